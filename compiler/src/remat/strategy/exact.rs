//! The exact strategy: an integer program over every candidate of the
//! unplanned graph and their conditional versions, solved by `microlp` (a
//! pure-Rust MILP solver), each solution checked against the peak model.
//!
//! The program. One binary `x_c` per candidate `c` of the unplanned graph
//! ([`super::remat`]'s value candidates, all of them). Objective: the fewest
//! extra FLOPs, `sum flops_c x_c` (plus one per chosen candidate, so that
//! free recomputations are not chosen for nothing; and, for each pair where
//! one's chain reads the other's value, that one's FLOPs again when both are
//! chosen: applied in value order, the chain then recomputes the other's too).
//! Memory: at every position `t` of the unplanned execution order,
//! `base[t] + sum delta_c[t] x_c <= budget`, where `base` is the live curve
//! without a plan and `delta_c` is the change that recomputing `c` alone
//! makes to it, measured by rewriting the graph with `c` and running the peak
//! model (the positions of `c`'s clones count at the late user they precede).
//!
//! Conditional variables. A candidate's chain depends on what is in memory at
//! its late point, and so on the recomputations already made: once `c` is
//! recomputed, `d`'s chain may read `c`'s clones and be far cheaper, or `c`'s
//! chain may read `d`'s value, so that one recomputation of `d` serves both.
//! So for each candidate `c` (and, breadth first, each conditional variable,
//! up to [`MAX_CONDITION_DEPTH`] candidates deep), the candidates of the graph
//! `c` rewrote that are cheaper there, or that `c`'s chain reads, become
//! variables `x_{d|c}`: their FLOPs are their chains' there, their memory
//! change the one they make after `c`'s; `x_{d|c} <= x_c`, and each candidate
//! is chosen in one version at most. Conditional variables are applied after
//! their conditions, and a conditional chain before a chosen candidate it
//! reads. (Greedy, choosing on the graph its earlier choices rewrote, gets
//! such plans for free; without them the program could not, and was up to
//! 2.6× dearer than greedy on the tiny GPT: `docs/memory-journal.md`, "The exact strategy's conditional candidates".)
//!
//! The sum is exact when candidates do not interact; they do (two
//! conditional variables of one condition, a chain through a third
//! candidate). So every solution is applied (each candidate re-found in the
//! graph the previous ones rewrote) and measured by the peak model; one that
//! misses the budget, or meets it with more FLOPs than the program counted,
//! is excluded (with every other version of its candidates) and the program
//! solved again, up to [`MAX_ROUNDS`] times or [`ROUNDS_SECONDS`], until the
//! program's next solution costs at least the best measured plan's FLOPs.
//! When no subset can meet the budget by the program, the program first finds
//! the lowest peak it can reach and then the fewest FLOPs at that peak; when
//! no measured plan meets the budget, the rounds are run again over the
//! unplanned graph's candidates alone, whose changes the program trusts less
//! blindly.
//!
//! Invariants:
//! - The plan returned is the best measured one: meets the budget with the
//!   fewest extra FLOPs, else the lowest peak; the empty plan is measured too,
//!   so the plan never predicts more memory than no plan.
//! - Optimal for the program (the solver proves it, within its time limit);
//!   the measured plan is the one reported, FLOPs and peak from the rewritten
//!   graph, never from the program.

use std::time::Duration;

use microlp::{ComparisonOp, OptimizationDirection, Problem, SolveOutcome, Variable};

use crate::cost;
use crate::ir::{Graph, NodeId, ValueId};
use crate::CompileError;

use crate::analysis::{live_peak, peak_of};
use crate::analysis::{liveness, Liveness};
use crate::remat::chain::{candidates, rewrite, Candidate};
use crate::remat::plan::{budget_bytes, finish, RematChoice, RematOptions, RematPlan, RematStrategy};

/// Solutions measured before the strategy returns the best one so far.
pub const MAX_ROUNDS: usize = 32;

/// Time the solver may spend on one program.
const SOLVE_SECONDS: u64 = 20;

/// Time the rounds may take in all: then the best measured plan is returned.
const ROUNDS_SECONDS: u64 = 20;

/// Candidates a conditional variable may be conditioned on, in a chain
/// (`d` given `c` given `b`: depth 3).
const MAX_CONDITION_DEPTH: usize = 3;

/// Conditional variables per candidate of the unplanned graph, at most.
const MAX_CONDITIONALS_PER_CANDIDATE: usize = 8;

/// Exact by an integer program over the unplanned graph's candidates and
/// their conditional versions (see the module docs). For small graphs, and to measure [`super::Greedy`] against.
#[derive(Clone, Copy, Debug, Default)]
pub struct Exact;

/// The program's data: per variable its objective and its sparse change of
/// the live curve; the unplanned curve. Variables `0..n` are the unplanned
/// graph's candidates; the rest are conditional ones.
struct Program {
    flops: Vec<f64>,
    delta: Vec<Vec<(usize, i64)>>,
    base: Vec<u64>,
    /// `given[k]` for a conditional variable `k`: `(c, d)`, candidate `d` as
    /// it is once variable `c` is applied (and `c`'s own conditions); `None`
    /// for the unplanned graph's candidates.
    given: Vec<Option<(usize, usize)>>,
    /// `reads[k]`: the candidates whose values variable `k`'s chain reads.
    reads: Vec<Vec<usize>>,
}

/// A variable's rewrite of the unplanned graph, with its conditions'.
struct Applied {
    var: usize,
    /// The candidates applied, in order (the variable's last).
    applied: Vec<usize>,
    graph: Graph,
    /// Each unplanned node's image in `graph`.
    map: Vec<NodeId>,
    l: Liveness,
    /// `graph`'s live curve less the unplanned one, per unplanned position.
    change: Vec<(usize, i64)>,
}

impl Program {
    /// The program over the first `n` variables (the unplanned graph's
    /// candidates) only.
    fn unconditional(&self, n: usize) -> Program {
        Program {
            flops: self.flops[..n].to_vec(),
            delta: self.delta[..n].to_vec(),
            base: self.base.clone(),
            given: vec![None; n],
            reads: self.reads[..n].to_vec(),
        }
    }

    /// A peak no choice can go under: at some position, the unplanned bytes
    /// less every variable's saving there.
    fn floor(&self) -> f64 {
        let mut at = self.base.iter().map(|&b| b as f64).collect::<Vec<_>>();
        for d in &self.delta {
            for &(t, v) in d {
                at[t] += v.min(0) as f64;
            }
        }
        at.into_iter().fold(0.0, f64::max)
    }

    /// The candidates whose value is a leaf of unconditional candidate `c`'s
    /// chain: applied in value order, when both are chosen `c`'s chain
    /// recomputes that one's too (its value is no longer in memory), and so
    /// on through the chosen ones. None for a conditional variable (they are
    /// the other order).
    fn leaf_of(&self, c: usize) -> &[usize] {
        if self.given[c].is_none() {
            &self.reads[c]
        } else {
            &[]
        }
    }

    /// The unplanned candidate a variable recomputes.
    fn candidate(&self, k: usize) -> usize {
        self.given[k].map_or(k, |(_, d)| d)
    }
}

impl RematStrategy for Exact {
    fn name(&self) -> &'static str {
        "exact"
    }

    fn plan(&self, g: &Graph, opts: &RematOptions) -> Result<RematPlan, CompileError> {
        let base_l = liveness(g, opts.fusion);
        let before = peak_of(&base_l);
        let budget = budget_bytes(opts.budget, &before);
        let cands = candidates(g, &base_l, opts);
        let base = base_l.live_curve();
        let mut flops: Vec<f64> = cands.iter().map(|c| c.flops as f64 + 1.0).collect();
        let mut given = vec![None; cands.len()];
        let mut reads: Vec<Vec<usize>> = Vec::with_capacity(cands.len());
        let mut delta = Vec::with_capacity(cands.len());
        // Rewrites to grow conditional variables from, breadth first.
        let mut grow = std::collections::VecDeque::new();
        for (i, c) in cands.iter().enumerate() {
            let (graph, map) = rewrite(g, c, opts.guard_leaves)?;
            let l = liveness(&graph, opts.fusion);
            let change = curve_change(&base_l, &base, &map, &l);
            delta.push(change.clone());
            reads.push((0..cands.len()).filter(|&j| j != i && c.leaves.contains(&cands[j].value)).collect());
            grow.push_back(Applied { var: i, applied: vec![i], graph, map, l, change });
        }
        let cap = MAX_CONDITIONALS_PER_CANDIDATE * cands.len();
        while let Some(a) = grow.pop_front() {
            if a.applied.len() >= MAX_CONDITION_DEPTH {
                continue;
            }
            for cn in candidates(&a.graph, &a.l, opts) {
                if flops.len() >= cands.len() + cap {
                    break;
                }
                let image = |v: ValueId| ValueId::new(a.map[v.node.index()], v.output);
                let Some(j) = cands.iter().position(|o| image(o.value) == cn.value) else { continue };
                // Another version only where the applied chains change this
                // candidate: its chain reads their clones (it is cheaper), or
                // the last one's chain reads its value (then one
                // recomputation serves that chain and its own readers, where
                // applying it first would make the chain recompute it again).
                let changed = cn.flops < cands[j].flops || reads[a.var].contains(&j);
                if a.applied.contains(&j) || !changed {
                    continue;
                }
                let (graph, m) = rewrite(&a.graph, &cn, opts.guard_leaves)?;
                let l = liveness(&graph, opts.fusion);
                let map: Vec<NodeId> = a.map.iter().map(|n| m[n.index()]).collect();
                let change = curve_change(&base_l, &base, &map, &l);
                let k = flops.len();
                flops.push(cn.flops as f64 + 1.0);
                given.push(Some((a.var, j)));
                delta.push(subtract(&change, &a.change));
                let mut applied = a.applied.clone();
                applied.push(j);
                reads.push((0..cands.len()).filter(|&j| cn.leaves.contains(&image(cands[j].value))).collect());
                grow.push_back(Applied { var: k, applied, graph, map, l, change });
            }
        }
        let program = Program { flops, delta, base, given, reads };
        let base_flops = cost::graph_cost(g).total.flops;
        // (meets budget, extra flops, peak) of the best measured plan: the
        // empty one first.
        let measure = |graph: &Graph| {
            let peak = live_peak(&liveness(graph, opts.fusion)).1;
            let flops = cost::graph_cost(graph).total.flops.saturating_sub(base_flops);
            (peak <= budget, flops, peak)
        };
        type Best = ((bool, u64, u64), Graph, Vec<RematChoice>);
        let mut best: Best = (measure(g), g.clone(), Vec::new());
        let better = |key: (bool, u64, u64), k: (bool, u64, u64)| match (key.0, k.0) {
            (true, false) => true,
            (false, true) => false,
            (true, true) => (key.1, key.2) < (k.1, k.2),
            (false, false) => (key.2, key.1) < (k.2, k.1),
        };
        let rounds = |program: &Program, best: &mut Best| -> Result<(), CompileError> {
            // The bound the program holds every position to: the budget, or
            // the lowest peak the program can reach when it cannot meet it
            // (surely so under the sum of every saving at some position).
            let feasible = budget as f64 >= program.floor()
                && solve(program, budget as f64, &[], Duration::from_secs(SOLVE_SECONDS))?.is_some();
            let mut bound = if feasible { budget as f64 } else { solve_lowest_peak(program)? };
            let deadline = std::time::Instant::now() + Duration::from_secs(ROUNDS_SECONDS);
            let mut excluded: Vec<Vec<usize>> = Vec::new();
            for _ in 0..MAX_ROUNDS {
                let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else { break };
                let Some(chosen) = solve(program, bound, &excluded, left)? else {
                    // Every choice the program fits under a bound below the
                    // budget was measured over it: look for any peak lower
                    // than the best measured one.
                    let lower = best.0 .2 as f64 - 1.0;
                    if best.0 .0 || lower <= bound {
                        break;
                    }
                    bound = lower;
                    continue;
                };
                if chosen.is_empty() {
                    break;
                }
                // The program's FLOPs for this choice: once a measured plan
                // meets the budget with no more, later solutions (each at
                // least as dear by the program) cannot be expected to win.
                let predicted: u64 = chosen
                    .iter()
                    .map(|&c| {
                        let mut inner = vec![c];
                        closure(program, c, &mut |d| {
                            if chosen.contains(&d) && !inner.contains(&d) {
                                inner.push(d);
                                true
                            } else {
                                false
                            }
                        });
                        inner.iter().map(|&d| program.flops[d] as u64 - 1).sum::<u64>()
                    })
                    .sum();
                if best.0 .0 && predicted >= best.0 .1 {
                    break;
                }
                let (graph, choices) = apply(g, &cands, &apply_order(program, &cands, &chosen), opts)?;
                let key = measure(&graph);
                if better(key, best.0) {
                    *best = (key, graph, choices);
                }
                excluded.push(chosen);
            }
            Ok(())
        };
        if !best.0 .0 && !cands.is_empty() {
            rounds(&program, &mut best)?;
            if !best.0 .0 {
                // The conditional variables' changes are each measured after
                // their conditions alone, and the program over-trusts them
                // when nothing meets the budget: the lowest peak is looked
                // for over the unplanned graph's candidates too.
                rounds(&program.unconditional(cands.len()), &mut best)?;
            }
        }
        let (_, graph, choices) = best;
        Ok(finish(self.name(), g, graph, choices, before, opts))
    }
}

/// The candidates the program chooses under `bound`, none of the `excluded`
/// sets; `None` when no choice fits.
fn solve(
    p: &Program,
    bound: f64,
    excluded: &[Vec<usize>],
    limit: Duration,
) -> Result<Option<Vec<usize>>, CompileError> {
    let mut lp = Problem::new(OptimizationDirection::Minimize);
    lp.set_time_limit(limit.min(Duration::from_secs(SOLVE_SECONDS)));
    let scale = p.flops.iter().copied().fold(1.0f64, f64::max);
    let xs: Vec<Variable> = p.flops.iter().map(|&f| lp.add_binary_var(f / scale)).collect();
    // z[c][d] = 1 when c's chain recomputes d's: z >= x_c + x_d - 1 for a
    // direct leaf d of c, z[c][e] >= z[c][d] + x_e - 1 for a leaf e of such a d.
    for c in 0..xs.len() {
        let mut z: Vec<(usize, Variable)> = Vec::new();
        let mut stack: Vec<(Option<usize>, usize)> = p.leaf_of(c).iter().map(|&d| (None, d)).collect();
        while let Some((via, d)) = stack.pop() {
            if d == c {
                continue;
            }
            let zd = match z.iter().find(|(e, _)| *e == d) {
                Some(&(_, v)) => v,
                None => {
                    let v = lp.add_var(p.flops[d] / scale, (0.0, 1.0));
                    z.push((d, v));
                    stack.extend(p.leaf_of(d).iter().map(|&e| (Some(d), e)));
                    v
                }
            };
            let from = match via {
                None => xs[c],
                Some(v) => z.iter().find(|(e, _)| *e == v).expect("pushed before its leaves").1,
            };
            lp.add_constraint([(from, 1.0), (xs[d], 1.0), (zd, -1.0)], ComparisonOp::Le, 1.0);
        }
    }
    conditions(&mut lp, p, &xs);
    let mem_scale = p.base.iter().copied().max().unwrap_or(1).max(1) as f64;
    for (t, rows) in rows_by_position(p).into_iter().enumerate() {
        let worst = p.base[t] as f64 + rows.iter().map(|&(_, d)| d.max(0) as f64).sum::<f64>();
        if worst <= bound {
            continue;
        }
        let terms: Vec<(Variable, f64)> = rows.iter().map(|&(c, d)| (xs[c], d as f64 / mem_scale)).collect();
        lp.add_constraint(terms, ComparisonOp::Le, (bound - p.base[t] as f64) / mem_scale);
    }
    for set in excluded {
        // Every version of the set's candidates: versions differ only in
        // the order they are applied in.
        let cs: Vec<usize> = set.iter().map(|&k| p.candidate(k)).collect();
        let terms: Vec<(Variable, f64)> =
            (0..xs.len()).filter(|&k| cs.contains(&p.candidate(k))).map(|k| (xs[k], 1.0)).collect();
        lp.add_constraint(terms, ComparisonOp::Le, set.len() as f64 - 1.0);
    }
    match lp.solve() {
        Ok(SolveOutcome::Solution(s)) => Ok(Some((0..xs.len()).filter(|&c| s.var_value(xs[c]) > 0.5).collect())),
        Ok(SolveOutcome::Interrupted(_)) | Err(microlp::Error::Infeasible) => Ok(None),
        Err(e) => Err(CompileError::Remat { strategy: "exact", reason: format!("the integer program: {e}") }),
    }
}

/// The lowest peak the program can reach (bytes), any FLOPs.
fn solve_lowest_peak(p: &Program) -> Result<f64, CompileError> {
    let mut lp = Problem::new(OptimizationDirection::Minimize);
    lp.set_time_limit(Duration::from_secs(SOLVE_SECONDS));
    let mem_scale = p.base.iter().copied().max().unwrap_or(1).max(1) as f64;
    let xs: Vec<Variable> = p.flops.iter().map(|_| lp.add_binary_var(0.0)).collect();
    let peak = lp.add_var(1.0, (0.0, f64::INFINITY));
    conditions(&mut lp, p, &xs);
    for (t, rows) in rows_by_position(p).into_iter().enumerate() {
        let mut terms: Vec<(Variable, f64)> = rows.iter().map(|&(c, d)| (xs[c], d as f64 / mem_scale)).collect();
        terms.push((peak, -1.0));
        lp.add_constraint(terms, ComparisonOp::Le, -(p.base[t] as f64) / mem_scale);
    }
    match lp.solve() {
        // A hair above the optimum, so the second program is not infeasible
        // by round-off.
        Ok(SolveOutcome::Solution(s)) => Ok(s.var_value(peak) * mem_scale + 1.0),
        Ok(SolveOutcome::Interrupted(_)) => Ok(p.base.iter().copied().max().unwrap_or(0) as f64),
        Err(e) => Err(CompileError::Remat { strategy: "exact", reason: format!("the lowest-peak program: {e}") }),
    }
}

/// A conditional variable needs its condition, and a candidate is recomputed
/// by one chain at most: `x_k <= x_c` for `k` = `d` given `c`, and
/// `x_d + sum_k x_k <= 1` over `d`'s conditional variables.
fn conditions(lp: &mut Problem, p: &Program, xs: &[Variable]) {
    let mut versions: Vec<Vec<(Variable, f64)>> = (0..xs.len()).map(|c| vec![(xs[c], 1.0)]).collect();
    for (k, g) in p.given.iter().enumerate() {
        if let Some((c, d)) = *g {
            lp.add_constraint([(xs[k], 1.0), (xs[c], -1.0)], ComparisonOp::Le, 0.0);
            versions[d].push((xs[k], 1.0));
        }
    }
    for v in versions.into_iter().filter(|v| v.len() > 1) {
        lp.add_constraint(v, ComparisonOp::Le, 1.0);
    }
}

/// The sparse change that a rewrite makes to the unplanned live curve `base`
/// (of `base_l`'s order), per unplanned position: `map` takes each unplanned
/// node to its image, `l` is the rewritten graph's liveness.
fn curve_change(base_l: &Liveness, base: &[u64], map: &[NodeId], l: &Liveness) -> Vec<(usize, i64)> {
    let curve = l.live_curve();
    let new_pos = l.positions();
    let mut d = Vec::new();
    let mut from = 0usize;
    for (t, id) in base_l.order.iter().enumerate() {
        // An original node the rewrite left without readers is dead there:
        // its position merges into the next one.
        let Some(q) = new_pos[map[id.index()].index()] else { continue };
        let live = curve[from..=q].iter().copied().max().unwrap_or(0);
        if live != base[t] {
            d.push((t, live as i64 - base[t] as i64));
        }
        from = q + 1;
    }
    d
}

/// `a - b` of two sparse changes sorted by position.
fn subtract(a: &[(usize, i64)], b: &[(usize, i64)]) -> Vec<(usize, i64)> {
    let mut out: std::collections::BTreeMap<usize, i64> = a.iter().copied().collect();
    for &(t, v) in b {
        *out.entry(t).or_default() -= v;
    }
    out.into_iter().filter(|&(_, v)| v != 0).collect()
}

/// Walks the candidates whose chains `c`'s would recompute: `visit(d)`
/// says whether to go on through `d`'s leaves.
fn closure(p: &Program, c: usize, visit: &mut dyn FnMut(usize) -> bool) {
    let mut stack = p.leaf_of(c).to_vec();
    while let Some(d) = stack.pop() {
        if visit(d) {
            stack.extend(p.leaf_of(d).iter().copied());
        }
    }
}

/// `(candidate, change)` at each position.
fn rows_by_position(p: &Program) -> Vec<Vec<(usize, i64)>> {
    let mut rows: Vec<Vec<(usize, i64)>> = vec![Vec::new(); p.base.len()];
    for (c, d) in p.delta.iter().enumerate() {
        for &(t, v) in d {
            rows[t].push((c, v));
        }
    }
    rows
}

/// The candidates of the chosen variables in the order they are applied:
/// value order (the order the program prices unconditional candidates in: a
/// chain recomputes a chosen candidate it reads), except that a conditional
/// variable comes after its condition (its candidate is as the condition's
/// rewrite left it), and a conditional variable's chain that reads a chosen
/// candidate's value comes before it (so that candidate's one recomputation
/// serves the chain too, as where the program measured the conditional).
fn apply_order(p: &Program, cands: &[Candidate], chosen: &[usize]) -> Vec<usize> {
    let mut left: Vec<usize> = chosen.to_vec();
    left.sort_by_key(|&k| cands[p.candidate(k)].value);
    let mut done: Vec<usize> = Vec::with_capacity(left.len());
    while !left.is_empty() {
        let ready = |k: usize| {
            p.given[k].is_none_or(|(c, _)| !left.contains(&c))
                && !left.iter().any(|&r| r != k && p.given[r].is_some() && p.reads[r].contains(&p.candidate(k)))
        };
        let waits_for_condition = |k: usize| p.given[k].is_some_and(|(c, _)| left.contains(&c));
        // On a cycle of reads, the first in value order whose condition is
        // applied (the program chooses a condition with its conditional).
        let i = left
            .iter()
            .position(|&k| ready(k))
            .or_else(|| left.iter().position(|&k| !waits_for_condition(k)))
            .unwrap_or(0);
        done.push(left.remove(i));
    }
    done.into_iter().map(|k| p.candidate(k)).collect()
}

/// `g` rewritten with the candidates in `order`, each re-found in the graph
/// the previous ones rewrote (its chain may differ there).
fn apply(
    g: &Graph,
    cands: &[Candidate],
    order: &[usize],
    opts: &RematOptions,
) -> Result<(Graph, Vec<RematChoice>), CompileError> {
    let mut cur = g.clone();
    let mut choices = Vec::new();
    let mut map: Vec<NodeId> = (0..g.len()).map(NodeId::from_index).collect();
    for c0 in order.iter().map(|&c| &cands[c]) {
        let v = ValueId::new(map[c0.value.node.index()], c0.value.output);
        let l = liveness(&cur, opts.fusion);
        let Some(c) = candidates(&cur, &l, opts).into_iter().find(|c| c.value == v) else { continue };
        let (next, m) = rewrite(&cur, &c, opts.guard_leaves)?;
        choices.push(c.choice(&cur));
        for slot in &mut map {
            *slot = m[slot.index()];
        }
        cur = next;
    }
    Ok((cur, choices))
}
