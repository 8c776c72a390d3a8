//! The ops recorded as one node with several outputs: an optimization barrier
//! over several values, and a draw of random bits that also returns the
//! generator's next state.
//!
//! Invariant: each output is a pending tensor of its own, and all of them
//! belong to the one node, recorded once.

use kiln_compiler::ir::{Op, RngAlgorithm, TensorType, ValueId};

use crate::core::error::Result;
use crate::core::tensor::Tensor;
use crate::engine::context;

impl Tensor {
    /// Fences values so XLA does not move computation across them.
    pub fn optimization_barrier(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
        let inputs = tensors.iter().map(|t| t.value("optimization_barrier")).collect::<Result<Vec<_>>>()?;
        context::with(|c| {
            let id = c.trace.graph.add(Op::OptimizationBarrier { inputs })?;
            Ok((0..tensors.len()).map(|i| Tensor::wrap(c.pending(ValueId::new(id, i as u32)))).collect())
        })
    }

    /// Records a `rng_bit_generator`; returns `(new_state, bits)`.
    pub(crate) fn rng_bit_generator(state: &Tensor, ty: TensorType) -> Result<(Tensor, Tensor)> {
        let s = state.value("rng_bit_generator")?;
        context::with(|c| {
            let id = c.trace.graph.add(Op::RngBitGenerator { algorithm: RngAlgorithm::ThreeFry, state: s, ty })?;
            Ok((Tensor::wrap(c.pending(ValueId::new(id, 0))), Tensor::wrap(c.pending(ValueId::new(id, 1)))))
        })
    }
}
