//! `Tensor`'s ops: everything a training loop does with a lazy tensor,
//! one file per kind of op, each adding one `impl Tensor` block to the handle
//! defined in `core::tensor`.
//!
//! Ops never run when called: they record a node into the thread's trace and
//! return a pending tensor, after checking shapes and dtypes (errors name the op
//! and the shapes). `mark_step` runs the trace. Reading values (`to_vec`, `item`)
//! is an explicit sync. Cloning a `Tensor` clones the handle: `assign` through
//! one clone is seen by all, which is how parameters and optimizer state are
//! updated in place (and their old buffers donated).
//!
//! - `record`: binding operands into the trace and recording an op;
//! - `create`: constructors (host data, device buffers, constants, iotas,
//!   random draws);
//! - `read`: reading values to the host (explicit syncs);
//! - `assign`: pointing a handle at another value;
//! - `elementwise`: unary, binary and comparison ops, selects, clamps,
//!   conversions, and the arithmetic operators;
//! - `shape`: broadcasts, reshapes, transposes, slices, gathers, scatters,
//!   concatenation, padding;
//! - `reduce`: reductions, softmaxes, argmax, the cross-replica sum;
//! - `products`: matrix products;
//! - `multi_output`: the ops with several outputs (optimization barriers,
//!   random bits);
//! - `layout`: the tensor's sharding over the mesh;
//! - `candle`: conversions to and from candle tensors.
//!
//! Invariants:
//! - An op checks its operands' shapes and dtypes when it is recorded and
//!   names itself in the error; an op that is refused records nothing.
//! - Every op records through [`record`] or the context's `push`, so the trace
//!   (and with it the step's key and program) depends only on the ops called
//!   and their operands, in call order.
//! - A scalar a dtype cannot hold exactly is an error, never truncated.

mod assign;
mod candle;
mod create;
mod elementwise;
mod layout;
mod multi_output;
mod products;
mod read;
mod record;
mod reduce;
mod shape;

use kiln_compiler::ir::{DType, Shape};

use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;
use record::record;

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
