//! Greedy by the cost model (see [`Greedy`]).

use rayon::prelude::*;

use crate::analysis::{kernel_seconds, live_peak, liveness, peak_of, Liveness};
use crate::ir::{Graph, NodeId, ValueId};
use crate::CompileError;

use super::super::chain::{candidates, first_backward_read, gathered_weights, rewrite, Candidate};
use super::super::plan::{
    budget_bytes, finish, RecomputeCost, RematBudget, RematChoice, RematOptions, RematPlan, RematStrategy,
    KERNEL_TRIES, STALE_SLACK,
};

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
        let mut siblings = if by_time {
            super::super::candidates::siblings::sibling_candidates(&cur, &cur_l, &cands, opts)
        } else {
            Vec::new()
        };
        if segments {
            let across = by_time.then(|| first_peak.and_then(|n| cur_l.positions()[n.index()]).unwrap_or(at));
            let segs = super::super::candidates::blocks::segment_candidates(&cur, &cur_l, &cands, across, opts);
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
        let (merged, n) = super::super::candidates::twins::merge_twin_gemms(&cur, opts.fusion, budget)?;
        tracing::debug!(twins = n, "merged twin GEMMs");
        cur = merged;
    }
    if opts.pin_floating && !choices.is_empty() {
        let l = liveness(&cur, opts.fusion);
        if let Some(bwd) = first_backward_read(&cur, &l, opts) {
            let weights = gathered_weights(&cur, &opts.gathered_params);
            let (pinned, n) = super::super::candidates::pin::pin_floating(&cur, opts.fusion, bwd, &weights)?;
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

/// The peak and how many positions reach it: a change helps when it lowers
/// the pair (a plateau at the peak is cut one candidate at a time).
fn pressure(l: &Liveness, at_least: u64) -> (u64, usize) {
    let curve = l.live_curve();
    let peak = curve.iter().copied().max().unwrap_or(0);
    (peak, curve.iter().filter(|&&b| b >= at_least.min(peak)).count())
}
