//! Pointing a tensor handle (and all its clones) at another value:
//! [`Tensor::assign`], and the snapshot of a value that later assigns do not
//! move.
//!
//! Invariants:
//! - Only a value of the same type is assigned; the old data, if nothing else
//!   holds it, is donated to the step that computes the new value.
//! - An assign inside a lowering or a captured step's trace is logged first
//!   (`engine::undo_assigns`), so it can be undone.
//! - Under a mesh, a ready value in another layout comes back through the
//!   host, so every handle on a buffer agrees on its layout.

use crate::core::error::{FrontendError, Result};
use crate::core::storage::State;
use crate::core::tensor::Tensor;
use crate::engine::context;

impl Tensor {
    /// Makes this handle (and its clones) refer to `value` from now on. The
    /// old data, if nothing else holds it, is donated to the step that computes
    /// `value`. Types must match.
    pub fn assign(&self, value: &Tensor) -> Result<()> {
        if value.ty() != self.ty() {
            return Err(FrontendError::TypeMismatch {
                op: "assign",
                what: "the assigned value".into(),
                expected: self.ty().clone().into(),
                got: value.ty().clone().into(),
            });
        }
        let new_state = match &*value.inner.state.borrow() {
            State::Ready(s) => State::Ready(s.clone()),
            State::Pending { epoch, value } => State::Pending { epoch: *epoch, value: *value },
        };
        // Under a mesh, buffers in another layout come back through the host.
        let new_state = match new_state {
            State::Ready(s) => State::Ready(crate::engine::partition::relayout(&value.inner, &self.inner, s)?),
            pending @ State::Pending { .. } => pending,
        };
        let pending = matches!(new_state, State::Pending { .. });
        crate::engine::undo_assigns::before_assign(&self.inner);
        *self.inner.state.borrow_mut() = new_state;
        self.inner.bound.set(None);
        if pending {
            context::with(|c| c.track(&self.inner));
        }
        Ok(())
    }

    /// A new handle on this tensor's current value in the step being recorded
    /// (binding ready data as a parameter of the step), which later `assign`s
    /// to `self` do not move: the "before" of an update that may be undone.
    /// Drop it before `mark_step`, or the step also outputs that value.
    pub(crate) fn snapshot(&self) -> Result<Tensor> {
        let v = self.value("snapshot")?;
        Ok(Tensor::wrap(context::with(|c| c.pending(v))))
    }
}
