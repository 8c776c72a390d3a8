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
//!
//! Elementwise ops on splats (splat constants or broadcast scalars, of any
//! size) fold to the scalar result broadcast; data movement of a splat is not
//! folded (the result is the same splat, spelled differently).

use egg::Id;

use super::{hole, splat_bits, Rhs, Rule};
use crate::interp::eval_op;
use crate::ir::{BinaryOp, DType, Literal, Op, TensorType, ValueId};
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
            BinaryOp::And | BinaryOp::Or | BinaryOp::Xor | BinaryOp::ShiftRightLogical => true,
            BinaryOp::Pow | BinaryOp::Max | BinaryOp::Min | BinaryOp::Rem => false,
        },
        Op::Unary { op: crate::ir::UnaryOp::Neg, .. } => true,
        _ => false,
    }
}

fn elementwise(op: &Op) -> bool {
    matches!(op, Op::Unary { .. } | Op::Binary { .. } | Op::Compare { .. } | Op::Select { .. } | Op::Convert { .. })
}

fn fold(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    if kids.is_empty() || kids.iter().any(|&k| eg[k].data.ty().is_none()) {
        return vec![];
    }
    if elementwise(op) {
        if let Some(rhs) = fold_splats(eg, op, kids) {
            return vec![rhs];
        }
    }
    let lits: Option<Vec<Literal>> = kids.iter().map(|&k| literal(eg, k)).collect();
    let Some(lits) = lits else { return vec![] };
    // Moving a splat gives a splat: a change of spelling, not of work (and
    // `broadcast_in_dim` of a scalar is the splat's canonical form).
    if !elementwise(op) && lits.iter().all(|l| l.is_splat()) {
        return vec![];
    }
    let operand_types: Vec<_> = lits.iter().map(|l| l.ty().clone()).collect();
    let Ok(outs) = crate::ir::infer::infer_types(op, &operand_types) else { return vec![] };
    if outs.len() != 1 || outs[0].size_in_bytes() > MAX_FOLD_BYTES {
        return vec![];
    }
    if !exact(op, operand_types[0].dtype, outs[0].dtype) {
        return vec![];
    }
    // Holes are numbered by operand position.
    let get = |v: ValueId| -> &Literal { &lits[v.output as usize] };
    match eval_op(op, &outs, &get) {
        Ok(mut v) if v.len() == 1 => vec![Rhs::node(Op::Constant { literal: v.remove(0) }, vec![])],
        Ok(_) | Err(_) => vec![],
    }
}

/// The value of class `k` when it is a small constant or a small broadcast splat.
fn literal(eg: &EGraph, k: Id) -> Option<Literal> {
    if let Some(l) = &eg[k].data.constant {
        return Some(l.clone());
    }
    let t = eg[k].data.ty()?;
    if t.size_in_bytes() > MAX_FOLD_BYTES {
        return None;
    }
    let bits = splat_bits(eg, k)?;
    Literal::from_bytes(t.clone(), bits.repeat(t.shape.num_elements())).ok()
}

/// An elementwise op on operands that are each one value everywhere (splat
/// constants or broadcast scalars, any size): the op on the scalars,
/// broadcast to the result's shape.
fn fold_splats(eg: &EGraph, op: &Op, kids: &[Id]) -> Option<Rhs> {
    let mut scalars = Vec::with_capacity(kids.len());
    for &k in kids {
        let t = eg[k].data.ty()?;
        let bits = splat_bits(eg, k)?;
        scalars.push(Literal::from_bytes(TensorType::scalar(t.dtype), bits).ok()?);
    }
    let types: Vec<TensorType> = scalars.iter().map(|l| l.ty().clone()).collect();
    let outs = crate::ir::infer::infer_types(op, &types).ok()?;
    if outs.len() != 1 || !exact(op, types[0].dtype, outs[0].dtype) {
        return None;
    }
    let get = |v: ValueId| -> &Literal { &scalars[v.output as usize] };
    let value = eval_op(op, &outs, &get).ok()?.pop()?;
    let full =
        crate::ir::infer::infer_types(op, &kids.iter().map(|&k| eg[k].data.ty().cloned()).collect::<Option<Vec<_>>>()?)
            .ok()?;
    let constant = Rhs::node(Op::Constant { literal: value }, vec![]);
    if full[0].shape.rank() == 0 {
        return Some(constant);
    }
    Some(Rhs::node(Op::BroadcastInDim { input: hole(), shape: full[0].shape.clone(), dims: vec![] }, vec![constant]))
}
