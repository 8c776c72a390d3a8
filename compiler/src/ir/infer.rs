//! Shape and dtype inference, run once when a node is added.
//!
//! Each case checks exactly what StableHLO's verifier would reject for that op,
//! so a program that gets into a `Graph` lowers to a module XLA accepts; the
//! errors name the op and the operand types.

use super::{
    AttentionAttrs, DType, Graph, HostCopyStep, Op, Outputs, RngAlgorithm, Shape, TensorType, UnaryOp, ValueId,
};
use crate::CompileError;

type Result<T> = std::result::Result<T, CompileError>;

fn invalid(op: &'static str, reason: impl Into<String>, operands: Vec<TensorType>) -> CompileError {
    CompileError::InvalidOperands { op, reason: reason.into(), operands }
}

/// Output types of `op` in `g`. Operands have been checked to exist.
pub fn infer(g: &Graph, op: &Op) -> Result<Outputs> {
    let operands: Vec<TensorType> = op.inputs().iter().map(|&v| g.ty(v).clone()).collect();
    infer_types(op, &operands)
}

/// Output types of `op` given its operands' types in [`Op::inputs`] order: no
/// graph needed (the e-graph's type analysis uses this). The op's `ValueId`s
/// only say which operand is which.
pub fn infer_types(op: &Op, operands: &[TensorType]) -> Result<Outputs> {
    let name = op.name();
    let inputs = op.inputs();
    if inputs.len() != operands.len() {
        return Err(invalid(
            name,
            format!("{} operand types for {} operands", operands.len(), inputs.len()),
            operands.to_vec(),
        ));
    }
    // Every value asked for is one of `inputs`, so the lookup always succeeds;
    // equal values have equal types, so the first match is the right one.
    let ty = |v: ValueId| operands[inputs.iter().position(|&x| x == v).unwrap_or(0)].clone();
    let one = |t: TensorType| Ok(smallvec::smallvec![t]);
    match op {
        Op::Parameter { ty, .. } => one(ty.clone()),
        Op::Constant { literal } => one(literal.ty().clone()),
        Op::Iota { ty, axis } => {
            check_axis(name, *axis, ty.shape.rank())?;
            if ty.dtype == DType::Pred {
                return Err(CompileError::UnsupportedDType { op: name, dtype: ty.dtype, expected: "a numeric type" });
            }
            one(ty.clone())
        }
        Op::Unary { op: u, input } => {
            let t = ty(*input);
            let ok = match u {
                UnaryOp::Not => !t.dtype.is_float(),
                UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign => t.dtype != DType::Pred,
                _ => t.dtype.is_float(),
            };
            if !ok {
                let expected = if u.float_only() {
                    "a floating-point type"
                } else if *u == UnaryOp::Not {
                    "i1 or an integer type"
                } else {
                    "a numeric type"
                };
                return Err(CompileError::UnsupportedDType { op: name, dtype: t.dtype, expected });
            }
            one(t)
        }
        Op::Binary { op: b, lhs, rhs } => {
            let (l, r) = (ty(*lhs), ty(*rhs));
            same_type(name, &l, &r)?;
            if b.is_logical() && l.dtype.is_float() {
                return Err(CompileError::UnsupportedDType {
                    op: name,
                    dtype: l.dtype,
                    expected: "i1 or an integer type",
                });
            }
            if b.is_shift() && !l.dtype.is_integer() {
                return Err(CompileError::UnsupportedDType { op: name, dtype: l.dtype, expected: "an integer type" });
            }
            if !b.is_logical() && l.dtype == DType::Pred {
                return Err(CompileError::UnsupportedDType { op: name, dtype: l.dtype, expected: "a numeric type" });
            }
            one(l)
        }
        Op::Compare { lhs, rhs, .. } => {
            let (l, r) = (ty(*lhs), ty(*rhs));
            same_type(name, &l, &r)?;
            one(TensorType::new(DType::Pred, l.shape))
        }
        Op::Select { pred, on_true, on_false } => {
            let (p, t, f) = (ty(*pred), ty(*on_true), ty(*on_false));
            same_type(name, &t, &f)?;
            if p.dtype != DType::Pred {
                return Err(CompileError::UnsupportedDType { op: name, dtype: p.dtype, expected: "i1" });
            }
            if p.shape.rank() != 0 && p.shape != t.shape {
                return Err(CompileError::ShapeMismatch { op: name, lhs: p.shape, rhs: t.shape });
            }
            one(t)
        }
        Op::Clamp { min, input, max } => {
            let (lo, x, hi) = (ty(*min), ty(*input), ty(*max));
            for bound in [&lo, &hi] {
                if bound.dtype != x.dtype {
                    return Err(CompileError::DTypeMismatch { op: name, lhs: bound.dtype, rhs: x.dtype });
                }
                if bound.shape.rank() != 0 && bound.shape != x.shape {
                    return Err(CompileError::ShapeMismatch { op: name, lhs: bound.shape.clone(), rhs: x.shape });
                }
            }
            one(x)
        }
        Op::Convert { input, to } => one(TensorType::new(*to, ty(*input).shape)),
        Op::BroadcastInDim { input, shape, dims } => {
            let t = ty(*input);
            if dims.len() != t.shape.rank() {
                return Err(invalid(
                    name,
                    format!("{} broadcast dimensions for an operand of rank {}", dims.len(), t.shape.rank()),
                    vec![t],
                ));
            }
            for (i, &d) in dims.iter().enumerate() {
                check_axis(name, d, shape.rank())?;
                if i > 0 && dims[i - 1] >= d {
                    return Err(invalid(name, format!("broadcast dimensions {dims:?} are not increasing"), vec![t]));
                }
                let (from, to) = (t.shape.0[i], shape.0[d]);
                if from != to && from != 1 {
                    return Err(invalid(
                        name,
                        format!("operand dimension {i} of size {from} cannot broadcast to size {to} of {shape}"),
                        vec![t],
                    ));
                }
            }
            one(TensorType::new(t.dtype, shape.clone()))
        }
        Op::Reshape { input, shape } => {
            let t = ty(*input);
            if shape.checked_num_elements().is_none() {
                return Err(invalid(
                    name,
                    format!("the target shape {shape} has more elements than this machine can address"),
                    vec![t],
                ));
            }
            if t.shape.num_elements() != shape.num_elements() {
                return Err(CompileError::ReshapeSize {
                    op: name,
                    from_elems: t.shape.num_elements(),
                    to_elems: shape.num_elements(),
                    from: t.shape,
                    to: shape.clone(),
                });
            }
            one(TensorType::new(t.dtype, shape.clone()))
        }
        Op::Transpose { input, perm } => {
            let t = ty(*input);
            check_permutation(name, perm, &t)?;
            let dims = perm.iter().map(|&p| t.shape.0[p]).collect::<Vec<_>>();
            one(TensorType::new(t.dtype, dims))
        }
        Op::Slice { input, start, limit, stride } => {
            let t = ty(*input);
            let r = t.shape.rank();
            if start.len() != r || limit.len() != r || stride.len() != r {
                return Err(invalid(name, format!("start/limit/stride must have {r} entries each"), vec![t]));
            }
            let mut dims = Vec::with_capacity(r);
            for i in 0..r {
                if start[i] > limit[i] || limit[i] > t.shape.0[i] || stride[i] == 0 {
                    return Err(invalid(
                        name,
                        format!(
                            "dimension {i}: start {} limit {} stride {} out of bounds for size {}",
                            start[i], limit[i], stride[i], t.shape.0[i]
                        ),
                        vec![t],
                    ));
                }
                dims.push((limit[i] - start[i]).div_ceil(stride[i]));
            }
            one(TensorType::new(t.dtype, dims))
        }
        Op::DynamicSlice { input, starts, sizes } => {
            let t = ty(*input);
            check_starts(&ty, name, &t, starts)?;
            if sizes.len() != t.shape.rank() || sizes.iter().zip(&t.shape.0).any(|(s, d)| s > d) {
                return Err(invalid(name, format!("slice sizes {sizes:?} do not fit {}", t.shape), vec![t]));
            }
            one(TensorType::new(t.dtype, sizes.clone()))
        }
        Op::DynamicUpdateSlice { input, update, starts } => {
            let (t, u) = (ty(*input), ty(*update));
            check_starts(&ty, name, &t, starts)?;
            if u.dtype != t.dtype {
                return Err(CompileError::DTypeMismatch { op: name, lhs: t.dtype, rhs: u.dtype });
            }
            if u.shape.rank() != t.shape.rank() || u.shape.0.iter().zip(&t.shape.0).any(|(s, d)| s > d) {
                return Err(CompileError::ShapeMismatch { op: name, lhs: t.shape, rhs: u.shape });
            }
            one(t)
        }
        Op::Concatenate { inputs, axis } => {
            let Some(first) = inputs.first() else {
                return Err(invalid(name, "needs at least one operand", vec![]));
            };
            let f = ty(*first);
            check_axis(name, *axis, f.shape.rank())?;
            let mut dims = f.shape.0.clone();
            dims[*axis] = 0;
            for &v in inputs {
                let t = ty(v);
                if t.dtype != f.dtype {
                    return Err(CompileError::DTypeMismatch { op: name, lhs: f.dtype, rhs: t.dtype });
                }
                let agree = t.shape.rank() == f.shape.rank()
                    && (0..t.shape.rank()).all(|i| i == *axis || t.shape.0[i] == f.shape.0[i]);
                if !agree {
                    return Err(CompileError::ShapeMismatch { op: name, lhs: f.shape, rhs: t.shape });
                }
                dims[*axis] = dims[*axis].checked_add(t.shape.0[*axis]).ok_or_else(|| {
                    invalid(
                        name,
                        format!("the sizes along axis {axis} overflow"),
                        inputs.iter().map(|&v| ty(v)).collect(),
                    )
                })?;
            }
            let out = TensorType::new(f.dtype, Shape(dims));
            if out.checked_size_in_bytes().is_none() {
                return Err(invalid(
                    name,
                    format!("the result {} has more bytes than this machine can address", out.shape),
                    vec![f],
                ));
            }
            one(out)
        }
        Op::Pad { input, value, low, high, interior } => {
            let (t, v) = (ty(*input), ty(*value));
            if v.shape.rank() != 0 || v.dtype != t.dtype {
                return Err(invalid(name, "padding value must be a scalar of the operand's dtype", vec![t, v]));
            }
            let r = t.shape.rank();
            if low.len() != r || high.len() != r || interior.len() != r {
                return Err(invalid(name, format!("low/high/interior must have {r} entries each"), vec![t, v]));
            }
            let mut dims = Vec::with_capacity(r);
            for i in 0..r {
                // Checked: low/high/interior come from user text and may be
                // i64::MIN/MAX; a wrapped size would reach XLA and abort it.
                // Every partial sum is checked, in both orders XLA may use:
                // the interior-padded size, then each edge on its own (an
                // edge may not remove more than that size), then both.
                let size = i64::try_from(t.shape.0[i]).ok().and_then(|d| {
                    let interior = i64::try_from(interior[i]).ok()?;
                    let inner = d.checked_add((d - 1).max(0).checked_mul(interior)?)?;
                    let (with_low, with_high) = (inner.checked_add(low[i])?, inner.checked_add(high[i])?);
                    if with_low < 0 || with_high < 0 {
                        return None;
                    }
                    with_low.checked_add(high[i])
                });
                let Some(size) = size else {
                    return Err(invalid(
                        name,
                        format!(
                            "dimension {i}: size {} with low {}, high {}, interior {} overflows or removes more than the dimension holds",
                            t.shape.0[i], low[i], high[i], interior[i]
                        ),
                        vec![t, v],
                    ));
                };
                if size < 0 {
                    return Err(invalid(name, format!("dimension {i} would have negative size {size}"), vec![t, v]));
                }
                dims.push(size as usize);
            }
            let out = TensorType::new(t.dtype, dims);
            if out.checked_size_in_bytes().is_none() {
                return Err(invalid(
                    name,
                    format!("the result {} has more bytes than this machine can address", out.shape),
                    vec![t, v],
                ));
            }
            one(out)
        }
        Op::Reduce { input, axes, .. } => {
            let t = ty(*input);
            for (i, &a) in axes.iter().enumerate() {
                check_axis(name, a, t.shape.rank())?;
                if i > 0 && axes[i - 1] >= a {
                    return Err(invalid(name, format!("axes {axes:?} must be sorted and unique"), vec![t]));
                }
            }
            let dims = (0..t.shape.rank()).filter(|i| !axes.contains(i)).map(|i| t.shape.0[i]).collect::<Vec<_>>();
            one(TensorType::new(t.dtype, dims))
        }
        Op::DotGeneral { lhs, rhs, dims } => {
            let (l, r) = (ty(*lhs), ty(*rhs));
            if l.dtype != r.dtype {
                return Err(CompileError::DTypeMismatch { op: name, lhs: l.dtype, rhs: r.dtype });
            }
            if l.dtype == DType::Pred {
                return Err(CompileError::UnsupportedDType { op: name, dtype: l.dtype, expected: "a numeric type" });
            }
            let bad = |reason: String| invalid(name, reason, vec![l.clone(), r.clone()]);
            if dims.lhs_batch.len() != dims.rhs_batch.len() || dims.lhs_contract.len() != dims.rhs_contract.len() {
                return Err(bad(format!("unpaired dimension numbers {dims:?}")));
            }
            let l_used: Vec<usize> = dims.lhs_batch.iter().chain(&dims.lhs_contract).copied().collect();
            let r_used: Vec<usize> = dims.rhs_batch.iter().chain(&dims.rhs_contract).copied().collect();
            for (used, t) in [(&l_used, &l), (&r_used, &r)] {
                for (i, &d) in used.iter().enumerate() {
                    if d >= t.shape.rank() || used[..i].contains(&d) {
                        return Err(bad(format!("dimension numbers {dims:?} are out of range or repeated")));
                    }
                }
            }
            for (a, b) in
                dims.lhs_batch.iter().zip(&dims.rhs_batch).chain(dims.lhs_contract.iter().zip(&dims.rhs_contract))
            {
                if l.shape.0[*a] != r.shape.0[*b] {
                    return Err(bad(format!(
                        "lhs dimension {a} ({}) != rhs dimension {b} ({})",
                        l.shape.0[*a], r.shape.0[*b]
                    )));
                }
            }
            let mut out: Vec<usize> = dims.lhs_batch.iter().map(|&d| l.shape.0[d]).collect();
            out.extend((0..l.shape.rank()).filter(|d| !l_used.contains(d)).map(|d| l.shape.0[d]));
            out.extend((0..r.shape.rank()).filter(|d| !r_used.contains(d)).map(|d| r.shape.0[d]));
            one(TensorType::new(l.dtype, out))
        }
        Op::Gather { operand, indices, axis } => {
            let (t, i) = (ty(*operand), ty(*indices));
            check_axis(name, *axis, t.shape.rank())?;
            check_index_dtype(name, &i)?;
            let mut dims = t.shape.0[..*axis].to_vec();
            dims.extend(&i.shape.0);
            dims.extend(&t.shape.0[*axis + 1..]);
            one(TensorType::new(t.dtype, dims))
        }
        Op::ScatterAdd { operand, indices, updates, axis } => {
            let (t, i, u) = (ty(*operand), ty(*indices), ty(*updates));
            check_axis(name, *axis, t.shape.rank())?;
            check_index_dtype(name, &i)?;
            let mut dims = t.shape.0[..*axis].to_vec();
            dims.extend(&i.shape.0);
            dims.extend(&t.shape.0[*axis + 1..]);
            if u.dtype != t.dtype {
                return Err(CompileError::DTypeMismatch { op: name, lhs: t.dtype, rhs: u.dtype });
            }
            if u.shape.dims() != &dims[..] {
                return Err(CompileError::ShapeMismatch { op: name, lhs: Shape::new(dims), rhs: u.shape });
            }
            one(t)
        }
        Op::RngBitGenerator { state, ty: out, algorithm } => {
            let s = ty(*state);
            // XLA keeps generator state as u64 words: two for THREE_FRY, two or
            // three for PHILOX.
            let words_ok = match algorithm {
                RngAlgorithm::ThreeFry => s.shape.dims() == [2],
                RngAlgorithm::Philox => s.shape.dims() == [2] || s.shape.dims() == [3],
            };
            if s.dtype != DType::U64 || !words_ok {
                return Err(invalid(
                    name,
                    format!(
                        "state must be ui64 of shape [2] ({} takes {})",
                        algorithm.name(),
                        match algorithm {
                            RngAlgorithm::ThreeFry => "2 words",
                            RngAlgorithm::Philox => "2 or 3 words",
                        }
                    ),
                    vec![s],
                ));
            }
            if !matches!(out.dtype, DType::U32 | DType::U64) {
                return Err(CompileError::UnsupportedDType { op: name, dtype: out.dtype, expected: "ui32 or ui64" });
            }
            Ok(smallvec::smallvec![s, out.clone()])
        }
        Op::OptimizationBarrier { inputs } => Ok(inputs.iter().map(|&v| ty(v)).collect()),
        Op::Place { input, .. } | Op::Whole { input } => one(ty(*input)),
        Op::HostCopy { inputs, step, ty: moved, .. } => {
            // Operands: the value (out, out_done, in_done) or a token (in),
            // then the token (out_done), then ties of any type.
            let token = TensorType::new(DType::U64, Vec::<usize>::new());
            let expect = |i: usize, want: &TensorType, what: &str| -> Result<()> {
                match inputs.get(i) {
                    Some(&v) if ty(v) == *want => Ok(()),
                    _ => Err(invalid(
                        name,
                        format!("{}: operand {i} ({what}) must be {want}", step.name()),
                        operands.to_vec(),
                    )),
                }
            };
            match step {
                HostCopyStep::Out => expect(0, moved, "the value")?,
                HostCopyStep::OutDone => {
                    expect(0, moved, "the value")?;
                    expect(1, &token, "the copy's token")?
                }
                HostCopyStep::In => expect(0, &token, "the copy's token")?,
                HostCopyStep::InDone => expect(0, moved, "the value")?,
            }
            one(if step.makes_token() { token } else { moved.clone() })
        }
        Op::AllReduce { input, .. } => {
            let t = ty(*input);
            if t.dtype == DType::Pred {
                return Err(CompileError::UnsupportedDType { op: name, dtype: t.dtype, expected: "a numeric type" });
            }
            one(t)
        }
        Op::Attention { q, k, v, bias, mask, attrs } => {
            let (q, k, v) = (ty(*q), ty(*k), ty(*v));
            let bias: Vec<TensorType> = bias.iter().map(|&b| ty(b)).collect();
            let stats = check_attention(name, &q, &k, &v, &bias, mask.map(ty).as_ref(), *attrs)?;
            Ok(smallvec::smallvec![q, stats])
        }
        Op::AttentionGrad { q, k, v, bias, mask, out, stats, dout, attrs } => {
            let (q, k, v) = (ty(*q), ty(*k), ty(*v));
            let bias: Vec<TensorType> = bias.iter().map(|&b| ty(b)).collect();
            let want_stats = check_attention(name, &q, &k, &v, &bias, mask.map(ty).as_ref(), *attrs)?;
            for t in [ty(*out), ty(*dout)] {
                if t != q {
                    return Err(invalid(name, "out and dout must have q's type", vec![q, t]));
                }
            }
            let s = ty(*stats);
            if s != want_stats {
                return Err(invalid(name, format!("stats must be {want_stats}"), vec![q, s]));
            }
            Ok([q, k, v].into_iter().chain(bias).collect())
        }
        Op::LayerNorm { x, gamma, beta, .. } => {
            let (x, g, b) = (ty(*x), ty(*gamma), ty(*beta));
            let stats = check_layer_norm(name, &x, &g)?;
            if b != g {
                return Err(invalid(name, "beta must have gamma's type", vec![x, g, b]));
            }
            Ok(smallvec::smallvec![x, stats.clone(), stats])
        }
        Op::LayerNormGrad { x, gamma, mean, rstd, dy } => {
            let (x, g) = (ty(*x), ty(*gamma));
            let stats = check_layer_norm(name, &x, &g)?;
            for s in [ty(*mean), ty(*rstd)] {
                if s != stats {
                    return Err(invalid(name, format!("mean and rstd must be {stats}"), vec![x, s]));
                }
            }
            if ty(*dy) != x {
                return Err(invalid(name, "dy must have x's type", vec![x, ty(*dy)]));
            }
            Ok(smallvec::smallvec![x, g.clone(), g])
        }
        Op::RmsNorm { x, gamma, .. } => {
            let (x, g) = (ty(*x), ty(*gamma));
            let stats = check_layer_norm(name, &x, &g)?;
            Ok(smallvec::smallvec![x, stats])
        }
        Op::RmsNormGrad { x, gamma, rstd, dy } => {
            let (x, g) = (ty(*x), ty(*gamma));
            let stats = check_layer_norm(name, &x, &g)?;
            if ty(*rstd) != stats {
                return Err(invalid(name, format!("rstd must be {stats}"), vec![x, ty(*rstd)]));
            }
            if ty(*dy) != x {
                return Err(invalid(name, "dy must have x's type", vec![x, ty(*dy)]));
            }
            Ok(smallvec::smallvec![x, g])
        }
        Op::LmHeadCrossEntropy { h, w, labels, chunk, shards } => {
            let (h, w) = (ty(*h), ty(*w));
            let rows = check_lm_head(name, &h, &w, &ty(*labels), *chunk, *shards)?;
            Ok(smallvec::smallvec![rows.clone(), rows])
        }
        Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll, chunk, shards } => {
            let (h, w) = (ty(*h), ty(*w));
            let rows = check_lm_head(name, &h, &w, &ty(*labels), *chunk, *shards)?;
            for t in [ty(*lse), ty(*dnll)] {
                if t != rows {
                    return Err(invalid(name, format!("lse and dnll must be {rows}"), vec![h, t]));
                }
            }
            Ok(smallvec::smallvec![h, w])
        }
        Op::LmHeadCrossEntropyFused { h, w, labels, scale, chunk, shards } => {
            let (h, w) = (ty(*h), ty(*w));
            let rows = check_lm_head(name, &h, &w, &ty(*labels), *chunk, *shards)?;
            let s = ty(*scale);
            if s != TensorType::scalar(DType::F32) {
                return Err(invalid(name, "scale must be a rank-0 f32", vec![h, s]));
            }
            Ok(smallvec::smallvec![rows.clone(), rows, h, w])
        }
    }
}

/// Checks `h: [n, d]`, `w: [vocab, d]` of one float dtype, integer `labels: [n]`,
/// `n, chunk >= 1` and `shards >= 1` dividing n; returns the per-token type
/// `[n]` f32.
fn check_lm_head(
    op: &'static str,
    h: &TensorType,
    w: &TensorType,
    labels: &TensorType,
    chunk: usize,
    shards: usize,
) -> Result<TensorType> {
    let all = || vec![h.clone(), w.clone(), labels.clone()];
    if !h.dtype.is_float() || w.dtype != h.dtype {
        return Err(invalid(op, "h and w must have one floating-point dtype", all()));
    }
    check_index_dtype(op, labels)?;
    let (hd, wd) = (h.shape.dims(), w.shape.dims());
    if hd.len() != 2 || wd.len() != 2 || hd[1] != wd[1] || labels.shape.dims() != [hd[0]] || hd[0] == 0 || chunk == 0 {
        return Err(invalid(op, "h must be [n, d] (n >= 1), w [vocab, d], labels [n], chunk >= 1", all()));
    }
    if shards == 0 || hd[0] % shards != 0 {
        return Err(invalid(op, format!("shards ({shards}) must be >= 1 and divide the {} rows", hd[0]), all()));
    }
    Ok(TensorType::new(DType::F32, vec![hd[0]]))
}

/// Checks `x: [..., d]` float and `gamma: [d]` of x's dtype; returns the
/// statistics' type `[...]` f32.
fn check_layer_norm(op: &'static str, x: &TensorType, gamma: &TensorType) -> Result<TensorType> {
    if !x.dtype.is_float() {
        return Err(CompileError::UnsupportedDType { op, dtype: x.dtype, expected: "a floating-point type" });
    }
    let r = x.shape.rank();
    if r == 0 || gamma.dtype != x.dtype || gamma.shape.dims() != [x.shape.dims()[r - 1]] {
        return Err(invalid(op, "x must be [..., d] and gamma, beta [d] of x's dtype", vec![x.clone(), gamma.clone()]));
    }
    Ok(TensorType::new(DType::F32, x.shape.dims()[..r - 1].to_vec()))
}

/// The statistics' type of an attention, after checking its operands
/// (`Op::Attention`'s documentation).
fn check_attention(
    op: &'static str,
    q: &TensorType,
    k: &TensorType,
    v: &TensorType,
    bias: &[TensorType],
    mask: Option<&TensorType>,
    attrs: AttentionAttrs,
) -> Result<TensorType> {
    let all = || {
        let mut all = vec![q.clone(), k.clone(), v.clone()];
        all.extend(bias.iter().cloned());
        all.extend(mask.cloned());
        all
    };
    if !q.dtype.is_float() {
        return Err(CompileError::UnsupportedDType { op, dtype: q.dtype, expected: "a floating-point type" });
    }
    if k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(invalid(op, "q, k and v must have one dtype", all()));
    }
    if q.shape.rank() != 4 || k.shape.rank() != 4 || v.shape.rank() != 4 {
        return Err(invalid(op, "q, k and v must be [batch, heads, seq, head_dim]", all()));
    }
    let (qd, kd, vd) = (q.shape.dims(), k.shape.dims(), v.shape.dims());
    let (k_seq, k_dim) = if attrs.k_transposed { (kd[3], kd[2]) } else { (kd[2], kd[3]) };
    if kd[0] != vd[0] || kd[1] != vd[1] || k_seq != vd[2] || k_dim != vd[3] {
        let layout = if attrs.k_transposed { "[batch, kv_heads, head_dim, kv_seq]" } else { "v's shape" };
        return Err(invalid(op, format!("k must be {layout} with v [batch, kv_heads, kv_seq, head_dim]"), all()));
    }
    if qd[0] != vd[0] || qd[3] != vd[3] {
        return Err(invalid(op, "q, k and v must share the batch and the head size", all()));
    }
    if vd[1] == 0 || qd[1] % vd[1] != 0 {
        return Err(invalid(op, format!("{} kv heads do not divide {} query heads", vd[1], qd[1]), all()));
    }
    if attrs.causal && qd[2] != k_seq {
        return Err(invalid(op, "a causal mask needs as many queries as keys", all()));
    }
    let scores = [qd[0], qd[1], qd[2], k_seq];
    let fits =
        |t: &TensorType| t.shape.rank() == 4 && t.shape.dims().iter().zip(scores).all(|(&d, s)| d == s || d == 1);
    for b in bias {
        if !b.dtype.is_float() || !fits(b) {
            let want = format!("a bias must be a float [b|1, h|1, t|1, s|1] for scores {scores:?}");
            return Err(invalid(op, want, all()));
        }
    }
    if let Some(m) = mask {
        if m.dtype != DType::Pred || !fits(m) {
            return Err(invalid(op, format!("a mask must be i1 [b|1, h|1, t|1, s|1] for scores {scores:?}"), all()));
        }
    }
    Ok(TensorType::new(DType::F32, vec![qd[0], qd[1], qd[2]]))
}

fn check_axis(op: &'static str, axis: usize, rank: usize) -> Result<()> {
    if axis < rank {
        Ok(())
    } else {
        Err(CompileError::BadAxis { op, axis, rank })
    }
}

fn same_type(op: &'static str, l: &TensorType, r: &TensorType) -> Result<()> {
    if l.dtype != r.dtype {
        return Err(CompileError::DTypeMismatch { op, lhs: l.dtype, rhs: r.dtype });
    }
    if l.shape != r.shape {
        return Err(CompileError::ShapeMismatch { op, lhs: l.shape.clone(), rhs: r.shape.clone() });
    }
    Ok(())
}

fn check_permutation(op: &'static str, perm: &[usize], t: &TensorType) -> Result<()> {
    let mut seen = vec![false; t.shape.rank()];
    if perm.len() != t.shape.rank() {
        return Err(invalid(op, format!("permutation {perm:?} has the wrong length"), vec![t.clone()]));
    }
    for &p in perm {
        if p >= seen.len() || seen[p] {
            return Err(invalid(op, format!("{perm:?} is not a permutation"), vec![t.clone()]));
        }
        seen[p] = true;
    }
    Ok(())
}

fn check_index_dtype(op: &'static str, t: &TensorType) -> Result<()> {
    if t.dtype.is_integer() {
        Ok(())
    } else {
        Err(CompileError::UnsupportedDType { op, dtype: t.dtype, expected: "an integer index type" })
    }
}

fn check_starts(
    ty: &dyn Fn(ValueId) -> TensorType,
    op: &'static str,
    t: &TensorType,
    starts: &[ValueId],
) -> Result<()> {
    if starts.len() != t.shape.rank() {
        return Err(invalid(
            op,
            format!("{} start indices for rank {}", starts.len(), t.shape.rank()),
            vec![t.clone()],
        ));
    }
    for &s in starts {
        let st = ty(s);
        if st.shape.rank() != 0 || !st.dtype.is_integer() {
            return Err(invalid(op, "start indices must be integer scalars", vec![t.clone(), st]));
        }
    }
    Ok(())
}
