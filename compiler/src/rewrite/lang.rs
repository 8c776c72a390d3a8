//! `TensorLang`: kiln's `Op` as e-graph nodes, one to one.
//!
//! An e-node is the `Op` itself with each operand replaced by a hole (the
//! operand's position), plus the e-class ids of the operands in [`Op::inputs`]
//! order. Attributes (shapes, permutations, dimension numbers, literals) stay
//! in the `Op`, so equality and hashing of e-nodes are the `Op`'s and nothing
//! is lost: [`to_op`] gives back the op with the operands filled in. A new `Op`
//! variant needs no change here except in [`needs_token`] (an exhaustive match,
//! so the compiler asks).
//!
//! Invariants:
//! - Ops that must never merge with an equal-looking op (parameters, RNG,
//!   collectives, optimization barriers) carry a unique nonzero `token`, so
//!   hash-consing keeps them apart; every other e-node has token 0. Rules never
//!   create tokened ops.
//! - A node with other than one output is a tuple class; its values are
//!   reached through [`TensorLang::Project`]. Single-output nodes are their own
//!   value.

use egg::{Id, Language};

use crate::ir::{NodeId, Op, ValueId};

/// One e-node.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorLang {
    /// An op with holes for operands; `children` fill them in order.
    Op { op: Op, token: u32, children: Vec<Id> },
    /// Output `index` of the multi-output node in class `tuple[0]`.
    Project { index: u32, tuple: [Id; 1] },
}

/// The discriminant egg uses to short-cut comparisons.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Op(&'static str),
    Project,
}

impl Language for TensorLang {
    type Discriminant = Kind;

    fn discriminant(&self) -> Kind {
        match self {
            TensorLang::Op { op, .. } => Kind::Op(op.name()),
            TensorLang::Project { .. } => Kind::Project,
        }
    }

    fn matches(&self, other: &Self) -> bool {
        match (self, other) {
            (TensorLang::Op { op: a, token: ta, children: ca }, TensorLang::Op { op: b, token: tb, children: cb }) => {
                a == b && ta == tb && ca.len() == cb.len()
            }
            (TensorLang::Project { index: a, .. }, TensorLang::Project { index: b, .. }) => a == b,
            (TensorLang::Op { .. }, TensorLang::Project { .. })
            | (TensorLang::Project { .. }, TensorLang::Op { .. }) => false,
        }
    }

    fn children(&self) -> &[Id] {
        match self {
            TensorLang::Op { children, .. } => children,
            TensorLang::Project { tuple, .. } => tuple,
        }
    }

    fn children_mut(&mut self) -> &mut [Id] {
        match self {
            TensorLang::Op { children, .. } => children,
            TensorLang::Project { tuple, .. } => tuple,
        }
    }
}

/// `op` with its operands replaced by holes numbered by position.
pub fn holed(op: &Op) -> Op {
    let mut op = op.clone();
    let mut pos = 0u32;
    op.map_inputs(|_| {
        let v = ValueId::new(NodeId::HOLE, pos);
        pos += 1;
        v
    });
    op
}

/// The op of a holed e-node with its operands filled in from `operands`
/// (one per hole, in order). Returns `None` when the counts differ.
pub fn to_op(holed_op: &Op, operands: &[ValueId]) -> Option<Op> {
    if holed_op.inputs().len() != operands.len() {
        return None;
    }
    let mut op = holed_op.clone();
    let mut it = operands.iter().copied();
    op.map_inputs(|_| it.next().expect("counts checked above"));
    Some(op)
}

/// An e-node for `op` (operands holed) over `children`; `token` is used only
/// when the op needs one.
pub fn enode(op: &Op, children: Vec<Id>, token: u32) -> TensorLang {
    let token = if needs_token(op) { token } else { 0 };
    TensorLang::Op { op: holed(op), token, children }
}

/// Ops that must never merge with another op of equal operands and
/// attributes ([`crate::ir::OpProps::unique`]).
pub fn needs_token(op: &Op) -> bool {
    op.props().unique
}
