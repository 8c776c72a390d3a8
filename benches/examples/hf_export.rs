//! Writes a tiny random kiln model of every architecture kiln reads from
//! Hugging Face as a `save_pretrained`-style directory (`hf::save`), with its
//! logits on fixed inputs, for `benches/hf/check.py check DIR` to load with
//! `transformers` and compare:
//! `cargo run --release -p kiln-benches --example hf_export -- DIR`.
//!
//! Writes `DIR/<name>/model/` and `DIR/<name>/expected.safetensors` (the
//! inputs under the names the model's forward takes, and `logits`).

use kiln::models::bert::{Bert, BertBatch, BertClassifier, BertConfig, BertFlavor};
use kiln::models::gpt2::{Gpt2, Gpt2Config};
use kiln::models::hf::{self, HfModel};
use kiln::models::llama::{Llama, LlamaConfig};
use kiln::models::t5::{FeedForward, T5Config, T5};
use kiln::models::Spelling;
use kiln::nn::ParamStore;
use kiln::{DType, Tensor};

/// Biases and norms away from their init (zeros, ones), so a swapped tensor
/// shows in the logits.
fn perturb(ps: &ParamStore) -> kiln::Result<()> {
    for (i, (_, p)) in ps.iter().enumerate() {
        if p.rank() == 1 {
            let n = p.dims()[0];
            let shift: Vec<f32> = (0..n).map(|j| (((i * 31 + j * 7) % 23) as f32 - 11.0) * 0.01).collect();
            p.assign(&p.add(&Tensor::from_vec(shift, [n])?)?)?;
        }
    }
    kiln::mark_step()?;
    Ok(())
}

/// `[2, len]` ids in `3..vocab`, the second row padded with `pad` after 5
/// when `padded`; the mask to match.
fn ids(vocab: usize, len: usize, pad: i32, padded: bool, salt: usize) -> kiln::Result<(Tensor, Tensor)> {
    let mut ids: Vec<i32> = (0..2 * len).map(|i| (3 + (i * 37 + salt * 11) % (vocab - 3)) as i32).collect();
    let mut mask = vec![1i32; 2 * len];
    if padded {
        for j in 5..len {
            ids[len + j] = pad;
            mask[len + j] = 0;
        }
    }
    Ok((Tensor::from_vec(ids, [2, len])?, Tensor::from_vec(mask, [2, len])?))
}

/// The tiny DistilBERT both DistilBERT directories are written from.
fn distilbert() -> BertConfig {
    BertConfig { vocab: 89, type_vocab: 0, flavor: BertFlavor::DistilBert, pooler: false, ..BertConfig::tiny() }
}

fn main() -> kiln::Result<()> {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "hf-export".into()));
    let mut written = Vec::new();
    let names = [
        "gpt2",
        "bert",
        "roberta",
        "distilbert",
        "llama",
        "llama-sharded",
        "t5",
        "t5-gated",
        "bert-cls",
        "roberta-cls",
        "distilbert-cls",
    ];
    for name in names {
        let mut ps = ParamStore::new(5);
        let mut inputs = Vec::new();
        let model = match name {
            "gpt2" => {
                let cfg = Gpt2Config { vocab: 97, dim: 32, layers: 2, heads: 4, max_positions: 16, eps: 1e-5 };
                HfModel::Gpt2(Gpt2::new(&mut ps, cfg, Spelling::Builtin)?)
            }
            "bert" => {
                HfModel::Bert(Bert::new(&mut ps, BertConfig { vocab: 89, ..BertConfig::tiny() }, Spelling::Builtin)?)
            }
            "roberta" => {
                let cfg = BertConfig {
                    vocab: 83,
                    max_positions: 18,
                    type_vocab: 1,
                    flavor: BertFlavor::Roberta { pad: 1 },
                    pooler: false,
                    mlm_head: true,
                    ..BertConfig::tiny()
                };
                HfModel::Bert(Bert::new(&mut ps, cfg, Spelling::Builtin)?)
            }
            "distilbert" => HfModel::Bert(Bert::new(&mut ps, distilbert(), Spelling::Builtin)?),
            "bert-cls" => {
                let labels = vec!["no".to_string(), "maybe".to_string(), "yes".to_string()];
                HfModel::BertClassifier(BertClassifier::new(
                    &mut ps,
                    BertConfig { vocab: 89, ..BertConfig::tiny() },
                    labels,
                    Spelling::Builtin,
                )?)
            }
            "roberta-cls" => {
                let cfg = BertConfig {
                    vocab: 83,
                    max_positions: 18,
                    type_vocab: 1,
                    flavor: BertFlavor::Roberta { pad: 1 },
                    ..BertConfig::tiny()
                };
                let labels = vec!["a".to_string(), "b".to_string()];
                HfModel::BertClassifier(BertClassifier::new(&mut ps, cfg, labels, Spelling::Builtin)?)
            }
            "distilbert-cls" => {
                let labels = ["w", "x", "y", "z"].map(String::from).to_vec();
                HfModel::BertClassifier(BertClassifier::new(&mut ps, distilbert(), labels, Spelling::Builtin)?)
            }
            "llama" | "llama-sharded" => {
                let cfg = LlamaConfig { vocab: 79, eps: 1e-6, tie_embeddings: false, ..LlamaConfig::tiny() };
                HfModel::Llama(Llama::new(&mut ps, cfg, Spelling::Builtin)?)
            }
            "t5" => {
                let cfg = T5Config { vocab: 71, feed_forward: FeedForward::Relu, ..T5Config::tiny() };
                HfModel::T5(T5::new(&mut ps, cfg, Spelling::Builtin)?)
            }
            _ => {
                let cfg = T5Config { vocab: 71, decoder_layers: 3, scale_decoder_output: false, ..T5Config::tiny() };
                HfModel::T5(T5::new(&mut ps, cfg, Spelling::Builtin)?)
            }
        };
        perturb(&ps)?;
        let logits = match &model {
            HfModel::Gpt2(m) => {
                let (x, _) = ids(97, 8, 0, false, 1)?;
                inputs.push(("input_ids", x.clone()));
                m.logits(&x)?
            }
            HfModel::Llama(m) => {
                let (x, _) = ids(79, 8, 0, false, 2)?;
                inputs.push(("input_ids", x.clone()));
                m.logits(&x)?
            }
            HfModel::Bert(_) | HfModel::BertClassifier(_) => {
                let m = match &model {
                    HfModel::BertClassifier(c) => &c.bert,
                    HfModel::Bert(m) => m,
                    _ => unreachable!(),
                };
                let pad = match m.cfg.flavor {
                    BertFlavor::Bert | BertFlavor::DistilBert => 0,
                    BertFlavor::Roberta { pad } => pad as i32,
                };
                let (x, mask) = ids(m.cfg.vocab, 8, pad, true, 3)?;
                let types = if m.cfg.type_vocab > 1 {
                    let t: Vec<i32> = (0..16).map(|i| i32::from(i % 8 >= 4)).collect();
                    let t = Tensor::from_vec(t, [2, 8])?;
                    inputs.push(("token_type_ids", t.clone()));
                    t
                } else {
                    Tensor::zeros(DType::I32, [2, 8])?
                };
                inputs.push(("input_ids", x.clone()));
                inputs.push(("attention_mask", mask.clone()));
                let batch = BertBatch { ids: x, types, mask };
                match &model {
                    HfModel::BertClassifier(c) => c.logits(&batch)?,
                    _ => m.mlm_logits(&batch)?,
                }
            }
            HfModel::T5(m) => {
                let (x, mask) = ids(71, 8, 0, true, 4)?;
                let (dec, _) = ids(71, 6, 0, false, 5)?;
                inputs.extend([("input_ids", x.clone()), ("attention_mask", mask.clone())]);
                inputs.push(("decoder_input_ids", dec.clone()));
                m.logits(&x, &mask, &dec)?
            }
        };
        kiln::mark_step()?;
        let out = dir.join(name);
        // The sharded one in shards of at most 30 KB, as transformers names them.
        let shard = if name == "llama-sharded" { 30_000 } else { hf::MAX_SHARD_BYTES };
        hf::save_sharded(&out.join("model"), &model, &ps, shard)?;
        let mut tensors: Vec<(String, Tensor)> = inputs.into_iter().map(|(n, t)| (n.to_string(), t)).collect();
        tensors.push(("logits".to_string(), logits));
        kiln::checkpoint::save(out.join("expected.safetensors"), 0, &tensors)?;
        written.push(name);
    }
    println!("wrote {}: {}", dir.display(), written.join(", "));
    Ok(())
}
