//! Llama (`LlamaForCausalLM`): `nn.Linear` weights transposed, the head
//! tied or its own `lm_head.weight` as the config says.

use std::path::Path;

use kiln_compiler::ir::Literal;
use kiln_frontend::nn::ParamStore;
use kiln_frontend::Result;
use serde_json::{json, Value};

use super::{bad, field, flag, load_dir, model_type, save_dir, size, string, HfName};
use crate::llama::{Llama, LlamaConfig};
use crate::Spelling;

/// The sizes a Hugging Face `LlamaConfig` gives, refusing what kiln's Llama
/// does not compute (biases, rope scaling, another activation or head size).
pub fn llama_config(config: &Value, path: &Path) -> Result<LlamaConfig> {
    model_type(config, &["llama"], path)?;
    if let Some(a) = string(config, "hidden_act", path)?.filter(|a| a != "silu") {
        return Err(bad(path, format!("hidden_act {a:?}: kiln's Llama computes silu (SwiGLU) only")));
    }
    for key in ["attention_bias", "mlp_bias"] {
        if flag(config, key, false, path)? {
            return Err(bad(path, format!("{key} = true: kiln's Llama has no biases")));
        }
    }
    // Transformers 4 keeps `rope_theta` and `rope_scaling` at the top;
    // 5 nests them in `rope_parameters` (`rope_type` "default" unscaled).
    let rope = config.get("rope_parameters").filter(|v| !v.is_null());
    let scaled = match rope {
        Some(r) => r.get("rope_type").and_then(Value::as_str).is_some_and(|t| t != "default"),
        None => config.get("rope_scaling").is_some_and(|v| !v.is_null()),
    };
    if scaled {
        return Err(bad(path, "rope scaling (rope_scaling, or a rope_type other than default) is not computed".into()));
    }
    let theta = match rope {
        Some(r) => field(r, "rope_theta", Value::as_f64, path)?,
        None => field(config, "rope_theta", Value::as_f64, path)?,
    };
    let dim = size(config, "hidden_size", 4096, path)?;
    let heads = size(config, "num_attention_heads", 32, path)?;
    let cfg = LlamaConfig {
        vocab: size(config, "vocab_size", 32000, path)?,
        dim,
        layers: size(config, "num_hidden_layers", 32, path)?,
        heads,
        kv_heads: size(config, "num_key_value_heads", heads, path)?,
        ffn: size(config, "intermediate_size", 11008, path)?,
        rope_theta: theta.unwrap_or(10000.0),
        eps: field(config, "rms_norm_eps", Value::as_f64, path)?.unwrap_or(1e-6),
        tie_embeddings: flag(config, "tie_word_embeddings", false, path)?,
    };
    if cfg.vocab == 0 || dim == 0 || heads == 0 || dim % heads != 0 {
        return Err(bad(path, format!("sizes that make no model: {cfg:?}")));
    }
    if let Some(hd) = field(config, "head_dim", |v| v.as_u64(), path)? {
        if hd != (dim / heads) as u64 {
            let reason =
                format!("head_dim = {hd}: kiln's Llama has hidden_size / num_attention_heads = {}", dim / heads);
            return Err(bad(path, reason));
        }
    }
    Ok(cfg)
}

/// Where kiln's parameter `name` is: the projections transposed; the
/// embedding and the untied head are `[vocab, dim]` in both.
fn locate(name: &str) -> Vec<HfName> {
    let table = name == "model.embed_tokens.weight" || name == "lm_head.weight";
    let linear = name.ends_with("_proj.weight");
    vec![if linear && !table { HfName::transposed(name) } else { HfName::same(name) }]
}

/// A Llama from a Hugging Face directory (`LlamaForCausalLM`).
pub fn load_llama(dir: &Path, spelling: Spelling) -> Result<(ParamStore, Llama)> {
    let config = |c: &Value, p: &Path, _: &[(String, Literal)]| llama_config(c, p);
    let tied = flag(&super::read_config(dir)?, "tie_word_embeddings", false, &dir.join("config.json"))?;
    // Rotary buffers of older files; the head's copy when tied.
    let ignored = move |n: &str| n.ends_with("rotary_emb.inv_freq") || (tied && n == "lm_head.weight");
    load_dir(dir, config, |ps, cfg| Llama::new(ps, cfg, spelling), locate, ignored)
}

/// Writes `model` as a Hugging Face `LlamaForCausalLM` directory.
pub fn save_llama(dir: &Path, model: &Llama, ps: &ParamStore, max_shard_bytes: Option<u64>) -> Result<()> {
    let c = model.cfg;
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab,
        "hidden_size": c.dim,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.dim / c.heads,
        "intermediate_size": c.ffn,
        "hidden_act": "silu",
        "rms_norm_eps": c.eps,
        "rope_theta": c.rope_theta,
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": "float32",
    });
    save_dir(dir, &config, ps, locate, max_shard_bytes)
}
