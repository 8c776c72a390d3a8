//! The frontend's one error type.

use thiserror::Error;

use kiln_compiler::ir::{Shape, TensorType};
use kiln_compiler::CompileError;

#[derive(Debug, Error)]
pub enum FrontendError {
    /// A shape or dtype error raised when an op was recorded.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// Autodiff met an op it has no derivative for.
    #[error("autodiff: {op} is not differentiable with respect to operand {operand} ({ty})")]
    NotDifferentiable { op: &'static str, operand: usize, ty: TensorType },
    /// Autodiff was asked for the gradient of a non-scalar or non-float value.
    #[error("autodiff: the loss must be a floating-point scalar, got {ty}")]
    LossNotScalar { ty: TensorType },
    #[error("{op}: shapes {lhs} and {rhs} do not broadcast")]
    Broadcast { op: &'static str, lhs: Shape, rhs: Shape },
}
