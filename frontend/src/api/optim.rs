//! Optimizers whose state lives on the device and is updated inside the step.
//!
//! Every update is recorded into the step's trace and assigned over the
//! parameter and state tensors, so their old buffers are donated and nothing
//! crosses to the host. The learning rate and the step count are tensors (a
//! host scalar fed each step, a device counter), never constants, so a changing
//! schedule does not change the program.
//!
//! Invariant: an optimizer step records into the step and reads nothing back,
//! and a learning rate that changes from step to step (a tensor fed each
//! step) does not change the program.

use kiln_compiler::ir::{DType, Literal, TensorType};

use crate::api::nn::InitPlacement;
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;

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
        InitPlacement::Device => crate::api::nn::own_full(0.0, t.shape())?,
    };
    if let Some(s) = t.sharding() {
        z.set_sharding(s)?;
    }
    Ok(z)
}

/// `Ok` if `ok`, else a [`FrontendError::HyperParameter`] for `value`,
/// naming the optimizer, the setting and the range it must lie in.
fn setting(op: &'static str, name: &'static str, value: f64, ok: bool, expected: &'static str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(FrontendError::HyperParameter { op, name, value, expected })
    }
}

/// `lr` as the f32 scalar a step takes it as, when it is one: finite, not
/// negative, not so large that f32 makes it infinite (1e308) and not so small
/// that f32 rounds a positive rate to 0 (1e-50). The one test of a learning
/// rate, for the optimizers and the training loops' settings alike.
pub fn f32_rate(lr: f64) -> Option<f32> {
    let f = lr as f32;
    (lr.is_finite() && lr >= 0.0 && f.is_finite() && (f > 0.0) == (lr > 0.0)).then_some(f)
}

/// A learning rate given as a Rust number, checked by [`f32_rate`].
pub(crate) fn lr_scalar(op: &'static str, lr: f64) -> Result<Tensor> {
    let expected = "finite, not negative, and representable in f32 (0 or at least 1.4e-45, below 3.4e38)";
    match f32_rate(lr) {
        Some(f) => Ok(Tensor::scalar(f)),
        None => Err(FrontendError::HyperParameter { op, name: "lr", value: lr, expected }),
    }
}

/// The same tensor twice in one parameter list would be updated twice with
/// the sum of its gradients counted once per entry: refused by index.
fn check_distinct(op: &'static str, params: &[Tensor]) -> Result<()> {
    for (j, p) in params.iter().enumerate() {
        if let Some(i) = params[..j].iter().position(|q| q.same(p)) {
            return Err(FrontendError::InvalidArgument {
                op,
                reason: format!("parameters {i} and {j} are the same tensor: list each parameter once"),
            });
        }
    }
    Ok(())
}

/// `params` must be the tensors, in the order, the optimizer was built for:
/// its state is matched to them by position.
fn check_same_params(op: &'static str, built_for: &[Tensor], params: &[Tensor]) -> Result<()> {
    if params.len() != built_for.len() {
        return Err(FrontendError::Count {
            op,
            what: "parameters",
            expected: format!("the {} it was built for", built_for.len()),
            got: params.len(),
        });
    }
    if let Some(i) = params.iter().zip(built_for).position(|(p, q)| !p.same(q)) {
        let reason = match built_for.iter().position(|q| q.same(&params[i])) {
            Some(k) => format!(
                "parameter {i} is the optimizer's parameter {k}: pass the parameters in the order it was built with \
                 (its state is matched to them by position)"
            ),
            None => format!("parameter {i} ({}) is not one the optimizer was built for", params[i].ty()),
        };
        return Err(FrontendError::InvalidArgument { op, reason });
    }
    Ok(())
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

/// What [`crate::api::train_step::TrainStep`] needs of an optimizer: to record its
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

impl AdamWConfig {
    /// Each setting in its range: the betas in [0, 1) (at 1 the bias
    /// correction divides by zero), `eps` positive in f32 (0 divides a zero
    /// moment by zero), the weight decay finite and not negative.
    pub fn check(&self) -> Result<()> {
        let beta = |name, b: f64| setting("adamw", name, b, (0.0..1.0).contains(&b), "in [0, 1)");
        beta("beta1", self.beta1)?;
        beta("beta2", self.beta2)?;
        let eps = self.eps as f32;
        setting(
            "adamw",
            "eps",
            self.eps,
            eps > 0.0 && eps.is_finite(),
            "positive and finite in f32 (at least 1.4e-45)",
        )?;
        setting(
            "adamw",
            "weight_decay",
            self.weight_decay,
            self.weight_decay.is_finite() && self.weight_decay >= 0.0,
            "finite and not negative",
        )
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
    /// The parameters it was built for, in order: `m[i]` and `v[i]` are
    /// `params[i]`'s, and a step refuses any other list.
    params: Vec<Tensor>,
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
        config.check()?;
        check_distinct("adamw", params)?;
        let zeros = |p: &Tensor| zeros_like(p, placement);
        Ok(AdamW {
            config,
            m: params.iter().map(zeros).collect::<Result<_>>()?,
            v: params.iter().map(zeros).collect::<Result<_>>()?,
            t: Tensor::scalar(0f32),
            params: params.to_vec(),
        })
    }

    /// Records one update of `params` with `grads` at learning rate `lr`.
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<()> {
        let lr = lr_scalar("adamw", lr)?;
        self.step_lr(params, grads, &lr)
    }

    /// [`AdamW::step`] with the learning rate as an f32 scalar tensor: what a
    /// captured step (`kiln::compile_step`) passes as an input, so a schedule
    /// changes it without retracing.
    pub fn step_lr(&mut self, params: &[Tensor], grads: &[Tensor], lr: &Tensor) -> Result<()> {
        check(params, grads)?;
        check_same_params("adamw", &self.params, params)?;
        let c = self.config;
        c.check()?;
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
    /// The parameters it was built for, in order (`buf[i]` is `params[i]`'s).
    params: Vec<Tensor>,
}

impl Sgd {
    /// Momentum and weight decay finite and not negative (PyTorch's ranges).
    pub fn new(params: &[Tensor], momentum: f64, weight_decay: f64) -> Result<Sgd> {
        Sgd::check_settings(momentum, weight_decay)?;
        check_distinct("sgd", params)?;
        Ok(Sgd {
            momentum,
            weight_decay,
            buf: params.iter().map(|p| zeros_like(p, InitPlacement::Host)).collect::<Result<_>>()?,
            params: params.to_vec(),
        })
    }

    fn check_settings(momentum: f64, weight_decay: f64) -> Result<()> {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        setting("sgd", "momentum", momentum, ok(momentum), "finite and not negative")?;
        setting("sgd", "weight_decay", weight_decay, ok(weight_decay), "finite and not negative")
    }

    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) -> Result<()> {
        let lr = lr_scalar("sgd", lr)?;
        self.step_lr(params, grads, &lr)
    }

    /// [`Sgd::step`] with the learning rate as an f32 scalar tensor.
    pub fn step_lr(&mut self, params: &[Tensor], grads: &[Tensor], lr: &Tensor) -> Result<()> {
        check(params, grads)?;
        check_same_params("sgd", &self.params, params)?;
        Sgd::check_settings(self.momentum, self.weight_decay)?;
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

    fn param(n: usize) -> Tensor {
        Tensor::from_vec((0..n).map(|i| 0.5 + i as f32).collect::<Vec<_>>(), [n]).unwrap()
    }

    fn refused_setting<T: std::fmt::Debug>(r: Result<T>) -> &'static str {
        match r {
            Err(FrontendError::HyperParameter { name, .. }) => name,
            other => panic!("expected a HyperParameter error, got {other:?}"),
        }
    }

    #[test]
    fn adamw_refuses_settings_that_cannot_train() {
        let p = [param(3)];
        let with = |f: fn(&mut AdamWConfig)| {
            let mut c = AdamWConfig::default();
            f(&mut c);
            AdamW::new(&p, c)
        };
        assert_eq!(refused_setting(with(|c| c.beta1 = 1.0)), "beta1");
        assert_eq!(refused_setting(with(|c| c.beta1 = -0.5)), "beta1");
        assert_eq!(refused_setting(with(|c| c.beta2 = 1.0)), "beta2");
        assert_eq!(refused_setting(with(|c| c.beta2 = f64::NAN)), "beta2");
        assert_eq!(refused_setting(with(|c| c.eps = 0.0)), "eps");
        assert_eq!(refused_setting(with(|c| c.eps = -1.0)), "eps");
        assert_eq!(refused_setting(with(|c| c.eps = 1e-50)), "eps"); // 0 in f32
        assert_eq!(refused_setting(with(|c| c.weight_decay = f64::NAN)), "weight_decay");
        assert_eq!(refused_setting(with(|c| c.weight_decay = -1.0)), "weight_decay");
        with(|c| c.beta1 = 0.0).unwrap();
        // A config changed after construction is checked at the step.
        let mut opt = AdamW::new(&p, AdamWConfig::default()).unwrap();
        opt.config.beta2 = 1.0;
        assert_eq!(refused_setting(opt.step(&p, &[param(3)], 1e-3)), "beta2");
    }

    #[test]
    fn learning_rates_that_cannot_train_are_refused_by_both_optimizers() {
        let p = [param(2)];
        let mut adamw = AdamW::new(&p, AdamWConfig::default()).unwrap();
        let mut sgd = Sgd::new(&p, 0.9, 0.0).unwrap();
        for lr in [f64::NAN, f64::INFINITY, -1e-2, 1e300, 1e-50] {
            let e = adamw.step(&p, &[param(2)], lr).unwrap_err().to_string();
            assert!(e.starts_with("adamw: lr = ") && e.contains("representable in f32"), "{lr}: {e}");
            assert_eq!(refused_setting(sgd.step(&p, &[param(2)], lr)), "lr");
        }
        adamw.step(&p, &[param(2)], 0.0).unwrap();
        sgd.step(&p, &[param(2)], 1e-3).unwrap();
    }

    #[test]
    fn sgd_refuses_momentum_and_decay_out_of_range() {
        let p = [param(2)];
        assert_eq!(refused_setting(Sgd::new(&p, f64::NAN, 0.0)), "momentum");
        assert_eq!(refused_setting(Sgd::new(&p, -1.0, 0.0)), "momentum");
        assert_eq!(refused_setting(Sgd::new(&p, 0.9, f64::INFINITY)), "weight_decay");
        assert_eq!(refused_setting(Sgd::new(&p, 0.9, -0.1)), "weight_decay");
    }

    #[test]
    fn a_parameter_listed_twice_is_refused() {
        let (a, b) = (param(2), param(3));
        let twice = [a.clone(), b, a];
        let e = AdamW::new(&twice, AdamWConfig::default()).unwrap_err().to_string();
        assert_eq!(e, "adamw: parameters 0 and 2 are the same tensor: list each parameter once");
        let e = Sgd::new(&twice, 0.0, 0.0).unwrap_err().to_string();
        assert!(e.starts_with("sgd: parameters 0 and 2 are the same tensor"), "{e}");
    }

    #[test]
    fn a_step_takes_the_parameters_the_optimizer_was_built_for_in_order() {
        let (a, b) = (param(2), param(2));
        let grads = [param(2), param(2)];
        let mut adamw = AdamW::new(&[a.clone(), b.clone()], AdamWConfig::default()).unwrap();
        let mut sgd = Sgd::new(std::slice::from_ref(&a), 0.9, 0.0).unwrap();
        // More parameters than it was built for: SGD used to update the first
        // and silently skip the rest.
        let e = sgd.step(&[a.clone(), b.clone()], &grads, 0.1).unwrap_err().to_string();
        assert_eq!(e, "sgd: 2 parameters for the 1 it was built for");
        // The same tensors in another order would swap their moments.
        let e = adamw.step(&[b.clone(), a.clone()], &grads, 0.1).unwrap_err().to_string();
        assert!(
            e.starts_with("adamw: parameter 0 is the optimizer's parameter 1: pass the parameters in the order"),
            "{e}"
        );
        let e = adamw.step(&[a.clone(), param(2)], &grads, 0.1).unwrap_err().to_string();
        assert_eq!(e, "adamw: parameter 1 (tensor<2xf32>) is not one the optimizer was built for");
        adamw.step(&[a, b], &grads, 0.1).unwrap();
    }

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
