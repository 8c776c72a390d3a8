//! Cost of the device-side checks (`KILN_DEVICE_CHECKS`, on by default) and of
//! anomaly mode on the Fashion-MNIST MLP's training step (784-256-128-10,
//! batch 128, AdamW) on the CPU plugin: the whole step (record, cache hit,
//! execute, read the loss) with checks off, on, and in anomaly mode. Before the
//! timings it prints each program's size: nodes after pruning, and the ops of
//! the optimized, lowered StableHLO.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::models::mlp::{MlpConfig, Trainer};
use kiln::Tensor;

fn batch() -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..128 * 784).map(|i| ((i * 7919) % 1000) as f32 / 1000.0).collect();
    let y: Vec<i32> = (0..128).map(|i| (i * 7) % 10).collect();
    (Tensor::from_vec(x, [128, 784]).expect("images"), Tensor::from_vec(y, [128]).expect("labels"))
}

#[derive(Clone, Copy)]
enum Mode {
    Off,
    On,
    Anomaly,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Off => "checks off",
            Mode::On => "checks on",
            Mode::Anomaly => "checks on + anomaly mode",
        }
    }

    fn set(self) {
        kiln::set_device_checks(!matches!(self, Mode::Off));
        kiln::set_detect_anomaly(matches!(self, Mode::Anomaly));
    }
}

/// CPU time of this process, all threads, in clock ticks (`/proc/self/stat`
/// utime + stime): less sensitive than wall time to other processes' load.
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit(')').next().unwrap_or_default();
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command name: state is field 3, utime 14, stime 15.
    f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
}

fn files(dir: &Path) -> BTreeSet<std::path::PathBuf> {
    std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
}

/// StableHLO ops of the optimized program of a saved graph.
fn lowered_ops(path: &Path) -> usize {
    let g = kiln_compiler::text::parse(&std::fs::read_to_string(path).expect("saved graph")).expect("parse");
    let (opt, _) = kiln_compiler::pipeline::optimize(&g).expect("optimize");
    let text = kiln_compiler::lower(&opt, &kiln_compiler::LowerOptions::default()).expect("lower");
    text.lines().filter(|l| l.contains("stablehlo.") && !l.contains("stablehlo.return")).count()
}

fn steps(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("kiln-bench-checks-{}", std::process::id()));
    // Read once per thread, on the first step that compiles.
    std::env::set_var("KILN_SAVE_GRAPHS", &dir);
    kiln::set_disk_cache(None).expect("no disk cache");
    let (x, y) = batch();
    let modes = [Mode::Off, Mode::On, Mode::Anomaly];
    let mut trainers: Vec<Trainer> = Vec::new();
    for mode in modes {
        mode.set();
        let mut t = Trainer::new(784, 10, &MlpConfig::default()).expect("trainer");
        let before = files(&dir);
        t.train_step_on(&x, &y, 1e-3).expect("first step");
        let new: Vec<_> = files(&dir).difference(&before).cloned().collect();
        let report = {
            let loss = kiln::nn::cross_entropy(&t.model.forward(&x).expect("forward"), &y, None).expect("loss");
            let r = kiln::mark_step().expect("forward step");
            drop(loss);
            r
        };
        let ops: Vec<usize> = new.iter().map(|p| lowered_ops(p)).collect();
        eprintln!(
            "{}: train step program {:?} StableHLO ops (optimized); forward-only step {} nodes, {} outputs",
            mode.name(),
            ops,
            report.nodes,
            report.outputs
        );
        trainers.push(t);
    }
    // Interleaved rounds (one step of each mode per round, the order rotating
    // every round), so load from other processes and cache effects fall on
    // every mode alike: median and lower decile of the whole step, and median
    // of the step without the plugin's execute (kiln's host work).
    let rounds = 600;
    let mut step_ms = vec![Vec::with_capacity(rounds); modes.len()];
    let mut host_ms = vec![Vec::with_capacity(rounds); modes.len()];
    let mut ticks = vec![0u64; modes.len()];
    for round in 0..rounds {
        for k in 0..modes.len() {
            let i = (round + k) % modes.len();
            modes[i].set();
            let before = kiln::metrics::snapshot().execute_time;
            let (start, cpu) = (Instant::now(), cpu_ticks());
            trainers[i].train_step_on(&x, &y, 1e-3).expect("step");
            let all = start.elapsed();
            ticks[i] += cpu_ticks() - cpu;
            step_ms[i].push(all.as_secs_f64() * 1e3);
            host_ms[i].push((all - (kiln::metrics::snapshot().execute_time - before)).as_secs_f64() * 1e3);
        }
    }
    for (i, mode) in modes.into_iter().enumerate() {
        let mut sorted = step_ms[i].clone();
        sorted.sort_by(f64::total_cmp);
        eprintln!(
            "interleaved, {rounds} rounds: {}: step median {:.3} ms, p10 {:.3} ms; without execute median {:.3} ms; \
             CPU time {:.2} ms per step (all threads)",
            mode.name(),
            kiln::models::mlp::median(&step_ms[i]),
            sorted[rounds / 10],
            kiln::models::mlp::median(&host_ms[i]),
            ticks[i] as f64 * 10.0 / rounds as f64
        );
    }
    // kiln's own time in the checks (sealing the trace, reading the flags),
    // from the step timeline, beside the read of the loss.
    for (i, mode) in modes.into_iter().enumerate() {
        mode.set();
        kiln::metrics::start_timeline();
        for _ in 0..300 {
            trainers[i].train_step_on(&x, &y, 1e-3).expect("step");
        }
        let events = kiln::metrics::take_timeline();
        let per_step = |name: &str| -> f64 {
            let mut by_step = std::collections::BTreeMap::<u64, f64>::new();
            for e in events.iter().filter(|e| e.name == name) {
                *by_step.entry(e.step).or_default() += e.duration.as_secs_f64() * 1e6;
            }
            kiln::models::mlp::median(&by_step.into_values().collect::<Vec<_>>())
        };
        eprintln!(
            "timeline, 300 steps: {}: median per step: device_checks (seal) {:.1} µs, device_checks_read {:.1} µs, \
             execute {:.1} µs, download (the loss) {:.1} µs",
            mode.name(),
            per_step("device_checks"),
            per_step("device_checks_read"),
            per_step("execute"),
            per_step("download")
        );
    }
    let mut g = c.benchmark_group("device_checks/mlp train step");
    for (mode, t) in modes.into_iter().zip(trainers.iter_mut()) {
        mode.set();
        g.bench_function(mode.name(), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    t.train_step_on(&x, &y, 1e-3).expect("step");
                }
                start.elapsed()
            })
        });
    }
    g.finish();
    let _ = std::fs::remove_dir_all(dir);
}

criterion_group!(benches, steps);
criterion_main!(benches);
