//! Reverse-mode automatic differentiation as a graph transform.
//!
//! `grad` appends the backward computation of `d loss / d wrt` to the same
//! graph, so forward, backward and the optimizer update compile as one program.
//! It walks nodes in reverse insertion (topological) order from the loss,
//! accumulating one cotangent per value, and visits only nodes on a path from a
//! `wrt` value to the loss: no backward op is emitted for a branch that does not
//! reach `wrt`.
//!
//! The rules live in `rules.rs`, one arm per op. `GradInfo::reads` records
//! every read of a forward value by a backward node (the builder records it
//! when the op is made, so a rule cannot forget one), and `GradInfo::saved`
//! the distinct forward values read: the activations a rematerialization pass
//! may choose to recompute instead of keeping. The tensor-level `grad` keeps
//! them on the step's trace (`Trace::backward_reads`) until the step is cut.
//!
//! Invariants:
//! - A backward op is emitted only for a node on a path from a `wrt` value to
//!   the loss, and nodes are visited in reverse insertion order: the same
//!   graph gets the same backward.
//! - Every read of a forward value by a backward node is in `GradInfo::reads`.
//! - An op with no derivative for an operand that wants one is
//!   `NotDifferentiable`, naming the op and the operand, never a zero
//!   gradient.

mod builder;
mod rules;

pub use crate::core::trace::BackwardRead;

use std::collections::HashMap;

use kiln_compiler::ir::{Graph, Literal, Op, ValueId};

use crate::core::error::{FrontendError, Result};
use crate::core::metrics;
use builder::Builder;

/// Gradients and what the backward pass reads from the forward.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GradInfo {
    /// One gradient per `wrt` value, with that value's type.
    pub grads: Vec<ValueId>,
    /// Forward values read by backward ops, in first-use order.
    pub saved: Vec<ValueId>,
    /// Every read of a forward value by a backward node, in creation order.
    pub reads: Vec<BackwardRead>,
}

/// `d loss / d wrt[i]` for each `i`, appended to `g`.
pub fn grad(g: &mut Graph, loss: ValueId, wrt: &[ValueId]) -> Result<Vec<ValueId>> {
    Ok(grad_with_info(g, loss, wrt)?.grads)
}

/// Like [`grad`], also reporting the forward values the backward reads.
/// Attention written with plain ops becomes the composite before the walk,
/// so its backward is the composite's (`docs/composites.md`).
pub fn grad_with_info(g: &mut Graph, loss: ValueId, wrt: &[ValueId]) -> Result<GradInfo> {
    g.check_value("grad", loss)?;
    let cache = &mut kiln_compiler::composite::ConstCache::new();
    kiln_compiler::composite::fuse(g, cache, kiln_compiler::composite::FuseOptions::default())?;
    differentiate(g, loss, wrt)
}

/// The backward walk of [`grad_with_info`], on a graph whose composites were
/// already fused.
pub(crate) fn differentiate(g: &mut Graph, loss: ValueId, wrt: &[ValueId]) -> Result<GradInfo> {
    g.check_value("grad", loss)?;
    for &w in wrt {
        g.check_value("grad", w)?;
    }
    let lt = g.ty(loss).clone();
    if lt.shape.rank() != 0 || !lt.dtype.is_float() {
        return Err(FrontendError::LossNotScalar { ty: lt });
    }
    let n = loss.node.index() + 1;
    // Nodes that depend on some wrt value (forward sweep) ...
    let mut depends = vec![false; n];
    for &w in wrt {
        if w.node.index() < n {
            depends[w.node.index()] = true;
        }
    }
    for (id, node) in g.nodes().take(n) {
        if !depends[id.index()] && node.op.inputs().iter().any(|v| depends[v.node.index()]) {
            depends[id.index()] = true;
        }
    }
    // ... and that the loss depends on (backward sweep).
    let mut reaches = vec![false; n];
    reaches[loss.node.index()] = true;
    for i in (0..n).rev() {
        if reaches[i] {
            for v in g.node(kiln_compiler::ir::NodeId::from_index(i)).op.inputs() {
                reaches[v.node.index()] = true;
            }
        }
    }
    let on_path: Vec<bool> = depends.iter().zip(&reaches).map(|(a, b)| *a && *b).collect();

    let mut b = Builder::new(g);
    let mut ct: HashMap<ValueId, ValueId> = HashMap::new();
    let one = b.constant(Literal::scalar(lt.dtype, 1.0))?;
    ct.insert(loss, one);
    for i in (0..n).rev() {
        if !on_path[i] {
            continue;
        }
        let id = kiln_compiler::ir::NodeId::from_index(i);
        let node = b.g.node(id).clone();
        let outs: Vec<Option<ValueId>> =
            (0..node.outputs.len()).map(|k| ct.get(&ValueId::new(id, k as u32)).copied()).collect();
        if outs.iter().all(Option::is_none) {
            continue;
        }
        let inputs = node.op.inputs();
        let wants: Vec<bool> = inputs.iter().map(|v| on_path[v.node.index()] && b.g.ty(*v).dtype.is_float()).collect();
        if !wants.iter().any(|&w| w) {
            continue;
        }
        let contributions = rules::backward(&mut b, id, &node.op, &outs, &wants)?;
        for (pos, c) in contributions {
            let target = inputs[pos];
            let sum = match ct.get(&target) {
                Some(&prev) => b.add(prev, c)?,
                None => c,
            };
            ct.insert(target, sum);
        }
    }
    let mut grads = Vec::with_capacity(wrt.len());
    for &w in wrt {
        grads.push(match ct.get(&w) {
            Some(&c) => c,
            None => {
                let ty = b.g.ty(w).clone();
                b.zeros(&ty)?
            }
        });
    }
    Ok(GradInfo { grads, saved: b.saved, reads: b.reads })
}

/// Applies the composite rewrite `grad` applies ([`kiln_compiler::composite::fuse`])
/// to the current trace now and returns what it found; for tests and tools that
/// want to see which attentions were recognised without differentiating.
pub fn fuse_trace() -> Result<kiln_compiler::composite::Fused> {
    let opts = fuse_options();
    crate::engine::context::with(|c| fuse_in(c, opts))
}

/// What the matchers are told: an LM-head loss found in plain ops gets the
/// blocks and shards `nn::lm_head_cross_entropy` would give it. Read outside
/// the context (the mesh is kept there).
pub(crate) fn fuse_options() -> kiln_compiler::composite::FuseOptions {
    let loss = kiln_compiler::composite::LossOptions {
        block_bytes: crate::api::nn::LM_HEAD_BLOCK_BYTES,
        data_shards: crate::engine::partition::data_parts(),
    };
    kiln_compiler::composite::FuseOptions { loss }
}

/// The composite rewrite on `c`'s trace, folded into its running hash.
pub(crate) fn fuse_in(
    c: &mut crate::engine::context::Context,
    opts: kiln_compiler::composite::FuseOptions,
) -> Result<kiln_compiler::composite::Fused> {
    let fused = kiln_compiler::composite::fuse(&mut c.trace.graph, &mut c.consts, opts)?;
    c.trace.note_rewrite(&fused.found);
    metrics::update(|m| {
        m.composites_found += fused.found.len() as u64;
        m.composites_missed += fused.missed.len() as u64;
    });
    Ok(fused)
}

/// Tells the user, once per process, of a composite left plain.
pub(crate) fn warn_missed(missed: &[kiln_compiler::composite::Missed]) {
    if let Some(m) = missed.first() {
        let message = || format!("{} at {} left plain: {} ({} such this step)", m.kind, m.node, m.reason, missed.len());
        tracing::debug!(kind = m.kind, node = %m.node, reason = %m.reason, "composite left plain");
        crate::core::warnings::show_once(crate::core::warnings::Warning::CompositeMissed, message);
    }
}

/// The composite ops in the current trace, in node order.
pub fn trace_composites() -> Vec<Op> {
    crate::engine::context::with(|c| {
        c.trace
            .graph
            .nodes()
            .filter(|(_, n)| kiln_compiler::composite::is_composite(&n.op))
            .map(|(_, n)| n.op.clone())
            .collect()
    })
}

/// Whether `op` has a derivative rule for operand `pos` (used by tests and
/// error messages).
pub fn is_differentiable(op: &Op, pos: usize) -> bool {
    rules::differentiable(op, pos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::ir::{DType, NodeId, ReduceOp, TensorType, UnaryOp};

    /// Every operand of a backward node that is a forward value is in `reads`,
    /// and `saved` is exactly the distinct forward values read.
    fn check_map(g: &Graph, forward_len: usize, info: &GradInfo) {
        let mut want = Vec::new();
        for i in forward_len..g.len() {
            let id = NodeId::from_index(i);
            for u in g.node(id).op.inputs() {
                if u.node.index() < forward_len {
                    want.push(BackwardRead { forward: u, user: id });
                }
            }
        }
        assert_eq!(info.reads, want);
        let mut distinct: Vec<ValueId> = Vec::new();
        for r in &want {
            if !distinct.contains(&r.forward) {
                distinct.push(r.forward);
            }
        }
        assert_eq!(info.saved, distinct);
    }

    #[test]
    fn reads_the_rules_take_directly_are_recorded() {
        // max-reduce reads its own result y (`broadcast(y)`) without marking
        // it: the map used to miss it.
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::F32, [3, 4]));
        let m = g.value(Op::Reduce { op: ReduceOp::Max, input: x, axes: vec![1] }).unwrap();
        let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: m }).unwrap();
        let loss = g.value(Op::Reduce { op: ReduceOp::Sum, input: t, axes: vec![0] }).unwrap();
        let forward_len = g.len();
        let info = grad_with_info(&mut g, loss, &[x]).unwrap();
        check_map(&g, forward_len, &info);
        assert!(info.saved.contains(&m), "the max's result is read by its rule: {:?}", info.saved);
        assert!(info.saved.contains(&t) && info.saved.contains(&x));
    }

    #[test]
    fn the_fused_lm_head_loss_is_not_differentiable() {
        // It is made by the compiler after autodiff; differentiating through
        // it is a typed error naming the op and operand.
        let mut g = Graph::new();
        let h = g.parameter(TensorType::new(DType::F32, [4, 3]));
        let w = g.parameter(TensorType::new(DType::F32, [5, 3]));
        let labels = g.parameter(TensorType::new(DType::I32, [4]));
        let scale = g.parameter(TensorType::new(DType::F32, []));
        let f = g.add(Op::LmHeadCrossEntropyFused { h, w, labels, scale, chunk: 2, shards: 1 }).unwrap();
        let loss = g.value(Op::Reduce { op: ReduceOp::Sum, input: ValueId::new(f, 0), axes: vec![0] }).unwrap();
        match grad_with_info(&mut g, loss, &[h]) {
            Err(crate::core::error::FrontendError::NotDifferentiable { op, operand, .. }) => {
                assert_eq!((op, operand), ("lm_head_cross_entropy_fused", 0));
            }
            other => panic!("expected NotDifferentiable, got {:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn every_forward_operand_of_a_backward_node_is_in_the_map() {
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::F32, [2, 3]));
        let w = g.parameter(TensorType::new(DType::F32, [3, 3]));
        let h = g.value(Op::DotGeneral { lhs: x, rhs: w, dims: kiln_compiler::ir::DotDims::matmul() }).unwrap();
        let e = g.value(Op::Unary { op: UnaryOp::Exp, input: h }).unwrap();
        let r = g.value(Op::Unary { op: UnaryOp::Rsqrt, input: e }).unwrap();
        let c = g.value(Op::Clamp { min: x, input: r, max: x }).unwrap_or(r);
        let loss = g.value(Op::Reduce { op: ReduceOp::Sum, input: c, axes: vec![0, 1] }).unwrap();
        let forward_len = g.len();
        let info = grad_with_info(&mut g, loss, &[w]).unwrap();
        check_map(&g, forward_len, &info);
        assert!(!info.reads.is_empty());
    }
}
