//! Data-parallel replicas, the plumbing: how many copies of the step run, one
//! per device, which of them this process runs, and tensors holding one value
//! per replica. The public `replicas` module (`api::replicas`) re-exports
//! these beside the collectives and the per-replica reads.
//!
//! Every replica runs the same compiled program (one multi-device PJRT
//! executable with `num_replicas = N`) on its own shard of the data.
//! Parameters start identical (host data is uploaded to every replica) and stay
//! identical because every replica applies the same all-reduced gradients.
//!
//! The count comes from the environment on first use — `PJRT_DEVICE=CUDA` with
//! `GPU_NUM_DEVICES=N` (all visible GPUs when unset), or `KILN_CPU_DEVICES=N`
//! on the CPU plugin — or from [`set_replicas`]. Bad values are errors that
//! name the variable, its value and the devices found.
//!
//! Invariants:
//! - A tensor made by `Tensor::from_vec` holds one value for every replica;
//!   [`from_shards`] makes one with a value per local replica, and refuses
//!   any other count of shards.
//! - Replicas are numbered globally across the processes of a run; this
//!   process's are [`local_replica_indices`], in order, and a step's
//!   per-replica values are this process's.
//! - Setting the count replaces the replica plan and drops the client and the
//!   programs made for the old one.

use kiln_compiler::ir::{Literal, Shape, TensorType};
use kiln_runtime::gpu;
use kiln_runtime::replicas::ReplicaEnv;

use crate::core::element::{self, Element};
use crate::core::error::{FrontendError, Result};
use crate::core::storage::{Inner, State, Storage};
use crate::core::tensor::Tensor;
use crate::engine::context;

/// Number of replicas the steps of this thread run on in this process (from
/// the environment on first use; see the module docs): the values a tensor
/// holds. In a run of several processes, see [`global_replicas`].
pub fn num_replicas() -> Result<usize> {
    context::with(|c| c.replicas())
}

/// Replicas of the whole run: this process's times the node count
/// (`KILN_NUM_NODES`; every node brings the same number). Equal to
/// [`num_replicas`] in a single process.
pub fn global_replicas() -> Result<usize> {
    context::with(|c| {
        let plan = c.exec.plan()?;
        Ok(plan.replicas * plan.identity.num_nodes as usize)
    })
}

/// The global indices of this process's replicas, in order (`0..n` in a
/// single process). In a run of several processes this creates the client,
/// which joins the run.
pub fn local_replica_indices() -> Result<Vec<usize>> {
    let global = global_replicas()?;
    let local = num_replicas()?;
    if global == local {
        return Ok((0..local).collect());
    }
    let client = context::with(|c| c.client())?;
    Ok(client.local_replicas(global))
}

/// Keeps this process's shards of every step: `steps[k][g]` is step `k`'s
/// shard for global replica `g` (as [`crate::data::replica_batches`] makes
/// them for [`global_replicas`]); the result has one shard per local replica.
pub fn local_shards<T>(steps: Vec<Vec<T>>) -> Result<Vec<Vec<T>>> {
    let global = global_replicas()?;
    let local = local_replica_indices()?;
    if local.len() == global {
        return Ok(steps);
    }
    Ok(steps
        .into_iter()
        .map(|step| step.into_iter().enumerate().filter(|(g, _)| local.contains(g)).map(|(_, s)| s).collect())
        .collect())
}

/// Runs this thread's later steps on `n` replicas of the selected plugin
/// (`PJRT_DEVICE`): on the CPU plugin a client with `n` devices, on CUDA the
/// first `n` GPUs. Call it before creating tensors; the errors are those of
/// `KILN_CPU_DEVICES=n` / `GPU_NUM_DEVICES=n`.
pub fn set_replicas(n: usize) -> Result<()> {
    let value = n.to_string();
    let env = ReplicaEnv {
        device: kiln_runtime::PjrtDevice::from_env()?,
        gpu_num_devices: Some(value.clone()),
        cpu_devices: Some(value),
        node: kiln_runtime::distributed::NodeEnv::from_env(),
    };
    let plan = env.plan(gpu::probe_gpus)?;
    context::set_plan(plan);
    Ok(())
}

/// A tensor holding `shards[r]` on replica `r`; each shard has `shape`. There
/// must be one shard per replica.
pub fn from_shards<T: Element>(shards: Vec<Vec<T>>, shape: impl Into<Shape>) -> Result<Tensor> {
    let shape = shape.into();
    let n = num_replicas()?;
    if shards.len() != n {
        return Err(FrontendError::Count {
            op: "from_shards",
            what: "shards",
            expected: format!("{n} replicas"),
            got: shards.len(),
        });
    }
    let ty = TensorType::new(T::DTYPE, shape.clone());
    let literals = shards
        .into_iter()
        .map(|data| {
            if data.len() != shape.num_elements() {
                return Err(FrontendError::DataLength { op: "from_shards", shape: shape.clone(), len: data.len() });
            }
            Ok(Literal::from_bytes(ty.clone(), element::to_bytes(&data))?)
        })
        .collect::<Result<Vec<_>>>()?;
    let storage = if literals.len() == 1 {
        Storage::Host(std::sync::Arc::new(literals.into_iter().next().expect("one shard")))
    } else {
        Storage::HostShards(std::sync::Arc::new(literals))
    };
    Ok(Tensor::wrap(Inner::new(ty, State::Ready(storage))))
}

/// A tensor holding `literals[r]` on replica `r` (one per replica, one type).
pub(crate) fn from_literal_shards(literals: Vec<Literal>) -> Result<Tensor> {
    let n = num_replicas()?;
    let Some(ty) = literals.first().map(|l| l.ty().clone()) else {
        return Err(FrontendError::Empty { op: "from_shards", what: "shard" });
    };
    if literals.len() != n {
        return Err(FrontendError::Count {
            op: "from_shards",
            what: "shards",
            expected: format!("{n} replicas"),
            got: literals.len(),
        });
    }
    if let Some((r, l)) = literals.iter().enumerate().find(|(_, l)| l.ty() != &ty) {
        let what = format!("shard {r}");
        let (expected, got) = (Box::new(ty), Box::new(l.ty().clone()));
        return Err(FrontendError::TypeMismatch { op: "from_shards", what, expected, got });
    }
    let storage = if n == 1 {
        Storage::Host(std::sync::Arc::new(literals.into_iter().next().expect("one shard")))
    } else {
        Storage::HostShards(std::sync::Arc::new(literals))
    };
    Ok(Tensor::wrap(Inner::new(ty, State::Ready(storage))))
}
