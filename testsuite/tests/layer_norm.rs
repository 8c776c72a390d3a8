//! The layer-norm and RMS-norm composites: each op on the reference
//! interpreter (written from its definition) against its plain expansion, on
//! the interpreter and through the XLA CPU plugin, forward and backward, on
//! fresh random inputs; and the interpreter's gradients against finite
//! differences of the f64 definition.
//!
//! Tolerances relative to max(1, |reference|): f64 1e-10; f32 1e-5 against the
//! interpreter (XLA's rsqrt is an approximation); bf16 3e-2 (8 significant bits,
//! the expansion rounds y once, dx after a subtraction of row means).

use kiln::compiler::composite;
use kiln::compiler::ir::{DType, Graph, Literal, Op, TensorType, ValueId};
use kiln::compiler::{interpret, lower, LowerOptions, LowerTarget};
use kiln::runtime::{Client, ClientOptions, CompileOptions, ExecArg};

mod common;
use common::Rng;

fn seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(5, |d| d.as_nanos() as u64)
}

/// Parameters x `[rows.., d]`, gamma, beta `[d]`, dy; outputs y, mean, rstd,
/// dx, dgamma, dbeta. With `rms`, the RMS norm: parameters x, gamma, beta
/// (unread), dy; outputs y, rstd, dx, dgamma.
fn graph(dtype: DType, dims: &[usize], eps: f64, rms: bool) -> Graph {
    let mut g = Graph::new();
    let d = *dims.last().unwrap();
    let x = g.parameter(TensorType::new(dtype, dims.to_vec()));
    let gamma = g.parameter(TensorType::new(dtype, vec![d]));
    let beta = g.parameter(TensorType::new(dtype, vec![d]));
    let dy = g.parameter(TensorType::new(dtype, dims.to_vec()));
    if rms {
        let n = g.add(Op::RmsNorm { x, gamma, eps_bits: eps.to_bits() }).unwrap();
        let gr = g.add(Op::RmsNormGrad { x, gamma, rstd: ValueId::new(n, 1), dy }).unwrap();
        g.set_outputs(vec![ValueId::new(n, 0), ValueId::new(n, 1), ValueId::new(gr, 0), ValueId::new(gr, 1)]).unwrap();
        return g;
    }
    let ln = g.add(Op::LayerNorm { x, gamma, beta, eps_bits: eps.to_bits() }).unwrap();
    let (mean, rstd) = (ValueId::new(ln, 1), ValueId::new(ln, 2));
    let gr = g.add(Op::LayerNormGrad { x, gamma, mean, rstd, dy }).unwrap();
    let mut outs: Vec<ValueId> = (0..3).map(|k| ValueId::new(ln, k)).collect();
    outs.extend((0..3).map(|k| ValueId::new(gr, k)));
    g.set_outputs(outs).unwrap();
    g
}

fn inputs(g: &Graph, rng: &mut Rng) -> Vec<Literal> {
    g.param_types()
        .iter()
        .map(|t| {
            let v: Vec<f64> = (0..t.shape.num_elements()).map(|_| 0.5 + 2.0 * rng.normal()).collect();
            Literal::from_f64s(t.dtype, t.shape.clone(), &v).unwrap()
        })
        .collect()
}

fn check(what: &str, got: &[Literal], want: &[Literal], tol: f64, seed: u64) {
    let names: &[&str] =
        if got.len() == 4 { &["y", "rstd", "dx", "dgamma"] } else { &["y", "mean", "rstd", "dx", "dgamma", "dbeta"] };
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a.ty(), b.ty(), "{what} {}", names[i]);
        let e = a.to_f64s().iter().zip(b.to_f64s()).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f64::max);
        eprintln!("{what}: {} max relative error {e:.2e}", names[i]);
        assert!(e <= tol, "{what}: {} differs by {e} > {tol} (seed {seed})", names[i]);
    }
}

#[test]
fn composite_matches_its_expansion_and_xla() {
    let s = seed();
    let mut rng = Rng::new(s);
    let c = Client::new(&ClientOptions::default()).unwrap();
    // dgamma sums over every row, so its error grows with the row count; on CUDA
    // (PJRT_DEVICE=CUDA) reductions also reorder.
    let f32_tol = if c.platform_name() == "cpu" { 1e-5 } else { 1e-4 };
    for (dims, eps, rms) in [
        (vec![3, 5, 8], 1e-5, false),
        (vec![7, 33], 1e-3, false),
        (vec![16], 1e-6, false),
        (vec![3, 5, 8], 1e-6, true),
        (vec![7, 33], 1e-3, true),
    ] {
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let g = graph(dtype, &dims, eps, rms);
            let x = inputs(&g, &mut rng);
            let want = interpret(&g, &x).unwrap();
            let plain = composite::expand(&g, LowerTarget::Cpu).unwrap();
            assert!(plain.nodes().all(|(_, n)| !composite::is_composite(&n.op)));
            let tol = match dtype {
                DType::F64 => 1e-10,
                DType::F32 => f32_tol,
                _ => 3e-2,
            };
            check(
                &format!("interp expansion {dtype} {dims:?} rms={rms}"),
                &interpret(&plain, &x).unwrap(),
                &want,
                tol,
                s,
            );
            if dtype == DType::F64 {
                continue;
            }
            let text = lower(&g, &LowerOptions::default()).unwrap();
            let exe = c.compile(&text, &CompileOptions::default()).unwrap();
            let dev = &c.devices()[0];
            let bufs: Vec<_> = x
                .iter()
                .map(|l| {
                    c.buffer_from_bytes(l.bytes(), kiln::element_type(l.ty().dtype), l.ty().shape.dims(), dev).unwrap()
                })
                .collect();
            let args: Vec<ExecArg> = bufs.iter().map(ExecArg::Borrowed).collect();
            let got: Vec<Literal> = exe
                .execute(&args)
                .unwrap()
                .iter()
                .zip(g.output_types())
                .map(|(b, ty)| Literal::from_bytes(ty, b.to_host_bytes().unwrap()).unwrap())
                .collect();
            check(&format!("xla {dtype} {dims:?} rms={rms}"), &got, &want, tol, s);
        }
    }
}

/// The interpreter's backward against central differences of the forward, in f64.
#[test]
fn backward_matches_finite_differences() {
    let s = seed();
    let mut rng = Rng::new(s);
    for rms in [false, true] {
        let g = graph(DType::F64, &[3, 6], 1e-5, rms);
        let x = inputs(&g, &mut rng);
        let out = interpret(&g, &x).unwrap();
        // loss = Σ y · dy, so d loss / d x = dx, / d gamma = dgamma, / d beta = dbeta.
        let loss = |inp: &[Literal]| -> f64 {
            let o = interpret(&g, inp).unwrap();
            o[0].to_f64s().iter().zip(inp[3].to_f64s()).map(|(a, b)| a * b).sum()
        };
        let pairs: &[(usize, usize)] = if rms { &[(0, 2), (1, 3)] } else { &[(0, 3), (1, 4), (2, 5)] };
        for &(param, grad) in pairs {
            let analytic = out[grad].to_f64s();
            let base = x[param].to_f64s();
            for i in 0..base.len() {
                let h = 1e-6;
                let mut plus = x.clone();
                let mut minus = x.clone();
                let (mut p, mut m) = (base.clone(), base.clone());
                p[i] += h;
                m[i] -= h;
                plus[param] = Literal::from_f64s(DType::F64, x[param].ty().shape.clone(), &p).unwrap();
                minus[param] = Literal::from_f64s(DType::F64, x[param].ty().shape.clone(), &m).unwrap();
                let fd = (loss(&plus) - loss(&minus)) / (2.0 * h);
                assert!(
                    (fd - analytic[i]).abs() <= 1e-5 * fd.abs().max(1.0),
                    "rms={rms} param {param}[{i}]: fd {fd} vs {} (seed {s})",
                    analytic[i]
                );
            }
        }
    }
}
