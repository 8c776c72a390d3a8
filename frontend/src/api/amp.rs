//! Mixed precision: the autocast policy and the dynamic loss scaler.
//!
//! **Autocast** is a scope on the recording thread: ops recorded inside
//! [`autocast`]`(dtype, || ...)` follow one fixed policy, consulted by the ops
//! themselves when they are recorded (the graph keeps ordinary `convert`s, so
//! autodiff, lowering and the interpreter need nothing new):
//! - matrix products (`matmul`, `dot_general`, hence `Linear` and attention)
//!   convert their floating operands to the low dtype and compute in it;
//!   `Linear` adds its bias in the low dtype too;
//! - reductions, softmax/log-softmax, LayerNorm/RMSNorm and the cross-entropy
//!   loss widen a low-precision input to f32 first and compute in f32;
//! - everything else runs in the dtype of its inputs; a binary op between two
//!   float dtypes promotes to the wider one (f32 for bf16 with f16), always,
//!   with or without a scope.
//!
//! Parameters stay f32 master weights: the low-precision copies are `convert`s
//! recorded into each step, and gradients reach the f32 parameters through
//! them. A scope rather than a policy object handed to every layer, because the
//! layers (and a user's own) then need no extra argument, and because a trace is
//! recorded on one thread in program order, which is exactly the extent of a
//! scope. Only recording is affected: the backward pass that `grad` appends
//! mirrors the forward's dtypes whether or not a scope is open, except that
//! the sum a broadcast's gradient takes (a bias's, over the tokens) runs in
//! f32 for a bf16 or f16 cotangent and is rounded once, as PyTorch's
//! sums of bf16 tensors do.
//!
//! **Loss scaling** ([`LossScaler`]) keeps small f16 gradients from flushing to
//! zero: the loss is multiplied by a scale before the backward and the gradients
//! divided by it after. The scale and its growth counter are f32 scalars on the
//! device, updated inside the step with `select`s, so a training loop never
//! reads them back: after a step with non-finite gradients the scale backs off,
//! after `growth_interval` clean steps in a row it grows. The order of a whole
//! step (scale, backward, all-reduce, unscale, clip, check, update or skip,
//! rescale) is enforced by [`crate::api::train_step::TrainStep`].
//!
//! Invariants:
//! - The policy is consulted only when an op is recorded: the graph holds
//!   ordinary `convert`s, so autodiff, lowering and the interpreter see
//!   nothing new.
//! - Scopes nest and the innermost wins; leaving a scope, also by unwinding,
//!   restores the enclosing one's dtype (kept in `core::settings`).
//! - The loss scaler's state never leaves the device: it is updated inside
//!   the step.

use kiln_compiler::ir::{BinaryOp, DType};

use crate::core::error::{FrontendError, Result};
use crate::core::settings;
use crate::core::tensor::Tensor;

/// Restores the enclosing scope's dtype when a scope ends, also by unwinding.
struct ScopeGuard {
    previous: Option<DType>,
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        settings::with(|s| s.autocast = self.previous);
    }
}

/// Runs `f` with autocast to `dtype` (`f16` or `bf16`) on this thread. Scopes
/// nest; the innermost wins.
pub fn autocast<R>(dtype: DType, f: impl FnOnce() -> Result<R>) -> Result<R> {
    if !matches!(dtype, DType::F16 | DType::BF16) {
        return Err(FrontendError::DType { op: "autocast", expected: "f16 or bf16", got: dtype });
    }
    let _guard = ScopeGuard { previous: settings::with(|s| s.autocast.replace(dtype)) };
    f()
}

/// Runs `f` under autocast to `dtype` when it is given, as it is otherwise.
pub fn autocast_if<R>(dtype: Option<DType>, f: impl FnOnce() -> Result<R>) -> Result<R> {
    match dtype {
        Some(d) => autocast(d, f),
        None => f(),
    }
}

/// The low-precision dtype of the innermost open autocast scope, if any.
pub fn autocast_dtype() -> Option<DType> {
    settings::autocast_dtype()
}

fn is_low(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// The dtype a matrix product with operands of `dtype` computes in: the
/// autocast dtype for floats inside a scope, `dtype` itself otherwise.
pub fn compute_dtype(dtype: DType) -> DType {
    match autocast_dtype() {
        Some(low) if dtype.is_float() => low,
        _ => dtype,
    }
}

/// Inside a scope, a low-precision float tensor widened to f32 (for ops the
/// policy keeps in f32); otherwise `t` itself.
pub fn full_precision(t: &Tensor) -> Result<Tensor> {
    match autocast_dtype() {
        Some(_) if is_low(t.dtype()) => t.to_dtype(DType::F32),
        _ => Ok(t.clone()),
    }
}

/// The dtype two float operands of an elementwise op meet in: the wider one,
/// f32 for the two 16-bit formats (neither holds the other). `None` unless both
/// are floats.
pub fn promote(a: DType, b: DType) -> Option<DType> {
    if a == b {
        return Some(a);
    }
    if !a.is_float() || !b.is_float() {
        return None;
    }
    Some(if a == DType::F64 || b == DType::F64 { DType::F64 } else { DType::F32 })
}

/// Settings of a [`LossScaler`] (PyTorch's `GradScaler` defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScalerConfig {
    /// The scale of the first step.
    pub init_scale: f64,
    /// Factor applied after `growth_interval` clean steps in a row (> 1).
    pub growth_factor: f64,
    /// Factor applied after a step with non-finite gradients (in (0, 1)).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (1 to 2^24, counted in f32).
    pub growth_interval: u64,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        LossScalerConfig { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000 }
    }
}

impl LossScalerConfig {
    fn validate(&self) -> Result<()> {
        let bad = |name: &'static str, value: f64, expected: &'static str| {
            Err(FrontendError::HyperParameter { op: "loss_scaler", name, value, expected })
        };
        if !(self.init_scale.is_finite() && self.init_scale > 0.0 && self.init_scale <= f64::from(f32::MAX)) {
            return bad("init_scale", self.init_scale, "positive and finite in f32");
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad("growth_factor", self.growth_factor, "finite and greater than 1");
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad("backoff_factor", self.backoff_factor, "in (0, 1)");
        }
        if !(1..=1 << 24).contains(&self.growth_interval) {
            return bad("growth_interval", self.growth_interval as f64, "between 1 and 2^24 steps");
        }
        Ok(())
    }
}

/// A dynamic loss scale held on the device.
#[derive(Clone, Debug)]
pub struct LossScaler {
    pub config: LossScalerConfig,
    /// The current scale (f32 scalar).
    pub scale: Tensor,
    /// Clean steps in a row since the last growth or backoff (f32 scalar).
    pub growth_tracker: Tensor,
}

impl LossScaler {
    pub fn new(config: LossScalerConfig) -> Result<LossScaler> {
        config.validate()?;
        Ok(LossScaler { config, scale: Tensor::scalar(config.init_scale as f32), growth_tracker: Tensor::scalar(0f32) })
    }

    /// Records the scale's update for a step whose gradients were `finite` (a
    /// pred scalar): back off and restart the count when not; grow and restart
    /// when the count reaches the interval; count otherwise. A grown scale is
    /// capped at f32's largest finite value so it can always back off again.
    pub fn update(&self, finite: &Tensor) -> Result<()> {
        let c = self.config;
        let counted = self.growth_tracker.add_scalar(1.0)?;
        let interval = Tensor::full(c.growth_interval as f64, DType::F32, [])?;
        let grow = finite.binary(BinaryOp::And, &counted.ge(&interval)?)?;
        let grown =
            self.scale.mul_scalar(c.growth_factor)?.minimum(&Tensor::full(f64::from(f32::MAX), DType::F32, [])?)?;
        let backed_off = self.scale.mul_scalar(c.backoff_factor)?;
        let kept = Tensor::where_cond(&grow, &grown, &self.scale)?;
        let scale = Tensor::where_cond(finite, &kept, &backed_off)?;
        let zero = Tensor::zeros(DType::F32, [])?;
        let tracker = Tensor::where_cond(&finite.binary(BinaryOp::And, &grow.logical_not()?)?, &counted, &zero)?;
        self.scale.assign(&scale)?;
        self.growth_tracker.assign(&tracker)
    }

    /// State tensors by name, for checkpoints.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        vec![("scale".into(), self.scale.clone()), ("growth_tracker".into(), self.growth_tracker.clone())]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() -> Result<()> {
        assert_eq!(autocast_dtype(), None);
        autocast(DType::BF16, || {
            assert_eq!(autocast_dtype(), Some(DType::BF16));
            autocast(DType::F16, || {
                assert_eq!(autocast_dtype(), Some(DType::F16));
                Ok(())
            })?;
            assert_eq!(autocast_dtype(), Some(DType::BF16));
            Ok(())
        })?;
        assert_eq!(autocast_dtype(), None);
        let err = autocast(DType::F32, || Ok(())).unwrap_err();
        assert!(matches!(err, FrontendError::DType { op: "autocast", got: DType::F32, .. }), "{err}");
        // An error inside the scope still closes it.
        let _ = autocast(DType::F16, || Err::<(), _>(FrontendError::StaleTensor { op: "test" }));
        assert_eq!(autocast_dtype(), None);
        Ok(())
    }

    #[test]
    fn promotion_meets_in_the_wider_float() {
        assert_eq!(promote(DType::BF16, DType::F32), Some(DType::F32));
        assert_eq!(promote(DType::F16, DType::BF16), Some(DType::F32));
        assert_eq!(promote(DType::F16, DType::F64), Some(DType::F64));
        assert_eq!(promote(DType::BF16, DType::BF16), Some(DType::BF16));
        assert_eq!(promote(DType::F32, DType::I32), None);
    }

    #[test]
    fn scaler_settings_are_checked() {
        let bad = [
            LossScalerConfig { init_scale: 0.0, ..Default::default() },
            LossScalerConfig { init_scale: f64::INFINITY, ..Default::default() },
            LossScalerConfig { growth_factor: 1.0, ..Default::default() },
            LossScalerConfig { backoff_factor: 1.0, ..Default::default() },
            LossScalerConfig { growth_interval: 0, ..Default::default() },
        ];
        for (cfg, name) in
            bad.iter().zip(["init_scale", "init_scale", "growth_factor", "backoff_factor", "growth_interval"])
        {
            match LossScaler::new(*cfg) {
                Err(FrontendError::HyperParameter { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{cfg:?}: {other:?}"),
            }
        }
        assert!(LossScaler::new(LossScalerConfig::default()).is_ok());
    }
}
