//! Global-norm gradient clipping, recorded into the step.
//!
//! The norm is the 2-norm of all gradients taken together, accumulated in f32
//! whatever the gradients' dtype. When it exceeds `max_norm`, every gradient is
//! multiplied by `max_norm / (norm + 1e-6)`; otherwise they pass unchanged
//! (multiplied by exactly 1). The norm stays a device tensor: clipping never
//! reads it back. A non-finite gradient makes the norm non-finite, which is how
//! [`crate::api::train_step::TrainStep`] detects a step to skip.
//!
//! Invariant: clipping records into the step and never reads a value back to
//! the host; with gradients whose norm is within `max_norm` the values are
//! unchanged.

use kiln_compiler::ir::DType;

use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;

/// Added to the norm before dividing, so an all-zero gradient divides safely.
pub const CLIP_EPS: f64 = 1e-6;

/// `sqrt(sum over all gradients of sum(g^2))`, an f32 scalar.
pub fn global_norm(grads: &[Tensor]) -> Result<Tensor> {
    let mut total: Option<Tensor> = None;
    for g in grads {
        let sq = g.to_dtype(DType::F32)?.square()?.sum_all()?;
        total = Some(match total {
            Some(t) => t.add(&sq)?,
            None => sq,
        });
    }
    match total {
        Some(t) => t.sqrt(),
        None => Err(FrontendError::Empty { op: "global_norm", what: "gradient" }),
    }
}

/// A clipping threshold must be positive and finite.
pub(crate) fn check_max_norm(op: &'static str, name: &'static str, value: f64) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(FrontendError::HyperParameter { op, name, value, expected: "positive and finite" })
    }
}

/// Scales `grads` so their global norm is at most `max_norm`; returns the
/// clipped gradients (each in its own dtype) and the norm before clipping.
pub fn clip_grad_norm(grads: &[Tensor], max_norm: f64) -> Result<(Vec<Tensor>, Tensor)> {
    check_max_norm("clip_grad_norm", "max_norm", max_norm)?;
    let norm = global_norm(grads)?;
    let coef = Tensor::full(max_norm, DType::F32, [])?.div(&norm.add_scalar(CLIP_EPS)?)?;
    let coef = coef.minimum(&Tensor::ones(DType::F32, [])?)?;
    let clipped = grads.iter().map(|g| g.mul(&coef.to_dtype(g.dtype())?)).collect::<Result<_>>()?;
    Ok((clipped, norm))
}

/// Whether `x` (a float tensor) holds no inf and no NaN, as a pred scalar:
/// `|x| <= max finite` is false for both.
pub fn all_finite(x: &Tensor) -> Result<Tensor> {
    let max = match x.dtype() {
        DType::F16 => f64::from(half::f16::MAX),
        DType::BF16 => f64::from(half::bf16::MAX),
        DType::F32 => f64::from(f32::MAX),
        DType::F64 => f64::MAX,
        other => return Err(FrontendError::DType { op: "all_finite", expected: "a float type", got: other }),
    };
    let ok = x.abs()?.le(&Tensor::full(max, x.dtype(), [])?)?;
    if x.rank() == 0 {
        return Ok(ok);
    }
    let axes: Vec<isize> = (0..x.rank() as isize).collect();
    // On pred, a min-reduction is a logical and.
    ok.min(&axes, false)
}
