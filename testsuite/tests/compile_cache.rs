//! The compile cache seen from a training loop: the persistent cache serves a
//! cleared memory cache, damaged entries are recompiled, and new programs that
//! resemble earlier ones are explained.

use kiln::nn::{cross_entropy, Linear, ParamStore};
use kiln::optim::Sgd;
use kiln::runtime::DiskCacheConfig;
use kiln::{metrics, Tensor};

mod common;
use common::Rng;

fn disk(dir: &std::path::Path) -> DiskCacheConfig {
    DiskCacheConfig { dir: dir.to_path_buf(), max_bytes: 1 << 30, read_only: false }
}

/// Random `x: [4, 8]` and `w: [8, 5]` for [`small_step`].
fn small_inputs(seed: u64) -> anyhow::Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(seed);
    let x = Tensor::from_vec(rng.normal_vec(4 * 8), [4, 8])?;
    Ok((x, Tensor::from_vec(rng.normal_vec(8 * 5), [8, 5])?))
}

/// `tanh(x @ w) * 1.5`, run as one step; returns the values.
fn small_step(x: &Tensor, w: &Tensor) -> anyhow::Result<(Vec<f32>, kiln::StepReport)> {
    let y = x.matmul(w)?.tanh()?.mul_scalar(1.5)?;
    let report = kiln::mark_step()?;
    Ok((y.to_vec::<f32>()?, report))
}

#[test]
fn the_disk_cache_serves_a_cleared_memory_cache_and_replaces_damaged_entries() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    kiln::set_disk_cache(Some(disk(dir.path())))?;
    let (x, w) = small_inputs(3)?;

    let m0 = metrics::snapshot();
    let (want, r) = small_step(&x, &w)?;
    assert!(r.compiled);
    let entries: Vec<_> = std::fs::read_dir(dir.path())?.map(|e| e.unwrap().path()).collect();
    assert_eq!(entries.len(), 1, "{entries:?}");

    kiln::clear_compile_cache();
    let (got, r) = small_step(&x, &w)?;
    assert!(!r.compiled, "a disk hit compiles nothing");
    assert_eq!(got, want);
    let m1 = metrics::snapshot();
    assert_eq!((m1.compiles - m0.compiles, m1.disk_hits - m0.disk_hits), (1, 1));
    assert!(m1.compile_time_saved > m0.compile_time_saved);

    // Damage the entry: it is reported, recompiled and replaced.
    let mut bytes = std::fs::read(&entries[0])?;
    let at = bytes.len() / 2;
    bytes[at] ^= 0xff;
    std::fs::write(&entries[0], &bytes)?;
    kiln::clear_compile_cache();
    let (got, r) = small_step(&x, &w)?;
    assert!(r.compiled);
    assert_eq!(got, want);
    let m2 = metrics::snapshot();
    assert_eq!(m2.corrupt_cache_entries - m1.corrupt_cache_entries, 1);
    kiln::clear_compile_cache();
    let (_, r) = small_step(&x, &w)?;
    assert!(!r.compiled, "the replaced entry serves the next miss");
    Ok(())
}

/// One SGD step of a linear classifier on a batch of `b` random images.
fn train_step(
    model: &Linear,
    opt: &mut Sgd,
    params: &[Tensor],
    b: usize,
    rng: &mut Rng,
) -> anyhow::Result<kiln::StepReport> {
    let x = Tensor::from_vec(rng.uniform_vec(b * 784, 0.0, 1.0), [b, 784])?.with_name("images");
    let labels: Vec<i32> = (0..b).map(|_| (rng.next_u64() % 10) as i32).collect();
    let y = Tensor::from_vec(labels, [b])?.with_name("labels");
    let loss = cross_entropy(&model.forward(&x)?, &y, None)?;
    let grads = kiln::grad(&loss, params)?;
    opt.step(params, &grads, 0.1)?;
    Ok(kiln::mark_step()?)
}

#[test]
fn a_changed_batch_size_is_explained_naming_the_inputs_and_shapes() -> anyhow::Result<()> {
    kiln::set_disk_cache(None)?;
    let mut ps = ParamStore::new(1);
    let model = Linear::new(&mut ps, "fc", 784, 10, true)?;
    let params = ps.tensors();
    let mut opt = Sgd::new(&params, 0.9, 0.0)?;
    let mut rng = Rng::new(7);
    let before = metrics::snapshot();
    for _ in 0..3 {
        let r = train_step(&model, &mut opt, &params, 32, &mut rng)?;
        assert_eq!(r.recompile, None);
    }
    // The partial last batch of an epoch.
    let r = train_step(&model, &mut opt, &params, 24, &mut rng)?;
    let text = r.recompile.expect("a smaller batch is a recompile");
    for want in [
        "input 'images'",
        "tensor<32x784xf32>",
        "tensor<24x784xf32>",
        "input 'labels'",
        "tensor<32xi32>",
        "tensor<24xi32>",
        "LastBatch::Drop",
        "LastBatch::Pad",
    ] {
        assert!(text.contains(want), "missing {want:?} in: {text}");
    }
    let after = metrics::snapshot();
    assert_eq!(after.recompiles - before.recompiles, 1);
    assert_eq!(after.recompile_explanations.last(), Some(&text));
    Ok(())
}

#[test]
fn a_changed_constant_is_explained_and_a_new_program_is_not() -> anyhow::Result<()> {
    kiln::set_disk_cache(None)?;
    let mut rng = Rng::new(5);
    let x = Tensor::from_vec(rng.normal_vec(16), [16])?;
    let scaled = |c: f64| -> anyhow::Result<kiln::StepReport> {
        let _y = x.mul_scalar(c)?.exp()?;
        Ok(kiln::mark_step()?)
    };
    assert_eq!(scaled(2.0)?.recompile, None);
    let text = scaled(3.0)?.recompile.expect("another constant is a recompile");
    assert!(text.contains("constant changed (2 -> 3)") && text.contains("pass it as a tensor"), "{text}");
    // A different computation is a new program, not a recompile.
    let _z = x.tanh()?.sum_all()?;
    let r = kiln::mark_step()?;
    assert!(r.compiled);
    assert_eq!(r.recompile, None);
    Ok(())
}

#[test]
fn a_loop_that_recompiles_every_step_is_warned_about() -> anyhow::Result<()> {
    kiln::set_disk_cache(None)?;
    let mut rng = Rng::new(9);
    let before = metrics::snapshot();
    for n in 8..13 {
        let x = Tensor::from_vec(rng.normal_vec(n), [n])?;
        let _y = x.tanh()?.sum_all()?;
        let r = kiln::mark_step()?;
        assert!(r.compiled);
    }
    let after = metrics::snapshot();
    assert_eq!(after.recompiles - before.recompiles, 4);
    assert_eq!(after.recompile_warnings - before.recompile_warnings, 1, "one warning when the streak reaches 4");
    Ok(())
}

/// The loop-kernel setting changes the lowered module on a GPU, not the
/// graph: switching it compiles the step again, in memory and on disk, and
/// switching back is served from the cache again.
#[test]
fn switching_the_loop_kernels_compiles_again_and_back_is_cached() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    kiln::set_disk_cache(Some(disk(dir.path())))?;
    let (x, w) = small_inputs(5)?;
    let mut compiled = Vec::new();
    let mut values = Vec::new();
    for on in [false, false, true, true, false] {
        kiln::set_loop_kernels(Some(on));
        assert_eq!(kiln::loop_kernels()?, on);
        let (v, r) = small_step(&x, &w)?;
        compiled.push(r.compiled);
        values.push(v);
    }
    kiln::set_loop_kernels(None);
    // off: compiled; off: memory hit; on: compiled; on: hit; off again: a
    // disk hit (the memory cache was cleared by the switch).
    assert_eq!(compiled, [true, false, true, false, false]);
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 2);
    // The CPU target has no loop kernels: the same values either way.
    assert!(values.iter().all(|v| v == &values[0]));
    Ok(())
}
