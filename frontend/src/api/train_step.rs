//! One training step in the order mixed precision needs, as one call.
//!
//! [`TrainStep::record`] appends to the step being recorded, after the forward
//! pass that produced the loss:
//! 1. the backward of `loss × scale` (the loss scaler's device scale; the loss
//!    itself without a scaler);
//! 2. [`replicas::all_reduce_mean`] of the gradients (nothing with one replica);
//! 3. unscaling: gradients × `1/scale`;
//! 4. the global gradient norm in f32, and clipping to `max_grad_norm` if set;
//! 5. the finite check: the step counts as clean when that norm is finite,
//!    which holds exactly when every gradient element is finite and their sum
//!    of squares does not overflow f32;
//! 6. the optimizer's update, kept only if the step is clean: every parameter
//!    and every optimizer state tensor (moments, buffers, the step counter) is
//!    assigned `select(clean, updated, before)`, so a skipped step leaves them
//!    bit-identical;
//! 7. the loss scaler's update (back off on a skip, grow after a run of clean
//!    steps).
//!
//! [`TrainStep::step`] is `record` followed by `mark_step`. Nothing is read back
//! to the host: the loss (averaged over replicas), the norm, whether the step
//! was skipped and the scale come back as tensors, ready once the step has run.
//! The norm, the skip decision and the scale are computed from all-reduced
//! gradients, so every replica makes the same decision.
//!
//! Without a scaler (full precision) steps 1 and 3 are the identity and the
//! rest is unchanged: a step with non-finite gradients is skipped there too.
//!
//! Invariant: a skipped step leaves every parameter and optimizer state tensor
//! bit-identical, and every replica makes the same skip decision.

use kiln_compiler::ir::DType;

use crate::api::amp::{LossScaler, LossScalerConfig};
use crate::api::clip::{self, clip_grad_norm, global_norm};
use crate::api::grad::grad;
use crate::api::optim::Optimizer;
use crate::api::replicas;
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;
use crate::engine::step::mark_step;

/// Settings of a [`TrainStep`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TrainStepOptions {
    /// Dynamic loss scaling (for f16 autocast; harmless with bf16). `None`:
    /// the loss is not scaled.
    pub loss_scaling: Option<LossScalerConfig>,
    /// Clip the global gradient norm to this value. `None`: no clipping (the
    /// norm is still computed, for the finite check and for logging).
    pub max_grad_norm: Option<f64>,
}

/// Values of one step for logging, all device tensors (reading one after the
/// step has run is a plain read, not a forced sync).
#[derive(Clone, Debug)]
pub struct StepStats {
    /// The unscaled loss, averaged over replicas (f32 scalar).
    pub loss: Tensor,
    /// Global norm of the unscaled gradients before clipping (f32 scalar).
    pub grad_norm: Tensor,
    /// Whether the update was skipped for non-finite gradients (pred scalar).
    pub skipped: Tensor,
    /// The loss scale after this step's update, the one the next step uses
    /// (f32 scalar; 1 without a scaler).
    pub scale: Tensor,
}

/// The ordered step: scaled backward, all-reduce, unscale, clip, finite check,
/// update or skip, scale update.
#[derive(Clone, Debug)]
pub struct TrainStep {
    pub scaler: Option<LossScaler>,
    pub max_grad_norm: Option<f64>,
}

impl TrainStep {
    pub fn new(options: TrainStepOptions) -> Result<TrainStep> {
        if let Some(m) = options.max_grad_norm {
            crate::api::clip::check_max_norm("train_step", "max_grad_norm", m)?;
        }
        let scaler = options.loss_scaling.map(LossScaler::new).transpose()?;
        Ok(TrainStep { scaler, max_grad_norm: options.max_grad_norm })
    }

    /// Records the step (see the module docs) for `loss`, an f32 scalar of the
    /// forward already recorded, updating `params` with `opt` at `lr`.
    pub fn record<O: Optimizer>(
        &mut self,
        loss: &Tensor,
        params: &[Tensor],
        opt: &mut O,
        lr: f64,
    ) -> Result<StepStats> {
        let lr = crate::api::optim::lr_scalar("train_step", lr)?;
        self.record_lr(loss, params, opt, &lr)
    }

    /// [`TrainStep::record`] with the learning rate as an f32 scalar tensor:
    /// what a captured step (`kiln::compile_step`) passes as an input, so a
    /// schedule changes it without retracing.
    pub fn record_lr<O: Optimizer>(
        &mut self,
        loss: &Tensor,
        params: &[Tensor],
        opt: &mut O,
        lr: &Tensor,
    ) -> Result<StepStats> {
        if loss.rank() != 0 {
            return Err(FrontendError::LossNotScalar { ty: loss.ty().clone() });
        }
        if loss.dtype() != DType::F32 {
            return Err(FrontendError::DType { op: "train_step", expected: "an f32 loss", got: loss.dtype() });
        }
        if params.is_empty() {
            return Err(FrontendError::Empty { op: "train_step", what: "parameter to update" });
        }
        // 1. Scaled backward.
        let scaled = match &self.scaler {
            Some(s) => loss.mul(&s.scale)?,
            None => loss.clone(),
        };
        let grads = grad(&scaled, params)?;
        // 2. Mean over replicas, before anything looks at the values.
        let grads = replicas::all_reduce_mean(&grads)?;
        // 3. Unscale.
        let grads = match &self.scaler {
            Some(s) => {
                let inv = Tensor::ones(DType::F32, [])?.div(&s.scale)?;
                grads.iter().map(|g| g.mul(&inv.to_dtype(g.dtype())?)).collect::<Result<Vec<_>>>()?
            }
            None => grads,
        };
        // 4. Clip.
        let (grads, grad_norm) = match self.max_grad_norm {
            Some(m) => clip_grad_norm(&grads, m)?,
            None => {
                let n = global_norm(&grads)?;
                (grads, n)
            }
        };
        // 5. Finite check.
        let clean = clip::all_finite(&grad_norm)?;
        // 6. Update, kept only when clean.
        let state: Vec<Tensor> = params.iter().cloned().chain(opt.state().into_iter().map(|(_, t)| t)).collect();
        let before = state.iter().map(Tensor::snapshot).collect::<Result<Vec<_>>>()?;
        opt.step_lr(params, &grads, lr)?;
        for (t, old) in state.iter().zip(&before) {
            t.assign(&Tensor::where_cond(&clean, t, old)?)?;
        }
        // Live snapshots would become outputs of the step.
        drop(before);
        // 7. Scale update.
        let scale = match &self.scaler {
            Some(s) => {
                s.update(&clean)?;
                s.scale.clone()
            }
            None => Tensor::ones(DType::F32, [])?,
        };
        let loss = replicas::all_reduce_mean(std::slice::from_ref(loss))?.remove(0);
        Ok(StepStats { loss, grad_norm, skipped: clean.logical_not()?, scale })
    }

    /// [`TrainStep::record`], then `mark_step`.
    pub fn step<O: Optimizer>(&mut self, loss: &Tensor, params: &[Tensor], opt: &mut O, lr: f64) -> Result<StepStats> {
        let stats = self.record(loss, params, opt, lr)?;
        mark_step()?;
        Ok(stats)
    }

    /// The loss scaler's state tensors by name (none without a scaler), for
    /// checkpoints.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        match &self.scaler {
            Some(s) => s.state().into_iter().map(|(n, t)| (format!("loss_scaler.{n}"), t)).collect(),
            None => Vec::new(),
        }
    }
}
