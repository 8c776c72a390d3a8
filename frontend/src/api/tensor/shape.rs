//! Shape ops: broadcasts, reshapes, transposes, slices (static and at run-time
//! offsets), gathers and scatters along an axis, concatenation and padding.
//!
//! Invariants:
//! - Axes may be negative (counted from the end) and are checked against the
//!   rank, naming the op.
//! - Indices read by a gather or scatter are range-checked on the device
//!   when checks are on (`engine::device_checks`), naming the op.

use kiln_compiler::ir::{Op, Shape};

use super::{axis, record};
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;

impl Tensor {
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
}
