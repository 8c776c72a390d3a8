//! Hugging Face checkpoints in and out: a directory as `save_pretrained`
//! writes it (`config.json` and `model.safetensors`), read into a kiln model
//! and written back so that `transformers` loads it.
//!
//! kiln's models name their parameters as the Hugging Face architectures do
//! (`transformer.h.0.attn.c_attn.weight`), with the same layouts (GPT-2's
//! `Conv1D` weights are `[in, out]`, as kiln's `Linear`), so reading is a
//! matter of finding each parameter's tensor, checking it, and converting
//! half-precision files to the parameter's dtype.
//!
//! Invariants:
//! - Nothing is assigned unless every parameter has its tensor with its shape
//!   and the file holds nothing else but what the architecture ties or keeps
//!   as a buffer (GPT-2's `lm_head.weight`, tied to `wte`; its causal-mask
//!   `attn.bias` buffers): a missing, extra or misshapen tensor is an error
//!   naming it, the file and the shapes.
//! - A config the model cannot honour (another activation, untied
//!   embeddings, GPT-2's attention-scaling variants) is refused naming the
//!   field, never silently computed another way.
//! - Written files are atomic (`kiln::atomic_write`).

use std::path::Path;

use kiln_compiler::ir::{DType, Literal, TensorType};
use kiln_frontend::nn::ParamStore;
use kiln_frontend::{FrontendError, Result, Tensor};
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

use crate::gpt2::{Gpt2, Gpt2Config};
use crate::Spelling;

/// The largest `config.json` read (they are a few KB).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

fn bad(path: &Path, reason: String) -> FrontendError {
    FrontendError::Checkpoint { path: path.to_path_buf(), reason }
}

/// `dir/config.json`, parsed.
pub fn read_config(dir: &Path) -> Result<Value> {
    let path = dir.join("config.json");
    let io = |source| FrontendError::Io { path: path.clone(), source };
    let meta = std::fs::metadata(&path).map_err(io)?;
    if !meta.is_file() || meta.len() > MAX_CONFIG_BYTES {
        return Err(bad(&path, format!("not a regular file of at most {MAX_CONFIG_BYTES} bytes")));
    }
    let text = std::fs::read_to_string(&path).map_err(io)?;
    serde_json::from_str(&text).map_err(|e| bad(&path, format!("not JSON: {e}")))
}

/// Every tensor of `dir/model.safetensors`, by name, as literals.
pub fn read_tensors(dir: &Path) -> Result<Vec<(String, Literal)>> {
    let path = dir.join("model.safetensors");
    if !path.exists() && dir.join("model.safetensors.index.json").exists() {
        return Err(bad(&path, "the checkpoint is sharded (model.safetensors.index.json): not read yet".into()));
    }
    // A regular file only (a FIFO would block), at its size against the host limit.
    let mut file = kiln_frontend::input::open(&path)?;
    let io = |source| FrontendError::Io { path: path.clone(), source };
    let len = file.metadata().map_err(io)?.len();
    kiln_frontend::limits::check_host_bytes(format!("Hugging Face weights {}", path.display()), Some(len))?;
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    std::io::Read::read_to_end(&mut std::io::Read::take(&mut file, len), &mut bytes).map_err(io)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(&path, format!("not a safetensors file: {e}")))?;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.iter() {
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::F64 => DType::F64,
            Dtype::I64 => DType::I64,
            Dtype::I32 => DType::I32,
            Dtype::U8 => DType::U8,
            Dtype::BOOL => DType::Pred,
            other => return Err(bad(&path, format!("tensor {name}: dtype {other:?} is not read"))),
        };
        let ty = TensorType::new(dtype, view.shape().to_vec());
        let lit =
            Literal::from_bytes(ty, view.data().to_vec()).map_err(|e| bad(&path, format!("tensor {name}: {e}")))?;
        out.push((name.to_string(), lit));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Assigns each of `ps`'s parameters its tensor of `tensors` (read from
/// `file`), found by its name or by `alias(name)`; `ignored(name)` says which
/// other tensors the file may hold. Checks everything before assigning.
pub fn load_into(
    ps: &ParamStore,
    tensors: &[(String, Literal)],
    file: &Path,
    alias: impl Fn(&str) -> Option<String>,
    ignored: impl Fn(&str) -> bool,
) -> Result<()> {
    let mut used = vec![false; tensors.len()];
    let mut plan = Vec::with_capacity(ps.len());
    for (name, param) in ps.iter() {
        let find = |n: &str| tensors.iter().position(|(t, _)| t == n);
        let Some(i) = find(name).or_else(|| alias(name).and_then(|a| find(&a))) else {
            return Err(bad(file, format!("no tensor {name} (the model's {})", param.ty())));
        };
        used[i] = true;
        let lit = &tensors[i].1;
        if lit.ty().shape != param.ty().shape {
            let reason =
                format!("tensor {} is {} in the file, the model's {name} is {}", tensors[i].0, lit.ty(), param.ty());
            return Err(bad(file, reason));
        }
        let lit = if lit.ty().dtype == param.dtype() {
            lit.clone()
        } else if lit.ty().dtype.is_float() && param.dtype().is_float() {
            Literal::from_f64s(param.dtype(), param.ty().shape.dims().to_vec(), &lit.to_f64s())?
        } else {
            let reason = format!("tensor {} is {}, the model's {name} is {}", tensors[i].0, lit.ty(), param.ty());
            return Err(bad(file, reason));
        };
        plan.push((param.clone(), lit));
    }
    let extra: Vec<&str> =
        tensors.iter().zip(&used).filter(|((n, _), u)| !**u && !ignored(n)).map(|((n, _), _)| n.as_str()).collect();
    if !extra.is_empty() {
        let shown = extra.iter().take(8).copied().collect::<Vec<_>>().join(", ");
        let more = if extra.len() > 8 { format!(" and {} more", extra.len() - 8) } else { String::new() };
        return Err(bad(file, format!("tensors the model does not have: {shown}{more}")));
    }
    for (param, lit) in plan {
        param.assign(&Tensor::from_literal(lit))?;
    }
    kiln_frontend::mark_step()?;
    Ok(())
}

/// A field of a config, as `what` (`None` when absent).
fn field<T>(config: &Value, key: &str, what: impl Fn(&Value) -> Option<T>, path: &Path) -> Result<Option<T>> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => what(v).map(Some).ok_or_else(|| bad(path, format!("config field {key} = {v} is not valid"))),
    }
}

/// The GPT-2 sizes a Hugging Face `GPT2Config` gives, refusing the options
/// kiln's GPT-2 does not compute.
pub fn gpt2_config(config: &Value, path: &Path) -> Result<Gpt2Config> {
    let size = |key: &str, default: usize| -> Result<usize> {
        Ok(field(config, key, |v| v.as_u64().and_then(|n| usize::try_from(n).ok()), path)?.unwrap_or(default))
    };
    let flag =
        |key: &str, default: bool| -> Result<bool> { Ok(field(config, key, Value::as_bool, path)?.unwrap_or(default)) };
    if let Some(t) = field(config, "model_type", |v| v.as_str().map(str::to_string), path)? {
        if t != "gpt2" {
            return Err(bad(path, format!("model_type {t:?}: not a GPT-2 checkpoint")));
        }
    }
    let act = field(config, "activation_function", |v| v.as_str().map(str::to_string), path)?;
    if let Some(a) = act.filter(|a| a != "gelu_new" && a != "gelu_pytorch_tanh") {
        return Err(bad(path, format!("activation_function {a:?}: kiln's GPT-2 computes gelu_new (tanh) only")));
    }
    for (key, default) in [("scale_attn_by_inverse_layer_idx", false), ("reorder_and_upcast_attn", false)] {
        if flag(key, default)? {
            return Err(bad(path, format!("{key} = true is not computed by kiln's GPT-2")));
        }
    }
    if !flag("scale_attn_weights", true)? || !flag("tie_word_embeddings", true)? {
        return Err(bad(path, "scale_attn_weights and tie_word_embeddings must be true for kiln's GPT-2".into()));
    }
    let eps = field(config, "layer_norm_epsilon", Value::as_f64, path)?.unwrap_or(1e-5);
    let cfg = Gpt2Config {
        vocab: size("vocab_size", 50257)?,
        dim: size("n_embd", 768)?,
        layers: size("n_layer", 12)?,
        heads: size("n_head", 12)?,
        max_positions: size("n_positions", 1024)?,
        eps,
    };
    if cfg.vocab == 0 || cfg.dim == 0 || cfg.heads == 0 || cfg.max_positions == 0 || cfg.dim % cfg.heads != 0 {
        return Err(bad(path, format!("sizes that make no model: {cfg:?}")));
    }
    Ok(cfg)
}

/// A GPT-2 from a Hugging Face directory (`GPT2LMHeadModel` or `GPT2Model`
/// as `save_pretrained` writes it), on a host-initialised store seeded 0
/// (every value is then replaced by the file's).
pub fn load_gpt2(dir: &Path, spelling: Spelling) -> Result<(ParamStore, Gpt2)> {
    let config_path = dir.join("config.json");
    let cfg = gpt2_config(&read_config(dir)?, &config_path)?;
    let tensors = read_tensors(dir)?;
    let mut ps = ParamStore::new(0);
    let model = Gpt2::new(&mut ps, cfg, spelling)?;
    // A `GPT2Model` file names them without the `transformer.` prefix.
    let alias = |n: &str| n.strip_prefix("transformer.").map(str::to_string);
    // The tied head and the attention's mask buffers (older files keep them).
    let ignored = |n: &str| n == "lm_head.weight" || n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias");
    load_into(&ps, &tensors, &dir.join("model.safetensors"), alias, ignored)?;
    Ok((ps, model))
}

/// Writes `model` (its parameters in `ps`) as a Hugging Face
/// `GPT2LMHeadModel` directory: `config.json` and `model.safetensors`.
pub fn save_gpt2(dir: &Path, model: &Gpt2, ps: &ParamStore) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| FrontendError::Io { path: dir.to_path_buf(), source })?;
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
    let mut tensors = Vec::with_capacity(ps.len());
    for (name, t) in ps.iter() {
        let lit = t.to_literal()?;
        tensors.push((name.to_string(), lit.ty().clone(), lit.bytes().to_vec()));
    }
    let views = tensors
        .iter()
        .map(|(n, ty, b)| {
            let dtype = match ty.dtype {
                DType::F32 => Dtype::F32,
                DType::F16 => Dtype::F16,
                DType::BF16 => Dtype::BF16,
                other => return Err(bad(dir, format!("parameter {n} is {other}: not written"))),
            };
            let view = safetensors::tensor::TensorView::new(dtype, ty.shape.dims().to_vec(), b)
                .map_err(|e| bad(dir, format!("parameter {n}: {e}")))?;
            Ok((n.as_str(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| bad(dir, format!("serializing: {e}")))?;
    kiln_frontend::atomic_write::write_atomically(&dir.join("model.safetensors"), &bytes)?;
    let text = serde_json::to_string_pretty(&config).map_err(|e| bad(dir, e.to_string()))?;
    kiln_frontend::atomic_write::write_atomically(&dir.join("config.json"), text.as_bytes())
}
