//! Algebraic identities that drop an op, exact for every input.
//!
//! Only identities that hold bit for bit: `x * 1`, `x / 1`, `x - (+0)` and
//! `x + (-0)` return `x` itself for every float (NaN payloads, infinities and
//! signed zeros included); `x + (+0)` does not (`-0 + +0 = +0`) and is only
//! used on integers.

use egg::Id;

use super::{is_splat_of, ty, Rhs, Rule};
use crate::ir::{BinaryOp, Op, UnaryOp};

pub fn rules() -> Vec<Rule> {
    vec![
        // x * 1 = x and 1 * x = x (IEEE: multiplying by one is exact).
        Rule { name: "mul-one", algebra: "x * 1 = x = 1 * x", find: mul_one },
        // x / 1 = x (IEEE: exact).
        Rule { name: "div-one", algebra: "x / 1 = x", find: div_one },
        // x - (+0) = x for floats and integers; x + (-0) = x = (-0) + x for floats;
        // x + 0 = x = 0 + x for integers.
        Rule { name: "add-zero", algebra: "x - 0 = x, x + (-0) = x (floats), x + 0 = x (integers)", find: add_zero },
        // -(-x) = x (negation flips the sign bit only; two's complement for integers).
        Rule { name: "neg-neg", algebra: "-(-x) = x", find: neg_neg },
        // select(p, x, x) = x.
        Rule { name: "select-same", algebra: "select(p, x, x) = x", find: select_same },
        // Data movement that moves nothing: reshape to the same shape, the
        // identity transpose, broadcast to the same shape in order, the full
        // slice, a reduction over no axes, concatenate of one operand, pad by
        // nothing.
        Rule {
            name: "noop-movement",
            algebra: "reshape/transpose/broadcast/slice/pad/concat/reduce that keeps x = x",
            find: noop,
        },
    ]
}

fn mul_one(eg: &crate::rewrite::EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    match op {
        Op::Binary { op: BinaryOp::Mul, .. } => {
            let mut out = Vec::new();
            if is_splat_of(eg, kids[1], 1.0) {
                out.push(Rhs::Class(kids[0]));
            }
            if is_splat_of(eg, kids[0], 1.0) {
                out.push(Rhs::Class(kids[1]));
            }
            out
        }
        _ => vec![],
    }
}

fn div_one(eg: &crate::rewrite::EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    match op {
        Op::Binary { op: BinaryOp::Div, .. } if is_splat_of(eg, kids[1], 1.0) => vec![Rhs::Class(kids[0])],
        _ => vec![],
    }
}

fn add_zero(eg: &crate::rewrite::EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    if !matches!(op, Op::Binary { op: BinaryOp::Add | BinaryOp::Sub, .. }) {
        return vec![];
    }
    let Some(t) = ty(eg, kids[0]) else { return vec![] };
    let float = t.dtype.is_float();
    match op {
        Op::Binary { op: BinaryOp::Sub, .. } if is_splat_of(eg, kids[1], 0.0) => vec![Rhs::Class(kids[0])],
        Op::Binary { op: BinaryOp::Add, .. } => {
            let zero = if float { -0.0 } else { 0.0 };
            let mut out = Vec::new();
            if is_splat_of(eg, kids[1], zero) {
                out.push(Rhs::Class(kids[0]));
            }
            if is_splat_of(eg, kids[0], zero) {
                out.push(Rhs::Class(kids[1]));
            }
            out
        }
        _ => vec![],
    }
}

fn neg_neg(eg: &crate::rewrite::EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    match op {
        Op::Unary { op: UnaryOp::Neg, .. } => super::ops(eg, kids[0])
            .filter(|(inner, _)| matches!(inner, Op::Unary { op: UnaryOp::Neg, .. }))
            .map(|(_, k)| Rhs::Class(k[0]))
            .collect(),
        _ => vec![],
    }
}

fn select_same(_: &crate::rewrite::EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    match op {
        Op::Select { .. } if kids[1] == kids[2] => vec![Rhs::Class(kids[1])],
        _ => vec![],
    }
}

fn noop(eg: &crate::rewrite::EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Some(first) = kids.first() else { return vec![] };
    let Some(t) = ty(eg, *first) else { return vec![] };
    let r = t.shape.rank();
    let same = match op {
        Op::Reshape { shape, .. } => *shape == t.shape,
        Op::Transpose { perm, .. } => perm.iter().enumerate().all(|(i, &p)| i == p),
        Op::BroadcastInDim { shape, dims, .. } => *shape == t.shape && dims.iter().enumerate().all(|(i, &d)| i == d),
        Op::Slice { start, limit, stride, .. } => {
            start.iter().all(|&s| s == 0) && stride.iter().all(|&s| s == 1) && limit.as_slice() == t.shape.dims()
        }
        Op::Reduce { axes, .. } => axes.is_empty(),
        Op::Concatenate { inputs, .. } => inputs.len() == 1,
        Op::Pad { low, high, interior, .. } => {
            low.iter().all(|&x| x == 0)
                && high.iter().all(|&x| x == 0)
                && interior.iter().all(|&x| x == 0)
                && r == low.len()
        }
        _ => false,
    };
    if same {
        vec![Rhs::Class(*first)]
    } else {
        vec![]
    }
}
