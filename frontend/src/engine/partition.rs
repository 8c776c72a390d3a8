//! Steps over the active device mesh: setting the mesh (and the replica plan
//! it runs under), and what the step, the compiler and reads need to know of
//! tensors' layouts on it (`crate::core::mesh` has the types).
//!
//! Invariants:
//! - Under a mesh the run has one logical replica: `replicas` sees 1, so no
//!   `all_reduce` is recorded; a tensor without a sharding is replicated over
//!   the whole mesh.
//! - A tensor's sharding is its layout on the devices: the program that
//!   produced its buffers was lowered with it, and every later program that
//!   reads them is lowered with it (the raw-trace key includes the layouts,
//!   [`layout_key`]).
//! - Every receiver of a step's output takes the same layout
//!   ([`output_shardings`]), so all handles on the same buffers agree on it.
//! - Without a mesh every function here answers "nothing to do" (no layout,
//!   key 0, no assembled read), so the replica path is unchanged.

use std::hash::{Hash, Hasher};
use std::rc::Rc;

use kiln_compiler::ir::Literal;

use crate::core::error::{FrontendError, Result};
use crate::core::mesh::{Mesh, Sharding, DATA, MODEL};
use crate::core::settings::{self, active_mesh};
use crate::core::storage::{Inner, Storage};
use crate::engine::context;

/// Runs this thread's later steps on `mesh`: one replica × `mesh.size()`
/// partitions of the selected plugin (`PJRT_DEVICE`). Call it before creating
/// tensors. Refused when `KILN_CPU_DEVICES` / `GPU_NUM_DEVICES` set another
/// device count, when there are not that many devices, or in a run of
/// several processes.
pub fn set_mesh(mesh: Mesh) -> Result<()> {
    let env = kiln_runtime::ReplicaEnv::from_env()?;
    let plan = plan_for(&mesh, &env)?;
    context::set_plan(plan);
    settings::with(|s| s.mesh = Some(mesh));
    Ok(())
}

pub use crate::core::mesh::plan_for;

/// The mesh this thread's steps run on (`None`: no partitioning). Reads
/// `KILN_MESH` on first use, as the replica plan reads its variables.
pub fn mesh() -> Result<Option<Mesh>> {
    context::with(|c| c.exec.plan().map(|_| ()))?;
    Ok(active_mesh())
}

/// XLA's compiled memory statistics of every program this thread compiled
/// or loaded, oldest first. Under a mesh they are one device's: argument
/// bytes count that device's shards.
pub fn program_memory_stats() -> Result<Vec<kiln_runtime::CompiledMemoryStats>> {
    let programs = context::with(|c| c.cache.history.clone());
    programs.iter().map(|p| p.exe.compiled_memory_stats().map_err(FrontendError::from)).collect()
}

/// How many equal contiguous parts the rows of a batch-major `[n, ...]`
/// activation come in under the active mesh: the `data` axis's size when it
/// divides `n` ([`shard_batch`] splits the batch over it, and the tokens' rows
/// follow the batch), else 1. The LM-head composite makes its row blocks
/// within each part, so no rows move between devices (`docs/sharding.md`,
/// "The LM head on each device's rows").
pub(crate) fn row_shards(n: usize) -> usize {
    match data_parts() {
        d if d > 1 && n % d == 0 => d,
        _ => 1,
    }
}

/// How many parts the active mesh's `data` axis splits a batch into (1
/// without one).
pub(crate) fn data_parts() -> usize {
    active_mesh().and_then(|m| m.axis_size(DATA)).unwrap_or(1)
}

/// How the cuDNN attention calls split under `mesh` (the CUDA lowering runs
/// each on one device's shard, `kiln_compiler::AttentionSplit`): the batch
/// over `data`, as [`shard_batch`] splits it, and the heads over `model`, as
/// tensor parallelism splits the fused qkv projection. `None` when neither
/// axis splits anything.
pub(crate) fn attention_split(mesh: &Mesh) -> Option<kiln_compiler::AttentionSplit> {
    let batch = mesh.axis_size(DATA).unwrap_or(1);
    let heads = mesh.axis_size(MODEL).unwrap_or(1);
    if batch * heads == 1 {
        return None;
    }
    // The axes of dimension 0 (batch) and of the heads dimension.
    let split = |rank: usize, heads_dim: usize| {
        let mut s = Sharding::replicated(rank);
        if batch > 1 {
            s = s.with(0, DATA);
        }
        if heads > 1 {
            s = s.with(heads_dim, MODEL);
        }
        s.hlo(mesh)
    };
    Some(kiln_compiler::AttentionSplit { batch, heads, btnh: split(4, 2), bnth: split(4, 1), bnt: split(3, 1) })
}

/// The sharding of `inner` (replicated when unset).
pub(crate) fn of(inner: &Inner) -> Sharding {
    inner.sharding.borrow().clone().unwrap_or_else(|| Sharding::replicated(inner.ty.shape.dims().len()))
}

/// The parameters of a trace fed by `bindings` that XLA's SPMD partitioner
/// gathers where they are computed with: the state a step updates
/// (`assigned`: an output is assigned over it) that is split over the `data`
/// axis, as FSDP splits weights. Batches are split over it too but are not
/// assigned over. Empty without a mesh or without that axis.
pub(crate) fn gathered_params(bindings: &[crate::core::trace::Binding], assigned: &[bool]) -> Vec<u32> {
    let Some(mesh) = active_mesh() else { return Vec::new() };
    if mesh.axis_size(DATA).is_none_or(|s| s == 1) {
        return Vec::new();
    }
    let split = |b: &crate::core::trace::Binding| {
        b.tensor.upgrade().is_some_and(|t| of(&t).dims().iter().any(|d| d.as_deref() == Some(DATA)))
    };
    (0..bindings.len()).filter(|&i| assigned[i] && split(&bindings[i])).map(|i| i as u32).collect()
}

/// Under a mesh, the layout of each output of a closing trace: the first
/// receiver's sharding that is set (replicated when none is), which every
/// receiver of that output then takes, so all handles on the buffers agree on
/// their layout. `None` without a mesh.
pub(crate) fn output_shardings(receivers: &[Vec<Rc<Inner>>]) -> Option<Vec<Sharding>> {
    active_mesh()?;
    Some(
        receivers
            .iter()
            .map(|rs| {
                let chosen = rs.iter().find_map(|r| r.sharding.borrow().clone());
                for r in rs {
                    *r.sharding.borrow_mut() = chosen.clone();
                }
                match (chosen, rs.first()) {
                    (Some(s), _) => s,
                    (None, Some(r)) => Sharding::replicated(r.ty.shape.dims().len()),
                    (None, None) => Sharding::replicated(0),
                }
            })
            .collect(),
    )
}

/// A hash of the layouts of a trace's parameters and outputs, mixed into the
/// raw-trace key so a trace recorded under other layouts compiles anew.
/// 0 without a mesh.
pub(crate) fn layout_key(params: &[crate::core::trace::Binding], outputs: Option<&[Sharding]>) -> u64 {
    let Some(mesh) = active_mesh() else { return 0 };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    mesh.hash(&mut h);
    for p in params {
        p.tensor.upgrade().and_then(|i| i.sharding.borrow().clone()).hash(&mut h);
    }
    outputs.hash(&mut h);
    h.finish()
}

/// Reads a device value laid out over the active mesh: the assembled global
/// bytes (device 0's copy when replicated). `None` when no mesh is active
/// (replica layout: the caller reads replica buffers).
pub(crate) fn read_device(inner: &Inner, value: &crate::core::storage::DeviceValue) -> Result<Option<Vec<u8>>> {
    let Some(mesh) = active_mesh() else { return Ok(None) };
    if value.0.len() != mesh.size() || value.0.len() == 1 {
        return Ok(None);
    }
    let sharding = of(inner);
    if sharding.is_replicated() {
        return Ok(Some(crate::engine::run::download(value, 0..1)?.swap_remove(0)));
    }
    let parts = crate::engine::run::download(value, 0..value.0.len())?;
    Ok(Some(sharding.assemble(&inner.ty, &mesh, &parts)))
}

/// The storage `to` takes when assigned `from`'s ready `storage`: the same
/// buffers when the layouts agree, else the assembled value on the host (the
/// next step uploads it in `to`'s layout).
pub(crate) fn relayout(from: &Inner, to: &Inner, storage: Storage) -> Result<Storage> {
    let Storage::Device(value) = &storage else { return Ok(storage) };
    if active_mesh().is_none() || of(from) == of(to) {
        return Ok(storage);
    }
    let bytes = match read_device(from, value)? {
        Some(b) => b,
        None => return Ok(storage),
    };
    Ok(Storage::Host(std::sync::Arc::new(Literal::from_bytes(from.ty.clone(), bytes)?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_splits_the_batch_over_data_and_the_heads_over_model() {
        let split = |spec: &str| attention_split(&Mesh::parse(spec).unwrap());
        let fsdp = split("data=2").unwrap();
        assert_eq!((fsdp.batch, fsdp.heads), (2, 1));
        assert_eq!((fsdp.btnh.as_str(), fsdp.bnt.as_str()), ("{devices=[2,1,1,1]0,1}", "{devices=[2,1,1]0,1}"));
        let tp = split("model=2").unwrap();
        assert_eq!((tp.batch, tp.heads), (1, 2));
        assert_eq!((tp.btnh.as_str(), tp.bnth.as_str()), ("{devices=[1,1,2,1]0,1}", "{devices=[1,2,1,1]0,1}"));
        let both = split("data=2,model=2").unwrap();
        assert_eq!((both.batch, both.heads), (2, 2));
        assert_eq!(both.btnh, "{devices=[2,1,2,1]0,1,2,3}");
        assert!(split("data=1").is_none());
    }
}
