//! T5 (`T5ForConditionalGeneration`): `nn.Linear` weights transposed, the
//! stacks' `embed_tokens` tied to `shared`, the head tied or its own, the
//! decoder's output scaled or not as the config says.

use std::path::Path;

use kiln_compiler::ir::Literal;
use kiln_frontend::nn::ParamStore;
use kiln_frontend::Result;
use serde_json::{json, Value};

use super::{bad, field, flag, load_dir, model_type, save_dir, size, string, HfName};
use crate::t5::{FeedForward, T5Config, T5};
use crate::Spelling;

/// The sizes a Hugging Face `T5Config` gives, refusing the feed-forwards
/// kiln's T5 does not compute.
///
/// Tying and scaling: transformers 4 wrote `tie_word_embeddings = false` for
/// T5 v1.1 (its own head, no scaling); transformers 5 always ties and says
/// whether to scale in `scale_decoder_outputs`. Both read as they mean.
pub fn t5_config(config: &Value, path: &Path) -> Result<T5Config> {
    model_type(config, &["t5"], path)?;
    let feed_forward = match string(config, "feed_forward_proj", path)?.as_deref() {
        None | Some("relu") => FeedForward::Relu,
        Some("gated-gelu") => FeedForward::GatedGelu,
        Some(other) => {
            return Err(bad(path, format!("feed_forward_proj {other:?}: kiln's T5 computes relu and gated-gelu")))
        }
    };
    let tie = flag(config, "tie_word_embeddings", true, path)?;
    let scale = flag(config, "scale_decoder_outputs", tie, path)?;
    let layers = size(config, "num_layers", 6, path)?;
    let cfg = T5Config {
        vocab: size(config, "vocab_size", 32128, path)?,
        d_model: size(config, "d_model", 512, path)?,
        d_kv: size(config, "d_kv", 64, path)?,
        heads: size(config, "num_heads", 8, path)?,
        d_ff: size(config, "d_ff", 2048, path)?,
        layers,
        decoder_layers: size(config, "num_decoder_layers", layers, path)?,
        buckets: size(config, "relative_attention_num_buckets", 32, path)?,
        max_distance: size(config, "relative_attention_max_distance", 128, path)?,
        feed_forward,
        eps: field(config, "layer_norm_epsilon", Value::as_f64, path)?.unwrap_or(1e-6),
        tie_embeddings: tie,
        scale_decoder_output: scale,
    };
    if cfg.vocab == 0 || cfg.d_model == 0 || cfg.heads == 0 || cfg.d_kv == 0 || cfg.buckets < 2 {
        return Err(bad(path, format!("sizes that make no model: {cfg:?}")));
    }
    Ok(cfg)
}

/// Where kiln's parameter `name` is: the projections transposed; `shared`,
/// the head and the relative-bias tables as kiln keeps them.
fn locate(name: &str) -> Vec<HfName> {
    let table = name == "shared.weight" || name == "lm_head.weight" || name.contains("relative_attention_bias");
    let linear = name.ends_with(".weight") && !name.contains("layer_norm");
    vec![if linear && !table { HfName::transposed(name) } else { HfName::same(name) }]
}

/// A T5 from a Hugging Face directory (`T5ForConditionalGeneration`).
pub fn load_t5(dir: &Path, spelling: Spelling) -> Result<(ParamStore, T5)> {
    let config = |c: &Value, p: &Path, _: &[(String, Literal)]| t5_config(c, p);
    let tied = flag(&super::read_config(dir)?, "tie_word_embeddings", true, &dir.join("config.json"))?;
    let ignored = move |n: &str| {
        n == "encoder.embed_tokens.weight" || n == "decoder.embed_tokens.weight" || (tied && n == "lm_head.weight")
    };
    load_dir(dir, config, |ps, cfg| T5::new(ps, cfg, spelling), locate, ignored)
}

/// Writes `model` as a Hugging Face `T5ForConditionalGeneration` directory.
pub fn save_t5(dir: &Path, model: &T5, ps: &ParamStore, max_shard_bytes: Option<u64>) -> Result<()> {
    let c = model.cfg;
    let feed_forward_proj = match c.feed_forward {
        FeedForward::Relu => "relu",
        FeedForward::GatedGelu => "gated-gelu",
    };
    let config = json!({
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": c.vocab,
        "d_model": c.d_model,
        "d_kv": c.d_kv,
        "num_heads": c.heads,
        "d_ff": c.d_ff,
        "num_layers": c.layers,
        "num_decoder_layers": c.decoder_layers,
        "relative_attention_num_buckets": c.buckets,
        "relative_attention_max_distance": c.max_distance,
        "feed_forward_proj": feed_forward_proj,
        "layer_norm_epsilon": c.eps,
        "tie_word_embeddings": c.tie_embeddings,
        "scale_decoder_outputs": c.scale_decoder_output,
        "is_encoder_decoder": true,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "torch_dtype": "float32",
    });
    save_dir(dir, &config, ps, locate, max_shard_bytes)
}
