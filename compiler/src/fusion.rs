//! Fusion groups: which producer -> consumer chains the backend is expected to
//! run as one kernel, and so which intermediates never reach memory.
//!
//! The plan follows what XLA's GPU fusion does with the ops kiln emits:
//! elementwise ops, broadcasts, reshapes, transposes, slices, pads and
//! concatenations fuse into their consumer (a loop fusion); a reduction fuses
//! the chain that feeds it (an input fusion) and ends its group; a
//! `dot_general` fuses its elementwise consumers (an epilogue) but not its
//! operands; gathers, scatters, dynamic slices, RNG, barriers and collectives
//! run alone. Each producer -> consumer decision is `Result<(), NoFuse>` with
//! the reason.
//!
//! Invariants: groups are convex (merging never creates a cycle between
//! groups); every node is in exactly one group; a node's value reaches memory
//! when it is a graph output or read by another group. Parameters and
//! constants are inputs, in groups of their own.

use crate::ir::{Graph, NodeId, Op, TensorType};

pub use crate::ir::FusionKind;

/// The kind of `op` ([`crate::ir::OpProps::fusion`]).
pub fn kind(op: &Op) -> FusionKind {
    op.props().fusion
}

/// Why a producer does not fuse into its consumer's group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoFuse {
    /// The producer is a graph input (parameter or constant).
    Input,
    /// One of the two runs as a kernel of its own.
    Opaque { op: &'static str },
    /// A broadcast-like producer with users in other groups: fusing it would
    /// recompute it in each of them.
    WouldDuplicate { other_users: usize },
    /// The producer has users outside the group from which the group is
    /// reachable: one kernel would have to run both before and after them.
    CreatesCycle { via: NodeId },
    /// A reduction's result is materialized (its group ends there).
    ReductionResult,
    /// Matrix products read their operands from memory (no prologue fusion).
    MatmulOperand,
    /// A matrix product fuses into elementwise consumers only.
    MatmulIntoNonElementwise,
}

/// Group index of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(pub u32);

/// The fusion plan of one graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusionPlan {
    /// `group[node]`: the group each node belongs to.
    group: Vec<GroupId>,
    /// Nodes of each group, in graph order; groups in order of their first node.
    groups: Vec<Vec<NodeId>>,
    /// Every producer -> consumer decision that was refused, with the reason.
    refused: Vec<(NodeId, NodeId, NoFuse)>,
    /// Bytes of each node's outputs that reach memory.
    memory_bytes: Vec<u64>,
    /// Bytes of each node's outputs.
    output_bytes: Vec<u64>,
    /// Groups that hold a node other than an input: the kernels.
    kernels: usize,
}

impl FusionPlan {
    pub fn group_of(&self, node: NodeId) -> GroupId {
        self.group[node.index()]
    }

    /// Groups that hold a node other than a parameter or constant: the
    /// kernels the backend is expected to launch.
    pub fn num_groups(&self) -> usize {
        self.kernels
    }

    pub fn groups(&self) -> &[Vec<NodeId>] {
        &self.groups
    }

    /// Groups that hold more than one node.
    pub fn fused_groups(&self) -> impl Iterator<Item = (GroupId, &[NodeId])> {
        self.groups.iter().enumerate().filter(|(_, g)| g.len() > 1).map(|(i, g)| (GroupId(i as u32), g.as_slice()))
    }

    pub fn refused(&self) -> &[(NodeId, NodeId, NoFuse)] {
        &self.refused
    }

    /// Whether `node`'s outputs are written to memory.
    pub fn reaches_memory(&self, node: NodeId) -> bool {
        self.memory_bytes[node.index()] > 0 || self.output_bytes[node.index()] == 0
    }

    /// Bytes of intermediate values written to memory (graph outputs and
    /// values read across groups; parameters and constants not counted).
    pub fn bytes_to_memory(&self) -> u64 {
        self.memory_bytes.iter().sum()
    }

    /// Bytes of values that stay inside a fused kernel.
    pub fn bytes_kept_on_chip(&self) -> u64 {
        self.output_bytes.iter().zip(&self.memory_bytes).map(|(o, m)| o - m).sum()
    }
}

fn bytes(t: &TensorType) -> u64 {
    (t.shape.num_elements() as u64).saturating_mul(t.dtype.size_in_bytes() as u64)
}

/// Whether producer `p` may join the group `target` of its consumer `c`, given
/// the current assignment.
pub fn can_fuse(
    g: &Graph,
    users: &[Vec<NodeId>],
    group: &[GroupId],
    is_output: &[bool],
    p: NodeId,
    c: NodeId,
) -> Result<(), NoFuse> {
    let (pk, ck) = (kind(&g.node(p).op), kind(&g.node(c).op));
    match pk {
        FusionKind::Input => return Err(NoFuse::Input),
        FusionKind::Opaque => return Err(NoFuse::Opaque { op: g.node(p).op.name() }),
        FusionKind::Reduction => return Err(NoFuse::ReductionResult),
        FusionKind::Elementwise | FusionKind::Movement | FusionKind::Matmul => {}
    }
    match ck {
        FusionKind::Opaque | FusionKind::Input => return Err(NoFuse::Opaque { op: g.node(c).op.name() }),
        FusionKind::Matmul => return Err(NoFuse::MatmulOperand),
        FusionKind::Elementwise | FusionKind::Movement | FusionKind::Reduction => {}
    }
    if pk == FusionKind::Matmul && ck != FusionKind::Elementwise {
        return Err(NoFuse::MatmulIntoNonElementwise);
    }
    let target = group[c.index()];
    let outside: Vec<NodeId> = users[p.index()].iter().copied().filter(|u| group[u.index()] != target).collect();
    if outside.is_empty() && !is_output[p.index()] {
        return Ok(());
    }
    if pk != FusionKind::Elementwise {
        return Err(NoFuse::WouldDuplicate { other_users: outside.len() });
    }
    // Multi-output fusion: `p` is computed in the group and also written out
    // for its other users, unless one of them leads back into the group.
    let last = (0..group.len()).rev().find(|&i| group[i] == target).unwrap_or(0);
    for &u in &outside {
        if reaches_group(users, group, target, u, last) {
            return Err(NoFuse::CreatesCycle { via: u });
        }
    }
    Ok(())
}

/// Whether a path of users from `from` reaches a node of `target` (nodes after
/// `last`, the group's last node, cannot).
fn reaches_group(users: &[Vec<NodeId>], group: &[GroupId], target: GroupId, from: NodeId, last: usize) -> bool {
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![from];
    while let Some(n) = stack.pop() {
        if n.index() > last || !seen.insert(n) {
            continue;
        }
        if group[n.index()] == target {
            return true;
        }
        stack.extend(users[n.index()].iter().copied());
    }
    false
}

/// Plans fusion groups for `g`: consumers are visited last to first, and each
/// operand's producer joins the consumer's group when [`can_fuse`] allows.
pub fn plan_fusion(g: &Graph) -> FusionPlan {
    let n = g.len();
    let mut users: Vec<Vec<NodeId>> = vec![Vec::new(); n];
    for (id, node) in g.nodes() {
        for v in node.op.inputs() {
            if users[v.node.index()].last() != Some(&id) {
                users[v.node.index()].push(id);
            }
        }
    }
    let mut is_output = vec![false; n];
    for v in g.outputs() {
        is_output[v.node.index()] = true;
    }
    let mut group: Vec<GroupId> = (0..n as u32).map(GroupId).collect();
    let mut refused = Vec::new();
    for ci in (0..n).rev() {
        let c = NodeId::from_index(ci);
        let mut producers: Vec<NodeId> = g.node(c).op.inputs().iter().map(|v| v.node).collect();
        producers.sort();
        producers.dedup();
        for p in producers.into_iter().rev() {
            if group[p.index()] == group[ci] {
                continue;
            }
            // Only producers still alone are considered: each joins one group.
            if group[p.index()] != GroupId(p.index() as u32) {
                continue;
            }
            match can_fuse(g, &users, &group, &is_output, p, c) {
                Ok(()) => group[p.index()] = group[ci],
                Err(why) => refused.push((p, c, why)),
            }
        }
    }
    // Renumber groups densely in order of first node.
    let mut dense: std::collections::HashMap<GroupId, GroupId> = std::collections::HashMap::new();
    let mut groups: Vec<Vec<NodeId>> = Vec::new();
    for (i, g) in group.iter_mut().enumerate().take(n) {
        let next = GroupId(dense.len() as u32);
        let d = *dense.entry(*g).or_insert(next);
        if d.0 as usize == groups.len() {
            groups.push(Vec::new());
        }
        groups[d.0 as usize].push(NodeId::from_index(i));
        *g = d;
    }
    let mut memory_bytes = vec![0u64; n];
    let mut output_bytes = vec![0u64; n];
    for (id, node) in g.nodes() {
        let b: u64 = node.outputs.iter().map(bytes).sum();
        let k = kind(&node.op);
        output_bytes[id.index()] = if k == FusionKind::Input { 0 } else { b };
        let crosses = users[id.index()].iter().any(|u| group[u.index()] != group[id.index()]);
        // Reshapes and barriers are free views; their input's bytes are what
        // reaches memory.
        let view = matches!(node.op, Op::Reshape { .. } | Op::Whole { .. } | Op::OptimizationBarrier { .. });
        if k != FusionKind::Input && !view && (crosses || is_output[id.index()]) {
            memory_bytes[id.index()] = b;
        }
        if view {
            output_bytes[id.index()] = 0;
        }
    }
    let kernels =
        groups.iter().filter(|members| members.iter().any(|&m| kind(&g.node(m).op) != FusionKind::Input)).count();
    FusionPlan { group, groups, refused, memory_bytes, output_bytes, kernels }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DType, DotDims, ReduceOp, UnaryOp};

    #[test]
    fn elementwise_chain_into_reduction_is_one_group() {
        // sum(exp(a) * b): one input fusion; exp and mul never reach memory.
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [8, 4]);
        let a = g.parameter(t.clone());
        let b = g.parameter(t);
        let e = g.value(Op::Unary { op: UnaryOp::Exp, input: a }).unwrap();
        let m = g.value(Op::Binary { op: BinaryOp::Mul, lhs: e, rhs: b }).unwrap();
        let r = g.value(Op::Reduce { op: ReduceOp::Sum, input: m, axes: vec![1] }).unwrap();
        g.set_outputs(vec![r]).unwrap();
        let plan = plan_fusion(&g);
        assert_eq!(plan.group_of(e.node), plan.group_of(r.node));
        assert_eq!(plan.group_of(m.node), plan.group_of(r.node));
        assert!(!plan.reaches_memory(e.node));
        assert_eq!(plan.bytes_to_memory(), 8 * 4);
        assert_eq!(plan.bytes_kept_on_chip(), 2 * 8 * 4 * 4);
        assert!(plan.refused().iter().any(|(p, _, why)| p.index() == 0 && *why == NoFuse::Input));
    }

    #[test]
    fn matmul_takes_an_epilogue_but_not_a_prologue() {
        let mut g = Graph::new();
        let a = g.parameter(TensorType::new(DType::F32, [4, 3]));
        let w = g.parameter(TensorType::new(DType::F32, [3, 5]));
        let na = g.value(Op::Unary { op: UnaryOp::Neg, input: a }).unwrap();
        let d = g.value(Op::DotGeneral { lhs: na, rhs: w, dims: DotDims::matmul() }).unwrap();
        let y = g.value(Op::Unary { op: UnaryOp::Tanh, input: d }).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let plan = plan_fusion(&g);
        assert_eq!(plan.group_of(d.node), plan.group_of(y.node));
        assert_ne!(plan.group_of(na.node), plan.group_of(d.node));
        assert!(plan.refused().contains(&(na.node, d.node, NoFuse::MatmulOperand)));
    }

    #[test]
    fn shared_broadcast_would_duplicate_and_shared_elementwise_may_cycle() {
        // e = exp(a); r = sum(e); s = e * bcast(r): e has users in two groups,
        // and the reduction's group leads back to e's consumer.
        let mut g = Graph::new();
        let a = g.parameter(TensorType::new(DType::F32, [4, 3]));
        let e = g.value(Op::Unary { op: UnaryOp::Exp, input: a }).unwrap();
        let r = g.value(Op::Reduce { op: ReduceOp::Max, input: e, axes: vec![1] }).unwrap();
        let b =
            g.value(Op::BroadcastInDim { input: r, shape: crate::ir::Shape::new(vec![4, 3]), dims: vec![0] }).unwrap();
        let s = g.value(Op::Binary { op: BinaryOp::Sub, lhs: e, rhs: b }).unwrap();
        let s2 = g.value(Op::Binary { op: BinaryOp::Mul, lhs: b, rhs: b }).unwrap();
        g.set_outputs(vec![s, s2]).unwrap();
        let plan = plan_fusion(&g);
        // b has users in s's and s2's groups.
        assert!(plan.refused().iter().any(|(p, _, why)| *p == b.node && matches!(why, NoFuse::WouldDuplicate { .. })));
        // e is read by the reduction (its own group) and by s, whose group the
        // reduction reaches: fusing e into s's group would make a cycle.
        assert!(plan.refused().iter().any(|(p, _, why)| *p == e.node && matches!(why, NoFuse::CreatesCycle { .. })));
        assert!(plan.refused().iter().any(|(p, _, why)| *p == r.node && *why == NoFuse::ReductionResult));
    }
}
