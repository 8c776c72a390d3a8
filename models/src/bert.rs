//! A BERT-style encoder: token, position and token-type embeddings, post-norm
//! blocks (attention, then a GELU feed-forward, each followed by a residual
//! add and LayerNorm), a pooler, and a masked-LM head tied to the word
//! embeddings. Batches of unequal lengths are padded and carry a padding
//! mask `[batch, seq]` (1 for a token, 0 for padding).
//!
//! [`Spelling::Plain`] writes it as Hugging Face's eager `BertSelfAttention`
//! does: the padding mask turned into an additive `(1 - mask) · -10000`
//! `[b, 1, 1, s]`, the scores divided by `sqrt(head_dim)`, the softmax written
//! out as `exp(x - max) / Σ`; LayerNorm from the mean and variance; the loss
//! as `logsumexp - picked`. [`Spelling::Builtin`] uses `nn::attention` with
//! its `key_padding_mask`, `nn::LayerNorm` and `nn::cross_entropy`.

use kiln_compiler::ir::DType;
use kiln_frontend::nn::{self, AttentionOptions, Embedding, LayerNorm, Linear, Module, ParamStore};
use kiln_frontend::{FrontendError, Result, Tensor};

use crate::Spelling;

/// The model's sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BertConfig {
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    /// The feed-forward's hidden width.
    pub ffn: usize,
    pub max_positions: usize,
    pub type_vocab: usize,
    pub eps: f64,
}

impl BertConfig {
    /// `bert-base-uncased`'s sizes (110M parameters).
    pub fn bert_base_uncased() -> BertConfig {
        BertConfig {
            vocab: 30522,
            dim: 768,
            layers: 12,
            heads: 12,
            ffn: 3072,
            max_positions: 512,
            type_vocab: 2,
            eps: 1e-12,
        }
    }

    /// A few thousand parameters, for tests on the CPU plugin.
    pub fn tiny() -> BertConfig {
        BertConfig { vocab: 53, dim: 32, layers: 2, heads: 4, ffn: 64, max_positions: 16, type_vocab: 2, eps: 1e-12 }
    }

    fn check(&self) -> Result<()> {
        if self.heads == 0 || self.dim % self.heads != 0 {
            let (value, expected) = (self.heads as f64, "a divisor of dim");
            return Err(FrontendError::HyperParameter { op: "bert", name: "heads", value, expected });
        }
        Ok(())
    }
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_norm: LayerNorm,
}

/// The encoder with its masked-LM head.
pub struct Bert {
    pub cfg: BertConfig,
    pub spelling: Spelling,
    words: Embedding,
    positions: Embedding,
    types: Embedding,
    emb_norm: LayerNorm,
    layers: Vec<Layer>,
    pooler: Linear,
    mlm_dense: Linear,
    mlm_norm: LayerNorm,
    mlm_bias: Tensor,
}

/// One padded batch: token ids, token types and the padding mask, all
/// `[batch, seq]` (the mask 1 for a token, 0 for padding).
pub struct BertBatch {
    pub ids: Tensor,
    pub types: Tensor,
    pub mask: Tensor,
}

impl Bert {
    pub fn new(ps: &mut ParamStore, cfg: BertConfig, spelling: Spelling) -> Result<Bert> {
        cfg.check()?;
        let d = cfg.dim;
        let norm = |ps: &mut ParamStore, name: String| -> Result<LayerNorm> {
            Ok(LayerNorm { eps: cfg.eps, ..LayerNorm::new(ps, &name, d)? })
        };
        let linear = |ps: &mut ParamStore, name: String, i: usize, o: usize| Linear::new(ps, &name, i, o, true);
        let words = Embedding::new(ps, "bert.embeddings.word_embeddings", cfg.vocab, d, 0.02)?;
        let positions = Embedding::new(ps, "bert.embeddings.position_embeddings", cfg.max_positions, d, 0.02)?;
        let types = Embedding::new(ps, "bert.embeddings.token_type_embeddings", cfg.type_vocab, d, 0.02)?;
        let emb_norm = norm(ps, "bert.embeddings.LayerNorm".into())?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("bert.encoder.layer.{l}");
            layers.push(Layer {
                query: linear(ps, format!("{p}.attention.self.query"), d, d)?,
                key: linear(ps, format!("{p}.attention.self.key"), d, d)?,
                value: linear(ps, format!("{p}.attention.self.value"), d, d)?,
                attn_out: linear(ps, format!("{p}.attention.output.dense"), d, d)?,
                attn_norm: norm(ps, format!("{p}.attention.output.LayerNorm"))?,
                intermediate: linear(ps, format!("{p}.intermediate.dense"), d, cfg.ffn)?,
                output: linear(ps, format!("{p}.output.dense"), cfg.ffn, d)?,
                out_norm: norm(ps, format!("{p}.output.LayerNorm"))?,
            });
        }
        Ok(Bert {
            pooler: linear(ps, "bert.pooler.dense".into(), d, d)?,
            mlm_dense: linear(ps, "cls.predictions.transform.dense".into(), d, d)?,
            mlm_norm: norm(ps, "cls.predictions.transform.LayerNorm".into())?,
            mlm_bias: ps.constant("cls.predictions.bias", [cfg.vocab], 0.0)?,
            cfg,
            spelling,
            words,
            positions,
            types,
            emb_norm,
            layers,
        })
    }

    fn layer_norm(&self, n: &LayerNorm, x: &Tensor) -> Result<Tensor> {
        match self.spelling {
            Spelling::Builtin => n.forward(x),
            Spelling::Plain => {
                let x = x.to_dtype(DType::F32)?;
                let mean = x.mean(&[-1], true)?;
                let c = x.sub(&mean)?;
                let var = c.mul(&c)?.mean(&[-1], true)?;
                c.div(&var.add_scalar(n.eps)?.sqrt()?)?.mul(&n.gamma)?.add(&n.beta)
            }
        }
    }

    /// `[b, s, d]` as `[b, h, s, hd]`.
    fn heads(&self, x: Tensor) -> Result<Tensor> {
        let (b, s, h) = (x.dims()[0], x.dims()[1], self.cfg.heads);
        x.reshape([b, s, h, self.cfg.dim / h])?.permute(vec![0, 2, 1, 3])
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
        if self.spelling == Spelling::Builtin {
            let opts = AttentionOptions { key_padding_mask: Some(mask), ..AttentionOptions::default() };
            return nn::attention(q, k, v, opts);
        }
        let (b, s, hd) = (mask.dims()[0], mask.dims()[1], q.dims()[3]);
        let extended =
            Tensor::ones(DType::F32, [b, 1, 1, s])?.sub(&mask.to_dtype(DType::F32)?.reshape([b, 1, 1, s])?)?;
        let extended = extended.mul_scalar(-10000.0)?;
        let scores = q.matmul(&k.transpose(-1, -2)?)?.div(&Tensor::full((hd as f64).sqrt(), q.dtype(), [])?)?;
        let scores = scores.to_dtype(DType::F32)?.add(&extended)?;
        let e = scores.sub(&scores.max(&[-1], true)?)?.exp()?;
        let p = e.div(&e.sum(&[-1], true)?)?.to_dtype(v.dtype())?;
        p.matmul(v)
    }

    fn layer(&self, l: &Layer, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, s, d) = (x.dims()[0], x.dims()[1], self.cfg.dim);
        let (q, k, v) =
            (self.heads(l.query.forward(x)?)?, self.heads(l.key.forward(x)?)?, self.heads(l.value.forward(x)?)?);
        let a = self.attention(&q, &k, &v, mask)?.permute(vec![0, 2, 1, 3])?.reshape([b, s, d])?;
        let x = self.layer_norm(&l.attn_norm, &x.add(&l.attn_out.forward(&a)?)?)?;
        let h = nn::gelu(&l.intermediate.forward(&x)?)?;
        self.layer_norm(&l.out_norm, &x.add(&l.output.forward(&h)?)?)
    }

    /// The encoder's output `[b, s, dim]`.
    pub fn encode(&self, batch: &BertBatch) -> Result<Tensor> {
        let ids = &batch.ids;
        if ids.rank() != 2 || batch.types.dims() != ids.dims() || batch.mask.dims() != ids.dims() {
            let what = "token types and the padding mask must have the ids' shape [batch, seq]".to_string();
            return Err(FrontendError::InvalidArgument { op: "bert", reason: format!("{what}: {}", ids.ty()) });
        }
        let s = ids.dims()[1];
        if s > self.cfg.max_positions {
            let reason = format!("{s} tokens a sequence, more than the {} positions", self.cfg.max_positions);
            return Err(FrontendError::InvalidArgument { op: "bert", reason });
        }
        let pos = Tensor::iota(DType::I32, [s], 0)?;
        let x =
            self.words.forward(ids)?.add(&self.positions.forward(&pos)?)?.add(&self.types.forward(&batch.types)?)?;
        let mut x = self.layer_norm(&self.emb_norm, &x)?;
        for l in &self.layers {
            x = self.layer(l, &x, &batch.mask)?;
        }
        Ok(x)
    }

    /// `tanh(W h_[CLS] + b)`, `[b, dim]`: what a classification head reads.
    pub fn pooled(&self, hidden: &Tensor) -> Result<Tensor> {
        let (b, d) = (hidden.dims()[0], hidden.dims()[2]);
        self.pooler.forward(&hidden.narrow(1, 0, 1)?.reshape([b, d])?)?.tanh()
    }

    /// Masked-LM loss: the mean cross-entropy of the predictions for `labels:
    /// [b · s]` over the positions where `weights: [b · s]` is 1.
    pub fn mlm_loss(&self, batch: &BertBatch, labels: &Tensor, weights: &Tensor) -> Result<Tensor> {
        let h = self.encode(batch)?;
        let n = h.dims()[0] * h.dims()[1];
        let h = h.reshape([n, self.cfg.dim])?;
        let t = self.layer_norm(&self.mlm_norm, &nn::gelu(&self.mlm_dense.forward(&h)?)?)?;
        let logits = t.matmul(&self.words.table.t()?)?.to_dtype(DType::F32)?.add(&self.mlm_bias)?;
        match self.spelling {
            Spelling::Builtin => nn::cross_entropy(&logits, labels, Some(weights)),
            Spelling::Plain => {
                let m = logits.max(&[-1], true)?;
                let lse = logits.sub(&m)?.exp()?.sum(&[-1], true)?.log()?.add(&m)?.reshape([n])?;
                let picked = logits.mul(&nn::one_hot(labels, self.cfg.vocab, DType::F32)?)?.sum(&[-1], false)?;
                let w = weights.to_dtype(DType::F32)?;
                lse.sub(&picked)?.mul(&w)?.sum_all()?.div(&w.sum_all()?)
            }
        }
    }
}

impl Module for Bert {
    /// Not a one-input model: use [`Bert::encode`].
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(FrontendError::InvalidArgument { op: "bert", reason: "takes a BertBatch: call Bert::encode".into() })
    }
    fn describe(&self) -> String {
        format!("Bert({} layers, dim {}, {} heads)", self.cfg.layers, self.cfg.dim, self.cfg.heads)
    }
    fn own_parameters(&self) -> Vec<Tensor> {
        vec![self.mlm_bias.clone()]
    }
    fn children(&self) -> Vec<&dyn Module> {
        let mut out: Vec<&dyn Module> = vec![&self.words, &self.positions, &self.types, &self.emb_norm];
        for l in &self.layers {
            out.extend([
                &l.query as &dyn Module,
                &l.key,
                &l.value,
                &l.attn_out,
                &l.attn_norm,
                &l.intermediate,
                &l.output,
                &l.out_norm,
            ]);
        }
        out.extend([&self.pooler as &dyn Module, &self.mlm_dense, &self.mlm_norm]);
        out
    }
}
