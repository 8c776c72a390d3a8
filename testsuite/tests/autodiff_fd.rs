//! Gradients from kiln's autodiff against central finite differences, in f64,
//! every function evaluated through XLA on the CPU plugin.
//!
//! Each check draws fresh inputs (the seed is printed), records
//! `loss = sum(f(x) * r)` with a fixed random `r` (so every output element
//! matters with a different weight), and compares `d loss / d x` with
//! `(loss(x + h e_i) - loss(x - h e_i)) / 2h`, `h = 1e-6`.
//! Tolerance: `|analytic - numeric| <= 1e-6 * max(1, |numeric|)`: central
//! differences err by O(h^2 f''') + O(eps / h), about 1e-10 here.

use kiln::{DType, Tensor};

mod common;
use common::Rng;

type F = dyn Fn(&[Tensor]) -> kiln::Result<Tensor>;

fn fresh_seed() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    t.as_nanos() as u64
}

/// Inputs in `[lo, hi)`, shaped by `shapes`.
fn check(name: &str, shapes: &[&[usize]], lo: f64, hi: f64, f: &F) {
    let seed = fresh_seed();
    let mut rng = Rng::new(seed);
    let xs: Vec<Vec<f64>> = shapes
        .iter()
        .map(|s| (0..s.iter().product::<usize>()).map(|_| lo + (hi - lo) * rng.uniform()).collect())
        .collect();
    let loss_at = |xs: &[Vec<f64>], want_grad: bool| -> (f64, Vec<Vec<f64>>) {
        let ts: Vec<Tensor> =
            xs.iter().zip(shapes).map(|(x, s)| Tensor::from_vec(x.clone(), s.to_vec()).unwrap()).collect();
        let y = f(&ts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut r = Rng::new(7);
        let weights: Vec<f64> = (0..y.elem_count()).map(|_| 0.5 + r.uniform()).collect();
        let w = Tensor::from_vec(weights, y.shape().clone()).unwrap();
        let loss = y.mul(&w).unwrap().sum_all().unwrap();
        let grads = if want_grad { kiln::grad(&loss, &ts).unwrap() } else { vec![] };
        kiln::mark_step().unwrap();
        (loss.item().unwrap(), grads.iter().map(|g| g.to_vec::<f64>().unwrap()).collect())
    };
    let (_, analytic) = loss_at(&xs, true);
    let h = 1e-6;
    for (k, x) in xs.iter().enumerate() {
        for i in 0..x.len() {
            let mut plus = xs.clone();
            plus[k][i] += h;
            let mut minus = xs.clone();
            minus[k][i] -= h;
            let numeric = (loss_at(&plus, false).0 - loss_at(&minus, false).0) / (2.0 * h);
            let a = analytic[k][i];
            assert!(
                (a - numeric).abs() <= 1e-6 * numeric.abs().max(1.0),
                "{name} (seed {seed}): input {k} element {i}: analytic {a} vs numeric {numeric}"
            );
        }
    }
}

#[test]
fn unary_ops() {
    use kiln::compiler::ir::UnaryOp::*;
    for (op, lo, hi) in [
        (Neg, -2.0, 2.0),
        (Abs, 0.1, 2.0),
        (Exp, -2.0, 2.0),
        (Log, 0.2, 3.0),
        (Log1p, -0.5, 2.0),
        (Expm1, -2.0, 2.0),
        (Tanh, -2.0, 2.0),
        (Logistic, -3.0, 3.0),
        (Sqrt, 0.2, 3.0),
        (Rsqrt, 0.2, 3.0),
        (Sin, -3.0, 3.0),
        (Cos, -3.0, 3.0),
        (Erf, -2.0, 2.0),
    ] {
        check(op.name(), &[&[2, 3]], lo, hi, &move |x| x[0].unary(op));
    }
}

#[test]
fn binary_ops_with_broadcasting() {
    use kiln::compiler::ir::BinaryOp::*;
    for (op, lo, hi) in [
        (Add, -2.0, 2.0),
        (Sub, -2.0, 2.0),
        (Mul, -2.0, 2.0),
        (Div, 0.5, 2.0),
        (Pow, 0.5, 2.0),
        (Max, -2.0, 2.0),
        (Min, -2.0, 2.0),
        (Rem, 0.3, 2.0),
    ] {
        check(op.name(), &[&[2, 3], &[3]], lo, hi, &move |x| x[0].binary(op, &x[1]));
    }
}

#[test]
fn select_clamp_and_convert() {
    check("where", &[&[2, 3], &[2, 3]], -1.0, 1.0, &|x| {
        let c = x[0].gt(&Tensor::full(0.0, DType::F64, [])?)?;
        Tensor::where_cond(&c, &x[0].mul(&x[1])?, &x[1].exp()?)
    });
    check("clamp", &[&[7]], -2.0, 2.0, &|x| x[0].clamp(-0.7, 0.9));
}

#[test]
fn shape_ops() {
    check("reshape+transpose", &[&[2, 3, 4]], -1.0, 1.0, &|x| x[0].reshape([6, 4])?.t()?.tanh());
    check("permute", &[&[2, 3, 4]], -1.0, 1.0, &|x| x[0].permute(vec![2, 0, 1])?.sin());
    check("broadcast", &[&[3, 1]], -1.0, 1.0, &|x| x[0].broadcast_to([2, 3, 4]));
    check("strided slice", &[&[5, 6]], -1.0, 1.0, &|x| x[0].slice(vec![1, 0], vec![5, 5], vec![2, 2]));
    check("narrow+cat", &[&[3, 4], &[3, 2]], -1.0, 1.0, &|x| Tensor::cat(&[x[0].narrow(1, 1, 2)?, x[1].exp()?], 1));
    check("pad (crop and grow)", &[&[3, 4]], -1.0, 1.0, &|x| x[0].pad(0.5, vec![1, -1], vec![-1, 2]));
    check("dynamic_slice", &[&[4, 5]], -1.0, 1.0, &|x| {
        let s = [Tensor::scalar(1i32), Tensor::scalar(2i32)];
        x[0].dynamic_slice(&s, vec![2, 3])
    });
    check("dynamic_update_slice", &[&[4, 5], &[2, 2]], -1.0, 1.0, &|x| {
        let s = [Tensor::scalar(1i32), Tensor::scalar(3i32)];
        x[0].dynamic_update_slice(&x[1].tanh()?, &s)
    });
}

#[test]
fn reductions() {
    check("sum", &[&[2, 3, 4]], -1.0, 1.0, &|x| x[0].sum(&[0, 2], false));
    check("max", &[&[3, 4]], -1.0, 1.0, &|x| x[0].max(&[1], false));
    check("min", &[&[3, 4]], -1.0, 1.0, &|x| x[0].min(&[0, 1], false));
    check("prod", &[&[3, 4]], 0.5, 1.5, &|x| x[0].reduce(kiln::compiler::ir::ReduceOp::Prod, &[1], false));
    check("softmax", &[&[3, 5]], -2.0, 2.0, &|x| x[0].softmax(-1));
    check("log_softmax", &[&[3, 5]], -2.0, 2.0, &|x| x[0].log_softmax(-1));
}

#[test]
fn products() {
    check("matmul", &[&[3, 4], &[4, 2]], -1.0, 1.0, &|x| x[0].matmul(&x[1]));
    check("batched matmul, broadcast batch", &[&[2, 3, 4], &[4, 5]], -1.0, 1.0, &|x| x[0].matmul(&x[1]));
    check("batched matmul", &[&[2, 3, 4], &[2, 4, 5]], -1.0, 1.0, &|x| x[0].matmul(&x[1]));
    // Batch dim 1 of lhs with 2 of rhs, two contracting dims in swapped order.
    check("dot_general", &[&[3, 2, 4, 5], &[5, 6, 2, 4]], -1.0, 1.0, &|x| {
        let dims = kiln::compiler::ir::DotDims {
            lhs_batch: vec![1],
            rhs_batch: vec![2],
            lhs_contract: vec![3, 2],
            rhs_contract: vec![0, 3],
        };
        x[0].dot_general(&x[1], dims)
    });
}

#[test]
fn gather_and_scatter_add_with_repeated_indices() {
    check("gather", &[&[5, 3]], -1.0, 1.0, &|x| {
        let idx = Tensor::from_vec(vec![4i32, 0, 4, 2], [2, 2])?;
        x[0].index_select(&idx, 0)
    });
    check("scatter_add", &[&[5, 3], &[4, 3]], -1.0, 1.0, &|x| {
        let idx = Tensor::from_vec(vec![1i32, 3, 1, 0], [4])?;
        x[0].index_add(&idx, &x[1], 0)
    });
}

#[test]
fn mlp_with_cross_entropy_and_layer_norm() {
    check("mlp", &[&[4, 6], &[6, 5], &[5], &[5, 3]], -1.0, 1.0, &|x| {
        let h = x[0].matmul(&x[1])?.add(&x[2])?;
        let ln = {
            let mean = h.mean(&[-1], true)?;
            let c = h.sub(&mean)?;
            c.mul(&c.square()?.mean(&[-1], true)?.add_scalar(1e-5)?.rsqrt()?)?
        };
        let logits = kiln::nn::gelu_tanh(&ln)?.matmul(&x[3])?;
        let labels = Tensor::from_vec(vec![2i32, 0, 1, 2], [4])?;
        let logp = logits.log_softmax(-1)?;
        let onehot = kiln::nn::one_hot(&labels, 3, DType::F64)?;
        logp.mul(&onehot)?.sum_all()?.neg()
    });
}

#[test]
fn unused_inputs_get_zeros_and_bad_losses_are_errors() -> anyhow::Result<()> {
    let a = Tensor::from_vec(vec![1.0f64, 2.0], [2])?;
    let b = Tensor::from_vec(vec![3.0f64, 4.0], [2])?;
    let loss = a.exp()?.sum_all()?;
    let g = kiln::grad(&loss, &[a.clone(), b.clone()])?;
    kiln::mark_step()?;
    assert_eq!(g[1].to_vec::<f64>()?, vec![0.0, 0.0]);
    let err = kiln::grad(&a.exp()?, std::slice::from_ref(&a)).unwrap_err();
    assert!(matches!(err, kiln::FrontendError::LossNotScalar { .. }), "{err}");
    Ok(())
}

#[test]
fn no_backward_ops_for_branches_that_do_not_reach_wrt() -> anyhow::Result<()> {
    use kiln::compiler::ir::{DType as D, Graph, Op, TensorType, UnaryOp};
    let mut g = Graph::new();
    let x = g.parameter(TensorType::new(D::F32, [3]));
    let y = g.parameter(TensorType::new(D::F32, [3]));
    let ex = g.value(Op::Unary { op: UnaryOp::Exp, input: x })?;
    let ey = g.value(Op::Unary { op: UnaryOp::Tanh, input: y })?;
    let s = g.value(Op::Binary { op: kiln::compiler::ir::BinaryOp::Add, lhs: ex, rhs: ey })?;
    let loss = g.value(Op::Reduce { op: kiln::compiler::ir::ReduceOp::Sum, input: s, axes: vec![0] })?;
    let before = g.len();
    let info = kiln::autodiff::grad_with_info(&mut g, loss, &[x])?;
    // Backward: the seed, broadcast of the seed (reduce), exp' (mul by exp x).
    // Nothing for tanh(y).
    let added: Vec<&str> = g.nodes().skip(before).map(|(_, n)| n.op.name()).collect();
    assert!(!added.contains(&"tanh") && !added.contains(&"sub"), "{added:?}");
    assert_eq!(info.saved, vec![ex], "the backward of exp reads exp(x)");
    Ok(())
}

#[test]
fn barrier_and_single_replica_all_reduce() {
    check("optimization_barrier", &[&[2, 3], &[3]], -1.0, 1.0, &|x| {
        let b = Tensor::optimization_barrier(&[x[0].tanh()?, x[1].exp()?])?;
        b[0].add(&b[1])
    });
    // One replica: all_reduce is the identity and so is its derivative.
    check("all_reduce", &[&[4]], -1.0, 1.0, &|x| x[0].sin()?.all_reduce(kiln::compiler::ir::ReduceOp::Sum));
}

#[test]
fn convert_passes_the_cotangent_back_in_the_input_dtype() -> anyhow::Result<()> {
    // d/dx sum(f32(x) * r) = r, delivered as f64 (an f32 round trip is too
    // coarse for finite differences at h = 1e-6, so this checks the value).
    let x = Tensor::from_vec(vec![0.25f64, -1.5, 2.0], [3])?;
    let r = Tensor::from_vec(vec![3.0f32, -0.5, 0.125], [3])?;
    let loss = x.to_dtype(DType::F32)?.mul(&r)?.sum_all()?;
    let g = kiln::grad(&loss, std::slice::from_ref(&x))?;
    kiln::mark_step()?;
    assert_eq!(g[0].dtype(), DType::F64);
    assert_eq!(g[0].to_vec::<f64>()?, vec![3.0, -0.5, 0.125]);
    Ok(())
}

/// `without_grad` (what `log_softmax` shifts by) keeps every value, infinities
/// included, and no gradient flows through it: `d/dx sum(x̄ · x) = x̄ = x`,
/// not `2x`.
#[test]
fn without_grad_keeps_the_values_and_cuts_the_gradient() -> anyhow::Result<()> {
    let seed = fresh_seed();
    let mut rng = Rng::new(seed);
    let mut xs: Vec<f64> = (0..6).map(|_| rng.normal()).collect();
    xs.extend([f64::INFINITY, f64::NEG_INFINITY]);
    let x = Tensor::from_vec(xs.clone(), [2, 4])?;
    let d = x.without_grad()?;
    let loss = d.mul(&x)?.sum_all()?;
    let g = kiln::grad(&loss, std::slice::from_ref(&x))?;
    kiln::mark_step()?;
    assert_eq!(d.to_vec::<f64>()?, xs, "values (seed {seed})");
    assert_eq!(g[0].to_vec::<f64>()?, xs, "gradient (seed {seed})");
    Ok(())
}
