//! The LM-head cross-entropy composite on the host, from its definition:
//! `logits = h wᵀ`, `lse_i = log Σ_j exp(logits_ij)`, `nll_i = lse_i - logits_{i, label_i}`;
//! the backward `dlogits = dnll · (softmax - onehot)`, `dh = dlogits w`,
//! `dw = dlogitsᵀ h`; the fused op is both with `dnll_i = scale` for every
//! row. All in f64, rounded once.

use crate::ir::{Literal, TensorType};

use super::err;

type Result<T> = std::result::Result<T, crate::CompileError>;

fn lit(ty: &TensorType, v: &[f64]) -> Result<Literal> {
    Literal::from_f64s(ty.dtype, ty.shape.clone(), v)
}

/// Row `i` of the logits and its log-sum-exp.
fn logits_row(h: &[f64], w: &[f64], i: usize, d: usize, vocab: usize) -> (Vec<f64>, f64) {
    let row: Vec<f64> = (0..vocab).map(|j| (0..d).map(|c| h[i * d + c] * w[j * d + c]).sum()).collect();
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    (row, lse)
}

fn label(labels: &[f64], i: usize, vocab: usize) -> Result<usize> {
    let l = labels[i];
    if l < 0.0 || l >= vocab as f64 {
        return Err(err("lm_head_cross_entropy", format!("label {l} of row {i} is outside the vocabulary of {vocab}")));
    }
    Ok(l as usize)
}

/// Outputs `[nll, lse]`.
pub(crate) fn forward(h: &Literal, w: &Literal, labels: &Literal, outs: &[TensorType]) -> Result<Vec<Literal>> {
    let (hv, wv, lv) = (h.to_f64s(), w.to_f64s(), labels.to_f64s());
    let (n, d) = (h.ty().shape.dims()[0], h.ty().shape.dims()[1]);
    let vocab = w.ty().shape.dims()[0];
    let (mut nll, mut lse) = (vec![0.0; n], vec![0.0; n]);
    for i in 0..n {
        let (row, l) = logits_row(&hv, &wv, i, d, vocab);
        lse[i] = l;
        nll[i] = l - row[label(&lv, i, vocab)?];
    }
    Ok(vec![lit(&outs[0], &nll)?, lit(&outs[1], &lse)?])
}

/// Outputs `[dh, dw]`.
pub(crate) fn backward(
    h: &Literal,
    w: &Literal,
    labels: &Literal,
    lse: &Literal,
    dnll: &Literal,
    outs: &[TensorType],
) -> Result<Vec<Literal>> {
    let (hv, wv, lv, sv, gv) = (h.to_f64s(), w.to_f64s(), labels.to_f64s(), lse.to_f64s(), dnll.to_f64s());
    let (n, d) = (h.ty().shape.dims()[0], h.ty().shape.dims()[1]);
    let vocab = w.ty().shape.dims()[0];
    let (mut dh, mut dw) = (vec![0.0; n * d], vec![0.0; vocab * d]);
    for i in 0..n {
        let (row, _) = logits_row(&hv, &wv, i, d, vocab);
        let y = label(&lv, i, vocab)?;
        for (j, x) in row.iter().enumerate() {
            let dl = gv[i] * ((x - sv[i]).exp() - if j == y { 1.0 } else { 0.0 });
            for c in 0..d {
                dh[i * d + c] += dl * wv[j * d + c];
                dw[j * d + c] += dl * hv[i * d + c];
            }
        }
    }
    Ok(vec![lit(&outs[0], &dh)?, lit(&outs[1], &dw)?])
}

/// Outputs `[nll, lse, dh, dw]` of the fused op: the forward, then the backward
/// with every row's cotangent equal to the scalar `scale`.
pub(crate) fn fused(
    h: &Literal,
    w: &Literal,
    labels: &Literal,
    scale: &Literal,
    outs: &[TensorType],
) -> Result<Vec<Literal>> {
    let (hv, wv, lv) = (h.to_f64s(), w.to_f64s(), labels.to_f64s());
    let s = scale.to_f64s()[0];
    let (n, d) = (h.ty().shape.dims()[0], h.ty().shape.dims()[1]);
    let vocab = w.ty().shape.dims()[0];
    let (mut nll, mut lse) = (vec![0.0; n], vec![0.0; n]);
    let (mut dh, mut dw) = (vec![0.0; n * d], vec![0.0; vocab * d]);
    for i in 0..n {
        let (row, l) = logits_row(&hv, &wv, i, d, vocab);
        let y = label(&lv, i, vocab)?;
        lse[i] = l;
        nll[i] = l - row[y];
        for (j, x) in row.iter().enumerate() {
            let dl = s * ((x - l).exp() - if j == y { 1.0 } else { 0.0 });
            for c in 0..d {
                dh[i * d + c] += dl * wv[j * d + c];
                dw[j * d + c] += dl * hv[i * d + c];
            }
        }
    }
    Ok(vec![lit(&outs[0], &nll)?, lit(&outs[1], &lse)?, lit(&outs[2], &dh)?, lit(&outs[3], &dw)?])
}
