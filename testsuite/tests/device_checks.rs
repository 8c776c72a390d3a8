//! Device-side checks and anomaly mode end to end on the XLA CPU plugin: labels
//! and indices out of range are typed errors naming the op, the layer, the value
//! and the range; the first non-finite op is named with its layer; correct runs
//! compute the same bits with checks on and off, and the cache stays warm.

use kiln::models::mlp::Mlp;
use kiln::nn::{cross_entropy, Embedding, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::{FrontendError, Tensor};

mod common;
use common::Rng;

fn logits(rows: usize, classes: usize, seed: u64) -> anyhow::Result<Tensor> {
    Ok(Tensor::from_vec(Rng::new(seed).normal_vec(rows * classes), [rows, classes])?)
}

/// The error of a step that reads `labels` through `cross_entropy`.
fn cross_entropy_step(labels: Vec<i32>) -> anyhow::Result<kiln::Result<f64>> {
    let n = labels.len();
    let loss = cross_entropy(&logits(n, 10, 1)?, &Tensor::from_vec(labels, [n])?, None)?;
    Ok(kiln::mark_step().and_then(|_| loss.item()))
}

#[test]
fn cross_entropy_with_label_10_names_the_op_value_and_range() -> anyhow::Result<()> {
    let err = cross_entropy_step(vec![3, 10, 0, 9])?.expect_err("label 10 of 10 classes");
    match &err {
        FrontendError::IndexOutOfRange { op, value, bound, count, total, min, max, .. } => {
            assert_eq!((*op, *value, *bound, *count, *total, *min, *max), ("cross_entropy", 10, 10, 1, 4, 0, 10));
        }
        other => panic!("expected IndexOutOfRange, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("cross_entropy") && msg.contains("label 10") && msg.contains("[0, 10)"), "{msg}");
    Ok(())
}

#[test]
fn cross_entropy_with_label_minus_one_names_the_value() -> anyhow::Result<()> {
    let err = cross_entropy_step(vec![-1, 2, 5, -1, 7])?.expect_err("label -1");
    assert!(
        matches!(
            err,
            FrontendError::IndexOutOfRange { op: "cross_entropy", value: -1, bound: 10, count: 2, total: 5, .. }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("label -1 is out of range [0, 10)"), "{err}");
    Ok(())
}

#[test]
fn labels_in_range_pass_and_the_next_step_runs() -> anyhow::Result<()> {
    let loss = cross_entropy_step(vec![0, 9, 4, 4])??;
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
    // A failed step does not poison the next one.
    assert!(cross_entropy_step(vec![12])?.is_err());
    assert!(cross_entropy_step(vec![1, 2])?.is_ok());
    Ok(())
}

#[test]
fn an_embedding_id_out_of_range_names_the_layer() -> anyhow::Result<()> {
    let mut ps = ParamStore::new(7);
    let wte = Embedding::new(&mut ps, "wte", 8, 4, 0.02)?;
    let ids = Tensor::from_vec(vec![0i32, 3, 8, 1, 2, 7], [2, 3])?;
    let y = wte.forward(&ids)?.sum_all()?;
    let err = kiln::mark_step().and_then(|_| y.item()).expect_err("id 8 of a vocabulary of 8");
    match &err {
        FrontendError::IndexOutOfRange { op, layer, what, value, bound, count, total, .. } => {
            assert_eq!(
                (*op, layer.as_deref(), *what, *value, *bound, *count, *total),
                ("gather", Some("wte"), "index", 8, 8, 1, 6)
            );
        }
        other => panic!("expected IndexOutOfRange, got {other:?}"),
    }
    assert!(err.to_string().starts_with("gather in layer wte: index 8 is out of range [0, 8)"), "{err}");
    Ok(())
}

#[test]
fn a_gather_index_out_of_range_is_an_error_on_either_side() -> anyhow::Result<()> {
    let x = Tensor::from_vec(Rng::new(3).normal_vec(12), [3, 4])?;
    for (idx, want) in [(vec![0i32, 4], 4i64), (vec![-3, 1], -3)] {
        let y = x.index_select(&Tensor::from_vec(idx, [2])?, 1)?;
        let err = kiln::mark_step().and_then(|_| y.to_vec::<f32>()).expect_err("out of range");
        assert!(
            matches!(err, FrontendError::IndexOutOfRange { op: "gather", layer: None, value, bound: 4, .. } if value == want),
            "{err:?}"
        );
    }
    Ok(())
}

/// A two-layer MLP trained for `steps` steps with AdamW on fresh data; returns
/// the loss bits, whether each step compiled, and the nodes and outputs of the
/// last step's program.
fn train_mlp(steps: usize, seed: u64) -> anyhow::Result<(Vec<u32>, Vec<bool>, usize, usize)> {
    let mut ps = ParamStore::new(seed);
    let model = Mlp::new(&mut ps, &[12, 16, 5])?;
    let mut opt = AdamW::new(&ps.tensors(), AdamWConfig::default())?;
    let mut rng = Rng::new(seed + 1);
    let (mut bits, mut compiled, mut last) = (Vec::new(), Vec::new(), (0, 0));
    for _ in 0..steps {
        let x = Tensor::from_vec(rng.normal_vec(8 * 12), [8, 12])?;
        let y = Tensor::from_vec((0..8).map(|_| (rng.next_u64() % 5) as i32).collect::<Vec<_>>(), [8])?;
        let loss = cross_entropy(&model.forward(&x)?, &y, None)?;
        let grads = kiln::grad(&loss, &ps.tensors())?;
        opt.step(&ps.tensors(), &grads, 1e-2)?;
        let report = kiln::mark_step()?;
        compiled.push(report.compiled);
        last = (report.nodes, report.outputs);
        bits.push((loss.item()? as f32).to_bits());
    }
    Ok((bits, compiled, last.0, last.1))
}

#[test]
fn checks_change_no_bits_and_no_cache_hits_and_off_records_nothing() -> anyhow::Result<()> {
    kiln::set_disk_cache(None)?;
    assert!(kiln::device_checks()?, "on by default");
    let (on, compiled_on, nodes_on, outputs_on) = train_mlp(6, 21)?;
    assert_eq!(compiled_on, [true, false, false, false, false, false], "one compile, then hits");
    kiln::set_device_checks(false);
    let (off, compiled_off, nodes_off, outputs_off) = train_mlp(6, 21)?;
    kiln::set_device_checks(true);
    assert_eq!(on, off, "losses are bit-identical with checks on and off");
    assert_eq!(compiled_off, [true, false, false, false, false, false]);
    // Off: the step outputs the loss and the updated state only; on: one flag vector more.
    assert_eq!(outputs_on, outputs_off + 1);
    assert!(nodes_on > nodes_off, "{nodes_on} vs {nodes_off}");
    // Off records nothing: the same step as a trace that never called a check.
    let (_, _, nodes_again, outputs_again) = {
        kiln::set_device_checks(false);
        let r = train_mlp(1, 21);
        kiln::set_device_checks(true);
        r?
    };
    assert_eq!((nodes_again, outputs_again), (nodes_off, outputs_off));
    Ok(())
}

#[test]
fn checks_off_give_no_error_for_a_bad_label() -> anyhow::Result<()> {
    kiln::set_device_checks(false);
    let loss = cross_entropy_step(vec![3, 10])?;
    kiln::set_device_checks(true);
    assert!(loss?.is_finite(), "the plausible wrong loss of before");
    Ok(())
}

#[test]
fn checks_on_the_reference_backend_too() -> anyhow::Result<()> {
    kiln::set_backend(kiln::Backend::Reference);
    let r = cross_entropy_step(vec![1, 11]);
    kiln::set_backend(kiln::Backend::Pjrt);
    assert!(matches!(r?, Err(FrontendError::IndexOutOfRange { value: 11, .. })));
    Ok(())
}

#[test]
fn anomaly_mode_names_the_first_non_finite_op_and_its_layer() -> anyhow::Result<()> {
    let mut ps = ParamStore::new(5);
    let model = Mlp::new(&mut ps, &[6, 8, 3])?;
    let mut data = Rng::new(9).normal_vec(4 * 6);
    data[7] = f32::NAN;
    let x = Tensor::from_vec(data, [4, 6])?.with_name("images");
    let y = Tensor::from_vec(vec![0i32, 1, 2, 1], [4])?;
    let step = || -> kiln::Result<()> {
        let loss = cross_entropy(&model.forward(&x)?, &y, None)?;
        let grads = kiln::grad(&loss, &ps.tensors())?;
        for (p, g) in ps.tensors().iter().zip(&grads) {
            p.assign(&p.sub(&g.mul_scalar(0.1)?)?)?;
        }
        kiln::mark_step().map(|_| ())
    };
    // Without anomaly mode the NaN passes silently into the weights.
    step()?;
    assert!(ps.get("fc0.weight").unwrap().to_vec::<f32>()?.iter().any(|v| v.is_nan()));
    let mut ps2 = ParamStore::new(5);
    let model2 = Mlp::new(&mut ps2, &[6, 8, 3])?;
    kiln::set_detect_anomaly(true);
    let loss = cross_entropy(&model2.forward(&x)?, &y, None)?;
    // Steps are asynchronous: the check's error comes at the step's
    // completion, which `sync` waits for.
    let r = kiln::mark_step().and_then(|_| kiln::sync());
    kiln::set_detect_anomaly(false);
    let err = r.expect_err("NaN input");
    match &err {
        FrontendError::NonFinite { op, layer, count, operands, .. } => {
            assert_eq!((*op, layer.as_deref()), ("dot_general", Some("fc0")), "{err}");
            // Row 1 of the input holds the NaN: its 8 outputs are NaN.
            assert_eq!(*count, 8, "{err}");
            assert!(operands.contains("input 'images'") && operands.contains("1 non-finite"), "{err}");
        }
        other => panic!("expected NonFinite, got {other:?}"),
    }
    drop(loss);
    // A finite step passes in anomaly mode.
    kiln::set_detect_anomaly(true);
    let x_ok = Tensor::from_vec(Rng::new(10).normal_vec(4 * 6), [4, 6])?;
    let loss = cross_entropy(&model2.forward(&x_ok)?, &y, None)?;
    let r = kiln::mark_step().and_then(|_| kiln::sync());
    kiln::set_detect_anomaly(false);
    r?;
    assert!(loss.item()?.is_finite());
    Ok(())
}

#[test]
fn anomaly_mode_finds_a_nan_made_inside_the_step() -> anyhow::Result<()> {
    let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], [3])?;
    kiln::set_detect_anomaly(true);
    let y = x.exp()?.log()?.mul_scalar(2.0)?.sqrt()?.sum_all()?;
    let r = kiln::mark_step().and_then(|_| kiln::sync());
    kiln::set_detect_anomaly(false);
    let err = r.expect_err("sqrt of -4");
    assert!(matches!(&err, FrontendError::NonFinite { op: "sqrt", layer: None, count: 1, .. }), "{err:?}");
    drop(y);
    Ok(())
}

#[test]
fn a_bad_label_on_one_replica_fails_the_step_counting_every_replica() -> anyhow::Result<()> {
    kiln::set_disk_cache(None)?;
    kiln::replicas::set_replicas(2)?;
    let labels = kiln::replicas::from_shards(vec![vec![1i32, 2, 3], vec![4, 10, 0]], [3])?;
    let loss = cross_entropy(&logits(3, 10, 4)?, &labels, None)?;
    let err = kiln::mark_step().and_then(|_| loss.item()).expect_err("label 10 on replica 1");
    assert!(
        matches!(err, FrontendError::IndexOutOfRange { value: 10, count: 1, total: 6, min: 0, max: 10, .. }),
        "{err:?}"
    );
    Ok(())
}
