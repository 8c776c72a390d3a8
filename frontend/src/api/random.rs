//! The thread's in-graph random generator.
//!
//! Random numbers are drawn inside the compiled step by `rng_bit_generator`
//! (THREE_FRY), threading a `u64[2]` state tensor from draw to draw. The state is
//! an ordinary tensor (on the device after the first step, donated each step), so
//! drawing costs no host sync and checkpoints can save and restore it.
//!
//! Invariants:
//! - Each random op draws inside the step and assigns the advanced state over
//!   the state tensor, so two draws never reuse bits and a restored state
//!   draws exactly what the uninterrupted run would have.
//! - Replica 0 keeps the seed itself (one replica draws what it always drew);
//!   the other replicas get their own keys, so their dropout masks differ.

use std::cell::RefCell;

use kiln_compiler::ir::{DType, Literal, Shape, TensorType};

use crate::core::error::Result;
use crate::core::tensor::Tensor;

thread_local! {
    static STATE: RefCell<Option<Tensor>> = const { RefCell::new(None) };
}

const DEFAULT_SEED: u64 = 0x6b69_6c6e; // "kiln"

fn state_literal(key: u64) -> Literal {
    let mut bytes = Vec::with_capacity(16);
    bytes.extend(key.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    Literal::from_bytes(TensorType::new(DType::U64, [2]), bytes).expect("16 bytes fill u64[2]")
}

/// Replica `r`'s generator key for `seed`: replica 0 keeps the seed itself (a
/// single replica draws what it always drew), the others get keys spread by
/// the golden-ratio increment, so dropout masks differ between replicas.
fn replica_key(seed: u64, r: usize) -> u64 {
    seed.wrapping_add((r as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// The initial state: one key per replica of this thread's steps.
fn initial_state(seed: u64) -> Tensor {
    // A plan that cannot be made fails the first step with its own error.
    // Keys follow global replica indices, so a run over several processes
    // draws what one process with all the replicas would.
    let replicas = crate::engine::replicas::local_replica_indices().unwrap_or_else(|_| vec![0]);
    if replicas == [0] {
        return Tensor::from_literal(state_literal(seed));
    }
    let states: Vec<Vec<u64>> = replicas.iter().map(|&r| vec![replica_key(seed, r), 0]).collect();
    crate::engine::replicas::from_shards(states, [2]).unwrap_or_else(|_| Tensor::from_literal(state_literal(seed)))
}

/// Restarts the generator from `seed` (each replica from its own key).
pub fn manual_seed(seed: u64) {
    STATE.with(|s| *s.borrow_mut() = Some(initial_state(seed)));
}

/// The generator's state tensor: `u64[2]` (key, counter), one per replica.
///
/// Every random op (`Tensor::rand`, `randn`, dropout) draws inside the step
/// and assigns the advanced state over this tensor, so saving it with the
/// parameters (as [`crate::api::checkpoint::training_state`] does) and restoring it
/// makes a resumed run draw exactly what the uninterrupted run would have.
/// The handle stays valid across steps; [`set_state`] or `assign` replaces
/// its value.
pub fn state() -> Tensor {
    STATE.with(|s| s.borrow_mut().get_or_insert_with(|| initial_state(DEFAULT_SEED)).clone())
}

/// Replaces the generator's state (from a checkpoint).
pub fn set_state(t: Tensor) {
    STATE.with(|s| *s.borrow_mut() = Some(t));
}

/// Draws `u32` bits of `shape`, advancing the state.
pub(crate) fn next_bits(shape: &Shape) -> Result<Tensor> {
    let state = state();
    let (next, bits) = Tensor::rng_bit_generator(&state, TensorType::new(DType::U32, shape.clone()))?;
    state.assign(&next)?;
    Ok(bits)
}
