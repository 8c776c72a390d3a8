//! Holding XLA to the program's order in the backward: each backward kernel
//! that does not already read the kernel before it (in the program's order)
//! reads its smallest operand through the runtime guard of [`crate::fence`]
//! anchored on that kernel, so a scheduler that orders the step itself (XLA
//! CPU's depth-first walk from the outputs) runs them in the program's order.
//! A gathered weight ([`crate::remat::chain::gathered_weights`]) is never the operand
//! guarded: XLA's SPMD partitioner would gather it again.

use crate::fence::{hold, Hold};
use crate::ir::{Graph, NodeId, Op, ValueId};
use crate::CompileError;

use crate::analysis::liveness;
use crate::analysis::Materialization;
use crate::remat::chain::{first_backward_read, gathered_weights};
use crate::remat::plan::{RematBudget, RematOptions};

/// `g` with its backward kernels chained by guards; how many were guarded.
/// `gathered_params`: as [`RematOptions::gathered_params`].
pub fn sequence_backward(
    g: &Graph,
    fusion: &dyn Materialization,
    gathered_params: &[u32],
) -> Result<(Graph, usize), CompileError> {
    let l = liveness(g, fusion);
    let opts = RematOptions::new(RematBudget::Bytes(0), fusion);
    let weights = gathered_weights(g, gathered_params);
    let Some(bwd) = first_backward_read(g, &l, &opts) else { return Ok((g.clone(), 0)) };
    let mut kernels: Vec<NodeId> = Vec::new();
    for &id in &l.order[bwd..] {
        let trivial = matches!(
            g.node(id).op,
            Op::Reshape { .. } | Op::Whole { .. } | Op::Parameter { .. } | Op::Constant { .. } | Op::Iota { .. }
        );
        if l.materialized[id.index()] && !trivial {
            kernels.push(id);
        }
    }
    // Each kernel that does not read the one before it waits for it.
    let mut holds: Vec<Hold> = Vec::new();
    for w in kernels.windows(2) {
        let (k, m) = (w[0], w[1]);
        let inputs = g.node(m).op.inputs();
        if inputs.iter().any(|u| u.node == k) {
            continue;
        }
        let guardable = inputs.iter().copied().filter(|u| !weights[u.node.index()]);
        if let Some(x) = guardable.min_by_key(|u| g.ty(*u).size_in_bytes()) {
            holds.push(Hold { node: m, anchor: ValueId::new(k, 0), operands: vec![x] });
        }
    }
    if holds.is_empty() {
        return Ok((g.clone(), 0));
    }
    Ok((hold(g, &holds)?, holds.len()))
}

/// [`sequence_backward`] for compiling to `target`: `g` unchanged where the
/// target keeps barriers (XLA CUDA orders the backward itself; held to the
/// program's order by barriers, gpt2-small's planned step took 24-27% more
/// time and 10-12% more temp on the H100, `docs/memory-journal.md`, "Sequencing the backward on CUDA: measured, not kept"), else with its
/// fusion model.
pub fn sequence_for(
    g: &Graph,
    target: crate::LowerTarget,
    gathered_params: &[u32],
) -> Result<(Graph, usize), CompileError> {
    if target.keeps_barriers() {
        return Ok((g.clone(), 0));
    }
    sequence_backward(g, crate::analysis::fusion_for(target), gathered_params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::EveryNodeAKernel;
    use crate::ir::{BinaryOp, DType, Literal, TensorType, UnaryOp};

    /// Forward a = tanh(p), b = tanh(a); backward d = exp(b) * a (reads a
    /// late: the first backward read), then a "weight gradient" w = d * p
    /// that nothing after it reads, then e = exp(d): e must wait for w.
    #[test]
    fn a_backward_kernel_waits_for_the_one_before_it() {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [64]);
        let p = g.parameter(t.clone());
        let a = g.value(Op::Unary { op: UnaryOp::Tanh, input: p }).unwrap();
        let b = g.value(Op::Unary { op: UnaryOp::Tanh, input: a }).unwrap();
        let eb = g.value(Op::Unary { op: UnaryOp::Exp, input: b }).unwrap();
        let d = g.value(Op::Binary { op: BinaryOp::Mul, lhs: eb, rhs: a }).unwrap();
        let w = g.value(Op::Binary { op: BinaryOp::Mul, lhs: d, rhs: p }).unwrap();
        let e = g.value(Op::Unary { op: UnaryOp::Exp, input: d }).unwrap();
        g.set_outputs(vec![w, e]).unwrap();
        let (s, guarded) = sequence_backward(&g, &EveryNodeAKernel, &[]).unwrap();
        crate::verify(&s).unwrap();
        assert!(guarded >= 1, "{}", crate::text::print(&s));
        // e reads d through the guard anchored on w.
        let exp_of_d =
            s.nodes().filter(|(_, n)| matches!(n.op, Op::Unary { op: UnaryOp::Exp, .. })).last().expect("e").1;
        let Op::Unary { input, .. } = exp_of_d.op else { unreachable!() };
        assert!(matches!(s.node(input.node).op, Op::Select { .. }), "{}", crate::text::print(&s));
        let x =
            Literal::from_f64s(DType::F32, [64], &(0..64).map(|i| (i as f64 * 0.3).sin()).collect::<Vec<_>>()).unwrap();
        assert_eq!(crate::interpret(&g, std::slice::from_ref(&x)).unwrap(), crate::interpret(&s, &[x]).unwrap());
    }
}
