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
//!
//! A block holds one `[chunk, vocab]` buffer, not two: the label's logit is
//! gathered from the logits (no reduction reads them for it), and the
//! gradient `dl` is written over the logits as the GEMM wrote them, in two
//! column parts, each read from the range it replaces
//! ([`dl_over_logits`]). Their start indices pass through an optimization
//! barrier, so XLA cannot fold them to constants: it runs a dynamic update
//! slice whose update reads the same range in place, where for constant
//! starts it ran a loop over the whole block (`docs/memory.md`, "dl written
//! over the logits").
//!
//! With `shards` > 1 (the rows split over a mesh's `data` axis, [`Rows`]) a
//! block takes `chunk` rows of every shard, each block's dw share keeps one
//! sum per shard (a batched GEMM), and the shards' sums are added once after
//! the last block, so XLA's SPMD partitioner runs every block on each
//! device's own rows with no communication, and all-reduces dw once. The
//! label's logit is then a one-hot row sum: a gather from the flattened block
//! is one the partitioner cannot prove local, and it all-gathered its indices
//! and all-reduced its result every block.

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

/// How the composite's `n` rows are split: `shards` equal contiguous parts
/// (one per device of a mesh's `data` axis, 1 otherwise), each cut into
/// blocks of `chunk` rows; block `i` is rows `i·chunk..` of every part.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows {
    pub chunk: usize,
    pub shards: usize,
}

impl Rows {
    /// `(start, end)` of each block within a part of `n / shards` rows.
    fn blocks(self, n: usize) -> Vec<(usize, usize)> {
        let part = n / self.shards;
        let c = self.chunk.max(1);
        (0..part.div_ceil(c)).map(|i| (i * c, ((i + 1) * c).min(part))).collect()
    }

    /// Rows `start..end` of every part of `x` (`[n, ...]`), in part order:
    /// `[shards · (end - start), ...]`.
    fn take(self, g: &mut Graph, x: ValueId, (start, end): (usize, usize)) -> Result<ValueId> {
        if self.shards == 1 {
            return slice_axis(g, x, 0, (start, end));
        }
        let parts = split_rows(g, x, self.shards)?;
        let block = slice_axis(g, parts, 1, (start, end))?;
        merge_rows(g, block)
    }

    /// The blocks' results (`[shards · c, ...]` each, from [`Rows::take`])
    /// joined back into `[n, ...]` in the rows' order.
    fn join(self, g: &mut Graph, blocks: Vec<ValueId>) -> Result<ValueId> {
        if self.shards == 1 || blocks.len() == 1 {
            return concat(g, blocks);
        }
        let parts = blocks.into_iter().map(|b| split_rows(g, b, self.shards)).collect::<Result<Vec<_>>>()?;
        let joined = v(g, Op::Concatenate { inputs: parts, axis: 1 })?;
        merge_rows(g, joined)
    }
}

/// The table `w` as the blocks read it: whole on every device when the rows
/// are split ([`Op::Whole`]). Each device runs its own rows against the whole
/// vocabulary. Left to choose, XLA's SPMD partitioner kept an FSDP table split
/// over the vocabulary and moved rows and logits instead: it gathered each
/// block's rows, made the logits of half the vocabulary on each device, and
/// all-gathered and all-to-all'ed them (3.6 GB of all-gathers and 1.6 GB of
/// all-to-alls a step for gpt2-small on two GPUs, `docs/sharding.md`).
fn table(g: &mut Graph, w: ValueId, rows: Rows) -> Result<ValueId> {
    if rows.shards > 1 {
        v(g, Op::Whole { input: w })
    } else {
        Ok(w)
    }
}

/// `[n, ...]` as `[parts, n / parts, ...]`.
fn split_rows(g: &mut Graph, x: ValueId, parts: usize) -> Result<ValueId> {
    let dims = g.ty(x).shape.dims().to_vec();
    let mut to = vec![parts, dims[0] / parts];
    to.extend_from_slice(&dims[1..]);
    v(g, Op::Reshape { input: x, shape: Shape::from(to) })
}

/// `[a, b, ...]` as `[a · b, ...]`.
fn merge_rows(g: &mut Graph, x: ValueId) -> Result<ValueId> {
    let dims = g.ty(x).shape.dims().to_vec();
    let mut to = vec![dims[0] * dims[1]];
    to.extend_from_slice(&dims[2..]);
    v(g, Op::Reshape { input: x, shape: Shape::from(to) })
}

/// `x` with `start..end` of its `axis`.
fn slice_axis(g: &mut Graph, x: ValueId, axis: usize, (start, end): (usize, usize)) -> Result<ValueId> {
    let t = g.ty(x).clone();
    let mut lo = vec![0; t.shape.rank()];
    let mut hi = t.shape.dims().to_vec();
    lo[axis] = start;
    hi[axis] = end;
    let stride = vec![1; t.shape.rank()];
    v(g, Op::Slice { input: x, start: lo, limit: hi, stride })
}

/// One block: its logits as the GEMM writes them (in h's dtype) and in the
/// accumulation dtype, and its labels.
struct Block {
    raw: ValueId,
    logits: ValueId,
    labels: ValueId,
    shape: Shape,
}

/// Block `start..end`; with `after`, its rows of h pass through an
/// optimization barrier together with `after` (the previous block's result),
/// and, with `guard` (a target that drops barriers), also through the runtime
/// guard on it ([`crate::fence::after`]), so XLA neither merges the blocks'
/// matmuls back into one nor runs them side by side: one block's logits are
/// dead before the next block's exist. `carry` (the previous block's rows of
/// dh, or in the forward alone its nll) passes through the same barrier and
/// is returned fenced, for the caller to read instead: XLA keeps only the
/// barrier operands whose results are read, and with dh it then finishes
/// that dh GEMM's split-K sum in the block that made it, where it had kept
/// every block's f32 pieces (12 MiB each for gpt2-small) for the final join.
#[allow(clippy::too_many_arguments)]
fn block(
    g: &mut Graph,
    h: ValueId,
    w: ValueId,
    labels: ValueId,
    (r, span): (Rows, (usize, usize)),
    after: Option<ValueId>,
    carry: Option<&mut ValueId>,
    guard: bool,
) -> Result<Block> {
    let dtype = g.ty(h).dtype;
    let hc = r.take(g, h, span)?;
    let hc = match (after, carry) {
        (Some(prev), Some(dh)) => {
            let fenced = crate::fence::after(g, &[hc, *dh], prev, guard)?;
            *dh = fenced[1];
            fenced[0]
        }
        (Some(prev), None) => crate::fence::after(g, &[hc], prev, guard)?[0],
        (None, _) => hc,
    };
    let lc = r.take(g, labels, span)?;
    let dims = DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![1], rhs_contract: vec![1] };
    let raw = v(g, Op::DotGeneral { lhs: hc, rhs: w, dims })?;
    let logits = convert(g, raw, acc(dtype))?;
    let shape = g.ty(logits).shape.clone();
    Ok(Block { raw, logits, labels: lc, shape })
}

/// Each row's logit at its label in the accumulation dtype, gathered from the
/// block's flattened logits; 0 for a label outside the vocabulary, as the
/// one-hot row sum it replaces gave. No reduction reads the logits for it, so
/// the kernel that turns them into dl reads them elementwise only.
fn picked_logit(g: &mut Graph, b: &Block) -> Result<ValueId> {
    let (rows, vocab) = (b.shape.dims()[0], b.shape.dims()[1]);
    let flat = v(g, Op::Reshape { input: b.raw, shape: Shape::from(vec![rows * vocab]) })?;
    let row_shape = Shape::from(vec![rows]);
    let label = convert(g, b.labels, DType::I64)?;
    let row = v(g, Op::Iota { ty: TensorType::new(DType::I64, row_shape.clone()), axis: 0 })?;
    let width = g.splat(DType::I64, vocab as f64, &row_shape)?;
    let start = v(g, Op::Binary { op: BinaryOp::Mul, lhs: row, rhs: width })?;
    let index = v(g, Op::Binary { op: BinaryOp::Add, lhs: start, rhs: label })?;
    let picked = v(g, Op::Gather { operand: flat, indices: index, axis: 0 })?;
    let picked = convert(g, picked, acc(g.ty(b.raw).dtype))?;
    let zero = g.splat(DType::I64, 0.0, &row_shape)?;
    let not_below = v(g, Op::Compare { dir: CompareDir::Ge, lhs: label, rhs: zero })?;
    let below_top = v(g, Op::Compare { dir: CompareDir::Lt, lhs: label, rhs: width })?;
    let in_vocab = v(g, Op::Binary { op: BinaryOp::And, lhs: not_below, rhs: below_top })?;
    let none = g.splat(g.ty(picked).dtype, 0.0, &row_shape)?;
    v(g, Op::Select { pred: in_vocab, on_true: picked, on_false: none })
}

/// The column ranges `(start, width)` [`dl_over_logits`] writes one at a
/// time: two halves, the first a multiple of 64 columns when that leaves
/// both non-empty (whole GEMM tiles for the dh GEMM reading them); one range
/// for a vocabulary of one.
fn column_parts(vocab: usize) -> Vec<(usize, usize)> {
    let half = vocab / 2;
    let first = if half >= 64 { half - half % 64 } else { half };
    if first == 0 {
        return vec![(0, vocab)];
    }
    vec![(0, first), (first, vocab - first)]
}

/// Each row's logit at its label in the accumulation dtype, as the row sum
/// of the logits where the column is the label (0 for a label outside the
/// vocabulary): the form for rows split over shards, which the partitioner
/// runs on each device's rows.
fn picked_by_row_sum(g: &mut Graph, b: &Block) -> Result<ValueId> {
    let hit = on_label(g, b.labels, &b.shape, 0)?;
    let zero = g.splat(g.ty(b.logits).dtype, 0.0, &b.shape)?;
    let on_label = v(g, Op::Select { pred: hit, on_true: b.logits, on_false: zero })?;
    row_sum(g, on_label)
}

/// `pred[rows, cols]` of a block's columns `first..first + cols`: true where
/// the column is the row's label (`labels: [rows]`).
fn on_label(g: &mut Graph, labels: ValueId, shape: &Shape, first: usize) -> Result<ValueId> {
    let label_dtype = g.ty(labels).dtype;
    let mut col = v(g, Op::Iota { ty: TensorType::new(label_dtype, shape.clone()), axis: 1 })?;
    if first > 0 {
        let offset = g.splat(label_dtype, first as f64, shape)?;
        col = v(g, Op::Binary { op: BinaryOp::Add, lhs: col, rhs: offset })?;
    }
    let lb = per_row(g, labels, shape)?;
    v(g, Op::Compare { dir: CompareDir::Eq, lhs: col, rhs: lb })
}

/// How a block's softmax and cotangent are made from its logits.
enum Softmax {
    /// `exp(x - max) / z` with the cotangent `scale` (the fused loss).
    Shifted { max: ValueId, z: ValueId, scale: ValueId },
    /// `exp(x - lse)` with a cotangent per row (the backward alone).
    FromLse { lse: ValueId, dnll: ValueId },
}

/// The block's `dl = cotangent · (softmax - onehot)` in h's dtype, written
/// over its logits as the GEMM wrote them ([`column_parts`] at a time, each
/// part read from the range it replaces), so the block holds one
/// `[chunk, vocab]` buffer where a separate dl held two. The parts' start
/// indices are fenced after `after` (the block's picked logit, which must be
/// read before the logits are overwritten): the barrier keeps XLA from
/// folding them into constants, for which it ran a loop over the whole block
/// instead of an in-place update of the part.
fn dl_over_logits(g: &mut Graph, b: &Block, sm: &Softmax, after: Option<ValueId>, guard: bool) -> Result<ValueId> {
    let dtype = g.ty(b.raw).dtype;
    let a = acc(dtype);
    let rows = b.shape.dims()[0];
    let parts = column_parts(b.shape.dims()[1]);
    let consts: Vec<ValueId> = parts
        .iter()
        .map(|&(start, _)| v(g, Op::Constant { literal: Literal::scalar(DType::I32, start as f64) }))
        .collect::<Result<_>>()?;
    let starts = match after {
        Some(anchor) => crate::fence::after(g, &consts, anchor, guard)?,
        None => {
            let n = g.add(Op::OptimizationBarrier { inputs: consts.clone() })?;
            (0..consts.len() as u32).map(|k| ValueId::new(n, k)).collect()
        }
    };
    let row0 = v(g, Op::Constant { literal: Literal::scalar(DType::I32, 0.0) })?;
    let mut buf = b.raw;
    for (&(start, width), &at) in parts.iter().zip(&starts) {
        let shape = Shape::from(vec![rows, width]);
        let x = v(g, Op::DynamicSlice { input: buf, starts: vec![row0, at], sizes: vec![rows, width] })?;
        let x = convert(g, x, a)?;
        let (p, cot) = match *sm {
            Softmax::Shifted { max, z, scale } => {
                let mb = per_row(g, max, &shape)?;
                let d = v(g, Op::Binary { op: BinaryOp::Sub, lhs: x, rhs: mb })?;
                let e = v(g, Op::Unary { op: UnaryOp::Exp, input: d })?;
                let zb = per_row(g, z, &shape)?;
                let p = v(g, Op::Binary { op: BinaryOp::Div, lhs: e, rhs: zb })?;
                (p, v(g, Op::BroadcastInDim { input: scale, shape: shape.clone(), dims: vec![] })?)
            }
            Softmax::FromLse { lse, dnll } => {
                let lb = per_row(g, lse, &shape)?;
                let d = v(g, Op::Binary { op: BinaryOp::Sub, lhs: x, rhs: lb })?;
                (v(g, Op::Unary { op: UnaryOp::Exp, input: d })?, per_row(g, dnll, &shape)?)
            }
        };
        let hit = on_label(g, b.labels, &shape, start)?;
        let onehot = v(g, Op::Convert { input: hit, to: a })?;
        let diff = v(g, Op::Binary { op: BinaryOp::Sub, lhs: p, rhs: onehot })?;
        let dl = v(g, Op::Binary { op: BinaryOp::Mul, lhs: diff, rhs: cot })?;
        let dl = convert(g, dl, dtype)?;
        buf = v(g, Op::DynamicUpdateSlice { input: buf, update: dl, starts: vec![row0, at] })?;
    }
    Ok(buf)
}

fn row_sum(g: &mut Graph, x: ValueId) -> Result<ValueId> {
    v(g, Op::Reduce { op: ReduceOp::Sum, input: x, axes: vec![1] })
}

fn per_row(g: &mut Graph, x: ValueId, shape: &Shape) -> Result<ValueId> {
    v(g, Op::BroadcastInDim { input: x, shape: shape.clone(), dims: vec![0] })
}

fn concat(g: &mut Graph, parts: Vec<ValueId>) -> Result<ValueId> {
    if parts.len() == 1 {
        return Ok(parts[0]);
    }
    v(g, Op::Concatenate { inputs: parts, axis: 0 })
}

/// One block's loss in the accumulation dtype: the log-sum-exp of each row,
/// the nll (`lse - picked logit`), the picked logit, and the row maxima and
/// sums of shifted exponentials, which the fused loss reuses for the softmax.
struct BlockLoss {
    lse: ValueId,
    nll: ValueId,
    picked: ValueId,
    max: ValueId,
    z: ValueId,
}

fn block_loss(g: &mut Graph, b: &Block, r: Rows) -> Result<BlockLoss> {
    let m = v(g, Op::Reduce { op: ReduceOp::Max, input: b.logits, axes: vec![1] })?;
    let mb = per_row(g, m, &b.shape)?;
    let d = v(g, Op::Binary { op: BinaryOp::Sub, lhs: b.logits, rhs: mb })?;
    let exp = v(g, Op::Unary { op: UnaryOp::Exp, input: d })?;
    let z = row_sum(g, exp)?;
    let lz = v(g, Op::Unary { op: UnaryOp::Log, input: z })?;
    let lse = v(g, Op::Binary { op: BinaryOp::Add, lhs: m, rhs: lz })?;
    let picked = if r.shards == 1 { picked_logit(g, b)? } else { picked_by_row_sum(g, b)? };
    let nll = v(g, Op::Binary { op: BinaryOp::Sub, lhs: lse, rhs: picked })?;
    Ok(BlockLoss { lse, nll, picked, max: m, z })
}

/// `[nll, lse]` of `lm_head_cross_entropy`, appended to `g`.
pub(crate) fn expand_forward(
    g: &mut Graph,
    h: ValueId,
    w: ValueId,
    labels: ValueId,
    rows: Rows,
    guard: bool,
) -> Result<[ValueId; 2]> {
    let n = g.ty(h).shape.dims()[0];
    let w = table(g, w, rows)?;
    let (mut nll, mut lse) = (Vec::new(), Vec::new());
    for span in rows.blocks(n) {
        // Each block's rows of h pass one barrier with the previous block's
        // nll, and that nll is read through it: XLA CUDA drops a barrier's
        // operand whose result nothing reads, and with it the order. With the
        // nll only an anchor, it ran all eight of gpt2-small's 1024-row blocks
        // of logits back to back, each in its own buffer (`docs/memory-journal.md`,
        // "The LM head in two passes").
        let after = nll.last().copied();
        let b = block(g, h, w, labels, (rows, span), after, nll.last_mut(), guard)?;
        let r = block_loss(g, &b, rows)?;
        nll.push(r.nll);
        lse.push(convert(g, r.lse, DType::F32)?);
    }
    let nll = nll.into_iter().map(|x| convert(g, x, DType::F32)).collect::<Result<Vec<_>>>()?;
    Ok([rows.join(g, nll)?, rows.join(g, lse)?])
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
    rows: Rows,
    guard: bool,
) -> Result<[ValueId; 2]> {
    let dtype = g.ty(h).dtype;
    let n = g.ty(h).shape.dims()[0];
    let w = table(g, w, rows)?;
    let (mut dh, mut dw) = (Vec::new(), None);
    let a = acc(dtype);
    let (lse, dnll) = (convert(g, lse, a)?, convert(g, dnll, a)?);
    for span in rows.blocks(n) {
        let b = block(g, h, w, labels, (rows, span), dw, dh.last_mut(), guard)?;
        let sm = Softmax::FromLse { lse: rows.take(g, lse, span)?, dnll: rows.take(g, dnll, span)? };
        let dl = dl_over_logits(g, &b, &sm, None, guard)?;
        let (dh_block, dw_sum) = block_grads(g, dl, w, h, (rows, span), dw)?;
        dh.push(dh_block);
        dw = Some(dw_sum);
    }
    let dh = finish(g, rows, dh, dw, guard)?;
    let dw = match dw {
        Some(x) => total_dw(g, x, dtype)?,
        None => {
            let t = g.ty(w).clone();
            g.splat(t.dtype, 0.0, &t.shape)?
        }
    };
    Ok([dh, dw])
}

/// One block's share of the gradient from its `dl` (`[c, vocab]`, in h's
/// dtype): the block's rows of dh, `dl · w`, and the running dw plus
/// `dlᵀ · h_block`, accumulated in f32 (f64 for f64). With shards, the share
/// and the running dw keep one sum per shard (`[shards, vocab, d]`, a batched
/// GEMM over each shard's rows), added up by [`total_dw`].
fn block_grads(
    g: &mut Graph,
    dl: ValueId,
    w: ValueId,
    h: ValueId,
    (r, span): (Rows, (usize, usize)),
    dw: Option<ValueId>,
) -> Result<(ValueId, ValueId)> {
    let a = acc(g.ty(h).dtype);
    let mm = DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![1], rhs_contract: vec![0] };
    let dh = v(g, Op::DotGeneral { lhs: dl, rhs: w, dims: mm })?;
    let hc = r.take(g, h, span)?;
    let part = if r.shards == 1 {
        let tm = DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![0], rhs_contract: vec![0] };
        v(g, Op::DotGeneral { lhs: dl, rhs: hc, dims: tm })?
    } else {
        let (dl, hc) = (split_rows(g, dl, r.shards)?, split_rows(g, hc, r.shards)?);
        let tm = DotDims { lhs_batch: vec![0], rhs_batch: vec![0], lhs_contract: vec![1], rhs_contract: vec![1] };
        v(g, Op::DotGeneral { lhs: dl, rhs: hc, dims: tm })?
    };
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
    rows: Rows,
    guard: bool,
) -> Result<[ValueId; 4]> {
    let dtype = g.ty(h).dtype;
    let n = g.ty(h).shape.dims()[0];
    let w = table(g, w, rows)?;
    let a = acc(dtype);
    let scale = convert(g, scale, a)?;
    let (mut nll, mut lse, mut dh, mut dw) = (Vec::new(), Vec::new(), Vec::new(), None);
    for span in rows.blocks(n) {
        // Chained on the running dw: block i+1's logits are made after block
        // i's dw share is added, so at most one block of logits is live.
        let b = block(g, h, w, labels, (rows, span), dw, dh.last_mut(), guard)?;
        let r = block_loss(g, &b, rows)?;
        nll.push(convert(g, r.nll, DType::F32)?);
        lse.push(convert(g, r.lse, DType::F32)?);
        // softmax = exp(logits - max) / z, as the loss's row sums made it.
        let sm = Softmax::Shifted { max: r.max, z: r.z, scale };
        let dl = dl_over_logits(g, &b, &sm, Some(r.picked), guard)?;
        let (dh_block, dw_sum) = block_grads(g, dl, w, h, (rows, span), dw)?;
        dh.push(dh_block);
        dw = Some(dw_sum);
    }
    let dh = finish(g, rows, dh, dw, guard)?;
    let dw = match dw {
        Some(x) => total_dw(g, x, dtype)?,
        None => {
            return Err(CompileError::Verify { node: "lm_head_cross_entropy_fused".into(), reason: "no rows".into() })
        }
    };
    Ok([rows.join(g, nll)?, rows.join(g, lse)?, dh, dw])
}

/// The running dw summed over its shards (when it has a shard axis) and
/// rounded to `dtype`.
fn total_dw(g: &mut Graph, running: ValueId, dtype: DType) -> Result<ValueId> {
    let running = if g.ty(running).shape.rank() == 3 {
        v(g, Op::Reduce { op: ReduceOp::Sum, input: running, axes: vec![0] })?
    } else {
        running
    };
    convert(g, running, dtype)
}

/// The blocks' rows of `dh` joined, and fenced after the running dw's last
/// sum (when there is one), so the backward that reads dh starts after the
/// last block's dw share is made and added. Unfenced, XLA's CUDA scheduler
/// put that GEMM at the end of the step, where the tied table's gradient
/// first reads dw, and kept the last block's dl (196.5 MiB for gpt2-small)
/// live through the whole backward (`docs/memory-journal.md`, "dl written over the
/// logits"). The anchor is the f32 sum, a kernel's output: a fence on its
/// rounding to w's dtype, which XLA fuses into the later reader, held nothing.
fn finish(g: &mut Graph, rows: Rows, dh: Vec<ValueId>, running_dw: Option<ValueId>, guard: bool) -> Result<ValueId> {
    let dh = rows.join(g, dh)?;
    match running_dw {
        Some(dw) => Ok(crate::fence::after(g, &[dh], dw, guard)?[0]),
        None => Ok(dh),
    }
}
