//! Rewrite rules as data: one topic a file, each rule a name, its algebra, and a
//! function that finds its matches.
//!
//! A rule's `find` sees one e-node (its holed op and operand classes) and
//! returns right-hand sides ([`Rhs`]): expressions over existing classes that
//! equal the node's class. The runner adds each and unions it with the class.
//! Rules read types and small constants from the class analysis.
//!
//! Every rule is exact: the right-hand side computes the same bits as the
//! left for every input (NaN, infinities and signed zeros included), unless
//! its comment says which freedom of the op it uses. No rule reassociates or
//! commutes float arithmetic.

mod convert;
mod fold;
mod identities;
mod layout;
pub mod matmul;
mod softmax;

use egg::Id;

use super::{enode, needs_token, EGraph};
use crate::ir::{decode, DType, Literal, Op, TensorType};
use crate::CompileError;

/// One rewrite rule.
#[derive(Clone, Copy)]
pub struct Rule {
    pub name: &'static str,
    /// The identity it applies, e.g. `x * 1 = x`.
    pub algebra: &'static str,
    /// Right-hand sides equal to the node `op(children)`.
    pub find: fn(&EGraph, &Op, &[Id]) -> Vec<Rhs>,
}

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.algebra)
    }
}

/// An expression to add to the e-graph.
#[derive(Clone, Debug, PartialEq)]
pub enum Rhs {
    /// An existing class.
    Class(Id),
    /// A new node; its operands (holes) are filled by `children` in order.
    Node(Op, Vec<Rhs>),
}

impl Rhs {
    pub fn node(op: Op, children: Vec<Rhs>) -> Rhs {
        Rhs::Node(op, children)
    }
}

/// A rule set: its name and the function that builds its rules.
type RuleSet = (&'static str, fn() -> Vec<Rule>);

/// The e-graph rule sets, by name, in the order the runner applies them.
pub const RULE_SETS: [RuleSet; 5] = [
    ("identities", identities::rules),
    ("layout", layout::rules),
    ("convert", convert::rules),
    ("fold", fold::rules),
    ("softmax", softmax::rules),
];

/// Rule sets that rewrite the extracted graph instead of the e-graph (their
/// decision is about several nodes at once; see [`matmul`]), applied after
/// extraction in this order.
pub const GRAPH_RULE_SETS: [&str; 1] = ["matmul"];

/// The e-graph rules of the named sets (all when `None`); a name of a graph
/// rule set selects no e-graph rule.
pub fn select(names: Option<&[String]>) -> Result<Vec<Rule>, CompileError> {
    let Some(names) = names else {
        return Ok(RULE_SETS.iter().flat_map(|(_, f)| f()).collect());
    };
    let mut out = Vec::new();
    for n in names {
        if GRAPH_RULE_SETS.contains(&n.as_str()) {
            continue;
        }
        let Some((_, f)) = RULE_SETS.iter().find(|(name, _)| name == n) else {
            return Err(CompileError::UnknownPass {
                name: format!("rule set {n}"),
                known: RULE_SETS.iter().map(|(n, _)| *n).chain(GRAPH_RULE_SETS).collect::<Vec<_>>().join(", "),
            });
        };
        out.extend(f());
    }
    Ok(out)
}

/// Whether the graph rule set `name` is selected (all are when `None`).
pub fn selects_graph_rule(names: Option<&[String]>, name: &str) -> bool {
    names.is_none_or(|ns| ns.iter().any(|n| n == name))
}

/// Adds `rhs` to the e-graph; a new node that needs a token is a rule bug.
pub fn add_rhs(eg: &mut EGraph, rhs: &Rhs) -> Result<Id, String> {
    match rhs {
        Rhs::Class(c) => Ok(*c),
        Rhs::Node(op, children) => {
            if needs_token(op) {
                return Err(format!("rules may not create {} nodes", op.name()));
            }
            let kids = children.iter().map(|c| add_rhs(eg, c)).collect::<Result<Vec<_>, _>>()?;
            if kids.len() != op.inputs().len() {
                return Err(format!("{}: {} operands for {} holes", op.name(), kids.len(), op.inputs().len()));
            }
            Ok(eg.add(enode(op, kids, 0)))
        }
    }
}

/// The type of a single-output class.
pub fn ty(eg: &EGraph, c: Id) -> Option<&TensorType> {
    eg[c].data.ty()
}

/// The ops (holed) and operand classes of class `c`.
pub fn ops(eg: &EGraph, c: Id) -> impl Iterator<Item = (&Op, &[Id])> {
    eg[c].nodes.iter().filter_map(|n| match n {
        super::TensorLang::Op { op, children, .. } => Some((op, children.as_slice())),
        super::TensorLang::Project { .. } => None,
    })
}

/// The raw bytes of one element when class `c` holds the same element
/// everywhere: a splat constant, or a broadcast of one.
pub fn splat_bits(eg: &EGraph, c: Id) -> Option<Vec<u8>> {
    fn of(l: &Literal) -> Option<Vec<u8>> {
        let n = l.ty().dtype.size_in_bytes();
        (l.is_splat() && l.bytes().len() >= n).then(|| l.bytes()[..n].to_vec())
    }
    if let Some(l) = &eg[c].data.constant {
        return of(l);
    }
    for (op, kids) in ops(eg, c) {
        if let Op::BroadcastInDim { .. } = op {
            if let Some(l) = &eg[kids[0]].data.constant {
                return of(l);
            }
        }
    }
    None
}

/// Whether class `c` is everywhere exactly the value `v` of its dtype, bit for
/// bit (so `0.0` does not match `-0.0`).
pub fn is_splat_of(eg: &EGraph, c: Id, v: f64) -> bool {
    let (Some(t), Some(bits)) = (ty(eg, c), splat_bits(eg, c)) else {
        return false;
    };
    let want = Literal::scalar(t.dtype, v);
    let is = bits == want.bytes();
    // Integers: `scalar` wraps, so also check the decoded value.
    is && (t.dtype.is_float() || decode(t.dtype, &bits) == v)
}

/// Whether `d` is a float dtype.
pub fn is_float(d: DType) -> bool {
    d.is_float()
}

/// A placeholder operand for ops built by rules (the e-node's children fill it).
pub fn hole() -> crate::ir::ValueId {
    crate::ir::ValueId::new(crate::ir::NodeId::HOLE, 0)
}
