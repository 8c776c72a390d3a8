//! The trace being recorded: the graph of the step that will compute the
//! pending tensors, the ready data it reads (its parameters, [`Binding`]s) and
//! the tensors it will hand its outputs to.
//!
//! Invariants:
//! - A tensor is either `Ready` (host or device storage) or `Pending` in exactly
//!   one trace, named by that trace's epoch (`core::storage`). Epochs are unique
//!   per process, so a tensor left pending by a trace that ended without running
//!   (a `lower`) is recognised as stale, never confused with a value of a later
//!   trace.
//! - A ready tensor read by a trace becomes one parameter of it, however often
//!   it is read (memoised on the tensor by epoch).
//! - Insertion order everywhere: live tensors and parameters are kept in `Vec`s,
//!   so the outputs and parameters of a step, and with them its program, are
//!   deterministic.
//! - Recording never touches a device or the program cache: a trace is plain
//!   host data until `mark_step` hands it to the executor.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_compiler::ir::{DType, Graph, Literal, NodeId, Op, Shape, ValueId};

use crate::core::error::{FrontendError, Result};
use crate::core::metrics;
use crate::core::storage::{Inner, State, Storage};

static NEXT_EPOCH: AtomicU64 = AtomicU64::new(1);

/// One read of a forward value by a backward node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardRead {
    /// The forward value read.
    pub forward: ValueId,
    /// The backward node that reads it.
    pub user: NodeId,
}

/// A parameter of the trace and the data it will be fed.
pub(crate) struct Binding {
    pub tensor: Weak<Inner>,
    pub tensor_id: u64,
    pub storage: Storage,
}

/// One step being recorded.
pub(crate) struct Trace {
    pub epoch: u64,
    pub graph: Graph,
    pub bindings: Vec<Binding>,
    /// Tensors that were pending in this trace when created or assigned.
    pub live: Vec<Weak<Inner>>,
    /// Running hash of the nodes `..hashed` (ops, which carry their types'
    /// determinants), kept up to date while recording so a cache-hit step does
    /// not rehash the whole trace.
    hasher: DefaultHasher,
    hashed: usize,
    /// Scalar constants broadcast to a shape, by (value bits, dtype, shape):
    /// recorded once per trace however often `x * 2.0` appears. Only looked up.
    pub constants: HashMap<(u64, DType, Shape), ValueId>,
    /// Every read of a forward value by a backward node made by `grad` in this
    /// step (autodiff's map, for memory planning).
    pub backward_reads: Vec<BackwardRead>,
    /// `live` is compacted (dead handles dropped) when it reaches this length,
    /// so dead tensors are released while recording, amortised O(1) per op.
    compact_at: usize,
}

impl Trace {
    pub fn new() -> Trace {
        Trace {
            epoch: NEXT_EPOCH.fetch_add(1, Ordering::Relaxed),
            graph: Graph::new(),
            bindings: Vec::new(),
            live: Vec::new(),
            hasher: DefaultHasher::new(),
            hashed: 0,
            backward_reads: Vec::new(),
            compact_at: 64,
            constants: HashMap::new(),
        }
    }

    /// Folds nodes recorded since the last call into the running hash.
    pub fn catch_up_hash(&mut self) {
        // Index directly: `nodes().skip(n)` would walk the first n nodes again.
        for i in self.hashed..self.graph.len() {
            self.graph.node(NodeId::from_index(i)).op.hash(&mut self.hasher);
        }
        self.hashed = self.graph.len();
    }

    /// Folds an in-place composite rewrite of already-hashed nodes into the
    /// running hash, so a rewritten trace never shares a key with the plain one.
    pub fn note_rewrite(&mut self, found: &[kiln_compiler::composite::Found]) {
        self.catch_up_hash();
        for f in found {
            f.node.hash(&mut self.hasher);
            f.op.hash(&mut self.hasher);
        }
    }

    /// Structural key of the trace as recorded: every node, the outputs and
    /// the aliases. Two traces with the same key prune and lower to the same
    /// program.
    pub fn raw_key(&mut self) -> u64 {
        self.catch_up_hash();
        let mut h = self.hasher.clone();
        self.graph.outputs().hash(&mut h);
        self.graph.aliases().hash(&mut h);
        h.finish()
    }
}

impl Trace {
    /// The value of `t` inside the current trace, binding it as a parameter if it
    /// is ready data.
    pub fn value_of(&mut self, op: &'static str, t: &Rc<Inner>) -> Result<ValueId> {
        let epoch = self.epoch;
        match &*t.state.borrow() {
            State::Pending { epoch: e, value } if *e == epoch => Ok(*value),
            State::Pending { .. } => Err(FrontendError::StaleTensor { op }),
            State::Ready(storage) => {
                if let Some((e, v)) = t.bound.get() {
                    if e == epoch {
                        return Ok(v);
                    }
                }
                let v = self.graph.parameter(t.ty.clone());
                self.bindings.push(Binding { tensor: Rc::downgrade(t), tensor_id: t.id, storage: storage.clone() });
                t.bound.set(Some((epoch, v)));
                Ok(v)
            }
        }
    }

    /// Records `op` and returns a pending tensor for its first output.
    pub fn push(&mut self, op: Op) -> Result<Rc<Inner>> {
        let id = self.graph.add(op)?;
        Ok(self.pending(ValueId::from(id)))
    }

    /// A new pending tensor for `value` of the current trace.
    pub fn pending(&mut self, value: ValueId) -> Rc<Inner> {
        metrics::update(|m| m.ops_recorded += 1);
        self.catch_up_hash();
        let ty = self.graph.ty(value).clone();
        let inner = Inner::new(ty, State::Pending { epoch: self.epoch, value });
        self.track(&inner);
        inner
    }

    /// A pending tensor holding `value` of `dtype` broadcast to `shape`,
    /// shared with earlier requests for the same constant in this trace.
    pub fn constant(&mut self, value: f64, dtype: DType, shape: &Shape) -> Result<Rc<Inner>> {
        let key = (value.to_bits(), dtype, shape.clone());
        let v = match self.constants.get(&key) {
            Some(&v) => v,
            None => {
                let c = self.graph.value(Op::Constant { literal: Literal::scalar(dtype, value) })?;
                let v = if shape.rank() == 0 {
                    c
                } else {
                    self.graph.value(Op::BroadcastInDim { input: c, shape: shape.clone(), dims: vec![] })?
                };
                self.constants.insert(key, v);
                v
            }
        };
        Ok(self.pending(v))
    }

    /// The elements of `v` when it is a constant of this trace (a literal,
    /// broadcast or reshaped), in no particular order: enough to ask whether
    /// it holds a value.
    pub fn constant_elements(&self, v: ValueId) -> Option<Vec<f64>> {
        match &self.graph.node(v.node).op {
            Op::Constant { literal } => Some(literal.to_f64s()),
            Op::BroadcastInDim { input, .. } | Op::Reshape { input, .. } => self.constant_elements(*input),
            _ => None,
        }
    }

    /// Remembers a pending tensor of the current trace.
    pub fn track(&mut self, inner: &Rc<Inner>) {
        let t = self;
        if t.live.len() >= t.compact_at {
            t.live.retain(|w| w.strong_count() > 0);
            t.compact_at = (2 * t.live.len()).max(64);
        }
        t.live.push(Rc::downgrade(inner));
    }
}
