//! Programs run on the CPU plugin and checked against f64 references.

mod common;

use common::*;
use kiln_runtime::{CompileOptions, ElementType, ExecArg};

#[test]
fn dot_general_tanh_matches_f64() -> anyhow::Result<()> {
    let client = cpu_client(1);
    let exe = client.compile(DOT_TANH, &CompileOptions::default())?;
    assert_eq!(exe.signature().to_string(), "(tensor<4x3xf32>, tensor<3x5xf32>) -> (tensor<4x5xf32>)");
    let device = &client.devices()[0];
    let mut rng = XorShift::new(0x5eed);
    for _ in 0..3 {
        let x = rng.vec_f32(12);
        let w = rng.vec_f32(15);
        let xb = client.buffer_from_host(&x, &[4, 3], device)?;
        let wb = client.buffer_from_host(&w, &[3, 5], device)?;
        let out = exe.execute(&[ExecArg::Borrowed(&xb), ExecArg::Borrowed(&wb)])?;
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].element_type(), ElementType::F32);
        assert_eq!(out[0].dims(), vec![4, 5]);
        let got = out[0].to_vec::<f32>()?;
        let (want, scale) = dot_tanh_reference(&x, &w);
        let err = max_rel_err(&got, &want, &scale);
        assert!(err < 1e-5, "max relative error {err}");
    }
    Ok(())
}

#[test]
fn all_reduce_over_four_replicas() -> anyhow::Result<()> {
    let client = cpu_client(4);
    assert_eq!(client.devices().len(), 4);
    let program = r#"
module @all_reduce attributes {mhlo.num_replicas = 4 : i32} {
  func.func public @main(%x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = "stablehlo.all_reduce"(%x) ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) {replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
"#;
    let exe = client.compile(program, &CompileOptions { num_replicas: 4, ..CompileOptions::default() })?;
    assert_eq!(exe.num_replicas(), 4);
    let mut rng = XorShift::new(42);
    let inputs: Vec<Vec<f32>> = (0..4).map(|_| rng.vec_f32(8)).collect();
    let devices = client.devices();
    let buffers =
        inputs.iter().zip(&devices).map(|(x, d)| client.buffer_from_host(x, &[8], d)).collect::<Result<Vec<_>, _>>()?;
    let args = buffers.iter().map(|b| vec![ExecArg::Borrowed(b)]).collect();
    let outputs = exe.execute_replicated(args)?;
    assert_eq!(outputs.len(), 4);
    let want: Vec<f64> = (0..8).map(|i| inputs.iter().map(|x| f64::from(x[i])).sum()).collect();
    let scale: Vec<f64> = (0..8).map(|i| inputs.iter().map(|x| f64::from(x[i]).abs()).sum()).collect();
    for (replica, out) in outputs.iter().enumerate() {
        assert_eq!(out[0].device(), devices[replica]);
        let err = max_rel_err(&out[0].to_vec::<f32>()?, &want, &scale);
        assert!(err < 1e-5, "replica {replica}: max relative error {err}");
    }
    Ok(())
}
