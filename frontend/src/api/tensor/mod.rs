//! `Tensor`: a lazy handle on a value of the step being recorded, or on data
//! that a finished step left on the device (or host).
//!
//! Ops never run when called: they record a node into the thread's trace and
//! return a pending tensor, after checking shapes and dtypes (errors name the op
//! and the shapes). `mark_step` runs the trace. Reading values (`to_vec`, `item`)
//! is an explicit sync. Cloning a `Tensor` clones the handle: `assign` through
//! one clone is seen by all, which is how parameters and optimizer state are
//! updated in place (and their old buffers donated).

mod layout;

use std::fmt;
use std::rc::Rc;
use std::sync::Arc;

use kiln_compiler::ir::{
    BinaryOp, CompareDir, DType, DotDims, Literal, Op, ReduceOp, RngAlgorithm, Shape, TensorType, UnaryOp, ValueId,
};

use crate::api::amp;
use crate::core::element::{self, Element};
use crate::core::error::{FrontendError, Result};
use crate::core::metrics;
use crate::engine::context::{self, DeviceValue, Inner, State, Storage};
use crate::engine::step;

#[derive(Clone)]
pub struct Tensor {
    pub(crate) inner: Rc<Inner>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &*self.inner.state.borrow() {
            State::Ready(Storage::Host(_)) => "host".to_string(),
            State::Ready(Storage::HostShards(s)) => format!("host, {} shards", s.len()),
            State::Ready(Storage::Device(d)) if d.0.len() == 1 => "device".to_string(),
            State::Ready(Storage::Device(d)) => format!("device, {} replicas", d.0.len()),
            State::Pending { value, .. } => format!("pending {value}"),
        };
        write!(f, "Tensor({}, {state})", self.inner.ty)
    }
}

/// Normalises a possibly negative axis.
fn axis(op: &'static str, a: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let i = if a < 0 { a + r } else { a };
    if (0..r).contains(&i) {
        Ok(i as usize)
    } else {
        Err(FrontendError::Axis { op, axis: a, rank })
    }
}

/// Refuses a scalar that `dtype` cannot hold exactly, for `op`: a fraction, a
/// value out of range or NaN for an integer type (NaN for `pred`, which holds
/// `value != 0`). Converting would truncate or saturate it into another
/// number, a silent wrong result (`i32` times 0.5 was 0). Float types take any
/// value and round it, as a `convert` does.
fn exact_scalar(op: &'static str, value: f64, dtype: DType) -> Result<()> {
    // [lo, end) in f64 (each bound exact), and the range as printed.
    let range = match dtype {
        DType::Pred => None,
        DType::I8 => Some((-128.0, 128.0, "[-128, 127]")),
        DType::I32 => Some((-2_147_483_648.0, 2_147_483_648.0, "[-2147483648, 2147483647]")),
        DType::I64 => Some((-(2f64.powi(63)), 2f64.powi(63), "[-2^63, 2^63 - 1]")),
        DType::U8 => Some((0.0, 256.0, "[0, 255]")),
        DType::U32 => Some((0.0, 4_294_967_296.0, "[0, 4294967295]")),
        DType::U64 => Some((0.0, 2f64.powi(64), "[0, 2^64 - 1]")),
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => return Ok(()),
    };
    let refused = match range {
        None if value.is_nan() => format!("NaN is neither true nor false ({dtype})"),
        None => return Ok(()),
        Some((lo, end, _)) if value.fract() == 0.0 && value >= lo && value < end => return Ok(()),
        Some((_, _, shown)) => format!("{value} is not a whole number in {dtype}'s range {shown}"),
    };
    Err(FrontendError::InvalidArgument {
        op,
        reason: format!("{refused}: convert the tensor to a floating-point type first"),
    })
}

/// Refuses a tensor of integers or booleans for `op`, a float-only composite,
/// by its own name (its parts would name `exp` or `log`).
pub(crate) fn floating(op: &'static str, t: &Tensor) -> Result<()> {
    floating_dtype(op, t.dtype())
}

/// [`floating`] for a dtype asked for (a random draw's).
fn floating_dtype(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(kiln_compiler::CompileError::UnsupportedDType { op, dtype, expected: "a floating-point type" }.into())
    }
}

fn record(op: Op) -> Result<Tensor> {
    context::with(|c| c.push(op)).map(Tensor::wrap)
}

/// An integer division by a constant holding 0, or of a constant holding the
/// signed minimum by a constant holding -1, is refused where it is recorded,
/// on every backend: XLA's constant folder divides with the host's
/// instruction and dies of SIGFPE on either (`kiln_compiler`'s guard refuses
/// it again before lowering, for graphs read from files), while the eager
/// backend and the interpreter would have computed -1.
fn refuse_trapping_division(op: BinaryOp, dtype: DType, lhs: ValueId, rhs: ValueId) -> Result<()> {
    use kiln_compiler::lower::{division_trap, DivisionTrap};
    let (dividend, divisor) = context::with(|c| (c.trace.constant_elements(lhs), c.trace.constant_elements(rhs)));
    let Some(divisor) = divisor else { return Ok(()) };
    // The constants as recorded, before their broadcasts: not paired.
    let what = match division_trap(dtype, dividend.as_deref(), &divisor, false) {
        None => return Ok(()),
        Some(DivisionTrap::ZeroDivisor { .. }) => "integer division by a constant holding 0".to_string(),
        Some(DivisionTrap::MinOverMinusOne { min, .. }) => {
            format!("{min} / -1 (a constant dividend holding the minimum, a divisor holding -1)")
        }
    };
    Err(FrontendError::InvalidArgument {
        op: op.name(),
        reason: format!(
            "{what} on {dtype}: XLA's constant folder crashes on it; divide floats, or by a value computed in the step"
        ),
    })
}

impl Tensor {
    pub(crate) fn wrap(inner: Rc<Inner>) -> Tensor {
        Tensor { inner }
    }

    /// Id of this tensor's value in the current trace (binding ready data as a
    /// parameter).
    pub(crate) fn value(&self, op: &'static str) -> Result<ValueId> {
        context::with(|c| c.value_of(op, &self.inner))
    }

    fn values<const N: usize>(op: &'static str, ts: [&Tensor; N]) -> Result<[ValueId; N]> {
        context::with(|c| {
            let mut out = [ValueId::from(kiln_compiler::ir::NodeId::from_index(0)); N];
            for (o, t) in out.iter_mut().zip(ts) {
                *o = c.value_of(op, &t.inner)?;
            }
            Ok(out)
        })
    }

    // ---- creation -------------------------------------------------------------

    /// A tensor holding `data` (row-major) with `shape`. The data is uploaded
    /// when a step first reads it.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::from_slice(&data, shape)
    }

    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.num_elements() {
            return Err(FrontendError::DataLength { op: "from_vec", shape, len: data.len() });
        }
        let ty = TensorType::new(T::DTYPE, shape);
        let literal = Literal::from_bytes(ty.clone(), element::to_bytes(data))?;
        Ok(Tensor::from_literal(literal))
    }

    /// A ready tensor on a device buffer of this thread's client.
    pub fn from_buffer(buffer: kiln_runtime::Buffer) -> Result<Tensor> {
        Tensor::from_replica_buffers(vec![buffer])
    }

    /// A ready tensor with one device buffer per replica (replica `r`'s on the
    /// device that runs replica `r`); the buffers must agree in type.
    pub fn from_replica_buffers(buffers: Vec<kiln_runtime::Buffer>) -> Result<Tensor> {
        let Some(first) = buffers.first() else {
            return Err(FrontendError::Empty { op: "from_replica_buffers", what: "buffer" });
        };
        let ty = TensorType::new(step::dtype_of(first.element_type()), first.dims());
        if let Some((r, b)) = buffers.iter().enumerate().find(|(_, b)| b.arg_type() != first.arg_type()) {
            let got = TensorType::new(step::dtype_of(b.element_type()), b.dims());
            let what = format!("replica {r}'s buffer");
            let (expected, got) = (Box::new(ty), Box::new(got));
            return Err(FrontendError::TypeMismatch { op: "from_replica_buffers", what, expected, got });
        }
        Ok(Tensor::wrap(Inner::new(ty, State::Ready(Storage::Device(Rc::new(DeviceValue(buffers, None)))))))
    }

    pub fn from_literal(literal: Literal) -> Tensor {
        let ty = literal.ty().clone();
        Tensor::wrap(Inner::new(ty, State::Ready(Storage::Host(Arc::new(literal)))))
    }

    pub fn scalar<T: Element>(value: T) -> Tensor {
        Tensor::from_slice(&[value], Shape::scalar()).expect("one value fills a scalar")
    }

    /// A tensor of `shape` filled with `value`, recorded as a broadcast constant
    /// (no host data; recorded once per step for each value, dtype and shape).
    /// A value an integer `dtype` cannot hold exactly (`2.5`, `1e10` for
    /// `i32`) is an error, not truncated.
    pub fn full(value: f64, dtype: DType, shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::constant_for("full", value, dtype, shape.into())
    }

    /// [`Tensor::full`] for `op`, which names a scalar `dtype` cannot hold.
    fn constant_for(op: &'static str, value: f64, dtype: DType, shape: Shape) -> Result<Tensor> {
        exact_scalar(op, value, dtype)?;
        context::with(|c| c.constant(value, dtype, &shape)).map(Tensor::wrap)
    }

    pub fn zeros(dtype: DType, shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::full(0.0, dtype, shape)
    }

    pub fn ones(dtype: DType, shape: impl Into<Shape>) -> Result<Tensor> {
        Tensor::full(1.0, dtype, shape)
    }

    /// `0, 1, ..., n-1`.
    pub fn arange(n: usize, dtype: DType) -> Result<Tensor> {
        record(Op::Iota { ty: TensorType::new(dtype, [n]), axis: 0 })
    }

    /// Values `0, 1, ...` along `axis` of `shape`.
    pub fn iota(dtype: DType, shape: impl Into<Shape>, axis: usize) -> Result<Tensor> {
        record(Op::Iota { ty: TensorType::new(dtype, shape), axis })
    }

    /// Uniform values in `[0, 1)` from the thread's in-graph generator.
    /// A floating-point `dtype` only: converted to an integer type the draws
    /// would all be 0 (and all but zero `true` as `pred`).
    pub fn rand(dtype: DType, shape: impl Into<Shape>) -> Result<Tensor> {
        floating_dtype("rand", dtype)?;
        let shape = shape.into();
        let bits = crate::api::random::next_bits(&shape)?;
        // The top 24 bits as an exact f32 fraction in [0, 1).
        let top = bits.binary_scalar(BinaryOp::Div, 256.0)?.to_dtype(DType::F32)?;
        top.mul_scalar(1.0 / 16_777_216.0)?.to_dtype(dtype)
    }

    /// Standard normal values (Box–Muller) from the thread's in-graph generator.
    /// A floating-point `dtype` only.
    pub fn randn(dtype: DType, shape: impl Into<Shape>) -> Result<Tensor> {
        floating_dtype("randn", dtype)?;
        let shape = shape.into();
        let u1 = Tensor::rand(DType::F32, shape.clone())?;
        let u2 = Tensor::rand(DType::F32, shape)?;
        // 1 - u1 lies in (0, 1], so the log is finite.
        let r = u1.neg()?.add_scalar(1.0)?.log()?.mul_scalar(-2.0)?.sqrt()?;
        let theta = u2.mul_scalar(std::f64::consts::TAU)?;
        r.mul(&theta.cos()?)?.to_dtype(dtype)
    }

    // ---- inspection -----------------------------------------------------------

    pub fn ty(&self) -> &TensorType {
        &self.inner.ty
    }

    pub fn shape(&self) -> &Shape {
        &self.inner.ty.shape
    }

    pub fn dims(&self) -> &[usize] {
        &self.inner.ty.shape.0
    }

    pub fn rank(&self) -> usize {
        self.inner.ty.shape.rank()
    }

    pub fn dtype(&self) -> DType {
        self.inner.ty.dtype
    }

    pub fn elem_count(&self) -> usize {
        self.inner.ty.shape.num_elements()
    }

    /// Whether the value still waits for `mark_step`.
    pub fn is_pending(&self) -> bool {
        matches!(&*self.inner.state.borrow(), State::Pending { .. })
    }

    /// The trace value a pending tensor stands for (its epoch and id), to
    /// tell whether it was reassigned since (`ParamStore::materialize`).
    pub(crate) fn pending_value(&self) -> Option<(u64, ValueId)> {
        match &*self.inner.state.borrow() {
            State::Pending { epoch, value } => Some((*epoch, *value)),
            State::Ready(_) => None,
        }
    }

    /// Whether the data lives on the device (after a step produced or read it).
    pub fn is_on_device(&self) -> bool {
        matches!(&*self.inner.state.borrow(), State::Ready(Storage::Device(_)))
    }

    /// Names this tensor in kiln's messages (a recompile explanation says
    /// "input 'images' changed ..."). Returns the tensor, for chaining.
    pub fn with_name(self, name: &str) -> Tensor {
        *self.inner.name.borrow_mut() = Some(Rc::from(name));
        self
    }

    /// The name given by [`Tensor::with_name`] (or a `ParamStore`).
    pub fn name(&self) -> Option<String> {
        self.inner.name.borrow().as_deref().map(str::to_string)
    }

    /// Same underlying tensor (handles compare by identity).
    pub fn same(&self, other: &Tensor) -> bool {
        Rc::ptr_eq(&self.inner, &other.inner)
    }

    // ---- reading (explicit syncs) --------------------------------------------

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
            context::Backend::Eager => crate::engine::eager::read_pending(&c.trace, &self.inner),
            context::Backend::Pjrt | context::Backend::Reference => Ok(None),
        })? {
            return Ok(vec![bytes]);
        }
        if self.is_pending() {
            metrics::update(|m| m.forced_syncs += 1);
            tracing::warn!(tensor = %self.ty(), "kiln: reading a pending tensor forces the step to run now");
            crate::core::warnings::show_once(crate::core::warnings::Warning::ForcedSync, || {
                format!("reading a pending {} forces the step to run now (read values after mark_step)", self.ty())
            });
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
                None => crate::engine::executor::download(&value, pick(value.0.len())),
            },
        }
    }

    // ---- assignment -----------------------------------------------------------

    /// Makes this handle (and its clones) refer to `value` from now on. The
    /// old data, if nothing else holds it, is donated to the step that computes
    /// `value`. Types must match.
    pub fn assign(&self, value: &Tensor) -> Result<()> {
        if value.ty() != self.ty() {
            return Err(FrontendError::TypeMismatch {
                op: "assign",
                what: "the assigned value".into(),
                expected: self.ty().clone().into(),
                got: value.ty().clone().into(),
            });
        }
        let new_state = match &*value.inner.state.borrow() {
            State::Ready(s) => State::Ready(s.clone()),
            State::Pending { epoch, value } => State::Pending { epoch: *epoch, value: *value },
        };
        // Under a mesh, buffers in another layout come back through the host.
        let new_state = match new_state {
            State::Ready(s) => State::Ready(crate::engine::partition::relayout(&value.inner, &self.inner, s)?),
            pending @ State::Pending { .. } => pending,
        };
        let pending = matches!(new_state, State::Pending { .. });
        crate::engine::undo_assigns::before_assign(&self.inner);
        *self.inner.state.borrow_mut() = new_state;
        self.inner.bound.set(None);
        if pending {
            context::with(|c| c.track(&self.inner));
        }
        Ok(())
    }

    /// A new handle on this tensor's current value in the step being recorded
    /// (binding ready data as a parameter of the step), which later `assign`s
    /// to `self` do not move: the "before" of an update that may be undone.
    /// Drop it before `mark_step`, or the step also outputs that value.
    pub(crate) fn snapshot(&self) -> Result<Tensor> {
        let v = self.value("snapshot")?;
        Ok(Tensor::wrap(context::with(|c| c.pending(v))))
    }

    // ---- elementwise ----------------------------------------------------------

    pub fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        let input = self.value(op.name())?;
        record(Op::Unary { op, input })
    }

    pub fn neg(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg)
    }
    pub fn abs(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Abs)
    }
    pub fn exp(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Exp)
    }
    pub fn log(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log)
    }
    pub fn log1p(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log1p)
    }
    pub fn expm1(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Expm1)
    }
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Tanh)
    }
    pub fn sigmoid(&self) -> Result<Tensor> {
        floating("sigmoid", self)?;
        self.unary(UnaryOp::Logistic)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sqrt)
    }
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Rsqrt)
    }
    pub fn sin(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sin)
    }
    pub fn cos(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Cos)
    }
    pub fn floor(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Floor)
    }
    pub fn ceil(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Ceil)
    }
    pub fn sign(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sign)
    }
    pub fn logical_not(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Not)
    }
    pub fn erf(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Erf)
    }
    pub fn square(&self) -> Result<Tensor> {
        self.mul(self)
    }
    pub fn relu(&self) -> Result<Tensor> {
        self.binary_scalar(BinaryOp::Max, 0.0)
    }

    /// Binary op with numpy broadcasting; two float dtypes meet in the wider
    /// one ([`amp::promote`]).
    pub fn binary(&self, op: BinaryOp, rhs: &Tensor) -> Result<Tensor> {
        let (a, b) = promote_pair(self, rhs)?;
        let (a, b) = broadcast_pair(op.name(), &a, &b)?;
        let [lhs, rhs] = Tensor::values(op.name(), [&a, &b])?;
        if matches!(op, BinaryOp::Div | BinaryOp::Rem) && a.dtype().is_integer() {
            refuse_trapping_division(op, a.dtype(), lhs, rhs)?;
        }
        record(Op::Binary { op, lhs, rhs })
    }

    /// Binary op with a scalar of this tensor's dtype.
    pub fn binary_scalar(&self, op: BinaryOp, value: f64) -> Result<Tensor> {
        let name = match op {
            BinaryOp::Add => "add_scalar",
            BinaryOp::Mul => "mul_scalar",
            BinaryOp::Pow => "powf",
            other => other.name(),
        };
        let s = Tensor::constant_for(name, value, self.dtype(), self.shape().clone())?;
        self.binary(op, &s)
    }

    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Add, rhs)
    }
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Sub, rhs)
    }
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Mul, rhs)
    }
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Div, rhs)
    }
    pub fn pow(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Pow, rhs)
    }
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Max, rhs)
    }
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Min, rhs)
    }
    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.binary_scalar(BinaryOp::Add, v)
    }
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.binary_scalar(BinaryOp::Mul, v)
    }
    pub fn powf(&self, v: f64) -> Result<Tensor> {
        self.binary_scalar(BinaryOp::Pow, v)
    }

    /// Elementwise comparison with broadcasting; the result is `pred`.
    pub fn compare(&self, dir: CompareDir, rhs: &Tensor) -> Result<Tensor> {
        let (a, b) = promote_pair(self, rhs)?;
        let (a, b) = broadcast_pair("compare", &a, &b)?;
        let [lhs, rhs] = Tensor::values("compare", [&a, &b])?;
        record(Op::Compare { dir, lhs, rhs })
    }
    pub fn eq(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CompareDir::Eq, rhs)
    }
    pub fn ne(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CompareDir::Ne, rhs)
    }
    pub fn lt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CompareDir::Lt, rhs)
    }
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CompareDir::Le, rhs)
    }
    pub fn gt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CompareDir::Gt, rhs)
    }
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        self.compare(CompareDir::Ge, rhs)
    }

    /// `cond ? on_true : on_false`, all three broadcast to a common shape.
    pub fn where_cond(cond: &Tensor, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        if cond.dtype() != DType::Pred {
            return Err(FrontendError::DType { op: "where", expected: "i1", got: cond.dtype() });
        }
        let (on_true, on_false) = promote_pair(on_true, on_false)?;
        let shape = broadcast_shape("where", cond.shape(), on_true.shape())?;
        let shape = broadcast_shape("where", &shape, on_false.shape())?;
        let (c, t, f) =
            (cond.broadcast_to(shape.clone())?, on_true.broadcast_to(shape.clone())?, on_false.broadcast_to(shape)?);
        let [pred, on_true, on_false] = Tensor::values("select", [&c, &t, &f])?;
        record(Op::Select { pred, on_true, on_false })
    }

    /// The same values with no gradient path back to `self`, recorded as
    /// `clamp(self, 0, self)` (`min(max(0, v), v) = v` for every `v`, NaN
    /// included): clamp's derivative reaches only its middle operand, here a
    /// constant. For shifts whose derivative is zero in exact arithmetic
    /// (like the max in `log_softmax`).
    pub fn without_grad(&self) -> Result<Tensor> {
        let zero = Tensor::zeros(self.dtype(), self.shape().clone())?;
        let [min, input, max] = Tensor::values("clamp", [self, &zero, self])?;
        record(Op::Clamp { min, input, max })
    }

    /// Clamps into `[lo, hi]`.
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        let lo = Tensor::constant_for("clamp", lo, self.dtype(), Shape::scalar())?;
        let hi = Tensor::constant_for("clamp", hi, self.dtype(), Shape::scalar())?;
        let [min, input, max] = Tensor::values("clamp", [&lo, self, &hi])?;
        record(Op::Clamp { min, input, max })
    }

    /// The same values in dtype `to`. A transpose recorded in this step is
    /// converted before it is transposed (`x.t().to_dtype(d)` records
    /// `transpose(convert(x))`): the same values, and the converted operand
    /// in its own layout, which the composites read (an LM head's table, an
    /// attention's keys under autocast: `docs/composites.md`).
    pub fn to_dtype(&self, to: DType) -> Result<Tensor> {
        if to == self.dtype() {
            return Ok(self.clone());
        }
        let input = self.value("convert")?;
        let transposed = context::with(|c| match &c.trace.graph.node(input.node).op {
            Op::Transpose { input, perm } if self.is_pending() => Some((*input, perm.clone())),
            _ => None,
        });
        if let Some((source, perm)) = transposed {
            let converted = context::with(|c| c.push(Op::Convert { input: source, to })).map(Tensor::wrap)?;
            let input = converted.value("transpose")?;
            return record(Op::Transpose { input, perm });
        }
        record(Op::Convert { input, to })
    }

    // ---- shape ----------------------------------------------------------------

    /// Broadcasts to `shape` with numpy rules (trailing alignment).
    pub fn broadcast_to(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        let (r, n) = (self.rank(), shape.rank());
        let fits = r <= n && self.dims().iter().zip(&shape.0[n - r..]).all(|(&a, &b)| a == b || a == 1);
        if !fits {
            return Err(FrontendError::Broadcast { op: "broadcast_to", lhs: self.shape().clone(), rhs: shape });
        }
        let input = self.value("broadcast_in_dim")?;
        record(Op::BroadcastInDim { input, shape, dims: (n - r..n).collect() })
    }

    /// Broadcast with an explicit dimension map (`dims[i]` is where input
    /// dimension `i` goes).
    pub fn broadcast_in_dim(&self, shape: impl Into<Shape>, dims: Vec<usize>) -> Result<Tensor> {
        let input = self.value("broadcast_in_dim")?;
        record(Op::BroadcastInDim { input, shape: shape.into(), dims })
    }

    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        let input = self.value("reshape")?;
        record(Op::Reshape { input, shape })
    }

    /// Collapses dimensions `start..` into one: `flatten_from(1)` of a
    /// `[b, c, h, w]` tensor is `[b, c·h·w]`. `start` must name a dimension.
    pub fn flatten_from(&self, start: usize) -> Result<Tensor> {
        if start >= self.rank() {
            return Err(FrontendError::InvalidArgument {
                op: "flatten_from",
                reason: format!("start {start} is not a dimension of {} (rank {})", self.ty(), self.rank()),
            });
        }
        let mut dims = self.dims()[..start].to_vec();
        dims.push(self.dims()[start..].iter().product());
        self.reshape(dims)
    }

    /// Result dimension `i` is input dimension `perm[i]`.
    pub fn permute(&self, perm: Vec<usize>) -> Result<Tensor> {
        let input = self.value("transpose")?;
        record(Op::Transpose { input, perm })
    }

    /// Swaps two dimensions.
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor> {
        let (a, b) = (axis("transpose", a, self.rank())?, axis("transpose", b, self.rank())?);
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(perm)
    }

    /// Transpose of a matrix (last two dimensions).
    pub fn t(&self) -> Result<Tensor> {
        self.transpose(-2, -1)
    }

    /// `len` entries of `axis` from `start`.
    pub fn narrow(&self, ax: isize, start: usize, len: usize) -> Result<Tensor> {
        let ax = axis("narrow", ax, self.rank())?;
        let size = self.dims()[ax];
        let end = start.checked_add(len).filter(|&e| e <= size).ok_or_else(|| FrontendError::InvalidArgument {
            op: "narrow",
            reason: format!("start {start} and length {len} run past dimension {ax} of {}", self.ty()),
        })?;
        let mut s = vec![0; self.rank()];
        let mut l = self.dims().to_vec();
        s[ax] = start;
        l[ax] = end;
        self.slice(s, l, vec![1; self.rank()])
    }

    pub fn slice(&self, start: Vec<usize>, limit: Vec<usize>, stride: Vec<usize>) -> Result<Tensor> {
        let input = self.value("slice")?;
        record(Op::Slice { input, start, limit, stride })
    }

    /// Rows of `axis` picked by the integer tensor `indices` (embedding lookup).
    pub fn index_select(&self, indices: &Tensor, ax: isize) -> Result<Tensor> {
        let ax = axis("gather", ax, self.rank())?;
        crate::engine::device_checks::check_index_range("gather", "index", indices, self.dims()[ax])?;
        let [operand, indices] = Tensor::values("gather", [self, indices])?;
        record(Op::Gather { operand, indices, axis: ax })
    }

    /// Adds `updates` into a copy of `self` at the rows `indices` of `axis`.
    /// An index outside the axis is reported after the step, as for
    /// [`Tensor::index_select`] (XLA would drop its update, and the gradient
    /// would still reach it through a clamped gather).
    pub fn index_add(&self, indices: &Tensor, updates: &Tensor, ax: isize) -> Result<Tensor> {
        let ax = axis("index_add", ax, self.rank())?;
        crate::engine::device_checks::check_index_range("index_add", "index", indices, self.dims()[ax])?;
        let [operand, indices, updates] = Tensor::values("scatter_add", [self, indices, updates])?;
        record(Op::ScatterAdd { operand, indices, updates, axis: ax })
    }

    /// Slice starting at runtime indices (scalar s32 tensors), of static `sizes`.
    pub fn dynamic_slice(&self, starts: &[Tensor], sizes: Vec<usize>) -> Result<Tensor> {
        let input = self.value("dynamic_slice")?;
        let starts = starts.iter().map(|s| s.value("dynamic_slice")).collect::<Result<Vec<_>>>()?;
        record(Op::DynamicSlice { input, starts, sizes })
    }

    pub fn dynamic_update_slice(&self, update: &Tensor, starts: &[Tensor]) -> Result<Tensor> {
        let [input, update] = Tensor::values("dynamic_update_slice", [self, update])?;
        let starts = starts.iter().map(|s| s.value("dynamic_update_slice")).collect::<Result<Vec<_>>>()?;
        record(Op::DynamicUpdateSlice { input, update, starts })
    }

    pub fn cat(tensors: &[Tensor], ax: isize) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return Err(FrontendError::Empty { op: "cat", what: "tensor" });
        };
        let ax = axis("concatenate", ax, first.rank())?;
        let inputs = tensors.iter().map(|t| t.value("concatenate")).collect::<Result<Vec<_>>>()?;
        record(Op::Concatenate { inputs, axis: ax })
    }

    pub fn pad(&self, value: f64, low: Vec<i64>, high: Vec<i64>) -> Result<Tensor> {
        let v = Tensor::constant_for("pad", value, self.dtype(), Shape::scalar())?;
        let [input, value] = Tensor::values("pad", [self, &v])?;
        let interior = vec![0; self.rank()];
        record(Op::Pad { input, value, low, high, interior })
    }

    // ---- reductions -----------------------------------------------------------

    /// Reduces over `axes`; under autocast a 16-bit float input is reduced in
    /// f32 (see [`crate::api::amp`]).
    pub fn reduce(&self, op: ReduceOp, axes: &[isize], keep_dims: bool) -> Result<Tensor> {
        if self.dtype() == DType::Pred && matches!(op, ReduceOp::Sum | ReduceOp::Prod) {
            return Err(FrontendError::InvalidArgument {
                op: op.name(),
                reason: format!(
                    "{} is pred, whose {} is a logical {}: convert it first (to_dtype(DType::I32)) to count or multiply",
                    self.ty(),
                    op.name(),
                    if op == ReduceOp::Sum { "or" } else { "and" }
                ),
            });
        }
        let x = amp::full_precision(self)?;
        // Named as called (`sum`, `max`, ...).
        let mut ax = axes.iter().map(|&a| axis(op.name(), a, self.rank())).collect::<Result<Vec<_>>>()?;
        ax.sort_unstable();
        ax.dedup();
        let input = x.value(op.name())?;
        let r = record(Op::Reduce { op, input, axes: ax.clone() })?;
        if keep_dims {
            let dims: Vec<usize> =
                self.dims().iter().enumerate().map(|(i, &d)| if ax.contains(&i) { 1 } else { d }).collect();
            r.reshape(dims)
        } else {
            Ok(r)
        }
    }

    pub fn sum(&self, axes: &[isize], keep_dims: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, axes, keep_dims)
    }

    /// Sum of every element (a scalar).
    pub fn sum_all(&self) -> Result<Tensor> {
        let axes: Vec<isize> = (0..self.rank() as isize).collect();
        self.sum(&axes, false)
    }

    /// Mean over `axes`; an axis named twice (`&[1, -1]` on a rank-2 tensor)
    /// counts once, as in the sum. Floating-point tensors only: an integer
    /// mean would round (convert with [`Tensor::to_dtype`] first). A 16-bit
    /// float mean is summed in f32 and rounded once, as PyTorch does: the
    /// sum of 100,000 f16 ones overflows f16 (the mean was inf). Under
    /// autocast the result stays f32, as every reduction's does.
    pub fn mean(&self, axes: &[isize], keep_dims: bool) -> Result<Tensor> {
        floating("mean", self)?;
        let mut ax = axes.iter().map(|&a| axis("mean", a, self.rank())).collect::<Result<Vec<_>>>()?;
        ax.sort_unstable();
        ax.dedup();
        let count: usize = ax.iter().map(|&a| self.dims()[a]).product();
        let narrow = matches!(self.dtype(), DType::F16 | DType::BF16);
        let x = if narrow { self.to_dtype(DType::F32)? } else { self.clone() };
        let m = x.sum(axes, keep_dims)?.mul_scalar(1.0 / count as f64)?;
        if narrow && amp::autocast_dtype().is_none() {
            m.to_dtype(self.dtype())
        } else {
            Ok(m)
        }
    }

    pub fn mean_all(&self) -> Result<Tensor> {
        let axes: Vec<isize> = (0..self.rank() as isize).collect();
        self.mean(&axes, false)
    }

    pub fn max(&self, axes: &[isize], keep_dims: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Max, axes, keep_dims)
    }

    pub fn min(&self, axes: &[isize], keep_dims: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Min, axes, keep_dims)
    }

    /// Numerically stable softmax along `axis` (in f32 under autocast).
    pub fn softmax(&self, ax: isize) -> Result<Tensor> {
        floating("softmax", self)?;
        axis("softmax", ax, self.rank())?;
        let x = amp::full_precision(self)?;
        let m = x.max(&[ax], true)?;
        let e = x.sub(&m)?.exp()?;
        e.div(&e.sum(&[ax], true)?)
    }

    /// `log(softmax(x))` via the log-sum-exp trick (in f32 under autocast).
    /// The shift `m = max(x)` is taken [`Tensor::without_grad`]: the result
    /// does not depend on it (`d/dm (x - m - log Σ exp(x - m)) = 0`), and
    /// differentiating through it costs the backward two more passes over
    /// the logits (a compare with the max, a count of the rows' maxima). On
    /// the H200, gpt2-small's step with explicit logits ran 1.06 ms faster
    /// without them and held 1.57 GB less (XLA had kept the f32 `exp` of the
    /// logits for that path; `benches/RESULTS.md`, "`log_softmax`'s max shift
    /// without a gradient").
    pub fn log_softmax(&self, ax: isize) -> Result<Tensor> {
        floating("log_softmax", self)?;
        axis("log_softmax", ax, self.rank())?;
        let x = amp::full_precision(self)?;
        let m = x.max(&[ax], true)?.without_grad()?;
        let shifted = x.sub(&m)?;
        let lse = shifted.exp()?.sum(&[ax], true)?.log()?;
        shifted.sub(&lse)
    }

    /// Index of the largest entry along `axis` (s32; ties pick the first, and
    /// a NaN counts as the largest, as in PyTorch and JAX). An empty axis has
    /// no largest entry and is an error.
    pub fn argmax(&self, ax: isize) -> Result<Tensor> {
        let a = axis("argmax", ax, self.rank())?;
        let n = self.dims()[a];
        if n == 0 || n > i32::MAX as usize {
            return Err(FrontendError::InvalidArgument {
                op: "argmax",
                reason: format!("axis {a} of {} has {n} entries: an i32 index needs 1 to 2^31 - 1", self.ty()),
            });
        }
        let m = self.max(&[ax], true)?;
        let mut hit = self.eq(&m)?;
        if self.dtype().is_float() {
            // A row with a NaN answers its first NaN: its max is NaN, which
            // equals nothing (before max propagated NaN on the CPU plugin,
            // argmax of [5, 1, NaN] read 0).
            let nan = self.ne(self)?;
            let any = nan.to_dtype(DType::I32)?.max(&[ax], true)?.gt(&Tensor::full(0.0, DType::I32, [])?)?;
            hit = Tensor::where_cond(&any, &nan, &hit)?;
        }
        let idx = Tensor::iota(DType::I32, self.shape().clone(), a)?;
        let big = Tensor::full(self.dims()[a] as f64, DType::I32, self.shape().clone())?;
        Tensor::where_cond(&hit, &idx, &big)?.min(&[ax], false)
    }

    // ---- products -------------------------------------------------------------

    /// Matrix product over the last two dimensions with numpy broadcasting of
    /// leading (batch) dimensions; a 2-D rhs is shared by every batch. Under
    /// autocast, float operands are converted to the low dtype first.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let (a, b) = autocast_operands(self, rhs)?;
        a.matmul_as_is(&b)
    }

    fn matmul_as_is(&self, rhs: &Tensor) -> Result<Tensor> {
        let (lr, rr) = (self.rank(), rhs.rank());
        for t in [self, rhs] {
            if t.rank() < 2 {
                return Err(FrontendError::Rank { op: "matmul", expected: 2, got: t.ty().clone() });
            }
        }
        let (lhs_inner, rhs_inner) = (self.dims()[lr - 1], rhs.dims()[rr - 2]);
        if lhs_inner != rhs_inner {
            return Err(FrontendError::InnerDims {
                op: "matmul",
                lhs: self.shape().clone(),
                rhs: rhs.shape().clone(),
                lhs_inner,
                rhs_inner,
            });
        }
        if rr == 2 {
            // [..., m, k] x [k, n]: contract the last lhs dim with rhs dim 0; the
            // free lhs dims lead the result, so no batching is needed.
            let [lhs, r] = Tensor::values("dot_general", [self, rhs])?;
            let dims =
                DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![lr - 1], rhs_contract: vec![0] };
            return record(Op::DotGeneral { lhs, rhs: r, dims });
        }
        let batch =
            broadcast_shape("matmul", &Shape::from(&self.dims()[..lr - 2]), &Shape::from(&rhs.dims()[..rr - 2]))?;
        let nb = batch.rank();
        let mut ls = batch.0.to_vec();
        ls.extend(&self.dims()[lr - 2..]);
        let mut rs = batch.0.to_vec();
        rs.extend(&rhs.dims()[rr - 2..]);
        let (a, b) = (self.broadcast_to(ls)?, rhs.broadcast_to(rs)?);
        let [lhs, r] = Tensor::values("dot_general", [&a, &b])?;
        let dims = DotDims {
            lhs_batch: (0..nb).collect(),
            rhs_batch: (0..nb).collect(),
            lhs_contract: vec![nb + 1],
            rhs_contract: vec![nb],
        };
        record(Op::DotGeneral { lhs, rhs: r, dims })
    }

    /// `stablehlo.dot_general` (operands autocast like [`Tensor::matmul`]).
    pub fn dot_general(&self, rhs: &Tensor, dims: DotDims) -> Result<Tensor> {
        let (a, b) = autocast_operands(self, rhs)?;
        let [lhs, r] = Tensor::values("dot_general", [&a, &b])?;
        record(Op::DotGeneral { lhs, rhs: r, dims })
    }

    /// Sum across data-parallel replicas.
    pub fn all_reduce(&self, op: ReduceOp) -> Result<Tensor> {
        let input = self.value("all_reduce")?;
        record(Op::AllReduce { op, input })
    }

    /// Fences values so XLA does not move computation across them.
    pub fn optimization_barrier(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
        let inputs = tensors.iter().map(|t| t.value("optimization_barrier")).collect::<Result<Vec<_>>>()?;
        context::with(|c| {
            let id = c.trace.graph.add(Op::OptimizationBarrier { inputs })?;
            Ok((0..tensors.len()).map(|i| Tensor::wrap(c.pending(ValueId::new(id, i as u32)))).collect())
        })
    }

    /// Records a `rng_bit_generator`; returns `(new_state, bits)`.
    pub(crate) fn rng_bit_generator(state: &Tensor, ty: TensorType) -> Result<(Tensor, Tensor)> {
        let s = state.value("rng_bit_generator")?;
        context::with(|c| {
            let id = c.trace.graph.add(Op::RngBitGenerator { algorithm: RngAlgorithm::ThreeFry, state: s, ty })?;
            Ok((Tensor::wrap(c.pending(ValueId::new(id, 0))), Tensor::wrap(c.pending(ValueId::new(id, 1)))))
        })
    }
}

/// Numpy broadcast of two shapes.
pub(crate) fn broadcast_shape(op: &'static str, a: &Shape, b: &Shape) -> Result<Shape> {
    let n = a.rank().max(b.rank());
    let mut out = vec![0; n];
    for (i, o) in out.iter_mut().enumerate() {
        let da = if i + a.rank() >= n { a.0[i + a.rank() - n] } else { 1 };
        let db = if i + b.rank() >= n { b.0[i + b.rank() - n] } else { 1 };
        *o = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return Err(FrontendError::Broadcast { op, lhs: a.clone(), rhs: b.clone() }),
        };
    }
    Ok(Shape::new(out))
}

/// Two float operands of different dtypes converted to the dtype they meet in;
/// anything else as it is (a mismatch is then reported by the op).
fn promote_pair(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    match amp::promote(a.dtype(), b.dtype()) {
        Some(d) if a.dtype() != b.dtype() => Ok((a.to_dtype(d)?, b.to_dtype(d)?)),
        _ => Ok((a.clone(), b.clone())),
    }
}

/// The operands of a matrix product in the dtype it computes in.
fn autocast_operands(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok((a.to_dtype(amp::compute_dtype(a.dtype()))?, b.to_dtype(amp::compute_dtype(b.dtype()))?))
}

fn broadcast_pair(op: &'static str, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    if a.shape() == b.shape() {
        return Ok((a.clone(), b.clone()));
    }
    let shape = broadcast_shape(op, a.shape(), b.shape())?;
    Ok((a.broadcast_to(shape.clone())?, b.broadcast_to(shape)?))
}

macro_rules! binop {
    ($trait:ident, $method:ident, $op:expr) => {
        impl std::ops::$trait<&Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                self.binary($op, rhs)
            }
        }
        impl std::ops::$trait<f64> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: f64) -> Result<Tensor> {
                self.binary_scalar($op, rhs)
            }
        }
    };
}

binop!(Add, add, BinaryOp::Add);
binop!(Sub, sub, BinaryOp::Sub);
binop!(Mul, mul, BinaryOp::Mul);
binop!(Div, div, BinaryOp::Div);
