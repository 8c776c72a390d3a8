//! Training end to end on the CPU plugin: the Fashion-MNIST MLP converges with
//! two compiles, matches the reference interpreter step by step, and resumes
//! bit-identically from a checkpoint.

use kiln::data::{self, FashionMnist, LastBatch, FASHION_MNIST_DIR};
use kiln::models::mlp::{self, MlpConfig, Trainer};

fn fmnist() -> FashionMnist {
    FashionMnist::load(FASHION_MNIST_DIR).expect("Fashion-MNIST (make test installs dataset-fashion-mnist)")
}

#[test]
fn mlp_learns_with_two_compiles() -> anyhow::Result<()> {
    // Compile counts must not depend on what earlier runs left on disk.
    kiln::set_disk_cache(None)?;
    let data = fmnist();
    let cfg = MlpConfig { hidden: vec![128], epochs: 1, max_steps: Some(300), ..MlpConfig::default() };
    let report = mlp::train(&data, &cfg, |_| {})?;
    assert_eq!(report.steps, 300);
    // One program for the train step, one for the eval step; step 1 (host
    // initialised state) and every later step share the first.
    assert_eq!(report.compiles, 2, "{report:?}");
    assert_eq!(report.cache_hits, 299 + 9, "299 train hits + 9 eval hits");
    let acc = report.test_accuracy.unwrap();
    assert!(acc >= 0.80, "test accuracy {acc} after 300 steps");
    let first: f64 = report.losses[..20].iter().sum::<f64>() / 20.0;
    let last: f64 = report.losses[280..].iter().sum::<f64>() / 20.0;
    assert!(last < 0.6 * first, "loss went from {first} to {last}");
    Ok(())
}

#[test]
fn compiled_and_reference_loss_curves_agree() -> anyhow::Result<()> {
    let data = fmnist();
    let cfg = MlpConfig { hidden: vec![64], ..MlpConfig::default() };
    let (compiled, reference) = mlp::compare_with(kiln::Backend::Reference, &data, &cfg, 20)?;
    assert_eq!(compiled.len(), 20);
    assert_eq!(reference.len(), 20);
    // f32 on both sides with different summation orders: the curves drift by
    // rounding only. Stated tolerance: 1e-3 relative per step.
    for (i, (a, b)) in compiled.iter().zip(&reference).enumerate() {
        assert!((a - b).abs() <= 1e-3 * b.abs().max(1.0), "step {i}: compiled {a} vs reference {b}");
    }
    assert!(compiled[19] < compiled[0], "the loss decreases: {compiled:?}");
    Ok(())
}

fn param_bytes(t: &Trainer) -> anyhow::Result<Vec<Vec<u8>>> {
    Ok(t.state().iter().map(|(_, x)| x.to_literal().map(|l| l.bytes().to_vec())).collect::<kiln::Result<_>>()?)
}

#[test]
fn checkpoint_resume_is_bit_identical() -> anyhow::Result<()> {
    let data = fmnist();
    let cfg = MlpConfig { hidden: vec![32], seed: 9, ..MlpConfig::default() };
    let batches = data::batches(data.train.len(), 64, Some(3), LastBatch::Drop);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("ckpt.safetensors");

    let mut straight = Trainer::new(784, 10, &cfg)?;
    for b in &batches[..6] {
        straight.train_step(&data.train, b, 1e-3)?;
    }
    let want = param_bytes(&straight)?;

    let mut first = Trainer::new(784, 10, &cfg)?;
    for b in &batches[..3] {
        first.train_step(&data.train, b, 1e-3)?;
    }
    first.save(&path)?;
    drop(first);
    // A fresh trainer from another seed: everything must come from the file.
    let mut resumed = Trainer::new(784, 10, &MlpConfig { seed: 1234, ..cfg.clone() })?;
    resumed.restore(&path)?;
    assert_eq!(resumed.step, 3);
    for b in &batches[3..6] {
        resumed.train_step(&data.train, b, 1e-3)?;
    }
    assert!(param_bytes(&resumed)? == want, "resumed training differs from the straight run");
    Ok(())
}

#[test]
fn corrupt_or_truncated_checkpoints_are_refused_and_change_nothing() -> anyhow::Result<()> {
    let data = fmnist();
    let cfg = MlpConfig { hidden: vec![16], ..MlpConfig::default() };
    let dir = tempfile::tempdir()?;
    let good = dir.path().join("good.safetensors");
    let mut t = Trainer::new(784, 10, &cfg)?;
    let b = &data::batches(data.train.len(), 32, None, LastBatch::Drop)[0];
    t.train_step(&data.train, b, 1e-3)?;
    t.save(&good)?;
    let bytes = std::fs::read(&good)?;
    let before = param_bytes(&t)?;

    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2])?;
    let err = t.restore(&truncated).unwrap_err().to_string();
    assert!(err.contains("truncated.safetensors"), "{err}");

    let corrupt = dir.path().join("corrupt.safetensors");
    let mut flipped = bytes.clone();
    let at = flipped.len() - 10;
    flipped[at] ^= 0x55;
    std::fs::write(&corrupt, &flipped)?;
    let err = t.restore(&corrupt).unwrap_err().to_string();
    assert!(err.contains("checksum"), "{err}");

    assert!(param_bytes(&t)? == before, "a refused checkpoint changed the model");
    // A save that fails leaves the previous checkpoint as it was.
    let dup = vec![("a".to_string(), t.state()[0].1.clone()), ("a".to_string(), t.state()[1].1.clone())];
    assert!(kiln::checkpoint::save(&good, 9, &dup).is_err());
    assert_eq!(std::fs::read(&good)?, bytes);
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 3, "no temp files left behind");
    Ok(())
}

#[test]
fn mlp_step_times_cover_the_steps_run_not_just_their_enqueue() -> anyhow::Result<()> {
    // Steps are asynchronous: a captured call returns once the step is
    // enqueued, and the device work is waited for when the loss is read.
    // Step times taken from one completion to the next contain every
    // execute call and every wait of the loop; enqueue times contain none of
    // the waits, which on this MLP are most of the step.
    let data = fmnist();
    let cfg = MlpConfig {
        hidden: vec![512, 512],
        batch: 256,
        epochs: 1,
        max_steps: Some(30),
        eval: false,
        ..MlpConfig::default()
    };
    let before = kiln::metrics::snapshot();
    let report = mlp::train(&data, &cfg, |_| {})?;
    let after = kiln::metrics::snapshot();
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let execute = ms(after.execute_time - before.execute_time);
    let wait = ms(after.device_wait_time - before.device_wait_time);
    let steps: f64 = report.step_ms.iter().sum();
    eprintln!(
        "step times {steps:.2} ms (median {:.3}), execute {execute:.2} ms, device waits {wait:.2} ms, loop {:.2} ms",
        report.step_ms_median(),
        report.train_seconds * 1e3
    );
    assert_eq!(report.step_ms.len(), 30);
    assert!(
        steps >= execute + wait,
        "step times add up to {steps:.2} ms, less than the {execute:.2} ms of execute calls and {wait:.2} ms of device waits"
    );
    // And no more than the loop's wall time: nothing is counted twice.
    assert!(steps <= report.train_seconds * 1e3, "step times {steps:.2} ms, loop {:.2} s", report.train_seconds);
    Ok(())
}
