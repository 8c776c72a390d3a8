//! What every strategy shares: the pass's options and budget, one
//! recomputation and a whole plan, the strategy trait and the entry point,
//! and the finishing of a plan against the model (its peaks, its price).
//!
//! Invariant: a plan's figures are the model's for the graph it holds; a
//! plan that does not meet its budget says so (`met`), it is never an error.

use crate::analysis::{kernel_seconds, liveness, peak_of, Materialization, PeakMemory};
use crate::cost;
use crate::ir::{Graph, ValueId};
use crate::target::Target;
use crate::CompileError;

/// How much memory the planned step may use.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RematBudget {
    /// Predicted peak (arguments, constants, outputs and temporaries) in bytes.
    /// 0 asks for the lowest peak the strategy can reach.
    Bytes(u64),
    /// A fraction, in [0, 1], of the step's activation memory: the step keeps
    /// its arguments, outputs and that fraction of its predicted temporaries
    /// without a plan ([`activation_budget_bytes`]).
    FractionOfActivations(f64),
}

/// Options of the remat pass.
#[derive(Clone)]
pub struct RematOptions<'a> {
    pub budget: RematBudget,
    /// Whose roofline prices a recomputation.
    pub target: Target,
    /// Which values reach memory (the fusion plan).
    pub fusion: &'a dyn Materialization,
    /// Longest chain of nodes cloned for one candidate.
    pub max_chain_nodes: usize,
    /// Only these forward values may be recomputed (autodiff's map of what
    /// the backward reads); `None`: any value with a long idle stretch.
    pub only: Option<&'a [ValueId]>,
    /// Greedy plans a second time with whole stretches of the forward
    /// between two cuts offered as candidates too ([`super::blocks`]:
    /// block-granular recomputation), and keeps the better plan by the model
    /// (both meet the budget: the less recomputation, by the model's added
    /// time under [`RecomputeCost::Kernels`], else by FLOPs; else the lower
    /// peak). Under [`RecomputeCost::Kernels`] the second plan is made only
    /// when the first adds more than [`SEGMENTS_FROM`] of the step's kernel
    /// time.
    pub segments: bool,
    /// After greedy's choices, pin backward kernels that read only forward
    /// values behind a runtime guard ([`super::pin`]), so XLA cannot run
    /// them early.
    pub pin_floating: bool,
    /// Which fenced leaves are read through the runtime guard as well as
    /// the barrier (see the module docs). [`LeafGuards::Every`] unless the
    /// caller knows the target.
    pub guard_leaves: LeafGuards,
    /// How greedy prices a recomputation.
    pub cost: RecomputeCost,
    /// Under [`RecomputeCost::Kernels`], whether a round reuses the scores
    /// earlier rounds measured until they matter (true), or measures every
    /// candidate again (false: the reference the lazy plans are checked
    /// against).
    pub lazy: bool,
    /// Parameters (by index) that XLA's SPMD partitioner gathers where they
    /// are computed with: weights split over the devices the batch is split
    /// over (FSDP). A value computed from them alone (a weight, its cast, its
    /// transpose) is never recomputed and is read where it is, outside the
    /// barrier: recomputing it, or reading it through the barrier, gathers
    /// the weight again (`docs/memory-journal.md`, "Remat under FSDP reads the
    /// gathered weights").
    pub gathered_params: Vec<u32>,
}

/// How greedy prices a recomputation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeCost {
    /// By the chain alone: loop-fusible clones add their arithmetic (they
    /// fuse into their readers), the others the roofline's slower of
    /// arithmetic and memory; of the candidates that cover the excess, the
    /// fewest FLOPs. Each round takes the first candidate in that order
    /// that lowers the peak.
    Arithmetic,
    /// By kernels: candidates are ordered by the chain's bytes read and
    /// written, then the first [`KERNEL_TRIES`] that lower the peak are
    /// each applied and the step's kernel time ([`super::kernel_seconds`])
    /// measured (lazily: [`RematOptions::lazy`]), and sibling candidates
    /// ([`super::siblings`]) beside them; the round takes the one that
    /// lowers the live bytes over the budget, summed over the program
    /// (`excess_area`), most per second added (one that covers the excess
    /// lowers all of them). For GPUs, where a clone feeding a GEMM is a
    /// kernel of its own and elementwise recomputation costs memory traffic,
    /// not arithmetic.
    Kernels,
}

/// Candidates measured by kernel time per round ([`RecomputeCost::Kernels`]).
pub const KERNEL_TRIES: usize = 32;

/// How much better than measured an earlier round's score may have become
/// ([`RematOptions::lazy`]): one within this factor of the round's fresh best
/// is measured again before the best is taken. On gpt2-small's saved step at
/// 50% (the CUDA model), taking the fresh best over every old score made the
/// lazy plan add 6% more predicted time than measuring every round; with
/// 1.25 it adds 0.1% less.
pub(crate) const STALE_SLACK: f64 = 1.25;

/// Which of a recomputed chain's fenced leaves the clones read through the
/// runtime guard ([`crate::fence`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeafGuards {
    /// Every leaf: where the target drops barriers before CSE (XLA CPU), so
    /// that no clone can merge with its original.
    Every,
    /// The smallest leaf of each entry of the chain (a clone that reads no
    /// other clone), so that every clone waits for the anchor even where the
    /// target drops the barrier's unread anchor (XLA CUDA).
    Entries,
    /// None: the barrier alone.
    Off,
    /// None, and every reader of the anchor from the barrier on reads the
    /// barrier's pass-through of it: XLA CUDA drops a barrier operand whose
    /// result nothing reads, so only a read anchor holds the clones back. A
    /// chain whose anchor nothing reads from there on gets
    /// [`LeafGuards::Entries`].
    PassAnchor,
}

impl RematOptions<'static> {
    /// The options for compiling to `target`: its fusion model, and the
    /// runtime guard on every fenced leaf where it drops barriers (XLA CPU),
    /// the anchor passed through the barrier where it keeps them through CSE
    /// (XLA CUDA).
    ///
    /// Block segments are tried on every target. Where the target drops
    /// barriers (XLA CPU) XLA orders the step itself and follows a plan of
    /// whole blocks better (tiny GPT, lowest peak: the same model peak at 15%
    /// fewer FLOPs, XLA's peak cut 2.01x against 1.95x). On XLA CUDA they pay
    /// at tight budgets only: gpt2-small at 25% of its activation memory
    /// took 24.0 ms a step at 0.98 GiB of temp against 25.9 ms at 0.90 GiB
    /// value by value (`docs/memory-journal.md`, "Block segments on CUDA at tight budgets"), and at 50% and 40% a plan with
    /// segments is the value plan or dearer, hence [`SEGMENTS_FROM`].
    pub fn for_target(budget: RematBudget, target: crate::LowerTarget) -> RematOptions<'static> {
        let drops = !target.keeps_barriers();
        let guard_leaves = if drops { LeafGuards::Every } else { LeafGuards::PassAnchor };
        let cost = if drops { RecomputeCost::Arithmetic } else { RecomputeCost::Kernels };
        RematOptions {
            guard_leaves,
            segments: true,
            cost,
            ..RematOptions::new(budget, crate::analysis::fusion_for(target))
        }
    }
}

impl<'a> RematOptions<'a> {
    /// The same options with another budget.
    pub fn with_budget(&self, budget: RematBudget) -> RematOptions<'a> {
        RematOptions { budget, ..self.clone() }
    }

    pub fn new(budget: RematBudget, fusion: &'a dyn Materialization) -> RematOptions<'a> {
        RematOptions {
            budget,
            target: Target::H100_SXM_MEASURED,
            fusion,
            max_chain_nodes: 128,
            only: None,
            segments: false,
            pin_floating: true,
            guard_leaves: LeafGuards::Every,
            cost: RecomputeCost::Arithmetic,
            lazy: true,
            gathered_params: Vec::new(),
        }
    }
}

/// One recomputation: a value, or several that one chain of clones frees.
#[derive(Clone, Debug, PartialEq)]
pub struct RematChoice {
    /// The value (the largest, where one chain frees several), in the graph
    /// the choice was made on.
    pub value: ValueId,
    /// The other values whose buffers the same clones free: a block
    /// segment's other roots, the other members of a sibling group
    /// ([`super::siblings`]). Empty for a single value.
    pub also: Vec<ValueId>,
    /// The op name of `value`'s producer.
    pub op: &'static str,
    /// Bytes of the buffers freed, `value`'s and `also`'s.
    pub bytes: u64,
    /// Nodes cloned to recompute it.
    pub recomputed_nodes: usize,
    /// FLOPs of the clones.
    pub flops: u64,
}

impl RematChoice {
    /// A value kept in host memory instead of recomputed (host offload, host
    /// copies): no clones, no FLOPs.
    pub(crate) fn moved(g: &Graph, value: ValueId, bytes: u64) -> RematChoice {
        RematChoice { value, also: Vec::new(), op: g.node(value.node).op.name(), bytes, recomputed_nodes: 0, flops: 0 }
    }
}

/// What a strategy chose and the graph it rewrote.
#[derive(Clone, Debug)]
pub struct RematPlan {
    pub strategy: &'static str,
    pub graph: Graph,
    pub choices: Vec<RematChoice>,
    pub before: PeakMemory,
    pub after: PeakMemory,
    /// The budget in bytes.
    pub budget_bytes: u64,
    /// Whether `after.peak_bytes <= budget_bytes`.
    pub met: bool,
    pub extra_flops: u64,
    /// Seconds added on the options' target: by the node roofline
    /// ([`crate::cost::estimate`]) with [`RecomputeCost::Arithmetic`], by
    /// kernels ([`super::kernel_seconds`]) with [`RecomputeCost::Kernels`].
    pub extra_seconds: f64,
    /// Values kept in pinned host memory between their forward write and
    /// their backward read ([`super::HostOffload`]; `recomputed_nodes` and
    /// `flops` are zero).
    pub offloaded: Vec<RematChoice>,
}

impl RematPlan {
    /// Values the plan frees by recomputing them (a chain of clones may free
    /// several: [`RematChoice::also`]).
    pub fn values_recomputed(&self) -> usize {
        self.choices.iter().map(|c| 1 + c.also.len()).sum()
    }
}

/// A way of choosing what to recompute.
pub trait RematStrategy {
    fn name(&self) -> &'static str;
    /// The graph rewritten with this strategy's choices (the input unchanged
    /// when nothing is chosen).
    fn plan(&self, g: &Graph, opts: &RematOptions) -> Result<RematPlan, CompileError>;
}

/// Plans with `strategy`: the pass's entry point.
pub fn rematerialize(g: &Graph, strategy: &dyn RematStrategy, opts: &RematOptions) -> Result<RematPlan, CompileError> {
    let _span = tracing::debug_span!("rematerialize", strategy = strategy.name(), nodes = g.len()).entered();
    strategy.plan(g, opts)
}

pub(crate) fn budget_bytes(budget: RematBudget, before: &PeakMemory) -> u64 {
    match budget {
        RematBudget::Bytes(b) => b,
        RematBudget::FractionOfActivations(f) => activation_budget_bytes(before, f),
    }
}

/// The byte limit of `fraction` of `before`'s activation memory: the
/// unplanned peak less `(1 - fraction)` of the unplanned temporaries.
pub fn activation_budget_bytes(before: &PeakMemory, fraction: f64) -> u64 {
    let cut = (1.0 - fraction.clamp(0.0, 1.0)) * before.temp_peak_bytes as f64;
    before.peak_bytes.saturating_sub(cut.round() as u64)
}

pub(crate) fn finish(
    strategy: &'static str,
    original: &Graph,
    graph: Graph,
    choices: Vec<RematChoice>,
    before: PeakMemory,
    opts: &RematOptions,
) -> RematPlan {
    let after_l = liveness(&graph, opts.fusion);
    let after = peak_of(&after_l);
    let budget = budget_bytes(opts.budget, &before);
    let extra_flops = cost::graph_cost(&graph).total.flops.saturating_sub(cost::graph_cost(original).total.flops);
    let extra_seconds = match opts.cost {
        RecomputeCost::Arithmetic => {
            cost::estimate_seconds(&graph, &opts.target) - cost::estimate_seconds(original, &opts.target)
        }
        RecomputeCost::Kernels => {
            kernel_seconds(&graph, &after_l, &opts.target)
                - kernel_seconds(original, &liveness(original, opts.fusion), &opts.target)
        }
    }
    .max(0.0);
    RematPlan {
        strategy,
        graph,
        choices,
        before,
        after,
        budget_bytes: budget,
        met: after.peak_bytes <= budget,
        extra_flops,
        extra_seconds,
        offloaded: Vec::new(),
    }
}
