//! The layer-norm composite on the host, from its definition: per row of the
//! last axis, `mean`, population variance, `rstd = 1/sqrt(var + eps)`,
//! `y = (x - mean) · rstd · gamma + beta`; the backward from the saved mean and
//! rstd. All in f64, rounded once to the result dtypes.

use crate::ir::{Literal, TensorType};

type Result<T> = std::result::Result<T, crate::CompileError>;

fn lit(ty: &TensorType, v: &[f64]) -> Result<Literal> {
    Literal::from_f64s(ty.dtype, ty.shape.clone(), v)
}

/// Outputs `[y, mean, rstd]`.
pub(crate) fn forward(
    x: &Literal,
    gamma: &Literal,
    beta: &Literal,
    eps: f64,
    outs: &[TensorType],
) -> Result<Vec<Literal>> {
    let (xv, g, b) = (x.to_f64s(), gamma.to_f64s(), beta.to_f64s());
    let d = g.len();
    let rows = xv.len().checked_div(d).unwrap_or(0);
    let (mut y, mut mean, mut rstd) = (vec![0.0; xv.len()], vec![0.0; rows], vec![0.0; rows]);
    for r in 0..rows {
        let row = &xv[r * d..(r + 1) * d];
        let m = row.iter().sum::<f64>() / d as f64;
        let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / d as f64;
        let s = 1.0 / (var + eps).sqrt();
        (mean[r], rstd[r]) = (m, s);
        for c in 0..d {
            y[r * d + c] = (row[c] - m) * s * g[c] + b[c];
        }
    }
    Ok(vec![lit(&outs[0], &y)?, lit(&outs[1], &mean)?, lit(&outs[2], &rstd)?])
}

/// Outputs `[dx, dgamma, dbeta]`.
pub(crate) fn backward(
    x: &Literal,
    gamma: &Literal,
    mean: &Literal,
    rstd: &Literal,
    dy: &Literal,
    outs: &[TensorType],
) -> Result<Vec<Literal>> {
    let (xv, g, mv, sv, dyv) = (x.to_f64s(), gamma.to_f64s(), mean.to_f64s(), rstd.to_f64s(), dy.to_f64s());
    let d = g.len();
    let rows = mv.len();
    let (mut dx, mut dg, mut db) = (vec![0.0; xv.len()], vec![0.0; d], vec![0.0; d]);
    for r in 0..rows {
        let xhat: Vec<f64> = (0..d).map(|c| (xv[r * d + c] - mv[r]) * sv[r]).collect();
        let dxhat: Vec<f64> = (0..d).map(|c| dyv[r * d + c] * g[c]).collect();
        let m1 = dxhat.iter().sum::<f64>() / d as f64;
        let m2 = dxhat.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / d as f64;
        for c in 0..d {
            dx[r * d + c] = sv[r] * (dxhat[c] - m1 - xhat[c] * m2);
            dg[c] += dyv[r * d + c] * xhat[c];
            db[c] += dyv[r * d + c];
        }
    }
    Ok(vec![lit(&outs[0], &dx)?, lit(&outs[1], &dg)?, lit(&outs[2], &db)?])
}

/// RMS norm's outputs `[y, rstd]`: per row, `rstd = 1/sqrt(mean(x²) + eps)`,
/// `y = x · rstd · gamma`.
pub(crate) fn rms_forward(x: &Literal, gamma: &Literal, eps: f64, outs: &[TensorType]) -> Result<Vec<Literal>> {
    let (xv, g) = (x.to_f64s(), gamma.to_f64s());
    let d = g.len();
    let rows = xv.len().checked_div(d).unwrap_or(0);
    let (mut y, mut rstd) = (vec![0.0; xv.len()], vec![0.0; rows]);
    for r in 0..rows {
        let row = &xv[r * d..(r + 1) * d];
        let s = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
        rstd[r] = s;
        for c in 0..d {
            y[r * d + c] = row[c] * s * g[c];
        }
    }
    Ok(vec![lit(&outs[0], &y)?, lit(&outs[1], &rstd)?])
}

/// RMS norm's backward `[dx, dgamma]` from the saved rstd: with `x̂ = x ·
/// rstd` and `dx̂ = dy · gamma`, `dx = rstd · (dx̂ - x̂ · mean(dx̂ x̂))`.
pub(crate) fn rms_backward(
    x: &Literal,
    gamma: &Literal,
    rstd: &Literal,
    dy: &Literal,
    outs: &[TensorType],
) -> Result<Vec<Literal>> {
    let (xv, g, sv, dyv) = (x.to_f64s(), gamma.to_f64s(), rstd.to_f64s(), dy.to_f64s());
    let d = g.len();
    let (mut dx, mut dg) = (vec![0.0; xv.len()], vec![0.0; d]);
    for r in 0..sv.len() {
        let xhat: Vec<f64> = (0..d).map(|c| xv[r * d + c] * sv[r]).collect();
        let dxhat: Vec<f64> = (0..d).map(|c| dyv[r * d + c] * g[c]).collect();
        let m = dxhat.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / d as f64;
        for c in 0..d {
            dx[r * d + c] = sv[r] * (dxhat[c] - xhat[c] * m);
            dg[c] += dyv[r * d + c] * xhat[c];
        }
    }
    Ok(vec![lit(&outs[0], &dx)?, lit(&outs[1], &dg)?])
}
