//! A T5-style encoder-decoder: RMS-style norms without bias or mean before
//! each sublayer, no scaling of the attention scores, relative position
//! buckets turned into a learned per-head bias (one table per stack, in its
//! first block, shared by the stack's blocks), a decoder with causal
//! self-attention and cross-attention to the encoder, a gated-GELU or ReLU
//! feed-forward, and a head tied to the shared embedding (the decoder's
//! output scaled by `d_model^-0.5`, as T5 does).
//!
//! [`Spelling::Plain`] writes attention as Hugging Face's `T5Attention` does:
//! `q kᵀ + position_bias`, keys masked with `where` against the dtype's
//! lowest value, a softmax in f32; the norm as `x · rsqrt(mean(x²) + eps)`.
//! [`Spelling::Builtin`] uses `nn::attention` (scale 1, the bias, the key
//! padding mask, causal) and `nn::RmsNorm`.

use kiln_compiler::ir::{CompareDir, DType};
use kiln_frontend::nn::{self, AttentionOptions, Embedding, Linear, Module, ParamStore, RmsNorm};
use kiln_frontend::{FrontendError, Result, Tensor};

use crate::Spelling;

/// T5's feed-forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedForward {
    /// `wo(relu(wi x))` (t5-small, t5-base).
    Relu,
    /// `wo(gelu_tanh(wi_0 x) · wi_1 x)` (T5 v1.1).
    GatedGelu,
}

/// The model's sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct T5Config {
    pub vocab: usize,
    pub d_model: usize,
    /// The size of one head.
    pub d_kv: usize,
    pub heads: usize,
    pub d_ff: usize,
    pub layers: usize,
    pub decoder_layers: usize,
    pub buckets: usize,
    pub max_distance: usize,
    pub feed_forward: FeedForward,
    pub eps: f64,
    /// Whether the output head is the shared embedding (else its own
    /// `lm_head.weight`, `[vocab, d_model]`, as T5 v1.1 checkpoints have).
    pub tie_embeddings: bool,
    /// Whether the decoder's output is scaled by `d_model^-0.5` before the
    /// head (T5; not T5 v1.1).
    pub scale_decoder_output: bool,
}

impl T5Config {
    /// `t5-small`'s sizes (60M parameters).
    pub fn t5_small() -> T5Config {
        T5Config {
            vocab: 32128,
            d_model: 512,
            d_kv: 64,
            heads: 8,
            d_ff: 2048,
            layers: 6,
            decoder_layers: 6,
            buckets: 32,
            max_distance: 128,
            feed_forward: FeedForward::Relu,
            eps: 1e-6,
            tie_embeddings: true,
            scale_decoder_output: true,
        }
    }

    /// `t5-base`'s sizes (220M parameters).
    pub fn t5_base() -> T5Config {
        T5Config { d_model: 768, heads: 12, d_ff: 3072, layers: 12, decoder_layers: 12, ..T5Config::t5_small() }
    }

    /// A few thousand parameters, for tests on the CPU plugin.
    pub fn tiny() -> T5Config {
        T5Config {
            vocab: 47,
            d_model: 32,
            d_kv: 8,
            heads: 4,
            d_ff: 48,
            layers: 2,
            decoder_layers: 2,
            buckets: 8,
            max_distance: 20,
            feed_forward: FeedForward::GatedGelu,
            eps: 1e-6,
            tie_embeddings: true,
            scale_decoder_output: true,
        }
    }
}

struct Attn {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
}

enum Ff {
    Relu { wi: Linear, wo: Linear },
    Gated { wi_0: Linear, wi_1: Linear, wo: Linear },
}

struct Block {
    self_norm: RmsNorm,
    self_attn: Attn,
    /// The decoder's cross-attention and its norm.
    cross: Option<(RmsNorm, Attn)>,
    ff_norm: RmsNorm,
    ff: Ff,
}

struct Stack {
    blocks: Vec<Block>,
    /// `[buckets, heads]`, in the stack's first block.
    relative_bias: Embedding,
    final_norm: RmsNorm,
    bidirectional: bool,
}

/// The encoder-decoder with its LM head.
pub struct T5 {
    pub cfg: T5Config,
    pub spelling: Spelling,
    shared: Embedding,
    encoder: Stack,
    decoder: Stack,
    /// The untied head's table `[vocab, d_model]`.
    lm_head: Option<Tensor>,
}

/// An encoder input and a decoder target, padded: `[batch, seq]` ids and
/// masks (1 for a token, 0 for padding); the decoder reads `labels` shifted
/// right after a start token 0.
pub struct T5Batch {
    pub input_ids: Tensor,
    pub input_mask: Tensor,
    pub labels: Tensor,
    pub label_mask: Tensor,
}

impl T5 {
    pub fn new(ps: &mut ParamStore, cfg: T5Config, spelling: Spelling) -> Result<T5> {
        let inner = cfg.heads * cfg.d_kv;
        let d = cfg.d_model;
        let lin = |ps: &mut ParamStore, name: String, i: usize, o: usize| Linear::new(ps, &name, i, o, false);
        let norm = |ps: &mut ParamStore, name: String| -> Result<RmsNorm> {
            Ok(RmsNorm { eps: cfg.eps, ..RmsNorm::new(ps, &name, d)? })
        };
        let attn = |ps: &mut ParamStore, p: String| -> Result<Attn> {
            Ok(Attn {
                q: lin(ps, format!("{p}.q"), d, inner)?,
                k: lin(ps, format!("{p}.k"), d, inner)?,
                v: lin(ps, format!("{p}.v"), d, inner)?,
                o: lin(ps, format!("{p}.o"), inner, d)?,
            })
        };
        let shared = Embedding::new(ps, "shared", cfg.vocab, d, 1.0)?;
        let stack = |ps: &mut ParamStore, name: &str, layers: usize, decoder: bool| -> Result<Stack> {
            let mut blocks = Vec::with_capacity(layers);
            let mut relative_bias = None;
            for l in 0..layers {
                let p = format!("{name}.block.{l}.layer");
                let self_norm = norm(ps, format!("{p}.0.layer_norm"))?;
                let self_attn = attn(ps, format!("{p}.0.SelfAttention"))?;
                if l == 0 {
                    let t = format!("{p}.0.SelfAttention.relative_attention_bias");
                    relative_bias = Some(Embedding::new(ps, &t, cfg.buckets, cfg.heads, 0.5)?);
                }
                let (cross, f) = if decoder {
                    (Some((norm(ps, format!("{p}.1.layer_norm"))?, attn(ps, format!("{p}.1.EncDecAttention"))?)), 2)
                } else {
                    (None, 1)
                };
                let ff_norm = norm(ps, format!("{p}.{f}.layer_norm"))?;
                let ff = match cfg.feed_forward {
                    FeedForward::Relu => Ff::Relu {
                        wi: lin(ps, format!("{p}.{f}.DenseReluDense.wi"), d, cfg.d_ff)?,
                        wo: lin(ps, format!("{p}.{f}.DenseReluDense.wo"), cfg.d_ff, d)?,
                    },
                    FeedForward::GatedGelu => Ff::Gated {
                        wi_0: lin(ps, format!("{p}.{f}.DenseReluDense.wi_0"), d, cfg.d_ff)?,
                        wi_1: lin(ps, format!("{p}.{f}.DenseReluDense.wi_1"), d, cfg.d_ff)?,
                        wo: lin(ps, format!("{p}.{f}.DenseReluDense.wo"), cfg.d_ff, d)?,
                    },
                };
                blocks.push(Block { self_norm, self_attn, cross, ff_norm, ff });
            }
            let relative_bias = relative_bias.ok_or(FrontendError::HyperParameter {
                op: "t5",
                name: "layers",
                value: 0.0,
                expected: "at least 1 in each stack",
            })?;
            let final_norm = norm(ps, format!("{name}.final_layer_norm"))?;
            Ok(Stack { blocks, relative_bias, final_norm, bidirectional: !decoder })
        };
        let encoder = stack(ps, "encoder", cfg.layers, false)?;
        let decoder = stack(ps, "decoder", cfg.decoder_layers, true)?;
        let lm_head = if cfg.tie_embeddings { None } else { Some(ps.normal("lm_head.weight", [cfg.vocab, d], 1.0)?) };
        Ok(T5 { cfg, spelling, shared, encoder, decoder, lm_head })
    }

    fn norm(&self, n: &RmsNorm, x: &Tensor) -> Result<Tensor> {
        match self.spelling {
            Spelling::Builtin => n.forward(x),
            Spelling::Plain => {
                let x32 = x.to_dtype(DType::F32)?;
                let var = x32.mul(&x32)?.mean(&[-1], true)?;
                n.gamma.mul(&x32.mul(&var.add_scalar(self.cfg.eps)?.rsqrt()?)?.to_dtype(x.dtype())?)
            }
        }
    }

    /// T5's relative position buckets `[t, s]` (i32) of query `i` and key `j`,
    /// computed in the graph from the distance `j - i`: exact buckets for
    /// small distances, logarithmic ones up to `max_distance`, and (for a
    /// bidirectional stack) half the buckets for keys after the query.
    fn buckets(&self, t: usize, s: usize, bidirectional: bool) -> Result<Tensor> {
        let rel = Tensor::iota(DType::I32, [t, s], 1)?.sub(&Tensor::iota(DType::I32, [t, s], 0)?)?;
        let zero = Tensor::zeros(DType::I32, [])?;
        let (mut buckets, mut ret) = (self.cfg.buckets as i64, Tensor::zeros(DType::I32, [t, s])?);
        let n = if bidirectional {
            buckets /= 2;
            let after = rel.compare(CompareDir::Gt, &zero)?.to_dtype(DType::I32)?;
            ret = ret.add(&after.mul_scalar(buckets as f64)?)?;
            rel.abs()?
        } else {
            rel.neg()?.maximum(&zero)?
        };
        let exact = buckets / 2;
        let is_small = n.compare(CompareDir::Lt, &Tensor::full(exact as f64, DType::I32, [])?)?;
        let nf = n.to_dtype(DType::F32)?.maximum(&Tensor::full(1.0, DType::F32, [])?)?;
        let scale = (buckets - exact) as f64 / (self.cfg.max_distance as f64 / exact as f64).ln();
        let large = nf.mul_scalar(1.0 / exact as f64)?.log()?.mul_scalar(scale)?.to_dtype(DType::I32)?;
        let large = large.add_scalar(exact as f64)?.minimum(&Tensor::full((buckets - 1) as f64, DType::I32, [])?)?;
        ret.add(&Tensor::where_cond(&is_small, &n, &large)?)
    }

    /// The stack's position bias `[1, heads, t, s]`.
    fn position_bias(&self, stack: &Stack, t: usize, s: usize) -> Result<Tensor> {
        let b = stack.relative_bias.forward(&self.buckets(t, s, stack.bidirectional)?)?; // [t, s, h]
        b.permute(vec![2, 0, 1])?.reshape([1, self.cfg.heads, t, s])
    }

    fn heads(&self, x: Tensor) -> Result<Tensor> {
        let (b, s) = (x.dims()[0], x.dims()[1]);
        x.reshape([b, s, self.cfg.heads, self.cfg.d_kv])?.permute(vec![0, 2, 1, 3])
    }

    /// `x` attending to `kv` (itself, or the encoder's output), its keys
    /// masked by `key_mask: [b, s]`, with `bias` and causality.
    fn attend(
        &self,
        a: &Attn,
        x: &Tensor,
        kv: &Tensor,
        key_mask: &Tensor,
        bias: Option<&Tensor>,
        causal: bool,
    ) -> Result<Tensor> {
        let (b, t) = (x.dims()[0], x.dims()[1]);
        let (q, k, v) = (self.heads(a.q.forward(x)?)?, self.heads(a.k.forward(kv)?)?, self.heads(a.v.forward(kv)?)?);
        let o = match self.spelling {
            Spelling::Builtin => {
                let opts =
                    AttentionOptions { causal, scale: Some(1.0), key_padding_mask: Some(key_mask), bias, mask: None };
                nn::attention(&q, &k, &v, opts)?
            }
            Spelling::Plain => {
                let s = k.dims()[2];
                let mut scores = q.matmul(&k.transpose(3, 2)?)?.to_dtype(DType::F32)?;
                if let Some(bias) = bias {
                    scores = scores.add(bias)?;
                }
                let mut keep = key_mask.compare(CompareDir::Ne, &Tensor::zeros(key_mask.dtype(), [])?)?;
                keep = keep.reshape([b, 1, 1, s])?;
                if causal {
                    let tri = Tensor::iota(DType::I32, [t, s], 1)?.le(&Tensor::iota(DType::I32, [t, s], 0)?)?;
                    keep = keep
                        .broadcast_to([b, 1, t, s])?
                        .binary(kiln_compiler::ir::BinaryOp::And, &tri.broadcast_to([b, 1, t, s])?)?;
                }
                let lowest = Tensor::full(f64::from(f32::MIN), DType::F32, [])?;
                let p = Tensor::where_cond(&keep, &scores, &lowest)?.softmax(-1)?.to_dtype(v.dtype())?;
                p.matmul(&v)?
            }
        };
        a.o.forward(&o.permute(vec![0, 2, 1, 3])?.reshape([b, t, self.cfg.heads * self.cfg.d_kv])?)
    }

    fn feed_forward(&self, ff: &Ff, x: &Tensor) -> Result<Tensor> {
        match ff {
            Ff::Relu { wi, wo } => wo.forward(&wi.forward(x)?.relu()?),
            Ff::Gated { wi_0, wi_1, wo } => wo.forward(&nn::gelu_tanh(&wi_0.forward(x)?)?.mul(&wi_1.forward(x)?)?),
        }
    }

    /// Runs `stack` over the embedded `x`; `memory` is the encoder's output
    /// and mask for the decoder.
    fn run(&self, stack: &Stack, x: Tensor, mask: &Tensor, memory: Option<(&Tensor, &Tensor)>) -> Result<Tensor> {
        let t = x.dims()[1];
        let bias = self.position_bias(stack, t, t)?;
        let causal = !stack.bidirectional;
        let mut x = x;
        for blk in &stack.blocks {
            let n = self.norm(&blk.self_norm, &x)?;
            x = x.add(&self.attend(&blk.self_attn, &n, &n, mask, Some(&bias), causal)?)?;
            if let (Some((norm, attn)), Some((enc, enc_mask))) = (&blk.cross, memory) {
                let n = self.norm(norm, &x)?;
                x = x.add(&self.attend(attn, &n, enc, enc_mask, None, false)?)?;
            }
            let n = self.norm(&blk.ff_norm, &x)?;
            x = x.add(&self.feed_forward(&blk.ff, &n)?)?;
        }
        self.norm(&stack.final_norm, &x)
    }

    /// The encoder's output `[b, s, d_model]`.
    pub fn encode(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        self.run(&self.encoder, self.shared.forward(ids)?, mask, None)
    }

    /// The head's logits `[b · t, vocab]` (f32) for the decoder reading
    /// `dec_ids: [b, t]` (its padding mask `dec_mask`) over the encoder's
    /// reading of `ids` (`mask`).
    fn decode(&self, ids: &Tensor, mask: &Tensor, dec_ids: &Tensor, dec_mask: &Tensor) -> Result<Tensor> {
        let two_d = |x: &Tensor| x.rank() == 2;
        if !(two_d(ids) && two_d(dec_ids) && ids.dims()[0] == dec_ids.dims()[0])
            || mask.dims() != ids.dims()
            || dec_mask.dims() != dec_ids.dims()
        {
            let reason = format!(
                "input ids {} (mask {}) and decoder ids {} (mask {}) must be [batch, seq] with masks of their shapes",
                ids.ty(),
                mask.ty(),
                dec_ids.ty(),
                dec_mask.ty()
            );
            return Err(FrontendError::InvalidArgument { op: "t5", reason });
        }
        let enc = self.encode(ids, mask)?;
        let (b, t) = (dec_ids.dims()[0], dec_ids.dims()[1]);
        let mut h = self.run(&self.decoder, self.shared.forward(dec_ids)?, dec_mask, Some((&enc, mask)))?;
        if self.cfg.scale_decoder_output {
            h = h.mul_scalar((self.cfg.d_model as f64).powf(-0.5))?;
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.shared.table);
        h.reshape([b * t, self.cfg.d_model])?.matmul(&head.t()?)?.to_dtype(DType::F32)
    }

    /// The logits `[b, t, vocab]` (f32) of the decoder reading `dec_ids: [b,
    /// t]` (no padding) over the encoder's reading of `ids` (padding mask
    /// `mask`): `T5ForConditionalGeneration`'s output for `decoder_input_ids`.
    pub fn logits(&self, ids: &Tensor, mask: &Tensor, dec_ids: &Tensor) -> Result<Tensor> {
        let dec_mask = Tensor::ones(DType::I32, dec_ids.shape().clone())?;
        let logits = self.decode(ids, mask, dec_ids, &dec_mask)?;
        logits.reshape([dec_ids.dims()[0], dec_ids.dims()[1], self.cfg.vocab])
    }

    /// The mean cross-entropy of the decoder's predictions of `labels` over
    /// their unpadded positions (teacher forcing).
    pub fn loss(&self, batch: &T5Batch) -> Result<Tensor> {
        let (ids, labels) = (&batch.input_ids, &batch.labels);
        if ids.rank() != 2 || labels.rank() != 2 || ids.dims()[0] != labels.dims()[0] {
            let reason = format!("input ids {} and labels {} must be [batch, seq]", ids.ty(), labels.ty());
            return Err(FrontendError::InvalidArgument { op: "t5", reason });
        }
        let (b, t) = (labels.dims()[0], labels.dims()[1]);
        // Decoder inputs: the labels shifted right after the start token 0.
        let start = Tensor::zeros(labels.dtype(), [b, 1])?;
        let dec_ids = Tensor::cat(&[start, labels.narrow(1, 0, t - 1)?], 1)?;
        let dec_mask =
            Tensor::cat(&[Tensor::ones(batch.label_mask.dtype(), [b, 1])?, batch.label_mask.narrow(1, 0, t - 1)?], 1)?;
        let logits = self.decode(ids, &batch.input_mask, &dec_ids, &dec_mask)?;
        let flat = labels.reshape([b * t])?;
        let weights = batch.label_mask.reshape([b * t])?.to_dtype(DType::F32)?;
        match self.spelling {
            Spelling::Builtin => nn::cross_entropy(&logits, &flat, Some(&weights)),
            Spelling::Plain => {
                let logp = logits.log_softmax(-1)?;
                let nll = logp.mul(&nn::one_hot(&flat, self.cfg.vocab, DType::F32)?)?.sum(&[-1], false)?.neg()?;
                nll.mul(&weights)?.sum_all()?.div(&weights.sum_all()?)
            }
        }
    }
}

impl Module for T5 {
    /// Not a one-input model: use [`T5::loss`] or [`T5::encode`].
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(FrontendError::InvalidArgument { op: "t5", reason: "takes a T5Batch: call T5::loss".into() })
    }
    fn describe(&self) -> String {
        format!(
            "T5({}+{} layers, d_model {}, {} heads)",
            self.cfg.layers, self.cfg.decoder_layers, self.cfg.d_model, self.cfg.heads
        )
    }
    fn children(&self) -> Vec<&dyn Module> {
        let mut out: Vec<&dyn Module> = vec![&self.shared];
        for stack in [&self.encoder, &self.decoder] {
            for (i, blk) in stack.blocks.iter().enumerate() {
                out.push(&blk.self_norm);
                let a = &blk.self_attn;
                out.extend([&a.q as &dyn Module, &a.k, &a.v, &a.o]);
                if i == 0 {
                    out.push(&stack.relative_bias);
                }
                if let Some((n, a)) = &blk.cross {
                    out.extend([n as &dyn Module, &a.q, &a.k, &a.v, &a.o]);
                }
                out.push(&blk.ff_norm);
                match &blk.ff {
                    Ff::Relu { wi, wo } => out.extend([wi as &dyn Module, wo]),
                    Ff::Gated { wi_0, wi_1, wo } => out.extend([wi_0 as &dyn Module, wi_1, wo]),
                }
            }
            out.push(&stack.final_norm);
        }
        out
    }
    fn own_parameters(&self) -> Vec<Tensor> {
        self.lm_head.iter().cloned().collect()
    }
}
