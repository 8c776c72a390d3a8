//! Dead-code elimination by rebuilding.
//!
//! Keeps the nodes the outputs reach, in their original (topological) order, and
//! drops unused parameters, renumbering the rest densely. Runs first in the
//! pipeline and again last; the frontend relies on it to make a step's program
//! independent of tensors the user created but never used.

use crate::ir::{Alias, Graph, NodeId, Op, ValueId};
use crate::CompileError;

/// The rebuilt graph and where its parameters came from.
#[derive(Clone, Debug)]
pub struct Pruned {
    pub graph: Graph,
    /// `kept_params[i]` is the old index of the new parameter `i`.
    pub kept_params: Vec<u32>,
    /// Number of nodes removed.
    pub removed: usize,
}

/// Rebuilds `g` without the nodes its outputs do not reach.
pub fn eliminate_dead_code(g: &Graph) -> Result<Pruned, CompileError> {
    prune(g, false)
}

/// Rebuilds `g` without the nodes its outputs do not reach, keeping every
/// parameter (and its index): the form passes inside the pipeline use.
pub fn eliminate_dead_code_keep_params(g: &Graph) -> Result<Graph, CompileError> {
    Ok(prune(g, true)?.graph)
}

fn prune(g: &Graph, keep_params: bool) -> Result<Pruned, CompileError> {
    let mut live = vec![false; g.len()];
    if keep_params {
        for p in g.params() {
            live[p.index()] = true;
        }
    }
    for v in g.outputs() {
        live[v.node.index()] = true;
    }
    // Operands precede their users, so one reverse sweep finds every live node.
    for (id, node) in g.nodes().collect::<Vec<_>>().into_iter().rev() {
        if live[id.index()] {
            for v in node.op.inputs() {
                live[v.node.index()] = true;
            }
        }
    }
    let mut out = Graph::new();
    let mut map: Vec<Option<NodeId>> = vec![None; g.len()];
    let mut kept_params = Vec::new();
    for (id, node) in g.nodes() {
        if !live[id.index()] {
            continue;
        }
        let mut op = node.op.clone();
        op.map_inputs(|v| ValueId::new(map[v.node.index()].expect("operands are live and earlier"), v.output));
        if let Op::Parameter { index, .. } = &mut op {
            kept_params.push(*index);
            *index = out.params().len() as u32;
        }
        map[id.index()] = Some(out.add(op)?);
    }
    let outputs =
        g.outputs().iter().map(|v| ValueId::new(map[v.node.index()].expect("outputs are live"), v.output)).collect();
    out.set_outputs(outputs)?;
    for a in g.aliases() {
        if let Some(param) = kept_params.iter().position(|&p| p == a.param) {
            out.add_alias(Alias { param: param as u32, output: a.output })?;
        }
    }
    let removed = g.len() - out.len();
    Ok(Pruned { graph: out, kept_params, removed })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, TensorType, UnaryOp};

    #[test]
    fn drops_unused_nodes_and_parameters() {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [3]);
        let a = g.parameter(t.clone());
        let b = g.parameter(t.clone());
        let _dead = g.value(Op::Unary { op: UnaryOp::Exp, input: a }).unwrap();
        let live = g.value(Op::Unary { op: UnaryOp::Tanh, input: b }).unwrap();
        g.set_outputs(vec![live]).unwrap();
        let p = eliminate_dead_code(&g).unwrap();
        assert_eq!(p.kept_params, vec![1]);
        assert_eq!(p.removed, 2);
        assert_eq!(p.graph.len(), 2);
        assert_eq!(p.graph.param_types(), vec![t]);
    }
}
