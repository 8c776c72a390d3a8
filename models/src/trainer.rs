//! kiln's training loop as a library (`kiln::train`): a model's parameters,
//! an AdamW optimizer, a learning-rate schedule and a batch source in;
//! [`Trainer::fit`] runs the steps with gradient clipping and mixed precision
//! as settings, evaluates on a validation set every N steps, saves and
//! resumes checkpoints (keeping the best by a validation metric), and calls
//! the user's callbacks with every step and evaluation. `kiln train`'s
//! built-in models (`mlp`, `gpt`, the zoo) are its users.
//!
//! ```no_run
//! // `kiln::train` in the `kiln` crate.
//! use kiln_frontend::nn::{cross_entropy, Linear, Module, ParamStore};
//! use kiln_frontend::optim::AdamWConfig;
//! use kiln_compiler::ir::DType;
//! use kiln_frontend::{Result, Tensor};
//! use kiln_models::trainer::{Checkpointing, Eval, FitConfig, Metric, Trainer};
//! # fn batch_of(step: u64) -> Result<Vec<Tensor>> {
//! #     Ok(vec![Tensor::from_vec(vec![0.5f32; 784], [1, 784])?, Tensor::from_vec(vec![(step % 10) as i32], [1])?])
//! # }
//! let mut ps = ParamStore::new(0);
//! let layer = Linear::new(&mut ps, "out", 784, 10, true)?;
//! let mut cfg = FitConfig::new(1_000, 1e-3);
//! cfg.eval_every = Some(100);
//! cfg.checkpoint = Some(Checkpointing::new("run.ckpt"));
//! let mut trainer = Trainer::new(&ps, AdamWConfig::default(), cfg)?;
//! trainer.on_step(|s| println!("step {} loss {:.4}", s.step, s.loss));
//! let loss = |b: &Vec<Tensor>| cross_entropy(&layer.forward(&b[0])?, &b[1], None);
//! let held: Vec<Vec<Tensor>> = (0..4).map(|i| batch_of(1_000_000 + i)).collect::<Result<_>>()?;
//! let accuracy = |b: &Vec<Tensor>| -> Result<Vec<Metric>> {
//!     let hits = layer.forward(&b[0])?.argmax(-1)?.eq(&b[1])?.to_dtype(DType::F32)?;
//!     Ok(vec![Metric::mean("accuracy", hits.mean_all()?)])
//! };
//! let report = trainer.fit(&mut batch_of, &loss, Some(&Eval::new(held, &accuracy)))?;
//! # Ok::<(), kiln_frontend::FrontendError>(())
//! ```
//!
//! How a step runs: the step (the loss, its gradients averaged over
//! replicas, the update) is captured (`kiln::compile_step`) and replayed,
//! one program per batch signature (a bucket of padded lengths is one); the
//! learning rate is an input, so the schedule never retraces. Step n's loss
//! is read after step n+1 is enqueued, so reading it does not stall the
//! device. Evaluation is captured too: its own program per signature,
//! without gradients or updates.
//!
//! Invariants:
//! - The batch of step n is `data.batch(n)` whatever ran before, so a run
//!   resumed from a checkpoint of step n trains on what the saved run would
//!   have, bit for bit (the state, the generator and the loss scale are in the
//!   checkpoint; the schedule is a function of the step).
//! - A checkpoint is written whole or not at all (`atomic_write`); an
//!   existing file is never replaced by accident (resume, overwrite, or an
//!   error naming what is there); the best checkpoint is replaced only by a
//!   better one.
//! - A step's callback runs after any checkpoint of that step is on disk.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kiln_compiler::ir::DType;
use kiln_frontend::checkpoint::{self, Settings};
use kiln_frontend::nn::ParamStore;
use kiln_frontend::optim::{AdamW, AdamWConfig, WarmupCosine};
use kiln_frontend::train_step::TrainStep;
use kiln_frontend::{amp, metrics, replicas, FrontendError, Result, Tensor};

use crate::mlp::{StepInfo, TrainReport};
use crate::training::{record_outcome, record_update, StepClock};

/// The checkpoint tensor holding [`Checkpointing::examples_per_step`].
pub const EXAMPLES_PER_STEP: &str = "data.examples_per_step";
/// The checkpoint tensor holding the best validation metric so far and the
/// step it was measured at, `[value, step]` f64 ([`KeepBest`]).
pub const BEST_METRIC: &str = "train.best_metric";

/// A batch as the captured step sees it: its tensors in a fixed order, and
/// the same structure rebuilt around other tensors of the same types (the
/// step's placeholders when it is traced). `Vec<Tensor>` is one; a struct
/// with optional parts (a mask only some batches have) is another, each
/// structure its own program. A batch should hold data (from the host or
/// device buffers), not tensors computed lazily (`Tensor::zeros`, a cast):
/// those run as a program of their own before each step; make such parts in
/// `with_tensors` instead, inside the step.
pub trait Batch: Sized {
    fn tensors(&self) -> Vec<Tensor>;
    /// `self`'s structure around `tensors` (as many as [`Batch::tensors`]
    /// returns, in its order).
    fn with_tensors(&self, tensors: &[Tensor]) -> Result<Self>;
    /// A name for the batch's shape family (its padded lengths), shown when
    /// a new one compiles; `None` for fixed-shape data.
    fn bucket(&self) -> Option<String> {
        None
    }
}

impl Batch for Vec<Tensor> {
    fn tensors(&self) -> Vec<Tensor> {
        self.clone()
    }

    fn with_tensors(&self, tensors: &[Tensor]) -> Result<Self> {
        Ok(tensors.to_vec())
    }
}

/// Where the batches come from: the batch of step `step` (counting from 0),
/// the same whatever ran before (see the module's invariants).
pub trait Data<B> {
    fn batch(&mut self, step: u64) -> Result<B>;

    /// The epoch step `step` belongs to, for progress and logs.
    fn epoch(&self, _step: u64) -> usize {
        0
    }
}

impl<B, F: FnMut(u64) -> Result<B>> Data<B> for F {
    fn batch(&mut self, step: u64) -> Result<B> {
        self(step)
    }
}

/// One number of an evaluation: `sum` over a batch and the `count` it is
/// out of (`None`: 1, for a value that is already a mean). The trainer adds
/// sums and counts over the validation batches (each averaged over
/// replicas) and reports `Σ sum / Σ count`.
pub struct Metric {
    pub name: String,
    pub sum: Tensor,
    pub count: Option<Tensor>,
}

impl Metric {
    /// A batch's mean (a loss): the evaluation reports the mean over batches.
    pub fn mean(name: impl Into<String>, value: Tensor) -> Metric {
        Metric { name: name.into(), sum: value, count: None }
    }

    /// `hits` out of `total` in a batch (an accuracy over weighted or padded
    /// rows): the evaluation reports the ratio of the totals.
    pub fn ratio(name: impl Into<String>, hits: Tensor, total: Tensor) -> Metric {
        Metric { name: name.into(), sum: hits, count: Some(total) }
    }
}

/// A validation set and what to measure on it. `metrics` runs the model as
/// it evaluates (dropout off); the trainer records no gradient and no
/// update around it.
pub struct Eval<'a, B> {
    pub batches: Vec<B>,
    pub metrics: &'a dyn Fn(&B) -> Result<Vec<Metric>>,
    /// Each replica evaluates rows of its own (as training batches are
    /// drawn), so the metrics are averaged over replicas; `false` when every
    /// replica sees the same batches (nothing to average: no collective).
    pub per_replica: bool,
}

impl<'a, B> Eval<'a, B> {
    /// Batches with rows per replica (see [`Eval::per_replica`]).
    pub fn new(batches: Vec<B>, metrics: &'a dyn Fn(&B) -> Result<Vec<Metric>>) -> Eval<'a, B> {
        Eval { batches, metrics, per_replica: true }
    }
}

/// One evaluation's results.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalResult {
    /// The step it followed.
    pub step: u64,
    /// Each metric by name, in the order the metrics closure returned them.
    pub metrics: Vec<(String, f64)>,
}

impl EvalResult {
    pub fn get(&self, name: &str) -> Option<f64> {
        self.metrics.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
    }
}

/// Keep the checkpoint of the best evaluation so far at `path`.
#[derive(Clone, Debug)]
pub struct KeepBest {
    pub path: PathBuf,
    /// The metric's name as the evaluation returns it.
    pub metric: String,
    /// Higher is better (an accuracy); lower is better otherwise (a loss).
    pub higher_is_better: bool,
}

/// Checkpoints of a run.
#[derive(Clone, Debug)]
pub struct Checkpointing {
    pub path: PathBuf,
    /// Save every this many steps, besides the end of the run.
    pub every: Option<u64>,
    /// Save at the end of every epoch ([`Data::epoch`]).
    pub each_epoch: bool,
    /// Continue from the checkpoint at `path` (an error when there is none).
    pub resume: bool,
    /// Replace a file at `path` (without `resume`); refused otherwise.
    pub overwrite: bool,
    /// Settings ([`RunRecord::settings`]) a resumed run may change.
    pub override_settings: Vec<String>,
}

impl Checkpointing {
    pub fn new(path: impl Into<PathBuf>) -> Checkpointing {
        Checkpointing {
            path: path.into(),
            every: None,
            each_epoch: false,
            resume: false,
            overwrite: false,
            override_settings: Vec::new(),
        }
    }
}

/// What every checkpoint of a run carries beside the training state, and
/// what a resume checks.
#[derive(Clone, Debug, Default)]
pub struct RunRecord {
    /// The run's settings, compared when resuming
    /// ([`checkpoint::check_settings`]).
    pub settings: Option<Settings>,
    /// Examples one step takes (batch × replicas): a saved step means a place
    /// in the data only at that batch, so resuming at another is refused.
    pub examples_per_step: Option<u64>,
    /// Tensors the run saves beside its state (its tokenizer) and reads back
    /// itself: saved, never restored.
    pub tensors: Vec<(String, Tensor)>,
}

/// What [`Trainer::fit`] does.
#[derive(Clone, Debug)]
pub struct FitConfig {
    /// The run's steps, counted from 0 (a resumed run trains the rest).
    pub steps: u64,
    pub schedule: WarmupCosine,
    /// Mixed precision: the forward autocast to this type (bf16, f16 with a
    /// dynamic loss scale), f32 master weights.
    pub amp: Option<DType>,
    /// Clip the gradients' global norm to this.
    pub max_grad_norm: Option<f64>,
    /// Keep going through a NaN or infinite loss (stopped with
    /// [`FrontendError::NonFiniteLoss`] otherwise).
    pub allow_non_finite_loss: bool,
    /// Evaluate every this many steps (and always at the end, when the fit
    /// is given a validation set).
    pub eval_every: Option<u64>,
    /// Evaluate at the end of every epoch ([`Data::epoch`]).
    pub eval_each_epoch: bool,
    pub checkpoint: Option<Checkpointing>,
    /// Save the state of the best evaluation so far.
    pub keep_best: Option<KeepBest>,
    /// What every checkpoint (the run's, the best) carries beside the state.
    pub record: RunRecord,
}

impl FitConfig {
    /// `steps` steps at peak rate `lr`: a tenth of them warming up, then a
    /// cosine decay to a tenth of `lr`.
    pub fn new(steps: u64, lr: f64) -> FitConfig {
        FitConfig {
            steps,
            schedule: WarmupCosine {
                base_lr: lr,
                min_lr: lr * 0.1,
                warmup_steps: (steps / 10).max(1),
                total_steps: steps,
            },
            amp: None,
            max_grad_norm: None,
            allow_non_finite_loss: false,
            eval_every: None,
            eval_each_epoch: false,
            checkpoint: None,
            keep_best: None,
            record: RunRecord::default(),
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |reason: String| Err(FrontendError::InvalidArgument { op: "train", reason });
        if self.steps == 0 {
            return bad("steps is 0: a run takes at least 1".into());
        }
        if self.eval_every == Some(0) {
            return bad("eval_every is 0: evaluate every 1 step or more".into());
        }
        if let Some(c) = &self.checkpoint {
            if c.every == Some(0) {
                return bad("checkpoint every 0 steps: give 1 or more".into());
            }
            if self.keep_best.as_ref().is_some_and(|best| best.path == c.path) {
                return bad(format!("the best checkpoint and the run's are both {}", c.path.display()));
            }
        }
        Ok(())
    }
}

/// What a fit did: the steps' report and every evaluation.
#[derive(Clone, Debug, Default)]
pub struct FitReport {
    pub train: TrainReport,
    pub evals: Vec<EvalResult>,
    /// The step of the checkpoint the run resumed from (0 for a fresh run).
    pub resumed_from: u64,
    /// The best evaluation's value of [`KeepBest::metric`] and its step.
    pub best: Option<(f64, u64)>,
}

type StepCallback<'a> = Box<dyn FnMut(&StepInfo) + 'a>;
type EvalCallback<'a> = Box<dyn FnMut(&EvalResult) + 'a>;

/// Parameters, optimizer and the settings of the steps (see the module docs).
pub struct Trainer<'a> {
    params: &'a ParamStore,
    opt: RefCell<AdamW>,
    ordered: RefCell<Option<TrainStep>>,
    cfg: FitConfig,
    step: u64,
    /// The best evaluation's value and step (with [`KeepBest`]).
    best: std::cell::Cell<Option<(f64, u64)>>,
    on_step: Vec<StepCallback<'a>>,
    on_eval: Vec<EvalCallback<'a>>,
}

impl<'a> Trainer<'a> {
    /// A trainer of `params` with a new AdamW (its state made where the
    /// parameters are, and, under a mesh with a policy set —
    /// `kiln::shard::set_policy`, `--shard` — split as the policy splits the
    /// parameters, which it applies first).
    pub fn new(params: &'a ParamStore, opt: AdamWConfig, cfg: FitConfig) -> Result<Trainer<'a>> {
        kiln_frontend::shard::apply_active(params)?;
        let opt = AdamW::with_state_on(&params.tensors(), opt, params.placement())?;
        Trainer::with_optimizer(params, opt, cfg)
    }

    /// A trainer with an optimizer made already (over `params.tensors()`).
    pub fn with_optimizer(params: &'a ParamStore, opt: AdamW, cfg: FitConfig) -> Result<Trainer<'a>> {
        cfg.check()?;
        let ordered = crate::training::ordered_step(cfg.amp, cfg.max_grad_norm)?;
        Ok(Trainer {
            params,
            opt: RefCell::new(opt),
            ordered: RefCell::new(ordered),
            cfg,
            step: 0,
            best: std::cell::Cell::new(None),
            on_step: Vec::new(),
            on_eval: Vec::new(),
        })
    }

    /// Calls `f` with every step once its loss is read.
    pub fn on_step(&mut self, f: impl FnMut(&StepInfo) + 'a) -> &mut Self {
        self.on_step.push(Box::new(f));
        self
    }

    /// Calls `f` with every evaluation.
    pub fn on_eval(&mut self, f: impl FnMut(&EvalResult) + 'a) -> &mut Self {
        self.on_eval.push(Box::new(f));
        self
    }

    /// Steps taken so far (the checkpoint's, after a resume).
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn config(&self) -> &FitConfig {
        &self.cfg
    }

    /// The loss scale now (f16 mixed precision only).
    pub fn loss_scale(&self) -> Result<Option<f64>> {
        self.ordered.borrow().as_ref().and_then(|o| o.scaler.as_ref()).map(|s| s.scale.item()).transpose()
    }

    /// The whole training state by name: parameters, optimizer state, the
    /// generator's state, the loss scaler's.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut state = crate::training::training_state(self.params, &self.opt.borrow());
        state.extend(self.ordered.borrow().iter().flat_map(TrainStep::state));
        state
    }

    /// Saves the state at the current step to `path`, with the run's records.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut state = self.state();
        let record = &self.cfg.record;
        if let Some(n) = record.examples_per_step {
            state.push((EXAMPLES_PER_STEP.to_string(), Tensor::from_vec(vec![n], [1])?));
        }
        if let Some(settings) = &record.settings {
            state.push(checkpoint::settings_tensor(settings)?);
        }
        state.extend(record.tensors.iter().cloned());
        if let Some((value, step)) = self.best.get() {
            state.push((BEST_METRIC.to_string(), Tensor::from_vec(vec![value, step as f64], [2])?));
        }
        checkpoint::save(path, self.step, &state)
    }

    /// Restores the checkpoint at `path` (written by [`Trainer::save`]):
    /// refused when it was taken at another number of examples a step or with
    /// other settings (but those [`Checkpointing::override_settings`] names).
    pub fn restore(&mut self, path: &Path) -> Result<()> {
        let loaded = checkpoint::load(path)?;
        let record = &self.cfg.record;
        if let Some(n) = record.examples_per_step {
            let saved = loaded.tensors.iter().find(|(name, _)| name == EXAMPLES_PER_STEP);
            let saved = saved.and_then(|(_, l)| l.to_f64s().first().map(|&v| v as u64));
            if let Some(saved) = saved.filter(|&s| s != n) {
                return Err(FrontendError::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!(
                        "saved at step {} of a run taking {saved} examples a step (batch × replicas), and \
                         this run takes {n}: the step would resume elsewhere in the data and the \
                         learning-rate schedule; resume with the batch it was saved with, or start a new run",
                        loaded.step
                    ),
                });
            }
        }
        if let Some(now) = &record.settings {
            let overrides = self.cfg.checkpoint.as_ref().map_or(&[][..], |c| &c.override_settings[..]);
            checkpoint::check_settings(path, loaded.settings(path)?.as_ref(), now, overrides)?;
        }
        let best = loaded.tensors.iter().find(|(n, _)| n == BEST_METRIC).map(|(_, l)| l.to_f64s());
        let best = best.and_then(|v| Some((*v.first()?, *v.get(1)? as u64)));
        self.step = checkpoint::restore_loaded(path, loaded, &self.state())?;
        self.best.set(best);
        Ok(())
    }

    /// Checks the checkpoint's path before any step (writable, nothing
    /// replaced by accident) and restores it when resuming. A restarted
    /// attempt under `kiln launch --restarts` continues from what an earlier
    /// attempt of this run saved (the first attempt refused any file that was
    /// there before, so this one is the run's own).
    fn prepare_checkpoint(&mut self) -> Result<()> {
        if let Some(best) = &self.cfg.keep_best {
            kiln_frontend::atomic_write::check_writable(&best.path)?;
        }
        let Some(c) = self.cfg.checkpoint.clone() else { return Ok(()) };
        let path = c.path.as_path();
        let target = kiln_frontend::atomic_write::check_writable(path)?;
        let exists = target.exists();
        if c.resume {
            if !exists {
                let reason = "--resume: no checkpoint to resume from".into();
                return Err(FrontendError::Checkpoint { path: path.to_path_buf(), reason });
            }
            self.restore(path)?;
            if self.step >= self.cfg.steps {
                return Err(FrontendError::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!(
                        "--resume: the checkpoint holds step {} and this run has {} steps: nothing to train \
                         (give the run more steps)",
                        self.step, self.cfg.steps
                    ),
                });
            }
            return Ok(());
        }
        let attempt = kiln_runtime::distributed::identity::NodeEnv::from_env().identity()?.scope.attempt;
        if exists && attempt > 0 {
            self.restore(path)?;
            eprintln!(
                "kiln: attempt {attempt} resumes from {} (step {}), which an earlier attempt of this run saved",
                path.display(),
                self.step
            );
            return Ok(());
        }
        if !exists || c.overwrite {
            return Ok(());
        }
        let refuse = |what: String| FrontendError::Checkpoint {
            path: path.to_path_buf(),
            reason: format!("{what}; pass --resume to continue from it or --overwrite to replace it"),
        };
        let loaded = checkpoint::load(path)
            .map_err(|e| refuse(format!("exists and is not a readable kiln checkpoint ({e})")))?;
        let step = loaded.step;
        for (name, tensor) in self.state() {
            match loaded.tensors.iter().find(|(n, _)| *n == name) {
                Some((_, lit)) if lit.ty() == tensor.ty() => {}
                Some((_, lit)) => {
                    return Err(refuse(format!(
                        "holds a checkpoint of another model at step {step} (tensor {name} is {}, this model's is {})",
                        lit.ty(),
                        tensor.ty()
                    )))
                }
                None => {
                    return Err(refuse(format!(
                        "holds a checkpoint of another model at step {step} (no tensor {name})"
                    )))
                }
            }
        }
        Err(refuse(format!("holds a checkpoint of this model at step {step}")))
    }

    /// Trains from the current step (0, or the checkpoint's when resuming) to
    /// `cfg.steps` on `data`'s batches, minimizing `loss` (recorded in
    /// training mode: dropout on), evaluating on `eval` every
    /// `cfg.eval_every` steps and at the end.
    pub fn fit<B: Batch>(
        &mut self,
        data: &mut dyn Data<B>,
        loss: &dyn Fn(&B) -> Result<Tensor>,
        eval: Option<&Eval<'_, B>>,
    ) -> Result<FitReport> {
        let before = metrics::snapshot();
        self.prepare_checkpoint()?;
        let mut report = FitReport { resumed_from: self.step, best: self.best.get(), ..FitReport::default() };
        let start = Instant::now();
        let total = self.cfg.steps;
        let schedule = self.cfg.schedule;
        let tensors = self.params.tensors();
        // The batch the step is called with: its structure for the trace.
        let current: RefCell<Option<B>> = RefCell::new(None);
        let (opt, ordered, amp_dtype) = (&self.opt, &self.ordered, self.cfg.amp);
        let mut captured = kiln_frontend::compile_step(|inputs: &[Tensor]| {
            let (batch_inputs, lr) = inputs.split_at(inputs.len().saturating_sub(1));
            let batch = template(&current)?.with_tensors(batch_inputs)?;
            let l = amp::autocast_if(amp_dtype, || loss(&batch))?;
            let lr = lr.first().ok_or_else(|| internal("the step's learning-rate input is missing"))?;
            record_update(ordered.borrow_mut().as_mut(), &tensors, &mut opt.borrow_mut(), &l, lr)
        });
        let mut evaluator = eval.map(|e| Evaluator::new(e, amp_dtype));
        let mut clock = StepClock::default();
        // Step n's outputs, its learning rate and epoch, until they are read.
        let mut unread: Option<(Vec<Tensor>, u64, f64, usize)> = None;
        let allow = self.cfg.allow_non_finite_loss;
        let read = |unread: &mut Option<(Vec<Tensor>, u64, f64, usize)>,
                    r: &mut TrainReport,
                    clock: &mut StepClock|
         -> Result<Option<StepInfo>> {
            let Some((outputs, step, lr, epoch)) = unread.take() else { return Ok(None) };
            let (loss, step_ms, grad_norm) = record_outcome(&outputs, step, allow, r, clock)?;
            let skipped_steps = r.skipped_steps;
            Ok(Some(StepInfo { epoch, step, steps_total: total, loss, step_ms, lr, skipped_steps, grad_norm }))
        };
        while self.step < total {
            let step = self.step;
            let batch = data.batch(step)?;
            let lr = schedule.lr(step);
            let mut inputs = batch.tensors();
            inputs.push(Tensor::scalar(lr as f32));
            let bucket = batch.bucket();
            *current.borrow_mut() = Some(batch);
            clock.start();
            let outputs = {
                let _bucket = bucket.map(|b| kiln_frontend::bucket(format!("train {b}")));
                captured.call(&inputs)?
            };
            self.step += 1;
            if let Some(info) = read(&mut unread, &mut report.train, &mut clock)? {
                self.on_step.iter_mut().for_each(|f| f(&info));
            }
            unread = Some((outputs, self.step, lr, data.epoch(step)));
            let n = self.step;
            let epoch_end = n < total && data.epoch(n) != data.epoch(n - 1);
            let ckpt = self.cfg.checkpoint.as_ref();
            let save_due =
                ckpt.is_some_and(|c| n == total || c.every.is_some_and(|e| n % e == 0) || (c.each_epoch && epoch_end));
            let eval_due = evaluator.is_some()
                && (n == total
                    || self.cfg.eval_every.is_some_and(|e| n % e == 0)
                    || (self.cfg.eval_each_epoch && epoch_end));
            if !(save_due || eval_due) {
                continue;
            }
            // A boundary: the step is read (it has run), then saved, then
            // shown, then evaluated.
            let info = read(&mut unread, &mut report.train, &mut clock)?;
            if save_due {
                if let Some(c) = ckpt {
                    self.save(&c.path)?;
                }
            }
            if let Some(info) = info {
                self.on_step.iter_mut().for_each(|f| f(&info));
            }
            if let Some(ev) = evaluator.as_mut() {
                if eval_due {
                    let result = ev.run(n)?;
                    self.on_eval.iter_mut().for_each(|f| f(&result));
                    self.consider_best(&result)?;
                    report.evals.push(result);
                }
            }
            // The clock's next step starts at its own start, not at the
            // completion of the step before the boundary's work.
            clock = StepClock::default();
        }
        if let Some(info) = read(&mut unread, &mut report.train, &mut clock)? {
            self.on_step.iter_mut().for_each(|f| f(&info));
        }
        tracing::info!(
            traces = captured.traces(),
            replays = captured.replays(),
            last_retrace = ?captured.last_retrace(),
            "kiln: the fit's captured step"
        );
        drop(captured);
        // Every step has finished and reported (its checks included) before
        // the run is called done.
        kiln_frontend::sync()?;
        let t = &mut report.train;
        t.train_seconds = start.elapsed().as_secs_f64();
        t.steps = self.step - report.resumed_from;
        t.allow_non_finite_loss = allow;
        t.loss_scale = self.loss_scale()?;
        t.count_since(&before);
        report.best = self.best.get();
        Ok(report)
    }

    /// Evaluates once on `eval` now (the step's programs are the fit's).
    pub fn evaluate<B: Batch>(&self, eval: &Eval<'_, B>) -> Result<EvalResult> {
        Evaluator::new(eval, self.cfg.amp).run(self.step)
    }

    /// After an evaluation: saves the best checkpoint when it improved on
    /// the best so far.
    fn consider_best(&self, result: &EvalResult) -> Result<()> {
        let Some(best) = self.cfg.keep_best.clone() else { return Ok(()) };
        let value = result.get(&best.metric).ok_or_else(|| FrontendError::InvalidArgument {
            op: "train",
            reason: format!(
                "keep-best metric {:?} is not one the evaluation returns ({})",
                best.metric,
                result.metrics.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
            ),
        })?;
        let better = match self.best.get() {
            None => value.is_finite(),
            Some((old, _)) => value.is_finite() && if best.higher_is_better { value > old } else { value < old },
        };
        if better {
            self.best.set(Some((value, result.step)));
            self.save(&best.path)?;
        }
        Ok(())
    }
}

/// The batch a captured step is being called with.
fn template<B>(current: &RefCell<Option<B>>) -> Result<std::cell::Ref<'_, B>> {
    std::cell::Ref::filter_map(current.borrow(), Option::as_ref)
        .map_err(|_| internal("the captured step was traced without its batch"))
}

fn internal(reason: &str) -> FrontendError {
    FrontendError::InvalidArgument { op: "train", reason: reason.to_string() }
}

/// The captured evaluation step of one validation set (one program per
/// batch signature), kept for every evaluation of a fit.
struct Evaluator<'e, B> {
    eval: &'e Eval<'e, B>,
    /// The batch the step is being called with (its index).
    current: std::rc::Rc<std::cell::Cell<usize>>,
    /// The metrics' names, and whether each has a count, as the trace found them.
    layout: std::rc::Rc<RefCell<Vec<(String, bool)>>>,
    step: kiln_frontend::CompiledStep<EvalFn<'e>>,
}

type EvalFn<'e> = Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>> + 'e>;

impl<'e, B: Batch> Evaluator<'e, B> {
    fn new(eval: &'e Eval<'e, B>, amp_dtype: Option<DType>) -> Self {
        let current = std::rc::Rc::new(std::cell::Cell::new(0));
        let layout = std::rc::Rc::new(RefCell::new(Vec::new()));
        let (at, names) = (current.clone(), layout.clone());
        let f: EvalFn<'e> = Box::new(move |inputs: &[Tensor]| {
            let b = eval.batches.get(at.get()).ok_or_else(|| internal("evaluation traced without its batch"))?;
            let b = b.with_tensors(inputs)?;
            let ms = amp::autocast_if(amp_dtype, || (eval.metrics)(&b))?;
            let mut outs = Vec::with_capacity(ms.len() * 2);
            let mut found = Vec::with_capacity(ms.len());
            for m in ms {
                found.push((m.name, m.count.is_some()));
                outs.push(m.sum.to_dtype(DType::F32)?.sum_all()?);
                if let Some(c) = m.count {
                    outs.push(c.to_dtype(DType::F32)?.sum_all()?);
                }
            }
            *names.borrow_mut() = found;
            if eval.per_replica {
                replicas::all_reduce_mean(&outs)
            } else {
                Ok(outs)
            }
        });
        Evaluator { eval, current, layout, step: kiln_frontend::compile_step(f) }
    }

    /// Every validation batch through the metrics (averaged over replicas),
    /// totalled.
    fn run(&mut self, step: u64) -> Result<EvalResult> {
        if self.eval.batches.is_empty() {
            return Err(FrontendError::InvalidArgument {
                op: "evaluate",
                reason: "the validation set has no batch".into(),
            });
        }
        let mut totals: Vec<(f64, f64)> = Vec::new();
        for (i, batch) in self.eval.batches.iter().enumerate() {
            self.current.set(i);
            let outputs = {
                let _bucket = batch.bucket().map(|b| kiln_frontend::bucket(format!("eval {b}")));
                self.step.call(&batch.tensors())?
            };
            let layout = self.layout.borrow();
            totals.resize(layout.len(), (0.0, 0.0));
            let mut it = outputs.iter();
            for ((_, counted), total) in layout.iter().zip(totals.iter_mut()) {
                let sum = it.next().ok_or_else(|| internal("an evaluation output is missing"))?.item()?;
                let count = if *counted {
                    it.next().ok_or_else(|| internal("an evaluation count is missing"))?.item()?
                } else {
                    1.0
                };
                total.0 += sum;
                total.1 += count;
            }
        }
        let layout = self.layout.borrow();
        let metrics = layout
            .iter()
            .zip(&totals)
            .map(|((name, _), &(sum, count))| (name.clone(), if count > 0.0 { sum / count } else { f64::NAN }))
            .collect();
        Ok(EvalResult { step, metrics })
    }
}
