//! The IR verifier: re-checks every invariant of [`Graph`] that a pass could break.
//!
//! `Graph::add` establishes the invariants when a node is made; passes that
//! rebuild or edit graphs may not. The pipeline runs `verify(&g)?` after each
//! pass in tests and debug builds, so a broken pass is caught where it ran, not
//! at lowering or inside XLA.
//!
//! Checked, in this order (the first violation is reported):
//! - every operand names an output of an earlier node (ids below the user's own);
//! - petgraph's edges agree with `op.inputs()` (same producers, same positions);
//! - each node's stored output types equal what [`infer::infer`] gives for its op;
//! - parameters are numbered `0..n` in insertion order and `g.params()` lists exactly them;
//! - every graph output exists;
//! - aliases name an existing parameter and output of the same type, each at most
//!   once, sorted (as `Graph::add_alias` keeps them, so printing is deterministic).
//!
//! The verifier never panics on a malformed graph: values are bounds-checked before
//! their types are read.

use crate::ir::{infer, Graph, NodeId, Op, ValueId};
use crate::CompileError;

fn fail(node: impl ToString, reason: impl Into<String>) -> CompileError {
    CompileError::Verify { node: node.to_string(), reason: reason.into() }
}

/// Whether `v` names an output of a node before `before` (all nodes when `None`).
fn defined(g: &Graph, v: ValueId, before: Option<NodeId>) -> bool {
    let limit = before.map_or(g.len(), NodeId::index);
    v.node.index() < limit && (v.output as usize) < g.node(v.node).outputs.len()
}

/// Checks every invariant of `g`; see the module docs for the list.
pub fn verify(g: &Graph) -> Result<(), CompileError> {
    let mut params_seen: u32 = 0;
    for (id, node) in g.nodes() {
        let inputs = node.op.inputs();
        for &v in &inputs {
            if !defined(g, v, Some(id)) {
                return Err(fail(id, format!("operand {v} is not defined before its use")));
            }
        }

        let edges = g.operand_edges(id);
        let expected: Vec<(u32, NodeId)> = inputs.iter().enumerate().map(|(pos, v)| (pos as u32, v.node)).collect();
        if edges != expected {
            return Err(fail(id, format!("graph edges {edges:?} disagree with the op's operands {expected:?}")));
        }

        let inferred = infer::infer(g, &node.op).map_err(|e| fail(id, format!("does not type-check: {e}")))?;
        if inferred != node.outputs {
            let stored: Vec<String> = node.outputs.iter().map(ToString::to_string).collect();
            let inferred: Vec<String> = inferred.iter().map(ToString::to_string).collect();
            return Err(fail(
                id,
                format!("stored output types [{}] differ from inferred [{}]", stored.join(", "), inferred.join(", ")),
            ));
        }

        if let Op::Parameter { index, .. } = node.op {
            if index != params_seen {
                return Err(fail(id, format!("parameter numbered {index}, expected {params_seen}")));
            }
            if g.params().get(index as usize) != Some(&id) {
                return Err(fail(id, format!("g.params()[{index}] is not this node")));
            }
            params_seen += 1;
        }
    }
    if g.params().len() != params_seen as usize {
        return Err(fail(
            "params",
            format!("g.params() lists {} parameters, the graph has {params_seen}", g.params().len()),
        ));
    }

    for (i, &v) in g.outputs().iter().enumerate() {
        if !defined(g, v, None) {
            return Err(fail("return", format!("output {i} ({v}) is not defined")));
        }
    }

    for (i, a) in g.aliases().iter().enumerate() {
        let name = format!("alias {} -> {}", a.param, a.output);
        let (Some(&p), Some(&o)) = (g.params().get(a.param as usize), g.outputs().get(a.output as usize)) else {
            return Err(fail(name, "no such parameter or output"));
        };
        let (pt, ot) = (&g.node(p).outputs[0], g.ty(o));
        if pt != ot {
            return Err(fail(name, format!("parameter type {pt} differs from output type {ot}")));
        }
        if let Some(prev) = i.checked_sub(1).map(|j| g.aliases()[j]) {
            if prev >= *a {
                return Err(fail(name, "aliases are not sorted and unique"));
            }
        }
        if g.aliases()[..i].iter().any(|b| b.param == a.param || b.output == a.output) {
            return Err(fail(name, "parameter or output aliased twice"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Alias, BinaryOp, DType, TensorType, UnaryOp};

    /// `%0, %1: f32[4]`, `%2 = exp %0`, `%3 = add %2, %1`, returns `%3`, aliases 0 -> 0.
    fn valid() -> Graph {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [4]);
        let x = g.parameter(t.clone());
        let y = g.parameter(t);
        let e = g.value(Op::Unary { op: UnaryOp::Exp, input: x }).unwrap();
        let s = g.value(Op::Binary { op: BinaryOp::Add, lhs: e, rhs: y }).unwrap();
        g.set_outputs(vec![s]).unwrap();
        g.add_alias(Alias { param: 0, output: 0 }).unwrap();
        g
    }

    fn n(i: usize) -> NodeId {
        NodeId::from_index(i)
    }

    /// Asserts that `g` fails verification at `node` with a reason containing `needle`.
    fn assert_fails(g: &Graph, node: &str, needle: &str) {
        match verify(g) {
            Err(CompileError::Verify { node: at, reason }) => {
                assert_eq!(at, node, "{reason}");
                assert!(reason.contains(needle), "reason {reason:?} lacks {needle:?}");
            }
            other => panic!("expected a verifier error at {node}, got {other:?}"),
        }
    }

    #[test]
    fn a_valid_graph_verifies() {
        assert_eq!(verify(&valid()), Ok(()));
        assert_eq!(verify(&Graph::new()), Ok(()));
    }

    #[test]
    fn use_before_definition_is_caught() {
        let mut g = valid();
        g.node_mut(n(2)).op = Op::Unary { op: UnaryOp::Exp, input: n(3).into() };
        assert_fails(&g, "%2", "operand %3 is not defined before its use");
    }

    #[test]
    fn missing_output_index_is_caught() {
        let mut g = valid();
        g.node_mut(n(2)).op = Op::Unary { op: UnaryOp::Exp, input: ValueId::new(n(0), 1) };
        assert_fails(&g, "%2", "operand %0#1 is not defined");
    }

    #[test]
    fn edges_that_disagree_with_operands_are_caught() {
        // %1 has %0's type, so only the edges betray the rewired operand.
        let mut g = valid();
        g.node_mut(n(2)).op = Op::Unary { op: UnaryOp::Exp, input: n(1).into() };
        assert_fails(&g, "%2", "disagree");
    }

    #[test]
    fn stale_output_types_are_caught() {
        let mut g = valid();
        g.node_mut(n(3)).outputs = vec![TensorType::new(DType::F32, [5])].into();
        assert_fails(&g, "%3", "stored output types [tensor<5xf32>] differ from inferred [tensor<4xf32>]");
    }

    #[test]
    fn ops_that_no_longer_type_check_are_caught() {
        let mut g = valid();
        g.node_mut(n(1)).op = Op::Parameter { index: 1, ty: TensorType::new(DType::F32, [5]) };
        g.node_mut(n(1)).outputs = vec![TensorType::new(DType::F32, [5])].into();
        assert_fails(&g, "%3", "does not type-check");
    }

    #[test]
    fn misnumbered_parameters_are_caught() {
        let mut g = valid();
        g.node_mut(n(1)).op = Op::Parameter { index: 0, ty: TensorType::new(DType::F32, [4]) };
        assert_fails(&g, "%1", "parameter numbered 0, expected 1");
    }

    #[test]
    fn params_list_out_of_step_is_caught() {
        let mut g = valid();
        g.lists_mut().0.swap(0, 1);
        assert_fails(&g, "%0", "g.params()[0] is not this node");

        let mut g = valid();
        g.lists_mut().0.push(n(3));
        assert_fails(&g, "params", "lists 3 parameters, the graph has 2");
    }

    #[test]
    fn undefined_outputs_are_caught() {
        let mut g = valid();
        g.lists_mut().1.push(n(9).into());
        assert_fails(&g, "return", "output 1 (%9) is not defined");
    }

    #[test]
    fn bad_aliases_are_caught() {
        let mut g = valid();
        g.lists_mut().2.push(Alias { param: 2, output: 0 });
        assert_fails(&g, "alias 2 -> 0", "no such parameter or output");

        let mut g = valid();
        g.lists_mut().2.push(Alias { param: 1, output: 0 });
        assert_fails(&g, "alias 1 -> 0", "aliased twice");

        let mut g = valid();
        g.lists_mut().2.insert(0, Alias { param: 1, output: 0 });
        assert_fails(&g, "alias 0 -> 0", "not sorted");

        // An output of another type than the parameter it would reuse.
        let mut g = valid();
        let c = g.value(Op::Convert { input: n(3).into(), to: DType::F16 }).unwrap();
        g.set_outputs(vec![c]).unwrap();
        assert_fails(&g, "alias 0 -> 0", "parameter type tensor<4xf32> differs from output type tensor<4xf16>");
    }
}
