//! Finding attention written with plain ops, and its plain expansion.
//!
//! The matcher walks up from a rank-4 `dot_general` `P · v` and accepts
//! `softmax(mask(scale · q kᵀ))` in any of these spellings: the scale as a
//! multiplication or division by a splat constant on the scores (before or after
//! an f32 upcast, before or after the mask) or on `q` or `k`; `kᵀ` as a
//! transpose feeding the dot or folded into its contracting dimensions; the
//! causal mask as a `select` against a large negative splat (either branch) or
//! as an additive bias of 0 / large negatives; softmax with or without the max
//! subtraction. The mask's values are not trusted to a spelling: its
//! constant subgraph is evaluated on the reference interpreter and compared to
//! the causal triangle, so a mask on the wrong axis or of the wrong direction
//! is rejected, as is a softmax over any axis but the keys.

use crate::interp::interpret;
use crate::ir::{
    AttentionAttrs, BinaryOp, CompareDir, DType, DotDims, Graph, Literal, NodeId, Op, ReduceOp, Shape, TensorType,
    UnaryOp, ValueId,
};
use crate::CompileError;

/// Below this, an additive bias or select value counts as "masked out"
/// (exp(-1e4) underflows even in f32 relative to any unmasked score).
const MASKED: f64 = -1e4;

/// One attention found in a graph.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionMatch {
    /// The `P · v` dot that becomes the composite.
    pub root: NodeId,
    pub q: ValueId,
    pub k: ValueId,
    pub v: ValueId,
    pub attrs: AttentionAttrs,
    /// Nodes between the operands and the root that the composite replaces
    /// (scores, mask, softmax), root excluded, in increasing order.
    pub replaced: Vec<NodeId>,
}

fn op(g: &Graph, v: ValueId) -> &Op {
    &g.node(v.node).op
}

fn dot_dims(batch: [usize; 2], lc: usize, rc: usize) -> DotDims {
    DotDims { lhs_batch: batch.to_vec(), rhs_batch: batch.to_vec(), lhs_contract: vec![lc], rhs_contract: vec![rc] }
}

/// The value of a splat constant behind broadcasts, reshapes and converts.
fn splat(g: &Graph, v: ValueId) -> Option<f64> {
    match op(g, v) {
        Op::Constant { literal } if literal.is_splat() && literal.ty().shape.num_elements() > 0 => {
            Some(literal.to_f64s()[0])
        }
        Op::BroadcastInDim { input, .. } | Op::Reshape { input, .. } | Op::Convert { input, .. } => splat(g, *input),
        _ => None,
    }
}

/// Evaluates `v` if it depends on no parameter or generator, by copying its
/// (small) ancestor subgraph and running the reference interpreter.
fn evaluate_constant(g: &Graph, v: ValueId) -> Option<Literal> {
    let mut needed = vec![false; v.node.index() + 1];
    needed[v.node.index()] = true;
    for i in (0..=v.node.index()).rev() {
        if !needed[i] {
            continue;
        }
        let node_op = &g.node(NodeId::from_index(i)).op;
        if matches!(node_op, Op::Parameter { .. } | Op::RngBitGenerator { .. }) || node_op.is_collective() {
            return None;
        }
        for x in node_op.inputs() {
            needed[x.node.index()] = true;
        }
    }
    let mut sub = Graph::new();
    let mut map = vec![None; needed.len()];
    for (i, &n) in needed.iter().enumerate() {
        if n {
            let mut o = g.node(NodeId::from_index(i)).op.clone();
            o.map_inputs(|x| ValueId::new(map[x.node.index()].expect("operands come first"), x.output));
            map[i] = Some(sub.add(o).ok()?);
        }
    }
    sub.set_outputs(vec![ValueId::new(map[v.node.index()]?, v.output)]).ok()?;
    interpret(&sub, &[]).ok()?.pop()
}

/// The `[t, s]` values of a rank-4 `[b, h, t, s]` value that is a constant
/// broadcast along batch and heads, row-major; `None` if it is not one.
fn key_query_table(g: &Graph, v: ValueId) -> Option<Vec<f64>> {
    let ty = g.ty(v);
    let (t, s) = (ty.shape.dims()[2], ty.shape.dims()[3]);
    let table = match op(g, v) {
        Op::BroadcastInDim { input, dims, .. } => {
            let it = g.ty(*input);
            let r = it.shape.rank();
            // Only the last two input dimensions may be non-1, and they must land
            // on the query and key axes, in that order.
            let ok = r >= 2
                && dims[r - 2..] == [2, 3]
                && it.shape.dims()[r - 2..] == [t, s]
                && it.shape.dims()[..r - 2].iter().all(|&d| d == 1);
            if !ok {
                return None;
            }
            evaluate_constant(g, *input)?
        }
        _ if ty.shape.dims()[0] * ty.shape.dims()[1] == 1 => evaluate_constant(g, v)?,
        _ => return None,
    };
    let vals = table.to_f64s();
    (vals.len() == t * s).then_some(vals)
}

/// Whether `keep[i * s + j]` is the causal triangle `j <= i` (`Some(true)`),
/// all true (`Some(false)`), or anything else (`None`).
fn classify_mask(keep: &[bool], t: usize, s: usize) -> Option<bool> {
    if keep.iter().all(|&k| k) {
        return Some(false);
    }
    let causal = (0..t).all(|i| (0..s).all(|j| keep[i * s + j] == (j <= i)));
    causal.then_some(true)
}

/// `x` broadcast back over the key axis from `reduce(op, x, [3])`, directly
/// (`dims [0, 1, 2]`) or through a keep-dims reshape (`[b, h, t, 1]`, dims `[0, 1, 2, 3]`).
fn is_row_reduction_of(g: &Graph, v: ValueId, want: ReduceOp, x: ValueId) -> bool {
    let Op::BroadcastInDim { input, dims, .. } = op(g, v) else { return false };
    let r = match op(g, *input) {
        Op::Reshape { input: r, shape } if shape.dims().len() == 4 && shape.dims()[3] == 1 => {
            if dims != &[0, 1, 2, 3] {
                return false;
            }
            *r
        }
        _ => {
            if dims != &[0, 1, 2] {
                return false;
            }
            *input
        }
    };
    matches!(op(g, r), Op::Reduce { op, input, axes } if *op == want && *input == x && axes == &[3])
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

/// Multiplies `scale` by a splat factor if `v` is `x * c`, `c * x` or `x / c`;
/// returns `x`.
fn peel_scale(g: &Graph, v: ValueId, scale: &mut f64) -> Option<ValueId> {
    match op(g, v) {
        Op::Binary { op: BinaryOp::Mul, lhs, rhs } => {
            if let Some(c) = splat(g, *rhs) {
                *scale *= c;
                Some(*lhs)
            } else if let Some(c) = splat(g, *lhs) {
                *scale *= c;
                Some(*rhs)
            } else {
                None
            }
        }
        Op::Binary { op: BinaryOp::Div, lhs, rhs } => {
            let c = splat(g, *rhs)?;
            *scale /= c;
            Some(*lhs)
        }
        _ => None,
    }
}

/// Tries to read an attention whose `P · v` is node `root`.
pub fn match_at(g: &Graph, root: NodeId) -> Result<AttentionMatch, String> {
    let Op::DotGeneral { lhs: pv_l, rhs: v, dims } = &g.node(root).op else {
        return Err("not a dot_general".into());
    };
    if g.ty(*v).shape.rank() != 4 || *dims != dot_dims([0, 1], 3, 2) {
        return Err("not a batched [b, h, t, s] x [b, h, s, d] product".into());
    }
    let mut inner: Vec<NodeId> = Vec::new();
    // Probabilities, possibly converted to v's dtype.
    let p = through_converts(g, *pv_l, &mut inner);
    let Op::Binary { op: BinaryOp::Div, lhs: e, rhs: denom } = op(g, p) else {
        return Err("the left operand is not a softmax (no division)".into());
    };
    inner.push(p.node);
    if !is_row_reduction_of(g, *denom, ReduceOp::Sum, *e) {
        return Err("the softmax is not normalised over the key axis".into());
    }
    inner.push(denom.node);
    push_reduction_chain(g, *denom, &mut inner);
    let Op::Unary { op: UnaryOp::Exp, input: shifted } = op(g, *e) else {
        return Err("the softmax numerator is not an exponential".into());
    };
    inner.push(e.node);
    let mut x = *shifted;
    if let Op::Binary { op: BinaryOp::Sub, lhs, rhs } = op(g, x) {
        if !is_row_reduction_of(g, *rhs, ReduceOp::Max, *lhs) {
            return Err("the softmax subtracts something other than the row maximum over keys".into());
        }
        inner.push(x.node);
        inner.push(rhs.node);
        push_reduction_chain(g, *rhs, &mut inner);
        x = *lhs;
    }
    // Masked, scaled scores: peel converts, scales and one mask in any order.
    let mut scale = 1.0;
    let mut causal: Option<bool> = None;
    let (t, s) = {
        let d = g.ty(x).shape.dims().to_vec();
        if d.len() != 4 {
            return Err("scores are not rank 4".into());
        }
        (d[2], d[3])
    };
    let scores = loop {
        match op(g, x) {
            Op::DotGeneral { .. } => break x,
            Op::Convert { input, .. } if g.ty(*input).dtype.is_float() => {
                inner.push(x.node);
                x = *input;
            }
            Op::Binary { op: BinaryOp::Mul | BinaryOp::Div, .. } => {
                let Some(y) = peel_scale(g, x, &mut scale) else {
                    return Err("scores are multiplied by a non-constant".into());
                };
                inner.push(x.node);
                x = y;
            }
            Op::Select { pred, on_true, on_false } if causal.is_none() => {
                let (kept, keep_if) = match (splat(g, *on_true), splat(g, *on_false)) {
                    (_, Some(c)) if c <= MASKED => (*on_true, true),
                    (Some(c), _) if c <= MASKED => (*on_false, false),
                    _ => return Err("select does not mask with a large negative constant".into()),
                };
                let table = key_query_table(g, *pred)
                    .ok_or("the mask is not a constant [t, s] table over query and key axes")?;
                let keep: Vec<bool> = table.iter().map(|&p| (p != 0.0) == keep_if).collect();
                causal = Some(classify_mask(&keep, t, s).ok_or("the mask is not causal (j <= i)")?);
                inner.push(x.node);
                x = kept;
            }
            Op::Binary { op: BinaryOp::Add, lhs, rhs } if causal.is_none() => {
                let (bias, kept) = match (key_query_table(g, *rhs), key_query_table(g, *lhs)) {
                    (Some(b), _) => (b, *lhs),
                    (None, Some(b)) => (b, *rhs),
                    (None, None) => return Err("scores plus a non-constant".into()),
                };
                if bias.iter().any(|&b| b != 0.0 && b > MASKED) {
                    return Err("the additive bias is not 0 / large negative".into());
                }
                let keep: Vec<bool> = bias.iter().map(|&b| b == 0.0).collect();
                causal = Some(classify_mask(&keep, t, s).ok_or("the additive mask is not causal (j <= i)")?);
                inner.push(x.node);
                x = kept;
            }
            other => return Err(format!("unexpected `{}` in the scores", other.name())),
        }
    };
    let Op::DotGeneral { lhs: qx, rhs: kx, dims: sd } = op(g, scores) else { unreachable!("loop breaks on a dot") };
    inner.push(scores.node);
    let k = if *sd == dot_dims([0, 1], 3, 3) {
        *kx
    } else if *sd == dot_dims([0, 1], 3, 2) {
        match op(g, *kx) {
            Op::Transpose { input, perm } if perm == &[0, 1, 3, 2] => *input,
            _ => return Err("the score product's right operand is not kᵀ".into()),
        }
    } else {
        return Err("the score product does not contract the head dimension".into());
    };
    let q = peel_scale(g, *qx, &mut scale).unwrap_or(*qx);
    let k = peel_scale(g, k, &mut scale).unwrap_or(k);
    let (tq, tk, tv) = (g.ty(q), g.ty(k), g.ty(*v));
    if tq.dtype != tk.dtype || tq.dtype != tv.dtype || tq.shape.rank() != 4 || tk.shape.dims() != tv.shape.dims() {
        return Err(format!("q {tq}, k {tk}, v {tv} do not fit one attention"));
    }
    if *g.ty(root.into()) != *tq {
        return Err("the output's type differs from q's".into());
    }
    inner.sort_unstable();
    inner.dedup();
    inner.retain(|&n| n != root);
    // Every replaced value must be read only inside the pattern, or the
    // probabilities would be needed anyway.
    for &n in &inner {
        if g.users(n).iter().any(|u| *u != root && inner.binary_search(u).is_err()) {
            return Err(format!("{n} is also used outside the attention"));
        }
    }
    Ok(AttentionMatch {
        root,
        q,
        k,
        v: *v,
        attrs: AttentionAttrs::new(scale, causal.unwrap_or(false)),
        replaced: inner,
    })
}

/// The broadcast → (reshape) → reduce chain behind a row reduction.
fn push_reduction_chain(g: &Graph, bcast: ValueId, inner: &mut Vec<NodeId>) {
    if let Op::BroadcastInDim { input, .. } = op(g, bcast) {
        inner.push(input.node);
        if let Op::Reshape { input: r, .. } = op(g, *input) {
            inner.push(r.node);
        }
    }
}

/// Every attention in `g`, by increasing root.
pub fn find(g: &Graph) -> Vec<AttentionMatch> {
    g.nodes()
        .filter(|(_, n)| matches!(n.op, Op::DotGeneral { .. }) && n.outputs[0].shape.rank() == 4)
        .filter_map(|(id, _)| match_at(g, id).ok())
        .collect()
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

    /// `scale · q kᵀ` in f32 (f64 for f64 operands), masked to -inf above the
    /// diagonal when causal.
    fn scores(&mut self, q: ValueId, k: ValueId, attrs: AttentionAttrs) -> Result<ValueId, CompileError> {
        let s = self.add(Op::DotGeneral { lhs: q, rhs: k, dims: dot_dims([0, 1], 3, 3) })?;
        let s = self.convert(s, accumulate(self.g.ty(q).dtype))?;
        let ty = self.g.ty(s).clone();
        let c = self.splat(attrs.scale(), &ty)?;
        let s = self.bin(BinaryOp::Mul, s, c)?;
        if !attrs.causal {
            return Ok(s);
        }
        let (t, n) = (ty.shape.dims()[2], ty.shape.dims()[3]);
        let it = TensorType::new(DType::I32, vec![t, n]);
        let rows = self.add(Op::Iota { ty: it.clone(), axis: 0 })?;
        let cols = self.add(Op::Iota { ty: it, axis: 1 })?;
        let keep = self.add(Op::Compare { dir: CompareDir::Le, lhs: cols, rhs: rows })?;
        let keep = self.add(Op::BroadcastInDim { input: keep, shape: ty.shape.clone(), dims: vec![2, 3] })?;
        let neg = self.splat(f64::NEG_INFINITY, &ty)?;
        self.add(Op::Select { pred: keep, on_true: s, on_false: neg })
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

/// Plain ops computing `[out, stats]` of `attention(q, k, v)`, appended to `g`.
pub(crate) fn expand_forward(
    g: &mut Graph,
    q: ValueId,
    k: ValueId,
    v: ValueId,
    attrs: AttentionAttrs,
) -> Result<[ValueId; 2], CompileError> {
    let dtype = g.ty(q).dtype;
    let mut e = Expander { g };
    let s = e.scores(q, k, attrs)?;
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
    let out = e.add(Op::DotGeneral { lhs: p, rhs: v, dims: dot_dims([0, 1], 3, 2) })?;
    Ok([out, stats])
}

/// Plain ops computing `[dq, dk, dv]` of `attention_grad`, appended to `g`.
/// The probabilities are recomputed from the saved statistics.
#[allow(clippy::too_many_arguments)]
pub(crate) fn expand_backward(
    g: &mut Graph,
    q: ValueId,
    k: ValueId,
    v: ValueId,
    out: ValueId,
    stats: ValueId,
    dout: ValueId,
    attrs: AttentionAttrs,
    guard: bool,
) -> Result<[ValueId; 3], CompileError> {
    let dtype = g.ty(q).dtype;
    // Where the backend drops barriers, its CSE would merge these scores with
    // the forward's and keep every layer's scores from the forward to here;
    // the scores read q only once the cotangent exists ([`crate::fence`]).
    let qs = if guard { crate::fence::after(g, &[q], dout, true)?[0] } else { q };
    let mut e = Expander { g };
    let s = e.scores(qs, k, attrs)?;
    let shape = e.g.ty(s).shape.clone();
    let acc = accumulate(dtype);
    let stats = e.convert(stats, acc)?;
    let lse = e.rows(stats, &shape)?;
    let shifted = e.bin(BinaryOp::Sub, s, lse)?;
    let p = e.add(Op::Unary { op: UnaryOp::Exp, input: shifted })?;
    let p_lo = e.convert(p, dtype)?;
    // dv = pᵀ dout: contract the query axis.
    let dv = e.add(Op::DotGeneral { lhs: p_lo, rhs: dout, dims: dot_dims([0, 1], 2, 2) })?;
    // dp = dout vᵀ.
    let dp = e.add(Op::DotGeneral { lhs: dout, rhs: v, dims: dot_dims([0, 1], 3, 3) })?;
    let dp = e.convert(dp, acc)?;
    // D_i = Σ_c dout_ic out_ic = Σ_j p_ij dp_ij.
    let (o32, g32) = (e.convert(out, acc)?, e.convert(dout, acc)?);
    let od = e.bin(BinaryOp::Mul, o32, g32)?;
    let d = e.add(Op::Reduce { op: ReduceOp::Sum, input: od, axes: vec![3] })?;
    let db = e.rows(d, &shape)?;
    let centred = e.bin(BinaryOp::Sub, dp, db)?;
    let ds = e.bin(BinaryOp::Mul, p, centred)?;
    let ty = e.g.ty(ds).clone();
    let c = e.splat(attrs.scale(), &ty)?;
    let ds = e.bin(BinaryOp::Mul, ds, c)?;
    let ds = e.convert(ds, dtype)?;
    let dq = e.add(Op::DotGeneral { lhs: ds, rhs: k, dims: dot_dims([0, 1], 3, 2) })?;
    let dk = e.add(Op::DotGeneral { lhs: ds, rhs: q, dims: dot_dims([0, 1], 2, 2) })?;
    Ok([dq, dk, dv])
}
