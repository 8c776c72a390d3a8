//! Setting the switches that change what a step compiles to: the memory
//! budget (in bytes, or as a share of the activation memory), host offload,
//! host copies and loop kernels. The values live in `core::settings` (where
//! they are read); they are set here because setting one invalidates
//! programs this thread compiled.
//!
//! Invariant: a program in the compile caches was built under the settings
//! set now. A setter whose value changes clears this thread's compiled
//! programs; one that sets the value already set clears nothing.

use crate::core::error::{FrontendError, Result};
use crate::core::settings::{self, Settings};
use crate::engine::context::clear_compile_cache;

/// Sets this thread's step memory budget in bytes (`None`: no remat pass).
/// Set before the CUDA client opens, it also has the client reserve its
/// memory pool at start unless `KILN_GPU_PREALLOCATE` says otherwise: a plan
/// sized to the pool needs it whole (`Executor::client`).
pub fn set_memory_limit(bytes: Option<u64>) {
    set(|s| &mut s.memory_limit_bytes, bytes);
}

/// Sets this thread's step memory budget as a fraction in (0, 1] of each
/// step's activation memory (the unplanned predicted peak less `1 - fraction`
/// of its predicted temporaries, `docs/memory.md`); when set it is used
/// instead of [`set_memory_limit`]'s bytes. `None`: no fraction.
pub fn set_activation_budget(fraction: Option<f64>) -> Result<()> {
    if let Some(f) = fraction {
        if !(f > 0.0 && f <= 1.0) {
            return Err(FrontendError::InvalidArgument {
                op: "set_activation_budget",
                reason: format!("the fraction of activation memory must be in (0, 1], got {f}"),
            });
        }
    }
    set(|s| &mut s.activation_fraction, fraction);
    Ok(())
}

/// Whether the remat pass may keep saved activations in pinned host memory
/// under the budget ([`kiln_compiler::remat::HostOffload`]) before it
/// recomputes. CUDA only: on the CPU plugin a step compiled under a budget
/// with this on fails with the compiler's typed `Remat` error.
pub fn set_host_offload(on: bool) {
    set(|s| &mut s.host_offload, on);
}

/// Whether the remat pass moves what its plan still holds across the step's
/// peak to pinned host memory over kiln's own copies, beside recomputation
/// ([`kiln_compiler::remat::HostCopies`]; both plugins run the copies).
pub fn set_host_copies(on: bool) {
    set(|s| &mut s.host_copies, on);
}

/// Whether this thread's steps run a column sum and the elementwise work
/// around it as kiln's own Triton kernel on CUDA
/// (`kiln_compiler::LowerOptions::loop_kernels`, `docs/memory.md`, "Loop
/// kernels of kiln's own"): `Some` decides; `None`, the default, leaves it to
/// `KILN_LOOP_KERNELS` (on unless it says off).
pub fn set_loop_kernels(on: Option<bool>) {
    set(|s| &mut s.loop_kernels, on);
}

/// Sets one of this thread's settings, clearing its compile caches when the
/// value changes (they hold programs built under the old one).
fn set<T: Copy + PartialEq>(field: impl FnOnce(&mut Settings) -> &mut T, value: T) {
    if settings::with(|s| std::mem::replace(field(s), value)) != value {
        clear_compile_cache();
    }
}
