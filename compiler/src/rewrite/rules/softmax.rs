//! Canonical forms of the pieces softmax, log-softmax and cross-entropy are
//! written with, so that differently written ones meet in one e-class (and
//! CSE, the composite matchers and XLA see one spelling).
//!
//! A softmax over the last axis is `e / bcast(Σ e)` with `e = exp(x -
//! bcast(max x))`; log-softmax is `(x - bcast(m)) - bcast(log Σ e)`; the
//! cross-entropy picks one entry of it per row. Users and frontends spell the
//! shift `x + (-m)` or `x - m`, take `exp`/`log`/`neg` of the broadcast row
//! statistic or broadcast the statistic after them, and combine two broadcast
//! rows elementwise before or after broadcasting. The rules below move each
//! spelling to one form:
//!
//! - the shift as a subtraction,
//! - elementwise ops on row statistics below the broadcast (on `[rows]`, not
//!   on `[rows, vocab]`: cheaper, and the form the frontend records),
//! - the max (or min) of a broadcast row over the broadcast axes as the row.
//!
//! All are exact, bit for bit: IEEE 754 defines `x - y` as `x + (-y)`;
//! an elementwise op applied before or after a broadcast sees the same
//! element; the max of copies of one value is that value (a NaN stays a NaN).
//! The rewrites that would change values are deliberately not here: `log(e /
//! Σ e) = (x - m) - log Σ e` and `exp(x) / Σ exp(x) = e / Σ e` round
//! differently (they are what a numerically careful user writes; the rules only
//! state identities).

use egg::Id;

use super::{hole, ops, ty, Rhs, Rule};
use crate::ir::{BinaryOp, Op, ReduceOp, UnaryOp};
use crate::rewrite::EGraph;

pub fn rules() -> Vec<Rule> {
    vec![
        // x + (-y) = x - y = (-y) + x (IEEE 754 defines subtraction so;
        // wrapping integers too).
        Rule { name: "add-neg", algebra: "x + (-y) = x - y = (-y) + x", find: add_neg },
        // f(bcast(x)) = bcast(f(x)) for an elementwise unary f.
        Rule { name: "unary-below-broadcast", algebra: "f(bcast(x, s, d)) = bcast(f(x), s, d)", find: unary_below },
        // bcast(a, s, d) ⊙ bcast(b, s, d) = bcast(a ⊙ b, s, d) for an
        // elementwise binary ⊙ and a, b of one type.
        Rule {
            name: "binary-below-broadcast",
            algebra: "bcast(a, s, d) ⊙ bcast(b, s, d) = bcast(a ⊙ b, s, d)",
            find: binary_below,
        },
        // max/min(bcast(x, s, d), axes) = x when the axes are exactly the
        // dimensions the broadcast added (and it added no others).
        Rule { name: "max-of-broadcast", algebra: "max(bcast(x, s, d), s \\ d) = x", find: max_of_broadcast },
    ]
}

fn add_neg(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::Binary { op: BinaryOp::Add, .. } = op else { return vec![] };
    let sub = |x: Id, y: Id| {
        Rhs::node(Op::Binary { op: BinaryOp::Sub, lhs: hole(), rhs: hole() }, vec![Rhs::Class(x), Rhs::Class(y)])
    };
    let negated = |c: Id| -> Vec<Id> {
        ops(eg, c).filter(|(inner, _)| matches!(inner, Op::Unary { op: UnaryOp::Neg, .. })).map(|(_, k)| k[0]).collect()
    };
    let mut out: Vec<Rhs> = negated(kids[1]).into_iter().map(|y| sub(kids[0], y)).collect();
    out.extend(negated(kids[0]).into_iter().map(|y| sub(kids[1], y)));
    out
}

fn unary_below(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::Unary { op: f, .. } = op else { return vec![] };
    ops(eg, kids[0])
        .filter_map(|(inner, k)| match inner {
            Op::BroadcastInDim { shape, dims, .. } => Some(Rhs::node(
                Op::BroadcastInDim { input: hole(), shape: shape.clone(), dims: dims.clone() },
                vec![Rhs::node(Op::Unary { op: *f, input: hole() }, vec![Rhs::Class(k[0])])],
            )),
            _ => None,
        })
        .collect()
}

fn binary_below(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::Binary { op: f, .. } = op else { return vec![] };
    let mut out = Vec::new();
    for (a_op, a) in ops(eg, kids[0]) {
        let Op::BroadcastInDim { shape: sa, dims: da, .. } = a_op else { continue };
        for (b_op, b) in ops(eg, kids[1]) {
            let Op::BroadcastInDim { shape: sb, dims: db, .. } = b_op else { continue };
            if sa != sb || da != db || ty(eg, a[0]).is_none() || ty(eg, a[0]) != ty(eg, b[0]) {
                continue;
            }
            out.push(Rhs::node(
                Op::BroadcastInDim { input: hole(), shape: sa.clone(), dims: da.clone() },
                vec![Rhs::node(
                    Op::Binary { op: *f, lhs: hole(), rhs: hole() },
                    vec![Rhs::Class(a[0]), Rhs::Class(b[0])],
                )],
            ));
        }
    }
    out
}

fn max_of_broadcast(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::Reduce { op: ReduceOp::Max | ReduceOp::Min, axes, .. } = op else { return vec![] };
    ops(eg, kids[0])
        .filter_map(|(inner, k)| match inner {
            Op::BroadcastInDim { shape, dims, .. } => {
                let added: Vec<usize> = (0..shape.rank()).filter(|i| !dims.contains(i)).collect();
                // The input must keep its own sizes (no size-1 dimension
                // stretched), so that the reduction's result is the input.
                let same = ty(eg, k[0])
                    .is_some_and(|t| dims.iter().enumerate().all(|(i, &d)| t.shape.dims()[i] == shape.dims()[d]));
                let sorted = dims.windows(2).all(|w| w[0] < w[1]);
                (added == *axes && same && sorted).then(|| Rhs::Class(k[0]))
            }
            _ => None,
        })
        .collect()
}
