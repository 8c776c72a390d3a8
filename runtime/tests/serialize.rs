//! Serialized executables come back with their signature and compute the
//! same thing; compiled memory stats are reported.

mod common;

use common::*;
use kiln_runtime::{CompileOptions, ExecArg, RuntimeError};

/// `tanh(x · w) · wᵀ`: the first product must live in a temporary.
const TWO_DOTS: &str = r#"
func.func public @main(%x: tensor<64x64xf32>, %w: tensor<64x64xf32>) -> tensor<64x64xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  %1 = stablehlo.tanh %0 : tensor<64x64xf32>
  %2 = stablehlo.dot_general %1, %w, contracting_dims = [1] x [1] : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  return %2 : tensor<64x64xf32>
}
"#;

#[test]
fn serialize_deserialize_execute_gives_same_result() -> anyhow::Result<()> {
    let client = cpu_client(1);
    let device = &client.devices()[0];
    let exe = client.compile(TWO_DOTS, &CompileOptions::default())?;

    let stats = exe.compiled_memory_stats()?;
    assert!(stats.temp_size_in_bytes > 0, "{stats:?}");
    assert_eq!(stats.argument_size_in_bytes, 2 * 64 * 64 * 4, "{stats:?}");
    assert_eq!(stats.output_size_in_bytes, 64 * 64 * 4, "{stats:?}");

    let mut rng = XorShift::new(99);
    let x = client.buffer_from_host(&rng.vec_f32(64 * 64), &[64, 64], device)?;
    let w = client.buffer_from_host(&rng.vec_f32(64 * 64), &[64, 64], device)?;
    let want = exe.execute(&[ExecArg::Borrowed(&x), ExecArg::Borrowed(&w)])?[0].to_vec::<f32>()?;

    let bytes = exe.serialize()?;
    let restored = client.deserialize_executable(&bytes, None)?;
    assert_eq!(restored.signature(), exe.signature());
    assert_eq!(restored.num_outputs(), 1);
    assert_eq!(restored.num_replicas(), 1);
    let got = restored.execute(&[ExecArg::Borrowed(&x), ExecArg::Borrowed(&w)])?[0].to_vec::<f32>()?;
    assert_eq!(got, want);
    Ok(())
}

#[test]
fn broken_envelopes_are_typed_errors() {
    let client = cpu_client(1);
    let err = client.deserialize_executable(b"not an executable", None).unwrap_err();
    assert!(matches!(err, RuntimeError::Deserialize { .. }), "{err}");
    let err = client.deserialize_executable(b"KILNEXE1\xff\xff", None).unwrap_err();
    assert!(matches!(err, RuntimeError::Deserialize { .. }), "{err}");
    let mut truncated = b"KILNEXE1".to_vec();
    truncated.extend_from_slice(&100u32.to_le_bytes());
    truncated.extend_from_slice(b"(tensor<f32>)");
    let err = client.deserialize_executable(&truncated, None).unwrap_err();
    assert!(matches!(err, RuntimeError::Deserialize { .. }), "{err}");
}
