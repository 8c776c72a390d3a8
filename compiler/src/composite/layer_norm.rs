//! The plain expansion of the layer-norm composite (every target: XLA fuses
//! it well; the composite's value is that the backward reads the saved mean and
//! rstd instead of autodiff's per-op intermediates).

use crate::ir::{BinaryOp, DType, Graph, Literal, Op, ReduceOp, Shape, UnaryOp, ValueId};
use crate::CompileError;

type Result<T> = std::result::Result<T, CompileError>;

struct Rows<'g> {
    g: &'g mut Graph,
    /// The operand's shape `[..., d]`.
    shape: Shape,
    acc: DType,
}

impl Rows<'_> {
    fn add(&mut self, op: Op) -> Result<ValueId> {
        self.g.value(op)
    }
    fn convert(&mut self, x: ValueId, to: DType) -> Result<ValueId> {
        if self.g.ty(x).dtype == to {
            return Ok(x);
        }
        self.add(Op::Convert { input: x, to })
    }
    fn bin(&mut self, op: BinaryOp, lhs: ValueId, rhs: ValueId) -> Result<ValueId> {
        self.add(Op::Binary { op, lhs, rhs })
    }
    fn last(&self) -> usize {
        self.shape.rank() - 1
    }
    /// Mean over the last axis: `[...]`.
    fn row_mean(&mut self, x: ValueId) -> Result<ValueId> {
        let s = self.add(Op::Reduce { op: ReduceOp::Sum, input: x, axes: vec![self.last()] })?;
        let d = self.shape.dims()[self.last()] as f64;
        let ty = self.g.ty(s).clone();
        let c = self.add(Op::Constant { literal: Literal::scalar(self.acc, 1.0 / d) })?;
        let c = self.add(Op::BroadcastInDim { input: c, shape: ty.shape, dims: vec![] })?;
        self.bin(BinaryOp::Mul, s, c)
    }
    /// A `[...]` row value broadcast back over the last axis.
    fn per_row(&mut self, x: ValueId) -> Result<ValueId> {
        self.add(Op::BroadcastInDim { input: x, shape: self.shape.clone(), dims: (0..self.last()).collect() })
    }
    /// A `[d]` column value broadcast over the rows.
    fn per_col(&mut self, x: ValueId) -> Result<ValueId> {
        let x = self.convert(x, self.acc)?;
        self.add(Op::BroadcastInDim { input: x, shape: self.shape.clone(), dims: vec![self.last()] })
    }
    /// `(x - mean) · rstd` from row statistics.
    fn normalised(&mut self, xf: ValueId, mean: ValueId, rstd: ValueId) -> Result<ValueId> {
        let m = self.per_row(mean)?;
        let c = self.bin(BinaryOp::Sub, xf, m)?;
        let r = self.per_row(rstd)?;
        self.bin(BinaryOp::Mul, c, r)
    }
}

fn rows(g: &mut Graph, x: ValueId) -> Rows<'_> {
    let t = g.ty(x).clone();
    let acc = if t.dtype == DType::F64 { DType::F64 } else { DType::F32 };
    Rows { g, shape: t.shape, acc }
}

/// `[y, mean, rstd]` of `layer_norm(x, gamma, beta)`, appended to `g`.
pub(crate) fn expand_forward(
    g: &mut Graph,
    x: ValueId,
    gamma: ValueId,
    beta: ValueId,
    eps: f64,
) -> Result<[ValueId; 3]> {
    let dtype = g.ty(x).dtype;
    let mut r = rows(g, x);
    let xf = r.convert(x, r.acc)?;
    let mean = r.row_mean(xf)?;
    let mb = r.per_row(mean)?;
    let c = r.bin(BinaryOp::Sub, xf, mb)?;
    let sq = r.bin(BinaryOp::Mul, c, c)?;
    let var = r.row_mean(sq)?;
    let ty = r.g.ty(var).clone();
    let e = r.add(Op::Constant { literal: Literal::scalar(r.acc, eps) })?;
    let e = r.add(Op::BroadcastInDim { input: e, shape: ty.shape, dims: vec![] })?;
    let ve = r.bin(BinaryOp::Add, var, e)?;
    let rstd = r.add(Op::Unary { op: UnaryOp::Rsqrt, input: ve })?;
    let rb = r.per_row(rstd)?;
    let n = r.bin(BinaryOp::Mul, c, rb)?;
    let gb = r.per_col(gamma)?;
    let bb = r.per_col(beta)?;
    let scaled = r.bin(BinaryOp::Mul, n, gb)?;
    let y = r.bin(BinaryOp::Add, scaled, bb)?;
    let y = r.convert(y, dtype)?;
    let mean = r.convert(mean, DType::F32)?;
    let rstd = r.convert(rstd, DType::F32)?;
    Ok([y, mean, rstd])
}

/// `[dx, dgamma, dbeta]` of `layer_norm_grad`, appended to `g`:
/// `dx = rstd · (dŷ - mean(dŷ) - x̂ · mean(dŷ x̂))` with `dŷ = dy · gamma`.
pub(crate) fn expand_backward(
    g: &mut Graph,
    x: ValueId,
    gamma: ValueId,
    mean: ValueId,
    rstd: ValueId,
    dy: ValueId,
) -> Result<[ValueId; 3]> {
    let dtype = g.ty(x).dtype;
    let mut r = rows(g, x);
    let xf = r.convert(x, r.acc)?;
    let (mean, rstd) = (r.convert(mean, r.acc)?, r.convert(rstd, r.acc)?);
    let xhat = r.normalised(xf, mean, rstd)?;
    let dyf = r.convert(dy, r.acc)?;
    let gb = r.per_col(gamma)?;
    let dxhat = r.bin(BinaryOp::Mul, dyf, gb)?;
    let m1 = r.row_mean(dxhat)?;
    let prod = r.bin(BinaryOp::Mul, dxhat, xhat)?;
    let m2 = r.row_mean(prod)?;
    let m1b = r.per_row(m1)?;
    let m2b = r.per_row(m2)?;
    let t1 = r.bin(BinaryOp::Sub, dxhat, m1b)?;
    let t2 = r.bin(BinaryOp::Mul, xhat, m2b)?;
    let t = r.bin(BinaryOp::Sub, t1, t2)?;
    let rb = r.per_row(rstd)?;
    let dx = r.bin(BinaryOp::Mul, rb, t)?;
    let dx = r.convert(dx, dtype)?;
    let lead: Vec<usize> = (0..r.last()).collect();
    let dyx = r.bin(BinaryOp::Mul, dyf, xhat)?;
    let dgamma = r.add(Op::Reduce { op: ReduceOp::Sum, input: dyx, axes: lead.clone() })?;
    let dbeta = r.add(Op::Reduce { op: ReduceOp::Sum, input: dyf, axes: lead })?;
    let (dgamma, dbeta) = (r.convert(dgamma, dtype)?, r.convert(dbeta, dtype)?);
    Ok([dx, dgamma, dbeta])
}

/// `[y, rstd]` of `rms_norm(x, gamma)`, appended to `g`.
pub(crate) fn expand_rms_forward(g: &mut Graph, x: ValueId, gamma: ValueId, eps: f64) -> Result<[ValueId; 2]> {
    let dtype = g.ty(x).dtype;
    let mut r = rows(g, x);
    let xf = r.convert(x, r.acc)?;
    let sq = r.bin(BinaryOp::Mul, xf, xf)?;
    let ms = r.row_mean(sq)?;
    let ty = r.g.ty(ms).clone();
    let e = r.add(Op::Constant { literal: Literal::scalar(r.acc, eps) })?;
    let e = r.add(Op::BroadcastInDim { input: e, shape: ty.shape, dims: vec![] })?;
    let me = r.bin(BinaryOp::Add, ms, e)?;
    let rstd = r.add(Op::Unary { op: UnaryOp::Rsqrt, input: me })?;
    let rb = r.per_row(rstd)?;
    let n = r.bin(BinaryOp::Mul, xf, rb)?;
    let gb = r.per_col(gamma)?;
    let y = r.bin(BinaryOp::Mul, n, gb)?;
    let y = r.convert(y, dtype)?;
    let rstd = r.convert(rstd, DType::F32)?;
    Ok([y, rstd])
}

/// `[dx, dgamma]` of `rms_norm_grad`, appended to `g`:
/// `dx = rstd · (dŷ - x̂ · mean(dŷ x̂))` with `x̂ = x · rstd`, `dŷ = dy · gamma`.
pub(crate) fn expand_rms_backward(
    g: &mut Graph,
    x: ValueId,
    gamma: ValueId,
    rstd: ValueId,
    dy: ValueId,
) -> Result<[ValueId; 2]> {
    let dtype = g.ty(x).dtype;
    let mut r = rows(g, x);
    let xf = r.convert(x, r.acc)?;
    let rstd = r.convert(rstd, r.acc)?;
    let rb = r.per_row(rstd)?;
    let xhat = r.bin(BinaryOp::Mul, xf, rb)?;
    let dyf = r.convert(dy, r.acc)?;
    let gb = r.per_col(gamma)?;
    let dxhat = r.bin(BinaryOp::Mul, dyf, gb)?;
    let prod = r.bin(BinaryOp::Mul, dxhat, xhat)?;
    let m = r.row_mean(prod)?;
    let mb = r.per_row(m)?;
    let t2 = r.bin(BinaryOp::Mul, xhat, mb)?;
    let t = r.bin(BinaryOp::Sub, dxhat, t2)?;
    let dx = r.bin(BinaryOp::Mul, rb, t)?;
    let dx = r.convert(dx, dtype)?;
    let lead: Vec<usize> = (0..r.last()).collect();
    let dyx = r.bin(BinaryOp::Mul, dyf, xhat)?;
    let dgamma = r.add(Op::Reduce { op: ReduceOp::Sum, input: dyx, axes: lead })?;
    let dgamma = r.convert(dgamma, dtype)?;
    Ok([dx, dgamma])
}
