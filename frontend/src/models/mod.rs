//! Built-in models and their training loops (used by the CLI, tests and benches).

pub mod mlp;

use crate::error::Result;
use crate::grad::grad;
use crate::nn::ParamStore;
use crate::optim::AdamW;
use crate::step::mark_step;
use crate::tensor::Tensor;
use crate::{random, replicas};

/// The step every built-in loop runs: gradients of `loss`, averaged over
/// replicas, the update, and `mark_step`; returns the loss averaged over
/// replicas (a value of the finished step, so no forced sync).
pub(crate) fn update_and_step(params: &ParamStore, opt: &mut AdamW, loss: &Tensor, lr: f64) -> Result<f64> {
    let tensors = params.tensors();
    let grads = replicas::all_reduce_mean(&grad(loss, &tensors)?)?;
    opt.step(&tensors, &grads, lr)?;
    let mean_loss = replicas::all_reduce_mean(std::slice::from_ref(loss))?.remove(0);
    mark_step()?;
    mean_loss.item()
}

/// The whole training state by name: parameters, optimizer state, RNG state.
pub(crate) fn training_state(params: &ParamStore, opt: &AdamW) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = params.iter().map(|(n, t)| (format!("param.{n}"), t.clone())).collect();
    out.extend(opt.state().into_iter().map(|(n, t)| (format!("optim.{n}"), t)));
    out.push(("rng.state".into(), random::state()));
    out
}
pub mod gpt;
