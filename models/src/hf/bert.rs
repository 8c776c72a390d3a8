//! BERT (`BertForMaskedLM`, `BertModel`), RoBERTa and XLM-R
//! (`RobertaForMaskedLM`, `XLMRobertaForMaskedLM`): `nn.Linear` weights
//! transposed, the masked-LM decoder tied to the word embeddings, the pooler
//! present when the file has it.

use std::path::Path;

use kiln_compiler::ir::Literal;
use kiln_frontend::nn::ParamStore;
use kiln_frontend::Result;
use serde_json::{json, Value};

use super::{bad, field, flag, load_dir, model_type, save_dir, size, string, HfName};
use crate::bert::{Bert, BertClassifier, BertConfig, BertFlavor};
use crate::Spelling;

/// The sizes a Hugging Face `BertConfig`, `RobertaConfig` or
/// `XLMRobertaConfig` gives, refusing what kiln's encoder does not compute;
/// `tensors` say whether the checkpoint has the pooler.
pub fn bert_config(config: &Value, path: &Path, tensors: &[(String, Literal)]) -> Result<BertConfig> {
    let t = model_type(config, &["bert", "roberta", "xlm-roberta", "distilbert"], path)?;
    let flavor = match t.as_deref() {
        Some("roberta" | "xlm-roberta") => BertFlavor::Roberta { pad: size(config, "pad_token_id", 1, path)? },
        Some("distilbert") => BertFlavor::DistilBert,
        _ => BertFlavor::Bert,
    };
    if flavor == BertFlavor::DistilBert {
        return distilbert_config(config, path, tensors);
    }
    if let Some(a) = string(config, "hidden_act", path)?.filter(|a| a != "gelu") {
        return Err(bad(path, format!("hidden_act {a:?}: kiln's BERT computes gelu (erf) only")));
    }
    if let Some(p) = string(config, "position_embedding_type", path)?.filter(|p| p != "absolute") {
        return Err(bad(path, format!("position_embedding_type {p:?}: kiln's BERT has absolute positions only")));
    }
    for key in ["is_decoder", "add_cross_attention"] {
        if flag(config, key, false, path)? {
            return Err(bad(path, format!("{key} = true: kiln's BERT is an encoder")));
        }
    }
    if !flag(config, "tie_word_embeddings", true, path)? {
        return Err(bad(path, "tie_word_embeddings = false: kiln's masked-LM head is tied".into()));
    }
    let body = if flavor == BertFlavor::Bert { "bert" } else { "roberta" };
    let has = |name: &str| tensors.iter().any(|(n, _)| n == name);
    let pooler = has(&format!("{body}.pooler.dense.weight"));
    let mlm_head = has("cls.predictions.transform.dense.weight") || has("lm_head.dense.weight");
    let cfg = BertConfig {
        vocab: size(config, "vocab_size", 30522, path)?,
        dim: size(config, "hidden_size", 768, path)?,
        layers: size(config, "num_hidden_layers", 12, path)?,
        heads: size(config, "num_attention_heads", 12, path)?,
        ffn: size(config, "intermediate_size", 3072, path)?,
        max_positions: size(config, "max_position_embeddings", 512, path)?,
        type_vocab: size(config, "type_vocab_size", 2, path)?,
        eps: field(config, "layer_norm_eps", Value::as_f64, path)?.unwrap_or(1e-12),
        flavor,
        pooler,
        mlm_head,
    };
    if cfg.vocab == 0 || cfg.dim == 0 || cfg.heads == 0 || cfg.type_vocab == 0 || cfg.dim % cfg.heads != 0 {
        return Err(bad(path, format!("sizes that make no model: {cfg:?}")));
    }
    Ok(cfg)
}

/// A `DistilBertConfig`'s sizes (its own keys: `dim`, `n_layers`,
/// `hidden_dim`, ...), refusing sinusoidal positions and other activations.
fn distilbert_config(config: &Value, path: &Path, tensors: &[(String, Literal)]) -> Result<BertConfig> {
    if let Some(a) = string(config, "activation", path)?.filter(|a| a != "gelu") {
        return Err(bad(path, format!("activation {a:?}: kiln's DistilBERT computes gelu (erf) only")));
    }
    if flag(config, "sinusoidal_pos_embds", false, path)? {
        return Err(bad(path, "sinusoidal_pos_embds = true: kiln's DistilBERT has learned positions only".into()));
    }
    if !flag(config, "tie_word_embeddings", true, path)? {
        return Err(bad(path, "tie_word_embeddings = false: kiln's masked-LM head is tied".into()));
    }
    let cfg = BertConfig {
        vocab: size(config, "vocab_size", 30522, path)?,
        dim: size(config, "dim", 768, path)?,
        layers: size(config, "n_layers", 6, path)?,
        heads: size(config, "n_heads", 12, path)?,
        ffn: size(config, "hidden_dim", 3072, path)?,
        max_positions: size(config, "max_position_embeddings", 512, path)?,
        type_vocab: 0,
        eps: 1e-12,
        flavor: BertFlavor::DistilBert,
        pooler: false,
        mlm_head: tensors.iter().any(|(n, _)| n == "vocab_transform.weight"),
    };
    if cfg.vocab == 0 || cfg.dim == 0 || cfg.heads == 0 || cfg.dim % cfg.heads != 0 {
        return Err(bad(path, format!("sizes that make no model: {cfg:?}")));
    }
    Ok(cfg)
}

/// Where kiln's parameter `name` is: `nn.Linear` weights (rank 2, not an
/// embedding table) transposed.
fn locate(name: &str) -> Vec<HfName> {
    let linear = name.ends_with(".weight")
        && !name.contains(".embeddings.")
        && !name.contains("LayerNorm")
        && !name.contains("layer_norm");
    vec![if linear { HfName::transposed(name) } else { HfName::same(name) }]
}

/// What a BERT-family file may hold besides the parameters: the tied
/// decoder (weight and bias) and the old position-id buffer.
fn ignored(name: &str) -> bool {
    matches!(
        name,
        "cls.predictions.decoder.weight"
            | "cls.predictions.decoder.bias"
            | "lm_head.decoder.weight"
            | "lm_head.decoder.bias"
            | "vocab_projector.weight"
    ) || name.ends_with("embeddings.position_ids")
}

/// A BERT, RoBERTa or XLM-R masked-LM model from a Hugging Face directory.
pub fn load_bert(dir: &Path, spelling: Spelling) -> Result<(ParamStore, Bert)> {
    load_dir(dir, bert_config, |ps, cfg| Bert::new(ps, cfg, spelling), locate, ignored)
}

/// The class names of a classifier's config (`id2label`, by id), or
/// `LABEL_i` for `n` classes when it has none.
fn class_names(config: &Value, n: usize, path: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = (0..n).map(|i| format!("LABEL_{i}")).collect();
    if let Some(map) = config.get("id2label").and_then(Value::as_object) {
        for (id, name) in map {
            let i: usize = id.parse().map_err(|_| bad(path, format!("id2label key {id:?} is not a class id")))?;
            let Some(slot) = names.get_mut(i) else {
                return Err(bad(path, format!("id2label names class {i}, the classifier has {n}")));
            };
            *slot = name.as_str().map_or_else(|| name.to_string(), str::to_string);
        }
    }
    Ok(names)
}

/// A BERT, RoBERTa, XLM-R or DistilBERT sequence classifier from a Hugging
/// Face directory (`BertForSequenceClassification`,
/// `RobertaForSequenceClassification`, `DistilBertForSequenceClassification`): its classes are the rows of the
/// classifier's output weight, named by `id2label`.
pub fn load_bert_classifier(dir: &Path, spelling: Spelling) -> Result<(ParamStore, BertClassifier)> {
    let config_path = dir.join("config.json");
    let value = super::read_config(dir)?;
    let config = |c: &Value, p: &Path, tensors: &[(String, Literal)]| -> Result<(BertConfig, Vec<String>)> {
        let cfg = bert_config(c, p, tensors)?;
        let out = tensors.iter().find(|(n, _)| n == "classifier.weight" || n == "classifier.out_proj.weight");
        let Some((_, w)) = out else {
            return Err(bad(p, "no classifier.weight or classifier.out_proj.weight: not a sequence classifier".into()));
        };
        let n = w.ty().shape.dims().first().copied().unwrap_or(0);
        Ok((cfg, class_names(&value, n, &config_path)?))
    };
    let make =
        |ps: &mut ParamStore, (cfg, labels): (BertConfig, Vec<String>)| BertClassifier::new(ps, cfg, labels, spelling);
    load_dir(dir, config, make, locate, ignored)
}

/// Writes `model` as a Hugging Face `BertForMaskedLM` or
/// `RobertaForMaskedLM` directory.
pub fn save_bert(dir: &Path, model: &Bert, ps: &ParamStore, max_shard_bytes: Option<u64>) -> Result<()> {
    save_dir(dir, &config_of(model, "ForMaskedLM"), ps, locate, max_shard_bytes)
}

/// Writes `model` as a Hugging Face `BertForSequenceClassification`,
/// `RobertaForSequenceClassification` or `DistilBertForSequenceClassification`
/// directory, its classes named.
pub fn save_bert_classifier(
    dir: &Path,
    model: &BertClassifier,
    ps: &ParamStore,
    max_shard_bytes: Option<u64>,
) -> Result<()> {
    let mut config = config_of(&model.bert, "ForSequenceClassification");
    let id2label: serde_json::Map<String, Value> =
        model.labels.iter().enumerate().map(|(i, l)| (i.to_string(), json!(l))).collect();
    let label2id: serde_json::Map<String, Value> =
        model.labels.iter().enumerate().map(|(i, l)| (l.clone(), json!(i))).collect();
    config["id2label"] = Value::Object(id2label);
    config["label2id"] = Value::Object(label2id);
    save_dir(dir, &config, ps, locate, max_shard_bytes)
}

/// The config of `model`'s encoder for the architecture `{Bert,Roberta}{task}`.
fn config_of(model: &Bert, task: &str) -> Value {
    let c = model.cfg;
    let (model_type, family, pad) = match c.flavor {
        BertFlavor::Bert => ("bert", "Bert", 0),
        BertFlavor::Roberta { pad } => ("roberta", "Roberta", pad),
        BertFlavor::DistilBert => ("distilbert", "DistilBert", 0),
    };
    let arch = format!("{family}{task}");
    if c.flavor == BertFlavor::DistilBert {
        return json!({
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": c.vocab,
            "dim": c.dim,
            "n_layers": c.layers,
            "n_heads": c.heads,
            "hidden_dim": c.ffn,
            "max_position_embeddings": c.max_positions,
            "activation": "gelu",
            "sinusoidal_pos_embds": false,
            "pad_token_id": pad,
            "tie_word_embeddings": true,
            "torch_dtype": "float32",
        });
    }
    json!({
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": c.vocab,
        "hidden_size": c.dim,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "intermediate_size": c.ffn,
        "max_position_embeddings": c.max_positions,
        "type_vocab_size": c.type_vocab,
        "layer_norm_eps": c.eps,
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        "pad_token_id": pad,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    })
}
