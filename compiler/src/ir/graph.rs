//! The step graph: nodes in a petgraph behind typed ids.
//!
//! Invariants:
//! - A node's operands are defined before it, so insertion order is a
//!   topological order and iteration is deterministic (no hash-map order).
//! - Shape and dtype of every output are inferred once, when the node is added,
//!   and stored on the node. A node that does not type-check is never added.
//! - Parameters are numbered `0..n` in the order they were added.
//! - Passes that delete nodes rebuild the graph (ids are dense).

use std::fmt;

use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use petgraph::Direction;

use super::{infer, Op, TensorType};
use crate::CompileError;

/// A node of the graph; `Display` is its text form `%12`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u32);

impl NodeId {
    /// An id no graph uses (the fingerprint's stand-in for operands).
    pub(crate) const HOLE: NodeId = NodeId(u32::MAX);

    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The id of the `index`-th node added. Only for code that walks ids densely
    /// (printers, parsers); a wrong index is caught when the id is used.
    pub fn from_index(index: usize) -> NodeId {
        NodeId(u32::try_from(index).expect("fewer than 2^32 nodes"))
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One output of a node: `%12` for the first (usually only) output, `%12#1`
/// for the second.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId {
    pub node: NodeId,
    pub output: u32,
}

impl ValueId {
    pub fn new(node: NodeId, output: u32) -> ValueId {
        ValueId { node, output }
    }
}

impl From<NodeId> for ValueId {
    fn from(node: NodeId) -> ValueId {
        ValueId { node, output: 0 }
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.output == 0 {
            write!(f, "{}", self.node)
        } else {
            write!(f, "{}#{}", self.node, self.output)
        }
    }
}

/// Output types of a node, inline for the usual single output: one heap
/// allocation less per node to make and to free every step.
pub type Outputs = smallvec::SmallVec<[TensorType; 1]>;

/// An operation and the types of its outputs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    pub op: Op,
    pub outputs: Outputs,
}

/// A program input that the runtime may overwrite with an output (donation):
/// `param`'s buffer is reused for `output`. Both must have the same type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Alias {
    pub param: u32,
    pub output: u32,
}

/// A dataflow graph with ordered parameters and outputs.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    g: DiGraph<Node, u32>,
    params: Vec<NodeId>,
    outputs: Vec<ValueId>,
    aliases: Vec<Alias>,
}

impl Graph {
    pub fn new() -> Graph {
        Graph::default()
    }

    /// An empty graph with room for `other`'s nodes and edges and `extra`
    /// more nodes: for a pass that rebuilds `other`.
    pub(crate) fn with_capacity_of(other: &Graph, extra: usize) -> Graph {
        let (nodes, edges) = (other.g.node_count() + extra, other.g.edge_count() + 4 * extra);
        Graph { g: DiGraph::with_capacity(nodes, edges), ..Graph::default() }
    }

    /// Type-checks `op` against the graph and appends it.
    pub fn add(&mut self, op: Op) -> Result<NodeId, CompileError> {
        for v in op.inputs() {
            self.check_value(op.name(), v)?;
        }
        let outputs = infer::infer(self, &op)?;
        self.push(op, outputs)
    }

    /// Appends `op`, a node of another graph whose operands are mapped to
    /// values of this one with the same types, with that node's `outputs`
    /// instead of inferring them again. For passes that rebuild a whole graph
    /// around a local change (remat rewrites the step once for each
    /// candidate it measures); [`crate::verify`], which the pipeline runs
    /// after every pass, infers every node's types again.
    pub(crate) fn add_copy(&mut self, op: Op, outputs: &Outputs) -> Result<NodeId, CompileError> {
        for v in op.inputs() {
            self.check_value(op.name(), v)?;
        }
        self.push(op, outputs.clone())
    }

    fn push(&mut self, op: Op, outputs: Outputs) -> Result<NodeId, CompileError> {
        if let Op::Parameter { index, .. } = &op {
            if *index as usize != self.params.len() {
                return Err(CompileError::ParameterOrder { index: *index, expected: self.params.len() as u32 });
            }
        }
        let inputs = op.inputs();
        let is_param = matches!(op, Op::Parameter { .. });
        let ix = self.g.add_node(Node { op, outputs });
        for (pos, v) in inputs.into_iter().enumerate() {
            self.g.add_edge(NodeIndex::new(v.node.index()), ix, pos as u32);
        }
        let id = NodeId(ix.index() as u32);
        if is_param {
            self.params.push(id);
        }
        Ok(id)
    }

    /// Adds a single-output op and returns its value.
    pub fn value(&mut self, op: Op) -> Result<ValueId, CompileError> {
        let id = self.add(op)?;
        Ok(ValueId::from(id))
    }

    /// `value` (a scalar of `dtype`) broadcast to `shape`: the constant
    /// itself for a scalar shape.
    pub fn splat(&mut self, dtype: super::DType, value: f64, shape: &super::Shape) -> Result<ValueId, CompileError> {
        let c = self.value(Op::Constant { literal: super::Literal::scalar(dtype, value) })?;
        if shape.rank() == 0 {
            return Ok(c);
        }
        self.value(Op::BroadcastInDim { input: c, shape: shape.clone(), dims: vec![] })
    }

    /// Appends the next parameter.
    pub fn parameter(&mut self, ty: TensorType) -> ValueId {
        let index = self.params.len() as u32;
        self.value(Op::Parameter { index, ty }).expect("a fresh parameter always type-checks")
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[NodeIndex::new(id.index())]
    }

    /// Type of one value. Panics on a value of another graph; use
    /// [`Graph::check_value`] on ids that come from outside.
    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.node(v.node).outputs[v.output as usize]
    }

    /// Checks that `v` names an output of a node of this graph.
    pub fn check_value(&self, op: &'static str, v: ValueId) -> Result<(), CompileError> {
        let ok = v.node.index() < self.g.node_count()
            && (v.output as usize) < self.g[NodeIndex::new(v.node.index())].outputs.len();
        if ok {
            Ok(())
        } else {
            Err(CompileError::UnknownValue { op, value: v })
        }
    }

    /// Producers of `id`'s operands as petgraph's edges record them, as
    /// `(operand position, producer)` sorted by position. Passes read
    /// `op.inputs()`; only the verifier reads the edges, to check they agree.
    pub(crate) fn operand_edges(&self, id: NodeId) -> Vec<(u32, NodeId)> {
        let mut edges: Vec<(u32, NodeId)> = self
            .g
            .edges_directed(NodeIndex::new(id.index()), Direction::Incoming)
            .map(|e| (*e.weight(), NodeId(e.source().index() as u32)))
            .collect();
        edges.sort();
        edges
    }

    /// Replaces node `id`'s op by `op` in place, for composite rewrites that must
    /// keep every existing `ValueId` valid. `op` reads only nodes before `id`
    /// (so insertion order stays topological), and its outputs start with the
    /// old outputs' types (so every existing use still type-checks); extra
    /// outputs are new values nobody reads yet.
    pub(crate) fn replace_op(&mut self, id: NodeId, op: Op) -> Result<(), CompileError> {
        for v in op.inputs() {
            self.check_value(op.name(), v)?;
            if v.node >= id {
                return Err(CompileError::Verify {
                    node: id.to_string(),
                    reason: format!("replacement reads {v}, defined later"),
                });
            }
        }
        let outputs = infer::infer(self, &op)?;
        let old = &self.node(id).outputs;
        if outputs.len() < old.len() || outputs[..old.len()] != old[..] {
            return Err(CompileError::Verify {
                node: id.to_string(),
                reason: "replacement changes the node's result types".into(),
            });
        }
        let ix = NodeIndex::new(id.index());
        while let Some(e) = self.g.first_edge(ix, Direction::Incoming) {
            self.g.remove_edge(e);
        }
        for (pos, v) in op.inputs().into_iter().enumerate() {
            self.g.add_edge(NodeIndex::new(v.node.index()), ix, pos as u32);
        }
        self.g[ix] = Node { op, outputs };
        Ok(())
    }

    /// Mutable access that bypasses every check `add` makes, so the verifier's
    /// tests can build graphs that break one invariant at a time.
    #[cfg(test)]
    pub(crate) fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.g[NodeIndex::new(id.index())]
    }

    /// Test-only, as [`Graph::node_mut`]: the parameter, output and alias lists.
    #[cfg(test)]
    pub(crate) fn lists_mut(&mut self) -> (&mut Vec<NodeId>, &mut Vec<ValueId>, &mut Vec<Alias>) {
        (&mut self.params, &mut self.outputs, &mut self.aliases)
    }

    pub fn len(&self) -> usize {
        self.g.node_count()
    }

    pub fn is_empty(&self) -> bool {
        self.g.node_count() == 0
    }

    /// All nodes in insertion (= topological) order.
    pub fn nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> + '_ {
        self.g.node_indices().map(|ix| (NodeId(ix.index() as u32), &self.g[ix]))
    }

    /// Nodes that read any output of `id`, in insertion order, without repeats.
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut users: Vec<NodeId> = self
            .g
            .neighbors_directed(NodeIndex::new(id.index()), Direction::Outgoing)
            .map(|ix| NodeId(ix.index() as u32))
            .collect();
        users.sort();
        users.dedup();
        users
    }

    pub fn params(&self) -> &[NodeId] {
        &self.params
    }

    pub fn param_types(&self) -> Vec<TensorType> {
        self.params.iter().map(|&p| self.node(p).outputs[0].clone()).collect()
    }

    pub fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }

    pub fn output_types(&self) -> Vec<TensorType> {
        self.outputs.iter().map(|&v| self.ty(v).clone()).collect()
    }

    pub fn set_outputs(&mut self, outputs: Vec<ValueId>) -> Result<(), CompileError> {
        for &v in &outputs {
            self.check_value("return", v)?;
        }
        self.outputs = outputs;
        Ok(())
    }

    pub fn aliases(&self) -> &[Alias] {
        &self.aliases
    }

    /// `from`'s aliases, for a graph rebuilt from it with the same parameters
    /// and outputs in the same order (each checked as [`Graph::add_alias`]
    /// checks one, without sorting the list again for each).
    pub(crate) fn copy_aliases(&mut self, from: &Graph) -> Result<(), CompileError> {
        for &alias in from.aliases() {
            self.check_alias(alias)?;
        }
        if let Some(&alias) = self.aliases.first() {
            return Err(CompileError::BadAlias { alias, reason: "parameter or output aliased twice" });
        }
        self.aliases = from.aliases.clone();
        Ok(())
    }

    /// Drops every donation: each output gets a buffer of its own.
    pub fn clear_aliases(&mut self) {
        self.aliases.clear();
    }

    /// Declares that parameter `param`'s buffer may be donated to output `output`.
    pub fn add_alias(&mut self, alias: Alias) -> Result<(), CompileError> {
        self.check_alias(alias)?;
        if self.aliases.iter().any(|a| a.param == alias.param || a.output == alias.output) {
            return Err(CompileError::BadAlias { alias, reason: "parameter or output aliased twice" });
        }
        self.aliases.push(alias);
        self.aliases.sort();
        Ok(())
    }

    /// `alias` names a parameter and an output of the same type.
    fn check_alias(&self, alias: Alias) -> Result<(), CompileError> {
        let p = self.params.get(alias.param as usize).copied();
        let o = self.outputs.get(alias.output as usize).copied();
        match (p, o) {
            (Some(p), Some(o)) if self.node(p).outputs[0] == *self.ty(o) => Ok(()),
            (Some(_), Some(_)) => Err(CompileError::BadAlias { alias, reason: "types differ" }),
            _ => Err(CompileError::BadAlias { alias, reason: "no such parameter or output" }),
        }
    }
}
