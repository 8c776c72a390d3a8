//! The e-class analysis: each class's output types and, for small constants,
//! the literal.
//!
//! Types come from the operands' classes through
//! [`infer_types`](crate::ir::infer::infer_types), so neither the analysis nor
//! extraction needs a `Graph`. All nodes of a class have the same types; a
//! union that would break that, or a node that does not type-check, is
//! recorded in [`TypeAnalysis::errors`] (egg's analysis cannot fail) and the
//! runner turns the first one into an error naming the rule.

use egg::{Analysis, DidMerge, Id};

use super::{EGraph, TensorLang};
use crate::ir::{infer, Literal, Op, Outputs, TensorType};

/// Constants up to this size are kept in the analysis for folding; larger
/// ones are never folded (folding them would bloat the program).
pub const MAX_FOLD_BYTES: usize = 4096;

/// What the analysis knows about one class.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassData {
    /// Output types (one for a value, several for a tuple class; empty only
    /// after an error).
    pub types: Outputs,
    /// The class's value when it contains a small constant.
    pub constant: Option<Literal>,
}

impl ClassData {
    /// The type of a single-output class.
    pub fn ty(&self) -> Option<&TensorType> {
        match self.types.as_slice() {
            [t] => Some(t),
            _ => None,
        }
    }
}

/// The analysis; `errors` collects type errors for the runner to report.
#[derive(Clone, Debug, Default)]
pub struct TypeAnalysis {
    pub errors: Vec<String>,
}

/// Output types of `node` from its children's classes.
pub fn node_types(eg: &EGraph, node: &TensorLang) -> Result<Outputs, String> {
    match node {
        TensorLang::Project { index, tuple } => match eg[tuple[0]].data.types.get(*index as usize) {
            Some(t) => Ok(smallvec::smallvec![t.clone()]),
            None => Err(format!("projection {index} of a node with {} outputs", eg[tuple[0]].data.types.len())),
        },
        TensorLang::Op { op, children, .. } => {
            let mut operands = Vec::with_capacity(children.len());
            for &c in children {
                match eg[c].data.ty() {
                    Some(t) => operands.push(t.clone()),
                    None => return Err(format!("{}: an operand is not a single value", op.name())),
                }
            }
            infer::infer_types(op, &operands).map_err(|e| e.to_string())
        }
    }
}

impl Analysis<TensorLang> for TypeAnalysis {
    type Data = ClassData;

    fn make(eg: &mut EGraph, enode: &TensorLang, _id: Id) -> ClassData {
        let types = match node_types(eg, enode) {
            Ok(t) => t,
            Err(e) => {
                eg.analysis.errors.push(e);
                Outputs::new()
            }
        };
        let constant = match enode {
            TensorLang::Op { op: Op::Constant { literal }, .. } if literal.bytes().len() <= MAX_FOLD_BYTES => {
                Some(literal.clone())
            }
            TensorLang::Op { .. } | TensorLang::Project { .. } => None,
        };
        ClassData { types, constant }
    }

    fn merge(&mut self, a: &mut ClassData, b: ClassData) -> DidMerge {
        if a.types != b.types {
            let show = |t: &Outputs| t.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            self.errors.push(format!("merged classes of types [{}] and [{}]", show(&a.types), show(&b.types)));
        }
        match (&a.constant, b.constant) {
            (None, Some(c)) => {
                a.constant = Some(c);
                DidMerge(true, false)
            }
            (Some(_), None) => DidMerge(false, true),
            (Some(_), Some(_)) | (None, None) => DidMerge(false, false),
        }
    }
}
