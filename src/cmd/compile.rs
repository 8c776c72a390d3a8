//! `kiln compile FILE`: compiles a saved step graph and reports what each stage did.
//!
//! FILE holds one graph in kiln's text form (`compiler::text`, the form the
//! frontend saves under `KILN_SAVE_GRAPHS=dir`). The command runs the stages a
//! training step's graph goes through: parse, verify, `pipeline::optimize`,
//! lower to StableHLO, compile through a PJRT client. One difference: the
//! frontend prunes unused parameters before optimizing, while here parameters
//! are kept as saved, so the compiled signature is the file's.
//!
//! It reports node counts before and after optimization and what the passes
//! did, the cost model's FLOPs and bytes with roofline estimates on the
//! built-in targets, the compile time, and the executable's compiled memory
//! stats. FLOPs, bytes and the roofline are those of the optimized graph, the
//! program XLA receives (before XLA's own fusion).
//!
//! Output: stdout carries exactly one thing, so that it can be piped. That is
//! the report (text, or one JSON object with `--json`), unless `--emit` prints
//! an artifact there; the text report then goes to stderr. With `--out FILE`
//! the artifact is written to FILE instead (a temporary file renamed into
//! place, so a reader never sees half a module) and stdout keeps the report.

use std::io::{IsTerminal, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use indicatif::{ProgressBar, ProgressStyle};
use kiln::compiler::composite::{self, Decision, Fused};
use kiln::compiler::cost::{self, GraphCost};
use kiln::compiler::fusion::FusionPlan;
use kiln::compiler::pipeline::{self, PipelineOptions, PipelineStats};
use kiln::compiler::target::Target;
use kiln::compiler::{lower, text, verify, CompileError, LowerOptions, LowerTarget};
use kiln::runtime::{Client, ClientOptions, CompileOptions, CompiledMemoryStats};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct CompileArgs {
    /// A step graph in kiln's text form.
    file: PathBuf,
    /// Number of data-parallel replicas to compile for, 1 to 4096 (on the CPU
    /// plugin, also the number of CPU devices the client creates).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    replicas: u32,
    /// The PJRT plugin `.so` to load (default: discovery through
    /// KILN_PJRT_PLUGIN and PJRT_DEVICE).
    #[arg(long, value_name = "PATH")]
    plugin: Option<PathBuf>,
    /// Print an artifact on stdout (the text report moves to stderr).
    #[arg(long, value_enum)]
    emit: Option<Emit>,
    /// Write the `--emit` artifact to FILE instead of stdout.
    #[arg(long, value_name = "FILE", requires = "emit")]
    out: Option<PathBuf>,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// Run these optimizer passes, in this order (comma-separated; see
    /// `compiler::pipeline::ALL_PASSES`), instead of the default list: bisect
    /// a pass by dropping it. An empty value runs none.
    #[arg(long, value_name = "A,B,C", value_delimiter = ',', num_args = 0..)]
    passes: Option<Vec<String>>,
    /// The default passes without the equality-saturation rewrite.
    #[arg(long, conflicts_with = "passes")]
    no_rewrite: bool,
    #[command(flatten)]
    memory: super::memory::MemoryArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Emit {
    /// The lowered StableHLO module.
    Stablehlo,
    /// The optimized graph in kiln's text form.
    Graph,
}

impl Emit {
    fn name(self) -> &'static str {
        match self {
            Emit::Stablehlo => "stablehlo",
            Emit::Graph => "graph",
        }
    }
}

/// Everything the report shows.
struct Report {
    file: PathBuf,
    replicas: usize,
    platform: String,
    plugin: PathBuf,
    stats: PipelineStats,
    /// Fusion groups of the optimized graph.
    fusion: FusionPlan,
    /// Op names of each node of the optimized graph (for listing groups).
    op_names: Vec<&'static str>,
    /// Composites found in the saved graph and the plain nodes each replaced,
    /// and the candidates left plain with the reason.
    composites: Fused,
    /// Per composite of the optimized graph: fused on the target, or why not.
    decisions: Vec<Decision>,
    cost: GraphCost,
    /// `(target name, seconds)` for each built-in target.
    roofline: Vec<(&'static str, f64)>,
    optimize: Duration,
    /// The target preparation's passes ([`lower::TARGET_PASSES`]).
    target_passes: Vec<pipeline::PassStats>,
    lower: Duration,
    compile: Duration,
    stablehlo_bytes: usize,
    memory: Result<CompiledMemoryStats, String>,
    /// The remat plan (`--memory-limit`).
    plan: Option<super::memory::PlanReport>,
    /// Where `--out` wrote the artifact.
    written: Option<(Emit, PathBuf)>,
}

pub fn run(args: &CompileArgs) -> anyhow::Result<()> {
    if args.json && args.emit.is_some() && args.out.is_none() {
        bail!("--json and --emit both print to stdout: add --out FILE to write the artifact to a file");
    }
    // Output paths are checked before the work that fills them.
    if let Some(plot) = &args.memory.memory_plot {
        super::memory::check_plot_path(plot)?;
    }
    let outputs = args.out.iter().map(|p| ("--out", p));
    for (flag, out) in outputs.chain(args.memory.memory_plot.iter().map(|p| ("--memory-plot", p))) {
        kiln::atomic_write::check_writable(out).with_context(|| format!("{flag} {}", out.display()))?;
    }
    // Flags are read before the graph and XLA's compile.
    super::memory::check_args(&args.memory, args.plugin.is_none())?;
    let replicas = args.replicas as usize;
    let path = &args.file;
    // The text is dropped once parsed: a graph of large constants holds
    // their text through XLA's compile otherwise.
    let graph = text::parse(&super::read_graph_text(path)?).map_err(|e| located(path, e))?;
    verify(&graph).with_context(|| format!("{}: the graph does not verify", path.display()))?;
    super::check_graph_memory(&graph, path, false)?;
    let mut graph = graph;
    let composites = composite::fuse(&mut graph, &mut composite::ConstCache::new(), composite::FuseOptions::default())
        .with_context(|| format!("finding composites in {}", path.display()))?;
    // The module is lowered for the plugin it will be compiled by.
    let cuda = match &args.plugin {
        Some(p) => p.to_string_lossy().contains("cuda"),
        None => kiln::runtime::PjrtDevice::from_env()? != kiln::runtime::PjrtDevice::Cpu,
    };
    let target = if cuda { LowerTarget::Cuda } else { LowerTarget::Cpu };

    let mut popts = PipelineOptions { prune_params: false, verify: true, ..PipelineOptions::default() };
    if let Some(passes) = &args.passes {
        popts.passes = passes.iter().filter(|p| !p.is_empty()).cloned().collect();
    }
    if args.no_rewrite {
        popts = popts.without_rewrite();
    }
    let mut dump = kiln::dump::Dump::from_env();
    let started = Instant::now();
    let out = pipeline::run(&graph, &popts, &mut |p, g| dump.observe(p, g))
        .with_context(|| format!("optimizing {}", path.display()))?;
    let optimize = started.elapsed();
    let fusion = kiln::compiler::fusion::plan_fusion(&out.graph);
    let (optimized, stats) = (out.graph, out.stats);
    let cost = cost::graph_cost(&optimized);
    let roofline = Target::ALL.iter().map(|t| (t.name, cost::estimate_seconds(&optimized, t))).collect();

    let started = Instant::now();
    let decisions = composite::decisions(&optimized, target);
    let lower_opts =
        LowerOptions { num_replicas: replicas, target, shardings: None, loop_kernels: kiln::loop_kernels()? };
    let prepared = lower::prepare(&optimized, &lower_opts, popts.verify, &mut |p, g| dump.observe(p, g))
        .with_context(|| format!("preparing {} for {target:?}", path.display()))?;
    dump.finish()?;
    let module = lower::print(&prepared).with_context(|| format!("lowering {}", path.display()))?;
    let target_passes = prepared.stats;
    let lower_time = started.elapsed();

    let spinner = spinner(args.json, &format!("compiling {} ({replicas} replica(s))", path.display()));
    let compiled = compile(&module, replicas, args.plugin.clone());
    spinner.finish_and_clear();
    let (client, exe, compile_time) = compiled?;
    let memory = exe.compiled_memory_stats().map_err(|e| e.to_string());
    let plan = super::memory::plan_and_compile(&args.memory, &optimized, &client, replicas, memory.clone().ok())?;

    let artifact = args.emit.map(|emit| match emit {
        Emit::Stablehlo => module.clone(),
        Emit::Graph => text::print(&optimized),
    });
    let written = match (args.emit, &args.out, &artifact) {
        (Some(emit), Some(out), Some(artifact)) => {
            kiln::atomic_write::write_atomically(out, artifact.as_bytes())?;
            Some((emit, out.clone()))
        }
        _ => None,
    };

    let report = Report {
        file: path.clone(),
        replicas,
        platform: client.platform_name().to_string(),
        plugin: client.plugin_path().to_path_buf(),
        stats,
        op_names: optimized.nodes().map(|(_, n)| n.op.name()).collect(),
        fusion,
        composites,
        decisions,
        cost,
        roofline,
        optimize,
        target_passes,
        lower: lower_time,
        compile: compile_time,
        stablehlo_bytes: module.len(),
        memory,
        plan,
        written,
    };
    match (args.out.is_none(), artifact) {
        (true, Some(artifact)) => {
            let mut stdout = std::io::stdout().lock();
            stdout.write_all(artifact.as_bytes()).context("writing to stdout")?;
            stdout.flush().context("writing to stdout")?;
            eprint!("{}", report.text());
        }
        _ if args.json => println!("{}", report.json()),
        _ => print!("{}", report.text()),
    }
    Ok(())
}

/// Creates the client and compiles `module` for `replicas` replicas.
fn compile(
    module: &str,
    replicas: usize,
    plugin: Option<PathBuf>,
) -> anyhow::Result<(Client, kiln::runtime::Executable, Duration)> {
    // The CPU plugin exposes one device unless told otherwise; other plugins
    // have the devices they have, and a too-small count is caught below.
    // Only the CPU plugin knows `cpu_device_count`: send it only when the CPU
    // plugin is the one discovery will pick.
    let on_cpu = plugin.is_none() && kiln::runtime::PjrtDevice::from_env()? == kiln::runtime::PjrtDevice::Cpu;
    let cpu_device_count = (replicas > 1 && on_cpu).then_some(replicas);
    let client = Client::new(&ClientOptions { plugin, cpu_device_count, ..ClientOptions::default() })
        .context("creating the PJRT client")?;
    let devices = client.devices().len();
    if devices < replicas {
        bail!(
            "--replicas {replicas} needs {replicas} devices, but the {} plugin ({}) has {devices}",
            client.platform_name(),
            client.plugin_path().display()
        );
    }
    let started = Instant::now();
    let exe = client
        .compile(module, &CompileOptions { num_replicas: replicas, ..CompileOptions::default() })
        .context("compiling the StableHLO module through PJRT")?;
    Ok((client, exe, started.elapsed()))
}

/// A parse error as `FILE:LINE: reason`, the form editors jump to.
fn located(path: &Path, e: CompileError) -> anyhow::Error {
    match e {
        CompileError::Parse { line, reason } => anyhow::anyhow!("{}:{line}: {reason}", path.display()),
        other => anyhow::Error::new(other).context(format!("parsing {}", path.display())),
    }
}

/// A spinner on stderr while the plugin compiles; hidden for `--json` and
/// when stderr is not a terminal (logs and pipes get no control codes).
fn spinner(json: bool, message: &str) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(message.to_string());
    // The compile call blocks this thread, so the spinner ticks on its own.
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Seconds in the unit that keeps three significant digits readable: a small
/// graph's roofline is nanoseconds, a training step's milliseconds.
fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else if s >= 1e-6 {
        format!("{:.3} us", s * 1e6)
    } else {
        format!("{:.3} ns", s * 1e9)
    }
}

impl Report {
    fn json(&self) -> Value {
        let totals = |t: &cost::Totals| {
            json!({
                "nodes": t.nodes,
                "flops": t.flops,
                "transcendentals": t.transcendentals,
                "bytes_read": t.bytes_read,
                "bytes_written": t.bytes_written,
                "collective_bytes": t.collective_bytes,
            })
        };
        let by_op: serde_json::Map<String, Value> =
            self.cost.by_op.iter().map(|(name, t)| (name.to_string(), totals(t))).collect();
        let roofline: serde_json::Map<String, Value> =
            self.roofline.iter().map(|(name, s)| (name.to_string(), json!(s))).collect();
        let t = &self.cost.total;
        let mut v = json!({
            "file": self.file.display().to_string(),
            "platform": self.platform,
            "plugin": self.plugin.display().to_string(),
            "replicas": self.replicas,
            "nodes_before": self.stats.nodes_in,
            "nodes_after": self.stats.nodes_out,
            "passes": self.stats.passes.iter().map(|p| json!({
                "name": p.name,
                "nodes_in": p.nodes_in,
                "nodes_out": p.nodes_out,
                "ms": ms(p.time),
                "changed": p.changed,
                "rules_fired": p.rules_fired(),
                "stop_reason": p.stop_reason(),
            })).collect::<Vec<_>>(),
            "target_passes": self.target_passes.iter().map(|p| json!({
                "name": p.name,
                "nodes_in": p.nodes_in,
                "nodes_out": p.nodes_out,
                "ms": ms(p.time),
                "changed": p.changed,
            })).collect::<Vec<_>>(),
            "fusion": {
                "groups": self.fusion.num_groups(),
                "bytes_to_memory": self.fusion.bytes_to_memory(),
                "bytes_kept_on_chip": self.fusion.bytes_kept_on_chip(),
                "fused": self.fusion.fused_groups().map(|(id, nodes)| json!({
                    "group": id.0,
                    "nodes": nodes.iter().map(|n| n.index()).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            },
            "flops": t.flops,
            "transcendentals": t.transcendentals,
            "bytes_read": t.bytes_read,
            "bytes_written": t.bytes_written,
            "collective_bytes": t.collective_bytes,
            "by_op": by_op,
            "roofline_seconds": roofline,
            "optimize_ms": ms(self.optimize),
            "lower_ms": ms(self.lower),
            "compile_ms": ms(self.compile),
            "stablehlo_bytes": self.stablehlo_bytes,
            "memory": match &self.memory {
                Ok(m) => memory_json(m),
                Err(_) => Value::Null,
            },
        });
        if let Err(e) = &self.memory {
            v["memory_error"] = json!(e);
        }
        v["composites"] = self
            .composites
            .found
            .iter()
            .map(|f| json!({"kind": f.kind, "node": f.node.to_string(), "replaced": f.replaced.iter().map(ToString::to_string).collect::<Vec<_>>()}))
            .collect();
        v["composites_missed"] = self
            .composites
            .missed
            .iter()
            .map(|m| json!({"kind": m.kind, "node": m.node.to_string(), "reason": m.reason}))
            .collect();
        v["composite_lowering"] = self
            .decisions
            .iter()
            .map(|d| json!({"kind": d.kind, "node": d.node.to_string(), "fused": d.fused.is_ok(), "reason": d.fused.as_ref().err()}))
            .collect();
        if let Some(plan) = &self.plan {
            v["memory_plan"] = plan.json();
        }
        if let Some((emit, path)) = &self.written {
            v["emitted"] = json!({"kind": emit.name(), "path": path.display().to_string()});
        }
        v
    }

    fn text(&self) -> String {
        let st = &self.stats;
        let t = &self.cost.total;
        let roofline: Vec<String> =
            self.roofline.iter().map(|(name, secs)| format!("{name} {}", seconds(*secs))).collect();
        let mut lines = vec![
            format!("{}: {} nodes, {} after optimization", self.file.display(), st.nodes_in, st.nodes_out),
            format!(
                "cost: {} FLOPs ({} transcendental), {} bytes read, {} written, {} across replicas",
                t.flops, t.transcendentals, t.bytes_read, t.bytes_written, t.collective_bytes
            ),
            format!("roofline (unfused): {}", roofline.join(", ")),
            format!(
                "compiled for {} replica(s) on {} in {:.1} ms (optimize {:.2} ms, lower {:.2} ms, {} bytes of StableHLO); plugin {}",
                self.replicas,
                self.platform,
                ms(self.compile),
                ms(self.optimize),
                ms(self.lower),
                self.stablehlo_bytes,
                self.plugin.display()
            ),
            match &self.memory {
                Ok(m) => format!(
                    "memory: arguments {} B, outputs {} B, aliased {} B, temporaries {} B, generated code {} B; held at once (arguments + outputs - aliased + temporaries) {} B; the plugin's own peak field {} B",
                    m.argument_size_in_bytes,
                    m.output_size_in_bytes,
                    m.alias_size_in_bytes,
                    m.temp_size_in_bytes,
                    m.generated_code_size_in_bytes,
                    m.held_bytes(),
                    m.peak_memory_in_bytes
                ),
                Err(e) => format!("memory: the plugin gave no compiled memory stats: {e}"),
            },
        ];
        for p in &st.passes {
            let mut line =
                format!("  pass {:<13} {:>7} -> {:>7} nodes {:>9.2} ms", p.name, p.nodes_in, p.nodes_out, ms(p.time));
            if p.changed > 0 {
                line += &format!(", {} changed", p.changed);
            }
            if let Some(stop) = p.stop_reason() {
                line += &format!(", stopped: {stop}");
            }
            if !p.rules_fired().is_empty() {
                let fired: Vec<String> = p.rules_fired().iter().map(|(r, n)| format!("{r} {n}")).collect();
                line += &format!(", rules fired: {}", fired.join(", "));
            }
            lines.push(line);
        }
        for p in &self.target_passes {
            lines.push(format!(
                "  target pass {:<17} {:>7} -> {:>7} nodes {:>9.2} ms, {} changed",
                p.name,
                p.nodes_in,
                p.nodes_out,
                ms(p.time),
                p.changed
            ));
        }
        lines.push(format!(
            "fusion: {} groups, {} bytes reach memory, {} stay in fused kernels",
            self.fusion.num_groups(),
            self.fusion.bytes_to_memory(),
            self.fusion.bytes_kept_on_chip()
        ));
        let shown = 40;
        for (id, nodes) in self.fusion.fused_groups().take(shown) {
            let members: Vec<String> =
                nodes.iter().map(|n| format!("%{} {}", n.index(), self.op_names[n.index()])).collect();
            lines.push(format!("  group {}: {}", id.0, members.join(", ")));
        }
        let fused = self.fusion.fused_groups().count();
        if fused > shown {
            lines.push(format!("  ... and {} more fused groups (all in --json)", fused - shown));
        }
        for m in &self.composites.missed {
            lines.push(format!("composite {} at {} left plain: {}", m.kind, m.node, m.reason));
        }
        for f in &self.composites.found {
            let replaced: Vec<String> = f.replaced.iter().map(ToString::to_string).collect();
            lines.push(format!(
                "composite {} at {} replaces {} nodes: {}",
                f.kind,
                f.node,
                replaced.len(),
                replaced.join(" ")
            ));
        }
        for d in &self.decisions {
            lines.push(match &d.fused {
                Ok(()) => format!("{} {}: fused kernel", d.kind, d.node),
                Err(why) => format!("{} {}: plain expansion ({why})", d.kind, d.node),
            });
        }
        if let Some(plan) = &self.plan {
            lines.push(plan.text().trim_end().to_string());
        }
        if let Some((emit, path)) = &self.written {
            lines.push(format!("wrote the {} to {}", emit.name(), path.display()));
        }
        lines.push(self.cost.to_string());
        lines.join("\n")
    }
}

fn memory_json(m: &CompiledMemoryStats) -> Value {
    json!({
        "generated_code_size_in_bytes": m.generated_code_size_in_bytes,
        "argument_size_in_bytes": m.argument_size_in_bytes,
        "output_size_in_bytes": m.output_size_in_bytes,
        "alias_size_in_bytes": m.alias_size_in_bytes,
        "temp_size_in_bytes": m.temp_size_in_bytes,
        "host_generated_code_size_in_bytes": m.host_generated_code_size_in_bytes,
        "host_argument_size_in_bytes": m.host_argument_size_in_bytes,
        "host_output_size_in_bytes": m.host_output_size_in_bytes,
        "host_alias_size_in_bytes": m.host_alias_size_in_bytes,
        "host_temp_size_in_bytes": m.host_temp_size_in_bytes,
        "peak_memory_in_bytes": m.peak_memory_in_bytes,
        "held_bytes": m.held_bytes(),
    })
}
