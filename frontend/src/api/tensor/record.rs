//! Operands into the trace and ops out of it: [`Tensor::value`] binds a
//! tensor into the step being recorded (ready data becomes a parameter of the
//! step), [`record`] adds an op and returns the pending tensor for its first
//! output.
//!
//! Invariant: a ready tensor read by a step is bound once, however often it is
//! read (`core::trace`), and a tensor pending in another trace is refused as
//! stale, naming the op.

use kiln_compiler::ir::{NodeId, Op, ValueId};

use crate::core::error::Result;
use crate::core::tensor::Tensor;
use crate::engine::context;

/// Records `op` into the thread's trace; the pending tensor of its first output.
pub(crate) fn record(op: Op) -> Result<Tensor> {
    context::with(|c| c.push(op)).map(Tensor::wrap)
}

impl Tensor {
    /// Id of this tensor's value in the current trace (binding ready data as a
    /// parameter).
    pub(crate) fn value(&self, op: &'static str) -> Result<ValueId> {
        context::with(|c| c.value_of(op, &self.inner))
    }

    /// The values of `ts` in the current trace, in order (see [`Tensor::value`]).
    pub(super) fn values<const N: usize>(op: &'static str, ts: [&Tensor; N]) -> Result<[ValueId; N]> {
        context::with(|c| {
            let mut out = [ValueId::from(NodeId::from_index(0)); N];
            for (o, t) in out.iter_mut().zip(ts) {
                *o = c.value_of(op, &t.inner)?;
            }
            Ok(out)
        })
    }
}
