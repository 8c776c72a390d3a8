//! Reverse-mode automatic differentiation as a graph transform.
//!
//! `grad` appends the backward computation of `d loss / d wrt` to the same
//! graph, so forward, backward and the optimizer update compile as one program.
//! It walks nodes in reverse insertion (topological) order from the loss,
//! accumulating one cotangent per value, and visits only nodes on a path from a
//! `wrt` value to the loss: no backward op is emitted for a branch that does not
//! reach `wrt`.
//!
//! The rules live in `rules.rs`, one arm per op. `GradInfo::saved` lists the
//! forward values the backward ops read (the activations a rematerialization
//! pass may later choose to recompute instead of keeping).

mod builder;
mod rules;

use std::collections::HashMap;

use kiln_compiler::ir::{Graph, Literal, Op, ValueId};

use crate::error::{FrontendError, Result};
use builder::Builder;

/// Gradients and what the backward pass reads from the forward.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GradInfo {
    /// One gradient per `wrt` value, with that value's type.
    pub grads: Vec<ValueId>,
    /// Forward values read by backward ops, in first-use order.
    pub saved: Vec<ValueId>,
}

/// `d loss / d wrt[i]` for each `i`, appended to `g`.
pub fn grad(g: &mut Graph, loss: ValueId, wrt: &[ValueId]) -> Result<Vec<ValueId>> {
    Ok(grad_with_info(g, loss, wrt)?.grads)
}

/// Like [`grad`], also reporting the forward values the backward reads.
pub fn grad_with_info(g: &mut Graph, loss: ValueId, wrt: &[ValueId]) -> Result<GradInfo> {
    g.check_value("grad", loss)?;
    for &w in wrt {
        g.check_value("grad", w)?;
    }
    let lt = g.ty(loss).clone();
    if lt.shape.rank() != 0 || !lt.dtype.is_float() {
        return Err(FrontendError::LossNotScalar { ty: lt });
    }
    // Attention written with plain ops becomes the composite before the walk,
    // so its backward is the composite's (`docs/composites.md`).
    kiln_compiler::composite::fuse(g)?;
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
    Ok(GradInfo { grads, saved: b.saved })
}

/// Applies the composite rewrite `grad` applies ([`kiln_compiler::composite::fuse`])
/// to the current trace now and returns what it found; for tests and tools that
/// want to see which attentions were recognised without differentiating.
pub fn fuse_trace() -> Result<Vec<kiln_compiler::composite::Found>> {
    crate::context::with(|c| {
        let found = kiln_compiler::composite::fuse(&mut c.trace.graph)?;
        c.trace.note_rewrite(&found);
        Ok(found)
    })
}

/// The composite ops in the current trace, in node order.
pub fn trace_composites() -> Vec<Op> {
    crate::context::with(|c| {
        c.trace.graph.nodes().filter(|(_, n)| kiln_compiler::composite::is_composite(&n.op)).map(|(_, n)| n.op.clone()).collect()
    })
}

/// Whether `op` has a derivative rule for operand `pos` (used by tests and
/// error messages).
pub fn is_differentiable(op: &Op, pos: usize) -> bool {
    rules::differentiable(op, pos)
}
