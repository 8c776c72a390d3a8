//! This thread's settings: the switches that decide how later steps are
//! recorded, planned and compiled, in one struct ([`Settings`]) per thread.
//!
//! What each is for:
//! - the step memory budget (`memory_limit_bytes`, or `activation_fraction`
//!   of each step's activation memory): every later step's program goes
//!   through the compiler's rematerialization pass (`compiler::memory`), which
//!   recomputes activations until the predicted peak of the step fits;
//! - what that pass may also do with host memory: keep saved activations
//!   there (`host_offload`), or move what its plan holds across the peak
//!   there over kiln's own copies (`host_copies`);
//! - how a step is lowered on CUDA: a column sum and the elementwise work
//!   around it as kiln's own kernel (`loop_kernels`);
//! - what a step checks on the device (`device_checks`, `detect_anomaly`,
//!   `engine::device_checks`);
//! - how ops are recorded: the autocast scope open now (`autocast`,
//!   `amp::autocast`);
//! - where a step runs: the device mesh (`mesh`) and the shard policy the
//!   built-in models apply under it (`shard_policy`).
//!
//! Invariants:
//! - Settings are per thread, as the lazy-tensor context is: a setter
//!   affects only the calling thread's later steps.
//! - `KILN_DEVICE_CHECKS` and `KILN_DETECT_ANOMALY` are read once per thread,
//!   on first use; a setter overrides them. `KILN_LOOP_KERNELS` is read at
//!   each use until a setter decides.
//! - The settings that change what a step compiles to (the memory budget,
//!   host offload, host copies, loop kernels) are set through
//!   `engine::compile_settings`, which clears this thread's compiled programs
//!   when a value changes: a program in the compile caches was built under the
//!   settings set now (the disk cache keys on the optimized program, which
//!   they change).
//! - Reading a setting never records, compiles or touches a device, and
//!   [`with`] is never held across a call that reads the settings again.

use std::cell::RefCell;

use kiln_compiler::ir::DType;

use crate::core::error::{FrontendError, Result};
use crate::core::mesh::{Mesh, PolicyKind};

/// This thread's switches (see the module docs for what each is for).
#[derive(Clone, Debug, Default)]
pub(crate) struct Settings {
    /// The step memory budget in bytes (`set_memory_limit`); `None`: no remat
    /// pass.
    pub memory_limit_bytes: Option<u64>,
    /// The budget as a fraction in (0, 1] of each step's activation memory
    /// (`set_activation_budget`); when set it is used instead of the bytes.
    pub activation_fraction: Option<f64>,
    /// Whether the remat pass may keep saved activations in pinned host
    /// memory under the budget before it recomputes (`set_host_offload`).
    pub host_offload: bool,
    /// Whether the remat pass moves what its plan holds across the step's
    /// peak to pinned host memory over kiln's own copies (`set_host_copies`).
    pub host_copies: bool,
    /// Whether steps run loop kernels on CUDA (`set_loop_kernels`); `None`:
    /// `KILN_LOOP_KERNELS` decides.
    pub loop_kernels: Option<bool>,
    /// Device-side range checks of labels and indices (`set_device_checks`);
    /// `None`: `KILN_DEVICE_CHECKS` not read yet.
    pub device_checks: Option<bool>,
    /// Anomaly mode (`set_detect_anomaly`); `None`: `KILN_DETECT_ANOMALY` not
    /// read yet.
    pub detect_anomaly: Option<bool>,
    /// The low-precision dtype of the innermost open autocast scope.
    pub autocast: Option<DType>,
    /// The device mesh steps are partitioned over (`shard::set_mesh`, or
    /// `KILN_MESH` when the replica plan is made); `None`: replicas only.
    pub mesh: Option<Mesh>,
    /// The policy the built-in models shard their parameters by under a mesh
    /// (`shard::set_policy`).
    pub shard_policy: Option<PolicyKind>,
}

thread_local! {
    static SETTINGS: RefCell<Settings> = RefCell::new(Settings::default());
}

/// Runs `f` with this thread's settings borrowed. `f` must not read the
/// settings again.
pub(crate) fn with<R>(f: impl FnOnce(&mut Settings) -> R) -> R {
    SETTINGS.with(|s| f(&mut s.borrow_mut()))
}

/// This thread's step memory budget.
pub fn memory_limit() -> Option<u64> {
    with(|s| s.memory_limit_bytes)
}

/// This thread's activation budget (a fraction), if any.
pub fn activation_budget() -> Option<f64> {
    with(|s| s.activation_fraction)
}

/// Refuses this thread's byte limit under its mesh of more than one device.
/// A byte limit is per device, and under a mesh the step the remat pass plans
/// is the unpartitioned one (every device's shards together): how its values
/// split is XLA's partitioner's to decide, so the model's bytes are not one
/// device's. A share of the activation memory means the same on either side
/// of the partitioner, and so does 0 (the lowest peak). Checked at every
/// compile; callers may check earlier.
pub fn check_memory_limit_for_mesh() -> Result<()> {
    if let (Some(bytes), None, Some(mesh)) =
        (memory_limit().filter(|&b| b > 0), activation_budget(), active_mesh().filter(|m| m.size() > 1))
    {
        return Err(FrontendError::InvalidArgument {
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

/// Whether host offload is on for this thread's steps.
pub fn host_offload() -> bool {
    with(|s| s.host_offload)
}

/// Whether kiln's host copies are on for this thread's steps.
pub fn host_copies() -> bool {
    with(|s| s.host_copies)
}

/// Whether this thread's steps run loop kernels ([`set_loop_kernels`], else
/// `KILN_LOOP_KERNELS`, else on). An unreadable variable is an error.
///
/// [`set_loop_kernels`]: crate::set_loop_kernels
pub fn loop_kernels() -> Result<bool> {
    match with(|s| s.loop_kernels) {
        Some(on) => Ok(on),
        None => Ok(kiln_runtime::env::bool_var("KILN_LOOP_KERNELS")?.unwrap_or(true)),
    }
}

/// Turns this thread's device-side range checks on or off (overrides
/// `KILN_DEVICE_CHECKS`).
pub fn set_device_checks(on: bool) {
    with(|s| s.device_checks = Some(on));
}

/// Whether this thread's steps check labels and indices on the device.
pub fn device_checks() -> Result<bool> {
    from_env_once(|s| &mut s.device_checks, "KILN_DEVICE_CHECKS", true)
}

/// Turns this thread's anomaly mode on or off (overrides `KILN_DETECT_ANOMALY`).
/// In anomaly mode every floating-point value a step computes is checked for
/// NaN and ±inf, and the first op (in recording order) whose output is not
/// finite is reported with the layer that recorded it. It is a debugging mode:
/// each checked value costs a few more ops and the step outputs a count per
/// value.
pub fn set_detect_anomaly(on: bool) {
    with(|s| s.detect_anomaly = Some(on));
}

/// Whether this thread runs in anomaly mode.
pub fn detect_anomaly() -> Result<bool> {
    from_env_once(|s| &mut s.detect_anomaly, "KILN_DETECT_ANOMALY", false)
}

/// A boolean setting: its value once set, else `var` (or `default` when
/// unset), read now and kept.
fn from_env_once(field: impl Fn(&mut Settings) -> &mut Option<bool>, var: &'static str, default: bool) -> Result<bool> {
    if let Some(v) = with(|s| *field(s)) {
        return Ok(v);
    }
    // The one boolean parser every kiln variable goes through.
    let v = kiln_runtime::env::bool_var(var)?.unwrap_or(default);
    with(|s| *field(s) = Some(v));
    Ok(v)
}

/// The low-precision dtype of the innermost open autocast scope, if any.
pub(crate) fn autocast_dtype() -> Option<DType> {
    with(|s| s.autocast)
}

/// The active mesh without reading the environment (the replica plan reads
/// `KILN_MESH` when it is made: `engine::partition::mesh`).
pub(crate) fn active_mesh() -> Option<Mesh> {
    with(|s| s.mesh.clone())
}
