//! `kiln profile <mlp|gpt|GRAPH> --steps N [--trace out.json]`: where a step's
//! time goes — recording (trace), compile or disk load, uploads, execution,
//! downloads — per step, as a summary and as a Chrome/Perfetto trace; the
//! eager baseline that compilation must pay for itself against; MFU on GPUs.
//!
//! For the built-in models the training loop runs with the frontend's
//! timeline on. A GRAPH file (kiln's text form, as `KILN_SAVE_GRAPHS` writes
//! it) is compiled and run directly through the runtime on random inputs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kiln::compiler::cost;
use kiln::compiler::ir::{DType, TensorType};
use kiln::compiler::remat::RematBudget;
use kiln::compiler::target::Target;
use kiln::compiler::{lower, pipeline, text, LowerOptions, LowerTarget};
use kiln::data::{FashionMnist, FASHION_MNIST_DIR};
use kiln::metrics::{self, Event, Payback};
use kiln::models::{gpt, mlp};
use kiln::runtime::{Client, ClientOptions, CompileOptions, ExecArg};
use serde_json::json;

use super::{AmpDtype, GptSize};

#[derive(Args)]
pub struct ProfileArgs {
    /// `mlp`, `gpt`, or the path of a step graph in kiln's text form.
    target: String,
    /// Steps (or executions of a graph) to profile.
    #[arg(long, default_value_t = 50)]
    steps: u64,
    /// Write the timeline as a Chrome/Perfetto trace (JSON) here.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Steps to run on the eager backend (candle, op by op) for the payback
    /// baseline (0 skips it).
    #[arg(long, default_value_t = 2)]
    eager_steps: u64,
    /// Fashion-MNIST's directory (mlp).
    #[arg(long, default_value = FASHION_MNIST_DIR)]
    data: PathBuf,
    /// The text to learn (gpt).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Batch size per replica (mlp).
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Hidden layer widths (mlp).
    #[arg(long, value_delimiter = ',', default_value = "256,128")]
    hidden: Vec<usize>,
    /// Model size (gpt).
    #[arg(long, value_enum, default_value_t = GptSize::Tiny)]
    config: GptSize,
    /// Pad the character vocabulary to this size (gpt; at least 1).
    #[arg(long)]
    vocab: Option<std::num::NonZeroUsize>,
    /// Mixed precision: matmuls in this dtype, f32 master weights.
    #[arg(long)]
    amp: Option<AmpDtype>,
    /// Clip the global gradient norm to this value (gpt), as `kiln train gpt
    /// --max-grad-norm` does.
    #[arg(long)]
    max_grad_norm: Option<f64>,
    /// End with one JSON object (for scripts).
    #[arg(long)]
    json: bool,
    /// The largest batch (in steps of an eighth of a power of two: 4096, 4608,
    /// 5120, ...) whose step fits --device-memory, with and without remat:
    /// found by kiln's peak model, then checked by compiling (not running) the
    /// step, searched lower while XLA's program does not fit.
    /// Nothing runs, so there is no timeline to write (`--trace`).
    #[arg(long, conflicts_with = "trace")]
    max_batch: bool,
    /// Rematerialize so each step's predicted peak fits SIZE (`2GiB`, bytes), or
    /// `N%`: keep the arguments, outputs and N% of the step's activation
    /// memory, as `kiln train --memory-limit` does; the report adds the plan's
    /// `remat:` line and the step's time shows what the recomputation costs.
    #[arg(long, value_name = "SIZE", conflicts_with = "max_batch")]
    memory_limit: Option<String>,
    /// Device memory for --max-batch (`60GiB`; default: what the plugin's
    /// allocator may take of the first device, on a GPU its memory fraction,
    /// 75% unless KILN_GPU_MEMORY_FRACTION says).
    #[arg(long, value_name = "SIZE", requires = "max_batch")]
    device_memory: Option<String>,
}

/// The phases of a step, in timeline order (their Perfetto rows). Steps are
/// asynchronous: `execute` is the enqueue, `device_wait` the host blocked on
/// the devices (the bound on steps in flight), `download` a read.
const PHASES: [&str; 7] = ["trace", "compile", "disk_load", "upload", "execute", "device_wait", "download"];

pub fn run(args: ProfileArgs) -> anyhow::Result<()> {
    if args.max_grad_norm.is_some() && args.target != "gpt" {
        anyhow::bail!("--max-grad-norm clips the gpt loop's gradients; {} has no clipping to profile", args.target);
    }
    if args.max_batch {
        return max_batch(&args);
    }
    if args.steps == 0 {
        anyhow::bail!("--steps must be at least 1");
    }
    if let Some(path) = &args.trace {
        kiln::atomic_write::check_writable(path).with_context(|| format!("--trace {}", path.display()))?;
    }
    let model = matches!(args.target.as_str(), "mlp" | "gpt");
    let budget = args.memory_limit.as_deref().map(super::memory::parse_budget).transpose()?;
    let Profiled { events, eager, platform, device_kind, graph_flops, transfers, remat } =
        if model { profile_model(&args)? } else { profile_graph(&args, Path::new(&args.target), budget)? };
    // Compiles, loads and executions as the timeline saw them (a graph file
    // runs outside the frontend, whose counters then stay empty).
    let count = |name: &str| events.iter().filter(|e| e.name == name).count() as u64;
    let total = |name: &str| events.iter().filter(|e| e.name == name).map(|e| e.duration).sum::<Duration>();
    let executions = count("execute");
    let m = metrics::snapshot();
    let (to_device, to_host) = transfers.unwrap_or((m.host_to_device_bytes, m.device_to_host_bytes));
    let summary = summarize(&events);
    let flops_per_step = match graph_flops {
        Some(f) => f,
        None if m.executions > 0 => m.flops_executed / m.executions as f64,
        None => 0.0,
    };
    let step_ms = step_ms_median(&events);
    // MFU against the dense bf16 peak of the GPU (the convention of
    // benches/RESULTS.md); not defined for CPUs.
    let target = Target::ALL.into_iter().find(|t| match t.name {
        "h100_sxm" => device_kind.contains("H100"),
        "h200_sxm" => device_kind.contains("H200"),
        _ => false,
    });
    let mfu = match (&target, step_ms) {
        (Some(t), Some(ms)) if ms > 0.0 => Some(flops_per_step / (ms / 1e3) / t.peak_bf16_flops_per_s),
        _ => None,
    };
    if let Some(path) = &args.trace {
        kiln::atomic_write::write_atomically(path, chrome_trace(&events).to_string().as_bytes())?;
    }
    let payback = match m.payback() {
        Payback::AfterSteps(n) => Some(n),
        Payback::Never | Payback::Unknown => None,
    };
    if args.json {
        let phases: serde_json::Map<String, serde_json::Value> = summary
            .iter()
            .map(|p| {
                (p.name.to_string(), json!({"first_ms": p.first_ms, "median_ms": p.median_ms, "total_ms": p.total_ms}))
            })
            .collect();
        println!(
            "{}",
            json!({
                "target": args.target,
                "platform": platform,
                "steps": args.steps,
                "phases": phases,
                "compiles": count("compile"),
                "compile_ms": ms(total("compile")),
                "cache_hits": m.cache_hits,
                "disk_hits": count("disk_load"),
                "executions": executions,
                "execute_ms_per_step": (executions > 0).then(|| ms(total("execute")) / executions as f64),
                "eager_step_ms": eager.map(ms),
                "payback_steps": payback,
                "host_to_device_bytes": to_device,
                "device_to_host_bytes": to_host,
                "forced_syncs": m.forced_syncs,
                "trace_file": args.trace,
                "device_kind": device_kind,
                "flops_per_step": flops_per_step,
                "step_ms_median": step_ms,
                "mfu": mfu,
                "mfu_peak": target.as_ref().map(|t| t.name),
                "remat": crate::remat_record_json(remat.as_ref()),
            })
        );
    } else {
        println!("profile {}: {} steps on {platform}", args.target, args.steps);
        println!("{:<10} {:>12} {:>16} {:>12}", "phase", "first step", "median (later)", "total");
        for p in &summary {
            let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3} ms"));
            println!(
                "{:<10} {:>12} {:>16} {:>12}",
                p.name,
                cell(p.first_ms),
                cell(p.median_ms),
                format!("{:.1} ms", p.total_ms)
            );
        }
        if let Some(ms) = step_ms {
            println!("step (later steps, median) {ms:.3} ms, {:.3} GFLOP per step (cost model)", flops_per_step / 1e9);
        }
        match (mfu, &target) {
            (Some(mfu), Some(t)) => println!(
                "MFU {:.3} of {}'s dense bf16 peak ({:.0} TFLOP/s)",
                mfu,
                t.name,
                t.peak_bf16_flops_per_s / 1e12
            ),
            _ => println!("MFU n/a on {device_kind} (defined against a GPU's peak)"),
        }
        if let Some(e) = eager {
            println!(
                "eager baseline: {} steps on the eager backend (candle), median {:.3} ms per step",
                args.eager_steps,
                ms(e)
            );
        }
        if model {
            // The metrics' report has the plan's `remat` row.
            println!("{m}");
        } else {
            if let Some(r) = &remat {
                println!("remat: {}", r.line());
            }
            println!(
                "host->device {to_device} bytes (the inputs, once), device->host {to_host} bytes (the last outputs)"
            );
        }
        if let Some(path) = &args.trace {
            println!("timeline written to {} (open it in ui.perfetto.dev or chrome://tracing)", path.display());
        }
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn progress(args: &ProfileArgs, len: u64) -> ProgressBar {
    if args.json {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// What a profiled run gives the report.
struct Profiled {
    events: Vec<Event>,
    eager: Option<Duration>,
    platform: String,
    device_kind: String,
    /// FLOPs of one execution, when the graph is known here (a graph file);
    /// the models' come from the frontend's counters.
    graph_flops: Option<f64>,
    /// Bytes copied to and from the device, when they were moved here (a
    /// graph file's inputs and last outputs); the models' come from the
    /// frontend's counters.
    transfers: Option<(u64, u64)>,
    /// The step's remat plan under `--memory-limit`.
    remat: Option<kiln::metrics::RematRecord>,
}

fn device_kind(client: &Client) -> String {
    client.devices().first().map_or_else(|| "no device".to_string(), |d| d.kind().to_string())
}

/// The median over steps 2.. of each step's summed phases.
fn step_ms_median(events: &[Event]) -> Option<f64> {
    let mut per_step: std::collections::BTreeMap<u64, f64> = Default::default();
    for e in events.iter().filter(|e| e.step >= 2) {
        *per_step.entry(e.step).or_default() += ms(e.duration);
    }
    let v: Vec<f64> = per_step.into_values().collect();
    (!v.is_empty()).then(|| mlp::median(&v))
}

/// Runs the eager baseline, then the built-in model with the timeline on.
fn profile_model(args: &ProfileArgs) -> anyhow::Result<Profiled> {
    type Runner<'a> = Box<dyn FnMut(u64, &mut dyn FnMut(&mlp::StepInfo)) -> anyhow::Result<mlp::TrainReport> + 'a>;
    let mut runner: Runner = match args.target.as_str() {
        "mlp" => {
            let data = FashionMnist::load(&args.data).context("loading Fashion-MNIST")?;
            let (batch, hidden, amp) = (args.batch, args.hidden.clone(), args.amp.map(Into::into));
            Box::new(move |steps, on_step| {
                let cfg = mlp::MlpConfig {
                    batch,
                    hidden: hidden.clone(),
                    amp,
                    epochs: usize::MAX / 2,
                    max_steps: Some(steps),
                    eval: false,
                    ..mlp::MlpConfig::default()
                };
                Ok(mlp::train(&data, &cfg, on_step)?)
            })
        }
        _ => {
            let path = args.text.as_deref().context("kiln profile gpt needs --text FILE")?;
            let base = gpt::GptConfig {
                vocab: args.vocab.map_or(0, std::num::NonZeroUsize::get),
                amp: args.amp.map(Into::into),
                max_grad_norm: args.max_grad_norm,
                ..args.config.config()
            };
            let text = gpt::read_text(path, base.seq)?;
            Box::new(move |steps, on_step| Ok(gpt::train(&text, &gpt::GptConfig { steps, ..base.clone() }, on_step)?))
        }
    };
    // The eager baseline first, so the compiled run's counters stand alone.
    let eager = if args.eager_steps > 0 {
        let bar = progress(args, args.eager_steps);
        bar.set_message("eager baseline (candle)");
        kiln::set_backend(kiln::Backend::Eager);
        let report = runner(args.eager_steps, &mut |s| bar.set_position(s.step));
        kiln::set_backend(kiln::Backend::Pjrt);
        bar.finish_and_clear();
        Some(Duration::from_secs_f64(mlp::median(&report?.step_ms) / 1e3))
    } else {
        None
    };
    // The budget plans the compiled steps (the eager backend plans nothing).
    crate::set_memory_limit(args.memory_limit.as_deref())?;
    let bar = progress(args, args.steps);
    bar.set_message("compiled steps");
    metrics::reset();
    if let Some(e) = eager {
        metrics::set_eager_step_time(e);
    }
    metrics::start_timeline();
    runner(args.steps, &mut |s| bar.set_position(s.step))?;
    let events = metrics::take_timeline();
    bar.finish_and_clear();
    let client = Client::new(&ClientOptions::default())?;
    Ok(Profiled {
        events,
        eager,
        platform: client.platform_name().to_string(),
        device_kind: device_kind(&client),
        graph_flops: None,
        transfers: None,
        remat: metrics::snapshot().step_remat_plan().cloned(),
    })
}

/// Compiles the graph in `path` and runs it `steps` times on random inputs.
fn profile_graph(args: &ProfileArgs, path: &Path, budget: Option<RematBudget>) -> anyhow::Result<Profiled> {
    let source = super::read_graph_text(path)
        .with_context(|| format!("reading step graph {} (expected mlp, gpt or a graph file)", path.display()))?;
    let graph = text::parse(&source).with_context(|| format!("parsing {}", path.display()))?;
    // Not held through the compile: a graph of large constants is mostly text.
    drop(source);
    super::check_graph_memory(&graph, path, true)?;
    let client = Client::new(&ClientOptions::default())?;
    let origin = Instant::now();
    let mut events = Vec::new();
    let mut span = |name: &'static str, step: u64, start: Instant| {
        events.push(Event { name, step, start: start - origin, duration: start.elapsed() });
    };
    // For the client's platform, as a step is: the CUDA fusion model, cuDNN
    // attention and the loop kernels on a GPU.
    let target = LowerTarget::from_platform(client.platform_name());
    let (bytes, fraction) = super::memory::budget_settings(budget);
    let popts = pipeline::PipelineOptions { prune_params: false, ..pipeline::PipelineOptions::default() }
        .with_target(target)
        .with_memory_limit(bytes)
        .with_activation_budget(fraction);
    let out = pipeline::run(&graph, &popts, &mut |_, _| {})?;
    let remat = out.stats.passes.iter().find_map(|p| p.remat().cloned()).map(|plan| kiln::metrics::RematRecord {
        plan,
        activation_fraction: fraction,
        mesh: None,
    });
    let optimized = out.graph;
    let lowering = LowerOptions { target, loop_kernels: kiln::loop_kernels()?, ..LowerOptions::default() };
    let t = Instant::now();
    let exe = client.compile(&lower(&optimized, &lowering)?, &CompileOptions::default())?;
    span("compile", 1, t);
    let device = client.devices().into_iter().next().context("the PJRT client has no devices")?;
    let t = Instant::now();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut uploaded = 0u64;
    let inputs = graph
        .param_types()
        .iter()
        .map(|ty| {
            let bytes = random_bytes(ty, &mut seed);
            uploaded += bytes.len() as u64;
            Ok(client.buffer_from_bytes(&bytes, kiln::element_type(ty.dtype), ty.shape.dims(), &device)?)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    span("upload", 1, t);
    let bar = progress(args, args.steps);
    let mut last = Vec::new();
    for step in 1..=args.steps {
        let t = Instant::now();
        let argv: Vec<ExecArg> = inputs.iter().map(ExecArg::Borrowed).collect();
        // `execute` returns when the device has finished (the runtime awaits
        // the completion events), so the span is the device time plus dispatch.
        last = exe.execute(&argv)?;
        span("execute", step, t);
        bar.set_position(step);
    }
    bar.finish_and_clear();
    let t = Instant::now();
    let mut downloaded = 0u64;
    for b in &last {
        downloaded += b.to_host_bytes()?.len() as u64;
    }
    span("download", args.steps, t);
    metrics::reset();
    Ok(Profiled {
        events,
        eager: None,
        platform: client.platform_name().to_string(),
        device_kind: device_kind(&client),
        graph_flops: Some(cost::graph_flops(&optimized)),
        transfers: Some((uploaded, downloaded)),
        remat,
    })
}

/// Random inputs of `ty`: floats in [-1, 1), integers in [0, 8) (valid as
/// small indices), random bits for unsigned state.
fn random_bytes(ty: &TensorType, seed: &mut u64) -> Vec<u8> {
    let mut next = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    };
    let n = ty.shape.num_elements();
    let unit = |r: u64| (r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
    let mut out = Vec::with_capacity(n * ty.dtype.size_in_bytes());
    for _ in 0..n {
        let r = next();
        match ty.dtype {
            DType::Pred => out.push((r & 1) as u8),
            DType::I8 | DType::U8 => out.push((r % 8) as u8),
            DType::I32 => out.extend(((r % 8) as i32).to_le_bytes()),
            DType::I64 => out.extend(((r % 8) as i64).to_le_bytes()),
            DType::U32 => out.extend((r as u32).to_le_bytes()),
            DType::U64 => out.extend(r.to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(unit(r)).to_le_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(unit(r)).to_le_bytes()),
            DType::F32 => out.extend((unit(r) as f32).to_le_bytes()),
            DType::F64 => out.extend(unit(r).to_le_bytes()),
        }
    }
    out
}

struct Phase {
    name: &'static str,
    /// The phase's time in step 1 (absent if step 1 had none).
    first_ms: Option<f64>,
    /// Median over the later steps that had it.
    median_ms: Option<f64>,
    total_ms: f64,
}

fn summarize(events: &[Event]) -> Vec<Phase> {
    PHASES
        .iter()
        .map(|&name| {
            let mut per_step: std::collections::BTreeMap<u64, f64> = Default::default();
            for e in events.iter().filter(|e| e.name == name) {
                *per_step.entry(e.step).or_default() += ms(e.duration);
            }
            let first_ms = per_step.get(&1).copied();
            let later: Vec<f64> = per_step.range(2..).map(|(_, v)| *v).collect();
            Phase {
                name,
                first_ms,
                median_ms: (!later.is_empty()).then(|| mlp::median(&later)),
                total_ms: per_step.values().fold(0.0, |a, b| a + b),
            }
        })
        .collect()
}

/// The Chrome trace-event format: one complete ("X") event per span, one row
/// (thread) per phase, times in microseconds.
fn chrome_trace(events: &[Event]) -> serde_json::Value {
    let tid = |name: &str| PHASES.iter().position(|p| *p == name).map_or(0, |i| i + 1);
    let mut out: Vec<serde_json::Value> = PHASES
        .iter()
        .enumerate()
        .map(|(i, p)| json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": i + 1, "args": {"name": p}}))
        .collect();
    out.push(json!({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "kiln"}}));
    for e in events {
        out.push(json!({
            "name": e.name,
            "cat": "kiln",
            "ph": "X",
            "pid": 1,
            "tid": tid(e.name),
            "ts": e.start.as_secs_f64() * 1e6,
            "dur": e.duration.as_secs_f64() * 1e6,
            "args": {"step": e.step},
        }));
    }
    json!({"traceEvents": out, "displayTimeUnit": "ms"})
}

/// `--max-batch`: see [`super::memory::max_batch`].
fn max_batch(args: &ProfileArgs) -> anyhow::Result<()> {
    use super::memory::{self, AdvisedModel};
    let asked = args.device_memory.as_deref().map(|s| memory::parse_bytes("--device-memory", s)).transpose()?;
    if let (Some(0), Some(s)) = (asked, args.device_memory.as_deref()) {
        anyhow::bail!("--device-memory {s}: no step fits in 0 bytes; give the device's memory (60GiB, 512MiB, bytes)");
    }
    let amp = args.amp.map(Into::into);
    let model = match args.target.as_str() {
        "mlp" => AdvisedModel::Mlp { cfg: mlp::MlpConfig { hidden: args.hidden.clone(), amp, ..Default::default() } },
        "gpt" => {
            // As `kiln train gpt`: the text's characters, padded to --vocab.
            let text = args.text.as_deref().map(|p| gpt::read_text(p, 1)).transpose()?;
            let vocab = match (args.vocab.map(std::num::NonZeroUsize::get), text.map(|t| gpt::CharVocab::new(&t).len()))
            {
                (Some(v), Some(chars)) => v.max(chars),
                (Some(v), None) => v,
                (None, Some(chars)) => chars,
                (None, None) => 256,
            };
            let max_grad_norm = args.max_grad_norm;
            AdvisedModel::Gpt { cfg: gpt::GptConfig { vocab, amp, max_grad_norm, ..args.config.config() } }
        }
        other => anyhow::bail!("--max-batch sizes the built-in models (mlp, gpt), not {other}"),
    };
    // The client the training loops would open: the models choose what they
    // record by its platform (the GPT's LM-head blocks, donation).
    let client = kiln::runtime::replica_plan_from_env()?.create_client()?;
    kiln::set_client(client.clone());
    // By default what the plugin's allocator may take of the first device
    // (on the CUDA plugin its memory fraction of the GPU), not the whole GPU.
    let device = match asked {
        Some(bytes) => bytes,
        None => {
            let first = client.devices().into_iter().next().context("--max-batch: the plugin has no device")?;
            let refused = |why: String| {
                anyhow::anyhow!(
                    "--max-batch: the {} plugin reports no memory limit for its device ({why}); \
                     give --device-memory SIZE",
                    client.platform_name()
                )
            };
            match first.memory_limit_bytes() {
                Ok(Some(limit)) => limit,
                Ok(None) => return Err(refused("none set".into())),
                Err(e) => return Err(refused(e.to_string())),
            }
        }
    };
    memory::max_batch(&model, device, &client, args.json)
}
