//! Live device buffers stay flat over many steps (its own test binary: the
//! runtime's live-buffer counter is process-wide, so parallel tests would
//! disturb it).

use kiln::Tensor;

mod common;
use common::Rng;

#[test]
fn live_buffers_stay_flat_over_1000_steps() -> anyhow::Result<()> {
    let w = Tensor::from_vec(Rng::new(3).normal_vec(256), [16, 16])?;
    let g = Tensor::from_vec(Rng::new(4).normal_vec(256), [16, 16])?;
    let step = || -> anyhow::Result<kiln::StepReport> {
        w.assign(&w.sub(&g.mul_scalar(1e-3)?)?)?;
        Ok(kiln::mark_step()?)
    };
    step()?;
    step()?;
    let live = kiln::runtime::live_buffer_count();
    for _ in 0..1000 {
        let r = step()?;
        assert!(!r.compiled, "{r:?}");
    }
    assert_eq!(kiln::runtime::live_buffer_count(), live, "live buffers grew");
    let expect = Rng::new(3).normal_vec(256)[5] as f64 - 1002.0 * 1e-3 * Rng::new(4).normal_vec(256)[5] as f64;
    let got = f64::from(w.to_vec::<f32>()?[5]);
    assert!((got - expect).abs() < 1e-3, "{got} vs {expect}");
    Ok(())
}
