//! Data-parallel replicas: how many copies of the step run, one per device, and
//! the collectives that keep them in agreement.
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
//! Values per replica: a tensor made by [`Tensor::from_vec`] holds one value
//! for every replica; [`from_shards`] makes one with a value per replica (data
//! shards); reading a tensor (`to_vec`, `item`) reads replica 0, and
//! [`replica_values`] reads every replica.
//!
//! The plumbing (the count, the plan, per-replica storage) is
//! `engine::replicas`; here are the collectives recorded into a step and the
//! per-replica read.
//!
//! Invariant: with one replica no collective is recorded: the step is the
//! single-device one.

use kiln_compiler::ir::ReduceOp;

use crate::core::element::{self, Element};
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;
pub use crate::engine::replicas::{
    from_shards, global_replicas, local_replica_indices, local_shards, num_replicas, set_replicas,
};

/// The mean of each tensor over all replicas, recorded into the step (an
/// `all_reduce` sum scaled by `1/n`). With one replica the tensors are returned
/// as they are: no collective is recorded.
pub fn all_reduce_mean(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    let n = global_replicas()?;
    if n == 1 {
        return Ok(tensors.to_vec());
    }
    tensors.iter().map(|t| t.all_reduce(ReduceOp::Sum)?.mul_scalar(1.0 / n as f64)).collect()
}

/// Every replica's value of `t` (runs the step first if `t` is pending).
pub fn replica_values<T: Element>(t: &Tensor) -> Result<Vec<Vec<T>>> {
    if T::DTYPE != t.dtype() {
        return Err(FrontendError::ReadDType { tensor: t.dtype(), requested: T::DTYPE });
    }
    Ok(t.replica_bytes()?.iter().map(|b| element::from_bytes(b)).collect())
}
