//! Every transform is a listed pass: each function of the compiler that
//! takes a graph and returns a new one is registered here with the stage that
//! runs it — a pass of the pipeline's list ([`ALL_PASSES`]), the pipeline's
//! prune stage, a target pass ([`TARGET_PASSES`]) or the frontend's composite
//! fusion before autodiff — so a transform added outside them (unverified,
//! undumped, unreported) fails here until it is given a stage.
//!
//! The scan reads the crate's source: `pub`, `pub(crate)` and `pub(super)`
//! functions outside test modules whose parameters take a `&Graph` (or
//! `&mut Graph`) and whose result holds a graph (`Graph`, `Pruned`,
//! `Rewritten`, `RematPlan`, `Fused`).

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use kiln_compiler::lower::TARGET_PASSES;
use kiln_compiler::pipeline::ALL_PASSES;

/// What runs outside the pipeline's list, by design.
const FRONTEND_FUSION: &str = "frontend: composite fusion on the recorded trace, before autodiff";
const PRUNE: &str = "prune";
const PIPELINE: &str = "the pipeline itself";

/// `(file under src/, function, the stage that runs it)`.
const REGISTRY: &[(&str, &str, &str)] = &[
    ("composite/mod.rs", "expand", "expand_composites"),
    ("composite/mod.rs", "fuse", FRONTEND_FUSION),
    ("fence.rs", "hold", "sequence"),
    ("passes/cse.rs", "eliminate_common_subexpressions", "cse"),
    ("passes/dce.rs", "eliminate_dead_code", PRUNE),
    ("passes/dce.rs", "eliminate_dead_code_keep_params", "dce"),
    ("passes/lm_head_loss.rs", "fuse_lm_head_loss", "lm_head_loss"),
    ("pipeline.rs", "optimize", PIPELINE),
    ("pipeline.rs", "optimize_with", PIPELINE),
    ("remat/candidates/pin.rs", "pin_floating", "remat"),
    ("remat/candidates/twins.rs", "merge_twin_gemms", "remat"),
    ("remat/chain.rs", "rewrite", "remat"),
    ("remat/plan.rs", "finish", "remat"),
    ("remat/plan.rs", "rematerialize", "remat"),
    ("remat/strategy/host_copies/mod.rs", "copies", "remat"),
    ("remat/strategy/mod.rs", "plan", "remat"),
    ("rewrite/extract.rs", "from_egraph", "rewrite"),
    ("rewrite/mod.rs", "rewrite", "rewrite"),
    ("rewrite/mod.rs", "rewrite_with", "rewrite"),
    ("rewrite/rules/matmul.rs", "merge_matmuls", "merge_matmuls"),
    ("schedule.rs", "sequence_backward", "sequence"),
    ("schedule.rs", "sequence_for", "sequence"),
];

/// Functions the scan finds that build no transformed graph.
const NOT_TRANSFORMS: &[(&str, &str)] = &[
    // An empty graph with room for another's nodes.
    ("ir/graph.rs", "with_capacity_of"),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Whether `ty` names `word` as a whole word.
fn names(ty: &str, word: &str) -> bool {
    ty.match_indices(word).any(|(i, _)| {
        let before = ty[..i].chars().next_back().is_none_or(|c| !c.is_alphanumeric() && c != '_');
        let after = ty[i + word.len()..].chars().next().is_none_or(|c| !c.is_alphanumeric() && c != '_');
        before && after
    })
}

/// `(file, function)` of every graph-to-graph function in `src`.
fn scan(src: &Path) -> Vec<(String, String)> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut found = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        // Test modules come last in this crate's files.
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        let rel = path.strip_prefix(src).unwrap().to_string_lossy().replace('\\', "/");
        for (i, _) in text.match_indices("fn ") {
            let head = text[..i].trim_end();
            if !(head.ends_with("pub") || head.ends_with("pub(crate)") || head.ends_with("pub(super)")) {
                continue;
            }
            let rest = &text[i + 3..];
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            let Some(sig_end) = rest.find(['{', ';']) else { continue };
            let sig = &rest[name.len()..sig_end];
            let Some((params, ret)) = sig.rsplit_once("->") else { continue };
            let takes_graph = params.contains("&Graph") || params.contains("&mut Graph");
            let gives_graph = ["Graph", "Pruned", "Rewritten", "RematPlan", "Fused"].iter().any(|w| names(ret, w));
            if takes_graph && gives_graph {
                found.push((rel.clone(), name));
            }
        }
    }
    found.sort();
    found
}

#[test]
fn every_graph_transform_runs_in_a_listed_stage() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = scan(&src);
    assert!(found.len() >= REGISTRY.len(), "the scan found too little: {found:?}");
    let registered = |f: &str, n: &str| {
        REGISTRY.iter().any(|(rf, rn, _)| *rf == f && *rn == n)
            || NOT_TRANSFORMS.iter().any(|(rf, rn)| *rf == f && *rn == n)
    };
    let unregistered: Vec<_> = found.iter().filter(|(f, n)| !registered(f, n)).collect();
    assert!(
        unregistered.is_empty(),
        "graph transforms with no stage (run them from a pass of pipeline::ALL_PASSES or lower::TARGET_PASSES \
         and register them here): {unregistered:?}"
    );
    let stale: Vec<_> = REGISTRY
        .iter()
        .map(|(f, n, _)| (f.to_string(), n.to_string()))
        .chain(NOT_TRANSFORMS.iter().map(|(f, n)| (f.to_string(), n.to_string())))
        .filter(|entry| !found.contains(entry))
        .collect();
    assert!(stale.is_empty(), "registered but not found in the source: {stale:?}");
}

#[test]
fn every_registered_stage_exists() {
    let listed: Vec<&str> = ALL_PASSES.iter().map(|p| p.name).chain(TARGET_PASSES).collect();
    for (file, name, stage) in REGISTRY {
        let known = listed.contains(stage) || [FRONTEND_FUSION, PRUNE, PIPELINE].contains(stage);
        assert!(known, "{file}::{name} is registered with {stage:?}, which is no stage; the passes: {listed:?}");
    }
    // Every listed pass and target pass runs at least one registered
    // transform, or changes nothing by design (loop_kernels picks kernels).
    for pass in &listed {
        let runs = REGISTRY.iter().any(|(_, _, s)| s == pass);
        assert!(runs || *pass == "loop_kernels", "{pass} runs no registered transform");
    }
}
