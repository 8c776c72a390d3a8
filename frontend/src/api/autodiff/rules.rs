//! One derivative rule per op.
//!
//! `backward` gets the cotangents of a node's outputs and returns the
//! contributions to the cotangents of the operands that want one (float
//! operands on a path from `wrt` to the loss), as `(operand position, value)`.
//!
//! Invariant: `backward` and `differentiable` match every op with no default
//! arm, so a new op fails to compile here until it has a rule (or is declared
//! not differentiable).

use kiln_compiler::ir::{BinaryOp, CompareDir, DType, DotDims, NodeId, Op, ReduceOp, Shape, UnaryOp, ValueId};

use super::builder::Builder;
use crate::core::error::{FrontendError, Result};

type Contributions = Vec<(usize, ValueId)>;

/// Whether operand `pos` of `op` has a (possibly zero) derivative rule.
pub(crate) fn differentiable(op: &Op, pos: usize) -> bool {
    match op {
        Op::Parameter { .. } | Op::Constant { .. } | Op::Iota { .. } | Op::Compare { .. } => false,
        Op::RngBitGenerator { .. } => false,
        // A clamp's bounds get no gradient (a stop-gradient, which
        // `Tensor::without_grad` relies on); `Tensor::clamp`'s are constants.
        Op::Clamp { .. } => true,
        Op::Select { .. } => pos != 0,
        Op::DynamicSlice { .. } => pos == 0,
        Op::DynamicUpdateSlice { .. } => pos < 2,
        Op::Gather { .. } => pos == 0,
        Op::ScatterAdd { .. } => pos != 1,
        Op::AllReduce { op, .. } => *op == ReduceOp::Sum,
        // q, k, v and the bias terms; the mask (a pred, last) has none.
        Op::Attention { bias, mask, .. } => mask.is_none() || pos < 3 + bias.len(),
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => true,
        Op::LmHeadCrossEntropy { .. } => pos < 2,
        // Second derivatives of composites are not built.
        // The fused LM-head loss already holds its own gradient, placements
        // are host offload's and `whole` the LM-head expansion's (all made by
        // the compiler after autodiff).
        Op::AttentionGrad { .. }
        | Op::LayerNormGrad { .. }
        | Op::RmsNormGrad { .. }
        | Op::LmHeadCrossEntropyGrad { .. }
        | Op::LmHeadCrossEntropyFused { .. }
        | Op::Place { .. }
        | Op::HostCopy { .. }
        | Op::Whole { .. } => false,
        Op::Unary { .. }
        | Op::Binary { .. }
        | Op::Convert { .. }
        | Op::BroadcastInDim { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concatenate { .. }
        | Op::Pad { .. }
        | Op::Reduce { .. }
        | Op::DotGeneral { .. }
        | Op::OptimizationBarrier { .. } => true,
    }
}

fn not_differentiable(b: &Builder, op: &Op, pos: usize) -> FrontendError {
    let v = op.inputs()[pos];
    FrontendError::NotDifferentiable { op: op.name(), operand: pos, ty: b.ty(v) }
}

pub(crate) fn backward(
    b: &mut Builder,
    id: NodeId,
    op: &Op,
    outs: &[Option<ValueId>],
    wants: &[bool],
) -> Result<Contributions> {
    let y = ValueId::from(id);
    let mut out = Contributions::new();
    for (pos, &w) in wants.iter().enumerate() {
        if w && !differentiable(op, pos) && !matches!(op, Op::Compare { .. } | Op::Iota { .. }) {
            return Err(not_differentiable(b, op, pos));
        }
    }
    // Single-output ops: the cotangent of output 0.
    let ct = outs.first().copied().flatten();
    match op {
        Op::Parameter { .. } | Op::Constant { .. } | Op::Iota { .. } | Op::Compare { .. } => {}
        Op::RngBitGenerator { .. } => {}
        Op::Unary { op: u, input } => {
            let (Some(ct), x) = (ct, *input) else { return Ok(out) };
            if let Some(d) = unary(b, *u, x, y, ct)? {
                out.push((0, d));
            }
        }
        Op::Binary { op: bop, lhs, rhs } => {
            let Some(ct) = ct else { return Ok(out) };
            binary(b, *bop, *lhs, *rhs, y, ct, wants, &mut out)?;
        }
        Op::Select { pred, .. } => {
            let Some(ct) = ct else { return Ok(out) };
            let zeros = b.full_like(0.0, ct)?;
            let p = b.fwd(*pred);
            if wants[1] {
                out.push((1, b.select(p, ct, zeros)?));
            }
            if wants[2] {
                out.push((2, b.select(p, zeros, ct)?));
            }
        }
        Op::Clamp { input, .. } => {
            // d/dx clamp(lo, x, hi) = 1 where lo <= x <= hi; the bounds get
            // none by definition (`without_grad` records `clamp(v, 0, v)` to
            // cut a gradient path; `clamp`'s bounds are constants).
            let Some(ct) = ct else { return Ok(out) };
            if !wants[1] {
                return Ok(out);
            }
            let x = b.fwd(*input);
            let same = b.compare(CompareDir::Eq, y, x)?;
            let zeros = b.full_like(0.0, ct)?;
            out.push((1, b.select(same, ct, zeros)?));
        }
        Op::Convert { input, .. } => {
            let Some(ct) = ct else { return Ok(out) };
            let to = b.ty(*input).dtype;
            out.push((0, b.op(Op::Convert { input: ct, to })?));
        }
        Op::BroadcastInDim { input, shape, dims } => {
            // Sum over the dimensions the broadcast created or expanded from 1.
            let Some(ct) = ct else { return Ok(out) };
            let in_shape = b.ty(*input).shape;
            let mut axes: Vec<usize> = (0..shape.rank()).filter(|a| !dims.contains(a)).collect();
            for (i, &d) in dims.iter().enumerate() {
                if in_shape.0[i] == 1 && shape.0[d] != 1 {
                    axes.push(d);
                }
            }
            axes.sort_unstable();
            // A low-precision cotangent (a bias under autocast) is summed in
            // f32 and rounded once, as autocast's forward reductions are.
            // Summed in bf16, a bias gradient over 16384 rows missed an f64
            // sum by 1.1 where bf16's rounding allows 0.46 (CPU plugin,
            // `a_bf16_bias_gradient_is_summed_in_f32`).
            let dt = b.ty(ct).dtype;
            let s = if !axes.is_empty() && matches!(dt, DType::BF16 | DType::F16) {
                let wide = b.op(Op::Convert { input: ct, to: DType::F32 })?;
                let s = b.sum(wide, axes)?;
                b.op(Op::Convert { input: s, to: dt })?
            } else {
                b.sum(ct, axes)?
            };
            out.push((0, b.reshape(s, in_shape)?));
        }
        Op::Reshape { input, .. } => {
            let Some(ct) = ct else { return Ok(out) };
            let s = b.ty(*input).shape;
            out.push((0, b.reshape(ct, s)?));
        }
        Op::Transpose { perm, .. } => {
            let Some(ct) = ct else { return Ok(out) };
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            out.push((0, b.transpose(ct, inv)?));
        }
        Op::Slice { input, start, stride, .. } => {
            // Scatter the cotangent back into zeros: pad with the slice's offsets
            // and stride - 1 zeros between kept elements.
            let Some(ct) = ct else { return Ok(out) };
            let ti = b.ty(*input);
            let to = b.ty(ct);
            if to.shape.num_elements() == 0 {
                out.push((0, b.zeros(&ti)?));
                return Ok(out);
            }
            let zero = b.full(0.0, ti.dtype, &Shape::scalar())?;
            let low: Vec<i64> = start.iter().map(|&s| s as i64).collect();
            let interior: Vec<usize> = stride.iter().map(|&s| s - 1).collect();
            let high: Vec<i64> = (0..ti.shape.rank())
                .map(|i| ti.shape.0[i] as i64 - (start[i] + (to.shape.0[i] - 1) * stride[i] + 1) as i64)
                .collect();
            out.push((0, b.op(Op::Pad { input: ct, value: zero, low, high, interior })?));
        }
        Op::DynamicSlice { input, starts, .. } => {
            let Some(ct) = ct else { return Ok(out) };
            let ti = b.ty(*input);
            let zeros = b.zeros(&ti)?;
            let starts: Vec<ValueId> = starts.iter().map(|&s| b.fwd(s)).collect();
            out.push((0, b.op(Op::DynamicUpdateSlice { input: zeros, update: ct, starts })?));
        }
        Op::DynamicUpdateSlice { update, starts, .. } => {
            let Some(ct) = ct else { return Ok(out) };
            let tu = b.ty(*update);
            let starts: Vec<ValueId> = starts.iter().map(|&s| b.fwd(s)).collect();
            if wants[0] {
                let zeros = b.zeros(&tu)?;
                out.push((0, b.op(Op::DynamicUpdateSlice { input: ct, update: zeros, starts: starts.clone() })?));
            }
            if wants[1] {
                out.push((1, b.op(Op::DynamicSlice { input: ct, starts, sizes: tu.shape.0.to_vec() })?));
            }
        }
        Op::Concatenate { inputs, axis } => {
            let Some(ct) = ct else { return Ok(out) };
            let tc = b.ty(ct);
            let mut offset = 0;
            for (pos, &v) in inputs.iter().enumerate() {
                let len = b.ty(v).shape.0[*axis];
                if wants[pos] {
                    let mut start = vec![0; tc.shape.rank()];
                    let mut limit = tc.shape.0.to_vec();
                    start[*axis] = offset;
                    limit[*axis] = offset + len;
                    let stride = vec![1; tc.shape.rank()];
                    out.push((pos, b.op(Op::Slice { input: ct, start, limit, stride })?));
                }
                offset += len;
            }
        }
        Op::Pad { input, low, high, interior, .. } => {
            // Undo cropping (negative low/high) with zeros, then take every
            // (interior + 1)-th element from the low offset.
            let Some(ct) = ct else { return Ok(out) };
            let ti = b.ty(*input);
            let gi = if ti.shape.num_elements() == 0 {
                b.zeros(&ti)?
            } else {
                let zero = b.full(0.0, ti.dtype, &Shape::scalar())?;
                let uncrop_low: Vec<i64> = low.iter().map(|&l| (-l).max(0)).collect();
                let uncrop_high: Vec<i64> = high.iter().map(|&h| (-h).max(0)).collect();
                let full = if uncrop_low.iter().chain(&uncrop_high).any(|&p| p > 0) {
                    let r = ti.shape.rank();
                    b.op(Op::Pad { input: ct, value: zero, low: uncrop_low, high: uncrop_high, interior: vec![0; r] })?
                } else {
                    ct
                };
                let start: Vec<usize> = low.iter().map(|&l| l.max(0) as usize).collect();
                let stride: Vec<usize> = interior.iter().map(|&i| i + 1).collect();
                let limit: Vec<usize> =
                    (0..ti.shape.rank()).map(|i| start[i] + (ti.shape.0[i] - 1) * stride[i] + 1).collect();
                b.op(Op::Slice { input: full, start, limit, stride })?
            };
            if wants[0] {
                out.push((0, gi));
            }
            if wants[1] {
                // The padding value's cotangent: everything not from the input.
                let all: Vec<usize> = (0..b.ty(ct).shape.rank()).collect();
                let total = b.sum(ct, all)?;
                let from_input_axes: Vec<usize> = (0..ti.shape.rank()).collect();
                let from_input = b.sum(gi, from_input_axes)?;
                out.push((1, b.sub(total, from_input)?));
            }
        }
        Op::Reduce { op: r, input, axes } => {
            let Some(ct) = ct else { return Ok(out) };
            let ti = b.ty(*input);
            let kept: Vec<usize> = (0..ti.shape.rank()).filter(|a| !axes.contains(a)).collect();
            let ct_full = b.broadcast(ct, ti.shape.clone(), kept.clone())?;
            let d = match r {
                // d/dx_i sum x = 1
                ReduceOp::Sum => ct_full,
                // Ties share the cotangent equally (as JAX does).
                ReduceOp::Max | ReduceOp::Min => {
                    let x = b.fwd(*input);
                    let y_full = b.broadcast(y, ti.shape.clone(), kept.clone())?;
                    let hit = b.compare(CompareDir::Eq, x, y_full)?;
                    let mask = b.op(Op::Convert { input: hit, to: ti.dtype })?;
                    let count = b.sum(mask, axes.clone())?;
                    let count_full = b.broadcast(count, ti.shape.clone(), kept)?;
                    let share = b.div(mask, count_full)?;
                    b.mul(ct_full, share)?
                }
                // d/dx_i prod x = prod x / x_i (undefined where x_i = 0).
                ReduceOp::Prod => {
                    let x = b.fwd(*input);
                    let y_full = b.broadcast(y, ti.shape.clone(), kept)?;
                    let q = b.div(y_full, x)?;
                    b.mul(ct_full, q)?
                }
            };
            out.push((0, d));
        }
        Op::DotGeneral { lhs, rhs, dims } => {
            let Some(ct) = ct else { return Ok(out) };
            if wants[0] {
                let r = b.fwd(*rhs);
                out.push((0, dot_lhs_grad(b, ct, r, dims, b.ty(*lhs).shape.rank(), b.ty(*rhs).shape.rank())?));
            }
            if wants[1] {
                let l = b.fwd(*lhs);
                out.push((1, dot_rhs_grad(b, ct, l, dims, b.ty(*lhs).shape.rank(), b.ty(*rhs).shape.rank())?));
            }
        }
        Op::Gather { operand, indices, axis } => {
            // The adjoint of gather is scatter-add into zeros.
            let Some(ct) = ct else { return Ok(out) };
            let zeros = b.zeros(&b.ty(*operand))?;
            let idx = b.fwd(*indices);
            out.push((0, b.op(Op::ScatterAdd { operand: zeros, indices: idx, updates: ct, axis: *axis })?));
        }
        Op::ScatterAdd { indices, axis, .. } => {
            let Some(ct) = ct else { return Ok(out) };
            if wants[0] {
                out.push((0, ct));
            }
            if wants[2] {
                let idx = b.fwd(*indices);
                out.push((2, b.op(Op::Gather { operand: ct, indices: idx, axis: *axis })?));
            }
        }
        Op::OptimizationBarrier { .. } => {
            for (pos, c) in outs.iter().enumerate() {
                if let (Some(c), true) = (c, wants[pos]) {
                    out.push((pos, *c));
                }
            }
        }
        Op::AllReduce { op: r, .. } => {
            // Every replica's input feeds every replica's sum, so the input's
            // cotangent is the sum of the outputs' cotangents across replicas.
            let Some(ct) = ct else { return Ok(out) };
            out.push((0, b.op(Op::AllReduce { op: *r, input: ct })?));
        }
        Op::Attention { q, k, v, bias, mask, attrs } => {
            // The backward composite reads the forward's operands, output and
            // softmax statistics (#1), never the probabilities. A cotangent only
            // for the statistics (nothing in kiln reads them) contributes none.
            // Its outputs are dq, dk, dv and one gradient per bias term, in
            // the order of the forward's operands.
            let Some(dout) = ct else { return Ok(out) };
            let (q, k, v) = (b.fwd(*q), b.fwd(*k), b.fwd(*v));
            let bias: Vec<ValueId> = bias.iter().map(|&x| b.fwd(x)).collect();
            let mask = mask.map(|m| b.fwd(m));
            let o = b.fwd(y);
            let stats = b.fwd(ValueId::new(id, 1));
            let grad = b.g.add(Op::AttentionGrad { q, k, v, bias, mask, out: o, stats, dout, attrs: *attrs })?;
            for (pos, &w) in wants.iter().enumerate() {
                if w {
                    out.push((pos, ValueId::new(grad, pos as u32)));
                }
            }
        }
        Op::LayerNorm { x, gamma, .. } => {
            // Reads x, gamma and the saved statistics (#1 mean, #2 rstd).
            let Some(dy) = ct else { return Ok(out) };
            let (x, gamma) = (b.fwd(*x), b.fwd(*gamma));
            let (mean, rstd) = (b.fwd(ValueId::new(id, 1)), b.fwd(ValueId::new(id, 2)));
            let grad = b.g.add(Op::LayerNormGrad { x, gamma, mean, rstd, dy })?;
            for (pos, &w) in wants.iter().enumerate() {
                if w {
                    out.push((pos, ValueId::new(grad, pos as u32)));
                }
            }
        }
        Op::RmsNorm { x, gamma, .. } => {
            // Reads x, gamma and the saved rstd (#1).
            let Some(dy) = ct else { return Ok(out) };
            let (x, gamma) = (b.fwd(*x), b.fwd(*gamma));
            let rstd = b.fwd(ValueId::new(id, 1));
            let grad = b.g.add(Op::RmsNormGrad { x, gamma, rstd, dy })?;
            for (pos, &w) in wants.iter().enumerate() {
                if w {
                    out.push((pos, ValueId::new(grad, pos as u32)));
                }
            }
        }
        Op::LmHeadCrossEntropy { h, w, labels, chunk, shards } => {
            // Reads h, w, labels and the saved log-sum-exp (#1); the logits are
            // recomputed block by block in the lowering.
            let Some(dnll) = ct else { return Ok(out) };
            let (h, w, labels) = (b.fwd(*h), b.fwd(*w), b.fwd(*labels));
            let lse = b.fwd(ValueId::new(id, 1));
            let grad =
                b.g.add(Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll, chunk: *chunk, shards: *shards })?;
            for (pos, &want) in wants.iter().enumerate().take(2) {
                if want {
                    out.push((pos, ValueId::new(grad, pos as u32)));
                }
            }
        }
        Op::AttentionGrad { .. }
        | Op::LayerNormGrad { .. }
        | Op::RmsNormGrad { .. }
        | Op::LmHeadCrossEntropyGrad { .. }
        | Op::LmHeadCrossEntropyFused { .. }
        | Op::Place { .. }
        | Op::HostCopy { .. }
        | Op::Whole { .. } => {}
    }
    Ok(out)
}

fn unary(b: &mut Builder, u: UnaryOp, x: ValueId, y: ValueId, ct: ValueId) -> Result<Option<ValueId>> {
    Ok(Some(match u {
        // d/dx -x = -1
        UnaryOp::Neg => b.neg(ct)?,
        // d/dx |x| = sign x
        UnaryOp::Abs => {
            let x = b.fwd(x);
            let s = b.unary(UnaryOp::Sign, x)?;
            b.mul(ct, s)?
        }
        // d/dx e^x = e^x
        UnaryOp::Exp => {
            let y = b.fwd(y);
            b.mul(ct, y)?
        }
        // d/dx ln x = 1/x
        UnaryOp::Log => {
            let x = b.fwd(x);
            b.div(ct, x)?
        }
        // d/dx ln(1 + x) = 1/(1 + x)
        UnaryOp::Log1p => {
            let x = b.fwd(x);
            let one = b.full_like(1.0, x)?;
            let d = b.add(one, x)?;
            b.div(ct, d)?
        }
        // d/dx (e^x - 1) = e^x = y + 1
        UnaryOp::Expm1 => {
            let y = b.fwd(y);
            let one = b.full_like(1.0, y)?;
            let e = b.add(y, one)?;
            b.mul(ct, e)?
        }
        // d/dx tanh x = 1 - tanh² x
        UnaryOp::Tanh => {
            let y = b.fwd(y);
            let y2 = b.mul(y, y)?;
            let one = b.full_like(1.0, y)?;
            let d = b.sub(one, y2)?;
            b.mul(ct, d)?
        }
        // d/dx σ(x) = σ(x)(1 - σ(x))
        UnaryOp::Logistic => {
            let y = b.fwd(y);
            let one = b.full_like(1.0, y)?;
            let c = b.sub(one, y)?;
            let d = b.mul(y, c)?;
            b.mul(ct, d)?
        }
        // d/dx sqrt x = 1/(2 sqrt x)
        UnaryOp::Sqrt => {
            let y = b.fwd(y);
            let h = b.div(ct, y)?;
            b.scale(h, 0.5)?
        }
        // d/dx x^(-1/2) = -x^(-3/2)/2 = -y/(2x)
        UnaryOp::Rsqrt => {
            let (x, y) = (b.fwd(x), b.fwd(y));
            let q = b.div(y, x)?;
            let d = b.scale(q, -0.5)?;
            b.mul(ct, d)?
        }
        // d/dx sin x = cos x
        UnaryOp::Sin => {
            let x = b.fwd(x);
            let c = b.unary(UnaryOp::Cos, x)?;
            b.mul(ct, c)?
        }
        // d/dx cos x = -sin x
        UnaryOp::Cos => {
            let x = b.fwd(x);
            let s = b.unary(UnaryOp::Sin, x)?;
            let m = b.mul(ct, s)?;
            b.neg(m)?
        }
        // d/dx erf x = 2/sqrt(pi) e^(-x²)
        UnaryOp::Erf => {
            let x = b.fwd(x);
            let x2 = b.mul(x, x)?;
            let nx2 = b.neg(x2)?;
            let e = b.unary(UnaryOp::Exp, nx2)?;
            let d = b.scale(e, 2.0 / std::f64::consts::PI.sqrt())?;
            b.mul(ct, d)?
        }
        // Piecewise constant: zero almost everywhere.
        UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Sign => return Ok(None),
        // Logical/bitwise: never on floats.
        UnaryOp::Not => return Ok(None),
    }))
}

#[allow(clippy::too_many_arguments)]
fn binary(
    b: &mut Builder,
    op: BinaryOp,
    lhs: ValueId,
    rhs: ValueId,
    y: ValueId,
    ct: ValueId,
    wants: &[bool],
    out: &mut Contributions,
) -> Result<()> {
    match op {
        // d(a+b) = da + db
        BinaryOp::Add => {
            if wants[0] {
                out.push((0, ct));
            }
            if wants[1] {
                out.push((1, ct));
            }
        }
        // d(a-b) = da - db
        BinaryOp::Sub => {
            if wants[0] {
                out.push((0, ct));
            }
            if wants[1] {
                out.push((1, b.neg(ct)?));
            }
        }
        // d(ab) = b da + a db
        BinaryOp::Mul => {
            if wants[0] {
                let r = b.fwd(rhs);
                out.push((0, b.mul(ct, r)?));
            }
            if wants[1] {
                let l = b.fwd(lhs);
                out.push((1, b.mul(ct, l)?));
            }
        }
        // d(a/b) = da/b - (a/b²) db = da/b - (y/b) db
        BinaryOp::Div => {
            let r = b.fwd(rhs);
            let q = b.div(ct, r)?;
            if wants[0] {
                out.push((0, q));
            }
            if wants[1] {
                let y = b.fwd(y);
                let m = b.mul(q, y)?;
                out.push((1, b.neg(m)?));
            }
        }
        // d(a^b) = b a^(b-1) da + a^b ln a db (ln a taken as 0 where a <= 0,
        // where the true derivative is undefined or the term vanishes).
        BinaryOp::Pow => {
            if wants[0] {
                let (l, r) = (b.fwd(lhs), b.fwd(rhs));
                let one = b.full_like(1.0, r)?;
                let rm1 = b.sub(r, one)?;
                let p = b.binary(BinaryOp::Pow, l, rm1)?;
                let d = b.mul(r, p)?;
                out.push((0, b.mul(ct, d)?));
            }
            if wants[1] {
                let (l, y) = (b.fwd(lhs), b.fwd(y));
                let zero = b.full_like(0.0, l)?;
                let pos = b.compare(CompareDir::Gt, l, zero)?;
                let one = b.full_like(1.0, l)?;
                let safe = b.select(pos, l, one)?;
                let ln = b.unary(UnaryOp::Log, safe)?;
                let d = b.mul(y, ln)?;
                let g = b.mul(ct, d)?;
                out.push((1, b.select(pos, g, zero)?));
            }
        }
        // The cotangent goes to the larger (smaller) operand; ties split it
        // equally, as JAX does.
        BinaryOp::Max | BinaryOp::Min => {
            let (l, r) = (b.fwd(lhs), b.fwd(rhs));
            let dir = if op == BinaryOp::Max { CompareDir::Gt } else { CompareDir::Lt };
            let wins = b.compare(dir, l, r)?;
            let tie = b.compare(CompareDir::Eq, l, r)?;
            let (one, half, zero) = (b.full_like(1.0, ct)?, b.full_like(0.5, ct)?, b.full_like(0.0, ct)?);
            let tie_share = b.select(tie, half, zero)?;
            let share = b.select(wins, one, tie_share)?;
            let dl = b.mul(ct, share)?;
            if wants[0] {
                out.push((0, dl));
            }
            if wants[1] {
                out.push((1, b.sub(ct, dl)?));
            }
        }
        // rem(a, b) = a - trunc(a/b) b: da = 1, db = -trunc(a/b)
        BinaryOp::Rem => {
            if wants[0] {
                out.push((0, ct));
            }
            if wants[1] {
                let (l, r) = (b.fwd(lhs), b.fwd(rhs));
                let q = b.div(l, r)?;
                let s = b.unary(UnaryOp::Sign, q)?;
                let a = b.unary(UnaryOp::Abs, q)?;
                let f = b.unary(UnaryOp::Floor, a)?;
                let t = b.mul(s, f)?;
                let m = b.mul(ct, t)?;
                out.push((1, b.neg(m)?));
            }
        }
        // Logical/bitwise ops and shifts never take floats.
        BinaryOp::And | BinaryOp::Or | BinaryOp::Xor | BinaryOp::ShiftRightLogical => {}
    }
    Ok(())
}

/// Positions of `dims` of a `rank`-dimensional operand that are neither batch
/// nor contracting, in increasing order.
fn free_dims(rank: usize, batch: &[usize], contract: &[usize]) -> Vec<usize> {
    (0..rank).filter(|d| !batch.contains(d) && !contract.contains(d)).collect()
}

/// `d lhs = ct · rhs`, contracting `ct`'s rhs-free dims with rhs's free dims,
/// then transposed back into lhs's layout.
fn dot_lhs_grad(b: &mut Builder, ct: ValueId, rhs: ValueId, d: &DotDims, lr: usize, rr: usize) -> Result<ValueId> {
    let nb = d.lhs_batch.len();
    let lf = free_dims(lr, &d.lhs_batch, &d.lhs_contract);
    let rf = free_dims(rr, &d.rhs_batch, &d.rhs_contract);
    let dims = DotDims {
        lhs_batch: (0..nb).collect(),
        rhs_batch: d.rhs_batch.clone(),
        lhs_contract: (nb + lf.len()..nb + lf.len() + rf.len()).collect(),
        rhs_contract: rf,
    };
    // Result: [batch, lhs free, rhs contract dims in increasing order].
    let raw = b.dot(ct, rhs, dims)?;
    let mut rc_sorted = d.rhs_contract.clone();
    rc_sorted.sort_unstable();
    let perm: Vec<usize> = (0..lr)
        .map(|dim| {
            if let Some(i) = d.lhs_batch.iter().position(|&x| x == dim) {
                i
            } else if let Some(k) = lf.iter().position(|&x| x == dim) {
                nb + k
            } else {
                let j = d.lhs_contract.iter().position(|&x| x == dim).expect("every dim is batch, free or contract");
                let k = rc_sorted.iter().position(|&x| x == d.rhs_contract[j]).expect("paired contract dim");
                nb + lf.len() + k
            }
        })
        .collect();
    b.transpose(raw, perm)
}

/// `d rhs = lhs · ct`, contracting lhs's free dims with `ct`'s lhs-free dims,
/// then transposed back into rhs's layout.
fn dot_rhs_grad(b: &mut Builder, ct: ValueId, lhs: ValueId, d: &DotDims, lr: usize, rr: usize) -> Result<ValueId> {
    let nb = d.lhs_batch.len();
    let lf = free_dims(lr, &d.lhs_batch, &d.lhs_contract);
    let rf = free_dims(rr, &d.rhs_batch, &d.rhs_contract);
    let dims = DotDims {
        lhs_batch: d.lhs_batch.clone(),
        rhs_batch: (0..nb).collect(),
        lhs_contract: lf.clone(),
        rhs_contract: (nb..nb + lf.len()).collect(),
    };
    // Result: [batch, lhs contract dims in increasing order, rhs free].
    let raw = b.dot(lhs, ct, dims)?;
    let mut lc_sorted = d.lhs_contract.clone();
    lc_sorted.sort_unstable();
    let nc = lc_sorted.len();
    let perm: Vec<usize> = (0..rr)
        .map(|dim| {
            if let Some(i) = d.rhs_batch.iter().position(|&x| x == dim) {
                i
            } else if let Some(k) = rf.iter().position(|&x| x == dim) {
                nb + nc + k
            } else {
                let j = d.rhs_contract.iter().position(|&x| x == dim).expect("every dim is batch, free or contract");
                let k = lc_sorted.iter().position(|&x| x == d.lhs_contract[j]).expect("paired contract dim");
                nb + k
            }
        })
        .collect();
    b.transpose(raw, perm)
}
