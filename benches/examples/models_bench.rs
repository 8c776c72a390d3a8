//! kiln's step time on the four model styles of `kiln_models`, each spelled
//! with plain ops or with the built-in calls (issue 59's table), at the sizes
//! `benches/device/models_peers.py` gives its JAX and PyTorch peers: the
//! grouped-query Llama (110M, seq 1024, batch 8), GPT-2 (124M, seq 1024,
//! batch 8), BERT-base masked LM (seq 512, batch 32, padded) and T5-base
//! (seq 512 → 128, batch 16). bf16 autocast, f32 master weights, AdamW, a
//! plain `mark_step` loop (every step recorded and differentiated: the host
//! cost of finding the composites is in the figure).
//!
//! `models_bench MODEL plain|builtin [ITERS REPS [tiny]]` prints `RESULT {json}`
//! (`tiny`: the models' CPU test sizes, to try the harness without a GPU):
//! ms/step (median of REPS runs of ITERS steps), tokens/s, the first step's
//! seconds (compile included), the first losses, XLA's memory stats, the
//! composites `grad` found (and left plain) in the first step and the host
//! time of the last step's recording and `grad`.

use std::time::Instant;

use kiln::nn::{Module, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::{metrics, DType, Tensor};
use kiln_models::bert::{Bert, BertBatch, BertConfig};
use kiln_models::gpt2::{Gpt2, Gpt2Config};
use kiln_models::llama::{Llama, LlamaConfig};
use kiln_models::t5::{T5Batch, T5Config, T5};
use kiln_models::Spelling;
use serde_json::json;

// Shared with the remat examples; this one reads a few of its helpers.
#[allow(dead_code)]
#[path = "common/budget_run.rs"]
mod budget_run;
#[path = "common/timing.rs"]
mod timing;
use timing::{bench, Res};

/// A model and its fixed batch.
enum Model {
    Llama(Llama, Tensor, Tensor),
    Gpt2(Gpt2, Tensor, Tensor),
    Bert(Bert, BertBatch, Tensor, Tensor),
    T5(T5, T5Batch),
}

/// A deterministic spread of ids below `n`.
fn ids(len: usize, n: usize, salt: usize) -> Vec<i32> {
    (0..len).map(|i| ((i * 7919 + salt * 104_729) % n) as i32).collect()
}

impl Model {
    fn new(name: &str, spelling: Spelling, ps: &mut ParamStore, tiny: bool) -> Res<(Model, usize)> {
        let pick = |full: usize, small: usize| if tiny { small } else { full };
        Ok(match name {
            "llama" => {
                let c = if tiny { LlamaConfig::tiny() } else { LlamaConfig::llama_110m() };
                let (b, t) = (pick(8, 2), pick(1024, 16));
                let m = Llama::new(ps, c, spelling)?;
                let x = Tensor::from_vec(ids(b * t, c.vocab, 1), [b, t])?;
                (Model::Llama(m, x, Tensor::from_vec(ids(b * t, c.vocab, 2), [b * t])?), b * t)
            }
            "gpt2" => {
                let c = if tiny { Gpt2Config::tiny() } else { Gpt2Config::gpt2() };
                let (b, t) = (pick(8, 2), pick(1024, 16));
                let m = Gpt2::new(ps, c, spelling)?;
                let x = Tensor::from_vec(ids(b * t, c.vocab, 1), [b, t])?;
                (Model::Gpt2(m, x, Tensor::from_vec(ids(b * t, c.vocab, 2), [b * t])?), b * t)
            }
            "bert" => {
                let c = if tiny { BertConfig::tiny() } else { BertConfig::bert_base_uncased() };
                let (b, s) = (pick(32, 2), pick(512, 16));
                let m = Bert::new(ps, c, spelling)?;
                // Lengths from half to the whole sequence; one token in 7 predicted.
                let mask: Vec<i32> = (0..b * s).map(|i| i32::from(i % s < s / 2 + (i / s) * s / (2 * b))).collect();
                let weights: Vec<f32> =
                    mask.iter().enumerate().map(|(i, &m)| (m != 0 && i % 7 == 0) as i32 as f32).collect();
                let batch = BertBatch {
                    ids: Tensor::from_vec(ids(b * s, c.vocab, 1), [b, s])?,
                    types: Tensor::from_vec(vec![0i32; b * s], [b, s])?,
                    mask: Tensor::from_vec(mask, [b, s])?,
                };
                let labels = Tensor::from_vec(ids(b * s, c.vocab, 2), [b * s])?;
                (Model::Bert(m, batch, labels, Tensor::from_vec(weights, [b * s])?), b * s)
            }
            "t5" => {
                let c = if tiny { T5Config::tiny() } else { T5Config::t5_base() };
                let (b, s, l) = (pick(16, 2), pick(512, 16), pick(128, 8));
                let m = T5::new(ps, c, spelling)?;
                let batch = T5Batch {
                    input_ids: Tensor::from_vec(ids(b * s, c.vocab, 1), [b, s])?,
                    input_mask: Tensor::from_vec(vec![1i32; b * s], [b, s])?,
                    labels: Tensor::from_vec(ids(b * l, c.vocab, 2), [b, l])?,
                    label_mask: Tensor::from_vec(vec![1i32; b * l], [b, l])?,
                };
                (Model::T5(m, batch), b * (s + l))
            }
            other => return Err(format!("unknown model `{other}`: llama, gpt2, bert or t5").into()),
        })
    }

    fn module(&self) -> &dyn Module {
        match self {
            Model::Llama(m, ..) => m,
            Model::Gpt2(m, ..) => m,
            Model::Bert(m, ..) => m,
            Model::T5(m, ..) => m,
        }
    }

    fn loss(&self) -> kiln::Result<Tensor> {
        kiln::amp::autocast(DType::BF16, || match self {
            Model::Llama(m, x, y) => m.loss(x, y),
            Model::Gpt2(m, x, y) => m.loss(x, y),
            Model::Bert(m, batch, labels, weights) => m.mlm_loss(batch, labels, weights),
            Model::T5(m, batch) => m.loss(batch),
        })
    }
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: models_bench llama|gpt2|bert|t5 plain|builtin [ITERS REPS]";
    let (Some(name), Some(spelling)) = (args.first(), args.get(1)) else { return Err(usage.into()) };
    let spelling = match spelling.as_str() {
        "plain" => Spelling::Plain,
        "builtin" => Spelling::Builtin,
        other => return Err(format!("unknown spelling `{other}`; {usage}").into()),
    };
    let (iters, reps) = budget_run::iters_reps(&args)?;
    let tiny = args.get(4).is_some_and(|a| a == "tiny");
    let platform = budget_run::client_under(None)?;
    let mut ps = ParamStore::new(0);
    let (model, tokens) = Model::new(name, spelling, &mut ps, tiny)?;
    let params = model.module().parameters();
    let mut opt = AdamW::new(&params, AdamWConfig::default())?;
    kiln::mark_step()?;
    let mut host = (0.0, 0.0);
    let mut step = |opt: &mut AdamW| -> Res<Tensor> {
        let t = Instant::now();
        let loss = model.loss()?;
        let recorded = t.elapsed().as_secs_f64();
        let grads = kiln::grad(&loss, &params)?;
        host = (recorded * 1e3, (t.elapsed().as_secs_f64() - recorded) * 1e3);
        opt.step(&params, &grads, 3e-4)?;
        kiln::mark_step()?;
        Ok(loss)
    };
    let t = Instant::now();
    let mut losses = vec![step(&mut opt)?.item()?];
    let first_step_s = t.elapsed().as_secs_f64();
    let first = metrics::snapshot();
    for _ in 0..2 {
        losses.push(step(&mut opt)?.item()?);
    }
    let m = metrics::snapshot();
    let (ms, runs) = bench(
        || {
            step(&mut opt)?;
            Ok(())
        },
        2,
        iters,
        reps,
    )?;
    let xla = budget_run::step_memory()?;
    let result = json!({
        "system": "kiln",
        "model": name,
        "spelling": spelling.name(),
        "platform": platform,
        "ms": ms,
        "runs_ms": runs,
        "tokens_per_s": tokens as f64 / (ms / 1e3),
        "first_step_s": first_step_s,
        "losses": losses,
        "compiles": m.compiles,
        "composites_found": first.composites_found,
        "composites_missed": first.composites_missed,
        "host_record_ms": host.0,
        "host_grad_ms": host.1,
        "xla": budget_run::xla_json(&xla),
    });
    println!("RESULT {result}");
    Ok(())
}
