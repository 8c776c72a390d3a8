//! What keeps [`crate::lower`] free of side effects: an undo log of the
//! tensors assigned while a lowering records.
//!
//! A lowering records a closure into a trace of its own and never runs it. A
//! closure that assigns (an optimizer step, a random draw advancing the
//! generator) points existing handles at values of that trace, which is
//! discarded afterwards: without the log, every parameter would be left stale.
//!
//! Invariants:
//! - While a lowering records, the first `assign` to each tensor saves the
//!   tensor's state (and its parameter binding) from before the lowering;
//!   later assigns to the same tensor save nothing.
//! - When the lowering ends (normally, by error or by unwinding), every saved
//!   tensor gets its old state back, so after `lower` every tensor reads as it
//!   did before. Tensors created inside the lowering are left stale: nothing
//!   outside the closure can hold them unless the closure leaked them.
//! - Lowerings nest: each has its own log, restored innermost first.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kiln_compiler::ir::ValueId;

use crate::context::{Inner, State};

struct Saved {
    tensor: Rc<Inner>,
    state: State,
    bound: Option<(u64, ValueId)>,
}

thread_local! {
    /// One log per lowering in progress, innermost last.
    static LOGS: RefCell<Vec<Vec<Saved>>> = const { RefCell::new(Vec::new()) };
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

fn copy(state: &State) -> State {
    match state {
        State::Ready(s) => State::Ready(s.clone()),
        State::Pending { epoch, value } => State::Pending { epoch: *epoch, value: *value },
    }
}

/// Called by `Tensor::assign` before it replaces `t`'s state.
pub(crate) fn before_assign(t: &Rc<Inner>) {
    if DEPTH.with(Cell::get) == 0 {
        return;
    }
    LOGS.with(|logs| {
        let mut logs = logs.borrow_mut();
        let log = logs.last_mut().expect("a log per lowering in progress");
        if !log.iter().any(|s| Rc::ptr_eq(&s.tensor, t)) {
            log.push(Saved { tensor: t.clone(), state: copy(&t.state.borrow()), bound: t.bound.get() });
        }
    });
}

/// Open while a lowering records; dropping it restores every tensor the
/// lowering assigned.
pub(crate) struct UndoAssigns(());

impl UndoAssigns {
    pub fn begin() -> UndoAssigns {
        LOGS.with(|l| l.borrow_mut().push(Vec::new()));
        DEPTH.with(|d| d.set(d.get() + 1));
        UndoAssigns(())
    }
}

impl Drop for UndoAssigns {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get() - 1));
        let log = LOGS.with(|l| l.borrow_mut().pop()).unwrap_or_default();
        // Restored in reverse, so the oldest saved state wins (each tensor is
        // saved once anyway).
        for s in log.into_iter().rev() {
            *s.tensor.state.borrow_mut() = s.state;
            s.tensor.bound.set(s.bound);
        }
    }
}
