//! `kiln compile --memory-limit` end to end on the CPU plugin: the plan, XLA's
//! stats of both programs, the plot, and a bad size named in the error.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use assert_cmd::Command;
use kiln::compiler::ir::{BinaryOp, DType, DotDims, Graph, Op, TensorType, UnaryOp};
use kiln::compiler::text;
use serde_json::Value;

/// A forward chain of `tanh(h @ w)` and a backward that reads every
/// activation in reverse (an elementwise-only chain would not do: XLA fuses
/// it into one kernel and keeps nothing).
fn ladder() -> Graph {
    let mut g = Graph::new();
    let t = TensorType::new(DType::F32, [64, 256]);
    let p = g.parameter(t.clone());
    let w = g.parameter(TensorType::new(DType::F32, [256, 256]));
    let mut acts = vec![p];
    for _ in 0..8 {
        let last = *acts.last().unwrap();
        let h = g.value(Op::DotGeneral { lhs: last, rhs: w, dims: DotDims::matmul() }).unwrap();
        acts.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: h }).unwrap());
    }
    let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: acts[8] }).unwrap();
    for i in (1..8).rev() {
        let d = g.value(Op::DotGeneral { lhs: ct, rhs: w, dims: DotDims::matmul() }).unwrap();
        ct = g.value(Op::Binary { op: BinaryOp::Mul, lhs: d, rhs: acts[i] }).unwrap();
    }
    g.set_outputs(vec![ct]).unwrap();
    g
}

/// `kiln compile` of the ladder, saved in a fresh directory, with `args`
/// after the path; `--memory-plot` (when given) draws into `live.svg` there.
fn compile_ladder(args: &[&str]) -> (tempfile::TempDir, std::path::PathBuf, std::process::Output) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ladder.kiln");
    std::fs::write(&path, text::print(&ladder())).unwrap();
    let plot = dir.path().join("live.svg");
    let mut cmd = Command::cargo_bin("kiln").unwrap();
    cmd.arg("compile").arg(&path).args(args);
    if args.contains(&"--memory-plot") {
        cmd.arg(&plot);
    }
    let out = cmd.output().unwrap();
    (dir, plot, out)
}

#[test]
fn memory_limit_reports_the_plan_and_xla_stats_and_draws_the_plot() {
    let (_dir, plot, out) = compile_ladder(&["--json", "--memory-limit", "0", "--memory-plot"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let plan = &v["memory_plan"];
    assert_eq!(plan["strategy"], "greedy");
    assert!(plan["activation_fraction"].is_null(), "a size, not a percentage: {plan}");
    assert!(!plan["recomputed"].as_array().unwrap().is_empty(), "{plan}");
    assert!(plan["recomputed"].as_array().unwrap().iter().all(|r| r["also"].is_array()), "{plan}");
    assert!(plan["extra_flops"].as_u64().unwrap() > 0, "{plan}");
    let pred = &plan["predicted"];
    assert!(pred["after"]["peak_bytes"].as_u64() < pred["before"]["peak_bytes"].as_u64(), "{plan}");
    let xla = &plan["xla"];
    assert!(xla["after"]["temp_bytes"].as_i64() < xla["before"]["temp_bytes"].as_i64(), "{plan}");
    // What XLA allocates, by the model, beside what XLA reports: the ladder's
    // one output holds temporaries before it is written.
    for when in ["before", "after"] {
        let (model, reported) =
            (pred[when]["allocated_bytes"].as_f64().unwrap(), xla[when]["peak_bytes"].as_f64().unwrap());
        assert!((model - reported).abs() <= 0.15 * reported, "{when}: {plan}");
        assert!(pred[when]["allocated_temp_bytes"].as_u64() <= pred[when]["temp_bytes"].as_u64(), "{when}: {plan}");
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("with the plan"), "{}", &svg[..svg.len().min(200)]);
}

/// Under `--remat-strategy exact` the report also gives greedy's plan at the
/// same budget, and says when greedy's is the better one (on the ladder at
/// 50% neither meets the budget and both reach the same peak, greedy with
/// fewer FLOPs); greedy's is `null` under other strategies.
#[test]
fn exact_is_reported_beside_greedys_plan() {
    let plan_of = |args: &[&str]| {
        let (_dir, _, out) = compile_ladder(args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["memory_plan"].clone()
    };
    let exact = plan_of(&["--json", "--memory-limit", "50%", "--remat-strategy", "exact"]);
    let greedy = plan_of(&["--json", "--memory-limit", "50%"]);
    assert_eq!(exact["strategy"], "exact");
    assert!(greedy["greedy"].is_null(), "{greedy}");
    let beside = &exact["greedy"];
    assert_eq!(beside["met"], greedy["met"], "{exact}");
    assert_eq!(beside["extra_flops"], greedy["extra_flops"], "{exact}");
    assert_eq!(beside["peak_bytes"], greedy["predicted"]["after"]["peak_bytes"], "{exact}");
    let values: usize =
        greedy["recomputed"].as_array().unwrap().iter().map(|r| 1 + r["also"].as_array().unwrap().len()).sum();
    assert_eq!(beside["values_recomputed"].as_u64().unwrap() as usize, values, "{exact}");
    let greedy_better = exact["met"] == false
        && greedy["met"] == false
        && beside["peak_bytes"] == exact["predicted"]["after"]["peak_bytes"]
        && beside["extra_flops"].as_u64() < exact["extra_flops"].as_u64();
    assert!(greedy_better, "the case this test was written on: {exact}");

    let (_dir, _, out) = compile_ladder(&["--memory-limit", "50%", "--remat-strategy", "exact"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("greedy at the same budget: not met"), "{text}");
    assert!(text.contains("(better than exact here: --remat-strategy greedy)"), "{text}");
}

#[test]
fn a_bad_memory_limit_is_named() {
    let (_dir, _, out) = compile_ladder(&["--memory-limit", "2 parsecs"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--memory-limit 2 parsecs: not a size") && err.contains("GiB"), "{err}");
}

/// `N%` keeps the arguments, the outputs and N% of the predicted
/// temporaries, as the training loops read it (it once meant N% of the whole
/// peak here and of the activations there).
#[test]
fn a_percentage_is_that_share_of_the_activation_memory() {
    let (_dir, _, out) = compile_ladder(&["--json", "--memory-limit", "50%"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let plan = &v["memory_plan"];
    let before = &plan["predicted"]["before"];
    let (peak, temp) = (before["peak_bytes"].as_u64().unwrap(), before["temp_bytes"].as_u64().unwrap());
    assert_eq!(plan["budget_bytes"].as_u64().unwrap(), peak - temp / 2, "{plan}");
    assert_eq!(plan["activation_fraction"].as_f64(), Some(0.5), "{plan}");
    assert!(plan["predicted"]["after"]["temp_bytes"].as_u64().unwrap() < temp, "{plan}");
}

/// The plot's path is checked before anything is compiled, and written as
/// every kiln output is: through a symlink to its target, never over a
/// directory, with no temp file of its own name left beside it.
#[test]
fn the_plot_path_is_checked_first_and_written_through_a_link() {
    let dir = tempfile::tempdir().unwrap();
    let graph = dir.path().join("ladder.kiln");
    std::fs::write(&graph, text::print(&ladder())).unwrap();
    let compile = |plot: &std::path::Path| {
        Command::cargo_bin("kiln")
            .unwrap()
            .arg("compile")
            .arg(&graph)
            .args(["--memory-limit", "0", "--memory-plot"])
            .arg(plot)
            .output()
            .unwrap()
    };
    // SVG under another format's name is refused before any work.
    let png = dir.path().join("live.png");
    let out = compile(&png);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("live.png") && err.contains("the plot is SVG, not .png"), "{err}");
    assert!(!png.exists() && out.stdout.is_empty());

    let sub = dir.path().join("plots");
    std::fs::create_dir(&sub).unwrap();
    let out = compile(&sub);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--memory-plot") && err.contains("plots") && err.contains("is a directory"), "{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("compiled"), "the refusal came after the compile");
    assert!(sub.is_dir() && std::fs::read_dir(&sub).unwrap().next().is_none());

    // A file a user keeps beside the plot, named as a plot's temp file would have been.
    let keep = dir.path().join("real.svg.tmp");
    std::fs::write(&keep, "mine").unwrap();
    let link = dir.path().join("live.svg");
    std::os::unix::fs::symlink("real.svg", &link).unwrap();
    let out = compile(&link);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
    let svg = std::fs::read_to_string(dir.path().join("real.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("with the plan"));
    assert_eq!(std::fs::read_to_string(&keep).unwrap(), "mine");
    let mut names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(names, ["ladder.kiln", "live.svg", "plots", "real.svg", "real.svg.tmp"]);
}

#[test]
fn host_offload_on_the_cpu_plugin_is_a_typed_error_and_writes_nothing() {
    let (_dir, plot, out) =
        compile_ladder(&["--memory-limit", "0", "--remat-strategy", "host-offload", "--memory-plot"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("host-offload") && err.contains("no host memory space"), "{err}");
    assert!(!plot.exists(), "no plot for a plan that was refused");
}

/// `kiln compile --remat-strategy host-copy` plans for the link
/// `KILN_HOST_LINK_GBPS` names, as the training loops do: a rate that is not
/// one is refused by name, and nothing is drawn.
#[test]
fn host_copy_reads_the_link_rate_and_refuses_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ladder.kiln");
    std::fs::write(&path, text::print(&ladder())).unwrap();
    let plot = dir.path().join("live.svg");
    let run = |gbps: &str| {
        Command::cargo_bin("kiln")
            .unwrap()
            .env("KILN_HOST_LINK_GBPS", gbps)
            .arg("compile")
            .arg(&path)
            .args(["--memory-limit", "50%", "--remat-strategy", "host-copy", "--memory-plot"])
            .arg(&plot)
            .output()
            .unwrap()
    };
    for bad in ["abc", "0", "-3"] {
        let out = run(bad);
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("KILN_HOST_LINK_GBPS") && err.contains(bad), "{bad}: {err}");
        assert!(!plot.exists(), "no plot for a plan that was refused ({bad})");
    }
    let out = run("30");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(plot.exists());
    // The report says what the link carried, or that it carried nothing.
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains("offloaded to pinned host memory") || report.contains("no value copied to the host"),
        "{report}"
    );
}

/// `kiln profile --max-batch`: each answer fits the device by the model and
/// in XLA's compiled program, lies on the grid of eighths of a power of two,
/// and is the model's largest there unless XLA refused that one; every batch
/// the model fitted but XLA's program did not is listed, the model's answer
/// first, each one larger than the answer. (On the CPU plugin the tiny GPT's
/// remat answer at 2 GiB is such a case: XLA's schedule of the planned steps
/// holds 10-30% more than the model.)
#[test]
fn max_batch_answers_fit_in_xla_too() {
    let out = Command::cargo_bin("kiln")
        .unwrap()
        .args(["profile", "gpt", "--max-batch", "--device-memory", "2GiB", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let device = v["device_memory_bytes"].as_u64().unwrap();
    assert_eq!(device, 2 << 30);
    assert_eq!(v["platform"], "cpu", "{v}");
    // An eighth of the power of two at or below `b`, 1 below 16.
    let step = |b: u64| ((1u64 << (63 - b.leading_zeros())) / 8).max(1);
    let answers = v["max_batch"].as_array().unwrap();
    assert_eq!(answers.len(), 2, "{v}");
    for a in answers {
        let batch = a["max_batch"].as_u64().unwrap_or_else(|| panic!("no batch fits: {a}"));
        assert_eq!(batch % step(batch), 0, "{a}");
        assert!(a["predicted_peak_bytes"].as_u64().unwrap() <= device, "{a}");
        assert!(a["xla_peak_bytes"].as_u64().unwrap() <= device, "{a}");
        let model = a["model_max_batch"].as_u64().unwrap();
        let over = a["over_in_xla"].as_array().unwrap();
        if over.is_empty() {
            assert_eq!(batch, model, "{a}");
        } else {
            assert_eq!(over[0]["batch"].as_u64(), Some(model), "{a}");
        }
        for o in over {
            assert!(o["batch"].as_u64().unwrap() > batch, "{a}");
            assert!(o["predicted_peak_bytes"].as_u64().unwrap() <= device, "{a}");
            assert!(o["xla_peak_bytes"].as_u64().unwrap() > device, "{a}");
        }
        // The model's own answer is the largest on the grid it fits: the
        // next batch on the grid was tried and did not fit.
        let remat = a["remat"].as_bool().unwrap();
        let rows: Vec<&Value> = v["search"].as_array().unwrap().iter().filter(|r| r["remat"] == remat).collect();
        let fits = |b: u64| rows.iter().find(|r| r["batch"].as_u64() == Some(b)).map(|r| r["fits"] == true);
        assert_eq!(fits(model), Some(true), "{v}");
        assert_eq!(fits(model + step(model)), Some(false), "{v}");
    }
}

/// What `--max-batch` sizes is the step `kiln train` compiles: the GPT's
/// recorded step (`recorded_train_step`) at the train loop's settings has,
/// through the same pipeline, the ops, parameters, outputs and donations of
/// the step the loop saved under `KILN_SAVE_GRAPHS` (bf16, so the ordered
/// step with its skip flag). The gradients alone, without the update, have
/// neither its parameters nor its outputs.
#[test]
fn max_batch_sizes_the_step_the_train_loop_compiles() {
    use kiln::compiler::pipeline::{run, PipelineOptions};
    use std::collections::BTreeMap;
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog. ".repeat(40)).unwrap();
    let out = Command::cargo_bin("kiln")
        .unwrap()
        .env("KILN_CACHE", "off")
        .env("KILN_SAVE_GRAPHS", dir.path().join("graphs"))
        .args(["train", "gpt", "--config", "tiny", "--steps", "1", "--vocab", "64", "--amp", "bf16"])
        .args(["--max-grad-norm", "1.0", "--text"])
        .arg(&text)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The step is the largest program the run saved (the others initialise).
    let saved = std::fs::read_dir(dir.path().join("graphs"))
        .unwrap()
        .map(|e| text::parse(&std::fs::read_to_string(e.unwrap().path()).unwrap()).unwrap())
        .max_by_key(Graph::len)
        .unwrap();
    let cfg = kiln::models::gpt::GptConfig {
        amp: Some(DType::BF16),
        max_grad_norm: Some(1.0),
        ..kiln::models::gpt::GptConfig::tiny(64)
    };
    let recorded = kiln::models::gpt::recorded_train_step(&cfg).unwrap();
    // What the pipeline makes of a graph: its ops by name, its parameter and
    // output types (sorted: the two record them in different orders), its
    // donations.
    let shape = |g: &Graph| {
        let g = run(g, &PipelineOptions::default(), &mut |_, _| {}).unwrap().graph;
        let mut ops = BTreeMap::<&str, usize>::new();
        for (_, n) in g.nodes() {
            *ops.entry(n.op.name()).or_default() += 1;
        }
        let mut params: Vec<String> = g.params().iter().map(|&p| format!("{:?}", g.node(p).outputs[0])).collect();
        let mut outputs: Vec<String> = g.outputs().iter().map(|&v| format!("{:?}", g.ty(v))).collect();
        params.sort();
        outputs.sort();
        (ops, params, outputs, g.aliases().len())
    };
    let (saved, recorded) = (shape(&saved), shape(&recorded));
    assert!(saved.1.len() > 20 && saved.2.len() > 20, "{saved:?}");
    assert_eq!(saved, recorded);
}

/// The text report ends with the command to run: with a memory limit where
/// remat raised the batch (the tiny GPT at 3 GiB), and without one where it
/// did not (the MLP at 64 MiB, whose next batch's input alone is 49 MiB).
#[test]
fn max_batch_names_the_train_command_that_fits() {
    let report = |args: &[&str]| {
        let out = Command::cargo_bin("kiln").unwrap().args(["profile"]).args(args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let batch = |text: &str, name: &str| -> u64 {
        let line = text.lines().find(|l| l.trim_start().starts_with(name)).unwrap_or_else(|| panic!("{text}"));
        line.split("batch").nth(1).unwrap().trim().split(':').next().unwrap().trim().parse().unwrap()
    };
    let mlp = report(&["mlp", "--max-batch", "--device-memory", "64MiB"]);
    let b = batch(&mlp, "without remat");
    assert_eq!(batch(&mlp, "with remat"), b, "{mlp}");
    assert!(mlp.contains("remat does not raise the batch here"), "{mlp}");
    assert!(mlp.contains(&format!("`kiln train mlp --batch {b}` fits without it")), "{mlp}");
    assert!(!mlp.contains("--memory-limit"), "{mlp}");

    let gpt = report(&["gpt", "--max-batch", "--device-memory", "3GiB"]);
    let (plain, remat) = (batch(&gpt, "without remat"), batch(&gpt, "with remat"));
    assert!(remat > plain, "{gpt}");
    assert!(gpt.contains(&format!("`kiln train gpt --batch {remat} --memory-limit {}`", 3u64 << 30)), "{gpt}");
    assert!(!gpt.contains("does not raise"), "{gpt}");
}

/// `--max-batch` refuses what cannot be sized before any work, by name: a
/// zero vocabulary or width, a clipping norm that is not positive (or
/// clipping for a model without it), a device size the CPU plugin
/// cannot give, and a device of 0 bytes.
#[test]
fn max_batch_names_bad_input() {
    let run = |args: &[&str]| {
        let out = Command::cargo_bin("kiln").unwrap().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: no answer printed");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run(&["profile", "gpt", "--max-batch", "--device-memory", "64MiB", "--vocab", "0"]);
    assert!(e.contains("invalid value '0' for '--vocab <VOCAB>'") && !e.contains("panicked"), "{e}");
    let e = run(&["profile", "mlp", "--max-batch", "--device-memory", "64MiB", "--hidden", "64,0"]);
    assert!(e.contains("hidden = 0") && !e.contains("panicked"), "{e}");
    // The clipping norm reaches the recorded step, which checks it.
    let e = run(&["profile", "gpt", "--max-batch", "--device-memory", "64MiB", "--max-grad-norm", "0"]);
    assert!(e.contains("max_grad_norm = 0") && !e.contains("panicked"), "{e}");
    let e = run(&["profile", "mlp", "--max-batch", "--device-memory", "64MiB", "--max-grad-norm", "1"]);
    assert!(e.contains("--max-grad-norm") && e.contains("mlp"), "{e}");
    let e = run(&["profile", "gpt", "--max-batch"]);
    assert!(e.contains("cpu plugin reports no memory limit") && e.contains("--device-memory"), "{e}");
    let e = run(&["profile", "mlp", "--max-batch", "--device-memory", "0GiB"]);
    assert!(e.contains("--device-memory 0GiB: no step fits in 0 bytes"), "{e}");
}

/// The memory flags are read before the graph and XLA's compile: with a file
/// that is not a graph, the flag's error comes first (it once came only
/// after a full compile, so a bad graph was named instead).
#[test]
fn memory_flags_are_checked_before_the_graph_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("not-a-graph.kiln");
    std::fs::write(&path, "this is not a graph\n").unwrap();
    for (args, says) in [
        (&["--memory-limit", "garbage"][..], "--memory-limit garbage: not a size"),
        (&["--memory-limit", "1GiB", "--remat-strategy", "host-offload"][..], "no host memory space"),
    ] {
        let out = Command::cargo_bin("kiln")
            .unwrap()
            .env_remove("PJRT_DEVICE")
            .arg("compile")
            .arg(&path)
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says) && !err.contains("not-a-graph.kiln"), "{args:?}: {err}");
    }
}

/// `kiln profile --memory-limit` profiles the planned step: a built-in loop
/// (its `--json` carries the plan, `null` without a limit) and a saved graph
/// (the ladder: its report has the `remat:` line, and the plan recomputes
/// where the unplanned one does not). A budget that is not one is named before
/// any work, and `--max-batch` sizes its own budget.
#[test]
fn profile_takes_a_memory_limit() {
    let dir = tempfile::tempdir().unwrap();
    let text_path = dir.path().join("text.txt");
    std::fs::write(&text_path, "the quick brown fox jumps over the lazy dog. ".repeat(40)).unwrap();
    let profile = |args: &[&str]| {
        let out = Command::cargo_bin("kiln")
            .unwrap()
            .env("KILN_CACHE", "off")
            .arg("profile")
            .args(args)
            .args(["--steps", "3", "--eager-steps", "0"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), stderr)
    };
    let json = |stdout: &str| -> Value { serde_json::from_str(stdout.lines().last().unwrap()).unwrap() };
    let text_arg = text_path.to_str().unwrap();

    let (ok, out, err) = profile(&["gpt", "--text", text_arg, "--memory-limit", "50%", "--json"]);
    assert!(ok, "{err}");
    let r = &json(&out)["remat"];
    assert_eq!(r["activation_fraction"], 0.5, "{r}");
    assert_eq!(r["met"], true, "{r}");
    assert!(r["values_recomputed"].as_u64().unwrap() > 0, "{r}");
    assert!(r["predicted_peak_bytes_after"].as_u64() < r["predicted_peak_bytes_before"].as_u64(), "{r}");
    let (ok, out, err) = profile(&["gpt", "--text", text_arg, "--json"]);
    assert!(ok, "{err}");
    assert!(json(&out)["remat"].is_null(), "{out}");

    let ladder_path = dir.path().join("ladder.kiln");
    std::fs::write(&ladder_path, text::print(&ladder())).unwrap();
    let ladder_arg = ladder_path.to_str().unwrap();
    let (ok, out, err) = profile(&[ladder_arg, "--memory-limit", "40%"]);
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.starts_with("remat: ")).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("40% of the activation memory") && line.contains("recomputed ("), "{line}");
    let (ok, out, err) = profile(&[ladder_arg, "--memory-limit", "40%", "--json"]);
    assert!(ok, "{err}");
    assert!(json(&out)["remat"]["values_recomputed"].as_u64().unwrap() > 0, "{out}");
    let (ok, out, err) = profile(&[ladder_arg]);
    assert!(ok, "{err}");
    assert!(!out.contains("remat: "), "{out}");

    let (ok, out, err) = profile(&["gpt", "--text", text_arg, "--memory-limit", "150%"]);
    assert!(!ok && out.is_empty(), "{out}");
    assert!(err.contains("--memory-limit 150%") && !err.contains("panicked"), "{err}");
    let (ok, _, err) = profile(&["gpt", "--max-batch", "--device-memory", "1GiB", "--memory-limit", "50%"]);
    assert!(!ok && err.contains("--memory-limit") && err.contains("--max-batch"), "{err}");
}
