//! Rematerialization: recompute long-lived activations where they are read
//! again instead of keeping them, until the step's predicted peak fits a budget.
//!
//! Where it runs: last in [`crate::pipeline::optimize`] (after CSE and DCE),
//! when a budget is set. Its graph goes straight to lowering.
//!
//! The model. In the execution order ([`super::liveness`]), a value `v` whose
//! direct users fall into an early group and a late group separated by a long
//! idle stretch (in a training step: its forward users and the backward users
//! that autodiff made read it) is a candidate. Rematerializing it clones `v`'s
//! producer, and those of its operands that are no longer in memory at that
//! point (a chain, up to `max_chain_nodes`), just before the first late user;
//! late users read the clone, so `v`'s buffer dies after its early users.
//! Operands still in memory there (and parameters) are the chain's leaves.
//!
//! The fence. The leaves reach the clones only through one
//! `optimization_barrier`, which also takes one operand of the first late
//! user that is computed after the gap (usually a cotangent). XLA's CSE cannot
//! merge a clone with its original (their operands differ), and no scheduler
//! can hoist the recomputation above the point where the backward needs it.
//! Without the fence XLA merges the clones back and the memory returns (what
//! torch_xla's checkpointing lost).
//!
//! The barrier alone is not enough on XLA's CPU backend: its pipeline removes
//! barriers before a later CSE, which then merged the clones back (seen
//! 2026-11-23: gpt tiny's XLA temp unchanged at 7.27 MiB with 15 fenced
//! recomputations). So each fenced leaf is also read through the runtime
//! guard of [`crate::fence`], anchored on the barrier's anchor: the identity
//! bit for bit, which no simplifier can prove, so the clone's operands differ
//! from the original's after the barrier is gone, and the clone still waits
//! for the anchor.
//!
//! XLA CUDA keeps barriers through CSE but drops a barrier operand whose
//! result nothing reads (seen 2026-11-23 in the H100's optimized module: the
//! barrier of a recomputed residual add became a tuple without its anchor,
//! and the add ran before the LM-head loss, in the forward). So there every
//! reader of the anchor from the barrier on reads the barrier's pass-through
//! of it, which keeps the anchor in the barrier and the clones behind it
//! ([`LeafGuards::PassAnchor`]). A chain whose anchor nothing reads from
//! there on instead reads one guarded operand per *entry* (a clone that reads
//! no other clone; [`LeafGuards::Entries`]), as every clone then waits for
//! the anchor through its entries: a select on the smallest operand, which
//! fuses into an elementwise reader but is a copy kernel of its own before a
//! GEMM. (`RematOptions::guard_leaves`, set by the pipeline from the target.)
//!
//! Invariants:
//! - The rewrite computes the same values: clones are the same ops on the
//!   same (fenced) inputs, and a barrier passes values through unchanged, so
//!   the reference interpreter gives bit-identical outputs.
//! - Parameters, outputs and aliases keep their order and indices.
//! - Random-bit generators are never cloned (a second draw would differ),
//!   nor backward composites; they are leaves. A multi-output node (a forward
//!   composite) is cloned whole, and late readers of any of its outputs read
//!   the clone's.
//! - Every change is checked against the peak model: a candidate that does
//!   not lower the predicted peak (or the number of positions at it) is
//!   discarded, so the plan never predicts more memory than no plan.

use rayon::prelude::*;

use crate::cost;
use crate::ir::{Graph, NodeId, Op, ValueId};
use crate::target::Target;
use crate::CompileError;

use super::kernel_time::{self, kernel_seconds};
use super::liveness::{liveness, users_of, BufferKind, Liveness};
use super::peak::{live_peak, peak_of, PeakMemory};
use super::Materialization;

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
const STALE_SLACK: f64 = 1.25;

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
        RematOptions { guard_leaves, segments: true, cost, ..RematOptions::new(budget, super::fusion_for(target)) }
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
    pub(super) fn moved(g: &Graph, value: ValueId, bytes: u64) -> RematChoice {
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

/// No recomputation: the baseline every plan is compared with.
#[derive(Clone, Copy, Debug, Default)]
pub struct Off;

impl RematStrategy for Off {
    fn name(&self) -> &'static str {
        "off"
    }

    fn plan(&self, g: &Graph, opts: &RematOptions) -> Result<RematPlan, CompileError> {
        let before = peak_of(&liveness(g, opts.fusion));
        Ok(finish(self.name(), g, g.clone(), Vec::new(), before, opts))
    }
}

/// Greedy by the cost model: while the peak is over budget, recompute a
/// candidate live across the peak: the cheapest of those that cover the
/// excess over the budget, else the one that frees the most memory per
/// second of recomputation, priced as [`RematOptions::cost`] says; a
/// candidate that does not lower the peak is skipped. Chosen values may
/// themselves be recomputed later in the loop.
#[derive(Clone, Copy, Debug, Default)]
pub struct Greedy;

/// Candidates tried per round before the greedy strategy gives up.
const GREEDY_TRIES: usize = 64;

/// Under [`RecomputeCost::Kernels`], greedy plans with block segments too
/// only when the value-by-value plan meets the budget for more than this
/// fraction of the step's kernel time (or does not meet it). On gpt2-small's
/// step by the CUDA model the segment plans were the value plans or dearer
/// up to 40% of activation memory (value plans +4% to +9% of the step) and
/// cheaper at 25% (+30%); the second plan doubles the pass's time.
pub const SEGMENTS_FROM: f64 = 0.10;

impl RematStrategy for Greedy {
    fn name(&self) -> &'static str {
        "greedy"
    }

    /// The plan [`Greedy::plan_at`] makes for the budget; where it misses
    /// the budget, also the plans greedy makes for tighter ones. Greedy's path
    /// depends on its budget (a small excess goes to the cheapest candidate
    /// that covers it) and can end above a budget that a tighter budget's path
    /// goes under, so a budget is called unreachable only after the
    /// lowest-peak path (budget 0) misses it too. When that path meets it,
    /// up to [`RETRY_SPLITS`] budgets between its peak and the budget are
    /// tried by bisection, and the cheapest plan that meets the budget is
    /// kept; else the lower peak.
    fn plan(&self, g: &Graph, opts: &RematOptions) -> Result<RematPlan, CompileError> {
        let plan = self.plan_at(g, opts)?;
        if plan.met || plan.budget_bytes == 0 {
            return Ok(plan);
        }
        let budget = plan.budget_bytes;
        let by_time = opts.cost == RecomputeCost::Kernels;
        let at = |bytes: u64| -> Result<RematPlan, CompileError> {
            let mut p = self.plan_at(g, &opts.with_budget(RematBudget::Bytes(bytes)))?;
            (p.budget_bytes, p.met) = (budget, p.after.peak_bytes <= budget);
            Ok(p)
        };
        let lowest = at(0)?;
        if !lowest.met {
            let lower = lowest.after.peak_bytes < plan.after.peak_bytes;
            tracing::debug!(
                budget,
                lowest = lowest.after.peak_bytes,
                first = plan.after.peak_bytes,
                "greedy: budget out of reach"
            );
            return Ok(if lower { lowest } else { plan });
        }
        let cost = |p: &RematPlan| if by_time { p.extra_seconds } else { p.extra_flops as f64 };
        let mut best = lowest;
        // Bisect the budget handed to greedy between the lowest path's peak
        // (met) and the budget (missed).
        let (mut lo, mut hi) = (best.after.peak_bytes, budget);
        for _ in 0..RETRY_SPLITS {
            let mid = lo + (hi - lo) / 2;
            if mid <= lo {
                break;
            }
            let p = at(mid)?;
            if p.met {
                lo = mid;
                if cost(&p) < cost(&best) {
                    best = p;
                }
            } else {
                hi = mid;
            }
        }
        tracing::debug!(budget, peak = best.after.peak_bytes, "greedy: budget met by a tighter path");
        Ok(best)
    }
}

/// Budgets tried between the lowest-peak path and a missed budget
/// ([`Greedy::plan`]).
const RETRY_SPLITS: usize = 3;

impl Greedy {
    /// Greedy at `opts`' budget: the value plan, and with
    /// [`RematOptions::segments`] the segment plan when it may pay, the
    /// better kept.
    fn plan_at(&self, g: &Graph, opts: &RematOptions) -> Result<RematPlan, CompileError> {
        let plan = greedy(self.name(), g, opts, false)?;
        if !opts.segments {
            return Ok(plan);
        }
        let by_time = opts.cost == RecomputeCost::Kernels;
        if by_time && plan.met {
            let step = kernel_seconds(g, &liveness(g, opts.fusion), &opts.target);
            if plan.extra_seconds <= SEGMENTS_FROM * step {
                return Ok(plan);
            }
        }
        let with = greedy(self.name(), g, opts, true)?;
        let key = |p: &RematPlan| {
            let cost = if by_time { p.extra_seconds } else { p.extra_flops as f64 };
            (!p.met, if p.met { 0 } else { p.after.peak_bytes }, cost, p.after.peak_bytes)
        };
        Ok(if key(&with).partial_cmp(&key(&plan)) == Some(std::cmp::Ordering::Less) { with } else { plan })
    }
}

/// One greedy plan; `segments`: block segments are candidates too.
fn greedy(name: &'static str, g: &Graph, opts: &RematOptions, segments: bool) -> Result<RematPlan, CompileError> {
    let base = liveness(g, opts.fusion);
    let before = peak_of(&base);
    let budget = budget_bytes(opts.budget, &before);
    let by_time = opts.cost == RecomputeCost::Kernels;
    let mut cur = g.clone();
    let mut cur_l = base;
    let mut choices = Vec::new();
    let mut cur_t = if by_time { kernel_seconds(&cur, &cur_l, &opts.target) } else { 0.0 };
    let mut memo = Memo::default();
    // The kernel at the unplanned peak, followed through the rewrites: where
    // the forward's segments end under `RecomputeCost::Kernels`
    // (`blocks::segment_candidates`).
    let mut first_peak = cur_l.order.get(before.peak_position).copied();
    loop {
        let peak = peak_of(&cur_l);
        if peak.peak_bytes <= budget {
            break;
        }
        let at = peak.peak_position;
        let mut cands: Vec<Candidate> = candidates(&cur, &cur_l, opts);
        // Values that would each clone one kernel are also offered together
        // ([`super::siblings`]); priced by kernels only, where a clone's
        // kernel is what a plan pays for.
        let mut siblings =
            if by_time { super::siblings::sibling_candidates(&cur, &cur_l, &cands, opts) } else { Vec::new() };
        if segments {
            let across = by_time.then(|| first_peak.and_then(|n| cur_l.positions()[n.index()]).unwrap_or(at));
            let segs = super::blocks::segment_candidates(&cur, &cur_l, &cands, across, opts);
            cands.extend(segs);
        }
        // Only values live across the peak can lower it.
        let across_peak = |c: &Candidate| c.early_end < at && at < c.late_pos;
        cands.retain(across_peak);
        siblings.retain(across_peak);
        // Bytes freed per second of recomputation, by the candidate's estimate.
        let per_second = |c: &Candidate| c.bytes as f64 / (c.seconds + 1e-12);
        siblings.sort_by(|a, b| per_second(b).total_cmp(&per_second(a)).then(a.value.cmp(&b.value)));
        // Candidates that alone cover the excess, cheapest first (so a
        // small excess is not paid for with a large recomputation); then
        // the others by bytes freed per second of recomputation.
        let excess = peak.peak_bytes.saturating_sub(budget);
        cands.sort_by(|a, b| {
            let (ca, cb) = (a.bytes >= excess, b.bytes >= excess);
            cb.cmp(&ca)
                .then_with(|| match (ca && cb, by_time) {
                    (true, false) => a.flops.cmp(&b.flops).then(a.seconds.total_cmp(&b.seconds)),
                    (true, true) => a.seconds.total_cmp(&b.seconds).then(a.flops.cmp(&b.flops)),
                    (false, _) => per_second(b).total_cmp(&per_second(a)),
                })
                .then(a.value.cmp(&b.value))
        });
        let round = Round {
            g: &cur,
            l: &cur_l,
            opts,
            budget,
            pressure: pressure(&cur_l, peak.peak_bytes),
            excess_area: if by_time { excess_area(&cur_l, budget) } else { 0 },
            seconds: cur_t,
        };
        let step =
            if by_time { round.by_kernels(&cands, &siblings, &mut memo)? } else { round.first_that_helps(&cands)? };
        let Some(step) = step else { break };
        choices.push(step.choice);
        memo.remap(&step.map);
        first_peak = first_peak.map(|n| step.map[n.index()]);
        cur = step.graph;
        cur_l = step.liveness;
        if let Some(m) = step.measured {
            cur_t = m.seconds;
        }
    }
    if !choices.is_empty() {
        // Two chains that clone the same GEMM share one ([`super::twins`]).
        let (merged, n) = super::twins::merge_twin_gemms(&cur, opts.fusion, budget)?;
        tracing::debug!(twins = n, "merged twin GEMMs");
        cur = merged;
    }
    if opts.pin_floating && !choices.is_empty() {
        let l = liveness(&cur, opts.fusion);
        if let Some(bwd) = first_backward_read(&cur, &l, opts) {
            let weights = gathered_weights(&cur, &opts.gathered_params);
            let (pinned, n) = super::pin::pin_floating(&cur, opts.fusion, bwd, &weights)?;
            tracing::debug!(pinned = n, "pinned floating backward kernels");
            cur = pinned;
        }
    }
    Ok(finish(name, g, cur, choices, before, opts))
}

/// One round of greedy: the graph so far, its liveness and its peak.
struct Round<'r, 'a> {
    g: &'r Graph,
    l: &'r Liveness,
    opts: &'r RematOptions<'a>,
    budget: u64,
    /// [`pressure`] at the peak.
    pressure: (u64, usize),
    /// [`excess_area`] over the budget (`Kernels` only).
    excess_area: u128,
    /// The step's kernel seconds (`Kernels` only).
    seconds: f64,
}

/// A candidate applied: the rewritten graph, its liveness and the old→new
/// node map.
struct Step {
    choice: RematChoice,
    graph: Graph,
    liveness: Liveness,
    map: Vec<NodeId>,
    measured: Option<Measured>,
}

impl Round<'_, '_> {
    /// `c` applied, if it lowers the peak (or the positions at it).
    fn apply(&self, c: &Candidate) -> Result<Option<Step>, CompileError> {
        let (graph, map) = rewrite(self.g, c, self.opts.guard_leaves)?;
        let liveness = liveness(&graph, self.opts.fusion);
        if pressure(&liveness, self.pressure.0) >= self.pressure {
            return Ok(None);
        }
        let choice = c.choice(self.g);
        Ok(Some(Step { choice, graph, liveness, map, measured: None }))
    }

    /// `c` applied and measured by kernel time, if it lowers the peak.
    fn measure(&self, c: &Candidate) -> Result<Option<Step>, CompileError> {
        let Some(mut step) = self.apply(c)? else { return Ok(None) };
        let t = kernel_seconds(&step.graph, &step.liveness, &self.opts.target);
        step.measured = Some(Measured {
            covers: live_peak(&step.liveness).1 <= self.budget,
            added: (t - self.seconds).max(0.0),
            freed: self.excess_area.saturating_sub(excess_area(&step.liveness, self.budget)),
            seconds: t,
        });
        Ok(Some(step))
    }

    /// `c`'s measurement recorded: its score in `memo` (dropped if it no
    /// longer lowers the peak), and its step kept if it is the best so far.
    fn record(&self, c: &Candidate, step: Option<Step>, memo: &mut Memo, best: &mut Option<Step>) -> Option<Measured> {
        let key = (c.value, c.chain.len());
        let Some(step) = step else {
            memo.scores.remove(&key);
            return None;
        };
        let m = step.measured.expect("measured");
        memo.scores.insert(key, m);
        if best.as_ref().is_none_or(|b| m.better_than(b.measured.as_ref().expect("measured"))) {
            *best = Some(step);
        }
        Some(m)
    }

    /// [`RecomputeCost::Arithmetic`]: the first candidate in order that
    /// lowers the peak.
    fn first_that_helps(&self, cands: &[Candidate]) -> Result<Option<Step>, CompileError> {
        for c in cands.iter().take(GREEDY_TRIES) {
            if let Some(step) = self.apply(c)? {
                return Ok(Some(step));
            }
        }
        Ok(None)
    }

    /// [`RecomputeCost::Kernels`]: of the first [`KERNEL_TRIES`] candidates
    /// in order that lower the peak, the best by measured kernel time
    /// ([`Measured::better_than`]).
    ///
    /// Lazily ([`RematOptions::lazy`]): a score an earlier round measured
    /// (in `memo`) stands in for its candidate until it is the round's best,
    /// and only then is it measured again; the round takes the first best
    /// that is fresh and that no old score made better by [`STALE_SLACK`]
    /// would beat. An old score is taken as a near bound: the excess a
    /// candidate frees mostly shrinks as the plan lowers the curve. Where it
    /// cannot be one, the candidate is measured at once: it freed no excess
    /// then (it lowered the peak only by its count of positions, so its
    /// score of zero orders nothing), or it did not cover the excess then
    /// and its bytes could cover it now. A candidate that did not lower the
    /// peak is tried again each round, as the peak moves. On gpt2-small's
    /// train step this gives the plans of measuring every candidate each
    /// round, or plans within 0.3% of their predicted time, in a third of
    /// the time (`docs/memory-journal.md`, "The remat pass's own time").
    ///
    /// The window's fresh measurements run on rayon's threads; the old
    /// scores that are measured again, one at a time, decide which is next.
    fn by_kernels(
        &self,
        cands: &[Candidate],
        siblings: &[Candidate],
        memo: &mut Memo,
    ) -> Result<Option<Step>, CompileError> {
        let excess = live_peak(self.l).1.saturating_sub(self.budget);
        // Each candidate of the window with its score, and whether the score
        // was measured this round.
        let mut window: Vec<(&Candidate, Measured, bool)> = Vec::new();
        // The best step measured this round, kept so the winner is not
        // applied twice.
        let mut best_fresh: Option<Step> = None;
        // The first candidates in order that lower the peak, up to
        // KERNEL_TRIES, each with its old score where that stands in for it.
        // Those without one are measured in parallel, a batch at a time: a
        // batch ends where the window would be full if every candidate in it
        // lowered the peak (or before a second candidate with the key of one
        // it measures), so exactly the candidates a walk one at a time would
        // measure are measured, and recorded in its order.
        // The sibling candidates ([`super::siblings`]) then fill a window of
        // their own: the chain-as-one-kernel estimate that orders `cands`
        // prices a GEMM shared by three values as if the three were one
        // kernel, and ranked among the values they would push out cheaper
        // candidates that the walk never measured.
        for (cands, cap) in [(&cands[..cands.len().min(GREEDY_TRIES)], KERNEL_TRIES), (siblings, siblings.len())] {
            let cap = window.len() + cap;
            let mut next = 0;
            while window.len() < cap && next < cands.len() {
                let mut batch: Vec<(&Candidate, Option<Measured>)> = Vec::new();
                let mut keys = Vec::new();
                while window.len() + batch.len() < cap && next < cands.len() {
                    let c = &cands[next];
                    let key = (c.value, c.chain.len());
                    if keys.contains(&key) {
                        break;
                    }
                    next += 1;
                    match memo.scores.get(&key).copied() {
                        Some(m) if self.opts.lazy && m.freed > 0 && (m.covers || c.bytes < excess) => {
                            batch.push((c, Some(m)))
                        }
                        _ => {
                            batch.push((c, None));
                            keys.push(key);
                        }
                    }
                }
                let to_measure: Vec<&Candidate> =
                    batch.iter().filter(|(_, old)| old.is_none()).map(|(c, _)| *c).collect();
                let mut steps =
                    to_measure.par_iter().map(|c| self.measure(c)).collect::<Result<Vec<_>, _>>()?.into_iter();
                for (c, old) in batch {
                    match old {
                        Some(m) => window.push((c, m, false)),
                        None => {
                            let step = steps.next().expect("one step per candidate measured");
                            if let Some(m) = self.record(c, step, memo, &mut best_fresh) {
                                window.push((c, m, true));
                            }
                        }
                    }
                }
            }
        }
        let mut measure = |c: &Candidate, memo: &mut Memo| -> Result<Option<Measured>, CompileError> {
            let step = self.measure(c)?;
            Ok(self.record(c, step, memo, &mut best_fresh))
        };
        let best_of = |window: &[(&Candidate, Measured, bool)],
                       keep: &dyn Fn(&(&Candidate, Measured, bool)) -> bool| {
            (0..window.len()).filter(|&k| keep(&window[k])).reduce(|a, b| {
                if window[b].1.better_than(&window[a].1) {
                    b
                } else {
                    a
                }
            })
        };
        loop {
            let Some(top) = best_of(&window, &|_| true) else { return Ok(None) };
            let (c, best, fresh) = window[top];
            // The best is an old score, or an old score better by
            // STALE_SLACK would beat the fresh best: measure it again.
            let stale = if fresh {
                best_of(&window, &|&(_, m, fresh)| !fresh && m.optimistic().better_than(&best))
            } else {
                Some(top)
            };
            if let Some(k) = stale {
                let ck = window[k].0;
                match measure(ck, memo)? {
                    Some(m) => window[k] = (ck, m, true),
                    None => {
                        window.remove(k);
                    }
                }
                continue;
            }
            let same = |s: &Step| s.choice.value == c.value && s.choice.recomputed_nodes == c.chain.len();
            return match best_fresh.filter(same) {
                Some(step) => Ok(Some(step)),
                None => self.measure(c),
            };
        }
    }
}

/// The scores earlier rounds measured, keyed by the candidate's value and
/// chain length in the current graph ([`Round::by_kernels`]).
#[derive(Default)]
struct Memo {
    scores: std::collections::HashMap<(ValueId, usize), Measured>,
}

impl Memo {
    /// Re-keys the scores for the graph a rewrite made (`map`: old node
    /// index → new node).
    fn remap(&mut self, map: &[NodeId]) {
        self.scores = std::mem::take(&mut self.scores)
            .into_iter()
            .map(|((v, n), m)| ((ValueId::new(map[v.node.index()], v.output), n), m))
            .collect();
    }
}

/// A candidate applied and measured by kernel time.
#[derive(Clone, Copy)]
struct Measured {
    /// The planned peak is within the budget after it.
    covers: bool,
    /// Kernel seconds it adds to the step.
    added: f64,
    /// How much it lowers the live bytes over the budget, summed over the
    /// program's positions ([`excess_area`]).
    freed: u128,
    /// The step's kernel seconds after it.
    seconds: f64,
}

impl Measured {
    /// The score made better by [`STALE_SLACK`]: an old score's bound.
    fn optimistic(&self) -> Measured {
        if self.covers {
            Measured { added: self.added / STALE_SLACK, ..*self }
        } else {
            Measured { freed: (self.freed as f64 * STALE_SLACK) as u128, ..*self }
        }
    }

    /// The most excess freed per second added. A candidate that covers the
    /// excess frees all of it, so of two such the faster wins, and one that
    /// covers wins over one that does not unless that one frees excess at a
    /// better rate (then the next round covers the rest). Covering first
    /// whatever the rate made greedy at 50% of gpt2-small's activation memory
    /// cover its last 36 MiB with a q/k/v recomputation ([`super::siblings`])
    /// instead of weight copies and a residual, 0.915 against 0.864 ms by the
    /// kernel model (the plan of before siblings, which this rule gives back).
    /// Equal rates: the one that covers, then the faster.
    fn better_than(&self, other: &Measured) -> bool {
        let rate = |m: &Measured| m.freed as f64 / (m.added + 1e-9);
        match rate(self).total_cmp(&rate(other)) {
            std::cmp::Ordering::Equal => (self.covers, other.added) > (other.covers, self.added),
            o => o == std::cmp::Ordering::Greater,
        }
    }
}

/// Live bytes over `budget`, summed over the program's positions: what a
/// plan must bring to zero. A value's buffer counts for every position it
/// is live over the budget at, so a layer norm's output that is dead at the
/// peak (only its small statistics are live there) frees little.
fn excess_area(l: &Liveness, budget: u64) -> u128 {
    l.live_curve().iter().map(|&b| b.saturating_sub(budget) as u128).sum()
}

pub(super) fn budget_bytes(budget: RematBudget, before: &PeakMemory) -> u64 {
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

/// The peak and how many positions reach it: a change helps when it lowers
/// the pair (a plateau at the peak is cut one candidate at a time).
fn pressure(l: &Liveness, at_least: u64) -> (u64, usize) {
    let curve = l.live_curve();
    let peak = curve.iter().copied().max().unwrap_or(0);
    (peak, curve.iter().filter(|&&b| b >= at_least.min(peak)).count())
}

pub(super) fn finish(
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

/// A value that can be recomputed for its late users.
#[derive(Clone, Debug)]
pub(super) struct Candidate {
    pub(super) value: ValueId,
    /// Other values whose buffers the chain frees ([`RematChoice::also`]).
    pub(super) also: Vec<ValueId>,
    /// Bytes of the buffers freed.
    pub(super) bytes: u64,
    /// Position after which no early user reads it.
    pub(super) early_end: usize,
    /// The first late user (the clones go just before it) and its position.
    pub(super) late_node: NodeId,
    pub(super) late_pos: usize,
    /// Nodes to clone, in insertion order; the last one produces `value`.
    pub(super) chain: Vec<NodeId>,
    /// Values the chain reads from memory, fenced by the barrier but for
    /// `unfenced`.
    pub(super) leaves: Vec<ValueId>,
    /// The leaves computed from gathered parameters alone
    /// ([`RematOptions::gathered_params`]), read where they are.
    pub(super) unfenced: Vec<ValueId>,
    /// A value of the late region that the barrier waits for.
    pub(super) anchor: Option<ValueId>,
    pub(super) flops: u64,
    pub(super) seconds: f64,
}

impl Candidate {
    pub(super) fn choice(&self, g: &Graph) -> RematChoice {
        RematChoice {
            value: self.value,
            also: self.also.clone(),
            op: g.node(self.value.node).op.name(),
            bytes: self.bytes,
            recomputed_nodes: self.chain.len(),
            flops: self.flops,
        }
    }
}

/// Whether a node may be cloned: same inputs give the same outputs. The
/// forward composites (attention, layer norm, the LM head's loss) are
/// deterministic and are cloned whole with every output (attention's
/// statistics, layer norm's mean and rstd): recomputing a transformer block
/// means recomputing them, and their price is the cost model's. Their
/// backward counterparts only ever run once, late; random-bit generators
/// would draw again.
pub(super) fn clonable(op: &Op) -> bool {
    op.props().clonable
}

/// Where the backward starts in `l`'s order: the first late read of any
/// candidate (in a training step, the first backward kernel that reads a
/// forward value).
pub(super) fn first_backward_read(g: &Graph, l: &Liveness, opts: &RematOptions) -> Option<usize> {
    candidates(g, l, opts).iter().map(|c| c.late_pos).min()
}

/// Whether `g` keeps any value for a reader well after its writer that remat
/// could recompute (a training step's backward reading the forward's values).
/// A program without a backward (an evaluation, the parameters' init) keeps
/// none: a budget in a share of its activation memory has nothing to act on.
pub fn keeps_values_for_later(g: &Graph, opts: &RematOptions) -> bool {
    first_backward_read(g, &liveness(g, opts.fusion), opts).is_some()
}

pub(super) fn candidates(g: &Graph, l: &Liveness, opts: &RematOptions) -> Vec<Candidate> {
    let users = users_of(g);
    let pos = l.positions();
    let weights = gathered_weights(g, &opts.gathered_params);
    let mut out = Vec::new();
    for b in &l.buffers {
        if b.kind != BufferKind::Temp {
            continue;
        }
        let v = b.value;
        if let Some(only) = opts.only {
            if !only.contains(&v) {
                continue;
            }
        }
        let node = g.node(v.node);
        if !clonable(&node.op) || matches!(node.op, Op::Constant { .. } | Op::Iota { .. }) || fixed(g, &weights, v.node)
        {
            continue;
        }
        // Kernels that read the buffer, directly or through fused nodes and
        // reshapes (views): `views` are those intermediaries.
        let (mut kernels, views) = readers(g, l, &users, v.node);
        kernels.sort_by_key(|&(p, _)| p);
        if kernels.len() < 2 {
            continue;
        }
        let mut best: Option<(usize, usize, usize)> = None; // (gap, split, early_end)
        for k in 1..kernels.len() {
            let early_end = kernels[k - 1].0.max(b.def);
            let late = kernels[k].0;
            if late > early_end + 1 {
                let gap = late - early_end;
                if best.is_none_or(|(g0, _, _)| gap > g0) {
                    best = Some((gap, k, early_end));
                }
            }
        }
        let Some((_, split, early_end)) = best else { continue };
        let (late_pos, late_node) = kernels[split];
        let Some((mut chain, leaves)) = chain_for(g, l, &weights, v, late_pos, opts.max_chain_nodes) else { continue };
        let unfenced = unfenced(&leaves, &weights);
        // Views placed before the late point that a late node reads (directly
        // or through other such views) are cloned too, for the late kernels.
        let mut early_views: Vec<NodeId> =
            views.into_iter().filter(|n| pos[n.index()].is_some_and(|p| p < late_pos)).collect();
        early_views.sort_by(|a, b| b.cmp(a));
        let mut view_clones: Vec<NodeId> = Vec::new();
        for &w in &early_views {
            let needed = users[w.index()]
                .iter()
                .any(|u| pos[u.index()].is_some_and(|p| p >= late_pos) || view_clones.contains(u));
            if needed {
                view_clones.push(w);
            }
        }
        // The anchor must be a buffer of its own outside the chain: fencing a
        // fused value would make it a kernel that reads the chain's originals.
        // The late kernel often reads its other operand through a view or a
        // fused producer (a reshaped or transposed cotangent), so those are
        // looked through to the buffers the late kernel reads.
        let anchor = anchor_for(g, l, late_node, late_pos, early_end, &chain, &view_clones);
        // Without a fenced leaf and an anchor nothing stops XLA's CSE from
        // merging the clones back (constant-only chains such as masks).
        if leaves.len() == unfenced.len() || anchor.is_none() {
            continue;
        }
        // Recompute time, as `opts.cost` prices a chain.
        let (flops, seconds) = recompute_cost(g, &chain, &leaves, b.bytes, opts);
        chain.extend(view_clones);
        chain.sort();
        chain.dedup();
        out.push(Candidate {
            value: v,
            also: Vec::new(),
            bytes: b.bytes,
            early_end,
            late_node,
            late_pos,
            chain,
            leaves,
            unfenced,
            anchor,
            flops,
            seconds,
        });
    }
    out
}

/// FLOPs and roofline seconds of recomputing `chain`, which reads `leaves`
/// and yields a buffer of `bytes`. [`RecomputeCost::Arithmetic`]:
/// loop-fusible ops fuse into the kernel that reads them and add only their
/// arithmetic; the others (dots, reductions, gathers) pay the slower of
/// arithmetic and memory. [`RecomputeCost::Kernels`]: the chain as one
/// kernel, the slower of its arithmetic and its traffic (the leaves read,
/// the value written) at the rates the kernel model achieves
/// ([`kernel_time`]): greedy's order before it measures kernel time.
pub(super) fn recompute_cost(
    g: &Graph,
    chain: &[NodeId],
    leaves: &[ValueId],
    bytes: u64,
    opts: &RematOptions,
) -> (u64, f64) {
    // One pass: the FLOPs, the arithmetic roofline and the kernel model's
    // achieved compute time of the chain.
    let (flops, roofline, compute) = chain.iter().fold((0u64, 0.0f64, 0.0f64), |(f, s, a), &n| {
        let c = cost::node_cost(g, n);
        let peak = c.flops as f64 / opts.target.peak_flops_per_s(c.peak);
        let t = if super::loop_fusible(&g.node(n).op) {
            peak
        } else {
            peak.max(c.bytes() as f64 / opts.target.mem_bytes_per_s)
        };
        (f.saturating_add(c.flops), s + t, a + kernel_time::achieved_compute_seconds(&g.node(n).op, &c, &opts.target))
    });
    match opts.cost {
        RecomputeCost::Arithmetic => (flops, roofline),
        RecomputeCost::Kernels => {
            let read: u64 = leaves.iter().map(|&v| g.ty(v).size_in_bytes() as u64).sum();
            (flops, compute.max(kernel_time::traffic_seconds(read.saturating_add(bytes), &opts.target)))
        }
    }
}

/// A buffer the kernel `late` reads (directly, or through fused producers and
/// reshapes), written after `early_end` and outside the nodes to clone: the
/// latest such one.
pub(super) fn anchor_for(
    g: &Graph,
    l: &Liveness,
    late: NodeId,
    late_pos: usize,
    early_end: usize,
    chain: &[NodeId],
    view_clones: &[NodeId],
) -> Option<ValueId> {
    let mut best: Option<ValueId> = None;
    let mut stack = g.node(late).op.inputs();
    let mut seen: Vec<NodeId> = Vec::new();
    while let Some(a) = stack.pop() {
        if chain.contains(&a.node) || seen.contains(&a.node) {
            continue;
        }
        seen.push(a.node);
        let i = a.node.index();
        // The value's fused readers are cloned with the chain, but what else
        // they read is the late region's: GELU's derivative reads the
        // recomputed `tanh` and, through them, the cotangent. Waiting for the
        // cotangent keeps the clones in the kernel XLA fuses the derivative
        // into (docs/memory-journal.md, "One pass over a recomputed leaf").
        let view = !l.materialized[i] || matches!(g.node(a.node).op, Op::Reshape { .. } | Op::Whole { .. });
        if view {
            stack.extend(g.node(a.node).op.inputs());
        } else if l.exec_pos[i].is_some_and(|p| p > early_end)
            && best.is_none_or(|b| l.exec_pos[b.node.index()] < l.exec_pos[i])
        {
            best = Some(a);
        }
    }
    if best.is_some() {
        return best;
    }
    // A late kernel that reads nothing else of the late region (a derivative
    // factor computed from the activation alone): the barrier waits for the
    // latest buffer written in the gap instead, one still live at the late
    // kernel if there is one (no buffer's life is then extended); the peak
    // model judges the plan with whatever extension remains.
    let outside = |b: &&super::liveness::Buffer| {
        b.def > early_end
            && b.def < late_pos
            && matches!(b.kind, BufferKind::Temp | BufferKind::Output | BufferKind::Donated)
            && !chain.contains(&b.value.node)
            && !view_clones.contains(&b.value.node)
    };
    let latest = |live_at_late: bool| {
        l.buffers.iter().filter(outside).filter(|b| !live_at_late || b.last_use >= late_pos).max_by_key(|b| b.def)
    };
    latest(true).or_else(|| latest(false)).map(|b| b.value)
}

/// The kernels reading node `n`'s buffer as `(position, node)`, following
/// fused users and reshapes, and those fused users and reshapes.
pub(super) fn readers(
    g: &Graph,
    l: &Liveness,
    users: &[Vec<NodeId>],
    n: NodeId,
) -> (Vec<(usize, NodeId)>, Vec<NodeId>) {
    let mut kernels = Vec::new();
    let mut views = Vec::new();
    let mut stack = vec![n];
    while let Some(x) = stack.pop() {
        for &u in &users[x.index()] {
            let Some(p) = l.exec_pos[u.index()] else { continue };
            let view = !l.materialized[u.index()] || matches!(g.node(u).op, Op::Reshape { .. } | Op::Whole { .. });
            if view {
                if !views.contains(&u) {
                    views.push(u);
                    stack.push(u);
                }
            } else if !kernels.iter().any(|&(_, k)| k == u) {
                kernels.push((p, u));
            }
        }
    }
    (kernels, views)
}

/// The nodes to clone to recompute `v` at position `at`, and the values they
/// read from memory; `None` when the chain would exceed `max_nodes`.
fn chain_for(
    g: &Graph,
    l: &Liveness,
    weights: &[bool],
    v: ValueId,
    at: usize,
    max_nodes: usize,
) -> Option<(Vec<NodeId>, Vec<ValueId>)> {
    clone_closure(g, vec![v.node], weights, max_nodes, |u| {
        Some(match l.buffer_of[u.node.index()][u.output as usize] {
            Some(b) => {
                let b = &l.buffers[b];
                b.value != v && b.def < at && b.last_use >= at
            }
            None => false,
        })
    })
}

/// What recomputing `roots` takes: walking back through operands, a value
/// is a leaf (read, not cloned) when its producer may not be cloned, when it
/// is [`fixed`] by `weights` ([`gathered_weights`]) or when `kept` says it is in
/// memory at the recomputation (constants and iotas excepted: cloning them
/// is free); every other producer is cloned too. The nodes to clone, roots
/// included, and the leaves, each sorted; `None` when the clones would
/// exceed `max_nodes` or `kept` answers `None`.
pub(super) fn clone_closure(
    g: &Graph,
    roots: Vec<NodeId>,
    weights: &[bool],
    max_nodes: usize,
    mut kept: impl FnMut(ValueId) -> Option<bool>,
) -> Option<(Vec<NodeId>, Vec<ValueId>)> {
    let mut chain = roots.clone();
    let mut leaves = Vec::new();
    let mut stack = roots;
    while let Some(n) = stack.pop() {
        for u in g.node(n).op.inputs() {
            if chain.contains(&u.node) || leaves.contains(&u) {
                continue;
            }
            let un = g.node(u.node);
            let is_leaf = !clonable(&un.op)
                || fixed(g, weights, u.node)
                || (kept(u)? && !matches!(un.op, Op::Constant { .. } | Op::Iota { .. }));
            if is_leaf {
                leaves.push(u);
            } else {
                if chain.len() >= max_nodes {
                    return None;
                }
                chain.push(u.node);
                stack.push(u.node);
            }
        }
    }
    chain.sort();
    leaves.sort();
    Some((chain, leaves))
}

/// Per node of `g`, whether it computes from the gathered parameters
/// `params` alone ([`RematOptions::gathered_params`]): such a parameter, or a
/// clonable node that reads such values (one at least), constants and iotas.
pub(super) fn gathered_weights(g: &Graph, params: &[u32]) -> Vec<bool> {
    let mut out = vec![false; g.len()];
    if params.is_empty() {
        return out;
    }
    let free = |n: NodeId| matches!(g.node(n).op, Op::Constant { .. } | Op::Iota { .. });
    for (id, node) in g.nodes() {
        out[id.index()] = match &node.op {
            Op::Parameter { index, .. } => params.contains(index),
            op if clonable(op) && !free(id) => {
                let inputs = op.inputs();
                inputs.iter().any(|u| out[u.node.index()]) && inputs.iter().all(|u| out[u.node.index()] || free(u.node))
            }
            _ => false,
        };
    }
    out
}

/// Whether node `n` is never recomputed where `weights` marks the gathered
/// weights ([`gathered_weights`]): a gathered weight, or rows picked from one
/// (an embedding's lookup). XLA's SPMD partitioner does not gather a table
/// for a lookup: it gathers every device's ids, picks the rows of its share
/// of the table for the whole batch, and reduce-scatters the result. A
/// recomputed lookup pays that again (`docs/memory.md`, "Remat under FSDP
/// reads the gathered weights").
pub(super) fn fixed(g: &Graph, weights: &[bool], n: NodeId) -> bool {
    weights[n.index()] || matches!(g.node(n).op, Op::Gather { operand, .. } if weights[operand.node.index()])
}

/// The leaves of a chain that `weights` marks: read where they are.
pub(super) fn unfenced(leaves: &[ValueId], weights: &[bool]) -> Vec<ValueId> {
    leaves.iter().copied().filter(|u| weights[u.node.index()]).collect()
}

/// `g` with `c`'s chain cloned before its first late user and every user at
/// or after that point reading the clone, its leaves read through the barrier
/// (and the runtime guard on the leaves `guard_leaves` picks); also the node
/// map old -> new.
pub(super) fn rewrite(
    g: &Graph,
    c: &Candidate,
    guard_leaves: LeafGuards,
) -> Result<(Graph, Vec<NodeId>), CompileError> {
    // The clones, the barrier and the guards' few nodes besides g's.
    let mut out = Graph::with_capacity_of(g, c.chain.len() + c.leaves.len() + 4);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.len());
    // Original chain node -> its clone, once the late point is reached.
    let mut clones: Vec<(NodeId, NodeId)> = Vec::new();
    // The anchor and the barrier's pass-through of it that later readers
    // read ([`LeafGuards::PassAnchor`]).
    let mut passed: Option<(ValueId, ValueId)> = None;
    let remap = |map: &[NodeId], v: ValueId| ValueId::new(map[v.node.index()], v.output);
    // The leaves behind the barrier; the unfenced ones are read where they
    // are, as the clones' other operands.
    let leaves: Vec<ValueId> = c.leaves.iter().copied().filter(|u| !c.unfenced.contains(u)).collect();
    for (id, node) in g.nodes() {
        if id == c.late_node {
            let mut fenced: Vec<ValueId> = leaves.iter().map(|&u| remap(&map, u)).collect();
            let n_leaves = fenced.len();
            if let Some(a) = c.anchor {
                fenced.push(remap(&map, a));
            }
            let barrier = if n_leaves > 0 { Some(out.add(Op::OptimizationBarrier { inputs: fenced })?) } else { None };
            // A passed anchor holds the clones back only if something from
            // here on reads it; otherwise the chain's entries are guarded.
            let pass = match (guard_leaves, barrier, c.anchor) {
                (LeafGuards::PassAnchor, Some(b), Some(a))
                    if g.users(a.node).iter().any(|&u| u >= id && g.node(u).op.inputs().contains(&a)) =>
                {
                    Some((a, ValueId::new(b, n_leaves as u32)))
                }
                _ => None,
            };
            let guard_leaves = match guard_leaves {
                LeafGuards::PassAnchor if pass.is_none() => LeafGuards::Entries,
                other => other,
            };
            passed = pass;
            // The runtime guard (see the module docs): the fenced leaves to
            // guard are read through `select(always, leaf, 0)`, `always`
            // computed from the anchor.
            let to_guard: Vec<bool> = match guard_leaves {
                LeafGuards::Every => vec![true; n_leaves],
                LeafGuards::Off | LeafGuards::PassAnchor => vec![false; n_leaves],
                LeafGuards::Entries => {
                    let mut pick = vec![false; n_leaves];
                    for &n in &c.chain {
                        let inputs = g.node(n).op.inputs();
                        if inputs.iter().any(|u| c.chain.contains(&u.node)) {
                            continue;
                        }
                        let smallest = inputs
                            .iter()
                            .filter_map(|u| leaves.iter().position(|x| x == u))
                            .min_by_key(|&k| g.ty(leaves[k]).size_in_bytes());
                        if let Some(k) = smallest {
                            pick[k] = true;
                        }
                    }
                    pick
                }
            };
            let guard = match (barrier, c.anchor) {
                (Some(b), Some(_)) if to_guard.contains(&true) => {
                    Some(crate::fence::always_true(&mut out, ValueId::new(b, n_leaves as u32))?)
                }
                _ => None,
            };
            let mut guarded: Vec<ValueId> = Vec::with_capacity(n_leaves);
            if let Some(b) = barrier {
                for (k, &wanted) in to_guard.iter().enumerate() {
                    let leaf = ValueId::new(b, k as u32);
                    guarded.push(match guard {
                        Some(p) if wanted => crate::fence::read_through(&mut out, p, leaf)?,
                        _ => leaf,
                    });
                }
            }
            for &n in &c.chain {
                let mut op = g.node(n).op.clone();
                op.map_inputs(|u| {
                    if let Some(k) = leaves.iter().position(|&x| x == u) {
                        guarded[k]
                    } else if let Some(&(_, cn)) = clones.iter().find(|(o, _)| *o == u.node) {
                        ValueId::new(cn, u.output)
                    } else {
                        // A view's other operands and the unfenced leaves
                        // are read where they are.
                        remap(&map, u)
                    }
                });
                clones.push((n, out.add_copy(op, &g.node(n).outputs)?));
            }
        }
        let mut op = node.op.clone();
        op.map_inputs(|u| match (clones.iter().find(|(o, _)| *o == u.node), passed) {
            (Some(&(_, cn)), _) => ValueId::new(cn, u.output),
            (None, Some((a, through))) if a == u => through,
            (None, _) => remap(&map, u),
        });
        map.push(out.add_copy(op, &node.outputs)?);
    }
    out.set_outputs(g.outputs().iter().map(|&v| remap(&map, v)).collect())?;
    out.copy_aliases(g)?;
    Ok((out, map))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Literal, TensorType, UnaryOp};
    use crate::memory::{peak_memory, EveryNodeAKernel};

    /// A "forward" chain a0..a3 of tanh, then a "backward" chain that reads
    /// each a_i in reverse order: the classic shape remat cuts.
    fn ladder(n: usize) -> Graph {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [256]);
        let p = g.parameter(t.clone());
        let mut acts = vec![p];
        for _ in 0..n {
            let last = *acts.last().unwrap();
            acts.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: last }).unwrap());
        }
        let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: acts[n] }).unwrap();
        for i in (1..n).rev() {
            ct = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: ct, rhs: acts[i] }).unwrap();
        }
        g.set_outputs(vec![ct]).unwrap();
        g
    }

    /// The ladder's backward reads its forward's values; the same chain
    /// without a backward (an evaluation's shape) keeps none for later.
    #[test]
    fn a_backward_is_what_keeps_values_for_later() {
        let opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        assert!(keeps_values_for_later(&ladder(6), &opts));
        let mut g = Graph::new();
        let mut x = g.parameter(TensorType::new(DType::F32, [256]));
        for _ in 0..6 {
            x = g.value(Op::Unary { op: UnaryOp::Tanh, input: x }).unwrap();
        }
        g.set_outputs(vec![x]).unwrap();
        assert!(!keeps_values_for_later(&g, &opts));
    }

    #[test]
    fn kernel_priced_greedy_cuts_the_ladder_peak_and_keeps_the_values() {
        let g = ladder(8);
        let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        let arith = rematerialize(&g, &Greedy, &opts).unwrap();
        opts.cost = RecomputeCost::Kernels;
        let plan = rematerialize(&g, &Greedy, &opts).unwrap();
        crate::verify(&plan.graph).unwrap();
        assert!(plan.after.peak_bytes < plan.before.peak_bytes, "{:?} -> {:?}", plan.before, plan.after);
        assert!(plan.after.peak_bytes <= arith.after.peak_bytes, "{:?} vs {:?}", plan.after, arith.after);
        assert!(plan.extra_seconds > 0.0);
        let x = Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| (i as f64 * 0.61).cos()).collect::<Vec<_>>())
            .unwrap();
        let want = crate::interpret(&g, std::slice::from_ref(&x)).unwrap();
        let got = crate::interpret(&plan.graph, &[x]).unwrap();
        assert_eq!(want, got, "recomputation is bit-identical on the interpreter");
    }

    #[test]
    fn kernel_priced_greedy_plans_alike_on_one_thread_and_on_four() {
        // Rounds measure their candidates in parallel batches; the plan must
        // be the one a walk one candidate at a time makes, whatever the
        // number of threads.
        let g = ladder(48);
        let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        opts.cost = RecomputeCost::Kernels;
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| rematerialize(&g, &Greedy, &opts).unwrap())
        };
        let (one, four) = (on(1), on(4));
        assert!(one.choices.len() > KERNEL_TRIES, "{} choices: too few rounds to fill a window", one.choices.len());
        assert_eq!(one.choices, four.choices);
        assert_eq!(one.after, four.after);
        assert_eq!(one.extra_seconds.to_bits(), four.extra_seconds.to_bits());
        assert_eq!(one.graph.to_string(), four.graph.to_string());
    }

    #[test]
    fn greedy_cuts_the_ladder_peak_and_keeps_the_values() {
        let g = ladder(8);
        let opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        let plan = rematerialize(&g, &Greedy, &opts).unwrap();
        crate::verify(&plan.graph).unwrap();
        assert!(plan.after.peak_bytes < plan.before.peak_bytes, "{:?} -> {:?}", plan.before, plan.after);
        assert!(!plan.choices.is_empty());
        assert!(plan.extra_flops > 0);
        assert_eq!(peak_memory(&plan.graph, &EveryNodeAKernel), plan.after);
        let x = Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| (i as f64 * 0.37).sin()).collect::<Vec<_>>())
            .unwrap();
        let want = crate::interpret(&g, std::slice::from_ref(&x)).unwrap();
        let got = crate::interpret(&plan.graph, &[x]).unwrap();
        assert_eq!(want, got, "recomputation is bit-identical on the interpreter");
    }

    /// `t = tanh(h)` is read by a forward row sum and, in the "backward",
    /// through fused products (`-(t·t)`, then times the cotangent `dg`) by
    /// one row sum; an unrelated GEMM `w` is written after `dg`. The barrier
    /// before the late kernel waits for `dg`, which the fused products read,
    /// not for `w`, the latest buffer of the gap: on the H100 waiting for a
    /// weight gradient made GELU's two recomputations a cycle to XLA.
    #[test]
    fn the_barrier_waits_for_what_the_fused_readers_read() {
        let mut g = Graph::new();
        let f32 = |dims: [usize; 2]| TensorType::new(DType::F32, dims);
        let h = g.parameter(f32([64, 128]));
        let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: h }).unwrap();
        let s = g.value(Op::Reduce { op: crate::ir::ReduceOp::Sum, input: t, axes: vec![1] }).unwrap();
        let (a, b) = (g.parameter(f32([64, 32])), g.parameter(f32([32, 128])));
        let dg = g.value(Op::DotGeneral { lhs: a, rhs: b, dims: crate::ir::DotDims::matmul() }).unwrap();
        let (c, d) = (g.parameter(f32([64, 32])), g.parameter(f32([32, 128])));
        let w = g.value(Op::DotGeneral { lhs: c, rhs: d, dims: crate::ir::DotDims::matmul() }).unwrap();
        let tt = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: t, rhs: t }).unwrap();
        let factor = g.value(Op::Unary { op: UnaryOp::Neg, input: tt }).unwrap();
        let prod = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: dg, rhs: factor }).unwrap();
        let r = g.value(Op::Reduce { op: crate::ir::ReduceOp::Sum, input: prod, axes: vec![1] }).unwrap();
        g.set_outputs(vec![s, w, r]).unwrap();
        let opts = RematOptions::new(RematBudget::Bytes(0), &crate::memory::XlaGpuFusion);
        let l = liveness(&g, opts.fusion);
        assert!(l.materialized[t.node.index()] && !l.materialized[prod.node.index()]);
        let cands = candidates(&g, &l, &opts);
        let c = cands.iter().find(|c| c.value == t).expect("tanh is a candidate");
        assert_eq!(c.late_node, r.node);
        assert_eq!(c.anchor, Some(dg));
    }

    /// [`ladder`] with a weight: eight layers `h = tanh(h ∘ wc)` of one
    /// weight's cast `wc = tanh(w)`, and a backward `ct = ct ∘ h_i ∘ wc` from
    /// the last layer down; `x` (parameter 0) is the input, `w` (parameter 1)
    /// the weight.
    fn weighted_ladder() -> (Graph, ValueId, ValueId) {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [256]);
        let x = g.parameter(t.clone());
        let w = g.parameter(t);
        let wc = g.value(Op::Unary { op: UnaryOp::Tanh, input: w }).unwrap();
        let mul = |g: &mut Graph, a, b| g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: a, rhs: b });
        let mut hs = vec![x];
        for _ in 0..8 {
            let y = mul(&mut g, *hs.last().unwrap(), wc).unwrap();
            hs.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: y }).unwrap());
        }
        let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: hs[8] }).unwrap();
        for &h in hs[1..8].iter().rev() {
            let m = mul(&mut g, ct, h).unwrap();
            ct = mul(&mut g, m, wc).unwrap();
        }
        g.set_outputs(vec![ct]).unwrap();
        (g, w, wc)
    }

    /// Under FSDP a weight read through the barrier or a guard, or
    /// recomputed, is a weight gathered again: with the weight's parameter
    /// among `gathered_params` the plan recomputes layers but reads the
    /// weight's cast where it is. Without, it fences the cast.
    #[test]
    fn a_gathered_weight_is_read_where_it_is() {
        let (g, w, wc) = weighted_ladder();
        let reads_weight = |plan: &RematPlan| {
            plan.graph.nodes().any(|(_, n)| {
                matches!(n.op, Op::OptimizationBarrier { .. } | Op::Select { .. })
                    && n.op.inputs().iter().any(|u| u.node == w.node || u.node == wc.node)
            })
        };
        let casts = |plan: &RematPlan| {
            plan.graph
                .nodes()
                .filter(|(_, n)| matches!(n.op, Op::Unary { op: UnaryOp::Tanh, input } if input.node == w.node))
                .count()
        };
        let x = Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| (i as f64 * 0.23).sin()).collect::<Vec<_>>())
            .unwrap();
        let wv =
            Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| 0.5 + (i as f64 * 0.71).cos()).collect::<Vec<_>>())
                .unwrap();
        let want = crate::interpret(&g, &[x.clone(), wv.clone()]).unwrap();
        let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        let fenced = rematerialize(&g, &Greedy, &opts).unwrap();
        assert!(reads_weight(&fenced), "without gathered parameters the cast is fenced:\n{}", fenced.graph);
        opts.gathered_params = vec![1];
        let plan = rematerialize(&g, &Greedy, &opts).unwrap();
        crate::verify(&plan.graph).unwrap();
        assert!(!plan.choices.is_empty());
        assert!(plan.after.peak_bytes < plan.before.peak_bytes, "{:?} -> {:?}", plan.before, plan.after);
        assert!(!reads_weight(&plan), "a gathered weight read through a fence:\n{}", plan.graph);
        assert_eq!(casts(&plan), 1, "the weight's cast recomputed:\n{}", plan.graph);
        assert_eq!(crate::interpret(&plan.graph, &[x, wv]).unwrap(), want);
    }

    /// An embedding's lookup `x0 = table[ids]` (the table parameter 1) under
    /// eight layers `h = tanh(h)`, and a backward `ct = ct ∘ h_i` down to
    /// `h_1`, which is the one value greedy may recompute. `x0` is dead by
    /// then, so recomputing `h_1` means looking the rows up again, unless the
    /// table is gathered: then the chain would read `x0`, kept for it, which
    /// frees nothing, and greedy leaves the step as it is.
    #[test]
    fn a_lookup_in_a_gathered_table_is_not_recomputed() {
        let mut g = Graph::new();
        let ids = g.parameter(TensorType::new(DType::I32, [64]));
        let table = g.parameter(TensorType::new(DType::F32, [16, 32]));
        let x0 = g.value(Op::Gather { operand: table, indices: ids, axis: 0 }).unwrap();
        let mut hs = vec![x0];
        for _ in 0..8 {
            let last = *hs.last().unwrap();
            hs.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: last }).unwrap());
        }
        let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: hs[8] }).unwrap();
        for &h in hs[1..8].iter().rev() {
            ct = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: ct, rhs: h }).unwrap();
        }
        g.set_outputs(vec![ct]).unwrap();
        let lookups = |plan: &RematPlan| plan.graph.nodes().filter(|(_, n)| matches!(n.op, Op::Gather { .. })).count();
        let only = [hs[1]];
        let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        opts.only = Some(&only);
        let idv =
            Literal::from_f64s(DType::I32, [64], &(0..64).map(|i| ((i * 7) % 16) as f64).collect::<Vec<_>>()).unwrap();
        let tv =
            Literal::from_f64s(DType::F32, [16, 32], &(0..512).map(|i| (i as f64 * 0.37).sin()).collect::<Vec<_>>())
                .unwrap();
        let want = crate::interpret(&g, &[idv.clone(), tv.clone()]).unwrap();
        for gathered in [false, true] {
            opts.gathered_params = if gathered { vec![1] } else { Vec::new() };
            let plan = rematerialize(&g, &Greedy, &opts).unwrap();
            crate::verify(&plan.graph).unwrap();
            // Gathered, keeping x0 for the chain frees nothing: no plan.
            let (recomputed, expected) = if gathered { (0, 1) } else { (1, 2) };
            assert_eq!(plan.values_recomputed(), recomputed, "gathered {gathered}:\n{}", plan.graph);
            assert_eq!(lookups(&plan), expected, "gathered {gathered}:\n{}", plan.graph);
            assert_eq!(crate::interpret(&plan.graph, &[idv.clone(), tv.clone()]).unwrap(), want);
        }
    }

    #[test]
    fn clones_read_their_inputs_through_a_barrier() {
        let g = ladder(6);
        let opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        let plan = rematerialize(&g, &Greedy, &opts).unwrap();
        let barriers = plan.graph.nodes().filter(|(_, n)| matches!(n.op, Op::OptimizationBarrier { .. })).count();
        assert_eq!(barriers, plan.choices.len());
    }

    fn selects(g: &Graph) -> usize {
        g.nodes().filter(|(_, n)| matches!(n.op, Op::Select { .. })).count()
    }

    /// The ladder's lowest-peak plan with every leaf guarded, and with
    /// `guards`; checks the second verifies and computes the same values.
    fn ladder_plans(guards: LeafGuards) -> (RematPlan, RematPlan) {
        let g = ladder(6);
        let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        opts.pin_floating = false;
        let every = rematerialize(&g, &Greedy, &opts).unwrap();
        opts.guard_leaves = guards;
        let plan = rematerialize(&g, &Greedy, &opts).unwrap();
        assert!(!plan.choices.is_empty());
        crate::verify(&plan.graph).unwrap();
        let x = Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| (i as f64 * 0.61).cos()).collect::<Vec<_>>())
            .unwrap();
        let want = crate::interpret(&g, std::slice::from_ref(&x)).unwrap();
        assert_eq!(crate::interpret(&plan.graph, &[x]).unwrap(), want);
        (every, plan)
    }

    #[test]
    fn without_guards_the_barrier_alone_fences_and_values_are_unchanged() {
        let (guarded, bare) = ladder_plans(LeafGuards::Off);
        assert!(selects(&guarded.graph) > 0, "the default reads fenced leaves through the guard");
        assert_eq!(selects(&bare.graph), 0);
        let barriers = bare.graph.nodes().filter(|(_, n)| matches!(n.op, Op::OptimizationBarrier { .. })).count();
        assert_eq!(barriers, bare.choices.len());
    }

    /// On targets that expand barriers before scheduling, each chain's entry
    /// reads one guarded leaf: every barrier feeds a select, there are no
    /// more selects than with every leaf guarded, and the values are the same.
    #[test]
    fn entry_guards_hold_every_chain_and_values_are_unchanged() {
        let (every, entries) = ladder_plans(LeafGuards::Entries);
        assert!(selects(&entries.graph) <= selects(&every.graph));
        for (b, _) in entries.graph.nodes().filter(|(_, n)| matches!(n.op, Op::OptimizationBarrier { .. })) {
            let guarded = entries.graph.nodes().any(|(_, n)| match n.op {
                Op::Select { on_true, .. } => on_true.node == b,
                _ => false,
            });
            assert!(guarded, "the barrier {b:?} feeds no guard");
        }
    }

    /// With the anchor passed through, no leaf is guarded, every barrier's
    /// last result (the anchor's pass-through) is read, nothing reads an
    /// anchor itself after its barrier, and the values are the same.
    #[test]
    fn a_passed_anchor_is_read_through_every_barrier_and_values_are_unchanged() {
        let (_, passed) = ladder_plans(LeafGuards::PassAnchor);
        let g = &passed.graph;
        assert_eq!(selects(g), 0);
        let barriers: Vec<_> = g.nodes().filter(|(_, n)| matches!(n.op, Op::OptimizationBarrier { .. })).collect();
        assert_eq!(barriers.len(), passed.choices.len());
        for (b, node) in barriers {
            let Op::OptimizationBarrier { inputs } = &node.op else { unreachable!() };
            let last = inputs.len() as u32 - 1;
            let through = ValueId::new(b, last);
            assert!(g.users(b).iter().any(|&u| g.node(u).op.inputs().contains(&through)), "{b:?}'s anchor is not read");
            let anchor = inputs[last as usize];
            for u in g.users(anchor.node) {
                if u.index() > b.index() {
                    assert!(!g.node(u).op.inputs().contains(&anchor), "{u:?} reads the anchor past {b:?}");
                }
            }
        }
    }

    #[test]
    fn off_changes_nothing() {
        let g = ladder(4);
        let opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        let plan = rematerialize(&g, &Off, &opts).unwrap();
        assert_eq!(crate::text::print(&plan.graph), crate::text::print(&g));
        assert_eq!(plan.extra_flops, 0);
        assert!(!plan.met);
    }

    #[test]
    fn exact_meets_a_budget_with_no_more_flops_than_greedy() {
        let g = ladder(6);
        let before = peak_memory(&g, &EveryNodeAKernel).peak_bytes;
        let opts = RematOptions::new(RematBudget::Bytes(before * 3 / 4), &EveryNodeAKernel);
        let greedy = rematerialize(&g, &Greedy, &opts).unwrap();
        let exact = rematerialize(&g, &crate::memory::Exact, &opts).unwrap();
        assert!(
            exact.met && greedy.met,
            "greedy {} exact {} budget {}",
            greedy.after.peak_bytes,
            exact.after.peak_bytes,
            before * 3 / 4
        );
        assert!(exact.extra_flops <= greedy.extra_flops);
    }

    /// A layer-norm composite read early and late: remat clones it whole
    /// (every output), and the values do not change.
    #[test]
    fn a_multi_output_composite_is_cloned_whole() {
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [16, 64]));
        let gamma = g.parameter(TensorType::new(DType::F32, [64]));
        let beta = g.parameter(TensorType::new(DType::F32, [64]));
        let a = g.value(Op::Unary { op: UnaryOp::Tanh, input: p }).unwrap();
        let ln = g.add(Op::LayerNorm { x: a, gamma, beta, eps_bits: 1e-5f64.to_bits() }).unwrap();
        let y = ValueId::new(ln, 0);
        let mut acts = vec![y];
        for _ in 0..6 {
            let last = *acts.last().unwrap();
            acts.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: last }).unwrap());
        }
        let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: *acts.last().unwrap() }).unwrap();
        for &h in acts[..acts.len() - 1].iter().rev() {
            ct = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: ct, rhs: h }).unwrap();
        }
        g.set_outputs(vec![ct]).unwrap();
        let plan = rematerialize(&g, &Greedy, &RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel)).unwrap();
        crate::verify(&plan.graph).unwrap();
        assert!(plan.after.peak_bytes < plan.before.peak_bytes);
        let lns = plan.graph.nodes().filter(|(_, n)| matches!(n.op, Op::LayerNorm { .. })).count();
        assert_eq!(lns, 2, "the composite is recomputed once: {:?}", plan.choices);
        let x: Vec<Literal> = [(vec![16usize, 64], 0.37), (vec![64], 0.11), (vec![64], 0.23)]
            .iter()
            .map(|(shape, k)| {
                let n: usize = shape.iter().product();
                Literal::from_f64s(DType::F32, shape.clone(), &(0..n).map(|i| (i as f64 * k).sin()).collect::<Vec<_>>())
                    .unwrap()
            })
            .collect();
        assert_eq!(crate::interpret(&g, &x).unwrap(), crate::interpret(&plan.graph, &x).unwrap());
    }
}
