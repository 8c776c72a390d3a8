//! `kiln compile` end to end: saved graphs compiled through the CPU plugin, the
//! JSON report against the cost model, emitted artifacts, replicas, and errors
//! that name the file, the line or the argument.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use kiln::compiler::cost::graph_cost;
use kiln::compiler::ir::{BinaryOp, DType, DotDims, Graph, Literal, Op, ReduceOp, Shape, TensorType, UnaryOp};
use kiln::compiler::{pipeline, text};
use serde_json::Value;

fn kiln() -> Command {
    Command::cargo_bin("kiln").expect("the kiln binary is built")
}

/// relu(x @ w1 + b1) @ w2, plus `x @ w1` recorded a second time so that CSE
/// has something to merge.
fn mlp() -> Graph {
    let f32 = |dims: &[usize]| TensorType::new(DType::F32, dims);
    let mut g = Graph::new();
    let x = g.parameter(f32(&[8, 4]));
    let w1 = g.parameter(f32(&[4, 16]));
    let b1 = g.parameter(f32(&[16]));
    let w2 = g.parameter(f32(&[16, 3]));
    let h = g.value(Op::DotGeneral { lhs: x, rhs: w1, dims: DotDims::matmul() }).unwrap();
    let bb = g.value(Op::BroadcastInDim { input: b1, shape: Shape::new([8, 16]), dims: vec![1] }).unwrap();
    let a = g.value(Op::Binary { op: BinaryOp::Add, lhs: h, rhs: bb }).unwrap();
    let zero = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 0.0) }).unwrap();
    let zb = g.value(Op::BroadcastInDim { input: zero, shape: Shape::new([8, 16]), dims: vec![] }).unwrap();
    let r = g.value(Op::Binary { op: BinaryOp::Max, lhs: a, rhs: zb }).unwrap();
    let y = g.value(Op::DotGeneral { lhs: r, rhs: w2, dims: DotDims::matmul() }).unwrap();
    let again = g.value(Op::DotGeneral { lhs: x, rhs: w1, dims: DotDims::matmul() }).unwrap();
    let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: again }).unwrap();
    let s = g.value(Op::Reduce { op: ReduceOp::Sum, input: t, axes: vec![0, 1] }).unwrap();
    g.set_outputs(vec![y, s]).unwrap();
    g
}

/// Writes `g`'s text form into `dir` as the frontend saves step graphs.
fn save(dir: &Path, name: &str, g: &Graph) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text::print(g)).unwrap();
    path
}

fn json_of(out: &std::process::Output) -> Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn json_reports_passes_cost_compile_time_and_memory() {
    let dir = tempfile::tempdir().unwrap();
    let g = mlp();
    let path = save(dir.path(), "step.kiln", &g);
    let v = json_of(&kiln().arg("compile").arg(&path).arg("--json").output().unwrap());

    let (optimized, stats) = pipeline::optimize(&g).unwrap();
    let cost = graph_cost(&optimized);
    assert_eq!(v["nodes_before"], 14);
    assert_eq!(v["nodes_after"], 13);
    let cse = v["passes"].as_array().unwrap().iter().find(|p| p["name"] == "cse").unwrap();
    assert_eq!(cse["changed"], 1, "{v}");
    let names: Vec<&str> = v["passes"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["lm_head_loss", "cse", "rewrite", "merge_matmuls", "dce"]);
    let rewrite = &v["passes"][2];
    assert_eq!(rewrite["stop_reason"], "saturated", "{v}");
    assert!(v["fusion"]["groups"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["nodes_after"], stats.nodes_out);
    // Dots 2*8*16*4 + 2*8*3*16, add and max over 128, tanh over 128, the sum over
    // 128; the second x @ w1 was merged away.
    assert_eq!(v["flops"], 2304);
    assert_eq!(v["flops"], cost.total.flops);
    assert_eq!(v["transcendentals"], 128);
    assert_eq!(v["bytes_read"], cost.total.bytes_read);
    assert_eq!(v["bytes_written"], cost.total.bytes_written);
    assert_eq!(v["by_op"]["dot_general"]["nodes"], 2);
    assert_eq!(v["by_op"]["dot_general"]["flops"], 1792);
    assert!(v["roofline_seconds"]["h100_sxm"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["compile_ms"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["platform"], "cpu");
    assert_eq!(v["replicas"], 1);
    // The four f32 parameters: 32 + 64 + 16 + 48 elements.
    assert_eq!(v["memory"]["argument_size_in_bytes"], 640, "{v}");
    for key in ["output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes", "peak_memory_in_bytes"] {
        assert!(v["memory"][key].is_i64(), "missing memory.{key} in {v}");
    }
    assert!(v["memory"]["output_size_in_bytes"].as_i64().unwrap() >= 96 + 4, "{v}");
    // What the program holds at once, the same sum on every plugin (the
    // plugin's own peak field leaves temporaries out on the CPU).
    let m = |k: &str| v["memory"][k].as_i64().unwrap();
    assert_eq!(
        m("held_bytes"),
        m("argument_size_in_bytes") + m("output_size_in_bytes") - m("alias_size_in_bytes") + m("temp_size_in_bytes"),
        "{v}"
    );
}

#[test]
fn the_text_report_names_the_file_and_draws_no_spinner_into_a_pipe() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), "step.kiln", &mlp());
    let out = kiln().arg("compile").arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("step.kiln: 14 nodes, 13 after optimization"), "{stdout}");
    assert!(stdout.contains("pass cse"), "{stdout}");
    assert!(stdout.contains("1 changed"), "{stdout}");
    assert!(stdout.contains("stopped: saturated"), "{stdout}");
    assert!(stdout.contains("fusion: "), "{stdout}");
    assert!(stdout.contains("  group "), "{stdout}");
    assert!(stdout.contains("cost: 2304 FLOPs (128 transcendental)"), "{stdout}");
    assert!(stdout.contains("memory: arguments 640 B"), "{stdout}");
    assert!(stdout.contains("; held at once (arguments + outputs - aliased + temporaries) "), "{stdout}");
    assert!(!String::from_utf8_lossy(&out.stderr).contains('\u{1b}'), "terminal control codes on a pipe");
}

#[test]
fn emit_stablehlo_prints_the_module_and_moves_the_report_to_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), "step.kiln", &mlp());
    let out = kiln().arg("compile").arg(&path).args(["--emit", "stablehlo"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let module = String::from_utf8(out.stdout).unwrap();
    assert!(module.starts_with("module @kiln"), "{module}");
    assert!(module.contains("func.func public @main("), "{module}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("after optimization"));
}

#[test]
fn emit_with_out_writes_the_file_and_leaves_no_temporary_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), "step.kiln", &mlp());
    let target = dir.path().join("out").join("step.mlir");
    std::fs::create_dir(dir.path().join("out")).unwrap();
    let v = json_of(
        &kiln()
            .arg("compile")
            .arg(&path)
            .args(["--emit", "stablehlo", "--json", "--out"])
            .arg(&target)
            .output()
            .unwrap(),
    );
    let module = std::fs::read_to_string(&target).unwrap();
    assert!(module.contains("func.func public @main("));
    assert_eq!(v["emitted"]["kind"], "stablehlo");
    assert_eq!(v["emitted"]["path"], target.display().to_string());
    assert_eq!(v["stablehlo_bytes"], module.len());
    let names: Vec<_> = std::fs::read_dir(dir.path().join("out")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["step.mlir"]);
}

#[test]
fn emit_graph_prints_the_optimized_graph_in_text_form() {
    let dir = tempfile::tempdir().unwrap();
    let g = mlp();
    let path = save(dir.path(), "step.kiln", &g);
    let out = kiln().arg("compile").arg(&path).args(["--emit", "graph"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8(out.stdout).unwrap();
    let (optimized, _) = pipeline::optimize(&g).unwrap();
    assert_eq!(printed, text::print(&optimized));
    assert_eq!(text::parse(&printed).unwrap().len(), 13);
}

#[test]
fn four_replicas_compile_an_all_reduce() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ar.kiln");
    std::fs::write(
        &path,
        "graph(%x: tensor<4x6xf32>) {\n  %s = all_reduce sum %x : tensor<4x6xf32>\n  %t = tanh %s : tensor<4x6xf32>\n  return %t\n}\n",
    )
    .unwrap();
    let target = dir.path().join("ar.mlir");
    let v = json_of(
        &kiln()
            .arg("compile")
            .arg(&path)
            .args(["--replicas", "4", "--json", "--emit", "stablehlo", "--out"])
            .arg(&target)
            .output()
            .unwrap(),
    );
    assert_eq!(v["replicas"], 4);
    assert_eq!(v["collective_bytes"], 96);
    assert_eq!(v["by_op"]["all_reduce"]["nodes"], 1);
    let module = std::fs::read_to_string(&target).unwrap();
    assert!(module.contains("mhlo.num_replicas = 4"), "{module}");
    assert!(module.contains("[[0, 1, 2, 3]]"), "{module}");
}

#[test]
fn a_missing_file_names_the_path() {
    let out = kiln().args(["compile", "/nonexistent/steps/step-0.kiln"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/steps/step-0.kiln"), "{err}");
}

#[test]
fn a_damaged_file_names_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("damaged.kiln");
    let mut lines: Vec<String> = text::print(&mlp()).lines().map(str::to_string).collect();
    // Line 4 is the add; make it read a value that does not exist.
    assert!(lines[3].contains("= add"), "{}", lines[3]);
    lines[3] = lines[3].replace("add %4", "add %99");
    std::fs::write(&path, lines.join("\n")).unwrap();
    let out = kiln().arg("compile").arg(&path).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:4: undefined value %99", path.display())), "{err}");

    // A file cut short ends before `return`.
    std::fs::write(&path, text::print(&mlp()).lines().take(3).collect::<Vec<_>>().join("\n")).unwrap();
    let out = kiln().arg("compile").arg(&path).arg("--json").output().unwrap();
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:3: unexpected end of input", path.display())), "{err}");
}

#[test]
fn bad_arguments_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), "step.kiln", &mlp());
    let refused = |args: &[&str], needle: &str| {
        let out = kiln().arg("compile").arg(&path).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    };
    refused(&["--replicas", "0"], "--replicas");
    refused(&["--replicas", "many"], "--replicas");
    refused(&["--emit", "llvm"], "--emit");
    refused(&["--out", "x.mlir"], "--emit");
    refused(&["--emit", "stablehlo", "--json"], "--out FILE");
    refused(&["--plugin", "/nonexistent/plugin.so"], "/nonexistent/plugin.so");
    let out = kiln().arg("compile").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("<FILE>"));
}

#[test]
fn passes_and_no_rewrite_choose_the_pass_list_and_unknown_names_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), "step.kiln", &mlp());
    let v = json_of(&kiln().arg("compile").arg(&path).args(["--json", "--passes", "dce,cse"]).output().unwrap());
    let names: Vec<&str> = v["passes"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["dce", "cse"]);
    assert_eq!(v["nodes_after"], 13);

    let v = json_of(&kiln().arg("compile").arg(&path).args(["--json", "--no-rewrite"]).output().unwrap());
    let names: Vec<&str> = v["passes"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["lm_head_loss", "cse", "dce"]);

    let out = kiln().arg("compile").arg(&path).args(["--passes", "cse,nope"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown pass \"nope\""), "{err}");
    assert!(err.contains("rewrite"), "{err}");
}

#[test]
fn dump_dir_gets_the_graph_after_each_pass() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), "step.kiln", &mlp());
    let dump = dir.path().join("dump");
    let out = kiln().arg("compile").arg(&path).env("KILN_DUMP_DIR", &dump).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let run = std::fs::read_dir(&dump).unwrap().next().unwrap().unwrap().path();
    let mut files: Vec<String> =
        std::fs::read_dir(&run).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(
        files,
        [
            "00-prune.kiln",
            "01-lm_head_loss.kiln",
            "02-cse.kiln",
            "03-rewrite.kiln",
            "04-merge_matmuls.kiln",
            "05-dce.kiln",
            "06-expand_composites.kiln"
        ]
    );
    let after_cse = text::parse(&std::fs::read_to_string(run.join("02-cse.kiln")).unwrap()).unwrap();
    assert_eq!(after_cse.len(), 13);
}

/// Causal attention written with plain ops: `softmax(select(causal, s · 0.5, -inf)) v`.
fn plain_attention() -> Graph {
    attention_with_dropout(false)
}

/// [`plain_attention`], with dropout on the probabilities when asked: `where(keep,
/// p · 1.25, 0)` with `keep` a program input.
fn attention_with_dropout(dropout: bool) -> Graph {
    let f32 = |dims: &[usize]| TensorType::new(DType::F32, dims);
    let mut g = Graph::new();
    let [q, k, v] = [0; 3].map(|_| g.parameter(f32(&[1, 2, 4, 8])));
    let bh = |lc, rc| DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![lc],
        rhs_contract: vec![rc],
    };
    let full = [1, 2, 4, 4];
    let s = g.value(Op::DotGeneral { lhs: q, rhs: k, dims: bh(3, 3) }).unwrap();
    let half = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 0.5) }).unwrap();
    let half = g.value(Op::BroadcastInDim { input: half, shape: Shape::new(full), dims: vec![] }).unwrap();
    let s = g.value(Op::Binary { op: BinaryOp::Mul, lhs: s, rhs: half }).unwrap();
    let it = TensorType::new(DType::I32, [4, 4]);
    let rows = g.value(Op::Iota { ty: it.clone(), axis: 0 }).unwrap();
    let cols = g.value(Op::Iota { ty: it, axis: 1 }).unwrap();
    let keep = g.value(Op::Compare { dir: kiln::compiler::ir::CompareDir::Le, lhs: cols, rhs: rows }).unwrap();
    let keep = g.value(Op::BroadcastInDim { input: keep, shape: Shape::new(full), dims: vec![2, 3] }).unwrap();
    let neg = g.value(Op::Constant { literal: Literal::scalar(DType::F32, f64::NEG_INFINITY) }).unwrap();
    let neg = g.value(Op::BroadcastInDim { input: neg, shape: Shape::new(full), dims: vec![] }).unwrap();
    let x = g.value(Op::Select { pred: keep, on_true: s, on_false: neg }).unwrap();
    let m = g.value(Op::Reduce { op: ReduceOp::Max, input: x, axes: vec![3] }).unwrap();
    let m = g.value(Op::BroadcastInDim { input: m, shape: Shape::new(full), dims: vec![0, 1, 2] }).unwrap();
    let d = g.value(Op::Binary { op: BinaryOp::Sub, lhs: x, rhs: m }).unwrap();
    let e = g.value(Op::Unary { op: UnaryOp::Exp, input: d }).unwrap();
    let z = g.value(Op::Reduce { op: ReduceOp::Sum, input: e, axes: vec![3] }).unwrap();
    let z = g.value(Op::BroadcastInDim { input: z, shape: Shape::new(full), dims: vec![0, 1, 2] }).unwrap();
    let mut p = g.value(Op::Binary { op: BinaryOp::Div, lhs: e, rhs: z }).unwrap();
    if dropout {
        let keep = g.parameter(TensorType::new(DType::Pred, full));
        let c = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 1.25) }).unwrap();
        let c = g.value(Op::BroadcastInDim { input: c, shape: Shape::new(full), dims: vec![] }).unwrap();
        let zero = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 0.0) }).unwrap();
        let zero = g.value(Op::BroadcastInDim { input: zero, shape: Shape::new(full), dims: vec![] }).unwrap();
        let scaled = g.value(Op::Binary { op: BinaryOp::Mul, lhs: p, rhs: c }).unwrap();
        p = g.value(Op::Select { pred: keep, on_true: scaled, on_false: zero }).unwrap();
    }
    let out = g.value(Op::DotGeneral { lhs: p, rhs: v, dims: bh(3, 2) }).unwrap();
    g.set_outputs(vec![out]).unwrap();
    g
}

#[test]
fn lists_the_composites_found_and_why_they_are_not_fused() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), "attention.kiln", &plain_attention());
    let v = json_of(&kiln().arg("compile").arg(&path).arg("--json").output().unwrap());
    let found = v["composites"].as_array().unwrap();
    assert_eq!(found.len(), 1, "{v}");
    assert_eq!(found[0]["kind"], "attention");
    // scores, scale, select, max, its broadcast, sub, exp, sum, its broadcast, div.
    assert_eq!(found[0]["replaced"].as_array().unwrap().len(), 10, "{v}");
    let lowering = v["composite_lowering"].as_array().unwrap();
    assert_eq!(lowering[0]["fused"], false);
    assert!(lowering[0]["reason"].as_str().unwrap().contains("Cpu target"), "{v}");
    let out = kiln().arg("compile").arg(&path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("composite attention at %") && text.contains("replaces 10 nodes"), "{text}");
    assert!(text.contains("plain expansion (the Cpu target has no fused attention kernel"), "{text}");
}

#[test]
fn a_composite_left_plain_is_listed_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), "dropout.kiln", &attention_with_dropout(true));
    let v = json_of(&kiln().arg("compile").arg(&path).arg("--json").output().unwrap());
    assert_eq!(v["composites"].as_array().unwrap().len(), 0, "{v}");
    let missed = v["composites_missed"].as_array().unwrap();
    assert_eq!(missed.len(), 1, "{v}");
    assert_eq!(missed[0]["kind"], "attention");
    assert!(missed[0]["reason"].as_str().unwrap().contains("dropout on the probabilities"), "{v}");
    let out = kiln().arg("compile").arg(&path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("composite attention at %") && text.contains("left plain: dropout"), "{text}");
}
