//! The closed set of operations of kiln's IR.
//!
//! Ops are plain data: operands are [`ValueId`]s, attributes are hashable, ordered
//! values. No closures, no handles, no ops named by strings, so `Op` converts to an
//! e-graph node and back without loss, and two structurally equal programs hash
//! alike. Each sub-enum knows its StableHLO mnemonic.

use super::{
    AttentionAttrs, BinaryOp, CompareDir, DType, DotDims, HostCopyStep, Literal, MemorySpace, ReduceOp, RngAlgorithm,
    Shape, TensorType, UnaryOp, ValueId,
};
use smallvec::{smallvec, SmallVec};

/// The operands of an op ([`Op::inputs`]).
pub type Inputs = SmallVec<[ValueId; 6]>;

/// One operation. Operands are values defined earlier in the same graph.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// The `index`-th input of the program.
    Parameter {
        index: u32,
        ty: TensorType,
    },
    Constant {
        literal: Literal,
    },
    /// Values `0, 1, 2, ...` along `axis`, broadcast over the other dimensions.
    Iota {
        ty: TensorType,
        axis: usize,
    },
    Unary {
        op: UnaryOp,
        input: ValueId,
    },
    /// Operands have identical types (the frontend broadcasts explicitly).
    Binary {
        op: BinaryOp,
        lhs: ValueId,
        rhs: ValueId,
    },
    Compare {
        dir: CompareDir,
        lhs: ValueId,
        rhs: ValueId,
    },
    /// `pred` is a scalar or has the operands' shape.
    Select {
        pred: ValueId,
        on_true: ValueId,
        on_false: ValueId,
    },
    /// `min` and `max` are scalars or have the input's shape.
    Clamp {
        min: ValueId,
        input: ValueId,
        max: ValueId,
    },
    Convert {
        input: ValueId,
        to: DType,
    },
    /// Input dimension `i` maps to result dimension `dims[i]`; every mapped
    /// dimension has the input's size or the input's size is 1.
    BroadcastInDim {
        input: ValueId,
        shape: Shape,
        dims: Vec<usize>,
    },
    Reshape {
        input: ValueId,
        shape: Shape,
    },
    /// Result dimension `i` is input dimension `perm[i]`.
    Transpose {
        input: ValueId,
        perm: Vec<usize>,
    },
    Slice {
        input: ValueId,
        start: Vec<usize>,
        limit: Vec<usize>,
        stride: Vec<usize>,
    },
    /// Start indices are scalar integer values, clamped into range as in StableHLO.
    DynamicSlice {
        input: ValueId,
        starts: Vec<ValueId>,
        sizes: Vec<usize>,
    },
    DynamicUpdateSlice {
        input: ValueId,
        update: ValueId,
        starts: Vec<ValueId>,
    },
    Concatenate {
        inputs: Vec<ValueId>,
        axis: usize,
    },
    /// `value` is a scalar of the input's dtype. Negative `low`/`high` crop.
    Pad {
        input: ValueId,
        value: ValueId,
        low: Vec<i64>,
        high: Vec<i64>,
        interior: Vec<usize>,
    },
    /// Reduces over `axes` (sorted, unique), which disappear from the result.
    Reduce {
        op: ReduceOp,
        input: ValueId,
        axes: Vec<usize>,
    },
    DotGeneral {
        lhs: ValueId,
        rhs: ValueId,
        dims: DotDims,
    },
    /// `operand` indexed along `axis` by the integer tensor `indices`: the result
    /// has shape `operand[..axis] ++ indices ++ operand[axis+1..]` (embedding lookup).
    Gather {
        operand: ValueId,
        indices: ValueId,
        axis: usize,
    },
    /// The adjoint of `Gather`: `updates` (shaped like the gather's result) are
    /// added into `operand` at the rows named by `indices`; repeated rows accumulate.
    ScatterAdd {
        operand: ValueId,
        indices: ValueId,
        updates: ValueId,
        axis: usize,
    },
    /// Outputs: `#0` the new state (same type as `state`), `#1` random bits of `ty`.
    RngBitGenerator {
        algorithm: RngAlgorithm,
        state: ValueId,
        ty: TensorType,
    },
    /// Outputs equal inputs; stops XLA from moving computation across it.
    OptimizationBarrier {
        inputs: Vec<ValueId>,
    },
    /// The input, with its buffer in memory space `to`: the identity on every
    /// value. Made only by host offload (`memory::HostOffload`), which sends a
    /// saved activation to pinned host memory after its forward write and
    /// back before its backward read; lowered to XLA's placement annotation
    /// on the CUDA target and to nothing elsewhere.
    Place {
        input: ValueId,
        to: MemorySpace,
    },
    /// One step of a value's trip to pinned host memory and back over copies
    /// of kiln's own (`memory::HostCopies`): the copies run on streams of the
    /// runtime's beside the kernels, ordered by events, and the program's
    /// order (held by the `ties`, operands the step waits for, and by
    /// barriers the planner adds) says when each starts and ends. `slot`
    /// names the value's host buffer; `ty` is the value's type. On values the
    /// trip is the identity: the interpreter keeps the value by slot from
    /// `Out` to `In`. Made only after autodiff, by the remat pass.
    HostCopy {
        inputs: Vec<ValueId>,
        step: HostCopyStep,
        slot: u32,
        ty: TensorType,
    },
    /// The input, whole on every device of a partitioned program: the
    /// identity on every value. Lowered to a replicated sharding constraint
    /// in a partitioned module (so XLA's SPMD partitioner gathers the value
    /// once where it is read, instead of choosing by each reader's operand
    /// sizes) and to nothing elsewhere. Made by the LM-head loss's expansion
    /// for the tied table when the rows are split over devices.
    Whole {
        input: ValueId,
    },
    /// Reduction of `input` across all replicas of the program.
    AllReduce {
        op: ReduceOp,
        input: ValueId,
    },
    /// Composite scaled-dot-product attention (`docs/composites.md`):
    /// `q: [b, hq, t, d]`, `k, v: [b, hkv, s, d]` (`k` as `[b, hkv, d, s]`
    /// when `attrs.k_transposed`), one float dtype, `hkv` dividing `hq`
    /// (`attrs.kv_heads` says which key/value head each query head reads).
    /// Scores `scale · q kᵀ` in f32 (f64 for f64 operands) plus every `bias`
    /// term (a float `[b|1, hq|1, t|1, s|1]`, converted to the scores' type),
    /// then `attrs.fill` where the pred `mask` (`[b|1, hq|1, t|1, s|1]`) is not
    /// `attrs.keep`, then `-inf` above the diagonal when causal; softmax over
    /// the keys. Outputs: `#0` the attention `[b, hq, t, d]` in the operands'
    /// dtype, `#1` the softmax statistics: the log-sum-exp of each row of
    /// masked scores, `[b, hq, t]` f32.
    Attention {
        q: ValueId,
        k: ValueId,
        v: ValueId,
        bias: Vec<ValueId>,
        mask: Option<ValueId>,
        attrs: AttentionAttrs,
    },
    /// The backward of [`Op::Attention`]: from the forward's operands, its output
    /// `out`, its statistics `stats` and the output's cotangent `dout` (all as the
    /// forward had them), outputs `#0` dq, `#1` dk, `#2` dv, then one gradient
    /// per `bias` term (each of its term's type). Reuses `stats` instead of the
    /// `[b, h, t, s]` probabilities, which never exist whole on a fused target.
    AttentionGrad {
        q: ValueId,
        k: ValueId,
        v: ValueId,
        bias: Vec<ValueId>,
        mask: Option<ValueId>,
        out: ValueId,
        stats: ValueId,
        dout: ValueId,
        attrs: AttentionAttrs,
    },
    /// Composite layer normalisation over the last axis (`docs/composites.md`):
    /// `y = (x - mean) · rstd · gamma + beta` with `rstd = 1/sqrt(var + eps)`.
    /// `x: [..., d]` float, `gamma, beta: [d]` of x's dtype. Outputs: `#0` y
    /// (x's type), `#1` mean and `#2` rstd, `[...]` f32: what the backward reuses.
    /// `eps_bits` is eps's f64 bits (hashable, ordered).
    LayerNorm {
        x: ValueId,
        gamma: ValueId,
        beta: ValueId,
        eps_bits: u64,
    },
    /// The backward of [`Op::LayerNorm`] from its saved mean and rstd: outputs
    /// `#0` dx, `#1` dgamma, `#2` dbeta.
    LayerNormGrad {
        x: ValueId,
        gamma: ValueId,
        mean: ValueId,
        rstd: ValueId,
        dy: ValueId,
    },
    /// Composite root-mean-square normalisation over the last axis
    /// (`docs/composites.md`): `y = x · rstd · gamma` with `rstd =
    /// 1/sqrt(mean(x²) + eps)`, computed in f32 (f64 for f64). `x: [..., d]`
    /// float, `gamma: [d]` of x's dtype. Outputs: `#0` y (x's type), `#1` rstd
    /// `[...]` f32, what the backward reuses. `eps_bits` is eps's f64 bits.
    RmsNorm {
        x: ValueId,
        gamma: ValueId,
        eps_bits: u64,
    },
    /// The backward of [`Op::RmsNorm`] from its saved rstd: outputs `#0` dx,
    /// `#1` dgamma.
    RmsNormGrad {
        x: ValueId,
        gamma: ValueId,
        rstd: ValueId,
        dy: ValueId,
    },
    /// Composite LM head + softmax cross-entropy (`docs/composites.md`):
    /// `logits = h wᵀ` for `h: [n, d]`, `w: [vocab, d]` (one float dtype), integer
    /// `labels: [n]`. Outputs `#0` the per-token negative log-likelihood and `#1`
    /// the per-token log-sum-exp, `[n]` f32. Lowered in row blocks of `chunk`
    /// tokens, so the `[n, vocab]` logits never exist whole. `shards` (≥ 1,
    /// dividing n) names how many equal contiguous parts the rows come in: one
    /// per device where a mesh's `data` axis splits the batch. A block then
    /// takes `chunk` rows of every part, so under XLA's SPMD partitioner each
    /// device makes its blocks from its own rows, and dw is summed over the
    /// parts once, after the last block (`docs/sharding.md`, "The LM head on
    /// each device's rows"). The values do not depend on `shards`.
    LmHeadCrossEntropy {
        h: ValueId,
        w: ValueId,
        labels: ValueId,
        chunk: usize,
        shards: usize,
    },
    /// The backward of [`Op::LmHeadCrossEntropy`] from its saved log-sum-exp and
    /// the cotangent `dnll` of the nll: outputs `#0` dh, `#1` dw.
    LmHeadCrossEntropyGrad {
        h: ValueId,
        w: ValueId,
        labels: ValueId,
        lse: ValueId,
        dnll: ValueId,
        chunk: usize,
        shards: usize,
    },
    /// [`Op::LmHeadCrossEntropy`] and its backward in one pass over the row
    /// blocks, for the case where every token's cotangent is the same scalar
    /// `scale` (rank 0, f32): the mean of the nll seeded by a constant or a loss
    /// scale. Outputs `#0` nll and `#1` lse (`[n]` f32, as the forward's), `#2`
    /// dh (h's type) and `#3` dw (w's type), the backward's with `dnll_i = scale`.
    /// Made only by the `lm_head_loss` pass (`docs/composites.md`); not
    /// differentiable.
    LmHeadCrossEntropyFused {
        h: ValueId,
        w: ValueId,
        labels: ValueId,
        scale: ValueId,
        chunk: usize,
        shards: usize,
    },
}

impl Op {
    /// Name in kiln's text form.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Parameter { .. } => "parameter",
            Op::Constant { .. } => "constant",
            Op::Iota { .. } => "iota",
            Op::Unary { op, .. } => op.name(),
            Op::Binary { op, .. } => op.name(),
            Op::Compare { .. } => "compare",
            Op::Select { .. } => "select",
            Op::Clamp { .. } => "clamp",
            Op::Convert { .. } => "convert",
            Op::BroadcastInDim { .. } => "broadcast_in_dim",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Slice { .. } => "slice",
            Op::DynamicSlice { .. } => "dynamic_slice",
            Op::DynamicUpdateSlice { .. } => "dynamic_update_slice",
            Op::Concatenate { .. } => "concatenate",
            Op::Pad { .. } => "pad",
            Op::Reduce { .. } => "reduce",
            Op::DotGeneral { .. } => "dot_general",
            Op::Gather { .. } => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::RngBitGenerator { .. } => "rng_bit_generator",
            Op::OptimizationBarrier { .. } => "optimization_barrier",
            Op::Place { .. } => "place",
            Op::HostCopy { .. } => "host_copy",
            Op::Whole { .. } => "whole",
            Op::AllReduce { .. } => "all_reduce",
            Op::Attention { .. } => "attention",
            Op::AttentionGrad { .. } => "attention_grad",
            Op::LayerNorm { .. } => "layer_norm",
            Op::LayerNormGrad { .. } => "layer_norm_grad",
            Op::RmsNorm { .. } => "rms_norm",
            Op::RmsNormGrad { .. } => "rms_norm_grad",
            Op::LmHeadCrossEntropy { .. } => "lm_head_cross_entropy",
            Op::LmHeadCrossEntropyGrad { .. } => "lm_head_cross_entropy_grad",
            Op::LmHeadCrossEntropyFused { .. } => "lm_head_cross_entropy_fused",
        }
    }

    /// Operands in a fixed order (the order of the text form). Up to six are
    /// held inline (more only for a long concatenation or barrier, or a
    /// dynamic slice of high rank): passes ask for them on every node of a
    /// step, often.
    pub fn inputs(&self) -> Inputs {
        match self {
            Op::Parameter { .. } | Op::Constant { .. } | Op::Iota { .. } => Inputs::new(),
            Op::Unary { input, .. }
            | Op::Convert { input, .. }
            | Op::BroadcastInDim { input, .. }
            | Op::Reshape { input, .. }
            | Op::Transpose { input, .. }
            | Op::Slice { input, .. }
            | Op::Reduce { input, .. }
            | Op::Place { input, .. }
            | Op::Whole { input }
            | Op::AllReduce { input, .. } => smallvec![*input],
            Op::Binary { lhs, rhs, .. } | Op::Compare { lhs, rhs, .. } | Op::DotGeneral { lhs, rhs, .. } => {
                smallvec![*lhs, *rhs]
            }
            Op::Select { pred, on_true, on_false } => smallvec![*pred, *on_true, *on_false],
            Op::Clamp { min, input, max } => smallvec![*min, *input, *max],
            Op::DynamicSlice { input, starts, .. } => std::iter::once(*input).chain(starts.iter().copied()).collect(),
            Op::DynamicUpdateSlice { input, update, starts } => {
                [*input, *update].into_iter().chain(starts.iter().copied()).collect()
            }
            Op::Concatenate { inputs, .. } | Op::OptimizationBarrier { inputs } | Op::HostCopy { inputs, .. } => {
                inputs.iter().copied().collect()
            }
            Op::Pad { input, value, .. } => smallvec![*input, *value],
            Op::Gather { operand, indices, .. } => smallvec![*operand, *indices],
            Op::ScatterAdd { operand, indices, updates, .. } => smallvec![*operand, *indices, *updates],
            Op::RngBitGenerator { state, .. } => smallvec![*state],
            Op::Attention { q, k, v, bias, mask, .. } => {
                [*q, *k, *v].into_iter().chain(bias.iter().copied()).chain(*mask).collect()
            }
            Op::AttentionGrad { q, k, v, bias, mask, out, stats, dout, .. } => {
                [*q, *k, *v].into_iter().chain(bias.iter().copied()).chain(*mask).chain([*out, *stats, *dout]).collect()
            }
            Op::LayerNorm { x, gamma, beta, .. } => smallvec![*x, *gamma, *beta],
            Op::LayerNormGrad { x, gamma, mean, rstd, dy } => smallvec![*x, *gamma, *mean, *rstd, *dy],
            Op::RmsNorm { x, gamma, .. } => smallvec![*x, *gamma],
            Op::RmsNormGrad { x, gamma, rstd, dy } => smallvec![*x, *gamma, *rstd, *dy],
            Op::LmHeadCrossEntropy { h, w, labels, .. } => smallvec![*h, *w, *labels],
            Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll, .. } => smallvec![*h, *w, *labels, *lse, *dnll],
            Op::LmHeadCrossEntropyFused { h, w, labels, scale, .. } => smallvec![*h, *w, *labels, *scale],
        }
    }

    /// Rewrites every operand through `f` (same order as [`Op::inputs`]).
    pub fn map_inputs(&mut self, mut f: impl FnMut(ValueId) -> ValueId) {
        match self {
            Op::Parameter { .. } | Op::Constant { .. } | Op::Iota { .. } => {}
            Op::Unary { input, .. }
            | Op::Convert { input, .. }
            | Op::BroadcastInDim { input, .. }
            | Op::Reshape { input, .. }
            | Op::Transpose { input, .. }
            | Op::Slice { input, .. }
            | Op::Reduce { input, .. }
            | Op::Place { input, .. }
            | Op::Whole { input }
            | Op::AllReduce { input, .. } => *input = f(*input),
            Op::Binary { lhs, rhs, .. } | Op::Compare { lhs, rhs, .. } | Op::DotGeneral { lhs, rhs, .. } => {
                *lhs = f(*lhs);
                *rhs = f(*rhs);
            }
            Op::Select { pred, on_true, on_false } => {
                *pred = f(*pred);
                *on_true = f(*on_true);
                *on_false = f(*on_false);
            }
            Op::Clamp { min, input, max } => {
                *min = f(*min);
                *input = f(*input);
                *max = f(*max);
            }
            Op::DynamicSlice { input, starts, .. } => {
                *input = f(*input);
                starts.iter_mut().for_each(|s| *s = f(*s));
            }
            Op::DynamicUpdateSlice { input, update, starts } => {
                *input = f(*input);
                *update = f(*update);
                starts.iter_mut().for_each(|s| *s = f(*s));
            }
            Op::Concatenate { inputs, .. } | Op::OptimizationBarrier { inputs } | Op::HostCopy { inputs, .. } => {
                inputs.iter_mut().for_each(|s| *s = f(*s));
            }
            Op::Pad { input, value, .. } => {
                *input = f(*input);
                *value = f(*value);
            }
            Op::Gather { operand, indices, .. } => {
                *operand = f(*operand);
                *indices = f(*indices);
            }
            Op::ScatterAdd { operand, indices, updates, .. } => {
                *operand = f(*operand);
                *indices = f(*indices);
                *updates = f(*updates);
            }
            Op::RngBitGenerator { state, .. } => *state = f(*state),
            Op::Attention { q, k, v, bias, mask, .. } => {
                for x in [q, k, v].into_iter().chain(bias.iter_mut()).chain(mask.as_mut()) {
                    *x = f(*x);
                }
            }
            Op::AttentionGrad { q, k, v, bias, mask, out, stats, dout, .. } => {
                for x in [q, k, v].into_iter().chain(bias.iter_mut()).chain(mask.as_mut()).chain([out, stats, dout]) {
                    *x = f(*x);
                }
            }
            Op::LayerNorm { x, gamma, beta, .. } => {
                for v in [x, gamma, beta] {
                    *v = f(*v);
                }
            }
            Op::LayerNormGrad { x, gamma, mean, rstd, dy } => {
                for v in [x, gamma, mean, rstd, dy] {
                    *v = f(*v);
                }
            }
            Op::RmsNorm { x, gamma, .. } => {
                for v in [x, gamma] {
                    *v = f(*v);
                }
            }
            Op::RmsNormGrad { x, gamma, rstd, dy } => {
                for v in [x, gamma, rstd, dy] {
                    *v = f(*v);
                }
            }
            Op::LmHeadCrossEntropy { h, w, labels, .. } => {
                for v in [h, w, labels] {
                    *v = f(*v);
                }
            }
            Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll, .. } => {
                for v in [h, w, labels, lse, dnll] {
                    *v = f(*v);
                }
            }
            Op::LmHeadCrossEntropyFused { h, w, labels, scale, .. } => {
                for v in [h, w, labels, scale] {
                    *v = f(*v);
                }
            }
        }
    }

    /// Ops whose result depends on more than their operands' values (replica
    /// identity): never merged or folded across replicas.
    pub fn is_collective(&self) -> bool {
        self.props().collective
    }
}
