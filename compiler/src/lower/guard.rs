//! Programs kiln knows would crash XLA are refused before lowering.
//!
//! XLA's constant folder evaluates integer `divide` and `remainder` with the
//! host's division instruction: a zero divisor, or the signed minimum divided
//! by −1, raises SIGFPE and kills the process (seen with `xla-cpu-pjrt`
//! 0.0.1 for i8, i32 and ui32). Whether XLA folds a division depends on its
//! own simplifications (a broadcast or a reshape of a constant dividend is
//! folded first), which kiln cannot predict, so any integer division whose
//! divisor is constant and holds a zero is refused, and so is a constant
//! dividend holding the minimum over a constant divisor holding −1. Floating
//! point division is IEEE (inf/NaN) and never traps.
//!
//! "Constant" is by value, not by spelling: XLA folds a zero reached through
//! a broadcast, a reshape, a convert, a concatenate or `sub(c, c)` as it
//! folds a bare literal. The guard looks through broadcasts and reshapes
//! (which keep the set of values) and evaluates any other operand computed
//! from constants alone with the reference interpreter
//! ([`crate::composite::consts::constant_value`]: at most 64 nodes and 2^24
//! elements; a larger constant subexpression is not evaluated).
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
        let Some((divisor, divisor_whole)) = constant(g, *rhs) else { continue };
        // Only a signed dividend can overflow: the others are not decoded.
        let dividend = if dtype.is_signed_integer() { constant(g, *lhs) } else { None };
        // Operands of one node have one shape: element i meets element i,
        // unless a broadcast or reshape was looked through on either side.
        let paired = divisor_whole && dividend.as_ref().is_none_or(|(_, whole)| *whole);
        let dividend = dividend.map(|(l, _)| elements(&l));
        let trap = division_trap(dtype, dividend.as_deref(), &elements(&divisor), paired);
        let reason = match trap {
            None => continue,
            Some(DivisionTrap::ZeroDivisor { at }) => format!("the constant divisor is 0 at element {at}"),
            Some(DivisionTrap::MinOverMinusOne { min, at }) => format!("{min} / -1 overflows at element {at}"),
        };
        return Err(CompileError::TrappingDivision { op: op.name(), node: format!("%{}", id.index()), dtype, reason });
    }
    Ok(())
}

/// An integer division XLA's constant folder traps on (SIGFPE).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DivisionTrap {
    /// The divisor holds 0 at element `at`.
    ZeroDivisor { at: usize },
    /// The dividend holds the signed minimum `min` (element `at`) where the
    /// divisor holds -1.
    MinOverMinusOne { min: f64, at: usize },
}

/// Whether an integer division of `dtype` by a constant holding `divisor`
/// traps when XLA folds it; `dividend` is `None` when it is no constant.
/// With `paired` (operands of one shape), element i meets element i only;
/// without (operands seen before a broadcast, as the frontend records them),
/// any element may meet any, and `at` is the dividend's. The one rule for
/// both the lowering's guard and the frontend's check at record time.
pub fn division_trap(dtype: DType, dividend: Option<&[f64]>, divisor: &[f64], paired: bool) -> Option<DivisionTrap> {
    if !dtype.is_integer() {
        return None;
    }
    if let Some(at) = divisor.iter().position(|&v| v == 0.0) {
        return Some(DivisionTrap::ZeroDivisor { at });
    }
    // NaN (never equal) for unsigned types, which cannot overflow so.
    let min = signed_min(dtype);
    let dividend = dividend?;
    let at = if paired {
        dividend.iter().zip(divisor).position(|(&a, &b)| a == min && b == -1.0)
    } else if divisor.contains(&-1.0) {
        dividend.iter().position(|&a| a == min)
    } else {
        None
    };
    at.map(|at| DivisionTrap::MinOverMinusOne { min, at })
}

/// `v`'s value if it is constant, and whether it is `v`'s whole value in
/// `v`'s own layout (false where a broadcast or reshape was looked through:
/// then only the set of its values is known).
fn constant(g: &Graph, v: ValueId) -> Option<(Literal, bool)> {
    let x = crate::composite::consts::through_broadcasts(g, v);
    crate::composite::consts::constant_value(g, x).map(|l| (l, x == v))
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
