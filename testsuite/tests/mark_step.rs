//! `mark_step` end to end on the XLA CPU plugin: values carried between steps,
//! the compile cache, donation, forced syncs, stale tensors.

use kiln::{metrics, DType, Tensor};

mod common;
use common::Rng;

#[test]
fn values_carry_across_steps_and_the_second_step_hits_the_cache() -> anyhow::Result<()> {
    // Compile counts must not depend on what earlier runs left on disk.
    kiln::set_disk_cache(None)?;
    let mut rng = Rng::new(11);
    let init = rng.normal_vec(6);
    let x = Tensor::from_vec(init.clone(), [2, 3])?;
    let state = Tensor::from_vec(vec![0f32; 6], [2, 3])?;
    let before = metrics::snapshot();
    let mut expect: Vec<f64> = vec![0.0; 6];
    for step in 0..5 {
        // state <- state * 0.5 + tanh(x)
        let next = state.mul_scalar(0.5)?.add(&x.tanh()?)?;
        state.assign(&next)?;
        let report = kiln::mark_step()?;
        assert_eq!(report.compiled, step == 0, "step {step} compiled: {report:?}");
        for (e, &v) in expect.iter_mut().zip(&init) {
            *e = *e * 0.5 + f64::from(v).tanh();
        }
        let got = state.to_vec::<f32>()?;
        for (g, e) in got.iter().zip(&expect) {
            assert!((f64::from(*g) - e).abs() <= 1e-5 * e.abs().max(1.0), "step {step}: {got:?} vs {expect:?}");
        }
    }
    let after = metrics::snapshot();
    assert_eq!(after.compiles - before.compiles, 1);
    assert_eq!(after.cache_hits - before.cache_hits, 4);
    assert_eq!(after.forced_syncs, before.forced_syncs, "reads after mark_step are not forced");
    Ok(())
}

#[test]
fn reading_a_pending_tensor_forces_and_counts_a_sync() -> anyhow::Result<()> {
    let x = Tensor::from_vec(vec![1f32, 2.0, 3.0, 4.0], [4])?;
    let s = x.exp()?.sum_all()?;
    let before = metrics::snapshot().forced_syncs;
    let v = s.item()?;
    assert_eq!(metrics::snapshot().forced_syncs, before + 1);
    let expect: f64 = [1f64, 2.0, 3.0, 4.0].iter().map(|v| v.exp()).sum();
    assert!((v - expect).abs() < 1e-4 * expect);
    Ok(())
}

#[test]
fn dead_tensors_cost_nothing() -> anyhow::Result<()> {
    let x = Tensor::from_vec(vec![1f32; 8], [8])?;
    let kept = x.add_scalar(1.0)?;
    for _ in 0..10 {
        let _unused = x.exp()?.matmul(&x.reshape([8, 1])?.t()?);
    }
    let r = kiln::mark_step()?;
    assert_eq!(r.outputs, 1);
    assert!(r.nodes <= 4, "only the kept value's nodes are compiled: {r:?}");
    assert_eq!(kept.to_vec::<f32>()?, vec![2.0; 8]);
    Ok(())
}

#[test]
fn shape_errors_are_raised_when_recorded() {
    let a = Tensor::from_vec(vec![1f32; 6], [2, 3]).unwrap();
    let b = Tensor::from_vec(vec![1f32; 8], [2, 4]).unwrap();
    let err = a.add(&b).unwrap_err().to_string();
    assert!(err.contains("[2, 3]") && err.contains("[2, 4]"), "{err}");
    let err = a.matmul(&b).unwrap_err().to_string();
    assert!(err.contains("matmul"), "{err}");
    let i = Tensor::from_vec(vec![1i32; 6], [2, 3]).unwrap();
    let err = a.add(&i).unwrap_err().to_string();
    assert!(err.contains("f32") && err.contains("i32"), "{err}");
}

#[test]
fn a_tensor_from_a_finished_lowering_is_stale() -> anyhow::Result<()> {
    let x = Tensor::from_vec(vec![1f32; 4], [4])?;
    let mut leaked = None;
    kiln::lower(|| {
        let y = x.exp()?;
        leaked = Some(y.clone());
        Ok(vec![y])
    })?;
    let err = leaked.unwrap().add_scalar(1.0).unwrap_err();
    assert!(matches!(err, kiln::FrontendError::StaleTensor { .. }), "{err}");
    Ok(())
}

#[test]
fn rand_is_seeded_and_in_range() -> anyhow::Result<()> {
    kiln::manual_seed(5);
    let a = Tensor::rand(DType::F32, [1000])?;
    kiln::mark_step()?;
    kiln::manual_seed(5);
    let b = Tensor::rand(DType::F32, [1000])?;
    kiln::mark_step()?;
    let (a, b) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
    assert_eq!(a, b);
    assert!(a.iter().all(|v| (0.0..1.0).contains(v)));
    let mean = a.iter().map(|&v| f64::from(v)).sum::<f64>() / 1000.0;
    assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
    let n = Tensor::randn(DType::F32, [4000])?.to_vec::<f32>()?;
    let m = n.iter().map(|&v| f64::from(v)).sum::<f64>() / 4000.0;
    let var = n.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / 4000.0;
    assert!(m.abs() < 0.1 && (var - 1.0).abs() < 0.1, "mean {m} var {var}");
    Ok(())
}
