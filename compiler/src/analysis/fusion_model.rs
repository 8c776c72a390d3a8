//! Fusion models: which values reach memory when XLA compiles kiln's
//! graph. [`Materialization`] is the one question liveness asks;
//! [`EveryNodeAKernel`] is the upper bound, [`XlaCpuFusion`] and
//! `XlaGpuFusion` (`xla_gpu.rs`) approximate what XLA's CPU and CUDA
//! backends fuse, and [`fusion_for`] picks one by the lowering target.
//!
//! Invariants: pure answers; a fused value has no buffer and is read where
//! its consumers execute; parameters, program outputs and barrier operands
//! are always materialized, whatever a model answers.

use crate::ir::{BinaryOp, Graph, NodeId, Op};

/// Which values reach memory: the one question liveness asks of a fusion plan.
///
/// `materialized(g, n)` is false when every output of node `n` lives only
/// inside the kernels of its consumers (a fused intermediate). Parameters,
/// program outputs and operands of an `optimization_barrier` are always
/// materialized, whatever the answer. `Sync`: the remat pass measures its
/// candidates on several threads.
pub trait Materialization: Sync {
    fn materialized(&self, g: &Graph, users: &[Vec<NodeId>], n: NodeId) -> bool;

    /// The answer for every node at once (`live[i]`: node `i` is executed;
    /// `users` lists live users only). A fusion model whose answer for a
    /// node depends on its neighbours' answers (how many kernels would
    /// recompute a fused value, [`XlaGpuFusion`]) decides here; the default
    /// asks [`Materialization::materialized`] node by node.
    fn plan(&self, g: &Graph, users: &[Vec<NodeId>], live: &[bool]) -> Vec<bool> {
        (0..g.len()).map(|i| live[i] && self.materialized(g, users, NodeId::from_index(i))).collect()
    }
    /// Whether a kernel's result may take the buffer of an operand that dies
    /// in it when the kernel reads that operand only through fused
    /// producers (true: XLA CPU's loop fusions do). XLA's GPU backend shares
    /// only operands the kernel reads directly: its reductions fused with
    /// elementwise siblings (the loss's gradient over the logits) never share.
    fn shares_through_fusion(&self) -> bool {
        true
    }

    /// Workspace bytes the backend's kernel for node `n` (materialized)
    /// allocates for its own run: a temporary live at that kernel only.
    fn scratch_bytes(&self, _g: &Graph, _n: NodeId) -> u64 {
        0
    }
}

/// The fusion model of the backend `target` compiles for: what the remat
/// pass, `kiln compile --memory-limit` and `kiln profile --max-batch` judge
/// a step's memory by.
pub fn fusion_for(target: crate::LowerTarget) -> &'static dyn Materialization {
    match target {
        crate::LowerTarget::Cpu => &XlaCpuFusion,
        crate::LowerTarget::Cuda => &super::XlaGpuFusion,
    }
}

/// Every node is its own kernel: every value reaches memory. The upper bound,
/// and the default until the optimizer's fusion plan is connected.
#[derive(Clone, Copy, Debug, Default)]
pub struct EveryNodeAKernel;

impl Materialization for EveryNodeAKernel {
    fn materialized(&self, _g: &Graph, _users: &[Vec<NodeId>], _n: NodeId) -> bool {
        true
    }
}

/// An approximation of XLA's loop fusion on its CPU and GPU backends, for
/// predicting the memory of the program XLA compiles from kiln's graph.
///
/// A node is fused into its users (no buffer) when it is a loop-fusible op
/// (elementwise, broadcast, transpose, slice, concatenate, pad, iota,
/// constant), every user can absorb a producer (the same ops, reshapes and
/// reductions), and fusing does not duplicate expensive work: an expensive op
/// (transcendental, divide, power, remainder) fuses only into a single user,
/// because XLA will not recompute it once per consumer.
#[derive(Clone, Copy, Debug, Default)]
pub struct XlaCpuFusion;

impl Materialization for XlaCpuFusion {
    fn materialized(&self, g: &Graph, users: &[Vec<NodeId>], n: NodeId) -> bool {
        let op = &g.node(n).op;
        let us = &users[n.index()];
        if !loop_fusible(op) || us.is_empty() {
            return true;
        }
        if !us.iter().all(|&u| absorbs(&g.node(u).op)) {
            return true;
        }
        us.len() > 1 && expensive(op)
    }
}

/// Ops XLA emits as one loop over the output elements.
pub fn loop_fusible(op: &Op) -> bool {
    op.props().loop_fusible
}

/// Ops that can take a loop-fusible producer into their own kernel.
fn absorbs(op: &Op) -> bool {
    match op {
        Op::Reduce { .. } => true,
        Op::Constant { .. } | Op::Iota { .. } => false,
        other => loop_fusible(other),
    }
}

/// Ops XLA does not duplicate into several consumers.
fn expensive(op: &Op) -> bool {
    match op {
        Op::Unary { op, .. } => crate::cost::is_transcendental_unary(*op),
        Op::Binary { op, .. } => match op {
            BinaryOp::Div | BinaryOp::Pow | BinaryOp::Rem => true,
            BinaryOp::Add
            | BinaryOp::Sub
            | BinaryOp::Mul
            | BinaryOp::Max
            | BinaryOp::Min
            | BinaryOp::And
            | BinaryOp::Or
            | BinaryOp::Xor
            | BinaryOp::ShiftRightLogical => false,
        },
        _ => false,
    }
}
