//! Host cost of a step of a model written as users write it (issue 59): a
//! 12-layer grouped-query decoder (`kiln_models::llama`, width 768, 12/4
//! heads, a 32k vocabulary, seq 1024, batch 8) recorded in plain ops and
//! with kiln's built-in calls. Per spelling, criterion times:
//! - `record`: the forward and the loss recorded into a trace;
//! - `grad`: `kiln::grad`, the composite search included (steady state: the
//!   constants it evaluates are cached from the first step);
//! - `hit`: a cache-hit `mark_step` of the same structure at small sizes (a
//!   12-layer decoder of width 64: the same nodes, cheap to run), without
//!   the plugin's execute and the time blocked on the device: closing the
//!   trace, its key, the lookup, the uploads.
//!
//! Each also prints host µs per recorded op (`RESULT {json}` lines), the
//! figures `benches/RESULTS.md` keeps.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::nn::{Module, ParamStore};
use kiln::{metrics, Tensor};
use kiln_models::llama::{Llama, LlamaConfig};
use kiln_models::Spelling;

const BATCH: usize = 8;
const SEQ: usize = 1024;

fn batch(cfg: &LlamaConfig, b: usize, t: usize) -> (Tensor, Tensor) {
    let ids = |s: usize| (0..b * t).map(|i| ((i * 7919 + s) % cfg.vocab) as i32).collect::<Vec<_>>();
    (Tensor::from_vec(ids(1), [b, t]).expect("ids"), Tensor::from_vec(ids(2), [b * t]).expect("targets"))
}

/// The shapes of [`LlamaConfig::llama_110m`] on small sizes: the same nodes.
fn small() -> LlamaConfig {
    LlamaConfig { vocab: 512, dim: 96, ffn: 128, ..LlamaConfig::llama_110m() }
}

fn report(what: &str, spelling: Spelling, per_iter: Duration, ops: u64) {
    let us = per_iter.as_secs_f64() * 1e6;
    println!(
        "RESULT {{\"what\": \"{what}\", \"spelling\": \"{}\", \"us\": {us:.1}, \"ops\": {ops}, \"us_per_op\": {:.3}}}",
        spelling.name(),
        us / ops.max(1) as f64
    );
}

fn record_and_grad(c: &mut Criterion) {
    let cfg = LlamaConfig::llama_110m();
    let mut group = c.benchmark_group("decoder 12 layers");
    group.sample_size(10);
    for spelling in Spelling::ALL {
        let mut ps = ParamStore::new(0);
        let model = Llama::new(&mut ps, cfg, spelling).expect("model");
        let params = model.parameters();
        let (ids, targets) = batch(&cfg, BATCH, SEQ);
        // One step's search first: it fills the cache of evaluated constants.
        let loss = model.loss(&ids, &targets).expect("record");
        let t = Instant::now();
        drop(kiln::grad(&loss, &params).expect("grad"));
        report("first grad", spelling, t.elapsed(), 1);
        drop(loss);
        kiln::mark_step().expect("nothing to run");
        let (mut ops, mut last) = ((0, 0), (Duration::ZERO, Duration::ZERO));
        group.bench_function(format!("record/{}", spelling.name()), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let before = metrics::snapshot().ops_recorded;
                    let t = Instant::now();
                    let loss = model.loss(&ids, &targets).expect("record");
                    total += t.elapsed();
                    ops.0 = metrics::snapshot().ops_recorded - before;
                    drop(loss);
                    kiln::mark_step().expect("nothing to run");
                }
                last.0 = total / iters as u32;
                total
            })
        });
        group.bench_function(format!("grad/{}", spelling.name()), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let loss = model.loss(&ids, &targets).expect("record");
                    let before = metrics::snapshot().ops_recorded;
                    let t = Instant::now();
                    let grads = kiln::grad(&loss, &params).expect("grad");
                    total += t.elapsed();
                    ops.1 = metrics::snapshot().ops_recorded - before;
                    drop((loss, grads));
                    kiln::mark_step().expect("nothing to run");
                }
                last.1 = total / iters as u32;
                total
            })
        });
        report("record", spelling, last.0, ops.0);
        report("grad", spelling, last.1, ops.0 + ops.1);
    }
    group.finish();
}

fn hit(c: &mut Criterion) {
    let cfg = small();
    let mut group = c.benchmark_group("decoder 12 layers, small sizes");
    group.sample_size(10);
    for spelling in Spelling::ALL {
        let mut ps = ParamStore::new(0);
        let model = Llama::new(&mut ps, cfg, spelling).expect("model");
        let params = model.parameters();
        let (ids, targets) = batch(&cfg, 2, 32);
        let step = || -> kiln::Result<(Tensor, Vec<Tensor>, u64)> {
            let before = metrics::snapshot().ops_recorded;
            let loss = model.loss(&ids, &targets)?;
            let grads = kiln::grad(&loss, &params)?;
            Ok((loss, grads, metrics::snapshot().ops_recorded - before))
        };
        let (l, g, _) = step().expect("step");
        kiln::mark_step().expect("compile");
        drop((l, g));
        let (mut ops, mut last) = (0, Duration::ZERO);
        group.bench_function(format!("hit/{}", spelling.name()), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let (l, g, n) = step().expect("step");
                    ops = n;
                    let before = metrics::snapshot();
                    let t = Instant::now();
                    kiln::mark_step().expect("hit");
                    let all = t.elapsed();
                    let after = metrics::snapshot();
                    total += all
                        - (after.execute_time - before.execute_time)
                        - (after.device_wait_time - before.device_wait_time);
                    drop((l, g));
                }
                last = total / iters as u32;
                total
            })
        });
        report("hit", spelling, last, ops);
        let m = metrics::snapshot();
        assert!(m.compiles >= 1 && m.cache_hits >= 1, "compiles {} hits {}", m.compiles, m.cache_hits);
    }
    group.finish();
}

criterion_group!(benches, record_and_grad, hit);
criterion_main!(benches);
