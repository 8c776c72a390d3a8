//! Fuses the LM-head loss with its gradient when the gradient's cotangent is
//! one scalar for every token (`docs/composites.md`).
//!
//! Autodiff turns `mean(lm_head_cross_entropy(h, w, labels))` into the forward
//! composite and, later in the program, `lm_head_cross_entropy_grad` with
//! `dnll = broadcast(s)`: the seed (or loss scale) times `1/n`, a rank-0 value.
//! The grad op recomputes every block's logits from the saved log-sum-exp. When
//! `s` does not depend on the forward's outputs, both can run in one loop over
//! the row blocks instead: [`Op::LmHeadCrossEntropyFused`] makes each block's
//! logits once and takes the loss and the gradient from them (three matmuls in
//! all, as the plain program, and no `[n, vocab]` buffer).
//!
//! The pair is matched when: the grad's `lse` is output `#1` of a forward
//! composite with the same `h`, `w`, `labels` and `chunk`; `dnll` is a
//! `broadcast_in_dim` of a rank-0 f32 value `s`; and the forward node is not an
//! ancestor of `s`. Anything else (a weighted mean, a cotangent built from the
//! loss) is left alone.
//!
//! The fused node takes the forward's place. The nodes of `s`'s cone that come
//! after the forward move before it (with every later parameter when the cone
//! holds one, so parameters stay in index order): insertion order stays
//! topological and parameters keep their indices. Outputs, aliases and every
//! other node are kept; the dead broadcast is left for dead-code elimination.
//!
//! Runs in the pipeline first, on the graph autodiff made, on every target and
//! so before remat: the memory model then sees the fused op, not the pair.

use crate::ir::{Alias, Graph, NodeId, Op, TensorType, ValueId};
use crate::CompileError;

/// One forward/grad pair to fuse, with the fused op's operands (in the
/// original graph's ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pair {
    forward: NodeId,
    grad: NodeId,
    h: ValueId,
    w: ValueId,
    labels: ValueId,
    scale: ValueId,
    chunk: usize,
    shards: usize,
}

/// Rebuilds `g` with every matching forward/grad pair of the LM-head loss
/// fused into one [`Op::LmHeadCrossEntropyFused`]; returns the graph and the
/// number of pairs fused.
pub fn fuse_lm_head_loss(g: &Graph) -> Result<(Graph, usize), CompileError> {
    let mut out = g.clone();
    let mut fused = 0;
    // One pair per rebuild: each rebuild renumbers the nodes. A step has one
    // loss, so this loop runs once or twice.
    while let Some(p) = find(&out) {
        out = rebuild(&out, p)?;
        fused += 1;
    }
    Ok((out, fused))
}

/// The first grad node (in insertion order) that pairs with its forward.
fn find(g: &Graph) -> Option<Pair> {
    g.nodes().find_map(|(id, node)| {
        let Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll, chunk, shards } = &node.op else { return None };
        if lse.output != 1 {
            return None;
        }
        let forward = lse.node;
        let same = Op::LmHeadCrossEntropy { h: *h, w: *w, labels: *labels, chunk: *chunk, shards: *shards };
        if g.node(forward).op != same {
            return None;
        }
        let scale = uniform(g, *dnll)?;
        if ancestors(g, scale.node)[forward.index()] {
            return None;
        }
        Some(Pair { forward, grad: id, h: *h, w: *w, labels: *labels, scale, chunk: *chunk, shards: *shards })
    })
}

/// `s` when `v` is `broadcast_in_dim(s)` of a rank-0 f32 `s`.
fn uniform(g: &Graph, v: ValueId) -> Option<ValueId> {
    match &g.node(v.node).op {
        Op::BroadcastInDim { input, dims, .. } if dims.is_empty() => {
            (*g.ty(*input) == TensorType::scalar(crate::ir::DType::F32)).then_some(*input)
        }
        _ => None,
    }
}

/// Which nodes are `id` or reach it (indexed by node).
fn ancestors(g: &Graph, id: NodeId) -> Vec<bool> {
    let mut seen = vec![false; g.len()];
    let mut stack = vec![id];
    while let Some(n) = stack.pop() {
        if std::mem::replace(&mut seen[n.index()], true) {
            continue;
        }
        stack.extend(g.node(n).op.inputs().into_iter().map(|v| v.node));
    }
    seen
}

fn rebuild(g: &Graph, p: Pair) -> Result<Graph, CompileError> {
    let f = p.forward.index();
    let cone = ancestors(g, p.scale.node);
    let mut hoist: Vec<bool> = (0..g.len()).map(|i| i > f && cone[i]).collect();
    let hoists_param = g.nodes().any(|(id, n)| hoist[id.index()] && matches!(n.op, Op::Parameter { .. }));
    if hoists_param {
        for (id, n) in g.nodes() {
            if id.index() > f && matches!(n.op, Op::Parameter { .. }) {
                hoist[id.index()] = true;
            }
        }
    }
    // The new graph's nodes in order: the forward's place takes the hoisted
    // cone, then the fused node; the grad node is dropped.
    let order = g.nodes().flat_map(|(id, _)| {
        let i = id.index();
        let here: Vec<Option<NodeId>> = if i == f {
            g.nodes().filter(|(h, _)| hoist[h.index()]).map(|(h, _)| Some(h)).chain([None]).collect()
        } else if hoist[i] || id == p.grad {
            vec![]
        } else {
            vec![Some(id)]
        };
        here
    });
    let mut r = Remap { map: vec![None; g.len()], fused: None, p };
    let mut out = Graph::new();
    for item in order.collect::<Vec<_>>() {
        match item {
            Some(id) => {
                let mut op = g.node(id).op.clone();
                let mut missing = None;
                op.map_inputs(|v| {
                    r.get(v).unwrap_or_else(|e| {
                        missing = Some(e);
                        v
                    })
                });
                if let Some(e) = missing {
                    return Err(e);
                }
                r.map[id.index()] = Some(out.add(op)?);
            }
            None => {
                let op = Op::LmHeadCrossEntropyFused {
                    h: r.get(p.h)?,
                    w: r.get(p.w)?,
                    labels: r.get(p.labels)?,
                    scale: r.get(p.scale)?,
                    chunk: p.chunk,
                    shards: p.shards,
                };
                r.fused = Some(out.add(op)?);
            }
        }
    }
    let outputs = g.outputs().iter().map(|&v| r.get(v)).collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(outputs)?;
    for &a in g.aliases() {
        out.add_alias(Alias { ..a })?;
    }
    Ok(out)
}

/// Old values to new: the forward's `#0`/`#1` and the grad's `#0`/`#1` become
/// the fused node's `#0`..`#3`.
struct Remap {
    map: Vec<Option<NodeId>>,
    fused: Option<NodeId>,
    p: Pair,
}

impl Remap {
    fn get(&self, v: ValueId) -> Result<ValueId, CompileError> {
        let (node, output) = if v.node == self.p.forward {
            (self.fused, v.output)
        } else if v.node == self.p.grad {
            (self.fused, 2 + v.output)
        } else {
            (self.map[v.node.index()], v.output)
        };
        // Unreachable while insertion order is topological and `find`'s
        // guard holds; an error, not a panic, if either is ever broken.
        node.map(|n| ValueId::new(n, output)).ok_or_else(|| CompileError::Verify {
            node: v.to_string(),
            reason: "lm_head_loss: a value is used before the node that makes it".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DType, Literal, Shape};

    /// forward; scale = p3 · (1/6) after it (p3 a later parameter); grad of
    /// `broadcast(scale)`; outputs nll, dh, dw.
    fn pair() -> Graph {
        let mut g = Graph::new();
        let h = g.parameter(TensorType::new(DType::F32, [6, 4]));
        let w = g.parameter(TensorType::new(DType::F32, [9, 4]));
        let labels = g.parameter(TensorType::new(DType::I32, [6]));
        let ce = g.add(Op::LmHeadCrossEntropy { h, w, labels, chunk: 2, shards: 1 }).unwrap();
        let seed = g.parameter(TensorType::scalar(DType::F32));
        let inv = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 1.0 / 6.0) }).unwrap();
        let s = g.value(Op::Binary { op: BinaryOp::Mul, lhs: seed, rhs: inv }).unwrap();
        let dnll = g.value(Op::BroadcastInDim { input: s, shape: Shape::new([6]), dims: vec![] }).unwrap();
        let lse = ValueId::new(ce, 1);
        let gr = g.add(Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll, chunk: 2, shards: 1 }).unwrap();
        g.set_outputs(vec![ValueId::new(ce, 0), ValueId::new(gr, 0), ValueId::new(gr, 1)]).unwrap();
        g
    }

    #[test]
    fn the_pair_becomes_one_op_at_the_forwards_place_after_the_hoisted_scale() {
        let g = pair();
        let (out, fused) = fuse_lm_head_loss(&g).unwrap();
        assert_eq!(fused, 1);
        crate::verify(&out).unwrap();
        assert_eq!(out.param_types(), g.param_types());
        let ops: Vec<&str> = out.nodes().map(|(_, n)| n.op.name()).collect();
        // The scale's parameter, constant and product moved before the fused
        // op; the broadcast stays (dead, for DCE); the grad is gone.
        assert_eq!(
            ops,
            [
                "parameter",
                "parameter",
                "parameter",
                "parameter",
                "constant",
                "mul",
                "lm_head_cross_entropy_fused",
                "broadcast_in_dim"
            ]
        );
        let f = NodeId::from_index(6);
        let outs: Vec<ValueId> = [0, 2, 3].into_iter().map(|k| ValueId::new(f, k)).collect();
        assert_eq!(out.outputs(), outs.as_slice());
        assert_eq!(out.output_types(), g.output_types());
        // A second run finds nothing more.
        assert_eq!(fuse_lm_head_loss(&out).unwrap().1, 0);
    }
}
