//! A ReLU MLP classifier on Fashion-MNIST, trained with AdamW.
//!
//! The loop is the reference for how a kiln training loop looks: record the
//! forward, the gradients and the update, `mark_step`, then read the loss (a
//! value of the finished step, so no forced sync). Batches keep one shape, so the
//! run compiles two programs: the train step and the eval step.
//!
//! With `amp` set, the forward (and evaluation) runs under autocast and the
//! update goes through [`crate::train_step::TrainStep`] (loss-scaled for f16).

use std::time::Instant;

use kiln_compiler::ir::DType;

use crate::context::{self, Backend};
use crate::data::{self, Batch, FashionMnist, ImageSet, LastBatch, Prefetcher};
use crate::amp;
use crate::error::Result;
use crate::nn::{cross_entropy, Linear, ParamStore};
use crate::optim::{AdamW, AdamWConfig, WarmupCosine};
use crate::step::mark_step;
use crate::tensor::Tensor;
use crate::train_step::TrainStep;
use crate::{checkpoint, metrics, random};

/// A stack of linear layers with ReLU between them.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub layers: Vec<Linear>,
}

impl Mlp {
    /// `sizes = [784, 256, 10]` builds two layers.
    pub fn new(ps: &mut ParamStore, sizes: &[usize]) -> Result<Mlp> {
        let layers = sizes
            .windows(2)
            .enumerate()
            .map(|(i, w)| Linear::new(ps, &format!("fc{i}"), w[0], w[1], true))
            .collect::<Result<_>>()?;
        Ok(Mlp { layers })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Settings of [`train`].
#[derive(Clone, Debug)]
pub struct MlpConfig {
    pub hidden: Vec<usize>,
    pub epochs: usize,
    pub batch: usize,
    pub eval_batch: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub seed: u64,
    /// Stop after this many train steps (all epochs when `None`).
    pub max_steps: Option<u64>,
    /// Evaluate on the test set after each epoch.
    pub eval: bool,
    /// Save a checkpoint here after each epoch.
    pub checkpoint: Option<std::path::PathBuf>,
    /// Mixed precision: matmuls in this dtype (`f16` or `bf16`), master weights
    /// in f32. `None`: everything in f32.
    pub amp: Option<DType>,
}

impl Default for MlpConfig {
    fn default() -> Self {
        MlpConfig {
            hidden: vec![256, 128],
            epochs: 8,
            batch: 128,
            eval_batch: 1000,
            lr: 2e-3,
            weight_decay: 1e-4,
            seed: 0,
            max_steps: None,
            eval: true,
            checkpoint: None,
            amp: None,
        }
    }
}

/// Progress of one step, for progress bars and logs.
#[derive(Clone, Debug)]
pub struct StepInfo {
    pub epoch: usize,
    pub step: u64,
    pub steps_total: u64,
    pub loss: f64,
    pub step_ms: f64,
}

/// What a run achieved.
#[derive(Clone, Debug, Default)]
pub struct TrainReport {
    pub losses: Vec<f64>,
    pub step_ms: Vec<f64>,
    pub test_accuracy: Option<f64>,
    pub steps: u64,
    pub compiles: u64,
    pub cache_hits: u64,
    /// Programs loaded from the persistent compile cache.
    pub disk_hits: u64,
    pub compile_seconds: f64,
    pub train_seconds: f64,
    /// Updates skipped for non-finite gradients (mixed precision only).
    pub skipped_steps: u64,
    /// The loss scale at the end (f16 mixed precision only).
    pub loss_scale: Option<f64>,
}

impl TrainReport {
    /// Fills the compile and cache counters with what happened since `before`.
    pub fn count_since(&mut self, before: &metrics::Metrics) {
        let after = metrics::snapshot();
        self.compiles = after.compiles - before.compiles;
        self.cache_hits = after.cache_hits - before.cache_hits;
        self.disk_hits = after.disk_hits - before.disk_hits;
        self.compile_seconds = (after.compile_time - before.compile_time).as_secs_f64();
    }

    pub fn final_loss(&self) -> f64 {
        self.losses.last().copied().unwrap_or(f64::NAN)
    }

    pub fn step_ms_median(&self) -> f64 {
        median(&self.step_ms)
    }
}

pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// The model, its parameters and optimizer.
pub struct Trainer {
    pub params: ParamStore,
    pub model: Mlp,
    pub opt: AdamW,
    pub step: u64,
    /// The ordered step when mixed precision is on.
    pub ordered: Option<TrainStep>,
    pub amp: Option<DType>,
    /// Updates skipped so far for non-finite gradients.
    pub skipped: u64,
}

impl Trainer {
    pub fn new(pixels: usize, classes: usize, cfg: &MlpConfig) -> Result<Trainer> {
        let mut params = ParamStore::new(cfg.seed);
        let mut sizes = vec![pixels];
        sizes.extend(&cfg.hidden);
        sizes.push(classes);
        let model = Mlp::new(&mut params, &sizes)?;
        let opt = AdamW::new(&params.tensors(), AdamWConfig { weight_decay: cfg.weight_decay, ..Default::default() })?;
        random::manual_seed(cfg.seed);
        let ordered = super::ordered_step(cfg.amp, None)?;
        Ok(Trainer { params, model, opt, step: 0, ordered, amp: cfg.amp, skipped: 0 })
    }

    /// Records and runs one training step; returns the loss.
    pub fn train_step(&mut self, set: &ImageSet, batch: &Batch, lr: f64) -> Result<f64> {
        let (x, y) = data::image_batch(set, batch)?;
        self.train_step_on(&x, &y, lr)
    }

    /// One training step on a batch already in tensors (e.g. prefetched).
    pub fn train_step_on(&mut self, x: &Tensor, y: &Tensor, lr: f64) -> Result<f64> {
        let (x, y) = (x.clone(), y.clone());
        let loss = amp::autocast_if(self.amp, || cross_entropy(&self.model.forward(&x)?, &y, None))?;
        let out = super::run_step(self.ordered.as_mut(), &self.params, &mut self.opt, &loss, lr)?;
        self.step += 1;
        self.skipped += u64::from(out.skipped);
        Ok(out.loss)
    }

    /// Accuracy on `set`, batched with padding so every example counts once.
    pub fn evaluate(&self, set: &ImageSet, eval_batch: usize) -> Result<f64> {
        let mut correct = 0.0;
        for b in data::batches(set.len(), eval_batch, None, LastBatch::Pad) {
            let (x, y) = data::image_batch(set, &b)?;
            let w = Tensor::from_vec(b.weights.clone(), [b.weights.len()])?;
            let pred = amp::autocast_if(self.amp, || self.model.forward(&x)?.argmax(-1))?;
            let hits = pred.eq(&y)?.to_dtype(DType::F32)?.mul(&w)?.sum_all()?;
            mark_step()?;
            correct += hits.item()?;
        }
        Ok(correct / set.len() as f64)
    }

    /// Every tensor of the training state, by name (for checkpoints).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut state = super::training_state(&self.params, &self.opt);
        state.extend(self.ordered.iter().flat_map(TrainStep::state));
        state
    }

    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        checkpoint::save(path, self.step, &self.state())
    }

    pub fn restore(&mut self, path: &std::path::Path) -> Result<()> {
        self.step = checkpoint::restore(path, &self.state())?;
        Ok(())
    }
}

/// Trains on `data` per `cfg`, calling `on_step` after every step.
pub fn train(data: &FashionMnist, cfg: &MlpConfig, mut on_step: impl FnMut(&StepInfo)) -> Result<TrainReport> {
    let before = metrics::snapshot();
    // The run's replicas: over several processes each keeps its own shards.
    let replicas = crate::replicas::global_replicas()?;
    let mut t = Trainer::new(data.train.pixels(), 10, cfg)?;
    // `cfg.batch` examples per replica per step.
    let per_epoch = (data.train.len() / (cfg.batch * replicas)) as u64;
    let total = cfg.max_steps.unwrap_or(per_epoch * cfg.epochs as u64).min(per_epoch * cfg.epochs as u64);
    let schedule = WarmupCosine { base_lr: cfg.lr, min_lr: cfg.lr * 0.05, warmup_steps: (total / 20).max(1), total_steps: total };
    let mut report = TrainReport::default();
    let start = Instant::now();
    'epochs: for epoch in 0..cfg.epochs {
        let seed = Some(cfg.seed ^ epoch as u64);
        let steps = crate::replicas::local_shards(data::replica_batches(data.train.len(), cfg.batch, replicas, seed, LastBatch::Drop))?;
        for item in Prefetcher::sharded(data.train.clone(), steps, 2)? {
            if t.step >= total {
                break 'epochs;
            }
            let (_, x, y) = item?;
            let t0 = Instant::now();
            let loss = t.train_step_on(&x, &y, schedule.lr(t.step))?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            report.losses.push(loss);
            report.step_ms.push(ms);
            on_step(&StepInfo { epoch, step: t.step, steps_total: total, loss, step_ms: ms });
        }
        if let Some(path) = &cfg.checkpoint {
            t.save(path)?;
        }
    }
    report.train_seconds = start.elapsed().as_secs_f64();
    if cfg.eval {
        report.test_accuracy = Some(t.evaluate(&data.test, cfg.eval_batch)?);
    }
    report.steps = t.step;
    report.skipped_steps = t.skipped;
    report.loss_scale = t.ordered.as_ref().and_then(|o| o.scaler.as_ref()).map(|s| s.scale.item()).transpose()?;
    report.count_since(&before);
    Ok(report)
}

/// Runs the first `steps` training steps on the compiled backend and again on the
/// reference interpreter, from the same initial weights and data order; returns
/// both loss curves `(compiled, reference)`.
pub fn compare_eager(data: &FashionMnist, cfg: &MlpConfig, steps: u64) -> Result<(Vec<f64>, Vec<f64>)> {
    let cfg = MlpConfig { max_steps: Some(steps), eval: false, checkpoint: None, ..cfg.clone() };
    let previous = context::backend();
    let run = |backend| -> Result<Vec<f64>> {
        context::set_backend(backend);
        Ok(train(data, &cfg, |_| {})?.losses)
    };
    let compiled = run(Backend::Pjrt);
    let reference = compiled.as_ref().ok().map(|_| run(Backend::Reference));
    context::set_backend(previous);
    Ok((compiled?, reference.expect("ran after a successful compiled run")?))
}
