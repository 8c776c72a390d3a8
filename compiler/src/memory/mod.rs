//! Memory planning: liveness of a step graph's buffers in an execution order,
//! a peak-memory model, and the rematerialization pass that trades recomputation
//! for memory under a budget.
//!
//! Where it runs: remat is the last pass of [`crate::pipeline::optimize`] when
//! `memory_limit_bytes` (or a fraction of the activation memory) is set; liveness
//! and peak are analyses that the CLI (`kiln compile --memory-limit`,
//! `kiln profile --max-batch`) and the remat strategies call on any graph.
//!
//! Invariants:
//! - The execution order is the graph's insertion order over the nodes the
//!   outputs reach (a topological order; dead nodes are never executed).
//! - Which values get a buffer of their own is decided by one
//!   [`Materialization`] answer per value. A value that is not materialized
//!   (fused into its consumers) has no buffer, and the reads it makes happen
//!   where its consumers execute. [`EveryNodeAKernel`] is the default; the
//!   optimizer's fusion plan answers the same question once it exists;
//!   [`XlaCpuFusion`] and [`XlaGpuFusion`] approximate what XLA's CPU and CUDA
//!   backends' own fusion does to the graph kiln hands them (what the model is
//!   checked against), and [`fusion_for`] picks one by the lowering target.
//! - A kernel's workspace (cuBLAS's, cuDNN's) is a `Scratch` buffer live at
//!   that kernel only; it counts as a temporary and is never a remat candidate.
//! - `reshape` and `optimization_barrier` never allocate: their results alias
//!   their operands' buffers (a bitcast, a pass-through).
//! - Everything here is pure: graph in, numbers or a new graph out.

mod blocks;
mod exact;
mod gpu;
mod host_copies;
mod kernel_time;
mod liveness;
mod offload;
mod peak;
mod pin;
mod remat;
mod sequence;
mod siblings;
mod twins;

pub use exact::Exact;
pub use gpu::XlaGpuFusion;
pub use host_copies::{copies, HostCopies, HOST_COPY_TRIP_SECONDS};
pub use kernel_time::{kernel_seconds, kernel_starts, kernel_times};
pub use liveness::{liveness, Allocation, Buffer, BufferKind, Liveness};
pub use offload::HostOffload;
pub use peak::{peak_memory, PeakMemory};
pub use remat::{
    activation_budget_bytes, keeps_values_for_later, rematerialize, Greedy, LeafGuards, Off, RecomputeCost,
    RematBudget, RematChoice, RematOptions, RematPlan, RematStrategy,
};
pub use sequence::{sequence_backward, sequence_for};

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
        crate::LowerTarget::Cuda => &XlaGpuFusion,
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
pub(crate) fn loop_fusible(op: &Op) -> bool {
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
