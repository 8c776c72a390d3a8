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

#[test]
fn device_checks_keep_donation_and_the_cache() -> anyhow::Result<()> {
    std::env::set_var("KILN_DONATE", "1");
    kiln::set_disk_cache(None)?;
    assert!(kiln::device_checks()?);
    let w = Tensor::from_vec(Rng::new(5).normal_vec(6 * 4), [6, 4])?;
    let x = Tensor::from_vec(Rng::new(6).normal_vec(3 * 6), [3, 6])?;
    let step = |labels: Vec<i32>| -> kiln::Result<(kiln::StepReport, f64)> {
        let loss = kiln::nn::cross_entropy(&x.matmul(&w)?, &Tensor::from_vec(labels, [3])?, None)?;
        let g = kiln::grad(&loss, std::slice::from_ref(&w))?.remove(0);
        w.assign(&w.sub(&g.mul_scalar(0.1)?)?)?;
        let r = kiln::mark_step()?;
        Ok((r, loss.item()?))
    };
    for i in 0..4 {
        let (r, loss) = step(vec![0, 3, 2])?;
        assert_eq!((r.compiled, r.donated), (i == 0, 1), "step {i}: {r:?}");
        assert!(loss.is_finite());
    }
    let err = step(vec![0, 4, 2]).expect_err("label 4 of 4 classes");
    assert!(matches!(err, kiln::FrontendError::IndexOutOfRange { value: 4, bound: 4, .. }), "{err:?}");
    Ok(())
}
