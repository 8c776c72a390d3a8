//! Reductions: sums, means, maxima and minima over axes, softmax and
//! log-softmax, argmax, and the sum across data-parallel replicas.
//!
//! Invariants:
//! - Under autocast a 16-bit float input is reduced in f32 (`amp`), and so is
//!   every mean of a 16-bit float, which is rounded once.
//! - An axis named twice counts once; a `pred` sum or product is refused
//!   (its meaning would be a logical or/and).

use kiln_compiler::ir::{DType, Op, ReduceOp};

use super::{axis, floating, record};
use crate::api::amp;
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;

impl Tensor {
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

    /// Sum across data-parallel replicas.
    pub fn all_reduce(&self, op: ReduceOp) -> Result<Tensor> {
        let input = self.value("all_reduce")?;
        record(Op::AllReduce { op, input })
    }
}
