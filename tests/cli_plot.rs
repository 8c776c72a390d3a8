//! `kiln train ... --log FILE` and `kiln plot`: a run's log holds one whole
//! JSON line per step and per evaluation, agreeing with the run's own report;
//! `kiln plot` draws one or several logs as one SVG, and refuses what it
//! cannot read or write before drawing anything.

#![allow(clippy::unwrap_used)] // Test helpers may unwrap (the workspace denies it in library code).

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn kiln() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.env("KILN_CACHE", "off").env_remove("KILN_CPU_DEVICES").env_remove("PJRT_DEVICE");
    cmd
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn refused(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn train_mlp(log: &Path, lr: &str) -> Value {
    let out = kiln()
        .args(["train", "mlp", "--epochs", "1", "--max-steps", "30", "--hidden", "16", "--json", "--lr", lr, "--log"])
        .arg(log)
        .output()
        .unwrap();
    serde_json::from_str(ok(&out).lines().last().unwrap()).unwrap()
}

#[test]
fn a_log_has_every_step_and_the_evaluation_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("fast.jsonl"), dir.path().join("slow.jsonl"));
    let report = train_mlp(&a, "2e-3");
    let log = lines(&a);
    let steps: Vec<&Value> = log.iter().filter(|v| v["kind"] == "step").collect();
    assert_eq!(steps.len(), 30);
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"], i as u64 + 1);
        assert_eq!(s["loss"], report["losses"][i], "step {}", i + 1);
        assert!(s["lr"].as_f64().unwrap() > 0.0 && s["step_ms"].as_f64().unwrap() > 0.0, "{s}");
        assert!(s["examples_per_second"].as_f64().unwrap() > 0.0, "{s}");
    }
    // The schedule's rates: at most --lr, decaying to the last step.
    let lrs: Vec<f64> = steps.iter().map(|s| s["lr"].as_f64().unwrap()).collect();
    let peak = lrs.iter().copied().fold(0.0, f64::max);
    assert!((peak - 2e-3).abs() < 1e-9 && lrs[29] < peak / 2.0, "{lrs:?}");
    let eval = log.last().unwrap();
    assert_eq!(
        (&eval["kind"], &eval["step"], &eval["test_accuracy"]),
        (&"eval".into(), &30.into(), &report["test_accuracy"])
    );
    train_mlp(&b, "5e-4");

    let svg = dir.path().join("curves.svg");
    let out = kiln().arg("plot").args([&a, &b]).arg("-o").arg(&svg).output().unwrap();
    assert!(ok(&out).contains("2 run(s), 3 panel(s)"));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..80.min(text.len())]);
    for said in ["training loss", "throughput", "evaluation: test_accuracy", "fast", "slow"] {
        assert!(text.contains(said), "{said}");
    }
}

#[test]
fn a_gpt_log_counts_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("gpt.jsonl");
    let out = kiln()
        .args(["train", "gpt", "--text", "/usr/share/common-licenses/Apache-2.0", "--steps", "4", "--log"])
        .arg(&log)
        .output()
        .unwrap();
    ok(&out);
    let steps = lines(&log);
    assert_eq!(steps.len(), 4);
    assert!(steps.iter().all(|s| s["tokens_per_second"].as_f64().is_some_and(|t| t > 0.0)), "{steps:?}");
}

#[test]
fn bad_logs_and_destinations_are_refused_before_anything_is_drawn_or_trained() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("c.svg");
    std::fs::write(&svg, "before").unwrap();
    let garbage = dir.path().join("notes.jsonl");
    std::fs::write(&garbage, "{\"kind\":\"step\",\"step\":1,\"loss\":2.0}\nnot json\n").unwrap();
    let err = refused(&kiln().arg("plot").arg(&garbage).arg("-o").arg(&svg).output().unwrap());
    assert!(err.contains("notes.jsonl:2: not a JSON object"), "{err}");
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let err = refused(&kiln().arg("plot").arg(&empty).arg("-o").arg(&svg).output().unwrap());
    assert!(err.contains("no step line"), "{err}");
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), "before", "a refused plot touched -o");
    let good = dir.path().join("good.jsonl");
    std::fs::write(&good, "{\"kind\":\"step\",\"step\":1,\"loss\":2.0}\n{\"kind\":\"step\",\"step\":2,\"loss\":1.5}\n")
        .unwrap();
    let err = refused(&kiln().arg("plot").arg(&good).args(["-o", "/sys/kernel/c.svg"]).output().unwrap());
    assert!(err.contains("no file can be written"), "{err}");
    // An unwritable log fails the run before it trains.
    for bad in [dir.path().to_path_buf(), "/sys/kernel/run.jsonl".into()] {
        let t = std::time::Instant::now();
        let err = refused(&kiln().args(["train", "mlp", "--epochs", "1", "--log"]).arg(&bad).output().unwrap());
        assert!(err.contains("--log"), "{err}");
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "{:?}", t.elapsed());
    }
}
