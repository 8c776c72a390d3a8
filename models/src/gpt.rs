//! A character-level GPT (pre-LN transformer with tied embeddings) and its
//! training loop.
//!
//! Batches are random windows of the encoded text, always `[batch, seq]`, so the
//! run compiles one program. Dropout draws from the in-graph generator, whose
//! state is part of the checkpointed training state. With `amp` or
//! `max_grad_norm` set, the update goes through
//! [`kiln_frontend::train_step::TrainStep`] (the forward under autocast, the gradients
//! clipped, f16 loss-scaled).

use std::path::Path;
use std::time::Instant;

use kiln_compiler::ir::DType;

use crate::mlp::{StepInfo, TrainReport};
use kiln_frontend::amp;
use kiln_frontend::nn::{
    self, CausalSelfAttention, Embedding, HostRng, InitPlacement, LayerNorm, MlpBlock, Module, ParamStore,
};
use kiln_frontend::optim::{AdamW, AdamWConfig};
use kiln_frontend::train_step::TrainStep;
use kiln_frontend::Tensor;
use kiln_frontend::{checkpoint, metrics, random};
use kiln_frontend::{FrontendError, Result};

/// Model and training settings.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab: usize,
    pub seq: usize,
    pub dim: usize,
    pub heads: usize,
    pub layers: usize,
    pub batch: usize,
    pub lr: f64,
    pub steps: u64,
    pub seed: u64,
    pub dropout: f64,
    /// Mixed precision: matmuls in this dtype (`f16` or `bf16`). `None`: f32.
    pub amp: Option<DType>,
    /// Clip the global gradient norm to this. `None`: no clipping.
    pub max_grad_norm: Option<f64>,
    /// Where parameters are initialised; `None`: `KILN_INIT`, else on the
    /// devices on the PJRT backend (`crate::training::init_placement`).
    pub init: Option<InitPlacement>,
    /// How the loss meets the tied LM head; `None`: `KILN_LM_HEAD`, else the
    /// backend's default ([`LmHeadLoss::resolve`]).
    pub lm_head: Option<LmHeadLoss>,
    /// Keep training through a loss that is NaN or infinite (the default
    /// stops with [`kiln_frontend::FrontendError::NonFiniteLoss`]).
    pub allow_non_finite_loss: bool,
    /// Evaluation and checkpoints of [`train`].
    pub run: GptRun,
}

/// Evaluation and checkpoints of a [`train`] run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GptRun {
    /// Hold out the text's last tenth and evaluate on windows of it every N
    /// steps (and at the end).
    pub eval_every: Option<u64>,
    /// Save the training state here at the end and every `checkpoint_every`
    /// steps; a file there is refused unless `resume` or `overwrite`.
    pub checkpoint: Option<std::path::PathBuf>,
    pub checkpoint_every: Option<u64>,
    /// Continue from `checkpoint`: each step's windows depend on the seed and
    /// the step alone, so the resumed run takes the steps the saved one would.
    pub resume: bool,
    pub overwrite: bool,
    /// Settings ([`GptConfig::run_settings`]) a resumed run may change.
    pub override_settings: Vec<String>,
    /// Keep the state of the evaluation with the lowest held-out loss here.
    pub keep_best: Option<std::path::PathBuf>,
}

/// The checkpoint tensor holding a run's characters in id order (UTF-8).
pub const CHARS: &str = "run.chars";
/// The checkpoint tensor holding the model's shape (`vocab=.. seq=.. dim=..
/// heads=.. layers=..`; `generate::load_gpt_checkpoint` reads both).
pub const SHAPE: &str = "run.gpt_shape";

fn text_tensor(name: &str, text: &str) -> Result<(String, Tensor)> {
    let bytes = text.as_bytes().to_vec();
    Ok((name.to_string(), Tensor::from_vec(bytes.clone(), [bytes.len()])?))
}

/// Validation batches a GPT run's evaluation takes from the held-out text.
pub const EVAL_BATCHES: u64 = 4;

/// Environment variable for [`GptConfig::lm_head`]: `logits`, `blocks` or
/// `blocks:MIB` (blocks of at most MIB MiB of f32 logits).
pub const ENV_LM_HEAD: &str = "KILN_LM_HEAD";

/// How [`Gpt::loss`] computes the cross-entropy of the tied LM head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LmHeadLoss {
    /// `[tokens, vocab]` logits through `nn::cross_entropy`, as
    /// [`Gpt::forward`] returns them.
    Logits,
    /// `nn::lm_head_cross_entropy_blocks`: the logits made in row blocks of at
    /// most `block_bytes` f32 bytes and never whole; with the mean's uniform
    /// cotangent the compiler fuses loss and gradient into one loop
    /// (`docs/composites.md`).
    Blocks { block_bytes: u64 },
}

impl LmHeadLoss {
    /// Blocks of [`nn::LM_HEAD_BLOCK_BYTES`] (256 MiB): what
    /// `KILN_LM_HEAD=blocks` names.
    pub const DEFAULT: LmHeadLoss = LmHeadLoss::Blocks { block_bytes: nn::LM_HEAD_BLOCK_BYTES };

    /// The default on a GPU: blocks of 394 MiB, four blocks of 2048 tokens at
    /// gpt2-small's 8 × 1024 × 50304 ([`nn::lm_head_block_rows`]). Measured on
    /// the H100 (`benches/RESULTS.md`, "The LM-head loss fused with its
    /// gradient", with blocks of 2053 tokens then): 8 blocks cut XLA's temp
    /// most (−1.20 GB) but the CLI's step was 3.8% slower; 4 blocks keep 89%
    /// of that cut at the explicit-logits step time; 2 blocks run 1–3% faster
    /// but cut only 0.69 GB.
    pub const DEFAULT_GPU: LmHeadLoss = LmHeadLoss::Blocks { block_bytes: 394 << 20 };

    /// The default for the current backend, for logits of `logits_bytes` (f32):
    /// [`LmHeadLoss::DEFAULT_GPU`] on a GPU; on the CPU plugin
    /// [`LmHeadLoss::DEFAULT`] when the logits need more than one of its
    /// blocks, else [`LmHeadLoss::Logits`] (one block saves nothing); the
    /// logits on the interpreter and the eager backend. On the CPU plugin the
    /// blocks cut XLA's temp of the gpt2-small step from 12.30 to 7.81 GB
    /// (`testsuite/tests/memory.rs`). (Before the compiler chained the blocks
    /// by data on the CPU target, XLA CPU ran them side by side and the CPU
    /// kept the logits: `docs/memory-journal.md`, "Fences the CPU plugin keeps".)
    pub fn default_for_backend(logits_bytes: u64) -> Result<LmHeadLoss> {
        Ok(match kiln_frontend::backend() {
            kiln_frontend::Backend::Pjrt => {
                if kiln_frontend::client()?.platform_name() != "cpu" {
                    LmHeadLoss::DEFAULT_GPU
                } else if logits_bytes > nn::LM_HEAD_BLOCK_BYTES {
                    LmHeadLoss::DEFAULT
                } else {
                    LmHeadLoss::Logits
                }
            }
            kiln_frontend::Backend::Reference | kiln_frontend::Backend::Eager => LmHeadLoss::Logits,
        })
    }

    /// `chosen`, else `KILN_LM_HEAD`, else [`LmHeadLoss::default_for_backend`]
    /// for logits of `logits_bytes`.
    pub fn resolve(chosen: Option<LmHeadLoss>, logits_bytes: u64) -> Result<LmHeadLoss> {
        if let Some(c) = chosen {
            return Ok(c);
        }
        match LmHeadLoss::from_env()? {
            Some(l) => Ok(l),
            None => LmHeadLoss::default_for_backend(logits_bytes),
        }
    }

    /// What `KILN_LM_HEAD` names; `None` where it is unset or empty.
    pub fn from_env() -> Result<Option<LmHeadLoss>> {
        match kiln_runtime::env::string_var(ENV_LM_HEAD)? {
            Some(v) if !v.trim().is_empty() => LmHeadLoss::parse(v.trim()).map(Some).ok_or(FrontendError::BadEnv {
                var: ENV_LM_HEAD,
                value: v,
                expected: "logits, blocks or blocks:MIB (a whole number of MiB >= 1)",
            }),
            _ => Ok(None),
        }
    }

    /// `logits`, `blocks` or `blocks:MIB`.
    pub fn parse(s: &str) -> Option<LmHeadLoss> {
        match s.split_once(':') {
            None if s == "logits" => Some(LmHeadLoss::Logits),
            None if s == "blocks" => Some(LmHeadLoss::DEFAULT),
            None => None,
            Some(("blocks", mib)) => {
                let mib: u64 = mib.parse().ok().filter(|&m| m >= 1)?;
                Some(LmHeadLoss::Blocks { block_bytes: mib.checked_mul(1 << 20)? })
            }
            Some(_) => None,
        }
    }
}

impl GptConfig {
    /// Small enough to train on two CPU cores in seconds.
    pub fn tiny(vocab: usize) -> GptConfig {
        GptConfig {
            vocab,
            seq: 32,
            dim: 64,
            heads: 4,
            layers: 2,
            batch: 16,
            lr: 3e-3,
            steps: 300,
            seed: 0,
            dropout: 0.0,
            amp: None,
            max_grad_norm: None,
            init: None,
            lm_head: None,
            allow_non_finite_loss: false,
            run: GptRun::default(),
        }
    }

    /// GPT-2 small's shape (`benches/RESULTS.md`'s `gpt2-small`): for accelerators.
    pub fn gpt2_small(vocab: usize) -> GptConfig {
        GptConfig {
            vocab,
            seq: 1024,
            dim: 768,
            heads: 12,
            layers: 12,
            batch: 8,
            lr: 6e-4,
            steps: 1000,
            seed: 0,
            dropout: 0.0,
            amp: None,
            max_grad_norm: None,
            init: None,
            lm_head: None,
            allow_non_finite_loss: false,
            run: GptRun::default(),
        }
    }
}

impl GptConfig {
    /// The model's shape as `generate::load_gpt_checkpoint` reads it.
    pub fn shape_text(&self) -> String {
        format!("vocab={} seq={} dim={} heads={} layers={}", self.vocab, self.seq, self.dim, self.heads, self.layers)
    }

    /// What a resumed run must share with the run that saved its checkpoint
    /// (the model's shape is checked by the tensors themselves).
    pub fn run_settings(&self) -> checkpoint::Settings {
        let amp = self.amp.map_or_else(|| "off".to_string(), |d| d.to_string());
        let clip = self.max_grad_norm.map_or_else(|| "off".to_string(), |c| c.to_string());
        let held_out = self.run.eval_every.is_some() || self.run.keep_best.is_some();
        [
            ("seed", self.seed.to_string()),
            ("lr", self.lr.to_string()),
            ("steps", self.steps.to_string()),
            ("seq", self.seq.to_string()),
            ("dropout", self.dropout.to_string()),
            ("amp", amp),
            ("max_grad_norm", clip),
            ("held_out", held_out.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Parameters of the model: the token and position embeddings, per
    /// block two layer norms, attention (`qkv`, `proj`) and the MLP (`fc`,
    /// `proj`) with their biases, and the final norm: `vocab·dim + seq·dim +
    /// layers·(12·dim² + 13·dim) + 2·dim`. `None` on overflow.
    pub fn parameter_count(&self) -> Option<usize> {
        let d = self.dim;
        let per_block = d.checked_mul(d)?.checked_mul(12)?.checked_add(d.checked_mul(13)?)?;
        self.vocab
            .checked_mul(d)?
            .checked_add(self.seq.checked_mul(d)?)?
            .checked_add(self.layers.checked_mul(per_block)?)?
            .checked_add(d.checked_mul(2)?)
    }

    /// Refuses settings that cannot train before anything is allocated or
    /// compiled: a zero size or step count, a learning rate that is not a
    /// finite positive f32, and parameters (weights, gradients, AdamW's two
    /// moments: four f32 copies) or the host's batch buffers (tokens and
    /// targets, `batch·seq` i32 each, for each of `replicas` replicas) beyond
    /// the host's memory. Sizes use checked arithmetic.
    pub fn check(&self, replicas: usize) -> Result<()> {
        let bad = |name: &'static str, value: f64, expected: &'static str| {
            Err(FrontendError::HyperParameter { op: "train gpt", name, value, expected })
        };
        for (name, value) in [
            ("vocab", self.vocab),
            ("seq", self.seq),
            ("dim", self.dim),
            ("heads", self.heads),
            ("layers", self.layers),
            ("batch", self.batch),
        ] {
            if value == 0 {
                return bad(name, 0.0, "at least 1");
            }
        }
        if self.steps == 0 {
            return bad("steps", 0.0, "at least 1");
        }
        // The schedule's rate reaches the step as an f32 scalar.
        if !(self.lr > 0.0 && kiln_frontend::optim::f32_rate(self.lr).is_some()) {
            return bad("lr", self.lr, "a finite number above 0 that f32 can hold (1.4e-45 to 3.4e38)");
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad("dropout", self.dropout, "in [0, 1)");
        }
        kiln_frontend::limits::check_host_bytes(
            format!(
                "the GPT's parameters (vocab {}, seq {}, dim {}, {} layers; weights, gradients and AdamW state)",
                self.vocab, self.seq, self.dim, self.layers
            ),
            self.parameter_count().and_then(|p| kiln_frontend::limits::checked_bytes(&[p, 4], 4)),
        )?;
        kiln_frontend::limits::check_host_bytes(
            format!(
                "the batch's tokens and targets (batch {} x seq {} x 2, {replicas} replica(s))",
                self.batch, self.seq
            ),
            kiln_frontend::limits::checked_bytes(&[self.batch, self.seq, 2, replicas.max(1)], 4),
        )
    }
}

/// The sorted distinct characters of a text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CharVocab {
    chars: Vec<char>,
}

impl CharVocab {
    pub fn new(text: &str) -> CharVocab {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        CharVocab { chars }
    }

    pub fn len(&self) -> usize {
        self.chars.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// Ids of `text`'s characters; characters outside the vocabulary are skipped.
    pub fn encode(&self, text: &str) -> Vec<i32> {
        text.chars().filter_map(|c| self.chars.binary_search(&c).ok().map(|i| i as i32)).collect()
    }

    pub fn decode(&self, ids: &[i32]) -> String {
        ids.iter().filter_map(|&i| self.chars.get(i as usize)).collect()
    }

    /// The characters in id order, as one string (what a checkpoint keeps).
    pub fn as_text(&self) -> String {
        self.chars.iter().collect()
    }
}

/// One pre-LN transformer block.
#[derive(Clone, Debug)]
struct Block {
    ln1: LayerNorm,
    attn: CausalSelfAttention,
    ln2: LayerNorm,
    mlp: MlpBlock,
}

/// Token and position embeddings, blocks, final norm, tied LM head.
#[derive(Clone, Debug)]
pub struct Gpt {
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    cfg: GptConfig,
    /// The mode [`Module::forward`] runs in (dropout on while training).
    training: std::cell::Cell<bool>,
}

impl Gpt {
    /// GPT-2 init: normal(0, 0.02), residual projections scaled by 1/sqrt(2·layers).
    pub fn new(ps: &mut ParamStore, cfg: &GptConfig) -> Result<Gpt> {
        let std = 0.02;
        let proj_std = std / (2.0 * cfg.layers as f64).sqrt();
        let blocks = (0..cfg.layers)
            .map(|i| {
                Ok(Block {
                    ln1: LayerNorm::new(ps, &format!("h{i}.ln1"), cfg.dim)?,
                    attn: CausalSelfAttention::new(ps, &format!("h{i}.attn"), cfg.dim, cfg.heads, std, proj_std)?,
                    ln2: LayerNorm::new(ps, &format!("h{i}.ln2"), cfg.dim)?,
                    mlp: MlpBlock::new(ps, &format!("h{i}.mlp"), cfg.dim, 4 * cfg.dim, std, proj_std)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Gpt {
            tok: Embedding::new(ps, "wte", cfg.vocab, cfg.dim, std)?,
            pos: Embedding::new(ps, "wpe", cfg.seq, cfg.dim, std)?,
            blocks,
            ln_f: LayerNorm::new(ps, "ln_f", cfg.dim)?,
            cfg: cfg.clone(),
            training: std::cell::Cell::new(true),
        })
    }

    /// `ids: [batch, seq]` s32 -> logits `[batch, seq, vocab]`.
    pub fn forward(&self, ids: &Tensor, train: bool) -> Result<Tensor> {
        // The LM head shares the token embedding: logits = h · Eᵀ.
        self.hidden(ids, train)?.matmul(&self.tok.table.t()?)
    }

    /// `ids: [batch, seq]` -> the final-norm output `[batch, seq, dim]` that
    /// the tied LM head reads.
    fn hidden(&self, ids: &Tensor, train: bool) -> Result<Tensor> {
        let t = ids.dims()[1];
        let positions = Tensor::arange(t, DType::I32)?;
        let mut h = self.tok.forward(ids)?.add(&self.pos.forward(&positions)?)?;
        h = nn::dropout(&h, self.cfg.dropout, train)?;
        for b in &self.blocks {
            h = h.add(&nn::dropout(&b.attn.forward(&b.ln1.forward(&h)?)?, self.cfg.dropout, train)?)?;
            h = h.add(&nn::dropout(&b.mlp.forward(&b.ln2.forward(&h)?)?, self.cfg.dropout, train)?)?;
        }
        self.ln_f.forward(&h)
    }

    /// The model's settings.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// An empty key/value cache of `context` positions for `batch` rows
    /// ([`crate::generate`]).
    pub fn new_cache(&self, batch: usize, context: usize) -> Result<crate::generate::KvCache> {
        let (h, hd) = (self.cfg.heads, self.cfg.dim / self.cfg.heads);
        crate::generate::KvCache::new(self.cfg.layers, [batch, h, context, hd], DType::F32)
    }

    /// The logits `[b, t, vocab]` of `ids: [b, t]` at positions `pos..pos +
    /// t` (`pos` an i32 scalar tensor), in eval mode, attending to the
    /// cache's earlier characters; their keys and values join the cache.
    pub fn decode(&self, ids: &Tensor, pos: &Tensor, cache: &mut crate::generate::KvCache) -> Result<Tensor> {
        let (b, t) = (ids.dims()[0], ids.dims()[1]);
        let positions = Tensor::iota(DType::I32, [t], 0)?.add(pos)?;
        let mut h = self.tok.forward(ids)?.add(&self.pos.forward(&positions)?)?;
        for (blk, c) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            let x = blk.ln1.forward(&h)?;
            let (heads, d) = (blk.attn.heads, self.cfg.dim);
            let hd = d / heads;
            let qkv = blk.attn.qkv.forward(&x)?.reshape([b, t, 3, heads, hd])?;
            let pick = |i: usize| qkv.narrow(2, i, 1)?.reshape([b, t, heads, hd])?.permute(vec![0, 2, 1, 3]);
            let y = c.attend(&pick(0)?, &pick(1)?, &pick(2)?, pos)?.permute(vec![0, 2, 1, 3])?.reshape([b, t, d])?;
            h = h.add(&blk.attn.proj.forward(&y)?)?;
            h = h.add(&blk.mlp.forward(&blk.ln2.forward(&h)?)?)?;
        }
        self.ln_f.forward(&h)?.matmul(&self.tok.table.t()?)
    }

    /// Mean next-character cross-entropy over every position, through the
    /// LM head the config's [`LmHeadLoss`] names.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, train: bool) -> Result<Tensor> {
        let tokens = ids.dims().iter().product::<usize>() as u64;
        let logits_bytes = tokens.saturating_mul(self.cfg.vocab as u64).saturating_mul(4);
        match LmHeadLoss::resolve(self.cfg.lm_head, logits_bytes)? {
            LmHeadLoss::Logits => {
                let logits = self.forward(ids, train)?;
                let (b, t, v) = (logits.dims()[0], logits.dims()[1], logits.dims()[2]);
                nn::cross_entropy(&logits.reshape([b * t, v])?, targets, None)
            }
            LmHeadLoss::Blocks { block_bytes } => {
                let h = self.hidden(ids, train)?;
                let (b, t, d) = (h.dims()[0], h.dims()[1], h.dims()[2]);
                nn::lm_head_cross_entropy_blocks(&h.reshape([b * t, d])?, &self.tok.table, targets, block_bytes)
            }
        }
    }
}

impl Module for Gpt {
    /// `ids: [batch, seq]` -> logits, with dropout as the mode says.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Gpt::forward(self, ids, self.training.get())
    }
    fn describe(&self) -> String {
        format!("Gpt({} layers, width {})", self.cfg.layers, self.cfg.dim)
    }
    /// In creation order: the blocks, the embeddings, the final norm.
    fn children(&self) -> Vec<&dyn Module> {
        let mut out: Vec<&dyn Module> = Vec::new();
        for b in &self.blocks {
            out.extend([&b.ln1 as &dyn Module, &b.attn, &b.ln2, &b.mlp]);
        }
        out.extend([&self.tok as &dyn Module, &self.pos, &self.ln_f]);
        out
    }
    fn mode_flag(&self) -> Option<&std::cell::Cell<bool>> {
        Some(&self.training)
    }
}

/// The model, its parameters and optimizer, and the batch sampler.
pub struct GptTrainer {
    pub params: ParamStore,
    pub model: Gpt,
    pub opt: AdamW,
    pub step: u64,
    /// The ordered step when mixed precision or clipping is on.
    pub ordered: Option<TrainStep>,
    /// Updates skipped so far for non-finite gradients.
    pub skipped: u64,
    data: Vec<i32>,
    sampler: HostRng,
    cfg: GptConfig,
}

impl GptTrainer {
    /// `data` are encoded characters; it must hold more than `seq` of them.
    pub fn new(data: Vec<i32>, cfg: &GptConfig) -> Result<GptTrainer> {
        Ok(GptTrainer::build(data, cfg)?.0)
    }

    /// [`GptTrainer::new`], timing its phases (the counters and `other_ms`
    /// are left to the caller, who knows the whole set-up).
    fn build(data: Vec<i32>, cfg: &GptConfig) -> Result<(GptTrainer, crate::training::SetupBreakdown)> {
        let mut times = crate::training::SetupBreakdown::default();
        let mut lap = Instant::now();
        if data.len() <= cfg.seq {
            return Err(FrontendError::InvalidArgument {
                op: "gpt",
                reason: format!("{} characters cannot fill one window of {} + 1", data.len(), cfg.seq),
            });
        }
        let mut params = ParamStore::with_placement(cfg.seed, crate::training::init_placement(cfg.init)?);
        let model = Gpt::new(&mut params, cfg)?;
        times.model_ms = crate::training::lap(&mut lap);
        // Under a mesh, the policy set for the run (`--shard`) before the
        // optimizer state is made from the parameters.
        kiln_frontend::shard::apply_active(&params)?;
        times.shard_ms = crate::training::lap(&mut lap);
        // The optimizer state in each parameter's sharding, made where the
        // parameters are: on the device placement its zeros are recorded
        // for the init program (no host buffer, no upload).
        let opt = AdamW::with_state_on(&params.tensors(), optimizer(), params.placement())?;
        times.optimizer_ms = crate::training::lap(&mut lap);
        // Then the init program runs (on-device init), producing each
        // parameter and state tensor in the sharding just set.
        params.materialize()?;
        times.init_step_ms = crate::training::lap(&mut lap);
        random::manual_seed(cfg.seed);
        let ordered = crate::training::ordered_step(cfg.amp, cfg.max_grad_norm)?;
        let trainer = GptTrainer {
            params,
            model,
            opt,
            step: 0,
            ordered,
            skipped: 0,
            data,
            sampler: HostRng::new(cfg.seed ^ 0x5eed),
            cfg: cfg.clone(),
        };
        Ok((trainer, times))
    }

    /// Random windows: inputs `[batch, seq]`, targets (shifted by one)
    /// `[batch·seq]`; with several replicas, each replica draws its own.
    pub fn next_batch(&mut self) -> Result<(Tensor, Tensor)> {
        sample_batch(&self.data, &mut self.sampler, &self.cfg)
    }

    /// Records and runs one training step; returns the loss.
    pub fn train_step(&mut self, lr: f64) -> Result<f64> {
        let (x, y) = self.next_batch()?;
        let loss = amp::autocast_if(self.cfg.amp, || self.model.loss(&x, &y, true))?;
        let out = crate::training::run_step(self.ordered.as_mut(), &self.params, &mut self.opt, &loss, lr)?;
        self.step += 1;
        self.skipped += u64::from(out.skipped);
        Ok(out.loss)
    }

    /// Every tensor of the training state, by name (for checkpoints).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut state = crate::training::training_state(&self.params, &self.opt);
        state.extend(self.ordered.iter().flat_map(TrainStep::state));
        state
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        checkpoint::save(path, self.step, &self.state())
    }
}

/// The GPT loop's optimizer.
fn optimizer() -> AdamWConfig {
    AdamWConfig { weight_decay: 0.1, beta2: 0.99, ..Default::default() }
}

/// The step `kiln train gpt` runs at `cfg` (its model, optimizer and ordered
/// step), recorded on tokens of the vocabulary and never run: what `kiln
/// profile gpt --max-batch` sizes. The parameters are initialised on the host.
pub fn recorded_train_step(cfg: &GptConfig) -> Result<kiln_compiler::ir::Graph> {
    cfg.check(1)?;
    let params = &mut ParamStore::new(cfg.seed);
    let model = Gpt::new(params, cfg)?;
    let mut opt = AdamW::new(&params.tensors(), optimizer())?;
    let ordered = crate::training::ordered_step(cfg.amp, cfg.max_grad_norm)?;
    let (b, t) = (cfg.batch, cfg.seq);
    let token = |i: usize| (i * 7919 % cfg.vocab) as i32;
    let x = Tensor::from_vec((0..b * t).map(token).collect::<Vec<_>>(), [b, t])?;
    let y = Tensor::from_vec((1..=b * t).map(token).collect::<Vec<_>>(), [b * t])?;
    crate::training::recorded_step(|x, y| model.loss(x, y, true), params, &mut opt, ordered, cfg.amp, (&x, &y))
}

/// The GPT's training step captured (`kiln::compile_step`): inputs `[tokens,
/// targets, lr]` (`lr` an f32 scalar), outputs the loss averaged over replicas
/// and, with an ordered step (mixed precision or clipping), whether the update
/// was skipped. Replays are bit-identical to [`GptTrainer::train_step`] on the
/// same batch; the borrows are of the trainer's fields, so the loop keeps its
/// sampler and step counter.
pub fn captured_step<'a>(
    model: &'a Gpt,
    params: Vec<Tensor>,
    opt: &'a mut AdamW,
    ordered: Option<&'a mut TrainStep>,
    amp: Option<DType>,
) -> kiln_frontend::CompiledStep<impl FnMut(&[Tensor]) -> Result<Vec<Tensor>> + 'a> {
    crate::training::captured_update(move |x, y| model.loss(x, y, true), params, opt, ordered, amp)
}

/// Splits the text's last tenth off `data` (for evaluation); each part must
/// hold a window of `seq` + 1 characters.
fn held_out(data: &mut Vec<i32>, seq: usize) -> Result<Vec<i32>> {
    let cut = data.len() - data.len() / 10;
    if data.len() - cut <= seq || cut <= seq {
        return Err(FrontendError::InvalidArgument {
            op: "train gpt",
            reason: format!(
                "evaluation holds out the text's last tenth, {} of its {} characters: each part needs more than \
                 --seq {seq} (give a longer text or drop --eval-every and --keep-best)",
                data.len() - cut,
                data.len()
            ),
        });
    }
    Ok(data.split_off(cut))
}

/// Random windows of `data` (see [`GptTrainer::next_batch`]).
fn sample_batch(data: &[i32], sampler: &mut HostRng, cfg: &GptConfig) -> Result<(Tensor, Tensor)> {
    let (b, t) = (cfg.batch, cfg.seq);
    // `GptConfig::check` bounds `b·t`; a config that skipped it still gets
    // an error, not an overflow.
    let Some(tokens) = b.checked_mul(t) else {
        let (limit, limit_source) = kiln_frontend::limits::host_limit_bytes()?;
        return Err(FrontendError::TooLarge {
            what: format!("a batch of {b} windows of {t} tokens"),
            bytes: None,
            limit,
            limit_source,
        });
    };
    // Every process draws every global replica's windows from the same
    // sampler and keeps its own, so the run sees what one process would.
    let global = kiln_frontend::replicas::global_replicas()?;
    let local = kiln_frontend::replicas::local_replica_indices()?;
    let (mut xs, mut ys) = (Vec::with_capacity(local.len()), Vec::with_capacity(local.len()));
    for g in 0..global {
        let (mut x, mut y) = (Vec::with_capacity(tokens), Vec::with_capacity(tokens));
        for _ in 0..b {
            let start = (sampler.next_u64() % (data.len() - t) as u64) as usize;
            x.extend_from_slice(&data[start..start + t]);
            y.extend_from_slice(&data[start + 1..start + t + 1]);
        }
        if local.contains(&g) {
            xs.push(x);
            ys.push(y);
        }
    }
    let (x, y) = (
        kiln_frontend::replicas::from_shards(xs, [b, t])?.with_name("tokens"),
        kiln_frontend::replicas::from_shards(ys, [tokens])?.with_name("targets"),
    );
    // Under a mesh the batch splits over its `data` axis.
    kiln_frontend::shard::shard_batch(&x)?;
    kiln_frontend::shard::shard_batch(&y)?;
    Ok((x, y))
}

/// The largest text [`read_text`] reads (256 MiB): far above any corpus a
/// character-level model on one host trains on, and it stops a mistaken
/// multi-gigabyte file from exhausting memory.
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// Reads a text file for training, with errors naming the path: a regular
/// file ([`kiln_frontend::input::open`]; a FIFO, device or directory is
/// refused before it is opened) of at most [`MAX_TEXT_BYTES`].
pub fn read_text(path: &Path, seq: usize) -> Result<String> {
    use std::io::Read as _;
    let io = |source| FrontendError::Io { path: path.into(), source };
    let file = kiln_frontend::input::open(path)?;
    let mut bytes = Vec::new();
    // One byte past the limit tells a file at the limit from a larger one.
    file.take(MAX_TEXT_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > MAX_TEXT_BYTES {
        return Err(FrontendError::Data {
            path: path.into(),
            reason: format!("longer than the {MAX_TEXT_BYTES}-byte limit of --text"),
        });
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| FrontendError::Data { path: path.into(), reason: format!("not UTF-8 text: {e}") })?;
    if text.chars().count() <= seq {
        return Err(FrontendError::Data {
            path: path.into(),
            reason: format!("{} characters, need more than the sequence length {seq}", text.chars().count()),
        });
    }
    Ok(text)
}

/// Trains `cfg` on `text`'s characters, calling `on_step` after every step
/// ([`train_with`] without an evaluation callback).
pub fn train(text: &str, cfg: &GptConfig, on_step: impl FnMut(&StepInfo)) -> Result<TrainReport> {
    train_with(text, cfg, on_step, |_| {})
}

/// Trains `cfg` on `text`'s characters through the general trainer
/// ([`crate::trainer::Trainer`]), calling `on_step` after every step and
/// `on_eval` with every evaluation (`cfg.run.eval_every`: the mean loss on
/// [`EVAL_BATCHES`] fixed batches of windows of the text's last tenth, held
/// out of training).
pub fn train_with(
    text: &str,
    cfg: &GptConfig,
    mut on_step: impl FnMut(&StepInfo),
    mut on_eval: impl FnMut(&crate::trainer::EvalResult),
) -> Result<TrainReport> {
    let before = metrics::snapshot();
    let vocab = CharVocab::new(text);
    // `cfg.vocab` pads the embedding past the text's characters (0: no
    // padding); below them it cannot be what the run uses.
    if cfg.vocab != 0 && cfg.vocab < vocab.len() {
        return Err(FrontendError::InvalidArgument {
            op: "train gpt",
            reason: format!(
                "a vocabulary of {} is smaller than the text's {} distinct characters (it pads, never cuts)",
                cfg.vocab,
                vocab.len()
            ),
        });
    }
    let cfg = GptConfig { vocab: vocab.len().max(cfg.vocab), ..cfg.clone() };
    cfg.check(kiln_frontend::replicas::global_replicas()?)?;
    let client = crate::training::open_client()?;
    let client_seconds = client.seconds;
    let setup = Instant::now();
    let counters = metrics::snapshot();
    let (t, mut breakdown) = GptTrainer::build(vocab.encode(text), &cfg)?;
    // The set-up ends when the parameters exist: the init program (device
    // placement) has finished, not only been enqueued.
    let waited = Instant::now();
    kiln_frontend::sync()?;
    breakdown.wait_ms = waited.elapsed().as_secs_f64() * 1e3;
    let setup_seconds = setup.elapsed().as_secs_f64();
    breakdown.finish(&counters, setup_seconds * 1e3);
    breakdown.memory_pool_ms = client.pool_ms();
    let GptTrainer { params, model, opt, mut data, .. } = t;
    // The held-out tail, when the run evaluates.
    let evaluates = cfg.run.eval_every.is_some() || cfg.run.keep_best.is_some();
    let held = if evaluates { held_out(&mut data, cfg.seq)? } else { Vec::new() };
    let mut fit = crate::trainer::FitConfig::new(cfg.steps, cfg.lr);
    fit.amp = cfg.amp;
    fit.max_grad_norm = cfg.max_grad_norm;
    fit.allow_non_finite_loss = cfg.allow_non_finite_loss;
    fit.eval_every = cfg.run.eval_every;
    fit.checkpoint = cfg.run.checkpoint.as_ref().map(|path| crate::trainer::Checkpointing {
        every: cfg.run.checkpoint_every,
        resume: cfg.run.resume,
        overwrite: cfg.run.overwrite,
        override_settings: cfg.run.override_settings.clone(),
        ..crate::trainer::Checkpointing::new(path)
    });
    fit.keep_best = cfg.run.keep_best.as_ref().map(|path| crate::trainer::KeepBest {
        path: path.clone(),
        metric: "loss".into(),
        higher_is_better: false,
    });
    fit.record = crate::trainer::RunRecord {
        settings: Some(cfg.run_settings()),
        examples_per_step: Some((cfg.batch * kiln_frontend::replicas::global_replicas()?) as u64),
        // What `generate::load_gpt_checkpoint` rebuilds the model and its characters from.
        tensors: vec![text_tensor(CHARS, &vocab.as_text())?, text_tensor(SHAPE, &cfg.shape_text())?],
    };
    let mut trainer = crate::trainer::Trainer::with_optimizer(&params, opt, fit)?;
    trainer.on_step(&mut on_step);
    trainer.on_eval(&mut on_eval);
    // Each step's windows from the seed and the step alone.
    let mut batches = |step: u64| -> Result<Vec<Tensor>> {
        let mut sampler = HostRng::new(crate::training::step_seed(cfg.seed ^ 0x5eed, step));
        let (x, y) = sample_batch(&data, &mut sampler, &cfg)?;
        Ok(vec![x, y])
    };
    // Fixed windows of the held-out text (dropout off).
    let eval_batches = (0..if evaluates { EVAL_BATCHES } else { 0 })
        .map(|i| {
            let mut sampler = HostRng::new(crate::training::step_seed(cfg.seed ^ 0xe7a1, i));
            sample_batch(&held, &mut sampler, &cfg).map(|(x, y)| vec![x, y])
        })
        .collect::<Result<Vec<_>>>()?;
    let metrics = |b: &Vec<Tensor>| -> Result<Vec<crate::trainer::Metric>> {
        Ok(vec![crate::trainer::Metric::mean("loss", model.loss(&b[0], &b[1], false)?)])
    };
    let eval = evaluates.then(|| crate::trainer::Eval::new(eval_batches, &metrics));
    let fitted = trainer.fit(&mut batches, &|b: &Vec<Tensor>| model.loss(&b[0], &b[1], true), eval.as_ref())?;
    let mut report = TrainReport {
        setup_seconds,
        client_seconds,
        setup: Some(breakdown),
        init: Some(params.placement()),
        ..fitted.train
    };
    report.count_since(&before);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `parameter_count` is what `Gpt::new` makes, so the host check sizes
    /// the real model.
    #[test]
    fn parameter_count_is_the_models() {
        let cfg = GptConfig { vocab: 11, layers: 3, ..GptConfig::tiny(11) };
        let mut ps = ParamStore::new(0);
        Gpt::new(&mut ps, &cfg).unwrap();
        assert_eq!(cfg.parameter_count(), Some(ps.num_elements()));
    }

    #[test]
    fn check_refuses_sizes_beyond_memory_and_settings_that_cannot_train() {
        let ok = GptConfig::tiny(65);
        ok.check(1).unwrap();
        let too_large =
            |cfg: GptConfig, replicas: usize| matches!(cfg.check(replicas), Err(FrontendError::TooLarge { .. }));
        assert!(too_large(GptConfig { vocab: usize::MAX, ..ok.clone() }, 1));
        assert!(too_large(GptConfig { batch: usize::MAX, ..ok.clone() }, 1));
        assert!(too_large(GptConfig { batch: 1 << 40, ..ok.clone() }, 1));
        assert!(too_large(ok.clone(), usize::MAX));
        for (cfg, name) in [
            (GptConfig { steps: 0, ..ok.clone() }, "steps"),
            (GptConfig { batch: 0, ..ok.clone() }, "batch"),
            (GptConfig { lr: 1e308, ..ok.clone() }, "lr"),
            (GptConfig { lr: 1e-50, ..ok.clone() }, "lr"),
            (GptConfig { lr: f64::NAN, ..ok.clone() }, "lr"),
        ] {
            match cfg.check(1) {
                Err(FrontendError::HyperParameter { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}: {other:?}"),
            }
        }
    }
}
