//! A GPT-2-style decoder: learned position embeddings, pre-norm blocks with
//! a fused `c_attn` projection to q, k and v, causal self-attention, a
//! GELU (tanh) feed-forward, a final LayerNorm and a head tied to the token
//! embedding.
//!
//! [`Spelling::Plain`] writes attention as Hugging Face's eager
//! `GPT2Attention` does: q, k, v split out of `c_attn`'s output, the scores
//! divided by `sqrt(head_dim)`, the causal mask as a constant additive table
//! (0 on and below the diagonal, -inf above), a softmax in f32; LayerNorm from
//! the mean and the mean of squares; the loss as `log_softmax` against one-hot
//! labels. [`Spelling::Builtin`] uses `nn::attention`, `nn::LayerNorm` and
//! `nn::lm_head_cross_entropy`.

use kiln_compiler::ir::DType;
use kiln_frontend::nn::{self, AttentionOptions, Embedding, LayerNorm, Linear, Module, ParamStore};
use kiln_frontend::{FrontendError, Result, Tensor};

use crate::Spelling;

/// The model's sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpt2Config {
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub max_positions: usize,
    pub eps: f64,
}

impl Gpt2Config {
    /// `gpt2`'s sizes (124M parameters), the vocabulary padded to 50304.
    pub fn gpt2() -> Gpt2Config {
        Gpt2Config { vocab: 50304, dim: 768, layers: 12, heads: 12, max_positions: 1024, eps: 1e-5 }
    }

    /// A few thousand parameters, for tests on the CPU plugin.
    pub fn tiny() -> Gpt2Config {
        Gpt2Config { vocab: 59, dim: 32, layers: 2, heads: 4, max_positions: 16, eps: 1e-5 }
    }
}

struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
}

/// The decoder; its loss is the mean next-token cross-entropy.
pub struct Gpt2 {
    pub cfg: Gpt2Config,
    pub spelling: Spelling,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
}

impl Gpt2 {
    pub fn new(ps: &mut ParamStore, cfg: Gpt2Config, spelling: Spelling) -> Result<Gpt2> {
        if cfg.heads == 0 || cfg.dim % cfg.heads != 0 {
            let (value, expected) = (cfg.heads as f64, "a divisor of dim");
            return Err(FrontendError::HyperParameter { op: "gpt2", name: "heads", value, expected });
        }
        let d = cfg.dim;
        let std = 0.02;
        let proj_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
        let norm = |ps: &mut ParamStore, name: String| -> Result<LayerNorm> {
            Ok(LayerNorm { eps: cfg.eps, ..LayerNorm::new(ps, &name, d)? })
        };
        let wte = Embedding::new(ps, "transformer.wte", cfg.vocab, d, std)?;
        let wpe = Embedding::new(ps, "transformer.wpe", cfg.max_positions, d, 0.01)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("transformer.h.{l}");
            blocks.push(Block {
                ln_1: norm(ps, format!("{p}.ln_1"))?,
                c_attn: Linear::new_normal(ps, &format!("{p}.attn.c_attn"), d, 3 * d, std)?,
                attn_proj: Linear::new_normal(ps, &format!("{p}.attn.c_proj"), d, d, proj_std)?,
                ln_2: norm(ps, format!("{p}.ln_2"))?,
                c_fc: Linear::new_normal(ps, &format!("{p}.mlp.c_fc"), d, 4 * d, std)?,
                mlp_proj: Linear::new_normal(ps, &format!("{p}.mlp.c_proj"), 4 * d, d, proj_std)?,
            });
        }
        let ln_f = norm(ps, "transformer.ln_f".into())?;
        Ok(Gpt2 { cfg, spelling, wte, wpe, blocks, ln_f })
    }

    fn layer_norm(&self, n: &LayerNorm, x: &Tensor) -> Result<Tensor> {
        match self.spelling {
            Spelling::Builtin => n.forward(x),
            Spelling::Plain => {
                let x = x.to_dtype(DType::F32)?;
                let mean = x.mean(&[-1], true)?;
                let var = x.square()?.mean(&[-1], true)?.sub(&mean.square()?)?;
                let xhat = x.sub(&mean)?.mul(&var.add_scalar(n.eps)?.rsqrt()?)?;
                xhat.mul(&n.gamma)?.add(&n.beta)
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
        let (t, hd) = (q.dims()[2], q.dims()[3]);
        // The causal table `triu(-inf, 1)`: 0 kept, -inf masked, built in
        // the graph (a table uploaded from the host would be a program input,
        // whose values the compiler cannot read: `docs/composites.md`).
        let above = Tensor::iota(DType::I32, [t, t], 1)?.gt(&Tensor::iota(DType::I32, [t, t], 0)?)?;
        let inf = Tensor::full(f64::NEG_INFINITY, DType::F32, [t, t])?;
        let causal = Tensor::where_cond(&above, &inf, &Tensor::zeros(DType::F32, [t, t])?)?;
        let scores = q.matmul(&k.transpose(-1, -2)?)?.to_dtype(DType::F32)?;
        let mut scores = scores.div(&Tensor::full((hd as f64).sqrt(), DType::F32, [])?)?.add(&causal)?;
        if let Some(docs) = docs {
            scores = Tensor::where_cond(docs, &scores, &Tensor::full(f64::NEG_INFINITY, DType::F32, [])?)?;
        }
        scores.softmax(-1)?.to_dtype(v.dtype())?.matmul(v)
    }

    fn block(
        &self,
        blk: &Block,
        x: &Tensor,
        cache: Option<(&mut crate::generate::LayerCache, &Tensor)>,
        docs: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, t, d) = (x.dims()[0], x.dims()[1], self.cfg.dim);
        let (h, hd) = (self.cfg.heads, d / self.cfg.heads);
        let qkv = blk.c_attn.forward(&self.layer_norm(&blk.ln_1, x)?)?;
        let split = |i: usize| qkv.narrow(2, i * d, d)?.reshape([b, t, h, hd])?.permute(vec![0, 2, 1, 3]);
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let a = match cache {
            None => self.attention(&q, &k, &v, docs)?,
            Some((c, pos)) => c.attend(&q, &k, &v, pos)?,
        };
        let a = a.permute(vec![0, 2, 1, 3])?.reshape([b, t, d])?;
        let x = x.add(&blk.attn_proj.forward(&a)?)?;
        let m = nn::gelu_tanh(&blk.c_fc.forward(&self.layer_norm(&blk.ln_2, &x)?)?)?;
        x.add(&blk.mlp_proj.forward(&m)?)
    }

    /// The final hidden states `[b, t, dim]` of `ids: [b, t]`.
    pub fn hidden(&self, ids: &Tensor) -> Result<Tensor> {
        self.hidden_packed(ids, None)
    }

    /// [`Gpt2::hidden`] of rows that pack several documents: attention
    /// within each document, positions from each one's start.
    pub fn hidden_packed(&self, ids: &Tensor, packing: Option<&crate::Packing>) -> Result<Tensor> {
        if ids.rank() != 2 {
            return Err(FrontendError::Rank { op: "gpt2", expected: 2, got: ids.ty().clone() });
        }
        let t = ids.dims()[1];
        if t > self.cfg.max_positions {
            let reason = format!("{t} tokens a sequence, more than the {} positions", self.cfg.max_positions);
            return Err(FrontendError::InvalidArgument { op: "gpt2", reason });
        }
        let pos = match packing {
            Some(p) => p.positions.clone(),
            None => Tensor::iota(DType::I32, [t], 0)?,
        };
        let docs = packing.map(crate::Packing::same_document).transpose()?;
        let mut x = self.wte.forward(ids)?.add(&self.wpe.forward(&pos)?)?;
        for blk in &self.blocks {
            x = self.block(blk, &x, None, docs.as_ref())?;
        }
        self.layer_norm(&self.ln_f, &x)
    }

    /// An empty key/value cache for `batch` sequences of up to `context`
    /// tokens.
    pub fn new_cache(&self, batch: usize, context: usize) -> Result<crate::generate::KvCache> {
        let (h, hd) = (self.cfg.heads, self.cfg.dim / self.cfg.heads);
        crate::generate::KvCache::new(self.cfg.layers, [batch, h, context, hd], DType::F32)
    }

    /// The logits `[b, t, vocab]` (f32) of `ids: [b, t]` at positions `pos
    /// ..pos + t` (`pos` an i32 scalar tensor), attending to the cache's
    /// earlier tokens; their keys and values are written into the cache.
    pub fn decode(&self, ids: &Tensor, pos: &Tensor, cache: &mut crate::generate::KvCache) -> Result<Tensor> {
        let t = ids.dims()[1];
        let positions = Tensor::iota(DType::I32, [t], 0)?.add(pos)?;
        let mut x = self.wte.forward(ids)?.add(&self.wpe.forward(&positions)?)?;
        for (blk, c) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            x = self.block(blk, &x, Some((c, pos)), None)?;
        }
        self.layer_norm(&self.ln_f, &x)?.matmul(&self.wte.table.t()?)?.to_dtype(DType::F32)
    }

    /// The tied head's logits `[b, t, vocab]` for `ids: [b, t]` (what
    /// Hugging Face's `GPT2LMHeadModel` returns as `logits`).
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        self.logits_packed(ids, None)
    }

    /// [`Gpt2::logits`] of packed rows ([`Gpt2::hidden_packed`]).
    pub fn logits_packed(&self, ids: &Tensor, packing: Option<&crate::Packing>) -> Result<Tensor> {
        let h = self.hidden_packed(ids, packing)?;
        h.matmul(&self.wte.table.t()?)
    }

    /// Mean cross-entropy of the tied head's predictions for `ids: [b, t]`
    /// against `targets: [b · t]`.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.loss_packed(ids, targets, None)
    }

    /// [`Gpt2::loss`] of packed rows ([`Gpt2::hidden_packed`]).
    pub fn loss_packed(&self, ids: &Tensor, targets: &Tensor, packing: Option<&crate::Packing>) -> Result<Tensor> {
        let h = self.hidden_packed(ids, packing)?;
        let n = h.dims()[0] * h.dims()[1];
        let h = h.reshape([n, self.cfg.dim])?;
        match self.spelling {
            Spelling::Builtin => nn::lm_head_cross_entropy(&h, &self.wte.table, targets),
            Spelling::Plain => {
                let logits = h.matmul(&self.wte.table.t()?)?.to_dtype(DType::F32)?;
                let onehot = nn::one_hot(targets, self.cfg.vocab, DType::F32)?;
                logits.log_softmax(-1)?.mul(&onehot)?.sum(&[-1], false)?.neg()?.mean_all()
            }
        }
    }
}

impl Module for Gpt2 {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.hidden(ids)
    }
    fn describe(&self) -> String {
        format!("Gpt2({} layers, dim {}, {} heads)", self.cfg.layers, self.cfg.dim, self.cfg.heads)
    }
    fn children(&self) -> Vec<&dyn Module> {
        let mut out: Vec<&dyn Module> = vec![&self.wte, &self.wpe];
        for b in &self.blocks {
            out.extend([&b.ln_1 as &dyn Module, &b.c_attn, &b.attn_proj, &b.ln_2, &b.c_fc, &b.mlp_proj]);
        }
        out.push(&self.ln_f);
        out
    }
}
