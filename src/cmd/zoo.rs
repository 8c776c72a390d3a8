//! `kiln train gpt2|llama|bert|roberta|t5`: the zoo's models on a text file
//! (`kiln::models::zoo`), from a named size or Hugging Face weights, written
//! back as a Hugging Face directory with its tokenizer.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use kiln::models::text::TokenizerSpec;
use kiln::models::zoo::{self, Arch, Init, ZooConfig};
use kiln::models::Spelling;
use serde_json::json;

use super::AmpDtype;

/// The spelling flag (`--spelling`).
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum SpellingArg {
    Plain,
    Builtin,
}

#[derive(clap::Args)]
pub struct ZooArgs {
    /// The text to learn from: one example a line (blank lines skipped; every
    /// tenth line is held out for evaluation).
    #[arg(long, required_unless_present = "data", conflicts_with = "data")]
    pub text: Option<PathBuf>,
    /// Tab-separated lines: `label<TAB>text` to learn to classify (bert,
    /// roberta: the model gets a sequence-classification head), or
    /// `source<TAB>target` pairs (t5: sequence to sequence); every tenth line
    /// is held out.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// A tokenizer.json, or `bpe:N`, `wordpiece:N`, `unigram:N` to train one
    /// of N tokens on the text (default: the architecture's family, 1000).
    #[arg(long, value_name = "FILE|KIND:N")]
    pub tokenizer: Option<TokenizerSpec>,
    /// The model's size: `tiny` or the Hugging Face name (gpt2,
    /// llama-110m, bert-base-uncased, roberta-base, t5-small, t5-base); its
    /// vocabulary is the tokenizer's.
    #[arg(long, default_value = "tiny")]
    pub config: String,
    /// Start from a Hugging Face directory (`hf:DIR`, as `save_pretrained`
    /// writes it) instead of --config.
    #[arg(long, value_name = "hf:DIR")]
    pub init: Option<String>,
    /// At the end, write the model as a Hugging Face directory (config.json,
    /// model.safetensors and the tokenizer.json), each file atomically.
    #[arg(long, value_name = "DIR")]
    pub save_hf: Option<PathBuf>,
    /// Tokens a sequence (the decoders' window, the encoders' longest line;
    /// shorter batches are padded to a bucket: 8, 16, 32, ... up to this).
    #[arg(long, default_value_t = 32)]
    pub seq: usize,
    /// Sequences a step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 100)]
    pub steps: u64,
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Mixed precision: matmuls in this dtype, f32 master weights.
    #[arg(long, ignore_case = true)]
    pub amp: Option<AmpDtype>,
    /// Clip the global gradient norm to this value.
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Evaluation, checkpoints, the best checkpoint.
    #[command(flatten)]
    pub run: super::RunArgs,
    /// Write attention, norms and the loss as plain ops (`plain`) or with
    /// kiln's built-in calls (`builtin`); the compiler makes them the same.
    #[arg(long, value_enum, default_value_t = SpellingArg::Builtin)]
    pub spelling: SpellingArg,
    /// Spread the step over the devices (KILN_CPU_DEVICES / GPU_NUM_DEVICES):
    /// `dp`, `fsdp`, `tp=N`, `fsdp,tp=N` as `kiln train gpt --shard`; --batch
    /// stays per data-parallel rank.
    #[arg(long, value_name = "SPEC")]
    pub shard: Option<String>,
    /// Rematerialize so each step's predicted peak fits SIZE or N%.
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// Keep training when a step's loss is NaN or infinite.
    #[arg(long)]
    pub allow_non_finite_loss: bool,
    /// Write one JSON object per step and per evaluation to FILE.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// End with one JSON object (for scripts).
    #[arg(long)]
    pub json: bool,
}

fn default_tokenizer(arch: Arch) -> TokenizerSpec {
    use kiln::models::text::TokenizerKind::{Bpe, Unigram, WordPiece};
    let kind = match arch {
        Arch::Bert | Arch::DistilBert => WordPiece,
        Arch::Gpt2 | Arch::Roberta => Bpe,
        Arch::Llama | Arch::T5 => Unigram,
    };
    TokenizerSpec::Train { kind, vocab: 1000 }
}

/// `--save-hf DIR` made and probed before training (the run would otherwise
/// train to the end and then fail to save).
fn prepare_save_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("--save-hf {}: creating it", dir.display()))?;
    kiln::atomic_write::check_writable(&dir.join("model.safetensors"))
        .with_context(|| format!("--save-hf {}", dir.display()))?;
    Ok(())
}

pub fn run(arch: Arch, args: ZooArgs, progress: indicatif::ProgressBar) -> anyhow::Result<()> {
    super::super::set_memory_limit(args.memory_limit.as_deref())?;
    let init = match args.init.as_deref() {
        None => Init::Fresh,
        Some(s) => match s.strip_prefix("hf:") {
            Some(dir) if !dir.is_empty() => Init::Hf(PathBuf::from(dir)),
            _ => anyhow::bail!("--init {s}: give hf:DIR, a Hugging Face directory"),
        },
    };
    if let Some(dir) = &args.save_hf {
        prepare_save_dir(dir)?;
    }
    // Under a mesh the batch is the global one: --batch per data rank.
    let ranks = match &args.shard {
        Some(spec) => super::super::set_shard(spec)?,
        None => 1,
    };
    let batch = args.batch.checked_mul(ranks).context("--batch times the data-parallel ranks overflows")?;
    let cfg = ZooConfig {
        size: args.config.clone(),
        seq: args.seq,
        batch,
        steps: args.steps,
        lr: args.lr,
        seed: args.seed,
        amp: args.amp.map(Into::into),
        max_grad_norm: Some(args.max_grad_norm),
        eval_every: args.run.eval_every,
        allow_non_finite_loss: args.allow_non_finite_loss,
        labelled: args.data.is_some(),
        checkpoint: args.run.checkpoint.clone(),
        checkpoint_every: args.run.checkpoint_every,
        resume: args.run.resume,
        overwrite: args.run.overwrite,
        keep_best: args.run.keep_best.clone(),
        override_settings: args.run.override_settings.clone(),
        spelling: match args.spelling {
            SpellingArg::Plain => Spelling::Plain,
            SpellingArg::Builtin => Spelling::Builtin,
        },
        ..ZooConfig::new(arch)
    };
    let spec = args.tokenizer.clone().unwrap_or_else(|| default_tokenizer(arch));
    let log = super::runlog::RunLog::create(args.log.as_deref(), "tokens", (cfg.batch * cfg.seq) as f64)?;
    // Both callbacks write it.
    let log = std::cell::RefCell::new(log);
    let mut evals_said = Vec::new();
    let Some(source) = args.text.as_ref().or(args.data.as_ref()) else {
        anyhow::bail!("give --text FILE (one example a line) or --data FILE (label<TAB>text lines)");
    };
    let (report, trained) = zoo::train(
        &cfg,
        source,
        &spec,
        &init,
        |s| {
            log.borrow_mut().step(s);
            progress.set_length(s.steps_total);
            progress.set_position(s.step);
            progress.set_message(format!("loss {:.4} step {:.1} ms", s.loss, s.step_ms));
        },
        |e| {
            log.borrow_mut().eval(e.step, "eval_loss", e.loss);
            log.borrow_mut().eval(e.step, "eval_accuracy", e.accuracy);
            let line = format!("eval at step {}: loss {:.4}, accuracy {:.3}", e.step, e.loss, e.accuracy);
            progress.println(&line);
            evals_said.push(line);
        },
    )?;
    progress.finish_and_clear();
    if let Some(dir) = &args.save_hf {
        kiln::models::hf::save(dir, &trained.model, &trained.params)
            .with_context(|| format!("--save-hf {}", dir.display()))?;
        trained.tokenizer.save(&dir.join("tokenizer.json")).with_context(|| format!("--save-hf {}", dir.display()))?;
    }
    // Text the tokenizer cannot map trains on its unknown token: say so
    // when it is more than a trace.
    if report.unknown_tokens * 100 > report.train_tokens {
        eprintln!(
            "kiln: {} of the {} training tokens ({:.1}%) are the tokenizer's unknown token: {} does not cover \
             this text (train one on it with --tokenizer wordpiece:N|bpe:N|unigram:N)",
            report.unknown_tokens,
            report.train_tokens,
            100.0 * report.unknown_tokens as f64 / report.train_tokens.max(1) as f64,
            trained.tokenizer.source
        );
    }
    let logged = log.into_inner().finish();
    let t = &report.train;
    let last = report.evals.last();
    if args.json {
        println!(
            "{}",
            json!({
                "model": arch.name(),
                "task": cfg.task(),
                "classes": report.classes,
                "init_note": report.init_note,
                "config": if matches!(init, Init::Fresh) { args.config.clone() } else { args.init.clone().unwrap_or_default() },
                "parameters": report.parameters,
                "sharded_parameters": report.sharded_parameters,
                "vocab": report.vocab,
                "tokenizer": trained.tokenizer.source,
                "tokenizer_vocab": report.tokenizer_vocab,
                "train_tokens": report.train_tokens,
                "unknown_tokens": report.unknown_tokens,
                "steps": t.steps,
                "first_loss": t.losses.first(),
                "final_loss": t.losses.last(),
                "losses": t.losses,
                "eval": report.evals.iter().map(|e| json!({"step": e.step, "loss": e.loss, "accuracy": e.accuracy})).collect::<Vec<_>>(),
                "bucket_lengths": report.bucket_lengths,
                "eval_buckets_used": report.eval_buckets.iter().map(|(a, b)| if *b == 0 { json!(a) } else { json!([a, b]) }).collect::<Vec<_>>(),
                "buckets_used": report.buckets.iter().map(|(a, b)| if *b == 0 { json!(a) } else { json!([a, b]) }).collect::<Vec<_>>(),
                "compiles": t.compiles,
                "cache_hits": t.cache_hits,
                "disk_hits": t.disk_hits,
                "compile_seconds": t.compile_seconds,
                "train_seconds": t.train_seconds,
                "skipped_steps": t.skipped_steps,
                "saved_hf": args.save_hf,
            })
        );
    } else {
        for line in &evals_said {
            println!("{line}");
        }
        let buckets: Vec<String> =
            report.buckets.iter().map(|(a, b)| if *b == 0 { a.to_string() } else { format!("{a}/{b}") }).collect();
        println!(
            "{}: {} steps ({}) in {:.1} s, loss {:.4} -> {:.4}; held-out loss {:.4}, accuracy {:.3}",
            arch.name(),
            t.steps,
            cfg.task(),
            t.train_seconds,
            t.losses.first().copied().unwrap_or(f64::NAN),
            t.losses.last().copied().unwrap_or(f64::NAN),
            last.map_or(f64::NAN, |e| e.loss),
            last.map_or(f64::NAN, |e| e.accuracy),
        );
        println!(
            "{} parameters, vocabulary {} ({}: {} tokens); {} programs ({} compiled, {} from the disk cache) \
             for {} training batch shape(s) ({}) and {} held-out",
            report.parameters,
            report.vocab,
            trained.tokenizer.source,
            report.tokenizer_vocab,
            t.compiles + t.disk_hits,
            t.compiles,
            t.disk_hits,
            report.buckets.len(),
            buckets.join(", "),
            report.eval_buckets.len(),
        );
        if let Some(note) = &report.init_note {
            println!("init: {note}");
        }
        if let Some(dir) = &args.save_hf {
            println!("saved {} (Hugging Face {} directory, with tokenizer.json)", dir.display(), arch.name());
        }
    }
    logged
}
