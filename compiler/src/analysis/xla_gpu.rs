//! XLA CUDA's fusion, as far as memory goes: which of kiln's values get a
//! buffer of their own when XLA's GPU backend compiles the step.
//!
//! Read off the H100 (2026-11-23, `benches/RESULTS.md` "peak model on
//! CUDA"): XLA's optimized HLO and buffer assignment of the gpt2-small bf16
//! train step. What it showed, and what the rules below encode:
//!
//! - Elementwise work (and broadcasts, converts, slices, transposes,
//!   reshapes) fuses into the kernels that read it: loop and input
//!   (reduction) fusions, the Triton normalization kernels that run the layer
//!   norms (kiln's `layer_norm` composites, with the residual add before them
//!   and the bf16 convert after), and the expansions of the other composites.
//!   A fused value is recomputed in every kernel that reads it.
//! - cuBLAS GEMMs (`dot_general`) and cuDNN attention read their operands
//!   from memory: a convert feeding a matmul is a kernel of its own (the bf16
//!   weight copies, `wrapped_convert`), as on the CPU. Transposes of a
//!   matmul operand are folded into the GEMM's layout.
//! - What counts as expensive differs from the CPU: `exp`, `sqrt`, `rsqrt` and
//!   `divide` in f32 or f16 are cheap on the GPU and duplicated into several
//!   readers (the loss's `exp` over the logits is never written), and so is
//!   `logistic` in any float type, which XLA expands into `exp` and an f32
//!   divide before fusing (a SwiGLU's sigmoid, read off the H200 on
//!   2026-11-28); `tanh`, `log` and the rest are computed once and written
//!   (GELU's `tanh` is a second output of the GELU kernel).
//! - Duplication stops: of two residual adds per block, XLA writes one (the
//!   add after the MLP) and recomputes the other in its readers. The model
//!   counts, from the last node back, how many kernels would recompute each
//!   fused value (each kernel once, however many of its nodes read the
//!   value); a value recomputed by more than [`MAX_RECOMPUTING_KERNELS`]
//!   kernels is written instead.

use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, UnaryOp};
use crate::target::CUBLAS_WORKSPACE_BYTES;

use super::{loop_fusible, Materialization};

/// Kernels that may each recompute one fused value before XLA writes it.
pub const MAX_RECOMPUTING_KERNELS: usize = 3;

/// The kernels that compute a node, at most one more than
/// [`MAX_RECOMPUTING_KERNELS`]: inline, as the model keeps one per node on
/// every liveness it computes.
type Kernels = smallvec::SmallVec<[u32; MAX_RECOMPUTING_KERNELS + 1]>;

/// An approximation of XLA's GPU fusion (the CUDA plugin), for predicting
/// the memory of the program XLA compiles from kiln's graph on the H100.
#[derive(Clone, Copy, Debug, Default)]
pub struct XlaGpuFusion;

impl Materialization for XlaGpuFusion {
    fn materialized(&self, g: &Graph, users: &[Vec<NodeId>], n: NodeId) -> bool {
        let live = vec![true; g.len()];
        self.plan(g, users, &live)[n.index()]
    }

    fn plan(&self, g: &Graph, users: &[Vec<NodeId>], live: &[bool]) -> Vec<bool> {
        let n = g.len();
        let mut materialized = vec![false; n];
        // The kernels that compute each node: itself for a kernel of its own,
        // for a fused node the kernels its readers run in, each counted once
        // (XLA computes a fused value once in a kernel however many of that
        // kernel's nodes read it), up to one more than the limit.
        let mut kernels: Vec<Kernels> = vec![Kernels::new(); n];
        let sources = sources(g, live);
        for i in (0..n).rev() {
            if !live[i] {
                continue;
            }
            let id = NodeId::from_index(i);
            let op = &g.node(id).op;
            let us = &users[i];
            let fusible = loop_fusible(op)
                && !us.is_empty()
                && us.iter().all(|&u| absorbs(&g.node(u).op, op))
                && !(us.len() > 1 && expensive(g, id));
            let mut readers = Kernels::new();
            for &u in us {
                let own = [u.index() as u32];
                let of_u = if materialized[u.index()] { &own[..] } else { &kernels[u.index()][..] };
                for &k in of_u {
                    if readers.len() <= MAX_RECOMPUTING_KERNELS && !readers.contains(&k) {
                        readers.push(k);
                    }
                }
            }
            // Recomputing a value that reads one buffer costs each reader what
            // reading the value would; one that combines two buffers (a
            // residual add) costs more per reader, so XLA writes it once it
            // has many readers.
            let combines = sources[i].len() > 1;
            materialized[i] = !fusible || (readers.len() > MAX_RECOMPUTING_KERNELS && combines);
            kernels[i] = if materialized[i] { smallvec::smallvec![i as u32] } else { readers };
        }
        materialized
    }

    fn shares_through_fusion(&self) -> bool {
        false
    }

    fn scratch_bytes(&self, g: &Graph, n: NodeId) -> u64 {
        match &g.node(n).op {
            Op::DotGeneral { .. } => CUBLAS_WORKSPACE_BYTES,
            // cuDNN's flash-attention backward: an f32 accumulator for dQ and
            // the f32 row sums of dO * O, plus 256 bytes (24.4 MiB for
            // gpt2-small's [8, 12, 1024, 64], as XLA allocated it).
            Op::AttentionGrad { q, .. } => {
                let s = g.ty(*q).shape.num_elements() as u64;
                let d = g.ty(*q).shape.dims().last().copied().unwrap_or(1).max(1) as u64;
                4 * s + 4 * (s / d) + 256
            }
            // The chunked LM-head loss runs one block of `chunk` tokens at a
            // time: the block's logits (the GEMM's output, in h's dtype) live
            // inside the composite, and in the backward (or the fused loss and
            // gradient) their gradient is written over them; while a block's
            // dw share (w's shape, in h's dtype) is made, the running dw,
            // summed in f32 when h is narrower, lives beside it. Measured on
            // the H100 (2026-11-24, gpt2-small bf16, `docs/memory.md`, "dl
            // written over the logits"): at the fused op's peak XLA held one
            // block (196.5 MiB), a dw share (74 MiB), the f32 running dw (147
            // MiB) and 36 MiB of f32 pieces of dh the model did not count;
            // with each block's dh finished in its block they are gone (XLA
            // temp 26.6 MiB less, `docs/memory.md`, "dh finished in its
            // block").
            // With `shards` parts, a block takes `chunk` rows of each and the
            // dw share and running dw have one copy a part (the graph's
            // global view; one of each per device under SPMD).
            Op::LmHeadCrossEntropy { h, w, chunk, shards, .. } => {
                CUBLAS_WORKSPACE_BYTES + lm_head_block(g, *h, *w, chunk * shards)
            }
            Op::LmHeadCrossEntropyGrad { h, w, chunk, shards, .. }
            | Op::LmHeadCrossEntropyFused { h, w, chunk, shards, .. } => {
                let (ht, wt) = (g.ty(*h), g.ty(*w));
                let share = (shards * wt.shape.num_elements() * ht.dtype.size_in_bytes()) as u64;
                let running_dw =
                    if ht.dtype.size_in_bytes() < 4 { 4 * (shards * wt.shape.num_elements()) as u64 } else { 0 };
                CUBLAS_WORKSPACE_BYTES + lm_head_block(g, *h, *w, chunk * shards) + share + running_dw
            }
            _ => 0,
        }
    }
}

/// Bytes of one block's logits `[min(chunk, tokens), vocab]` in `h`'s dtype
/// (`h`: `[tokens, d]`, `w`: `[vocab, d]`).
fn lm_head_block(g: &Graph, h: crate::ir::ValueId, w: crate::ir::ValueId, chunk: usize) -> u64 {
    let (ht, wt) = (g.ty(h), g.ty(w));
    let d = ht.shape.dims().last().copied().unwrap_or(1).max(1);
    let tokens = ht.shape.num_elements() / d;
    let vocab = wt.shape.dims().first().copied().unwrap_or(0);
    (chunk.min(tokens) * vocab * ht.dtype.size_in_bytes()) as u64
}

/// For each node, up to two kernels' outputs (non-fusible producers) that a
/// fused computation of it reads element for element: broadcasts of smaller
/// values, constants and iotas read none.
fn sources(g: &Graph, live: &[bool]) -> Vec<Vec<NodeId>> {
    let mut out: Vec<Vec<NodeId>> = vec![Vec::new(); g.len()];
    for (id, node) in g.nodes() {
        let i = id.index();
        if !live[i] {
            continue;
        }
        out[i] = match &node.op {
            Op::Constant { .. } | Op::Iota { .. } => Vec::new(),
            Op::BroadcastInDim { input, .. }
                if g.ty(*input).shape.num_elements() < node.outputs[0].shape.num_elements() =>
            {
                Vec::new()
            }
            op if loop_fusible(op) => {
                let mut s: Vec<NodeId> = Vec::new();
                for v in op.inputs() {
                    for &x in &out[v.node.index()] {
                        if s.len() < 2 && !s.contains(&x) {
                            s.push(x);
                        }
                    }
                }
                s
            }
            _ => vec![id],
        };
    }
    out
}

/// Whether kernel `user` can take the fusible `producer` into itself.
fn absorbs(user: &Op, producer: &Op) -> bool {
    match user {
        // Loop and input fusions.
        Op::Reduce { .. } => true,
        Op::Constant { .. } | Op::Iota { .. } | Op::Parameter { .. } => false,
        // Triton normalization kernels, and the composites' plain expansions
        // (layer norm's backward, the LM head's loss), fuse their producers.
        Op::LayerNorm { .. }
        | Op::LayerNormGrad { .. }
        | Op::RmsNorm { .. }
        | Op::RmsNormGrad { .. }
        | Op::LmHeadCrossEntropy { .. }
        | Op::LmHeadCrossEntropyGrad { .. }
        | Op::LmHeadCrossEntropyFused { .. } => true,
        // cuBLAS takes an operand in either layout: a transpose (or a
        // reshape) before a GEMM is folded; anything else is written first.
        Op::DotGeneral { .. } => matches!(producer, Op::Transpose { .. } | Op::Reshape { .. } | Op::Whole { .. }),
        Op::Unary { .. }
        | Op::Binary { .. }
        | Op::Compare { .. }
        | Op::Select { .. }
        | Op::Clamp { .. }
        | Op::Convert { .. }
        | Op::BroadcastInDim { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concatenate { .. }
        | Op::Pad { .. }
        | Op::Reshape { .. }
        | Op::Whole { .. } => true,
        // Custom calls (cuDNN attention), in-place updates, gathers, collectives
        // and barriers read their operands from memory.
        Op::DynamicSlice { .. }
        | Op::DynamicUpdateSlice { .. }
        | Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::RngBitGenerator { .. }
        | Op::OptimizationBarrier { .. }
        | Op::Place { .. }
        | Op::HostCopy { .. }
        | Op::AllReduce { .. }
        | Op::Attention { .. }
        | Op::AttentionGrad { .. } => false,
    }
}

/// Ops XLA's GPU backend does not duplicate into several consumers
/// (`GpuInstructionFusion::IsExpensive`: the CPU's list, less `exp`, `sqrt`,
/// `rsqrt` and `divide` in f32 or f16, which the GPU computes cheaply).
fn expensive(g: &Graph, n: NodeId) -> bool {
    let node = g.node(n);
    let cheap_float = matches!(node.outputs.first().map(|t| t.dtype), Some(DType::F32 | DType::F16));
    match &node.op {
        Op::Unary { op, .. } => match op {
            UnaryOp::Exp | UnaryOp::Sqrt | UnaryOp::Rsqrt => !cheap_float,
            // XLA expands the logistic into `1 / (1 + exp(-x))` before it
            // fuses, with the divide in f32 also for bf16, and duplicates
            // that into every reader: a SwiGLU's bf16 sigmoid is computed
            // in each kernel that reads it, never written (H200, 2026-11-28,
            // the Llama-style step of `remat_llama`).
            UnaryOp::Logistic => !node.outputs.first().is_some_and(|t| t.dtype.is_float()),
            other => crate::cost::is_transcendental_unary(*other),
        },
        Op::Binary { op, .. } => match op {
            BinaryOp::Div => !cheap_float,
            BinaryOp::Pow | BinaryOp::Rem => true,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{liveness, peak_memory, XlaCpuFusion};
    use crate::ir::{ReduceOp, TensorType, ValueId};

    fn sum_rows(g: &mut Graph, x: ValueId) -> ValueId {
        g.value(Op::Reduce { op: ReduceOp::Sum, input: x, axes: vec![1] }).unwrap()
    }

    /// `u = op(p)` read by two row sums: whether `u` is written.
    fn two_readers(op: UnaryOp, dtype: DType) -> (Graph, NodeId) {
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(dtype, [64, 128]));
        let u = g.value(Op::Unary { op, input: p }).unwrap();
        let a = sum_rows(&mut g, u);
        let m = g.value(Op::Unary { op: UnaryOp::Neg, input: u }).unwrap();
        let b = sum_rows(&mut g, m);
        g.set_outputs(vec![a, b]).unwrap();
        (g, u.node)
    }

    #[test]
    fn f32_exp_is_recomputed_by_each_reader_on_the_gpu_but_tanh_is_written() {
        let (g, u) = two_readers(UnaryOp::Exp, DType::F32);
        assert!(!liveness(&g, &XlaGpuFusion).materialized[u.index()], "GPU: exp f32 is cheap");
        assert!(liveness(&g, &XlaCpuFusion).materialized[u.index()], "CPU: exp is expensive");
        let (g, u) = two_readers(UnaryOp::Exp, DType::BF16);
        assert!(liveness(&g, &XlaGpuFusion).materialized[u.index()], "GPU: exp bf16 is expensive");
        let (g, u) = two_readers(UnaryOp::Tanh, DType::F32);
        assert!(liveness(&g, &XlaGpuFusion).materialized[u.index()], "GPU: tanh is expensive");
        for dtype in [DType::BF16, DType::F32] {
            let (g, u) = two_readers(UnaryOp::Logistic, dtype);
            assert!(!liveness(&g, &XlaGpuFusion).materialized[u.index()], "GPU: logistic {dtype} is expanded, cheap");
            assert!(liveness(&g, &XlaCpuFusion).materialized[u.index()], "CPU: logistic {dtype} is expensive");
        }
    }

    /// A residual stream `x_{i+1} = x_i + f_i` where each `f_i` is a GEMM of
    /// `-x_i` (the negation a kernel of its own, as a layer norm is) and each
    /// `x_i` is read by that kernel, by a reduction and by the next add: XLA
    /// writes some adds, and recomputes the others.
    #[test]
    fn a_residual_chain_is_written_every_few_adds_not_every_add_nor_never() {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [64, 64]);
        let w = g.parameter(t.clone());
        let mut x = g.parameter(t);
        let mut adds = Vec::new();
        let mut outs = Vec::new();
        for _ in 0..8 {
            let n = g.value(Op::Unary { op: UnaryOp::Neg, input: x }).unwrap();
            let f = g.value(Op::DotGeneral { lhs: n, rhs: w, dims: crate::ir::DotDims::matmul() }).unwrap();
            outs.push(sum_rows(&mut g, x));
            x = g.value(Op::Binary { op: BinaryOp::Add, lhs: x, rhs: f }).unwrap();
            adds.push(x.node);
        }
        outs.push(x);
        g.set_outputs(outs).unwrap();
        let l = liveness(&g, &XlaGpuFusion);
        let written = adds[..7].iter().filter(|a| l.materialized[a.index()]).count();
        assert!(written > 0 && written < 7, "{written} of 7 adds written");
        // The CPU model recomputes every add: its readers absorb it, and an
        // add is cheap.
        let c = liveness(&g, &XlaCpuFusion);
        assert_eq!(adds[..7].iter().filter(|a| c.materialized[a.index()]).count(), 0);
    }

    /// `v = a * b` (two buffers) read by `k` fused nodes whose results meet
    /// in one row sum, or each summed by a kernel of its own.
    fn many_readers(k: usize, one_kernel: bool) -> (Graph, NodeId) {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [64, 128]);
        let a = g.parameter(t.clone());
        let b = g.parameter(t);
        let v = g.value(Op::Binary { op: BinaryOp::Mul, lhs: a, rhs: b }).unwrap();
        let reads: Vec<ValueId> = (0..k).map(|_| g.value(Op::Unary { op: UnaryOp::Neg, input: v }).unwrap()).collect();
        let outs = if one_kernel {
            let sum = reads[1..]
                .iter()
                .fold(reads[0], |s, &r| g.value(Op::Binary { op: BinaryOp::Add, lhs: s, rhs: r }).unwrap());
            vec![sum_rows(&mut g, sum)]
        } else {
            reads.iter().map(|&r| sum_rows(&mut g, r)).collect()
        };
        g.set_outputs(outs).unwrap();
        (g, v.node)
    }

    /// XLA computes a fused value once in each kernel that reads it, however
    /// many of that kernel's nodes do (GELU's derivative reads the `tanh`
    /// through several products that all end in the one backward kernel,
    /// H100 2026-11-24): readers are counted by kernel, not by path.
    #[test]
    fn a_value_fused_into_one_kernel_by_many_paths_is_not_written() {
        let (g, v) = many_readers(6, true);
        assert!(!liveness(&g, &XlaGpuFusion).materialized[v.index()], "six paths into one kernel");
        let (g, v) = many_readers(6, false);
        assert!(liveness(&g, &XlaGpuFusion).materialized[v.index()], "six kernels");
        let (g, v) = many_readers(MAX_RECOMPUTING_KERNELS, false);
        assert!(!liveness(&g, &XlaGpuFusion).materialized[v.index()], "as many kernels as the limit");
    }

    #[test]
    fn a_transposed_matmul_operand_is_folded_and_a_gemm_has_a_workspace() {
        let mut g = Graph::new();
        let a = g.parameter(TensorType::new(DType::F32, [256, 128]));
        let b = g.parameter(TensorType::new(DType::F32, [256, 128]));
        let at = g.value(Op::Transpose { input: a, perm: vec![1, 0] }).unwrap();
        let d = g.value(Op::DotGeneral { lhs: at, rhs: b, dims: crate::ir::DotDims::matmul() }).unwrap();
        g.set_outputs(vec![d]).unwrap();
        let l = liveness(&g, &XlaGpuFusion);
        assert!(!l.materialized[at.node.index()]);
        assert!(liveness(&g, &XlaCpuFusion).materialized[at.node.index()]);
        let scratch: Vec<_> = l.buffers.iter().filter(|b| b.kind == super::super::BufferKind::Scratch).collect();
        assert_eq!(scratch.len(), 1);
        assert_eq!(scratch[0].bytes, CUBLAS_WORKSPACE_BYTES);
        assert_eq!(scratch[0].def, scratch[0].last_use);
        // Arguments 2 x 128 KiB, the output 64 KiB, and the workspace while the
        // GEMM runs.
        let p = peak_memory(&g, &XlaGpuFusion);
        assert_eq!(p.temp_peak_bytes, CUBLAS_WORKSPACE_BYTES);
        assert_eq!(p.peak_bytes, 2 * 131_072 + 65_536 + CUBLAS_WORKSPACE_BYTES);
    }

    /// The chunked LM-head loss holds one block's logits inside the
    /// composite, beside a GEMM workspace; the backward writes their gradient
    /// over them and also holds a dw share and the running dw (f32 for a
    /// bf16 h).
    #[test]
    fn the_chunked_lm_head_loss_holds_one_blocks_logits_as_scratch() {
        let mut g = Graph::new();
        let h = g.parameter(TensorType::new(DType::BF16, [64, 32]));
        let w = g.parameter(TensorType::new(DType::BF16, [100, 32]));
        let labels = g.parameter(TensorType::new(DType::I32, [64]));
        let f = g.add(Op::LmHeadCrossEntropy { h, w, labels, chunk: 16, shards: 1 }).unwrap();
        let (nll, lse) = (ValueId::new(f, 0), ValueId::new(f, 1));
        let b = g.add(Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll: nll, chunk: 16, shards: 1 }).unwrap();
        g.set_outputs(vec![ValueId::new(b, 0), ValueId::new(b, 1)]).unwrap();
        let l = liveness(&g, &XlaGpuFusion);
        let scratch: Vec<u64> =
            l.buffers.iter().filter(|b| b.kind == super::super::BufferKind::Scratch).map(|b| b.bytes).collect();
        let block = 16 * 100 * 2;
        let (share, running_dw) = (100 * 32 * 2, 100 * 32 * 4);
        assert_eq!(scratch, vec![CUBLAS_WORKSPACE_BYTES + block, CUBLAS_WORKSPACE_BYTES + block + share + running_dw]);
    }

    /// `y = neg(sum_bcast + tanh(x))`: on the CPU `y` may take the buffer of
    /// `tanh(x)` (written, read only through the fused add); on the GPU only
    /// a buffer the kernel reads directly is shared.
    #[test]
    fn the_gpu_shares_only_buffers_a_kernel_reads_directly() {
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::F32, [64, 64]));
        let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: x }).unwrap();
        let s = sum_rows(&mut g, t);
        let sb = g
            .value(Op::BroadcastInDim { input: s, shape: crate::ir::Shape::new(vec![64, 64]), dims: vec![0] })
            .unwrap();
        let a = g.value(Op::Binary { op: BinaryOp::Add, lhs: sb, rhs: t }).unwrap();
        let y = g.value(Op::Unary { op: UnaryOp::Neg, input: a }).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let temp_at_y = |f: &dyn Materialization| {
            let l = liveness(&g, f);
            let at = l.exec_pos[y.node.index()].unwrap();
            l.temp_curve()[at]
        };
        // The row sums (256 bytes) are live at y either way.
        assert_eq!(temp_at_y(&XlaCpuFusion), 256, "the CPU writes y into tanh's buffer");
        assert_eq!(temp_at_y(&XlaGpuFusion), 16_384 + 256, "the GPU keeps tanh's buffer beside y");
    }
}
