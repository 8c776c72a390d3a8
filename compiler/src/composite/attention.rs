//! Finding attention written with plain ops, and its plain expansion.
//!
//! The matcher walks up from a rank-4 `dot_general` `P · v` and reads
//! `softmax(mask(scale · q kᵀ + bias)) v` as it finds it, normalising each
//! spelling into the composite's attributes as it goes (`docs/composites.md`,
//! "What the matcher accepts"):
//! - the softmax as `e / Σ e` with `e = exp(x - max x)` or `exp(x)`, or as
//!   `exp(log_softmax(x))`, over the key axis, the max with or without a
//!   gradient;
//! - between the softmax and the score product, in any order: float converts,
//!   multiplications or divisions by a constant (however it is spelled: its
//!   value is read, not its form), masks as `select` against a large negative
//!   constant on either branch (a constant causal table becomes `causal`, any
//!   other mask an operand, `and` of the two both), and additive terms (a
//!   constant causal table of 0 / large negatives becomes `causal`, anything
//!   else a bias operand, read through its broadcast);
//! - `q kᵀ` with `kᵀ` a transpose, folded into the dot, or given as it is
//!   (a converted `kᵀ`: `k_transposed`); a scale on `q` or `k`;
//! - key/value heads repeated by broadcast + reshape (grouped) or by
//!   concatenation (tiled), read as grouped-query attention.
//!
//! Every reading is local to the candidate and every constant it evaluates is
//! cached by structure ([`super::consts`]), so the search costs O(nodes) per
//! step. A candidate that looks like attention (its softmax was found) but is
//! not taken is reported with the reason, for `kiln compile`.

use super::consts::{self, AdditiveTable, ConstCache, PredTable, MASKED};
use crate::ir::{
    AttentionAttrs, BinaryOp, CompareDir, DType, DotDims, Graph, KvHeads, NodeId, Op, ReduceOp, Shape, TensorType,
    UnaryOp, ValueId,
};
use crate::CompileError;

/// One attention found in a graph.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionMatch {
    /// The `P · v` dot that becomes the composite.
    pub root: NodeId,
    /// The composite (`Op::Attention`).
    pub op: Op,
    /// Nodes between the operands and the root that the composite replaces
    /// (scores, mask, softmax), root excluded, in increasing order.
    pub replaced: Vec<NodeId>,
}

/// Why a candidate was not taken; `candidate` when it looked like attention
/// (a softmax over the keys feeding the product), so that the reason is
/// worth reporting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Miss {
    pub reason: String,
    pub candidate: bool,
}

fn op(g: &Graph, v: ValueId) -> &Op {
    &g.node(v.node).op
}

fn dot_dims(batch: [usize; 2], lc: usize, rc: usize) -> DotDims {
    DotDims { lhs_batch: batch.to_vec(), rhs_batch: batch.to_vec(), lhs_contract: vec![lc], rhs_contract: vec![rc] }
}

/// `x` broadcast back over the key axis from `reduce(op, x, [3])`, directly
/// (`dims [0, 1, 2]`) or through a keep-dims reshape (`[b, h, t, 1]`, dims
/// `[0, 1, 2, 3]`), the reduction possibly taken without a gradient
/// (`clamp(m, 0, m)`, [`Tensor::without_grad`]'s spelling). Pushes the chain's
/// nodes to `inner`.
fn is_row_reduction_of(g: &Graph, v: ValueId, want: ReduceOp, x: ValueId, inner: &mut Vec<NodeId>) -> bool {
    let Op::BroadcastInDim { input, dims, .. } = op(g, v) else { return false };
    let mut chain = vec![v.node];
    let mut r = *input;
    if let Op::Clamp { min, input: zero, max } = op(g, r) {
        if min == max && consts_zero(g, *zero) {
            chain.push(r.node);
            chain.push(zero.node);
            r = *min;
        }
    }
    match op(g, r) {
        Op::Reshape { input: inner_r, shape } if shape.dims().len() == 4 && shape.dims()[3] == 1 => {
            if dims != &[0, 1, 2, 3] {
                return false;
            }
            chain.push(r.node);
            r = *inner_r;
        }
        _ if dims != &[0, 1, 2] => return false,
        _ => {}
    }
    if let Op::Clamp { min, input: zero, max } = op(g, r) {
        if min == max && consts_zero(g, *zero) {
            chain.push(r.node);
            r = *min;
        }
    }
    let ok = matches!(op(g, r), Op::Reduce { op, input, axes } if *op == want && *input == x && axes == &[3]);
    if ok {
        chain.push(r.node);
        inner.extend(chain);
    }
    ok
}

/// Whether `v` is a literal zero (splat), read by its literal only.
fn consts_zero(g: &Graph, v: ValueId) -> bool {
    let x = super::consts::through_broadcasts(g, v);
    matches!(op(g, x), Op::Constant { literal } if literal.is_splat() && literal.to_f64s().first() == Some(&0.0))
}

/// Strips converts between float types.
fn through_converts(g: &Graph, mut v: ValueId, seen: &mut Vec<NodeId>) -> ValueId {
    while let Op::Convert { input, .. } = op(g, v) {
        if !g.ty(*input).dtype.is_float() {
            break;
        }
        seen.push(v.node);
        v = *input;
    }
    v
}

/// Multiplies `scale` by a constant factor if `v` is `x * c`, `c * x` or
/// `x / c`; returns `x`.
fn peel_scale(g: &Graph, v: ValueId, scale: &mut f64, cache: &mut ConstCache) -> Option<ValueId> {
    match op(g, v) {
        Op::Binary { op: BinaryOp::Mul, lhs, rhs } => {
            if let Some(c) = consts::splat_value(g, *rhs, cache) {
                *scale *= c;
                Some(*lhs)
            } else if let Some(c) = consts::splat_value(g, *lhs, cache) {
                *scale *= c;
                Some(*rhs)
            } else {
                None
            }
        }
        Op::Binary { op: BinaryOp::Div, lhs, rhs } => {
            let c = consts::splat_value(g, *rhs, cache)?;
            *scale /= c;
            Some(*lhs)
        }
        _ => None,
    }
}

/// The softmax over the key axis whose probabilities are `p`: returns its
/// input (the scores) and pushes its nodes to `inner`.
fn softmax_input(g: &Graph, p: ValueId, inner: &mut Vec<NodeId>) -> Option<ValueId> {
    // e / Σ e, e = exp(x - max x) or exp(x).
    if let Op::Binary { op: BinaryOp::Div, lhs: e, rhs: denom } = op(g, p) {
        let Op::Unary { op: UnaryOp::Exp, input: shifted } = op(g, *e) else { return None };
        let mut chain = vec![p.node, e.node];
        if !is_row_reduction_of(g, *denom, ReduceOp::Sum, *e, &mut chain) {
            return None;
        }
        let x = shifted_input(g, *shifted, &mut chain);
        inner.extend(chain);
        return Some(x);
    }
    // exp(log_softmax(x)): exp(y - log Σ exp(y)), y = x - max x or x.
    let Op::Unary { op: UnaryOp::Exp, input: ls } = op(g, p) else { return None };
    let Op::Binary { op: BinaryOp::Sub, lhs: y, rhs: lse } = op(g, *ls) else { return None };
    let mut chain = vec![p.node, ls.node];
    let Op::BroadcastInDim { input: l, .. } = op(g, *lse) else { return None };
    let mut log = *l;
    if let Op::Reshape { input, .. } = op(g, log) {
        chain.push(log.node);
        log = *input;
    }
    let Op::Unary { op: UnaryOp::Log, input: sum } = op(g, log) else { return None };
    let Op::Reduce { op: ReduceOp::Sum, input: ey, axes } = op(g, *sum) else { return None };
    let Op::Unary { op: UnaryOp::Exp, input: y2 } = op(g, *ey) else { return None };
    if axes != &[3] || y2 != y || !matches!(g.ty(*lse).shape.rank(), 4) {
        return None;
    }
    chain.extend([lse.node, log.node, sum.node, ey.node]);
    let x = shifted_input(g, *y, &mut chain);
    inner.extend(chain);
    Some(x)
}

/// `x` if `y` is `x - max x` (over the keys), else `y` itself.
fn shifted_input(g: &Graph, y: ValueId, chain: &mut Vec<NodeId>) -> ValueId {
    if let Op::Binary { op: BinaryOp::Sub, lhs, rhs } = op(g, y) {
        let mut c = vec![y.node];
        if is_row_reduction_of(g, *rhs, ReduceOp::Max, *lhs, &mut c) {
            chain.extend(c);
            return *lhs;
        }
    }
    y
}

/// Whether `x` reaches the score product `q · kᵀ` through the ops the scores
/// may pass (a bounded look, to tell the scores from an additive term).
fn leads_to_scores(g: &Graph, x: ValueId, depth: usize) -> bool {
    if depth == 0 {
        return false;
    }
    match op(g, x) {
        Op::DotGeneral { dims, .. } => {
            dims.lhs_batch == [0, 1]
                && dims.rhs_batch == [0, 1]
                && dims.lhs_contract == [3]
                && g.ty(x).shape.rank() == 4
        }
        Op::Convert { input, .. } => leads_to_scores(g, *input, depth - 1),
        Op::Binary { op: BinaryOp::Mul | BinaryOp::Div | BinaryOp::Add, lhs, rhs } => {
            leads_to_scores(g, *lhs, depth - 1) || leads_to_scores(g, *rhs, depth - 1)
        }
        Op::Select { on_true, on_false, .. } => {
            leads_to_scores(g, *on_true, depth - 1) || leads_to_scores(g, *on_false, depth - 1)
        }
        _ => false,
    }
}

/// A `[b|1, h|1, t|1, s|1]` operand for a full-shaped `v`: `v`'s source when
/// `v` broadcasts a rank-4 value over its size-1 dimensions, else `v`.
fn small_operand(g: &Graph, v: ValueId) -> ValueId {
    match op(g, v) {
        Op::BroadcastInDim { input, dims, .. } if dims == &[0, 1, 2, 3] => *input,
        _ => v,
    }
}

/// `k` (or `v`) with its heads' repetition read: the repeated value and how,
/// or `x` itself when it repeats nothing.
fn unrepeat(g: &Graph, x: ValueId, inner: &mut Vec<NodeId>) -> (ValueId, Option<KvHeads>) {
    let d = g.ty(x).shape.dims().to_vec();
    match op(g, x) {
        Op::Reshape { input: b, .. } => {
            let Op::BroadcastInDim { input: kv, shape, dims } = op(g, *b) else { return (x, None) };
            let (kd, bd) = (g.ty(*kv).shape.dims(), shape.dims());
            if kd.len() != 4 || bd.len() != 5 || bd[0] != d[0] || bd[3..] != d[2..] || bd[1] * bd[2] != d[1] {
                return (x, None);
            }
            let how = if dims == &[0, 1, 3, 4] && bd[1] == kd[1] {
                KvHeads::Grouped
            } else if dims == &[0, 2, 3, 4] && bd[2] == kd[1] {
                KvHeads::Tiled
            } else {
                return (x, None);
            };
            inner.extend([x.node, b.node]);
            (*kv, Some(how))
        }
        Op::Concatenate { inputs, axis: 1 } if inputs.len() > 1 && inputs.iter().all(|&i| i == inputs[0]) => {
            inner.push(x.node);
            (inputs[0], Some(KvHeads::Tiled))
        }
        _ => (x, None),
    }
}

/// What the walk down the scores has read so far.
struct Scores {
    scale: f64,
    causal: bool,
    mask: Option<(ValueId, bool, f64)>,
    bias: Vec<ValueId>,
}

/// Reads a `select` that masks the scores: returns the kept branch.
fn read_select(
    g: &Graph,
    x: ValueId,
    acc: &mut Scores,
    cache: &mut ConstCache,
    inner: &mut Vec<NodeId>,
) -> Result<ValueId, String> {
    let Op::Select { pred, on_true, on_false } = op(g, x) else { unreachable!("called on a select") };
    let (kept, keep, fill) = match (consts::splat_value(g, *on_true, cache), consts::splat_value(g, *on_false, cache)) {
        (_, Some(c)) if c <= MASKED => (*on_true, true, c),
        (Some(c), _) if c <= MASKED => (*on_false, false, c),
        _ => return Err("a select on the scores that does not mask with a large negative constant".into()),
    };
    // A constant causal table becomes `causal`; `and` (behind broadcasts over
    // size-1 dimensions) splits into its parts.
    let mut parts = vec![*pred];
    let mut p = *pred;
    let mut chain = Vec::new();
    while let Op::BroadcastInDim { input, dims, .. } = op(g, p) {
        if dims != &[0, 1, 2, 3] {
            break;
        }
        chain.push(p.node);
        p = *input;
    }
    if let Op::Binary { op: BinaryOp::And, lhs, rhs } = op(g, p) {
        if keep {
            parts = vec![*lhs, *rhs];
            chain.push(p.node);
            inner.extend(chain);
        }
    }
    let mut data = Vec::new();
    for part in parts {
        match consts::table(g, part, cache).map(|c| c.pred) {
            Some(PredTable::Lower) if keep => acc.causal = true,
            Some(PredTable::Upper) if !keep => acc.causal = true,
            Some(PredTable::AllTrue) if keep => {}
            Some(PredTable::AllFalse) if !keep => {}
            _ => data.push(part),
        }
    }
    match data.as_slice() {
        [] => {}
        [m] if acc.mask.is_none() => acc.mask = Some((small_operand(g, *m), keep, fill * acc.scale)),
        _ => return Err("more than one data mask on the scores".into()),
    }
    inner.push(x.node);
    Ok(kept)
}

/// Reads an addition to the scores: returns the scores' side.
fn read_add(
    g: &Graph,
    x: ValueId,
    acc: &mut Scores,
    cache: &mut ConstCache,
    inner: &mut Vec<NodeId>,
) -> Result<ValueId, String> {
    let Op::Binary { op: BinaryOp::Add, lhs, rhs } = op(g, x) else { unreachable!("called on an add") };
    let (scores, term) = if leads_to_scores(g, *lhs, 8) {
        (*lhs, *rhs)
    } else if leads_to_scores(g, *rhs, 8) {
        (*rhs, *lhs)
    } else {
        return Err("an addition on the scores whose operands do not lead to q · kᵀ".into());
    };
    match consts::table(g, term, cache).map(|c| c.additive) {
        Some(AdditiveTable::Causal) => acc.causal = true,
        Some(AdditiveTable::AllZero) => {}
        _ => {
            if acc.scale != 1.0 {
                return Err(format!("a bias added before a scale of {} (the composite adds it after)", acc.scale));
            }
            if acc.bias.len() == 2 {
                return Err("more than two additive terms on the scores".into());
            }
            acc.bias.push(small_operand(g, term));
        }
    }
    inner.push(x.node);
    Ok(scores)
}

/// Tries to read an attention whose `P · v` is node `root`.
pub fn match_at(g: &Graph, root: NodeId, cache: &mut ConstCache) -> Result<AttentionMatch, Miss> {
    let quiet = |r: &str| Miss { reason: r.to_string(), candidate: false };
    let loud = |r: String| Miss { reason: r, candidate: true };
    let Op::DotGeneral { lhs: pv_l, rhs: vx, dims } = &g.node(root).op else {
        return Err(quiet("not a dot_general"));
    };
    if g.ty(*vx).shape.rank() != 4 || *dims != dot_dims([0, 1], 3, 2) {
        return Err(quiet("not a batched [b, h, t, s] x [b, h, s, d] product"));
    }
    let mut inner: Vec<NodeId> = Vec::new();
    // Probabilities, possibly converted to v's dtype.
    let p = through_converts(g, *pv_l, &mut inner);
    let Some(mut x) = softmax_input(g, p, &mut inner) else {
        // Dropout on the probabilities: `where(keep, p · 1/(1-rate), 0)`.
        if let Op::Select { on_true, .. } = op(g, p) {
            let kept = through_converts(g, *on_true, &mut Vec::new());
            let kept = peel_scale(g, kept, &mut 1.0, cache).unwrap_or(kept);
            if softmax_input(g, through_converts(g, kept, &mut Vec::new()), &mut Vec::new()).is_some() {
                return Err(loud(
                    "dropout on the probabilities: cuDNN's dropout draws its own bits, which kiln's reference \
                     interpreter and the CPU plugin cannot reproduce (kiln's RNG contract)"
                        .into(),
                ));
            }
        }
        return Err(quiet("the left operand is not a softmax over the key axis"));
    };
    // Masked, scaled scores: peel converts, scales, masks and terms in any order.
    if g.ty(x).shape.rank() != 4 {
        return Err(loud("scores are not rank 4".into()));
    }
    let mut acc = Scores { scale: 1.0, causal: false, mask: None, bias: Vec::new() };
    let scores = loop {
        match op(g, x) {
            Op::DotGeneral { .. } => break x,
            Op::Convert { input, .. } if g.ty(*input).dtype.is_float() => {
                inner.push(x.node);
                x = *input;
            }
            Op::Binary { op: BinaryOp::Mul | BinaryOp::Div, .. } => {
                let Some(y) = peel_scale(g, x, &mut acc.scale, cache) else {
                    return Err(loud("scores multiplied by a non-constant".into()));
                };
                inner.push(x.node);
                x = y;
            }
            Op::Select { .. } => x = read_select(g, x, &mut acc, cache, &mut inner).map_err(loud)?,
            Op::Binary { op: BinaryOp::Add, .. } => x = read_add(g, x, &mut acc, cache, &mut inner).map_err(loud)?,
            other => return Err(loud(format!("unexpected `{}` in the scores", other.name()))),
        }
    };
    let Op::DotGeneral { lhs: qx, rhs: kx, dims: sd } = op(g, scores) else { unreachable!("loop breaks on a dot") };
    inner.push(scores.node);
    let mut k_transposed = false;
    let mut repeats = Vec::new();
    let mut k = if *sd == dot_dims([0, 1], 3, 3) {
        *kx
    } else if *sd == dot_dims([0, 1], 3, 2) {
        match op(g, *kx) {
            Op::Transpose { input, perm } if perm == &[0, 1, 3, 2] => {
                repeats.push(kx.node);
                *input
            }
            _ => {
                k_transposed = true;
                *kx
            }
        }
    } else {
        return Err(loud("the score product does not contract the head dimension".into()));
    };
    let q = peel_scale(g, *qx, &mut acc.scale, cache).unwrap_or(*qx);
    k = peel_scale(g, k, &mut acc.scale, cache).unwrap_or(k);
    let (k, k_heads) = unrepeat(g, k, &mut repeats);
    let (v, v_heads) = unrepeat(g, *vx, &mut repeats);
    if k_heads != v_heads {
        return Err(loud("k and v repeat their heads differently".into()));
    }
    let mut attrs = AttentionAttrs::new(acc.scale, acc.causal);
    attrs.k_transposed = k_transposed;
    attrs.kv_heads = k_heads.unwrap_or(KvHeads::Grouped);
    if let Some((_, keep, fill)) = acc.mask {
        attrs = attrs.with_mask(fill, keep);
    }
    let op = Op::Attention { q, k, v, bias: acc.bias, mask: acc.mask.map(|m| m.0), attrs };
    let types: Vec<TensorType> = op.inputs().iter().map(|&x| g.ty(x).clone()).collect();
    let outs = crate::ir::infer::infer_types(&op, &types).map_err(|e| loud(format!("{e}")))?;
    if outs[0] != *g.ty(root.into()) {
        return Err(loud(format!("the output {} differs from the composite's {}", g.ty(root.into()), outs[0])));
    }
    inner.sort_unstable();
    inner.dedup();
    inner.retain(|&n| n != root);
    // Every replaced value must be read only inside the pattern, or the
    // probabilities would be needed anyway.
    for &n in &inner {
        if g.users(n).iter().any(|u| *u != root && inner.binary_search(u).is_err()) {
            return Err(loud(format!("{n} ({}) is also used outside the attention", g.node(n).op.name())));
        }
    }
    // Head repetitions go when nothing else reads them.
    for n in repeats {
        if g.users(n).iter().all(|u| *u == root || inner.contains(u)) {
            inner.push(n);
        }
    }
    inner.sort_unstable();
    inner.dedup();
    Ok(AttentionMatch { root, op, replaced: inner })
}

/// Every attention in `g`, by increasing root, and the candidates not taken.
pub fn find(g: &Graph, cache: &mut ConstCache) -> (Vec<AttentionMatch>, Vec<(NodeId, String)>) {
    let mut found = Vec::new();
    let mut missed = Vec::new();
    for (id, n) in g.nodes() {
        if !matches!(n.op, Op::DotGeneral { .. }) || n.outputs[0].shape.rank() != 4 {
            continue;
        }
        match match_at(g, id, cache) {
            Ok(m) => found.push(m),
            Err(Miss { reason, candidate: true }) => missed.push((id, reason)),
            Err(_) => {}
        }
    }
    (found, missed)
}

/// The operands of one attention composite, as the expansion reads them.
#[derive(Clone, Debug)]
pub(crate) struct Operands {
    pub q: ValueId,
    pub k: ValueId,
    pub v: ValueId,
    pub bias: Vec<ValueId>,
    pub mask: Option<ValueId>,
    pub attrs: AttentionAttrs,
}

/// Appends helpers for the plain expansion to `g`.
struct Expander<'g> {
    g: &'g mut Graph,
}

impl Expander<'_> {
    fn add(&mut self, op: Op) -> Result<ValueId, CompileError> {
        self.g.value(op)
    }
    fn convert(&mut self, x: ValueId, to: DType) -> Result<ValueId, CompileError> {
        if self.g.ty(x).dtype == to {
            return Ok(x);
        }
        self.add(Op::Convert { input: x, to })
    }
    fn splat(&mut self, value: f64, ty: &TensorType) -> Result<ValueId, CompileError> {
        self.g.splat(ty.dtype, value, &ty.shape)
    }
    fn bin(&mut self, op: BinaryOp, lhs: ValueId, rhs: ValueId) -> Result<ValueId, CompileError> {
        self.add(Op::Binary { op, lhs, rhs })
    }
    fn rows(&mut self, x: ValueId, shape: &Shape) -> Result<ValueId, CompileError> {
        self.add(Op::BroadcastInDim { input: x, shape: shape.clone(), dims: vec![0, 1, 2] })
    }
    /// A `[b|1, h|1, t|1, s|1]` value broadcast to `shape`.
    fn full(&mut self, x: ValueId, shape: &Shape) -> Result<ValueId, CompileError> {
        if self.g.ty(x).shape == *shape {
            return Ok(x);
        }
        self.add(Op::BroadcastInDim { input: x, shape: shape.clone(), dims: vec![0, 1, 2, 3] })
    }

    /// `x: [b, hkv, m, n]` with its heads repeated to `hq` as `kv_heads` says.
    fn repeat_heads(&mut self, x: ValueId, hq: usize, kv_heads: KvHeads) -> Result<ValueId, CompileError> {
        let t = self.g.ty(x).clone();
        let d = t.shape.dims().to_vec();
        let (hkv, g) = (d[1], hq / d[1]);
        if g == 1 {
            return Ok(x);
        }
        let (shape, dims) = match kv_heads {
            KvHeads::Grouped => (vec![d[0], hkv, g, d[2], d[3]], vec![0, 1, 3, 4]),
            KvHeads::Tiled => (vec![d[0], g, hkv, d[2], d[3]], vec![0, 2, 3, 4]),
        };
        let b = self.add(Op::BroadcastInDim { input: x, shape: Shape::from(shape), dims })?;
        self.add(Op::Reshape { input: b, shape: Shape::from(vec![d[0], hq, d[2], d[3]]) })
    }

    /// The sum over query heads sharing a key/value head of `x: [b, hq, m, n]`:
    /// the adjoint of [`Expander::repeat_heads`].
    fn sum_heads(&mut self, x: ValueId, hkv: usize, kv_heads: KvHeads) -> Result<ValueId, CompileError> {
        let d = self.g.ty(x).shape.dims().to_vec();
        let g = d[1] / hkv;
        if g == 1 {
            return Ok(x);
        }
        let (shape, axis) = match kv_heads {
            KvHeads::Grouped => (vec![d[0], hkv, g, d[2], d[3]], 2),
            KvHeads::Tiled => (vec![d[0], g, hkv, d[2], d[3]], 1),
        };
        let r = self.add(Op::Reshape { input: x, shape: Shape::from(shape) })?;
        self.add(Op::Reduce { op: ReduceOp::Sum, input: r, axes: vec![axis] })
    }

    /// k as `[b, hq, s, d]`, ready for the score product (the heads repeated,
    /// a transposed k turned back).
    fn keys(&mut self, a: &Operands) -> Result<ValueId, CompileError> {
        let hq = self.g.ty(a.q).shape.dims()[1];
        let k =
            if a.attrs.k_transposed { self.add(Op::Transpose { input: a.k, perm: vec![0, 1, 3, 2] })? } else { a.k };
        self.repeat_heads(k, hq, a.attrs.kv_heads)
    }

    /// Where the mask keeps a score and where causality does (`pred`s of
    /// the full shape), each `None` when it keeps every score.
    fn keep(&mut self, a: &Operands, shape: &Shape) -> Result<[Option<ValueId>; 2], CompileError> {
        let mask = match a.mask {
            Some(m) => {
                let m = self.full(m, shape)?;
                Some(if a.attrs.keep { m } else { self.add(Op::Unary { op: UnaryOp::Not, input: m })? })
            }
            None => None,
        };
        let causal = if a.attrs.causal {
            let d = shape.dims();
            let it = TensorType::new(DType::I32, vec![d[2], d[3]]);
            let rows = self.add(Op::Iota { ty: it.clone(), axis: 0 })?;
            let cols = self.add(Op::Iota { ty: it, axis: 1 })?;
            let c = self.add(Op::Compare { dir: CompareDir::Le, lhs: cols, rhs: rows })?;
            Some(self.add(Op::BroadcastInDim { input: c, shape: shape.clone(), dims: vec![2, 3] })?)
        } else {
            None
        };
        Ok([mask, causal])
    }

    /// `scale · q kᵀ + Σ bias` in f32 (f64 for f64 operands), `fill` where the
    /// mask does not keep a score and -inf above the diagonal when causal.
    /// Returns the scores and where both keep them (`None`: everywhere).
    fn scores(&mut self, a: &Operands, q: ValueId) -> Result<(ValueId, Option<ValueId>), CompileError> {
        let k = self.keys(a)?;
        let s = self.add(Op::DotGeneral { lhs: q, rhs: k, dims: dot_dims([0, 1], 3, 3) })?;
        let s = self.convert(s, accumulate(self.g.ty(q).dtype))?;
        let ty = self.g.ty(s).clone();
        let c = self.splat(a.attrs.scale(), &ty)?;
        let mut s = self.bin(BinaryOp::Mul, s, c)?;
        for &b in &a.bias {
            let b = self.convert(b, ty.dtype)?;
            let b = self.full(b, &ty.shape)?;
            s = self.bin(BinaryOp::Add, s, b)?;
        }
        let [mask, causal] = self.keep(a, &ty.shape)?;
        if let Some(m) = mask {
            let fill = self.splat(a.attrs.fill(), &ty)?;
            s = self.add(Op::Select { pred: m, on_true: s, on_false: fill })?;
        }
        if let Some(c) = causal {
            let neg = self.splat(f64::NEG_INFINITY, &ty)?;
            s = self.add(Op::Select { pred: c, on_true: s, on_false: neg })?;
        }
        let keep = match (mask, causal) {
            (Some(m), Some(c)) => Some(self.bin(BinaryOp::And, m, c)?),
            (m, c) => m.or(c),
        };
        Ok((s, keep))
    }
}

/// The dtype scores and softmax are computed in.
fn accumulate(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Plain ops computing `[out, stats]` of the attention `a`, appended to `g`.
pub(crate) fn expand_forward(g: &mut Graph, a: &Operands) -> Result<[ValueId; 2], CompileError> {
    let dtype = g.ty(a.q).dtype;
    let hq = g.ty(a.q).shape.dims()[1];
    let mut e = Expander { g };
    let (s, _) = e.scores(a, a.q)?;
    let shape = e.g.ty(s).shape.clone();
    let m = e.add(Op::Reduce { op: ReduceOp::Max, input: s, axes: vec![3] })?;
    let mb = e.rows(m, &shape)?;
    let shifted = e.bin(BinaryOp::Sub, s, mb)?;
    let ex = e.add(Op::Unary { op: UnaryOp::Exp, input: shifted })?;
    let z = e.add(Op::Reduce { op: ReduceOp::Sum, input: ex, axes: vec![3] })?;
    let log_z = e.add(Op::Unary { op: UnaryOp::Log, input: z })?;
    let stats = e.bin(BinaryOp::Add, m, log_z)?;
    let stats = e.convert(stats, DType::F32)?;
    let zb = e.rows(z, &shape)?;
    let p = e.bin(BinaryOp::Div, ex, zb)?;
    let p = e.convert(p, dtype)?;
    let v = e.repeat_heads(a.v, hq, a.attrs.kv_heads)?;
    let out = e.add(Op::DotGeneral { lhs: p, rhs: v, dims: dot_dims([0, 1], 3, 2) })?;
    Ok([out, stats])
}

/// The forward values `attention_grad` reads besides its operands.
pub(crate) struct Saved {
    pub out: ValueId,
    pub stats: ValueId,
    pub dout: ValueId,
}

/// Plain ops computing `[dq, dk, dv, dbias..]` of `attention_grad`, appended
/// to `g`. The probabilities are recomputed from the saved statistics.
pub(crate) fn expand_backward(
    g: &mut Graph,
    a: &Operands,
    saved: Saved,
    guard: bool,
) -> Result<Vec<ValueId>, CompileError> {
    let Saved { out, stats, dout } = saved;
    let dtype = g.ty(a.q).dtype;
    let (hq, hkv) = (g.ty(a.q).shape.dims()[1], g.ty(a.v).shape.dims()[1]);
    // Where the backend drops barriers, its CSE would merge these scores with
    // the forward's and keep every layer's scores from the forward to here;
    // the scores read q only once the cotangent exists ([`crate::fence`]).
    let qs = if guard { crate::fence::after(g, &[a.q], dout, true)?[0] } else { a.q };
    let mut e = Expander { g };
    let (s, keep) = e.scores(a, qs)?;
    let shape = e.g.ty(s).shape.clone();
    let acc = accumulate(dtype);
    let stats = e.convert(stats, acc)?;
    let lse = e.rows(stats, &shape)?;
    let shifted = e.bin(BinaryOp::Sub, s, lse)?;
    let p = e.add(Op::Unary { op: UnaryOp::Exp, input: shifted })?;
    let p_lo = e.convert(p, dtype)?;
    // dv = pᵀ dout: contract the query axis.
    let dv = e.add(Op::DotGeneral { lhs: p_lo, rhs: dout, dims: dot_dims([0, 1], 2, 2) })?;
    let dv = e.sum_heads(dv, hkv, a.attrs.kv_heads)?;
    // dp = dout vᵀ.
    let v = e.repeat_heads(a.v, hq, a.attrs.kv_heads)?;
    let dp = e.add(Op::DotGeneral { lhs: dout, rhs: v, dims: dot_dims([0, 1], 3, 3) })?;
    let dp = e.convert(dp, acc)?;
    // D_i = Σ_c dout_ic out_ic = Σ_j p_ij dp_ij.
    let (o32, g32) = (e.convert(out, acc)?, e.convert(dout, acc)?);
    let od = e.bin(BinaryOp::Mul, o32, g32)?;
    let d = e.add(Op::Reduce { op: ReduceOp::Sum, input: od, axes: vec![3] })?;
    let db = e.rows(d, &shape)?;
    let centred = e.bin(BinaryOp::Sub, dp, db)?;
    let mut ds = e.bin(BinaryOp::Mul, p, centred)?;
    if a.mask.is_some() {
        // A masked score is a constant: no gradient, whatever its weight.
        let ty = e.g.ty(ds).clone();
        let zero = e.splat(0.0, &ty)?;
        let keep = keep.expect("a mask makes a keep predicate");
        ds = e.add(Op::Select { pred: keep, on_true: ds, on_false: zero })?;
    }
    let mut dbias = Vec::with_capacity(a.bias.len());
    for &b in &a.bias {
        let bt = e.g.ty(b).clone();
        let axes: Vec<usize> = (0..4).filter(|&ax| bt.shape.dims()[ax] == 1 && shape.dims()[ax] != 1).collect();
        let mut x = ds;
        if !axes.is_empty() {
            x = e.add(Op::Reduce { op: ReduceOp::Sum, input: x, axes })?;
            x = e.add(Op::Reshape { input: x, shape: bt.shape.clone() })?;
        }
        dbias.push(e.convert(x, bt.dtype)?);
    }
    let ty = e.g.ty(ds).clone();
    let c = e.splat(a.attrs.scale(), &ty)?;
    let ds = e.bin(BinaryOp::Mul, ds, c)?;
    let ds = e.convert(ds, dtype)?;
    let k = e.keys(a)?;
    let dq = e.add(Op::DotGeneral { lhs: ds, rhs: k, dims: dot_dims([0, 1], 3, 2) })?;
    let dk = e.add(Op::DotGeneral { lhs: ds, rhs: a.q, dims: dot_dims([0, 1], 2, 2) })?;
    let mut dk = e.sum_heads(dk, hkv, a.attrs.kv_heads)?;
    if a.attrs.k_transposed {
        dk = e.add(Op::Transpose { input: dk, perm: vec![0, 1, 3, 2] })?;
    }
    Ok([dq, dk, dv].into_iter().chain(dbias).collect())
}

/// The large negative a mask becomes in cuDNN's bias, per operand dtype: the
/// values JAX's cuDNN path uses (`-2 << 40` in bf16, `-2 << 14` in f16), not
/// `-inf`, which cuDNN's kernels mishandle when two masked scores meet.
fn cudnn_masked(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => -32768.0,
        _ => -2.0 * (1u64 << 40) as f64,
    }
}

/// `[b|1, h|1, t|1, s|1]` shape of a value as its broadcast's source would
/// give it: `x`'s own shape, or its source's sizes on the axes its
/// `broadcast_in_dim` maps and 1 elsewhere.
fn minimal_shape(g: &Graph, x: ValueId) -> [usize; 4] {
    let full: [usize; 4] = g.ty(x).shape.dims().try_into().unwrap_or([1; 4]);
    match op(g, x) {
        Op::BroadcastInDim { input, dims, .. } => {
            let mut m = [1; 4];
            for (i, &ax) in dims.iter().enumerate() {
                m[ax] = g.ty(*input).shape.dims()[i];
            }
            m
        }
        _ => full,
    }
}

/// `x` at its [`minimal_shape`] (a broadcast of its source), appended to `g`.
fn minimal(g: &mut Graph, x: ValueId) -> Result<ValueId, CompileError> {
    let m = minimal_shape(g, x);
    if g.ty(x).shape.dims() == m {
        return Ok(x);
    }
    let Op::BroadcastInDim { input, dims, .. } = op(g, x).clone() else {
        unreachable!("a smaller shape is a broadcast's")
    };
    if g.ty(input).shape.dims() == m {
        return Ok(input);
    }
    g.value(Op::BroadcastInDim { input, shape: Shape::from(m.to_vec()), dims })
}

/// The shape of the one bias cuDNN reads for an attention with these terms
/// and mask (`[b|1, h|1, t, s]`), or `None` when it reads none.
pub(crate) fn cudnn_bias_shape(g: &Graph, q: ValueId, bias: &[ValueId], mask: Option<ValueId>) -> Option<[usize; 4]> {
    if bias.is_empty() && mask.is_none() {
        return None;
    }
    let mut shape = [1, 1, 0, 0];
    for x in bias.iter().copied().chain(mask) {
        let m = minimal_shape(g, x);
        shape[0] = shape[0].max(m[0]);
        shape[1] = shape[1].max(m[1]);
        shape[2] = g.ty(x).shape.dims()[2].max(g.ty(q).shape.dims()[2]);
        shape[3] = g.ty(x).shape.dims()[3];
    }
    Some(shape)
}

/// An attention in the form the cuDNN lowering takes (`lower/cudnn.rs`):
/// `k` as `[b, hkv, s, d]`, grouped heads (tiled ones repeated), at most one
/// bias of q's dtype shaped `[b|1, h|1, t, s]` holding every term and the
/// mask, no mask operand.
struct Prepared {
    op: Operands,
    /// The key/value heads were repeated to the query heads' count (tiled).
    repeated: bool,
}

fn prepare(g: &mut Graph, a: &Operands) -> Result<Prepared, CompileError> {
    let (dtype, hq) = (g.ty(a.q).dtype, g.ty(a.q).shape.dims()[1]);
    let shape = cudnn_bias_shape(g, a.q, &a.bias, a.mask);
    let mut e = Expander { g };
    let mut k = if a.attrs.k_transposed { e.add(Op::Transpose { input: a.k, perm: vec![0, 1, 3, 2] })? } else { a.k };
    let mut v = a.v;
    let repeated = a.attrs.kv_heads == KvHeads::Tiled && e.g.ty(v).shape.dims()[1] != hq;
    if repeated {
        k = e.repeat_heads(k, hq, KvHeads::Tiled)?;
        v = e.repeat_heads(v, hq, KvHeads::Tiled)?;
    }
    let bias = match shape {
        None => Vec::new(),
        Some(shape) => {
            let full = Shape::from(shape.to_vec());
            let ty = TensorType::new(DType::F32, shape.to_vec());
            let mut sum: Option<ValueId> = None;
            for &b in &a.bias {
                let b = minimal(e.g, b)?;
                let b = e.convert(b, DType::F32)?;
                let b = e.full(b, &full)?;
                sum = Some(match sum {
                    Some(s) => e.bin(BinaryOp::Add, s, b)?,
                    None => b,
                });
            }
            if let Some(m) = a.mask {
                let m = minimal(e.g, m)?;
                let m = e.full(m, &full)?;
                let (zero, neg) = (e.splat(0.0, &ty)?, e.splat(cudnn_masked(dtype), &ty)?);
                let (on_true, on_false) = if a.attrs.keep { (zero, neg) } else { (neg, zero) };
                let m = e.add(Op::Select { pred: m, on_true, on_false })?;
                sum = Some(match sum {
                    Some(s) => e.bin(BinaryOp::Add, s, m)?,
                    None => m,
                });
            }
            let b = sum.expect("a bias shape means a term or a mask");
            vec![e.convert(b, dtype)?]
        }
    };
    let mut attrs = AttentionAttrs::new(a.attrs.scale(), a.attrs.causal);
    attrs.kv_heads = KvHeads::Grouped;
    Ok(Prepared { op: Operands { q: a.q, k, v, bias, mask: None, attrs }, repeated })
}

/// The fused forward in the cuDNN lowering's form, appended to `g`:
/// `[out, stats]`.
pub(crate) fn prepare_forward(g: &mut Graph, a: &Operands) -> Result<[ValueId; 2], CompileError> {
    let p = prepare(g, a)?.op;
    let n = g.add(Op::Attention { q: p.q, k: p.k, v: p.v, bias: p.bias, mask: None, attrs: p.attrs })?;
    Ok([ValueId::new(n, 0), ValueId::new(n, 1)])
}

/// The fused backward in the cuDNN lowering's form, appended to `g`:
/// `[dq, dk, dv, dbias..]` as `attention_grad` gives them for `a`.
pub(crate) fn prepare_backward(g: &mut Graph, a: &Operands, saved: Saved) -> Result<Vec<ValueId>, CompileError> {
    let Prepared { op: p, repeated } = prepare(g, a)?;
    let hkv = g.ty(a.v).shape.dims()[1];
    let n = g.add(Op::AttentionGrad {
        q: p.q,
        k: p.k,
        v: p.v,
        bias: p.bias.clone(),
        mask: None,
        out: saved.out,
        stats: saved.stats,
        dout: saved.dout,
        attrs: p.attrs,
    })?;
    let mut e = Expander { g };
    let (mut dk, mut dv) = (ValueId::new(n, 1), ValueId::new(n, 2));
    if repeated {
        dk = e.sum_heads(dk, hkv, KvHeads::Tiled)?;
        dv = e.sum_heads(dv, hkv, KvHeads::Tiled)?;
    }
    if a.attrs.k_transposed {
        dk = e.add(Op::Transpose { input: dk, perm: vec![0, 1, 3, 2] })?;
    }
    let mut grads = vec![ValueId::new(n, 0), dk, dv];
    for &b in &a.bias {
        // Each term's gradient is the combined bias's, summed over the axes
        // the term broadcasts (unused unless cuDNN exported it: `fusable`).
        let combined = ValueId::new(n, 3);
        let (bt, ct) = (e.g.ty(b).clone(), e.g.ty(combined).clone());
        let axes: Vec<usize> = (0..4).filter(|&ax| bt.shape.dims()[ax] == 1 && ct.shape.dims()[ax] != 1).collect();
        let mut x = e.convert(combined, DType::F32)?;
        if !axes.is_empty() {
            x = e.add(Op::Reduce { op: ReduceOp::Sum, input: x, axes })?;
        }
        if e.g.ty(x).shape != bt.shape {
            x = e.add(Op::Reshape { input: x, shape: bt.shape.clone() })?;
        }
        grads.push(e.convert(x, bt.dtype)?);
    }
    Ok(grads)
}
