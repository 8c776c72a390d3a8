//! Matrix products: `matmul` with numpy broadcasting of batch dimensions, and
//! `dot_general`.
//!
//! Invariant: under autocast, float operands are converted to the low dtype
//! before the product is recorded (`amp::compute_dtype`), so the product
//! computes in it.

use kiln_compiler::ir::{DotDims, Op, Shape};

use super::{broadcast_shape, record};
use crate::api::amp;
use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;

impl Tensor {
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
}

/// The operands of a matrix product in the dtype it computes in.
fn autocast_operands(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok((a.to_dtype(amp::compute_dtype(a.dtype()))?, b.to_dtype(amp::compute_dtype(b.dtype()))?))
}
