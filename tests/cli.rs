//! The `kiln` binary end to end: the main job's JSON, devices, bad arguments.

use assert_cmd::Command;

/// The binary with the persistent compile cache off, so compile counts do not
/// depend on earlier runs (the cache has its own tests in `cli_cache.rs`).
fn kiln() -> Command {
    let mut cmd = Command::cargo_bin("kiln").expect("the kiln binary is built");
    cmd.env("KILN_CACHE", "off");
    cmd
}

#[test]
fn train_mlp_json_reports_accuracy_and_two_compiles() {
    let out = kiln().args(["train", "mlp", "--epochs", "1", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let last = stdout.lines().last().unwrap();
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    for key in ["test_accuracy", "final_loss", "steps", "compiles", "step_ms_median"] {
        assert!(v.get(key).is_some(), "missing {key} in {last}");
    }
    assert_eq!(v["compiles"], 2);
    assert_eq!(v["steps"], 468);
    assert!(v["test_accuracy"].as_f64().unwrap() > 0.8, "{last}");
}

#[test]
fn devices_lists_the_cpu_plugin() {
    let out = devices_cmd(&[]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["platform"], "cpu");
    assert_eq!(v["pjrt_device"], "CPU");
    assert!(!v["devices"].as_array().unwrap().is_empty());
    assert_eq!(v["replicas"], 1);
    assert_eq!(v["replicas_source"], "KILN_CPU_DEVICES unset");
    assert!(v["gpu_probe"]["driver"].is_string() && v["gpu_probe"]["gpus"].is_array(), "{v}");
    assert_eq!(v["errors"], serde_json::json!([]));
    // The pinned plugin implements C API 0.81 and chains the FFI extension
    // (among others), each extension at least `PJRT_Extension_Base` long.
    assert_eq!(v["pjrt_api_version"], "0.81", "{v}");
    let extensions = v["plugin_extensions"].as_array().unwrap();
    assert!(extensions.iter().any(|e| e["name"] == "ffi" && e["type"] == 5), "{v}");
    assert!(extensions.iter().all(|e| e["struct_size"].as_u64().unwrap() >= 24), "{v}");
}

/// `kiln devices --json` with these variables and none of the replica
/// variables inherited from the caller.
fn devices_cmd(vars: &[(&str, &str)]) -> Command {
    let mut cmd = kiln();
    cmd.args(["devices", "--json"]);
    for var in ["PJRT_DEVICE", "GPU_NUM_DEVICES", "KILN_CPU_DEVICES", "KILN_PJRT_PLUGIN"] {
        cmd.env_remove(var);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd
}

#[test]
fn kiln_cpu_devices_sets_the_devices_and_the_replicas() {
    for n in [4, 2] {
        let value = n.to_string();
        let out = devices_cmd(&[("KILN_CPU_DEVICES", &value)]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["devices"].as_array().unwrap().len(), n, "{v}");
        assert_eq!(v["replicas"], n);
        assert_eq!(v["replicas_source"], format!("KILN_CPU_DEVICES={n}"));
    }
    let out = kiln().args(["devices"]).env_remove("PJRT_DEVICE").env("KILN_CPU_DEVICES", "2").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("replicas: 2 (KILN_CPU_DEVICES=2)"), "{text}");
}

#[test]
fn bad_kiln_cpu_devices_fail_naming_the_variable_and_value() {
    for (value, problem) in
        [("zero", "is not a whole number"), ("0", "must be at least 1"), ("-3", "must be at least 1")]
    {
        let out = devices_cmd(&[("KILN_CPU_DEVICES", value)]).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "KILN_CPU_DEVICES={value}");
        let err = String::from_utf8_lossy(&out.stderr);
        let expected = format!("error: KILN_CPU_DEVICES={value:?} {problem}; the XLA CPU plugin makes 1 to 64 devices");
        assert!(err.contains(&expected), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        // The JSON still shows the plugin's devices, and no replica count.
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["platform"], "cpu");
        assert!(v["replicas"].is_null(), "{v}");
        assert!(v["errors"][0].as_str().unwrap().starts_with(&format!("KILN_CPU_DEVICES={value:?}")), "{v}");
    }
}

/// A PJRT_DEVICE kiln does not know: `--json` still prints an object with
/// the error (it printed nothing on stdout).
#[test]
fn an_unknown_pjrt_device_still_gives_json() {
    let out = devices_cmd(&[("PJRT_DEVICE", "TPU")]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let err = v["errors"][0].as_str().unwrap();
    assert!(err.contains("PJRT_DEVICE") && err.contains("TPU"), "{v}");
    assert!(String::from_utf8_lossy(&out.stderr).contains(err), "the error is on stderr too");
}

#[test]
fn gpu_num_devices_on_a_machine_without_gpus_fails_clearly() {
    let out = devices_cmd(&[("PJRT_DEVICE", "CUDA"), ("GPU_NUM_DEVICES", "2")]).output().unwrap();
    // 1 is kiln's own failure; a panic would exit with 101.
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("error: GPU_NUM_DEVICES=\"2\" asks for more devices than the"), "{err}");
    assert!(err.contains("devices found: "), "{err}");
    // Without the NVIDIA kernel module (this project's machines) the probe
    // names the missing driver library.
    if !std::path::Path::new("/proc/driver/nvidia").exists() {
        assert!(err.contains("devices found: no CUDA driver found (libcuda.so.1)"), "{err}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["gpu_probe"]["driver"], "missing");
        assert_eq!(v["pjrt_device"], "CUDA");
        assert!(v["replicas"].is_null(), "{v}");
    }
    // Unset, it fails the same way: there is no GPU to use.
    let out = devices_cmd(&[("PJRT_DEVICE", "CUDA")]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if !std::path::Path::new("/proc/driver/nvidia").exists() {
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("GPU_NUM_DEVICES unset uses every visible GPU as a replica, but there is none"), "{err}");
    }
}

#[test]
fn a_missing_dataset_names_the_path() {
    let out = kiln().args(["train", "mlp", "--data", "/nonexistent/fmnist"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/fmnist") && err.contains("dataset-fashion-mnist"), "{err}");
}

#[test]
fn a_bad_plugin_path_is_a_clear_error() {
    let out = kiln().args(["devices"]).env("KILN_PJRT_PLUGIN", "/nonexistent/plugin.so").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/plugin.so"), "{err}");
}

#[test]
fn bad_arguments_are_refused() {
    let out = kiln().args(["train", "mlp", "--epochs", "many"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--epochs"));
    let out = kiln().args(["train", "resnet"]).output().unwrap();
    assert!(!out.status.success());
}

#[test]
fn train_gpt_refuses_a_missing_text_naming_it() {
    let out = kiln().args(["train", "gpt", "--text", "/nonexistent/corpus.txt"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/corpus.txt"));
}

#[test]
fn train_gpt_json_reports_one_compile() {
    let out = kiln()
        .args(["train", "gpt", "--text", "/usr/share/common-licenses/Apache-2.0", "--steps", "20", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["compiles"], 1);
    assert_eq!(v["steps"], 20);
    assert!(v["final_loss"].as_f64().unwrap() < v["first_loss"].as_f64().unwrap());
}

#[test]
fn profile_mlp_reports_phases_payback_and_writes_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("timeline.json");
    let out = kiln()
        .args(["profile", "mlp", "--steps", "12", "--eager-steps", "1", "--json", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["compiles"], 1, "{v}");
    assert_eq!(v["executions"], 12, "{v}");
    for phase in ["trace", "compile", "upload", "execute", "download"] {
        assert!(v["phases"][phase]["total_ms"].as_f64().unwrap() > 0.0, "{phase} in {v}");
    }
    assert!(v["phases"]["compile"]["first_ms"].as_f64().unwrap() > 0.0);
    assert!(v["phases"]["compile"]["median_ms"].is_null(), "compiles only in step 1: {v}");
    // The eager reference is far slower than compiled steps on this MLP.
    assert!(v["payback_steps"].as_u64().unwrap() >= 1, "{v}");
    assert!(v["flops_per_step"].as_f64().unwrap() > 1e8, "{v}");
    assert!(v["mfu"].is_null(), "no MFU on a CPU: {v}");
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let executes = t["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == "execute").count();
    assert_eq!(executes, 12);
}

#[test]
fn profile_refuses_what_it_cannot_profile() {
    let out = kiln().args(["profile", "/nonexistent/step.kiln"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/step.kiln"));
    let out = kiln().args(["profile", "gpt"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--text"));
    let out = kiln().args(["profile", "mlp", "--steps", "0"]).output().unwrap();
    assert!(!out.status.success());
}

#[test]
fn train_mlp_on_four_cpu_replicas() {
    let out = kiln()
        .env("KILN_CPU_DEVICES", "4")
        .args(["train", "mlp", "--max-steps", "40", "--batch", "32", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["steps"], 40, "{v}");
    assert_eq!(v["compiles"], 2, "train and eval programs, once each: {v}");
    assert!(v["test_accuracy"].as_f64().unwrap() > 0.6, "{v}");
}

#[test]
fn train_gpt_with_amp_reports_the_dtype_and_the_loss_scale() {
    let text = "/usr/share/common-licenses/Apache-2.0";
    let out = kiln()
        .args(["train", "gpt", "--text", text, "--steps", "20", "--amp", "f16", "--max-grad-norm", "1", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["amp"], "f16");
    assert_eq!(v["compiles"], 1);
    assert_eq!(v["skipped_steps"], 0);
    assert_eq!(v["loss_scale"], 65536.0, "no growth within 20 steps of a 2000-step interval");
    assert!(v["final_loss"].as_f64().unwrap() < v["first_loss"].as_f64().unwrap());

    let out = kiln().args(["train", "mlp", "--amp", "f32"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--amp"));
    let out = kiln().args(["train", "gpt", "--text", text, "--max-grad-norm", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("max_grad_norm = 0 must be positive"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn compare_eager_trains_the_mlp_on_candle_beside_the_compiled_backend() {
    let out = kiln().args(["train", "mlp", "--hidden", "64", "--compare-eager", "40", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // With --json stdout is the one object, no table before it.
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let (compiled, eager) = (v["compiled"].as_array().unwrap(), v["eager"].as_array().unwrap());
    assert_eq!((compiled.len(), eager.len()), (40, 40), "{v}");
    // f32 on both sides, different kernels: rounding drift only.
    for (a, b) in compiled.iter().zip(eager) {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        assert!((a - b).abs() <= 1e-4 * a.abs(), "compiled {a} vs eager {b}");
    }
    assert!(eager[39].as_f64().unwrap() < eager[0].as_f64().unwrap(), "{v}");
}

/// `--compare-eager` trains nothing it could save and runs its own step
/// count: with the flags it would ignore, it is refused naming both.
#[test]
fn compare_eager_refuses_the_flags_it_would_ignore() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("c.safetensors");
    let ck = ck.to_str().unwrap();
    for (extra, flag) in [
        (&["--checkpoint", ck][..], "--checkpoint"),
        (&["--checkpoint", ck, "--resume"][..], "--resume"),
        (&["--checkpoint", ck, "--overwrite"][..], "--overwrite"),
        (&["--max-steps", "3"][..], "--max-steps"),
    ] {
        let out = kiln().args(["train", "mlp", "--compare-eager", "2"]).args(extra).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && !err.contains("panicked"), "{extra:?}: {err}");
        assert!(err.contains("--compare-eager") && err.contains(flag), "{extra:?}: {err}");
    }
    assert!(!std::path::Path::new(ck).exists(), "nothing was written");
    let out = kiln().args(["train", "mlp", "--compare-eager", "0"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--compare-eager"));
}

#[test]
fn errors_say_their_cause_once() {
    // An I/O error of the frontend: its message says the cause, and the CLI
    // does not repeat it from the error's source.
    let out = kiln().args(["train", "gpt", "--text", "/nonexistent/t.txt", "--steps", "1"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("{err}"));
    assert_eq!(line.matches("No such file").count(), 1, "{line}");
}

#[test]
fn plugin_info_lines_are_quiet_unless_asked() {
    let run = |asked: bool| {
        let mut cmd = kiln();
        cmd.args(["train", "mlp", "--max-steps", "1", "--epochs", "1", "--hidden", "16"])
            .env("KILN_CPU_DEVICES", "2")
            .env_remove("TF_CPP_MIN_LOG_LEVEL");
        if asked {
            cmd.env("KILN_PLUGIN_LOGS", "1");
        } else {
            cmd.env_remove("KILN_PLUGIN_LOGS");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // The CPU plugin's INFO note about the device count.
    assert!(!run(false).contains("cpu_device_count"));
    assert!(run(true).contains("cpu_device_count"));
}

/// Every `*.md` file a subcommand's `--help` points at exists in the
/// repository (`train mlp --help` once named a BENCHMARKS.md it does not have).
#[test]
fn documents_named_in_help_exist() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut named = 0;
    for sub in [&["train", "mlp"][..], &["train", "gpt"], &["profile"], &["compile"], &["launch"], &["devices"]] {
        let out = kiln().args(sub).arg("--help").output().unwrap();
        assert!(out.status.success());
        let help = String::from_utf8(out.stdout).unwrap();
        for word in help.split(|c: char| c.is_whitespace() || "()`',;".contains(c)) {
            if let Some(stem) = word.strip_suffix(".md").or_else(|| word.strip_suffix(".md's")) {
                named += 1;
                let path = root.join(format!("{stem}.md"));
                assert!(path.is_file(), "kiln {} --help names {word}, which is not in the repository", sub.join(" "));
            }
        }
    }
    assert!(named > 0, "the help names no document at all: the check would check nothing");
}

#[test]
fn amp_and_shard_spellings() {
    // --amp takes BF16 as bf16 (clap suggested f16 for it).
    let out = kiln()
        .env("KILN_CACHE", "off")
        .args(["train", "mlp", "--amp", "BF16", "--max-steps", "2", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // A --shard part given twice is named.
    let text = "/usr/share/common-licenses/Apache-2.0";
    let out = kiln().args(["train", "gpt", "--text", text, "--steps", "2", "--shard", "fsdp,fsdp"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("fsdp is given twice"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--vocab` pads the text's characters; a size below them was silently
/// replaced by the text's count, and 0 (kiln's internal "unpadded") was
/// accepted where 2 was refused.
#[test]
fn a_vocab_below_the_texts_characters_is_refused() {
    let text = "/usr/share/common-licenses/Apache-2.0";
    for cmd in ["train", "profile"] {
        let out = kiln().args([cmd, "gpt", "--text", text, "--steps", "1", "--vocab", "0"]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{cmd}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("invalid value '0' for '--vocab <VOCAB>'"), "{cmd}: {err}");
    }
    let out = kiln().args(["train", "gpt", "--text", text, "--steps", "1", "--vocab", "5"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("train gpt: a vocabulary of 5 is smaller than the text's") && err.contains("distinct characters"),
        "{err}"
    );
}

/// A diverged run is an error naming the step, not "final loss NaN" with
/// exit 0; `--allow-non-finite-loss` keeps going, as asked.
#[test]
fn a_non_finite_loss_stops_the_run_naming_the_step() {
    let args = ["train", "mlp", "--lr", "1e30", "--epochs", "1", "--max-steps", "12", "--hidden", "32"];
    let out = kiln().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("step ") && err.contains("not finite") && err.contains("--allow-non-finite-loss"), "{err}");
    let out = kiln().args(args).args(["--allow-non-finite-loss", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
