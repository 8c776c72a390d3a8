//! The memory side of `kiln compile`: `--memory-limit SIZE` plans
//! rematerialization for the compiled graph and reports the plan beside XLA's
//! own memory stats; `--memory-plot FILE.svg` draws live bytes over the step
//! with and without the plan. Also the byte sizes the CLI accepts
//! (`2GiB`, `512MiB`, `1.5e9`, `0`).

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use kiln::compiler::analysis::{fusion_for, liveness, Materialization, PeakMemory};
use kiln::compiler::ir::Graph;
use kiln::compiler::pipeline::{PipelineOptions, RematSummary};
use kiln::compiler::remat::{HostOffload, RematBudget, RematOptions, RematPlan, StrategyKind, HOST_COPY_TRIP_SECONDS};
use kiln::compiler::{lower, LowerOptions};
use kiln::runtime::{Client, CompileOptions, CompiledMemoryStats};
use serde_json::{json, Value};

#[derive(clap::Args, Clone, Debug, Default)]
pub struct MemoryArgs {
    /// Plan rematerialization so the step's predicted peak fits SIZE (`2GiB`,
    /// `512MiB`, bytes, `0` for the lowest peak the strategy reaches), or
    /// `N%`: keep the arguments, outputs and N% of the step's activation
    /// (temporary) memory, as the training loops do; the report shows the
    /// plan and XLA's stats of both programs.
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// How to choose what to recompute.
    #[arg(long, value_enum, default_value_t = Strategy(StrategyKind::Greedy), requires = "memory_limit")]
    pub remat_strategy: Strategy,
    /// Draw live bytes over the step, with and without the plan, as SVG.
    #[arg(long, value_name = "FILE", requires = "memory_limit")]
    pub memory_plot: Option<PathBuf>,
}

/// `--remat-strategy`: the compiler's [`StrategyKind`], spelled and
/// explained by the compiler, so the CLI and the pipeline share one list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Strategy(pub StrategyKind);

impl clap::ValueEnum for Strategy {
    fn value_variants<'a>() -> &'a [Self] {
        const ALL: [Strategy; StrategyKind::ALL.len()] = {
            let mut all = [Strategy(StrategyKind::Off); StrategyKind::ALL.len()];
            let mut i = 0;
            while i < all.len() {
                all[i] = Strategy(StrategyKind::ALL[i]);
                i += 1;
            }
            all
        };
        &ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.0.name()).help(self.0.about()))
    }
}

/// A byte size given to `flag`, in [`kiln::runtime::env::parse_size`]'s
/// spellings (`2GiB`, `2G`, `512MB`, `1.5e9`, `0`), the same as kiln's
/// variables take.
pub fn parse_bytes(flag: &str, s: &str) -> anyhow::Result<u64> {
    kiln::runtime::env::parse_size(s)
        .with_context(|| format!("{flag} {s}: not a size: {}", kiln::runtime::env::SIZE_SPELLINGS))
}

/// A budget as the pipeline's two settings: (a byte limit, a share of the
/// activation memory), at most one of them set.
pub fn budget_settings(budget: Option<RematBudget>) -> (Option<u64>, Option<f64>) {
    match budget {
        Some(RematBudget::Bytes(b)) => (Some(b), None),
        Some(RematBudget::FractionOfActivations(f)) => (None, Some(f)),
        None => (None, None),
    }
}

/// `--memory-limit` as a budget, for `kiln compile` and the training loops
/// alike: `N%` keeps N% of the step's activation memory, anything else is a
/// size.
pub fn parse_budget(s: &str) -> anyhow::Result<RematBudget> {
    match s.trim().strip_suffix('%') {
        Some(p) => {
            let f: f64 = p.trim().parse().with_context(|| format!("--memory-limit {s}: not a percentage"))?;
            if !(f > 0.0 && f <= 100.0) {
                anyhow::bail!("--memory-limit {s}: a percentage of the activation memory must be in (0, 100]");
            }
            Ok(RematBudget::FractionOfActivations(f / 100.0))
        }
        None => {
            // A share written as the library's fraction (`0.5`) would read
            // as a count of bytes rounded down to 0, the lowest-peak plan.
            if let Ok(f) = s.trim().parse::<f64>() {
                if f > 0.0 && f < 1.0 {
                    anyhow::bail!(
                        "--memory-limit {s}: a bare number is bytes, and {s} bytes is less than one; \
                         for a share of the activation memory write {}%",
                        (f * 1e6).round() / 1e4
                    );
                }
            }
            Ok(RematBudget::Bytes(parse_bytes("--memory-limit", s)?))
        }
    }
}

/// The memory flags checked before any work: `--memory-limit` must parse,
/// and `--remat-strategy host-offload` is refused where the plugin is known
/// to be the CPU one (`plugin_from_env`: chosen by `PJRT_DEVICE`, not
/// `--plugin`), for the reason the strategy gives.
pub fn check_args(args: &MemoryArgs, plugin_from_env: bool) -> anyhow::Result<()> {
    if let Some(limit) = &args.memory_limit {
        parse_budget(limit)?;
    }
    if args.remat_strategy.0 == StrategyKind::HostOffload
        && plugin_from_env
        && kiln::runtime::PjrtDevice::from_env()? == kiln::runtime::PjrtDevice::Cpu
    {
        let offload = HostOffload { target: kiln::compiler::LowerTarget::Cpu };
        if let Some(reason) = offload.unavailable_reason() {
            anyhow::bail!("--remat-strategy host-offload is not available on the CPU plugin: {reason}");
        }
    }
    Ok(())
}

/// The plan and XLA's view of both programs.
pub struct PlanReport {
    /// What `--memory-limit` asked for; `plan.budget_bytes` is what it came to.
    pub budget: RematBudget,
    /// The pipeline's `remat` pass report.
    pub plan: RematSummary,
    pub xla_before: Option<CompiledMemoryStats>,
    pub xla_after: Result<CompiledMemoryStats, String>,
    /// Under `--remat-strategy exact`, greedy's plan at the same budget, for
    /// comparison: the program is exact over the unplanned graph's
    /// candidates, and greedy, choosing on the graphs its choices rewrote,
    /// can do better (`docs/memory.md`, "The exact strategy").
    pub greedy: Option<RematPlan>,
}

/// Plans remat for `optimized` and compiles the planned program on `client`.
pub fn plan_and_compile(
    args: &MemoryArgs,
    optimized: &Graph,
    client: &Client,
    replicas: usize,
    xla_before: Option<CompiledMemoryStats>,
) -> anyhow::Result<Option<PlanReport>> {
    let Some(limit) = &args.memory_limit else { return Ok(None) };
    let budget = parse_budget(limit)?;
    let target = kiln::compiler::LowerTarget::from_platform(client.platform_name());
    let strategy = args.remat_strategy.0;
    let link = if strategy == StrategyKind::HostCopy {
        kiln::host_link_rate()?
    } else {
        kiln::compiler::target::HOST_COPY_LINK_BYTES_PER_SECOND
    };
    // The pipeline's last two passes, as the training loops run them under a
    // budget: the backward held to the program's order where the target
    // reorders it, then the strategy. The optimized graph keeps its
    // parameters (it was pruned already).
    let (bytes, fraction) = budget_settings(Some(budget));
    let pipeline = PipelineOptions { passes: Vec::new(), prune_params: false, ..PipelineOptions::default() }
        .with_target(target)
        .with_memory_limit(bytes)
        .with_activation_budget(fraction)
        .with_remat_strategy(strategy)
        .with_host_link_rate(link);
    let mut sequenced = None;
    let out = kiln::compiler::pipeline::run(optimized, &pipeline, &mut |stage, g| {
        if stage == "sequence" {
            sequenced = Some(g.clone());
        }
    })
    .context("planning rematerialization")?;
    let (Some(sequenced), Some(plan)) = (sequenced, out.stats.passes.iter().find_map(|p| p.remat()).cloned()) else {
        anyhow::bail!("the pipeline ran without its sequence and remat passes");
    };
    let planned = out.graph;
    let module = lower(
        &planned,
        &LowerOptions { num_replicas: replicas, target, shardings: None, loop_kernels: kiln::loop_kernels()? },
    )
    .context("lowering the planned graph")?;
    let xla_after = client
        .compile(
            &module,
            &CompileOptions {
                num_replicas: replicas,
                // As the training loops compile a planned step with replicas.
                keep_order: target.keeps_plan_order(!plan.recomputed.is_empty(), replicas > 1),
                ..CompileOptions::default()
            },
        )
        .context("compiling the planned graph")?
        .compiled_memory_stats()
        .map_err(|e| e.to_string());
    if let Some(path) = &args.memory_plot {
        plot(path, &sequenced, &planned, fusion_for(target))?;
    }
    // An analysis beside the plan, not a pass: what greedy would have done.
    let greedy = match strategy {
        StrategyKind::Exact => Some(
            StrategyKind::Greedy
                .plan(&sequenced, &RematOptions::for_target(budget, target), target, link)
                .context("planning greedy for comparison")?,
        ),
        _ => None,
    };
    Ok(Some(PlanReport { budget, plan, xla_before, xla_after, greedy }))
}

impl PlanReport {
    pub fn json(&self) -> Value {
        let p = &self.plan;
        let xla = |m: &CompiledMemoryStats| json!({"temp_bytes": m.temp_size_in_bytes, "peak_bytes": m.held_bytes()});
        // Live bytes (what the plan is made on) and what XLA allocates for
        // them (`PeakMemory::allocated_bytes`, to hold against XLA's figures).
        let predicted = |m: &PeakMemory| {
            json!({
                "temp_bytes": m.temp_peak_bytes, "peak_bytes": m.peak_bytes,
                "allocated_temp_bytes": m.allocated_temp_bytes, "allocated_bytes": m.allocated_bytes,
            })
        };
        json!({
            "strategy": p.strategy,
            "budget_bytes": p.budget_bytes,
            "activation_fraction": match self.budget {
                RematBudget::FractionOfActivations(f) => Some(f),
                RematBudget::Bytes(_) => None,
            },
            "met": p.met,
            "recomputed": p.recomputed.iter().map(|c| json!({
                "value": c.value.to_string(), "op": c.op, "bytes": c.bytes,
                "also": c.also.iter().map(|v| v.to_string()).collect::<Vec<_>>(),
                "recomputed_nodes": c.recomputed_nodes, "flops": c.flops,
            })).collect::<Vec<_>>(),
            "offloaded": p.offloaded.iter().map(|c| json!({
                "value": c.value.to_string(), "op": c.op, "bytes": c.bytes,
            })).collect::<Vec<_>>(),
            "greedy": self.greedy.as_ref().map(|g| json!({
                "met": g.met, "peak_bytes": g.after.peak_bytes, "extra_flops": g.extra_flops,
                "values_recomputed": g.values_recomputed(),
            })),
            "bytes_saved": p.before.peak_bytes.saturating_sub(p.after.peak_bytes),
            "extra_flops": p.extra_flops,
            "extra_roofline_seconds": p.extra_seconds,
            "predicted": {
                "before": predicted(&p.before),
                "after": predicted(&p.after),
            },
            "xla": {
                "before": self.xla_before.as_ref().map(xla),
                "after": self.xla_after.as_ref().ok().map(xla),
            },
        })
    }

    pub fn text(&self) -> String {
        let p = &self.plan;
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0));
        let budget = match self.budget {
            RematBudget::FractionOfActivations(f) => {
                format!("{} ({:.0}% of the activation memory)", mib(p.budget_bytes), f * 100.0)
            }
            RematBudget::Bytes(_) => mib(p.budget_bytes),
        };
        let mut lines = vec![format!(
            "remat ({}): budget {}, {}; {} value(s) recomputed in {} recomputation(s), peak {} -> {} predicted ({} saved), {} extra FLOPs ({:.3} ms on {})",
            p.strategy,
            budget,
            if p.met {
                "met".to_string()
            } else {
                let over = p.after.peak_bytes.saturating_sub(p.budget_bytes);
                format!("not met (the lowest peak found, {:.1} KiB over it)", over as f64 / 1024.0)
            },
            p.values_recomputed(),
            p.recomputed.len(),
            mib(p.before.peak_bytes),
            mib(p.after.peak_bytes),
            mib(p.before.peak_bytes.saturating_sub(p.after.peak_bytes)),
            p.extra_flops,
            p.extra_seconds * 1e3,
            kiln::compiler::target::Target::H100_SXM_MEASURED.name,
        )];
        lines.push(format!(
            "  predicted temporaries {} -> {}; as XLA allocates them, temporaries {} -> {}, args + outputs + temps {} -> {}",
            mib(p.before.temp_peak_bytes),
            mib(p.after.temp_peak_bytes),
            mib(p.before.allocated_temp_bytes),
            mib(p.after.allocated_temp_bytes),
            mib(p.before.allocated_bytes),
            mib(p.after.allocated_bytes)
        ));
        match (&self.xla_before, &self.xla_after) {
            (Some(b), Ok(a)) => lines.push(format!(
                "  XLA temporaries {} -> {}, XLA peak (args + outputs + temps) {} -> {}",
                mib(b.temp_size_in_bytes as u64),
                mib(a.temp_size_in_bytes as u64),
                mib(b.held_bytes() as u64),
                mib(a.held_bytes() as u64)
            )),
            (_, Err(e)) => lines.push(format!("  XLA gave no memory stats for the planned program: {e}")),
            (None, Ok(a)) => lines.push(format!("  XLA temporaries after: {}", mib(a.temp_size_in_bytes as u64))),
        }
        if let Some(g) = &self.greedy {
            // Met first, then the lower peak where neither meets it, then
            // the fewer FLOPs.
            let key = |met: bool, peak: u64, flops: u64| (!met, if met { 0 } else { peak }, flops);
            let better = key(g.met, g.after.peak_bytes, g.extra_flops) < key(p.met, p.after.peak_bytes, p.extra_flops);
            lines.push(format!(
                "  greedy at the same budget: {}, peak {} predicted, {} value(s) recomputed, {} extra FLOPs{}",
                if g.met { "met" } else { "not met" },
                mib(g.after.peak_bytes),
                g.values_recomputed(),
                g.extra_flops,
                if better { " (better than exact here: --remat-strategy greedy)" } else { "" }
            ));
        }
        for c in p.recomputed.iter().take(20) {
            let also = match c.also.len() {
                0 => String::new(),
                n => format!(" and {n} more value(s) with it"),
            };
            lines.push(format!(
                "  recompute {}{also} ({}, {}, {} node(s), {} FLOPs)",
                c.value,
                c.op,
                mib(c.bytes),
                c.recomputed_nodes,
                c.flops
            ));
        }
        if p.recomputed.len() > 20 {
            lines.push(format!("  ... and {} more", p.recomputed.len() - 20));
        }
        if !p.offloaded.is_empty() {
            let bytes: u64 = p.offloaded.iter().map(|c| c.bytes).sum();
            lines.push(format!("  {} value(s) offloaded to pinned host memory ({})", p.offloaded.len(), mib(bytes)));
        }
        if p.offloaded.is_empty() && p.strategy == "host-copy" {
            lines.push(format!(
                "  no value copied to the host: greedy's plan alone was the strategy's best \
                 (the least added time by the model, a trip priced at {:.0} µs, or over the budget \
                 the lowest peak; docs/memory-journal.md, \"What a copy costs\")",
                HOST_COPY_TRIP_SECONDS * 1e6
            ));
        }
        for c in p.offloaded.iter().take(20) {
            lines.push(format!("  offload {} ({}, {})", c.value, c.op, mib(c.bytes)));
        }
        lines.join("\n") + "\n"
    }
}

/// Live bytes over the step (position in the execution order, as a fraction
/// of the step so both programs share the x axis), before and after.
/// `--memory-plot` draws SVG: a path that names another format (`live.png`)
/// is refused rather than given SVG under that name. A path with no
/// extension is the user's to name.
pub fn check_plot_path(path: &Path) -> anyhow::Result<()> {
    match path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()) {
        Some(ext) if ext != "svg" => {
            anyhow::bail!("--memory-plot {}: the plot is SVG, not .{ext}: give a path ending in .svg", path.display())
        }
        _ => Ok(()),
    }
}

fn plot(path: &Path, before: &Graph, after: &Graph, fusion: &dyn Materialization) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let curve = |g: &Graph| -> Vec<(f64, f64)> {
        let c = liveness(g, fusion).live_curve();
        let n = c.len().max(2) as f64 - 1.0;
        c.iter().enumerate().map(|(i, &b)| (i as f64 / n, b as f64 / (1024.0 * 1024.0))).collect()
    };
    let (a, b) = (curve(before), curve(after));
    let top = a.iter().chain(&b).map(|p| p.1).fold(0.0f64, f64::max) * 1.05 + 1e-3;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("live bytes over the step", ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..1.0, 0.0..top)
            .map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?;
        chart
            .configure_mesh()
            .x_desc("fraction of the step (execution order)")
            .y_desc("MiB live")
            .draw()
            .map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?;
        chart
            .draw_series(LineSeries::new(a, &RED))
            .map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?
            .label("without remat")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        chart
            .draw_series(LineSeries::new(b, &BLUE))
            .map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?
            .label("with the plan")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?;
        root.present().map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?;
    }
    // Through symlinks to their target, never over a directory or a device,
    // and no temp file left behind.
    kiln::atomic_write::write_atomically(path, svg.as_bytes())?;
    Ok(())
}

/// What `kiln profile <model> --max-batch` sizes: a training loop's
/// configuration, whose batch the search sets.
pub enum AdvisedModel {
    Mlp { cfg: kiln::models::mlp::MlpConfig },
    Gpt { cfg: kiln::models::gpt::GptConfig },
}

/// The step `kiln train` runs for `model` at batch `batch`, recorded and not
/// run: forward, loss, gradients and the AdamW update, parameters and moments
/// among its arguments.
fn step_graph(model: &AdvisedModel, batch: usize) -> anyhow::Result<Graph> {
    use kiln::models::{gpt, mlp};
    Ok(match model {
        AdvisedModel::Mlp { cfg } => {
            let cfg = mlp::MlpConfig { batch, ..cfg.clone() };
            mlp::recorded_train_step(&cfg)?
        }
        AdvisedModel::Gpt { cfg } => gpt::recorded_train_step(&gpt::GptConfig { batch, ..cfg.clone() })?,
    })
}

/// One answer of `--max-batch`: the largest batch whose step fits, without
/// or with remat.
struct Advice {
    remat: bool,
    /// The largest batch by kiln's peak model (what XLA allocates, `PeakMemory::allocated_bytes`).
    model_batch: Option<usize>,
    /// The largest batch whose compiled program fits too (`model_batch` where
    /// XLA gives no stats).
    batch: Option<usize>,
    predicted_peak_bytes: u64,
    /// XLA's compiled peak of `batch`'s step (arguments, outputs not donated
    /// into them, temporaries).
    xla_peak_bytes: Option<u64>,
    /// Larger batches the model fits and XLA's program does not: (batch,
    /// predicted peak, XLA's peak).
    over_in_xla: Vec<(usize, u64, u64)>,
}

/// The spacing of the batches `--max-batch` answers with around `b`: an
/// eighth of the power of two at or below it (1 below 16), so answers are
/// within 12.5% of the largest batch that fits and stay round (4608, 5120).
fn batch_step(b: usize) -> usize {
    let octave = 1usize << (usize::BITS - 1 - b.max(1).leading_zeros());
    (octave / 8).max(1)
}

/// The largest batch on `batch_step`'s grid at or below `b` (at least 1).
fn on_batch_grid(b: usize) -> usize {
    let b = b.max(1);
    b - b % batch_step(b)
}

/// The largest batch `--max-batch` tries: an answer of this batch means
/// "at least", and says so.
pub const MAX_BATCH_SEARCHED: usize = 1 << 20;

/// The largest batch whose training step fits `device_bytes`, without and
/// with remat: found by kiln's peak model (doubling, then halving the gap
/// between the last batch that fits and the first that does not), then
/// checked by compiling the step through `client` (not run). Each step is
/// the one `kiln train` would compile on `client`: the same recorded step,
/// the same pipeline for its platform (with remat, the one `kiln train
/// --memory-limit <device_bytes>` runs), lowered for it. Where XLA's program
/// holds more than the device (the CPU plugin schedules a planned step its own
/// way, `docs/memory.md`), the search goes on below it in XLA, and the
/// answers XLA refused are reported.
pub fn max_batch(model: &AdvisedModel, device_bytes: u64, client: &Client, json: bool) -> anyhow::Result<()> {
    use kiln::compiler::pipeline::{self, PipelineOptions};
    let target = kiln::compiler::LowerTarget::from_platform(client.platform_name());
    let fusion = fusion_for(target);
    // Each batch's step through the default passes, made once: the remat
    // search plans on the same graphs, through the passes a memory limit adds
    // (the training pipeline's list, in two runs).
    let mut optimized = std::collections::BTreeMap::<usize, Graph>::new();
    let mut predicted = |b: usize, remat: bool| -> anyhow::Result<(u64, Graph)> {
        let optimize = |g: &Graph, opts: &PipelineOptions| {
            pipeline::run(g, opts, &mut |_, _| {}).with_context(|| format!("optimizing the batch-{b} step"))
        };
        let g = match optimized.entry(b) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(optimize(&step_graph(model, b)?, &PipelineOptions::default().with_target(target))?.graph)
            }
        };
        if !remat {
            return Ok((kiln::compiler::analysis::peak_memory(g, fusion).allocated_bytes, g.clone()));
        }
        let opts = PipelineOptions { passes: Vec::new(), prune_params: false, ..PipelineOptions::default() }
            .with_target(target)
            .with_memory_limit(Some(device_bytes));
        let out = optimize(g, &opts)?;
        let plan = out.stats.passes.iter().find_map(|p| p.remat()).context("no remat pass ran")?;
        Ok((plan.after.allocated_bytes, out.graph))
    };
    // XLA's peak of the compiled step; `None` where the plugin gives no stats.
    let compiled_peak = |g: &Graph| -> anyhow::Result<Option<u64>> {
        let module =
            lower(g, &LowerOptions { target, loop_kernels: kiln::loop_kernels()?, ..LowerOptions::default() })?;
        let exe = client.compile(&module, &CompileOptions::default()).context("compiling the advised step")?;
        Ok(exe.compiled_memory_stats().ok().map(|m| m.held_bytes().max(0) as u64))
    };
    let mut rows = Vec::new();
    let mut advice = Vec::new();
    for remat in [false, true] {
        let mut best: Option<(usize, u64, Graph)> = None;
        // A batch's plan is made once (XLA's search may come back to a batch
        // the model's tried: gpt2-small's plans take seconds each).
        let mut probed = std::collections::BTreeMap::<usize, (u64, Graph)>::new();
        let mut probe = |b: usize| -> anyhow::Result<(u64, Graph)> {
            if let Some((peak, g)) = probed.get(&b) {
                return Ok((*peak, g.clone()));
            }
            let t = std::time::Instant::now();
            let (peak, g) = predicted(b, remat)?;
            tracing::info!(batch = b, remat, peak, ms = t.elapsed().as_millis() as u64, "max-batch: predicted");
            rows.push(json!({"batch": b, "remat": remat, "predicted_peak_bytes": peak, "fits": peak <= device_bytes}));
            probed.insert(b, (peak, g.clone()));
            Ok((peak, g))
        };
        // Doubling finds a batch the model fits and one it does not; halving
        // the gap between them, on the grid of `batch_step`, finds the
        // largest it fits. A batch that fits without remat fits with it (its
        // plan recomputes nothing), so the remat search starts at the other's
        // answer.
        let mut b = advice.first().and_then(|a: &Advice| a.model_batch).filter(|_| remat).unwrap_or(1);
        let mut over = None;
        while b <= MAX_BATCH_SEARCHED {
            let (peak, g) = probe(b)?;
            if peak > device_bytes {
                over = Some(b);
                break;
            }
            best = Some((b, peak, g));
            b *= 2;
        }
        if let (Some(mut hi), Some(mut lo)) = (over, best.as_ref().map(|x| x.0)) {
            while hi - lo > batch_step(lo) {
                let mid = on_batch_grid(lo + (hi - lo) / 2);
                let (peak, g) = probe(mid)?;
                if peak > device_bytes {
                    hi = mid;
                } else {
                    (lo, best) = (mid, Some((mid, peak, g)));
                }
            }
        }
        let mut a = Advice {
            remat,
            model_batch: best.as_ref().map(|x| x.0),
            batch: None,
            predicted_peak_bytes: 0,
            xla_peak_bytes: None,
            over_in_xla: Vec::new(),
        };
        // Where XLA's program holds more than the device, the search goes on
        // in XLA between the largest batch known to fit (with remat, the
        // answer without it, whose step a plan leaves as it is) and the
        // smallest it refused: first where XLA's overshoot of the model's
        // answer points, then halving the gap on the grid.
        let plain = advice
            .first()
            .filter(|_| remat)
            .and_then(|p: &Advice| p.batch.map(|b| (b, p.predicted_peak_bytes, p.xla_peak_bytes)));
        let mut fit = plain;
        let mut refused: Option<usize> = None;
        let mut next = best.take();
        while let Some((b, peak, g)) = next.take() {
            let t = std::time::Instant::now();
            let xla = compiled_peak(&g)?;
            tracing::info!(batch = b, remat, ?xla, ms = t.elapsed().as_millis() as u64, "max-batch: compiled");
            let mut guess = 0;
            match xla {
                Some(x) if x > device_bytes => {
                    a.over_in_xla.push((b, peak, x));
                    // Where the overshoot points, the first time; after
                    // that it has been seen to point too high.
                    if refused.is_none() {
                        guess = on_batch_grid((b as f64 * device_bytes as f64 / x as f64) as usize);
                    }
                    refused = Some(b);
                }
                _ => fit = Some((b, peak, xla)),
            }
            // The model's answer fits in XLA: nothing larger fits the model.
            let Some(mut hi) = refused else { break };
            // The next batch to compile lies strictly between `lo` (fits in
            // XLA, or 0) and `hi` (refused by XLA or by the model).
            let lo = fit.map_or(0, |f| f.0);
            while hi - lo > batch_step(lo) {
                if guess <= lo || guess >= hi {
                    guess = on_batch_grid(lo + (hi - lo) / 2);
                }
                let (peak, g) = probe(guess)?;
                if peak <= device_bytes {
                    next = Some((guess, peak, g));
                    break;
                }
                hi = guess;
            }
            refused = Some(hi);
        }
        if let Some((b, peak, xla)) = fit {
            (a.batch, a.predicted_peak_bytes, a.xla_peak_bytes) = (Some(b), peak, xla);
        }
        advice.push(a);
    }
    let summary: Vec<Value> = advice
        .iter()
        .map(|a| {
            json!({
                "remat": a.remat,
                "max_batch": a.batch,
                "model_max_batch": a.model_batch,
                "search_capped": a.model_batch == Some(MAX_BATCH_SEARCHED),
                "predicted_peak_bytes": a.batch.map(|_| a.predicted_peak_bytes),
                "xla_peak_bytes": a.xla_peak_bytes,
                "over_in_xla": a.over_in_xla.iter().map(|&(b, p, x)| json!({
                    "batch": b, "predicted_peak_bytes": p, "xla_peak_bytes": x
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    // `kiln train` without a byte limit grows the CUDA plugin's pool region by
    // region unless told to reserve it (`KILN_GPU_PREALLOCATE`); with one it
    // reserves the pool (the frontend's executor).
    let grows = client.platform_name() != "cpu" && {
        let mut loops = kiln::runtime::ClientOptions::default();
        kiln::runtime::GpuMemory::from_env()?.apply(&mut loops);
        loops.preallocate == Some(false)
    };
    let out = json!({
        "device_memory_bytes": device_bytes,
        "platform": client.platform_name(),
        "gpu_pool_grows": grows,
        "search": rows,
        "max_batch": summary
    });
    if json {
        println!("{out}");
        return Ok(());
    }
    let name = match model {
        AdvisedModel::Mlp { .. } => "mlp",
        AdvisedModel::Gpt { .. } => "gpt",
    };
    print!("{}", max_batch_report(&advice, name, device_bytes, client.platform_name(), grows));
    Ok(())
}

/// `--max-batch`'s text answer for model `name` (`mlp`, `gpt`).
fn max_batch_report(advice: &[Advice], name: &str, device_bytes: u64, platform: &str, grows: bool) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "largest batch (in steps of an eighth of a power of two) whose training step (parameters, AdamW moments, gradients, the update) \
         fits {} on {platform}, by kiln's peak model, checked by compiling the step with XLA (not run):",
        kiln::metrics::bytes(device_bytes)
    );
    for a in advice {
        let label = if a.remat { "with remat" } else { "without remat" };
        match a.batch {
            Some(b) => {
                let xla = a.xla_peak_bytes.map_or("no stats".to_string(), kiln::metrics::bytes);
                let _ = writeln!(
                    o,
                    "  {label:<13} batch {b:>6}: predicted peak {}, XLA {xla}",
                    kiln::metrics::bytes(a.predicted_peak_bytes)
                );
                if b == MAX_BATCH_SEARCHED {
                    let _ = writeln!(o, "  {:<13} (the search stops there: larger batches were not tried)", "");
                }
            }
            None => {
                let _ = writeln!(o, "  {label:<13} not even batch 1 fits");
            }
        }
        for &(ob, p, x) in &a.over_in_xla {
            let _ = writeln!(
                o,
                "  {:<13} batch {ob:>6} fits by the model ({}), not in XLA's program ({})",
                "",
                kiln::metrics::bytes(p),
                kiln::metrics::bytes(x)
            );
        }
    }
    if grows && advice.iter().any(|a| !a.remat && a.batch.is_some()) {
        let _ = writeln!(
            o,
            "  without remat, `kiln train` grows the GPU's pool as it goes: a step within a few GiB of the limit \
             may need KILN_GPU_PREALLOCATE=true"
        );
    }
    let plain = advice.iter().find(|a| !a.remat).and_then(|a| a.batch);
    match advice.iter().find(|a| a.remat).and_then(|a| a.batch) {
        Some(b) if b == MAX_BATCH_SEARCHED && plain == Some(b) => {
            let _ = writeln!(o, "  `kiln train {name} --batch {b}` fits without remat");
        }
        Some(b) if Some(b) == plain => {
            let _ =
                writeln!(o, "  remat does not raise the batch here: `kiln train {name} --batch {b}` fits without it");
        }
        Some(b) => {
            let _ = writeln!(
                o,
                "  with remat, `kiln train {name} --batch {b} --memory-limit {device_bytes}` (and the same settings) \
                 compiles the plan sized here"
            );
        }
        None => {}
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("--x", "2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("--x", "2G").unwrap(), 2 << 30);
        let e = parse_bytes("--device-memory", "2 parsecs").unwrap_err().to_string();
        assert!(e.contains("--device-memory 2 parsecs: not a size") && e.contains("KiB"), "{e}");
        assert!(parse_bytes("--x", "-1").is_err());
        let e = parse_budget("2XB").unwrap_err().to_string();
        assert!(e.starts_with("--memory-limit 2XB: not a size"), "{e}");
        assert_eq!(parse_budget("50%").unwrap(), RematBudget::FractionOfActivations(0.5));
        assert!(parse_budget("0%").is_err());
        let e = parse_budget("0.5").unwrap_err().to_string();
        assert!(e.contains("0.5 bytes is less than one") && e.contains("write 50%"), "{e}");
        assert!(parse_budget("0.333").unwrap_err().to_string().contains("write 33.3%"));
        assert_eq!(parse_budget("0").unwrap(), RematBudget::Bytes(0));
        assert_eq!(parse_budget("1.5e9").unwrap(), RematBudget::Bytes(1_500_000_000));
    }

    /// The answers' grid: every batch below 16, then eight batches an
    /// octave, and a grid point stays where it is.
    #[test]
    fn batches_lie_on_a_grid_of_eighths() {
        assert_eq!(
            (0..=17).map(on_batch_grid).collect::<Vec<_>>(),
            [1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 16]
        );
        assert_eq!([4096, 4607, 4608, 5119, 8191, 8192].map(on_batch_grid), [4096, 4096, 4608, 4608, 7680, 8192]);
        assert_eq!([1, 15, 16, 4096, 5000, MAX_BATCH_SEARCHED].map(batch_step), [1, 1, 2, 512, 512, 1 << 17]);
        for b in 1..5000 {
            let g = on_batch_grid(b);
            assert!(g <= b && b - g < batch_step(b) && on_batch_grid(g) == g, "{b} -> {g}");
        }
    }

    fn advice(remat: bool, batch: Option<usize>) -> Advice {
        Advice {
            remat,
            model_batch: batch,
            batch,
            predicted_peak_bytes: 3 << 30,
            xla_peak_bytes: Some(3 << 30),
            over_in_xla: Vec::new(),
        }
    }

    /// An answer at the search's last batch says that larger ones were not
    /// tried, and makes no claim about what remat would add; below it, equal
    /// answers say remat does not raise the batch, and a larger remat answer
    /// names the command that compiles its plan.
    #[test]
    fn max_batch_report_says_where_the_search_stopped() {
        let top = Some(MAX_BATCH_SEARCHED);
        let r = max_batch_report(&[advice(false, top), advice(true, top)], "mlp", 100 << 30, "cpu", false);
        assert_eq!(r.matches("the search stops there").count(), 2, "{r}");
        assert!(r.contains(&format!("`kiln train mlp --batch {MAX_BATCH_SEARCHED}` fits without remat")), "{r}");
        assert!(!r.contains("does not raise"), "{r}");

        let r = max_batch_report(&[advice(false, Some(64)), advice(true, Some(64))], "mlp", 1 << 30, "cpu", false);
        assert!(r.contains("remat does not raise the batch here: `kiln train mlp --batch 64` fits without it"), "{r}");
        assert!(!r.contains("search stops"), "{r}");

        let r = max_batch_report(&[advice(false, Some(8)), advice(true, Some(32))], "gpt", 1 << 30, "cuda", true);
        assert!(r.contains(&format!("`kiln train gpt --batch 32 --memory-limit {}`", 1u64 << 30)), "{r}");
        assert!(r.contains("KILN_GPU_PREALLOCATE=true"), "{r}");

        let r = max_batch_report(&[advice(false, None), advice(true, None)], "gpt", 1 << 20, "cpu", false);
        assert_eq!(r.matches("not even batch 1 fits").count(), 2, "{r}");
    }
}
