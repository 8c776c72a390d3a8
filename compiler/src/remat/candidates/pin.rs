//! Pinning floating backward kernels: a backward kernel whose operands are all
//! forward values (attention's recomputed scores and probabilities, read
//! from the saved queries, keys and statistics) can be run by XLA's scheduler
//! anywhere after the forward. On gpt2-small's planned step XLA ran three
//! blocks' `[8, 12, 1024, 1024]` probabilities during the LM head's backward
//! (1.2 GB live at the peak, docs/memory-journal.md ("Why the 2x is not reached on the CPU plugin")), which the peak model, following
//! insertion order, never sees.
//!
//! The rewrite: each such kernel of at least [`PIN_MIN_BYTES_FRACTION`] of
//! the largest buffer reads its forward operands through the runtime guard of
//! [`super::remat`] (`select(always, x, 0)`, `always` computed from an anchor)
//! whose anchor is the latest backward buffer written before it that depends
//! on the backward's own progress (on the first backward read, where the
//! cotangents start). The select is the identity bit for bit, so
//! values do not change; the kernel can no longer run before its anchor.
//!
//! A kernel that reads nothing but scalar constants (the zeros an embedding's
//! gradient is scattered into) floats the same way; it reads its constants
//! through the guard, unless XLA folds it into an add ([`folded_by_xla`]).
//!
//! A gathered weight ([`crate::remat::chain::gathered_weights`]) is never read
//! through a guard: XLA's SPMD partitioner would gather it again. A kernel
//! with nothing else to guard is left alone.
//!
//! Invariants: no node is cloned and no FLOP of the model's is added beyond
//! the guards' selects; parameters, outputs and aliases keep their indices.

use crate::ir::{BinaryOp, Graph, NodeId, Op, ValueId};
use crate::CompileError;

use crate::analysis::Materialization;
use crate::analysis::{liveness, BufferKind};
use crate::fence::{hold, Hold};

/// Kernels with outputs smaller than this fraction of the largest buffer are
/// left alone (guards cost a select each; small kernels do not move peaks).
pub(crate) const PIN_MIN_BYTES_FRACTION: f64 = 0.02;

/// `g` with its floating backward kernels pinned; `bwd` is the position of
/// the first backward read, `weights` marks the gathered weights by node.
/// Returns the graph and how many kernels were pinned.
pub(crate) fn pin_floating(
    g: &Graph,
    fusion: &dyn Materialization,
    bwd: usize,
    weights: &[bool],
) -> Result<(Graph, usize), CompileError> {
    let l = liveness(g, fusion);
    let n = g.len();
    let pos = l.positions();
    // Every backward value derives from forward values, so "floating" is
    // relative to the backward's progress: a node progresses when it is the
    // first backward read (the loss's gradient, where the cotangents start)
    // or reads a node that progresses; a node at or after `bwd` that does not
    // is floating.
    let Some(&first) = l.order.get(bwd) else { return Ok((g.clone(), 0)) };
    let mut progressing = vec![false; n];
    let mut floating = vec![false; n];
    for &id in &l.order {
        let i = id.index();
        let p = pos[i].expect("ordered nodes have positions");
        if p < bwd {
            continue;
        }
        progressing[i] = id == first || g.node(id).op.inputs().iter().any(|u| progressing[u.node.index()]);
        floating[i] = !progressing[i];
    }
    let largest = l.buffers.iter().map(|b| b.bytes).max().unwrap_or(0);
    let min_bytes = (largest as f64 * PIN_MIN_BYTES_FRACTION) as u64;
    // Kernels to pin, each with its anchor and the operands it reads through
    // the guard.
    let mut holds: Vec<Hold> = Vec::new();
    for &id in &l.order {
        let i = id.index();
        let p = pos[i].expect("ordered nodes have positions");
        if !floating[i] || !l.materialized[i] || matches!(g.node(id).op, Op::Reshape { .. } | Op::Whole { .. }) {
            continue;
        }
        let bytes: u64 = g.node(id).outputs.iter().map(|t| t.size_in_bytes() as u64).sum();
        let operands = guarded_operands(g, id, &pos, bwd, weights);
        if bytes < min_bytes || operands.is_empty() {
            continue;
        }
        let anchor = l
            .buffers
            .iter()
            .filter(|b| {
                b.def < p
                    && matches!(b.kind, BufferKind::Temp | BufferKind::Output | BufferKind::Donated)
                    && progressing[b.value.node.index()]
            })
            .max_by_key(|b| b.def)
            .map(|b| b.value);
        if let Some(anchor) = anchor {
            holds.push(Hold { node: id, anchor, operands });
        }
    }
    if holds.is_empty() {
        return Ok((g.clone(), 0));
    }
    Ok((hold(g, &holds)?, holds.len()))
}

/// The operands of a floating kernel `id` that its pin reads through the
/// guard: those computed in the forward (before position `bwd`), or, for a
/// kernel that reads nothing but scalar constants (the zeros an embedding's
/// gradient is scattered into, which XLA's schedule otherwise writes in the
/// forward and holds through the backward), those constants. Empty when the
/// kernel has neither, and for constants XLA folds away ([`folded_by_xla`]).
/// Gathered weights (`weights`, by node) are never guarded.
fn guarded_operands(g: &Graph, id: NodeId, pos: &[Option<usize>], bwd: usize, weights: &[bool]) -> Vec<ValueId> {
    let inputs = g.node(id).op.inputs();
    let mut operands: Vec<ValueId> = Vec::new();
    for u in inputs.iter().copied() {
        if pos[u.node.index()].is_some_and(|q| q < bwd) && !weights[u.node.index()] && !operands.contains(&u) {
            operands.push(u);
        }
    }
    let scalar_constant =
        |u: &ValueId| matches!(&g.node(u.node).op, Op::Constant { literal } if literal.ty().shape.rank() == 0);
    if operands.is_empty() && !inputs.is_empty() && inputs.iter().all(scalar_constant) {
        for u in inputs.iter().copied() {
            if !operands.contains(&u) {
                operands.push(u);
            }
        }
    }
    if !operands.is_empty() && operands.iter().all(scalar_constant) && folded_by_xla(g, id) {
        return Vec::new();
    }
    operands
}

/// Whether `id` (a kernel of constants) is only ever scattered into, with
/// every scatter's result only added to something: XLA's simplifier rewrites
/// `a + scatter_add(zeros, i, u)` as `scatter_add(a, i, u)`, so the kernel
/// never runs unless a guard stops the rewrite. gpt2-small's tied embedding
/// is such a case (its input-side gradient is added to the LM head's dw):
/// pinned, its f32 zeros `[50304, 768]` held the 22% plan 21 MB higher on
/// the H200 (`docs/memory-journal.md`, "Zeros pinned to the backward").
fn folded_by_xla(g: &Graph, id: NodeId) -> bool {
    let is_output = |n: NodeId| g.outputs().iter().any(|o| o.node == n);
    let users = g.users(id);
    !users.is_empty()
        && users.iter().all(|&s| {
            let added = g.users(s);
            matches!(g.node(s).op, Op::ScatterAdd { operand, .. } if operand.node == id)
                && !is_output(s)
                && !added.is_empty()
                && added.iter().all(|&a| matches!(g.node(a).op, Op::Binary { op: BinaryOp::Add, .. }))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::EveryNodeAKernel;
    use crate::ir::{BinaryOp, DType, Literal, TensorType, UnaryOp};

    #[test]
    fn a_backward_kernel_that_reads_only_forward_values_waits_for_the_backward() {
        // forward: a = exp(p), b = tanh(a); backward from d = b * a: then
        // s = log(a) reads only the forward, e = d * s.
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [1024]));
        let a = g.value(Op::Unary { op: UnaryOp::Exp, input: p }).unwrap();
        let b = g.value(Op::Unary { op: UnaryOp::Tanh, input: a }).unwrap();
        let d = g.value(Op::Binary { op: BinaryOp::Mul, lhs: b, rhs: a }).unwrap();
        let s = g.value(Op::Unary { op: UnaryOp::Log, input: a }).unwrap();
        let e = g.value(Op::Binary { op: BinaryOp::Mul, lhs: d, rhs: s }).unwrap();
        g.set_outputs(vec![e]).unwrap();
        // The first backward read is d, at position 3.
        let (pinned, n) = pin_floating(&g, &EveryNodeAKernel, 3, &vec![false; g.len()]).unwrap();
        assert_eq!(n, 1);
        crate::verify(&pinned).unwrap();
        let log = pinned.nodes().find(|(_, nd)| matches!(nd.op, Op::Unary { op: UnaryOp::Log, .. })).unwrap().1;
        let Op::Unary { input, .. } = log.op else { unreachable!() };
        assert!(matches!(pinned.node(input.node).op, Op::Select { .. }), "log reads its operand through the guard");
        let x = Literal::from_f64s(DType::F32, [1024], &(0..1024).map(|i| (i as f64 * 0.01).cos()).collect::<Vec<_>>())
            .unwrap();
        assert_eq!(crate::interpret(&g, std::slice::from_ref(&x)).unwrap(), crate::interpret(&pinned, &[x]).unwrap());
    }

    /// The zeros a backward accumulates into read nothing but a constant. They
    /// are pinned too, and their guard's branches differ, so that no
    /// simplifier can fold `select(always, 0, 0)` into 0 and the guard with it.
    /// `zero_in_forward`: the constant is made before the backward (a shared
    /// constant), or in it.
    fn zeros_pinned(zero_in_forward: bool) {
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [1024]));
        let zero_early = zero_in_forward.then(|| g.value(Op::Constant { literal: Literal::scalar(DType::F32, 0.0) }));
        let a = g.value(Op::Unary { op: UnaryOp::Exp, input: p }).unwrap();
        let b = g.value(Op::Unary { op: UnaryOp::Tanh, input: a }).unwrap();
        let d = g.value(Op::Binary { op: BinaryOp::Mul, lhs: b, rhs: a }).unwrap();
        let zero = match zero_early {
            Some(z) => z.unwrap(),
            None => g.value(Op::Constant { literal: Literal::scalar(DType::F32, 0.0) }).unwrap(),
        };
        let z = g.value(Op::BroadcastInDim { input: zero, shape: [1024].into(), dims: vec![] }).unwrap();
        let e = g.value(Op::Binary { op: BinaryOp::Add, lhs: z, rhs: d }).unwrap();
        g.set_outputs(vec![e]).unwrap();
        let bwd = if zero_in_forward { 4 } else { 3 };
        let (pinned, n) = pin_floating(&g, &EveryNodeAKernel, bwd, &vec![false; g.len()]).unwrap();
        assert_eq!(n, 1, "the zeros are the one floating kernel");
        crate::verify(&pinned).unwrap();
        let bcast = pinned
            .nodes()
            .find(|(_, nd)| matches!(nd.op, Op::BroadcastInDim { .. }) && nd.outputs[0].shape.rank() == 1);
        let Op::BroadcastInDim { input, .. } = bcast.unwrap().1.op else { unreachable!() };
        let Op::Select { on_true, on_false, .. } = pinned.node(input.node).op else {
            panic!("the zeros read their constant through the guard")
        };
        let constant = |v: ValueId| match &pinned.node(v.node).op {
            Op::Constant { literal } => literal.to_f64s(),
            other => panic!("a guard branch is {other:?}"),
        };
        assert_eq!(constant(on_true), vec![0.0]);
        assert_eq!(constant(on_false), vec![1.0], "the branches differ");
        let x =
            Literal::from_f64s(DType::F32, [1024], &(0..1024).map(|i| (i as f64 * 0.013).sin()).collect::<Vec<_>>())
                .unwrap();
        assert_eq!(crate::interpret(&g, std::slice::from_ref(&x)).unwrap(), crate::interpret(&pinned, &[x]).unwrap());
    }

    /// Zeros scattered into and then added to something are left alone: XLA
    /// folds `a + scatter_add(0, i, u)` into `scatter_add(a, i, u)`, which a
    /// guard on the zeros would stop.
    #[test]
    fn zeros_xla_folds_into_an_add_are_not_pinned() {
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [256, 4]));
        let ids = g.parameter(TensorType::new(DType::I32, [8]));
        let a = g.value(Op::Unary { op: UnaryOp::Exp, input: p }).unwrap();
        let da = g.value(Op::Binary { op: BinaryOp::Mul, lhs: a, rhs: a }).unwrap();
        let rows = g.value(Op::Gather { operand: a, indices: ids, axis: 0 }).unwrap();
        let d = g.value(Op::Unary { op: UnaryOp::Tanh, input: rows }).unwrap();
        let zero = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 0.0) }).unwrap();
        let z = g.value(Op::BroadcastInDim { input: zero, shape: [256, 4].into(), dims: vec![] }).unwrap();
        let s = g.value(Op::ScatterAdd { operand: z, indices: ids, updates: d, axis: 0 }).unwrap();
        let total = g.value(Op::Binary { op: BinaryOp::Add, lhs: da, rhs: s }).unwrap();
        g.set_outputs(vec![total]).unwrap();
        // The backward starts at d (p, ids, a, da, rows, d).
        let (_, n) = pin_floating(&g, &EveryNodeAKernel, 5, &vec![false; g.len()]).unwrap();
        assert_eq!(n, 0, "the zeros are folded into the add by XLA, not pinned");
        // Read by the step's output directly, the same zeros are pinned.
        let mut g2 = g.clone();
        g2.set_outputs(vec![s, da]).unwrap();
        let (_, n) = pin_floating(&g2, &EveryNodeAKernel, 5, &vec![false; g2.len()]).unwrap();
        assert_eq!(n, 1);
    }

    #[test]
    fn zeros_made_in_the_backward_wait_for_it() {
        zeros_pinned(false);
    }

    #[test]
    fn zeros_from_a_constant_made_in_the_forward_wait_for_the_backward() {
        zeros_pinned(true);
    }
}
