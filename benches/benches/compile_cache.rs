//! Compile overhead (`benches/RESULTS.md`, "kiln's targets", `compile`; on the CPU plugin): a training
//! step of the Fashion-MNIST MLP compiled cold, loaded warm from the
//! persistent cache, and served from the in-memory cache. Target: a warm start
//! from disk ≥ 20× faster than the cold compile.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::models::mlp::{MlpConfig, Trainer};
use kiln::runtime::DiskCacheConfig;
use kiln::Tensor;

fn batch() -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..128 * 784).map(|i| ((i * 7919) % 1000) as f32 / 1000.0).collect();
    let y: Vec<i32> = (0..128).map(|i| (i * 7) % 10).collect();
    (Tensor::from_vec(x, [128, 784]).expect("images"), Tensor::from_vec(y, [128]).expect("labels"))
}

/// Times `iters` train steps, each after dropping the in-memory programs.
fn time_after_clearing(t: &mut Trainer, x: &Tensor, y: &Tensor, iters: u64) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        kiln::clear_compile_cache();
        let start = Instant::now();
        t.train_step_on(x, y, 1e-3).expect("step");
        total += start.elapsed();
    }
    total
}

fn compile(c: &mut Criterion) {
    let cfg = MlpConfig::default();
    let mut t = Trainer::new(784, 10, &cfg).expect("trainer");
    let (x, y) = batch();
    let mut g = c.benchmark_group("compile/mlp train step");
    g.sample_size(10);

    kiln::set_disk_cache(None).expect("no disk cache");
    g.bench_function("cold compile", |b| b.iter_custom(|iters| time_after_clearing(&mut t, &x, &y, iters)));

    let dir = std::env::temp_dir().join(format!("kiln-bench-cache-{}", std::process::id()));
    kiln::set_disk_cache(Some(DiskCacheConfig { dir: dir.clone(), max_bytes: 1 << 30, read_only: false }))
        .expect("disk cache");
    t.train_step_on(&x, &y, 1e-3).expect("fill the disk cache");
    g.bench_function("warm from disk", |b| b.iter_custom(|iters| time_after_clearing(&mut t, &x, &y, iters)));

    g.bench_function("in-memory hit", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                t.train_step_on(&x, &y, 1e-3).expect("step");
            }
            start.elapsed()
        })
    });
    g.finish();
    let _ = std::fs::remove_dir_all(dir);
}

criterion_group!(benches, compile);
criterion_main!(benches);
