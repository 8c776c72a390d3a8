//! Which step is the parameters' init program: a step cut inside
//! [`as_param_init`] is reported as the init's (`engine::compile` names it so
//! when a memory limit is not met, and says nothing of a share of the
//! activation memory, which means nothing for a program that keeps no values
//! for a backward).
//!
//! Invariant: the mark is set only while the closure runs, and the mark from
//! before is restored when it returns or unwinds, so marks nest.

use std::cell::Cell;

thread_local! {
    static PARAM_INIT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `step` (a `mark_step`) as the parameters' init program
/// ([`crate::nn::ParamStore::materialize`]): the budget's remat pass still
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
