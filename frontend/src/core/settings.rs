//! The step memory budget: `set_memory_limit(Some(bytes))` makes every later
//! step's program go through the compiler's rematerialization pass
//! (`compiler::memory`), which recomputes activations until the predicted peak
//! of the step fits.
//!
//! Invariant: a program in the compile caches was built under the limit that
//! is set now (changing the limit clears this thread's caches; the disk cache
//! keys on the optimized program, which the limit changes).

use std::cell::Cell;

thread_local! {
    static LIMIT: Cell<Option<u64>> = const { Cell::new(None) };
    static ACTIVATION: Cell<Option<f64>> = const { Cell::new(None) };
    static HOST_OFFLOAD: Cell<bool> = const { Cell::new(false) };
    static HOST_COPIES: Cell<bool> = const { Cell::new(false) };
    static LOOP_KERNELS: Cell<Option<bool>> = const { Cell::new(None) };
    static PARAM_INIT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `step` (a `mark_step`) as the parameters' init program
/// ([`crate::api::nn::ParamStore::materialize`]): the budget's remat pass still
/// runs on it, and a limit it does not meet is reported as the init's. Under
/// a percentage of the activation memory it is not reported at all, as no
/// program that keeps nothing for a backward is
/// (`RematSummary::keeps_values`).
pub(crate) fn as_param_init<R>(step: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            PARAM_INIT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(PARAM_INIT.with(|c| c.replace(true)));
    step()
}

/// Whether the step being cut is the parameters' init ([`as_param_init`]).
pub(crate) fn in_param_init() -> bool {
    PARAM_INIT.with(Cell::get)
}

/// Sets this thread's step memory budget in bytes (`None`: no remat pass).
/// Set before the CUDA client opens, it also has the client reserve its
/// memory pool at start unless `KILN_GPU_PREALLOCATE` says otherwise: a plan
/// sized to the pool needs it whole (`Executor::client`).
pub fn set_memory_limit(bytes: Option<u64>) {
    set(&LIMIT, bytes);
}

/// This thread's step memory budget.
pub fn memory_limit() -> Option<u64> {
    LIMIT.with(Cell::get)
}

/// Sets this thread's step memory budget as a fraction in (0, 1] of each
/// step's activation memory (the unplanned predicted peak less `1 - fraction`
/// of its predicted temporaries, `docs/memory.md`); when set it is used
/// instead of [`set_memory_limit`]'s bytes. `None`: no fraction.
pub fn set_activation_budget(fraction: Option<f64>) -> crate::core::error::Result<()> {
    if let Some(f) = fraction {
        if !(f > 0.0 && f <= 1.0) {
            return Err(crate::core::error::FrontendError::InvalidArgument {
                op: "set_activation_budget",
                reason: format!("the fraction of activation memory must be in (0, 1], got {f}"),
            });
        }
    }
    set(&ACTIVATION, fraction);
    Ok(())
}

/// This thread's activation budget (a fraction), if any.
pub fn activation_budget() -> Option<f64> {
    ACTIVATION.with(Cell::get)
}

/// Refuses this thread's byte limit under its mesh of more than one device.
/// A byte limit is per device, and under a mesh the step the remat pass plans
/// is the unpartitioned one (every device's shards together): how its values
/// split is XLA's partitioner's to decide, so the model's bytes are not one
/// device's. A share of the activation memory means the same on either side
/// of the partitioner, and so does 0 (the lowest peak). Checked at every
/// compile; callers may check earlier.
pub fn check_memory_limit_for_mesh() -> crate::core::error::Result<()> {
    if let (Some(bytes), None, Some(mesh)) = (
        memory_limit().filter(|&b| b > 0),
        activation_budget(),
        crate::engine::partition::active_mesh().filter(|m| m.size() > 1),
    ) {
        return Err(crate::core::error::FrontendError::InvalidArgument {
            op: "set_memory_limit",
            reason: format!(
                "a limit of {bytes} B is one device's memory, and under the mesh {mesh} ({} devices) the remat pass \
                 plans the unpartitioned step, whose bytes are all devices' together: set an activation budget \
                 (kiln::set_activation_budget, a share of the step's activation memory) instead",
                mesh.size()
            ),
        });
    }
    Ok(())
}

/// Whether the remat pass may keep saved activations in pinned host memory
/// under the budget ([`kiln_compiler::memory::HostOffload`]) before it
/// recomputes. CUDA only: on the CPU plugin a step compiled under a budget
/// with this on fails with the compiler's typed `Remat` error.
pub fn set_host_offload(on: bool) {
    set(&HOST_OFFLOAD, on);
}

/// Whether host offload is on for this thread's steps.
pub fn host_offload() -> bool {
    HOST_OFFLOAD.with(Cell::get)
}

/// Whether the remat pass moves what its plan still holds across the step's
/// peak to pinned host memory over kiln's own copies, beside recomputation
/// ([`kiln_compiler::memory::HostCopies`]; both plugins run the copies).
pub fn set_host_copies(on: bool) {
    set(&HOST_COPIES, on);
}

/// Whether kiln's host copies are on for this thread's steps.
pub fn host_copies() -> bool {
    HOST_COPIES.with(Cell::get)
}

/// Whether this thread's steps run a column sum and the elementwise work
/// around it as kiln's own Triton kernel on CUDA
/// (`kiln_compiler::LowerOptions::loop_kernels`, `docs/memory.md`, "Loop
/// kernels of kiln's own"): `Some` decides; `None`, the default, leaves it to
/// `KILN_LOOP_KERNELS` (on unless it says off).
pub fn set_loop_kernels(on: Option<bool>) {
    set(&LOOP_KERNELS, on);
}

/// Whether this thread's steps run loop kernels ([`set_loop_kernels`], else
/// `KILN_LOOP_KERNELS`, else on). An unreadable variable is an error.
pub fn loop_kernels() -> crate::core::error::Result<bool> {
    match LOOP_KERNELS.with(Cell::get) {
        Some(on) => Ok(on),
        None => Ok(kiln_runtime::env::bool_var("KILN_LOOP_KERNELS")?.unwrap_or(true)),
    }
}

/// Sets one of this thread's settings, clearing its compile caches when the
/// value changes (they hold programs built under the old one).
fn set<T: Copy + PartialEq + 'static>(setting: &'static std::thread::LocalKey<Cell<T>>, value: T) {
    if setting.with(|c| c.replace(value)) != value {
        crate::engine::context::clear_compile_cache();
    }
}

/// The pruned step graph whose outputs are `f`'s tensors, recorded apart from
/// the current step and never run (what `kiln profile --max-batch` sizes).
/// Where the step checks values on the device ([`crate::engine::device_checks`]), the
/// flag output `mark_step` would add comes last.
///
/// A tensor that `f` reads and then assigns over (an optimizer's update of a
/// parameter) and returns donates its buffer to that output, as a step does on
/// a backend that donates (every one but the XLA CPU plugin): the peak model
/// bills the new value to the old one's buffer.
pub fn capture_graph(
    f: impl FnOnce() -> crate::core::error::Result<Vec<crate::api::tensor::Tensor>>,
) -> crate::core::error::Result<kiln_compiler::ir::Graph> {
    use crate::engine::context::{self, State, Trace};
    let outer = context::with(|c| std::mem::replace(&mut c.trace, Trace::new()));
    // The flag output of the step's device checks, last, as `mark_step` adds it.
    let result = f().and_then(|mut outputs| {
        outputs.extend(crate::engine::device_checks::seal()?.map(|s| s.flags().clone()));
        Ok(outputs)
    });
    let inner = context::with(|c| std::mem::replace(&mut c.trace, outer));
    let outputs = result?;
    let mut graph = inner.graph;
    let mut values = Vec::with_capacity(outputs.len());
    for t in &outputs {
        match &*t.inner.state.borrow() {
            State::Pending { epoch, value } if *epoch == inner.epoch => values.push(*value),
            State::Pending { .. } | State::Ready(_) => {
                return Err(crate::core::error::FrontendError::StaleTensor { op: "capture_graph" })
            }
        }
    }
    graph.set_outputs(values)?;
    for (p, b) in inner.bindings.iter().enumerate() {
        let Some(out) = outputs.iter().position(|t| t.inner.id == b.tensor_id) else { continue };
        let alias = kiln_compiler::ir::Alias { param: p as u32, output: out as u32 };
        if graph.ty(graph.outputs()[out]) == &graph.node(graph.params()[p]).outputs[0] {
            graph.add_alias(alias)?;
        }
    }
    Ok(kiln_compiler::passes::eliminate_dead_code(&graph)?.graph)
}
