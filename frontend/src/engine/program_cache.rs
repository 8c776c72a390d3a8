//! This thread's program cache: the compiled programs of its steps, found by
//! the raw trace's key (the hit path, looked up by `mark_step` before anything
//! is pruned or lowered) and by the canonical key of the optimized program
//! (`engine::compile`, the miss path), with the history recompiles are
//! explained against and the persistent cache's setting.
//!
//! Invariants:
//! - `traces` and `programs` are only looked up, never iterated (their order
//!   is not deterministic); `history` is in compile order; a program is in
//!   `history` exactly when it is in `programs`.
//! - A program in the cache was built under the settings set now: changing a
//!   setting that changes programs clears it (`engine::compile_settings`), and
//!   so do a new client or replica plan.
//! - The persistent cache is read from the environment on the first miss
//!   unless it was set explicitly.

use std::collections::HashMap;
use std::rc::Rc;

use kiln_compiler::ir::{Graph, TensorType};
use kiln_runtime::{CompileKey, DiskCache, DiskCacheConfig, Executable};

use crate::core::error::Result;
use crate::core::mesh::{Mesh, Sharding};

/// A compiled program and how a raw trace's parameters feed it.
pub(crate) struct CacheEntry {
    pub program: Rc<Program>,
    /// `kept_params[i]`: the raw trace parameter feeding program parameter `i`.
    pub kept_params: Vec<u32>,
    /// Whether program parameter `i` is donated.
    pub donated: Vec<bool>,
    /// Nodes of the pruned program.
    pub nodes: usize,
}

/// The persistent cache of this context: read from the environment on the first
/// miss unless set explicitly.
pub(crate) enum DiskSetting {
    FromEnv,
    Off,
    On(DiskCache),
}

/// This thread's compiled programs.
///
/// Invariants: `traces` and `programs` are only looked up, never iterated
/// (their order is not deterministic); `history` is in compile order; a
/// program is in `history` exactly when it is in `programs`.
pub(crate) struct ProgramCache {
    /// Compiled programs by the raw trace's key (the hit path).
    pub traces: HashMap<u64, Rc<CacheEntry>>,
    /// Compiled programs by their canonical key, so traces that optimize to
    /// the same program share one executable.
    pub programs: HashMap<CompileKey, Rc<Program>>,
    /// Every program compiled or loaded in this context, oldest first: what a
    /// recompile is compared with to explain it.
    pub history: Vec<Rc<Program>>,
    /// Steps in a row that needed a new program (the recompile-every-step warning).
    pub new_programs_in_a_row: u32,
    pub disk: DiskSetting,
    /// `KILN_SAVE_GRAPHS`, read once: where each new program's graph is saved.
    pub save_graphs: Option<Option<std::path::PathBuf>>,
}

impl ProgramCache {
    pub fn new() -> ProgramCache {
        ProgramCache {
            traces: HashMap::new(),
            programs: HashMap::new(),
            history: Vec::new(),
            new_programs_in_a_row: 0,
            disk: DiskSetting::FromEnv,
            save_graphs: None,
        }
    }
}

impl ProgramCache {
    pub fn clear(&mut self) {
        self.traces.clear();
        self.programs.clear();
        self.history.clear();
        self.new_programs_in_a_row = 0;
    }

    /// The disk cache, opened from the environment on first use.
    pub fn disk_cache(&mut self) -> Result<Option<DiskCache>> {
        if let DiskSetting::FromEnv = self.disk {
            self.disk = match DiskCacheConfig::from_env()? {
                Some(config) => DiskSetting::On(DiskCache::open(config)?),
                None => DiskSetting::Off,
            };
        }
        Ok(match &self.disk {
            DiskSetting::On(d) => Some(d.clone()),
            DiskSetting::Off | DiskSetting::FromEnv => None,
        })
    }

    /// `KILN_SAVE_GRAPHS`, read once.
    pub fn save_graphs_dir(&mut self) -> Option<std::path::PathBuf> {
        self.save_graphs
            .get_or_insert_with(|| std::env::var_os("KILN_SAVE_GRAPHS").filter(|v| !v.is_empty()).map(Into::into))
            .clone()
    }
}

/// A compiled program of this thread.
pub(crate) struct Program {
    pub exe: Executable,
    /// The pruned graph (before optimization): what a later recompile is
    /// compared with.
    pub graph: Graph,
    /// FLOPs of one execution on one replica (the cost model's count of the
    /// optimized program): what MFU is computed from.
    pub flops: f64,
    /// Under a mesh: the mesh and the layout of each parameter (what host
    /// data is sliced by on upload).
    pub layout: Option<Layout>,
}

/// How a partitioned program's parameters lie on the mesh's devices.
pub(crate) struct Layout {
    pub mesh: Mesh,
    pub params: Vec<Sharding>,
}

impl Program {
    pub fn param_types(&self) -> Vec<TensorType> {
        self.graph.param_types()
    }
}
