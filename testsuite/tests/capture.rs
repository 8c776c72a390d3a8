//! Captured step functions (`kiln::compile_step`): traced once per signature,
//! replayed bit-identically, retraced with an explanation when a guard fails.

use kiln::nn::{cross_entropy, Linear, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::{grad, Tensor};

mod common;
use common::Rng;

struct Model {
    l1: Linear,
    l2: Linear,
    params: Vec<Tensor>,
    opt: AdamW,
}

fn model() -> anyhow::Result<Model> {
    let mut ps = ParamStore::new(21);
    let l1 = Linear::new(&mut ps, "fc0", 32, 48, true)?;
    let l2 = Linear::new(&mut ps, "fc1", 48, 10, true)?;
    let params = ps.tensors();
    let opt = AdamW::new(&params, AdamWConfig::default())?;
    Ok(Model { l1, l2, params, opt })
}

/// One training step on `inputs = [x, y, lr]`; returns the loss.
fn train(m: &mut Model, inputs: &[Tensor]) -> kiln::Result<Vec<Tensor>> {
    let loss = cross_entropy(&m.l2.forward(&m.l1.forward(&inputs[0])?.relu()?)?, &inputs[1], None)?;
    let grads = grad(&loss, &m.params)?;
    m.opt.step_lr(&m.params, &grads, &inputs[2])?;
    Ok(vec![loss])
}

fn batches(n: usize, rows: usize) -> Vec<(Tensor, Tensor, Tensor)> {
    let mut rng = Rng::new(99);
    (0..n)
        .map(|i| {
            let x = rng.normal_vec(rows * 32);
            let y: Vec<i32> = (0..rows)
                .map(|r| (0..10).max_by(|&a, &b| x[r * 32 + a].total_cmp(&x[r * 32 + b])).expect("10") as i32)
                .collect();
            let lr = 1e-2 * (1.0 - i as f32 / (2 * n) as f32);
            (Tensor::from_vec(x, [rows, 32]).expect("x"), Tensor::from_vec(y, [rows]).expect("y"), Tensor::scalar(lr))
        })
        .collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>().expect("read").iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_captured_step_gives_bit_identical_results_to_the_traced_one() -> anyhow::Result<()> {
    let data = batches(40, 16);
    // Traced: the closure runs every step.
    let mut a = model()?;
    let mut traced = Vec::new();
    for (x, y, lr) in &data {
        let out = train(&mut a, &[x.clone(), y.clone(), lr.clone()])?;
        kiln::mark_step()?;
        traced.push(bits(&out[0]));
    }
    // Captured: traced once, replayed 39 times (the learning rate changes
    // every call through its input tensor).
    let mut b = model()?;
    let before = kiln::metrics::snapshot();
    let mut captured = Vec::new();
    {
        let mut step = kiln::compile_step(|inputs: &[Tensor]| train(&mut b, inputs));
        for (x, y, lr) in &data {
            let out = step.call(&[x.clone(), y.clone(), lr.clone()])?;
            captured.push(bits(&out[0]));
        }
        assert_eq!(step.traces(), 1, "{:?}", step.last_retrace());
        assert_eq!(step.replays(), 39);
    }
    assert_eq!(traced, captured, "losses differ");
    for (p, q) in a.params.iter().zip(&b.params) {
        assert_eq!(bits(p), bits(q), "parameter {:?} differs", p.name());
    }
    assert_eq!(bits(&a.opt.t), bits(&b.opt.t));
    let after = kiln::metrics::snapshot();
    assert_eq!(after.replays - before.replays, 39);
    assert_eq!(after.compiles, before.compiles, "the captured step reuses the traced step's program");
    Ok(())
}

#[test]
fn a_new_signature_retraces_and_says_what_changed() -> anyhow::Result<()> {
    let mut m = model()?;
    let big = batches(3, 16);
    let small = batches(2, 8);
    let mut step = kiln::compile_step(|inputs: &[Tensor]| train(&mut m, inputs));
    for (x, y, lr) in &big {
        step.call(&[x.clone(), y.clone(), lr.clone()])?;
    }
    assert_eq!((step.traces(), step.replays()), (1, 2));
    for (x, y, lr) in &small {
        step.call(&[x.clone(), y.clone(), lr.clone()])?;
    }
    assert_eq!((step.traces(), step.replays()), (2, 3));
    let why = step.last_retrace().expect("explained").to_string();
    assert!(why.contains("new signature: input 0 is tensor<8x32xf32>, was tensor<16x32xf32>"), "{why}");
    assert!(why.contains("input 1 is tensor<8xi32>, was tensor<16xi32>"), "{why}");
    // Back to the first signature: its plan is still there.
    let (x, y, lr) = &big[0];
    step.call(&[x.clone(), y.clone(), lr.clone()])?;
    assert_eq!((step.traces(), step.replays()), (2, 4));
    Ok(())
}

#[test]
fn a_closure_that_makes_host_data_inside_is_traced_every_call_and_says_why() -> anyhow::Result<()> {
    let mut m = model()?;
    let data = batches(3, 16);
    let mut reference = model()?;
    let mut step = kiln::compile_step(|inputs: &[Tensor]| {
        // The learning rate made inside from a Rust value: cannot be replayed.
        let lr = Tensor::scalar(1e-2f32);
        train(&mut m, &[inputs[0].clone(), inputs[1].clone(), lr])
    });
    for (x, y, _) in &data {
        let got = step.call(&[x.clone(), y.clone()])?;
        let want = train(&mut reference, &[x.clone(), y.clone(), Tensor::scalar(1e-2f32)])?;
        kiln::mark_step()?;
        assert_eq!(bits(&got[0]), bits(&want[0]));
    }
    assert_eq!((step.traces(), step.replays()), (3, 0));
    let why = step.last_retrace().expect("explained");
    assert!(why.contains("created inside the closure from host data"), "{why}");
    Ok(())
}

#[test]
fn verify_mode_catches_rust_values_baked_into_the_trace() -> anyhow::Result<()> {
    let w = Tensor::from_vec(Rng::new(3).normal_vec(64), [64])?;
    let mut scale = 1.0;
    let mut step = kiln::compile_step(|_: &[Tensor]| {
        // A Rust value that changes between calls: baked in at trace time.
        scale *= 0.5;
        w.assign(&w.mul_scalar(scale)?)?;
        Ok(vec![])
    })
    .verify(true);
    step.call(&[])?;
    let err = step.call(&[]).expect_err("the second trace differs");
    assert!(err.to_string().contains("differs from the captured one"), "{err}");
    Ok(())
}

/// A closure that reads a value inside runs a step mid-call: it is traced
/// on every call, and the reason names the read (it used to blame host data
/// made inside the closure).
#[test]
fn a_closure_that_reads_inside_is_traced_every_call_and_says_so() -> anyhow::Result<()> {
    let mut m = model()?;
    let data = batches(3, 16);
    let mut reads = Vec::new();
    let mut step = kiln::compile_step(|inputs: &[Tensor]| {
        let out = train(&mut m, inputs)?;
        reads.push(out[0].item()?);
        Ok(out)
    });
    for (x, y, lr) in &data {
        step.call(&[x.clone(), y.clone(), lr.clone()])?;
    }
    assert_eq!((step.traces(), step.replays()), (3, 0));
    let why = step.last_retrace().expect("explained");
    assert!(why.contains("the closure ran a step itself (a read such as item() or to_vec(), or mark_step)"), "{why}");
    drop(step);
    assert_eq!(reads.len(), 3);
    Ok(())
}

/// A call whose closure fails after the optimizer step has no effect: the
/// update it recorded is discarded, not run by the next call (it used to be:
/// AdamW's counter ended one step ahead and the parameters drifted from a
/// loop that skipped the batch).
#[test]
fn a_failed_call_leaves_parameters_and_optimizer_state_as_they_were() -> anyhow::Result<()> {
    let data = batches(8, 16);
    let odd = batches(1, 5).pop().expect("one batch");
    // The loop without the failing batch.
    let mut a = model()?;
    for (x, y, lr) in &data {
        train(&mut a, &[x.clone(), y.clone(), lr.clone()])?;
        kiln::mark_step()?;
    }
    // Captured, with a batch of 5 rows in the middle whose call fails after
    // its update was recorded.
    let mut b = model()?;
    {
        let mut step = kiln::compile_step(|inputs: &[Tensor]| {
            let out = train(&mut b, inputs)?;
            if inputs[0].dims()[0] == 5 {
                return Err(kiln::FrontendError::InvalidArgument { op: "user step", reason: "a batch of 5".into() });
            }
            Ok(out)
        });
        for (i, (x, y, lr)) in data.iter().enumerate() {
            if i == 4 {
                let e = step.call(&[odd.0.clone(), odd.1.clone(), odd.2.clone()]).unwrap_err();
                assert_eq!(e.to_string(), "user step: a batch of 5");
            }
            step.call(&[x.clone(), y.clone(), lr.clone()])?;
        }
    }
    kiln::sync()?;
    for (p, q) in a.params.iter().zip(&b.params) {
        assert_eq!(bits(p), bits(q), "parameter {:?} differs", p.name());
    }
    assert_eq!(b.opt.t.to_vec::<f32>()?, vec![8.0], "AdamW's step counter");
    assert_eq!(bits(&a.opt.t), bits(&b.opt.t));
    Ok(())
}
