//! kiln's side of the device harness (`benches/device/run.sh`): the workloads
//! of `../shared/bench/peers.py`, timed the way it times its peers (warm-up,
//! then the median over `reps` of `iters` steps ended by a device sync).
//!
//! `device_bench [mlp | mlp64 | mlp4096] [chain] [gpt] [compile]` (all when none); prints one line
//! per figure and writes `$OUT/kiln.json` (when `OUT` is set) as a list of
//! `{work, system, ms, ...}` like the peers' `baseline.json`.

use std::time::{Duration, Instant};

use kiln::models::gpt::{Gpt, GptConfig};
use kiln::nn::{cross_entropy, Linear, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::{grad, metrics, DType, Tensor};
use serde_json::{json, Value};

#[path = "common/timing.rs"]
mod timing;
use timing::{bench, Res};

/// `extra` with the runs of [`bench`] added.
fn with_runs(mut extra: Value, runs: &[f64]) -> Value {
    extra["runs_ms"] = json!(runs.iter().map(|r| (r * 1e4).round() / 1e4).collect::<Vec<_>>());
    extra
}

struct Out(Vec<Value>);

impl Out {
    fn rec(&mut self, work: &str, system: &str, ms: f64, extra: Value) {
        println!("{work:14} {system:28} {ms:9.3} ms/step {extra}");
        let mut v = json!({"work": work, "system": system, "ms": ms});
        if let (Value::Object(m), Value::Object(e)) = (&mut v, extra) {
            m.extend(e);
        }
        self.0.push(v);
    }
}

/// Host time per step and device time per step of `n` calls of `f` run
/// synchronously (at most 0 steps in flight), from kiln's metrics.
fn phases(mut f: impl FnMut() -> Res<()>, n: usize) -> Res<Value> {
    kiln::set_max_steps_in_flight(0);
    f()?;
    let before = metrics::snapshot();
    let t = Instant::now();
    for _ in 0..n {
        f()?;
    }
    let wall = t.elapsed();
    let after = metrics::snapshot();
    kiln::set_max_steps_in_flight(2);
    let per = |d: Duration| d.as_secs_f64() * 1e3 / n as f64;
    let device = per(after.device_wait_time - before.device_wait_time) + per(after.execute_time - before.execute_time);
    Ok(json!({
        "sync_step_ms": per(wall),
        "sync_device_ms": device,
        "sync_host_ms": per(wall) - device,
    }))
}

struct Mlp {
    layers: Vec<Linear>,
    params: Vec<Tensor>,
    opt: AdamW,
}

fn mlp() -> Res<Mlp> {
    let mut ps = ParamStore::new(0);
    let sizes = [784, 4096, 4096, 10];
    let layers = (0..3)
        .map(|i| Linear::new(&mut ps, &format!("fc{i}"), sizes[i], sizes[i + 1], true))
        .collect::<Result<Vec<_>, _>>()?;
    let params = ps.tensors();
    let opt = AdamW::new(&params, AdamWConfig::default())?;
    Ok(Mlp { layers, params, opt })
}

fn mlp_step(m: &mut Mlp, inputs: &[Tensor]) -> kiln::Result<Vec<Tensor>> {
    let mut h = inputs[0].clone();
    for (i, l) in m.layers.iter().enumerate() {
        h = l.forward(&h)?;
        if i < 2 {
            h = h.relu()?;
        }
    }
    let loss = cross_entropy(&h, &inputs[1], None)?;
    let grads = grad(&loss, &m.params)?;
    m.opt.step_lr(&m.params, &grads, &inputs[2])?;
    Ok(vec![loss])
}

fn run_mlp(out: &mut Out, batch: usize) -> Res<()> {
    let work = format!("mlp-b{batch}");
    let x = Tensor::randn(DType::F32, [batch, 784])?;
    let y = Tensor::from_vec((0..batch).map(|i| (i * 7 % 10) as i32).collect::<Vec<_>>(), [batch])?;
    let lr = Tensor::scalar(1e-3f32);
    kiln::mark_step()?;
    let inputs = [x, y, lr];
    let mut m = mlp()?;
    let (ms, runs) = bench(
        || {
            mlp_step(&mut m, &inputs)?;
            kiln::mark_step()?;
            Ok(())
        },
        10,
        50,
        5,
    )?;
    let extra = phases(
        || {
            mlp_step(&mut m, &inputs)?;
            kiln::mark_step()?;
            Ok(())
        },
        20,
    )?;
    out.rec(&work, "kiln-traced", ms, with_runs(extra, &runs));
    let mut m = mlp()?;
    let mut step = kiln::compile_step(|i: &[Tensor]| mlp_step(&mut m, i));
    let (ms, runs) = bench(
        || {
            step.call(&inputs)?;
            Ok(())
        },
        10,
        50,
        5,
    )?;
    let extra = phases(
        || {
            step.call(&inputs)?;
            Ok(())
        },
        20,
    )?;
    out.rec(&work, "kiln-captured", ms, with_runs(extra, &runs));
    Ok(())
}

fn chain(x: &Tensor) -> kiln::Result<Tensor> {
    let mut y = x.clone();
    for _ in 0..250 {
        y = y.mul_scalar(1.0001)?.add_scalar(0.001)?.tanh()?.add_scalar(-0.0005)?;
    }
    Ok(y)
}

fn run_chain(out: &mut Out) -> Res<()> {
    let x = Tensor::randn(DType::F32, [1024])?;
    kiln::mark_step()?;
    let (ms, runs) = bench(
        || {
            let y = chain(&x)?;
            kiln::mark_step()?;
            drop(y);
            Ok(())
        },
        3,
        20,
        5,
    )?;
    out.rec("chain1k", "kiln-traced", ms, with_runs(json!({}), &runs));
    let inputs = [x];
    let mut step = kiln::compile_step(|i: &[Tensor]| Ok(vec![chain(&i[0])?]));
    let (ms, runs) = bench(
        || {
            step.call(&inputs)?;
            Ok(())
        },
        3,
        20,
        5,
    )?;
    let extra = phases(
        || {
            step.call(&inputs)?;
            Ok(())
        },
        20,
    )?;
    out.rec("chain1k", "kiln-captured", ms, with_runs(extra, &runs));
    Ok(())
}

/// gpt2-small bf16 (captured): timed into `out`, or, with `profile: Some(n)`,
/// `n` steps and nothing else (for a kernel profiler).
fn run_gpt(out: &mut Out, profile: Option<usize>) -> Res<()> {
    let cfg = GptConfig { amp: Some(DType::BF16), ..GptConfig::gpt2_small(50304) };
    let mut ps = ParamStore::new(0);
    let model = Gpt::new(&mut ps, &cfg)?;
    let params = ps.tensors();
    let mut opt = AdamW::new(&params, AdamWConfig { weight_decay: 0.1, ..Default::default() })?;
    let ids = |seed: usize| (0..cfg.batch * cfg.seq).map(|i| ((i * 7919 + seed) % 50257) as i32).collect::<Vec<_>>();
    let x = Tensor::from_vec(ids(1), [cfg.batch, cfg.seq])?;
    let y = Tensor::from_vec(ids(2), [cfg.batch * cfg.seq])?;
    let lr = Tensor::scalar(3e-4f32);
    kiln::mark_step()?;
    let inputs = [x, y, lr];
    let mut step = kiln::compile_step(|i: &[Tensor]| {
        let loss = kiln::amp::autocast(DType::BF16, || model.loss(&i[0], &i[1], true))?;
        let grads = grad(&loss, &params)?;
        opt.step_lr(&params, &grads, &i[2])?;
        Ok(vec![loss])
    });
    if let Some(n) = profile {
        for _ in 0..n {
            step.call(&inputs)?;
        }
        kiln::sync()?;
        println!("profile-gpt: {n} steps");
        return Ok(());
    }
    let t = Instant::now();
    step.call(&inputs)?;
    kiln::sync()?;
    let first = t.elapsed().as_secs_f64() * 1e3;
    let (ms, runs) = bench(
        || {
            step.call(&inputs)?;
            Ok(())
        },
        3,
        10,
        3,
    )?;
    let extra = phases(
        || {
            step.call(&inputs)?;
            Ok(())
        },
        5,
    )?;
    let mut extra = with_runs(extra, &runs);
    extra["first_step_ms"] = json!(first);
    out.rec("gpt2-small", "kiln-captured", ms, extra);
    Ok(())
}

fn run_compile(out: &mut Out) -> Res<()> {
    let dir = std::env::temp_dir().join(format!("kiln-device-bench-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    kiln::set_disk_cache(Some(kiln::runtime::DiskCacheConfig {
        dir: dir.clone(),
        max_bytes: 4 << 30,
        read_only: false,
    }))?;
    let x = Tensor::randn(DType::F32, [64, 784])?;
    let y = Tensor::from_vec((0..64i32).map(|i| i % 10).collect::<Vec<_>>(), [64])?;
    let lr = Tensor::scalar(1e-3f32);
    kiln::mark_step()?;
    let inputs = [x, y, lr];
    let mut m = mlp()?;
    kiln::set_max_steps_in_flight(0);
    let mut timed = |label: &str, out: &mut Out| -> Res<()> {
        let before = metrics::snapshot();
        let t = Instant::now();
        mlp_step(&mut m, &inputs)?;
        let r = kiln::mark_step()?;
        let wall = t.elapsed().as_secs_f64() * 1e3;
        let after = metrics::snapshot();
        let ms = |a: Duration, b: Duration| (a - b).as_secs_f64() * 1e3;
        let device = ms(after.execute_time, before.execute_time) + ms(after.device_wait_time, before.device_wait_time);
        // The figure is the step without its execution: what getting the
        // program cost (compile, disk load, or the in-memory lookup and trace).
        out.rec(
            "compile",
            label,
            wall - device,
            json!({
                "compiled": r.compiled,
                "step_ms": wall,
                "compile_ms": ms(after.compile_time, before.compile_time),
                "disk_load_ms": ms(after.disk_load_time, before.disk_load_time),
            }),
        );
        Ok(())
    };
    kiln::clear_compile_cache();
    timed("kiln-cold", out)?;
    kiln::clear_compile_cache();
    timed("kiln-warm-disk", out)?;
    timed("kiln-in-memory", out)?;
    kiln::set_max_steps_in_flight(2);
    let _ = std::fs::remove_dir_all(&dir);
    kiln::set_disk_cache(None)?;
    Ok(())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let want = |w: &str| args.is_empty() || args.iter().any(|a| a == w);
    let mut out = Out(Vec::new());
    let client = kiln::runtime::replica_plan_from_env()?.create_client()?;
    println!(
        "kiln on {} (PJRT C API {:?}); event functions: {:?}",
        client.platform_name(),
        client.api_version(),
        client.event_functions()
    );
    kiln::set_client(client);
    // `profile-mlp BATCH N` (`profile-mlp4096 N`: batch 4096): N captured
    // MLP steps and nothing else, for a kernel profiler (not part of the
    // default set).
    let profile_batch = match args.first().map(String::as_str) {
        Some("profile-mlp4096") => Some(4096),
        Some("profile-mlp") => Some(args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4096)),
        _ => None,
    };
    if let Some(batch) = profile_batch {
        let steps_arg = if args[0] == "profile-mlp" { 2 } else { 1 };
        let n: usize = args.get(steps_arg).and_then(|a| a.parse().ok()).unwrap_or(20);
        let x = Tensor::randn(DType::F32, [batch, 784])?;
        let y = Tensor::from_vec((0..batch).map(|i| (i * 7 % 10) as i32).collect::<Vec<_>>(), [batch])?;
        let inputs = [x, y, Tensor::scalar(1e-3f32)];
        kiln::mark_step()?;
        let mut m = mlp()?;
        let mut step = kiln::compile_step(|i: &[Tensor]| mlp_step(&mut m, i));
        for _ in 0..n {
            step.call(&inputs)?;
        }
        kiln::sync()?;
        println!("profile-mlp b{batch}: {n} steps");
        return Ok(());
    }
    // `profile-gpt N`: N captured gpt2-small steps and nothing else.
    if args.first().map(String::as_str) == Some("profile-gpt") {
        let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20);
        return run_gpt(&mut out, Some(n));
    }
    if want("compile") {
        run_compile(&mut out)?;
    }
    if want("mlp") || want("mlp64") {
        run_mlp(&mut out, 64)?;
    }
    if want("mlp") || want("mlp4096") {
        run_mlp(&mut out, 4096)?;
    }
    if want("chain") {
        run_chain(&mut out)?;
    }
    if want("gpt") {
        run_gpt(&mut out, None)?;
    }
    if let Some(dir) = std::env::var_os("OUT") {
        std::fs::write(std::path::Path::new(&dir).join("kiln.json"), serde_json::to_string_pretty(&out.0)?)?;
    }
    Ok(())
}
