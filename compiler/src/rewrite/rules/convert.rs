//! Lossless convert elimination (AMP graphs convert back and forth a lot).
//!
//! A conversion `A -> B` is lossless when every value of `A` is a value of
//! `B` (bf16 and f16 into f32 and f64, f32 into f64, narrower integers into
//! wider ones or into floats with enough mantissa, pred into anything). Then
//! `B -> A` undoes it exactly, and `A -> B -> C` rounds the same value once, as
//! `A -> C` does.

use egg::Id;

use super::{hole, ops, ty, Rhs, Rule};
use crate::ir::{DType, Op};
use crate::rewrite::EGraph;

pub fn rules() -> Vec<Rule> {
    vec![
        // convert(x: A, A) = x.
        Rule { name: "convert-same", algebra: "convert(x: A -> A) = x", find: convert_same },
        // convert(convert(x: A, B), A) = x when A -> B is lossless.
        Rule { name: "convert-roundtrip", algebra: "convert(convert(x: A -> B) -> A) = x, A ⊂ B", find: roundtrip },
        // convert(convert(x: A, B), C) = convert(x, C) when A -> B is lossless.
        Rule {
            name: "convert-chain",
            algebra: "convert(convert(x: A -> B) -> C) = convert(x: A -> C), A ⊂ B",
            find: chain,
        },
        // convert(m(x)) = m(convert(x)) for data movement m (transpose, reshape,
        // broadcast, slice): conversion is per element, movement moves elements.
        // Both directions are added; extraction keeps the cheaper (narrow types
        // move fewer bytes), and a transpose below a convert can then fold
        // into a dot_general.
        Rule { name: "convert-movement", algebra: "convert(m(x)) = m(convert(x))", find: through_movement },
    ]
}

/// Whether every value of `from` is exactly a value of `to`.
pub fn lossless(from: DType, to: DType) -> bool {
    use DType::*;
    if from == to {
        return true;
    }
    match from {
        Pred => true,
        BF16 => matches!(to, F32 | F64),
        F16 => matches!(to, F32 | F64),
        F32 => matches!(to, F64),
        F64 => false,
        // 8 significant bits in bf16, 11 in f16, 24 in f32, 53 in f64.
        I8 => matches!(to, I32 | I64 | BF16 | F16 | F32 | F64),
        U8 => matches!(to, I32 | I64 | U32 | U64 | BF16 | F16 | F32 | F64),
        I32 => matches!(to, I64 | F64),
        U32 => matches!(to, I64 | U64 | F64),
        I64 | U64 => false,
    }
}

fn convert_same(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::Convert { to, .. } = op else { return vec![] };
    match ty(eg, kids[0]) {
        Some(t) if t.dtype == *to => vec![Rhs::Class(kids[0])],
        _ => vec![],
    }
}

fn roundtrip(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::Convert { to: a, .. } = op else { return vec![] };
    let Some(b) = ty(eg, kids[0]) else { return vec![] };
    ops(eg, kids[0])
        .filter(|(inner, _)| matches!(inner, Op::Convert { .. }))
        .filter_map(|(_, k)| match ty(eg, k[0]) {
            Some(x) if x.dtype == *a && lossless(*a, b.dtype) => Some(Rhs::Class(k[0])),
            _ => None,
        })
        .collect()
}

fn chain(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    let Op::Convert { to: c, .. } = op else { return vec![] };
    let Some(b) = ty(eg, kids[0]) else { return vec![] };
    ops(eg, kids[0])
        .filter(|(inner, _)| matches!(inner, Op::Convert { .. }))
        .filter_map(|(_, k)| match ty(eg, k[0]) {
            Some(x) if lossless(x.dtype, b.dtype) && x.dtype != *c => {
                Some(Rhs::node(Op::Convert { input: hole(), to: *c }, vec![Rhs::Class(k[0])]))
            }
            _ => None,
        })
        .collect()
}

fn is_movement(op: &Op) -> bool {
    matches!(op, Op::Transpose { .. } | Op::Reshape { .. } | Op::BroadcastInDim { .. } | Op::Slice { .. })
}

fn through_movement(eg: &EGraph, op: &Op, kids: &[Id]) -> Vec<Rhs> {
    match op {
        // convert(m(x)) -> m(convert(x))
        Op::Convert { to, .. } => ops(eg, kids[0])
            .filter(|(inner, _)| is_movement(inner))
            .map(|(inner, k)| {
                Rhs::node(
                    inner.clone(),
                    vec![Rhs::node(Op::Convert { input: hole(), to: *to }, vec![Rhs::Class(k[0])])],
                )
            })
            .collect(),
        // m(convert(x)) -> convert(m(x))
        m if is_movement(m) => ops(eg, kids[0])
            .filter_map(|(inner, k)| match inner {
                Op::Convert { to, .. } => Some(Rhs::node(
                    Op::Convert { input: hole(), to: *to },
                    vec![Rhs::node(m.clone(), vec![Rhs::Class(k[0])])],
                )),
                _ => None,
            })
            .collect(),
        _ => vec![],
    }
}
