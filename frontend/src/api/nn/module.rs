//! `Module`: what every layer and model is to the rest of kiln — a forward
//! function, the parameters it owns, its sub-modules, and a train/eval mode.
//!
//! Invariants:
//! - [`Module::parameters`] lists each parameter once (by handle identity), in
//!   the order a depth-first walk meets them: own parameters first, then each
//!   child's. For the built-in layers and models that is the order the
//!   `ParamStore` created them in, so optimizer state lines up with it.
//! - A parameter's name is the one its `ParamStore` gave it (`fc0.weight`);
//!   names are what checkpoints store, so they never depend on the walk.
//! - The train/eval flag lives in the layers that behave differently
//!   ([`Dropout`]), in a `Cell`, so switching modes needs only `&self`.
//! - An error raised inside a layer's forward names the layer (and every
//!   enclosing layer that runs through [`scoped`]): `LayerNorm(257): mul: ...`.

use std::cell::Cell;

use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;

/// A layer or a model: a forward function with parameters.
///
/// A user's model implements [`Module::forward`], [`Module::describe`] and
/// [`Module::children`] (the layers it holds); parameters, named parameters
/// and the train/eval switch then come for free.
pub trait Module {
    /// The forward computation.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// How messages name this module: `Linear(784 -> 257)`, `LayerNorm(257)`.
    fn describe(&self) -> String;

    /// Parameters held directly by this module (not by its children).
    fn own_parameters(&self) -> Vec<Tensor> {
        Vec::new()
    }

    /// The modules this one holds, in the order their parameters were made.
    fn children(&self) -> Vec<&dyn Module> {
        Vec::new()
    }

    /// The train/eval flag of a module that behaves differently in the two
    /// modes (dropout); `None` for the rest.
    fn mode_flag(&self) -> Option<&Cell<bool>> {
        None
    }

    /// Every parameter of this module and its children, each once, in
    /// creation order.
    fn parameters(&self) -> Vec<Tensor> {
        let mut out: Vec<Tensor> = Vec::new();
        walk(self, &mut |own, _| {
            for p in own {
                if !out.iter().any(|q| q.same(&p)) {
                    out.push(p);
                }
            }
        });
        out
    }

    /// [`Module::parameters`] with their `ParamStore` names (`param{i}` for a
    /// tensor that was never named).
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.parameters()
            .into_iter()
            .enumerate()
            .map(|(i, t)| (t.name().unwrap_or_else(|| format!("param{i}")), t))
            .collect()
    }

    /// Elements over all parameters.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(Tensor::elem_count).sum()
    }

    /// Switches this module and all its children to training (`true`) or
    /// evaluation (`false`) behaviour.
    fn set_training(&self, training: bool) {
        walk(self, &mut |_, flag| {
            if let Some(flag) = flag {
                flag.set(training);
            }
        });
    }

    /// Training mode (dropout active).
    fn train(&self) {
        self.set_training(true);
    }

    /// Evaluation mode (dropout off).
    fn eval(&self) {
        self.set_training(false);
    }

    /// Whether any part of this module is in training mode (modules without
    /// a mode flag count as training, PyTorch's default).
    fn is_training(&self) -> bool {
        let mut flags = Vec::new();
        walk(self, &mut |_, flag| flags.extend(flag.map(Cell::get)));
        flags.is_empty() || flags.into_iter().any(|f| f)
    }
}

/// What [`walk`] calls on each module: its own parameters and mode flag.
type Visit<'a> = dyn FnMut(Vec<Tensor>, Option<&Cell<bool>>) + 'a;

/// Depth-first, parents before children: each module's own parameters and
/// mode flag.
fn walk<M: Module + ?Sized>(m: &M, f: &mut Visit<'_>) {
    f(m.own_parameters(), m.mode_flag());
    for c in m.children() {
        walk(c, f);
    }
}

/// Runs `f`; an error it returns is wrapped to name the layer `describe()`
/// (called only on error, so the happy path formats nothing).
pub fn scoped<T>(describe: impl FnOnce() -> String, f: impl FnOnce() -> Result<T>) -> Result<T> {
    f().map_err(|e| FrontendError::InLayer { layer: describe(), source: Box::new(e) })
}

/// Zeroes each element with probability `p` in training mode (scaling the
/// rest by `1/(1-p)`); the identity in evaluation mode.
#[derive(Clone, Debug)]
pub struct Dropout {
    pub p: f64,
    training: Cell<bool>,
}

impl Dropout {
    /// A dropout layer in training mode; `p` must lie in `[0, 1)`.
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            return Err(FrontendError::HyperParameter { op: "dropout", name: "p", value: p, expected: "in [0, 1)" });
        }
        Ok(Dropout { p, training: Cell::new(true) })
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        scoped(|| self.describe(), || super::dropout(x, self.p, self.training.get()))
    }
    fn describe(&self) -> String {
        format!("Dropout({})", self.p)
    }
    fn mode_flag(&self) -> Option<&Cell<bool>> {
        Some(&self.training)
    }
}

/// Modules applied one after another.
#[derive(Default)]
pub struct Sequential {
    pub layers: Vec<Box<dyn Module>>,
}

impl Sequential {
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// Appends `layer`; returns `self` for chaining.
    pub fn push(mut self, layer: impl Module + 'static) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        Ok(h)
    }
    fn describe(&self) -> String {
        format!("Sequential({} layers)", self.layers.len())
    }
    fn children(&self) -> Vec<&dyn Module> {
        self.layers.iter().map(|l| l.as_ref()).collect()
    }
}

/// A function as a parameterless module (`Func::new("relu", nn::relu)`).
pub struct Func {
    name: &'static str,
    f: fn(&Tensor) -> Result<Tensor>,
}

impl Func {
    pub fn new(name: &'static str, f: fn(&Tensor) -> Result<Tensor>) -> Func {
        Func { name, f }
    }
}

impl Module for Func {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (self.f)(x)
    }
    fn describe(&self) -> String {
        self.name.to_string()
    }
}
