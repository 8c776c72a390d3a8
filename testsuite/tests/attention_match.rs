//! The attention matcher on attentions written with plain tensor ops: four
//! spellings are found (with the right scale and mask), two near-misses that
//! would change numerics are not. Each found attention must also compute what
//! the plain ops computed: the same forward run before and after the rewrite
//! (XLA CPU plugin, fresh random inputs; tolerance relative to max(1, |x|):
//! f32 1e-5, bf16 2e-2), and `grad` through it matches `grad` through the
//! module's composite within the same tolerances.

use kiln::autodiff::{fuse_trace, trace_composites};
use kiln::compiler::ir::{DType, Op, Shape};
use kiln::nn::{self, CausalSelfAttention, ParamStore};
use kiln::{amp, Tensor};

mod common;
use common::Rng;

type Build = fn(&Tensor, &Tensor, &Tensor) -> kiln::Result<Tensor>;

const B: usize = 2;
const H: usize = 3;
const T: usize = 8;
const D: usize = 16;

fn seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(3, |d| d.as_nanos() as u64)
}

fn qkv(rng: &mut Rng) -> kiln::Result<[Tensor; 3]> {
    Ok([0; 3].map(|_| Tensor::from_vec(rng.normal_vec(B * H * T * D), [B, H, T, D])).map(|t| t.unwrap()))
}

fn causal_keep(t: usize) -> kiln::Result<Tensor> {
    Tensor::iota(DType::I32, [t, t], 1)?.le(&Tensor::iota(DType::I32, [t, t], 0)?)
}

/// The body `nn::CausalSelfAttention` had before it called the composite:
/// scale on the scores, f32 upcast under autocast, causal mask by select
/// against f32's lowest, `softmax`.
fn builtin_as_written(q: &Tensor, k: &Tensor, v: &Tensor) -> kiln::Result<Tensor> {
    let att = q.matmul(&k.transpose(-2, -1)?)?.mul_scalar(1.0 / (D as f64).sqrt())?;
    let att = amp::full_precision(&att)?;
    let neg = Tensor::full(f64::from(f32::MIN), att.dtype(), Shape::scalar())?;
    let att = Tensor::where_cond(&causal_keep(T)?, &att, &neg)?.softmax(-1)?;
    att.matmul(v)
}

/// Scale on q, causal mask as an additive bias of 0 / -1e9 built in the graph.
/// (A bias uploaded from the host is a program input, whose values the
/// compiler cannot check, so it is never taken for a causal mask.)
fn scale_on_q_additive_mask(q: &Tensor, k: &Tensor, v: &Tensor) -> kiln::Result<Tensor> {
    let zero = Tensor::zeros(DType::F32, [T, T])?;
    let bias = Tensor::where_cond(&causal_keep(T)?, &zero, &Tensor::full(-1e9, DType::F32, [T, T])?)?;
    let s = q.mul_scalar(0.25)?.matmul(&k.t()?)?.add(&bias)?;
    s.softmax(-1)?.matmul(v)
}

/// Scale as a division after the mask, the mask with the masked value on the
/// true branch, softmax written out without the max subtraction.
fn divided_manual_softmax(q: &Tensor, k: &Tensor, v: &Tensor) -> kiln::Result<Tensor> {
    let s = q.matmul(&k.transpose(2, 3)?)?;
    let future = Tensor::iota(DType::I32, [T, T], 1)?.gt(&Tensor::iota(DType::I32, [T, T], 0)?)?;
    let masked = Tensor::where_cond(&future, &Tensor::full(f64::NEG_INFINITY, DType::F32, Shape::scalar())?, &s)?;
    let e = masked.div(&Tensor::full(4.0, DType::F32, Shape::scalar())?)?.exp()?;
    e.div(&e.sum(&[-1], true)?)?.matmul(v)
}

/// No mask, kᵀ folded into the dot's dimensions, bf16 operands with the scores
/// upcast to f32 by hand and the probabilities cast back.
fn unmasked_bf16_dot_general(q: &Tensor, k: &Tensor, v: &Tensor) -> kiln::Result<Tensor> {
    let (q, k, v) = (q.to_dtype(DType::BF16)?, k.to_dtype(DType::BF16)?, v.to_dtype(DType::BF16)?);
    let dims = kiln::compiler::ir::DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![3],
        rhs_contract: vec![3],
    };
    let s = q.dot_general(&k, dims)?.to_dtype(DType::F32)?.mul_scalar(0.3)?;
    s.softmax(-1)?.to_dtype(DType::BF16)?.matmul(&v)?.to_dtype(DType::F32)
}

/// The mask's comparison flipped (keys after the query are kept): not causal,
/// but a mask the composite takes as an operand, computing the same.
fn mask_on_the_wrong_side(q: &Tensor, k: &Tensor, v: &Tensor) -> kiln::Result<Tensor> {
    let keep = Tensor::iota(DType::I32, [T, T], 0)?.le(&Tensor::iota(DType::I32, [T, T], 1)?)?;
    let s = q.matmul(&k.t()?)?.mul_scalar(0.25)?;
    let neg = Tensor::full(-1e30, DType::F32, Shape::scalar())?;
    Tensor::where_cond(&keep, &s, &neg)?.softmax(-1)?.matmul(v)
}

/// Near-miss: softmax over the query axis.
fn softmax_over_queries(q: &Tensor, k: &Tensor, v: &Tensor) -> kiln::Result<Tensor> {
    let s = q.matmul(&k.t()?)?.mul_scalar(0.25)?;
    let neg = Tensor::full(-1e30, DType::F32, Shape::scalar())?;
    Tensor::where_cond(&causal_keep(T)?, &s, &neg)?.softmax(-2)?.matmul(v)
}

/// Near-miss: dropout on the probabilities (cuDNN's dropout cannot draw
/// kiln's bits).
fn dropout_on_probabilities(q: &Tensor, k: &Tensor, v: &Tensor) -> kiln::Result<Tensor> {
    let p = q.matmul(&k.t()?)?.mul_scalar(0.25)?.softmax(-1)?;
    let keep = Tensor::iota(DType::I32, p.dims().to_vec(), 3)?.ne(&Tensor::full(2.0, DType::I32, [])?)?;
    Tensor::where_cond(&keep, &p.mul_scalar(1.25)?, &Tensor::zeros(DType::F32, [])?)?.matmul(v)
}

/// Near-miss: a bias inside the scale, `(q kᵀ + b) · 0.25`.
fn bias_inside_the_scale(q: &Tensor, k: &Tensor, v: &Tensor) -> kiln::Result<Tensor> {
    let b = Tensor::iota(DType::F32, [1, H, T, T], 1)?.mul(&k.sum_all()?)?;
    q.matmul(&k.t()?)?.add(&b)?.mul_scalar(0.25)?.softmax(-1)?.matmul(v)
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs() / f64::from(y.abs()).max(1.0))
        .fold(0.0, f64::max)
}

/// Runs `build` plainly, then again with the rewrite applied; returns the
/// found composites' (scale, causal) and the largest difference.
fn run(build: Build, autocast: bool, seed: u64) -> kiln::Result<(Vec<(f64, bool)>, f64)> {
    let [q, k, v] = qkv(&mut Rng::new(seed))?;
    // Under autocast the operands arrive in bf16, as the module's do (the
    // matcher does not look through a convert placed after `kᵀ`).
    let dtype = if autocast { DType::BF16 } else { DType::F32 };
    let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
    let record = || amp::autocast_if(autocast.then_some(DType::BF16), || build(&q, &k, &v));
    let plain = record()?.to_dtype(DType::F32)?.to_vec::<f32>()?;
    let out = record()?.to_dtype(DType::F32)?;
    let found = fuse_trace()?.found;
    let fused = out.to_vec::<f32>()?;
    let attrs = found
        .iter()
        .map(|f| match f.op {
            Op::Attention { attrs, .. } => (attrs.scale(), attrs.causal),
            ref other => panic!("unexpected composite {}", other.name()),
        })
        .collect();
    Ok((attrs, max_rel(&fused, &plain)))
}

#[test]
fn six_spellings_are_found_and_compute_the_same() -> kiln::Result<()> {
    let s = seed();
    let cases: [(&str, Build, bool, f64, bool, f64); 6] = [
        ("builtin_as_written f32", builtin_as_written, false, 0.25, true, 1e-5),
        ("builtin_as_written autocast bf16", builtin_as_written, true, 0.25, true, 2e-2),
        ("scale_on_q_additive_mask", scale_on_q_additive_mask, false, 0.25, true, 1e-5),
        ("divided_manual_softmax", divided_manual_softmax, false, 0.25, true, 1e-5),
        ("unmasked_bf16_dot_general", unmasked_bf16_dot_general, false, 0.3, false, 2e-2),
        ("mask_on_the_wrong_side", mask_on_the_wrong_side, false, 0.25, false, 1e-5),
    ];
    for (name, build, autocast, scale, causal, tol) in cases {
        let (found, err) = run(build, autocast, s)?;
        assert_eq!(found.len(), 1, "{name}: found {found:?} (seed {s})");
        assert!((found[0].0 - scale).abs() < 1e-6 && found[0].1 == causal, "{name}: {found:?}");
        eprintln!("{name}: found, max relative difference {err:.2e}");
        assert!(err <= tol, "{name}: rewritten result differs by {err} > {tol} (seed {s})");
    }
    Ok(())
}

#[test]
fn near_misses_are_not_found() -> kiln::Result<()> {
    for (name, build) in [
        ("softmax_over_queries", softmax_over_queries as Build),
        ("dropout_on_probabilities", dropout_on_probabilities),
        ("bias_inside_the_scale", bias_inside_the_scale),
    ] {
        let (found, err) = run(build, false, seed())?;
        assert!(found.is_empty(), "{name}: wrongly found {found:?}");
        assert_eq!(err, 0.0, "{name}: the trace changed");
    }
    Ok(())
}

/// The module records the composite itself; its gradients equal those of the
/// plain spelling it replaced (which `grad` rewrites into the same composite).
#[test]
fn module_records_the_composite_and_its_gradients_match_the_plain_spelling() -> kiln::Result<()> {
    let s = seed();
    let mut ps = ParamStore::new(s);
    let attn = CausalSelfAttention::new(&mut ps, "attn", H * D, H, 0.2, 0.2)?;
    let x = Tensor::from_vec(Rng::new(s).normal_vec(B * T * H * D), [B, T, H * D])?;
    let y = attn.forward(&x)?;
    assert_eq!(trace_composites().iter().filter(|o| matches!(o, Op::Attention { .. })).count(), 1);
    let loss = y.square()?.sum_all()?;
    let _ = loss.to_vec::<f32>()?;

    let [q, k, v] = qkv(&mut Rng::new(s ^ 1))?;
    let w = Tensor::from_vec(Rng::new(s ^ 2).normal_vec(B * H * T * D), [B, H, T, D])?;
    let composite = nn::scaled_dot_product_attention(&q, &k, &v, true)?.mul(&w)?.sum_all()?;
    let g1 = kiln::grad(&composite, &[q.clone(), k.clone(), v.clone()])?;
    let plain = builtin_as_written(&q, &k, &v)?.mul(&w)?.sum_all()?;
    let g2 = kiln::grad(&plain, &[q.clone(), k.clone(), v.clone()])?;
    assert!(trace_composites().iter().filter(|o| matches!(o, Op::AttentionGrad { .. })).count() == 2);
    for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
        let err = max_rel(&a.to_vec::<f32>()?, &b.to_vec::<f32>()?);
        eprintln!("d{}: max relative difference {err:.2e}", ["q", "k", "v"][i]);
        assert!(err <= 1e-5, "gradient {i} differs by {err} (seed {s})");
    }
    Ok(())
}
