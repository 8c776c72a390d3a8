//! Finding the LM head's cross-entropy written with plain ops.
//!
//! The matcher walks down from the per-token loss `[n]` and reads
//! `nll = logsumexp(z) - z[label]` over logits `z = h wᵀ` (`h: [n, d]`,
//! `w: [vocab, d]`, possibly converted to f32), spelled as
//! - `-Σ log_softmax(z) · onehot(labels)` (the log-softmax with its max shift
//!   taken with or without a gradient, or no shift), or
//! - `logsumexp(z) - Σ z · onehot(labels)`, the log-sum-exp as `log Σ exp(z -
//!   m) + m` or `log Σ exp(z)`;
//!
//! the one-hot as an `iota` compared with the labels, converted. It becomes
//! the LM-head composite (`lm_head_cross_entropy`), whose blocks never hold
//! the `[n, vocab]` logits whole. Logits with a bias term, or read anywhere
//! else (an accuracy, a second loss), stay plain, with the reason.

use crate::ir::{BinaryOp, CompareDir, DotDims, Graph, NodeId, Op, ReduceOp, UnaryOp, ValueId};

/// How the matcher sizes the composite's row blocks and shards (what the
/// frontend's `nn::lm_head_cross_entropy` would choose).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossOptions {
    /// Bytes of f32 logits a row block holds at most.
    pub block_bytes: u64,
    /// Equal parts the rows come in (a mesh's `data` axis); 1 without one.
    pub data_shards: usize,
}

impl Default for LossOptions {
    fn default() -> Self {
        LossOptions { block_bytes: 256 << 20, data_shards: 1 }
    }
}

/// One LM-head loss found in a graph.
#[derive(Clone, Debug, PartialEq)]
pub struct LossMatch {
    /// The per-token loss node that becomes the composite.
    pub root: NodeId,
    /// `Op::LmHeadCrossEntropy`.
    pub op: Op,
    /// The plain nodes it stands for, root excluded, in increasing order.
    pub replaced: Vec<NodeId>,
}

fn op(g: &Graph, v: ValueId) -> &Op {
    &g.node(v.node).op
}

/// A row value of `[n, 1]` (or `[n]`) broadcast over the columns: the value.
fn per_row(g: &Graph, v: ValueId, inner: &mut Vec<NodeId>) -> Option<ValueId> {
    let Op::BroadcastInDim { input, dims, .. } = op(g, v) else { return None };
    let ok = matches!(dims.as_slice(), [0, 1] if g.ty(*input).shape.dims().get(1) == Some(&1)) || dims == &[0];
    ok.then(|| {
        inner.push(v.node);
        *input
    })
}

/// `x` if `v` is a reduction `op` of `x: [n, V]` over its columns (kept or not).
fn row_reduce(g: &Graph, v: ValueId, want: ReduceOp, inner: &mut Vec<NodeId>) -> Option<ValueId> {
    let mut r = v;
    let mut chain = Vec::new();
    if let Op::Clamp { min, max, .. } = op(g, r) {
        if min == max {
            chain.push(r.node);
            r = *min;
        }
    }
    if let Op::Reshape { input, .. } = op(g, r) {
        chain.push(r.node);
        r = *input;
    }
    let Op::Reduce { op: o, input, axes } = op(g, r) else { return None };
    if *o != want || axes != &[1] || g.ty(*input).shape.rank() != 2 {
        return None;
    }
    chain.push(r.node);
    inner.extend(chain);
    Some(*input)
}

/// `z` if `v` is `z - max(z)` over the columns (the max with or without a
/// gradient), else `v`.
fn unshifted(g: &Graph, v: ValueId, inner: &mut Vec<NodeId>) -> ValueId {
    if let Op::Binary { op: BinaryOp::Sub, lhs, rhs } = op(g, v) {
        let mut chain = vec![v.node];
        if let Some(m) = per_row(g, *rhs, &mut chain) {
            if row_reduce(g, m, ReduceOp::Max, &mut chain) == Some(*lhs) {
                inner.extend(chain);
                return *lhs;
            }
        }
    }
    v
}

/// `(z, shifted)` if `v` is `log Σ exp(y)` over the columns (`[n, 1]` or
/// `[n]`), `y` being `z` shifted by its max or `z` itself.
fn log_sum_exp(g: &Graph, v: ValueId, inner: &mut Vec<NodeId>) -> Option<(ValueId, ValueId)> {
    let mut chain = Vec::new();
    let mut x = v;
    if let Op::Reshape { input, .. } = op(g, x) {
        chain.push(x.node);
        x = *input;
    }
    let Op::Unary { op: UnaryOp::Log, input: s } = op(g, x) else { return None };
    chain.push(x.node);
    let e = row_reduce(g, *s, ReduceOp::Sum, &mut chain)?;
    let Op::Unary { op: UnaryOp::Exp, input: y } = op(g, e) else { return None };
    chain.push(e.node);
    let z = unshifted(g, *y, &mut chain);
    inner.extend(chain);
    Some((z, *y))
}

/// The labels `[n]` of a one-hot `[n, V]` (`iota` along the columns compared
/// equal with the labels, converted to a float).
fn one_hot_labels(g: &Graph, v: ValueId, inner: &mut Vec<NodeId>) -> Option<ValueId> {
    let Op::Convert { input: c, .. } = op(g, v) else { return None };
    let Op::Compare { dir: CompareDir::Eq, lhs, rhs } = op(g, *c) else { return None };
    let is_columns = |x: &ValueId| matches!(op(g, *x), Op::Iota { axis: 1, .. });
    let other = if is_columns(lhs) {
        *rhs
    } else if is_columns(rhs) {
        *lhs
    } else {
        return None;
    };
    let mut chain = vec![v.node, c.node];
    let mut l = per_row(g, other, &mut chain)?;
    if let Op::Reshape { input, .. } = op(g, l) {
        chain.push(l.node);
        l = *input;
    }
    let t = g.ty(l);
    (t.shape.rank() == 1 && t.dtype.is_integer()).then(|| {
        inner.extend(chain);
        l
    })
}

/// `Σ a · b` over the columns where one factor is a one-hot: `(other, labels)`.
fn picked(g: &Graph, v: ValueId, inner: &mut Vec<NodeId>) -> Option<(ValueId, ValueId)> {
    let mut chain = Vec::new();
    let prod = row_reduce(g, v, ReduceOp::Sum, &mut chain)?;
    let Op::Binary { op: BinaryOp::Mul, lhs, rhs } = op(g, prod) else { return None };
    chain.push(prod.node);
    let (other, labels) = match one_hot_labels(g, *rhs, &mut chain) {
        Some(l) => (*lhs, l),
        None => (*rhs, one_hot_labels(g, *lhs, &mut chain)?),
    };
    inner.extend(chain);
    Some((other, labels))
}

/// The head of logits `z`: `(h, w)` for `z = h wᵀ`, through a float convert.
fn head(g: &Graph, z: ValueId, inner: &mut Vec<NodeId>) -> Result<(ValueId, ValueId), String> {
    let mut d = z;
    if let Op::Convert { input, .. } = op(g, d) {
        if g.ty(*input).dtype.is_float() {
            inner.push(d.node);
            d = *input;
        }
    }
    let Op::DotGeneral { lhs, rhs, dims } = op(g, d) else {
        return Err(format!("the logits are a `{}`, not the head's product h wᵀ (a bias term?)", op(g, d).name()));
    };
    let plain = |lc: usize, rc: usize| DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![lc],
        rhs_contract: vec![rc],
    };
    if g.ty(*lhs).shape.rank() != 2 || g.ty(*rhs).shape.rank() != 2 {
        return Err("the head's product is not [n, d] x [d, vocab]".into());
    }
    inner.push(d.node);
    if *dims == plain(1, 1) {
        return Ok((*lhs, *rhs));
    }
    if *dims == plain(1, 0) {
        if let Op::Transpose { input, .. } = op(g, *rhs) {
            inner.push(rhs.node);
            return Ok((*lhs, *input));
        }
        return Err(
            "the head's weight is laid out [d, vocab] (a Linear's): the composite reads a [vocab, d] table".into()
        );
    }
    Err("the head's product does not contract the hidden size".into())
}

/// Tries to read the per-token loss at `root`.
fn match_at(g: &Graph, root: NodeId, opts: LossOptions) -> Result<LossMatch, (String, bool)> {
    let quiet = |r: &str| (r.to_string(), false);
    let t = g.ty(root.into());
    if t.shape.rank() != 1 || !t.dtype.is_float() {
        return Err(quiet("not a per-token value"));
    }
    let mut inner = Vec::new();
    let (z, labels) = match &g.node(root).op {
        // -Σ log_softmax(z) · onehot
        Op::Unary { op: UnaryOp::Neg, input } => {
            let (logp, labels) = picked(g, *input, &mut inner).ok_or_else(|| quiet("not a picked log-probability"))?;
            let Op::Binary { op: BinaryOp::Sub, lhs: shifted, rhs: lse_b } = op(g, logp) else {
                return Err(quiet("not a log-softmax"));
            };
            inner.push(logp.node);
            let l = per_row(g, *lse_b, &mut inner).ok_or_else(|| quiet("not a log-softmax"))?;
            let (z, y) = log_sum_exp(g, l, &mut inner).ok_or_else(|| quiet("not a log-softmax"))?;
            if y != *shifted {
                return Err(quiet("the log-softmax's terms differ"));
            }
            (z, labels)
        }
        // logsumexp(z) - Σ z · onehot
        Op::Binary { op: BinaryOp::Sub, lhs, rhs } => {
            let (zp, labels) = picked(g, *rhs, &mut inner).ok_or_else(|| quiet("not a picked logit"))?;
            let mut l = *lhs;
            if let Op::Reshape { input, .. } = op(g, l) {
                inner.push(l.node);
                l = *input;
            }
            let z = match op(g, l) {
                // log Σ exp(z - m) + m
                Op::Binary { op: BinaryOp::Add, lhs: a, rhs: m } => {
                    inner.push(l.node);
                    let (z, _) = log_sum_exp(g, *a, &mut inner).ok_or_else(|| quiet("not a log-sum-exp"))?;
                    if row_reduce(g, *m, ReduceOp::Max, &mut inner) != Some(z) {
                        return Err(quiet("the log-sum-exp adds back something other than the max"));
                    }
                    z
                }
                _ => log_sum_exp(g, l, &mut inner).ok_or_else(|| quiet("not a log-sum-exp"))?.0,
            };
            if z != zp {
                return Err(quiet("the log-sum-exp and the picked logit read different logits"));
            }
            (z, labels)
        }
        _ => return Err(quiet("not a loss")),
    };
    // A classifier's few classes gain nothing from the fused head: its near
    // misses are not worth telling a user about.
    let classes = g.ty(z).shape.dims().last().copied().unwrap_or(0);
    let loud = |r: String| (r, classes >= LOUD_FROM_CLASSES);
    let (h, w) = head(g, z, &mut inner).map_err(loud)?;
    let (n, vocab) = (g.ty(h).shape.dims()[0], g.ty(w).shape.dims()[0]);
    let shards = if opts.data_shards > 1 && n % opts.data_shards == 0 { opts.data_shards } else { 1 };
    let chunk = super::lm_head_block_rows(opts.block_bytes / shards.max(1) as u64, vocab).min(n / shards).max(1);
    let op = Op::LmHeadCrossEntropy { h, w, labels, chunk, shards };
    let types: Vec<_> = op.inputs().iter().map(|&x| g.ty(x).clone()).collect();
    let outs = crate::ir::infer::infer_types(&op, &types).map_err(|e| loud(e.to_string()))?;
    if outs[0] != *t {
        return Err(loud(format!("the loss {t} differs from the composite's {}", outs[0])));
    }
    inner.sort_unstable();
    inner.dedup();
    inner.retain(|&x| x != root);
    for &x in &inner {
        let outside = g.users(x).iter().any(|u| *u != root && inner.binary_search(u).is_err());
        if outside && !matches!(g.node(x).op, Op::Iota { .. } | Op::Constant { .. }) {
            return Err(loud(format!(
                "{x} ({}) is also used outside the loss (the logits are read elsewhere)",
                g.node(x).op.name()
            )));
        }
    }
    Ok(LossMatch { root, op, replaced: inner })
}

/// Classes from which a cross-entropy that is not quite an LM head's is
/// reported as a near miss ([`super::Missed`]): the fused head saves the
/// `[tokens, vocab]` logits' memory and passes, which matter for a
/// vocabulary, not for a classifier's ten classes.
pub const LOUD_FROM_CLASSES: usize = 1024;

/// Every LM-head loss of `g`, by increasing root, and the candidates not
/// taken (those whose log-softmax was read) with the reason.
pub fn find(g: &Graph, opts: LossOptions) -> (Vec<LossMatch>, Vec<(NodeId, String)>) {
    let (mut found, mut missed) = (Vec::new(), Vec::new());
    for (id, n) in g.nodes() {
        if !matches!(n.op, Op::Unary { op: UnaryOp::Neg, .. } | Op::Binary { op: BinaryOp::Sub, .. }) {
            continue;
        }
        match match_at(g, id, opts) {
            Ok(m) => found.push(m),
            Err((reason, true)) => missed.push((id, reason)),
            Err(_) => {}
        }
    }
    (found, missed)
}
