//! `kiln train gpt --shard` and the mesh in `kiln devices`: each run is its
//! own process, so the device variables are set per command. Bad meshes and
//! shardings fail with messages naming the mesh, the variable, the tensor,
//! the dimension and the axis.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use assert_cmd::Command;

fn kiln(vars: &[(&str, &str)]) -> Command {
    let mut cmd = Command::cargo_bin("kiln").expect("the kiln binary is built");
    cmd.env("KILN_CACHE", "off");
    for var in ["PJRT_DEVICE", "GPU_NUM_DEVICES", "KILN_CPU_DEVICES", "KILN_PJRT_PLUGIN", "KILN_MESH"] {
        cmd.env_remove(var);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd
}

fn corpus(dir: &std::path::Path) -> std::path::PathBuf {
    let words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dogs", "while", "birds", "sing"];
    let mut text = String::new();
    for i in 0..300 {
        text.push_str(words[(i * 7 + i / 11) % words.len()]);
        text.push(if i % 12 == 11 { '\n' } else { ' ' });
    }
    let path = dir.join("corpus.txt");
    std::fs::write(&path, text).unwrap();
    path
}

fn train(vars: &[(&str, &str)], text: &std::path::Path, shard: &str) -> std::process::Output {
    train_with(vars, text, shard, &[])
}

fn train_with(vars: &[(&str, &str)], text: &std::path::Path, shard: &str, more: &[&str]) -> std::process::Output {
    let text = text.to_str().unwrap();
    kiln(vars)
        .args(["train", "gpt", "--text", text, "--steps", "6", "--shard", shard, "--json"])
        .args(more)
        .output()
        .unwrap()
}

fn final_loss(out: &std::process::Output) -> f64 {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    v["final_loss"].as_f64().unwrap()
}

#[test]
fn fsdp_and_tp_train_like_data_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path());
    let four = [("KILN_CPU_DEVICES", "4")];
    // The global batch is the batch per data-parallel rank times the ranks:
    // fsdp on 4 devices has 4 ranks, tp=2 on 4 devices 2 (data=2,model=2).
    // Against dp with as many ranks the losses agree up to summation order.
    let dp4 = final_loss(&train(&four, &text, "dp"));
    let dp2 = final_loss(&train(&[("KILN_CPU_DEVICES", "2")], &text, "dp"));
    for (spec, dp) in [("fsdp", dp4), ("tp=2", dp2), ("fsdp,tp=2", dp2)] {
        let out = train(&four, &text, spec);
        let loss = final_loss(&out);
        assert!((loss - dp).abs() < 1e-3, "--shard {spec}: {loss} vs dp {dp}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("kiln: mesh"), "the mesh is announced");
    }
}

/// FSDP with tensor parallelism under a share of the activation memory: the
/// remat pass plans the unpartitioned step (reading the weights the forward
/// gathered over `data`), the losses are the unplanned run's, and the JSON
/// report names the mesh whose whole step its bytes are.
#[test]
fn fsdp_with_tp_under_a_budget_trains_like_the_unplanned_run() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path());
    let four = [("KILN_CPU_DEVICES", "4")];
    let plain = final_loss(&train(&four, &text, "fsdp,tp=2"));
    let out = train_with(&four, &text, "fsdp,tp=2", &["--memory-limit", "50%"]);
    let planned = final_loss(&out);
    assert!((planned - plain).abs() <= 1e-6 * plain.abs().max(1.0), "planned {planned} vs unplanned {plain}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let remat = &v["remat"];
    assert_eq!(remat["mesh"], "data=2,model=2", "{remat}");
    assert_eq!(remat["activation_fraction"].as_f64(), Some(0.5), "{remat}");
    assert!(remat["values_recomputed"].as_u64().unwrap() > 0, "{remat}");
}

#[test]
fn bad_shard_specs_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let text = corpus(dir.path());
    // tp=3 does not divide 4 devices.
    let out = train(&[("KILN_CPU_DEVICES", "4")], &text, "tp=3");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("model=3") && err.contains("4 devices"), "{err}");
    // tp=3 on 3 devices: the attention's 4 heads (the qkv weight's dimension
    // 2, which TP splits) do not split 3 ways; refused before anything
    // compiles.
    let out = train(&[("KILN_CPU_DEVICES", "3")], &text, "tp=3");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("h0.attn.qkv.weight") && err.contains("dimension 2") && err.contains("axis model (size 3)"),
        "{err}"
    );
    // Not a spec at all, and dp mixed with a mesh.
    for spec in ["zero3", "dp,fsdp", "tp=0"] {
        let out = train(&[("KILN_CPU_DEVICES", "2")], &text, spec);
        assert!(!out.status.success(), "{spec} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(spec.split(',').next_back().unwrap()) || err.contains("dp"), "{spec}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn devices_shows_the_mesh_and_refuses_one_of_the_wrong_size() {
    let out = kiln(&[("KILN_CPU_DEVICES", "4"), ("KILN_MESH", "data=2,model=2")])
        .args(["devices", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mesh"]["spec"], "data=2,model=2");
    assert_eq!(v["mesh"]["devices"], 4);
    assert_eq!(v["mesh"]["axes"][1]["name"], "model");

    let out = kiln(&[("KILN_CPU_DEVICES", "4"), ("KILN_MESH", "data=4")]).args(["devices"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("mesh: data=4 (4 devices, KILN_MESH)"));

    // A mesh of 4 on 2 devices: the command fails naming both.
    let out = kiln(&[("KILN_CPU_DEVICES", "2"), ("KILN_MESH", "data=4")]).args(["devices"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mesh data=4 has 4 devices") && err.contains("KILN_CPU_DEVICES=2"), "{err}");
}
