//! Host overhead of kiln's lazy-tensor path (BENCHMARKS.md targets):
//! - `trace/op`: recording one elementwise op (target ≤ 0.5 µs);
//! - `dispatch/chain1k`: a cache-hit `mark_step` of a 1000-node step, from the
//!   call to the plugin's execute, reported without the execute itself
//!   (target ≤ 30 µs), and the whole hit step with execute for reference.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::{metrics, DType, Tensor};

/// `chain1k`: ×1.0001, +0.001, tanh, −0.0005, repeated to 1000 ops.
fn chain(x: &Tensor) -> kiln::Result<Tensor> {
    let mut y = x.clone();
    for _ in 0..250 {
        y = y.mul_scalar(1.0001)?.add_scalar(0.001)?.tanh()?.add_scalar(-0.0005)?;
    }
    Ok(y)
}

fn trace(c: &mut Criterion) {
    let x = Tensor::from_vec(vec![0.5f32; 1024], [1024]).expect("input");
    c.bench_function("trace/1000 ops", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                let y = chain(&x).expect("trace");
                total += t.elapsed();
                drop(y);
                kiln::mark_step().expect("empty step");
            }
            total
        })
    });
}

fn dispatch(c: &mut Criterion) {
    let x = Tensor::from_vec((0..1024).map(|i| i as f32 / 1024.0).collect::<Vec<_>>(), [1024]).expect("input");
    let mut y = chain(&x).expect("trace");
    kiln::mark_step().expect("compile");
    c.bench_function("dispatch/chain1k hit, without execute", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                y = chain(&x).expect("trace");
                let before = metrics::snapshot().execute_time;
                let t = Instant::now();
                kiln::mark_step().expect("hit");
                let all = t.elapsed();
                total += all - (metrics::snapshot().execute_time - before);
            }
            total
        })
    });
    c.bench_function("dispatch/chain1k hit, with execute", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                y = chain(&x).expect("trace");
                let t = Instant::now();
                kiln::mark_step().expect("hit");
                total += t.elapsed();
            }
            total
        })
    });
    assert_eq!(y.dtype(), DType::F32);
    let m = metrics::snapshot();
    eprintln!("compiles {} cache hits {}", m.compiles, m.cache_hits);
}

criterion_group!(benches, trace, dispatch);
criterion_main!(benches);
