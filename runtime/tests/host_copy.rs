//! kiln's host copies (`pjrt::host_copy`): the four custom calls run on the
//! CPU plugin, the value comes back bit for bit, and misuse is an error of
//! the execution, not a crash.

mod common;

use common::*;
use kiln_runtime::{CompileOptions, ExecArg};

/// `x` to the host after `tanh`, back for a later `multiply`: the shape of
/// the compiler's lowering of one offloaded value.
fn program(slot_back: i64, back_type: &str) -> String {
    format!(
        r#"
module @host_copy {{
  func.func public @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {{
    %a = stablehlo.tanh %x : tensor<4x8xf32>
    %t0 = stablehlo.custom_call @kiln_host_copy_out(%a) {{api_version = 4 : i32, backend_config = {{slot = 7 : i64}}, has_side_effect = true}} : (tensor<4x8xf32>) -> tensor<ui64>
    %b = stablehlo.exponential %x : tensor<4x8xf32>
    %t1 = stablehlo.custom_call @kiln_host_copy_out_done(%a, %t0, %b) {{api_version = 4 : i32, backend_config = {{slot = 7 : i64}}, has_side_effect = true}} : (tensor<4x8xf32>, tensor<ui64>, tensor<4x8xf32>) -> tensor<ui64>
    %c = stablehlo.add %b, %x : tensor<4x8xf32>
    %h = stablehlo.custom_call @kiln_host_copy_in(%t1, %c) {{api_version = 4 : i32, backend_config = {{slot = {slot_back} : i64}}, has_side_effect = true}} : (tensor<ui64>, tensor<4x8xf32>) -> {back_type}
    %d = stablehlo.custom_call @kiln_host_copy_in_done(%h) {{api_version = 4 : i32, backend_config = {{slot = {slot_back} : i64}}, has_side_effect = true, output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 0, operand_tuple_indices = []>]}} : ({back_type}) -> {back_type}
    %e = stablehlo.multiply %c, %d : tensor<4x8xf32>
    return %e : tensor<4x8xf32>
  }}
}}
"#
    )
}

/// The same computation with the value kept on the device.
const PLAIN: &str = r#"
module @plain {
  func.func public @main(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %a = stablehlo.tanh %x : tensor<4x8xf32>
    %b = stablehlo.exponential %x : tensor<4x8xf32>
    %c = stablehlo.add %b, %x : tensor<4x8xf32>
    %e = stablehlo.multiply %c, %a : tensor<4x8xf32>
    return %e : tensor<4x8xf32>
  }
}
"#;

#[test]
fn a_value_comes_back_from_the_host_bit_for_bit() -> anyhow::Result<()> {
    let client = cpu_client(1);
    let device = &client.devices()[0];
    let exe = client.compile(&program(7, "tensor<4x8xf32>"), &CompileOptions::default())?;
    let plain = client.compile(PLAIN, &CompileOptions::default())?;
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
    let mut rng = XorShift::new(seed);
    for _ in 0..3 {
        let x = rng.vec_f32(32);
        let xb = client.buffer_from_host(&x, &[4, 8], device)?;
        let got = exe.execute(&[ExecArg::Borrowed(&xb)])?.remove(0).to_vec::<f32>()?;
        let want = plain.execute(&[ExecArg::Borrowed(&xb)])?.remove(0).to_vec::<f32>()?;
        assert_eq!(got, want, "seed {seed}");
        // And the program computes what it says (XLA's tanh and exp against
        // Rust's, to a few ulps).
        for (g, v) in got.iter().zip(&x) {
            let r = (f64::from(*v).exp() + f64::from(*v)) * f64::from(*v).tanh();
            assert!((f64::from(*g) - r).abs() <= 1e-6 * (1.0 + r.abs()), "{g} against {r} (seed {seed})");
        }
    }
    Ok(())
}

#[test]
fn a_copy_back_of_another_size_is_an_execution_error() -> anyhow::Result<()> {
    let client = cpu_client(1);
    let device = &client.devices()[0];
    // The copy back asks for 4x4 of a value copied out as 4x8.
    let text = program(7, "tensor<4x4xf32>").replace(
        "%e = stablehlo.multiply %c, %d : tensor<4x8xf32>\n    return %e",
        "%e = stablehlo.pad %d, %d0, low = [0, 0], high = [0, 4], interior = [0, 0] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4x8xf32>\n    return %e",
    ).replace("%a = stablehlo.tanh", "%d0 = stablehlo.constant dense<0.0> : tensor<f32>\n    %a = stablehlo.tanh");
    let exe = client.compile(&text, &CompileOptions::default())?;
    let xb = client.buffer_from_host(&XorShift::new(3).vec_f32(32), &[4, 8], device)?;
    let err = exe.execute(&[ExecArg::Borrowed(&xb)]).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("kiln_host_copy_in") && err.contains("128 bytes copied out, 64 asked back"), "{err}");
    Ok(())
}
