//! Ordering fences that every backend keeps.
//!
//! An `optimization_barrier` orders and separates values on XLA's CUDA
//! backend, but XLA's CPU backend removes every barrier in its layout
//! pipeline, before a later CSE pass (`docs/memory.md`, "The CPU model on
//! gpt2-small"). There a barrier orders nothing: recomputed values merge with
//! their originals and independent blocks run side by side.
//!
//! The fence that survives is a data dependence that no simplifier can fold:
//! `x` read as `select(always, x, 0)`, where `always` is `a == a || a != a`
//! for the first element `a` of an anchor value, or for each of its elements
//! when x has the anchor's shape. It is true at run time for
//! every value, NaN included, so the select is the identity bit for bit; no
//! compiler can prove it, so whatever reads the guarded `x` waits for the
//! anchor and differs from whatever reads `x` itself. The select is
//! elementwise and fuses into its reader's kernel.
//!
//! Used by the remat pass (recomputed chains, pinned backward kernels) and, on
//! the CPU target, by the attention backward's expansion and the LM-head
//! loss's blocks.

use crate::error::CompileError;
use crate::ir::{BinaryOp, CompareDir, DType, Graph, NodeId, Op, Shape, ValueId};

/// A `pred` scalar that is true at run time whatever `anchor` holds, but that
/// no compiler can fold: `x == x || x != x` for the anchor's first element
/// `x` (as a float, where `x == x` is not a tautology because of NaN).
pub(crate) fn always_true(out: &mut Graph, anchor: ValueId) -> Result<ValueId, CompileError> {
    let rank = out.ty(anchor).shape.rank();
    let mut x = anchor;
    if rank > 0 {
        let one =
            out.value(Op::Slice { input: x, start: vec![0; rank], limit: vec![1; rank], stride: vec![1; rank] })?;
        x = out.value(Op::Reshape { input: one, shape: Shape::scalar() })?;
    }
    always_true_each(out, x)
}

/// `select(always, x, 0)`: `x` read through the runtime guard (`always` from
/// [`always_true`]), so that whatever reads it waits for the anchor.
///
/// A constant `x` splatted with 0 reads as `select(always, x, 1)` instead:
/// a select whose branches are the same constant is folded by any
/// simplifier, and the guard with it.
pub(crate) fn read_through(out: &mut Graph, always: ValueId, x: ValueId) -> Result<ValueId, CompileError> {
    let ty = out.ty(x).clone();
    let other = match &out.node(x.node).op {
        Op::Constant { literal } if literal.is_splat() && literal.to_f64s().first() == Some(&0.0) => 1.0,
        _ => 0.0,
    };
    let other = out.splat(ty.dtype, other, &ty.shape)?;
    out.value(Op::Select { pred: always, on_true: x, on_false: other })
}

/// One node held back: it reads `operands` (some of its own) through the
/// runtime guard on `anchor`, so it cannot run before the anchor exists.
pub(crate) struct Hold {
    pub(crate) node: NodeId,
    pub(crate) anchor: ValueId,
    pub(crate) operands: Vec<ValueId>,
}

/// `g` rebuilt with each of `holds` (in node order, one per node) applied;
/// parameters, outputs and aliases keep their indices.
pub(crate) fn hold(g: &Graph, holds: &[Hold]) -> Result<Graph, CompileError> {
    let mut out = Graph::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(g.len());
    let remap = |map: &[NodeId], v: ValueId| ValueId::new(map[v.node.index()], v.output);
    let mut next = holds.iter().peekable();
    for (id, node) in g.nodes() {
        let mut op = node.op.clone();
        match next.next_if(|h| h.node == id) {
            Some(h) => {
                let always = always_true(&mut out, remap(&map, h.anchor))?;
                let mut guarded: Vec<(ValueId, ValueId)> = Vec::with_capacity(h.operands.len());
                for &u in &h.operands {
                    guarded.push((u, read_through(&mut out, always, remap(&map, u))?));
                }
                op.map_inputs(|u| match guarded.iter().find(|(o, _)| *o == u) {
                    Some(&(_, gv)) => gv,
                    None => remap(&map, u),
                });
            }
            None => op.map_inputs(|u| remap(&map, u)),
        }
        map.push(out.add(op)?);
    }
    if let Some(h) = next.next() {
        return Err(CompileError::Verify {
            node: format!("{:?}", h.node),
            reason: "a hold out of node order, or on a node the graph does not have".into(),
        });
    }
    out.set_outputs(g.outputs().iter().map(|&v| remap(&map, v)).collect())?;
    for &a in g.aliases() {
        out.add_alias(a)?;
    }
    Ok(out)
}

/// `xs` read only after `anchor` exists, on every backend: through one
/// `optimization_barrier` with `anchor` (which the CUDA backend keeps), and,
/// where the backend drops barriers (`guard`), also through the runtime guard.
/// An `x` of the anchor's shape is guarded element by element (`select(a == a
/// || a != a, x, 0)` over the whole anchor), so that under SPMD each shard
/// reads its own elements; any other `x` through [`always_true`] on the
/// anchor's first element, which a sharded anchor would have to fetch from
/// the shard holding it (a collective per fence).
pub(crate) fn after(
    out: &mut Graph,
    xs: &[ValueId],
    anchor: ValueId,
    guard: bool,
) -> Result<Vec<ValueId>, CompileError> {
    let mut inputs = xs.to_vec();
    inputs.push(anchor);
    let b = out.add(Op::OptimizationBarrier { inputs })?;
    let fenced: Vec<ValueId> = (0..xs.len()).map(|k| ValueId::new(b, k as u32)).collect();
    if !guard {
        return Ok(fenced);
    }
    let anchor = ValueId::new(b, xs.len() as u32);
    let mut scalar = None;
    let mut elementwise = None;
    let mut guarded = Vec::with_capacity(fenced.len());
    for x in fenced {
        let always = if out.ty(x).shape == out.ty(anchor).shape {
            match elementwise {
                Some(p) => p,
                None => *elementwise.insert(always_true_each(out, anchor)?),
            }
        } else {
            match scalar {
                Some(p) => p,
                None => *scalar.insert(always_true(out, anchor)?),
            }
        };
        guarded.push(read_through(out, always, x)?);
    }
    Ok(guarded)
}

/// [`always_true`] element by element over the whole of `anchor`: a `pred`
/// tensor of its shape, true everywhere at run time.
fn always_true_each(out: &mut Graph, anchor: ValueId) -> Result<ValueId, CompileError> {
    let mut x = anchor;
    if !out.ty(x).dtype.is_float() {
        x = out.value(Op::Convert { input: x, to: DType::F32 })?;
    }
    let eq = out.value(Op::Compare { dir: CompareDir::Eq, lhs: x, rhs: x })?;
    let ne = out.value(Op::Compare { dir: CompareDir::Ne, lhs: x, rhs: x })?;
    out.value(Op::Binary { op: BinaryOp::Or, lhs: eq, rhs: ne })
}
