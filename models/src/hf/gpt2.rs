//! GPT-2 (`GPT2LMHeadModel`, `GPT2Model`): names as kiln's, `Conv1D`
//! weights `[in, out]` as kiln's `Linear`, the head tied to `wte`.

use std::path::Path;

use kiln_compiler::ir::Literal;
use kiln_frontend::nn::ParamStore;
use kiln_frontend::Result;
use serde_json::{json, Value};

use super::{bad, field, flag, load_dir, model_type, save_dir, size, string, HfName};
use crate::gpt2::{Gpt2, Gpt2Config};
use crate::Spelling;

/// The GPT-2 sizes a Hugging Face `GPT2Config` gives, refusing the options
/// kiln's GPT-2 does not compute.
pub fn gpt2_config(config: &Value, path: &Path) -> Result<Gpt2Config> {
    model_type(config, &["gpt2"], path)?;
    if let Some(a) =
        string(config, "activation_function", path)?.filter(|a| a != "gelu_new" && a != "gelu_pytorch_tanh")
    {
        return Err(bad(path, format!("activation_function {a:?}: kiln's GPT-2 computes gelu_new (tanh) only")));
    }
    for key in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
        if flag(config, key, false, path)? {
            return Err(bad(path, format!("{key} = true is not computed by kiln's GPT-2")));
        }
    }
    if !flag(config, "scale_attn_weights", true, path)? || !flag(config, "tie_word_embeddings", true, path)? {
        return Err(bad(path, "scale_attn_weights and tie_word_embeddings must be true for kiln's GPT-2".into()));
    }
    if let Some(inner) = field(config, "n_inner", |v| v.as_u64(), path)? {
        let dim = size(config, "n_embd", 768, path)?;
        if inner != 4 * dim as u64 {
            return Err(bad(path, format!("n_inner = {inner}: kiln's GPT-2 has a 4 x n_embd = {} MLP", 4 * dim)));
        }
    }
    let eps = field(config, "layer_norm_epsilon", Value::as_f64, path)?.unwrap_or(1e-5);
    let cfg = Gpt2Config {
        vocab: size(config, "vocab_size", 50257, path)?,
        dim: size(config, "n_embd", 768, path)?,
        layers: size(config, "n_layer", 12, path)?,
        heads: size(config, "n_head", 12, path)?,
        max_positions: size(config, "n_positions", 1024, path)?,
        eps,
    };
    if cfg.vocab == 0 || cfg.dim == 0 || cfg.heads == 0 || cfg.max_positions == 0 || cfg.dim % cfg.heads != 0 {
        return Err(bad(path, format!("sizes that make no model: {cfg:?}")));
    }
    Ok(cfg)
}

/// Where kiln's GPT-2 parameter `name` is: under its own name, or without
/// the `transformer.` prefix (a `GPT2Model` file).
fn locate(name: &str) -> Vec<HfName> {
    let mut out = vec![HfName::same(name)];
    out.extend(name.strip_prefix("transformer.").map(HfName::same));
    out
}

/// A GPT-2 from a Hugging Face directory (`GPT2LMHeadModel` or `GPT2Model`
/// as `save_pretrained` writes it).
pub fn load_gpt2(dir: &Path, spelling: Spelling) -> Result<(ParamStore, Gpt2)> {
    let config = |c: &Value, p: &Path, _: &[(String, Literal)]| gpt2_config(c, p);
    // The tied head and the attention's mask buffers (older files keep them).
    let ignored = |n: &str| n == "lm_head.weight" || n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias");
    load_dir(dir, config, |ps, cfg| Gpt2::new(ps, cfg, spelling), locate, ignored)
}

/// Writes `model` (its parameters in `ps`) as a Hugging Face
/// `GPT2LMHeadModel` directory: `config.json` and `model.safetensors`.
pub fn save_gpt2(dir: &Path, model: &Gpt2, ps: &ParamStore, max_shard_bytes: Option<u64>) -> Result<()> {
    let c = model.cfg;
    let config = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab,
        "n_embd": c.dim,
        "n_layer": c.layers,
        "n_head": c.heads,
        "n_positions": c.max_positions,
        "n_ctx": c.max_positions,
        "layer_norm_epsilon": c.eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    });
    save_dir(dir, &config, ps, locate, max_shard_bytes)
}
