//! Bounded constant folding through the reference interpreter.
//!
//! An op whose operands are all small constants becomes the constant the
//! interpreter computes, when the result is small too (at most
//! [`MAX_FOLD_BYTES`]) and the interpreter's result is bit-exact for that op:
//! data movement (exact by construction), comparisons and selects, integer
//! and bitwise arithmetic (wrapping, as XLA), float conversions, and f32/f64
//! `+ - * /` (computed in f64 and rounded once, which is IEEE's f32 result).
//! Transcendentals, reductions and dots are never folded: the interpreter's
//! f64 results can differ from the backend's by an ulp.

use egg::Id;

use super::{Rhs, Rule};
use crate::interp::eval_op;
use crate::ir::{BinaryOp, DType, Literal, Op, ValueId};
use crate::rewrite::analysis::MAX_FOLD_BYTES;
use crate::rewrite::EGraph;

pub fn rules() -> Vec<Rule> {
    // op(c1, .., cn) = c where c is the op's value on the constants.
    vec![Rule { name: "constant-fold", algebra: "op(c1, .., cn) = eval(op, c1, .., cn)", find: fold }]
}

/// Whether the interpreter computes `op` on these dtypes bit-exactly.
fn exact(op: &Op, operand: DType, result: DType) -> bool {
    match op {
        Op::BroadcastInDim { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concatenate { .. }
        | Op::Pad { .. }
        | Op::Select { .. }
        | Op::Compare { .. } => true,
        Op::Convert { .. } => (operand.is_float() && result.is_float()) || (!operand.is_float() && !result.is_float()),
        Op::Binary { op: b, .. } => match b {
            BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul => {
                matches!(operand, DType::F32 | DType::F64) || operand.is_integer()
            }
            BinaryOp::Div => matches!(operand, DType::F32 | DType::F64),
            BinaryOp::And | BinaryOp::Or | BinaryOp::Xor => true,
            BinaryOp::Pow | BinaryOp::Max | BinaryOp::Min | BinaryOp::Rem => false,
        },
        Op::Unary { op: crate::ir::UnaryOp::Neg, .. } => true,
        _ => false,
    }
}

fn fold(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    if kids.is_empty() || eg[kids[0]].data.ty().is_none() {
        return vec![];
    }
    let lits: Option<Vec<&Literal>> = kids.iter().map(|&k| eg[k].data.constant.as_ref()).collect();
    let Some(lits) = lits else { return vec![] };
    // The op's own class holds its types; find them through an operand-free lookup
    // of the result type instead: infer again from the operand types.
    let operand_types: Vec<_> = lits.iter().map(|l| l.ty().clone()).collect();
    let Ok(outs) = crate::ir::infer::infer_types(op, &operand_types) else { return vec![] };
    if outs.len() != 1 || outs[0].size_in_bytes() > MAX_FOLD_BYTES {
        return vec![];
    }
    if !exact(op, operand_types[0].dtype, outs[0].dtype) {
        return vec![];
    }
    // Holes are numbered by operand position.
    let get = |v: ValueId| -> &Literal { lits[v.output as usize] };
    match eval_op(op, &outs, &get) {
        Ok(mut v) if v.len() == 1 => vec![Rhs::node(Op::Constant { literal: v.remove(0) }, vec![])],
        Ok(_) | Err(_) => vec![],
    }
}
