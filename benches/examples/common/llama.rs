//! A Llama-style decoder written against kiln's public API as a user would
//! write it, for checking the memory planner on a model it was not tuned on:
//! RMSNorm before each sublayer, separate q/k/v/o projections without biases,
//! rotary position embeddings, SwiGLU feed-forward, an untied output head and
//! the plain cross entropy over explicit logits. Used by `remat_llama` (the
//! device run) and `testsuite/tests/remat_unseen.rs` (the CPU checks).

use kiln::nn::{self, Embedding, Linear, RmsNorm};
use kiln::{Result, Tensor};

/// The model's sizes and its batch.
#[derive(Clone, Copy, Debug)]
pub struct LlamaConfig {
    pub vocab: usize,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    /// SwiGLU's hidden width.
    pub ffn: usize,
    pub seq: usize,
    pub batch: usize,
}

impl LlamaConfig {
    /// About 130M parameters: 8 layers of width 1024, for a GPU.
    pub fn small() -> LlamaConfig {
        LlamaConfig { vocab: 16384, dim: 1024, layers: 8, heads: 16, ffn: 2816, seq: 1024, batch: 8 }
    }

    /// 29k parameters and 1,024 tokens a step, for the CPU plugin: the
    /// activations outweigh the parameters and optimizer state.
    pub fn tiny() -> LlamaConfig {
        LlamaConfig { vocab: 61, dim: 32, layers: 2, heads: 4, ffn: 88, seq: 64, batch: 16 }
    }
}

struct Block {
    attn_norm: RmsNorm,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    mlp_norm: RmsNorm,
    w1: Linear,
    w3: Linear,
    w2: Linear,
}

pub struct Llama {
    cfg: LlamaConfig,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    head: Linear,
    /// Rotary tables, `[seq, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
}

impl Llama {
    pub fn new(ps: &mut nn::ParamStore, cfg: LlamaConfig) -> Result<Llama> {
        let (d, f) = (cfg.dim, cfg.ffn);
        let linear = |ps: &mut nn::ParamStore, name: String, i: usize, o: usize| Linear::new(ps, &name, i, o, false);
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            blocks.push(Block {
                attn_norm: RmsNorm::new(ps, &format!("l{l}.attn_norm"), d)?,
                wq: linear(ps, format!("l{l}.wq"), d, d)?,
                wk: linear(ps, format!("l{l}.wk"), d, d)?,
                wv: linear(ps, format!("l{l}.wv"), d, d)?,
                wo: linear(ps, format!("l{l}.wo"), d, d)?,
                mlp_norm: RmsNorm::new(ps, &format!("l{l}.mlp_norm"), d)?,
                w1: linear(ps, format!("l{l}.w1"), d, f)?,
                w3: linear(ps, format!("l{l}.w3"), d, f)?,
                w2: linear(ps, format!("l{l}.w2"), f, d)?,
            });
        }
        let half = d / cfg.heads / 2;
        let angle = |t: usize, i: usize| t as f64 / 10000f64.powf(i as f64 / half as f64);
        let table = |f: fn(f64) -> f64| -> Result<Tensor> {
            let v = (0..cfg.seq).flat_map(|t| (0..half).map(move |i| f(angle(t, i)) as f32)).collect();
            Tensor::from_vec(v, [cfg.seq, half])
        };
        Ok(Llama {
            cfg,
            embed: Embedding::new(ps, "embed", cfg.vocab, d, 0.02)?,
            blocks,
            norm: RmsNorm::new(ps, "norm", d)?,
            head: linear(ps, "head".into(), d, cfg.vocab)?,
            cos: table(f64::cos)?,
            sin: table(f64::sin)?,
        })
    }

    /// `x: [heads…, seq, head_dim]` rotated by position: each pair of
    /// halves `(a, b)` becomes `(a cos - b sin, b cos + a sin)`.
    fn rope(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let half = dims[3] / 2;
        let (a, b) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let shape = [dims[0], dims[1], dims[2], half];
        let (cos, sin) = (self.cos.broadcast_to(shape)?, self.sin.broadcast_to(shape)?);
        let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
        Tensor::cat(&[a.mul(&cos)?.sub(&b.mul(&sin)?)?, b.mul(&cos)?.add(&a.mul(&sin)?)?], 3)
    }

    fn block(&self, blk: &Block, x: &Tensor) -> Result<Tensor> {
        let LlamaConfig { batch: b, seq: t, dim: d, heads: h, .. } = self.cfg;
        let heads = |y: Tensor| y.reshape([b, t, h, d / h])?.permute(vec![0, 2, 1, 3]);
        let n = blk.attn_norm.forward(x)?;
        let q = self.rope(&heads(blk.wq.forward(&n)?)?)?;
        let k = self.rope(&heads(blk.wk.forward(&n)?)?)?;
        let v = heads(blk.wv.forward(&n)?)?;
        let a = nn::scaled_dot_product_attention(&q, &k, &v, true)?.permute(vec![0, 2, 1, 3])?.reshape([b, t, d])?;
        let x = x.add(&blk.wo.forward(&a)?)?;
        let n = blk.mlp_norm.forward(&x)?;
        let gate = blk.w1.forward(&n)?;
        let swish = gate.mul(&gate.sigmoid()?)?;
        x.add(&blk.w2.forward(&swish.mul(&blk.w3.forward(&n)?)?)?)
    }

    /// Mean next-token cross entropy of `ids: [batch, seq]` against
    /// `targets: [batch * seq]`.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let LlamaConfig { batch: b, seq: t, dim: d, .. } = self.cfg;
        let mut x = self.embed.forward(ids)?;
        for blk in &self.blocks {
            x = self.block(blk, &x)?;
        }
        let logits = self.head.forward(&self.norm.forward(&x)?.reshape([b * t, d])?)?;
        nn::cross_entropy(&logits, targets, None)
    }

    /// A fixed batch spread over the vocabulary: ids and their targets.
    pub fn batch(&self) -> Result<(Tensor, Tensor)> {
        let LlamaConfig { batch: b, seq: t, vocab, .. } = self.cfg;
        let ids = |seed: usize| (0..b * t).map(|i| ((i * 7919 + seed) % vocab) as i32).collect::<Vec<_>>();
        Ok((Tensor::from_vec(ids(1), [b, t])?, Tensor::from_vec(ids(2), [b * t])?))
    }
}
