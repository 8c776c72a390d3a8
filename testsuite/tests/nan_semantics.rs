//! NaN through max and min, on every backend: StableHLO's `maximum` and
//! `minimum` propagate NaN, and so must the XLA CPU plugin (whose default
//! skipped it until kiln turned its fast min/max off), the eager backend
//! (candle's skip it) and the reference interpreter (whose clamp skipped it).
//! Fresh random inputs with NaNs at random places, against a host computation
//! in f64; values without a NaN compare exactly (max and min round nothing).

use kiln::{Backend, Tensor};

mod common;
use common::Rng;

const ROWS: usize = 24;
const COLS: usize = 7;

fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

/// Random normals with about one entry in six NaN.
fn with_nans(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut v = rng.normal_vec(n);
    for x in &mut v {
        if rng.next_u64() % 6 == 0 {
            *x = f32::NAN;
        }
    }
    v
}

fn same(what: &str, backend: Backend, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{backend:?} {what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() { g.is_nan() } else { f64::from(g) == w };
        assert!(ok, "{backend:?} {what}[{i}]: {g}, want {w}");
    }
}

#[test]
fn max_min_and_clamp_propagate_nan_on_every_backend() -> kiln::Result<()> {
    let mut rng = Rng::new(77);
    let (a, b) = (with_nans(&mut rng, ROWS * COLS), with_nans(&mut rng, ROWS * COLS));
    assert!(a.iter().any(|x| x.is_nan()) && b.iter().any(|x| x.is_nan()));
    let (a64, b64): (Vec<f64>, Vec<f64>) =
        (a.iter().map(|&x| x.into()).collect(), b.iter().map(|&x| x.into()).collect());
    let pairwise = |f: fn(f64, f64) -> f64| a64.iter().zip(&b64).map(|(&x, &y)| f(x, y)).collect::<Vec<_>>();
    let rows = |f: fn(f64, f64) -> f64, init: f64| {
        a64.chunks(COLS).map(|r| r.iter().fold(init, |m, &x| f(m, x))).collect::<Vec<_>>()
    };
    let want_maximum = pairwise(nan_max);
    let want_minimum = pairwise(nan_min);
    let want_max = rows(nan_max, f64::NEG_INFINITY);
    let want_min = rows(nan_min, f64::INFINITY);
    let want_clamp: Vec<f64> = a64.iter().map(|&x| nan_min(nan_max(x, -0.5), 0.5)).collect();
    let want_all = a64.iter().fold(f64::NEG_INFINITY, |m, &x| nan_max(m, x));
    assert!(want_max.iter().any(|x| x.is_nan()) && want_max.iter().any(|x| !x.is_nan()));

    for backend in [Backend::Pjrt, Backend::Eager, Backend::Reference] {
        kiln::set_backend(backend);
        let x = Tensor::from_vec(a.clone(), [ROWS, COLS])?;
        let y = Tensor::from_vec(b.clone(), [ROWS, COLS])?;
        let outs = [
            x.maximum(&y)?,
            x.minimum(&y)?,
            x.max(&[1], false)?,
            x.min(&[1], false)?,
            x.clamp(-0.5, 0.5)?,
            x.max(&[0, 1], false)?,
        ];
        kiln::mark_step()?;
        let got: Vec<Vec<f32>> = outs.iter().map(|t| t.to_vec::<f32>()).collect::<kiln::Result<_>>()?;
        same("maximum", backend, &got[0], &want_maximum);
        same("minimum", backend, &got[1], &want_minimum);
        same("max along rows", backend, &got[2], &want_max);
        same("min along rows", backend, &got[3], &want_min);
        same("clamp", backend, &got[4], &want_clamp);
        same("max of all", backend, &got[5], &[want_all]);
    }
    kiln::set_backend(Backend::Pjrt);
    Ok(())
}
