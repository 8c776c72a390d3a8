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
use crate::bert::{Bert, BertConfig, BertFlavor};
use crate::Spelling;

/// The sizes a Hugging Face `BertConfig`, `RobertaConfig` or
/// `XLMRobertaConfig` gives, refusing what kiln's encoder does not compute;
/// `tensors` say whether the checkpoint has the pooler.
pub fn bert_config(config: &Value, path: &Path, tensors: &[(String, Literal)]) -> Result<BertConfig> {
    let t = model_type(config, &["bert", "roberta", "xlm-roberta"], path)?;
    let flavor = match t.as_deref() {
        Some("roberta" | "xlm-roberta") => BertFlavor::Roberta { pad: size(config, "pad_token_id", 1, path)? },
        _ => BertFlavor::Bert,
    };
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
    let body = match flavor {
        BertFlavor::Bert => "bert",
        BertFlavor::Roberta { .. } => "roberta",
    };
    let pooler = tensors.iter().any(|(n, _)| *n == format!("{body}.pooler.dense.weight"));
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
    };
    if cfg.vocab == 0 || cfg.dim == 0 || cfg.heads == 0 || cfg.type_vocab == 0 || cfg.dim % cfg.heads != 0 {
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
    ) || name.ends_with("embeddings.position_ids")
}

/// A BERT, RoBERTa or XLM-R masked-LM model from a Hugging Face directory.
pub fn load_bert(dir: &Path, spelling: Spelling) -> Result<(ParamStore, Bert)> {
    load_dir(dir, bert_config, |ps, cfg| Bert::new(ps, cfg, spelling), locate, ignored)
}

/// Writes `model` as a Hugging Face `BertForMaskedLM` or
/// `RobertaForMaskedLM` directory.
pub fn save_bert(dir: &Path, model: &Bert, ps: &ParamStore) -> Result<()> {
    let c = model.cfg;
    let (model_type, arch, pad) = match c.flavor {
        BertFlavor::Bert => ("bert", "BertForMaskedLM", 0),
        BertFlavor::Roberta { pad } => ("roberta", "RobertaForMaskedLM", pad),
    };
    let config = json!({
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
    });
    save_dir(dir, &config, ps, locate)
}
