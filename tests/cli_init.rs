//! `KILN_INIT`: the built-in models initialise on the host or through the
//! init program, with the same weights, so the same losses.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use assert_cmd::Command;

const TEXT: &str = "/usr/share/common-licenses/Apache-2.0";

fn train_gpt(init: &str) -> serde_json::Value {
    train_gpt_with(init, &[], &[])
}

fn train_gpt_with(init: &str, env: &[(&str, &str)], args: &[&str]) -> serde_json::Value {
    let out = Command::cargo_bin("kiln")
        .expect("the kiln binary is built")
        .env("KILN_CACHE", "off")
        .env_remove("KILN_CPU_DEVICES")
        .env_remove("KILN_MESH")
        .envs(env.iter().copied())
        .env("KILN_INIT", init)
        .args(["train", "gpt", "--text", TEXT, "--steps", "5", "--seed", "9", "--json"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

#[test]
fn device_init_trains_the_losses_of_host_init() {
    let host = train_gpt("host");
    let device = train_gpt("device");
    assert_eq!((host["init"].as_str(), device["init"].as_str()), (Some("host"), Some("device")));
    // The same weights and the same step program: bit-identical losses.
    assert_eq!(host["losses"], device["losses"], "host {host}\ndevice {device}");
    assert_eq!(device["compiles"].as_u64(), host["compiles"].as_u64().map(|c| c + 1), "the init program: {device}");
    assert!(device["setup_ms"].as_f64().unwrap() > 0.0);
    // Each run is its own process, so each opens the plugin once, outside
    // its set-up figure.
    for run in [&host, &device] {
        assert!(run["client_ms"].as_f64().unwrap() > 0.0, "{run}");
        // The breakdown's phases add up to the set-up.
        let b = &run["setup_breakdown"];
        let phases: f64 = ["model_ms", "shard_ms", "optimizer_ms", "init_step_ms", "wait_ms", "other_ms"]
            .iter()
            .map(|k| b[k].as_f64().unwrap_or_else(|| panic!("{k} in {b}")))
            .sum();
        let setup = run["setup_ms"].as_f64().unwrap();
        assert!((phases - setup).abs() < 0.01 * setup + 0.5, "phases {phases} ms, set-up {setup} ms: {b}");
    }
    // Host init compiles and uploads nothing in its set-up; the init
    // program is one compile and uploads only scalars: the optimizer
    // state is made on the device with it, not uploaded.
    let (hb, db) = (&host["setup_breakdown"], &device["setup_breakdown"]);
    assert_eq!((hb["compiles"].as_u64(), hb["host_to_device_bytes"].as_u64()), (Some(0), Some(0)), "{hb}");
    assert_eq!(db["compiles"].as_u64(), Some(1), "{db}");
    let uploaded = db["host_to_device_bytes"].as_u64().unwrap();
    assert!(uploaded > 0 && uploaded < 4096, "{uploaded} B uploaded by the device set-up: {db}");
    assert!(db["init_step_ms"].as_f64().unwrap() > 0.0 && db["compile_ms"].as_f64().unwrap() > 0.0, "{db}");
}

/// Under FSDP on 4 CPU devices the policy is applied before the init program
/// runs, so each parameter is made in its shard: the losses are those of host
/// init (uploaded, then split) to the bit.
#[test]
fn device_init_under_fsdp_trains_the_losses_of_host_init() {
    let env = [("KILN_CPU_DEVICES", "4")];
    let host = train_gpt_with("host", &env, &["--shard", "fsdp"]);
    let device = train_gpt_with("device", &env, &["--shard", "fsdp"]);
    assert_eq!(device["mesh"].as_str(), Some("data=4"), "{device}");
    assert_eq!(host["losses"], device["losses"], "host {host}\ndevice {device}");
}

#[test]
fn an_unknown_placement_names_the_variable() {
    let out = Command::cargo_bin("kiln")
        .unwrap()
        .env("KILN_CACHE", "off")
        .env("KILN_INIT", "gpu")
        .args(["train", "gpt", "--text", TEXT, "--steps", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("KILN_INIT") && err.contains("\"gpu\"") && err.contains("host or device"), "{err}");
}
