//! Gradients of tensors: the tensor-level face of [`crate::api::autodiff`].
//!
//! The backward ops go into the same trace as the forward, so forward, backward
//! and the optimizer update compile as one program.
//!
//! Invariants:
//! - The composite rewrite `grad` applies first is folded into the trace's
//!   running hash, so a rewritten trace never shares a key with the plain one.
//! - Asking for the gradient of an integer tensor is an error, not zeros.
//! - The backward's reads of forward values stay on the step's trace until it
//!   is cut (memory planning reads them).

use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;
use crate::engine::context;

/// `d loss / d wrt[i]` for each `i`; `loss` must be a floating scalar and
/// every `wrt` floating point (an integer tensor has no gradient: asking for
/// one is an error, not zeros).
pub fn grad(loss: &Tensor, wrt: &[Tensor]) -> Result<Vec<Tensor>> {
    if let Some((i, t)) = wrt.iter().enumerate().find(|(_, t)| !t.dtype().is_float()) {
        return Err(FrontendError::NoGradient { index: i, ty: t.ty().clone() });
    }
    let l = loss.value("grad")?;
    let ws = wrt.iter().map(|t| t.value("grad")).collect::<Result<Vec<_>>>()?;
    let opts = crate::api::autodiff::fuse_options();
    let grads = context::with(|c| {
        // The composite rewrite `autodiff::grad` would do, done here so that the
        // trace's running hash hears of it.
        let fused = crate::api::autodiff::fuse_in(c, opts)?;
        let info = crate::api::autodiff::differentiate(&mut c.trace.graph, l, &ws)?;
        c.trace.backward_reads.extend(info.reads);
        let grads: Vec<Tensor> = info.grads.into_iter().map(|v| Tensor::wrap(c.pending(v))).collect();
        Ok::<_, FrontendError>((grads, fused.missed))
    })?;
    let (grads, missed) = grads;
    crate::api::autodiff::warn_missed(&missed);
    Ok(grads)
}
