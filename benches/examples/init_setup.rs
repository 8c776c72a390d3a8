//! Set-up time of a model's parameters: host init against the init program.
//!
//! `init_setup [tiny|gpt2-small]...` (both when none). For each config, one
//! process, with the disk cache the environment sets (`KILN_CACHE=off`: a
//! cold compile; a filled `KILN_CACHE_DIR`: a disk hit):
//! - `host`: the parameters as host data, then the upload the first step
//!   would do (a step moving each parameter to the devices, its compile
//!   excluded);
//! - `device cold`: recording the init program, compiling it, running it to
//!   completion (`kiln::sync`);
//! - `device warm`: the same with another seed (the program in memory): what
//!   every later model of the same structure, or a disk-cache hit, pays.
//!
//! The init program's form is `KILN_INIT_FORM` (`flat` by default, or
//! `per-parameter`), its shifts `KILN_INIT_SHIFTS` (`input` by default,
//! `constant`, `divide`). Before anything, a trivial program (one add) is
//! compiled and run: its compile is the plugin's fixed cost of a cold
//! compile, the floor; its compile + run + read also pays what the client
//! does once (the CUDA plugin reserves its memory pool at the first
//! allocation), which a second trivial program shows by difference.
//!
//! `init_setup --compare [tiny|gpt2-small]`: runs the init program in both
//! forms and compares every parameter with host init for the same seed
//! (elements that differ, and the largest difference in f32 ulps).
//!
//! Prints one line per figure and writes `$OUT/init_setup.json` (or
//! `$OUT/init_compare.json`) when `OUT` is set.

use std::time::Instant;

use kiln::models::gpt::{Gpt, GptConfig};
use kiln::nn::{InitForm, InitPlacement, ParamStore};
use kiln::{metrics, Tensor};
use serde_json::json;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn build(seed: u64, placement: InitPlacement, cfg: &GptConfig) -> Res<(ParamStore, f64, f64)> {
    let t = Instant::now();
    let mut ps = ParamStore::with_placement(seed, placement);
    Gpt::new(&mut ps, cfg)?;
    let recorded = t.elapsed().as_secs_f64() * 1e3;
    ps.materialize()?;
    kiln::sync()?;
    Ok((ps, recorded, t.elapsed().as_secs_f64() * 1e3))
}

fn config(name: &str) -> Res<GptConfig> {
    match name {
        "tiny" => Ok(GptConfig::tiny(65)),
        "gpt2-small" => Ok(GptConfig::gpt2_small(50304)),
        other => Err(format!("unknown config {other}: tiny or gpt2-small").into()),
    }
}

/// Every parameter as f32 bits, in store order.
fn bits(ps: &ParamStore) -> Res<Vec<(String, Vec<u32>)>> {
    ps.iter().map(|(n, t)| Ok((n.to_string(), t.to_vec::<f32>()?.into_iter().map(f32::to_bits).collect()))).collect()
}

/// Host init against the init program in both forms, element by element.
fn compare(name: &str) -> Res<()> {
    let cfg = config(name)?;
    let seed = 1;
    let mut host = ParamStore::with_placement(seed, InitPlacement::Host);
    Gpt::new(&mut host, &cfg)?;
    let want = bits(&host)?;
    drop(host);
    let mut out = Vec::new();
    for (form, label) in [(InitForm::Flat, "flat"), (InitForm::PerParameter, "per-parameter")] {
        let mut ps = ParamStore::with_placement(seed, InitPlacement::Device);
        ps.set_init_form(form);
        Gpt::new(&mut ps, &cfg)?;
        ps.materialize()?;
        let got = bits(&ps)?;
        drop(ps);
        let (mut elements, mut differ, mut max_ulps, mut worst) = (0usize, 0usize, 0u32, String::new());
        for ((wn, w), (gn, g)) in want.iter().zip(&got) {
            if wn != gn || w.len() != g.len() {
                return Err(format!("parameter lists differ at {wn} / {gn}").into());
            }
            elements += w.len();
            for (a, b) in w.iter().zip(g) {
                if a != b {
                    differ += 1;
                    // Sign-magnitude bits: for values of one sign the bit
                    // distance is the ulp distance; a sign flip counts as huge.
                    let ulps = if (a ^ b) >> 31 == 0 { a.abs_diff(*b) } else { u32::MAX };
                    if ulps > max_ulps {
                        max_ulps = ulps;
                        worst = wn.clone();
                    }
                }
            }
        }
        println!(
            "compare {name} seed {seed} {label:13}: {differ} of {elements} elements differ from host init, \
             max {max_ulps} ulp{}",
            if worst.is_empty() { String::new() } else { format!(" (in {worst})") }
        );
        out.push(json!({"config": name, "seed": seed, "form": label, "elements": elements, "differ": differ, "max_ulps": max_ulps, "worst": worst}));
    }
    if let Some(dir) = std::env::var_os("OUT") {
        std::fs::write(std::path::Path::new(&dir).join("init_compare.json"), serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}

fn main() -> Res<()> {
    // The client exists before anything is timed (its creation, with the
    // plugin's start, is not set-up of the model); this first program's
    // compile is the floor of any cold compile.
    let m = metrics::snapshot();
    let t = Instant::now();
    let one = Tensor::scalar(1f32).add_scalar(1.0)?;
    kiln::mark_step()?;
    let enqueued_ms = t.elapsed().as_secs_f64() * 1e3;
    one.item()?;
    let first_ms = t.elapsed().as_secs_f64() * 1e3;
    let floor_ms = (metrics::snapshot().compile_time - m.compile_time).as_secs_f64() * 1e3;
    println!(
        "trivial program (one add): compile {floor_ms:.1} ms; compile + run + read {first_ms:.1} ms (enqueued after {enqueued_ms:.1})"
    );
    // A second new program on the same client: what the first one paid once
    // for the client (its first compile, its first execution) shows as the
    // difference.
    let t = Instant::now();
    let two = Tensor::scalar(2f32).mul_scalar(3.0)?;
    kiln::mark_step()?;
    two.item()?;
    println!("second trivial program (one multiply): compile + run + read {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    let mut names: Vec<String> = std::env::args().skip(1).collect();
    if names.first().map(String::as_str) == Some("--lower") {
        // The init program's StableHLO text in both forms, and the time kiln
        // takes to record, optimize and lower it (no compile).
        let dir = std::env::var_os("OUT").map(std::path::PathBuf::from).unwrap_or_else(|| ".".into());
        for name in names.iter().skip(1) {
            let cfg = config(name)?;
            for (form, label) in [(InitForm::Flat, "flat"), (InitForm::PerParameter, "per-parameter")] {
                let t = Instant::now();
                let text = kiln::lower(|| {
                    let mut ps = ParamStore::with_placement(1, InitPlacement::Device);
                    ps.set_init_form(form);
                    Gpt::new(&mut ps, &cfg)?;
                    ps.prepare_init()?;
                    Ok(ps.tensors())
                })?;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let path = dir.join(format!("init_{name}_{label}.mlir"));
                std::fs::write(&path, &text)?;
                println!("lower {name} {label}: {ms:.1} ms, {} bytes -> {}", text.len(), path.display());
            }
        }
        return Ok(());
    }
    if names.first().map(String::as_str) == Some("--compare") {
        for name in names.iter().skip(1) {
            compare(name)?;
        }
        return Ok(());
    }
    if names.is_empty() {
        names = vec!["tiny".into(), "gpt2-small".into()];
    }
    let form = std::env::var(kiln::nn::ENV_INIT_FORM).unwrap_or_else(|_| "flat".into());
    let mut out = Vec::new();
    for name in &names {
        let cfg = config(name)?;
        let (host, _, host_ms) = build(1, InitPlacement::Host, &cfg)?;
        let elements = host.num_elements();
        // What the first step adds for host data: the upload, measured as a
        // step that only moves each parameter onto the devices (x + 0), less
        // that step's compile.
        let m = metrics::snapshot();
        let t = Instant::now();
        for (_, p) in host.iter() {
            p.assign(&p.add_scalar(0.0)?)?;
        }
        kiln::mark_step()?;
        kiln::sync()?;
        let upload_compile_ms = (metrics::snapshot().compile_time - m.compile_time).as_secs_f64() * 1e3;
        let upload_ms = t.elapsed().as_secs_f64() * 1e3 - upload_compile_ms;
        drop(host);
        let m0 = metrics::snapshot();
        let (cold, record_ms, cold_ms) = build(1, InitPlacement::Device, &cfg)?;
        let m1 = metrics::snapshot();
        drop(cold);
        let (warm, _, warm_ms) = build(2, InitPlacement::Device, &cfg)?;
        drop(warm);
        let compile_ms = (m1.compile_time - m0.compile_time).as_secs_f64() * 1e3;
        let disk_hits = m1.disk_hits - m0.disk_hits;
        println!(
            "{name:11} ({form}) {elements:>11} params  host {host_ms:9.1} ms + upload {upload_ms:.1} ms  device cold \
             {cold_ms:9.1} ms (record {record_ms:.1}, compile {compile_ms:.1}, disk hits {disk_hits})  device warm {warm_ms:9.1} ms"
        );
        out.push(json!({
            "config": name, "form": form, "floor_compile_ms": floor_ms, "params": elements, "host_ms": host_ms, "host_upload_ms": upload_ms,
            "device_cold_ms": cold_ms,
            "device_record_ms": record_ms, "device_compile_ms": compile_ms, "device_disk_hits": disk_hits, "device_warm_ms": warm_ms,
        }));
    }
    if let Some(dir) = std::env::var_os("OUT") {
        std::fs::write(std::path::Path::new(&dir).join("init_setup.json"), serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}
