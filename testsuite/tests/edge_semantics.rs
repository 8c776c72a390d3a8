//! Ops at their edges, on every backend (XLA CPU, eager, the reference
//! interpreter), against host computations: each case here once gave a
//! silent wrong answer, a hang or a disagreement between backends.

use kiln::{Backend, DType, FrontendError, Tensor};

mod common;
use common::Rng;

const BACKENDS: [Backend; 3] = [Backend::Pjrt, Backend::Eager, Backend::Reference];

/// Runs `f` on each backend, then puts the default back.
fn on_every_backend(mut f: impl FnMut(Backend) -> kiln::Result<()>) -> kiln::Result<()> {
    for b in BACKENDS {
        kiln::set_backend(b);
        let r = f(b);
        kiln::set_backend(Backend::Pjrt);
        r?;
    }
    Ok(())
}

/// GELU (exact, through erf) of fresh values with exact zeros among them:
/// the reference interpreter's erf spun forever on 0.
#[test]
fn gelu_of_zero_on_every_backend() -> kiln::Result<()> {
    let mut v = Rng::new(5).normal_vec(16);
    v[3] = 0.0;
    v[9] = -0.0;
    let want: Vec<f64> = v.iter().map(|&x| 0.5 * f64::from(x) * (1.0 + erf(f64::from(x) / 2f64.sqrt()))).collect();
    on_every_backend(|b| {
        let y = kiln::nn::gelu(&Tensor::from_vec(v.clone(), [16])?)?;
        kiln::mark_step()?;
        for (i, (g, w)) in y.to_vec::<f32>()?.iter().zip(&want).enumerate() {
            assert!((f64::from(*g) - w).abs() <= 1e-6 * (1.0 + w.abs()), "{b:?} gelu[{i}]: {g}, want {w}");
        }
        Ok(())
    })
}

/// erf by its Taylor series in f64 (to about 1e-13 for |x| < 4, where these
/// inputs lie).
fn erf(x: f64) -> f64 {
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    2.0 / std::f64::consts::PI.sqrt() * sum
}

/// Sums and means of 16-bit floats accumulate in f32 and round once: candle
/// summed bf16 in bf16 (4096 values in [1, 1.5) gave 512), and a mean summed
/// in f16 overflowed to inf past 65504 on every backend.
#[test]
fn half_precision_sums_and_means_accumulate_wide() -> kiln::Result<()> {
    let mut rng = Rng::new(11);
    let v = rng.uniform_vec(4096, 1.0, 1.5);
    let sum: f64 = v.iter().map(|&x| f64::from(x)).sum();
    let long = rng.uniform_vec(100_000, 0.5, 1.5);
    let mean: f64 = long.iter().map(|&x| f64::from(x)).sum::<f64>() / long.len() as f64;
    on_every_backend(|b| {
        for dt in [DType::F16, DType::BF16] {
            // One rounding of the sum to the dtype is at most 2^-8 (bf16)
            // relative; the inputs' own rounding moves the sum by less.
            let tol = if dt == DType::BF16 { 1.0 / 128.0 } else { 1.0 / 512.0 };
            let s = Tensor::from_vec(v.clone(), [4096])?.to_dtype(dt)?.sum_all()?.to_dtype(DType::F32)?;
            let m = Tensor::from_vec(long.clone(), [100_000])?.to_dtype(dt)?.mean_all()?;
            assert_eq!(m.dtype(), dt, "a mean keeps its dtype outside autocast");
            let m = m.to_dtype(DType::F32)?;
            kiln::mark_step()?;
            let (s, m) = (s.item()?, m.item()?);
            assert!((s - sum).abs() <= tol * sum, "{b:?} {dt} sum {s}, want {sum}");
            assert!((m - mean).abs() <= tol * mean, "{b:?} {dt} mean {m}, want {mean}");
        }
        Ok(())
    })
}

/// sign keeps NaN and -0 (candle's gave 0 and +0).
#[test]
fn sign_keeps_nan_and_negative_zero() -> kiln::Result<()> {
    let mut v = Rng::new(2).normal_vec(6);
    v[0] = f32::NAN;
    v[1] = -0.0;
    v[2] = 0.0;
    on_every_backend(|b| {
        let y = Tensor::from_vec(v.clone(), [6])?.sign()?;
        kiln::mark_step()?;
        let got = y.to_vec::<f32>()?;
        assert!(got[0].is_nan(), "{b:?} sign(NaN) = {}", got[0]);
        assert_eq!(got[1].to_bits(), (-0f32).to_bits(), "{b:?} sign(-0)");
        assert_eq!(got[2].to_bits(), 0f32.to_bits(), "{b:?} sign(0)");
        for (i, (&g, &x)) in got.iter().zip(&v).enumerate().skip(3) {
            assert_eq!(g, x.signum(), "{b:?} sign[{i}] of {x}");
        }
        Ok(())
    })
}

/// max and min over an empty axis are the reductions' identities (candle
/// failed on them).
#[test]
fn max_and_min_over_an_empty_axis_are_their_identities() -> kiln::Result<()> {
    on_every_backend(|b| {
        let x = Tensor::from_vec(Vec::<f32>::new(), [3, 0])?;
        let (hi, lo) = (x.max(&[1], false)?, x.min(&[1], false)?);
        kiln::mark_step()?;
        assert_eq!(hi.to_vec::<f32>()?, vec![f32::NEG_INFINITY; 3], "{b:?}");
        assert_eq!(lo.to_vec::<f32>()?, vec![f32::INFINITY; 3], "{b:?}");
        Ok(())
    })
}

/// Floats beyond i64's and u64's range saturate, NaN gives 0 (the reference
/// interpreter wrapped inf to i64::MIN, and to 0 for u64).
#[test]
fn float_to_64_bit_integers_saturates() -> kiln::Result<()> {
    let v = vec![f32::INFINITY, 1e20, f32::NEG_INFINITY, f32::NAN, -7.9, 3.5e18];
    on_every_backend(|b| {
        let x = Tensor::from_vec(v.clone(), [6])?;
        let (i, u) = (x.to_dtype(DType::I64)?, x.to_dtype(DType::U64)?);
        kiln::mark_step()?;
        assert_eq!(i.to_vec::<i64>()?, vec![i64::MAX, i64::MAX, i64::MIN, 0, -7, 3.5e18f32 as i64], "{b:?}");
        assert_eq!(u.to_vec::<u64>()?, vec![u64::MAX, u64::MAX, 0, 0, 0, 3.5e18f32 as u64], "{b:?}");
        Ok(())
    })
}

/// f32 to bf16 rounds once to nearest even, for data and for constants that
/// XLA folds (the interpreter and the constant folder went through a
/// conversion that dropped the low bits first and rounded down here).
#[test]
fn bf16_rounds_once_from_data_and_from_constants() -> kiln::Result<()> {
    let v = 1.0 + 2f32.powi(-8) + 2f32.powi(-23);
    on_every_backend(|b| {
        let data = Tensor::from_vec(vec![v, -v], [2])?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        let folded = Tensor::full(f64::from(v), DType::F32, [2])?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        kiln::mark_step()?;
        assert_eq!(data.to_vec::<f32>()?, vec![1.0078125, -1.0078125], "{b:?} data");
        assert_eq!(folded.to_vec::<f32>()?, vec![1.0078125; 2], "{b:?} constant");
        Ok(())
    })
}

/// index_add with an index outside the axis is an error after the step, as
/// index_select's is (XLA dropped the update silently).
#[test]
fn index_add_out_of_range_is_an_error() -> kiln::Result<()> {
    let mut rng = Rng::new(8);
    let base = Tensor::from_vec(rng.normal_vec(6), [6, 1])?;
    let upd = Tensor::from_vec(rng.normal_vec(3), [3, 1])?;
    on_every_backend(|b| {
        for (idx, want) in [(vec![7i32, 1, 2], 7i64), (vec![0, -1, 2], -1)] {
            let y = base.index_add(&Tensor::from_vec(idx, [3])?, &upd, 0)?;
            let err = kiln::mark_step().and_then(|_| y.to_vec::<f32>()).expect_err("out of range");
            assert!(
                matches!(err, FrontendError::IndexOutOfRange { op: "index_add", value, bound: 6, .. } if value == want),
                "{b:?}: {err:?}"
            );
        }
        // In range, it adds (duplicates accumulate).
        let y = base.index_add(&Tensor::from_vec(vec![5i32, 0, 5], [3])?, &upd, 0)?;
        kiln::mark_step()?;
        let (bv, uv) = (base.to_vec::<f32>()?, upd.to_vec::<f32>()?);
        let mut want = bv.clone();
        want[5] += uv[0] + uv[2];
        want[0] += uv[1];
        for (g, w) in y.to_vec::<f32>()?.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6, "{b:?}: {g}, want {w}");
        }
        Ok(())
    })
}

#[test]
fn sum_of_pred_and_flatten_past_the_rank_are_refused() -> kiln::Result<()> {
    let x = Tensor::from_vec(vec![1f32, -2.0, 3.0], [3])?;
    let p = x.gt(&Tensor::full(0.0, DType::F32, [])?)?;
    let e = p.sum_all().unwrap_err().to_string();
    assert!(e.starts_with("sum: tensor<3xi1> is pred, whose sum is a logical or: convert it first"), "{e}");
    let count = p.to_dtype(DType::I32)?.sum_all()?;
    kiln::mark_step()?;
    assert_eq!(count.item()?, 2.0);
    let t = Tensor::from_vec(vec![0f32; 24], [2, 3, 4])?;
    assert_eq!(t.flatten_from(1)?.dims(), &[2, 12]);
    let e = t.flatten_from(3).unwrap_err().to_string();
    assert_eq!(e, "flatten_from: start 3 is not a dimension of tensor<2x3x4xf32> (rank 3)");
    Ok(())
}

/// Integer division by a constant holding 0 (or MIN / -1 of constants) is
/// refused where it is recorded, on every backend and naming the op; XLA's
/// constant folder would die of SIGFPE on it, and the eager backend and the
/// interpreter used to compute -1 instead. A divisor that is data is not a
/// constant, and divides as it does on every backend.
#[test]
fn integer_division_by_a_constant_zero_is_refused_on_every_backend() -> kiln::Result<()> {
    on_every_backend(|b| {
        let three = Tensor::full(3.0, DType::I32, [4])?;
        let e = three.div(&Tensor::full(0.0, DType::I32, [4])?).unwrap_err().to_string();
        assert!(
            e.starts_with("div: integer division by a constant holding 0 on i32: XLA's constant folder"),
            "{b:?}: {e}"
        );
        let x = Tensor::from_vec(vec![7i32, -9, 4, 1], [4])?;
        let e = x.binary_scalar(kiln::compiler::ir::BinaryOp::Rem, 0.0).unwrap_err().to_string();
        assert!(e.starts_with("rem: integer division by a constant holding 0 on i32"), "{b:?}: {e}");
        let min = Tensor::full(f64::from(i32::MIN), DType::I32, [2])?;
        let e = min.div(&Tensor::full(-1.0, DType::I32, [2])?).unwrap_err().to_string();
        assert!(e.starts_with("div: -2147483648 / -1"), "{b:?}: {e}");
        // Data divisors are not constants.
        let y = x.div(&Tensor::from_vec(vec![2i32, 3, -4, 5], [4])?)?;
        kiln::mark_step()?;
        assert_eq!(y.to_vec::<i32>()?, vec![3, -3, -1, 0], "{b:?}");
        Ok(())
    })
}

/// Integers convert to f32 in one rounding to nearest even, and to bf16 from
/// that f32, as XLA's CPU plugin and the eager backend do. The reference
/// interpreter went through f64 and rounded twice: 2^60 + 2^36 + 1, just over
/// a tie of f32, fell onto the tie in f64 and then to even (2^60, not 2^60 +
/// 2^37); and, exact in f64, 2^30 + 2^22 + 1 rounded once to bf16 where XLA
/// rounds it to f32 first (2^30 + 2^23 against XLA's 2^30).
#[test]
fn integers_to_floats_round_as_xla_does() -> kiln::Result<()> {
    let (p22, p36, p52, p60) = (1i64 << 22, 1i64 << 36, 1i64 << 52, 1i64 << 60);
    let mut wide = vec![p60 + p36 + 1, -(p60 + p36 + 1), p60 + p52 + 1, p60 + p36, i64::MAX, i64::MIN + 1];
    let mut rng =
        Rng::new(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_secs()));
    wide.extend((0..26).map(|_| rng.next_u64() as i64 >> (rng.next_u64() % 40)));
    let narrow = vec![(1 << 30) + p22 as i32 + 1, (1 << 30) + p22 as i32, -(1 << 30) - 3 * p22 as i32 - 1, i32::MAX];
    // The host rounds an integer to f32 once, to nearest even.
    let want_f32: Vec<f32> = wide.iter().map(|&v| v as f32).collect();
    assert_eq!(want_f32[0], (p60 + 2 * p36) as f32);
    let want_bf16 = [2f32.powi(30), 2f32.powi(30), -(2f32.powi(30) + 2f32.powi(24)), 2f32.powi(31)];
    on_every_backend(|b| {
        let x = Tensor::from_vec(wide.clone(), [wide.len()])?.to_dtype(DType::F32)?;
        let y = Tensor::from_vec(narrow.clone(), [4])?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        kiln::mark_step()?;
        assert_eq!(x.to_vec::<f32>()?, want_f32, "{b:?}: i64 to f32");
        assert_eq!(y.to_vec::<f32>()?, want_bf16, "{b:?}: i32 to bf16");
        Ok(())
    })
}
