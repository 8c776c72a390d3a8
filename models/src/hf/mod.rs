//! Hugging Face checkpoints in and out: a directory as `save_pretrained`
//! writes it (`config.json` and `model.safetensors`), read into a kiln model
//! and written back so that `transformers` loads it.
//!
//! kiln's models name their parameters as the Hugging Face architectures do
//! (`transformer.h.0.attn.c_attn.weight`, `bert.encoder.layer.0...`,
//! `model.layers.0.self_attn.q_proj.weight`, `encoder.block.0.layer.0...`).
//! Layouts differ in one way: kiln's `Linear` weight is `[in, out]`, as
//! GPT-2's `Conv1D`, while PyTorch's `nn.Linear` (BERT, RoBERTa, Llama, T5)
//! stores `[out, in]`, so those are transposed on the way in and out
//! ([`HfName::transposed`]). Reading is then a matter of finding each
//! parameter's tensor, checking it, and converting half-precision files to
//! the parameter's dtype. One module per architecture maps its config and
//! names: [`gpt2`], [`bert`] (BERT, RoBERTa, XLM-R), [`llama`], [`t5`];
//! [`load`] picks by the config's `model_type`.
//!
//! Invariants:
//! - Nothing is assigned unless every parameter has its tensor with its shape
//!   and the file holds nothing else but what the architecture ties or keeps
//!   as a buffer (GPT-2's `lm_head.weight`, tied to `wte`; its causal-mask
//!   `attn.bias` buffers): a missing, extra or misshapen tensor is an error
//!   naming it, the file and the shapes.
//! - A config the model cannot honour (another activation, GPT-2's
//!   attention-scaling variants, Llama's rope scaling, biases kiln's Llama
//!   does not have) is refused naming the field, never silently computed
//!   another way.
//! - Written files are atomic (`kiln::atomic_write`).

use std::path::Path;

use kiln_compiler::ir::{DType, Literal, TensorType};
use kiln_frontend::nn::ParamStore;
use kiln_frontend::{FrontendError, Result, Tensor};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::bert::{Bert, BertClassifier};
use crate::gpt2::Gpt2;
use crate::llama::Llama;
use crate::t5::T5;
use crate::Spelling;

pub mod bert;
pub mod gpt2;
pub mod llama;
pub mod t5;

pub use self::bert::{bert_config, load_bert, load_bert_classifier, save_bert, save_bert_classifier};
pub use self::gpt2::{gpt2_config, load_gpt2, save_gpt2};
pub use self::llama::{llama_config, load_llama, save_llama};
pub use self::t5::{load_t5, save_t5, t5_config};

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
    read_safetensors(&path)
}

/// The tensor names of `dir/model.safetensors`, from its header alone.
pub fn tensor_names(dir: &Path) -> Result<Vec<String>> {
    use std::io::Read as _;
    let path = dir.join("model.safetensors");
    let io = |source| FrontendError::Io { path: path.clone(), source };
    let mut file = kiln_frontend::input::open(&path)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io)?;
    let len = u64::from_le_bytes(len);
    // safetensors' own bound on a header.
    if len > 100_000_000 {
        return Err(bad(&path, format!("a header of {len} bytes: not a safetensors file")));
    }
    let mut header = Vec::new();
    file.take(len).read_to_end(&mut header).map_err(io)?;
    let value: Value =
        serde_json::from_slice(&header).map_err(|e| bad(&path, format!("not a safetensors header: {e}")))?;
    let map = value.as_object().ok_or_else(|| bad(&path, "not a safetensors header: not an object".into()))?;
    Ok(map.keys().filter(|k| *k != "__metadata__").cloned().collect())
}

/// Every tensor of the safetensors file `path`, by name, as literals.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, Literal)>> {
    let path = path.to_path_buf();
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

/// Where a kiln parameter's tensor is in a Hugging Face file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfName {
    pub name: String,
    /// Stored `[out, in]` (PyTorch's `nn.Linear`) where kiln's parameter is
    /// `[in, out]`.
    pub transposed: bool,
}

impl HfName {
    pub fn same(name: &str) -> HfName {
        HfName { name: name.to_string(), transposed: false }
    }

    pub fn transposed(name: &str) -> HfName {
        HfName { name: name.to_string(), transposed: true }
    }
}

/// A rank-2 literal's transpose (bytes moved whole, any dtype).
fn transpose(lit: &Literal) -> Result<Literal> {
    let dims = lit.ty().shape.dims();
    let (r, c) = (dims[0], dims[1]);
    let size = lit.ty().dtype.size_in_bytes();
    let src = lit.bytes();
    let mut out = vec![0u8; src.len()];
    for i in 0..r {
        for j in 0..c {
            let (from, to) = ((i * c + j) * size, (j * r + i) * size);
            out[to..to + size].copy_from_slice(&src[from..from + size]);
        }
    }
    Ok(Literal::from_bytes(TensorType::new(lit.ty().dtype, vec![c, r]), out)?)
}

/// Assigns each of `ps`'s parameters its tensor of `tensors` (read from
/// `file`), the first of `locate(name)`'s places the file has; `ignored(name)`
/// says which other tensors the file may hold (tied copies, buffers).
/// Checks everything before assigning.
pub fn load_into(
    ps: &ParamStore,
    tensors: &[(String, Literal)],
    file: &Path,
    locate: impl Fn(&str) -> Vec<HfName>,
    ignored: impl Fn(&str) -> bool,
) -> Result<()> {
    let mut used = vec![false; tensors.len()];
    let mut plan = Vec::with_capacity(ps.len());
    for (name, param) in ps.iter() {
        let places = locate(name);
        let found =
            places.iter().find_map(|p| tensors.iter().position(|(t, _)| *t == p.name).map(|i| (i, p.transposed)));
        let Some((i, transposed)) = found else {
            let hf = places.first().map_or(name, |p| p.name.as_str());
            return Err(bad(file, format!("no tensor {hf} (the model's {name}, {})", param.ty())));
        };
        used[i] = true;
        let (file_name, lit) = (&tensors[i].0, &tensors[i].1);
        let expected: Vec<usize> =
            if transposed { param.dims().iter().rev().copied().collect() } else { param.dims().to_vec() };
        if lit.ty().shape.dims() != expected.as_slice() {
            let layout = if transposed { " ([out, in], the transpose of kiln's [in, out])" } else { "" };
            let reason = format!(
                "tensor {file_name} is {} in the file, the model's {name} needs {expected:?}{layout}",
                lit.ty()
            );
            return Err(bad(file, reason));
        }
        let lit = if transposed { transpose(lit)? } else { lit.clone() };
        let lit = if lit.ty().dtype == param.dtype() {
            lit
        } else if lit.ty().dtype.is_float() && param.dtype().is_float() {
            Literal::from_f64s(param.dtype(), param.ty().shape.dims().to_vec(), &lit.to_f64s())?
        } else {
            let reason = format!("tensor {file_name} is {}, the model's {name} is {}", lit.ty(), param.ty());
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

/// A string field (`None` when absent).
fn string(config: &Value, key: &str, path: &Path) -> Result<Option<String>> {
    field(config, key, |v| v.as_str().map(str::to_string), path)
}

/// A size field, `default` when absent.
fn size(config: &Value, key: &str, default: usize, path: &Path) -> Result<usize> {
    Ok(field(config, key, |v| v.as_u64().and_then(|n| usize::try_from(n).ok()), path)?.unwrap_or(default))
}

/// A boolean field, `default` when absent.
fn flag(config: &Value, key: &str, default: bool, path: &Path) -> Result<bool> {
    Ok(field(config, key, Value::as_bool, path)?.unwrap_or(default))
}

/// Refuses a config whose `model_type` is not one of `expected`; returns it.
fn model_type(config: &Value, expected: &[&str], path: &Path) -> Result<Option<String>> {
    let t = string(config, "model_type", path)?;
    if let Some(t) = &t {
        if !expected.contains(&t.as_str()) {
            let names = expected.join(" or ");
            return Err(bad(path, format!("model_type {t:?}: not a {names} checkpoint")));
        }
    }
    Ok(t)
}

/// Reads `dir` as `make` builds it: the config through `config`, a store
/// seeded 0 (every value is then replaced by the file's), the model, and its
/// parameters from the file through `locate` and `ignored`.
fn load_dir<C, M>(
    dir: &Path,
    config: impl FnOnce(&Value, &Path, &[(String, Literal)]) -> Result<C>,
    make: impl FnOnce(&mut ParamStore, C) -> Result<M>,
    locate: impl Fn(&str) -> Vec<HfName>,
    ignored: impl Fn(&str) -> bool,
) -> Result<(ParamStore, M)> {
    let config_path = dir.join("config.json");
    let value = read_config(dir)?;
    let tensors = read_tensors(dir)?;
    let cfg = config(&value, &config_path, &tensors)?;
    let mut ps = ParamStore::new(0);
    let model = make(&mut ps, cfg)?;
    load_into(&ps, &tensors, &dir.join("model.safetensors"), locate, ignored)?;
    Ok((ps, model))
}

/// Writes `ps`'s parameters as `dir/model.safetensors`, each under the first
/// of `locate(name)`'s places (transposed where it says), and `config` as
/// `dir/config.json`; both atomically.
fn save_dir(dir: &Path, config: &Value, ps: &ParamStore, locate: impl Fn(&str) -> Vec<HfName>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| FrontendError::Io { path: dir.to_path_buf(), source })?;
    let mut tensors = Vec::with_capacity(ps.len());
    for (name, t) in ps.iter() {
        let mut lit = t.to_literal()?;
        let place = locate(name).into_iter().next().unwrap_or_else(|| HfName::same(name));
        if place.transposed {
            lit = transpose(&lit)?;
        }
        tensors.push((place.name, lit.ty().clone(), lit.bytes().to_vec()));
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
    let text = serde_json::to_string_pretty(config).map_err(|e| bad(dir, e.to_string()))?;
    kiln_frontend::atomic_write::write_atomically(&dir.join("config.json"), text.as_bytes())
}

/// A model read from a Hugging Face directory, of whichever architecture its
/// config names.
pub enum HfModel {
    Gpt2(Gpt2),
    Bert(Bert),
    /// A BERT-family sequence classifier.
    BertClassifier(BertClassifier),
    Llama(Llama),
    T5(T5),
}

impl HfModel {
    /// The architecture, as the config's `model_type` names it.
    pub fn model_type(&self) -> &'static str {
        match self {
            HfModel::Gpt2(_) => "gpt2",
            HfModel::Bert(m) | HfModel::BertClassifier(BertClassifier { bert: m, .. }) => match m.cfg.flavor {
                crate::bert::BertFlavor::Bert => "bert",
                crate::bert::BertFlavor::Roberta { .. } => "roberta",
                crate::bert::BertFlavor::DistilBert => "distilbert",
            },
            HfModel::Llama(_) => "llama",
            HfModel::T5(_) => "t5",
        }
    }
}

/// The model a Hugging Face directory holds: GPT-2, BERT, RoBERTa, XLM-R,
/// Llama or T5, picked by its config's `model_type`; any other is refused
/// naming it.
pub fn load(dir: &Path, spelling: Spelling) -> Result<(ParamStore, HfModel)> {
    let config_path = dir.join("config.json");
    let config = read_config(dir)?;
    let Some(t) = string(&config, "model_type", &config_path)? else {
        return Err(bad(&config_path, "no model_type: the architecture is not known".into()));
    };
    match t.as_str() {
        "gpt2" => load_gpt2(dir, spelling).map(|(ps, m)| (ps, HfModel::Gpt2(m))),
        "bert" | "roberta" | "xlm-roberta" | "distilbert" => {
            let names = tensor_names(dir)?;
            if names.iter().any(|n| n == "classifier.weight" || n == "classifier.out_proj.weight") {
                load_bert_classifier(dir, spelling).map(|(ps, m)| (ps, HfModel::BertClassifier(m)))
            } else {
                load_bert(dir, spelling).map(|(ps, m)| (ps, HfModel::Bert(m)))
            }
        }
        "llama" => load_llama(dir, spelling).map(|(ps, m)| (ps, HfModel::Llama(m))),
        "t5" => load_t5(dir, spelling).map(|(ps, m)| (ps, HfModel::T5(m))),
        other => Err(bad(
            &config_path,
            format!("model_type {other:?}: kiln reads gpt2, bert, roberta, xlm-roberta, distilbert, llama and t5"),
        )),
    }
}

/// Writes `model` (its parameters in `ps`) as a Hugging Face directory of its
/// architecture.
pub fn save(dir: &Path, model: &HfModel, ps: &ParamStore) -> Result<()> {
    match model {
        HfModel::Gpt2(m) => save_gpt2(dir, m, ps),
        HfModel::Bert(m) => save_bert(dir, m, ps),
        HfModel::BertClassifier(m) => save_bert_classifier(dir, m, ps),
        HfModel::Llama(m) => save_llama(dir, m, ps),
        HfModel::T5(m) => save_t5(dir, m, ps),
    }
}
