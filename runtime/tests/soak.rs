//! 10,000 executions of one small program leak neither buffers nor memory.
//!
//! Alone in its own test binary so that `live_buffer_count` and RSS are not
//! disturbed by other tests running in parallel.

mod common;

use common::*;
use kiln_runtime::{live_buffer_count, CompileOptions, ExecArg};

const ITERATIONS: usize = 10_000;
const WARM_UP: usize = 500;
/// Allowed RSS growth after warm-up, in KiB (allocator noise, plugin caches).
const RSS_BOUND_KIB: u64 = 8 * 1024;

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let resident_pages: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("statm field 2");
    // Linux x86-64 and aarch64 (4 KiB pages) are the supported hosts.
    resident_pages * 4
}

#[test]
fn ten_thousand_executions_do_not_leak() -> anyhow::Result<()> {
    let client = cpu_client(1);
    let device = &client.devices()[0];
    let program = r#"
func.func public @main(%x: tensor<16xf32>, %y: tensor<16xf32>) -> tensor<16xf32> {
  %0 = stablehlo.multiply %x, %y : tensor<16xf32>
  return %0 : tensor<16xf32>
}
"#;
    let exe = client.compile(program, &CompileOptions::default())?;
    let y = client.buffer_from_host(&[2.0f32; 16], &[16], device)?;

    let step = |i: usize| -> anyhow::Result<()> {
        let x = client.buffer_from_host(&[i as f32; 16], &[16], device)?;
        let out = exe.execute(&[ExecArg::Donated(x), ExecArg::Borrowed(&y)])?;
        let v = out[0].to_vec::<f32>()?;
        assert_eq!(v[15], 2.0 * i as f32);
        Ok(())
    };

    for i in 0..WARM_UP {
        step(i)?;
    }
    let live = live_buffer_count();
    let rss_before = rss_kib();
    for i in 0..ITERATIONS {
        step(i)?;
        assert_eq!(live_buffer_count(), live, "iteration {i}");
    }
    let rss_after = rss_kib();
    let growth = rss_after.saturating_sub(rss_before);
    eprintln!("soak: {ITERATIONS} executions, RSS {rss_before} KiB -> {rss_after} KiB (+{growth} KiB)");
    assert!(growth < RSS_BOUND_KIB, "RSS grew by {growth} KiB over {ITERATIONS} executions");
    Ok(())
}
