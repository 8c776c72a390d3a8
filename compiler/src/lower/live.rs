//! Liveness for lowering: which nodes the program's outputs depend on.
//!
//! The lowering emits only these, so a graph that still holds dead nodes (no DCE
//! pass has run, or a pass left some behind) lowers to the same module as its
//! cleaned-up form. The graph is read, never changed. The cost model
//! ([`crate::cost`]) counts the same nodes, so dead code costs nothing there either.
//!
//! Invariant relied on: operands are defined before their users (insertion
//! order is topological), so one backward sweep over the ids is enough.

use crate::ir::{Graph, NodeId};

/// `live[i]` is true when node `i` is reachable from an output.
pub(crate) fn live_nodes(g: &Graph) -> Vec<bool> {
    let mut live = vec![false; g.len()];
    for v in g.outputs() {
        live[v.node.index()] = true;
    }
    for i in (0..g.len()).rev() {
        if live[i] {
            for v in g.node(NodeId::from_index(i)).op.inputs() {
                live[v.node.index()] = true;
            }
        }
    }
    live
}
