//! A ReLU MLP classifier on Fashion-MNIST, trained with AdamW.
//!
//! The loop is the reference for how a kiln training loop looks: record the
//! forward, the gradients and the update, `mark_step`, then read the loss (a
//! value of the finished step, so no forced sync). Batches keep one shape, so the
//! run compiles two programs: the train step and the eval step.
//!
//! With `amp` set, the forward (and evaluation) runs under autocast and the
//! update goes through [`kiln_frontend::train_step::TrainStep`] (loss-scaled for f16).

use std::time::Instant;

use kiln_compiler::ir::DType;

use kiln_frontend::amp;
use kiln_frontend::data::{self, Batch, FashionMnist, ImageSet, LastBatch, Prefetcher};
use kiln_frontend::mark_step;
use kiln_frontend::nn::{cross_entropy, InitPlacement, Linear, Module, ParamStore};
use kiln_frontend::optim::{AdamW, AdamWConfig, WarmupCosine};
use kiln_frontend::train_step::TrainStep;
use kiln_frontend::Backend;
use kiln_frontend::Tensor;
use kiln_frontend::{checkpoint, metrics, random};
use kiln_frontend::{FrontendError, Result};

use crate::trainer::{Checkpointing, FitConfig, Metric, RunRecord};

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
        kiln_frontend::nn::scoped(|| Module::describe(self), || self.forward_layers(x))
    }

    fn forward_layers(&self, x: &Tensor) -> Result<Tensor> {
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

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Mlp::forward(self, x)
    }
    fn describe(&self) -> String {
        "Mlp".to_string()
    }
    fn children(&self) -> Vec<&dyn Module> {
        self.layers.iter().map(|l| l as &dyn Module).collect()
    }
}

/// Fashion-MNIST's images: 28 × 28 pixels.
pub const PIXELS: usize = 28 * 28;
/// Fashion-MNIST's classes.
pub const CLASSES: usize = 10;

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
    /// Save a checkpoint here after each epoch, every `checkpoint_every`
    /// steps and at the end of the run; a file already there is refused
    /// unless `resume` or `overwrite`.
    pub checkpoint: Option<std::path::PathBuf>,
    /// Also save every this many steps (needs `checkpoint`).
    pub checkpoint_every: Option<u64>,
    /// Continue from `checkpoint` (which must exist): the same data order,
    /// schedule and state, so the run ends bit-identical to one that was
    /// never interrupted.
    pub resume: bool,
    /// Replace whatever file is at `checkpoint` (without it, or `resume`, an
    /// existing file is refused).
    pub overwrite: bool,
    /// Settings ([`Trainer::settings`]) a resumed run may change from the
    /// checkpoint's (any other difference is refused).
    pub override_settings: Vec<String>,
    /// Mixed precision: matmuls in this dtype (`f16` or `bf16`), master weights
    /// in f32. `None`: everything in f32.
    pub amp: Option<DType>,
    /// Where parameters are initialised; `None`: `KILN_INIT`, else on the
    /// devices on the PJRT backend (`crate::training::init_placement`).
    pub init: Option<InitPlacement>,
    /// Keep training through a loss that is NaN or infinite (the default
    /// stops with [`kiln_frontend::FrontendError::NonFiniteLoss`]).
    pub allow_non_finite_loss: bool,
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
            checkpoint_every: None,
            resume: false,
            overwrite: false,
            override_settings: Vec::new(),
            amp: None,
            init: None,
            allow_non_finite_loss: false,
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
    /// The learning rate the step's update used.
    pub lr: f64,
    /// Updates skipped so far for non-finite gradients (mixed precision).
    pub skipped_steps: u64,
    /// The gradients' global norm before clipping, where the loop computes
    /// it (with clipping or mixed precision: the ordered step).
    pub grad_norm: Option<f64>,
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
    /// Seconds from the start of the run until the model, its parameters
    /// (initialised and, on the device placement, computed) and the optimizer
    /// existed, after the client was open (`client_seconds`).
    pub setup_seconds: f64,
    /// Seconds opening the PJRT client took in this run (0 when it was open
    /// already or the backend is not PJRT).
    pub client_seconds: f64,
    /// Where `setup_seconds` went (the GPT loop fills it).
    pub setup: Option<crate::training::SetupBreakdown>,
    /// Where the parameters were initialised.
    pub init: Option<InitPlacement>,
    /// Keep training through a loss that is NaN or infinite (the default
    /// stops with [`kiln_frontend::FrontendError::NonFiniteLoss`]).
    pub allow_non_finite_loss: bool,
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
    /// Examples a step takes (batch × replicas), saved with the state and
    /// checked when a checkpoint is restored: the saved step means a place
    /// in the data and the learning-rate schedule only at the batch it was
    /// taken with. `None`: neither saved nor checked.
    pub examples_per_step: Option<u64>,
    /// The run's settings (seed, learning rate, schedule, precision), saved
    /// with the state and compared when a checkpoint is restored
    /// ([`checkpoint::check_settings`]). `None`: neither saved nor compared.
    pub settings: Option<checkpoint::Settings>,
    /// Settings a restore may find changed.
    pub override_settings: Vec<String>,
}

/// The checkpoint tensor holding [`Trainer::examples_per_step`].
pub const EXAMPLES_PER_STEP: &str = "data.examples_per_step";

impl Trainer {
    pub fn new(pixels: usize, classes: usize, cfg: &MlpConfig) -> Result<Trainer> {
        let mut params = ParamStore::with_placement(cfg.seed, crate::training::init_placement(cfg.init)?);
        let model = Mlp::new(&mut params, &cfg.layer_sizes(pixels, classes))?;
        // The optimizer's zeros where the parameters are made (recorded for
        // the init program on the device placement), then the init step.
        let opt = AdamW::with_state_on(&params.tensors(), cfg.optimizer(), params.placement())?;
        params.materialize()?;
        random::manual_seed(cfg.seed);
        let ordered = crate::training::ordered_step(cfg.amp, None)?;
        Ok(Trainer {
            params,
            model,
            opt,
            step: 0,
            ordered,
            amp: cfg.amp,
            skipped: 0,
            examples_per_step: None,
            settings: None,
            override_settings: cfg.override_settings.clone(),
        })
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
        let out = crate::training::run_step(self.ordered.as_mut(), &self.params, &mut self.opt, &loss, lr)?;
        self.step += 1;
        self.skipped += u64::from(out.skipped);
        Ok(out.loss)
    }

    /// Accuracy on `set`, batched with padding so every example counts once.
    pub fn evaluate(&self, set: &ImageSet, eval_batch: usize) -> Result<f64> {
        let mut correct = 0.0;
        for b in data::batches(set.len(), eval_batch, None, LastBatch::Pad) {
            let (x, y) = data::image_batch(set, &b)?;
            // A test label no class can match would only lower the accuracy.
            let classes = self.model.layers.last().map_or(0, |l| l.weight.dims()[1]);
            kiln_frontend::check_index_range("evaluate", "label", &y, classes)?;
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
        let mut state = crate::training::training_state(&self.params, &self.opt);
        state.extend(self.ordered.iter().flat_map(TrainStep::state));
        state
    }

    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        let mut state = self.state();
        if let Some(n) = self.examples_per_step {
            state.push((EXAMPLES_PER_STEP.to_string(), Tensor::from_vec(vec![n], [1])?));
        }
        if let Some(settings) = &self.settings {
            state.push(checkpoint::settings_tensor(settings)?);
        }
        checkpoint::save(path, self.step, &state)
    }

    /// Restores a checkpoint [`Trainer::save`] wrote. One saved at another
    /// number of examples a step is refused, naming both (a file without the
    /// number, written before it was saved, is taken as it is). So is one
    /// saved with other [`Trainer::settings`], unless
    /// [`Trainer::override_settings`] names each that differs.
    pub fn restore(&mut self, path: &std::path::Path) -> Result<()> {
        let loaded = checkpoint::load(path)?;
        if let Some(n) = self.examples_per_step {
            let saved = loaded.tensors.iter().find(|(name, _)| name == EXAMPLES_PER_STEP);
            if let Some(saved) = saved.and_then(|(_, l)| l.to_f64s().first().map(|&v| v as u64)).filter(|&s| s != n) {
                return Err(FrontendError::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!(
                        "saved at step {} of a run taking {saved} examples a step (batch × replicas), and this \
                         run takes {n}: the step would resume elsewhere in the data and the learning-rate \
                         schedule; resume with the batch it was saved with, or start a new run",
                        loaded.step
                    ),
                });
            }
        }
        if let Some(now) = &self.settings {
            checkpoint::check_settings(path, loaded.settings(path)?.as_ref(), now, &self.override_settings)?;
        }
        self.step = checkpoint::restore_loaded(path, loaded, &self.state())?;
        Ok(())
    }
}

/// The step `kiln train mlp` runs at `cfg` on Fashion-MNIST (its model,
/// optimizer and ordered step), recorded on synthetic images and never run:
/// what `kiln profile mlp --max-batch` sizes. The parameters are initialised
/// on the host.
pub fn recorded_train_step(cfg: &MlpConfig) -> Result<kiln_compiler::ir::Graph> {
    cfg.check_settings(PIXELS)?;
    let (pixels, classes) = (PIXELS, CLASSES);
    let params = &mut ParamStore::new(cfg.seed);
    let model = Mlp::new(params, &cfg.layer_sizes(pixels, classes))?;
    let mut opt = AdamW::new(&params.tensors(), cfg.optimizer())?;
    let ordered = crate::training::ordered_step(cfg.amp, None)?;
    let b = cfg.batch;
    let x = Tensor::from_vec((0..b * pixels).map(|i| (i % 251) as f32 / 251.0).collect::<Vec<_>>(), [b, pixels])?;
    let y = Tensor::from_vec((0..b).map(|i| (i % classes) as i32).collect::<Vec<_>>(), [b])?;
    let loss = |x: &Tensor, y: &Tensor| cross_entropy(&model.forward(x)?, y, None);
    crate::training::recorded_step(loss, params, &mut opt, ordered, cfg.amp, (&x, &y))
}

/// The MLP's training step captured (`kiln::compile_step`): inputs `[x, y,
/// lr]` (`lr` an f32 scalar), outputs the loss averaged over replicas and,
/// with an ordered step (`ordered`), whether the update was skipped. Replays
/// are bit-identical to [`Trainer::train_step_on`]; the borrows are of the
/// trainer's fields, so the loop keeps its step counter.
pub fn captured_step<'a>(
    model: &'a Mlp,
    params: Vec<Tensor>,
    opt: &'a mut AdamW,
    ordered: Option<&'a mut TrainStep>,
    amp: Option<DType>,
) -> kiln_frontend::CompiledStep<impl FnMut(&[Tensor]) -> Result<Vec<Tensor>> + 'a> {
    crate::training::captured_update(move |x, y| cross_entropy(&model.forward(x)?, y, None), params, opt, ordered, amp)
}

impl MlpConfig {
    /// The widths of every layer: `pixels`, the hidden layers, `classes`.
    fn layer_sizes(&self, pixels: usize, classes: usize) -> Vec<usize> {
        let mut sizes = vec![pixels];
        sizes.extend(&self.hidden);
        sizes.push(classes);
        sizes
    }

    /// The loop's optimizer.
    fn optimizer(&self) -> AdamWConfig {
        AdamWConfig { weight_decay: self.weight_decay, ..Default::default() }
    }

    /// The settings a resumed run must share with the run that saved its
    /// checkpoint, for a schedule of `steps` steps: `seed` (initial values and
    /// the data order), `lr` and `weight_decay`, `steps` (the schedule's
    /// length: another `--max-steps` is another schedule) and `amp`. The
    /// batch is checked apart ([`Trainer::examples_per_step`]), the layer
    /// sizes by the tensors' shapes.
    pub fn run_settings(&self, steps: u64) -> checkpoint::Settings {
        let amp = self.amp.map_or_else(|| "off".to_string(), |d| d.to_string());
        [
            ("seed", self.seed.to_string()),
            ("lr", self.lr.to_string()),
            ("weight_decay", self.weight_decay.to_string()),
            ("steps", steps.to_string()),
            ("amp", amp),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Refuses settings that cannot train before anything is allocated or
    /// compiled: those [`check_settings`](Self::check_settings) refuses, and a
    /// training set smaller than one step on `replicas` replicas.
    pub fn check(&self, data: &FashionMnist, replicas: usize) -> Result<()> {
        self.check_settings(data.train.pixels())?;
        let step = self.batch.checked_mul(replicas);
        if step.is_none_or(|s| data.train.len() < s) {
            return Err(FrontendError::DatasetTooSmall { examples: data.train.len(), batch: self.batch, replicas });
        }
        Ok(())
    }

    /// The checks that need no data: a zero batch, width, epoch or step
    /// count, a learning rate that is not a finite positive f32, parameters
    /// of `pixels`-wide inputs larger than host memory, checkpoint flags
    /// without a file.
    pub fn check_settings(&self, pixels: usize) -> Result<()> {
        let bad = |name: &'static str, value: f64, expected: &'static str| {
            Err(FrontendError::HyperParameter { op: "train mlp", name, value, expected })
        };
        if self.batch == 0 {
            return bad("batch", 0.0, "at least 1");
        }
        if self.eval_batch == 0 {
            return bad("eval_batch", 0.0, "at least 1");
        }
        if self.epochs == 0 {
            return bad("epochs", 0.0, "at least 1");
        }
        if self.max_steps == Some(0) {
            return bad("max_steps", 0.0, "at least 1");
        }
        // The schedule's rate reaches the step as an f32 scalar.
        if !(self.lr > 0.0 && kiln_frontend::optim::f32_rate(self.lr).is_some()) {
            return bad("lr", self.lr, "a finite number above 0 that f32 can hold (1.4e-45 to 3.4e38)");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", self.weight_decay, "a finite number of at least 0");
        }
        if self.hidden.contains(&0) {
            return bad("hidden", 0.0, "widths of at least 1");
        }
        // Weights, AdamW's two moments and the gradient: four f32 copies.
        let sizes = self.layer_sizes(pixels, CLASSES);
        let params =
            sizes.windows(2).try_fold(0usize, |acc, w| acc.checked_add(w[0].checked_mul(w[1])?.checked_add(w[1])?));
        kiln_frontend::limits::check_host_bytes(
            format!("the MLP {sizes:?} (weights, gradients and AdamW state)"),
            params.and_then(|p| kiln_frontend::limits::checked_bytes(&[p, 4], 4)),
        )?;
        if self.checkpoint_every == Some(0) {
            return bad("checkpoint_every", 0.0, "at least 1");
        }
        if self.checkpoint.is_none() && (self.resume || self.checkpoint_every.is_some()) {
            return Err(FrontendError::InvalidArgument {
                op: "train mlp",
                reason: "--resume and --checkpoint-every need --checkpoint FILE".into(),
            });
        }
        Ok(())
    }
}

/// Trains on `data` per `cfg`, calling `on_step` after every step and
/// `on_eval` with the test set's accuracy after every epoch (`cfg.eval`): the
/// general trainer ([`crate::trainer::Trainer`]) over [`EpochBatches`].
pub fn train_with(
    data: &FashionMnist,
    cfg: &MlpConfig,
    mut on_step: impl FnMut(&StepInfo),
    mut on_eval: impl FnMut(&crate::trainer::EvalResult),
) -> Result<TrainReport> {
    let before = metrics::snapshot();
    // The run's replicas: over several processes each keeps its own shards.
    let replicas = kiln_frontend::replicas::global_replicas()?;
    cfg.check(data, replicas)?;
    let client = crate::training::open_client()?;
    let client_seconds = client.seconds;
    let setup = Instant::now();
    let t = Trainer::new(data.train.pixels(), CLASSES, cfg)?;
    // `cfg.batch` examples per replica per step.
    let per_epoch = (data.train.len() / (cfg.batch * replicas)) as u64;
    let all_steps = per_epoch.saturating_mul(cfg.epochs as u64);
    let total = cfg.max_steps.unwrap_or(all_steps).min(all_steps);
    // The set-up ends with the devices' memory pool reserved (the first
    // step's allocations would wait for it anyway).
    client.pool_ms();
    let setup_seconds = setup.elapsed().as_secs_f64();
    let Trainer { params, model, opt, .. } = t;
    let mut fit = FitConfig::new(total, cfg.lr);
    fit.schedule =
        WarmupCosine { base_lr: cfg.lr, min_lr: cfg.lr * 0.05, warmup_steps: (total / 20).max(1), total_steps: total };
    fit.amp = cfg.amp;
    fit.allow_non_finite_loss = cfg.allow_non_finite_loss;
    fit.checkpoint = cfg.checkpoint.as_ref().map(|path| Checkpointing {
        every: cfg.checkpoint_every,
        resume: cfg.resume,
        overwrite: cfg.overwrite,
        override_settings: cfg.override_settings.clone(),
        each_epoch: true,
        ..Checkpointing::new(path)
    });
    fit.eval_each_epoch = cfg.eval;
    fit.record = RunRecord {
        settings: Some(cfg.run_settings(total)),
        examples_per_step: Some((cfg.batch * replicas) as u64),
        tensors: Vec::new(),
    };
    let mut trainer = crate::trainer::Trainer::with_optimizer(&params, opt, fit)?;
    trainer.on_step(&mut on_step);
    trainer.on_eval(&mut on_eval);
    let mut batches =
        EpochBatches { data, batch: cfg.batch, seed: cfg.seed, replicas, per_epoch, total, current: None };
    // The test set in padded batches (every example counts once): hits
    // weighted by the rows' weights, out of their sum.
    let test = if cfg.eval { test_batches(&data.test, cfg.eval_batch)? } else { Vec::new() };
    let classes = model.layers.last().map_or(0, |l| l.weight.dims()[1]);
    let accuracy = |b: &Vec<Tensor>| -> Result<Vec<Metric>> {
        // A test label no class can match would only lower the accuracy.
        kiln_frontend::check_index_range("evaluate", "label", &b[1], classes)?;
        let hits = model.forward(&b[0])?.argmax(-1)?.eq(&b[1])?.to_dtype(DType::F32)?.mul(&b[2])?.sum_all()?;
        Ok(vec![Metric::ratio("accuracy", hits, b[2].sum_all()?)])
    };
    // Every replica sees the whole test set: nothing to average.
    let eval =
        cfg.eval.then(|| crate::trainer::Eval { per_replica: false, ..crate::trainer::Eval::new(test, &accuracy) });
    let loss = |b: &Vec<Tensor>| cross_entropy(&model.forward(&b[0])?, &b[1], None);
    let fitted = trainer.fit(&mut batches, &loss, eval.as_ref())?;
    let mut report = TrainReport {
        setup_seconds,
        client_seconds,
        init: Some(params.placement()),
        test_accuracy: fitted.evals.last().and_then(|e| e.get("accuracy")),
        steps: trainer.step(),
        ..fitted.train
    };
    report.count_since(&before);
    Ok(report)
}

/// Trains on `data` per `cfg`, calling `on_step` after every step
/// ([`train_with`] without an evaluation callback).
pub fn train(data: &FashionMnist, cfg: &MlpConfig, on_step: impl FnMut(&StepInfo)) -> Result<TrainReport> {
    train_with(data, cfg, on_step, |_| {})
}

/// `set` in batches of `size`, the last padded, as `[images, labels,
/// weights]` (weight 0 on padding rows).
fn test_batches(set: &ImageSet, size: usize) -> Result<Vec<Vec<Tensor>>> {
    data::batches(set.len(), size, None, LastBatch::Pad)
        .iter()
        .map(|b| {
            let (x, y) = data::image_batch(set, b)?;
            Ok(vec![x, y, Tensor::from_vec(b.weights.clone(), [b.weights.len()])?])
        })
        .collect()
}

/// Fashion-MNIST's training batches as the trainer asks for them: step n is
/// batch `n mod per_epoch` of epoch `n / per_epoch`, each epoch shuffled from
/// the seed and the epoch alone, uploaded two steps ahead on a thread of
/// their own ([`Prefetcher`]); each replica gets its own rows.
pub struct EpochBatches<'d> {
    data: &'d FashionMnist,
    batch: usize,
    seed: u64,
    replicas: usize,
    per_epoch: u64,
    /// The run's steps: nothing is prefetched past them.
    total: u64,
    /// The epoch being read, the step its prefetcher yields next.
    current: Option<(u64, u64, Prefetcher)>,
}

impl crate::trainer::Data<Vec<Tensor>> for EpochBatches<'_> {
    fn batch(&mut self, step: u64) -> Result<Vec<Tensor>> {
        let epoch = step / self.per_epoch.max(1);
        if !matches!(&self.current, Some((e, next, _)) if *e == epoch && *next == step) {
            let mut steps = kiln_frontend::replicas::local_shards(data::replica_batches(
                self.data.train.len(),
                self.batch,
                self.replicas,
                Some(self.seed ^ epoch),
                LastBatch::Drop,
            ))?;
            let first = epoch * self.per_epoch;
            steps.truncate(usize::try_from(self.total.saturating_sub(first)).unwrap_or(usize::MAX));
            steps.drain(..usize::try_from(step - first).unwrap_or(usize::MAX).min(steps.len()));
            self.current = Some((epoch, step, Prefetcher::sharded(self.data.train.clone(), steps, 2)?));
        }
        let none = || FrontendError::InvalidArgument {
            op: "train mlp",
            reason: format!("step {step} is past the epoch's batches"),
        };
        let (_, next, batches) = self.current.as_mut().ok_or_else(none)?;
        let (_, x, y) = batches.next().ok_or_else(none)??;
        *next += 1;
        Ok(vec![x, y])
    }

    fn epoch(&self, step: u64) -> usize {
        (step / self.per_epoch.max(1)) as usize
    }
}

/// Runs the first `steps` training steps on the compiled backend and again on the
/// eager backend (candle, op by op), from the same initial weights and data
/// order; returns both loss curves `(compiled, eager)`. [`compare_with`] picks
/// the other backend (the f64 reference interpreter for exact checks).
pub fn compare_eager(data: &FashionMnist, cfg: &MlpConfig, steps: u64) -> Result<(Vec<f64>, Vec<f64>)> {
    compare_with(Backend::Eager, data, cfg, steps)
}

/// [`compare_eager`] against `other` instead of the eager backend.
pub fn compare_with(other: Backend, data: &FashionMnist, cfg: &MlpConfig, steps: u64) -> Result<(Vec<f64>, Vec<f64>)> {
    let cfg = MlpConfig {
        max_steps: Some(steps),
        eval: false,
        checkpoint: None,
        checkpoint_every: None,
        resume: false,
        ..cfg.clone()
    };
    let previous = kiln_frontend::backend();
    let run = |backend| -> Result<Vec<f64>> {
        kiln_frontend::set_backend(backend);
        Ok(train(data, &cfg, |_| {})?.losses)
    };
    let compiled = run(Backend::Pjrt);
    let reference = compiled.as_ref().ok().map(|_| run(other));
    kiln_frontend::set_backend(previous);
    Ok((compiled?, reference.expect("ran after a successful compiled run")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings that would train zero steps, or in f32 with an infinite or
    /// zero rate, are refused by name.
    #[test]
    fn check_settings_refuses_what_cannot_train() {
        MlpConfig::default().check_settings(PIXELS).unwrap();
        for (cfg, name) in [
            (MlpConfig { epochs: 0, ..MlpConfig::default() }, "epochs"),
            (MlpConfig { max_steps: Some(0), ..MlpConfig::default() }, "max_steps"),
            (MlpConfig { lr: 1e308, ..MlpConfig::default() }, "lr"),
            (MlpConfig { lr: 1e-50, ..MlpConfig::default() }, "lr"),
        ] {
            match cfg.check_settings(PIXELS) {
                Err(FrontendError::HyperParameter { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}: {other:?}"),
            }
        }
    }
}
