//! A Llama-style decoder: RMSNorm before each sublayer, grouped-query
//! attention (fewer key/value heads than query heads) with rotary position
//! embeddings computed in the graph, a SwiGLU feed-forward, and the output
//! head tied to the token embedding.
//!
//! [`Spelling::Plain`] writes it as Hugging Face's eager `LlamaAttention`
//! does: key/value heads repeated by broadcast + reshape (`repeat_kv`), the
//! causal mask from two `iota`s compared, `where` against -1e9, a softmax in
//! f32; RMSNorm as `x · rsqrt(mean(x²) + eps)` in f32; the loss as
//! `log_softmax` of the tied head's logits against one-hot labels.
//! [`Spelling::Builtin`] uses `nn::attention` (grouped heads, no copies),
//! `nn::RmsNorm` and `nn::lm_head_cross_entropy`.

use kiln_compiler::ir::DType;
use kiln_frontend::nn::{self, AttentionOptions, Embedding, Linear, Module, ParamStore, RmsNorm};
use kiln_frontend::{FrontendError, Result, Tensor};

use crate::Spelling;

/// The model's sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// SwiGLU's hidden width.
    pub ffn: usize,
    pub rope_theta: f64,
    pub eps: f64,
    /// Whether the output head is the token embedding (else its own
    /// `lm_head.weight`, `[vocab, dim]`, as Hugging Face's Llama defaults).
    pub tie_embeddings: bool,
}

impl LlamaConfig {
    /// About 110M parameters (85M in the blocks): 12 layers of width 768, 12
    /// query heads sharing 4 key/value heads, a 32k vocabulary.
    pub fn llama_110m() -> LlamaConfig {
        LlamaConfig {
            vocab: 32000,
            dim: 768,
            layers: 12,
            heads: 12,
            kv_heads: 4,
            ffn: 2048,
            rope_theta: 10000.0,
            eps: 1e-5,
            tie_embeddings: true,
        }
    }

    /// A few thousand parameters, for tests on the CPU plugin.
    pub fn tiny() -> LlamaConfig {
        LlamaConfig {
            vocab: 61,
            dim: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 48,
            rope_theta: 10000.0,
            eps: 1e-5,
            tie_embeddings: true,
        }
    }

    fn head_dim(&self) -> usize {
        self.dim / self.heads
    }

    fn check(&self) -> Result<()> {
        let bad = |name, value: usize, expected| {
            Err(FrontendError::HyperParameter { op: "llama", name, value: value as f64, expected })
        };
        if self.heads == 0 || self.dim % self.heads != 0 || self.head_dim() % 2 != 0 {
            return bad("heads", self.heads, "a divisor of dim giving an even head size");
        }
        if self.kv_heads == 0 || self.heads % self.kv_heads != 0 {
            return bad("kv_heads", self.kv_heads, "a divisor of heads");
        }
        Ok(())
    }
}

struct Block {
    attn_norm: RmsNorm,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    mlp_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// The decoder; its loss is the mean next-token cross-entropy.
pub struct Llama {
    pub cfg: LlamaConfig,
    pub spelling: Spelling,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    /// The untied head's table `[vocab, dim]`.
    lm_head: Option<Tensor>,
    /// RoPE's inverse frequencies `[head_dim / 2]` f32, made once: a tensor
    /// that outlives a captured step, which the step reads as state (made
    /// inside it from host data, it would retrace every call).
    inv_freq: Tensor,
}

impl Llama {
    pub fn new(ps: &mut ParamStore, cfg: LlamaConfig, spelling: Spelling) -> Result<Llama> {
        cfg.check()?;
        let (d, hd) = (cfg.dim, cfg.head_dim());
        let linear = |ps: &mut ParamStore, name: String, i: usize, o: usize| Linear::new(ps, &name, i, o, false);
        let norm = |ps: &mut ParamStore, name: String| -> Result<RmsNorm> {
            Ok(RmsNorm { eps: cfg.eps, ..RmsNorm::new(ps, &name, d)? })
        };
        let embed = Embedding::new(ps, "model.embed_tokens", cfg.vocab, d, 0.02)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            blocks.push(Block {
                attn_norm: norm(ps, format!("{p}.input_layernorm"))?,
                wq: linear(ps, format!("{p}.self_attn.q_proj"), d, cfg.heads * hd)?,
                wk: linear(ps, format!("{p}.self_attn.k_proj"), d, cfg.kv_heads * hd)?,
                wv: linear(ps, format!("{p}.self_attn.v_proj"), d, cfg.kv_heads * hd)?,
                wo: linear(ps, format!("{p}.self_attn.o_proj"), cfg.heads * hd, d)?,
                mlp_norm: norm(ps, format!("{p}.post_attention_layernorm"))?,
                gate: linear(ps, format!("{p}.mlp.gate_proj"), d, cfg.ffn)?,
                up: linear(ps, format!("{p}.mlp.up_proj"), d, cfg.ffn)?,
                down: linear(ps, format!("{p}.mlp.down_proj"), cfg.ffn, d)?,
            });
        }
        let norm = norm(ps, "model.norm".into())?;
        let lm_head =
            if cfg.tie_embeddings { None } else { Some(ps.normal("lm_head.weight", [cfg.vocab, d], 0.02)?) };
        let half = cfg.head_dim() / 2;
        let inv: Vec<f32> =
            (0..half).map(|i| cfg.rope_theta.powf(-((2 * i) as f64) / (2 * half) as f64) as f32).collect();
        let inv_freq = Tensor::from_vec(inv, [half])?;
        Ok(Llama { cfg, spelling, embed, blocks, norm, lm_head, inv_freq })
    }

    /// `cos` and `sin` of the rotary angles, `[t, head_dim / 2]` f32, from
    /// the positions (an `iota`) and the inverse frequencies.
    fn rotary(&self, t: usize, offset: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let half = self.cfg.head_dim() / 2;
        let mut pos = Tensor::iota(DType::F32, [t, half], 0)?;
        if let Some(o) = offset {
            pos = pos.add(&o.to_dtype(DType::F32)?)?;
        }
        let angles = pos.mul(&self.inv_freq)?;
        Ok((angles.cos()?, angles.sin()?))
    }

    /// `cos` and `sin` of the rotary angles at `positions: [b, t]`, as `[b,
    /// 1, t, head_dim / 2]` (broadcast over the heads).
    fn rotary_at(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, t) = (positions.dims()[0], positions.dims()[1]);
        let pos = positions.to_dtype(DType::F32)?.reshape([b, 1, t, 1])?;
        let angles = pos.mul(&self.inv_freq)?;
        Ok((angles.cos()?, angles.sin()?))
    }

    /// `x: [b, h, t, hd]` rotated: halves `(a, b)` become
    /// `(a cos - b sin, b cos + a sin)`.
    fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let half = x.dims()[3] / 2;
        let (a, b) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
        Tensor::cat(&[a.mul(&cos)?.sub(&b.mul(&sin)?)?, b.mul(&cos)?.add(&a.mul(&sin)?)?], 3)
    }

    fn rms_norm(&self, n: &RmsNorm, x: &Tensor) -> Result<Tensor> {
        match self.spelling {
            Spelling::Builtin => n.forward(x),
            Spelling::Plain => {
                let x32 = x.to_dtype(DType::F32)?;
                let var = x32.square()?.mean(&[-1], true)?;
                let y = x32.mul(&var.add_scalar(self.cfg.eps)?.rsqrt()?)?;
                n.gamma.mul(&y.to_dtype(x.dtype())?)
            }
        }
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, docs: Option<&Tensor>) -> Result<Tensor> {
        if self.spelling == Spelling::Builtin {
            return nn::attention(
                q,
                k,
                v,
                AttentionOptions { causal: true, mask: docs, ..AttentionOptions::default() },
            );
        }
        let [b, h, t, hd] = [q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]];
        let repeat_kv = |x: &Tensor| -> Result<Tensor> {
            let hkv = x.dims()[1];
            x.broadcast_in_dim([b, hkv, h / hkv, t, hd], vec![0, 1, 3, 4])?.reshape([b, h, t, hd])
        };
        let (k, v) = (repeat_kv(k)?, repeat_kv(v)?);
        let scores = q.matmul(&k.transpose(2, 3)?)?.mul_scalar(1.0 / (hd as f64).sqrt())?;
        let mut keep = Tensor::iota(DType::I32, [t, t], 0)?.ge(&Tensor::iota(DType::I32, [t, t], 1)?)?;
        if let Some(docs) = docs {
            let causal = keep.broadcast_to([b, 1, t, t])?;
            keep = causal.binary(kiln_compiler::ir::BinaryOp::And, docs)?;
        }
        let neg = Tensor::full(-1e9, scores.dtype(), [])?;
        let scores = Tensor::where_cond(&keep, &scores, &neg)?;
        let p = scores.to_dtype(DType::F32)?.softmax(-1)?.to_dtype(q.dtype())?;
        p.matmul(&v)
    }

    fn block(
        &self,
        blk: &Block,
        x: &Tensor,
        rot: &(Tensor, Tensor),
        cache: Option<(&mut crate::generate::LayerCache, &Tensor)>,
        docs: Option<&Tensor>,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (b, t, hd) = (x.dims()[0], x.dims()[1], cfg.head_dim());
        let heads = |y: Tensor, n: usize| y.reshape([b, t, n, hd])?.permute(vec![0, 2, 1, 3]);
        let n = self.rms_norm(&blk.attn_norm, x)?;
        let q = Self::rope(&heads(blk.wq.forward(&n)?, cfg.heads)?, &rot.0, &rot.1)?;
        let k = Self::rope(&heads(blk.wk.forward(&n)?, cfg.kv_heads)?, &rot.0, &rot.1)?;
        let v = heads(blk.wv.forward(&n)?, cfg.kv_heads)?;
        let a = match cache {
            None => self.attention(&q, &k, &v, docs)?,
            Some((c, pos)) => c.attend(&q, &k, &v, pos)?,
        };
        let a = a.permute(vec![0, 2, 1, 3])?.reshape([b, t, cfg.heads * hd])?;
        let x = x.add(&blk.wo.forward(&a)?)?;
        let n = self.rms_norm(&blk.mlp_norm, &x)?;
        let g = blk.gate.forward(&n)?;
        let silu = g.mul(&g.sigmoid()?)?;
        x.add(&blk.down.forward(&silu.mul(&blk.up.forward(&n)?)?)?)
    }

    /// The final hidden states `[b, t, dim]` of `ids: [b, t]`.
    pub fn hidden(&self, ids: &Tensor) -> Result<Tensor> {
        self.hidden_packed(ids, None)
    }

    /// [`Llama::hidden`] of rows that pack several documents: attention
    /// within each document, rotary positions from each one's start.
    pub fn hidden_packed(&self, ids: &Tensor, packing: Option<&crate::Packing>) -> Result<Tensor> {
        if ids.rank() != 2 {
            return Err(FrontendError::Rank { op: "llama", expected: 2, got: ids.ty().clone() });
        }
        let rot = match packing {
            Some(p) => self.rotary_at(&p.positions)?,
            None => self.rotary(ids.dims()[1], None)?,
        };
        let docs = packing.map(crate::Packing::same_document).transpose()?;
        let mut x = self.embed.forward(ids)?;
        for blk in &self.blocks {
            x = self.block(blk, &x, &rot, None, docs.as_ref())?;
        }
        self.rms_norm(&self.norm, &x)
    }

    /// An empty key/value cache for `batch` sequences of up to `context`
    /// tokens (the key/value heads only: grouped-query attention shares them).
    pub fn new_cache(&self, batch: usize, context: usize) -> Result<crate::generate::KvCache> {
        let shape = [batch, self.cfg.kv_heads, context, self.cfg.head_dim()];
        crate::generate::KvCache::new(self.cfg.layers, shape, DType::F32)
    }

    /// The logits `[b, t, vocab]` (f32) of `ids: [b, t]` at positions `pos
    /// ..pos + t` (`pos` an i32 scalar tensor), attending to the cache's
    /// earlier tokens; their keys and values are written into the cache.
    pub fn decode(&self, ids: &Tensor, pos: &Tensor, cache: &mut crate::generate::KvCache) -> Result<Tensor> {
        let rot = self.rotary(ids.dims()[1], Some(pos))?;
        let mut x = self.embed.forward(ids)?;
        for (blk, c) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            x = self.block(blk, &x, &rot, Some((c, pos)), None)?;
        }
        let h = self.rms_norm(&self.norm, &x)?;
        h.matmul(&self.head().t()?)?.to_dtype(DType::F32)
    }

    /// The output head's table `[vocab, dim]`: the token embedding when tied.
    fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed.table)
    }

    /// The next-token logits `[b, t, vocab]` (f32) of `ids: [b, t]`:
    /// `LlamaForCausalLM`'s output.
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        self.logits_packed(ids, None)
    }

    /// [`Llama::logits`] of packed rows ([`Llama::hidden_packed`]).
    pub fn logits_packed(&self, ids: &Tensor, packing: Option<&crate::Packing>) -> Result<Tensor> {
        let h = self.hidden_packed(ids, packing)?;
        h.matmul(&self.head().t()?)?.to_dtype(DType::F32)
    }

    /// Mean cross-entropy of the head's predictions for `ids: [b, t]`
    /// against `targets: [b · t]`.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.loss_packed(ids, targets, None)
    }

    /// [`Llama::loss`] of packed rows ([`Llama::hidden_packed`]).
    pub fn loss_packed(&self, ids: &Tensor, targets: &Tensor, packing: Option<&crate::Packing>) -> Result<Tensor> {
        let h = self.hidden_packed(ids, packing)?;
        let n = h.dims()[0] * h.dims()[1];
        let h = h.reshape([n, self.cfg.dim])?;
        let table = self.head();
        match self.spelling {
            Spelling::Builtin => nn::lm_head_cross_entropy(&h, table, targets),
            Spelling::Plain => {
                let logits = h.matmul(&table.t()?)?.to_dtype(DType::F32)?;
                let logp = logits.log_softmax(-1)?;
                let onehot = nn::one_hot(targets, self.cfg.vocab, DType::F32)?;
                logp.mul(&onehot)?.sum(&[-1], false)?.neg()?.mean_all()
            }
        }
    }
}

impl Module for Llama {
    /// The final hidden states of token ids.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.hidden(ids)
    }
    fn describe(&self) -> String {
        let c = &self.cfg;
        format!("Llama({} layers, dim {}, {}/{} heads)", c.layers, c.dim, c.heads, c.kv_heads)
    }
    fn children(&self) -> Vec<&dyn Module> {
        let mut out: Vec<&dyn Module> = vec![&self.embed];
        for b in &self.blocks {
            out.extend([&b.attn_norm as &dyn Module, &b.wq, &b.wk, &b.wv, &b.wo, &b.mlp_norm, &b.gate, &b.up, &b.down]);
        }
        out.push(&self.norm);
        out
    }
    fn own_parameters(&self) -> Vec<Tensor> {
        self.lm_head.iter().cloned().collect()
    }
}
