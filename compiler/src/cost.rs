//! The cost model: FLOPs and bytes of each node, whole-graph totals, and a
//! roofline estimate of run time on a [`Target`].
//!
//! Where it runs: after optimization, on the graph about to be lowered (the
//! CLI's `kiln compile` report), and on the recorded step graph for MFU
//! (`model FLOPs / step time / peak FLOP/s`). Extraction, fusion and remat
//! will ask it too. It is pure arithmetic over the shapes and dtypes stored on
//! the nodes: nothing is inferred again and nothing is run.
//!
//! What a node costs, as a standalone kernel that reads its operands from
//! memory and writes its results (no fusion yet: the byte counts are what an
//! unfused program moves, an upper bound on what XLA's fused one does):
//! - `dot_general`: `2 × batch × M × N × K` FLOPs (one multiply and one add per
//!   term), with batch, M (lhs free), N (rhs free) and K (contracting) the
//!   products of their dimensions as [`DotDims`] names them.
//! - Elementwise ops (unary, binary, compare, select, clamp, convert): one FLOP
//!   per output element. Transcendental ops (`exp`, `log`, `log1p`, `expm1`,
//!   `tanh`, `logistic`, `sqrt`, `rsqrt`, `sin`, `cos`, `erf`, `pow`) count one
//!   FLOP each as well, and are also counted in `transcendentals`, because on
//!   a GPU they run on the special-function units at a fraction of FMA
//!   throughput; a caller that weighs them differently can.
//! - `reduce`: one FLOP per input element.
//! - `scatter_add`: one FLOP (the add) per update element.
//! - `rng_bit_generator`: one op per generated element. The real Threefry and
//!   Philox rounds are tens of integer ops per word; a step draws few enough
//!   bits that the difference does not matter for a roofline.
//! - Data movement (`iota`, `broadcast_in_dim`, `transpose`, `slice`,
//!   `dynamic_slice`, `dynamic_update_slice`, `concatenate`, `pad`, `gather`):
//!   no FLOPs, the bytes they touch. Slices and gathers read only what they
//!   select; `dynamic_update_slice` and `scatter_add` update in place, as XLA
//!   does when the operand's buffer can be reused, so they move the update's
//!   bytes, not the whole operand's.
//! - `reshape` and `optimization_barrier`: nothing. A reshape of a dense
//!   row-major array is a bitcast in XLA and a barrier passes its operands
//!   through; charging bytes for them would count copies that never happen.
//! - `all_reduce`: no FLOPs, its operand's bytes read and result written, and
//!   the operand's bytes as `collective_bytes`, which the roofline charges at
//!   the interconnect's bandwidth.
//! - `parameter` and `constant`: nothing. Their bytes are charged to the nodes
//!   that read them.
//!
//! Whole-graph totals count only the nodes the outputs reach (dead code is
//! not compiled, so it costs nothing). Counts are exact integers and saturate
//! at `u64::MAX` instead of wrapping on absurd shapes.

use std::collections::BTreeMap;
use std::fmt;

use crate::ir::{BinaryOp, DType, DotDims, Graph, NodeId, Op, TensorType, UnaryOp};
pub use crate::target::PeakClass;
use crate::target::Target;

/// The cost of one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeCost {
    /// Arithmetic operations, transcendentals included.
    pub flops: u64,
    /// How many of `flops` are transcendental functions.
    pub transcendentals: u64,
    /// Bytes of operands read.
    pub bytes_read: u64,
    /// Bytes of results written.
    pub bytes_written: u64,
    /// Bytes sent across replicas (collectives only).
    pub collective_bytes: u64,
    pub peak: PeakClass,
}

impl NodeCost {
    fn free() -> NodeCost {
        NodeCost {
            flops: 0,
            transcendentals: 0,
            bytes_read: 0,
            bytes_written: 0,
            collective_bytes: 0,
            peak: PeakClass::Vector,
        }
    }

    fn moves(bytes_read: u64, bytes_written: u64) -> NodeCost {
        NodeCost { bytes_read, bytes_written, ..NodeCost::free() }
    }

    /// Bytes read plus bytes written.
    pub fn bytes(&self) -> u64 {
        self.bytes_read.saturating_add(self.bytes_written)
    }
}

/// Sums of node costs over a set of nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Number of nodes summed.
    pub nodes: usize,
    pub flops: u64,
    pub transcendentals: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub collective_bytes: u64,
}

impl Totals {
    fn add(&mut self, c: &NodeCost) {
        self.nodes += 1;
        self.flops = self.flops.saturating_add(c.flops);
        self.transcendentals = self.transcendentals.saturating_add(c.transcendentals);
        self.bytes_read = self.bytes_read.saturating_add(c.bytes_read);
        self.bytes_written = self.bytes_written.saturating_add(c.bytes_written);
        self.collective_bytes = self.collective_bytes.saturating_add(c.collective_bytes);
    }

    /// Bytes read plus bytes written.
    pub fn bytes(&self) -> u64 {
        self.bytes_read.saturating_add(self.bytes_written)
    }
}

/// The cost of the live part of a graph.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphCost {
    pub total: Totals,
    /// Per op kind, keyed by the op's name in the text form (`dot_general`,
    /// `add`, `reduce`, ...), in name order so that reports are deterministic.
    pub by_op: BTreeMap<&'static str, Totals>,
}

/// The cost of node `id` of `g`. Panics on an id of another graph (as
/// [`Graph::node`] does).
pub fn node_cost(g: &Graph, id: NodeId) -> NodeCost {
    let node = g.node(id);
    let operands: Vec<TensorType> = node.op.inputs().iter().map(|&v| g.ty(v).clone()).collect();
    op_cost(&node.op, &operands, &node.outputs)
}

/// The cost of `op` given its operands' types ([`Op::inputs`] order) and its
/// output types: no graph needed (extraction from the e-graph uses this).
pub fn op_cost(op: &Op, operands: &[TensorType], outputs: &[TensorType]) -> NodeCost {
    let inputs = op.inputs();
    // Every value asked for is one of `inputs`; equal values have equal types.
    let ty = |v: crate::ir::ValueId| -> &TensorType {
        &operands[inputs.iter().position(|&x| x == v).unwrap_or(0).min(operands.len().saturating_sub(1))]
    };
    let sum_bytes =
        |values: &[crate::ir::ValueId]| values.iter().fold(0u64, |acc, &v| acc.saturating_add(bytes(ty(v))));
    let written = outputs.iter().fold(0u64, |acc, t| acc.saturating_add(bytes(t)));
    let read_all = || operands.iter().fold(0u64, |acc, t| acc.saturating_add(bytes(t)));
    let first_out = outputs.first();
    let out_elems = first_out.map_or(0, elements);
    let out_bytes = first_out.map_or(0, bytes);
    let elementwise = |transcendental: bool| NodeCost {
        flops: out_elems,
        transcendentals: if transcendental { out_elems } else { 0 },
        bytes_read: read_all(),
        bytes_written: written,
        ..NodeCost::free()
    };
    match op {
        Op::Parameter { .. } | Op::Constant { .. } => NodeCost::free(),
        Op::Iota { .. } => NodeCost::moves(0, written),
        Op::Unary { op, input: _ } => elementwise(is_transcendental_unary(*op)),
        Op::Binary { op, lhs: _, rhs: _ } => elementwise(is_transcendental_binary(*op)),
        Op::Compare { .. } | Op::Select { .. } | Op::Clamp { .. } | Op::Convert { .. } => elementwise(false),
        Op::BroadcastInDim { .. } | Op::Transpose { .. } | Op::Concatenate { .. } | Op::Pad { .. } => {
            NodeCost::moves(read_all(), written)
        }
        // A placement is a copy over the host link (an async copy engine), no
        // arithmetic and no device kernel.
        // A sharding constraint: no kernel of its own (the gather it asks for
        // in a partitioned program is communication, not priced here).
        Op::Reshape { .. }
        | Op::OptimizationBarrier { .. }
        | Op::Place { .. }
        | Op::HostCopy { .. }
        | Op::Whole { .. } => NodeCost::free(),
        // Reads the selected elements only: as many as it writes.
        Op::Slice { .. } => NodeCost::moves(out_bytes, written),
        Op::DynamicSlice { input: _, starts, sizes: _ } => {
            NodeCost::moves(out_bytes.saturating_add(sum_bytes(starts)), written)
        }
        Op::DynamicUpdateSlice { input: _, update, starts } => {
            let update = bytes(ty(*update));
            NodeCost::moves(update.saturating_add(sum_bytes(starts)), update)
        }
        Op::Gather { operand: _, indices, axis: _ } => {
            NodeCost::moves(out_bytes.saturating_add(bytes(ty(*indices))), written)
        }
        Op::ScatterAdd { operand: _, indices, updates, axis: _ } => {
            let u = ty(*updates);
            // Reads each update and the operand row it lands on, writes that row.
            let read = bytes(u).saturating_mul(2).saturating_add(bytes(ty(*indices)));
            NodeCost { flops: elements(u), bytes_read: read, bytes_written: bytes(u), ..NodeCost::free() }
        }
        Op::Reduce { op: _, input, axes: _ } => {
            NodeCost { flops: elements(ty(*input)), bytes_read: read_all(), bytes_written: written, ..NodeCost::free() }
        }
        Op::DotGeneral { lhs, rhs, dims } => {
            let (l, r) = (ty(*lhs), ty(*rhs));
            NodeCost {
                flops: dot_flops(l, r, dims),
                bytes_read: read_all(),
                bytes_written: written,
                peak: match l.dtype {
                    DType::BF16 | DType::F16 => PeakClass::Bf16Matmul,
                    DType::F32 => PeakClass::Tf32Matmul,
                    DType::Pred
                    | DType::I8
                    | DType::I32
                    | DType::I64
                    | DType::U8
                    | DType::U32
                    | DType::U64
                    | DType::F64 => PeakClass::Vector,
                },
                ..NodeCost::free()
            }
        }
        Op::RngBitGenerator { algorithm: _, state: _, ty } => {
            NodeCost { flops: elements(ty), bytes_read: read_all(), bytes_written: written, ..NodeCost::free() }
        }
        Op::AllReduce { op: _, input } => {
            NodeCost { collective_bytes: bytes(ty(*input)), ..NodeCost::moves(read_all(), written) }
        }
        // Fused attention reads its operands and writes its results once: the
        // [b, h, t, s] scores stay on chip. The forward runs two matmuls of
        // 2·b·h·t·s·d flops each, the backward five (scores recomputed, dv, dp,
        // dq, dk); a causal mask skips half of them.
        Op::Attention { q, v, attrs, .. } | Op::AttentionGrad { q, v, attrs, .. } => {
            let (qt, vt) = (ty(*q), ty(*v));
            let (qd, vd) = (qt.shape.dims(), vt.shape.dims());
            let pairs = (qd[0] * qd[1] * qd[2] * vd[2]) as u64 / if attrs.causal { 2 } else { 1 };
            let matmuls = if matches!(op, Op::Attention { .. }) { 2u64 } else { 5 };
            NodeCost {
                flops: (matmuls * 2 * qd[3] as u64).saturating_mul(pairs),
                transcendentals: pairs,
                bytes_read: read_all(),
                bytes_written: written,
                peak: if matches!(qt.dtype, DType::BF16 | DType::F16) {
                    PeakClass::Bf16Matmul
                } else {
                    PeakClass::Tf32Matmul
                },
                ..NodeCost::free()
            }
        }
        // About 8 flops per element each way (moments, normalise, affine; the
        // backward's two row means), one rsqrt per row; operands read once.
        // Forward: one [n, d] x [d, vocab] matmul (2·n·d·vocab) and a few flops
        // and one exp per logit; backward: the logits again plus two matmuls.
        // Only operands and results touch memory: the logits stay in blocks.
        // The fused op: the forward's matmul and the backward's two, with no
        // recomputation (the logits are made once).
        Op::LmHeadCrossEntropy { h, w, .. }
        | Op::LmHeadCrossEntropyGrad { h, w, .. }
        | Op::LmHeadCrossEntropyFused { h, w, .. } => {
            let (ht, wt) = (ty(*h), ty(*w));
            let logits = (ht.shape.dims()[0] * wt.shape.dims()[0]) as u64;
            let matmuls = match op {
                Op::LmHeadCrossEntropy { .. } => 1u64,
                _ => 3,
            };
            NodeCost {
                flops: (matmuls * 2 * ht.shape.dims()[1] as u64 + 4).saturating_mul(logits),
                transcendentals: logits,
                bytes_read: read_all(),
                bytes_written: written,
                peak: if matches!(ht.dtype, DType::BF16 | DType::F16) {
                    PeakClass::Bf16Matmul
                } else {
                    PeakClass::Tf32Matmul
                },
                ..NodeCost::free()
            }
        }
        Op::LayerNorm { x, .. } | Op::LayerNormGrad { x, .. } | Op::RmsNorm { x, .. } | Op::RmsNormGrad { x, .. } => {
            let t = ty(*x);
            let rows = t.shape.dims()[..t.shape.rank().saturating_sub(1)].iter().product::<usize>() as u64;
            NodeCost {
                flops: 8 * elements(t),
                transcendentals: rows,
                bytes_read: read_all(),
                bytes_written: written,
                ..NodeCost::free()
            }
        }
    }
}

/// Totals and the per-op breakdown over the nodes `g`'s outputs reach.
pub fn graph_cost(g: &Graph) -> GraphCost {
    let live = crate::lower::live::live_nodes(g);
    let mut cost = GraphCost::default();
    for (id, node) in g.nodes() {
        if !live[id.index()] {
            continue;
        }
        let c = node_cost(g, id);
        cost.total.add(&c);
        cost.by_op.entry(node.op.name()).or_default().add(&c);
    }
    cost
}

/// FLOPs of the live part of `g`, for MFU: `graph_flops(g) / step_seconds /
/// peak_flops_per_s`. Called on the step graph before rematerialization this
/// is the model's FLOPs; after remat it includes the recomputation (hardware
/// FLOPs).
pub fn graph_flops(g: &Graph) -> f64 {
    graph_cost(g).total.flops as f64
}

/// A roofline estimate of a graph's run time on one target.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    /// Sum over nodes of the slowest of their compute, memory and collective times.
    pub seconds: f64,
    /// Time of the nodes whose arithmetic bounds them.
    pub compute_bound_seconds: f64,
    /// Time of the nodes whose memory traffic bounds them.
    pub memory_bound_seconds: f64,
    /// Time of the nodes whose interconnect traffic bounds them.
    pub collective_bound_seconds: f64,
}

/// Roofline estimate of `g` on `target`: each live node takes the longest of
/// `flops / peak`, `bytes / mem_bytes_per_s` and `collective_bytes /
/// interconnect_bytes_per_s`, and nodes run one after another. Since the node
/// costs are unfused, this over-estimates memory-bound programs that XLA fuses;
/// kernel launch and host overheads are not modelled.
pub fn estimate(g: &Graph, target: &Target) -> Estimate {
    let live = crate::lower::live::live_nodes(g);
    let mut e = Estimate::default();
    for (id, _) in g.nodes() {
        if !live[id.index()] {
            continue;
        }
        let c = node_cost(g, id);
        let compute = c.flops as f64 / target.peak_flops_per_s(c.peak);
        let memory = c.bytes() as f64 / target.mem_bytes_per_s;
        let collective = c.collective_bytes as f64 / target.interconnect_bytes_per_s;
        // Ties go to compute, then memory: a node that costs nothing adds 0 anywhere.
        if collective > compute && collective > memory {
            e.collective_bound_seconds += collective;
        } else if memory > compute {
            e.memory_bound_seconds += memory;
        } else {
            e.compute_bound_seconds += compute;
        }
    }
    e.seconds = e.compute_bound_seconds + e.memory_bound_seconds + e.collective_bound_seconds;
    e
}

/// [`estimate`]'s total in seconds.
pub fn estimate_seconds(g: &Graph, target: &Target) -> f64 {
    estimate(g, target).seconds
}

/// A table: one row per op kind, then the total.
impl fmt::Display for GraphCost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<22} {:>6} {:>14} {:>14} {:>14} {:>14}",
            "op", "nodes", "flops", "bytes_read", "bytes_written", "collective"
        )?;
        let rows = self.by_op.iter().map(|(name, t)| (*name, t)).chain(std::iter::once(("total", &self.total)));
        for (name, t) in rows {
            writeln!(
                f,
                "{name:<22} {:>6} {:>14} {:>14} {:>14} {:>14}",
                t.nodes, t.flops, t.bytes_read, t.bytes_written, t.collective_bytes
            )?;
        }
        Ok(())
    }
}

fn elements(t: &TensorType) -> u64 {
    t.shape.dims().iter().fold(1u64, |acc, &d| acc.saturating_mul(d as u64))
}

fn bytes(t: &TensorType) -> u64 {
    elements(t).saturating_mul(t.dtype.size_in_bytes() as u64)
}

/// `2 × batch × M × N × K`: every output element (batch × M × N of them) is a
/// sum of K products.
fn dot_flops(l: &TensorType, r: &TensorType, dims: &DotDims) -> u64 {
    let product = |t: &TensorType, pick: &mut dyn FnMut(usize) -> bool| {
        (0..t.shape.rank()).filter(|&d| pick(d)).fold(1u64, |acc, d| acc.saturating_mul(t.shape.dims()[d] as u64))
    };
    let batch = product(l, &mut |d| dims.lhs_batch.contains(&d));
    let k = product(l, &mut |d| dims.lhs_contract.contains(&d));
    let m = product(l, &mut |d| !dims.lhs_batch.contains(&d) && !dims.lhs_contract.contains(&d));
    let n = product(r, &mut |d| !dims.rhs_batch.contains(&d) && !dims.rhs_contract.contains(&d));
    [batch, m, n, k].into_iter().fold(2u64, u64::saturating_mul)
}

pub(crate) fn is_transcendental_unary(op: UnaryOp) -> bool {
    match op {
        UnaryOp::Exp
        | UnaryOp::Log
        | UnaryOp::Log1p
        | UnaryOp::Expm1
        | UnaryOp::Tanh
        | UnaryOp::Logistic
        | UnaryOp::Sqrt
        | UnaryOp::Rsqrt
        | UnaryOp::Sin
        | UnaryOp::Cos
        | UnaryOp::Erf => true,
        UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Sign | UnaryOp::Not => false,
    }
}

fn is_transcendental_binary(op: BinaryOp) -> bool {
    match op {
        BinaryOp::Pow => true,
        BinaryOp::Add
        | BinaryOp::Sub
        | BinaryOp::Mul
        | BinaryOp::Div
        | BinaryOp::Max
        | BinaryOp::Min
        | BinaryOp::Rem
        | BinaryOp::And
        | BinaryOp::Or
        | BinaryOp::Xor
        | BinaryOp::ShiftRightLogical => false,
    }
}
