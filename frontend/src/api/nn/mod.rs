//! Neural-network layers over lazy tensors, and a named parameter store.
//!
//! Layers hold handles to their parameters (clones of the store's tensors), so
//! an optimizer that assigns new values through the store updates the layers.
//! Parameters are f32 master weights made from the store's seed: on the host
//! ([`InitPlacement::Host`]) or by a compiled init program on the devices
//! ([`InitPlacement::Device`], `device_init`), with the same values.
//!
//! Invariant: the store's draws form one stream per seed, taken in creation
//! order; [`ParamSpec::first_draw`] says where each parameter's draws start,
//! whichever placement made it.

mod attention;
mod device_init;
mod init;
mod module;

use kiln_compiler::ir::{CompareDir, DType, Shape, ValueId};

pub use attention::{attention, scaled_dot_product_attention, AttentionOptions, CausalSelfAttention};
pub(crate) use device_init::own_full;
pub use device_init::{init_value, Init, InitForm, InitPlacement, ParamSpec, ENV_INIT_FORM};
pub use init::HostRng;
pub use module::{scoped, Dropout, Func, Module, Sequential};

use crate::api::amp;
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;
use crate::engine::scope;

/// Named parameters in creation order.
#[derive(Clone, Debug)]
pub struct ParamStore {
    params: Vec<(String, Tensor)>,
    rng: HostRng,
    /// How each parameter was made, in creation order (`Init::Given` for
    /// tensors registered with [`ParamStore::add`]).
    specs: Vec<ParamSpec>,
    /// Draws of the seed's stream taken so far.
    draws: u64,
    placement: InitPlacement,
    seed: u64,
    /// Per parameter, the pending value its device init recorded (`None`:
    /// host data or given), so `materialize` can tell an untouched init from
    /// a reassigned one.
    recorded: Vec<Option<(u64, ValueId)>>,
    /// The init program's form (`None`: `KILN_INIT_FORM`, else flat).
    form: Option<InitForm>,
}

impl ParamStore {
    /// A store that initialises on the host.
    pub fn new(seed: u64) -> ParamStore {
        ParamStore::with_placement(seed, InitPlacement::Host)
    }

    /// A store that initialises where `placement` says. With
    /// [`InitPlacement::Device`] parameters are recorded as pending values of
    /// the current step; [`ParamStore::materialize`] runs them as their own
    /// program (otherwise the first step that reads them computes them).
    pub fn with_placement(seed: u64, placement: InitPlacement) -> ParamStore {
        ParamStore {
            params: Vec::new(),
            rng: HostRng::new(seed),
            specs: Vec::new(),
            draws: 0,
            placement,
            seed,
            recorded: Vec::new(),
            form: None,
        }
    }

    pub fn placement(&self) -> InitPlacement {
        self.placement
    }

    /// How [`ParamStore::materialize`] records the init program (device
    /// placement); the values are the same in either form.
    pub fn set_init_form(&mut self, form: InitForm) {
        self.form = Some(form);
    }

    /// How every parameter was made, in creation order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Registers `t` under `name` (names must be unique).
    pub fn add(&mut self, name: impl Into<String>, t: Tensor) -> Result<Tensor> {
        self.register(name.into(), t, Init::Given)
    }

    fn register(&mut self, name: String, t: Tensor, init: Init) -> Result<Tensor> {
        if self.params.iter().any(|(n, _)| *n == name) {
            return Err(FrontendError::DuplicateName { op: "param", name });
        }
        let t = t.with_name(&name);
        let first_draw = self.draws;
        self.draws = self.draws.wrapping_add(init.draws_per_element().wrapping_mul(t.elem_count() as u64));
        self.specs.push(ParamSpec { name: name.clone(), shape: t.shape().clone(), init, first_draw });
        let recorded = match (self.placement, init) {
            (InitPlacement::Device, Init::Uniform { .. } | Init::Normal { .. } | Init::Constant { .. }) => {
                t.pending_value()
            }
            (InitPlacement::Host, _) | (InitPlacement::Device, Init::Given) => None,
        };
        self.recorded.push(recorded);
        self.params.push((name, t.clone()));
        Ok(t)
    }

    /// Makes `name` per `init` where this store initialises.
    fn make(&mut self, name: &str, shape: Shape, init: Init) -> Result<Tensor> {
        let t = match self.placement {
            InitPlacement::Host => {
                let n = shape.num_elements();
                let data = match init {
                    Init::Uniform { bound } => self.rng.uniform_vec(n, -bound, bound),
                    Init::Normal { std } => self.rng.normal_vec(n, std),
                    Init::Constant { value } => vec![value; n],
                    Init::Given => {
                        return Err(FrontendError::InvalidArgument {
                            op: "param",
                            reason: format!("{name}: a given tensor is registered with ParamStore::add"),
                        })
                    }
                };
                Tensor::from_vec(data, shape)?
            }
            InitPlacement::Device => {
                let spec = ParamSpec { name: name.to_string(), shape, init, first_draw: self.draws };
                // The host generator stays in step with the stream.
                self.rng.skip(init.draws_per_element().wrapping_mul(spec.shape.num_elements() as u64));
                init_value(self.seed, &spec)?
            }
        };
        self.register(name.to_string(), t, init)
    }

    pub fn uniform(&mut self, name: &str, shape: impl Into<Shape>, bound: f64) -> Result<Tensor> {
        self.make(name, shape.into(), Init::Uniform { bound })
    }

    pub fn normal(&mut self, name: &str, shape: impl Into<Shape>, std: f64) -> Result<Tensor> {
        self.make(name, shape.into(), Init::Normal { std })
    }

    pub fn constant(&mut self, name: &str, shape: impl Into<Shape>, value: f32) -> Result<Tensor> {
        self.make(name, shape.into(), Init::Constant { value })
    }

    /// Runs the init program of parameters still pending (device placement)
    /// as one step, so they are device data before the first training step
    /// (which then compiles to the program every later step runs). A step
    /// boundary: anything else pending in the current step runs with it.
    /// Returns whether a step ran.
    pub fn materialize(&self) -> Result<bool> {
        if !self.params.iter().any(|(_, t)| t.is_pending()) {
            return Ok(false);
        }
        self.prepare_init()?;
        crate::engine::param_init::as_param_init(crate::engine::step::mark_step)?;
        Ok(true)
    }

    /// Puts the pending init into the store's [`InitForm`] without running
    /// it (what [`ParamStore::materialize`] does before its step; under
    /// `kiln::lower` it shows the init program). Nothing to do for host
    /// placement or the per-parameter form.
    pub fn prepare_init(&self) -> Result<()> {
        let form = match self.form {
            Some(f) => f,
            None => InitForm::from_env()?,
        };
        match (self.placement, form) {
            (InitPlacement::Device, InitForm::Flat) => self.flatten_normal_runs(),
            (InitPlacement::Device, InitForm::PerParameter) | (InitPlacement::Host, _) => Ok(()),
        }
    }

    /// Re-records the init of normal parameters whose draws follow each
    /// other as runs of one flat computation (`device_init::normal_run`):
    /// XLA's GPU compile of the init program then has one kernel with the
    /// transcendentals per run instead of one per parameter (`docs/init.md`).
    /// Only parameters still holding the value `make` recorded and laid out
    /// replicated take part; a sharded one keeps its per-axis init, which
    /// each device computes for its shard alone. The values are the same
    /// either way; the per-parameter records left behind are dead code.
    fn flatten_normal_runs(&self) -> Result<()> {
        let mut runs: Vec<Vec<usize>> = Vec::new();
        let mut end: Option<u64> = None;
        for (i, spec) in self.specs.iter().enumerate() {
            let t = &self.params[i].1;
            let eligible = matches!(spec.init, Init::Normal { .. })
                && self.recorded[i].is_some()
                && t.pending_value() == self.recorded[i]
                && t.sharding().is_none();
            if !eligible {
                continue;
            }
            // A run needs consecutive draws: a parameter between that draws
            // (uniform, or normal but sharded) moves `first_draw` past `end`.
            match (runs.last_mut(), end) {
                (Some(run), Some(e)) if e == spec.first_draw => run.push(i),
                _ => runs.push(vec![i]),
            }
            end = Some(spec.first_draw.wrapping_add(2u64.wrapping_mul(spec.shape.num_elements() as u64)));
        }
        for run in runs.iter().filter(|r| r.len() > 1) {
            let specs: Vec<&ParamSpec> = run.iter().map(|&i| &self.specs[i]).collect();
            let values = device_init::normal_run(self.seed, &specs)?;
            for (&i, v) in run.iter().zip(&values) {
                self.params[i].1.assign(v)?;
            }
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.params.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.params.iter().map(|(n, t)| (n.as_str(), t))
    }

    pub fn tensors(&self) -> Vec<Tensor> {
        self.params.iter().map(|(_, t)| t.clone()).collect()
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    pub fn num_elements(&self) -> usize {
        self.params.iter().map(|(_, t)| t.elem_count()).sum()
    }
}

/// `y = x W + b` with `W: [in, out]`, or with output features of a shape of
/// their own, `W: [in, o1, o2, ..]` and `b: [o1, o2, ..]` (the fused attention
/// projection's `[in, 3, heads, head_dim]`): `x: [.., in]` then gives
/// `[.., o1, o2, ..]`, the same values as the `[in, o1·o2·..]` Linear with
/// the same row-major weight, reshaped.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// PyTorch's default init: uniform in `±1/sqrt(in)` for weight and bias.
    pub fn new(ps: &mut ParamStore, name: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Linear> {
        let bound = 1.0 / (d_in as f64).sqrt();
        let weight = ps.uniform(&format!("{name}.weight"), [d_in, d_out], bound)?;
        let bias = if bias { Some(ps.uniform(&format!("{name}.bias"), [d_out], bound)?) } else { None };
        Ok(Linear { weight, bias })
    }

    /// GPT-style init: normal(0, std) weights, zero bias.
    pub fn new_normal(ps: &mut ParamStore, name: &str, d_in: usize, d_out: usize, std: f64) -> Result<Linear> {
        let weight = ps.normal(&format!("{name}.weight"), [d_in, d_out], std)?;
        let bias = Some(ps.constant(&format!("{name}.bias"), [d_out], 0.0)?);
        Ok(Linear { weight, bias })
    }

    /// GPT-style init with shaped output features: normal(0, std) weights
    /// `[d_in, out..]`, zero bias `[out..]`. The draws are those of
    /// [`Linear::new_normal`] with `d_out` = the product of `out`, in the same
    /// row-major order, so host and device init give the values of the flat
    /// weight.
    pub fn new_normal_shaped(ps: &mut ParamStore, name: &str, d_in: usize, out: &[usize], std: f64) -> Result<Linear> {
        let mut dims = vec![d_in];
        dims.extend_from_slice(out);
        let weight = ps.normal(&format!("{name}.weight"), dims, std)?;
        let bias = Some(ps.constant(&format!("{name}.bias"), out.to_vec(), 0.0)?);
        Ok(Linear { weight, bias })
    }

    /// In the weight's dtype, or in the autocast dtype inside a scope (bias
    /// included, as a fused `x W + b` would). The input must be floating
    /// point: integer data (raw `u8` pixels) is refused, not converted.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _layer = scope::enter_owner_of(&self.weight, 1);
        scoped(
            || Module::describe(self),
            || {
                if !x.dtype().is_float() {
                    return Err(FrontendError::DType {
                        op: "linear",
                        expected: "a floating-point input",
                        got: x.dtype(),
                    });
                }
                let dtype = amp::compute_dtype(self.weight.dtype());
                let w = &self.weight;
                if w.rank() == 2 {
                    let y = x.to_dtype(dtype)?.matmul(w)?;
                    return match &self.bias {
                        Some(b) => y.add(&b.to_dtype(dtype)?),
                        None => Ok(y),
                    };
                }
                // Shaped outputs `[in, o1, o2, ..]`.
                let xr = x.rank();
                if xr == 0 || w.rank() < 2 || x.dims()[xr - 1] != w.dims()[0] {
                    return Err(FrontendError::InnerDims {
                        op: "linear",
                        lhs: x.shape().clone(),
                        rhs: w.shape().clone(),
                        lhs_inner: x.dims().last().copied().unwrap_or(0),
                        rhs_inner: w.dims().first().copied().unwrap_or(0),
                    });
                }
                let out = &w.dims()[1..];
                let mut y_dims = x.dims()[..xr - 1].to_vec();
                y_dims.extend_from_slice(out);
                let split_out = w.sharding().is_some_and(|s| s.dims()[1..].iter().any(Option::is_some));
                if !split_out {
                    // Output features whole on every device: the flat product
                    // `x [.., in] · W [in, o1·o2·..]`, reshaped. The same
                    // values as the shaped one, and what XLA compiles best:
                    // a 2-D weight's transpose in the input gradient (`dy ·
                    // Wᵀ`) folds into the GEMM, while a weight with several
                    // free dimensions is transposed into a copy first (the
                    // tiny GPT's CPU step: +2 copies, +2 transposes). This
                    // keeps the unsharded program the one of the flat
                    // `[in, 3·dim]` qkv Linear.
                    let n = out.iter().product::<usize>();
                    let y = x.to_dtype(dtype)?.matmul(&w.reshape([w.dims()[0], n])?)?;
                    let y = match &self.bias {
                        Some(b) => y.add(&b.to_dtype(dtype)?.reshape([n])?)?,
                        None => y,
                    };
                    return y.reshape(y_dims);
                }
                // An output dimension split over a mesh axis (tensor
                // parallelism on the attention's heads): the contraction
                // `matmul` records for a 2-D weight (x's last dimension with
                // the weight's first), its free dimensions kept apart, so
                // the partitioner keeps the split on the result with no
                // communication (a reshape to the flat weight could not
                // express the split and would reshard it).
                let dims = kiln_compiler::ir::DotDims {
                    lhs_batch: vec![],
                    rhs_batch: vec![],
                    lhs_contract: vec![xr - 1],
                    rhs_contract: vec![0],
                };
                let y = x.to_dtype(dtype)?.dot_general(w, dims)?;
                match &self.bias {
                    Some(b) => y.add(&b.to_dtype(dtype)?),
                    None => Ok(y),
                }
            },
        )
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Linear::forward(self, x)
    }
    fn describe(&self) -> String {
        let d = self.weight.dims();
        match d {
            [i, o] => format!("Linear({i} -> {o})"),
            _ => format!("Linear({} -> {:?})", d[0], &d[1..]),
        }
    }
    fn own_parameters(&self) -> Vec<Tensor> {
        std::iter::once(self.weight.clone()).chain(self.bias.clone()).collect()
    }
}

/// Rows of a `[vocab, dim]` table picked by integer ids.
#[derive(Clone, Debug)]
pub struct Embedding {
    pub table: Tensor,
}

impl Embedding {
    pub fn new(ps: &mut ParamStore, name: &str, vocab: usize, dim: usize, std: f64) -> Result<Embedding> {
        Ok(Embedding { table: ps.normal(&format!("{name}.weight"), [vocab, dim], std)? })
    }

    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let _layer = scope::enter_owner_of(&self.table, 1);
        scoped(|| Module::describe(self), || self.table.index_select(ids, 0))
    }
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        Embedding::forward(self, ids)
    }
    fn describe(&self) -> String {
        format!("Embedding({}, {})", self.table.dims()[0], self.table.dims()[1])
    }
    fn own_parameters(&self) -> Vec<Tensor> {
        vec![self.table.clone()]
    }
}

/// Layer normalisation over the last dimension.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub gamma: Tensor,
    pub beta: Tensor,
    pub eps: f64,
}

impl LayerNorm {
    pub fn new(ps: &mut ParamStore, name: &str, dim: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            gamma: ps.constant(&format!("{name}.weight"), [dim], 1.0)?,
            beta: ps.constant(&format!("{name}.bias"), [dim], 0.0)?,
            eps: 1e-5,
        })
    }

    /// In f32 under autocast. Recorded as one layer-norm composite whose
    /// backward reuses the saved mean and rstd (`docs/composites.md`).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _layer = scope::enter_owner_of(&self.gamma, 1);
        scoped(
            || Module::describe(self),
            || {
                let x = amp::full_precision(x)?;
                let (gamma, beta) = (self.gamma.to_dtype(x.dtype())?, self.beta.to_dtype(x.dtype())?);
                let (xv, g, b) = (x.value("layer_norm")?, gamma.value("layer_norm")?, beta.value("layer_norm")?);
                let op = kiln_compiler::ir::Op::LayerNorm { x: xv, gamma: g, beta: b, eps_bits: self.eps.to_bits() };
                crate::engine::context::with(|c| c.push(op)).map(Tensor::wrap)
            },
        )
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        LayerNorm::forward(self, x)
    }
    fn describe(&self) -> String {
        format!("LayerNorm({})", self.gamma.dims()[0])
    }
    fn own_parameters(&self) -> Vec<Tensor> {
        vec![self.gamma.clone(), self.beta.clone()]
    }
}

/// Root-mean-square normalisation over the last dimension.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub gamma: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn new(ps: &mut ParamStore, name: &str, dim: usize) -> Result<RmsNorm> {
        Ok(RmsNorm { gamma: ps.constant(&format!("{name}.weight"), [dim], 1.0)?, eps: 1e-6 })
    }

    /// In f32 under autocast. Recorded as one RMS-norm composite whose
    /// backward reuses the saved rstd (`docs/composites.md`).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _layer = scope::enter_owner_of(&self.gamma, 1);
        scoped(
            || Module::describe(self),
            || {
                let x = amp::full_precision(x)?;
                let gamma = self.gamma.to_dtype(x.dtype())?;
                let (xv, g) = (x.value("rms_norm")?, gamma.value("rms_norm")?);
                let op = kiln_compiler::ir::Op::RmsNorm { x: xv, gamma: g, eps_bits: self.eps.to_bits() };
                crate::engine::context::with(|c| c.push(op)).map(Tensor::wrap)
            },
        )
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        RmsNorm::forward(self, x)
    }
    fn describe(&self) -> String {
        format!("RmsNorm({})", self.gamma.dims()[0])
    }
    fn own_parameters(&self) -> Vec<Tensor> {
        vec![self.gamma.clone()]
    }
}

/// Zeroes each element with probability `p` while training (scaling the rest by
/// `1/(1-p)`); draws from the in-graph generator.
pub fn dropout(x: &Tensor, p: f64, train: bool) -> Result<Tensor> {
    if !train || p == 0.0 {
        return Ok(x.clone());
    }
    if !(0.0..1.0).contains(&p) {
        return Err(FrontendError::HyperParameter { op: "dropout", name: "p", value: p, expected: "in [0, 1)" });
    }
    let u = Tensor::rand(x.dtype(), x.shape().clone())?;
    let keep = u.ge(&Tensor::full(p, x.dtype(), Shape::scalar())?)?;
    let zeros = Tensor::zeros(x.dtype(), x.shape().clone())?;
    Tensor::where_cond(&keep, &x.mul_scalar(1.0 / (1.0 - p))?, &zeros)
}

pub fn relu(x: &Tensor) -> Result<Tensor> {
    x.relu()
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    crate::api::tensor::floating("gelu_tanh", x)?;
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let inner = x.add(&x.mul(x)?.mul(x)?.mul_scalar(0.044715)?)?.mul_scalar(c)?;
    // `(0.5 x) (1 + tanh ..)`, not `0.5 (x (1 + tanh ..))` (the same value:
    // halving is exact): with the constant multiply last, XLA's GPU backend
    // fuses it into the next matmul's operand, which turns that matmul and
    // its weight-gradient matmul from cuBLAS into slower Triton GEMMs
    // (gpt2-small on the H100: 12 x 95 us instead of about 55 us).
    x.mul_scalar(0.5)?.mul(&inner.tanh()?.add_scalar(1.0)?)
}

/// GELU, exact: `x Φ(x) = 0.5 x (1 + erf(x / sqrt(2)))` (PyTorch's default).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    crate::api::tensor::floating("gelu", x)?;
    let inner = x.mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?.erf()?.add_scalar(1.0)?;
    x.mul_scalar(0.5)?.mul(&inner) // the halving first, as in `gelu_tanh`
}

/// Mean cross-entropy of `logits: [n, classes]` against integer `labels: [n]`,
/// through a stable log-softmax, in f32. With `weights: [n]`, a weighted mean
/// (padding rows weigh 0). [`cross_entropy_with`] takes options (the dtype,
/// label smoothing).
pub fn cross_entropy(logits: &Tensor, labels: &Tensor, weights: Option<&Tensor>) -> Result<Tensor> {
    cross_entropy_with(logits, labels, weights, CrossEntropyOptions::default())
}

/// Options of [`cross_entropy_with`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOptions {
    /// The dtype the loss is computed in: `None` is f32 (what training wants
    /// under autocast too); `Some(F64)` for checks against f64 references.
    pub dtype: Option<DType>,
    /// Label smoothing `eps` in `[0, 1)`: the target puts `1 - eps` on the
    /// label and spreads `eps` evenly over all classes (PyTorch's definition).
    pub label_smoothing: f64,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions { dtype: None, label_smoothing: 0.0 }
    }
}

/// [`cross_entropy`] with options. Labels must be integers (a float label
/// tensor is refused, not truncated) and logits floating point.
pub fn cross_entropy_with(
    logits: &Tensor,
    labels: &Tensor,
    weights: Option<&Tensor>,
    opts: CrossEntropyOptions,
) -> Result<Tensor> {
    let op = "cross_entropy";
    if logits.rank() != 2 || labels.rank() != 1 || labels.dims()[0] != logits.dims()[0] {
        return Err(FrontendError::LabelShape { op, logits: logits.ty().clone(), labels: labels.ty().clone() });
    }
    if !labels.dtype().is_integer() {
        return Err(FrontendError::DType { op, expected: "integer labels", got: labels.dtype() });
    }
    if !logits.dtype().is_float() {
        return Err(FrontendError::DType { op, expected: "floating-point logits", got: logits.dtype() });
    }
    let eps = opts.label_smoothing;
    if !(0.0..1.0).contains(&eps) {
        return Err(FrontendError::HyperParameter { op, name: "label_smoothing", value: eps, expected: "in [0, 1)" });
    }
    let dtype = opts.dtype.unwrap_or(DType::F32);
    if !dtype.is_float() {
        return Err(FrontendError::DType { op, expected: "a floating-point loss dtype", got: dtype });
    }
    let classes = logits.dims()[1];
    crate::engine::device_checks::check_index_range("cross_entropy", "label", labels, classes)?;
    let logits = logits.to_dtype(dtype)?;
    let logp = logits.log_softmax(-1)?;
    let onehot = one_hot(labels, classes, dtype)?;
    let target = if eps > 0.0 { onehot.mul_scalar(1.0 - eps)?.add_scalar(eps / classes as f64)? } else { onehot };
    let nll = logp.mul(&target)?.sum(&[-1], false)?.neg()?;
    match weights {
        Some(w) => {
            let w = w.to_dtype(dtype)?;
            nll.mul(&w)?.sum_all()?.div(&w.sum_all()?)
        }
        None => nll.mean_all(),
    }
}

/// Mean cross-entropy of the logits `h · tableᵀ` (an LM head tied to a
/// `[vocab, d]` embedding table) against integer `labels: [n]`, for `h: [n, d]`,
/// recorded as one composite (`docs/composites.md`): the `[n, vocab]` logits are
/// computed in blocks of tokens inside the program, forward and backward, and
/// never exist whole. Matmuls in the autocast dtype inside a scope, the softmax
/// in f32.
pub fn lm_head_cross_entropy(h: &Tensor, table: &Tensor, labels: &Tensor) -> Result<Tensor> {
    lm_head_cross_entropy_blocks(h, table, labels, LM_HEAD_BLOCK_BYTES)
}

/// The default block of [`lm_head_cross_entropy`]: 256 MiB of f32 logits.
pub const LM_HEAD_BLOCK_BYTES: u64 = 256 << 20;

/// [`lm_head_cross_entropy`] with blocks of at most `block_bytes` of f32
/// logits ([`lm_head_block_rows`] tokens). Fewer, bigger blocks mean fewer
/// kernel launches and fewer passes over dw's f32 accumulator; smaller ones a
/// smaller transient (`docs/composites.md`). Under a mesh whose `data` axis
/// splits the rows, each device makes blocks of its own rows, and
/// `block_bytes` bounds one device's block (`docs/sharding.md`, "The LM head
/// on each device's rows").
pub fn lm_head_cross_entropy_blocks(h: &Tensor, table: &Tensor, labels: &Tensor, block_bytes: u64) -> Result<Tensor> {
    for (what, t, expected, layout) in
        [("h", h, 2, "[n, d]"), ("table", table, 2, "[vocab, d]"), ("labels", labels, 1, "[n]")]
    {
        if t.rank() != expected {
            let op = "lm_head_cross_entropy";
            return Err(FrontendError::OperandRank { op, what, got: t.ty().clone(), expected, layout });
        }
    }
    crate::engine::device_checks::check_index_range("lm_head_cross_entropy", "label", labels, table.dims()[0])?;
    let dtype = amp::compute_dtype(h.dtype());
    let (h, table) = (h.to_dtype(dtype)?, table.to_dtype(dtype)?);
    let chunk = lm_head_block_rows(block_bytes, table.dims()[0]);
    let shards = crate::engine::partition::row_shards(h.dims()[0]);
    let (hv, wv, lv) = (
        h.value("lm_head_cross_entropy")?,
        table.value("lm_head_cross_entropy")?,
        labels.value("lm_head_cross_entropy")?,
    );
    let op = kiln_compiler::ir::Op::LmHeadCrossEntropy { h: hv, w: wv, labels: lv, chunk, shards };
    let nll = crate::engine::context::with(|c| c.push(op)).map(Tensor::wrap)?;
    nll.mean_all()
}

/// Tokens per block of [`lm_head_cross_entropy_blocks`]
/// ([`kiln_compiler::composite::lm_head_block_rows`]).
pub use kiln_compiler::composite::{lm_head_block_rows, LM_HEAD_BLOCK_ALIGN};

/// `[n] -> [n, classes]` one-hot rows of `dtype`.
pub fn one_hot(labels: &Tensor, classes: usize, dtype: DType) -> Result<Tensor> {
    let n = labels.dims()[0];
    let iota = Tensor::iota(labels.dtype(), [n, classes], 1)?;
    let l = labels.reshape([n, 1])?;
    iota.compare(CompareDir::Eq, &l)?.to_dtype(dtype)
}

/// Two-layer perceptron block with GELU: `dim -> hidden -> dim`.
#[derive(Clone, Debug)]
pub struct MlpBlock {
    pub fc: Linear,
    pub proj: Linear,
}

impl MlpBlock {
    pub fn new(ps: &mut ParamStore, name: &str, dim: usize, hidden: usize, std: f64, proj_std: f64) -> Result<Self> {
        Ok(MlpBlock {
            fc: Linear::new_normal(ps, &format!("{name}.fc"), dim, hidden, std)?,
            proj: Linear::new_normal(ps, &format!("{name}.proj"), hidden, dim, proj_std)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _layer = scope::enter_owner_of(&self.fc.weight, 2);
        scoped(|| Module::describe(self), || self.proj.forward(&gelu_tanh(&self.fc.forward(x)?)?))
    }
}

impl Module for MlpBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        MlpBlock::forward(self, x)
    }
    fn describe(&self) -> String {
        let d = self.fc.weight.dims();
        format!("MlpBlock({} -> {} -> {})", d[0], d[1], d[0])
    }
    fn children(&self) -> Vec<&dyn Module> {
        vec![&self.fc, &self.proj]
    }
}
