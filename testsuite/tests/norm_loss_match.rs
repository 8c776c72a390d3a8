//! The norm and loss matchers on spellings a user writes: each is found as
//! its composite (layer norm, RMS norm, the LM head's cross-entropy) and
//! computes what the plain ops computed (the same forward run before and
//! after the rewrite through the XLA CPU plugin, fresh random inputs;
//! tolerance relative to max(1, |x|): 1e-5); near-misses stay plain, with a
//! reason, and leave the trace as it was.

use kiln::autodiff::fuse_trace;
use kiln::compiler::ir::DType;
use kiln::nn;
use kiln::Tensor;

mod common;
use common::Rng;

type Build = fn(&[Tensor]) -> kiln::Result<Tensor>;

const ROWS: usize = 6;
const D: usize = 16;
/// A vocabulary, not a classifier's classes: near misses are reported from
/// `LOUD_FROM_CLASSES` (1024) classes on.
const VOCAB: usize = 1031;

fn seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(9, |d| d.as_nanos() as u64)
}

/// x `[2, 3, D]`, gamma and beta `[D]`, h `[ROWS, D]`, the table `[VOCAB, D]`
/// and the labels `[ROWS]`.
fn inputs(rng: &mut Rng) -> kiln::Result<Vec<Tensor>> {
    Ok(vec![
        Tensor::from_vec(rng.normal_vec(ROWS * D), [2, 3, D])?,
        Tensor::from_vec(rng.uniform_vec(D, 0.5, 1.5), [D])?,
        Tensor::from_vec(rng.normal_vec(D), [D])?,
        Tensor::from_vec(rng.normal_vec(ROWS * D), [ROWS, D])?,
        Tensor::from_vec(rng.normal_vec(VOCAB * D), [VOCAB, D])?,
        Tensor::from_vec((0..ROWS).map(|_| (rng.next_u64() % VOCAB as u64) as i32).collect::<Vec<_>>(), [ROWS])?,
    ])
}

fn layer_norm_centred(i: &[Tensor]) -> kiln::Result<Tensor> {
    let (x, g, b) = (&i[0], &i[1], &i[2]);
    let c = x.sub(&x.mean(&[-1], true)?)?;
    let var = c.square()?.mean(&[-1], true)?;
    c.mul(&var.add_scalar(1e-5)?.rsqrt()?)?.mul(g)?.add(b)
}

/// `mean(x²) - mean(x)²`, divided by the root, gain first, beta first.
fn layer_norm_moments(i: &[Tensor]) -> kiln::Result<Tensor> {
    let (x, g, b) = (&i[0], &i[1], &i[2]);
    let m = x.mean(&[-1], true)?;
    let var = x.mul(x)?.mean(&[-1], true)?.sub(&m.mul(&m)?)?;
    let y = x.sub(&m)?.div(&var.add_scalar(1e-6)?.sqrt()?)?;
    b.add(&g.mul(&y)?)
}

fn rms_norm_llama(i: &[Tensor]) -> kiln::Result<Tensor> {
    let x = i[0].to_dtype(DType::F32)?;
    let var = x.powf(2.0)?.mean(&[-1], true)?;
    i[1].mul(&x.mul(&var.add_scalar(1e-6)?.rsqrt()?)?)
}

/// `x / sqrt(Σ x² / d + eps)`.
fn rms_norm_divided(i: &[Tensor]) -> kiln::Result<Tensor> {
    let x = &i[0];
    let ms = x.mul(x)?.sum(&[-1], true)?.div(&Tensor::full(D as f64, DType::F32, [])?)?;
    x.div(&ms.add_scalar(1e-5)?.sqrt()?)?.mul(&i[1])
}

fn logits(i: &[Tensor]) -> kiln::Result<Tensor> {
    i[3].matmul(&i[4].t()?)
}

fn loss_log_softmax(i: &[Tensor]) -> kiln::Result<Tensor> {
    let logp = logits(i)?.log_softmax(-1)?;
    logp.mul(&nn::one_hot(&i[5], VOCAB, DType::F32)?)?.sum(&[-1], false)?.neg()?.mean_all()
}

fn loss_logsumexp_minus_picked(i: &[Tensor]) -> kiln::Result<Tensor> {
    let z = logits(i)?;
    let m = z.max(&[-1], true)?;
    let lse = z.sub(&m)?.exp()?.sum(&[-1], true)?.log()?.add(&m)?.reshape([ROWS])?;
    let picked = z.mul(&nn::one_hot(&i[5], VOCAB, DType::F32)?)?.sum(&[-1], false)?;
    lse.sub(&picked)?.mean_all()
}

fn loss_builtin_cross_entropy(i: &[Tensor]) -> kiln::Result<Tensor> {
    nn::cross_entropy(&logits(i)?, &i[5], None)
}

/// Near-miss: the logits are also read for an accuracy.
fn loss_logits_read_twice(i: &[Tensor]) -> kiln::Result<Tensor> {
    let z = logits(i)?;
    let hits = z.argmax(-1)?.eq(&i[5])?.to_dtype(DType::F32)?.mean_all()?;
    nn::cross_entropy(&z, &i[5], None)?.add(&hits)
}

/// Near-miss: a bias on the logits.
fn loss_with_bias(i: &[Tensor]) -> kiln::Result<Tensor> {
    nn::cross_entropy(&logits(i)?.add(&i[4].sum(&[-1], false)?)?, &i[5], None)
}

/// Near-miss: a head laid out `[d, vocab]`, as a `Linear`'s weight is.
fn loss_linear_head(i: &[Tensor]) -> kiln::Result<Tensor> {
    let w = i[4].t()?.mul_scalar(1.0)?;
    nn::cross_entropy(&i[3].matmul(&w)?, &i[5], None)
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs() / f64::from(y.abs()).max(1.0))
        .fold(0.0, f64::max)
}

/// Runs `build` plainly, then again rewritten: the kinds found, the reasons
/// of the misses, and the largest difference.
fn run(build: Build, seed: u64) -> kiln::Result<(Vec<&'static str>, Vec<String>, f64)> {
    let i = inputs(&mut Rng::new(seed))?;
    let plain = build(&i)?.to_vec::<f32>()?;
    let out = build(&i)?;
    let fused = fuse_trace()?;
    let got = out.to_vec::<f32>()?;
    let kinds = fused.found.iter().map(|f| f.kind).collect();
    let missed = fused.missed.iter().map(|m| m.reason.clone()).collect();
    Ok((kinds, missed, max_rel(&got, &plain)))
}

#[test]
fn spellings_are_found_and_compute_the_same() -> kiln::Result<()> {
    let s = seed();
    let cases: [(&str, Build, &str); 7] = [
        ("layer_norm_centred", layer_norm_centred, "layer_norm"),
        ("layer_norm_moments", layer_norm_moments, "layer_norm"),
        ("rms_norm_llama", rms_norm_llama, "rms_norm"),
        ("rms_norm_divided", rms_norm_divided, "rms_norm"),
        ("loss_log_softmax", loss_log_softmax, "lm_head_cross_entropy"),
        ("loss_logsumexp_minus_picked", loss_logsumexp_minus_picked, "lm_head_cross_entropy"),
        ("loss_builtin_cross_entropy", loss_builtin_cross_entropy, "lm_head_cross_entropy"),
    ];
    for (name, build, kind) in cases {
        let (found, missed, err) = run(build, s)?;
        eprintln!("{name}: found {found:?}, missed {missed:?}, max relative difference {err:.2e}");
        assert_eq!(found, [kind], "{name} (seed {s})");
        assert!(err <= 1e-5, "{name}: the rewritten result differs by {err} (seed {s})");
    }
    Ok(())
}

#[test]
fn near_misses_stay_plain_with_their_reason() -> kiln::Result<()> {
    let cases: [(&str, Build, &str); 3] = [
        ("loss_logits_read_twice", loss_logits_read_twice, "also used outside the loss"),
        ("loss_with_bias", loss_with_bias, "a bias term"),
        ("loss_linear_head", loss_linear_head, "[d, vocab]"),
    ];
    for (name, build, reason) in cases {
        let (found, missed, err) = run(build, seed())?;
        assert!(found.is_empty(), "{name}: wrongly found {found:?}");
        assert!(missed.iter().any(|m| m.contains(reason)), "{name}: reasons {missed:?}");
        assert_eq!(err, 0.0, "{name}: the trace changed");
    }
    Ok(())
}

/// A classifier's cross-entropy over a few classes with a biased head (an
/// MLP's) is no LM head and no near miss worth a warning: nothing is found
/// and nothing reported.
#[test]
fn a_classifiers_biased_logits_are_no_near_miss() -> kiln::Result<()> {
    let mut rng = Rng::new(seed());
    let h = Tensor::from_vec(rng.normal_vec(ROWS * D), [ROWS, D])?;
    let w = Tensor::from_vec(rng.normal_vec(D * 10), [D, 10])?;
    let b = Tensor::from_vec(rng.normal_vec(10), [10])?;
    let labels = Tensor::from_vec((0..ROWS).map(|i| (i % 10) as i32).collect::<Vec<_>>(), [ROWS])?;
    let z = h.matmul(&w)?.add(&b)?;
    let logp = z.log_softmax(-1)?;
    let loss = logp.mul(&nn::one_hot(&labels, 10, DType::F32)?)?.sum(&[-1], false)?.neg()?.mean_all()?;
    let before = kiln::metrics::snapshot().composites_missed;
    kiln::grad(&loss, &[w, b])?;
    assert_eq!(kiln::metrics::snapshot().composites_missed, before);
    Ok(())
}
