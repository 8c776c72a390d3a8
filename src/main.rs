//! The `kiln` command line: train the built-in models; the other commands live in `cmd/`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kiln::data::{FashionMnist, FASHION_MNIST_DIR};
use kiln::models::gpt;
use kiln::models::mlp::{self, MlpConfig};
use serde_json::json;

mod cmd;

use cmd::{AmpDtype, GptSize};
use kiln::models::zoo::Arch;

#[derive(Parser)]
#[command(name = "kiln", version, about = "kiln: a graph-compiling training accelerator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a built-in model.
    Train {
        #[command(subcommand)]
        model: Model,
    },
    /// Where a step's time goes: trace, compile, transfers, execute (per step,
    /// as a Chrome/Perfetto trace with --trace), and when compiling pays off.
    Profile(cmd::profile::ProfileArgs),
    /// The persistent compile cache (KILN_CACHE_DIR).
    Cache {
        #[command(subcommand)]
        command: cmd::cache::CacheCommand,
    },
    /// Compile a saved step graph (kiln's text form) and report its cost.
    Compile(cmd::compile::CompileArgs),
    /// Run a command as N processes of one run on this machine (each gets
    /// KILN_NUM_NODES, KILN_NODE_ID, KILN_COORDINATOR; with GPUs, its own).
    Launch(cmd::launch::LaunchArgs),
    /// Continue a prompt with a GPT-2 or Llama directory (hf:DIR) and its
    /// tokenizer, or a `kiln train gpt` checkpoint (--checkpoint FILE): a
    /// key/value cache, sampling in the graph.
    Generate(cmd::generate::GenerateArgs),
    /// Draw the curves of one or several runs' --log files as one SVG (loss,
    /// throughput, evaluations).
    Plot(cmd::plot::PlotArgs),
    /// List the PJRT devices of the selected plugin.
    Devices {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum Model {
    /// A ReLU MLP on Fashion-MNIST (784-256-128-10, AdamW).
    Mlp {
        #[arg(long, default_value_t = 8)]
        epochs: usize,
        /// Examples per step on each replica.
        #[arg(long, default_value_t = 128)]
        batch: usize,
        /// Hidden layer widths (benches/RESULTS.md's mlp-b4096 is 4096,4096).
        #[arg(long, value_delimiter = ',', default_value = "256,128")]
        hidden: Vec<usize>,
        #[arg(long, default_value_t = 2e-3)]
        lr: f64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Train for this many steps (at most --epochs' worth): the learning-rate schedule (warm-up,
        /// cosine decay) spans them, so a run with another --max-steps is another run, not a prefix.
        #[arg(long, value_name = "N")]
        max_steps: Option<u64>,
        /// Directory holding Fashion-MNIST's IDX files.
        #[arg(long, default_value = FASHION_MNIST_DIR)]
        data: PathBuf,
        /// Save a checkpoint here after each epoch and at the end of the run.
        /// A file already there (a previous run's checkpoint included) is
        /// refused unless --resume or --overwrite.
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// Also save the checkpoint every N steps.
        #[arg(long, value_name = "N", requires = "checkpoint")]
        checkpoint_every: Option<u64>,
        /// Continue from --checkpoint FILE, bit-identical to a run that was
        /// never interrupted (same flags otherwise).
        #[arg(long, requires = "checkpoint")]
        resume: bool,
        /// Replace whatever is at --checkpoint FILE (a previous run's checkpoint
        /// included) instead of refusing it.
        #[arg(long, requires = "checkpoint", conflicts_with = "resume")]
        overwrite: bool,
        /// With --resume: settings this run may change from the checkpoint's
        /// (comma-separated: seed, lr, weight_decay, steps, amp). Any other
        /// difference is refused, so a resumed run continues the saved one.
        #[arg(long, value_name = "NAMES", value_delimiter = ',', requires = "resume")]
        override_settings: Vec<String>,
        /// Instead of training, run the first N steps on the compiled and on
        /// the eager backend (candle, op by op) and print both loss curves
        /// side by side (with --json, one JSON object); nothing is saved.
        #[arg(
            long,
            value_name = "N",
            value_parser = clap::value_parser!(u64).range(1..),
            conflicts_with_all = ["checkpoint", "checkpoint_every", "resume", "overwrite", "max_steps"]
        )]
        compare_eager: Option<u64>,
        /// Mixed precision: matmuls in this dtype, f32 master weights.
        #[arg(long, ignore_case = true)]
        amp: Option<AmpDtype>,
        /// Rematerialize so each step's predicted peak fits SIZE (`2GiB`, `512MiB`, bytes),
        /// or `N%`: keep the arguments, outputs and N% of the step's activation
        /// (temporary) memory (docs/memory.md).
        #[arg(long, value_name = "SIZE")]
        memory_limit: Option<String>,
        /// Keep training when a step's loss is NaN or infinite (by default
        /// the run stops with an error naming the step; a loss scaler's
        /// skipped steps never stop it).
        #[arg(long)]
        allow_non_finite_loss: bool,
        /// Write one JSON object per step (loss, learning rate, step time,
        /// throughput, skipped steps) and per evaluation to FILE as the run
        /// goes (`kiln plot FILE` draws it).
        #[arg(long, value_name = "FILE")]
        log: Option<PathBuf>,
        /// End with one JSON object (for scripts).
        #[arg(long)]
        json: bool,
    },
    /// GPT-2 (Hugging Face's architecture) as a causal LM on a text file.
    Gpt2(cmd::zoo::ZooArgs),
    /// A Llama (RMSNorm, rotary, grouped-query attention, SwiGLU) as a causal LM.
    Llama(cmd::zoo::ZooArgs),
    /// BERT as a masked LM on a text file's lines.
    Bert(cmd::zoo::ZooArgs),
    /// RoBERTa as a masked LM on a text file's lines.
    Roberta(cmd::zoo::ZooArgs),
    /// DistilBERT as a masked LM on a text file's lines.
    Distilbert(cmd::zoo::ZooArgs),
    /// T5 with span corruption on a text file's lines.
    T5(cmd::zoo::ZooArgs),
    /// A character-level GPT on a text file.
    Gpt {
        /// The text to learn.
        #[arg(long)]
        text: PathBuf,
        #[arg(long, value_enum, default_value_t = GptSize::Tiny)]
        config: GptSize,
        /// Training steps (default: the config's).
        #[arg(long)]
        steps: Option<u64>,
        /// Pad the vocabulary (the text's characters) to this size, e.g. GPT-2's
        /// 50304 for its embedding and LM-head shapes (at least 1).
        #[arg(long)]
        vocab: Option<std::num::NonZeroUsize>,
        /// Sequences per step, per replica or data-parallel rank (default: the
        /// config's; `kiln profile gpt --max-batch` finds the largest that fits).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        batch: Option<u64>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Mixed precision: matmuls in this dtype, f32 master weights.
        #[arg(long, ignore_case = true)]
        amp: Option<AmpDtype>,
        /// Clip the global gradient norm to this value.
        #[arg(long)]
        max_grad_norm: Option<f64>,
        /// Rematerialize so each step's predicted peak fits SIZE (`2GiB`, `512MiB`, bytes),
        /// or `N%`: keep the arguments, outputs and N% of the step's activation
        /// (temporary) memory (docs/memory.md).
        #[arg(long, value_name = "SIZE")]
        memory_limit: Option<String>,
        /// Spread the step over the devices (KILN_CPU_DEVICES / GPU_NUM_DEVICES):
        /// `dp` (replicas, the default), `fsdp` (parameters and optimizer state
        /// split over a `data` axis), `tp=N` (Megatron tensor parallelism over
        /// N devices, the rest data parallel), `fsdp,tp=N`. The batch is per
        /// data-parallel rank, as with replicas.
        #[arg(long, value_name = "SPEC")]
        shard: Option<String>,
        /// Keep training when a step's loss is NaN or infinite (by default
        /// the run stops with an error naming the step; a loss scaler's
        /// skipped steps never stop it).
        #[arg(long)]
        allow_non_finite_loss: bool,
        /// Evaluation (on the text's last tenth, held out), checkpoints.
        #[command(flatten)]
        run: cmd::RunArgs,
        /// Write one JSON object per step (loss, learning rate, step time,
        /// throughput, skipped steps) and per evaluation to FILE as the run
        /// goes (`kiln plot FILE` draws it).
        #[arg(long, value_name = "FILE")]
        log: Option<PathBuf>,
        /// End with one JSON object (for scripts).
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("KILN_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a pipe or a log file gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    // A node of `kiln launch` dies with its launcher (before anything else:
    // reading data can take long).
    if let Err(e) = kiln::runtime::distributed::bind_to_launcher() {
        eprintln!("error: {e}");
        return ExitCode::from(u8::try_from(kiln::runtime::distributed::EXIT_PEER_LOST).unwrap_or(1));
    }
    if let Command::Launch(args) = &cli.command {
        return match cmd::launch::run(args) {
            Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let result = run(cli);
    // Every exit path waits for the steps still on the devices before the
    // plugin's exit handlers run (an error can leave one running: a bad value
    // read after the step was enqueued, a non-finite loss read while the next
    // step runs).
    kiln::quiesce();
    // A run of several processes marks this node done, so peers do not take
    // its exit for a failure (a no-op in a single process).
    if result.is_ok() {
        kiln_runtime::distributed::finish();
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            if let Some(hint) = hint(&e) {
                eprintln!("hint: {hint}");
            }
            ExitCode::FAILURE
        }
    }
}

/// What to do next, for errors whose message cannot say it: the plugin's
/// out-of-memory error names bytes and an allocator, not kiln's remedies.
fn hint(e: &anyhow::Error) -> Option<&'static str> {
    use kiln::runtime::{PjrtErrorCode, RuntimeError};
    let out_of_memory = e.chain().any(|cause| {
        let runtime =
            cause.downcast_ref::<RuntimeError>().or_else(|| match cause.downcast_ref::<kiln::FrontendError>() {
                Some(kiln::FrontendError::Runtime(r)) => Some(r),
                _ => None,
            });
        matches!(runtime, Some(RuntimeError::Pjrt { code: PjrtErrorCode::ResourceExhausted, .. }))
    });
    out_of_memory.then_some(
        "the step needs more device memory than the plugin may take: `kiln profile <model> --max-batch` finds the \
         largest batch that fits, and `--memory-limit` rematerializes the step to fit a budget (docs/memory.md)",
    )
}

/// The error and its causes joined by ": ", each cause said once: kiln's
/// errors put their cause in their own message (an I/O error's), so a cause
/// the message already contains is not repeated.
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        // `main` runs launches itself to keep the children's exit status.
        Command::Launch(args) => cmd::launch::run(&args).map(drop),
        Command::Compile(args) => cmd::compile::run(&args),
        Command::Plot(args) => cmd::plot::run(&args),
        Command::Generate(args) => cmd::generate::run(&args),
        Command::Devices { json } => cmd::devices::run(json),
        Command::Profile(args) => cmd::profile::run(args),
        Command::Cache { command } => cmd::cache::run(command),
        Command::Train {
            model:
                Model::Mlp {
                    epochs,
                    batch,
                    hidden,
                    lr,
                    seed,
                    max_steps,
                    data,
                    checkpoint,
                    checkpoint_every,
                    resume,
                    overwrite,
                    override_settings,
                    compare_eager,
                    amp,
                    memory_limit,
                    allow_non_finite_loss,
                    log,
                    json,
                },
        } => {
            check_lr(lr)?;
            set_memory_limit(memory_limit.as_deref())?;
            let cfg = MlpConfig {
                epochs,
                batch,
                hidden,
                lr,
                seed,
                max_steps,
                checkpoint,
                checkpoint_every,
                resume,
                overwrite,
                override_settings,
                amp: amp.map(Into::into),
                allow_non_finite_loss,
                ..MlpConfig::default()
            };
            // Before the data is read (`mlp::train` checks again with it).
            cfg.check_settings(mlp::PIXELS)?;
            train_mlp(&cfg, &data, compare_eager, log.as_deref(), json)
        }
        Command::Train { model: Model::Gpt2(args) } => {
            let bar = progress(args.json);
            cmd::zoo::run(Arch::Gpt2, args, bar)
        }
        Command::Train { model: Model::Llama(args) } => {
            let bar = progress(args.json);
            cmd::zoo::run(Arch::Llama, args, bar)
        }
        Command::Train { model: Model::Bert(args) } => {
            let bar = progress(args.json);
            cmd::zoo::run(Arch::Bert, args, bar)
        }
        Command::Train { model: Model::Roberta(args) } => {
            let bar = progress(args.json);
            cmd::zoo::run(Arch::Roberta, args, bar)
        }
        Command::Train { model: Model::Distilbert(args) } => {
            let bar = progress(args.json);
            cmd::zoo::run(Arch::DistilBert, args, bar)
        }
        Command::Train { model: Model::T5(args) } => {
            let bar = progress(args.json);
            cmd::zoo::run(Arch::T5, args, bar)
        }
        Command::Train {
            model:
                Model::Gpt {
                    text,
                    config,
                    steps,
                    vocab,
                    batch,
                    seed,
                    amp,
                    max_grad_norm,
                    memory_limit,
                    shard,
                    allow_non_finite_loss,
                    run,
                    log,
                    json,
                },
        } => {
            set_memory_limit(memory_limit.as_deref())?;
            let mut base = config.config();
            if let Some(b) = batch {
                base.batch = usize::try_from(b)?;
            }
            if let Some(spec) = &shard {
                // Under a mesh the config's batch is the global one: keep
                // `batch` per data-parallel rank, as replicas draw it.
                let ranks = set_shard(spec)?;
                // Before the text is read; every compile checks again.
                kiln::check_memory_limit_for_mesh().with_context(|| {
                    format!(
                        "--memory-limit {} with --shard {spec}: give a share of the activation memory instead \
                         (--memory-limit 50%)",
                        memory_limit.as_deref().unwrap_or_default()
                    )
                })?;
                base.batch = base.batch.checked_mul(ranks).with_context(|| {
                    format!("--batch {} x {ranks} data-parallel ranks overflows a batch size", base.batch)
                })?;
            }
            let cfg = gpt::GptConfig {
                steps: steps.unwrap_or(base.steps),
                // 0: the text's characters, unpadded.
                vocab: vocab.map_or(0, std::num::NonZeroUsize::get),
                seed,
                amp: amp.map(Into::into),
                max_grad_norm,
                allow_non_finite_loss,
                run: gpt::GptRun {
                    eval_every: run.eval_every,
                    checkpoint: run.checkpoint,
                    checkpoint_every: run.checkpoint_every,
                    resume: run.resume,
                    overwrite: run.overwrite,
                    override_settings: run.override_settings,
                    keep_best: run.keep_best,
                },
                ..base
            };
            // The settings before the text is read (the vocabulary is at
            // least one character); `gpt::train` checks again with the
            // text's vocabulary and the run's replicas.
            gpt::GptConfig { vocab: cfg.vocab.max(1), ..cfg.clone() }.check(1)?;
            train_gpt(&text, &cfg, log.as_deref(), json)
        }
    }
}

/// `--lr`: the schedule's rate reaches the step as an f32 scalar, so it must
/// be finite and above 0 there too (`1e308` is finite in f64 and infinite in
/// f32, `1e-50` is 0).
fn check_lr(lr: f64) -> anyhow::Result<()> {
    if !(lr > 0.0 && kiln::optim::f32_rate(lr).is_some()) {
        anyhow::bail!(
            "--lr {lr:e}: the learning rate must be a finite number above 0 that f32 can hold (1.4e-45 to 3.4e38)"
        );
    }
    Ok(())
}

/// `--shard SPEC`: sets the mesh and policy (none for `dp`); returns the
/// data-parallel degree (the mesh's `data` axis, 1 without one).
pub(crate) fn set_shard(spec: &str) -> anyhow::Result<usize> {
    let env = kiln::runtime::ReplicaEnv::from_env()?;
    let devices = env.plan(kiln::runtime::probe_gpus)?.replicas;
    match kiln::shard::parse_shard_flag(spec, devices)? {
        None => Ok(1),
        Some((mesh, policy)) => {
            let data = mesh.axis_size(kiln::shard::DATA).unwrap_or(1);
            eprintln!("kiln: mesh {mesh} ({} devices), {policy:?}", mesh.size());
            kiln::shard::set_mesh(mesh)?;
            kiln::shard::set_policy(Some(policy));
            Ok(data)
        }
    }
}

fn progress(json: bool) -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    if json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar
}

/// `--memory-limit` for the training loops, read as `kiln compile` reads it.
pub(crate) fn set_memory_limit(limit: Option<&str>) -> anyhow::Result<()> {
    let (bytes, fraction) = cmd::memory::budget_settings(limit.map(cmd::memory::parse_budget).transpose()?);
    kiln::set_memory_limit(bytes);
    kiln::set_activation_budget(fraction)?;
    Ok(())
}

fn train_gpt(
    path: &std::path::Path,
    cfg: &gpt::GptConfig,
    log: Option<&std::path::Path>,
    json: bool,
) -> anyhow::Result<()> {
    let text = gpt::read_text(path, cfg.seq)?;
    // Tokens a step takes over every device (see `global_batch` below).
    let step_tokens = (cfg.batch * kiln::replicas::global_replicas()? * cfg.seq) as f64;
    // Both callbacks write the log.
    let log = std::cell::RefCell::new(cmd::runlog::RunLog::create(log, "tokens", step_tokens)?);
    let bar = progress(json);
    let mut evals = Vec::new();
    let report = gpt::train_with(
        &text,
        cfg,
        |s| {
            log.borrow_mut().step(s);
            bar.set_length(s.steps_total);
            bar.set_position(s.step);
            bar.set_message(format!("loss {:.4} step {:.1} ms", s.loss, s.step_ms));
        },
        |e| {
            let loss = e.get("loss").unwrap_or(f64::NAN);
            log.borrow_mut().eval(e.step, "eval_loss", loss);
            bar.println(format!("eval at step {}: held-out loss {loss:.4}", e.step));
            evals.push((e.step, loss));
        },
    )?;
    bar.finish_and_clear();
    let logged = log.into_inner().finish();
    // Sequences per step over every device (replicas draw `batch` each; under
    // a mesh `batch` is already the global batch and there is one replica).
    let global_batch = cfg.batch * kiln::replicas::global_replicas()?;
    let tokens_per_second = (global_batch * cfg.seq) as f64 / (report.step_ms_median() / 1e3);
    // XLA's plan for the largest program (the train step), for one device.
    let step_memory = kiln::shard::program_memory_stats()?.into_iter().max_by_key(|m| m.argument_size_in_bytes);
    let mesh = kiln::shard::mesh()?;
    if json {
        println!(
            "{}",
            json!({
                "model": "gpt",
                "eval": evals.iter().map(|&(step, loss)| json!({"step": step, "loss": loss})).collect::<Vec<_>>(),
                "mesh": mesh.as_ref().map(ToString::to_string),
                "global_batch": global_batch,
                "seq": cfg.seq,
                "tokens_per_second": tokens_per_second,
                "device_memory": step_memory.map(|m| json!({
                    "argument_bytes": m.argument_size_in_bytes,
                    "output_bytes": m.output_size_in_bytes,
                    "alias_bytes": m.alias_size_in_bytes,
                    "temp_bytes": m.temp_size_in_bytes,
                    "held_bytes": m.held_bytes(),
                    "plugin_peak_bytes": m.peak_memory_in_bytes,
                })),
                "amp": cfg.amp.map(|d| d.to_string()),
                "skipped_steps": report.skipped_steps,
                "loss_scale": report.loss_scale,
                "final_loss": report.final_loss(),
                "first_loss": report.losses.first(),
                "losses": report.losses,
                "steps": report.steps,
                "compiles": report.compiles,
                "cache_hits": report.cache_hits,
                "disk_hits": report.disk_hits,
                "compile_seconds": report.compile_seconds,
                "first_step_ms": report.step_ms.first(),
                "step_ms_median": report.step_ms_median(),
                "train_seconds": report.train_seconds,
                "init": report.init.map(init_name),
                "setup_ms": report.setup_seconds * 1e3,
                "client_ms": report.client_seconds * 1e3,
                "setup_breakdown": report.setup.as_ref().map(setup_json),
                "remat": remat_json(),
            })
        );
    } else {
        println!(
            "gpt: {} steps in {:.1} s, loss {:.4} -> {:.4}, {} compiles, median step {:.2} ms",
            report.steps,
            report.train_seconds,
            report.losses.first().copied().unwrap_or(f64::NAN),
            report.final_loss(),
            report.compiles,
            report.step_ms_median()
        );
        for (step, loss) in &evals {
            println!("eval at step {step}: held-out loss {loss:.4}");
        }
        print_amp(cfg.amp, &report);
        if let Some(line) = kiln::metrics::snapshot().step_remat_line() {
            println!("remat: {line}");
            // What XLA made of the plan: its compiled step's figures.
            if let Some(m) = &step_memory {
                let size = |b: i64| kiln::metrics::bytes(u64::try_from(b).unwrap_or(0));
                println!(
                    "xla: the compiled step holds {} at once, {} of it temporaries{}",
                    size(m.held_bytes()),
                    size(m.temp_size_in_bytes),
                    if mesh.is_some() { " (one device's)" } else { "" }
                );
            }
        }
    }
    // A log that could not be written whole fails the run, after its summary.
    logged
}

/// The train step's remat plan for `--json` (`null` without a memory
/// limit): see [`remat_record_json`].
fn remat_json() -> serde_json::Value {
    remat_record_json(kiln::metrics::snapshot().step_remat_plan())
}

/// A remat plan for `--json` (`null` without one): the budget, whether it was
/// met, what was recomputed and the peaks by kiln's model.
fn remat_record_json(record: Option<&kiln::metrics::RematRecord>) -> serde_json::Value {
    let Some(record) = record else { return serde_json::Value::Null };
    let r = &record.plan;
    json!({
        "budget_bytes": r.budget_bytes,
        "activation_fraction": record.activation_fraction,
        "mesh": record.mesh,
        "met": r.met,
        "values_recomputed": r.values_recomputed(),
        "extra_flops": r.recomputed_flops(),
        "values_offloaded": r.offloaded.len(),
        "predicted_peak_bytes_before": r.before.peak_bytes,
        "predicted_peak_bytes_after": r.after.peak_bytes,
        "predicted_temp_bytes_before": r.before.allocated_temp_bytes,
        "predicted_temp_bytes_after": r.after.allocated_temp_bytes,
        "predicted_live_temp_bytes_before": r.before.temp_peak_bytes,
        "predicted_live_temp_bytes_after": r.after.temp_peak_bytes,
    })
}

/// `kiln train gpt --json`'s `setup_breakdown`: where `setup_ms` went.
fn setup_json(b: &kiln::models::SetupBreakdown) -> serde_json::Value {
    json!({
        "model_ms": b.model_ms,
        "shard_ms": b.shard_ms,
        "optimizer_ms": b.optimizer_ms,
        "init_step_ms": b.init_step_ms,
        "wait_ms": b.wait_ms,
        "other_ms": b.other_ms,
        "memory_pool_ms": b.memory_pool_ms,
        "trace_ms": b.trace_ms,
        "pipeline_ms": b.pipeline_ms,
        "compile_ms": b.compile_ms,
        "disk_load_ms": b.disk_load_ms,
        "disk_store_ms": b.disk_store_ms,
        "upload_ms": b.upload_ms,
        "execute_ms": b.execute_ms,
        "device_wait_ms": b.device_wait_ms,
        "compiles": b.compiles,
        "disk_hits": b.disk_hits,
        "host_to_device_bytes": b.host_to_device_bytes,
    })
}

/// `host` or `device`, as `KILN_INIT` spells it.
fn init_name(p: kiln::nn::InitPlacement) -> &'static str {
    match p {
        kiln::nn::InitPlacement::Host => "host",
        kiln::nn::InitPlacement::Device => "device",
    }
}

/// One line on mixed precision, when it was on.
fn print_amp(amp: Option<kiln::DType>, report: &mlp::TrainReport) {
    if let Some(d) = amp {
        let scale = report.loss_scale.map_or("none".to_string(), |s| s.to_string());
        println!("amp {d}: {} of {} updates skipped, final loss scale {scale}", report.skipped_steps, report.steps);
    }
}

fn train_mlp(
    cfg: &MlpConfig,
    dir: &PathBuf,
    compare: Option<u64>,
    log: Option<&std::path::Path>,
    json: bool,
) -> anyhow::Result<()> {
    let data = FashionMnist::load(dir).context("loading Fashion-MNIST")?;
    if let Some(n) = compare {
        let (compiled, eager) = mlp::compare_eager(&data, cfg, n)?;
        let diffs: Vec<f64> = compiled.iter().zip(&eager).map(|(a, b)| (a - b).abs()).collect();
        let worst = diffs.iter().copied().fold(0.0, f64::max);
        if json {
            // stdout carries the one object alone, as every --json does.
            println!("{}", json!({"compiled": compiled, "eager": eager, "max_abs_diff": worst}));
            return Ok(());
        }
        println!("{:>5}  {:>12}  {:>12}  {:>10}", "step", "compiled", "eager", "|diff|");
        for (i, ((a, b), d)) in compiled.iter().zip(&eager).zip(&diffs).enumerate() {
            println!("{:>5}  {a:>12.6}  {b:>12.6}  {d:>10.2e}", i + 1);
        }
        return Ok(());
    }
    let examples = (cfg.batch * kiln::replicas::global_replicas()?) as f64;
    // Both callbacks write the log.
    let log = std::cell::RefCell::new(cmd::runlog::RunLog::create(log, "examples", examples)?);
    let bar = progress(json);
    let report = mlp::train_with(
        &data,
        cfg,
        |s| {
            log.borrow_mut().step(s);
            bar.set_length(s.steps_total);
            bar.set_position(s.step);
            if s.step % 20 == 0 {
                let m = kiln::metrics::snapshot();
                bar.set_message(format!(
                    "epoch {} loss {:.4} step {:.1} ms compiles {} hits {}",
                    s.epoch + 1,
                    s.loss,
                    s.step_ms,
                    m.compiles,
                    m.cache_hits
                ));
            }
        },
        |e| {
            if let Some(a) = e.get("accuracy") {
                log.borrow_mut().eval(e.step, "test_accuracy", a);
                bar.println(format!("step {}: test accuracy {:.2}%", e.step, a * 100.0));
            }
        },
    )?;
    bar.finish_and_clear();
    let logged = log.into_inner().finish();
    let acc = report.test_accuracy.unwrap_or(f64::NAN);
    if json {
        println!(
            "{}",
            json!({
                "model": "mlp",
                "amp": cfg.amp.map(|d| d.to_string()),
                "skipped_steps": report.skipped_steps,
                "loss_scale": report.loss_scale,
                "test_accuracy": acc,
                "final_loss": report.final_loss(),
                "losses": report.losses,
                "steps": report.steps,
                "compiles": report.compiles,
                "cache_hits": report.cache_hits,
                "disk_hits": report.disk_hits,
                "compile_seconds": report.compile_seconds,
                "first_step_ms": report.step_ms.first(),
                "step_ms_median": report.step_ms_median(),
                "train_seconds": report.train_seconds,
                "init": report.init.map(init_name),
                "setup_ms": report.setup_seconds * 1e3,
                "client_ms": report.client_seconds * 1e3,
                "remat": remat_json(),
            })
        );
    } else {
        println!(
            "mlp: {} steps in {:.1} s, final loss {:.4}, test accuracy {:.2}%, {} compiles, {} cache hits, median step {:.2} ms",
            report.steps,
            report.train_seconds,
            report.final_loss(),
            acc * 100.0,
            report.compiles,
            report.cache_hits,
            report.step_ms_median()
        );
        print_amp(cfg.amp, &report);
        println!("{}", kiln::metrics::report());
    }
    // A log that could not be written whole fails the run, after its summary.
    logged
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln::runtime::{PjrtErrorCode, RuntimeError};

    fn pjrt(code: PjrtErrorCode) -> RuntimeError {
        RuntimeError::Pjrt {
            function: "PJRT_Event_Await",
            code,
            message: "Out of memory while trying to allocate".into(),
        }
    }

    #[test]
    fn an_out_of_memory_error_gets_the_remedies_however_it_is_wrapped() {
        let direct = anyhow::Error::from(pjrt(PjrtErrorCode::ResourceExhausted));
        let through_frontend = anyhow::Error::from(kiln::FrontendError::from(pjrt(PjrtErrorCode::ResourceExhausted)));
        let with_context = through_frontend.context("step 3");
        for e in [direct, with_context] {
            let h = hint(&e).expect("a hint");
            assert!(h.contains("--max-batch") && h.contains("--memory-limit"), "{h}");
        }
        assert_eq!(hint(&anyhow::Error::from(pjrt(PjrtErrorCode::InvalidArgument))), None);
        assert_eq!(hint(&anyhow::anyhow!("no such file")), None);
    }
}
