//! Training the zoo's models on a user's text: what `kiln train gpt2|llama|
//! bert|roberta|distilbert|t5` runs. The decoders learn the next token of
//! the lines packed into fixed windows, each line a document of its own
//! (attention within it, positions from its start: [`crate::Packing`]); BERT and RoBERTa the masked tokens of single
//! lines; T5 the spans its sentinels replaced. A model starts from a named
//! size with the tokenizer's vocabulary, or from a Hugging Face directory
//! (`--init hf:DIR`), and can be written back as one (`hf::save`).
//!
//! Variable-length batches (BERT, RoBERTa, T5) are padded to buckets
//! ([`text::Buckets`]): a run compiles one training program per bucket (per
//! pair of buckets for T5) and one evaluation program per held-out bucket,
//! never one per length.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::Path;

use kiln_compiler::ir::DType;
use kiln_frontend::nn::ParamStore;
use kiln_frontend::optim::AdamWConfig;
use kiln_frontend::{metrics, FrontendError, Result, Tensor};

use crate::bert::{Bert, BertBatch, BertClassifier, BertConfig, BertFlavor};
use crate::gpt2::{Gpt2, Gpt2Config};
use crate::hf::{self, HfModel};
use crate::llama::{Llama, LlamaConfig};
use crate::mlp::{StepInfo, TrainReport};
use crate::t5::{T5Batch, T5Config, T5};
use crate::text::{self, Buckets, Corpus, Rng, TextTokenizer, TokenizerSpec};
use crate::trainer::{self, Checkpointing, FitConfig, Metric, RunRecord, Trainer};
use crate::Spelling;

/// The checkpoint tensor holding the run's tokenizer (`tokenizer.json` text).
pub const TOKENIZER: &str = "run.tokenizer";

/// Which model of the zoo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Gpt2,
    Llama,
    Bert,
    Roberta,
    DistilBert,
    T5,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Gpt2 => "gpt2",
            Arch::Llama => "llama",
            Arch::Bert => "bert",
            Arch::Roberta => "roberta",
            Arch::DistilBert => "distilbert",
            Arch::T5 => "t5",
        }
    }

    /// The sizes `--config` names for it.
    pub fn sizes(self) -> &'static [&'static str] {
        match self {
            Arch::Gpt2 => &["tiny", "gpt2"],
            Arch::Llama => &["tiny", "llama-110m"],
            Arch::Bert => &["tiny", "bert-base-uncased"],
            Arch::Roberta => &["tiny", "roberta-base"],
            Arch::DistilBert => &["tiny", "distilbert-base-uncased"],
            Arch::T5 => &["tiny", "t5-small", "t5-base"],
        }
    }

    /// What it learns from the text.
    pub fn task(self) -> &'static str {
        match self {
            Arch::Gpt2 | Arch::Llama => "causal LM",
            Arch::Bert | Arch::Roberta | Arch::DistilBert => "masked LM",
            Arch::T5 => "span corruption",
        }
    }
}

/// A zoo training run's settings.
#[derive(Clone, Debug)]
pub struct ZooConfig {
    pub arch: Arch,
    /// One of [`Arch::sizes`] (ignored with `init`).
    pub size: String,
    /// Tokens a sequence: the decoders' window, the encoders' longest line.
    pub seq: usize,
    pub batch: usize,
    pub steps: u64,
    pub lr: f64,
    pub seed: u64,
    pub amp: Option<DType>,
    pub max_grad_norm: Option<f64>,
    /// Evaluate on the held-out lines every N steps (and always at the end).
    pub eval_every: Option<u64>,
    /// Batches an evaluation reads (the same ones every time).
    pub eval_batches: usize,
    pub allow_non_finite_loss: bool,
    pub spelling: Spelling,
    /// Learn from `--data`'s tab-separated lines instead of the
    /// architecture's language-model task: `label<TAB>text` classification
    /// (BERT, RoBERTa) or `source<TAB>target` sequence to sequence (T5).
    pub labelled: bool,
    /// Save the whole training state here every `checkpoint_every` steps and
    /// at the end (kiln's checkpoint format, with the run's settings).
    pub checkpoint: Option<std::path::PathBuf>,
    pub checkpoint_every: Option<u64>,
    /// Continue from `checkpoint`: the batches depend only on the seed and
    /// the step, so the resumed run takes the steps the saved one would have.
    pub resume: bool,
    /// Replace a file at `checkpoint` instead of refusing it.
    pub overwrite: bool,
    /// Keep the state of the evaluation with the lowest held-out loss here
    /// (with the run's settings and tokenizer).
    pub keep_best: Option<std::path::PathBuf>,
    /// Settings a resumed run may change from the checkpoint's.
    pub override_settings: Vec<String>,
}

impl ZooConfig {
    /// What a resumed run must share with the run that saved its checkpoint.
    fn settings(&self) -> kiln_frontend::checkpoint::Settings {
        let amp = self.amp.map_or_else(|| "off".to_string(), |d| d.to_string());
        [
            ("model", self.arch.name().to_string()),
            ("task", self.task().to_string()),
            ("seed", self.seed.to_string()),
            ("lr", self.lr.to_string()),
            ("steps", self.steps.to_string()),
            ("batch", self.batch.to_string()),
            ("seq", self.seq.to_string()),
            ("amp", amp),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Sequence classification (`--data` for BERT, RoBERTa or DistilBERT).
    pub fn classify(&self) -> bool {
        self.labelled && matches!(self.arch, Arch::Bert | Arch::Roberta | Arch::DistilBert)
    }

    /// Source-to-target pairs (`--data` for T5).
    pub fn seq2seq(&self) -> bool {
        self.labelled && self.arch == Arch::T5
    }

    /// What the run learns.
    pub fn task(&self) -> &'static str {
        if self.classify() {
            "sequence classification"
        } else if self.seq2seq() {
            "sequence to sequence"
        } else {
            self.arch.task()
        }
    }

    pub fn new(arch: Arch) -> ZooConfig {
        ZooConfig {
            arch,
            size: "tiny".into(),
            seq: 32,
            batch: 8,
            steps: 100,
            lr: 3e-3,
            seed: 0,
            amp: None,
            max_grad_norm: Some(1.0),
            eval_every: None,
            eval_batches: 4,
            allow_non_finite_loss: false,
            spelling: Spelling::Builtin,
            labelled: false,
            checkpoint: None,
            checkpoint_every: None,
            resume: false,
            overwrite: false,
            keep_best: None,
            override_settings: Vec::new(),
        }
    }

    fn check(&self) -> Result<()> {
        let bad =
            |name, value: f64, expected| Err(FrontendError::HyperParameter { op: "train", name, value, expected });
        if self.seq < 4 {
            return bad("seq", self.seq as f64, "at least 4");
        }
        if self.batch == 0 {
            return bad("batch", 0.0, "at least 1");
        }
        if self.steps == 0 {
            return bad("steps", 0.0, "at least 1");
        }
        if self.labelled && !matches!(self.arch, Arch::Bert | Arch::Roberta | Arch::DistilBert | Arch::T5) {
            let reason = format!(
                "--data (classification for bert, roberta and distilbert, source/target pairs for t5) is not for {}",
                self.arch.name()
            );
            return Err(FrontendError::InvalidArgument { op: "train", reason });
        }
        if self.checkpoint.is_none() && (self.resume || self.checkpoint_every.is_some()) {
            let reason = "--resume and --checkpoint-every need --checkpoint FILE".to_string();
            return Err(FrontendError::InvalidArgument { op: "train", reason });
        }
        if self.checkpoint_every == Some(0) {
            return bad("checkpoint_every", 0.0, "at least 1");
        }
        if self.eval_batches == 0 {
            return bad("eval_batches", 0.0, "at least 1");
        }
        if !(self.lr > 0.0 && kiln_frontend::optim::f32_rate(self.lr).is_some()) {
            return bad("lr", self.lr, "a finite number above 0 that f32 can hold");
        }
        Ok(())
    }
}

/// One evaluation on the held-out lines.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Eval {
    pub step: u64,
    pub loss: f64,
    /// The fraction of predicted tokens (next tokens, masked tokens, span
    /// tokens) the model's argmax gets right.
    pub accuracy: f64,
}

/// What a zoo run did.
#[derive(Debug, Default)]
pub struct ZooReport {
    pub train: TrainReport,
    pub evals: Vec<Eval>,
    /// The padded lengths the training batches used (input, target; the
    /// target is 0 but for T5).
    pub buckets: BTreeSet<(usize, usize)>,
    /// The padded lengths the evaluation batches used.
    pub eval_buckets: BTreeSet<(usize, usize)>,
    /// The lengths batches may take.
    pub bucket_lengths: Vec<usize>,
    pub vocab: usize,
    pub tokenizer_vocab: usize,
    pub train_tokens: usize,
    /// Training tokens the tokenizer could not map (its unknown token).
    pub unknown_tokens: usize,
    pub parameters: usize,
    /// Parameters split over the mesh (`--shard fsdp|tp=N`; 0 without one).
    pub sharded_parameters: usize,
    /// The classes of a classification run, by id.
    pub classes: Vec<String>,
    /// How `--init` was used when it was not a whole model of the task (a
    /// masked-LM encoder under a new classification head).
    pub init_note: Option<String>,
}

/// The trained model with its parameters and tokenizer.
pub struct Trained {
    pub model: HfModel,
    pub params: ParamStore,
    pub tokenizer: TextTokenizer,
}

/// Where the weights start.
#[derive(Clone, Debug)]
pub enum Init {
    /// `cfg.size`'s architecture, initialised from the seed.
    Fresh,
    /// A Hugging Face directory of the same architecture.
    Hf(std::path::PathBuf),
}

/// The model of `cfg` for a tokenizer of `tok_vocab` tokens (its padding id
/// `pad`): its vocabulary and positions sized to fit.
fn fresh(cfg: &ZooConfig, tok_vocab: usize, pad: u32, classes: &[String]) -> Result<(ParamStore, HfModel)> {
    let mut ps = ParamStore::new(cfg.seed);
    let size = cfg.size.as_str();
    if !cfg.arch.sizes().contains(&size) {
        let reason = format!("--config {size}: {} has {}", cfg.arch.name(), cfg.arch.sizes().join(", "));
        return Err(FrontendError::InvalidArgument { op: "train", reason });
    }
    let (seq, sp) = (cfg.seq, cfg.spelling);
    let model = match cfg.arch {
        Arch::Gpt2 => {
            let base = if size == "tiny" { Gpt2Config::tiny() } else { Gpt2Config::gpt2() };
            let c = Gpt2Config { vocab: tok_vocab, max_positions: base.max_positions.max(seq), ..base };
            HfModel::Gpt2(Gpt2::new(&mut ps, c, sp)?)
        }
        Arch::Llama => {
            let base = if size == "tiny" { LlamaConfig::tiny() } else { LlamaConfig::llama_110m() };
            HfModel::Llama(Llama::new(&mut ps, LlamaConfig { vocab: tok_vocab, ..base }, sp)?)
        }
        Arch::Bert | Arch::Roberta | Arch::DistilBert => {
            let base = match (cfg.arch, size) {
                (_, "tiny") => BertConfig::tiny(),
                (Arch::Bert, _) => BertConfig::bert_base_uncased(),
                (Arch::DistilBert, _) => BertConfig::distilbert_base_uncased(),
                _ => BertConfig::roberta_base(),
            };
            let (flavor, positions, type_vocab) = match cfg.arch {
                Arch::Bert => (BertFlavor::Bert, seq, base.type_vocab),
                Arch::DistilBert => (BertFlavor::DistilBert, seq, 0),
                _ => (BertFlavor::Roberta { pad: pad as usize }, seq + pad as usize + 1, 1),
            };
            let c = BertConfig {
                vocab: tok_vocab,
                max_positions: base.max_positions.max(positions),
                type_vocab,
                flavor,
                pooler: false,
                mlm_head: true,
                ..base
            };
            if cfg.classify() {
                HfModel::BertClassifier(BertClassifier::new(&mut ps, c, classes.to_vec(), sp)?)
            } else {
                HfModel::Bert(Bert::new(&mut ps, c, sp)?)
            }
        }
        Arch::T5 => {
            let base = match size {
                "tiny" => T5Config::tiny(),
                "t5-small" => T5Config::t5_small(),
                _ => T5Config::t5_base(),
            };
            HfModel::T5(T5::new(&mut ps, T5Config { vocab: tok_vocab + text::SENTINELS, ..base }, sp)?)
        }
    };
    Ok((ps, model))
}

/// The model's vocabulary and the longest sequence its positions allow.
fn limits(model: &HfModel) -> (usize, Option<usize>) {
    match model {
        HfModel::Gpt2(m) => (m.cfg.vocab, Some(m.cfg.max_positions)),
        HfModel::Llama(m) => (m.cfg.vocab, None),
        HfModel::Bert(m) | HfModel::BertClassifier(BertClassifier { bert: m, .. }) => {
            let offset = match m.cfg.flavor {
                BertFlavor::Bert | BertFlavor::DistilBert => 0,
                BertFlavor::Roberta { pad } => pad + 1,
            };
            (m.cfg.vocab, Some(m.cfg.max_positions.saturating_sub(offset)))
        }
        HfModel::T5(m) => (m.cfg.vocab, None),
    }
}

/// A directory's model, checked against the run: the architecture, the
/// tokenizer's vocabulary and padding id, the sequence length.
fn from_hf(
    dir: &Path,
    cfg: &ZooConfig,
    tok: &TextTokenizer,
    classes: &[String],
    note: &mut Option<String>,
) -> Result<(ParamStore, HfModel)> {
    let (ps, model) = hf::load(dir, cfg.spelling)?;
    let (ps, model) = match model {
        // A masked-LM encoder to fine-tune for classification: its weights
        // under a new head, as `from_pretrained` of a classifier does.
        HfModel::Bert(m) if cfg.classify() => {
            let mut fresh_ps = ParamStore::new(cfg.seed);
            let c = BertClassifier::new(&mut fresh_ps, m.cfg, classes.to_vec(), cfg.spelling)?;
            let (mut copied, mut new) = (0, Vec::new());
            for (name, t) in fresh_ps.iter() {
                match ps.get(name).filter(|src| src.ty() == t.ty()) {
                    Some(src) => {
                        t.assign(src)?;
                        copied += 1;
                    }
                    None => new.push(name.to_string()),
                }
            }
            kiln_frontend::mark_step()?;
            *note = Some(format!("{copied} tensors from {}, {} new ({})", dir.display(), new.len(), new.join(", ")));
            (fresh_ps, HfModel::BertClassifier(c))
        }
        HfModel::BertClassifier(_) if !cfg.classify() => {
            let reason = "a sequence classifier: give its labelled data with --data".to_string();
            return Err(FrontendError::Checkpoint { path: dir.to_path_buf(), reason });
        }
        m => (ps, m),
    };
    let wrong = |reason: String| FrontendError::Checkpoint { path: dir.to_path_buf(), reason };
    if model.model_type() != cfg.arch.name() {
        return Err(wrong(format!("a {} model, not {}", model.model_type(), cfg.arch.name())));
    }
    let (vocab, positions) = limits(&model);
    let needed = tok.vocab_size() + if cfg.arch == Arch::T5 { text::SENTINELS } else { 0 };
    if needed > vocab {
        let sentinels =
            if cfg.arch == Arch::T5 { format!(" and {} sentinels", text::SENTINELS) } else { String::new() };
        return Err(wrong(format!(
            "the model's vocabulary of {vocab} is smaller than the tokenizer's {} tokens{sentinels} ({})",
            tok.vocab_size(),
            tok.source
        )));
    }
    if let HfModel::Bert(m) | HfModel::BertClassifier(BertClassifier { bert: m, .. }) = &model {
        if let BertFlavor::Roberta { pad } = m.cfg.flavor {
            if pad != tok.specials.pad as usize {
                let reason = format!("pad_token_id {pad}, the tokenizer's padding id is {}", tok.specials.pad);
                return Err(wrong(reason));
            }
        }
    }
    if let Some(p) = positions.filter(|&p| p < cfg.seq) {
        return Err(wrong(format!("{p} positions, fewer than --seq {}", cfg.seq)));
    }
    Ok((ps, model))
}

/// A batch shape's name in compile messages: `len 16`, `len 32/16` (T5's
/// input and target).
fn bucket_name((a, b): (usize, usize)) -> String {
    if b == 0 {
        format!("len {a}")
    } else {
        format!("len {a}/{b}")
    }
}

enum Batch {
    Causal(text::CausalBatch),
    Mlm(text::MlmBatch),
    Span(text::SpanBatch),
    Class(text::ClassBatch),
}

impl Batch {
    fn lens(&self) -> (usize, usize) {
        match self {
            Batch::Causal(b) => (b.ids.dims()[1], 0),
            Batch::Mlm(b) => (b.len, 0),
            Batch::Class(b) => (b.len, 0),
            Batch::Span(b) => b.lens,
        }
    }
}

impl trainer::Batch for Batch {
    fn tensors(&self) -> Vec<Tensor> {
        match self {
            Batch::Causal(b) => {
                vec![b.ids.clone(), b.targets.clone(), b.packing.segments.clone(), b.packing.positions.clone()]
            }
            Batch::Mlm(b) => vec![b.ids.clone(), b.types.clone(), b.mask.clone(), b.labels.clone(), b.weights.clone()],
            Batch::Span(b) => vec![b.input_ids.clone(), b.input_mask.clone(), b.labels.clone(), b.label_mask.clone()],
            Batch::Class(b) => vec![b.ids.clone(), b.types.clone(), b.mask.clone(), b.labels.clone()],
        }
    }

    fn with_tensors(&self, t: &[Tensor]) -> Result<Self> {
        let want = trainer::Batch::tensors(self).len();
        if t.len() != want {
            let reason = format!("a batch of {want} tensors rebuilt from {}", t.len());
            return Err(FrontendError::InvalidArgument { op: "train", reason });
        }
        let t = |i: usize| t[i].clone();
        Ok(match self {
            Batch::Causal(_) => Batch::Causal(text::CausalBatch {
                ids: t(0),
                targets: t(1),
                packing: crate::Packing { segments: t(2), positions: t(3) },
            }),
            Batch::Mlm(b) => Batch::Mlm(text::MlmBatch {
                ids: t(0),
                types: t(1),
                mask: t(2),
                labels: t(3),
                weights: t(4),
                len: b.len,
            }),
            Batch::Span(b) => Batch::Span(text::SpanBatch {
                input_ids: t(0),
                input_mask: t(1),
                labels: t(2),
                label_mask: t(3),
                lens: b.lens,
            }),
            Batch::Class(b) => {
                Batch::Class(text::ClassBatch { ids: t(0), types: t(1), mask: t(2), labels: t(3), len: b.len })
            }
        })
    }

    fn bucket(&self) -> Option<String> {
        Some(bucket_name(self.lens()))
    }
}

/// Makes the batches of the run's task.
struct Batcher {
    arch: Arch,
    classify: bool,
    seq2seq: bool,
    batch: usize,
    seq: usize,
    buckets: Buckets,
    specials: text::Specials,
    vocab: usize,
    path: std::path::PathBuf,
}

impl Batcher {
    fn next(&self, corpus: &Corpus, rng: &mut Rng) -> Result<Batch> {
        let sp = &self.specials;
        let eos = sp.sep.unwrap_or(sp.pad);
        if self.classify {
            return Ok(Batch::Class(corpus.classify(self.batch, &self.buckets, sp, rng)?));
        }
        if self.seq2seq {
            let eos = sp.sep.unwrap_or(sp.pad);
            return Ok(Batch::Span(corpus.pairs(self.batch, &self.buckets, eos, sp.pad, rng)?));
        }
        Ok(match self.arch {
            Arch::Gpt2 | Arch::Llama => Batch::Causal(corpus.causal(self.batch, self.seq, eos, rng, &self.path)?),
            Arch::Bert | Arch::Roberta | Arch::DistilBert => {
                Batch::Mlm(corpus.mlm(self.batch, &self.buckets, sp, self.vocab, rng)?)
            }
            Arch::T5 => Batch::Span(corpus.spans(self.batch, &self.buckets, eos, sp.pad, self.vocab, rng)?),
        })
    }
}

fn mismatch(model: &HfModel, batch: &Batch) -> FrontendError {
    let reason = format!("a {} model cannot take a batch of lengths {:?}", model.model_type(), batch.lens());
    FrontendError::InvalidArgument { op: "train", reason }
}

/// The batch's mean loss.
fn loss(model: &HfModel, batch: &Batch) -> Result<Tensor> {
    match (model, batch) {
        (HfModel::Gpt2(m), Batch::Causal(b)) => m.loss_packed(&b.ids, &b.targets, Some(&b.packing)),
        (HfModel::Llama(m), Batch::Causal(b)) => m.loss_packed(&b.ids, &b.targets, Some(&b.packing)),
        (HfModel::Bert(m), Batch::Mlm(b)) => {
            let batch = BertBatch { ids: b.ids.clone(), types: b.types.clone(), mask: b.mask.clone() };
            m.mlm_loss(&batch, &b.labels, &b.weights)
        }
        (HfModel::BertClassifier(m), Batch::Class(b)) => {
            let batch = BertBatch { ids: b.ids.clone(), types: b.types.clone(), mask: b.mask.clone() };
            m.loss(&batch, &b.labels)
        }
        (HfModel::T5(m), Batch::Span(b)) => m.loss(&T5Batch {
            input_ids: b.input_ids.clone(),
            input_mask: b.input_mask.clone(),
            labels: b.labels.clone(),
            label_mask: b.label_mask.clone(),
        }),
        _ => Err(mismatch(model, batch)),
    }
}

/// The batch's (loss, correct predictions, predictions) as f32 scalars.
fn evaluate(model: &HfModel, batch: &Batch) -> Result<[Tensor; 3]> {
    let l = loss(model, batch)?;
    let (logits, labels, weights) = match (model, batch) {
        (HfModel::Gpt2(m), Batch::Causal(b)) => (m.logits_packed(&b.ids, Some(&b.packing))?, b.targets.clone(), None),
        (HfModel::Llama(m), Batch::Causal(b)) => (m.logits_packed(&b.ids, Some(&b.packing))?, b.targets.clone(), None),
        (HfModel::Bert(m), Batch::Mlm(b)) => {
            let batch = BertBatch { ids: b.ids.clone(), types: b.types.clone(), mask: b.mask.clone() };
            (m.mlm_logits(&batch)?, b.labels.clone(), Some(b.weights.clone()))
        }
        (HfModel::BertClassifier(m), Batch::Class(b)) => {
            let batch = BertBatch { ids: b.ids.clone(), types: b.types.clone(), mask: b.mask.clone() };
            (m.logits(&batch)?, b.labels.clone(), None)
        }
        (HfModel::T5(m), Batch::Span(b)) => {
            let (n, t) = (b.labels.dims()[0], b.labels.dims()[1]);
            let start = Tensor::zeros(b.labels.dtype(), [n, 1])?;
            let dec = Tensor::cat(&[start, b.labels.narrow(1, 0, t - 1)?], 1)?;
            let w = b.label_mask.reshape([n * t])?.to_dtype(DType::F32)?;
            (m.logits(&b.input_ids, &b.input_mask, &dec)?, b.labels.reshape([n * t])?, Some(w))
        }
        _ => return Err(mismatch(model, batch)),
    };
    let v = *logits.dims().last().unwrap_or(&1);
    let n = logits.dims().iter().product::<usize>() / v.max(1);
    let predicted = logits.reshape([n, v])?.argmax(-1)?.to_dtype(DType::I32)?;
    let right = predicted.eq(&labels.to_dtype(DType::I32)?)?.to_dtype(DType::F32)?;
    let weights = match weights {
        Some(w) => w,
        None => Tensor::ones(DType::F32, [n])?,
    };
    Ok([l.to_dtype(DType::F32)?, right.mul(&weights)?.sum_all()?, weights.sum_all()?])
}

/// Trains `cfg` on the text at `path` with the tokenizer `spec`, from
/// `init`; `on_step` sees every step, `on_eval` every evaluation.
pub fn train(
    cfg: &ZooConfig,
    path: &Path,
    spec: &TokenizerSpec,
    init: &Init,
    mut on_step: impl FnMut(&StepInfo),
    mut on_eval: impl FnMut(&Eval),
) -> Result<(ZooReport, Trained)> {
    cfg.check()?;
    let before = metrics::snapshot();
    let lines = text::read_lines(path)?;
    // Classification: the lines' format and classes checked first, the
    // tokenizer trained on their text alone.
    let (data_classes, texts) = if cfg.classify() {
        let (classes, _, texts) = text::labelled(lines.clone(), None, path)?;
        (classes, texts)
    } else {
        (Vec::new(), lines.clone())
    };
    // A resumed run reads its tokenizer from the checkpoint: a trained one
    // can differ between trainings (WordPiece breaks ties in hash order).
    let resumed = match (&cfg.checkpoint, cfg.resume) {
        (Some(path), true) => Some((path, kiln_frontend::checkpoint::load(path)?)),
        _ => None,
    };
    let saved_tokenizer = match &resumed {
        Some((path, loaded)) => match loaded.tensors.iter().find(|(n, _)| n == TOKENIZER) {
            Some((_, lit)) => {
                let json = std::str::from_utf8(lit.bytes()).map_err(|_| FrontendError::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!("tensor {TOKENIZER} is not UTF-8 text"),
                })?;
                Some(TextTokenizer::from_json(json, format!("the tokenizer saved in {}", path.display()))?)
            }
            None => None,
        },
        None => None,
    };
    let tokenizer = match (saved_tokenizer, spec) {
        (Some(saved), TokenizerSpec::File(p)) => {
            let given = TextTokenizer::load(p)?;
            if given.to_json()? != saved.to_json()? {
                let reason = format!("--tokenizer {} is not the tokenizer the checkpoint's run used", p.display());
                return Err(FrontendError::InvalidArgument { op: "train", reason });
            }
            saved
        }
        (Some(saved), TokenizerSpec::Train { .. }) => saved,
        (None, TokenizerSpec::File(p)) => TextTokenizer::load(p)?,
        (None, TokenizerSpec::Train { kind, vocab }) => {
            let texts: Vec<String> = texts.iter().map(|(_, l)| l.clone()).collect();
            TextTokenizer::train(*kind, *vocab, &texts)?
        }
    };
    if matches!(cfg.arch, Arch::Bert | Arch::Roberta | Arch::DistilBert)
        && !cfg.classify()
        && tokenizer.specials.mask.is_none()
    {
        let reason =
            format!("{} has no mask token ([MASK] or <mask>), which masked-LM training needs", tokenizer.source);
        return Err(FrontendError::InvalidArgument { op: "train", reason });
    }
    let mut init_note = None;
    let (params, model) = match init {
        Init::Fresh => fresh(cfg, tokenizer.vocab_size(), tokenizer.specials.pad, &data_classes)?,
        Init::Hf(dir) => from_hf(dir, cfg, &tokenizer, &data_classes, &mut init_note)?,
    };
    let (vocab, _) = limits(&model);
    // A classifier's own classes (a loaded one keeps its id2label order).
    let classes = match &model {
        HfModel::BertClassifier(m) => m.labels.clone(),
        _ => Vec::new(),
    };
    let (train_lines, held_lines) = text::split(lines);
    let corpus_of = |lines: text::Lines| -> Result<Corpus> {
        if cfg.seq2seq() {
            let pairs = text::pairs(lines, path)?;
            let sources: text::Lines = pairs.iter().map(|(n, a, _)| (*n, a.clone())).collect();
            let targets: text::Lines = pairs.into_iter().map(|(n, _, b)| (n, b)).collect();
            let targets = Corpus::new(&tokenizer, &targets, vocab, path)?.lines;
            return Ok(Corpus { targets, ..Corpus::new(&tokenizer, &sources, vocab, path)? });
        }
        if !cfg.classify() {
            return Corpus::new(&tokenizer, &lines, vocab, path);
        }
        let (_, ids, texts) = text::labelled(lines, Some(&classes), path)?;
        Ok(Corpus { classes: ids, ..Corpus::new(&tokenizer, &texts, vocab, path)? })
    };
    let corpus = corpus_of(train_lines)?;
    let held = corpus_of(held_lines)?;
    let batcher = Batcher {
        classify: cfg.classify(),
        seq2seq: cfg.seq2seq(),
        arch: cfg.arch,
        batch: cfg.batch,
        seq: cfg.seq,
        buckets: Buckets::up_to(cfg.seq),
        specials: tokenizer.specials,
        // T5's sentinels sit at the top: random replacements and ids stay below them.
        vocab,
        path: path.to_path_buf(),
    };
    let mut report = ZooReport {
        vocab,
        tokenizer_vocab: tokenizer.vocab_size(),
        train_tokens: corpus.tokens(),
        unknown_tokens: tokenizer
            .specials
            .unk
            .map_or(0, |u| corpus.lines.iter().flatten().filter(|&&t| t == u).count()),
        parameters: params.num_elements(),
        bucket_lengths: batcher.buckets.0.clone(),
        classes: classes.clone(),
        init_note,
        ..ZooReport::default()
    };
    let json = tokenizer.to_json()?.into_bytes();
    let tokenizer_tensor = Tensor::from_vec(json.clone(), [json.len()])?;
    let mut fit = FitConfig::new(cfg.steps, cfg.lr);
    fit.amp = cfg.amp;
    fit.max_grad_norm = cfg.max_grad_norm;
    fit.allow_non_finite_loss = cfg.allow_non_finite_loss;
    fit.eval_every = cfg.eval_every;
    fit.checkpoint = cfg.checkpoint.as_ref().map(|path| Checkpointing {
        every: cfg.checkpoint_every,
        resume: cfg.resume,
        overwrite: cfg.overwrite,
        override_settings: cfg.override_settings.clone(),
        ..Checkpointing::new(path)
    });
    fit.record = RunRecord {
        settings: Some(cfg.settings()),
        examples_per_step: Some((cfg.batch * kiln_frontend::replicas::global_replicas()?) as u64),
        tensors: vec![(TOKENIZER.to_string(), tokenizer_tensor)],
    };
    fit.keep_best = cfg.keep_best.as_ref().map(|path| trainer::KeepBest {
        path: path.clone(),
        metric: "loss".into(),
        higher_is_better: false,
    });
    let evals = RefCell::new(Vec::new());
    let mut trainer = Trainer::new(&params, AdamWConfig { weight_decay: 0.01, ..Default::default() }, fit)?;
    trainer.on_step(&mut on_step);
    trainer.on_eval(|e| {
        let e = Eval {
            step: e.step,
            loss: e.get("loss").unwrap_or(f64::NAN),
            accuracy: e.get("accuracy").unwrap_or(f64::NAN),
        };
        on_eval(&e);
        evals.borrow_mut().push(e);
    });
    // The same held-out batches at every evaluation.
    let mut rng = Rng::new(cfg.seed ^ 0x5eed_e7a1);
    let held: Vec<Batch> = (0..cfg.eval_batches).map(|_| batcher.next(&held, &mut rng)).collect::<Result<_>>()?;
    report.eval_buckets = held.iter().map(Batch::lens).collect();
    let metrics = |b: &Batch| -> Result<Vec<Metric>> {
        let [l, right, total] = evaluate(&model, b)?;
        Ok(vec![Metric::mean("loss", l), Metric::ratio("accuracy", right, total)])
    };
    let mut buckets = BTreeSet::new();
    // The step's batch from the seed and the step alone (a resumed run
    // draws what the saved one would have).
    let mut data = |step: u64| -> Result<Batch> {
        let mut rng = Rng::new(crate::training::step_seed(cfg.seed, step));
        let batch = batcher.next(&corpus, &mut rng)?;
        buckets.insert(batch.lens());
        Ok(batch)
    };
    let fitted = trainer.fit(&mut data, &|b: &Batch| loss(&model, b), Some(&trainer::Eval::new(held, &metrics)))?;
    drop(trainer);
    report.buckets = buckets;
    report.evals = evals.into_inner();
    report.sharded_parameters = params.iter().filter(|(_, t)| t.sharding().is_some()).count();
    report.train = fitted.train;
    report.train.count_since(&before);
    Ok((report, Trained { model, params, tokenizer }))
}
