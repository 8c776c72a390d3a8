//! Mixed precision end to end on the CPU plugin: the autocast policy as it
//! lowers, dynamic loss scaling (skip, backoff, growth) inside the step,
//! global-norm clipping against an f64 reference, the ordered
//! [`TrainStep`] against the plain optimizer step, and on two replicas.

use kiln::amp::{self, LossScalerConfig};
use kiln::clip;
use kiln::data::{FashionMnist, FASHION_MNIST_DIR};
use kiln::models::gpt::{self, GptConfig};
use kiln::models::mlp::{self, MlpConfig, Trainer};
use kiln::nn::{self, Linear, ParamStore};
use kiln::optim::{AdamW, AdamWConfig, Optimizer, Sgd};
use kiln::train_step::{TrainStep, TrainStepOptions};
use kiln::{DType, FrontendError, Tensor};

mod common;
use common::Rng;

/// Two linear layers with a ReLU between: 6 -> 8 -> 3 classes.
struct Net {
    ps: ParamStore,
    l1: Linear,
    l2: Linear,
}

impl Net {
    fn new(seed: u64) -> kiln::Result<Net> {
        let mut ps = ParamStore::new(seed);
        let l1 = Linear::new(&mut ps, "l1", 6, 8, true)?;
        let l2 = Linear::new(&mut ps, "l2", 8, 3, true)?;
        Ok(Net { ps, l1, l2 })
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> kiln::Result<Tensor> {
        nn::cross_entropy(&self.l2.forward(&self.l1.forward(x)?.relu()?)?, y, None)
    }
}

/// A fresh batch of 5 examples.
fn batch(rng: &mut Rng) -> kiln::Result<(Tensor, Tensor)> {
    let x = Tensor::from_vec(rng.normal_vec(30), [5, 6])?;
    let y: Vec<i32> = (0..5).map(|_| (rng.next_u64() % 3) as i32).collect();
    Ok((x, Tensor::from_vec(y, [5])?))
}

fn bytes(ts: &[Tensor]) -> kiln::Result<Vec<Vec<u8>>> {
    ts.iter().map(|t| Ok(t.to_literal()?.bytes().to_vec())).collect()
}

fn state_of<O: Optimizer>(net: &Net, opt: &O) -> Vec<Tensor> {
    net.ps.tensors().into_iter().chain(opt.state().into_iter().map(|(_, t)| t)).collect()
}

/// Runs clean, inf, nan, clean steps under f16 autocast with a scaler and
/// checks what each leaves behind.
fn skips_non_finite_steps<O: Optimizer>(make: impl Fn(&[Tensor]) -> kiln::Result<O>, seed: u64) -> anyhow::Result<()> {
    let net = Net::new(seed)?;
    let mut opt = make(&net.ps.tensors())?;
    let init = 1024.0;
    let cfg = LossScalerConfig { init_scale: init, growth_interval: 1000, ..LossScalerConfig::default() };
    let mut ts = TrainStep::new(TrainStepOptions { loss_scaling: Some(cfg), max_grad_norm: Some(5.0) })?;
    let mut rng = Rng::new(seed);
    let mut run = |factor: f32, ts: &mut TrainStep, opt: &mut O| -> kiln::Result<kiln::train_step::StepStats> {
        let (x, y) = batch(&mut rng)?;
        // The injected factor is host data fed to the same program every step.
        let loss = amp::autocast(DType::F16, || net.loss(&x, &y)?.mul(&Tensor::scalar(factor)))?;
        ts.step(&loss, &net.ps.tensors(), opt, 0.05)
    };

    let s = run(1.0, &mut ts, &mut opt)?;
    assert_eq!(s.skipped.item()?, 0.0, "a clean first step updates");
    assert_eq!(s.scale.item()?, init);
    let after_clean = bytes(&state_of(&net, &opt))?;

    for (step, bad) in [(2, f32::INFINITY), (3, f32::NAN)] {
        let s = run(bad, &mut ts, &mut opt)?;
        assert_eq!(s.skipped.item()?, 1.0, "step {step} ({bad}) is skipped");
        assert!(!s.grad_norm.item()?.is_finite(), "step {step}: the norm shows it");
        assert!(
            bytes(&state_of(&net, &opt))? == after_clean,
            "step {step} ({bad}): parameters or optimizer state moved"
        );
        // Exact: the factors and the initial scale are powers of two.
        assert_eq!(s.scale.item()?, init * 0.5f64.powi(step - 1), "step {step}: the scale backs off");
        assert_eq!(ts.scaler.as_ref().unwrap().growth_tracker.item()?, 0.0);
    }

    let s = run(1.0, &mut ts, &mut opt)?;
    assert_eq!(s.skipped.item()?, 0.0, "the next clean step updates");
    assert!(s.grad_norm.item()?.is_finite() && s.grad_norm.item()? > 0.0);
    let now = bytes(&net.ps.tensors())?;
    for (i, (a, b)) in now.iter().zip(&after_clean).enumerate() {
        assert!(a != b, "parameter {i} did not move on the clean step");
    }
    assert_eq!(s.scale.item()?, init * 0.25, "a clean step keeps the scale");
    assert_eq!(ts.scaler.as_ref().unwrap().growth_tracker.item()?, 1.0);
    Ok(())
}

#[test]
fn injected_inf_and_nan_skip_the_adamw_update_and_back_off() -> anyhow::Result<()> {
    skips_non_finite_steps(|p| AdamW::new(p, AdamWConfig::default()), 11)?;
    Ok(())
}

#[test]
fn injected_inf_and_nan_skip_the_sgd_update_and_back_off() -> anyhow::Result<()> {
    skips_non_finite_steps(|p| Sgd::new(p, 0.9, 1e-4), 12)
}

#[test]
fn the_adamw_step_counter_only_counts_applied_updates() -> anyhow::Result<()> {
    let net = Net::new(13)?;
    let mut opt = AdamW::new(&net.ps.tensors(), AdamWConfig::default())?;
    let mut ts =
        TrainStep::new(TrainStepOptions { loss_scaling: Some(LossScalerConfig::default()), max_grad_norm: None })?;
    let mut rng = Rng::new(13);
    for factor in [1.0, f32::INFINITY, 1.0, f32::NAN, 1.0] {
        let (x, y) = batch(&mut rng)?;
        let loss = amp::autocast(DType::BF16, || net.loss(&x, &y)?.mul(&Tensor::scalar(factor)))?;
        ts.step(&loss, &net.ps.tensors(), &mut opt, 0.01)?;
    }
    assert_eq!(opt.t.item()?, 3.0, "three of five steps applied");
    Ok(())
}

#[test]
fn the_scale_grows_after_growth_interval_clean_steps() -> anyhow::Result<()> {
    let net = Net::new(14)?;
    let mut opt = Sgd::new(&net.ps.tensors(), 0.0, 0.0)?;
    let cfg = LossScalerConfig { init_scale: 256.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 3 };
    let mut ts = TrainStep::new(TrainStepOptions { loss_scaling: Some(cfg), max_grad_norm: None })?;
    let mut rng = Rng::new(14);
    // (injected factor, scale after the step, growth counter after the step)
    let script = [
        (1.0, 256.0, 1.0),
        (1.0, 256.0, 2.0),
        (1.0, 512.0, 0.0), // third clean step in a row: grow, restart the count
        (1.0, 512.0, 1.0),
        (f32::INFINITY, 256.0, 0.0), // a skip restarts the count
        (1.0, 256.0, 1.0),
        (1.0, 256.0, 2.0),
        (1.0, 512.0, 0.0),
    ];
    for (i, (factor, scale, count)) in script.into_iter().enumerate() {
        let (x, y) = batch(&mut rng)?;
        let loss = amp::autocast(DType::F16, || net.loss(&x, &y)?.mul(&Tensor::scalar(factor)))?;
        let s = ts.step(&loss, &net.ps.tensors(), &mut opt, 0.01)?;
        assert_eq!(s.scale.item()?, scale, "scale after step {}", i + 1);
        assert_eq!(ts.scaler.as_ref().unwrap().growth_tracker.item()?, count, "count after step {}", i + 1);
    }
    Ok(())
}

/// Global norm and clipped values on the host in f64.
fn reference_clip(grads: &[Vec<f64>], max_norm: f64) -> (Vec<Vec<f64>>, f64) {
    let norm = grads.iter().flatten().map(|v| v * v).sum::<f64>().sqrt();
    let coef = (max_norm / (norm + clip::CLIP_EPS)).min(1.0);
    (grads.iter().map(|g| g.iter().map(|v| v * coef).collect()).collect(), norm)
}

fn random_grads(rng: &mut Rng) -> Vec<(Vec<f32>, Vec<usize>)> {
    [vec![7, 5], vec![13], vec![3, 4, 2]]
        .into_iter()
        .map(|s| (rng.uniform_vec(s.iter().product(), -3.0, 3.0), s))
        .collect()
}

#[test]
fn clipping_matches_an_f64_reference() -> anyhow::Result<()> {
    let mut rng = Rng::new(15);
    let host = random_grads(&mut rng);
    let wide: Vec<Vec<f64>> = host.iter().map(|(v, _)| v.iter().map(|&x| f64::from(x)).collect()).collect();
    let grads = host.iter().map(|(v, s)| Tensor::from_vec(v.clone(), s.clone())).collect::<kiln::Result<Vec<_>>>()?;
    let (_, true_norm) = reference_clip(&wide, f64::INFINITY);
    assert!(true_norm > 1.0, "fresh non-zero gradients");

    // Clipped: the norm is above max_norm. f32 arithmetic over 73 values:
    // stated tolerance 1e-6 relative on the norm, 1e-5 on each value.
    let max_norm = 0.3 * true_norm;
    let (clipped, norm) = clip::clip_grad_norm(&grads, max_norm)?;
    kiln::mark_step()?;
    let (want, want_norm) = reference_clip(&wide, max_norm);
    assert!((norm.item()? - want_norm).abs() <= 1e-6 * want_norm, "norm {} vs {want_norm}", norm.item()?);
    let mut clipped_sq = 0.0;
    for (k, (c, w)) in clipped.iter().zip(&want).enumerate() {
        for (i, (got, want)) in c.to_vec::<f32>()?.iter().zip(w).enumerate() {
            assert!((f64::from(*got) - want).abs() <= 1e-5 * want.abs().max(1e-3), "grad {k}[{i}]: {got} vs {want}");
            clipped_sq += f64::from(*got).powi(2);
        }
    }
    assert!((clipped_sq.sqrt() - max_norm).abs() <= 1e-5 * max_norm, "the clipped norm is max_norm");

    // Not clipped: the norm is below max_norm, the gradients pass bit-exactly.
    let (same, norm) = clip::clip_grad_norm(&grads, 1.5 * true_norm)?;
    kiln::mark_step()?;
    assert!((norm.item()? - true_norm).abs() <= 1e-6 * true_norm);
    for (s, (v, _)) in same.iter().zip(&host) {
        assert_eq!(&s.to_vec::<f32>()?, v);
    }
    Ok(())
}

#[test]
fn the_norm_of_bf16_gradients_accumulates_in_f32() -> anyhow::Result<()> {
    let mut rng = Rng::new(16);
    let host: Vec<(Vec<half::bf16>, Vec<usize>)> = random_grads(&mut rng)
        .into_iter()
        .map(|(v, s)| (v.into_iter().map(half::bf16::from_f32).collect(), s))
        .collect();
    let wide: Vec<Vec<f64>> = host.iter().map(|(v, _)| v.iter().map(|x| x.to_f64()).collect()).collect();
    let grads = host.iter().map(|(v, s)| Tensor::from_vec(v.clone(), s.clone())).collect::<kiln::Result<Vec<_>>>()?;
    let max_norm = 0.5 * reference_clip(&wide, f64::INFINITY).1;
    let (clipped, norm) = clip::clip_grad_norm(&grads, max_norm)?;
    kiln::mark_step()?;
    let (want, want_norm) = reference_clip(&wide, max_norm);
    assert_eq!(norm.dtype(), DType::F32);
    // bf16 keeps 8 significant bits (relative step 2^-8): a bf16 accumulation
    // would miss by ~1e-3; f32 accumulation is within 1e-6.
    assert!((norm.item()? - want_norm).abs() <= 1e-6 * want_norm, "norm {} vs {want_norm}", norm.item()?);
    for (c, w) in clipped.iter().zip(&want) {
        assert_eq!(c.dtype(), DType::BF16, "clipped gradients keep their dtype");
        for (got, want) in c.to_f64s()?.iter().zip(w) {
            assert!((got - want).abs() <= 2f64.powi(-8) * want.abs(), "{got} vs {want}");
        }
    }
    Ok(())
}

/// A bias under bf16 autocast gets its gradient summed in f32 over the
/// tokens and rounded to bf16 once: within bf16's rounding of an f64 sum of
/// the same cotangent. Summed in bf16 (as it was), 16384 rows missed by
/// several times that.
#[test]
fn a_bf16_bias_gradient_is_summed_in_f32() -> anyhow::Result<()> {
    let (n, k, d) = (16384, 4, 64);
    let mut rng = Rng::new(23);
    let mut ps = ParamStore::new(5);
    let lin = Linear::new(&mut ps, "l", k, d, true)?;
    let x = Tensor::from_vec(rng.normal_vec(n * k), [n, k])?;
    // A cotangent that bf16 holds exactly, so the reference sums what the
    // backward sums.
    let c: Vec<f32> = rng.normal_vec(n * d).into_iter().map(|v| half::bf16::from_f32(v).to_f32()).collect();
    let y = amp::autocast(DType::BF16, || lin.forward(&x))?;
    assert_eq!(y.dtype(), DType::BF16);
    let loss = y.to_dtype(DType::F32)?.mul(&Tensor::from_vec(c.clone(), [n, d])?)?.sum_all()?;
    let bias = lin.bias.clone().expect("a bias");
    let db = kiln::grad(&loss, &[bias])?.remove(0);
    kiln::mark_step()?;
    let got = db.to_f64s()?;
    for (j, g) in got.iter().enumerate() {
        let want: f64 = (0..n).map(|r| c[r * d + j] as f64).sum();
        let mass: f64 = (0..n).map(|r| (c[r * d + j] as f64).abs()).sum();
        // Rounding to bf16 (half of 2^-7 relative) and f32 accumulation.
        let tol = 2f64.powi(-8) * want.abs() + 2f64.powi(-20) * mass;
        assert!((g - want).abs() <= tol, "column {j}: {g} vs {want} (tolerance {tol})");
    }
    Ok(())
}

#[test]
fn bad_settings_are_typed_errors_naming_the_setting() -> anyhow::Result<()> {
    let g = Tensor::from_vec(Rng::new(17).normal_vec(4), [4])?;
    match clip::clip_grad_norm(&[g], -1.0) {
        Err(FrontendError::HyperParameter { name: "max_norm", .. }) => {}
        other => panic!("{other:?}"),
    }
    match TrainStep::new(TrainStepOptions { loss_scaling: None, max_grad_norm: Some(f64::NAN) }) {
        Err(FrontendError::HyperParameter { name: "max_grad_norm", .. }) => {}
        other => panic!("{other:?}"),
    }
    let bad = LossScalerConfig { backoff_factor: 2.0, ..LossScalerConfig::default() };
    match TrainStep::new(TrainStepOptions { loss_scaling: Some(bad), max_grad_norm: None }) {
        Err(e @ FrontendError::HyperParameter { name: "backoff_factor", .. }) => {
            assert!(e.to_string().contains("backoff_factor = 2"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // The loss must be an f32 scalar: a bf16 loss lost its precision already.
    let net = Net::new(17)?;
    let mut opt = Sgd::new(&net.ps.tensors(), 0.0, 0.0)?;
    let (x, y) = batch(&mut Rng::new(17))?;
    let loss = net.loss(&x, &y)?.to_dtype(DType::BF16)?;
    let mut ts = TrainStep::new(TrainStepOptions::default())?;
    match ts.record(&loss, &net.ps.tensors(), &mut opt, 0.1) {
        Err(FrontendError::DType { op: "train_step", got: DType::BF16, .. }) => {}
        other => panic!("{other:?}"),
    }
    Ok(())
}

#[test]
fn autocast_lowers_bf16_matmuls_and_an_f32_loss() -> anyhow::Result<()> {
    let mut rng = Rng::new(18);
    let mut ps = ParamStore::new(18);
    let lin = Linear::new(&mut ps, "fc", 8, 4, true)?;
    let x = Tensor::from_vec(rng.normal_vec(16), [2, 8])?;
    let y = Tensor::from_vec(vec![3i32, 1], [2])?;
    let text = kiln::lower(|| {
        let loss = amp::autocast(DType::BF16, || nn::cross_entropy(&lin.forward(&x)?, &y, None))?;
        let grads = kiln::grad(&loss, std::slice::from_ref(&lin.weight))?;
        assert_eq!(grads[0].dtype(), DType::F32, "the master weight's gradient is f32");
        Ok(vec![loss, grads[0].clone()])
    })?;
    let dots: Vec<&str> = text.lines().filter(|l| l.contains("stablehlo.dot_general")).collect();
    // The forward product and the weight gradient's product.
    assert_eq!(dots.len(), 2, "{text}");
    for d in &dots {
        assert!(d.ends_with("xbf16>") && !d.contains("f32"), "not a bf16 product: {d}");
    }
    let reduces: Vec<&str> = text.lines().filter(|l| l.contains("stablehlo.reduce")).collect();
    assert!(!reduces.is_empty());
    for r in &reduces {
        assert!(!r.contains("bf16"), "a reduction outside f32: {r}");
    }
    // And the label range check's flags, as the step compiles them.
    assert!(
        text.contains("-> (tensor<f32>, tensor<8x4xf32>, tensor<3xi64>)"),
        "an f32 loss and an f32 gradient: {text}"
    );

    // The layer alone: operands converted, product and bias add in bf16.
    let layer = kiln::lower(|| Ok(vec![amp::autocast(DType::BF16, || lin.forward(&x))?]))?;
    insta::assert_snapshot!(layer, @r"
    module @kiln attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
      func.func public @main(%arg0: tensor<2x8xf32>, %arg1: tensor<8x4xf32>, %arg2: tensor<4xf32>) -> (tensor<2x4xbf16>) {
        %v3 = stablehlo.convert %arg0 : (tensor<2x8xf32>) -> tensor<2x8xbf16>
        %v4 = stablehlo.convert %arg1 : (tensor<8x4xf32>) -> tensor<8x4xbf16>
        %v5 = stablehlo.dot_general %v3, %v4, contracting_dims = [1] x [0] : (tensor<2x8xbf16>, tensor<8x4xbf16>) -> tensor<2x4xbf16>
        %v6 = stablehlo.convert %arg2 : (tensor<4xf32>) -> tensor<4xbf16>
        %v7 = stablehlo.broadcast_in_dim %v6, dims = [1] : (tensor<4xbf16>) -> tensor<2x4xbf16>
        %v8 = stablehlo.add %v5, %v7 : tensor<2x4xbf16>
        return %v8 : tensor<2x4xbf16>
      }
    }
    ");

    // Without the scope the same layer lowers with no bf16 at all.
    let plain = kiln::lower(|| Ok(vec![nn::cross_entropy(&lin.forward(&x)?, &y, None)?]))?;
    assert!(!plain.contains("bf16"), "{plain}");
    Ok(())
}

#[test]
fn mixed_float_elementwise_ops_promote_to_f32() -> anyhow::Result<()> {
    let mut rng = Rng::new(19);
    let a = rng.normal_vec(6);
    let b = rng.normal_vec(6);
    let ta = Tensor::from_vec(a.iter().map(|&v| half::bf16::from_f32(v)).collect::<Vec<_>>(), [6])?;
    let tb = Tensor::from_vec(b.iter().map(|&v| half::f16::from_f32(v)).collect::<Vec<_>>(), [6])?;
    let tc = Tensor::from_vec(b.clone(), [6])?;
    let (s1, s2) = (ta.add(&tb)?, ta.mul(&tc)?);
    assert_eq!((s1.dtype(), s2.dtype()), (DType::F32, DType::F32));
    let lt = ta.lt(&tc)?;
    kiln::mark_step()?;
    // Each operand is exactly representable in f32, so the results are f32
    // sums and products of the rounded operands (stated tolerance: f32 rounding).
    for i in 0..6 {
        let (x, y) = (half::bf16::from_f32(a[i]).to_f64(), half::f16::from_f32(b[i]).to_f64());
        assert!((s1.to_f64s()?[i] - (x + y)).abs() <= 1e-6 * (x + y).abs().max(1.0));
        assert!((s2.to_f64s()?[i] - x * f64::from(b[i])).abs() <= 1e-6 * (x * f64::from(b[i])).abs().max(1.0));
        assert_eq!(lt.to_f64s()?[i] != 0.0, x < f64::from(b[i]));
    }
    Ok(())
}

fn fmnist() -> FashionMnist {
    FashionMnist::load(FASHION_MNIST_DIR).expect("Fashion-MNIST (make test installs dataset-fashion-mnist)")
}

fn trains_under(dtype: DType) -> anyhow::Result<mlp::TrainReport> {
    // Compile counts must not depend on an earlier run's persistent cache.
    kiln::set_disk_cache(None)?;
    let cfg =
        MlpConfig { hidden: vec![128], epochs: 1, max_steps: Some(300), amp: Some(dtype), ..MlpConfig::default() };
    let report = mlp::train(&fmnist(), &cfg, |_| {})?;
    assert_eq!(report.steps, 300);
    // One train program (step 1 with host-initialised state and every later
    // step share it) and one eval program: no recompiles.
    assert_eq!(report.compiles, 2, "{dtype}: {report:?}");
    assert_eq!(report.cache_hits, 299 + 9, "{dtype}: 299 train hits + 9 eval hits");
    let first: f64 = report.losses[..20].iter().sum::<f64>() / 20.0;
    let last: f64 = report.losses[280..].iter().sum::<f64>() / 20.0;
    assert!(last < 0.6 * first, "{dtype}: loss went from {first} to {last}");
    let acc = report.test_accuracy.unwrap_or(0.0);
    assert!(acc >= 0.80, "{dtype}: test accuracy {acc} after 300 steps");
    eprintln!(
        "{dtype}: loss {first:.4} -> {last:.4}, accuracy {acc:.4}, skipped {}, scale {:?}",
        report.skipped_steps, report.loss_scale
    );
    Ok(report)
}

#[test]
fn the_mlp_trains_under_bf16_autocast_without_recompiles() -> anyhow::Result<()> {
    let report = trains_under(DType::BF16)?;
    assert_eq!(report.skipped_steps, 0, "bf16 has f32's range");
    assert_eq!(report.loss_scale, None, "bf16 runs unscaled");
    Ok(())
}

#[test]
fn the_mlp_trains_under_f16_autocast_with_loss_scaling() -> anyhow::Result<()> {
    let report = trains_under(DType::F16)?;
    assert!(report.skipped_steps <= 5, "{} of 300 updates skipped", report.skipped_steps);
    let scale = report.loss_scale.unwrap_or(0.0);
    assert!(scale >= 1.0 && scale.log2().fract() == 0.0, "scale {scale} stays a power of two");
    Ok(())
}

#[test]
fn the_f16_training_state_includes_the_loss_scaler() -> anyhow::Result<()> {
    let names = |amp| -> kiln::Result<Vec<String>> {
        let cfg = MlpConfig { hidden: vec![8], amp, ..MlpConfig::default() };
        Ok(Trainer::new(784, 10, &cfg)?.state().into_iter().map(|(n, _)| n).collect())
    };
    let (plain, half) = (names(None)?, names(Some(DType::F16))?);
    assert_eq!(half.len(), plain.len() + 2);
    assert!(half.ends_with(&["loss_scaler.scale".to_string(), "loss_scaler.growth_tracker".to_string()]), "{half:?}");
    assert!(!plain.iter().any(|n| n.contains("loss_scaler")));
    Ok(())
}

#[test]
fn the_tiny_gpt_trains_under_bf16_with_clipping_and_one_compile() -> anyhow::Result<()> {
    kiln::set_disk_cache(None)?;
    let text = gpt::read_text(std::path::Path::new("/usr/share/common-licenses/Apache-2.0"), 32)?;
    let cfg = GptConfig { steps: 150, amp: Some(DType::BF16), max_grad_norm: Some(1.0), ..GptConfig::tiny(0) };
    let report = gpt::train(&text, &cfg, |_| {})?;
    assert_eq!((report.compiles, report.cache_hits), (1, 149), "{report:?}");
    assert_eq!(report.skipped_steps, 0);
    let first = report.losses[0];
    let last: f64 = report.losses[130..].iter().sum::<f64>() / 20.0;
    // Measured: 4.31 at step 1 (ln 73 = 4.29), 2.20 at step 150 (f32 without
    // clipping: 2.34).
    assert!(first > 4.0, "starts near uniform: {first}");
    assert!(last < 2.8, "mean loss of the last 20 steps: {last}");
    Ok(())
}

/// Runs `steps` updates of a fresh `Net` two ways from the same weights and
/// batches: `grad` + the optimizer's own step, and the full [`TrainStep`]
/// without AMP; returns both final parameter sets.
fn plain_and_ordered<O: Optimizer>(
    make: impl Fn(&[Tensor]) -> kiln::Result<O>,
    seed: u64,
) -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
    let flat = |net: &Net| -> kiln::Result<Vec<f32>> {
        Ok(net.ps.tensors().iter().map(|t| t.to_vec::<f32>()).collect::<kiln::Result<Vec<_>>>()?.concat())
    };
    let (plain, ordered) = (Net::new(seed)?, Net::new(seed)?);
    let (mut opt_a, mut opt_b) = (make(&plain.ps.tensors())?, make(&ordered.ps.tensors())?);
    let mut ts = TrainStep::new(TrainStepOptions::default())?;
    let mut rng = Rng::new(seed);
    for _ in 0..4 {
        let (x, y) = batch(&mut rng)?;
        let loss = plain.loss(&x, &y)?;
        let g = kiln::grad(&loss, &plain.ps.tensors())?;
        opt_a.step(&plain.ps.tensors(), &g, 0.05)?;
        kiln::mark_step()?;
        let s = ts.step(&ordered.loss(&x, &y)?, &ordered.ps.tensors(), &mut opt_b, 0.05)?;
        assert_eq!(s.skipped.item()?, 0.0);
        assert_eq!(s.scale.item()?, 1.0, "no scaler: scale 1");
    }
    Ok((flat(&plain)?, flat(&ordered)?))
}

#[test]
fn the_ordered_step_without_amp_matches_the_plain_optimizer_step() -> anyhow::Result<()> {
    for (name, (a, b)) in [
        ("adamw", plain_and_ordered(|p| AdamW::new(p, AdamWConfig::default()), 20)?),
        ("sgd", plain_and_ordered(|p| Sgd::new(p, 0.9, 1e-4), 21)?),
    ] {
        assert_eq!(a.len(), b.len());
        // Same math in f32; XLA may fuse the two programs differently, so the
        // stated tolerance is f32 rounding: 1e-6 relative.
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{name} param {i}: {x} vs {y}");
        }
    }
    Ok(())
}

/// Parameters after `factors.len()` steps of [`TrainStep`] (scaled, f32, AdamW)
/// on `replicas` replicas, replica `r` training on `shards[s][r]` scaled by
/// `factors[s][r]`; every replica's parameters and skip flags.
type ReplicaRun = (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>);

fn run_replicas(
    replicas: usize,
    shards: &[Vec<(Vec<f32>, Vec<i32>)>],
    factors: &[Vec<f32>],
) -> anyhow::Result<ReplicaRun> {
    kiln::replicas::set_replicas(replicas)?;
    let net = Net::new(30)?;
    let mut opt = AdamW::new(&net.ps.tensors(), AdamWConfig::default())?;
    let cfg = LossScalerConfig { init_scale: 1024.0, growth_interval: 1000, ..LossScalerConfig::default() };
    let mut ts = TrainStep::new(TrainStepOptions { loss_scaling: Some(cfg), max_grad_norm: Some(1.0) })?;
    let mut skipped = Vec::new();
    for (step, f) in shards.iter().zip(factors) {
        let n = step[0].1.len();
        let x = kiln::replicas::from_shards(step.iter().map(|(x, _)| x.clone()).collect(), [n, 6])?;
        let y = kiln::replicas::from_shards(step.iter().map(|(_, y)| y.clone()).collect(), [n])?;
        let factor = kiln::replicas::from_shards(f.iter().map(|&v| vec![v]).collect(), [])?;
        let loss = net.loss(&x, &y)?.mul(&factor)?;
        let s = ts.record(&loss, &net.ps.tensors(), &mut opt, 0.05)?;
        let flag = s.skipped.to_dtype(DType::F32)?;
        kiln::mark_step()?;
        skipped.push(kiln::replicas::replica_values::<f32>(&flag)?.concat());
    }
    let params =
        net.ps.tensors().iter().map(kiln::replicas::replica_values::<f32>).collect::<kiln::Result<Vec<_>>>()?;
    Ok((params, skipped))
}

#[test]
fn two_replicas_reduce_before_the_check_and_skip_together() -> anyhow::Result<()> {
    let mut rng = Rng::new(31);
    let mut shard = || -> (Vec<f32>, Vec<i32>) { (rng.normal_vec(30), (0..5).map(|i| i * 7 % 3).collect()) };
    let steps: Vec<Vec<(Vec<f32>, Vec<i32>)>> = (0..3).map(|_| vec![shard(), shard()]).collect();
    // Step 2: only replica 1's loss is inf.
    let factors = vec![vec![1.0, 1.0], vec![1.0, f32::INFINITY], vec![1.0, 1.0]];
    // The same batches whole on one replica (its own thread: the replica count
    // is set per thread before any tensor exists).
    let whole: Vec<Vec<(Vec<f32>, Vec<i32>)>> = steps
        .iter()
        .map(|s| {
            vec![(s.iter().flat_map(|(x, _)| x.clone()).collect(), s.iter().flat_map(|(_, y)| y.clone()).collect())]
        })
        .collect();
    let whole_factors: Vec<Vec<f32>> = vec![vec![1.0], vec![f32::INFINITY], vec![1.0]];
    let one = std::thread::spawn(move || run_replicas(1, &whole, &whole_factors).map_err(|e| e.to_string()))
        .join()
        .map_err(|_| anyhow::anyhow!("the one-replica run panicked"))?
        .map_err(anyhow::Error::msg)?;
    let two = run_replicas(2, &steps, &factors)?;

    assert_eq!(two.1, vec![vec![0.0, 0.0], vec![1.0, 1.0], vec![0.0, 0.0]], "both replicas skip step 2 together");
    assert_eq!(one.1, vec![vec![0.0], vec![1.0], vec![0.0]]);
    for (i, (p2, p1)) in two.0.iter().zip(&one.0).enumerate() {
        assert_eq!(p2[0], p2[1], "parameter {i} differs between replicas");
        // The mean of two 5-example mean losses is the 10-example mean loss:
        // same update up to f32 rounding of the two reductions (stated 1e-5).
        for (a, b) in p2[0].iter().zip(&p1[0]) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "parameter {i}: {a} (2 replicas) vs {b} (1 replica)");
        }
    }
    Ok(())
}

/// The ordered step the capture tests train with: a scale high enough to
/// overflow f16 gradients at first and a short growth interval, so the run
/// skips, backs off and grows; clipping on.
fn eventful_ordered_step() -> kiln::Result<TrainStep> {
    TrainStep::new(TrainStepOptions {
        loss_scaling: Some(LossScalerConfig { init_scale: 2f64.powi(24), growth_interval: 4, ..Default::default() }),
        max_grad_norm: Some(0.5),
    })
}

fn state_bytes(state: Vec<(String, Tensor)>) -> kiln::Result<Vec<(String, Vec<u8>)>> {
    state.into_iter().map(|(n, t)| Ok((n, t.to_literal()?.bytes().to_vec()))).collect()
}

#[test]
fn the_captured_mlp_step_with_loss_scaling_and_clipping_is_bit_identical_to_the_traced_one() -> anyhow::Result<()> {
    let data = fmnist();
    let cfg = MlpConfig { hidden: vec![64], amp: Some(DType::F16), ..MlpConfig::default() };
    let batches = kiln::data::batches(data.train.len(), 64, Some(5), kiln::data::LastBatch::Drop);
    let steps = 24;
    // A learning rate that changes every step (an input of the captured step).
    let lr = |n: usize| 2e-3 * (1.0 + n as f64) / 10.0;
    let mut traced = Trainer::new(784, 10, &cfg)?;
    traced.ordered = Some(eventful_ordered_step()?);
    let mut want = Vec::new();
    for (n, b) in batches[..steps].iter().enumerate() {
        want.push(traced.train_step(&data.train, b, lr(n))?.to_bits());
    }
    let mut captured = Trainer::new(784, 10, &cfg)?;
    captured.ordered = Some(eventful_ordered_step()?);
    let (mut got, mut skipped) = (Vec::new(), 0);
    {
        let c = &mut captured;
        let mut step = mlp::captured_step(&c.model, c.params.tensors(), &mut c.opt, c.ordered.as_mut(), c.amp);
        for (n, b) in batches[..steps].iter().enumerate() {
            let (x, y) = kiln::data::image_batch(&data.train, b)?;
            let out = step.call(&[x, y, Tensor::scalar(lr(n) as f32)])?;
            assert_eq!(out.len(), 3, "loss, the skip flag and the gradient norm");
            got.push(out[0].item()?.to_bits());
            skipped += u64::from(out[1].item()? != 0.0);
            // The norm before clipping: positive, and infinite or NaN exactly
            // when the step was skipped for non-finite gradients.
            let (norm, was_skipped) = (out[2].item()?, out[1].item()? != 0.0);
            let fits = if was_skipped { !norm.is_finite() } else { norm.is_finite() && norm > 0.0 };
            assert!(fits, "step {n}: norm {norm}, skipped {was_skipped}");
        }
        assert_eq!((step.traces(), step.replays()), (1, steps as u64 - 1), "{:?}", step.last_retrace());
    }
    assert_eq!(got, want, "losses, as f64 bits");
    assert_eq!(skipped, traced.skipped);
    assert!(skipped > 0 && skipped < steps as u64, "the run skipped {skipped} of {steps} updates");
    assert!(state_bytes(captured.state())? == state_bytes(traced.state())?, "the training states differ");
    Ok(())
}

#[test]
fn the_captured_gpt_step_with_bf16_and_clipping_is_bit_identical_to_the_traced_one() -> anyhow::Result<()> {
    let text = gpt::read_text(std::path::Path::new("/usr/share/common-licenses/Apache-2.0"), 32)?;
    let vocab = gpt::CharVocab::new(&text);
    let cfg = GptConfig { amp: Some(DType::BF16), max_grad_norm: Some(0.05), ..GptConfig::tiny(vocab.len()) };
    let steps = 6;
    let lr = |n: usize| 1e-3 * (1.0 + n as f64);
    let mut traced = gpt::GptTrainer::new(vocab.encode(&text), &cfg)?;
    let mut want = Vec::new();
    for n in 0..steps {
        want.push(traced.train_step(lr(n))?.to_bits());
    }
    // The same windows: the sampler depends on the seed alone.
    let mut sampler = gpt::GptTrainer::new(vocab.encode(&text), &cfg)?;
    let batches = (0..steps).map(|_| sampler.next_batch()).collect::<kiln::Result<Vec<_>>>()?;
    drop(sampler);
    let mut captured = gpt::GptTrainer::new(vocab.encode(&text), &cfg)?;
    let mut got = Vec::new();
    {
        let c = &mut captured;
        let mut step = gpt::captured_step(&c.model, c.params.tensors(), &mut c.opt, c.ordered.as_mut(), cfg.amp);
        for (n, (x, y)) in batches.into_iter().enumerate() {
            let out = step.call(&[x, y, Tensor::scalar(lr(n) as f32)])?;
            got.push(out[0].item()?.to_bits());
            assert_eq!(out[1].item()?, 0.0, "bf16 steps are clean");
        }
        assert_eq!((step.traces(), step.replays()), (1, steps as u64 - 1), "{:?}", step.last_retrace());
    }
    assert_eq!(got, want, "losses, as f64 bits");
    assert!(state_bytes(captured.state())? == state_bytes(traced.state())?, "the training states differ");
    Ok(())
}
