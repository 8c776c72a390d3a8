//! `Tensor`: the lazy tensor handle, a shared reference to a tensor's state
//! (`core::storage::Inner`), and what can be asked of it without recording or
//! reading anything: its type, whether it is pending, its name.
//!
//! The ops that record into the step live in `api::tensor`; the handle is
//! defined here, below the engine, because the engine's own signatures carry
//! tensors (a captured step's inputs and outputs, a lowering's outputs,
//! replica shards, device checks).
//!
//! Invariants:
//! - Cloning a `Tensor` clones the handle, never the value: `assign` through
//!   one clone is seen by all, which is how parameters and optimizer state are
//!   updated in place (and their old buffers donated).
//! - Nothing here records an op, runs a step or touches a device.

use std::fmt;
use std::rc::Rc;

use kiln_compiler::ir::{DType, Shape, TensorType, ValueId};

use crate::core::storage::{Inner, State, Storage};

/// A lazy handle on a value of the step being recorded, or on data that a
/// finished step left on the device (or host).
#[derive(Clone)]
pub struct Tensor {
    pub(crate) inner: Rc<Inner>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &*self.inner.state.borrow() {
            State::Ready(Storage::Host(_)) => "host".to_string(),
            State::Ready(Storage::HostShards(s)) => format!("host, {} shards", s.len()),
            State::Ready(Storage::Device(d)) if d.0.len() == 1 => "device".to_string(),
            State::Ready(Storage::Device(d)) => format!("device, {} replicas", d.0.len()),
            State::Pending { value, .. } => format!("pending {value}"),
        };
        write!(f, "Tensor({}, {state})", self.inner.ty)
    }
}

impl Tensor {
    pub(crate) fn wrap(inner: Rc<Inner>) -> Tensor {
        Tensor { inner }
    }

    pub fn ty(&self) -> &TensorType {
        &self.inner.ty
    }

    pub fn shape(&self) -> &Shape {
        &self.inner.ty.shape
    }

    pub fn dims(&self) -> &[usize] {
        &self.inner.ty.shape.0
    }

    pub fn rank(&self) -> usize {
        self.inner.ty.shape.rank()
    }

    pub fn dtype(&self) -> DType {
        self.inner.ty.dtype
    }

    pub fn elem_count(&self) -> usize {
        self.inner.ty.shape.num_elements()
    }

    /// Whether the value still waits for `mark_step`.
    pub fn is_pending(&self) -> bool {
        matches!(&*self.inner.state.borrow(), State::Pending { .. })
    }

    /// The trace value a pending tensor stands for (its epoch and id), to
    /// tell whether it was reassigned since (`ParamStore::materialize`).
    pub(crate) fn pending_value(&self) -> Option<(u64, ValueId)> {
        match &*self.inner.state.borrow() {
            State::Pending { epoch, value } => Some((*epoch, *value)),
            State::Ready(_) => None,
        }
    }

    /// Whether the data lives on the device (after a step produced or read it).
    pub fn is_on_device(&self) -> bool {
        matches!(&*self.inner.state.borrow(), State::Ready(Storage::Device(_)))
    }

    /// Names this tensor in kiln's messages (a recompile explanation says
    /// "input 'images' changed ..."). Returns the tensor, for chaining.
    pub fn with_name(self, name: &str) -> Tensor {
        *self.inner.name.borrow_mut() = Some(Rc::from(name));
        self
    }

    /// The name given by [`Tensor::with_name`] (or a `ParamStore`).
    pub fn name(&self) -> Option<String> {
        self.inner.name.borrow().as_deref().map(str::to_string)
    }

    /// Same underlying tensor (handles compare by identity).
    pub fn same(&self, other: &Tensor) -> bool {
        Rc::ptr_eq(&self.inner, &other.inner)
    }
}
