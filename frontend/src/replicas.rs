//! Data-parallel replicas: how many copies of the step run, one per device, and
//! the collectives that keep them in agreement.
//!
//! Every replica runs the same compiled program on its own shard of the data;
//! parameters start identical and stay identical because every replica applies
//! the same all-reduced gradients.

use kiln_compiler::ir::ReduceOp;

use crate::context;
use crate::error::Result;
use crate::tensor::Tensor;

/// Number of replicas the steps of this thread run on (1 unless replicas were
/// set up).
pub fn num_replicas() -> usize {
    context::with(|c| c.replicas)
}

/// The mean of each tensor over all replicas, recorded into the step (an
/// `all_reduce` sum scaled by `1/n`). With one replica the tensors are returned
/// as they are: no collective is recorded.
pub fn all_reduce_mean(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    let n = num_replicas();
    if n == 1 {
        return Ok(tensors.to_vec());
    }
    tensors.iter().map(|t| t.all_reduce(ReduceOp::Sum)?.mul_scalar(1.0 / n as f64)).collect()
}
