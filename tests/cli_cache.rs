//! The persistent compile cache across processes, through the `kiln` binary:
//! a second run compiles nothing, concurrent runs share one directory, damaged
//! entries are recompiled, read-only mode, `kiln cache stats|clear`, and
//! `KILN_SAVE_GRAPHS` feeding `kiln compile` and `kiln profile`.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Output;

use assert_cmd::Command;
use serde_json::Value;

fn kiln(cache: &Path) -> Command {
    let mut cmd = Command::cargo_bin("kiln").expect("the kiln binary is built");
    cmd.env("KILN_CACHE_DIR", cache).env_remove("KILN_CACHE").env_remove("KILN_CACHE_READONLY");
    cmd
}

/// The last stdout line as JSON, after checking the run succeeded.
fn json(out: &Output) -> Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// A short training run: 30 steps and the evaluation, two programs.
const TRAIN: [&str; 6] = ["train", "mlp", "--max-steps", "30", "--json", "--epochs=1"];

fn entries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .map(|rd| rd.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "kexe")).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// `KILN_LOOP_KERNELS` changes the lowered module on a GPU, not the graph:
/// a program compiled with the loop kernels off is never served with them on
/// (the cache key used to hold the graph only).
#[test]
fn the_loop_kernel_setting_is_part_of_the_cache_key() {
    let dir = tempfile::tempdir().unwrap();
    let run = |on: &str| json(&kiln(dir.path()).env("KILN_LOOP_KERNELS", on).args(TRAIN).output().unwrap());
    let off = run("0");
    assert_eq!((off["compiles"].as_u64(), off["disk_hits"].as_u64()), (Some(2), Some(0)), "{off}");
    let on = run("1");
    assert_eq!((on["compiles"].as_u64(), on["disk_hits"].as_u64()), (Some(2), Some(0)), "{on}");
    let again = run("1");
    assert_eq!((again["compiles"].as_u64(), again["disk_hits"].as_u64()), (Some(0), Some(2)), "{again}");
    assert_eq!(entries(dir.path()).len(), 4);
}

#[test]
fn a_second_run_compiles_nothing_and_trains_identically() {
    let dir = tempfile::tempdir().unwrap();
    let first = json(&kiln(dir.path()).args(TRAIN).output().unwrap());
    assert_eq!((first["compiles"].as_u64(), first["disk_hits"].as_u64()), (Some(2), Some(0)), "{first}");
    assert_eq!(entries(dir.path()).len(), 2);
    let second = json(&kiln(dir.path()).args(TRAIN).output().unwrap());
    assert_eq!((second["compiles"].as_u64(), second["disk_hits"].as_u64()), (Some(0), Some(2)), "{second}");
    // The loaded programs compute exactly what the compiled ones did.
    assert_eq!(first["final_loss"], second["final_loss"]);
    assert_eq!(first["test_accuracy"], second["test_accuracy"]);
}

#[test]
fn two_processes_fill_one_cache_dir_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let spawn = || {
        std::process::Command::new(assert_cmd::cargo::cargo_bin("kiln"))
            .args(TRAIN)
            .env("KILN_CACHE_DIR", dir.path())
            .env_remove("KILN_CACHE")
            .env_remove("KILN_CACHE_READONLY")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let (a, b) = (json(&a), json(&b));
    assert_eq!(a["final_loss"], b["final_loss"]);
    assert_eq!(entries(dir.path()).len(), 2, "one entry per program, whoever wrote it");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 2, "no temp files left: {leftovers:?}");
    let third = json(&kiln(dir.path()).args(TRAIN).output().unwrap());
    assert_eq!(third["compiles"].as_u64(), Some(0), "{third}");
}

#[test]
fn damaged_entries_are_recompiled_replaced_and_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let first = json(&kiln(dir.path()).args(TRAIN).output().unwrap());
    let files = entries(dir.path());
    // One entry with a flipped byte, the other truncated.
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x5a;
    std::fs::write(&files[0], &bytes).unwrap();
    let bytes = std::fs::read(&files[1]).unwrap();
    std::fs::write(&files[1], &bytes[..bytes.len() / 3]).unwrap();

    let out = kiln(dir.path()).args(TRAIN).output().unwrap();
    let second = json(&out);
    assert_eq!(second["compiles"].as_u64(), Some(2), "{second}");
    assert_eq!(second["final_loss"], first["final_loss"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("corrupt compile-cache entry"), "{stderr}");
    let third = json(&kiln(dir.path()).args(TRAIN).output().unwrap());
    assert_eq!(third["compiles"].as_u64(), Some(0), "the replaced entries serve: {third}");
}

#[test]
fn a_read_only_cache_serves_but_never_writes() {
    let dir = tempfile::tempdir().unwrap();
    let ro = |d: &Path| {
        let mut c = kiln(d);
        c.env("KILN_CACHE_READONLY", "1");
        c
    };
    let empty = json(&ro(dir.path()).args(TRAIN).output().unwrap());
    assert_eq!(empty["compiles"].as_u64(), Some(2));
    assert!(entries(dir.path()).is_empty(), "read-only mode wrote entries");

    json(&kiln(dir.path()).args(TRAIN).output().unwrap());
    let filled = json(&ro(dir.path()).args(TRAIN).output().unwrap());
    assert_eq!((filled["compiles"].as_u64(), filled["disk_hits"].as_u64()), (Some(0), Some(2)), "{filled}");
    let out = ro(dir.path()).args(["cache", "clear"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("read-only"));
    assert_eq!(entries(dir.path()).len(), 2);
}

#[test]
fn cache_stats_and_clear_report_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    json(&kiln(dir.path()).args(TRAIN).output().unwrap());
    let stats = json(&kiln(dir.path()).args(["cache", "stats", "--json"]).output().unwrap());
    assert_eq!(stats["entries"].as_u64(), Some(2), "{stats}");
    assert!(stats["bytes"].as_u64().unwrap() > 0);
    assert_eq!(stats["dir"].as_str(), Some(dir.path().to_str().unwrap()));
    let text = kiln(dir.path()).args(["cache", "stats"]).output().unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("2 entries"));
    let cleared = json(&kiln(dir.path()).args(["cache", "clear", "--json"]).output().unwrap());
    assert_eq!(cleared["removed"].as_u64(), Some(2));
    assert!(entries(dir.path()).is_empty());
}

#[test]
fn bad_cache_settings_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = kiln(dir.path()).env("KILN_CACHE_MAX_BYTES", "lots").args(["cache", "stats"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("KILN_CACHE_MAX_BYTES") && err.contains("lots"), "{err}");
    let out = kiln(dir.path()).env("KILN_CACHE", "sometimes").args(TRAIN).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("KILN_CACHE=\"sometimes\""));
    let out = kiln(dir.path()).args(["cache", "purge"]).output().unwrap();
    assert!(!out.status.success(), "an unknown cache subcommand is refused");
}

#[test]
fn saved_graphs_compile_and_profile_offline() {
    let dir = tempfile::tempdir().unwrap();
    let graphs = dir.path().join("graphs");
    let run = json(&kiln(&dir.path().join("cache")).env("KILN_SAVE_GRAPHS", &graphs).args(TRAIN).output().unwrap());
    assert_eq!(run["compiles"].as_u64(), Some(2));
    let mut saved: Vec<_> = std::fs::read_dir(&graphs).unwrap().map(|e| e.unwrap().path()).collect();
    saved.sort();
    assert_eq!(saved.len(), 2, "the train and eval programs: {saved:?}");
    for g in &saved {
        let text = std::fs::read_to_string(g).unwrap();
        kiln::compiler::text::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", g.display()));
        let c = json(&kiln(&dir.path().join("cache")).arg("compile").arg(g).arg("--json").output().unwrap());
        assert!(c["flops"].as_f64().unwrap() > 0.0, "{c}");
    }
    let trace = dir.path().join("graph.json");
    let p = json(
        &kiln(&dir.path().join("cache"))
            .arg("profile")
            .arg(&saved[0])
            .args(["--steps", "5", "--json", "--trace"])
            .arg(&trace)
            .output()
            .unwrap(),
    );
    assert_eq!((p["compiles"].as_u64(), p["executions"].as_u64()), (Some(1), Some(5)), "{p}");
    // It uploads every parameter once and downloads the last outputs (it
    // reported 0 bytes both ways before).
    let g = kiln::compiler::text::parse(&std::fs::read_to_string(&saved[0]).unwrap()).unwrap();
    let params: u64 = g.param_types().iter().map(|t| t.size_in_bytes() as u64).sum();
    let outputs: u64 = g.output_types().iter().map(|t| t.size_in_bytes() as u64).sum();
    assert!(params > 0 && outputs > 0);
    assert_eq!((p["host_to_device_bytes"].as_u64(), p["device_to_host_bytes"].as_u64()), (Some(params), Some(outputs)));
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let spans = t["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").count();
    assert_eq!(spans, 1 + 1 + 5 + 1, "compile, upload, 5 executions, download");
}

/// `KILN_CACHE_MAX_BYTES` bounds what the directory holds, from the moment
/// the cache opens: below one entry's size nothing is kept or served (a
/// bound of 0 used to keep the newest entry and serve hits from it).
#[test]
fn a_bound_below_one_entry_keeps_and_serves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let first = json(&kiln(dir.path()).args(TRAIN).output().unwrap());
    assert_eq!(first["compiles"], 2, "{first}");
    assert_eq!(entries(dir.path()).len(), 2);
    for bound in ["0", "1K"] {
        let run = json(&kiln(dir.path()).env("KILN_CACHE_MAX_BYTES", bound).args(TRAIN).output().unwrap());
        assert_eq!((run["compiles"].as_u64(), run["disk_hits"].as_u64()), (Some(2), Some(0)), "{bound}: {run}");
        assert_eq!(entries(dir.path()), Vec::<std::path::PathBuf>::new(), "{bound}");
    }
    // A bound that holds them keeps them again.
    json(&kiln(dir.path()).env("KILN_CACHE_MAX_BYTES", "1G").args(TRAIN).output().unwrap());
    assert_eq!(entries(dir.path()).len(), 2);
}

/// `kiln cache stats` and `clear` look at a directory that is not there
/// without making it (stats used to create it and its missing parents).
#[test]
fn stats_and_clear_of_a_missing_directory_make_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("not").join("there");
    let stats = json(&kiln(&missing).args(["cache", "stats", "--json"]).output().unwrap());
    assert_eq!((stats["entries"].as_u64(), stats["read_only"].as_bool()), (Some(0), Some(false)), "{stats}");
    let clear = json(&kiln(&missing).args(["cache", "clear", "--json"]).output().unwrap());
    assert_eq!(clear["removed"], 0, "{clear}");
    assert!(!dir.path().join("not").exists(), "nothing was made");
}

/// An entry copied under another entry's name is the other program: a user
/// found a `--max-grad-norm 1.0` GPT run reproducing another run's losses with
/// no compile (here: an f32 run's program under a bf16 run's names). Each entry holds the full key it was compiled for, checked
/// before it is served: a copy is a miss, recompiled, and the run trains as
/// it would with no cache.
#[test]
fn an_entry_copied_under_another_key_is_never_served() {
    let (plain_dir, bf16_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let plain = json(&kiln(plain_dir.path()).args(TRAIN).output().unwrap());
    let bf16_args = [&TRAIN[..], &["--amp", "bf16"]].concat();
    let bf16 = json(&kiln(bf16_dir.path()).args(&bf16_args).output().unwrap());
    assert_ne!(plain["losses"], bf16["losses"], "the two runs must differ for the test to mean anything");
    // Every bf16 entry's file now holds a plain run's program.
    let (from, to) = (entries(plain_dir.path()), entries(bf16_dir.path()));
    assert_eq!((from.len(), to.len()), (2, 2));
    for to in &to {
        let same_size = from.iter().max_by_key(|f| std::fs::metadata(f).unwrap().len()).unwrap();
        std::fs::copy(same_size, to).unwrap();
    }
    let out = kiln(bf16_dir.path()).args(&bf16_args).output().unwrap();
    let again = json(&out);
    assert_eq!(again["disk_hits"].as_u64(), Some(0), "{again}");
    assert_eq!(again["compiles"].as_u64(), Some(2), "{again}");
    assert_eq!(again["losses"], bf16["losses"]);
}
