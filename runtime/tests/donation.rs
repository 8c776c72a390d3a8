//! Donated arguments of an aliased program are consumed without leaking, and
//! borrowed arguments of the same program are left intact.

mod common;

use common::*;
use kiln_runtime::{live_buffer_count, CompileOptions, ExecArg};

/// The live-buffer counter is process-wide: tests that assert on it take turns.
static COUNTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

const ADD_ONE_ALIASED: &str = r#"
module @add_one {
  func.func public @main(%arg0: tensor<4xf32> {tf.aliasing_output = 0 : i32}) -> tensor<4xf32> {
    %one = stablehlo.constant dense<1.0> : tensor<4xf32>
    %0 = stablehlo.add %arg0, %one : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"#;

#[test]
fn donated_buffer_is_reused_and_not_leaked() -> anyhow::Result<()> {
    let _turn = COUNTER.lock().unwrap_or_else(|e| e.into_inner());
    let client = cpu_client(1);
    let device = &client.devices()[0];
    let exe = client.compile(ADD_ONE_ALIASED, &CompileOptions::default())?;
    assert_eq!(exe.compiled_memory_stats()?.alias_size_in_bytes, 16);

    let mut state = client.buffer_from_host(&[1.0f32, 2.0, 3.0, 4.0], &[4], device)?;
    let live = live_buffer_count();
    for _ in 0..20 {
        let mut out = exe.execute(&[ExecArg::Donated(state)])?;
        state = out.pop().expect("one output");
        assert_eq!(live_buffer_count(), live);
    }
    assert_eq!(state.to_vec::<f32>()?, vec![21.0, 22.0, 23.0, 24.0]);

    // Borrowed: the input must survive even though the program aliases it.
    let out = exe.execute(&[ExecArg::Borrowed(&state)])?;
    assert_eq!(out[0].to_vec::<f32>()?, vec![22.0, 23.0, 24.0, 25.0]);
    assert_eq!(state.to_vec::<f32>()?, vec![21.0, 22.0, 23.0, 24.0]);
    drop(out);
    drop(state);
    assert_eq!(live_buffer_count(), live - 1);
    Ok(())
}

#[test]
fn replicated_donation_consumes_every_replica_argument() -> anyhow::Result<()> {
    let _turn = COUNTER.lock().unwrap_or_else(|e| e.into_inner());
    let client = cpu_client(2);
    let exe = client.compile(ADD_ONE_ALIASED, &CompileOptions { num_replicas: 2, ..Default::default() })?;
    let devices = client.devices();
    let mut states =
        devices.iter().map(|d| client.buffer_from_host(&[0.0f32; 4], &[4], d)).collect::<Result<Vec<_>, _>>()?;
    let live = live_buffer_count();
    for _ in 0..5 {
        let args = states.into_iter().map(|b| vec![ExecArg::Donated(b)]).collect();
        states = exe.execute_replicated(args)?.into_iter().map(|mut o| o.remove(0)).collect();
        assert_eq!(live_buffer_count(), live);
    }
    for (state, device) in states.iter().zip(&devices) {
        assert_eq!(state.device(), *device);
        assert_eq!(state.to_vec::<f32>()?, vec![5.0; 4]);
    }
    Ok(())
}
