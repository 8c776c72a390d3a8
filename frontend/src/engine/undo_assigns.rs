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
//! - A captured step's trace (`crate::engine::capture`) opens a log too, kept when
//!   its closure returns and restored when the closure fails, so a failed
//!   call leaves every tensor as it was ([`UndoAssigns::keep`]).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kiln_compiler::ir::ValueId;

use crate::core::storage::{Inner, State};

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

/// Whether the innermost open log holds `storage` (the saved state of a
/// tensor the lowering assigned): a reference that a step cut outside the
/// lowering would not have, so donation does not count it.
pub(crate) fn saved_holds(storage: &crate::core::storage::Storage) -> bool {
    use crate::core::storage::Storage;
    if DEPTH.with(Cell::get) == 0 {
        return false;
    }
    LOGS.with(|logs| {
        logs.borrow().last().is_some_and(|log| {
            log.iter().any(|s| match (&s.state, storage) {
                (State::Ready(Storage::Device(a)), Storage::Device(b)) => Rc::ptr_eq(a, b),
                (State::Ready(Storage::Host(a)), Storage::Host(b)) => std::sync::Arc::ptr_eq(a, b),
                (State::Ready(Storage::HostShards(a)), Storage::HostShards(b)) => std::sync::Arc::ptr_eq(a, b),
                _ => false,
            })
        })
    })
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

    /// Closes the log keeping every assignment made while it was open. Under
    /// an enclosing log, the states saved here move to it (where it has none
    /// of its own for the tensor), so the enclosing undo still restores them.
    pub fn keep(self) {
        std::mem::forget(self);
        DEPTH.with(|d| d.set(d.get() - 1));
        LOGS.with(|l| {
            let mut logs = l.borrow_mut();
            let log = logs.pop().unwrap_or_default();
            if let Some(outer) = logs.last_mut() {
                for s in log {
                    if !outer.iter().any(|o| Rc::ptr_eq(&o.tensor, &s.tensor)) {
                        outer.push(s);
                    }
                }
            }
        });
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

#[cfg(test)]
mod tests {
    use super::UndoAssigns;
    use crate::core::tensor::Tensor;

    fn t(v: f32) -> Tensor {
        Tensor::from_vec(vec![v, v + 1.0], [2]).unwrap()
    }

    #[test]
    fn a_kept_inner_log_is_still_undone_by_the_enclosing_one() {
        let (a, b) = (t(1.0), t(2.0));
        let outer = UndoAssigns::begin();
        a.assign(&t(10.0)).unwrap();
        let inner = UndoAssigns::begin();
        b.assign(&t(20.0)).unwrap();
        a.assign(&t(30.0)).unwrap();
        inner.keep();
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![20.0, 21.0], "kept while the outer log is open");
        drop(outer);
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0, 2.0], "a as before the outer log");
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![2.0, 3.0], "b, saved by the inner log, as before too");
    }

    #[test]
    fn a_dropped_log_restores_and_a_kept_one_does_not() {
        let a = t(1.0);
        let undo = UndoAssigns::begin();
        a.assign(&t(5.0)).unwrap();
        drop(undo);
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
        let keep = UndoAssigns::begin();
        a.assign(&t(7.0)).unwrap();
        keep.keep();
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![7.0, 8.0]);
    }
}
