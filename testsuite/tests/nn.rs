//! nn layers and optimizers against f64 host references, run through XLA.

use kiln::nn::{self, LayerNorm, ParamStore, RmsNorm};
use kiln::optim::{AdamW, AdamWConfig, Sgd};
use kiln::{DType, Tensor};

mod common;
use common::Rng;

fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((f64::from(*g) - w).abs() <= tol * w.abs().max(1.0), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn layer_norm_and_rms_norm_match_f64() -> anyhow::Result<()> {
    let mut rng = Rng::new(21);
    let x = rng.normal_vec(12);
    let t = Tensor::from_vec(x.clone(), [3, 4])?;
    let mut ps = ParamStore::new(0);
    let (ln, rms) = (LayerNorm::new(&mut ps, "ln", 4)?, RmsNorm::new(&mut ps, "rms", 4)?);
    let (a, b) = (ln.forward(&t)?, rms.forward(&t)?);
    kiln::mark_step()?;
    let (mut want_ln, mut want_rms) = (Vec::new(), Vec::new());
    for row in x.chunks(4) {
        let r: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
        let mean = r.iter().sum::<f64>() / 4.0;
        let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 4.0;
        want_ln.extend(r.iter().map(|v| (v - mean) / (var + 1e-5).sqrt()));
        let ms = r.iter().map(|v| v * v).sum::<f64>() / 4.0;
        want_rms.extend(r.iter().map(|v| v / (ms + 1e-6).sqrt()));
    }
    close(&a.to_vec::<f32>()?, &want_ln, 1e-5, "layer_norm");
    close(&b.to_vec::<f32>()?, &want_rms, 1e-5, "rms_norm");
    Ok(())
}

#[test]
fn cross_entropy_matches_f64() -> anyhow::Result<()> {
    let mut rng = Rng::new(5);
    let logits = rng.normal_vec(15);
    let labels = vec![4i32, 0, 2];
    let l =
        nn::cross_entropy(&Tensor::from_vec(logits.clone(), [3, 5])?, &Tensor::from_vec(labels.clone(), [3])?, None)?;
    let want: f64 = logits
        .chunks(5)
        .zip(&labels)
        .map(|(row, &y)| {
            let m = row.iter().fold(f64::MIN, |a, &v| a.max(f64::from(v)));
            let lse = m + row.iter().map(|&v| (f64::from(v) - m).exp()).sum::<f64>().ln();
            lse - f64::from(row[y as usize])
        })
        .sum::<f64>()
        / 3.0;
    assert!((l.item()? - want).abs() < 1e-5, "{} vs {want}", l.item()?);
    Ok(())
}

/// The gradient of cross-entropy is `(softmax - onehot) / n` (f64, fresh
/// logits), and it is recorded without a path through log-softmax's max
/// shift: no float comparison (the shift's derivative is zero, and that path
/// cost gpt2-small's explicit-logits step on the H200 1.06 ms and 1.57 GB,
/// `benches/RESULTS.md`, "`log_softmax`'s max shift without a gradient").
#[test]
fn cross_entropy_gradient_is_softmax_minus_onehot_without_the_max_path() -> anyhow::Result<()> {
    use kiln::compiler::ir::Op;
    let (n, c) = (4, 9);
    let mut rng = Rng::new(0x05ee_d1c3);
    let logits = rng.normal_vec(n * c);
    let labels = vec![3i32, 0, 8, 5];
    let x = Tensor::from_vec(logits.clone(), [n, c])?;
    let y = Tensor::from_vec(labels.clone(), [n])?;
    let g = kiln::capture_graph(|| {
        let loss = nn::cross_entropy(&x, &y, None)?;
        Ok(vec![loss.clone(), kiln::grad(&loss, std::slice::from_ref(&x))?.remove(0)])
    })?;
    let float_compares = g
        .nodes()
        .filter(|(_, node)| matches!(&node.op, Op::Compare { lhs, .. } if g.ty(*lhs).dtype.is_float()))
        .count();
    assert_eq!(float_compares, 0, "the backward compares the logits with something (their max?)");

    let got = kiln::grad(&nn::cross_entropy(&x, &y, None)?, std::slice::from_ref(&x))?.remove(0).to_vec::<f32>()?;
    let want: Vec<f64> = logits
        .chunks(c)
        .zip(&labels)
        .flat_map(|(row, &l)| {
            let e: Vec<f64> = row.iter().map(|&v| f64::from(v).exp()).collect();
            let z: f64 = e.iter().sum();
            e.into_iter().enumerate().map(move |(j, ej)| (ej / z - f64::from(j == l as usize)) / n as f64)
        })
        .collect();
    close(&got, &want, 1e-6, "d cross_entropy / d logits");
    Ok(())
}

#[test]
fn dropout_zeroes_about_p_and_rescales_the_rest() -> anyhow::Result<()> {
    kiln::manual_seed(17);
    let x = Tensor::full(2.0, DType::F32, [4000])?;
    let y = nn::dropout(&x, 0.25, true)?;
    let same = nn::dropout(&x, 0.25, false)?;
    kiln::mark_step()?;
    let v = y.to_vec::<f32>()?;
    let zeros = v.iter().filter(|&&e| e == 0.0).count() as f64 / 4000.0;
    assert!((zeros - 0.25).abs() < 0.03, "dropped fraction {zeros}");
    assert!(v.iter().all(|&e| e == 0.0 || (e - 2.0 / 0.75).abs() < 1e-6));
    assert_eq!(same.to_vec::<f32>()?, vec![2.0; 4000]);
    assert!(nn::dropout(&x, 1.5, true).is_err());
    Ok(())
}

#[test]
fn sgd_with_momentum_matches_the_recurrence() -> anyhow::Result<()> {
    // Minimise sum((w - t)^2): g = 2 (w - t); buf = mu buf + g; w -= lr buf.
    let (w0, target) = (Rng::new(1).normal_vec(6), Rng::new(2).normal_vec(6));
    let w = Tensor::from_vec(w0.clone(), [6])?;
    let t = Tensor::from_vec(target.clone(), [6])?;
    let mut opt = Sgd::new(std::slice::from_ref(&w), 0.9, 0.0)?;
    for _ in 0..5 {
        let loss = w.sub(&t)?.square()?.sum_all()?;
        let g = kiln::grad(&loss, std::slice::from_ref(&w))?;
        opt.step(std::slice::from_ref(&w), &g, 0.05)?;
        kiln::mark_step()?;
    }
    let (mut wv, mut buf): (Vec<f64>, Vec<f64>) = (w0.iter().map(|&v| v.into()).collect(), vec![0.0; 6]);
    for _ in 0..5 {
        for i in 0..6 {
            let g = 2.0 * (wv[i] - f64::from(target[i]));
            buf[i] = 0.9 * buf[i] + g;
            wv[i] -= 0.05 * buf[i];
        }
    }
    close(&w.to_vec::<f32>()?, &wv, 1e-5, "sgd");
    Ok(())
}

#[test]
fn adamw_matches_the_reference_update() -> anyhow::Result<()> {
    let (w0, target) = (Rng::new(3).normal_vec(5), Rng::new(4).normal_vec(5));
    let w = Tensor::from_vec(w0.clone(), [5])?;
    let t = Tensor::from_vec(target.clone(), [5])?;
    let cfg = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
    let mut opt = AdamW::new(std::slice::from_ref(&w), cfg)?;
    let lr = 0.01;
    for _ in 0..4 {
        let loss = w.sub(&t)?.square()?.sum_all()?;
        let g = kiln::grad(&loss, std::slice::from_ref(&w))?;
        opt.step(std::slice::from_ref(&w), &g, lr)?;
        kiln::mark_step()?;
    }
    let mut wv: Vec<f64> = w0.iter().map(|&v| v.into()).collect();
    let (mut m, mut v) = (vec![0.0; 5], vec![0.0; 5]);
    for step in 1..=4 {
        for i in 0..5 {
            let g = 2.0 * (wv[i] - f64::from(target[i]));
            m[i] = 0.9 * m[i] + 0.1 * g;
            v[i] = 0.999 * v[i] + 0.001 * g * g;
            let mh = m[i] / (1.0 - 0.9f64.powi(step));
            let vh = v[i] / (1.0 - 0.999f64.powi(step));
            wv[i] -= lr * 0.1 * wv[i];
            wv[i] -= lr * mh / (vh.sqrt() + 1e-8);
        }
    }
    close(&w.to_vec::<f32>()?, &wv, 1e-5, "adamw");
    assert_eq!(opt.t.item()?, 4.0);
    Ok(())
}

/// `CausalSelfAttention` slices q, k, v on the qkv projection's `3` axis
/// before permuting to `[b, h, t, hd]` (the layout the CUDA backward needs no
/// transpose for): its output and gradients (weights and input) equal a plain
/// reference that permutes first and writes causal softmax attention out.
#[test]
fn causal_self_attention_matches_a_plain_reference_with_gradients() -> anyhow::Result<()> {
    let (b, t, d, h) = (2, 5, 16, 4);
    let hd = d / h;
    let mut ps = ParamStore::new(3);
    let attn = nn::CausalSelfAttention::new(&mut ps, "attn", d, h, 0.2, 0.2)?;
    let mut rng = Rng::new(9);
    let x = Tensor::from_vec(rng.normal_vec(b * t * d), [b, t, d])?;
    let r = Tensor::from_vec(rng.normal_vec(b * t * d), [b, t, d])?;
    let y = attn.forward(&x)?;
    let qkv = attn.qkv.forward(&x)?.reshape([b, t, 3, h, hd])?.permute(vec![2, 0, 3, 1, 4])?;
    let pick = |i: usize| qkv.narrow(0, i, 1)?.reshape([b, h, t, hd]);
    let (q, k, v) = (pick(0)?, pick(1)?, pick(2)?);
    let s = q.matmul(&k.transpose(-1, -2)?)?.mul_scalar(1.0 / (hd as f64).sqrt())?;
    let keep = Tensor::iota(DType::I32, [b, h, t, t], 3)?.le(&Tensor::iota(DType::I32, [b, h, t, t], 2)?)?;
    let p = Tensor::where_cond(&keep, &s, &Tensor::full(-1e30, DType::F32, [b, h, t, t])?)?.softmax(-1)?;
    let want = attn.proj.forward(&p.matmul(&v)?.permute(vec![0, 2, 1, 3])?.reshape([b, t, d])?)?;
    let wrt = [attn.qkv.weight.clone(), attn.proj.weight.clone(), x.clone()];
    let got_g = kiln::grad(&y.mul(&r)?.sum_all()?, &wrt)?;
    let want_g = kiln::grad(&want.mul(&r)?.sum_all()?, &wrt)?;
    kiln::mark_step()?;
    let f64s = |t: &Tensor| -> anyhow::Result<Vec<f64>> { Ok(t.to_vec::<f32>()?.into_iter().map(f64::from).collect()) };
    close(&y.to_vec::<f32>()?, &f64s(&want)?, 1e-5, "output");
    for (i, (g, w)) in got_g.iter().zip(&want_g).enumerate() {
        close(&g.to_vec::<f32>()?, &f64s(w)?, 1e-4, &format!("gradient {i}"));
    }
    Ok(())
}
