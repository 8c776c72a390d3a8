//! Four model styles a user brings, each written twice (`kiln_models`'
//! `Spelling`): with plain tensor ops where kiln has a built-in call, and
//! with the built-in calls. Over 5 AdamW steps on fresh random data the two
//! spellings' losses agree within 1e-5 of each other and of the reference
//! interpreter (f64) running the plain spelling; `grad` finds in the plain
//! spelling every composite the model holds (attentions, layer or RMS norms,
//! the LM head's loss), the same ones the built-in spelling records.
//! Tolerance: absolute, on losses near ln(vocab) ≈ 4.

use kiln::autodiff::trace_composites;
use kiln::backend;
use kiln::compiler::ir::Op;
use kiln::nn::{Module, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::{Backend, Tensor};
use kiln_models::bert::{Bert, BertBatch, BertConfig};
use kiln_models::gpt2::{Gpt2, Gpt2Config};
use kiln_models::llama::{Llama, LlamaConfig};
use kiln_models::t5::{T5Batch, T5Config, T5};
use kiln_models::Spelling;

mod common;
use common::Rng;

const STEPS: usize = 5;

fn seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(5, |d| d.as_nanos() as u64)
}

fn ints(rng: &mut Rng, n: usize, below: usize) -> Vec<i32> {
    (0..n).map(|_| (rng.next_u64() % below as u64) as i32).collect()
}

/// Padding masks: row `i` keeps `len - i` tokens (at least 2).
fn padding(b: usize, s: usize) -> Vec<i32> {
    (0..b * s).map(|x| i32::from(x % s < (s - x / s).max(2))).collect()
}

/// A model under test: builds itself from a seed in one spelling and records
/// one step's loss.
trait Case {
    fn name(&self) -> &'static str;
    /// The forward composites the model holds: attentions, layer norms, RMS
    /// norms, LM-head losses.
    fn composites(&self) -> [usize; 4];
    fn build(&self, ps: &mut ParamStore, s: Spelling) -> kiln::Result<Box<dyn Loss>>;
}

trait Loss {
    fn params(&self) -> Vec<Tensor>;
    fn loss(&self, data: &Data) -> kiln::Result<Tensor>;
}

/// The data of every step (the same batch each step: the losses fall).
struct Data {
    ints: Vec<Vec<i32>>,
    dims: Vec<Vec<usize>>,
}

impl Data {
    fn tensor(&self, i: usize) -> kiln::Result<Tensor> {
        Tensor::from_vec(self.ints[i].clone(), self.dims[i].clone())
    }
}

struct LlamaCase;
impl Case for LlamaCase {
    fn name(&self) -> &'static str {
        "llama (grouped-query, rotary, RMSNorm, SwiGLU, tied)"
    }
    fn composites(&self) -> [usize; 4] {
        let l = LlamaConfig::tiny().layers;
        [l, 0, 2 * l + 1, 1]
    }
    fn build(&self, ps: &mut ParamStore, s: Spelling) -> kiln::Result<Box<dyn Loss>> {
        Ok(Box::new(Llama::new(ps, LlamaConfig::tiny(), s)?))
    }
}
impl Loss for Llama {
    fn params(&self) -> Vec<Tensor> {
        self.parameters()
    }
    fn loss(&self, d: &Data) -> kiln::Result<Tensor> {
        Llama::loss(self, &d.tensor(0)?, &d.tensor(1)?)
    }
}

struct Gpt2Case;
impl Case for Gpt2Case {
    fn name(&self) -> &'static str {
        "gpt2 (fused qkv, additive causal table, LayerNorm, tied)"
    }
    fn composites(&self) -> [usize; 4] {
        let l = Gpt2Config::tiny().layers;
        [l, 2 * l + 1, 0, 1]
    }
    fn build(&self, ps: &mut ParamStore, s: Spelling) -> kiln::Result<Box<dyn Loss>> {
        Ok(Box::new(Gpt2::new(ps, Gpt2Config::tiny(), s)?))
    }
}
impl Loss for Gpt2 {
    fn params(&self) -> Vec<Tensor> {
        self.parameters()
    }
    fn loss(&self, d: &Data) -> kiln::Result<Tensor> {
        Gpt2::loss(self, &d.tensor(0)?, &d.tensor(1)?)
    }
}

struct BertCase;
impl Case for BertCase {
    fn name(&self) -> &'static str {
        "bert (padding mask, post-LN, masked LM)"
    }
    /// The MLM logits have a bias: the loss stays plain in both spellings.
    fn composites(&self) -> [usize; 4] {
        let l = BertConfig::tiny().layers;
        [l, 2 * l + 2, 0, 0]
    }
    fn build(&self, ps: &mut ParamStore, s: Spelling) -> kiln::Result<Box<dyn Loss>> {
        Ok(Box::new(Bert::new(ps, BertConfig::tiny(), s)?))
    }
}
impl Loss for Bert {
    fn params(&self) -> Vec<Tensor> {
        self.parameters()
    }
    fn loss(&self, d: &Data) -> kiln::Result<Tensor> {
        let batch = BertBatch { ids: d.tensor(0)?, types: d.tensor(1)?, mask: d.tensor(2)? };
        let weights = Tensor::from_vec(d.ints[4].iter().map(|&w| w as f32).collect::<Vec<_>>(), d.dims[4].clone())?;
        self.mlm_loss(&batch, &d.tensor(3)?, &weights)
    }
}

struct T5Case;
impl Case for T5Case {
    fn name(&self) -> &'static str {
        "t5 (relative bias, cross-attention, RMS norm, gated GELU)"
    }
    fn composites(&self) -> [usize; 4] {
        let c = T5Config::tiny();
        [c.layers + 2 * c.decoder_layers, 0, 2 * c.layers + 1 + 3 * c.decoder_layers + 1, 1]
    }
    fn build(&self, ps: &mut ParamStore, s: Spelling) -> kiln::Result<Box<dyn Loss>> {
        Ok(Box::new(T5::new(ps, T5Config::tiny(), s)?))
    }
}
impl Loss for T5 {
    fn params(&self) -> Vec<Tensor> {
        self.parameters()
    }
    fn loss(&self, d: &Data) -> kiln::Result<Tensor> {
        let batch = T5Batch {
            input_ids: d.tensor(0)?,
            input_mask: d.tensor(1)?,
            labels: d.tensor(2)?,
            label_mask: d.tensor(3)?,
        };
        T5::loss(self, &batch)
    }
}

fn data(case: &str, rng: &mut Rng) -> Data {
    let (b, t) = (3, 8);
    let (ints, dims): (Vec<Vec<i32>>, Vec<Vec<usize>>) = if case.starts_with("llama") {
        (
            vec![ints(rng, b * t, LlamaConfig::tiny().vocab), ints(rng, b * t, LlamaConfig::tiny().vocab)],
            vec![vec![b, t], vec![b * t]],
        )
    } else if case.starts_with("gpt2") {
        (
            vec![ints(rng, b * t, Gpt2Config::tiny().vocab), ints(rng, b * t, Gpt2Config::tiny().vocab)],
            vec![vec![b, t], vec![b * t]],
        )
    } else if case.starts_with("bert") {
        let v = BertConfig::tiny().vocab;
        let mask = padding(b, t);
        // Predict about one real token in three (at least the first of each row).
        let weights: Vec<i32> =
            mask.iter().enumerate().map(|(i, &m)| m * i32::from(i % t == 0 || rng.uniform() < 0.35)).collect();
        (
            vec![ints(rng, b * t, v), ints(rng, b * t, 2), mask, ints(rng, b * t, v), weights],
            vec![vec![b, t], vec![b, t], vec![b, t], vec![b * t], vec![b * t]],
        )
    } else {
        let v = T5Config::tiny().vocab;
        let (s, l) = (t, 6);
        (
            vec![ints(rng, b * s, v), padding(b, s), ints(rng, b * l, v), padding(b, l)],
            vec![vec![b, s], vec![b, s], vec![b, l], vec![b, l]],
        )
    };
    Data { ints, dims }
}

/// The forward composites of the trace: attentions, layer norms, RMS norms,
/// LM-head losses.
fn composites() -> [usize; 4] {
    let ops = trace_composites();
    let count = |f: fn(&Op) -> bool| ops.iter().filter(|o| f(o)).count();
    [
        count(|o| matches!(o, Op::Attention { .. })),
        count(|o| matches!(o, Op::LayerNorm { .. })),
        count(|o| matches!(o, Op::RmsNorm { .. })),
        count(|o| matches!(o, Op::LmHeadCrossEntropy { .. } | Op::LmHeadCrossEntropyFused { .. })),
    ]
}

/// The losses of `STEPS` AdamW steps, and the forward composites of the
/// first step's trace after `grad`.
fn train(case: &dyn Case, spelling: Spelling, seed: u64, d: &Data) -> kiln::Result<(Vec<f64>, [usize; 4])> {
    let mut ps = ParamStore::new(seed);
    let model = case.build(&mut ps, spelling)?;
    let params = model.params();
    let mut opt = AdamW::new(&params, AdamWConfig::default())?;
    let mut losses = Vec::new();
    let mut found = [0; 4];
    for step in 0..STEPS {
        let loss = model.loss(d)?;
        let grads = kiln::grad(&loss, &params)?;
        if step == 0 {
            found = composites();
        }
        opt.step(&params, &grads, 3e-3)?;
        kiln::mark_step()?;
        losses.push(loss.item()?);
    }
    Ok((losses, found))
}

#[test]
fn both_spellings_train_alike_and_the_plain_one_is_found() -> kiln::Result<()> {
    let s = seed();
    let cases: [&dyn Case; 4] = [&LlamaCase, &Gpt2Case, &BertCase, &T5Case];
    for case in cases {
        let d = data(case.name(), &mut Rng::new(s ^ 0xda7a));
        let (plain, found) = train(case, Spelling::Plain, s, &d)?;
        let (builtin, recorded) = train(case, Spelling::Builtin, s, &d)?;
        let previous = backend();
        kiln::set_backend(Backend::Reference);
        let reference = train(case, Spelling::Plain, s, &d);
        kiln::set_backend(previous);
        let (reference, _) = reference?;
        eprintln!(
            "{}: plain {plain:?}\n  builtin {builtin:?}\n  reference {reference:?}\n  composites {found:?}",
            case.name()
        );
        assert!(plain.last() < plain.first(), "{}: the loss did not fall: {plain:?}", case.name());
        for i in 0..STEPS {
            for (what, other) in [("builtin", builtin[i]), ("reference", reference[i])] {
                let diff = (plain[i] - other).abs();
                assert!(
                    diff <= 1e-5,
                    "{}: step {i}: plain {} vs {what} {other}: {diff:.2e} (seed {s})",
                    case.name(),
                    plain[i]
                );
            }
        }
        assert_eq!(found, case.composites(), "{}: composites found in the plain spelling", case.name());
        assert_eq!(recorded, found, "{}: the built-in spelling's composites", case.name());
    }
    Ok(())
}
