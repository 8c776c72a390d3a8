//! Where a tensor's value is: the state every lazy tensor handle shares
//! ([`Inner`]) and the storage of a ready value ([`Storage`]): host data, one
//! host value per replica, or one device buffer per replica together with the
//! step that produced them.
//!
//! Invariants:
//! - A tensor is either `Ready` (with its storage) or `Pending` in exactly one
//!   trace, named by that trace's epoch (`core::trace`).
//! - Tensor ids grow with creation order and are never reused in a process:
//!   a tensor with a smaller id existed before ([`next_tensor_id`]).
//! - A device value keeps the [`StepRun`] of the asynchronous step that
//!   produced it, so that a read waits for that step and reports its failure
//!   naming it (`engine::executor`); uploads have none.
//! - Storage is shared, never copied: clones of a storage are handles on the
//!   same literal or buffers (counted by `Rc`/`Arc`, which is how a step
//!   knows that a parameter's buffer can be donated).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kiln_compiler::ir::{Literal, TensorType, ValueId};
use kiln_runtime::{Buffer, Completion};

use crate::core::error::{FrontendError, Result};
use crate::core::mesh::Sharding;

static NEXT_TENSOR: AtomicU64 = AtomicU64::new(1);

/// The id the next tensor will get: tensors with a smaller id existed before.
pub(crate) fn next_tensor_id() -> u64 {
    NEXT_TENSOR.load(Ordering::Relaxed)
}

/// Where a ready tensor's data lives.
#[derive(Clone)]
pub(crate) enum Storage {
    /// One host value, the same on every replica.
    Host(Arc<Literal>),
    /// One host value per replica, in replica order (data shards, the
    /// per-replica generator state).
    HostShards(Arc<Vec<Literal>>),
    /// One device buffer per replica, in replica order.
    Device(Rc<DeviceValue>),
}

impl Storage {
    /// Number of replicas the storage holds values for (`None`: the same
    /// value serves any number).
    pub fn replicas(&self) -> Option<usize> {
        match self {
            Storage::Host(_) => None,
            Storage::HostShards(s) => Some(s.len()),
            Storage::Device(d) => Some(d.0.len()),
        }
    }
}

pub(crate) enum State {
    Ready(Storage),
    Pending { epoch: u64, value: ValueId },
}

pub(crate) struct Inner {
    pub id: u64,
    pub ty: TensorType,
    pub state: RefCell<State>,
    /// `(epoch, parameter value)` when this ready tensor is a parameter of the
    /// trace with that epoch.
    pub bound: Cell<Option<(u64, ValueId)>>,
    /// A name for messages (recompile explanations): parameters get theirs
    /// from the `ParamStore`, data batches from the loader.
    pub name: RefCell<Option<Rc<str>>>,
    /// Its layout over the mesh (`None`: replicated); see `core::mesh`.
    pub sharding: RefCell<Option<Sharding>>,
}

impl Inner {
    pub fn new(ty: TensorType, state: State) -> Rc<Inner> {
        Rc::new(Inner {
            id: NEXT_TENSOR.fetch_add(1, Ordering::Relaxed),
            ty,
            state: RefCell::new(state),
            bound: Cell::new(None),
            name: RefCell::new(None),
            sharding: RefCell::new(None),
        })
    }
}

/// A value on the devices: one buffer per replica, replica `r`'s on the
/// device that runs replica `r`, and the step that produced it when that step
/// ran asynchronously (`None` for uploads).
pub(crate) struct DeviceValue(pub Vec<Buffer>, pub Option<Rc<StepRun>>);

/// What runs when a step's results are known (`engine::run::on_step_complete`).
pub(crate) type Hook = Box<dyn FnOnce() -> Result<()>>;

/// One enqueued step.
pub(crate) struct StepRun {
    /// The step's number (`metrics().steps` when it was cut; 1-based).
    pub step: u64,
    /// The run's events until its outcome is known.
    pub done: RefCell<Option<Completion>>,
    /// Hooks registered while the step was recorded.
    pub hooks: RefCell<Vec<Hook>>,
}

impl StepRun {
    /// The error a failure of this step is reported as.
    pub fn failed(&self, cause: impl std::fmt::Display) -> FrontendError {
        FrontendError::StepFailed { step: self.step, reason: cause.to_string() }
    }
}
