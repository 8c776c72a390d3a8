//! The optimization pipeline: one [`Pass`] shape and one ordered list of them.
//!
//! Every caller (the frontend's miss path, `lower_with`, `kiln compile`,
//! `kiln profile`) goes through [`run`]: prune dead code (optionally dropping
//! unused parameters), then run the passes of [`PipelineOptions::passes`] in
//! order. After each pass, when [`PipelineOptions::verify`] is set (the
//! default, in every build), the verifier re-checks the graph, so a pass that
//! breaks an invariant is named where it ran ([`CompileError::AfterPass`]).
//!
//! The compiler stays pure: [`run`] takes an observer that sees the graph after
//! pruning and after every pass (the frontend writes `KILN_DUMP_DIR` files from
//! it), and returns per-pass [`PassStats`] (nodes in/out, time, what changed,
//! and each kind of pass's own [`PassReport`]) for the metrics report and
//! `kiln compile --json`.
//!
//! Invariant: no pass renumbers parameters. Only the prune stage before the
//! list drops unused ones, and it reports which it kept.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::ir::Graph;
use crate::passes::{
    eliminate_common_subexpressions, eliminate_dead_code, eliminate_dead_code_keep_params, fuse_lm_head_loss, Pruned,
};
use crate::remat::StrategyKind;
use crate::rewrite::{self, RewriteOptions};
use crate::CompileError;

/// What one pass did: what every pass reports, and its own report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassStats {
    pub name: &'static str,
    pub nodes_in: usize,
    pub nodes_out: usize,
    pub time: Duration,
    /// Nodes a pass merged or removed (CSE, DCE), values it recomputes (remat).
    pub changed: usize,
    /// FLOPs a pass added (remat's recomputation).
    pub extra_flops: u64,
    /// What this kind of pass has to say beyond that.
    pub report: PassReport,
}

/// A pass's own report: each kind of pass says its own things, so no pass
/// carries another's fields.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum PassReport {
    /// Nothing beyond [`PassStats`]' common figures.
    #[default]
    None,
    /// Equality saturation: how many times each rule fired, by name, and
    /// why the runner stopped (`saturated`, `iteration limit`, ...).
    Rewrite { rules_fired: BTreeMap<&'static str, usize>, stop_reason: String },
    /// A graph rule applied in one sweep (no e-graph): how many times each
    /// rule fired.
    Rules { rules_fired: BTreeMap<&'static str, usize> },
    /// The remat pass's plan (what the benches and `kiln compile` report).
    Remat(Box<RematSummary>),
}

impl PassStats {
    /// The rules a rewrite pass fired (empty for other passes).
    pub fn rules_fired(&self) -> BTreeMap<&'static str, usize> {
        match &self.report {
            PassReport::Rewrite { rules_fired, .. } | PassReport::Rules { rules_fired } => rules_fired.clone(),
            _ => BTreeMap::new(),
        }
    }

    /// Why a rewrite pass stopped.
    pub fn stop_reason(&self) -> Option<&str> {
        match &self.report {
            PassReport::Rewrite { stop_reason, .. } => Some(stop_reason),
            _ => None,
        }
    }

    /// The remat pass's plan.
    pub fn remat(&self) -> Option<&RematSummary> {
        match &self.report {
            PassReport::Remat(plan) => Some(plan),
            _ => None,
        }
    }
}

/// What the remat pass planned, in the peak model's bytes: the strategy's
/// [`crate::remat::RematPlan`] without its graph (the pass's output is the
/// graph).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RematSummary {
    /// The strategy's name ([`crate::remat::StrategyKind::name`]).
    pub strategy: &'static str,
    /// The budget the plan was made for (resolved from a fraction when the
    /// budget was one).
    pub budget_bytes: u64,
    pub met: bool,
    /// The model's figures of the graph before and after the plan.
    pub before: crate::analysis::PeakMemory,
    pub after: crate::analysis::PeakMemory,
    /// Each recomputation: its value (in the graph the choice was made on),
    /// producer's op, bytes, nodes cloned, FLOPs.
    pub recomputed: Vec<crate::remat::RematChoice>,
    /// FLOPs the plan adds to the step: the planned graph's minus the
    /// unplanned one's.
    pub extra_flops: u64,
    /// Step time the plan adds by the strategy's time model
    /// ([`crate::remat::RematPlan::extra_seconds`]).
    pub extra_seconds: f64,
    /// Each value kept in pinned host memory (`recomputed_nodes` and `flops`
    /// zero).
    pub offloaded: Vec<crate::remat::RematChoice>,
    /// Whether the unplanned program keeps values for later readers that
    /// remat could recompute ([`crate::remat::keeps_values_for_later`]):
    /// false for a program without a backward.
    pub keeps_values: bool,
}

impl RematSummary {
    /// Values the plan frees by recomputing them (a chain of clones may free
    /// several).
    pub fn values_recomputed(&self) -> usize {
        self.recomputed.iter().map(|c| 1 + c.also.len()).sum()
    }

    /// FLOPs of the recomputations' clones, summed per choice (the field
    /// [`RematSummary::extra_flops`] is the whole graph's difference, which
    /// counts clones that later merged once).
    pub fn recomputed_flops(&self) -> u64 {
        self.recomputed.iter().map(|c| c.flops).sum()
    }

    /// The added step time in nanoseconds, rounded.
    pub fn extra_ns(&self) -> u64 {
        (self.extra_seconds * 1e9).round() as u64
    }
}

/// What the pipeline did, for metrics and the CLI.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PipelineStats {
    /// Nodes of the graph given to [`run`].
    pub nodes_in: usize,
    /// Nodes after the prune stage.
    pub nodes_pruned: usize,
    pub nodes_out: usize,
    pub passes: Vec<PassStats>,
    pub total_time: Duration,
    /// Values the remat pass recomputes, and the FLOPs it adds.
    pub remat_recomputed: usize,
    pub remat_extra_flops: u64,
}

impl PipelineStats {
    /// Sum of `changed` over the passes called `name`.
    pub fn changed_by(&self, name: &str) -> usize {
        self.passes.iter().filter(|p| p.name == name).map(|p| p.changed).sum()
    }

    /// All rules fired, summed over passes.
    pub fn rules_fired(&self) -> BTreeMap<&'static str, usize> {
        let mut all = BTreeMap::new();
        for p in &self.passes {
            for (r, n) in p.rules_fired() {
                *all.entry(r).or_insert(0) += n;
            }
        }
        all
    }
}

/// Options every pass may read.
#[derive(Clone, Debug, PartialEq)]
pub struct PassOptions {
    pub rewrite: RewriteOptions,
    /// The `remat` pass rematerializes until the predicted step peak fits
    /// this many bytes (greedy strategy, [`crate::memory`]); `None`: it
    /// changes nothing.
    pub memory_limit_bytes: Option<u64>,
    /// The remat pass's budget as a fraction in (0, 1] of the step's
    /// activation memory (used instead of `memory_limit_bytes` when set): the
    /// limit is the unplanned predicted peak minus `(1 - fraction)` times the
    /// unplanned predicted temporaries, so the step keeps its arguments and
    /// outputs and that fraction of its temporaries (`docs/memory.md`).
    pub activation_fraction: Option<f64>,
    /// The backend the graph is compiled for: the remat pass judges memory
    /// by its fusion model ([`crate::analysis::fusion_for`]).
    pub target: crate::LowerTarget,
    /// How the remat pass chooses ([`StrategyKind`]: greedy by default).
    pub remat_strategy: StrategyKind,
    /// The link rate, bytes per second each way, that
    /// [`StrategyKind::HostCopy`] plans its copies for.
    pub host_link_bytes_per_second: f64,
    /// Parameters that XLA's SPMD partitioner will gather where they are
    /// computed with (FSDP's weights): the remat pass reads them and what is
    /// computed from them alone where they are
    /// ([`crate::remat::RematOptions::gathered_params`]).
    pub gathered_params: Vec<u32>,
}

/// One pass: a name (what `--passes` spells) and a function from graph to graph
/// that fills in its stats (the pipeline fills in name, nodes and time).
#[derive(Clone, Copy)]
pub struct Pass {
    pub name: &'static str,
    pub run: fn(&Graph, &PassOptions, &mut PassStats) -> Result<Graph, CompileError>,
}

impl std::fmt::Debug for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// Every pass, by name. `PASSES` is the default order.
pub const ALL_PASSES: [Pass; 7] = [
    Pass { name: "lm_head_loss", run: run_lm_head_loss },
    Pass { name: "cse", run: run_cse },
    Pass { name: "rewrite", run: run_rewrite },
    Pass { name: "merge_matmuls", run: run_merge_matmuls },
    Pass { name: "dce", run: run_dce },
    Pass { name: "sequence", run: run_sequence },
    Pass { name: "remat", run: run_remat },
];

/// The default pipeline: fuse the LM-head loss with its gradient where the
/// cotangent is one scalar (on autodiff's own graph, before anything reshapes
/// the cotangent), merge duplicates so the e-graph starts small, rewrite by
/// equality saturation (extraction already shares equal values), merge
/// products of one operand where the cost model says reading it once pays
/// (the `matmul` rule set's graph rule), remove what the rewrites left
/// unused. A memory budget adds `sequence` and `remat`
/// after them. Fusion planning is an analysis of the result
/// ([`crate::fusion::plan_fusion`]), not a pass: it changes no graph.
pub const DEFAULT_PASSES: [&str; 5] = ["lm_head_loss", "cse", "rewrite", "merge_matmuls", "dce"];

/// The pass called `name`, or an error listing the known names.
pub fn pass(name: &str) -> Result<Pass, CompileError> {
    ALL_PASSES.iter().copied().find(|p| p.name == name).ok_or_else(|| CompileError::UnknownPass {
        name: name.to_string(),
        known: ALL_PASSES.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
    })
}

/// How [`run`] runs.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineOptions {
    /// Pass names in order (see [`ALL_PASSES`]).
    pub passes: Vec<String>,
    /// Drop parameters the outputs do not need (the frontend's programs);
    /// `false` keeps the signature (`kiln compile` on a saved graph).
    pub prune_params: bool,
    /// Run the verifier after pruning and after every pass.
    pub verify: bool,
    pub pass_options: PassOptions,
}

impl Default for PipelineOptions {
    fn default() -> PipelineOptions {
        PipelineOptions {
            passes: DEFAULT_PASSES.iter().map(|s| s.to_string()).collect(),
            prune_params: true,
            // On by default everywhere (release tests too): it costs about 7 ms
            // per pass on the gpt2-small train step, next to seconds of XLA
            // compile on the same miss.
            verify: true,
            pass_options: PassOptions {
                rewrite: RewriteOptions::default(),
                memory_limit_bytes: None,
                activation_fraction: None,
                target: crate::LowerTarget::Cpu,
                remat_strategy: StrategyKind::Greedy,
                host_link_bytes_per_second: crate::target::HOST_COPY_LINK_BYTES_PER_SECOND,
                gathered_params: Vec::new(),
            },
        }
    }
}

impl PipelineOptions {
    /// The default list without the rewrites: the `rewrite` pass and the
    /// `matmul` rule set's `merge_matmuls` (`kiln compile --no-rewrite`).
    pub fn without_rewrite(mut self) -> PipelineOptions {
        self.passes.retain(|p| p != "rewrite" && p != "merge_matmuls");
        self
    }

    /// Adds the `remat` pass at the end, under `limit` bytes (`None`: no
    /// change).
    pub fn with_memory_limit(mut self, limit: Option<u64>) -> PipelineOptions {
        if let Some(limit) = limit {
            self.pass_options.memory_limit_bytes = Some(limit);
            self.add_remat_pass();
        }
        self
    }

    /// Adds the `remat` pass at the end, under `fraction` of the step's
    /// activation memory ([`PassOptions::activation_fraction`]; `None`: no
    /// change).
    pub fn with_activation_budget(mut self, fraction: Option<f64>) -> PipelineOptions {
        if let Some(f) = fraction {
            self.pass_options.activation_fraction = Some(f);
            self.add_remat_pass();
        }
        self
    }

    /// The backend the graph is for (the remat pass's fusion model).
    pub fn with_target(mut self, target: crate::LowerTarget) -> PipelineOptions {
        self.pass_options.target = target;
        self
    }

    /// The strategy the remat pass plans with ([`PassOptions::remat_strategy`]).
    pub fn with_remat_strategy(mut self, strategy: StrategyKind) -> PipelineOptions {
        self.pass_options.remat_strategy = strategy;
        self
    }

    /// Host offload as the remat strategy when `on` (the training loops'
    /// switch; off leaves the strategy as it is).
    pub fn with_host_offload(self, on: bool) -> PipelineOptions {
        if on {
            self.with_remat_strategy(StrategyKind::HostOffload)
        } else {
            self
        }
    }

    /// Host copies as the remat strategy when `on`; it takes precedence over
    /// host offload when both switches are on, as it always has.
    pub fn with_host_copies(self, on: bool) -> PipelineOptions {
        if on {
            self.with_remat_strategy(StrategyKind::HostCopy)
        } else {
            self
        }
    }

    /// The link rate kiln's host copies are planned for.
    pub fn with_host_link_rate(mut self, bytes_per_second: f64) -> PipelineOptions {
        self.pass_options.host_link_bytes_per_second = bytes_per_second;
        self
    }

    /// The parameters XLA's SPMD partitioner gathers
    /// ([`PassOptions::gathered_params`]).
    pub fn with_gathered_params(mut self, params: Vec<u32>) -> PipelineOptions {
        self.pass_options.gathered_params = params;
        self
    }

    /// The `sequence` and `remat` passes at the end of the list, once each.
    fn add_remat_pass(&mut self) {
        for name in ["sequence", "remat"] {
            if !self.passes.iter().any(|p| p == name) {
                self.passes.push(name.to_string());
            }
        }
    }
}

pub use crate::remat::activation_budget_bytes;

/// The pipeline's result.
#[derive(Clone, Debug)]
pub struct Optimized {
    /// The graph after the last pass: what is lowered.
    pub graph: Graph,
    /// The graph after pruning, before any pass, and which parameters it kept
    /// (all of them, in order, when `prune_params` is off).
    pub pruned: Pruned,
    pub stats: PipelineStats,
}

/// Prunes `g` and runs the passes; `observe(stage, graph)` sees the graph after
/// pruning (stage `"prune"`) and after each pass (the pass's name).
pub fn run(
    g: &Graph,
    opts: &PipelineOptions,
    observe: &mut dyn FnMut(&str, &Graph),
) -> Result<Optimized, CompileError> {
    let _span = tracing::debug_span!("pipeline", nodes = g.len()).entered();
    let passes = opts.passes.iter().map(|n| pass(n)).collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let pruned = if opts.prune_params {
        eliminate_dead_code(g)?
    } else {
        Pruned { graph: g.clone(), kept_params: (0..g.params().len() as u32).collect(), removed: 0 }
    };
    if opts.verify {
        crate::verify(&pruned.graph).map_err(|e| after("prune", e))?;
    }
    observe("prune", &pruned.graph);
    let mut stats = PipelineStats { nodes_in: g.len(), nodes_pruned: pruned.graph.len(), ..Default::default() };
    let mut graph = pruned.graph.clone();
    for p in passes {
        let t = Instant::now();
        let mut ps = PassStats { name: p.name, nodes_in: graph.len(), ..Default::default() };
        graph = (p.run)(&graph, &opts.pass_options, &mut ps)?;
        ps.time = t.elapsed();
        ps.nodes_out = graph.len();
        if graph.params().len() != pruned.graph.params().len() {
            return Err(after(
                p.name,
                CompileError::Verify { node: "params".into(), reason: "the pass changed the parameter list".into() },
            ));
        }
        if opts.verify {
            crate::verify(&graph).map_err(|e| after(p.name, e))?;
        }
        observe(p.name, &graph);
        if p.name == "remat" {
            stats.remat_recomputed += ps.changed;
            stats.remat_extra_flops += ps.extra_flops;
        }
        stats.passes.push(ps);
    }
    stats.nodes_out = graph.len();
    stats.total_time = started.elapsed();
    Ok(Optimized { graph, pruned, stats })
}

/// Runs the default pipeline on `g` without pruning parameters or observing:
/// the graph and stats. Kept for callers that only want the optimized graph.
pub fn optimize(g: &Graph) -> Result<(Graph, PipelineStats), CompileError> {
    let opts = PipelineOptions { prune_params: false, ..PipelineOptions::default() };
    let out = run(g, &opts, &mut |_, _| {})?;
    Ok((out.graph, out.stats))
}

/// Options of [`optimize_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OptimizeOptions {
    /// Rematerialize until the predicted step peak fits this many bytes
    /// (greedy strategy, [`crate::memory`]); `None`: no remat pass.
    pub memory_limit_bytes: Option<u64>,
}

/// [`optimize`] with options: the default passes, then `remat` under a limit.
pub fn optimize_with(g: &Graph, o: &OptimizeOptions) -> Result<(Graph, PipelineStats), CompileError> {
    let opts =
        PipelineOptions { prune_params: false, ..PipelineOptions::default() }.with_memory_limit(o.memory_limit_bytes);
    let out = run(g, &opts, &mut |_, _| {})?;
    Ok((out.graph, out.stats))
}

fn after(pass: &'static str, e: CompileError) -> CompileError {
    CompileError::AfterPass { pass, source: Box::new(e) }
}

fn run_lm_head_loss(g: &Graph, _: &PassOptions, s: &mut PassStats) -> Result<Graph, CompileError> {
    let (g, fused) = fuse_lm_head_loss(g)?;
    s.changed = fused;
    Ok(g)
}

fn run_cse(g: &Graph, _: &PassOptions, s: &mut PassStats) -> Result<Graph, CompileError> {
    let (g, merged) = eliminate_common_subexpressions(g)?;
    s.changed = merged;
    Ok(g)
}

/// DCE inside the list keeps every parameter (parameters keep their indices).
fn run_dce(g: &Graph, _: &PassOptions, s: &mut PassStats) -> Result<Graph, CompileError> {
    let out = eliminate_dead_code_keep_params(g)?;
    s.changed = g.len() - out.len();
    Ok(out)
}

fn run_rewrite(g: &Graph, o: &PassOptions, s: &mut PassStats) -> Result<Graph, CompileError> {
    let out = rewrite::rewrite(g, &o.rewrite)?;
    s.report = PassReport::Rewrite {
        rules_fired: out.report.rules_fired.clone(),
        stop_reason: out.report.stop_reason.to_string(),
    };
    s.changed = g.len().saturating_sub(out.graph.len());
    Ok(out.graph)
}

/// The `matmul` rule set's graph rule, where the rule sets select it.
fn run_merge_matmuls(g: &Graph, o: &PassOptions, s: &mut PassStats) -> Result<Graph, CompileError> {
    use crate::rewrite::rules::{self, matmul};
    if !rules::selects_graph_rule(o.rewrite.rule_sets.as_deref(), "matmul") {
        return Ok(g.clone());
    }
    let (out, merged) = matmul::merge_matmuls(g, matmul::MergeDecision::CostModel)?;
    s.changed = merged;
    let mut rules_fired = BTreeMap::new();
    if merged > 0 {
        rules_fired.insert("merge-matmuls", merged);
    }
    s.report = PassReport::Rules { rules_fired };
    Ok(out)
}

/// Remat last, on the graph about to be lowered: the target backend's fusion
/// model decides which values get buffers (`crate::memory`).
fn run_remat(g: &Graph, o: &PassOptions, s: &mut PassStats) -> Result<Graph, CompileError> {
    use crate::remat::RematBudget;
    let budget = match (o.activation_fraction, o.memory_limit_bytes) {
        (Some(f), _) => RematBudget::FractionOfActivations(f),
        (None, Some(limit)) => RematBudget::Bytes(limit),
        (None, None) => return Ok(g.clone()),
    };
    let ro = crate::remat::RematOptions {
        gathered_params: o.gathered_params.clone(),
        ..crate::remat::RematOptions::for_target(budget, o.target)
    };
    let plan = o.remat_strategy.plan(g, &ro, o.target, o.host_link_bytes_per_second)?;
    s.changed = plan.choices.len();
    s.extra_flops = plan.extra_flops;
    // A plan that chose something had candidates; only an empty plan asks.
    let keeps_values =
        !plan.choices.is_empty() || !plan.offloaded.is_empty() || crate::remat::keeps_values_for_later(g, &ro);
    s.report = PassReport::Remat(Box::new(RematSummary {
        strategy: plan.strategy,
        keeps_values,
        budget_bytes: plan.budget_bytes,
        met: plan.met,
        before: plan.before,
        after: plan.after,
        recomputed: plan.choices,
        extra_flops: plan.extra_flops,
        extra_seconds: plan.extra_seconds,
        offloaded: plan.offloaded,
    }));
    Ok(plan.graph)
}

/// On targets that drop barriers (XLA CPU, whose scheduler orders a step
/// itself), chain the backward's kernels in the program's order with runtime
/// guards ([`crate::schedule::sequence_backward`]), so XLA frees each layer's
/// operands where the program does. It trades step time for memory (tiny
/// GPT on the CPU plugin: XLA temp -11.4%, step time +4-8%), so it runs
/// with a memory budget, before `remat`, or when listed.
fn run_sequence(g: &Graph, o: &PassOptions, s: &mut PassStats) -> Result<Graph, CompileError> {
    let (out, guarded) = crate::schedule::sequence_for(g, o.target, &o.gathered_params)?;
    s.changed = guarded;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DType, Op, TensorType, UnaryOp};

    fn sample() -> Graph {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [4]);
        let a = g.parameter(t.clone());
        let _unused = g.parameter(t);
        let e1 = g.value(Op::Unary { op: UnaryOp::Exp, input: a }).unwrap();
        let e2 = g.value(Op::Unary { op: UnaryOp::Exp, input: a }).unwrap();
        let _dead = g.value(Op::Unary { op: UnaryOp::Tanh, input: a }).unwrap();
        let s = g.value(Op::Binary { op: BinaryOp::Add, lhs: e1, rhs: e2 }).unwrap();
        g.set_outputs(vec![s]).unwrap();
        g
    }

    #[test]
    fn runs_the_list_in_order_and_observes_each_stage() {
        let opts = PipelineOptions { verify: true, ..PipelineOptions::default() };
        let mut seen = Vec::new();
        let out = run(&sample(), &opts, &mut |name, g| seen.push((name.to_string(), g.len()))).unwrap();
        let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["prune", "lm_head_loss", "cse", "rewrite", "merge_matmuls", "dce"]);
        assert_eq!(out.pruned.kept_params, vec![0]);
        assert_eq!(out.stats.nodes_in, 6);
        assert_eq!(out.stats.nodes_pruned, 4);
        assert_eq!(out.stats.changed_by("cse"), 1);
        assert_eq!(out.graph.len(), 3);
        assert_eq!(out.stats.passes.len(), 5);
        assert!(out.stats.passes.iter().find(|p| p.name == "rewrite").unwrap().stop_reason().is_some());
    }

    #[test]
    fn placements_pass_through_every_pass() {
        // A value sent to the host and back twice: CSE merges the two round
        // trips into one (as it merges equal barriers), and the values stay.
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [4]);
        let a = g.parameter(t);
        let e = g.value(Op::Unary { op: UnaryOp::Exp, input: a }).unwrap();
        let mut outs = Vec::new();
        for _ in 0..2 {
            let h = g.value(Op::Place { input: e, to: crate::ir::MemorySpace::PinnedHost }).unwrap();
            outs.push(g.value(Op::Place { input: h, to: crate::ir::MemorySpace::Device }).unwrap());
        }
        let s = g.value(Op::Binary { op: BinaryOp::Add, lhs: outs[0], rhs: outs[1] }).unwrap();
        g.set_outputs(vec![s]).unwrap();
        let out = run(&g, &PipelineOptions { verify: true, ..PipelineOptions::default() }, &mut |_, _| {}).unwrap();
        let places = out.graph.nodes().filter(|(_, n)| matches!(n.op, Op::Place { .. })).count();
        assert_eq!(places, 2);
        let x = crate::ir::Literal::from_f64s(DType::F32, [4], &[0.3, -1.2, 2.5, 0.01]).unwrap();
        assert_eq!(
            crate::interpret(&g, std::slice::from_ref(&x)).unwrap(),
            crate::interpret(&out.graph, &[x]).unwrap()
        );
    }

    #[test]
    fn host_offload_under_a_budget_on_the_cpu_target_is_the_strategys_typed_error() {
        let opts = PipelineOptions::default().with_memory_limit(Some(0)).with_host_offload(true);
        let err = run(&sample(), &opts, &mut |_, _| {}).unwrap_err().to_string();
        assert!(err.contains("host-offload") && err.contains("annotate_device_placement"), "{err}");
        // Without a budget there is no remat pass, and nothing to refuse.
        let opts = PipelineOptions::default().with_host_offload(true);
        assert!(run(&sample(), &opts, &mut |_, _| {}).is_ok());
    }

    #[test]
    fn an_activation_budget_keeps_arguments_outputs_and_that_fraction_of_temporaries() {
        let before = crate::analysis::PeakMemory {
            argument_bytes: 400,
            constant_bytes: 0,
            output_bytes: 100,
            alias_bytes: 0,
            temp_peak_bytes: 1000,
            peak_bytes: 1450,
            allocated_temp_bytes: 1000,
            allocated_bytes: 1500,
            peak_position: 3,
        };
        assert_eq!(activation_budget_bytes(&before, 1.0), 1450);
        assert_eq!(activation_budget_bytes(&before, 0.5), 950);
        assert_eq!(activation_budget_bytes(&before, 0.25), 700);
        // Under 5% no plan can meet it, but the bytes never wrap.
        let tiny = crate::analysis::PeakMemory { peak_bytes: 10, ..before };
        assert_eq!(activation_budget_bytes(&tiny, 0.0), 0);
    }

    #[test]
    fn a_full_activation_budget_adds_the_remat_pass_and_recomputes_nothing() {
        let opts = PipelineOptions::default().with_activation_budget(Some(1.0));
        assert_eq!(opts.passes.last().map(String::as_str), Some("remat"));
        let out = run(&sample(), &opts, &mut |_, _| {}).unwrap();
        let remat = out.stats.passes.iter().find(|p| p.name == "remat").unwrap().remat().cloned().unwrap();
        assert!(remat.met);
        assert!(remat.recomputed.is_empty());
        assert_eq!(remat.budget_bytes, remat.before.peak_bytes);
        assert_eq!(out.stats.remat_recomputed, 0);
    }

    #[test]
    fn keeps_parameters_when_asked() {
        let opts = PipelineOptions { verify: true, prune_params: false, ..PipelineOptions::default() };
        let out = run(&sample(), &opts, &mut |_, _| {}).unwrap();
        assert_eq!(out.graph.params().len(), 2);
        assert_eq!(out.pruned.kept_params, vec![0, 1]);
    }

    #[test]
    fn unknown_pass_names_are_a_typed_error() {
        let opts = PipelineOptions { passes: vec!["cse".into(), "nope".into()], ..PipelineOptions::default() };
        match run(&sample(), &opts, &mut |_, _| {}) {
            Err(CompileError::UnknownPass { name, known }) => {
                assert_eq!(name, "nope");
                assert!(known.contains("rewrite"), "{known}");
            }
            other => panic!("expected UnknownPass, got {other:?}"),
        }
    }

    #[test]
    fn without_rewrite_drops_only_that_pass() {
        let o = PipelineOptions::default().without_rewrite();
        assert_eq!(o.passes, ["lm_head_loss", "cse", "dce"]);
    }
}
