//! Recompile explanations: when a step needs a new program that has the same
//! ops as an earlier one, say what changed (which input's shape or dtype, or
//! which op) and how to keep the program stable.
//!
//! Two programs *resemble* each other when their pruned graphs have the same
//! op kinds in the same order and the same number of inputs: the usual cause
//! is a batch or sequence length that changed, or a Rust scalar baked into the
//! program as a constant. Programs that do not resemble any earlier one (the
//! eval step beside the train step) are new, not recompiles, and get no
//! explanation.
//!
//! Invariants:
//! - A new program is compared with the newest earlier program it resembles,
//!   and only with one that resembles it.
//! - Explaining only reads the graphs: it never changes a program, its key or
//!   the cache.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::rc::Rc;

use kiln_compiler::ir::{Graph, Node, Op, TensorType};

use crate::engine::program_cache::Program;

thread_local! {
    static BUCKET: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// While held, the steps recorded are one *bucket* of a loop that pads its
/// batches to a few lengths on purpose (`label` names it: `len 64`): a new
/// program for a new bucket is expected, one per bucket, so it is said as
/// that bucket's compile, not warned of as a recompile.
#[must_use = "the bucket lasts while the guard is held"]
pub struct BucketGuard {
    previous: Option<String>,
}

/// Names the bucket of the steps recorded until the guard drops.
pub fn bucket(label: impl Into<String>) -> BucketGuard {
    let previous = BUCKET.with(|b| b.borrow_mut().replace(label.into()));
    BucketGuard { previous }
}

impl Drop for BucketGuard {
    fn drop(&mut self) {
        BUCKET.with(|b| *b.borrow_mut() = self.previous.take());
    }
}

/// The bucket the current step belongs to, if a loop named one.
pub(crate) fn current_bucket() -> Option<String> {
    BUCKET.with(|b| b.borrow().clone())
}

fn same_ops(a: &Graph, b: &Graph) -> bool {
    a.len() == b.len()
        && a.params().len() == b.params().len()
        && a.nodes().zip(b.nodes()).all(|((_, x), (_, y))| x.op.name() == y.op.name())
}

fn input_name(names: &[Option<Rc<str>>], i: usize) -> String {
    match names.get(i).and_then(|n| n.as_deref()) {
        Some(n) => format!("input '{n}' (parameter {i})"),
        None => format!("input {i}"),
    }
}

/// The explanation for a new program `g` fed by inputs named `names`, or
/// `None` when it resembles no program in `history` (newest is compared first).
pub(crate) fn new_program(g: &Graph, names: &[Option<Rc<str>>], history: &[Rc<Program>]) -> Option<String> {
    let old = history.iter().rev().find(|p| same_ops(&p.graph, g))?;
    let before = old.param_types();
    let after = g.param_types();
    let changed: Vec<(usize, &TensorType, &TensorType)> =
        before.iter().zip(&after).enumerate().filter(|(_, (b, a))| b != a).map(|(i, (b, a))| (i, b, a)).collect();
    let mut text = String::from("recompiling: ");
    if changed.is_empty() {
        // Same inputs: an op's attributes or a constant differ.
        let first = g.nodes().zip(old.graph.nodes()).find(|((_, x), (_, y))| x != y);
        match first {
            Some(((id, new), (_, was))) => {
                let _ = write!(
                    text,
                    "the inputs are unchanged but op {id} ({}) differs from the earlier program's: {}",
                    new.op.name(),
                    describe_difference(new, was)
                );
            }
            None => text
                .push_str("the program equals an earlier one but was keyed differently (outputs or donation changed)"),
        }
        return Some(text);
    }
    for (k, (i, b, a)) in changed.iter().enumerate() {
        if k > 0 {
            text.push_str("; ");
        }
        let _ = write!(text, "{} changed from {b} to {a}", input_name(names, *i));
    }
    let only_leading = changed.iter().all(|(_, b, a)| {
        b.dtype == a.dtype
            && b.shape.rank() == a.shape.rank()
            && b.shape.rank() > 0
            && b.shape.dims()[1..] == a.shape.dims()[1..]
    });
    let dtype_changed = changed.iter().any(|(_, b, a)| b.dtype != a.dtype);
    if only_leading {
        text.push_str(
            ". Only the leading (batch) dimension changed, as a partial last batch does: keep batches one size \
             with `LastBatch::Drop` (drop_last) or pad them to a bucket with `LastBatch::Pad`",
        );
    } else if dtype_changed {
        text.push_str(". A dtype changed: convert inputs to one dtype before they reach the step");
    } else {
        text.push_str(
            ". Shapes changed: pad variable lengths to a few bucket sizes so that each compiles once \
             (`kiln::models::text::Buckets`, as `kiln train bert|roberta|t5` do; name each with `kiln::bucket` and \
             its compile is expected), or for a decoder pack the text into fixed-length windows (as `kiln train \
             gpt2|llama` do)",
        );
    }
    Some(text)
}

fn describe_difference(new: &Node, was: &Node) -> String {
    if new.outputs != was.outputs {
        // Name the output that changed: a multi-output op (rng_bit_generator:
        // state and bits) may keep its first output's type.
        let changed = new.outputs.iter().zip(&was.outputs).position(|(n, w)| n != w);
        return match changed {
            Some(k) if new.outputs.len() == 1 => {
                format!("its type was {} and is now {}", was.outputs[k], new.outputs[k])
            }
            Some(k) => format!("its output {k} was {} and is now {}", was.outputs[k], new.outputs[k]),
            None => {
                let types = |n: &Node| n.outputs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
                format!("its outputs were ({}) and are now ({})", types(was), types(new))
            }
        };
    }
    match (&new.op, &was.op) {
        (Op::Constant { literal: n }, Op::Constant { literal: w }) => format!(
            "a constant changed ({} -> {}); a Rust value recorded as a constant changes the program: pass it as a \
             tensor instead (as the optimizers do with the learning rate)",
            short(w.to_f64s()),
            short(n.to_f64s())
        ),
        _ => "its attributes changed".to_string(),
    }
}

fn short(v: Vec<f64>) -> String {
    match v.as_slice() {
        [x] => format!("{x}"),
        xs if xs.len() <= 4 => format!("{xs:?}"),
        xs => format!("{} values", xs.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::ir::{DType, NodeId, RngAlgorithm, ValueId};

    fn rng(bits: usize) -> Node {
        let ty = TensorType::new(DType::U32, [bits]);
        Node {
            op: Op::RngBitGenerator {
                algorithm: RngAlgorithm::ThreeFry,
                state: ValueId::new(NodeId::from_index(0), 0),
                ty: ty.clone(),
            },
            outputs: [TensorType::new(DType::U64, [2]), ty].into_iter().collect(),
        }
    }

    /// The H100 harness printed "its type was tensor<2xui64> and is now
    /// tensor<2xui64>" for an rng_bit_generator whose bits changed size.
    #[test]
    fn a_changed_second_output_is_the_one_named() {
        let text = describe_difference(&rng(64), &rng(4096));
        assert!(text.contains("output 1 was tensor<4096xui32> and is now tensor<64xui32>"), "{text}");
    }
}
