//! Block-granular rematerialization candidates: recompute a whole stretch of
//! the forward (a transformer block, a half block) behind one fence, keeping
//! only the value that enters it.
//!
//! Value-by-value candidates ([`super::remat`]) stop their chains at operands
//! still in memory at the late point, which are usually other saved
//! activations of the same block: freeing a block's activations then takes a
//! dozen fences and chains, and XLA's scheduler and heap packing follow such
//! plans poorly. A segment candidate frees every saved activation between two
//! cuts of the forward at once.
//!
//! The model. The forward is the part of the execution order before the first
//! late read of any value candidate (`bwd`). A *cut* is a forward buffer `c`
//! such that, at `c`'s position, no other sizable forward buffer is still
//! waiting for a forward reader: everything after `c` in the forward is
//! computed from `c`, parameters, constants and small values (in a
//! transformer, the residual stream between sublayers). "Sizable" means more
//! than [`CUT_SLACK`] of `c`'s bytes in all.
//!
//! A segment is the stretch between two consecutive cuts (or the start, or
//! `bwd`). Its roots are its nodes that the backward reads directly; its chain
//! is the roots and their producers back to the segment's leaves: the cut
//! that opens it, parameters, buffers written before it, and nodes that may
//! not be cloned. The rewrite ([`super::remat`]'s) clones the chain before the
//! first backward read of any root and points every later reader at the
//! clones, so every root's buffer dies after its forward use.
//!
//! Invariants:
//! - Segment candidates are ordinary [`Candidate`]s: the same rewrite, fence,
//!   runtime guard and peak-model check apply, and the interpreter computes
//!   the same values bit for bit.
//! - The cut values themselves are never in a chain: they are what is kept.

use crate::ir::{Graph, NodeId, Op, ValueId};

use crate::analysis::{users_of, BufferKind, Liveness};
use crate::remat::chain::{
    anchor_for, clonable, clone_closure, fixed, gathered_weights, readers, recompute_cost, unfenced, Candidate,
};
use crate::remat::plan::RematOptions;

/// A forward buffer is a cut when the other forward buffers waiting at its
/// position hold at most this fraction of its bytes.
pub(crate) const CUT_SLACK: f64 = 0.25;

/// A segment spans at most this many consecutive cuts (cuts inside it are
/// recomputed too): small cuts such as a wide hidden layer's output would
/// otherwise split a block into pieces.
const MAX_SPAN_CUTS: usize = 6;

/// Longest chain a segment may clone.
const MAX_SEGMENT_NODES: usize = 4096;

/// Positions of the forward cuts of `g`, ascending, given `bwd`, the position
/// of the first backward read.
///
/// Counted over nodes, not buffers: a residual stream is a chain of adds
/// that XLA fuses into each reader, so no buffer holds it, yet each add is
/// the one value the rest of the forward needs. Nodes that depend on no
/// parameter (constants, iotas and what is made of them) are cloned freely
/// and never hold a cut open.
pub(crate) fn cuts(g: &Graph, l: &Liveness, users: &[Vec<NodeId>], pos: &[Option<usize>], bwd: usize) -> Vec<usize> {
    let mut data = vec![false; g.len()];
    for (id, node) in g.nodes() {
        data[id.index()] =
            matches!(node.op, Op::Parameter { .. }) || node.op.inputs().iter().any(|u| data[u.node.index()]);
    }
    // Bytes of forward nodes waiting for a forward reader at each position:
    // a node waits over [its position, its last forward reader's).
    let mut diff = vec![0i128; bwd + 1];
    let mut own: Vec<(usize, u64)> = Vec::new();
    for (p, &id) in l.order.iter().enumerate().take(bwd) {
        let node = g.node(id);
        if matches!(node.op, Op::Parameter { .. }) || !data[id.index()] {
            continue;
        }
        let Some(last) = users[id.index()].iter().filter_map(|u| pos[u.index()]).filter(|&q| q < bwd).max() else {
            continue;
        };
        if last > p {
            let bytes: u64 = node.outputs.iter().map(|t| t.size_in_bytes() as u64).sum();
            diff[p] += i128::from(bytes);
            diff[last] -= i128::from(bytes);
            own.push((p, bytes));
        }
    }
    let mut waiting = vec![0u64; bwd];
    let mut acc = 0i128;
    for (p, w) in waiting.iter_mut().enumerate() {
        acc += diff[p];
        *w = acc as u64;
    }
    own.into_iter()
        .filter(|&(p, bytes)| (waiting[p].saturating_sub(bytes) as f64) <= CUT_SLACK * bytes as f64)
        .map(|(p, _)| p)
        .collect()
}

/// One candidate per segment between consecutive cuts of the forward.
///
/// The forward ends at the first late read of the value candidates in
/// `values`; with `across`, of those whose idle stretch spans that position
/// (the kernel of the unplanned peak). Without it a value read twice inside
/// the forward ends it early: on gpt2-small's step by the CUDA model the
/// embedding's output, read by the first residual add, ended it at the first
/// block after three segments, and greedy stopped at 1.93 GiB at 40% and
/// below. The CPU target keeps the first rule, which its measured plans were
/// made with (`RematOptions::for_target`).
pub(crate) fn segment_candidates(
    g: &Graph,
    l: &Liveness,
    values: &[Candidate],
    across: Option<usize>,
    opts: &RematOptions,
) -> Vec<Candidate> {
    let spans = |c: &&Candidate| across.is_none_or(|p| c.early_end < p && p < c.late_pos);
    let Some(bwd) = values.iter().filter(spans).map(|c| c.late_pos).min() else { return Vec::new() };
    let users = users_of(g);
    let pos = l.positions();
    let weights = gathered_weights(g, &opts.gathered_params);
    let cuts = cuts(g, l, &users, &pos, bwd);
    let mut bounds: Vec<Option<usize>> = vec![None];
    bounds.extend(cuts.iter().map(|&c| Some(c)));
    let mut out = Vec::new();
    bounds.push(Some(bwd));
    for (k, &lo) in bounds.iter().enumerate() {
        for span in 1..=MAX_SPAN_CUTS {
            let Some(&Some(hi)) = bounds.get(k + span) else { break };
            let inside = |p: usize| lo.is_none_or(|lo| p > lo) && p < hi;
            let seg = segment(g, l, &users, &pos, &weights, bwd, lo, &inside, opts);
            if let Some(c) = seg {
                out.push(c);
            }
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn segment(
    g: &Graph,
    l: &Liveness,
    users: &[Vec<NodeId>],
    pos: &[Option<usize>],
    weights: &[bool],
    bwd: usize,
    lo: Option<usize>,
    inside: &dyn Fn(usize) -> bool,
    opts: &RematOptions,
) -> Option<Candidate> {
    // Roots: nodes of the segment that a backward node reads directly; a
    // gathered weight (`weights`, [`gathered_weights`]) is read where it is.
    let mut roots: Vec<NodeId> = Vec::new();
    let mut late_pos = usize::MAX;
    for &id in &l.order {
        let p = pos[id.index()]?;
        if !inside(p) {
            continue;
        }
        let op = &g.node(id).op;
        if !clonable(op) || matches!(op, Op::Constant { .. } | Op::Iota { .. }) || fixed(g, weights, id) {
            continue;
        }
        let first_late = users[id.index()].iter().filter_map(|u| pos[u.index()]).filter(|&q| q >= bwd).min();
        if let Some(q) = first_late {
            roots.push(id);
            late_pos = late_pos.min(q);
        }
    }
    if roots.is_empty() {
        return None;
    }
    let late_node = l.order[late_pos];
    let before = |p: usize| lo.is_some_and(|lo| p <= lo);
    // Before the segment: the cut that opens it (kept, in memory or made so
    // by the fence) and buffers are leaves; fused values made of them are
    // cloned.
    let (chain, leaves) = clone_closure(g, roots.clone(), weights, MAX_SEGMENT_NODES, |u| {
        let in_memory = l.buffer_of[u.node.index()][u.output as usize].is_some();
        let up = pos[u.node.index()]?;
        Some(before(up) && (in_memory || Some(up) == lo))
    })?;
    // Bytes freed: the roots' own buffers (views and fused roots have none).
    let mut freed: Vec<(u64, ValueId)> = Vec::new();
    let mut early_end = 0usize;
    for &r in &roots {
        let (kernels, _) = readers(g, l, users, r);
        if let Some(e) = kernels.iter().map(|&(p, _)| p).filter(|&p| p < bwd).max() {
            early_end = early_end.max(e);
        }
        for (k, slot) in l.buffer_of[r.index()].iter().enumerate() {
            let Some(b) = *slot else { continue };
            let b = &l.buffers[b];
            if b.kind == BufferKind::Temp && b.value.node == r {
                freed.push((b.bytes, ValueId::new(r, k as u32)));
            }
        }
    }
    // The largest buffer (the first of equals) names the candidate.
    let (_, value) = freed.iter().copied().reduce(|a, b| if b.0 > a.0 { b } else { a })?;
    let bytes: u64 = freed.iter().map(|&(b, _)| b).sum();
    let also: Vec<ValueId> = freed.iter().map(|&(_, v)| v).filter(|&v| v != value).collect();
    early_end = early_end.max(l.buffers[l.buffer_of[value.node.index()][value.output as usize]?].def);
    let unfenced = unfenced(&leaves, weights);
    if early_end >= late_pos || leaves.len() == unfenced.len() {
        return None;
    }
    let anchor = anchor_for(g, l, late_node, late_pos, early_end, &chain, &[]);
    anchor?;
    let (flops, seconds) = recompute_cost(g, &chain, &leaves, bytes, opts);
    Some(Candidate {
        value,
        also,
        bytes,
        early_end,
        late_node,
        late_pos,
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
    use crate::analysis::EveryNodeAKernel;
    use crate::ir::{BinaryOp, DType, Literal, TensorType, UnaryOp};
    use crate::remat::{rematerialize, Greedy, RematBudget, RematOptions};

    use super::*;

    /// A residual stack: `h' = h + tanh(exp(h))` four times, then a backward
    /// that reads every block's inner values in reverse order.
    fn residual(blocks: usize) -> Graph {
        let mut g = Graph::new();
        let mut h = g.parameter(TensorType::new(DType::F32, [512]));
        let mut inner = Vec::new();
        for _ in 0..blocks {
            let a = g.value(Op::Unary { op: UnaryOp::Exp, input: h }).unwrap();
            let b = g.value(Op::Unary { op: UnaryOp::Tanh, input: a }).unwrap();
            inner.push((a, b));
            h = g.value(Op::Binary { op: BinaryOp::Add, lhs: h, rhs: b }).unwrap();
        }
        let mut ct = g.value(Op::Unary { op: UnaryOp::Neg, input: h }).unwrap();
        for &(a, b) in inner.iter().rev() {
            ct = g.value(Op::Binary { op: BinaryOp::Mul, lhs: ct, rhs: b }).unwrap();
            ct = g.value(Op::Binary { op: BinaryOp::Mul, lhs: ct, rhs: a }).unwrap();
        }
        g.set_outputs(vec![ct]).unwrap();
        g
    }

    #[test]
    fn the_residual_stream_is_where_the_forward_is_cut() {
        let g = residual(4);
        let l = crate::analysis::liveness(&g, &EveryNodeAKernel);
        let users = users_of(&g);
        let pos = l.positions();
        // The backward starts with the neg after the last add (position 13).
        let cuts = cuts(&g, &l, &users, &pos, 13);
        let adds: Vec<usize> = l
            .order
            .iter()
            .enumerate()
            .filter(|(_, id)| matches!(g.node(**id).op, Op::Binary { op: BinaryOp::Add, .. }))
            .map(|(p, _)| p)
            .collect();
        for a in &adds[..3] {
            assert!(cuts.contains(a), "the residual add at {a} is a cut: {cuts:?}");
        }
    }

    #[test]
    fn segments_recompute_whole_blocks_and_keep_the_values() {
        let g = residual(4);
        let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
        let plain = rematerialize(&g, &Greedy, &opts).unwrap();
        opts.segments = true;
        let plan = rematerialize(&g, &Greedy, &opts).unwrap();
        crate::verify(&plan.graph).unwrap();
        assert!(plan.after.peak_bytes < plan.before.peak_bytes);
        assert!(plan.choices.iter().any(|c| c.recomputed_nodes >= 2), "{:?}", plan.choices);
        assert!(plan.after.peak_bytes <= plain.after.peak_bytes, "{:?} vs {:?}", plan.after, plain.after);
        let x = Literal::from_f64s(DType::F32, [512], &(0..512).map(|i| (i as f64 * 0.013).sin()).collect::<Vec<_>>())
            .unwrap();
        let want = crate::interpret(&g, std::slice::from_ref(&x)).unwrap();
        assert_eq!(want, crate::interpret(&plan.graph, &[x]).unwrap());
    }
}
