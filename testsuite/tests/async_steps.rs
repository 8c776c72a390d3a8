//! Asynchronous steps: `mark_step` enqueues and returns; reads wait for what
//! they read; at most `max_steps_in_flight` steps are unfinished.

use kiln::nn::{cross_entropy, Linear, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::{grad, Tensor};

mod common;
use common::Rng;

/// 100 AdamW steps of a 32-64-10 MLP on fresh random data; the loss of every
/// step, read one step late when `lag` (so step n+1 is recorded while step n
/// may still run).
fn mlp_losses(in_flight: usize, lag: bool) -> anyhow::Result<Vec<f32>> {
    kiln::set_max_steps_in_flight(in_flight);
    let mut ps = ParamStore::new(7);
    let l1 = Linear::new(&mut ps, "fc0", 32, 64, true)?;
    let l2 = Linear::new(&mut ps, "fc1", 64, 10, true)?;
    let params = ps.tensors();
    let mut opt = AdamW::new(&params, AdamWConfig::default())?;
    let mut rng = Rng::new(11);
    let batches: Vec<(Vec<f32>, Vec<i32>)> = (0..100)
        .map(|_| {
            let x = rng.normal_vec(16 * 32);
            // A learnable target: the index of the largest of the first 10 features.
            let y = (0..16)
                .map(|r| (0..10).max_by(|&a, &b| x[r * 32 + a].total_cmp(&x[r * 32 + b])).expect("10 features") as i32)
                .collect();
            (x, y)
        })
        .collect();
    let mut losses = Vec::new();
    let mut pending: Option<Tensor> = None;
    for (x, y) in &batches {
        let x = Tensor::from_vec(x.clone(), [16, 32])?;
        let y = Tensor::from_vec(y.clone(), [16])?;
        let loss = cross_entropy(&l2.forward(&l1.forward(&x)?.relu()?)?, &y, None)?;
        let grads = grad(&loss, &params)?;
        opt.step(&params, &grads, 1e-2)?;
        kiln::mark_step()?;
        if lag {
            if let Some(prev) = pending.replace(loss) {
                losses.push(prev.to_vec::<f32>()?[0]);
            }
        } else {
            losses.push(loss.to_vec::<f32>()?[0]);
        }
    }
    if let Some(prev) = pending {
        losses.push(prev.to_vec::<f32>()?[0]);
    }
    kiln::sync()?;
    Ok(losses)
}

#[test]
fn async_steps_give_bit_identical_losses_to_sync_ones() -> anyhow::Result<()> {
    let sync = mlp_losses(0, false)?;
    let asynchronous = mlp_losses(2, true)?;
    let deep = mlp_losses(8, true)?;
    assert_eq!(sync.len(), 100);
    assert!(sync[99] < 0.8 * sync[0], "the MLP learns: {} -> {}", sync[0], sync[99]);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&sync), bits(&asynchronous), "2 steps in flight");
    assert_eq!(bits(&sync), bits(&deep), "8 steps in flight");
    kiln::set_max_steps_in_flight(2);
    Ok(())
}
