//! The attention composite on the host, written from its definition (not from
//! the plain expansion it is tested against): per `(batch, head)`, scores
//! `s = scale · q kᵀ` masked to `-inf` above the diagonal when causal, the row
//! log-sum-exp `lse`, probabilities `p = exp(s - lse)`, output `p v`. All in f64,
//! rounded once to the result dtypes.

use crate::ir::{AttentionAttrs, DType, Literal, TensorType};

use super::err;

type Result<T> = std::result::Result<T, crate::CompileError>;

/// Dimensions `(batch·heads, t, s, d)` of `q: [b, h, t, d]`, `k: [b, h, s, d]`.
fn dims(q: &Literal, k: &Literal) -> (usize, usize, usize, usize) {
    let (qd, kd) = (q.ty().shape.dims(), k.ty().shape.dims());
    (qd[0] * qd[1], qd[2], kd[2], qd[3])
}

/// Masked, scaled scores of one `(batch, head)` slice: `[t][s]`.
fn scores(q: &[f64], k: &[f64], t: usize, s: usize, d: usize, attrs: AttentionAttrs) -> Vec<f64> {
    let scale = attrs.scale();
    let mut out = vec![f64::NEG_INFINITY; t * s];
    for i in 0..t {
        for j in 0..s {
            if attrs.causal && j > i {
                continue;
            }
            let dot: f64 = (0..d).map(|x| q[i * d + x] * k[j * d + x]).sum();
            out[i * s + j] = scale * dot;
        }
    }
    out
}

fn literal(ty: &TensorType, values: &[f64]) -> Result<Literal> {
    Literal::from_f64s(ty.dtype, ty.shape.clone(), values)
}

/// Outputs `[out, stats]` of `attention(q, k, v)`.
pub(crate) fn forward(
    q: &Literal,
    k: &Literal,
    v: &Literal,
    attrs: AttentionAttrs,
    outs: &[TensorType],
) -> Result<Vec<Literal>> {
    let (bh, t, s, d) = dims(q, k);
    let (qv, kv, vv) = (q.to_f64s(), k.to_f64s(), v.to_f64s());
    let mut out = vec![0.0; bh * t * d];
    let mut stats = vec![0.0; bh * t];
    for b in 0..bh {
        let sc = scores(&qv[b * t * d..], &kv[b * s * d..], t, s, d, attrs);
        for i in 0..t {
            let row = &sc[i * s..(i + 1) * s];
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            stats[b * t + i] = lse;
            for (j, x) in row.iter().enumerate() {
                let p = (x - lse).exp();
                for c in 0..d {
                    out[(b * t + i) * d + c] += p * vv[(b * s + j) * d + c];
                }
            }
        }
    }
    Ok(vec![literal(&outs[0], &out)?, literal(&outs[1], &stats)?])
}

/// Outputs `[dq, dk, dv]` of `attention_grad`, from the saved statistics.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: &Literal,
    k: &Literal,
    v: &Literal,
    out: &Literal,
    stats: &Literal,
    dout: &Literal,
    attrs: AttentionAttrs,
    outs: &[TensorType],
) -> Result<Vec<Literal>> {
    if stats.ty().dtype != DType::F32 {
        return Err(err("attention_grad", "statistics must be f32"));
    }
    let (bh, t, s, d) = dims(q, k);
    let (qv, kv, vv) = (q.to_f64s(), k.to_f64s(), v.to_f64s());
    let (ov, lv, gv) = (out.to_f64s(), stats.to_f64s(), dout.to_f64s());
    let scale = attrs.scale();
    let (mut dq, mut dk, mut dv) = (vec![0.0; bh * t * d], vec![0.0; bh * s * d], vec![0.0; bh * s * d]);
    for b in 0..bh {
        let sc = scores(&qv[b * t * d..], &kv[b * s * d..], t, s, d, attrs);
        for i in 0..t {
            let gi = &gv[(b * t + i) * d..(b * t + i + 1) * d];
            // D_i = dout_i · out_i, the row sum of p ∘ dp.
            let di: f64 = (0..d).map(|c| gi[c] * ov[(b * t + i) * d + c]).sum();
            for j in 0..s {
                let p = (sc[i * s + j] - lv[b * t + i]).exp();
                if p == 0.0 {
                    continue;
                }
                let vj = &vv[(b * s + j) * d..(b * s + j + 1) * d];
                let dp: f64 = (0..d).map(|c| gi[c] * vj[c]).sum();
                let ds = p * (dp - di) * scale;
                for c in 0..d {
                    dv[(b * s + j) * d + c] += p * gi[c];
                    dq[(b * t + i) * d + c] += ds * kv[(b * s + j) * d + c];
                    dk[(b * s + j) * d + c] += ds * qv[(b * t + i) * d + c];
                }
            }
        }
    }
    Ok(vec![literal(&outs[0], &dq)?, literal(&outs[1], &dk)?, literal(&outs[2], &dv)?])
}
