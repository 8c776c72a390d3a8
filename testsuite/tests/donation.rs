//! Opt-in buffer donation (`KILN_DONATE=1`): the old parameter buffer is handed
//! to the step that replaces it. Its own test binary, since it sets a
//! process-wide variable.

use kiln::Tensor;

mod common;
use common::Rng;

#[test]
fn donated_updates_are_correct_and_keep_live_buffers_flat() -> anyhow::Result<()> {
    std::env::set_var("KILN_DONATE", "1");
    let w0 = Rng::new(3).normal_vec(256);
    let g0 = Rng::new(4).normal_vec(256);
    let w = Tensor::from_vec(w0.clone(), [16, 16])?;
    let g = Tensor::from_vec(g0.clone(), [16, 16])?;
    let step = || -> anyhow::Result<kiln::StepReport> {
        w.assign(&w.sub(&g.mul_scalar(1e-3)?)?)?;
        Ok(kiln::mark_step()?)
    };
    step()?;
    step()?;
    let live = kiln::runtime::live_buffer_count();
    for _ in 0..1000 {
        let r = step()?;
        assert_eq!(r.donated, 1, "the old weight buffer is donated: {r:?}");
    }
    assert_eq!(kiln::runtime::live_buffer_count(), live, "live buffers grew");
    let got = w.to_vec::<f32>()?;
    for i in 0..256 {
        let mut want = w0[i];
        for _ in 0..1002 {
            want -= (g0[i] as f64 * 1e-3) as f32;
        }
        assert!((got[i] - want).abs() < 1e-4, "element {i}: {} vs {want}", got[i]);
    }
    Ok(())
}
