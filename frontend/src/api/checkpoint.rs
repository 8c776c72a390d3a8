//! Checkpoints of the whole training state in safetensors format.
//!
//! A checkpoint holds named tensors (parameters, optimizer state, the RNG
//! state) and the step number. Writes go to a temporary file in the same
//! directory, are synced, then renamed over the target, so a crash mid-write
//! leaves the previous checkpoint intact. A checksum over the step and every
//! tensor's name, dtype, shape and bytes is stored in the metadata and
//! verified on load: a corrupt or truncated file is an error naming the path,
//! never silently loaded. (Files of format 1, written before 2026-11-25,
//! still load; their checksum covers the names and bytes only.)
//!
//! A tensor whose replicas hold different values (the per-replica RNG keys)
//! is saved once per replica (`<name>@replica<r>` for r ≥ 1) and restored to
//! every replica, so a resumed run with replicas and dropout continues bit for
//! bit; restoring it into a run with another replica count is an error.
//! In a run of several processes every node calls `save` alike (the pending
//! step may hold collectives); each puts the checksum of its values in the
//! run's store (the generator state, per replica by design, left out) and its
//! replicas' generator states by global replica index; node 0 checks that all
//! agree, writes the file once, holding every replica's generator state as
//! one process with all the replicas would, and then puts `written`; the
//! others return only after that, so no node goes on believing in a file that
//! is not complete. Disagreeing values are an error naming the nodes, on every
//! node. On restore each process takes its own replicas' states, so a resumed
//! run of several processes draws the dropout masks of an uninterrupted one.
//!
//! Invariants:
//! - A checkpoint on disk is the previous one or the whole new one
//!   (`core::atomic_write`).
//! - A corrupt or truncated file is an error naming the path, never loaded.
//! - A restore assigns nothing unless every tensor it restores is present with
//!   its type.

use std::collections::HashMap;
use std::path::Path;

use kiln_compiler::ir::{DType, Literal, TensorType};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::api::nn::Module;
use crate::api::optim::Optimizer;
use crate::api::train_step::TrainStep;
use crate::core::atomic_write::write_atomically;
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;
use crate::engine::step::mark_step;

/// The format written: its checksum covers the step, and every tensor's
/// dtype and shape besides its name and bytes.
const FORMAT: &str = "kiln-checkpoint-2";
/// The format before 2026-11-25, still read: its checksum covered names and
/// bytes only, so a flipped step, dtype or shape in the header went unseen.
const FORMAT_1: &str = "kiln-checkpoint-1";
/// `<name>@replica<r>`: replica `r`'s value of a tensor whose replicas differ.
const REPLICA_SEP: &str = "@replica";

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::Pred => Dtype::BOOL,
        DType::I8 => Dtype::I8,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
        DType::U32 => Dtype::U32,
        DType::U64 => Dtype::U64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
    }
}

fn kiln_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::BOOL => DType::Pred,
        Dtype::I8 => DType::I8,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
        Dtype::U64 => DType::U64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        _ => return None,
    })
}

/// FNV-1a: cheap, and enough to catch corruption.
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn eat(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn eat_u64(&mut self, v: u64) {
        self.eat(&v.to_le_bytes());
    }
}

/// Over names and bytes: format 1's checksum, and what the nodes of a run
/// compare before one of them writes.
fn checksum<'a>(items: impl Iterator<Item = (&'a str, &'a [u8])>) -> u64 {
    let mut h = Fnv::new();
    for (name, bytes) in items {
        h.eat(name.as_bytes());
        h.eat_u64(bytes.len() as u64);
        h.eat(bytes);
    }
    h.0
}

/// The file's checksum (format 2): the step, then each tensor (sorted by
/// name) as its name, dtype, rank, dimensions and bytes.
fn file_checksum<'a>(step: u64, items: impl Iterator<Item = (&'a str, &'a Literal)>) -> u64 {
    let mut h = Fnv::new();
    h.eat(b"step");
    h.eat_u64(step);
    for (name, l) in items {
        h.eat_u64(name.len() as u64);
        h.eat(name.as_bytes());
        h.eat(l.ty().dtype.to_string().as_bytes());
        let dims = l.ty().shape.dims();
        h.eat_u64(dims.len() as u64);
        for &d in dims {
            h.eat_u64(d as u64);
        }
        h.eat_u64(l.bytes().len() as u64);
        h.eat(l.bytes());
    }
    h.0
}

/// Every tensor a training run needs to resume, by name: `param.<name>` for
/// each of `model`'s parameters (their `ParamStore` names), `optim.<name>` for
/// the optimizer's state (moments, counters), and `rng.state` for the
/// in-graph generator (see [`crate::api::random::state`]). The step number is
/// saved beside them by [`save_training`].
pub fn training_state(model: &dyn Module, optimizer: &dyn Optimizer) -> Vec<(String, Tensor)> {
    state_of(model.named_parameters(), optimizer)
}

/// [`training_state`] from named parameters (the built-in loops' `ParamStore`).
pub fn state_of(params: Vec<(String, Tensor)>, optimizer: &dyn Optimizer) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = params.into_iter().map(|(n, t)| (format!("param.{n}"), t)).collect();
    out.extend(optimizer.state().into_iter().map(|(n, t)| (format!("optim.{n}"), t)));
    out.push(("rng.state".into(), crate::api::random::state()));
    out
}

/// Saves the whole training state of `model` and `optimizer` at `step` to
/// `path` (atomically; see [`save`]). A loop that steps through a
/// [`TrainStep`] with loss scaling saves with [`save_training_with`], or a
/// resumed run starts again from the initial loss scale.
pub fn save_training(path: impl AsRef<Path>, step: u64, model: &dyn Module, optimizer: &dyn Optimizer) -> Result<()> {
    save(path, step, &training_state(model, optimizer))
}

/// Restores what [`save_training`] wrote into `model`, `optimizer` and the
/// generator; returns the saved step. Nothing is assigned unless every tensor
/// is present with its type, and the file holds nothing else: a tensor the
/// model and optimizer lack (another model's layer, a loss scaler's state) is
/// an error naming it. [`restore`] loads a subset.
pub fn restore_training(path: impl AsRef<Path>, model: &dyn Module, optimizer: &dyn Optimizer) -> Result<u64> {
    restore_all(path.as_ref(), &training_state(model, optimizer))
}

/// [`save_training`] with `train_step`'s state too (its loss scale and growth
/// counter), so a mixed-precision run resumes bit-identically.
pub fn save_training_with(
    path: impl AsRef<Path>,
    step: u64,
    model: &dyn Module,
    optimizer: &dyn Optimizer,
    train_step: &TrainStep,
) -> Result<()> {
    save(path, step, &training_state_with(model, optimizer, train_step))
}

/// Restores what [`save_training_with`] wrote (see [`restore_training`]).
pub fn restore_training_with(
    path: impl AsRef<Path>,
    model: &dyn Module,
    optimizer: &dyn Optimizer,
    train_step: &TrainStep,
) -> Result<u64> {
    restore_all(path.as_ref(), &training_state_with(model, optimizer, train_step))
}

/// [`training_state`] and `train_step`'s state (its loss scaler's): what
/// [`save_training_with`] writes and [`restore_training_with`] reads.
fn training_state_with(model: &dyn Module, optimizer: &dyn Optimizer, train_step: &TrainStep) -> Vec<(String, Tensor)> {
    let mut state = training_state(model, optimizer);
    state.extend(train_step.state());
    state
}

/// Saves `tensors` (runs the pending step first) and `step` to `path`.
pub fn save(path: impl AsRef<Path>, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
    let path = path.as_ref();
    let err = |reason: String| FrontendError::Checkpoint { path: path.to_path_buf(), reason };
    if tensors.iter().any(|(_, t)| t.is_pending()) {
        mark_step()?;
    }
    let mut names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if names.windows(2).any(|w| w[0] == w[1]) {
        return Err(err("duplicate tensor names".into()));
    }
    if let Some(n) = names.iter().find(|n| n.contains(REPLICA_SEP)) {
        return Err(err(format!(
            "tensor name {n:?} contains {REPLICA_SEP:?}, which checkpoints keep for replicas' own values: rename it"
        )));
    }
    // Replica 0's value under the tensor's name; a tensor whose replicas hold
    // different values (the per-replica RNG keys) also stores replicas 1.. as
    // `<name>@replica<r>`, so a resumed run gets every replica's value back.
    // In a run of several processes the generator state's replicas are
    // gathered on node 0 by their global index (`save_once`).
    let session = kiln_runtime::distributed::session();
    let mut literals = Vec::with_capacity(tensors.len());
    let mut mine = Vec::new();
    for (n, t) in tensors {
        let replicas = t.replica_bytes()?;
        if session.is_some() && is_per_replica(n) {
            let local = crate::engine::replicas::local_replica_indices()?;
            // A value alike on every replica is read once.
            let values = if replicas.len() == 1 { vec![replicas[0].clone(); local.len()] } else { replicas };
            if values.len() != local.len() {
                return Err(err(format!(
                    "tensor {n} holds {} replicas' values, this process has {} replica(s)",
                    values.len(),
                    local.len()
                )));
            }
            let values = local.into_iter().zip(values).map(|(g, b)| Ok((g, Literal::from_bytes(t.ty().clone(), b)?)));
            mine.push(ReplicaValues { name: n.clone(), values: values.collect::<Result<_>>()? });
            continue;
        }
        for (r, bytes) in replicas.iter().enumerate() {
            if r == 0 || replicas.iter().any(|b| b != &replicas[0]) {
                let name = if r == 0 { n.clone() } else { format!("{n}{REPLICA_SEP}{r}") };
                literals.push((name, Literal::from_bytes(t.ty().clone(), bytes.clone())?));
            }
        }
    }
    match session {
        Some(session) => save_once(&session, path, step, literals, mine),
        None => write_atomically(path, &serialize(path, step, &literals)?),
    }
}

/// The file's bytes: `literals` and `step`, with the format and checksum.
fn serialize(path: &Path, step: u64, literals: &[(String, Literal)]) -> Result<Vec<u8>> {
    let err = |reason: String| FrontendError::Checkpoint { path: path.to_path_buf(), reason };
    // Sorted by name: the order safetensors gives back on load.
    let mut sorted: Vec<&(String, Literal)> = literals.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let sum = file_checksum(step, sorted.iter().map(|(n, l)| (n.as_str(), l)));
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("step".to_string(), step.to_string());
    meta.insert("checksum".to_string(), format!("{sum:016x}"));
    let views = literals
        .iter()
        .map(|(n, l)| {
            let view = TensorView::new(st_dtype(l.ty().dtype), l.ty().shape.dims().to_vec(), l.bytes())
                .map_err(|e| err(format!("tensor {n}: {e}")))?;
            Ok((n.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, Some(meta)).map_err(|e| err(e.to_string()))
}

/// One process's values of a per-replica tensor: (global replica index,
/// value) for each of its replicas.
#[derive(Clone, Debug, PartialEq)]
struct ReplicaValues {
    name: String,
    values: Vec<(usize, Literal)>,
}

/// `mine` as bytes for the run's store: per tensor, its name, then each
/// replica's global index and bytes (lengths as u64, little-endian).
fn encode_replicas(mine: &[ReplicaValues]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut put = |bytes: &[u8]| {
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    };
    for t in mine {
        put(t.name.as_bytes());
        put(&(t.values.len() as u64).to_le_bytes());
        for (g, l) in &t.values {
            put(&(*g as u64).to_le_bytes());
            put(l.bytes());
        }
    }
    out
}

/// Reads what [`encode_replicas`] wrote on another node, whose tensors are
/// `like`'s (the same names and types, every node saving the same state).
fn decode_replicas(bytes: &[u8], like: &[ReplicaValues]) -> std::result::Result<Vec<ReplicaValues>, String> {
    let mut rest = bytes;
    let mut take = || -> std::result::Result<&[u8], String> {
        let short = || "its replicas' values end early".to_string();
        let (len, tail) = rest.split_first_chunk::<8>().ok_or_else(short)?;
        let len = usize::try_from(u64::from_le_bytes(*len)).map_err(|_| short())?;
        if len > tail.len() {
            return Err(short());
        }
        let (item, tail) = tail.split_at(len);
        rest = tail;
        Ok(item)
    };
    let number = |b: &[u8]| -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(b.try_into().map_err(|_| "a count that is not 8 bytes".to_string())?))
    };
    let mut out = Vec::with_capacity(like.len());
    for t in like {
        let name = take()?;
        if name != t.name.as_bytes() {
            return Err(format!("it sent {:?} where this node has {}", String::from_utf8_lossy(name), t.name));
        }
        let ty = t.values.first().map(|(_, l)| l.ty().clone()).ok_or("a tensor with no replica")?;
        let count = number(take()?)?;
        let mut values = Vec::new();
        for _ in 0..count {
            let g = usize::try_from(number(take()?)?).map_err(|_| "a replica index out of range".to_string())?;
            let value = Literal::from_bytes(ty.clone(), take()?.to_vec())
                .map_err(|e| format!("{}: replica {g}'s value: {e}", t.name))?;
            values.push((g, value));
        }
        out.push(ReplicaValues { name: t.name.clone(), values });
    }
    if !rest.is_empty() {
        return Err(format!("{} bytes more than this node's tensors", rest.len()));
    }
    Ok(out)
}

/// Every node's values of each per-replica tensor as the file holds them:
/// global replica 0's under the tensor's name, and where the replicas differ
/// replica g's as `<name>@replica<g>`, as one process with all the replicas
/// would write. The global indices must be `0..n`, each once.
fn merge_replicas(all: Vec<ReplicaValues>) -> std::result::Result<Vec<(String, Literal)>, String> {
    let mut by_name = std::collections::BTreeMap::<String, std::collections::BTreeMap<usize, Literal>>::new();
    for t in all {
        let slot = by_name.entry(t.name.clone()).or_default();
        for (g, l) in t.values {
            if slot.insert(g, l).is_some() {
                return Err(format!("{}: replica {g} was sent twice", t.name));
            }
        }
    }
    let mut out = Vec::new();
    for (name, values) in by_name {
        if values.keys().enumerate().any(|(i, &g)| i != g) {
            return Err(format!("{name}: the replicas sent are {:?}, not 0..{}", values.keys(), values.len()));
        }
        let values: Vec<Literal> = values.into_values().collect();
        let differ = values.iter().any(|l| l.bytes() != values[0].bytes());
        for (g, l) in values.into_iter().enumerate() {
            if g == 0 {
                out.push((name.clone(), l));
            } else if differ {
                out.push((format!("{name}{REPLICA_SEP}{g}"), l));
            }
        }
    }
    Ok(out)
}

/// Tensors that differ between replicas by design and so are left out of the
/// nodes' agreement check: the generator state (`rng.state` in the built-in
/// loops' training state). Every node sends its replicas' values to node 0,
/// and the file holds all of them by global replica index ([`merge_replicas`]).
fn is_per_replica(name: &str) -> bool {
    name == "rng.state" || name.ends_with(".rng.state")
}

/// The multi-process save (see the module docs): node 0 writes after every
/// node's checksum of `shared` matched its own, with every node's values of
/// the per-replica tensors (`mine` on each).
fn save_once(
    session: &kiln_runtime::distributed::Session,
    path: &Path,
    step: u64,
    shared: Vec<(String, Literal)>,
    mine: Vec<ReplicaValues>,
) -> Result<()> {
    let err = |reason: String| FrontendError::Checkpoint { path: path.to_path_buf(), reason };
    let sum = {
        let mut sorted: Vec<&(String, Literal)> = shared.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        checksum(sorted.iter().map(|(n, l)| (n.as_str(), l.bytes())))
    };
    let id = session.identity();
    let scope =
        format!("ckpt/{step}/{:016x}", checksum(std::iter::once(("path", path.as_os_str().as_encoded_bytes()))));
    let written = format!("{scope}/written");
    if id.node_id != 0 {
        session.put(&format!("{scope}/replicas/{}", id.node_id), &encode_replicas(&mine))?;
        session.put(&format!("{scope}/sum/{}", id.node_id), &sum.to_le_bytes())?;
        let answer = session.wait_for(&written)?;
        return match answer.as_slice() {
            b"ok" => Ok(()),
            other => Err(err(String::from_utf8_lossy(other).into_owned())),
        };
    }
    let mut differ = Vec::new();
    let mut all = mine.clone();
    let mut unreadable = None;
    for node in 1..id.num_nodes {
        let theirs = session.wait_for(&format!("{scope}/sum/{node}"))?;
        if theirs.as_slice() != sum.to_le_bytes() {
            differ.push(node);
        }
        let replicas = session.wait_for(&format!("{scope}/replicas/{node}"))?;
        match decode_replicas(&replicas, &mine) {
            Ok(r) => all.extend(r),
            Err(e) => unreadable = unreadable.or(Some(format!("node {node}'s generator state: {e}"))),
        }
    }
    let merged = match (differ.is_empty(), unreadable) {
        (false, _) => {
            Err(format!("not written: the values of node(s) {differ:?} differ from node 0's (checksum {sum:016x})"))
        }
        (true, Some(e)) => Err(format!("not written: {e}")),
        (true, None) => merge_replicas(all).map_err(|e| format!("not written: {e}")),
    };
    let replicas = match merged {
        Ok(replicas) => replicas,
        Err(reason) => {
            session.put(&written, reason.as_bytes())?;
            return Err(err(reason));
        }
    };
    let mut literals = shared;
    literals.extend(replicas);
    let outcome = serialize(path, step, &literals).and_then(|bytes| write_atomically(path, &bytes));
    let note = match &outcome {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("node 0 could not write it: {e}"),
    };
    session.put(&written, note.as_bytes())?;
    outcome
}

/// A loaded checkpoint.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub step: u64,
    pub tensors: Vec<(String, Literal)>,
}

impl Loaded {
    /// The run settings saved with [`settings_tensor`]; `None` for a file
    /// saved without them.
    pub fn settings(&self, path: &Path) -> Result<Option<Settings>> {
        let Some((_, lit)) = self.tensors.iter().find(|(n, _)| n == SETTINGS) else { return Ok(None) };
        let err = |reason: &str| FrontendError::Checkpoint { path: path.to_path_buf(), reason: reason.into() };
        if lit.ty().dtype != DType::U8 {
            return Err(err("tensor run.settings is not u8 text"));
        }
        let text = std::str::from_utf8(lit.bytes()).map_err(|_| err("tensor run.settings is not UTF-8 text"))?;
        text.lines()
            .map(|line| {
                let (k, v) = line.split_once('=').ok_or_else(|| err("tensor run.settings has a line without '='"))?;
                Ok((k.to_string(), v.to_string()))
            })
            .collect::<Result<Settings>>()
            .map(Some)
    }
}

/// The checkpoint tensor holding a run's settings ([`settings_tensor`]).
pub const SETTINGS: &str = "run.settings";

/// A run's settings by name, as text (`"lr" → "0.002"`): what a resumed run
/// must share with the run that saved the checkpoint for the resumed run to
/// continue it (the seed, the learning rate and its schedule, the precision).
pub type Settings = std::collections::BTreeMap<String, String>;

/// `settings` as the tensor a checkpoint stores them in: `name=value` lines,
/// as `u8` text, under [`SETTINGS`] (so the file's checksum covers them and a
/// run of several processes saves them as any other tensor). A name holding
/// `=` or a line break, or a value holding a line break, is refused.
pub fn settings_tensor(settings: &Settings) -> Result<(String, Tensor)> {
    let mut text = String::new();
    for (k, v) in settings {
        if k.is_empty() || k.contains(['=', '\n', '\r']) || v.contains(['\n', '\r']) {
            return Err(FrontendError::InvalidArgument {
                op: "checkpoint::settings_tensor",
                reason: format!("setting {k:?} = {v:?}: a name is one line without '=', a value one line"),
            });
        }
        text.push_str(&format!("{k}={v}\n"));
    }
    let bytes = text.into_bytes();
    let n = bytes.len();
    Ok((SETTINGS.to_string(), Tensor::from_vec(bytes, [n])?))
}

/// Compares the settings of the run that saved the checkpoint at `path`
/// (`saved`; `None` for a file saved without them, taken as it is) with this
/// run's (`now`). A difference is refused, naming each setting with both
/// values, unless `overrides` names it; a name in `overrides` that is not a
/// setting is refused too (a typo would otherwise change nothing). A setting
/// only one of the two runs has counts as a difference.
pub fn check_settings(path: &Path, saved: Option<&Settings>, now: &Settings, overrides: &[String]) -> Result<()> {
    let err = |reason: String| FrontendError::Checkpoint { path: path.to_path_buf(), reason };
    if let Some(unknown) = overrides.iter().find(|o| !now.contains_key(o.as_str())) {
        let names: Vec<&str> = now.keys().map(String::as_str).collect();
        return Err(err(format!(
            "--override-settings names {unknown:?}, which is not a setting of this run (its settings: {})",
            names.join(", ")
        )));
    }
    let Some(saved) = saved else { return Ok(()) };
    let names: std::collections::BTreeSet<&String> = saved.keys().chain(now.keys()).collect();
    let shown = |v: Option<&String>| v.map_or_else(|| "unset".to_string(), Clone::clone);
    let differ: Vec<(&String, String, String)> = names
        .into_iter()
        .filter(|k| saved.get(*k) != now.get(*k) && !overrides.contains(k))
        .map(|k| (k, shown(saved.get(k)), shown(now.get(k))))
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    let list: Vec<String> =
        differ.iter().map(|(k, a, b)| format!("{k} {a} in the checkpoint, {b} in this run")).collect();
    let names: Vec<&str> = differ.iter().map(|(k, _, _)| k.as_str()).collect();
    Err(err(format!(
        "--resume: this run's settings differ from the run that saved it: {}; resuming would not continue that \
         run. Run with the saved settings, or name the ones to change in --override-settings {}",
        list.join("; "),
        names.join(",")
    )))
}

/// Reads and verifies a checkpoint: a regular file
/// ([`crate::core::input::open`]: a FIFO or device is refused, not read)
/// whose size fits the host limit.
pub fn load(path: impl AsRef<Path>) -> Result<Loaded> {
    use std::io::Read as _;
    let path = path.as_ref();
    let io = |source| FrontendError::Io { path: path.to_path_buf(), source };
    let file = crate::core::input::open(path)?;
    let len = file.metadata().map_err(io)?.len();
    crate::core::limits::check_host_bytes(format!("checkpoint {}", path.display()), Some(len))?;
    // The size read above, and no more: a file growing meanwhile is read
    // as it was.
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(len).read_to_end(&mut bytes).map_err(io)?;
    load_bytes(&bytes, path)
}

/// [`load`] of a file's bytes already in memory (`path` names it in errors).
/// Any bytes give a checkpoint or an error, never a panic (fuzzed in
/// `frontend/tests/fuzz_readers.rs`).
pub fn load_bytes(bytes: &[u8], path: &Path) -> Result<Loaded> {
    let err = |reason: String| FrontendError::Checkpoint { path: path.to_path_buf(), reason };
    let (_, meta) =
        SafeTensors::read_metadata(bytes).map_err(|e| err(format!("not a readable safetensors file: {e}")))?;
    let info = meta.metadata().clone().unwrap_or_default();
    let format = info.get("format").map(String::as_str);
    if format != Some(FORMAT) && format != Some(FORMAT_1) {
        return Err(err(format!("not a kiln checkpoint (format {format:?})")));
    }
    let step = info.get("step").and_then(|s| s.parse().ok()).ok_or_else(|| err("missing step".into()))?;
    let expected = info.get("checksum").cloned().ok_or_else(|| err("missing checksum".into()))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| err(format!("corrupt: {e}")))?;
    let mut tensors = Vec::new();
    for (name, view) in st.iter() {
        let dtype = kiln_dtype(view.dtype()).ok_or_else(|| err(format!("tensor {name}: unsupported dtype")))?;
        let ty = TensorType::new(dtype, view.shape().to_vec());
        let lit = Literal::from_bytes(ty, view.data().to_vec()).map_err(|e| err(format!("tensor {name}: {e}")))?;
        tensors.push((name.to_string(), lit));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let got = if format == Some(FORMAT) {
        file_checksum(step, tensors.iter().map(|(n, l)| (n.as_str(), l)))
    } else {
        checksum(tensors.iter().map(|(n, l)| (n.as_str(), l.bytes())))
    };
    let got = format!("{got:016x}");
    if got != expected {
        return Err(err(format!("checksum mismatch (stored {expected}, computed {got}): the file is corrupt")));
    }
    Ok(Loaded { step, tensors })
}

/// Whether `file` is `model` with some trailing dimensions merged into one
/// (same dtype: `[64, 192]` for `[64, 3, 4, 16]`, `[192]` for `[3, 4, 16]`):
/// the same row-major values, so the bytes load as they are.
fn merges_trailing_dims(file: &TensorType, model: &TensorType) -> bool {
    let (f, m) = (file.shape.dims(), model.shape.dims());
    if file.dtype != model.dtype || f.is_empty() || f.len() >= m.len() {
        return false;
    }
    let k = f.len() - 1;
    f[..k] == m[..k] && f[k] == m[k..].iter().product::<usize>()
}

/// Loads `path` into `targets` (every target must be present with its type,
/// or, for layouts kiln regrouped, with its trailing dimensions merged:
/// `merges_trailing_dims`); returns the saved step. Nothing is assigned
/// unless all targets match.
pub fn restore(path: impl AsRef<Path>, targets: &[(String, Tensor)]) -> Result<u64> {
    let path = path.as_ref();
    restore_loaded(path, load(path)?, targets)
}

/// [`restore`] of a file that must hold `targets` and nothing else (their
/// replicas' values aside).
fn restore_all(path: &Path, targets: &[(String, Tensor)]) -> Result<u64> {
    let loaded = load(path)?;
    let base = |n: &str| n.split_once(REPLICA_SEP).map_or(n, |(b, _)| b).to_string();
    let extra: Vec<String> = loaded
        .tensors
        .iter()
        .map(|(n, _)| base(n))
        .filter(|n| !targets.iter().any(|(t, _)| t == n))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !extra.is_empty() {
        let hint = if extra.iter().any(|n| n.starts_with("loss_scaler.")) {
            " (a loss scaler's state: restore with restore_training_with and the TrainStep)"
        } else {
            " (checkpoint::restore loads a subset)"
        };
        return Err(FrontendError::Checkpoint {
            path: path.to_path_buf(),
            reason: format!(
                "the file holds {} tensor(s) this model and optimizer lack: {}{hint}",
                extra.len(),
                extra.join(", ")
            ),
        });
    }
    restore_loaded(path, loaded, targets)
}

/// [`restore`] of a checkpoint already loaded from `path`.
pub fn restore_loaded(path: &Path, loaded: Loaded, targets: &[(String, Tensor)]) -> Result<u64> {
    let mut plan = Vec::with_capacity(targets.len());
    for (name, t) in targets {
        let lit = loaded.tensors.iter().find(|(n, _)| n == name).map(|(_, l)| l).ok_or_else(|| {
            FrontendError::Checkpoint { path: path.to_path_buf(), reason: format!("no tensor {name}") }
        })?;
        // Every replica's value in the model's type: as saved, or regrouped
        // when the file holds it with its trailing dimensions merged (the same
        // row-major values in a layout kiln moved to without reordering: the
        // attention's qkv `[dim, 3·dim]` → `[dim, 3, heads, head_dim]`).
        let fit = |l: &Literal| -> Result<Literal> {
            if l.ty() == t.ty() {
                Ok(l.clone())
            } else if merges_trailing_dims(l.ty(), t.ty()) {
                Ok(Literal::from_bytes(t.ty().clone(), l.bytes().to_vec())?)
            } else {
                Err(FrontendError::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!("tensor {name} is {} in the file but {} in the model", l.ty(), t.ty()),
                })
            }
        };
        let lit = fit(lit)?;
        // Replicas 1.. saved apart: there must be one per replica of this run.
        let others: Vec<&Literal> = (1..)
            .map_while(|r| loaded.tensors.iter().find(|(n, _)| *n == format!("{name}{REPLICA_SEP}{r}")).map(|(_, l)| l))
            .collect();
        let value = if others.is_empty() {
            Tensor::from_literal(lit)
        } else {
            // Saved by global replica index: this process takes its own.
            let replicas = crate::engine::replicas::global_replicas()?;
            if others.len() + 1 != replicas {
                return Err(FrontendError::Checkpoint {
                    path: path.to_path_buf(),
                    reason: format!(
                        "tensor {name} was saved with {} replicas' values, this run has {replicas} replica(s)",
                        others.len() + 1
                    ),
                });
            }
            let mut all = vec![lit];
            for o in others {
                all.push(fit(o)?);
            }
            let mine = crate::engine::replicas::local_replica_indices()?.into_iter().map(|g| all[g].clone()).collect();
            crate::engine::replicas::from_literal_shards(mine)?
        };
        plan.push((t, value));
    }
    for (t, value) in plan {
        t.assign(&value)?;
    }
    Ok(loaded.step)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::ir::TensorType;
    use kiln_runtime::distributed::{Identity, RunScope, ServerConfig, Session, StoreServer, Timeouts};

    /// A generator state `u64[2]` (key, counter) as a literal.
    fn state(key: u64, counter: u64) -> Literal {
        let bytes = [key.to_le_bytes(), counter.to_le_bytes()].concat();
        Literal::from_bytes(TensorType::new(DType::U64, [2usize]), bytes).unwrap()
    }

    fn rng(values: &[(usize, u64)]) -> Vec<ReplicaValues> {
        vec![ReplicaValues {
            name: "rng.state".into(),
            values: values.iter().map(|&(g, k)| (g, state(k, 7))).collect(),
        }]
    }

    fn names(literals: &[(String, Literal)]) -> Vec<&str> {
        literals.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// A node's values travel through the store and come back as they were;
    /// bytes cut short, a wrong name or bytes left over are errors naming
    /// what was wrong, never a panic.
    #[test]
    fn replica_values_survive_the_store_and_bad_bytes_are_named() {
        let mine = rng(&[(2, 0x9e37), (3, 0x3c6e)]);
        let bytes = encode_replicas(&mine);
        assert_eq!(decode_replicas(&bytes, &rng(&[(0, 1), (1, 2)])).unwrap(), mine);
        for cut in 0..bytes.len() {
            assert!(decode_replicas(&bytes[..cut], &mine).is_err(), "{cut} bytes decoded");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode_replicas(&longer, &mine).unwrap_err().contains("1 bytes more"));
        let other = vec![ReplicaValues { name: "model.rng.state".into(), values: mine[0].values.clone() }];
        assert!(decode_replicas(&bytes, &other).unwrap_err().contains("\"rng.state\" where this node has"));
    }

    /// Two nodes of two replicas each: the file holds global replica 0's
    /// state under the name and replicas 1-3's as `@replica<g>`, as one
    /// process with four replicas writes it; states alike on every replica
    /// are one tensor; a missing or repeated replica is refused.
    fn settings(pairs: &[(&str, &str)]) -> Settings {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn settings_round_trip_and_differences_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.ck");
        let saved = settings(&[("lr", "0.002"), ("seed", "3"), ("amp", "off")]);
        let w = Tensor::from_vec(vec![1.5f32, -2.0], [2]).unwrap();
        save(&path, 4, &[("param.w".to_string(), w), settings_tensor(&saved).unwrap()]).unwrap();
        let loaded = load(&path).unwrap();
        assert_eq!(loaded.settings(&path).unwrap().as_ref(), Some(&saved));
        check_settings(&path, Some(&saved), &saved, &[]).unwrap();
        let now = settings(&[("lr", "0.01"), ("seed", "3"), ("amp", "bf16")]);
        let e = check_settings(&path, Some(&saved), &now, &[]).unwrap_err().to_string();
        assert!(e.contains("amp off in the checkpoint, bf16 in this run; lr 0.002"), "{e}");
        assert!(e.contains("--override-settings amp,lr"), "{e}");
        check_settings(&path, Some(&saved), &now, &["amp".into(), "lr".into()]).unwrap();
        let e = check_settings(&path, Some(&saved), &now, &["ampp".into()]).unwrap_err().to_string();
        assert!(e.contains("\"ampp\", which is not a setting"), "{e}");
        // A file saved without settings is taken as it is; one more setting
        // on either side is a difference.
        check_settings(&path, None, &now, &[]).unwrap();
        let e = check_settings(&path, Some(&saved), &settings(&[("lr", "0.002"), ("seed", "3")]), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("amp off in the checkpoint, unset in this run"), "{e}");
        for bad in [("a=b", "1"), ("", "1"), ("lr", "1\n2")] {
            assert!(settings_tensor(&settings(&[bad])).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn replicas_merge_by_global_index() {
        let mut all = rng(&[(2, 30), (3, 40)]);
        all.extend(rng(&[(0, 10), (1, 20)]));
        let merged = merge_replicas(all).unwrap();
        assert_eq!(names(&merged), ["rng.state", "rng.state@replica1", "rng.state@replica2", "rng.state@replica3"]);
        for (g, (_, l)) in merged.iter().enumerate() {
            assert_eq!(l, &state(10 * (g as u64 + 1), 7));
        }
        let mut alike = rng(&[(0, 5)]);
        alike.extend(rng(&[(1, 5)]));
        assert_eq!(names(&merge_replicas(alike).unwrap()), ["rng.state"]);
        let mut gap = rng(&[(0, 1)]);
        gap.extend(rng(&[(2, 2)]));
        assert!(merge_replicas(gap).unwrap_err().contains("not 0..2"));
        let mut twice = rng(&[(0, 1), (1, 2)]);
        twice.extend(rng(&[(1, 3)]));
        assert!(merge_replicas(twice).unwrap_err().contains("replica 1 was sent twice"));
    }

    fn identity(node: u32, coordinator: &str, run: &str) -> Identity {
        Identity {
            node_id: node,
            num_nodes: 2,
            coordinator: Some(coordinator.to_string()),
            serves_store: false,
            scope: RunScope { run_id: run.into(), attempt: 0 },
            local_devices: None,
            timeouts: Timeouts { startup_ms: 10_000, peer_ms: 10_000 },
            token: None,
        }
    }

    /// Two nodes save through the run's store (two sessions in threads):
    /// node 0 writes one file with both nodes' generator states by global
    /// replica, and both return only once it is written. Shared values that
    /// differ are refused on both nodes, and no file is written.
    #[test]
    fn two_nodes_write_one_file_with_every_replicas_generator_state() {
        let server = StoreServer::bind("127.0.0.1:0", ServerConfig::new(None, 2)).unwrap();
        let addr = server.local_addr().to_string();
        let dir = tempfile::tempdir().unwrap();
        let weight = |v: f32| {
            let ty = TensorType::new(DType::F32, [2usize]);
            ("param.w".to_string(), Literal::from_bytes(ty, [v.to_le_bytes(), 2.5f32.to_le_bytes()].concat()).unwrap())
        };
        let save_on_both = |run: &str, file: &str, w1: f32| {
            let path = dir.path().join(file);
            let nodes: Vec<_> = (0..2u32)
                .map(|node| {
                    let (id, path) = (identity(node, &addr, run), path.clone());
                    let shared = vec![weight(if node == 0 { 1.5 } else { w1 })];
                    let mine = rng(&[(node as usize, 100 + u64::from(node))]);
                    std::thread::spawn(move || {
                        let session = Session::start(id)?;
                        Ok::<_, FrontendError>(save_once(&session, &path, 9, shared, mine))
                    })
                })
                .collect();
            let outcomes: Vec<Result<()>> = nodes.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
            (path, outcomes)
        };

        let (path, outcomes) = save_on_both("agree", "c.safetensors", 1.5);
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        let loaded = load(&path).unwrap();
        assert_eq!(loaded.step, 9);
        let mut got = loaded.tensors.clone();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(names(&got), ["param.w", "rng.state", "rng.state@replica1"]);
        assert_eq!(got[0].1, weight(1.5).1);
        assert_eq!(got[1].1, state(100, 7));
        assert_eq!(got[2].1, state(101, 7));

        let (path, outcomes) = save_on_both("differ", "d.safetensors", -1.0);
        for o in outcomes {
            let e = o.unwrap_err().to_string();
            assert!(e.contains("not written") && e.contains("node(s) [1] differ"), "{e}");
        }
        assert!(!path.exists());
    }
}
