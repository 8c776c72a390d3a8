//! Generation from the zoo's decoders (GPT-2, Llama) and `kiln train gpt`'s
//! character-level GPT, with a key/value cache.
//!
//! The cache is one pair of fixed-size tensors per layer, `[batch,
//! kv_heads, context, head_dim]`, updated in place (`dynamic_update_slice`
//! at the step's position, assigned back so the step donates the old
//! buffer). A run compiles two programs whatever the prompt's length and the
//! number of new tokens: the prompt, padded to the context, and the decode
//! step; positions and the prompt's length are tensor inputs, never constants.
//!
//! Sampling is in the graph, from kiln's in-graph generator: temperature,
//! then top-k and top-p as thresholds on the probabilities found by
//! bisection (no sort: each halving is one reduction over the vocabulary),
//! then a Gumbel-max draw among the tokens kept. Temperature 0 is greedy.

use std::path::Path;
use std::time::Instant;

use kiln_compiler::ir::{BinaryOp, DType};
use kiln_frontend::checkpoint;
use kiln_frontend::nn::{self, AttentionOptions, InitPlacement, ParamStore};
use kiln_frontend::{metrics, FrontendError, Result, Tensor};

use crate::gpt::{self, CharVocab, Gpt, GptConfig};
use crate::gpt2::Gpt2;
use crate::llama::Llama;

/// One layer's keys and values, `[batch, kv_heads, context, head_dim]`.
pub struct LayerCache {
    k: Tensor,
    v: Tensor,
}

impl LayerCache {
    /// Writes `k, v: [b, kv_heads, t, hd]` at positions `pos..pos + t` and
    /// attends `q: [b, heads, t, hd]` to every cached key up to each query's
    /// own position.
    pub fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, pos: &Tensor) -> Result<Tensor> {
        let zero = Tensor::zeros(DType::I32, [])?;
        let starts = [zero.clone(), zero.clone(), pos.clone(), zero];
        let new_k = self.k.dynamic_update_slice(&k.to_dtype(self.k.dtype())?, &starts)?;
        let new_v = self.v.dynamic_update_slice(&v.to_dtype(self.v.dtype())?, &starts)?;
        self.k.assign(&new_k)?;
        self.v.assign(&new_v)?;
        let (t, context) = (q.dims()[2], self.k.dims()[2]);
        let key = Tensor::iota(DType::I32, [t, context], 1)?;
        let query = Tensor::iota(DType::I32, [t, context], 0)?.add(pos)?;
        let mask = key.le(&query)?.reshape([1, 1, t, context])?;
        let (kc, vc) = (self.k.to_dtype(q.dtype())?, self.v.to_dtype(q.dtype())?);
        nn::attention(q, &kc, &vc, AttentionOptions { mask: Some(&mask), ..AttentionOptions::default() })
    }
}

/// Every layer's cache.
pub struct KvCache {
    pub layers: Vec<LayerCache>,
    pub context: usize,
}

impl KvCache {
    pub fn new(layers: usize, shape: [usize; 4], dtype: DType) -> Result<KvCache> {
        let layers = (0..layers)
            .map(|_| Ok(LayerCache { k: Tensor::zeros(dtype, shape)?, v: Tensor::zeros(dtype, shape)? }))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache { layers, context: shape[2] })
    }
}

/// A decoder that generates.
#[derive(Clone, Copy)]
pub enum Decoder<'a> {
    Gpt2(&'a Gpt2),
    Llama(&'a Llama),
    /// `kiln train gpt`'s character-level model.
    Gpt(&'a Gpt),
}

impl Decoder<'_> {
    fn new_cache(self, context: usize) -> Result<KvCache> {
        match self {
            Decoder::Gpt2(m) => m.new_cache(1, context),
            Decoder::Llama(m) => m.new_cache(1, context),
            Decoder::Gpt(m) => m.new_cache(1, context),
        }
    }

    fn decode(self, ids: &Tensor, pos: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        match self {
            Decoder::Gpt2(m) => m.decode(ids, pos, cache),
            Decoder::Llama(m) => m.decode(ids, pos, cache),
            Decoder::Gpt(m) => m.decode(ids, pos, cache),
        }
    }

    pub fn vocab(self) -> usize {
        match self {
            Decoder::Gpt2(m) => m.cfg.vocab,
            Decoder::Llama(m) => m.cfg.vocab,
            Decoder::Gpt(m) => m.config().vocab,
        }
    }

    /// The longest context its positions allow (`None`: rotary, any).
    pub fn max_context(self) -> Option<usize> {
        match self {
            Decoder::Gpt2(m) => Some(m.cfg.max_positions),
            Decoder::Llama(_) => None,
            Decoder::Gpt(m) => Some(m.config().seq),
        }
    }

    /// Full-forward logits `[1, t, vocab]` of `ids: [1, t]` (no cache).
    pub fn logits(self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Decoder::Gpt2(m) => m.logits(ids)?.to_dtype(DType::F32),
            Decoder::Llama(m) => m.logits(ids),
            Decoder::Gpt(m) => m.forward(ids, false),
        }
    }
}

/// How the next token is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 is greedy (the argmax).
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_k: None, top_p: None };

    pub fn check(&self) -> Result<()> {
        let bad =
            |name, value: f64, expected| Err(FrontendError::HyperParameter { op: "generate", name, value, expected });
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", self.temperature, "a finite number >= 0 (0: greedy)");
        }
        if self.top_k == Some(0) {
            return bad("top_k", 0.0, "at least 1");
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad("top_p", p, "in (0, 1]");
        }
        Ok(())
    }
}

/// Halvings of a threshold's interval: the threshold is found to within
/// `max p / 2^32`, below any f32 probability step that matters.
const BISECTIONS: usize = 32;

/// The largest threshold `τ` in `[0, max p]` for which `holds(τ)` (true at
/// 0, false past the maximum), by bisection in the graph.
fn threshold(p: &Tensor, holds: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let mut lo = Tensor::zeros(DType::F32, [])?;
    let mut hi = p.max(&[0, 1], false)?;
    for _ in 0..BISECTIONS {
        let mid = lo.add(&hi)?.mul_scalar(0.5)?;
        let ok = holds(&mid)?;
        lo = Tensor::where_cond(&ok, &mid, &lo)?;
        hi = Tensor::where_cond(&ok, &hi, &mid)?;
    }
    Ok(lo)
}

/// The next token `[1]` (i32) drawn from `logits: [1, vocab]` (f32).
pub fn sample(logits: &Tensor, s: &Sampling) -> Result<Tensor> {
    if s.temperature == 0.0 {
        return logits.argmax(-1)?.to_dtype(DType::I32);
    }
    let v = logits.dims()[1];
    let p = logits.mul_scalar(1.0 / s.temperature)?.softmax(-1)?;
    let mut keep = p.ge(&Tensor::zeros(DType::F32, [])?)?;
    if let Some(k) = s.top_k.filter(|&k| k < v) {
        // The smallest probability among the k largest: count(p >= τ) >= k.
        let tau = threshold(&p, |mid| {
            let count = p.ge(mid)?.to_dtype(DType::F32)?.sum_all()?;
            count.ge(&Tensor::full(k as f64, DType::F32, [])?)
        })?;
        keep = keep.binary(BinaryOp::And, &p.ge(&tau)?)?;
    }
    if let Some(top_p) = s.top_p.filter(|&t| t < 1.0) {
        // The nucleus: the largest τ whose tokens p >= τ hold top_p of the mass.
        let tau = threshold(&p, |mid| {
            let mass = Tensor::where_cond(&p.ge(mid)?, &p, &Tensor::zeros(DType::F32, [])?)?.sum_all()?;
            mass.ge(&Tensor::full(top_p, DType::F32, [])?)
        })?;
        keep = keep.binary(BinaryOp::And, &p.ge(&tau)?)?;
    }
    // Gumbel-max: argmax(log p + g), g = -log(-log u), u in (0, 1).
    let u = Tensor::rand(DType::F32, [1, v])?.maximum(&Tensor::full(1e-12, DType::F32, [])?)?;
    let g = u.log()?.neg()?.log()?.neg()?;
    let score = p.log()?.add(&g)?;
    let score = Tensor::where_cond(&keep, &score, &Tensor::full(f64::NEG_INFINITY, DType::F32, [])?)?;
    score.argmax(-1)?.to_dtype(DType::I32)
}

/// What a generation produced and how fast.
#[derive(Clone, Debug, Default)]
pub struct Generated {
    /// The new tokens (the prompt excluded).
    pub tokens: Vec<u32>,
    /// Time to the first new token (the prompt's program), ms.
    pub prompt_ms: f64,
    /// Time of the remaining tokens, ms (the first decode step's compile
    /// included).
    pub decode_ms: f64,
    /// New tokens a second from the third on: the decode step's own rate,
    /// its compile (in the second token's step) left out. 0 with fewer than
    /// three tokens.
    pub decode_tokens_per_second: f64,
    /// Programs compiled (or read from the disk cache) during the run.
    pub programs: u64,
}

fn scalar_i32(v: usize) -> Result<Tensor> {
    Tensor::from_vec(vec![i32::try_from(v).unwrap_or(i32::MAX)], Vec::<usize>::new())
}

/// Up to `max_new` tokens after `prompt` from `model`, in a context of
/// `context` tokens, stopping early after `stop`.
pub fn generate(
    model: Decoder<'_>,
    prompt: &[u32],
    max_new: usize,
    context: usize,
    sampling: &Sampling,
    stop: Option<u32>,
) -> Result<Generated> {
    sampling.check()?;
    let bad = |reason: String| Err(FrontendError::InvalidArgument { op: "generate", reason });
    if prompt.is_empty() {
        return bad("an empty prompt: generation needs at least one token".into());
    }
    if let Some(max) = model.max_context().filter(|&m| context > m) {
        return bad(format!("a context of {context} tokens, more than the model's {max} positions"));
    }
    if prompt.len() + max_new > context {
        return bad(format!(
            "a prompt of {} tokens and {max_new} new ones need {} positions, more than the context of {context}",
            prompt.len(),
            prompt.len() + max_new
        ));
    }
    if let Some(&t) = prompt.iter().find(|&&t| t as usize >= model.vocab()) {
        return bad(format!("prompt token {t} is outside the model's vocabulary of {}", model.vocab()));
    }
    let before = metrics::snapshot();
    let mut out = Generated::default();
    if max_new == 0 {
        return Ok(out);
    }
    let mut cache = model.new_cache(context)?;
    // The prompt, padded to the context: one program for every length.
    let start = Instant::now();
    let mut padded: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    padded.resize(context, 0);
    let ids = Tensor::from_vec(padded, [1, context])?;
    let logits = model.decode(&ids, &scalar_i32(0)?, &mut cache)?;
    let zero = Tensor::zeros(DType::I32, [])?;
    let last = logits.dynamic_slice(&[zero.clone(), scalar_i32(prompt.len() - 1)?, zero], vec![1, 1, model.vocab()])?;
    let mut token = sample(&last.reshape([1, model.vocab()])?, sampling)?;
    kiln_frontend::mark_step()?;
    let mut next = token.item()? as u32;
    out.tokens.push(next);
    out.prompt_ms = start.elapsed().as_secs_f64() * 1e3;
    let decode = Instant::now();
    let mut warm: Option<Instant> = None;
    for pos in prompt.len()..prompt.len() + max_new - 1 {
        if Some(next) == stop {
            break;
        }
        let logits = model.decode(&token.reshape([1, 1])?, &scalar_i32(pos)?, &mut cache)?;
        token = sample(&logits.reshape([1, model.vocab()])?, sampling)?;
        kiln_frontend::mark_step()?;
        next = token.item()? as u32;
        out.tokens.push(next);
        warm.get_or_insert_with(Instant::now);
    }
    out.decode_ms = decode.elapsed().as_secs_f64() * 1e3;
    let steady = out.tokens.len().saturating_sub(2);
    let seconds = warm.map_or(0.0, |w| w.elapsed().as_secs_f64());
    out.decode_tokens_per_second = if steady > 0 && seconds > 0.0 { steady as f64 / seconds } else { 0.0 };
    let after = metrics::snapshot();
    out.programs = (after.compiles - before.compiles) + (after.disk_hits - before.disk_hits);
    Ok(out)
}

/// The model `kiln train gpt --checkpoint FILE` saved, its parameters (on
/// the host) and its characters: what `kiln generate --checkpoint FILE`
/// samples from. A checkpoint without the run's characters and shape (an
/// MLP's, a zoo model's) is refused naming what it lacks.
pub fn load_gpt_checkpoint(path: &Path) -> Result<(Gpt, ParamStore, CharVocab)> {
    let loaded = checkpoint::load(path)?;
    let refuse = |reason: String| FrontendError::Checkpoint { path: path.to_path_buf(), reason };
    let text = |name: &str| -> Result<String> {
        let (_, lit) = loaded.tensors.iter().find(|(n, _)| n == name).ok_or_else(|| {
            refuse(format!("no tensor {name}: not a checkpoint of `kiln train gpt` (a character-level GPT)"))
        })?;
        String::from_utf8(lit.bytes().to_vec()).map_err(|_| refuse(format!("tensor {name} is not UTF-8 text")))
    };
    let chars = text(gpt::CHARS)?;
    let shape = text(gpt::SHAPE)?;
    let field = |key: &str| -> Result<usize> {
        shape
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
            .ok_or_else(|| refuse(format!("tensor {} ({shape:?}) has no {key}", gpt::SHAPE)))
    };
    let vocab = CharVocab::new(&chars);
    if vocab.as_text() != chars {
        return Err(refuse(format!("tensor {} is not a sorted set of characters", gpt::CHARS)));
    }
    let cfg = GptConfig {
        vocab: field("vocab")?,
        seq: field("seq")?,
        dim: field("dim")?,
        heads: field("heads")?,
        layers: field("layers")?,
        init: Some(InitPlacement::Host),
        ..GptConfig::tiny(0)
    };
    let mut params = ParamStore::with_placement(0, InitPlacement::Host);
    let model = Gpt::new(&mut params, &cfg)?;
    let targets: Vec<(String, Tensor)> = params.iter().map(|(n, t)| (format!("param.{n}"), t.clone())).collect();
    checkpoint::restore_loaded(path, loaded, &targets)?;
    Ok((model, params, vocab))
}
