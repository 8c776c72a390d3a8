//! `kiln train gpt --memory-limit N%` on the CPU plugin: N% of the step's
//! activation memory (docs/memory.md). The planned step trains the same
//! losses as the unplanned one and XLA's temp bytes drop; bad percentages are
//! named.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use assert_cmd::Command;
use serde_json::Value;

/// `kiln` with the compile cache off, so every run compiles (and plans).
fn kiln() -> Command {
    let mut cmd = Command::cargo_bin("kiln").unwrap();
    cmd.env("KILN_CACHE", "off");
    cmd
}

/// Runs `cmd`, which must succeed, and returns its stderr (the warnings).
fn stderr_of_success(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    err
}

fn train(text: &std::path::Path, limit: Option<&str>) -> Value {
    let mut cmd = kiln();
    cmd.args(["train", "gpt", "--config", "tiny", "--steps", "3", "--json", "--text"]).arg(text);
    if let Some(l) = limit {
        cmd.args(["--memory-limit", l]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn text_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let path = dir.path().join("text.txt");
    let text: String = (0..4000).map(|i| (b'a' + ((i * 7 + i / 13) % 23) as u8) as char).collect();
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn half_the_activation_memory_trains_the_same_losses_with_fewer_temp_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let text = text_file(&dir);
    let plain = train(&text, None);
    let half = train(&text, Some("50%"));
    let losses =
        |v: &Value| -> Vec<f64> { v["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect() };
    let (a, b) = (losses(&plain), losses(&half));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "losses {a:?} vs {b:?}");
    }
    let temp = |v: &Value| v["device_memory"]["temp_bytes"].as_i64().unwrap();
    assert!(temp(&half) < temp(&plain), "XLA temp bytes {} planned vs {} unplanned", temp(&half), temp(&plain));
    // The JSON reports the train step's plan, and no plan without a limit.
    assert!(plain["remat"].is_null(), "{}", plain["remat"]);
    let r = &half["remat"];
    assert_eq!(r["met"], true, "{r}");
    assert!(r["values_recomputed"].as_u64().unwrap() > 0 && r["extra_flops"].as_u64().unwrap() > 0, "{r}");
    let (before, after) =
        (r["predicted_peak_bytes_before"].as_u64().unwrap(), r["predicted_peak_bytes_after"].as_u64().unwrap());
    assert!(after < before && after <= r["budget_bytes"].as_u64().unwrap(), "{r}");
    // 50% of the live temporaries is what the peak gave up.
    let live = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k}: {r}"));
    let (live_before, live_after) = (live("predicted_live_temp_bytes_before"), live("predicted_live_temp_bytes_after"));
    assert!(live_after < live_before && (before - after) * 2 >= live_before, "{r}");
}

/// With the parameters initialised on the device, their init is a program of
/// its own, with nothing kept for a backward. A percentage of the activation
/// memory names the training steps' working sets, so the init is not warned
/// about under one (a user on a GPU saw only a warning that the limit was not
/// met, about a program they never wrote); a byte limit the init exceeds is
/// reported, naming it. The text summary reports the train step's plan.
#[test]
fn the_init_program_is_named_and_a_percentage_leaves_it_unreported() {
    let dir = tempfile::tempdir().unwrap();
    let text = text_file(&dir);
    let run = |limit: &str| {
        let out = kiln()
            .env("KILN_INIT", "device")
            .args(["train", "gpt", "--config", "tiny", "--steps", "1", "--memory-limit", limit, "--text"])
            .arg(&text)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        (String::from_utf8_lossy(&out.stdout).into_owned(), err)
    };
    let (out, err) = run("50%");
    assert!(!err.contains("not met"), "the train step meets 50% and the init is not reported: {err}");
    let line = out.lines().find(|l| l.starts_with("remat: ")).unwrap_or_else(|| panic!("no remat line: {out}"));
    assert!(line.contains("50% of the activation memory) met: ") && line.contains("value(s) recomputed"), "{line}");
    // Beside the plan, what XLA compiled of it.
    let xla = out.lines().find(|l| l.starts_with("xla: ")).unwrap_or_else(|| panic!("no xla line: {out}"));
    assert!(xla.contains("the compiled step holds ") && xla.contains(" MiB of it temporaries"), "{xla}");
    let (_, err) = run("1KiB");
    let init: Vec<&str> = err.lines().filter(|l| l.contains("(the parameters' init, ")).collect();
    assert_eq!(init.len(), 1, "{err}");
    assert!(init[0].contains("memory limit 1024 B not met by rematerialization"), "{}", init[0]);
}

#[test]
fn a_percentage_outside_the_range_or_a_bare_fraction_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let text = text_file(&dir);
    let cases = [
        ("0%", "must be in (0, 100]"),
        ("150%", "must be in (0, 100]"),
        ("half%", "not a percentage"),
        // The library's fraction, which as bytes would round down to 0.
        ("0.5", "write 50%"),
    ];
    for (limit, says) in cases {
        let out = kiln()
            .args(["train", "gpt", "--config", "tiny", "--steps", "1", "--memory-limit", limit, "--text"])
            .arg(&text)
            .output()
            .unwrap();
        assert!(!out.status.success(), "--memory-limit {limit} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(limit.trim_end_matches('%')) && err.contains(says), "{limit}: {err}");
    }
}

#[test]
fn a_limit_remat_cannot_meet_trains_with_the_lowest_peak_plan_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let text = text_file(&dir);
    let err = stderr_of_success(
        kiln()
            .env("KILN_SAVE_GRAPHS", dir.path().join("graphs"))
            .args(["train", "gpt", "--config", "tiny", "--steps", "1", "--json", "--memory-limit", "1KiB", "--text"])
            .arg(&text),
    );
    assert!(err.contains("memory limit 1024 B not met") && err.contains("lowest-peak plan"), "{err}");
    // The warning names the program as KILN_SAVE_GRAPHS names its file.
    let at = err.find("in program step-").expect("the warning names its program") + "in program ".len();
    let name = &err[at..at + "step-".len() + 16];
    assert!(dir.path().join("graphs").join(format!("{name}.kiln")).is_file(), "{name}: {err}");
}

/// Limits the MLP's programs cannot meet, where greedy recomputes nothing:
/// the warnings say why, not just "0 values". The train step's peak is past
/// the values it keeps; the evaluation program keeps none, so under a
/// percentage of the activation memory it is not reported (a budget that
/// names the steps' saved activations means nothing for it), and under a byte
/// limit it is, saying there is nothing to recompute.
#[test]
fn a_limit_where_nothing_is_recomputed_says_why() {
    let warnings = |limit: &str| -> Vec<String> {
        let args = ["train", "mlp", "--epochs", "1", "--max-steps", "2", "--json", "--memory-limit", limit];
        let err = stderr_of_success(kiln().args(args));
        err.lines().filter(|l| l.contains("not met by rematerialization")).map(str::to_string).collect()
    };
    let peak_past = "0 value(s) recomputed); no recomputation found lowers this program's peak";
    let nothing_kept = "0 value(s) recomputed); the program keeps no values for a backward";
    let percentage = warnings("50%");
    assert_eq!(percentage.len(), 1, "{percentage:#?}");
    assert!(
        percentage[0].contains(peak_past) && percentage[0].contains("50% of its activation memory"),
        "{percentage:#?}"
    );
    let bytes = warnings("5MiB");
    assert_eq!(bytes.len(), 2, "{bytes:#?}");
    assert_eq!(bytes.iter().filter(|w| w.contains(peak_past)).count(), 1, "{bytes:#?}");
    assert_eq!(bytes.iter().filter(|w| w.contains(nothing_kept)).count(), 1, "{bytes:#?}");
}

/// A byte limit the plan meets in live bytes while XLA's compiled program
/// holds more (on the CPU plugin every output has an allocation of its own
/// for the whole run): the run trains and says so, with XLA's figures.
#[test]
fn a_limit_met_in_live_bytes_but_not_in_xlas_program_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let text = text_file(&dir);
    let err = stderr_of_success(
        kiln()
            .args(["train", "gpt", "--config", "tiny", "--vocab", "64", "--steps", "1", "--memory-limit", "5MiB"])
            .arg("--text")
            .arg(&text),
    );
    assert!(!err.contains("not met"), "remat meets 5 MiB of live bytes: {err}");
    let at = err.find("memory limit 5242880 B met by rematerialization").expect("the warning");
    let line = err[at..].lines().next().unwrap();
    let held: u64 = line.split("compiled program holds ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    let live: u64 = line.split("live peak is ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(live <= 5 << 20 && held > 5 << 20, "{line}");
}

/// A byte limit of 2^63 or more is met by every program and warns about
/// none (it was cast to i64, wrapped negative, and every compiled program
/// "held more" than it).
#[test]
fn a_limit_beyond_i64_gives_no_spurious_warning() {
    let dir = tempfile::tempdir().unwrap();
    let text = text_file(&dir);
    for limit in ["18446744073709551615", "9223372036854775808"] {
        let err = stderr_of_success(
            kiln()
                .args(["train", "gpt", "--config", "tiny", "--steps", "1", "--memory-limit", limit])
                .arg("--text")
                .arg(&text),
        );
        assert!(!err.contains("compiled program holds") && !err.contains("not met"), "{limit}: {err}");
    }
}

/// Under `--shard` a size is refused before training (it is one device's
/// memory, and remat plans the unpartitioned step); `dp`, which runs one
/// program per replica, takes it.
#[test]
fn a_size_under_a_sharded_mesh_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let text = text_file(&dir);
    let run = |shard: &str| {
        kiln()
            .env("KILN_CPU_DEVICES", "2")
            .args(["train", "gpt", "--config", "tiny", "--steps", "1", "--memory-limit", "8MiB", "--shard", shard])
            .arg("--text")
            .arg(&text)
            .output()
            .unwrap()
    };
    let out = run("fsdp");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--memory-limit 8MiB with --shard fsdp") && err.contains("--memory-limit 50%"), "{err}");
    assert!(out.stdout.is_empty(), "nothing trained: {}", String::from_utf8_lossy(&out.stdout));
    let out = run("dp");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // 0, the lowest peak, means the same on either side of the partitioner.
    let out = kiln()
        .env("KILN_CPU_DEVICES", "2")
        .args(["train", "gpt", "--config", "tiny", "--steps", "1", "--memory-limit", "0", "--shard", "fsdp", "--text"])
        .arg(&text)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
