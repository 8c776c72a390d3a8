//! The plain, chunked expansion of the LM-head cross-entropy composite: the
//! tokens are split into row blocks of `chunk`, and each block computes its
//! logits `[chunk, vocab]`, their log-sum-exp and the picked logit (forward), or
//! recomputes them for `softmax - onehot` (backward), so no `[tokens, vocab]`
//! logits tensor exists in the program. Blocks are static slices chained by
//! optimization barriers, so XLA runs them one after another
//! (`docs/composites.md`); on a target whose backend drops barriers (XLA CPU)
//! the chain is also a data dependence ([`crate::fence`]), else XLA's
//! scheduler computes every block's logits at once.
//!
//! The fused op (a uniform cotangent `scale`) does both in one loop: each block
//! makes its logits once, takes the loss from them, and turns them into
//! `scale · (softmax - onehot)` for its rows of dh and its share of dw, so the
//! step runs the three matmuls of the plain program and no more. dw is
//! accumulated in the accumulation dtype (f32 for bf16/f16/f32 operands) and
//! rounded to w's dtype once at the end.

use crate::ir::{
    BinaryOp, CompareDir, DType, DotDims, Graph, Literal, Op, ReduceOp, Shape, TensorType, UnaryOp, ValueId,
};
use crate::CompileError;

type Result<T> = std::result::Result<T, CompileError>;

fn v(g: &mut Graph, op: Op) -> Result<ValueId> {
    g.value(op)
}

fn acc(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn convert(g: &mut Graph, x: ValueId, to: DType) -> Result<ValueId> {
    if g.ty(x).dtype == to {
        return Ok(x);
    }
    v(g, Op::Convert { input: x, to })
}

fn rows(g: &mut Graph, x: ValueId, start: usize, end: usize) -> Result<ValueId> {
    let t = g.ty(x).clone();
    let mut lo = vec![0; t.shape.rank()];
    let mut hi = t.shape.dims().to_vec();
    lo[0] = start;
    hi[0] = end;
    let stride = vec![1; t.shape.rank()];
    v(g, Op::Slice { input: x, start: lo, limit: hi, stride })
}

/// One block's logits in the accumulation dtype, its log-sum-exp input
/// pieces and the one-hot mask of its labels.
struct Block {
    logits: ValueId,
    onehot: ValueId,
    shape: Shape,
}

/// Block `start..end`; with `after`, its rows of h pass through an
/// optimization barrier together with `after` (the previous block's result),
/// and, with `guard` (a target that drops barriers), also through the runtime
/// guard on it ([`crate::fence::after`]), so XLA neither merges the blocks'
/// matmuls back into one nor runs them side by side: one block's logits are
/// dead before the next block's exist.
fn block(
    g: &mut Graph,
    h: ValueId,
    w: ValueId,
    labels: ValueId,
    (start, end): (usize, usize),
    after: Option<ValueId>,
    guard: bool,
) -> Result<Block> {
    let dtype = g.ty(h).dtype;
    let hc = rows(g, h, start, end)?;
    let hc = match after {
        Some(prev) => crate::fence::after(g, &[hc], prev, guard)?[0],
        None => hc,
    };
    let lc = rows(g, labels, start, end)?;
    let dims = DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![1], rhs_contract: vec![1] };
    let logits = v(g, Op::DotGeneral { lhs: hc, rhs: w, dims })?;
    let logits = convert(g, logits, acc(dtype))?;
    let shape = g.ty(logits).shape.clone();
    let lt = g.ty(lc).dtype;
    let iota = v(g, Op::Iota { ty: TensorType::new(lt, shape.clone()), axis: 1 })?;
    let lb = v(g, Op::BroadcastInDim { input: lc, shape: shape.clone(), dims: vec![0] })?;
    let hit = v(g, Op::Compare { dir: CompareDir::Eq, lhs: iota, rhs: lb })?;
    let onehot = v(g, Op::Convert { input: hit, to: acc(dtype) })?;
    Ok(Block { logits, onehot, shape })
}

fn row_sum(g: &mut Graph, x: ValueId) -> Result<ValueId> {
    v(g, Op::Reduce { op: ReduceOp::Sum, input: x, axes: vec![1] })
}

fn per_row(g: &mut Graph, x: ValueId, shape: &Shape) -> Result<ValueId> {
    v(g, Op::BroadcastInDim { input: x, shape: shape.clone(), dims: vec![0] })
}

fn blocks(n: usize, chunk: usize) -> Vec<(usize, usize)> {
    let c = chunk.max(1);
    (0..n.div_ceil(c)).map(|i| (i * c, ((i + 1) * c).min(n))).collect()
}

fn concat(g: &mut Graph, parts: Vec<ValueId>) -> Result<ValueId> {
    if parts.len() == 1 {
        return Ok(parts[0]);
    }
    v(g, Op::Concatenate { inputs: parts, axis: 0 })
}

/// One block's loss in the accumulation dtype: the log-sum-exp of each row,
/// the nll (`lse - picked logit`), and the shifted exponentials and their
/// row sums, which the fused loss reuses for the softmax.
struct BlockLoss {
    lse: ValueId,
    nll: ValueId,
    exp: ValueId,
    z: ValueId,
}

fn block_loss(g: &mut Graph, b: &Block) -> Result<BlockLoss> {
    let m = v(g, Op::Reduce { op: ReduceOp::Max, input: b.logits, axes: vec![1] })?;
    let mb = per_row(g, m, &b.shape)?;
    let d = v(g, Op::Binary { op: BinaryOp::Sub, lhs: b.logits, rhs: mb })?;
    let exp = v(g, Op::Unary { op: UnaryOp::Exp, input: d })?;
    let z = row_sum(g, exp)?;
    let lz = v(g, Op::Unary { op: UnaryOp::Log, input: z })?;
    let lse = v(g, Op::Binary { op: BinaryOp::Add, lhs: m, rhs: lz })?;
    let picked = v(g, Op::Binary { op: BinaryOp::Mul, lhs: b.logits, rhs: b.onehot })?;
    let picked = row_sum(g, picked)?;
    let nll = v(g, Op::Binary { op: BinaryOp::Sub, lhs: lse, rhs: picked })?;
    Ok(BlockLoss { lse, nll, exp, z })
}

/// `[nll, lse]` of `lm_head_cross_entropy`, appended to `g`.
pub(crate) fn expand_forward(
    g: &mut Graph,
    h: ValueId,
    w: ValueId,
    labels: ValueId,
    chunk: usize,
    guard: bool,
) -> Result<[ValueId; 2]> {
    let n = g.ty(h).shape.dims()[0];
    let (mut nll, mut lse) = (Vec::new(), Vec::new());
    let mut after = None;
    for (s, e) in blocks(n, chunk) {
        let b = block(g, h, w, labels, (s, e), after, guard)?;
        let r = block_loss(g, &b)?;
        after = Some(r.nll);
        nll.push(convert(g, r.nll, DType::F32)?);
        lse.push(convert(g, r.lse, DType::F32)?);
    }
    Ok([concat(g, nll)?, concat(g, lse)?])
}

/// `[dh, dw]` of `lm_head_cross_entropy_grad`, appended to `g`:
/// `dlogits = dnll · (softmax - onehot)` per block, recomputed from `lse`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn expand_backward(
    g: &mut Graph,
    h: ValueId,
    w: ValueId,
    labels: ValueId,
    lse: ValueId,
    dnll: ValueId,
    chunk: usize,
    guard: bool,
) -> Result<[ValueId; 2]> {
    let dtype = g.ty(h).dtype;
    let n = g.ty(h).shape.dims()[0];
    let (mut dh, mut dw) = (Vec::new(), None);
    let a = acc(dtype);
    let (lse, dnll) = (convert(g, lse, a)?, convert(g, dnll, a)?);
    for (s, e) in blocks(n, chunk) {
        let b = block(g, h, w, labels, (s, e), dw, guard)?;
        let lc = rows(g, lse, s, e)?;
        let lb = per_row(g, lc, &b.shape)?;
        let d = v(g, Op::Binary { op: BinaryOp::Sub, lhs: b.logits, rhs: lb })?;
        let p = v(g, Op::Unary { op: UnaryOp::Exp, input: d })?;
        let diff = v(g, Op::Binary { op: BinaryOp::Sub, lhs: p, rhs: b.onehot })?;
        let gc = rows(g, dnll, s, e)?;
        let gb = per_row(g, gc, &b.shape)?;
        let dl = v(g, Op::Binary { op: BinaryOp::Mul, lhs: diff, rhs: gb })?;
        let dl = convert(g, dl, dtype)?;
        let (dh_block, dw_sum) = block_grads(g, dl, w, h, (s, e), dw)?;
        dh.push(dh_block);
        dw = Some(dw_sum);
    }
    let dw = match dw {
        Some(x) => convert(g, x, dtype)?,
        None => {
            let t = g.ty(w).clone();
            let z = v(g, Op::Constant { literal: Literal::scalar(t.dtype, 0.0) })?;
            v(g, Op::BroadcastInDim { input: z, shape: t.shape, dims: vec![] })?
        }
    };
    Ok([concat(g, dh)?, dw])
}

/// One block's share of the gradient from its `dl` (`[c, vocab]`, in h's
/// dtype): the block's rows of dh, `dl · w`, and the running dw plus
/// `dlᵀ · h_block`, accumulated in f32 (f64 for f64).
fn block_grads(
    g: &mut Graph,
    dl: ValueId,
    w: ValueId,
    h: ValueId,
    (start, end): (usize, usize),
    dw: Option<ValueId>,
) -> Result<(ValueId, ValueId)> {
    let a = acc(g.ty(h).dtype);
    let mm = DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![1], rhs_contract: vec![0] };
    let dh = v(g, Op::DotGeneral { lhs: dl, rhs: w, dims: mm })?;
    let hc = rows(g, h, start, end)?;
    let tm = DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![0], rhs_contract: vec![0] };
    let part = v(g, Op::DotGeneral { lhs: dl, rhs: hc, dims: tm })?;
    let part = convert(g, part, a)?;
    let dw = match dw {
        None => part,
        Some(prev) => v(g, Op::Binary { op: BinaryOp::Add, lhs: prev, rhs: part })?,
    };
    Ok((dh, dw))
}

/// `[nll, lse, dh, dw]` of `lm_head_cross_entropy_fused`, appended to `g`: per
/// block exactly three matmuls (logits, dh rows, dw share), and no value of
/// `[n, vocab]` elements.
pub(crate) fn expand_fused(
    g: &mut Graph,
    h: ValueId,
    w: ValueId,
    labels: ValueId,
    scale: ValueId,
    chunk: usize,
    guard: bool,
) -> Result<[ValueId; 4]> {
    let dtype = g.ty(h).dtype;
    let n = g.ty(h).shape.dims()[0];
    let a = acc(dtype);
    let scale = convert(g, scale, a)?;
    let (mut nll, mut lse, mut dh, mut dw) = (Vec::new(), Vec::new(), Vec::new(), None);
    for (s, e) in blocks(n, chunk) {
        // Chained on the running dw: block i+1's logits are made after block
        // i's dw share is added, so at most one block of logits is live.
        let b = block(g, h, w, labels, (s, e), dw, guard)?;
        let r = block_loss(g, &b)?;
        nll.push(convert(g, r.nll, DType::F32)?);
        lse.push(convert(g, r.lse, DType::F32)?);
        // softmax = exp(logits - max) / z, from the exponentials already made.
        let zb = per_row(g, r.z, &b.shape)?;
        let p = v(g, Op::Binary { op: BinaryOp::Div, lhs: r.exp, rhs: zb })?;
        let diff = v(g, Op::Binary { op: BinaryOp::Sub, lhs: p, rhs: b.onehot })?;
        let sb = v(g, Op::BroadcastInDim { input: scale, shape: b.shape.clone(), dims: vec![] })?;
        let dl = v(g, Op::Binary { op: BinaryOp::Mul, lhs: diff, rhs: sb })?;
        let dl = convert(g, dl, dtype)?;
        let (dh_block, dw_sum) = block_grads(g, dl, w, h, (s, e), dw)?;
        dh.push(dh_block);
        dw = Some(dw_sum);
    }
    let dw = match dw {
        Some(x) => convert(g, x, dtype)?,
        None => {
            return Err(CompileError::Verify { node: "lm_head_cross_entropy_fused".into(), reason: "no rows".into() })
        }
    };
    Ok([concat(g, nll)?, concat(g, lse)?, concat(g, dh)?, dw])
}
