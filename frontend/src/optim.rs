//! Optimizers whose state lives on the device and is updated inside the step.
//!
//! Every update is recorded into the step's trace and assigned over the
//! parameter and state tensors, so their old buffers are donated and nothing
//! crosses to the host. The learning rate and the step count are tensors (a
//! host scalar fed each step, a device counter), never constants, so a changing
//! schedule does not change the program.

use kiln_compiler::ir::{DType, Literal, TensorType};

use crate::error::{FrontendError, Result};
use crate::nn::InitPlacement;
use crate::tensor::Tensor;

/// Zeros like `t`, in `t`'s sharding (optimizer state is split where its
/// parameter is: FSDP shards the state with the parameters), made where
/// `placement` says:
/// - host: all-zero bytes, uploaded by the first step. `vec![0u8; n]` takes
///   zeroed pages from the allocator instead of encoding every element
///   (gpt2-small's two AdamW states took 4.2 s of set-up that way on a
///   loaded 2-core box);
/// - device: recorded in the current step, computed where they live (run by
///   the next step, e.g. with the init program by `ParamStore::materialize`;
///   no host buffer, no upload). Each is a value of its own, not the step's
///   shared broadcast constant (`Tensor::zeros`): a shared value becomes one
///   output whose buffer every receiver holds, and a shared buffer cannot be
///   donated, so the first training step would compile without the state's
///   aliases.
fn zeros_like(t: &Tensor, placement: InitPlacement) -> Result<Tensor> {
    let z = match placement {
        InitPlacement::Host => {
            let ty = TensorType::new(DType::F32, t.shape().clone());
            Tensor::from_literal(Literal::from_bytes(ty.clone(), vec![0u8; ty.size_in_bytes()])?)
        }
        InitPlacement::Device => crate::nn::own_full(0.0, t.shape())?,
    };
    if let Some(s) = t.sharding() {
        z.set_sharding(s)?;
    }
    Ok(z)
}

fn check(params: &[Tensor], grads: &[Tensor]) -> Result<()> {
    if params.len() != grads.len() {
        return Err(FrontendError::Count {
            op: "optimizer",
            what: "gradients",
            expected: format!("{} parameters", params.len()),
            got: grads.len(),
        });
    }
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        if p.ty() != g.ty() {
            return Err(FrontendError::TypeMismatch {
                op: "optimizer",
                what: format!("the gradient of parameter {i}"),
                expected: p.ty().clone().into(),
                got: g.ty().clone().into(),
            });
        }
        if p.dtype() != DType::F32 {
            return Err(FrontendError::DType { op: "optimizer", expected: "f32 master weights", got: p.dtype() });
        }
    }
    Ok(())
}

/// A learning rate given as a tensor must be an f32 scalar.
fn check_lr(op: &'static str, lr: &Tensor) -> Result<()> {
    if lr.ty() != &kiln_compiler::ir::TensorType::scalar(DType::F32) {
        let (expected, got) = (Box::new(kiln_compiler::ir::TensorType::scalar(DType::F32)), Box::new(lr.ty().clone()));
        return Err(FrontendError::TypeMismatch { op, what: "the learning rate".into(), expected, got });
    }
    Ok(())
}

/// What [`crate::train_step::TrainStep`] needs of an optimizer: to record its
/// update, and to name every tensor that update assigns over besides the
/// parameters, so a skipped step can restore them all.
pub trait Optimizer {
    /// Records one update of `params` with `grads` at learning rate `lr`.
    fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<()>;
    /// [`Optimizer::step`] with the learning rate as an f32 scalar tensor (an
    /// input of a captured step, so a schedule changes it without retracing).
    fn step_lr(&mut self, params: &[Tensor], grads: &[Tensor], lr: &Tensor) -> Result<()>;
    /// Every state tensor `step` assigns (moments, buffers, counters), by name.
    fn state(&self) -> Vec<(String, Tensor)>;
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<()> {
        AdamW::step(self, params, grads, lr)
    }
    fn step_lr(&mut self, params: &[Tensor], grads: &[Tensor], lr: &Tensor) -> Result<()> {
        AdamW::step_lr(self, params, grads, lr)
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        AdamW::state(self)
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<()> {
        Sgd::step(self, params, grads, lr)
    }
    fn step_lr(&mut self, params: &[Tensor], grads: &[Tensor], lr: &Tensor) -> Result<()> {
        Sgd::step_lr(self, params, grads, lr)
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        Sgd::state(self)
    }
}

/// Hyper-parameters of [`AdamW`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay (multiplied by the learning rate).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// Adam with decoupled weight decay and bias correction.
#[derive(Clone, Debug)]
pub struct AdamW {
    pub config: AdamWConfig,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Number of updates applied (f32 scalar on the device).
    pub t: Tensor,
}

impl AdamW {
    /// The state as host zeros, uploaded by the first step.
    pub fn new(params: &[Tensor], config: AdamWConfig) -> Result<AdamW> {
        AdamW::with_state_on(params, config, InitPlacement::Host)
    }

    /// The state's zeros made where `placement` says. With
    /// [`InitPlacement::Device`] they are recorded in the current step, in
    /// each parameter's sharding: run them before the first training step
    /// (with a device-initialised store's init program, by making the
    /// optimizer before `ParamStore::materialize`, or by `mark_step`), or
    /// that step computes them and compiles to a program no later step runs.
    pub fn with_state_on(params: &[Tensor], config: AdamWConfig, placement: InitPlacement) -> Result<AdamW> {
        let zeros = |p: &Tensor| zeros_like(p, placement);
        Ok(AdamW {
            config,
            m: params.iter().map(zeros).collect::<Result<_>>()?,
            v: params.iter().map(zeros).collect::<Result<_>>()?,
            t: Tensor::scalar(0f32),
        })
    }

    /// Records one update of `params` with `grads` at learning rate `lr`.
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<()> {
        self.step_lr(params, grads, &Tensor::scalar(lr as f32))
    }

    /// [`AdamW::step`] with the learning rate as an f32 scalar tensor: what a
    /// captured step (`kiln::compile_step`) passes as an input, so a schedule
    /// changes it without retracing.
    pub fn step_lr(&mut self, params: &[Tensor], grads: &[Tensor], lr: &Tensor) -> Result<()> {
        check(params, grads)?;
        if params.len() != self.m.len() {
            return Err(FrontendError::Count {
                op: "adamw",
                what: "parameters",
                expected: format!("the {} it was built for", self.m.len()),
                got: params.len(),
            });
        }
        let c = self.config;
        check_lr("adamw", lr)?;
        let t = self.t.add_scalar(1.0)?;
        // Bias corrections 1 - beta^t, computed in-graph from the counter.
        let bc1 = Tensor::full(c.beta1, DType::F32, [])?.pow(&t)?.neg()?.add_scalar(1.0)?;
        let bc2 = Tensor::full(c.beta2, DType::F32, [])?.pow(&t)?.neg()?.add_scalar(1.0)?;
        let step_size = lr.div(&bc1)?;
        let lr = lr.clone();
        let bc2_sqrt = bc2.sqrt()?;
        for ((p, g), (m, v)) in params.iter().zip(grads).zip(self.m.iter().zip(&self.v)) {
            let m_new = m.mul_scalar(c.beta1)?.add(&g.mul_scalar(1.0 - c.beta1)?)?;
            let v_new = v.mul_scalar(c.beta2)?.add(&g.square()?.mul_scalar(1.0 - c.beta2)?)?;
            let denom = v_new.sqrt()?.div(&bc2_sqrt)?.add_scalar(c.eps)?;
            let update = m_new.div(&denom)?.mul(&step_size)?;
            let decayed = p.sub(&p.mul(&lr)?.mul_scalar(c.weight_decay)?)?;
            p.assign(&decayed.sub(&update)?)?;
            m.assign(&m_new)?;
            v.assign(&v_new)?;
        }
        self.t.assign(&t)?;
        Ok(())
    }

    /// State tensors by name, for checkpoints.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("t".to_string(), self.t.clone())];
        for (i, (m, v)) in self.m.iter().zip(&self.v).enumerate() {
            out.push((format!("m.{i}"), m.clone()));
            out.push((format!("v.{i}"), v.clone()));
        }
        out
    }
}

/// SGD with momentum (PyTorch's formulation) and L2 weight decay.
#[derive(Clone, Debug)]
pub struct Sgd {
    pub momentum: f64,
    pub weight_decay: f64,
    pub buf: Vec<Tensor>,
}

impl Sgd {
    pub fn new(params: &[Tensor], momentum: f64, weight_decay: f64) -> Result<Sgd> {
        Ok(Sgd {
            momentum,
            weight_decay,
            buf: params.iter().map(|p| zeros_like(p, InitPlacement::Host)).collect::<Result<_>>()?,
        })
    }

    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<()> {
        self.step_lr(params, grads, &Tensor::scalar(lr as f32))
    }

    /// [`Sgd::step`] with the learning rate as an f32 scalar tensor.
    pub fn step_lr(&mut self, params: &[Tensor], grads: &[Tensor], lr: &Tensor) -> Result<()> {
        check(params, grads)?;
        check_lr("sgd", lr)?;
        for ((p, g), b) in params.iter().zip(grads).zip(&self.buf) {
            let g = if self.weight_decay != 0.0 { g.add(&p.mul_scalar(self.weight_decay)?)? } else { g.clone() };
            let b_new = b.mul_scalar(self.momentum)?.add(&g)?;
            p.assign(&p.sub(&b_new.mul(lr)?)?)?;
            b.assign(&b_new)?;
        }
        Ok(())
    }

    pub fn state(&self) -> Vec<(String, Tensor)> {
        self.buf.iter().enumerate().map(|(i, b)| (format!("momentum.{i}"), b.clone())).collect()
    }
}

/// Linear warmup then cosine decay to `min_lr`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WarmupCosine {
    pub base_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl WarmupCosine {
    /// The learning rate for update number `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.base_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = WarmupCosine { base_lr: 1.0, min_lr: 0.1, warmup_steps: 10, total_steps: 110 };
        assert!((s.lr(0) - 0.1).abs() < 1e-12);
        assert!((s.lr(9) - 1.0).abs() < 1e-12);
        assert!((s.lr(10) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.55).abs() < 1e-12);
        assert!((s.lr(110) - 0.1).abs() < 1e-12);
        assert!((s.lr(500) - 0.1).abs() < 1e-12);
    }
}
