//! The README's Rust examples, each run here as printed, with only the setup
//! it leaves out (the data, the model, the optimizer) around it. The last test
//! checks that every ```rust block of the README appears in this file line for
//! line, so the README cannot drift from code that compiles and runs.

mod common;
use common::Rng;

use kiln::Tensor;

/// `n` batches of `b` rows of fresh uniform inputs and labels below `classes`.
fn batches(rng: &mut Rng, n: usize, b: usize, width: usize, classes: i32) -> kiln::Result<Vec<(Tensor, Tensor)>> {
    (0..n)
        .map(|_| {
            let x = Tensor::from_vec(rng.uniform_vec(b * width, -1.0, 1.0), [b, width])?;
            let y = (0..b).map(|_| (rng.next_u64() % classes as u64) as i32).collect::<Vec<_>>();
            Ok((x, Tensor::from_vec(y, [b])?))
        })
        .collect()
}

#[test]
#[rustfmt::skip]
fn a_training_loop() -> kiln::Result<()> {
    let batches = batches(&mut Rng::new(11), 3, 16, 784, 10)?;
    let before = kiln::metrics::snapshot();

use kiln::nn::{cross_entropy, ParamStore};
use kiln::models::mlp::Mlp;
use kiln::optim::{AdamW, AdamWConfig};

let mut ps = ParamStore::new(/* seed */ 0);
let model = Mlp::new(&mut ps, &[784, 256, 10])?;
let params = ps.tensors();
let mut opt = AdamW::new(&params, AdamWConfig::default())?;
for (x, y) in batches {                       // x: [b, 784] f32, y: [b] i32 tensors
    let loss = cross_entropy(&model.forward(&x)?, &y, None)?;
    let grads = kiln::grad(&loss, &params)?;  // backward ops join the same step
    opt.step(&params, &grads, 1e-3)?;         // parameters are assigned in place
    kiln::mark_step()?;                       // compile once, then enqueue from the cache
    println!("loss {}", loss.item()?);        // waits for the loss only: no forced sync
}
println!("{}", kiln::metrics::report());      // steps, compiles, cache hits, transfers, syncs

    let after = kiln::metrics::snapshot();
    assert!(after.steps >= before.steps + 3, "{before:?} -> {after:?}");
    Ok(())
}

#[test]
#[rustfmt::skip]
#[allow(unused_variables)]
fn modules() -> kiln::Result<()> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    // The example writes `run.safetensors` where it runs; no other test here
    // reads a relative path.
    std::env::set_current_dir(dir.path()).expect("into the temporary directory");
    let mut ps = ParamStore::new(3);
    let block = Block {
        ln: LayerNorm::new(&mut ps, "b0.ln", 24)?,
        fc1: Linear::new(&mut ps, "b0.fc1", 24, 48, true)?,
        fc2: Linear::new(&mut ps, "b0.fc2", 48, 24, true)?,
        drop: Dropout::new(0.1)?,
    };
    let opt = AdamW::new(&block.parameters(), AdamWConfig::default())?;
    let step = 7;

use kiln::nn::{self, Dropout, LayerNorm, Linear, Module, ParamStore};
use kiln::{checkpoint, optim::{AdamW, AdamWConfig}, Tensor};

struct Block { ln: LayerNorm, fc1: Linear, fc2: Linear, drop: Dropout }

impl Module for Block {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        let h = self.fc2.forward(&nn::gelu(&self.fc1.forward(&self.ln.forward(x)?)?)?)?;
        x.add(&self.drop.forward(&h)?)
    }
    fn describe(&self) -> String { "Block".into() }
    fn children(&self) -> Vec<&dyn Module> { vec![&self.ln, &self.fc1, &self.fc2, &self.drop] }
}

let params = block.parameters();                       // in creation order
let names = block.named_parameters();                  // ("b0.fc1.weight", tensor), ...
block.eval();                                          // dropout off (block.train() back on)
checkpoint::save_training("run.safetensors", step, &block, &opt)?;   // params, optimizer, RNG, step
let step = checkpoint::restore_training("run.safetensors", &block, &opt)?;

    assert_eq!(step, 7);
    assert_eq!(params.len(), 6);
    let names: Vec<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"b0.fc1.weight"), "{names:?}");
    Ok(())
}

#[test]
#[rustfmt::skip]
fn mixed_precision() -> kiln::Result<()> {
    use kiln::models::mlp::Mlp;
    use kiln::nn::{cross_entropy, ParamStore};
    use kiln::optim::{AdamW, AdamWConfig};
    let batches = batches(&mut Rng::new(12), 2, 8, 32, 4)?;
    let mut ps = ParamStore::new(5);
    let model = Mlp::new(&mut ps, &[32, 16, 4])?;
    let params = ps.tensors();
    let mut opt = AdamW::new(&params, AdamWConfig::default())?;
    let before = kiln::metrics::snapshot();

use kiln::amp::{self, LossScalerConfig};
use kiln::train_step::{TrainStep, TrainStepOptions};

let mut step = TrainStep::new(TrainStepOptions {
    loss_scaling: Some(LossScalerConfig::default()), // scale 2^16, x2 every 2000 clean steps, x0.5 on inf/nan
    max_grad_norm: Some(1.0),
})?;
for (x, y) in batches {
    // Matmuls in f16 (or bf16); reductions, softmax, norms and the loss in f32.
    let loss = amp::autocast(kiln::DType::F16, || cross_entropy(&model.forward(&x)?, &y, None))?;
    // scaled backward -> all-reduce -> unscale -> clip -> finite check ->
    // update or skip (params and optimizer state untouched) -> scale update -> mark_step
    let stats = step.step(&loss, &params, &mut opt, 1e-3)?;
    println!("loss {} norm {} skipped {}", stats.loss.item()?, stats.grad_norm.item()?, stats.skipped.item()?);
}

    let after = kiln::metrics::snapshot();
    assert!(after.steps >= before.steps + 2, "{before:?} -> {after:?}");
    Ok(())
}

/// The memory section's loop, on four GELU blocks behind layer norms, whose
/// activations are most of the step. Keeping half of them is met, and the
/// trained parameters are those of the same loop without a budget, within
/// 1e-6.
#[test]
#[rustfmt::skip]
fn memory_budget() -> kiln::Result<()> {
    use kiln::nn::{cross_entropy, LayerNorm, Linear, MlpBlock, Module, ParamStore, Sequential};
    use kiln::optim::{AdamW, AdamWConfig};
    let setup = || -> kiln::Result<_> {
        let batches = batches(&mut Rng::new(13), 3, 2048, 64, 8)?;
        let mut ps = ParamStore::new(6);
        let mut model = Sequential::new().push(Linear::new(&mut ps, "in", 64, 256, true)?);
        for i in 0..4 {
            model = model
                .push(LayerNorm::new(&mut ps, &format!("b{i}.ln"), 256)?)
                .push(MlpBlock::new(&mut ps, &format!("b{i}.mlp"), 256, 1024, 0.02, 0.02)?);
        }
        let model = model.push(Linear::new(&mut ps, "out", 256, 8, true)?);
        let params = model.parameters();
        let opt = AdamW::new(&params, AdamWConfig::default())?;
        Ok((batches, model, params, opt))
    };
    let values = |params: &[Tensor]| -> kiln::Result<Vec<f32>> {
        Ok(params.iter().map(|p| p.to_vec::<f32>()).collect::<kiln::Result<Vec<_>>>()?.concat())
    };

    let (batches, model, params, mut opt) = setup()?;
    for (x, y) in batches {
        let loss = cross_entropy(&model.forward(&x)?, &y, None)?;
        let grads = kiln::grad(&loss, &params)?;
        opt.step(&params, &grads, 1e-3)?;
        kiln::mark_step()?;
    }
    let plain = values(&params)?;

    let (batches, model, params, mut opt) = setup()?;

kiln::set_activation_budget(Some(0.5))?;  // keep half of each step's activation memory
// or kiln::set_memory_limit(Some(2 << 30)): fit each step's predicted peak in 2 GiB
for (x, y) in batches {
    let loss = cross_entropy(&model.forward(&x)?, &y, None)?;
    let grads = kiln::grad(&loss, &params)?;
    opt.step(&params, &grads, 1e-3)?;
    kiln::mark_step()?;                   // planned when the step is first compiled
}
let metrics = kiln::metrics::snapshot();
println!("{}", metrics.step_remat_line().unwrap_or_default());
// peak budget 86.3 MiB (…) met: 17 value(s) recomputed (1.16e9 extra FLOPs), predicted peak 147.9 MiB -> 85.8 MiB, …
kiln::set_activation_budget(None)?;       // later steps keep everything again

    let line = metrics.step_remat_line();
    let plan = metrics.step_remat_plan().expect("the budgeted step's plan");
    assert_eq!(plan.activation_fraction, Some(0.5));
    assert!(plan.plan.met && plan.plan.values_recomputed() > 0, "{line:?}");
    assert!(plan.plan.after.peak_bytes < plan.plan.before.peak_bytes, "{line:?}");
    assert!(kiln::activation_budget().is_none());
    let planned = values(&params)?;
    assert_eq!(plain.len(), planned.len());
    for (i, (a, b)) in plain.iter().zip(&planned).enumerate() {
        assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "parameter value {i}: {a} without a budget, {b} with");
    }
    Ok(())
}

#[test]
#[rustfmt::skip]
fn a_trainer() -> kiln::Result<()> {
    let dir = tempfile::tempdir().map_err(|e| kiln::FrontendError::InvalidArgument { op: "test", reason: e.to_string() })?;
    let dir = dir.path();
    let mut ps = kiln::nn::ParamStore::new(2);
    let model = kiln::models::mlp::Mlp::new(&mut ps, &[784, 64, 10])?;
    // Fresh data for each step (the same for the same step), three held-out batches.
    let batch_of = |step: u64| -> kiln::Result<Vec<Tensor>> {
        let (x, y) = batches(&mut Rng::new(100 + step), 1, 16, 784, 10)?.remove(0);
        Ok(vec![x, y])
    };
    let held_out: Vec<Vec<Tensor>> = (0..3).map(|i| batch_of(1_000_000 + i)).collect::<kiln::Result<_>>()?;

use kiln::nn::cross_entropy;
use kiln::optim::AdamWConfig;
use kiln::train::{Checkpointing, Eval, FitConfig, KeepBest, Metric, Trainer};
use kiln::Tensor;

let mut cfg = FitConfig::new(/* steps */ 400, /* peak lr */ 1e-3);  // warm-up, cosine decay
cfg.max_grad_norm = Some(1.0);
cfg.amp = Some(kiln::DType::BF16);
cfg.eval_every = Some(100);                               // and always at the end
cfg.checkpoint = Some(Checkpointing { every: Some(200), ..Checkpointing::new(dir.join("run.ckpt")) });
cfg.keep_best = Some(KeepBest { path: dir.join("best.ckpt"), metric: "loss".into(), higher_is_better: false });
let mut trainer = Trainer::new(&ps, AdamWConfig::default(), cfg)?;
trainer.on_step(|s| if s.step % 100 == 0 { println!("step {} loss {:.4}", s.step, s.loss) });
trainer.on_eval(|e| println!("eval at {}: {:?}", e.step, e.metrics));
let loss = |b: &Vec<Tensor>| cross_entropy(&model.forward(&b[0])?, &b[1], None);
let metrics = |b: &Vec<Tensor>| -> kiln::Result<Vec<Metric>> {
    Ok(vec![Metric::mean("loss", cross_entropy(&model.forward(&b[0])?, &b[1], None)?)])
};
let report = trainer.fit(&mut |step| batch_of(step), &loss, Some(&Eval::new(held_out, &metrics)))?;

    assert_eq!(report.train.steps, 400);
    assert_eq!(report.evals.iter().map(|e| e.step).collect::<Vec<_>>(), [100, 200, 300, 400]);
    assert_eq!(kiln::checkpoint::load(dir.join("run.ckpt"))?.step, 400);
    let (_, best_step) = report.best.ok_or_else(|| kiln::FrontendError::InvalidArgument { op: "test", reason: "no best".into() })?;
    assert_eq!(kiln::checkpoint::load(dir.join("best.ckpt"))?.step, best_step);
    Ok(())
}

#[test]
fn mlp_layer_lowering() -> kiln::Result<()> {
    let x = kiln::Tensor::from_vec(vec![0.5f32; 8], [2, 4])?;
    let w = kiln::Tensor::from_vec(vec![0.25f32; 12], [4, 3])?;
    let text = kiln::lower(|| Ok(vec![x.matmul(&w)?.relu()?]))?;
    insta::assert_snapshot!(text);
    Ok(())
}

/// Each ```rust block of the README, line for line (leading spaces aside), in
/// this file.
#[test]
fn every_rust_example_in_the_readme_is_run_here() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).expect("README.md");
    let here: Vec<&str> = include_str!("readme.rs").lines().map(str::trim_start).collect();
    let mut blocks = Vec::new();
    let mut open: Option<Vec<&str>> = None;
    for line in readme.lines() {
        match (&mut open, line.trim()) {
            (None, "```rust") => open = Some(Vec::new()),
            (Some(_), "```") => blocks.push(open.take().unwrap()),
            (Some(b), _) => b.push(line.trim_start()),
            (None, _) => {}
        }
    }
    assert!(open.is_none(), "an unclosed ```rust block in the README");
    assert_eq!(blocks.len(), 6, "the README's Rust examples changed in number: run each here");
    for block in &blocks {
        let found = here.windows(block.len()).any(|w| w == block.as_slice());
        assert!(found, "this README example is not run by testsuite/tests/readme.rs:\n{}", block.join("\n"));
    }
}
