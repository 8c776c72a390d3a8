//! kiln's graph IR: element types, shapes, constants, the closed `Op` enum and
//! the `Graph` that holds a step.

mod dtype;
mod graph;
pub mod infer;
mod literal;
mod op;
mod op_kinds;
mod props;
mod shape;

pub use dtype::DType;
pub use graph::{Alias, Graph, Node, NodeId, Outputs, ValueId};
pub use literal::{bf16_from_f64, decode, f16_from_f64, Literal};
pub use op::Op;
pub use op_kinds::{
    AttentionAttrs, BinaryOp, CompareDir, DotDims, HostCopyStep, KvHeads, MemorySpace, ReduceOp, RngAlgorithm, UnaryOp,
};
pub use props::{FusionKind, OpProps};
pub use shape::{Dims, Shape, TensorType};
