//! Step time by kernels: the roofline over the kernels a fusion model makes
//! of a graph, not over its nodes.
//!
//! [`crate::cost::estimate`] prices every node as a kernel of its own, so
//! elementwise work costs its operands' and result's bytes even where XLA
//! fuses it away, and [`super::remat`]'s first cost of a recomputation
//! prices fusible work at its arithmetic alone, as if it always fused into
//! its reader. Neither is what a recomputed chain costs on a GPU: a clone
//! that feeds a GEMM (GELU's output for the weight gradient, a layer norm's
//! output, a bf16 weight copy) is written by a kernel of its own that reads
//! the chain's inputs, while one that feeds an elementwise kernel fuses into
//! it and costs that kernel its extra inputs' bytes. Measured on the H100
//! (`docs/memory-journal.md`, "What a plan's step time is made of"): a plan of 2.1%
//! extra FLOPs, almost all elementwise, cost 1.05 ms of kernel time, 5.2%.
//!
//! The model: each materialized node of a [`Liveness`] is a kernel; its
//! fused producers (the non-materialized nodes it reaches through its
//! operands) run inside it. A kernel takes the slower of its arithmetic (its
//! own and its fused producers' FLOPs at the target's peaks) and its memory
//! traffic (the buffers at the fused region's edge it reads, once each, and
//! what it writes) at the target's bandwidth, each at the share of the
//! target's peak the H100 trace showed ([`ACHIEVED_BANDWIDTH`],
//! [`ACHIEVED_GEMM`]), and no less than [`MIN_KERNEL_SECONDS`]. What a
//! kernel reads is the liveness's buffers (`Liveness::buffer_of`: reshapes
//! and barriers alias their operands'); parameters and materialized
//! constants are read, never run, and a constant the fusion model fuses is
//! part of its reader. Kernels run one after another. Absolute times are rough (one efficiency
//! for every shape, no overlap); what remat uses is the difference between
//! two graphs, where the kernels they share cancel.

use crate::cost;
use crate::ir::{Graph, NodeId, Op};
use crate::target::Target;
use crate::target::{
    ACHIEVED_ATTENTION_BACKWARD, ACHIEVED_ATTENTION_FORWARD, ACHIEVED_BANDWIDTH, ACHIEVED_GEMM, MIN_KERNEL_SECONDS,
};

use super::liveness::Liveness;

/// Seconds of `g`'s kernels as `l` (its liveness under a fusion model) makes
/// them, on `target`.
pub fn kernel_seconds(g: &Graph, l: &Liveness, target: &Target) -> f64 {
    kernel_times(g, l, target).iter().sum()
}

/// Seconds of the kernels at each position of `l`'s order (zero where no
/// kernel runs): when each kernel starts and ends, for scheduling copies
/// beside them.
pub fn kernel_times(g: &Graph, l: &Liveness, target: &Target) -> Vec<f64> {
    let mut walk = Walk::new(g.len());
    let mut at = vec![0.0; l.order.len()];
    for (id, node) in g.nodes() {
        if let (true, Some(p), true) = (l.materialized[id.index()], l.exec_pos[id.index()], runs(&node.op)) {
            at[p] += walk.kernel(g, l, id, target);
        }
    }
    at
}

/// When each position's kernel starts, by [`kernel_times`], and after the
/// last the step's end: position `p`'s kernel runs from `[p]` to `[p + 1]`.
pub fn kernel_starts(g: &Graph, l: &Liveness, target: &Target) -> Vec<f64> {
    let mut start = vec![0.0];
    for t in kernel_times(g, l, target) {
        start.push(start[start.len() - 1] + t);
    }
    start
}

/// Whether a materialized node is work of its own (not a view, an input, a
/// pass-through, or a copy to or from the host, which runs on the copy
/// engines beside the kernels).
fn runs(op: &Op) -> bool {
    !matches!(
        op,
        Op::Parameter { .. }
            | Op::Constant { .. }
            | Op::Reshape { .. }
            | Op::Whole { .. }
            | Op::OptimizationBarrier { .. }
            | Op::Place { .. }
            | Op::HostCopy { .. }
    )
}

/// Scratch for one kernel's walk over its fused region, reused across
/// kernels (`in_region` is stamped per kernel, so it is never cleared).
struct Walk {
    stamp: u32,
    in_region: Vec<u32>,
    /// Buffers the current kernel reads, each counted once.
    read: Vec<usize>,
    stack: Vec<NodeId>,
}

impl Walk {
    fn new(n: usize) -> Walk {
        Walk { stamp: 0, in_region: vec![0; n], read: Vec::new(), stack: Vec::new() }
    }

    fn kernel(&mut self, g: &Graph, l: &Liveness, k: NodeId, target: &Target) -> f64 {
        self.stamp += 1;
        let stamp = self.stamp;
        self.read.clear();
        self.stack.clear();
        self.stack.push(k);
        self.in_region[k.index()] = stamp;
        let node_k = g.node(k);
        let mut compute = 0.0;
        let mut bytes_read = 0u64;
        while let Some(m) = self.stack.pop() {
            let node = g.node(m);
            compute += achieved_compute_seconds(&node.op, &cost::node_cost(g, m), target);
            for u in node.op.inputs() {
                // A value with a buffer (views and barriers alias their
                // operands') is read from memory; one without is fused into
                // this kernel.
                if let Some(b) = l.buffer_of[u.node.index()][u.output as usize] {
                    if self.read.contains(&b) {
                        continue;
                    }
                    self.read.push(b);
                    // A slice or gather reads what it selects.
                    let bytes = match node.op {
                        Op::Slice { .. } | Op::DynamicSlice { .. } | Op::Gather { .. } => {
                            node.outputs[0].size_in_bytes() as u64
                        }
                        _ => l.buffers[b].bytes,
                    };
                    bytes_read = bytes_read.saturating_add(bytes);
                    continue;
                }
                let p = u.node;
                if self.in_region[p.index()] != stamp {
                    self.in_region[p.index()] = stamp;
                    self.stack.push(p);
                }
            }
        }
        // In-place updates move the update, not the whole operand.
        let traffic = match node_k.op {
            Op::DynamicUpdateSlice { .. } | Op::ScatterAdd { .. } => cost::node_cost(g, k).bytes(),
            _ => bytes_read.saturating_add(node_k.outputs.iter().map(|t| t.size_in_bytes() as u64).sum::<u64>()),
        };
        compute.max(traffic_seconds(traffic, target)).max(MIN_KERNEL_SECONDS)
    }
}

/// Seconds of the arithmetic `c` of a node running `op` at the rate the
/// target achieves for it: fused attention at its measured share of the
/// peak ([`ACHIEVED_ATTENTION_FORWARD`], [`ACHIEVED_ATTENTION_BACKWARD`]),
/// other GEMMs at [`ACHIEVED_GEMM`], vector work at the peak.
pub fn achieved_compute_seconds(op: &Op, c: &cost::NodeCost, target: &Target) -> f64 {
    let achieved = match (op, c.peak) {
        (Op::Attention { .. }, _) => ACHIEVED_ATTENTION_FORWARD,
        (Op::AttentionGrad { .. }, _) => ACHIEVED_ATTENTION_BACKWARD,
        (_, cost::PeakClass::Bf16Matmul | cost::PeakClass::Tf32Matmul) => ACHIEVED_GEMM,
        (_, cost::PeakClass::Vector) => 1.0,
    };
    c.flops as f64 / (target.peak_flops_per_s(c.peak) * achieved)
}

/// Seconds to move `bytes` at [`ACHIEVED_BANDWIDTH`] of the target's.
pub fn traffic_seconds(bytes: u64, target: &Target) -> f64 {
    bytes as f64 / (target.mem_bytes_per_s * ACHIEVED_BANDWIDTH)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{liveness, EveryNodeAKernel, Materialization, XlaCpuFusion};
    use crate::ir::{BinaryOp, DType, DotDims, Shape, TensorType, UnaryOp};

    const T: Target = Target::H100_SXM_MEASURED;
    const MIB4: f64 = (4 << 20) as f64;
    const BW: f64 = T.mem_bytes_per_s * ACHIEVED_BANDWIDTH;

    fn seconds(g: &Graph, fusion: &dyn Materialization) -> f64 {
        kernel_seconds(g, &liveness(g, fusion), &T)
    }

    /// `exp(p) + p` over a 4 MiB f32 parameter.
    fn exp_add() -> Graph {
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [1024, 1024]));
        let e = g.value(Op::Unary { op: UnaryOp::Exp, input: p }).unwrap();
        let s = g.value(Op::Binary { op: BinaryOp::Add, lhs: e, rhs: p }).unwrap();
        g.set_outputs(vec![s]).unwrap();
        g
    }

    #[test]
    fn a_fused_producer_adds_no_traffic_and_its_input_is_read_once() {
        let g = exp_add();
        // One kernel: reads p once (the exp and the add both read it), writes the sum.
        let fused = seconds(&g, &XlaCpuFusion);
        assert!((fused - 2.0 * MIB4 / BW).abs() < 1e-12, "{fused}");
        // Two kernels: exp reads p and writes e; the add reads e and p and writes.
        let apart = seconds(&g, &EveryNodeAKernel);
        assert!((apart - 5.0 * MIB4 / BW).abs() < 1e-12, "{apart}");
    }

    #[test]
    fn a_matmul_is_bound_by_arithmetic_and_a_tiny_kernel_by_the_floor() {
        let mut g = Graph::new();
        let t = TensorType::new(DType::BF16, [2048, 2048]);
        let a = g.parameter(t.clone());
        let b = g.parameter(t);
        let d = g.value(Op::DotGeneral { lhs: a, rhs: b, dims: DotDims::matmul() }).unwrap();
        g.set_outputs(vec![d]).unwrap();
        let flops = 2.0 * 2048f64.powi(3);
        let s = seconds(&g, &EveryNodeAKernel);
        assert!((s - flops / (T.peak_bf16_flops_per_s * ACHIEVED_GEMM)).abs() < 1e-12, "{s}");

        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [16]));
        let n = g.value(Op::Unary { op: UnaryOp::Neg, input: p }).unwrap();
        g.set_outputs(vec![n]).unwrap();
        assert_eq!(seconds(&g, &EveryNodeAKernel), MIN_KERNEL_SECONDS);
    }

    #[test]
    fn fused_attention_runs_at_its_measured_share_of_the_peak_not_a_gemms() {
        use crate::ir::AttentionAttrs;
        // gpt2-small's causal attention, one layer: 12.9 GFLOP forward.
        let mut g = Graph::new();
        let t = TensorType::new(DType::BF16, [8, 12, 1024, 64]);
        let (q, k, v) = (g.parameter(t.clone()), g.parameter(t.clone()), g.parameter(t));
        let a = g
            .add(Op::Attention { q, k, v, bias: vec![], mask: None, attrs: AttentionAttrs::new(0.125, true) })
            .unwrap();
        g.set_outputs(vec![crate::ir::ValueId::new(a, 0)]).unwrap();
        let flops = 2.0 * 2.0 * 64.0 * (8.0 * 12.0 * 1024.0 * 1024.0 / 2.0);
        let s = seconds(&g, &EveryNodeAKernel);
        assert!((s - flops / (T.peak_bf16_flops_per_s * ACHIEVED_ATTENTION_FORWARD)).abs() < 1e-12, "{s}");
        // The trace's 46.8 µs a call, within 1%; priced as a GEMM it was 18.4.
        assert!((s - 46.8e-6).abs() < 0.01 * 46.8e-6, "{s}");
    }

    #[test]
    fn reshapes_and_barriers_are_views_not_kernels() {
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [1024, 1024]));
        let r = g.value(Op::Reshape { input: p, shape: Shape::from(vec![1 << 20]) }).unwrap();
        let b = g.value(Op::OptimizationBarrier { inputs: vec![r] }).unwrap();
        let n = g.value(Op::Unary { op: UnaryOp::Neg, input: b }).unwrap();
        g.set_outputs(vec![n]).unwrap();
        // The negation alone: reads p's 4 MiB through the views, writes 4 MiB.
        let s = seconds(&g, &EveryNodeAKernel);
        assert!((s - 2.0 * MIB4 / BW).abs() < 1e-12, "{s}");
    }
}
