//! Programs kiln knows would crash XLA are refused before lowering.
//!
//! XLA's constant folder evaluates integer `divide` and `remainder` with the
//! host's division instruction: a zero divisor, or the signed minimum divided
//! by −1, raises SIGFPE and kills the process (seen with `xla-cpu-pjrt`
//! 0.0.1 for i8, i32 and ui32). Whether XLA folds a division depends on its
//! own simplifications (a broadcast or a reshape of a constant dividend is
//! folded first), which kiln cannot predict, so any integer division whose
//! divisor is a constant holding a zero is refused, and so is a constant
//! dividend holding the minimum over a constant divisor holding −1. Floating
//! point division is IEEE (inf/NaN) and never traps.
//!
//! Only nodes that will be emitted (live) are checked; the graph is read,
//! never changed.

use crate::ir::{decode, BinaryOp, DType, Graph, Literal, Op, ValueId};
use crate::CompileError;

/// Refuses the first live integer division that would trap in XLA.
pub(crate) fn refuse_trapping_division(g: &Graph, live: &[bool]) -> Result<(), CompileError> {
    for (id, node) in g.nodes() {
        if !live[id.index()] {
            continue;
        }
        let Op::Binary { op, lhs, rhs } = &node.op else { continue };
        if !matches!(op, BinaryOp::Div | BinaryOp::Rem) {
            continue;
        }
        let dtype = g.ty(*rhs).dtype;
        if !dtype.is_integer() {
            continue;
        }
        let Some(divisor) = constant(g, *rhs) else { continue };
        let values = elements(divisor);
        let refuse = |reason: String| CompileError::TrappingDivision {
            op: op.name(),
            node: format!("%{}", id.index()),
            dtype,
            reason,
        };
        if let Some(i) = values.iter().position(|&v| v == 0.0) {
            return Err(refuse(format!("the constant divisor is 0 at element {i}")));
        }
        if dtype.is_signed_integer() {
            if let Some(dividend) = constant(g, *lhs) {
                let min = signed_min(dtype);
                let pair = elements(dividend).iter().zip(&values).position(|(&a, &b)| a == min && b == -1.0);
                if let Some(i) = pair {
                    return Err(refuse(format!("{min} / -1 overflows at element {i}")));
                }
            }
        }
    }
    Ok(())
}

fn constant(g: &Graph, v: ValueId) -> Option<&Literal> {
    if let Op::Constant { literal } = &g.node(v.node).op {
        Some(literal)
    } else {
        None
    }
}

/// Every element as f64 (exact for the integer values compared here: 0, −1
/// and the signed minimums are powers of two or small).
fn elements(l: &Literal) -> Vec<f64> {
    let size = l.ty().dtype.size_in_bytes();
    l.bytes().chunks_exact(size).map(|c| decode(l.ty().dtype, c)).collect()
}

fn signed_min(dtype: DType) -> f64 {
    match dtype {
        DType::I8 => f64::from(i8::MIN),
        DType::I32 => f64::from(i32::MIN),
        DType::I64 => i64::MIN as f64,
        DType::Pred | DType::U8 | DType::U32 | DType::U64 | DType::F16 | DType::BF16 | DType::F32 | DType::F64 => {
            f64::NAN
        }
    }
}
