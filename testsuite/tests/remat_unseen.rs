//! The remat pass on a model it was not tuned on: the Llama-style decoder of
//! `benches/examples/common/llama.rs` (RMSNorm, rotary embeddings, SwiGLU, an
//! untied head over explicit logits), trained on the CPU plugin under
//! activation budgets. The budgeted runs train to the unbudgeted run's
//! parameters and XLA's temporaries of the step drop.

// The device example uses the GPU config, which these tests do not.
#[allow(dead_code)]
#[path = "../../benches/examples/common/llama.rs"]
mod llama;

use kiln::nn::ParamStore;
use kiln::optim::{AdamW, AdamWConfig};
use llama::{Llama, LlamaConfig};

/// Three steps of the tiny Llama (f32) under `budget`: every parameter's
/// values after them, XLA's temp bytes of the step program, and the plan.
fn train(budget: Option<f64>) -> kiln::Result<(Vec<f32>, u64, Option<kiln::metrics::RematRecord>)> {
    kiln::set_disk_cache(None)?;
    kiln::set_activation_budget(budget)?;
    let mut ps = ParamStore::new(4);
    let model = Llama::new(&mut ps, LlamaConfig::tiny())?;
    let params = ps.tensors();
    let mut opt = AdamW::new(&params, AdamWConfig { weight_decay: 0.1, ..Default::default() })?;
    let (x, y) = model.batch()?;
    for _ in 0..3 {
        let loss = model.loss(&x, &y)?;
        let grads = kiln::grad(&loss, &params)?;
        opt.step(&params, &grads, 1e-3)?;
        kiln::mark_step()?;
    }
    let values = params.iter().map(|p| p.to_vec::<f32>()).collect::<kiln::Result<Vec<_>>>()?.concat();
    // The step is the program with the most arguments (the init has none).
    let temp = kiln::shard::program_memory_stats()?
        .into_iter()
        .max_by_key(|s| s.argument_size_in_bytes)
        .map(|s| s.temp_size_in_bytes as u64)
        .expect("a compiled step");
    let plan = kiln::metrics::snapshot().step_remat_plan().cloned();
    kiln::set_activation_budget(None)?;
    Ok((values, temp, plan))
}

/// Measured 2026-11-28 (printed): XLA temp 6,944,896 B unplanned; at 50%
/// 4,358,984 B (1.59x; met, 21 values recomputed); at 25% 3,720,008 B
/// (1.87x; not met by the model, 29 values). The model's unplanned temp is
/// 6,037,536 B, 13% under XLA CPU's, which orders the step itself.
#[test]
fn a_model_remat_was_not_tuned_on_trains_the_same_in_less_memory() -> kiln::Result<()> {
    let (plain, plain_temp, none) = train(None)?;
    assert!(none.is_none());
    for budget in [0.5, 0.25] {
        let (planned, temp, plan) = train(Some(budget))?;
        let plan = plan.expect("a plan under a budget");
        let r = &plan.plan;
        eprintln!(
            "{:.0}%: met {}, {} values recomputed, +{} FLOPs; model temp {} -> {} B; XLA temp {plain_temp} -> {temp} B",
            budget * 100.0,
            r.met,
            r.values_recomputed(),
            r.recomputed_flops(),
            r.before.allocated_temp_bytes,
            r.after.allocated_temp_bytes
        );
        assert!(r.values_recomputed() > 0, "{:?}", plan);
        for (i, (a, b)) in plain.iter().zip(&planned).enumerate() {
            assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{budget}: parameter value {i}: {a} against {b}");
        }
        if budget == 0.5 {
            assert!(r.met, "{plan:?}");
            assert!(temp * 4 <= plain_temp * 3, "XLA temp {plain_temp} -> {temp} at 50%");
        }
    }
    Ok(())
}

/// The model itself: the loss of its first step on fresh random parameters
/// is near ln(vocab), and a step lowers it.
#[test]
fn the_unseen_model_trains() -> kiln::Result<()> {
    let mut ps = ParamStore::new(9);
    let model = Llama::new(&mut ps, LlamaConfig::tiny())?;
    let params = ps.tensors();
    let mut opt = AdamW::new(&params, AdamWConfig::default())?;
    let (x, y) = model.batch()?;
    let mut losses = Vec::new();
    for _ in 0..4 {
        let loss = model.loss(&x, &y)?;
        let grads = kiln::grad(&loss, &params)?;
        opt.step(&params, &grads, 3e-3)?;
        kiln::mark_step()?;
        losses.push(loss.item()?);
    }
    let uniform = (LlamaConfig::tiny().vocab as f64).ln();
    assert!((losses[0] - uniform).abs() < 0.5, "{losses:?} against ln(vocab) {uniform}");
    assert!(losses[3] < losses[0], "{losses:?}");
    Ok(())
}
