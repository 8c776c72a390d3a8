//! The reference interpreter: evaluates a graph on the host, one op at a time.
//!
//! It is the oracle for parity tests (XLA must agree with it) and the engine of
//! the eager debug backend. Simplicity over speed, with these rules:
//! - Values are [`Literal`]s. Data-movement ops (broadcast, reshape, transpose,
//!   slices, pads, concatenation, gathers, select) copy element bytes, so they
//!   are exact for every dtype.
//! - Float arithmetic runs in f64 and rounds once to the result dtype, which
//!   equals IEEE f32/f16/bf16 arithmetic for +, -, *, / and sqrt, and differs from
//!   XLA's transcendental approximations by about an ulp. Dots and reductions
//!   accumulate in f64.
//! - Integer arithmetic runs in i128 and wraps to the dtype's width (two's
//!   complement), so 64-bit values stay exact. Division by zero gives -1 for
//!   division and the dividend for remainder, as XLA does.
//! - `rng_bit_generator` reproduces XLA's Threefry/Philox bits and layout
//!   (`rng.rs`; parity-tested against the plugin).
//!
//! Only nodes the outputs need are evaluated.

mod attention;
mod layer_norm;
mod lm_head;
mod ops;
mod rng;

use crate::ir::{Graph, HostCopyStep, Literal, NodeId, Op, ValueId};
use crate::CompileError;

pub(crate) fn err(op: &'static str, reason: impl Into<String>) -> CompileError {
    CompileError::Interpret { op, reason: reason.into() }
}

/// Evaluates one op whose operands `get` returns, with result types `outs`
/// (a node's `outputs`): what a host backend that runs most ops elsewhere
/// falls back on (exact integer, pred and RNG semantics). Parameters and
/// `all_reduce` are not ops of one replica and are refused.
pub fn interpret_op<'a>(
    op: &Op,
    outs: &[crate::ir::TensorType],
    get: &dyn Fn(ValueId) -> &'a Literal,
) -> Result<Vec<Literal>, CompileError> {
    ops::eval(op, outs, get)
}

/// Evaluates `g`'s outputs given one literal per parameter.
pub fn interpret(g: &Graph, inputs: &[Literal]) -> Result<Vec<Literal>, CompileError> {
    let mut out = interpret_replicated(g, &[inputs.to_vec()])?;
    Ok(out.pop().unwrap_or_default())
}

/// Evaluates `g` on N replicas in lockstep; `all_reduce` combines across them.
pub fn interpret_replicated(g: &Graph, inputs: &[Vec<Literal>]) -> Result<Vec<Vec<Literal>>, CompileError> {
    let types = g.param_types();
    for (r, list) in inputs.iter().enumerate() {
        if list.len() != types.len() {
            return Err(err("parameter", format!("replica {r}: {} inputs for {} parameters", list.len(), types.len())));
        }
        for (i, (l, t)) in list.iter().zip(&types).enumerate() {
            if l.ty() != t {
                return Err(err("parameter", format!("replica {r}: parameter {i} expects {t}, got {}", l.ty())));
            }
        }
    }
    let n = g.len();
    let mut needed = vec![false; n];
    for v in g.outputs() {
        needed[v.node.index()] = true;
    }
    for i in (0..n).rev() {
        if needed[i] {
            for v in g.node(NodeId::from_index(i)).op.inputs() {
                needed[v.node.index()] = true;
            }
        }
    }
    let replicas = inputs.len();
    // values[replica][node] = outputs of that node.
    let mut values: Vec<Vec<Vec<Literal>>> = vec![vec![Vec::new(); n]; replicas];
    // Values on their trip to the host (`host_copy`), by replica and slot.
    let mut host: Vec<std::collections::HashMap<u32, Literal>> = vec![Default::default(); replicas];
    for (id, node) in g.nodes() {
        if !needed[id.index()] {
            continue;
        }
        if let Op::AllReduce { op, input } = &node.op {
            let parts: Vec<&Literal> = values.iter().map(|v| &v[input.node.index()][input.output as usize]).collect();
            let combined = ops::all_reduce(*op, &parts)?;
            for v in values.iter_mut() {
                v[id.index()] = vec![combined.clone()];
            }
            continue;
        }
        for (r, v) in values.iter_mut().enumerate() {
            let get = |x: ValueId| -> &Literal { &v[x.node.index()][x.output as usize] };
            let outs = match &node.op {
                Op::Parameter { index, .. } => vec![inputs[r][*index as usize].clone()],
                Op::HostCopy { inputs, step: HostCopyStep::Out, slot, .. } => {
                    host[r].insert(*slot, get(inputs[0]).clone());
                    ops::eval(&node.op, &node.outputs, &get)?
                }
                Op::HostCopy { step: HostCopyStep::In, slot, .. } => vec![host[r]
                    .remove(slot)
                    .ok_or_else(|| err("host_copy", format!("slot {slot} is copied back but was never copied out")))?],
                op => ops::eval(op, &node.outputs, &get)?,
            };
            v[id.index()] = outs;
        }
    }
    Ok(values
        .iter()
        .map(|v| g.outputs().iter().map(|o| v[o.node.index()][o.output as usize].clone()).collect())
        .collect())
}

/// Evaluates one op on literal operands (for constant folding): `operand(v)`
/// gives the literal of each operand value. Not for parameters or collectives.
pub(crate) fn eval_op<'a>(
    op: &Op,
    outputs: &[crate::ir::TensorType],
    operand: &dyn Fn(ValueId) -> &'a Literal,
) -> Result<Vec<Literal>, CompileError> {
    ops::eval(op, outputs, operand)
}
