//! Per-op evaluation for the reference interpreter.

use crate::ir::{
    decode, BinaryOp, CompareDir, DType, DotDims, HostCopyStep, Literal, Op, ReduceOp, Shape, TensorType, UnaryOp,
    ValueId,
};
use crate::CompileError;

use super::err;

type Result<T> = std::result::Result<T, CompileError>;

/// Evaluates one op (not parameters or all_reduce, which the driver handles).
pub(crate) fn eval<'a>(op: &Op, outs: &[TensorType], get: &dyn Fn(ValueId) -> &'a Literal) -> Result<Vec<Literal>> {
    let out = &outs[0];
    let one = |l: Literal| Ok(vec![l]);
    match op {
        Op::Parameter { .. } | Op::AllReduce { .. } => Err(err(op.name(), "evaluated by the driver")),
        Op::Constant { literal } => one(literal.clone()),
        Op::Iota { ty, axis } => {
            let strides = ty.shape.strides();
            let vals: Vec<f64> =
                (0..ty.shape.num_elements()).map(|i| ((i / strides[*axis]) % ty.shape.0[*axis]) as f64).collect();
            one(floats_to(ty, &vals))
        }
        Op::Unary { op: u, input } => one(unary(*u, get(*input))?),
        Op::Binary { op: b, lhs, rhs } => one(binary(*b, get(*lhs), get(*rhs))?),
        Op::Compare { dir, lhs, rhs } => one(compare(*dir, get(*lhs), get(*rhs), out)),
        Op::Select { pred, on_true, on_false } => {
            let (p, t, f) = (get(*pred), get(*on_true), get(*on_false));
            let scalar = p.ty().shape.rank() == 0;
            one(pick(out, |i| if p.bytes()[if scalar { 0 } else { i }] != 0 { (t, i) } else { (f, i) }))
        }
        Op::Clamp { min, input, max } => {
            let (lo, x, hi) = (get(*min), get(*input), get(*max));
            // Bounds are scalars or full tensors.
            if x.ty().dtype.is_float() {
                let (lo, xs, hi) = (lo.to_f64s(), x.to_f64s(), hi.to_f64s());
                // NaN in, NaN out (StableHLO's propagating max and min; f64's skip NaN).
                let nan_max = |a: f64, b: f64| if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) };
                let nan_min = |a: f64, b: f64| if a.is_nan() || b.is_nan() { f64::NAN } else { a.min(b) };
                let v: Vec<f64> =
                    (0..xs.len()).map(|i| nan_min(nan_max(xs[i], lo[at_l(&lo, i)]), hi[at_l(&hi, i)])).collect();
                one(floats_to(out, &v))
            } else {
                let (lo, xs, hi) = (ints(lo), ints(x), ints(hi));
                let v: Vec<i128> =
                    (0..xs.len()).map(|i| xs[i].max(lo[at_l_i(&lo, i)]).min(hi[at_l_i(&hi, i)])).collect();
                one(ints_to(out, &v))
            }
        }
        Op::Convert { input, to } => one(convert(get(*input), *to)),
        Op::BroadcastInDim { input, shape, dims } => {
            let x = get(*input);
            let in_shape = &x.ty().shape;
            let in_strides = in_shape.strides();
            let out_strides = shape.strides();
            one(pick(out, |i| {
                let mut src = 0;
                for (k, &d) in dims.iter().enumerate() {
                    if in_shape.0[k] != 1 {
                        src += ((i / out_strides[d]) % shape.0[d]) * in_strides[k];
                    }
                }
                (x, src)
            }))
        }
        Op::Reshape { input, .. } => one(Literal::from_bytes(out.clone(), get(*input).bytes().to_vec())?),
        Op::Transpose { input, perm } => {
            let x = get(*input);
            let in_strides = x.ty().shape.strides();
            let out_strides = out.shape.strides();
            one(pick(out, |i| {
                let src = perm
                    .iter()
                    .enumerate()
                    .map(|(j, &p)| ((i / out_strides[j]) % out.shape.0[j]) * in_strides[p])
                    .sum();
                (x, src)
            }))
        }
        Op::Slice { input, start, stride, .. } => {
            let x = get(*input);
            let in_strides = x.ty().shape.strides();
            let out_strides = out.shape.strides();
            one(pick(out, |i| {
                let src = (0..out.shape.rank())
                    .map(|j| (start[j] + ((i / out_strides[j]) % out.shape.0[j]) * stride[j]) * in_strides[j])
                    .sum();
                (x, src)
            }))
        }
        Op::DynamicSlice { input, starts, sizes } => {
            let x = get(*input);
            let st = clamped_starts(starts.iter().map(|&s| get(s)), &x.ty().shape, sizes);
            let in_strides = x.ty().shape.strides();
            let out_strides = out.shape.strides();
            one(pick(out, |i| {
                let src = (0..out.shape.rank())
                    .map(|j| (st[j] + (i / out_strides[j]) % out.shape.0[j]) * in_strides[j])
                    .sum();
                (x, src)
            }))
        }
        Op::DynamicUpdateSlice { input, update, starts } => {
            let (x, u) = (get(*input), get(*update));
            let st = clamped_starts(starts.iter().map(|&s| get(s)), &x.ty().shape, u.ty().shape.dims());
            let mut bytes = x.bytes().to_vec();
            let n = x.ty().dtype.size_in_bytes();
            let (in_strides, u_strides) = (x.ty().shape.strides(), u.ty().shape.strides());
            for k in 0..u.ty().shape.num_elements() {
                let dst: usize = (0..u.ty().shape.rank())
                    .map(|j| (st[j] + (k / u_strides[j]) % u.ty().shape.0[j]) * in_strides[j])
                    .sum();
                bytes[dst * n..(dst + 1) * n].copy_from_slice(&u.bytes()[k * n..(k + 1) * n]);
            }
            one(Literal::from_bytes(out.clone(), bytes)?)
        }
        Op::Concatenate { inputs, axis } => {
            let parts: Vec<&Literal> = inputs.iter().map(|&v| get(v)).collect();
            let out_strides = out.shape.strides();
            one(pick(out, |i| {
                let mut c = (i / out_strides[*axis]) % out.shape.0[*axis];
                for p in &parts {
                    let len = p.ty().shape.0[*axis];
                    if c < len {
                        let ps = p.ty().shape.strides();
                        let src =
                            (0..out.shape.rank())
                                .map(|j| {
                                    if j == *axis {
                                        c * ps[j]
                                    } else {
                                        ((i / out_strides[j]) % out.shape.0[j]) * ps[j]
                                    }
                                })
                                .sum();
                        return (*p, src);
                    }
                    c -= len;
                }
                unreachable!("concatenate coordinates are inside the result, which infer sized")
            }))
        }
        Op::Pad { input, value, low, interior, .. } => {
            let (x, v) = (get(*input), get(*value));
            let n = x.ty().dtype.size_in_bytes();
            let mut bytes = v.bytes().repeat(out.shape.num_elements());
            let (in_strides, out_strides) = (x.ty().shape.strides(), out.shape.strides());
            'elems: for k in 0..x.ty().shape.num_elements() {
                let mut dst = 0i64;
                for j in 0..out.shape.rank() {
                    let c = ((k / in_strides[j]) % x.ty().shape.0[j]) as i64;
                    let o = low[j] + c * (interior[j] as i64 + 1);
                    if o < 0 || o >= out.shape.0[j] as i64 {
                        continue 'elems;
                    }
                    dst += o * out_strides[j] as i64;
                }
                let dst = dst as usize;
                bytes[dst * n..(dst + 1) * n].copy_from_slice(&x.bytes()[k * n..(k + 1) * n]);
            }
            one(Literal::from_bytes(out.clone(), bytes)?)
        }
        Op::Reduce { op: r, input, axes } => one(reduce(*r, get(*input), axes, out)),
        Op::DotGeneral { lhs, rhs, dims } => one(dot(get(*lhs), get(*rhs), dims, out)),
        Op::Gather { operand, indices, axis } => {
            let (x, idx) = (get(*operand), ints(get(*indices)));
            let xs = &x.ty().shape;
            let ir = get(*indices).ty().shape.rank();
            let (in_strides, out_strides) = (xs.strides(), out.shape.strides());
            one(pick(out, |i| {
                let coord = |j: usize| (i / out_strides[j]) % out.shape.0[j];
                let mut src = 0;
                for (j, s) in in_strides.iter().enumerate().take(*axis) {
                    src += coord(j) * s;
                }
                let istr = Shape::from(&out.shape.0[*axis..*axis + ir]).strides();
                let flat: usize = (0..ir).map(|k| coord(axis + k) * istr[k]).sum();
                // XLA clamps gather start indices into range.
                let row = idx[flat].clamp(0, xs.0[*axis] as i128 - 1) as usize;
                src += row * in_strides[*axis];
                for (j, s) in in_strides.iter().enumerate().take(xs.rank()).skip(axis + 1) {
                    src += coord(j + ir - 1) * s;
                }
                (x, src)
            }))
        }
        Op::ScatterAdd { operand, indices, updates, axis } => {
            let (x, idx, u) = (get(*operand), ints(get(*indices)), get(*updates));
            let ir = get(*indices).ty().shape.rank();
            let xs = &x.ty().shape;
            let (x_strides, u_strides) = (xs.strides(), u.ty().shape.strides());
            let istr = Shape::from(&u.ty().shape.0[*axis..*axis + ir]).strides();
            let target = |k: usize| -> Option<usize> {
                let coord = |j: usize| (k / u_strides[j]) % u.ty().shape.0[j];
                let flat: usize = (0..ir).map(|m| coord(axis + m) * istr[m]).sum();
                let row = idx[flat];
                // XLA drops updates whose index is out of bounds.
                if row < 0 || row >= xs.0[*axis] as i128 {
                    return None;
                }
                let mut dst = row as usize * x_strides[*axis];
                for (j, s) in x_strides.iter().enumerate().take(*axis) {
                    dst += coord(j) * s;
                }
                for (j, s) in x_strides.iter().enumerate().take(xs.rank()).skip(axis + 1) {
                    dst += coord(j + ir - 1) * s;
                }
                Some(dst)
            };
            if x.ty().dtype.is_float() {
                let (mut acc, uv) = (x.to_f64s(), u.to_f64s());
                for (k, v) in uv.iter().enumerate() {
                    if let Some(d) = target(k) {
                        acc[d] += v;
                    }
                }
                one(floats_to(out, &acc))
            } else {
                let (mut acc, uv) = (ints(x), ints(u));
                for (k, v) in uv.iter().enumerate() {
                    if let Some(d) = target(k) {
                        acc[d] += v;
                    }
                }
                one(ints_to(out, &acc))
            }
        }
        Op::RngBitGenerator { algorithm, state, ty } => super::rng::rng_bit_generator(*algorithm, get(*state), ty),
        Op::OptimizationBarrier { inputs } => Ok(inputs.iter().map(|&v| get(v).clone()).collect()),
        Op::Place { input, .. } | Op::Whole { input } => one(get(*input).clone()),
        // A trip to the host as one op sees it: tokens out, the value through.
        // A copy back needs the value its copy out kept: `interpret` holds it.
        Op::HostCopy { inputs, step, slot, .. } => match step {
            HostCopyStep::Out | HostCopyStep::OutDone => one(Literal::scalar(DType::U64, 0.0)),
            HostCopyStep::InDone => one(get(inputs[0]).clone()),
            HostCopyStep::In => Err(err(
                "host_copy",
                format!("slot {slot}: a copy back is evaluated with its copy out, by `interpret`"),
            )),
        },
        Op::Attention { q, k, v, bias, mask, attrs } => {
            let bias: Vec<&Literal> = bias.iter().map(|&b| get(b)).collect();
            super::attention::forward(get(*q), get(*k), get(*v), &bias, mask.map(get), *attrs, outs)
        }
        Op::AttentionGrad { q, k, v, bias, mask, out, stats, dout, attrs } => {
            let bias: Vec<&Literal> = bias.iter().map(|&b| get(b)).collect();
            let saved = super::attention::Saved { out: get(*out), stats: get(*stats), dout: get(*dout) };
            super::attention::backward(get(*q), get(*k), get(*v), &bias, mask.map(get), saved, *attrs, outs)
        }
        Op::LayerNorm { x, gamma, beta, eps_bits } => {
            super::layer_norm::forward(get(*x), get(*gamma), get(*beta), f64::from_bits(*eps_bits), outs)
        }
        Op::LayerNormGrad { x, gamma, mean, rstd, dy } => {
            super::layer_norm::backward(get(*x), get(*gamma), get(*mean), get(*rstd), get(*dy), outs)
        }
        Op::RmsNorm { x, gamma, eps_bits } => {
            super::layer_norm::rms_forward(get(*x), get(*gamma), f64::from_bits(*eps_bits), outs)
        }
        Op::RmsNormGrad { x, gamma, rstd, dy } => {
            super::layer_norm::rms_backward(get(*x), get(*gamma), get(*rstd), get(*dy), outs)
        }
        Op::LmHeadCrossEntropy { h, w, labels, .. } => super::lm_head::forward(get(*h), get(*w), get(*labels), outs),
        Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll, .. } => {
            super::lm_head::backward(get(*h), get(*w), get(*labels), get(*lse), get(*dnll), outs)
        }
        Op::LmHeadCrossEntropyFused { h, w, labels, scale, .. } => {
            super::lm_head::fused(get(*h), get(*w), get(*labels), get(*scale), outs)
        }
    }
}

fn at_l(v: &[f64], i: usize) -> usize {
    if v.len() == 1 {
        0
    } else {
        i
    }
}

fn at_l_i(v: &[i128], i: usize) -> usize {
    if v.len() == 1 {
        0
    } else {
        i
    }
}

/// Builds a literal of `ty` whose element `i` is element `j` of `src` for
/// `(src, j) = f(i)`.
fn pick<'a>(ty: &TensorType, f: impl Fn(usize) -> (&'a Literal, usize)) -> Literal {
    let n = ty.dtype.size_in_bytes();
    let mut bytes = Vec::with_capacity(ty.size_in_bytes());
    for i in 0..ty.shape.num_elements() {
        let (src, j) = f(i);
        bytes.extend_from_slice(&src.bytes()[j * n..(j + 1) * n]);
    }
    Literal::from_bytes(ty.clone(), bytes).expect("one element per position")
}

fn clamped_starts<'a>(starts: impl Iterator<Item = &'a Literal>, shape: &Shape, sizes: &[usize]) -> Vec<usize> {
    starts
        .zip(shape.dims().iter().zip(sizes))
        .map(|(s, (&d, &size))| ints(s)[0].clamp(0, (d - size) as i128) as usize)
        .collect()
}

/// Every element as an exact integer (pred as 0/1).
pub(crate) fn ints(l: &Literal) -> Vec<i128> {
    let d = l.ty().dtype;
    let n = d.size_in_bytes();
    l.bytes()
        .chunks_exact(n)
        .map(|c| match d {
            DType::Pred => i128::from(c[0] != 0),
            DType::I8 => i128::from(c[0] as i8),
            DType::I32 => i128::from(i32::from_le_bytes(c.try_into().expect("4 bytes"))),
            DType::I64 => i128::from(i64::from_le_bytes(c.try_into().expect("8 bytes"))),
            DType::U8 => i128::from(c[0]),
            DType::U32 => i128::from(u32::from_le_bytes(c.try_into().expect("4 bytes"))),
            DType::U64 => i128::from(u64::from_le_bytes(c.try_into().expect("8 bytes"))),
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 => decode(d, c) as i128,
        })
        .collect()
}

/// Encodes integers, wrapping to the dtype's width (pred: `!= 0`).
pub(crate) fn ints_to(ty: &TensorType, vals: &[i128]) -> Literal {
    let mut bytes = Vec::with_capacity(ty.size_in_bytes());
    for &v in vals {
        match ty.dtype {
            DType::Pred => bytes.push(u8::from(v != 0)),
            DType::I8 | DType::U8 => bytes.push(v as u8),
            DType::I32 | DType::U32 => bytes.extend((v as u32).to_le_bytes()),
            DType::I64 | DType::U64 => bytes.extend((v as u64).to_le_bytes()),
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 => {
                return floats_to(ty, &vals.iter().map(|&v| v as f64).collect::<Vec<_>>())
            }
        }
    }
    Literal::from_bytes(ty.clone(), bytes).expect("one element per value")
}

/// Encodes floats, rounding once to the dtype.
pub(crate) fn floats_to(ty: &TensorType, vals: &[f64]) -> Literal {
    Literal::from_f64s(ty.dtype, ty.shape.clone(), vals).expect("one element per value")
}

fn erf(x: f64) -> f64 {
    // Abramowitz–Stegun 7.1.26 is too coarse; use the series for |x| < 2.5 and
    // the continued fraction of erfc beyond (both ~1e-15).
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    let r = if a < 2.5 {
        // `<=`: at 0 every term is 0 and `<` never held (the reference
        // backend spun forever on erf(0), so on GELU of a zero). Below 2.5
        // the terms fall under 1e-17 of the sum within about 60 steps.
        let (mut term, mut sum, mut n) = (a, a, 0.0);
        while n < 200.0 {
            n += 1.0;
            term *= -a * a / n;
            let add = term / (2.0 * n + 1.0);
            sum += add;
            if add.abs() <= 1e-17 * sum.abs() {
                break;
            }
        }
        2.0 / std::f64::consts::PI.sqrt() * sum
    } else {
        // erfc(a) = exp(-a²)/sqrt(pi) · 1/(a + 1/2/(a + 1/(a + 3/2/(a + ...))))
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (a + f);
        }
        1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / (a + f)
    };
    r.copysign(x)
}

fn unary(u: UnaryOp, x: &Literal) -> Result<Literal> {
    let ty = x.ty();
    if ty.dtype.is_float() {
        let f = |v: f64| match u {
            UnaryOp::Neg => -v,
            UnaryOp::Abs => v.abs(),
            UnaryOp::Exp => v.exp(),
            UnaryOp::Log => v.ln(),
            UnaryOp::Log1p => v.ln_1p(),
            UnaryOp::Expm1 => v.exp_m1(),
            UnaryOp::Tanh => v.tanh(),
            UnaryOp::Logistic => 1.0 / (1.0 + (-v).exp()),
            UnaryOp::Sqrt => v.sqrt(),
            UnaryOp::Rsqrt => 1.0 / v.sqrt(),
            UnaryOp::Sin => v.sin(),
            UnaryOp::Cos => v.cos(),
            UnaryOp::Floor => v.floor(),
            UnaryOp::Ceil => v.ceil(),
            UnaryOp::Sign => {
                if v.is_nan() || v == 0.0 {
                    v
                } else {
                    v.signum()
                }
            }
            UnaryOp::Erf => erf(v),
            UnaryOp::Not => f64::NAN,
        };
        return Ok(floats_to(ty, &x.to_f64s().into_iter().map(f).collect::<Vec<_>>()));
    }
    let unsigned = !ty.dtype.is_signed_integer();
    let f = |v: i128| -> Result<i128> {
        Ok(match u {
            UnaryOp::Neg => -v,
            UnaryOp::Abs => v.abs(),
            UnaryOp::Sign => {
                if unsigned {
                    v.min(1)
                } else {
                    v.signum()
                }
            }
            UnaryOp::Not => {
                if ty.dtype == DType::Pred {
                    i128::from(v == 0)
                } else {
                    !v
                }
            }
            _ => return Err(err(u.name(), format!("not defined on {}", ty.dtype))),
        })
    };
    let vals = ints(x).into_iter().map(f).collect::<Result<Vec<_>>>()?;
    Ok(ints_to(ty, &vals))
}

fn binary(b: BinaryOp, l: &Literal, r: &Literal) -> Result<Literal> {
    let ty = l.ty();
    if ty.dtype.is_float() {
        let f = |a: f64, c: f64| match b {
            BinaryOp::Add => a + c,
            BinaryOp::Sub => a - c,
            BinaryOp::Mul => a * c,
            BinaryOp::Div => a / c,
            BinaryOp::Pow => a.powf(c),
            BinaryOp::Max => {
                if a.is_nan() || c.is_nan() {
                    f64::NAN
                } else {
                    a.max(c)
                }
            }
            BinaryOp::Min => {
                if a.is_nan() || c.is_nan() {
                    f64::NAN
                } else {
                    a.min(c)
                }
            }
            BinaryOp::Rem => a % c,
            BinaryOp::And | BinaryOp::Or | BinaryOp::Xor | BinaryOp::ShiftRightLogical => f64::NAN,
        };
        let (a, c) = (l.to_f64s(), r.to_f64s());
        return Ok(floats_to(ty, &a.iter().zip(&c).map(|(&a, &c)| f(a, c)).collect::<Vec<_>>()));
    }
    let pred = ty.dtype == DType::Pred;
    let f = |a: i128, c: i128| -> i128 {
        match b {
            BinaryOp::Add => a + c,
            BinaryOp::Sub => a - c,
            BinaryOp::Mul => a.wrapping_mul(c),
            // Integer division truncates; by zero XLA gives -1 (all ones).
            BinaryOp::Div => {
                if c == 0 {
                    -1
                } else {
                    a / c
                }
            }
            BinaryOp::Rem => {
                if c == 0 {
                    a
                } else {
                    a % c
                }
            }
            BinaryOp::Pow => int_pow(a, c, ty.dtype),
            BinaryOp::Max => a.max(c),
            BinaryOp::Min => a.min(c),
            BinaryOp::And => {
                if pred {
                    i128::from(a != 0 && c != 0)
                } else {
                    a & c
                }
            }
            BinaryOp::Or => {
                if pred {
                    i128::from(a != 0 || c != 0)
                } else {
                    a | c
                }
            }
            BinaryOp::Xor => {
                if pred {
                    i128::from((a != 0) != (c != 0))
                } else {
                    a ^ c
                }
            }
            BinaryOp::ShiftRightLogical => shift_right_logical(a, c, ty.dtype),
        }
    };
    let (a, c) = (ints(l), ints(r));
    Ok(ints_to(ty, &a.iter().zip(&c).map(|(&a, &c)| f(a, c)).collect::<Vec<_>>()))
}

/// StableHLO `shift_right_logical` on `d`'s bits: zeros shift in, an amount
/// outside `[0, bits)` gives 0; a signed result is the bits read back as
/// signed.
fn shift_right_logical(a: i128, amount: i128, d: DType) -> i128 {
    let bits = 8 * d.size_in_bytes() as u32;
    let mask = (1u128 << bits) - 1;
    let amount = match u32::try_from(amount) {
        Ok(n) if n < bits => n,
        _ => return 0,
    };
    let r = ((a as u128) & mask) >> amount;
    if d.is_signed_integer() && r >> (bits - 1) == 1 {
        r as i128 - (1i128 << bits)
    } else {
        r as i128
    }
}

fn int_pow(base: i128, exp: i128, d: DType) -> i128 {
    if exp < 0 {
        return match base {
            1 => 1,
            -1 => {
                if exp % 2 == 0 {
                    1
                } else {
                    -1
                }
            }
            _ => 0,
        };
    }
    let bits = 8 * d.size_in_bytes() as u32;
    let mask = if bits >= 128 { -1 } else { (1i128 << bits) - 1 };
    let (mut r, mut b, mut e) = (1i128, base & mask, exp);
    while e > 0 {
        if e & 1 == 1 {
            r = r.wrapping_mul(b) & mask;
        }
        b = b.wrapping_mul(b) & mask;
        e >>= 1;
    }
    r
}

fn compare(dir: CompareDir, l: &Literal, r: &Literal, out: &TensorType) -> Literal {
    let test = |o: Option<std::cmp::Ordering>| -> bool {
        use std::cmp::Ordering::*;
        match (dir, o) {
            (CompareDir::Ne, None) => true,
            (_, None) => false,
            (CompareDir::Eq, Some(o)) => o == Equal,
            (CompareDir::Ne, Some(o)) => o != Equal,
            (CompareDir::Lt, Some(o)) => o == Less,
            (CompareDir::Le, Some(o)) => o != Greater,
            (CompareDir::Gt, Some(o)) => o == Greater,
            (CompareDir::Ge, Some(o)) => o != Less,
        }
    };
    let vals: Vec<i128> = if l.ty().dtype.is_float() {
        l.to_f64s().iter().zip(r.to_f64s()).map(|(a, b)| i128::from(test(a.partial_cmp(&b)))).collect()
    } else {
        ints(l).iter().zip(ints(r)).map(|(a, b)| i128::from(test(a.partial_cmp(&b)))).collect()
    };
    ints_to(out, &vals)
}

fn convert(x: &Literal, to: DType) -> Literal {
    let ty = TensorType::new(to, x.ty().shape.clone());
    let from = x.ty().dtype;
    if to == DType::Pred {
        let v: Vec<i128> = x.to_f64s().iter().map(|&v| i128::from(v != 0.0)).collect();
        return ints_to(&ty, &v);
    }
    if to.is_float() {
        if from.is_float() {
            return floats_to(&ty, &x.to_f64s());
        }
        // One rounding to f32 (and from there to bf16 or f16), as XLA's
        // integer conversions round: through f64 first, a 64-bit integer
        // just over a tie of f32 fell onto the tie and then to even.
        let round = |v: i128| if to == DType::F64 { v as f64 } else { f64::from(v as f32) };
        return floats_to(&ty, &ints(x).iter().map(|&v| round(v)).collect::<Vec<_>>());
    }
    if from.is_float() {
        // Truncate toward zero, saturate at the type's range, NaN -> 0.
        let (lo, hi) = int_range(to);
        let v: Vec<i128> = x
            .to_f64s()
            .iter()
            // Clamped as integers: i64::MAX and u64::MAX round up to 2^63
            // and 2^64 as f64, which wrapped to i64::MIN and 0.
            .map(|&v| if v.is_nan() { 0 } else { (v.trunc() as i128).clamp(lo, hi) })
            .collect();
        return ints_to(&ty, &v);
    }
    ints_to(&ty, &ints(x))
}

fn int_range(d: DType) -> (i128, i128) {
    match d {
        DType::Pred => (0, 1),
        DType::I8 => (i8::MIN.into(), i8::MAX.into()),
        DType::I32 => (i32::MIN.into(), i32::MAX.into()),
        DType::I64 => (i64::MIN.into(), i64::MAX.into()),
        DType::U8 => (0, u8::MAX.into()),
        DType::U32 => (0, u32::MAX.into()),
        DType::U64 => (0, u64::MAX.into()),
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => (i128::MIN, i128::MAX),
    }
}

/// For each input element, the index of the output element it reduces into.
fn reduce_targets(shape: &Shape, axes: &[usize], out: &TensorType) -> Vec<usize> {
    let strides = shape.strides();
    let out_strides = out.shape.strides();
    let kept: Vec<usize> = (0..shape.rank()).filter(|a| !axes.contains(a)).collect();
    (0..shape.num_elements())
        .map(|i| kept.iter().enumerate().map(|(k, &d)| ((i / strides[d]) % shape.0[d]) * out_strides[k]).sum())
        .collect()
}

fn reduce(r: ReduceOp, x: &Literal, axes: &[usize], out: &TensorType) -> Literal {
    let targets = reduce_targets(&x.ty().shape, axes, out);
    let n = out.shape.num_elements();
    let d = x.ty().dtype;
    if d.is_float() {
        let mut acc = vec![r.identity(d); n];
        for (v, &t) in x.to_f64s().iter().zip(&targets) {
            acc[t] = match r {
                ReduceOp::Sum => acc[t] + v,
                ReduceOp::Prod => acc[t] * v,
                ReduceOp::Max => {
                    if v.is_nan() || acc[t].is_nan() {
                        f64::NAN
                    } else {
                        acc[t].max(*v)
                    }
                }
                ReduceOp::Min => {
                    if v.is_nan() || acc[t].is_nan() {
                        f64::NAN
                    } else {
                        acc[t].min(*v)
                    }
                }
            };
        }
        return floats_to(out, &acc);
    }
    let pred = d == DType::Pred;
    let init = match (r, pred) {
        (ReduceOp::Sum | ReduceOp::Max, true) => 0,
        (ReduceOp::Prod | ReduceOp::Min, true) => 1,
        (ReduceOp::Sum, false) => 0,
        (ReduceOp::Prod, false) => 1,
        (ReduceOp::Max, false) => int_range(d).0,
        (ReduceOp::Min, false) => int_range(d).1,
    };
    let mut acc = vec![init; n];
    for (v, &t) in ints(x).iter().zip(&targets) {
        acc[t] = match (r, pred) {
            // On pred, sum/max are "or" and prod/min are "and".
            (ReduceOp::Sum | ReduceOp::Max, true) => i128::from(acc[t] != 0 || *v != 0),
            (ReduceOp::Prod | ReduceOp::Min, true) => i128::from(acc[t] != 0 && *v != 0),
            (ReduceOp::Sum, false) => acc[t] + v,
            (ReduceOp::Prod, false) => acc[t].wrapping_mul(*v),
            (ReduceOp::Max, false) => acc[t].max(*v),
            (ReduceOp::Min, false) => acc[t].min(*v),
        };
    }
    ints_to(out, &acc)
}

fn dot(l: &Literal, r: &Literal, d: &DotDims, out: &TensorType) -> Literal {
    let (ls, rs) = (&l.ty().shape, &r.ty().shape);
    let (lst, rst) = (ls.strides(), rs.strides());
    let free = |rank: usize, b: &[usize], c: &[usize]| {
        (0..rank).filter(|x| !b.contains(x) && !c.contains(x)).collect::<Vec<_>>()
    };
    let (lf, rf) = (free(ls.rank(), &d.lhs_batch, &d.lhs_contract), free(rs.rank(), &d.rhs_batch, &d.rhs_contract));
    // Offsets of every contracting position in lhs and rhs.
    let csizes: Vec<usize> = d.lhs_contract.iter().map(|&a| ls.0[a]).collect();
    let kn: usize = csizes.iter().product();
    let cstr = Shape::new(csizes.clone()).strides();
    let (mut dl, mut dr) = (Vec::with_capacity(kn), Vec::with_capacity(kn));
    for k in 0..kn {
        let (mut a, mut b) = (0, 0);
        for (j, (&la, &ra)) in d.lhs_contract.iter().zip(&d.rhs_contract).enumerate() {
            let c = (k / cstr[j]) % csizes[j];
            a += c * lst[la];
            b += c * rst[ra];
        }
        dl.push(a);
        dr.push(b);
    }
    let ostr = out.shape.strides();
    let nb = d.lhs_batch.len();
    let base = |i: usize| -> (usize, usize) {
        let coord = |j: usize| (i / ostr[j]) % out.shape.0[j];
        let (mut a, mut b) = (0, 0);
        for j in 0..nb {
            a += coord(j) * lst[d.lhs_batch[j]];
            b += coord(j) * rst[d.rhs_batch[j]];
        }
        for (k, &f) in lf.iter().enumerate() {
            a += coord(nb + k) * lst[f];
        }
        for (k, &f) in rf.iter().enumerate() {
            b += coord(nb + lf.len() + k) * rst[f];
        }
        (a, b)
    };
    let n = out.shape.num_elements();
    if l.ty().dtype.is_float() {
        let (lv, rv) = (l.to_f64s(), r.to_f64s());
        let vals: Vec<f64> = (0..n)
            .map(|i| {
                let (a, b) = base(i);
                dl.iter().zip(&dr).map(|(x, y)| lv[a + x] * rv[b + y]).sum()
            })
            .collect();
        floats_to(out, &vals)
    } else {
        let (lv, rv) = (ints(l), ints(r));
        let vals: Vec<i128> = (0..n)
            .map(|i| {
                let (a, b) = base(i);
                dl.iter().zip(&dr).fold(0i128, |s, (x, y)| s.wrapping_add(lv[a + x].wrapping_mul(rv[b + y])))
            })
            .collect();
        ints_to(out, &vals)
    }
}

/// Elementwise combination of one value across replicas.
pub(crate) fn all_reduce(r: ReduceOp, parts: &[&Literal]) -> Result<Literal> {
    let first = parts.first().ok_or_else(|| err("all_reduce", "no replicas"))?;
    let ty = first.ty().clone();
    let mut acc = (*first).clone();
    for p in &parts[1..] {
        acc = binary(r.combiner(), &acc, p)?;
    }
    debug_assert_eq!(acc.ty(), &ty);
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::{convert, erf};
    use crate::ir::{DType, Literal};

    #[test]
    fn float_to_64_bit_integers_saturates_as_xla_does() {
        let x = Literal::from_f64s(DType::F32, [6], &[f64::INFINITY, 1e19, 1e20, f64::NEG_INFINITY, f64::NAN, -7.9])
            .unwrap();
        let i = convert(&x, DType::I64);
        let got: Vec<i64> = i.bytes().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, [i64::MAX, i64::MAX, i64::MAX, i64::MIN, 0, -7]);
        let u = convert(&x, DType::U64);
        let got: Vec<u64> = u.bytes().chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, [u64::MAX, 1e19f32 as u64, u64::MAX, 0, 0, 0]); // 1e19 in f32 fits u64
    }

    #[test]
    fn erf_ends_at_zero_and_matches_known_values() {
        assert_eq!(erf(0.0).to_bits(), 0f64.to_bits());
        assert_eq!(erf(-0.0).to_bits(), (-0f64).to_bits());
        assert_eq!(erf(1e-300), 2.0 / std::f64::consts::PI.sqrt() * 1e-300);
        // erf to 16 digits (Python's math.erf).
        for (x, want) in [
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.4, 0.999_311_486_103_354_9),
            (3.0, 0.999_977_909_503_001_4),
        ] {
            assert!((erf(x) - want).abs() < 1e-15, "erf({x}) = {}", erf(x));
            assert!((erf(-x) + want).abs() < 1e-15, "erf(-{x})");
        }
        assert!(erf(f64::NAN).is_nan());
    }
}
