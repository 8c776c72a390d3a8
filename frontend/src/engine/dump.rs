//! `KILN_DUMP_DIR=dir`: the graph after pruning and after each pass of the
//! optimizer pipeline, in kiln's text form, and the StableHLO module compiled
//! (`NN-stablehlo.mlir`, for a program compiled rather than found in a cache).
//!
//! Each pipeline run gets its own numbered folder `dir/pipeline-NNNN/`, whose
//! files `00-prune.kiln`, `01-lm_head_loss.kiln`, `02-cse.kiln`, ... follow the pass order, so a diff of
//! two neighbours shows what one pass did.
//!
//! Invariants:
//! - The compiler only calls the observer (it stays free of I/O); the files
//!   are written here, atomically, so a reader never sees half a graph.
//! - The first write error is kept and returned by [`Dump::finish`], so a run
//!   never continues having silently dumped half.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_compiler::ir::Graph;

use crate::core::atomic_write::write_atomically;
use crate::core::error::{FrontendError, Result};

static RUN: AtomicU64 = AtomicU64::new(0);

/// The observer of one pipeline run.
pub struct Dump {
    dir: Option<PathBuf>,
    stage: usize,
    error: Option<FrontendError>,
}

impl Dump {
    /// A dump into `KILN_DUMP_DIR` when it is set and not empty; else a no-op.
    pub fn from_env() -> Dump {
        let root = std::env::var_os("KILN_DUMP_DIR").filter(|v| !v.is_empty()).map(PathBuf::from);
        Dump::into_dir(root)
    }

    /// A dump into a fresh numbered folder under `root` (a no-op for `None`).
    pub fn into_dir(root: Option<PathBuf>) -> Dump {
        let dir = root.map(|r| r.join(format!("pipeline-{:04}", RUN.fetch_add(1, Ordering::Relaxed))));
        Dump { dir, stage: 0, error: None }
    }

    /// Writes `graph` as the next stage; the pipeline's observer.
    pub fn observe(&mut self, pass: &str, graph: &Graph) {
        if self.dir.is_some() {
            self.write(&format!("{pass}.kiln"), || kiln_compiler::text::print(graph));
        }
    }

    /// Writes `text` as the next stage, in file `NN-<name>` (the lowered
    /// module: `stablehlo.mlir`).
    pub fn text(&mut self, name: &str, text: &str) {
        self.write(name, || text.to_string());
    }

    fn write(&mut self, name: &str, contents: impl FnOnce() -> String) {
        let Some(dir) = &self.dir else { return };
        if self.error.is_some() {
            return;
        }
        let path = dir.join(format!("{:02}-{name}", self.stage));
        self.stage += 1;
        let result = std::fs::create_dir_all(dir)
            .map_err(|source| FrontendError::Io { path: dir.clone(), source })
            .and_then(|()| write_atomically(&path, contents().as_bytes()));
        if let Err(e) = result {
            self.error = Some(e);
        }
    }

    /// The first write error, if any.
    pub fn finish(self) -> Result<()> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
