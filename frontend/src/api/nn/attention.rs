//! Attention as a built-in call: the composite `grad` also finds in plain ops
//! (`docs/composites.md`), recorded directly with its masks, bias and
//! grouped key/value heads, and the GPT's causal self-attention layer.
//!
//! Invariant: every operand is checked when the call is recorded, so a mask
//! of the wrong batch or a head count that does not divide is a typed error
//! naming the op (and, inside a module, the layer) and both shapes, never a
//! compile error later.

use kiln_compiler::ir::{AttentionAttrs, BinaryOp, DType, Op, Shape};

use super::module::{scoped, Module};
use super::{Linear, ParamStore};
use crate::api::amp;
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;
use crate::engine::scope;

/// What [`attention`] applies to the scores besides the scale.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionOptions<'a> {
    /// Query `i` sees keys `0..=i` only (needs as many queries as keys).
    pub causal: bool,
    /// The scores' scale; `None` is `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// A pred broadcastable to the scores `[batch, heads, q_seq, kv_seq]`
    /// (each dimension full or 1): scores where it is false are masked.
    pub mask: Option<&'a Tensor>,
    /// `[batch, kv_seq]`, the padding mask of a batch of sequences: keys where
    /// it is zero (false) are masked for every head and query, as Hugging
    /// Face's `attention_mask` (any dtype; non-zero keeps).
    pub key_padding_mask: Option<&'a Tensor>,
    /// A float term added to the scaled scores, broadcastable to them (T5's
    /// relative position bias `[1, heads, q_seq, kv_seq]`, ALiBi); it has a
    /// gradient.
    pub bias: Option<&'a Tensor>,
}

/// `softmax(mask(scale · q kᵀ + bias)) v` for `q: [batch, heads, q_seq,
/// head_dim]` and `k, v: [batch, kv_heads, kv_seq, head_dim]`, recorded as one
/// attention composite (`docs/composites.md`). `kv_heads` must divide `heads`:
/// with fewer, each group of `heads / kv_heads` query heads shares one key/value
/// head (grouped-query attention, Llama's `repeat_kv`), with no copy of k and
/// v. Scores and softmax in f32; operands and result in the autocast dtype
/// inside a scope (else q's dtype). On CUDA with bf16/f16 it runs as cuDNN
/// flash attention, elsewhere as plain ops; the backward reuses the softmax
/// statistics.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: AttentionOptions<'_>) -> Result<Tensor> {
    let op = "attention";
    for (what, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            let layout = "[batch, heads, seq, head_dim]";
            return Err(FrontendError::OperandRank { op, what, got: t.ty().clone(), expected: 4, layout });
        }
    }
    let shapes = |reason: String| FrontendError::AttentionShapes {
        op,
        reason,
        q: Box::new(q.ty().clone()),
        k: Box::new(k.ty().clone()),
        v: Box::new(v.ty().clone()),
    };
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    if kd != vd {
        return Err(shapes("k and v must have one shape".into()));
    }
    if qd[0] != kd[0] || qd[3] != kd[3] {
        return Err(shapes("q, k and v must share the batch and the head size".into()));
    }
    if kd[1] == 0 || qd[1] % kd[1] != 0 {
        return Err(shapes(format!("{} key/value heads do not divide {} query heads", kd[1], qd[1])));
    }
    if opts.causal && qd[2] != kd[2] {
        return Err(shapes(format!("a causal mask needs as many queries ({}) as keys ({})", qd[2], kd[2])));
    }
    let scores = Shape::from(vec![qd[0], qd[1], qd[2], kd[2]]);
    let mask = attention_mask(opts, &scores)?;
    let bias = match opts.bias {
        Some(b) => {
            fits_scores(op, "bias", b, &scores)?;
            if !b.dtype().is_float() {
                let why = "must be floating point".to_string();
                return Err(FrontendError::AttentionOperand {
                    op,
                    what: "bias",
                    got: Box::new(b.ty().clone()),
                    scores,
                    why,
                });
            }
            vec![b.value(op)?]
        }
        None => Vec::new(),
    };
    let dtype = amp::compute_dtype(q.dtype());
    let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
    let scale = opts.scale.unwrap_or(1.0 / (q.dims()[3] as f64).sqrt());
    let attrs = AttentionAttrs::new(scale, opts.causal);
    let (q, k, v) = (q.value(op)?, k.value(op)?, v.value(op)?);
    let mask = mask.map(|m| m.value(op)).transpose()?;
    crate::engine::context::with(|c| c.push(Op::Attention { q, k, v, bias, mask, attrs })).map(Tensor::wrap)
}

/// `attention(q, k, v)` with the default scale, causal or not: the call
/// [`CausalSelfAttention`] makes.
pub fn scaled_dot_product_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    attention(q, k, v, AttentionOptions { causal, ..AttentionOptions::default() }).map_err(|e| match e {
        FrontendError::OperandRank { what, got, expected, layout, .. } => {
            FrontendError::OperandRank { op: "scaled_dot_product_attention", what, got, expected, layout }
        }
        other => other,
    })
}

/// Checks that `t` is rank 4 with each dimension the scores' or 1.
fn fits_scores(op: &'static str, what: &'static str, t: &Tensor, scores: &Shape) -> Result<()> {
    let fits = t.rank() == 4 && t.dims().iter().zip(scores.dims()).all(|(&d, &s)| d == s || d == 1);
    if fits {
        return Ok(());
    }
    let why = "must be [batch|1, heads|1, q_seq|1, kv_seq|1]".to_string();
    Err(FrontendError::AttentionOperand { op, what, got: Box::new(t.ty().clone()), scores: scores.clone(), why })
}

/// The pred mask of `opts` (its `mask` and `key_padding_mask` together),
/// rank 4 and broadcastable to `scores`.
fn attention_mask(opts: AttentionOptions<'_>, scores: &Shape) -> Result<Option<Tensor>> {
    let op = "attention";
    let mask = match opts.mask {
        Some(m) => {
            fits_scores(op, "mask", m, scores)?;
            if m.dtype() != DType::Pred {
                let why = "must be a pred (i1): true keeps a score".to_string();
                let got = Box::new(m.ty().clone());
                return Err(FrontendError::AttentionOperand { op, what: "mask", got, scores: scores.clone(), why });
            }
            Some(m.clone())
        }
        None => None,
    };
    let Some(kpm) = opts.key_padding_mask else { return Ok(mask) };
    let (b, s) = (scores.dims()[0], scores.dims()[3]);
    if kpm.dims() != [b, s] {
        let why = format!("must be [batch, kv_seq] = [{b}, {s}]");
        let got = Box::new(kpm.ty().clone());
        return Err(FrontendError::AttentionOperand { op, what: "key_padding_mask", got, scores: scores.clone(), why });
    }
    let keep =
        if kpm.dtype() == DType::Pred { kpm.clone() } else { kpm.ne(&Tensor::zeros(kpm.dtype(), Shape::scalar())?)? };
    let keep = keep.reshape([b, 1, 1, s])?;
    Ok(Some(match mask {
        None => keep,
        Some(m) => {
            let shape: Vec<usize> = m.dims().iter().zip(keep.dims()).map(|(&a, &k)| a.max(k)).collect();
            m.broadcast_to(shape.clone())?.binary(BinaryOp::And, &keep.broadcast_to(shape)?)?
        }
    }))
}

/// Multi-head causal self-attention with a fused qkv projection.
///
/// The projection's output features have their own shape, `[3, heads,
/// head_dim]` (weight `[dim, 3, heads, head_dim]`, bias `[3, heads,
/// head_dim]`): the row-major values of the flat `[dim, 3·dim]` projection,
/// so the init draws and the arithmetic are those of the flat one, but the
/// head axis is a dimension a sharding can name. Tensor parallelism splits
/// it (`shard::ShardPolicy::TensorParallel`): each device then holds q, k
/// and v of the same contiguous group of heads, and the attention runs on
/// its heads with no communication (`docs/sharding.md`).
#[derive(Clone, Debug)]
pub struct CausalSelfAttention {
    pub qkv: Linear,
    pub proj: Linear,
    pub heads: usize,
}

impl CausalSelfAttention {
    pub fn new(ps: &mut ParamStore, name: &str, dim: usize, heads: usize, std: f64, proj_std: f64) -> Result<Self> {
        if dim % heads != 0 {
            return Err(FrontendError::HyperParameter {
                op: "attention",
                name: "heads",
                value: heads as f64,
                expected: "a divisor of the model width",
            });
        }
        Ok(CausalSelfAttention {
            qkv: Linear::new_normal_shaped(ps, &format!("{name}.qkv"), dim, &[3, heads, dim / heads], std)?,
            proj: Linear::new_normal(ps, &format!("{name}.proj"), dim, dim, proj_std)?,
            heads,
        })
    }

    /// `x: [batch, seq, dim]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _layer = scope::enter_owner_of(&self.qkv.weight, 2);
        scoped(|| Module::describe(self), || self.forward_unscoped(x))
    }

    fn forward_unscoped(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() != 3 {
            return Err(FrontendError::Rank { op: "attention", expected: 3, got: x.ty().clone() });
        }
        let (b, t, d) = (x.dims()[0], x.dims()[1], x.dims()[2]);
        let (h, hd) = (self.heads, d / self.heads);
        // q, k, v are sliced out of `[b, t, 3, h, hd]` on the `3` axis and only
        // then permuted to `[b, h, t, hd]`: the backward then pads dq, dk, dv
        // into the projection's gradient in its own `[b, t, 3, h, hd]` order
        // (one elementwise pass, which XLA fuses with the qkv bias reduction),
        // and on CUDA the permute cancels against the BTNH layout of the cuDNN
        // call. Slicing on a leading `3` axis instead cost a transpose of the
        // whole gradient plus a separate bias reduction per layer
        // (`docs/composites.md`).
        // The projection gives `[b, t, 3, h, hd]` itself (a flat `[dim,
        // 3·dim]` Linear put in the public field by hand is reshaped).
        let qkv = self.qkv.forward(x)?;
        let qkv = if qkv.dims() == [b, t, 3, h, hd] { qkv } else { qkv.reshape([b, t, 3, h, hd])? };
        let pick = |i: usize| qkv.narrow(2, i, 1)?.reshape([b, t, h, hd])?.permute(vec![0, 2, 1, 3]);
        let (q, k, v) = (pick(0)?, pick(1)?, pick(2)?);
        let y = scaled_dot_product_attention(&q, &k, &v, true)?.permute(vec![0, 2, 1, 3])?.reshape([b, t, d])?;
        self.proj.forward(&y)
    }
}

impl Module for CausalSelfAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        CausalSelfAttention::forward(self, x)
    }
    fn describe(&self) -> String {
        format!("CausalSelfAttention({}, {} heads)", self.proj.weight.dims()[1], self.heads)
    }
    fn children(&self) -> Vec<&dyn Module> {
        vec![&self.qkv, &self.proj]
    }
}
