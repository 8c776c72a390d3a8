//! Sibling candidates: value candidates that would each recompute the same
//! kernel, offered together.
//!
//! A value candidate's chain ([`super::remat`]) runs back through operands
//! that are no longer in memory at its late point, so values made from one
//! unsaved kernel each clone that kernel. The q, k and v of an attention are
//! slices of one QKV projection: each alone clones the projection's GEMM,
//! and chosen one after another they make the backward run it three times
//! (gpt2-small's step at 33% of its activation memory by the CUDA model: 14
//! q/k/v values, 14 recomputed GEMMs, 61.75 µs each by the kernel model). A
//! sibling candidate is the union of the chains of the value candidates that
//! clone the same kernel that is not loop-fusible (a GEMM, a reduction, a
//! composite) for the same late kernel: each node cloned once, the leaves of
//! them all, the bytes of them all.
//!
//! Invariants:
//! - Sibling candidates are ordinary [`Candidate`]s: the same rewrite, fence,
//!   runtime guard and peak-model check apply, and the interpreter computes
//!   the same values bit for bit (a clone is the same op on the same
//!   inputs, whichever candidate named it).
//! - They are offered beside their members, never instead of them: greedy
//!   still prices a lone q where only a q is worth its recomputation.

use std::collections::HashMap;

use crate::ir::{Graph, NodeId, ValueId};

use crate::analysis::loop_fusible;
use crate::analysis::Liveness;
use crate::remat::chain::{anchor_for, recompute_cost, Candidate};
use crate::remat::plan::RematOptions;

/// One candidate for each group of `values` whose chains clone a shared
/// kernel that is not loop-fusible, for the same late kernel. A group whose
/// union is one member's own chain is left out (that member already is it).
pub(crate) fn sibling_candidates(g: &Graph, l: &Liveness, values: &[Candidate], opts: &RematOptions) -> Vec<Candidate> {
    let mut parent: Vec<usize> = (0..values.len()).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    let mut first: HashMap<(NodeId, NodeId), usize> = HashMap::new();
    for (i, c) in values.iter().enumerate() {
        for &n in &c.chain {
            if loop_fusible(&g.node(n).op) || !l.materialized[n.index()] {
                continue;
            }
            let j = *first.entry((c.late_node, n)).or_insert(i);
            let (a, b) = (root(&mut parent, j), root(&mut parent, i));
            if a != b {
                parent[b.max(a)] = a.min(b);
            }
        }
    }
    let mut groups: HashMap<usize, Vec<usize>> = HashMap::new();
    for i in 0..values.len() {
        let r = root(&mut parent, i);
        groups.entry(r).or_default().push(i);
    }
    let mut groups: Vec<Vec<usize>> = groups.into_values().filter(|m| m.len() > 1).collect();
    groups.sort();
    groups.into_iter().filter_map(|members| union(g, l, values, &members, opts)).collect()
}

/// The candidate recomputing every one of `members` (indices into `values`,
/// ascending; one late kernel) at once.
fn union(g: &Graph, l: &Liveness, values: &[Candidate], members: &[usize], opts: &RematOptions) -> Option<Candidate> {
    let first = &values[members[0]];
    let mut chain: Vec<NodeId> = members.iter().flat_map(|&i| values[i].chain.iter().copied()).collect();
    chain.sort();
    chain.dedup();
    if members.iter().any(|&i| values[i].chain.len() == chain.len()) {
        return None;
    }
    let mut leaves: Vec<ValueId> = members
        .iter()
        .flat_map(|&i| values[i].leaves.iter().copied())
        .filter(|v| chain.binary_search(&v.node).is_err())
        .collect();
    leaves.sort();
    leaves.dedup();
    let unfenced: Vec<ValueId> =
        leaves.iter().copied().filter(|v| members.iter().any(|&i| values[i].unfenced.contains(v))).collect();
    let early_end = members.iter().map(|&i| values[i].early_end).max()?;
    if leaves.len() == unfenced.len() || early_end >= first.late_pos {
        return None;
    }
    let bytes: u64 = members.iter().map(|&i| values[i].bytes).sum();
    // The largest member names the candidate, as a segment's largest root
    // names a segment.
    let value = members.iter().map(|&i| &values[i]).max_by_key(|c| (c.bytes, std::cmp::Reverse(c.value)))?.value;
    let also: Vec<ValueId> = members
        .iter()
        .flat_map(|&i| std::iter::once(values[i].value).chain(values[i].also.iter().copied()))
        .filter(|&v| v != value)
        .collect();
    let anchor = anchor_for(g, l, first.late_node, first.late_pos, early_end, &chain, &[]);
    anchor?;
    let (flops, seconds) = recompute_cost(g, &chain, &leaves, bytes, opts);
    Some(Candidate {
        value,
        also,
        bytes,
        early_end,
        late_node: first.late_node,
        late_pos: first.late_pos,
        chain,
        leaves,
        unfenced,
        anchor,
        flops,
        seconds,
    })
}

#[cfg(test)]
mod tests {
    use crate::analysis::{liveness, EveryNodeAKernel};
    use crate::ir::{BinaryOp, DType, DotDims, Literal, Op, TensorType, UnaryOp};
    use crate::remat::{rematerialize, Greedy, RecomputeCost, RematBudget, RematOptions};

    use super::*;
    use crate::remat::chain::candidates;

    /// One projection `h = x · w` sliced into three parts that the forward
    /// adds up, a ladder of `tanh` over the sum, and a backward that reads
    /// the ladder in reverse and then the three parts in one concatenation.
    fn projection_of_three() -> Graph {
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::F32, [256, 64]));
        let w = g.parameter(TensorType::new(DType::F32, [64, 384]));
        let h = g.value(Op::DotGeneral { lhs: x, rhs: w, dims: DotDims::matmul() }).unwrap();
        let part = |g: &mut Graph, k: usize| {
            g.value(Op::Slice {
                input: h,
                start: vec![0, 128 * k],
                limit: vec![256, 128 * (k + 1)],
                stride: vec![1, 1],
            })
            .unwrap()
        };
        let (a, b, c) = (part(&mut g, 0), part(&mut g, 1), part(&mut g, 2));
        let ab = g.value(Op::Binary { op: BinaryOp::Add, lhs: a, rhs: b }).unwrap();
        let mut f = g.value(Op::Binary { op: BinaryOp::Add, lhs: ab, rhs: c }).unwrap();
        let mut ladder = vec![f];
        for _ in 0..6 {
            f = g.value(Op::Unary { op: UnaryOp::Tanh, input: f }).unwrap();
            ladder.push(f);
        }
        let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: f }).unwrap();
        for &v in ladder.iter().rev().skip(1) {
            ct = g.value(Op::Binary { op: BinaryOp::Mul, lhs: ct, rhs: v }).unwrap();
        }
        let parts = g.value(Op::Concatenate { inputs: vec![a, b, c], axis: 1 }).unwrap();
        let ct3 = g.value(Op::Concatenate { inputs: vec![ct, ct, ct], axis: 1 }).unwrap();
        let out = g.value(Op::Binary { op: BinaryOp::Mul, lhs: parts, rhs: ct3 }).unwrap();
        g.set_outputs(vec![out]).unwrap();
        g
    }

    fn dots(g: &Graph) -> usize {
        g.nodes().filter(|(_, n)| matches!(n.op, Op::DotGeneral { .. })).count()
    }

    #[test]
    fn three_slices_of_one_projection_are_offered_as_one_recomputation() {
        let g = projection_of_three();
        let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        opts.cost = RecomputeCost::Kernels;
        let l = liveness(&g, opts.fusion);
        let values = candidates(&g, &l, &opts);
        let parts: Vec<&Candidate> =
            values.iter().filter(|c| matches!(g.node(c.value.node).op, Op::Slice { .. })).collect();
        assert_eq!(parts.len(), 3, "each slice is a candidate of its own");
        assert!(parts.iter().all(|c| c
            .chain
            .iter()
            .filter(|&&n| matches!(g.node(n).op, Op::DotGeneral { .. }))
            .count()
            == 1));
        let siblings = sibling_candidates(&g, &l, &values, &opts);
        assert_eq!(siblings.len(), 1, "{siblings:?}");
        let s = &siblings[0];
        assert_eq!(s.bytes, parts.iter().map(|c| c.bytes).sum::<u64>());
        assert_eq!(s.chain.len(), 4, "the dot once and the three slices: {:?}", s.chain);
        let mut freed: Vec<ValueId> = std::iter::once(s.value).chain(s.also.iter().copied()).collect();
        freed.sort();
        let mut want: Vec<ValueId> = parts.iter().map(|c| c.value).collect();
        want.sort();
        assert_eq!(freed, want, "the choice names every slice it frees");
        assert!(s.seconds < parts.iter().map(|c| c.seconds).sum::<f64>());
    }

    #[test]
    fn greedy_recomputes_the_projection_once_for_its_three_slices() {
        let g = projection_of_three();
        let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        opts.cost = RecomputeCost::Kernels;
        let plan = rematerialize(&g, &Greedy, &opts).unwrap();
        crate::verify(&plan.graph).unwrap();
        assert!(plan.after.peak_bytes < plan.before.peak_bytes, "{:?} -> {:?}", plan.before, plan.after);
        let parts = plan
            .graph
            .nodes()
            .filter(|(_, n)| matches!(n.op, Op::Slice { .. }) && n.outputs[0].shape.dims() == [256, 128])
            .count();
        assert_eq!(parts, 6, "the three slices are recomputed: {}", plan.graph);
        assert_eq!(dots(&plan.graph), 2, "the projection is recomputed once: {}", plan.graph);
        let draw = |n: usize, s: f64| (0..n).map(|i| ((i as f64 + s) * 0.37).sin()).collect::<Vec<_>>();
        let x = Literal::from_f64s(DType::F32, [256, 64], &draw(256 * 64, 0.3)).unwrap();
        let w = Literal::from_f64s(DType::F32, [64, 384], &draw(64 * 384, 1.7)).unwrap();
        let want = crate::interpret(&g, &[x.clone(), w.clone()]).unwrap();
        assert_eq!(want, crate::interpret(&plan.graph, &[x, w]).unwrap(), "bit-identical on the interpreter");
    }
}
