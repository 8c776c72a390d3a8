//! The exact strategy: an integer program over every candidate of the
//! unplanned graph, solved by `microlp` (a pure-Rust MILP solver), each
//! solution checked against the peak model.
//!
//! The program. One binary `x_c` per candidate `c` of the unplanned graph
//! ([`super::remat`]'s value candidates, all of them). Objective: the fewest
//! extra FLOPs, `sum flops_c x_c` (plus one per chosen candidate, so that
//! free recomputations are not chosen for nothing). Memory: at every position
//! `t` of the unplanned execution order (and, for each pair of candidates
//! where one's chain reads the other's value, that one's FLOPs again when both
//! are chosen: the chain then recomputes the other's too),
//! `base[t] + sum delta_c[t] x_c <= budget`, where `base` is the live curve
//! without a plan and `delta_c` is the change that recomputing `c` alone
//! makes to it, measured by rewriting the graph with `c` and running the peak
//! model (the positions of `c`'s clones count at the late user they precede).
//!
//! The sum is exact when candidates do not interact; they do when one's chain
//! reads another's value (the second chain then grows or shrinks). So every
//! solution is applied (in value order, each candidate re-found in the graph
//! the previous ones rewrote) and measured by the peak model; one that misses
//! the budget, or meets it with more FLOPs than the program counted, is
//! excluded (`sum_{c in S} x_c <= |S| - 1`) and the program solved again, up
//! to [`MAX_ROUNDS`] times, until the program's next solution costs at least
//! the best measured plan's FLOPs. When no subset can meet the
//! budget by the program, the program first finds the lowest peak it can
//! reach and then the fewest FLOPs at that peak.
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

use super::liveness::liveness;
use super::peak::peak_of;
use super::remat::{
    budget_bytes, candidates, finish, rewrite, Candidate, RematChoice, RematOptions, RematPlan, RematStrategy,
};

/// Solutions measured before the strategy returns the best one so far.
pub const MAX_ROUNDS: usize = 32;

/// Time the solver may spend on one program.
const SOLVE_SECONDS: u64 = 20;

/// Exact by an integer program over the unplanned graph's candidates (see the
/// module docs). For small graphs, and to measure [`super::Greedy`] against.
#[derive(Clone, Copy, Debug, Default)]
pub struct Exact;

/// The program's data: per candidate its objective and its sparse change of
/// the live curve; the unplanned curve.
struct Program {
    flops: Vec<f64>,
    /// `leaf_of[c]`: the candidates whose value is a leaf of `c`'s chain.
    /// When both are chosen `c`'s chain recomputes that one's too (its value
    /// is no longer in memory), and so on through the chosen ones.
    leaf_of: Vec<Vec<usize>>,
    delta: Vec<Vec<(usize, i64)>>,
    base: Vec<u64>,
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
        let mut delta = Vec::with_capacity(cands.len());
        for c in &cands {
            let (next, map) = rewrite(g, c, opts.guard_leaves)?;
            let l = liveness(&next, opts.fusion);
            let curve = l.live_curve();
            let mut new_pos = vec![None; next.len()];
            for (p, id) in l.order.iter().enumerate() {
                new_pos[id.index()] = Some(p);
            }
            let mut d = Vec::new();
            let mut from = 0usize;
            for (t, id) in base_l.order.iter().enumerate() {
                // An original node the rewrite left without readers is dead
                // there: its position merges into the next one.
                let Some(q) = new_pos[map[id.index()].index()] else { continue };
                let live = curve[from..=q].iter().copied().max().unwrap_or(0);
                if live != base[t] {
                    d.push((t, live as i64 - base[t] as i64));
                }
                from = q + 1;
            }
            delta.push(d);
        }
        let leaf_of: Vec<Vec<usize>> = cands
            .iter()
            .enumerate()
            .map(|(i, c)| (0..cands.len()).filter(|&j| j != i && c.leaves.contains(&cands[j].value)).collect())
            .collect();
        let program = Program { flops: cands.iter().map(|c| c.flops as f64 + 1.0).collect(), leaf_of, delta, base };
        let base_flops = cost::graph_cost(g).total.flops;
        // (meets budget, extra flops, peak) of the best measured plan: the
        // empty one first.
        let measure = |graph: &Graph| {
            let peak = peak_of(&liveness(graph, opts.fusion)).peak_bytes;
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
        if !best.0 .0 && !cands.is_empty() {
            // The bound the program holds every position to: the budget, or
            // the lowest peak the program can reach when it cannot meet it.
            let bound = match solve(&program, budget as f64, &[])? {
                Some(_) => budget as f64,
                None => solve_lowest_peak(&program)?,
            };
            let mut excluded: Vec<Vec<usize>> = Vec::new();
            for _ in 0..MAX_ROUNDS {
                let Some(chosen) = solve(&program, bound, &excluded)? else { break };
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
                        closure(&program, c, &mut |d| {
                            if chosen.contains(&d) && !inner.contains(&d) {
                                inner.push(d);
                                true
                            } else {
                                false
                            }
                        });
                        inner.iter().map(|&d| cands[d].flops).sum::<u64>()
                    })
                    .sum();
                if best.0 .0 && predicted >= best.0 .1 {
                    break;
                }
                let (graph, choices) = apply(g, &cands, &chosen, opts)?;
                let key = measure(&graph);
                if better(key, best.0) {
                    best = (key, graph, choices);
                }
                excluded.push(chosen);
            }
        }
        let (_, graph, choices) = best;
        Ok(finish(self.name(), g, graph, choices, before, opts))
    }
}

/// The candidates the program chooses under `bound`, none of the `excluded`
/// sets; `None` when no choice fits.
fn solve(p: &Program, bound: f64, excluded: &[Vec<usize>]) -> Result<Option<Vec<usize>>, CompileError> {
    let mut lp = Problem::new(OptimizationDirection::Minimize);
    lp.set_time_limit(Duration::from_secs(SOLVE_SECONDS));
    let scale = p.flops.iter().copied().fold(1.0f64, f64::max);
    let xs: Vec<Variable> = p.flops.iter().map(|&f| lp.add_binary_var(f / scale)).collect();
    // z[c][d] = 1 when c's chain recomputes d's: z >= x_c + x_d - 1 for a
    // direct leaf d of c, z[c][e] >= z[c][d] + x_e - 1 for a leaf e of such a d.
    for c in 0..xs.len() {
        let mut z: Vec<(usize, Variable)> = Vec::new();
        let mut stack: Vec<(Option<usize>, usize)> = p.leaf_of[c].iter().map(|&d| (None, d)).collect();
        while let Some((via, d)) = stack.pop() {
            if d == c {
                continue;
            }
            let zd = match z.iter().find(|(e, _)| *e == d) {
                Some(&(_, v)) => v,
                None => {
                    let v = lp.add_var(p.flops[d] / scale, (0.0, 1.0));
                    z.push((d, v));
                    stack.extend(p.leaf_of[d].iter().map(|&e| (Some(d), e)));
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
        let terms: Vec<(Variable, f64)> = set.iter().map(|&c| (xs[c], 1.0)).collect();
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

/// Walks the candidates whose chains `c`'s would recompute: `visit(d)`
/// says whether to go on through `d`'s leaves.
fn closure(p: &Program, c: usize, visit: &mut dyn FnMut(usize) -> bool) {
    let mut stack = p.leaf_of[c].clone();
    while let Some(d) = stack.pop() {
        if visit(d) {
            stack.extend(p.leaf_of[d].iter().copied());
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

/// `g` rewritten with the chosen candidates in value order, each re-found in
/// the graph the previous ones rewrote (its chain may differ there).
fn apply(
    g: &Graph,
    cands: &[Candidate],
    chosen: &[usize],
    opts: &RematOptions,
) -> Result<(Graph, Vec<RematChoice>), CompileError> {
    let mut order: Vec<usize> = chosen.to_vec();
    order.sort_by_key(|&c| cands[c].value);
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
