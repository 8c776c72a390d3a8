//! Hugging Face checkpoints in and out: a directory as `save_pretrained`
//! writes it (`config.json` and `model.safetensors`, or the shards a
//! `model.safetensors.index.json` lists), read into a kiln model and written
//! back so that `transformers` loads it.
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
//! - A shard the index names is a file of the directory itself (a name with a
//!   path separator or `..` is refused), every tensor the index lists is in
//!   the shard it names, and no shard holds a tensor the index does not list.

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

/// The one-file weights' name.
const WEIGHTS: &str = "model.safetensors";
/// The sharded weights' index.
const INDEX: &str = "model.safetensors.index.json";
/// The largest index read (a 70B model's is about 100 KB).
const MAX_INDEX_BYTES: u64 = 64 << 20;
/// Shards `save` writes at most (transformers' long-standing default): a
/// model below it is one `model.safetensors`.
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Where the weights of `dir` are: `model.safetensors`, else the index of
/// a sharded checkpoint (the path errors name).
pub fn weights_path(dir: &Path) -> std::path::PathBuf {
    let one = dir.join(WEIGHTS);
    if !one.exists() && dir.join(INDEX).exists() {
        return dir.join(INDEX);
    }
    one
}

/// A sharded checkpoint's `weight_map`: each tensor's shard, a file name in
/// the directory.
fn shard_index(dir: &Path) -> Result<std::collections::BTreeMap<String, String>> {
    let path = dir.join(INDEX);
    let io = |source| FrontendError::Io { path: path.clone(), source };
    let meta = std::fs::metadata(&path).map_err(io)?;
    if !meta.is_file() || meta.len() > MAX_INDEX_BYTES {
        return Err(bad(&path, format!("not a regular file of at most {MAX_INDEX_BYTES} bytes")));
    }
    let value: Value = serde_json::from_str(&std::fs::read_to_string(&path).map_err(io)?)
        .map_err(|e| bad(&path, format!("not JSON: {e}")))?;
    let map = value.get("weight_map").and_then(Value::as_object).ok_or_else(|| bad(&path, "no weight_map".into()))?;
    let mut out = std::collections::BTreeMap::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| bad(&path, format!("tensor {tensor}: its shard is not a file name")))?;
        let plain = !file.is_empty() && file != "." && file != ".." && !file.contains(['/', '\\']);
        if !plain {
            return Err(bad(&path, format!("tensor {tensor}: shard {file:?} is not a file of this directory")));
        }
        out.insert(tensor.clone(), file.to_string());
    }
    if out.is_empty() {
        return Err(bad(&path, "an empty weight_map".into()));
    }
    Ok(out)
}

/// Every tensor of `dir`'s weights (`model.safetensors`, or every shard of a
/// sharded checkpoint), by name, as literals.
pub fn read_tensors(dir: &Path) -> Result<Vec<(String, Literal)>> {
    let path = weights_path(dir);
    if !path.ends_with(INDEX) {
        return read_safetensors(&path);
    }
    let index = shard_index(dir)?;
    let mut files: Vec<&String> = index.values().collect();
    files.sort();
    files.dedup();
    let mut out = Vec::with_capacity(index.len());
    for file in files {
        let shard = dir.join(file);
        for (name, lit) in read_safetensors(&shard)? {
            if index.get(&name) != Some(file) {
                let listed = index.get(&name).map_or("not listed".to_string(), |f| format!("listed in {f}"));
                return Err(bad(&shard, format!("tensor {name} is in this shard but the index has it {listed}")));
            }
            out.push((name, lit));
        }
    }
    if out.len() != index.len() {
        let found: std::collections::BTreeSet<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
        let missing: Vec<String> =
            index.iter().filter(|(n, _)| !found.contains(n.as_str())).map(|(n, f)| format!("{n} (in {f})")).collect();
        return Err(bad(&path, format!("tensors the index lists are not in their shards: {}", missing.join(", "))));
    }
    Ok(out)
}

/// The tensor names of `dir`'s weights, from the safetensors header (or the
/// sharded checkpoint's index) alone.
pub fn tensor_names(dir: &Path) -> Result<Vec<String>> {
    use std::io::Read as _;
    if weights_path(dir).ends_with(INDEX) {
        return Ok(shard_index(dir)?.into_keys().collect());
    }
    let path = dir.join(WEIGHTS);
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
    load_into(&ps, &tensors, &weights_path(dir), locate, ignored)?;
    Ok((ps, model))
}

/// Writes `ps`'s parameters as `dir/model.safetensors` (or, past
/// `max_shard_bytes`, as shards `model-0000i-of-0000n.safetensors` and their
/// index), each under the first of `locate(name)`'s places (transposed where
/// it says), and `config` as `dir/config.json`; every file atomically. The
/// other layout's files a previous save left there are removed once the new
/// ones are written, so the directory holds one model.
fn save_dir(
    dir: &Path,
    config: &Value,
    ps: &ParamStore,
    locate: impl Fn(&str) -> Vec<HfName>,
    max_shard_bytes: Option<u64>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| FrontendError::Io { path: dir.to_path_buf(), source })?;
    let mut tensors = Vec::with_capacity(ps.len());
    for (name, t) in ps.iter() {
        let mut lit = t.to_literal()?;
        let place = locate(name).into_iter().next().unwrap_or_else(|| HfName::same(name));
        if place.transposed {
            lit = transpose(&lit)?;
        }
        if !matches!(lit.ty().dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(bad(dir, format!("parameter {name} is {}: not written", lit.ty().dtype)));
        }
        tensors.push((place.name, lit));
    }
    // Shards in parameter order, each up to the limit (a larger tensor alone).
    let limit = max_shard_bytes.unwrap_or(u64::MAX).max(1);
    let mut shards: Vec<Vec<&(String, Literal)>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in &tensors {
        let bytes = t.1.bytes().len() as u64;
        if size > 0 && size.saturating_add(bytes) > limit {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes;
        if let Some(shard) = shards.last_mut() {
            shard.push(t);
        }
    }
    let n = shards.len();
    let names: Vec<String> = if n == 1 {
        vec![WEIGHTS.to_string()]
    } else {
        (1..=n).map(|i| format!("model-{i:05}-of-{n:05}.safetensors")).collect()
    };
    for (file, shard) in names.iter().zip(&shards) {
        let bytes = serialize(dir, shard)?;
        kiln_frontend::atomic_write::write_atomically(&dir.join(file), &bytes)?;
    }
    if n > 1 {
        let total: u64 = tensors.iter().map(|(_, l)| l.bytes().len() as u64).sum();
        let weight_map: serde_json::Map<String, Value> = names
            .iter()
            .zip(&shards)
            .flat_map(|(file, shard)| shard.iter().map(move |(t, _)| (t.clone(), Value::from(file.as_str()))))
            .collect();
        let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let text = serde_json::to_string_pretty(&index).map_err(|e| bad(dir, e.to_string()))?;
        kiln_frontend::atomic_write::write_atomically(&dir.join(INDEX), text.as_bytes())?;
    }
    let text = serde_json::to_string_pretty(config).map_err(|e| bad(dir, e.to_string()))?;
    kiln_frontend::atomic_write::write_atomically(&dir.join("config.json"), text.as_bytes())?;
    remove_stale(dir, &names)
}

/// One safetensors file of `tensors`.
fn serialize(dir: &Path, tensors: &[&(String, Literal)]) -> Result<Vec<u8>> {
    let views = tensors
        .iter()
        .map(|(n, lit)| {
            let dtype = match lit.ty().dtype {
                DType::F16 => Dtype::F16,
                DType::BF16 => Dtype::BF16,
                _ => Dtype::F32,
            };
            let view = safetensors::tensor::TensorView::new(dtype, lit.ty().shape.dims().to_vec(), lit.bytes())
                .map_err(|e| bad(dir, format!("parameter {n}: {e}")))?;
            Ok((n.as_str(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(meta)).map_err(|e| bad(dir, format!("serializing: {e}")))
}

/// Removes the weights files of `dir` a save did not just write (`written`):
/// the one-file weights after a sharded save, the index and older shards
/// after either.
fn remove_stale(dir: &Path, written: &[String]) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|source| FrontendError::Io { path: dir.to_path_buf(), source })?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let shard = name.starts_with("model-") && name.contains("-of-") && name.ends_with(".safetensors");
        let stale =
            if name == INDEX { written.len() == 1 } else { (name == WEIGHTS || shard) && !written.contains(&name) };
        if stale {
            std::fs::remove_file(entry.path()).map_err(|source| FrontendError::Io { path: entry.path(), source })?;
        }
    }
    Ok(())
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
/// architecture, in shards of at most [`MAX_SHARD_BYTES`].
pub fn save(dir: &Path, model: &HfModel, ps: &ParamStore) -> Result<()> {
    save_sharded(dir, model, ps, MAX_SHARD_BYTES)
}

/// [`save`] with shards of at most `max_shard_bytes` (one
/// `model.safetensors` when the weights fit in one).
pub fn save_sharded(dir: &Path, model: &HfModel, ps: &ParamStore, max_shard_bytes: u64) -> Result<()> {
    let max = Some(max_shard_bytes);
    match model {
        HfModel::Gpt2(m) => save_gpt2(dir, m, ps, max),
        HfModel::Bert(m) => save_bert(dir, m, ps, max),
        HfModel::BertClassifier(m) => save_bert_classifier(dir, m, ps, max),
        HfModel::Llama(m) => save_llama(dir, m, ps, max),
        HfModel::T5(m) => save_t5(dir, m, ps, max),
    }
}
