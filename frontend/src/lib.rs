//! kiln's frontend: lazy tensors, autodiff, nn layers, optimizers, mixed
//! precision, data loading, checkpoints.
//!
//! A training loop records ops on [`Tensor`]s until [`mark_step`]; the step is
//! then compiled (once) and run, and the pending tensors become device data.
//!
//! # Layout
//!
//! Three layers, one folder each, every module with a `//!` saying what it
//! does and what must stay true:
//!
//! - `core/`: plain data and per-thread state, no recording and no device:
//!   the error type, host elements, size limits, this thread's settings (one
//!   struct), warnings, the counters, the atomic writer, input files, the trace, tensor
//!   storage, the `Tensor` handle, meshes and shardings;
//! - `engine/`: what records, compiles and runs a step: the per-thread
//!   context, the program cache and its miss path, the executor, `mark_step`,
//!   lowering, captured steps, the eager backend, device-side checks, layer
//!   scopes, replicas and the active mesh;
//! - `api/`: what a training loop calls: tensor ops, `grad` and autodiff,
//!   layers, optimizers, mixed precision, clipping, the training step, data,
//!   checkpoints, the random generator, shard policies, the replicas'
//!   collectives and metrics reporting.
//!
//! This file only re-exports: every public path (`kiln_frontend::Tensor`,
//! `kiln_frontend::nn::…`, `kiln_frontend::shard::…`) names an item where it
//! lives in its layer.
//!
//! # The import rule
//!
//! Layers import downward only: a module of `core/` names only `crate::core`,
//! one of `engine/` only `crate::core` and `crate::engine`, one of `api/` any
//! layer. Paths name the layer (`crate::core::error::Result`), never this
//! file's re-exports, which are the API's. The `layers` tests below check it
//! on the sources; a module's unit tests may drive it through the whole crate.
//!
//! Two calls cross layers without an import, each documented where it is made:
//! - The lazy read forcing the step: reading a pending tensor runs
//!   `mark_step` (`api/tensor/read.rs`). The reads live with the other ops in
//!   the API, so here the call goes down into the engine.
//! - The one call up: the engine's device checks (`engine/device_checks.rs`)
//!   record their summaries and the step's flag output with `Tensor`'s ops,
//!   which `api/tensor/` defines on the core handle. Removing it means
//!   recording those nodes without the ops (a rewrite of the checks, not a
//!   move) or moving the ops below the engine (then they are no longer the
//!   API's); it is left as it is, in plain sight.

mod api;
mod core;
mod engine;

pub use crate::api::{amp, autodiff, checkpoint, clip, data, metrics, nn, optim, random, replicas, shard, train_step};
pub use crate::core::{atomic_write, input, limits, warnings};
pub use crate::engine::{dump, scope};

pub use crate::api::grad::grad;
pub use crate::api::random::manual_seed;
pub use crate::core::element::{element_type, Element};
pub use crate::core::error::{FrontendError, Result};
pub use crate::core::settings::{
    activation_budget, check_memory_limit_for_mesh, detect_anomaly, device_checks, host_copies, host_offload,
    loop_kernels, memory_limit, set_detect_anomaly, set_device_checks,
};
pub use crate::core::tensor::Tensor;
pub use crate::engine::capture::{compile_step, CompiledStep};
pub use crate::engine::compile::host_link_rate;
pub use crate::engine::compile_settings::{
    set_activation_budget, set_host_copies, set_host_offload, set_loop_kernels, set_memory_limit,
};
pub use crate::engine::context::{backend, clear_compile_cache, client, set_backend, set_client, set_disk_cache};
pub use crate::engine::device_checks::check_index_range;
pub use crate::engine::executor::Backend;
pub use crate::engine::explain::{bucket, BucketGuard};
pub use crate::engine::lower::{capture_graph, lower, lower_with, LowerOpts};
pub use crate::engine::run::{quiesce, set_max_steps_in_flight, steps_in_flight, sync};
pub use crate::engine::step::{donation_enabled, mark_step, step, StepReport};
/// candle-core, for [`Tensor::to_candle`] and [`Tensor::from_candle`].
pub use candle_core;

#[cfg(test)]
mod layers {
    //! The import rule above, checked on the sources: every `crate::` path a
    //! layer names outside comments and unit tests.

    use std::path::{Path, PathBuf};

    /// Every `.rs` file under `dir`, sorted.
    fn sources(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).expect("the layer's folder exists") {
            let path = entry.expect("a readable entry").path();
            if path.is_dir() {
                out.extend(sources(&path));
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
        out.sort();
        out
    }

    /// `(line, module)` for every `crate::module` that `text` names in code,
    /// before its unit tests and outside comments.
    fn crate_paths(text: &str) -> Vec<(usize, String)> {
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        let mut out = Vec::new();
        for (n, line) in code.lines().enumerate() {
            let line = line.split("//").next().unwrap_or("");
            for (at, _) in line.match_indices("crate::") {
                let rest = &line[at + "crate::".len()..];
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                out.push((n + 1, name));
            }
        }
        out
    }

    /// `file:line: crate::module` for each path of `layer` outside `allowed`.
    fn violations(layer: &str, allowed: &[&str]) -> Vec<String> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(layer);
        let files = sources(&root);
        assert!(files.len() > 5, "{} holds the layer's sources", root.display());
        let mut out = Vec::new();
        for file in files {
            let text = std::fs::read_to_string(&file).expect("a readable source");
            for (line, module) in crate_paths(&text) {
                if !allowed.contains(&module.as_str()) {
                    out.push(format!("{}:{line}: crate::{module}", file.display()));
                }
            }
        }
        out
    }

    #[test]
    fn core_names_only_core() {
        let found = violations("core", &["core"]);
        assert!(found.is_empty(), "core imports a higher layer:\n{}", found.join("\n"));
    }

    #[test]
    fn engine_names_only_core_and_engine() {
        let found = violations("engine", &["core", "engine"]);
        assert!(found.is_empty(), "engine imports a higher layer:\n{}", found.join("\n"));
    }

    #[test]
    fn the_api_names_layers_not_the_re_exports() {
        let found = violations("api", &["core", "engine", "api"]);
        assert!(found.is_empty(), "api goes through lib.rs's re-exports:\n{}", found.join("\n"));
    }

    #[test]
    fn paths_in_code_are_found_and_comments_and_tests_are_not() {
        let text = "use crate::core::error::Result;\n\
                    let t = crate::api::tensor::record(op); // crate::nn in a comment\n\
                    //! [`crate::engine::step`]\n\
                    #[cfg(test)]\n\
                    use crate::api::nn::Linear;\n";
        assert_eq!(crate_paths(text), vec![(1, "core".to_string()), (2, "api".to_string())]);
    }
}
