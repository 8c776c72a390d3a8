//! The attention composite on the host, written from its definition (not from
//! the plain expansion it is tested against): per `(batch, query head)`, with
//! the key/value head that query head reads, scores `s = scale · q kᵀ + Σ bias`,
//! `fill` where the mask does not keep a score, `-inf` above the diagonal when
//! causal; the row log-sum-exp `lse`, probabilities `p = exp(s - lse)`, output
//! `p v`. All in f64, rounded once to the result dtypes. A masked score has
//! no gradient (it is a constant), as `select` gives none to the branch it
//! does not take.

use crate::ir::{AttentionAttrs, DType, Literal, TensorType};

use super::err;

type Result<T> = std::result::Result<T, crate::CompileError>;

/// One attention's sizes: batch, query heads, key/value heads, queries, keys,
/// head size.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    hq: usize,
    hkv: usize,
    t: usize,
    s: usize,
    d: usize,
}

impl Dims {
    fn of(q: &Literal, v: &Literal) -> Dims {
        let (qd, vd) = (q.ty().shape.dims(), v.ty().shape.dims());
        Dims { b: qd[0], hq: qd[1], hkv: vd[1], t: qd[2], s: vd[2], d: qd[3] }
    }
}

/// A `[b|1, h|1, t|1, s|1]` operand read at a full `(b, h, i, j)` index.
struct Broadcast {
    values: Vec<f64>,
    strides: [usize; 4],
}

impl Broadcast {
    fn new(l: &Literal) -> Broadcast {
        let dims = l.ty().shape.dims();
        let mut strides = [0; 4];
        let mut acc = 1;
        for ax in (0..4).rev() {
            strides[ax] = if dims[ax] == 1 { 0 } else { acc };
            acc *= dims[ax];
        }
        Broadcast { values: l.to_f64s(), strides }
    }

    fn at(&self, idx: [usize; 4]) -> f64 {
        self.values[idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum::<usize>()]
    }

    /// Adds `x` into the entry behind `idx` (the sum over broadcast axes).
    fn accumulate(&mut self, idx: [usize; 4], x: f64) {
        let at = idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum::<usize>();
        self.values[at] += x;
    }
}

/// The operands of one attention, as f64s.
struct Operands {
    dims: Dims,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    bias: Vec<Broadcast>,
    mask: Option<Broadcast>,
    attrs: AttentionAttrs,
}

impl Operands {
    fn new(
        q: &Literal,
        k: &Literal,
        v: &Literal,
        bias: &[&Literal],
        mask: Option<&Literal>,
        attrs: AttentionAttrs,
    ) -> Operands {
        Operands {
            dims: Dims::of(q, v),
            q: q.to_f64s(),
            k: k.to_f64s(),
            v: v.to_f64s(),
            bias: bias.iter().map(|b| Broadcast::new(b)).collect(),
            mask: mask.map(Broadcast::new),
            attrs,
        }
    }

    /// The key/value head query head `h` reads.
    fn kv_head(&self, h: usize) -> usize {
        self.attrs.kv_heads.source(h, self.dims.hq, self.dims.hkv)
    }

    /// Offset of `q[b, h, i, 0]`.
    fn q_at(&self, b: usize, h: usize, i: usize) -> usize {
        let Dims { hq, t, d, .. } = self.dims;
        ((b * hq + h) * t + i) * d
    }

    /// Offset of `v[b, kh, j, 0]` (and of `k` when not transposed).
    fn v_at(&self, b: usize, kh: usize, j: usize) -> usize {
        let Dims { hkv, s, d, .. } = self.dims;
        ((b * hkv + kh) * s + j) * d
    }

    /// `k[b, kh, j, x]` whatever its layout.
    fn k(&self, b: usize, kh: usize, j: usize, x: usize) -> f64 {
        let Dims { hkv, s, d, .. } = self.dims;
        if self.attrs.k_transposed {
            self.k[((b * hkv + kh) * d + x) * s + j]
        } else {
            self.k[self.v_at(b, kh, j) + x]
        }
    }

    /// Whether score `(b, h, i, j)` is replaced: `Some(fill)` by the mask,
    /// `Some(-inf)` by causality, `None` when it is kept.
    fn masked(&self, idx: [usize; 4]) -> Option<f64> {
        if self.attrs.causal && idx[3] > idx[2] {
            return Some(f64::NEG_INFINITY);
        }
        let m = self.mask.as_ref()?;
        ((m.at(idx) != 0.0) != self.attrs.keep).then(|| self.attrs.fill())
    }

    /// The scores of one `(batch, query head)`: `[t][s]`, and whether each was
    /// masked.
    fn scores(&self, b: usize, h: usize) -> (Vec<f64>, Vec<bool>) {
        let Dims { t, s, d, .. } = self.dims;
        let (kh, scale) = (self.kv_head(h), self.attrs.scale());
        let mut out = vec![0.0; t * s];
        let mut masked = vec![false; t * s];
        for i in 0..t {
            let qi = self.q_at(b, h, i);
            for j in 0..s {
                let idx = [b, h, i, j];
                out[i * s + j] = match self.masked(idx) {
                    Some(fill) => {
                        masked[i * s + j] = true;
                        fill
                    }
                    None => {
                        let dot: f64 = (0..d).map(|x| self.q[qi + x] * self.k(b, kh, j, x)).sum();
                        scale * dot + self.bias.iter().map(|bias| bias.at(idx)).sum::<f64>()
                    }
                };
            }
        }
        (out, masked)
    }
}

fn literal(ty: &TensorType, values: &[f64]) -> Result<Literal> {
    Literal::from_f64s(ty.dtype, ty.shape.clone(), values)
}

/// Outputs `[out, stats]` of `attention(q, k, v, bias.., mask)`.
pub(crate) fn forward(
    q: &Literal,
    k: &Literal,
    v: &Literal,
    bias: &[&Literal],
    mask: Option<&Literal>,
    attrs: AttentionAttrs,
    outs: &[TensorType],
) -> Result<Vec<Literal>> {
    let ops = Operands::new(q, k, v, bias, mask, attrs);
    let Dims { b: nb, hq, t, s, d, .. } = ops.dims;
    let mut out = vec![0.0; nb * hq * t * d];
    let mut stats = vec![0.0; nb * hq * t];
    for b in 0..nb {
        for h in 0..hq {
            let kh = ops.kv_head(h);
            let (sc, _) = ops.scores(b, h);
            for i in 0..t {
                let row = &sc[i * s..(i + 1) * s];
                let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                stats[(b * hq + h) * t + i] = lse;
                let oi = ops.q_at(b, h, i);
                for (j, x) in row.iter().enumerate() {
                    let p = (x - lse).exp();
                    let vj = ops.v_at(b, kh, j);
                    for c in 0..d {
                        out[oi + c] += p * ops.v[vj + c];
                    }
                }
            }
        }
    }
    Ok(vec![literal(&outs[0], &out)?, literal(&outs[1], &stats)?])
}

/// The forward's values [`backward`] reads again.
pub(crate) struct Saved<'a> {
    pub out: &'a Literal,
    pub stats: &'a Literal,
    pub dout: &'a Literal,
}

/// Outputs `[dq, dk, dv, dbias..]` of `attention_grad`, from the saved
/// statistics.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: &Literal,
    k: &Literal,
    v: &Literal,
    bias: &[&Literal],
    mask: Option<&Literal>,
    saved: Saved<'_>,
    attrs: AttentionAttrs,
    outs: &[TensorType],
) -> Result<Vec<Literal>> {
    if saved.stats.ty().dtype != DType::F32 {
        return Err(err("attention_grad", "statistics must be f32"));
    }
    let ops = Operands::new(q, k, v, bias, mask, attrs);
    let Dims { b: nb, hq, t, s, d, .. } = ops.dims;
    let (ov, lv, gv) = (saved.out.to_f64s(), saved.stats.to_f64s(), saved.dout.to_f64s());
    let scale = attrs.scale();
    let mut dq = vec![0.0; q.ty().shape.num_elements()];
    let mut dk = vec![0.0; k.ty().shape.num_elements()];
    let mut dv = vec![0.0; v.ty().shape.num_elements()];
    let mut dbias: Vec<Broadcast> = bias
        .iter()
        .map(|b| {
            let mut z = Broadcast::new(b);
            z.values.iter_mut().for_each(|x| *x = 0.0);
            z
        })
        .collect();
    for b in 0..nb {
        for h in 0..hq {
            let kh = ops.kv_head(h);
            let (sc, masked) = ops.scores(b, h);
            for i in 0..t {
                let qi = ops.q_at(b, h, i);
                let gi = &gv[qi..qi + d];
                // D_i = dout_i · out_i, the row sum of p ∘ dp.
                let di: f64 = (0..d).map(|c| gi[c] * ov[qi + c]).sum();
                let lse = lv[(b * hq + h) * t + i];
                for j in 0..s {
                    let p = (sc[i * s + j] - lse).exp();
                    if p == 0.0 {
                        continue;
                    }
                    let vj = ops.v_at(b, kh, j);
                    let dp: f64 = (0..d).map(|c| gi[c] * ops.v[vj + c]).sum();
                    for c in 0..d {
                        dv[vj + c] += p * gi[c];
                    }
                    if masked[i * s + j] {
                        continue;
                    }
                    let ds = p * (dp - di);
                    for z in &mut dbias {
                        z.accumulate([b, h, i, j], ds);
                    }
                    for c in 0..d {
                        dq[qi + c] += scale * ds * ops.k(b, kh, j, c);
                        let at = if attrs.k_transposed { ((b * ops.dims.hkv + kh) * d + c) * s + j } else { vj + c };
                        dk[at] += scale * ds * ops.q[qi + c];
                    }
                }
            }
        }
    }
    let mut res = vec![literal(&outs[0], &dq)?, literal(&outs[1], &dk)?, literal(&outs[2], &dv)?];
    for (z, ty) in dbias.iter().zip(&outs[3..]) {
        res.push(literal(ty, &z.values)?);
    }
    Ok(res)
}
