//! The compiler's one error type.
//!
//! Shape and dtype errors are raised when a node is added, so they name the op
//! and the offending operand types; the frontend passes them to the user as they
//! are.

use thiserror::Error;

use crate::ir::{Alias, DType, Shape, TensorType, ValueId};

#[derive(Debug, Error, Clone, PartialEq)]
pub enum CompileError {
    #[error("{op}: operand {value} is not defined in this graph")]
    UnknownValue { op: &'static str, value: ValueId },
    #[error("{op}: shapes {lhs} and {rhs} do not match")]
    ShapeMismatch { op: &'static str, lhs: Shape, rhs: Shape },
    #[error("{op}: dtypes {lhs} and {rhs} do not match")]
    DTypeMismatch { op: &'static str, lhs: DType, rhs: DType },
    #[error("{op}: dtype {dtype} is not supported ({expected})")]
    UnsupportedDType { op: &'static str, dtype: DType, expected: &'static str },
    #[error("{op}: axis {axis} is out of range for rank {rank}")]
    BadAxis { op: &'static str, axis: usize, rank: usize },
    #[error("{op}: cannot reshape {from} ({from_elems} elements) to {to} ({to_elems} elements)")]
    ReshapeSize { op: &'static str, from: Shape, to: Shape, from_elems: usize, to_elems: usize },
    #[error("{op}: {reason} (operand types: {})", fmt_types(.operands))]
    InvalidOperands { op: &'static str, reason: String, operands: Vec<TensorType> },
    #[error("constant of type {ty} needs {} bytes, got {bytes}", .ty.size_in_bytes())]
    LiteralSize { ty: TensorType, bytes: usize },
    #[error("parameter {index} added out of order: the next parameter is {expected}")]
    ParameterOrder { index: u32, expected: u32 },
    #[error("alias of parameter {} to output {}: {reason}", .alias.param, .alias.output)]
    BadAlias { alias: Alias, reason: &'static str },
    #[error("verifier: {node}: {reason}")]
    Verify { node: String, reason: String },
    #[error("text form, line {line}: {reason}")]
    Parse { line: usize, reason: String },
    /// An integer division XLA would crash on (SIGFPE in its constant folder).
    #[error("{node}: integer {op} on {dtype} would crash XLA: {reason}")]
    TrappingDivision { op: &'static str, node: String, dtype: DType, reason: String },
    #[error("unknown pass {name:?} (known passes: {known})")]
    UnknownPass { name: String, known: String },
    #[error("after pass {pass}: {source}")]
    AfterPass { pass: &'static str, source: Box<CompileError> },
    #[error("rewrite rule {rule}: {reason}")]
    Rewrite { rule: &'static str, reason: String },
    #[error("interpreter: {op}: {reason}")]
    Interpret { op: &'static str, reason: String },
    #[error("remat strategy {strategy}: {reason}")]
    Remat { strategy: &'static str, reason: String },
}

fn fmt_types(types: &[TensorType]) -> String {
    types.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}
