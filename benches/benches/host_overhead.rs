//! Host overhead of kiln's lazy-tensor path (targets: `benches/RESULTS.md`, "kiln's targets"):
//! - `trace/op`: recording one elementwise op (target ≤ 0.5 µs);
//! - `dispatch/chain1k`: a cache-hit `mark_step` of a 1000-node step, from the
//!   call to the plugin's execute, reported without the execute itself
//!   (target ≤ 30 µs), and the whole hit step with execute for reference;
//! - `capture/chain1k`: a call of the captured chain (`kiln::compile_step`),
//!   which records nothing, reported without the plugin's execute call and
//!   without time blocked on the device (target ≤ 15 µs), and whole.

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
                let before = metrics::snapshot();
                let t = Instant::now();
                kiln::mark_step().expect("hit");
                let all = t.elapsed();
                let after = metrics::snapshot();
                // Steps are asynchronous: the bound on steps in flight may wait
                // for an earlier step, which is device time, not dispatch.
                total += all
                    - (after.execute_time - before.execute_time)
                    - (after.device_wait_time - before.device_wait_time);
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

fn capture(c: &mut Criterion) {
    let x = Tensor::from_vec((0..1024).map(|i| i as f32 / 1024.0).collect::<Vec<_>>(), [1024]).expect("input");
    let mut step = kiln::compile_step(|inputs: &[Tensor]| Ok(vec![chain(&inputs[0])?]));
    let inputs = [x];
    step.call(&inputs).expect("trace");
    c.bench_function("capture/chain1k call, host only", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let before = metrics::snapshot();
                let t = Instant::now();
                let out = step.call(&inputs).expect("replay");
                let all = t.elapsed();
                drop(out);
                let after = metrics::snapshot();
                total += all
                    - (after.execute_time - before.execute_time)
                    - (after.device_wait_time - before.device_wait_time);
            }
            total
        })
    });
    c.bench_function("capture/chain1k call, whole", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                drop(step.call(&inputs).expect("replay"));
            }
            kiln::sync().expect("sync");
            t.elapsed()
        })
    });
    assert_eq!(step.traces(), 1, "{:?}", step.last_retrace());
}

criterion_group!(benches, trace, dispatch, capture);
criterion_main!(benches);
