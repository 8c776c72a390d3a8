//! Sharding on one host through XLA's SPMD partitioner: a device mesh with
//! named axes, a sharding per tensor, and policies that shard a
//! [`ParamStore`](crate::nn::ParamStore) (FSDP, Megatron-style tensor
//! parallelism, both). docs/sharding.md has the design and what each plugin
//! accepts.
//!
//! The public face of three layers: the mesh and sharding types
//! (`core::mesh`), the active mesh and the step's layouts
//! (`engine::partition`), and here the policies ([`ShardPolicy`]), the CLI's
//! `--shard` flag ([`parse_shard_flag`]) and [`shard_batch`].
//!
//! Invariant: under a mesh the run has one logical replica (`replicas` sees
//! 1) and a tensor without a sharding is replicated over the whole mesh.

mod flag;
mod policy;

pub use crate::core::mesh::{Mesh, PolicyKind, Sharding, DATA, ENV_MESH, MODEL};
pub use crate::engine::partition::{mesh, plan_for, program_memory_stats, set_mesh};
pub use flag::parse_shard_flag;
pub use policy::{apply, apply_active, megatron_pairs, set_policy, ShardPolicy};

use crate::core::error::Result;
use crate::core::settings::active_mesh;
use crate::core::tensor::Tensor;

/// Splits a batch's first dimension over the mesh's `data` axis; nothing
/// without a mesh or without that axis.
pub fn shard_batch(t: &Tensor) -> Result<()> {
    let Some(mesh) = active_mesh() else { return Ok(()) };
    if mesh.axis_size(DATA).is_none_or(|s| s == 1) || t.rank() == 0 {
        return Ok(());
    }
    t.set_sharding(Sharding::split(t.rank(), 0, DATA))
}
