//! kiln's models against Hugging Face `transformers` itself: tiny random
//! models `benches/hf/check.py make` saved with `save_pretrained`
//! (`testsuite/fixtures/hf/`, with their logits on fixed inputs, padded
//! where the model takes a mask) load through `kiln::models::hf::load` and
//! give the same logits in both spellings; every architecture written back
//! loads to the same logits; wrong files are refused naming the tensor.

#![allow(clippy::unwrap_used)] // Test helpers may unwrap (the workspace denies it in library code).

use std::path::{Path, PathBuf};

use kiln::compiler::ir::Literal;
use kiln::models::bert::BertBatch;
use kiln::models::hf::{self, HfModel};
use kiln::models::Spelling;
use kiln::Tensor;

/// f32 logits within this of transformers' (CPU, f32 both sides).
const TOLERANCE: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf")
}

fn expected(name: &str) -> Vec<(String, Literal)> {
    hf::read_safetensors(&fixtures().join(format!("{name}-expected.safetensors"))).unwrap()
}

fn get(tensors: &[(String, Literal)], name: &str) -> Tensor {
    Tensor::from_literal(tensors.iter().find(|(n, _)| n == name).unwrap().1.clone())
}

/// The model's logits on the fixture's inputs.
fn logits(model: &HfModel, inputs: &[(String, Literal)]) -> Tensor {
    let ids = get(inputs, "input_ids");
    let out = match model {
        HfModel::Gpt2(m) => m.logits(&ids),
        HfModel::Llama(m) => m.logits(&ids),
        HfModel::Bert(_) | HfModel::BertClassifier(_) => {
            let has = |n: &str| inputs.iter().any(|(k, _)| k == n);
            let mask = get(inputs, "attention_mask");
            let types = if has("token_type_ids") {
                get(inputs, "token_type_ids")
            } else {
                Tensor::zeros(kiln::DType::I32, ids.shape().clone()).unwrap()
            };
            let batch = BertBatch { ids, types, mask };
            match model {
                HfModel::Bert(m) => m.mlm_logits(&batch),
                HfModel::BertClassifier(m) => m.logits(&batch),
                _ => unreachable!(),
            }
        }
        HfModel::T5(m) => m.logits(&ids, &get(inputs, "attention_mask"), &get(inputs, "decoder_input_ids")),
    };
    out.unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

const MODELS: [(&str, &str); 12] = [
    ("gpt2-tiny", "gpt2"),
    ("bert-tiny", "bert"),
    ("roberta-tiny", "roberta"),
    ("llama-tiny", "llama"),
    ("t5-tiny", "t5"),
    ("t5-gated-tiny", "t5"),
    ("distilbert-tiny", "distilbert"),
    ("bert-cls-tiny", "bert"),
    ("roberta-cls-tiny", "roberta"),
    ("distilbert-cls-tiny", "distilbert"),
    // XLM-R is RoBERTa's architecture under another model_type.
    ("xlm-roberta-tiny", "roberta"),
    // Saved by transformers in three shards with an index.
    ("llama-sharded-tiny", "llama"),
];

#[test]
fn transformers_models_give_transformers_logits() {
    for (name, model_type) in MODELS {
        let inputs = expected(name);
        let want = get(&inputs, "logits");
        for spelling in Spelling::ALL {
            let (_, model) = hf::load(&fixtures().join(name), spelling).unwrap();
            assert_eq!(model.model_type(), model_type);
            if let HfModel::BertClassifier(m) = &model {
                // The classes as the config's id2label names them.
                let want: &[&str] = match name {
                    "bert-cls-tiny" => &["negative", "neutral", "positive"],
                    "distilbert-cls-tiny" => &["spam", "ham", "other", "more"],
                    _ => &["LABEL_0", "LABEL_1"],
                };
                assert_eq!(m.labels, want);
            }
            let diff = max_diff(&logits(&model, &inputs), &want);
            eprintln!("{name} ({}): max |kiln - transformers| = {diff:.2e}", spelling.name());
            assert!(diff <= TOLERANCE, "{name} {spelling:?}: {diff} > {TOLERANCE}");
        }
    }
}

#[test]
fn every_architecture_written_back_loads_to_the_same_logits() {
    for (name, _) in MODELS {
        let inputs = expected(name);
        let (ps, model) = hf::load(&fixtures().join(name), Spelling::Builtin).unwrap();
        let dir = tempfile::tempdir().unwrap();
        hf::save(dir.path(), &model, &ps).unwrap();
        let (_, again) = hf::load(dir.path(), Spelling::Builtin).unwrap();
        let diff = max_diff(&logits(&model, &inputs), &logits(&again, &inputs));
        assert_eq!(diff, 0.0, "{name}: written and read back, the logits moved by {diff}");
        // The file holds what transformers' does, under the same names and
        // shapes (kiln drops nothing and adds nothing).
        let ours = hf::read_tensors(dir.path()).unwrap();
        let theirs = hf::read_tensors(&fixtures().join(name)).unwrap();
        let shapes = |t: &[(String, Literal)]| {
            let mut v = t.iter().map(|(n, l)| (n.clone(), l.ty().clone())).collect::<Vec<_>>();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        assert_eq!(shapes(&ours), shapes(&theirs), "{name}");
    }
}

#[test]
fn sharded_checkpoints_load_and_save_and_bad_indexes_are_refused() {
    let name = "llama-sharded-tiny";
    let inputs = expected(name);
    let (ps, model) = hf::load(&fixtures().join(name), Spelling::Builtin).unwrap();
    // Written in shards of at most 30 KB (82 KB of weights): an index and three files, as
    // transformers names them; read back to the same logits.
    let dir = tempfile::tempdir().unwrap();
    hf::save(dir.path(), &model, &ps).unwrap();
    assert!(dir.path().join("model.safetensors").exists());
    hf::save_sharded(dir.path(), &model, &ps, 30_000).unwrap();
    let mut files: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(
        files,
        [
            "config.json",
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json"
        ],
        "the one-file weights of the earlier save are gone"
    );
    let (_, again) = hf::load(dir.path(), Spelling::Builtin).unwrap();
    assert_eq!(max_diff(&logits(&model, &inputs), &logits(&again, &inputs)), 0.0);
    // Saved whole again: the shards and the index go.
    hf::save(dir.path(), &model, &ps).unwrap();
    assert!(!dir.path().join("model.safetensors.index.json").exists());
    assert!(!dir.path().join("model-00001-of-00003.safetensors").exists());

    // Bad indexes: a shard outside the directory, a tensor not in its shard,
    // a shard holding a tensor the index does not list.
    let copy = |edit: &dyn Fn(&mut serde_json::Value)| {
        let d = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(fixtures().join(name)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
        }
        let index = d.path().join("model.safetensors.index.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(&index, v.to_string()).unwrap();
        d
    };
    let d = copy(&|v| v["weight_map"]["lm_head.weight"] = "../../etc/passwd".into());
    let e = refused(d.path());
    assert!(e.contains("lm_head.weight") && e.contains("not a file of this directory"), "{e}");
    // (lm_head.weight is all of shard 3, which the index then no longer names.)
    let d = copy(&|v| v["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors".into());
    let e = refused(d.path());
    assert!(e.contains("not in their shards: lm_head.weight (in model-00001-of-00003.safetensors)"), "{e}");
    let d = copy(&|v| v["weight_map"]["model.norm.weight"] = "model-00003-of-00003.safetensors".into());
    let e = refused(d.path());
    assert!(e.contains("tensor model.norm.weight is in this shard but the index has it listed in"), "{e}");
    let d = copy(&|v| {
        v["weight_map"].as_object_mut().unwrap().remove("model.norm.weight");
    });
    let e = refused(d.path());
    assert!(e.contains("model.norm.weight is in this shard but the index has it not listed"), "{e}");
    let d = copy(&|v| v["weight_map"]["extra.weight"] = "model-00001-of-00003.safetensors".into());
    let e = refused(d.path());
    assert!(e.contains("extra.weight (in model-00001-of-00003.safetensors)"), "{e}");
}

/// A copy of fixture `name` with its tensors edited.
fn edited(name: &str, edit: impl FnOnce(&mut Vec<(String, Literal)>)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixtures().join(name).join("config.json"), dir.path().join("config.json")).unwrap();
    let mut tensors = hf::read_tensors(&fixtures().join(name)).unwrap();
    edit(&mut tensors);
    let t: Vec<(String, Tensor)> = tensors.into_iter().map(|(n, l)| (n, Tensor::from_literal(l))).collect();
    kiln::checkpoint::save(dir.path().join("model.safetensors"), 0, &t).unwrap();
    dir
}

fn refused(dir: &Path) -> String {
    match hf::load(dir, Spelling::Builtin) {
        Ok(_) => panic!("a bad directory loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn wrong_files_and_configs_are_refused_naming_what_is_wrong() {
    // A projection stored the wrong way round: named with both layouts.
    let d = edited("llama-tiny", |t| {
        let i = t.iter().position(|(n, _)| n == "model.layers.0.self_attn.k_proj.weight").unwrap();
        let lit = &t[i].1;
        let ty = kiln::TensorType::new(lit.ty().dtype, [32usize, 16]);
        t[i].1 = Literal::from_bytes(ty, lit.bytes().to_vec()).unwrap();
    });
    let e = refused(d.path());
    assert!(e.contains("model.layers.0.self_attn.k_proj.weight") && e.contains("[out, in]"), "{e}");

    // An untied Llama without its head.
    let d = edited("llama-tiny", |t| t.retain(|(n, _)| n != "lm_head.weight"));
    assert!(refused(d.path()).contains("no tensor lm_head.weight"));

    // BERT with a next-sentence head kiln's masked-LM model does not have.
    let d = edited("bert-tiny", |t| {
        let w = t.iter().find(|(n, _)| n == "cls.predictions.transform.dense.weight").unwrap().1.clone();
        t.push(("cls.seq_relationship.weight".into(), w));
    });
    assert!(refused(d.path()).contains("tensors the model does not have: cls.seq_relationship.weight"));

    // T5 without a decoder block's cross-attention.
    let d = edited("t5-tiny", |t| t.retain(|(n, _)| !n.starts_with("decoder.block.1.layer.1.EncDecAttention.q")));
    assert!(refused(d.path()).contains("no tensor decoder.block.1.layer.1.EncDecAttention.q.weight"));

    // Configs kiln's models cannot honour.
    for (name, field, value, said) in [
        ("llama-tiny", "hidden_act", "\"gelu\"", "hidden_act \"gelu\""),
        ("llama-tiny", "attention_bias", "true", "attention_bias = true"),
        ("llama-tiny", "rope_parameters", "{\"rope_type\": \"yarn\", \"factor\": 4.0}", "rope scaling"),
        ("llama-tiny", "head_dim", "16", "head_dim = 16"),
        ("bert-tiny", "position_embedding_type", "\"relative_key\"", "position_embedding_type"),
        ("bert-tiny", "hidden_act", "\"relu\"", "hidden_act \"relu\""),
        ("t5-tiny", "feed_forward_proj", "\"gated-silu\"", "feed_forward_proj \"gated-silu\""),
        ("t5-tiny", "model_type", "\"mt5\"", "model_type \"mt5\""),
    ] {
        let d = edited(name, |_| {});
        let path = d.path().join("config.json");
        let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config[field] = serde_json::from_str(value).unwrap();
        std::fs::write(&path, config.to_string()).unwrap();
        let e = refused(d.path());
        assert!(e.contains(said), "{name} {field}: {e}");
    }
}
