//! Memory under asynchronous steps: its own test binary, so resident memory
//! is not disturbed by other tests' threads.

use kiln::Tensor;

mod common;
use common::Rng;

#[test]
fn memory_stays_flat_over_10000_async_steps() -> anyhow::Result<()> {
    kiln::set_max_steps_in_flight(2);
    let w0 = Rng::new(5).normal_vec(1024);
    let w = Tensor::from_vec(w0.clone(), [1024])?;
    let step = || -> anyhow::Result<()> {
        w.assign(&w.mul_scalar(0.999)?.add_scalar(0.001)?)?;
        kiln::mark_step()?;
        assert!(kiln::steps_in_flight() <= 2, "bound on steps in flight broken: {}", kiln::steps_in_flight());
        Ok(())
    };
    for _ in 0..100 {
        step()?;
    }
    let live = kiln::runtime::live_buffer_count();
    let rss = rss_bytes();
    for _ in 0..10_000 {
        step()?;
    }
    // The last steps may still be in flight; their outputs are live either way.
    assert_eq!(kiln::runtime::live_buffer_count(), live, "live buffers grew");
    let grown = rss_bytes().saturating_sub(rss);
    assert!(grown < 8 << 20, "resident memory grew by {grown} bytes over 10,000 steps");
    kiln::sync()?;
    assert_eq!(kiln::steps_in_flight(), 0);
    let got = w.to_vec::<f32>()?;
    let mut want = w0[17];
    for _ in 0..10_100 {
        want = want * 0.999 + 0.001;
    }
    assert!((got[17] - want).abs() < 1e-4, "{} vs {want}", got[17]);
    Ok(())
}

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("linux");
    let pages: usize = statm.split_whitespace().nth(1).expect("resident").parse().expect("a number");
    pages * 4096
}
