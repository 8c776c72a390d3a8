//! Common-subexpression elimination by hash-consing.
//!
//! Two nodes with equal ops (after their operands were merged) compute the same
//! value and become one. Collectives are never merged (their value depends on
//! the replica), and neither are RNG ops (equal state in, equal bits out is true,
//! but the frontend never records two with the same state, so merging would only
//! hide a bug). Runs after dead-code elimination; a rematerialization pass must
//! run after it, since CSE would undo recomputation.

use std::collections::HashMap;

use crate::ir::{Alias, Graph, NodeId, Op, ValueId};
use crate::CompileError;

/// Rebuilds `g` with duplicate computations merged; returns the graph and the
/// number of nodes merged away. Parameters keep their indices.
pub fn eliminate_common_subexpressions(g: &Graph) -> Result<(Graph, usize), CompileError> {
    let mut out = Graph::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(g.len());
    // Only looked up by key, never iterated, so hash order cannot leak out.
    let mut seen: HashMap<Op, NodeId> = HashMap::new();
    let mut merged = 0;
    for (_, node) in g.nodes() {
        let mut op = node.op.clone();
        op.map_inputs(|v| ValueId::new(map[v.node.index()], v.output));
        let mergeable = op.props().deterministic;
        if mergeable {
            if let Some(&id) = seen.get(&op) {
                map.push(id);
                merged += 1;
                continue;
            }
        }
        let id = out.add(op.clone())?;
        if mergeable {
            seen.insert(op, id);
        }
        map.push(id);
    }
    let outputs = g.outputs().iter().map(|v| ValueId::new(map[v.node.index()], v.output)).collect();
    out.set_outputs(outputs)?;
    for &a in g.aliases() {
        out.add_alias(Alias { ..a })?;
    }
    Ok((out, merged))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DType, TensorType, UnaryOp};

    #[test]
    fn merges_equal_ops_after_their_operands() {
        // exp(a) + exp(a) -> let e = exp(a) in e + e
        let mut g = Graph::new();
        let a = g.parameter(TensorType::new(DType::F32, [4]));
        let e1 = g.value(Op::Unary { op: UnaryOp::Exp, input: a }).unwrap();
        let e2 = g.value(Op::Unary { op: UnaryOp::Exp, input: a }).unwrap();
        let s = g.value(Op::Binary { op: BinaryOp::Add, lhs: e1, rhs: e2 }).unwrap();
        g.set_outputs(vec![s]).unwrap();
        let (out, merged) = eliminate_common_subexpressions(&g).unwrap();
        assert_eq!(merged, 1);
        let last = out.nodes().last().unwrap().1;
        assert_eq!(last.op.inputs()[0], last.op.inputs()[1]);
    }

    #[test]
    fn never_merges_collectives() {
        let mut g = Graph::new();
        let a = g.parameter(TensorType::new(DType::F32, [4]));
        let r1 = g.value(Op::AllReduce { op: crate::ir::ReduceOp::Sum, input: a }).unwrap();
        let r2 = g.value(Op::AllReduce { op: crate::ir::ReduceOp::Sum, input: a }).unwrap();
        g.set_outputs(vec![r1, r2]).unwrap();
        assert_eq!(eliminate_common_subexpressions(&g).unwrap().1, 0);
    }
}
