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
//!
//! [`BertFlavor::Roberta`] is RoBERTa (and XLM-R): the same encoder under
//! Hugging Face's RoBERTa names, its positions counted from the padding id
//! (`pad + 1` for the first token, `pad` for padding tokens, as Hugging
//! Face's `create_position_ids_from_input_ids` computes them from the ids).

use kiln_compiler::ir::{CompareDir, DType};
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
    pub flavor: BertFlavor,
    /// Whether the model has the pooler (`BertModel`,
    /// `BertForSequenceClassification`); Hugging Face's masked-LM models do
    /// not.
    pub pooler: bool,
    /// Whether the model has the masked-LM head (`BertForMaskedLM`);
    /// classification models do not.
    pub mlm_head: bool,
}

/// Which of the BERT family: the parameter names and how positions count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BertFlavor {
    /// BERT: positions `0..seq`, names under `bert.` and `cls.predictions.`.
    Bert,
    /// RoBERTa and XLM-R: names under `roberta.` and `lm_head.`; a token's
    /// position is `pad + 1 +` the number of non-`pad` ids before it, a
    /// `pad` id's is `pad`.
    Roberta { pad: usize },
    /// DistilBERT: the same post-norm encoder under `distilbert.`
    /// (`q_lin`, `sa_layer_norm`, `ffn.lin1`, ...), no token types
    /// (`type_vocab` 0), the masked-LM head `vocab_transform`,
    /// `vocab_layer_norm`, `vocab_projector`.
    DistilBert,
}

/// A flavor's parameter names: the embeddings', a layer's (from its index)
/// and the heads'.
struct Names {
    body: &'static str,
    layer: fn(&str, usize) -> [String; 8],
    head: [&'static str; 3],
}

impl Names {
    fn of(flavor: BertFlavor) -> Names {
        fn bert_layer(body: &str, l: usize) -> [String; 8] {
            let p = format!("{body}.encoder.layer.{l}");
            [
                format!("{p}.attention.self.query"),
                format!("{p}.attention.self.key"),
                format!("{p}.attention.self.value"),
                format!("{p}.attention.output.dense"),
                format!("{p}.attention.output.LayerNorm"),
                format!("{p}.intermediate.dense"),
                format!("{p}.output.dense"),
                format!("{p}.output.LayerNorm"),
            ]
        }
        fn distil_layer(body: &str, l: usize) -> [String; 8] {
            let p = format!("{body}.transformer.layer.{l}");
            [
                format!("{p}.attention.q_lin"),
                format!("{p}.attention.k_lin"),
                format!("{p}.attention.v_lin"),
                format!("{p}.attention.out_lin"),
                format!("{p}.sa_layer_norm"),
                format!("{p}.ffn.lin1"),
                format!("{p}.ffn.lin2"),
                format!("{p}.output_layer_norm"),
            ]
        }
        match flavor {
            BertFlavor::Bert => Names {
                body: "bert",
                layer: bert_layer,
                head: [
                    "cls.predictions.transform.dense",
                    "cls.predictions.transform.LayerNorm",
                    "cls.predictions.bias",
                ],
            },
            BertFlavor::Roberta { .. } => Names {
                body: "roberta",
                layer: bert_layer,
                head: ["lm_head.dense", "lm_head.layer_norm", "lm_head.bias"],
            },
            BertFlavor::DistilBert => Names {
                body: "distilbert",
                layer: distil_layer,
                head: ["vocab_transform", "vocab_layer_norm", "vocab_projector.bias"],
            },
        }
    }
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
            flavor: BertFlavor::Bert,
            pooler: true,
            mlm_head: true,
        }
    }

    /// `distilbert-base-uncased`'s sizes (66M parameters).
    pub fn distilbert_base_uncased() -> BertConfig {
        BertConfig {
            layers: 6,
            type_vocab: 0,
            flavor: BertFlavor::DistilBert,
            pooler: false,
            ..BertConfig::bert_base_uncased()
        }
    }

    /// `roberta-base`'s sizes (125M parameters).
    pub fn roberta_base() -> BertConfig {
        BertConfig {
            vocab: 50265,
            max_positions: 514,
            type_vocab: 1,
            eps: 1e-5,
            flavor: BertFlavor::Roberta { pad: 1 },
            pooler: false,
            mlm_head: true,
            ..BertConfig::bert_base_uncased()
        }
    }

    /// A few thousand parameters, for tests on the CPU plugin.
    pub fn tiny() -> BertConfig {
        BertConfig {
            vocab: 53,
            dim: 32,
            layers: 2,
            heads: 4,
            ffn: 64,
            max_positions: 16,
            type_vocab: 2,
            eps: 1e-12,
            flavor: BertFlavor::Bert,
            pooler: true,
            mlm_head: true,
        }
    }

    fn check(&self) -> Result<()> {
        if self.heads == 0 || self.dim % self.heads != 0 {
            let (value, expected) = (self.heads as f64, "a divisor of dim");
            return Err(FrontendError::HyperParameter { op: "bert", name: "heads", value, expected });
        }
        if let BertFlavor::Roberta { pad } = self.flavor {
            if pad >= self.vocab || self.max_positions < pad + 2 {
                let (value, expected) = (pad as f64, "a token id below vocab, with max_positions >= pad + 2");
                return Err(FrontendError::HyperParameter { op: "roberta", name: "pad", value, expected });
            }
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
    /// None without token types (DistilBERT).
    types: Option<Embedding>,
    emb_norm: LayerNorm,
    layers: Vec<Layer>,
    pooler: Option<Linear>,
    mlm: Option<MlmHead>,
}

/// The masked-LM head: a dense layer, GELU and LayerNorm, then the tied
/// word embeddings and a bias.
struct MlmHead {
    dense: Linear,
    norm: LayerNorm,
    bias: Tensor,
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
        let names = Names::of(cfg.flavor);
        let (body, head) = (names.body, names.head);
        let words = Embedding::new(ps, &format!("{body}.embeddings.word_embeddings"), cfg.vocab, d, 0.02)?;
        let positions =
            Embedding::new(ps, &format!("{body}.embeddings.position_embeddings"), cfg.max_positions, d, 0.02)?;
        let types = if cfg.type_vocab == 0 {
            None
        } else {
            Some(Embedding::new(ps, &format!("{body}.embeddings.token_type_embeddings"), cfg.type_vocab, d, 0.02)?)
        };
        let emb_norm = norm(ps, format!("{body}.embeddings.LayerNorm"))?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let [q, k, v, o, an, i, out, on] = (names.layer)(body, l);
            layers.push(Layer {
                query: linear(ps, q, d, d)?,
                key: linear(ps, k, d, d)?,
                value: linear(ps, v, d, d)?,
                attn_out: linear(ps, o, d, d)?,
                attn_norm: norm(ps, an)?,
                intermediate: linear(ps, i, d, cfg.ffn)?,
                output: linear(ps, out, cfg.ffn, d)?,
                out_norm: norm(ps, on)?,
            });
        }
        Ok(Bert {
            pooler: if cfg.pooler { Some(linear(ps, format!("{body}.pooler.dense"), d, d)?) } else { None },
            mlm: if cfg.mlm_head {
                Some(MlmHead {
                    dense: linear(ps, head[0].into(), d, d)?,
                    norm: norm(ps, head[1].into())?,
                    bias: ps.constant(head[2], [cfg.vocab], 0.0)?,
                })
            } else {
                None
            },
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

    /// The positions of `ids: [b, s]`: `[s]` for BERT, `[b, s]` counted from
    /// the padding id for RoBERTa (a running count of non-padding ids, as a
    /// product with an upper-triangular matrix of ones: exact in f32 for any
    /// sequence that fits the position table).
    fn position_ids(&self, ids: &Tensor) -> Result<Tensor> {
        let s = ids.dims()[1];
        match self.cfg.flavor {
            BertFlavor::Bert | BertFlavor::DistilBert => Tensor::iota(DType::I32, [s], 0),
            BertFlavor::Roberta { pad } => {
                let real = ids.compare(CompareDir::Ne, &Tensor::full(pad as f64, ids.dtype(), [])?)?;
                let real = real.to_dtype(DType::F32)?;
                let upper = Tensor::iota(DType::I32, [s, s], 0)?.le(&Tensor::iota(DType::I32, [s, s], 1)?)?;
                let count = real.matmul(&upper.to_dtype(DType::F32)?)?;
                count.mul(&real)?.add_scalar(pad as f64)?.to_dtype(DType::I32)
            }
        }
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
        let mut x = self.words.forward(ids)?.add(&self.positions.forward(&self.position_ids(ids)?)?)?;
        if let Some(types) = &self.types {
            x = x.add(&types.forward(&batch.types)?)?;
        }
        let mut x = self.layer_norm(&self.emb_norm, &x)?;
        for l in &self.layers {
            x = self.layer(l, &x, &batch.mask)?;
        }
        Ok(x)
    }

    /// `tanh(W h_[CLS] + b)`, `[b, dim]`: what a classification head reads.
    pub fn pooled(&self, hidden: &Tensor) -> Result<Tensor> {
        let Some(pooler) = &self.pooler else {
            let reason = "this model was made without its pooler (BertConfig::pooler)".to_string();
            return Err(FrontendError::InvalidArgument { op: "bert", reason });
        };
        let (b, d) = (hidden.dims()[0], hidden.dims()[2]);
        pooler.forward(&hidden.narrow(1, 0, 1)?.reshape([b, d])?)?.tanh()
    }

    /// The masked-LM head's logits `[b · s, vocab]` (f32) for the encoder's
    /// output `[b, s, dim]`.
    fn mlm_head(&self, h: &Tensor) -> Result<Tensor> {
        let Some(head) = &self.mlm else {
            let reason = "this model was made without its masked-LM head (BertConfig::mlm_head)".to_string();
            return Err(FrontendError::InvalidArgument { op: "bert", reason });
        };
        let n = h.dims()[0] * h.dims()[1];
        let h = h.reshape([n, self.cfg.dim])?;
        let t = self.layer_norm(&head.norm, &nn::gelu(&head.dense.forward(&h)?)?)?;
        t.matmul(&self.words.table.t()?)?.to_dtype(DType::F32)?.add(&head.bias)
    }

    /// The masked-LM logits `[b, s, vocab]` (f32): `BertForMaskedLM`'s and
    /// `RobertaForMaskedLM`'s output.
    pub fn mlm_logits(&self, batch: &BertBatch) -> Result<Tensor> {
        let h = self.encode(batch)?;
        let (b, s) = (h.dims()[0], h.dims()[1]);
        self.mlm_head(&h)?.reshape([b, s, self.cfg.vocab])
    }

    /// Masked-LM loss: the mean cross-entropy of the predictions for `labels:
    /// [b · s]` over the positions where `weights: [b · s]` is 1.
    pub fn mlm_loss(&self, batch: &BertBatch, labels: &Tensor, weights: &Tensor) -> Result<Tensor> {
        let h = self.encode(batch)?;
        let n = h.dims()[0] * h.dims()[1];
        let logits = self.mlm_head(&h)?;
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
        let name = match self.cfg.flavor {
            BertFlavor::Bert => "Bert",
            BertFlavor::Roberta { .. } => "Roberta",
            BertFlavor::DistilBert => "DistilBert",
        };
        format!("{name}({} layers, dim {}, {} heads)", self.cfg.layers, self.cfg.dim, self.cfg.heads)
    }
    fn own_parameters(&self) -> Vec<Tensor> {
        self.mlm.iter().map(|m| m.bias.clone()).collect()
    }
    fn children(&self) -> Vec<&dyn Module> {
        let mut out: Vec<&dyn Module> = vec![&self.words, &self.positions];
        if let Some(t) = &self.types {
            out.push(t);
        }
        out.push(&self.emb_norm);
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
        if let Some(p) = &self.pooler {
            out.push(p);
        }
        if let Some(m) = &self.mlm {
            out.extend([&m.dense as &dyn Module, &m.norm]);
        }
        out
    }
}

/// A sequence classifier over the encoder, as Hugging Face's
/// `BertForSequenceClassification` (the pooler, then `classifier`),
/// `RobertaForSequenceClassification` (`classifier.dense`, tanh,
/// `classifier.out_proj` on the first token) and
/// `DistilBertForSequenceClassification` (`pre_classifier`, ReLU,
/// `classifier` on the first token) compute it.
pub struct BertClassifier {
    pub bert: Bert,
    /// The class names, by id.
    pub labels: Vec<String>,
    head: ClassHead,
}

enum ClassHead {
    Pooled { classifier: Linear },
    Roberta { dense: Linear, out_proj: Linear },
    Distil { pre_classifier: Linear, classifier: Linear },
}

impl BertClassifier {
    /// `cfg`'s encoder (without a masked-LM head; BERT with its pooler) and
    /// a head over `labels`.
    pub fn new(ps: &mut ParamStore, cfg: BertConfig, labels: Vec<String>, spelling: Spelling) -> Result<Self> {
        if labels.len() < 2 {
            let (value, expected) = (labels.len() as f64, "at least 2 classes");
            return Err(FrontendError::HyperParameter { op: "bert classifier", name: "labels", value, expected });
        }
        let pooler = cfg.flavor == BertFlavor::Bert;
        let cfg = BertConfig { pooler, mlm_head: false, ..cfg };
        let bert = Bert::new(ps, cfg, spelling)?;
        let (d, n) = (cfg.dim, labels.len());
        let head = match cfg.flavor {
            BertFlavor::Roberta { .. } => ClassHead::Roberta {
                dense: Linear::new(ps, "classifier.dense", d, d, true)?,
                out_proj: Linear::new(ps, "classifier.out_proj", d, n, true)?,
            },
            BertFlavor::DistilBert => ClassHead::Distil {
                pre_classifier: Linear::new(ps, "pre_classifier", d, d, true)?,
                classifier: Linear::new(ps, "classifier", d, n, true)?,
            },
            BertFlavor::Bert => ClassHead::Pooled { classifier: Linear::new(ps, "classifier", d, n, true)? },
        };
        Ok(BertClassifier { bert, labels, head })
    }

    /// The class logits `[b, classes]` (f32).
    pub fn logits(&self, batch: &BertBatch) -> Result<Tensor> {
        let h = self.bert.encode(batch)?;
        let out = match &self.head {
            ClassHead::Pooled { classifier } => classifier.forward(&self.bert.pooled(&h)?)?,
            ClassHead::Roberta { dense, out_proj } => out_proj.forward(&dense.forward(&first_token(&h)?)?.tanh()?)?,
            ClassHead::Distil { pre_classifier, classifier } => {
                classifier.forward(&pre_classifier.forward(&first_token(&h)?)?.relu()?)?
            }
        };
        out.to_dtype(DType::F32)
    }

    /// The mean cross-entropy of the logits against `labels: [b]`.
    pub fn loss(&self, batch: &BertBatch, labels: &Tensor) -> Result<Tensor> {
        nn::cross_entropy(&self.logits(batch)?, labels, None)
    }
}

/// The first token's hidden state `[b, d]` of `h: [b, t, d]`.
fn first_token(h: &Tensor) -> Result<Tensor> {
    let (b, d) = (h.dims()[0], h.dims()[2]);
    h.narrow(1, 0, 1)?.reshape([b, d])
}

impl Module for BertClassifier {
    /// Not a one-input model: use [`BertClassifier::logits`].
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        let reason = "takes a BertBatch: call BertClassifier::logits".into();
        Err(FrontendError::InvalidArgument { op: "bert classifier", reason })
    }
    fn describe(&self) -> String {
        format!("{} classifier over {} classes", self.bert.describe(), self.labels.len())
    }
    fn children(&self) -> Vec<&dyn Module> {
        let mut out: Vec<&dyn Module> = vec![&self.bert];
        match &self.head {
            ClassHead::Pooled { classifier } => out.push(classifier),
            ClassHead::Roberta { dense, out_proj } => out.extend([dense as &dyn Module, out_proj]),
            ClassHead::Distil { pre_classifier, classifier } => out.extend([pre_classifier as &dyn Module, classifier]),
        }
        out
    }
}
