//! Elementwise ops: unary math, binary arithmetic with numpy broadcasting,
//! comparisons, selects, clamps, dtype conversions, and the `+ - * /`
//! operators on `&Tensor`.
//!
//! Invariants:
//! - Two float operands of different dtypes meet in the wider one
//!   (`amp::promote`), with or without an autocast scope; other mismatches are
//!   the op's typed error.
//! - An integer division that XLA's constant folder would trap on (by a
//!   constant 0, or the minimum by -1) is refused where it is recorded.

use kiln_compiler::ir::{BinaryOp, CompareDir, DType, Op, Shape, UnaryOp, ValueId};

use super::{broadcast_shape, floating, record};
use crate::api::amp;
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;
use crate::engine::context;

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
}

/// Two float operands of different dtypes converted to the dtype they meet in;
/// anything else as it is (a mismatch is then reported by the op).
fn promote_pair(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    match amp::promote(a.dtype(), b.dtype()) {
        Some(d) if a.dtype() != b.dtype() => Ok((a.to_dtype(d)?, b.to_dtype(d)?)),
        _ => Ok((a.clone(), b.clone())),
    }
}

/// Both operands broadcast to their common shape.
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
