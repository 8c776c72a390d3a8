//! Finding layer norm and RMS norm written with plain ops.
//!
//! The matchers walk down from the last op of a norm (`+ beta` for layer
//! norm, `· gamma` for RMS norm) and read, over the last axis:
//! - layer norm: `(x - mean(x)) · rsqrt(var + eps) · gamma + beta`, the
//!   variance as `mean((x - mean)²)` or as `mean(x²) - mean(x)²`, the
//!   normalisation as `· rsqrt(..)` or `/ sqrt(..)`;
//! - RMS norm: `x · rsqrt(mean(x²) + eps) · gamma`, likewise;
//!
//! a mean as a sum times `1/d` (or divided by `d`), kept or not; `x²` as
//! `x · x` or `x ^ 2`; gamma and beta broadcast from `[d]`; float converts
//! between the normalised value and the gain. Constants are read by value
//! ([`super::consts`]). The composite computes the statistics in f32 (f64
//! for f64) and the variance from the centred values, whatever the spelling
//! (`mean(x²) - mean(x)²` cancels badly in f32; the composite does not).
//!
//! Every reading is local to its root, so the search is O(nodes).

use super::consts::{self, ConstCache};
use crate::ir::{BinaryOp, Graph, NodeId, Op, ReduceOp, UnaryOp, ValueId};

/// One norm found in a graph.
#[derive(Clone, Debug, PartialEq)]
pub struct NormMatch {
    /// The node that becomes the composite (`+ beta` or `· gamma`).
    pub root: NodeId,
    /// `Op::LayerNorm` or `Op::RmsNorm`.
    pub op: Op,
    /// The plain nodes it stands for, root excluded, in increasing order.
    pub replaced: Vec<NodeId>,
}

fn op(g: &Graph, v: ValueId) -> &Op {
    &g.node(v.node).op
}

fn last(g: &Graph, v: ValueId) -> usize {
    g.ty(v).shape.rank().saturating_sub(1)
}

/// `[d]` broadcast over the rows of `v`'s shape: the `[d]` value.
fn per_column(g: &Graph, v: ValueId) -> Option<ValueId> {
    match op(g, v) {
        Op::BroadcastInDim { input, dims, .. }
            if dims.len() == 1 && dims[0] == last(g, v) && g.ty(*input).shape.rank() == 1 =>
        {
            Some(*input)
        }
        _ => None,
    }
}

/// A per-row value broadcast over the last axis: the `[.., 1]` (kept) or
/// `[..]` value.
fn per_row(g: &Graph, v: ValueId, inner: &mut Vec<NodeId>) -> Option<ValueId> {
    let Op::BroadcastInDim { input, dims, .. } = op(g, v) else { return None };
    let (r, ir) = (g.ty(v).shape.rank(), g.ty(*input).shape.rank());
    let kept = ir == r && g.ty(*input).shape.dims()[r - 1] == 1 && dims.iter().copied().eq(0..r);
    let dropped = ir + 1 == r && dims.iter().copied().eq(0..r - 1);
    (kept || dropped).then(|| {
        inner.push(v.node);
        *input
    })
}

/// `x` if `v` is the mean of `x` over its last axis (kept or not).
fn row_mean(g: &Graph, v: ValueId, cache: &mut ConstCache, inner: &mut Vec<NodeId>) -> Option<ValueId> {
    let (sum, factor) = match op(g, v) {
        Op::Binary { op: BinaryOp::Mul, lhs, rhs } => match consts::splat_value(g, *rhs, cache) {
            Some(c) => (*lhs, c),
            None => (*rhs, consts::splat_value(g, *lhs, cache)?),
        },
        Op::Binary { op: BinaryOp::Div, lhs, rhs } => (*lhs, 1.0 / consts::splat_value(g, *rhs, cache)?),
        _ => return None,
    };
    let mut chain = vec![v.node];
    let mut s = sum;
    if let Op::Reshape { input, .. } = op(g, s) {
        chain.push(s.node);
        s = *input;
    }
    let Op::Reduce { op: ReduceOp::Sum, input, axes } = op(g, s) else { return None };
    let d = *g.ty(*input).shape.dims().last()?;
    if axes != &[last(g, *input)] || (factor * d as f64 - 1.0).abs() > 1e-6 {
        return None;
    }
    chain.push(s.node);
    inner.extend(chain);
    Some(*input)
}

/// `x` if `v` is `x · x` or `x ^ 2`.
fn square_of(g: &Graph, v: ValueId, cache: &mut ConstCache) -> Option<ValueId> {
    match op(g, v) {
        Op::Binary { op: BinaryOp::Mul, lhs, rhs } if lhs == rhs => Some(*lhs),
        Op::Binary { op: BinaryOp::Pow, lhs, rhs } if consts::splat_value(g, *rhs, cache) == Some(2.0) => Some(*lhs),
        _ => None,
    }
}

/// The variance `var` and eps of `rsqrt(var + eps)` (`rsqrt: true`) or
/// `sqrt(var + eps)`.
fn under_root(
    g: &Graph,
    v: ValueId,
    rsqrt: bool,
    cache: &mut ConstCache,
    inner: &mut Vec<NodeId>,
) -> Option<(ValueId, f64)> {
    let want = if rsqrt { UnaryOp::Rsqrt } else { UnaryOp::Sqrt };
    let Op::Unary { op: u, input } = op(g, v) else { return None };
    if *u != want {
        return None;
    }
    let Op::Binary { op: BinaryOp::Add, lhs, rhs } = op(g, *input) else { return None };
    let (var, eps) = match consts::splat_value(g, *rhs, cache) {
        Some(e) => (*lhs, e),
        None => (*rhs, consts::splat_value(g, *lhs, cache)?),
    };
    inner.extend([v.node, input.node]);
    Some((var, eps))
}

/// A normalised value: `c · s`, `s · c` with `s` the per-row `rsqrt(var +
/// eps)`, or `c / s` with `s` the per-row `sqrt(var + eps)`. Returns `c`, var
/// and eps.
fn normalised(
    g: &Graph,
    v: ValueId,
    cache: &mut ConstCache,
    inner: &mut Vec<NodeId>,
) -> Option<(ValueId, ValueId, f64)> {
    let mut try_side = |c: ValueId, s: ValueId, rsqrt: bool, inner: &mut Vec<NodeId>| {
        let mut chain = Vec::new();
        let r = per_row(g, s, &mut chain)?;
        let (var, eps) = under_root(g, r, rsqrt, cache, &mut chain)?;
        inner.extend(chain);
        Some((c, var, eps))
    };
    let found = match op(g, v) {
        Op::Binary { op: BinaryOp::Mul, lhs, rhs } => {
            try_side(*lhs, *rhs, true, inner).or_else(|| try_side(*rhs, *lhs, true, inner))
        }
        Op::Binary { op: BinaryOp::Div, lhs, rhs } => try_side(*lhs, *rhs, false, inner),
        _ => None,
    }?;
    inner.push(v.node);
    Some(found)
}

/// Strips float converts.
fn through_converts(g: &Graph, mut v: ValueId, inner: &mut Vec<NodeId>) -> ValueId {
    while let Op::Convert { input, .. } = op(g, v) {
        if !g.ty(*input).dtype.is_float() {
            break;
        }
        inner.push(v.node);
        v = *input;
    }
    v
}

/// The gain of `v = y · gamma` (either order): `(y, gamma)`.
fn gain(g: &Graph, v: ValueId, inner: &mut Vec<NodeId>) -> Option<(ValueId, ValueId)> {
    let Op::Binary { op: BinaryOp::Mul, lhs, rhs } = op(g, v) else { return None };
    let (y, gamma) = match (per_column(g, *rhs), per_column(g, *lhs)) {
        (Some(gm), _) => (*lhs, gm),
        (None, Some(gm)) => (*rhs, gm),
        (None, None) => return None,
    };
    inner.push(v.node);
    inner.push(if per_column(g, *rhs).is_some() { rhs.node } else { lhs.node });
    Some((y, gamma))
}

/// Reads a layer norm whose `+ beta` is `root`.
fn layer_norm_at(g: &Graph, root: NodeId, cache: &mut ConstCache) -> Result<NormMatch, String> {
    let Op::Binary { op: BinaryOp::Add, lhs, rhs } = &g.node(root).op else { return Err("not an add".into()) };
    let mut inner = Vec::new();
    let (scaled, beta, beta_b) = match (per_column(g, *rhs), per_column(g, *lhs)) {
        (Some(b), _) => (*lhs, b, *rhs),
        (None, Some(b)) => (*rhs, b, *lhs),
        (None, None) => return Err("no [d] term".into()),
    };
    inner.push(beta_b.node);
    let (y, gamma) = gain(g, scaled, &mut inner).ok_or("no gain")?;
    let y = through_converts(g, y, &mut inner);
    let (c, var, eps) = normalised(g, y, cache, &mut inner).ok_or("not normalised")?;
    let Op::Binary { op: BinaryOp::Sub, lhs: x, rhs: mb } = op(g, c) else { return Err("not centred".into()) };
    inner.push(c.node);
    let m = per_row(g, *mb, &mut inner).ok_or("not centred by a row value")?;
    if row_mean(g, m, cache, &mut inner) != Some(*x) {
        return Err("not centred by the row mean".into());
    }
    // var = mean((x - mean)²), or mean(x²) - mean(x)².
    let centred = row_mean(g, var, cache, &mut inner).and_then(|sq| square_of(g, sq, cache).map(|s| (sq, s)));
    match centred {
        Some((sq, s)) if s == c => inner.push(sq.node),
        _ => {
            let Op::Binary { op: BinaryOp::Sub, lhs: ex2, rhs: e2x } = op(g, var) else {
                return Err("the variance is not a mean of squares".into());
            };
            let sq = row_mean(g, *ex2, cache, &mut inner).ok_or("no mean of squares")?;
            if square_of(g, sq, cache) != Some(*x) || square_of(g, *e2x, cache) != Some(m) {
                return Err("the variance is not mean(x²) - mean(x)²".into());
            }
            inner.extend([var.node, sq.node, e2x.node]);
        }
    }
    finish(g, root, Op::LayerNorm { x: *x, gamma, beta, eps_bits: eps.to_bits() }, inner)
}

/// Reads an RMS norm whose `· gamma` is `root`.
fn rms_norm_at(g: &Graph, root: NodeId, cache: &mut ConstCache) -> Result<NormMatch, String> {
    let mut inner = Vec::new();
    let (y, gamma) = gain(g, root.into(), &mut inner).ok_or("no gain")?;
    let y = through_converts(g, y, &mut inner);
    let (x, var, eps) = normalised(g, y, cache, &mut inner).ok_or("not normalised")?;
    let sq = row_mean(g, var, cache, &mut inner).ok_or("no mean of squares")?;
    if square_of(g, sq, cache) != Some(x) {
        return Err("not the mean of x²".into());
    }
    inner.push(sq.node);
    finish(g, root, Op::RmsNorm { x, gamma, eps_bits: eps.to_bits() }, inner)
}

/// Types the composite and checks that nothing outside reads what it replaces.
fn finish(g: &Graph, root: NodeId, op: Op, mut inner: Vec<NodeId>) -> Result<NormMatch, String> {
    let types: Vec<_> = op.inputs().iter().map(|&x| g.ty(x).clone()).collect();
    let outs = crate::ir::infer::infer_types(&op, &types).map_err(|e| e.to_string())?;
    if outs[0] != *g.ty(root.into()) {
        return Err(format!("the result {} differs from the composite's {}", g.ty(root.into()), outs[0]));
    }
    inner.sort_unstable();
    inner.dedup();
    inner.retain(|&n| n != root);
    // Statistics read outside, or a broadcast gamma shared with another
    // user, stay: only what nothing else reads is replaced.
    for &n in &inner {
        if g.users(n).iter().any(|u| *u != root && inner.binary_search(u).is_err()) {
            let shared = matches!(g.node(n).op, Op::BroadcastInDim { .. } | Op::Constant { .. });
            if !shared {
                return Err(format!("{n} ({}) is also used outside the norm", g.node(n).op.name()));
            }
        }
    }
    let dead: Vec<NodeId> = inner
        .iter()
        .copied()
        .filter(|&n| g.users(n).iter().all(|u| *u == root || inner.binary_search(u).is_ok()))
        .collect();
    Ok(NormMatch { root, op, replaced: dead })
}

/// Every layer norm and RMS norm of `g`, by increasing root. Layer norms are
/// read first, so that an RMS reading of a layer norm's inner product is
/// not taken.
pub fn find(g: &Graph, cache: &mut ConstCache) -> Vec<NormMatch> {
    let mut found: Vec<NormMatch> = Vec::new();
    for (id, n) in g.nodes() {
        if matches!(n.op, Op::Binary { op: BinaryOp::Add, .. }) && n.outputs[0].dtype.is_float() {
            if let Ok(m) = layer_norm_at(g, id, cache) {
                found.push(m);
            }
        }
    }
    let mut taken = vec![false; g.len()];
    found.iter().flat_map(|m| &m.replaced).for_each(|n| taken[n.index()] = true);
    for (id, n) in g.nodes() {
        if matches!(n.op, Op::Binary { op: BinaryOp::Mul, .. }) && n.outputs[0].dtype.is_float() && !taken[id.index()] {
            if let Ok(m) = rms_norm_at(g, id, cache) {
                found.push(m);
            }
        }
    }
    found.sort_by_key(|m| m.root);
    found
}
