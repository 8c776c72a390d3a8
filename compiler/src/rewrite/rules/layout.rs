//! Transpose, reshape and broadcast canonicalization, and folding transposes
//! into `dot_general`'s dimension numbers.
//!
//! All of these move the same element values to the same places, so they are
//! exact. Folding a transpose into a `dot_general` keeps every product and the
//! set of terms of every sum; the order in which the backend accumulates a
//! sum is its own choice in either form.

use egg::Id;

use super::{hole, ops, ty, Rhs, Rule};
use crate::ir::{DotDims, Op, Shape};
use crate::rewrite::EGraph;

pub fn rules() -> Vec<Rule> {
    vec![
        // transpose(transpose(x, p), q) = transpose(x, r) with r[i] = p[q[i]].
        Rule {
            name: "transpose-transpose",
            algebra: "transpose(transpose(x, p), q) = transpose(x, p∘q)",
            find: transpose_transpose,
        },
        // reshape(reshape(x, s1), s2) = reshape(x, s2): row-major order is kept by both.
        Rule {
            name: "reshape-reshape",
            algebra: "reshape(reshape(x, s1), s2) = reshape(x, s2)",
            find: reshape_reshape,
        },
        // broadcast(broadcast(x, s1, d1), s2, d2) = broadcast(x, s2, d2∘d1).
        Rule {
            name: "broadcast-broadcast",
            algebra: "bcast(bcast(x, s1, d1), s2, d2) = bcast(x, s2, d2∘d1)",
            find: broadcast_broadcast,
        },
        // reshape or transpose of a broadcast scalar is the broadcast scalar.
        Rule { name: "move-splat", algebra: "reshape/transpose(bcast(scalar)) = bcast(scalar)", find: move_splat },
        // dot(transpose(a, p), b, dims) = dot(a, b, dims mapped through p) when the
        // free dimensions keep their order (and the same for the rhs).
        Rule {
            name: "transpose-into-dot",
            algebra: "dot(transpose(a, p), b, d) = dot(a, b, p(d))",
            find: transpose_into_dot,
        },
    ]
}

fn transpose_transpose(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::Transpose { perm: q, .. } = op else { return vec![] };
    ops(eg, kids[0])
        .filter_map(|(inner, k)| match inner {
            Op::Transpose { perm: p, .. } => {
                let r: Vec<usize> = q.iter().map(|&i| p[i]).collect();
                Some(Rhs::node(Op::Transpose { input: hole(), perm: r }, vec![Rhs::Class(k[0])]))
            }
            _ => None,
        })
        .collect()
}

fn reshape_reshape(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::Reshape { shape, .. } = op else { return vec![] };
    ops(eg, kids[0])
        .filter_map(|(inner, k)| match inner {
            Op::Reshape { .. } => {
                Some(Rhs::node(Op::Reshape { input: hole(), shape: shape.clone() }, vec![Rhs::Class(k[0])]))
            }
            _ => None,
        })
        .collect()
}

fn broadcast_broadcast(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::BroadcastInDim { shape, dims: d2, .. } = op else { return vec![] };
    ops(eg, kids[0])
        .filter_map(|(inner, k)| match inner {
            Op::BroadcastInDim { dims: d1, .. } => {
                let dims: Vec<usize> = d1.iter().map(|&i| d2[i]).collect();
                Some(Rhs::node(
                    Op::BroadcastInDim { input: hole(), shape: shape.clone(), dims },
                    vec![Rhs::Class(k[0])],
                ))
            }
            _ => None,
        })
        .collect()
}

fn move_splat(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let out_shape: Shape = match op {
        Op::Reshape { shape, .. } => shape.clone(),
        Op::Transpose { perm, .. } => match ty(eg, kids[0]) {
            Some(t) => Shape::new(perm.iter().map(|&p| t.shape.0[p]).collect::<Vec<_>>()),
            None => return vec![],
        },
        _ => return vec![],
    };
    ops(eg, kids[0])
        .filter_map(|(inner, k)| match inner {
            Op::BroadcastInDim { .. } if ty(eg, k[0]).is_some_and(|t| t.shape.rank() == 0) => Some(Rhs::node(
                Op::BroadcastInDim { input: hole(), shape: out_shape.clone(), dims: vec![] },
                vec![Rhs::Class(k[0])],
            )),
            _ => None,
        })
        .collect()
}

/// Dimension numbers for one side after looking through `transpose(x, perm)`:
/// `None` when the side's free dimensions would change order.
fn through(perm: &[usize], batch: &[usize], contract: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
    let free: Vec<usize> =
        (0..perm.len()).filter(|d| !batch.contains(d) && !contract.contains(d)).map(|d| perm[d]).collect();
    if free.windows(2).any(|w| w[0] > w[1]) {
        return None;
    }
    Some((batch.iter().map(|&d| perm[d]).collect(), contract.iter().map(|&d| perm[d]).collect()))
}

fn transpose_into_dot(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::DotGeneral { dims, .. } = op else { return vec![] };
    let mut out = Vec::new();
    for (inner, k) in ops(eg, kids[0]) {
        if let Op::Transpose { perm, .. } = inner {
            if let Some((lhs_batch, lhs_contract)) = through(perm, &dims.lhs_batch, &dims.lhs_contract) {
                let d = DotDims { lhs_batch, lhs_contract, ..dims.clone() };
                out.push(Rhs::node(
                    Op::DotGeneral { lhs: hole(), rhs: hole(), dims: d },
                    vec![Rhs::Class(k[0]), Rhs::Class(kids[1])],
                ));
            }
        }
    }
    for (inner, k) in ops(eg, kids[1]) {
        if let Op::Transpose { perm, .. } = inner {
            if let Some((rhs_batch, rhs_contract)) = through(perm, &dims.rhs_batch, &dims.rhs_contract) {
                let d = DotDims { rhs_batch, rhs_contract, ..dims.clone() };
                out.push(Rhs::node(
                    Op::DotGeneral { lhs: hole(), rhs: hole(), dims: d },
                    vec![Rhs::Class(kids[0]), Rhs::Class(k[0])],
                ));
            }
        }
    }
    out
}
