//! Tensor constructors: host data (one value for every replica), device
//! buffers, literals, scalars, broadcast constants, iotas and random draws from
//! the thread's in-graph generator.
//!
//! Invariants:
//! - Host data is not uploaded here: a step that first reads it uploads it
//!   once, and the tensor then refers to the device copy.
//! - A constant is recorded once per step for each value, dtype and shape;
//!   a value an integer dtype cannot hold exactly is an error, not truncated.
//! - Random draws happen inside the step (`api::random`): constructing one
//!   costs no host sync.

use std::rc::Rc;
use std::sync::Arc;

use kiln_compiler::ir::{BinaryOp, DType, Literal, Op, Shape, TensorType};

use super::{floating_dtype, record};
use crate::core::element::{self, Element};
use crate::core::error::{FrontendError, Result};
use crate::core::storage::{DeviceValue, Inner, State, Storage};
use crate::core::tensor::Tensor;
use crate::engine::context;

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

impl Tensor {
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
        let ty = TensorType::new(element::dtype_of(first.element_type()), first.dims());
        if let Some((r, b)) = buffers.iter().enumerate().find(|(_, b)| b.arg_type() != first.arg_type()) {
            let got = TensorType::new(element::dtype_of(b.element_type()), b.dims());
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
    pub(super) fn constant_for(op: &'static str, value: f64, dtype: DType, shape: Shape) -> Result<Tensor> {
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
}
