//! Reading a tensor's values to the host: `to_vec`, `to_literal`,
//! `to_f64s`, `item`, and every replica's bytes. Each read is an explicit
//! sync, counted in the metrics.
//!
//! Invariants:
//! - A read waits only for the buffers it reads (`engine::run::download`);
//!   under a mesh it assembles the shards into the global value.
//! - Reading a pending value runs the step first (`mark_step`), counted as a
//!   forced sync and warned about once; on the eager backend the pending value
//!   is already computed and the step is not cut.
//! - A read never reinterprets bytes: asking for another dtype than the
//!   tensor's is an error.

use kiln_compiler::ir::Literal;

use crate::core::element::{self, Element};
use crate::core::error::{FrontendError, Result};
use crate::core::metrics;
use crate::core::storage::{State, Storage};
use crate::core::tensor::Tensor;
use crate::engine::context;
use crate::engine::executor::Backend;
use crate::engine::step;

impl Tensor {
    /// The values, row-major. A pending tensor forces the step to run first,
    /// which is counted in `metrics().forced_syncs`.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(FrontendError::ReadDType { tensor: self.dtype(), requested: T::DTYPE });
        }
        Ok(element::from_bytes(&self.to_bytes()?))
    }

    /// The values as a literal (host copy).
    pub fn to_literal(&self) -> Result<Literal> {
        Ok(Literal::from_bytes(self.ty().clone(), self.to_bytes()?)?)
    }

    /// Every element widened to f64, whatever the dtype.
    pub fn to_f64s(&self) -> Result<Vec<f64>> {
        Ok(self.to_literal()?.to_f64s())
    }

    /// The single value of a one-element tensor, as f64.
    pub fn item(&self) -> Result<f64> {
        if self.elem_count() != 1 {
            return Err(FrontendError::NotOneElement { op: "item", got: self.ty().clone() });
        }
        Ok(self.to_f64s()?[0])
    }

    /// Replica 0's bytes (every replica's for [`Tensor::replica_bytes`]).
    fn to_bytes(&self) -> Result<Vec<u8>> {
        Ok(self.read(Some(0))?.swap_remove(0))
    }

    /// Every replica's bytes, in replica order (one entry for a value that
    /// is the same on every replica and lives on the host).
    pub(crate) fn replica_bytes(&self) -> Result<Vec<Vec<u8>>> {
        self.read(None)
    }

    /// Reads replica `only` (or all): an explicit sync, counted.
    fn read(&self, only: Option<usize>) -> Result<Vec<Vec<u8>>> {
        // Eager: a pending value is already computed; reading it does not cut the step.
        if let Some(bytes) = context::with(|c| match c.exec.backend {
            Backend::Eager => crate::engine::eager::read_pending(&c.trace, &self.inner),
            Backend::Pjrt | Backend::Reference => Ok(None),
        })? {
            return Ok(vec![bytes]);
        }
        if self.is_pending() {
            metrics::update(|m| m.forced_syncs += 1);
            tracing::warn!(tensor = %self.ty(), "kiln: reading a pending tensor forces the step to run now");
            crate::core::warnings::show_once(crate::core::warnings::Warning::ForcedSync, || {
                format!("reading a pending {} forces the step to run now (read values after mark_step)", self.ty())
            });
            // The lazy read forcing the step: a pending value exists only once
            // its step has run, so the read runs that whole step now, with
            // every other pending tensor of it. It is the one read with a
            // step's effects; living with the ops in the API layer, it calls
            // down into the engine.
            step::mark_step()?;
        }
        metrics::update(|m| m.reads += 1);
        let storage = match &*self.inner.state.borrow() {
            State::Ready(s) => s.clone(),
            State::Pending { .. } => return Err(FrontendError::StaleTensor { op: "to_vec" }),
        };
        let pick = |n: usize| match only {
            Some(r) => r..r + 1,
            None => 0..n,
        };
        match storage {
            Storage::Host(lit) => Ok(vec![lit.bytes().to_vec()]),
            Storage::HostShards(shards) => Ok(shards[pick(shards.len())].iter().map(|l| l.bytes().to_vec()).collect()),
            Storage::Device(value) => match crate::engine::partition::read_device(&self.inner, &value)? {
                // Under a mesh the buffers are one value's shards: one value.
                Some(bytes) => Ok(vec![bytes]),
                None => crate::engine::run::download(&value, pick(value.0.len())),
            },
        }
    }
}
