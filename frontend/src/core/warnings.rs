//! kiln's warnings to the user: a recompile, a forced sync, a run of
//! recompiles, a captured step that cannot be replayed, donation forced on
//! with the XLA CPU plugin, an attention left plain. They reach the user without any setup.
//!
//! Every warning goes to `tracing` (as a `WARN` event, at its call site). When no subscriber
//! listens for warnings (a library user who installed none), the first
//! warning of each kind is also printed on stderr, once per process, with a
//! note saying how to silence it; later ones of that kind are only counted in
//! [`crate::metrics`].
//!
//! Invariants:
//! - At most one stderr line per [`Warning`] kind per process.
//! - `KILN_WARNINGS=0` (read once) or [`set_enabled`]`(false)` silences the
//!   stderr lines; `tracing` still gets every event.
//! - A program with a subscriber that shows warnings (the `kiln` CLI) sees each
//!   warning once, through the subscriber, never twice.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::OnceLock;

/// The kinds of warning kiln gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Warning {
    /// A step needed a new program that resembles an earlier one (a shape or
    /// constant changed).
    Recompile,
    /// Reading a pending tensor forced the step to run early.
    ForcedSync,
    /// Several steps in a row each needed a new program.
    RecompileStreak,
    /// A captured step (`kiln::compile_step`) cannot be replayed, so it is
    /// traced on every call.
    CaptureUnreplayable,
    /// `KILN_DONATE=1` on the XLA CPU plugin, which has computed wrong values
    /// on donated buffers (`docs/donation.md`).
    DonationOnCpu,
    /// `grad` found something that looks like a composite (an attention's
    /// softmax feeding its product) but left it plain, with the reason
    /// (`docs/composites.md`).
    CompositeMissed,
}

impl Warning {
    const ALL: [Warning; 6] = [
        Warning::Recompile,
        Warning::ForcedSync,
        Warning::RecompileStreak,
        Warning::CaptureUnreplayable,
        Warning::DonationOnCpu,
        Warning::CompositeMissed,
    ];

    fn bit(self) -> u8 {
        match self {
            Warning::Recompile => 1,
            Warning::ForcedSync => 2,
            Warning::RecompileStreak => 4,
            Warning::CaptureUnreplayable => 8,
            Warning::DonationOnCpu => 16,
            Warning::CompositeMissed => 32,
        }
    }

    /// The kind's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Warning::Recompile => "recompile",
            Warning::ForcedSync => "forced sync",
            Warning::RecompileStreak => "recompile streak",
            Warning::CaptureUnreplayable => "captured step traced on every call",
            Warning::DonationOnCpu => "donation on the XLA CPU plugin",
            Warning::CompositeMissed => "composite left plain",
        }
    }
}

/// Kinds already printed on stderr (bits of [`Warning::bit`]).
static SHOWN: AtomicU8 = AtomicU8::new(0);
/// `None` until set or read from the environment.
static ENABLED: OnceLock<AtomicBool> = OnceLock::new();

fn enabled_flag() -> &'static AtomicBool {
    // A value that is not a boolean is reported by [`check_env`] (at the
    // first step); until then it leaves the warnings on.
    ENABLED.get_or_init(|| AtomicBool::new(kiln_runtime::env::bool_var(ENV_WARNINGS).ok().flatten().unwrap_or(true)))
}

/// The variable that turns the stderr lines off (`KILN_WARNINGS=0`): a
/// boolean ([`kiln_runtime::env::parse_bool`]'s spellings).
pub const ENV_WARNINGS: &str = "KILN_WARNINGS";

/// Refuses a `KILN_WARNINGS` that is not a boolean (`KILN_WARNINGS=abc` is
/// an error, as every other bad value is, not silently "on"). Called where a
/// run's settings are first read (the executor's plan).
pub fn check_env() -> crate::core::error::Result<()> {
    kiln_runtime::env::bool_var(ENV_WARNINGS)?;
    Ok(())
}

/// Turns the stderr lines on or off for this process (the environment's
/// `KILN_WARNINGS=0` sets the initial value to off).
pub fn set_enabled(on: bool) {
    enabled_flag().store(on, Ordering::Relaxed);
}

/// Whether warnings may be printed on stderr.
pub fn enabled() -> bool {
    enabled_flag().load(Ordering::Relaxed)
}

/// Allows each kind to be printed once more (for tests).
pub fn reset_shown() {
    SHOWN.store(0, Ordering::Relaxed);
}

/// Prints warning `kind` on stderr when nothing else will show it: called
/// beside the `tracing::warn!` of the same warning. `message` is built only
/// when printed.
pub(crate) fn show_once(kind: Warning, message: impl FnOnce() -> String) {
    if tracing::enabled!(tracing::Level::WARN) || !enabled() {
        return;
    }
    let bit = kind.bit();
    if SHOWN.fetch_or(bit, Ordering::Relaxed) & bit != 0 {
        return;
    }
    eprintln!(
        "kiln warning ({}): {}\n  (shown once per kind; KILN_WARNINGS=0 or kiln::warnings::set_enabled(false) silences it)",
        kind.name(),
        message()
    );
}

/// Every kind, for documentation and tests.
pub fn kinds() -> &'static [Warning] {
    &Warning::ALL
}
