//! The optimization pipeline: a readable list of passes.
//!
//! Each stage is followed by `verify` in debug builds and tests, so a pass that
//! breaks an invariant is caught where it ran.

use crate::ir::Graph;
use crate::passes::{eliminate_common_subexpressions, eliminate_dead_code};
use crate::CompileError;

/// What the pipeline did, for metrics and the CLI.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PipelineStats {
    pub nodes_in: usize,
    pub nodes_out: usize,
    pub dead_removed: usize,
    pub cse_merged: usize,
    /// Values the remat pass recomputes, and the FLOPs it adds.
    pub remat_recomputed: usize,
    pub remat_extra_flops: u64,
}

/// Options of [`optimize_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OptimizeOptions {
    /// Rematerialize until the predicted step peak fits this many bytes
    /// (greedy strategy, [`crate::memory`]); `None`: no remat pass.
    pub memory_limit_bytes: Option<u64>,
}

/// Runs the optimization passes. Parameters keep their indices: the caller has
/// already pruned unused ones with [`eliminate_dead_code`].
pub fn optimize(g: &Graph) -> Result<(Graph, PipelineStats), CompileError> {
    optimize_with(g, &OptimizeOptions::default())
}

/// [`optimize`] with options.
pub fn optimize_with(g: &Graph, opts: &OptimizeOptions) -> Result<(Graph, PipelineStats), CompileError> {
    let (g, mut stats) = optimize_core(g)?;
    // Remat (kept apart from the passes above so the pass list can absorb it
    // as one entry): last, on the graph about to be lowered.
    let g = match opts.memory_limit_bytes {
        Some(limit) => {
            let fusion = crate::memory::XlaCpuFusion;
            let ro = crate::memory::RematOptions::new(crate::memory::RematBudget::Bytes(limit), &fusion);
            let plan = crate::memory::rematerialize(&g, &crate::memory::Greedy, &ro)?;
            stats.remat_recomputed = plan.choices.len();
            stats.remat_extra_flops = plan.extra_flops;
            debug_verify(&plan.graph)?;
            plan.graph
        }
        None => g,
    };
    stats.nodes_out = g.len();
    Ok((g, stats))
}

fn optimize_core(g: &Graph) -> Result<(Graph, PipelineStats), CompileError> {
    let _span = tracing::debug_span!("optimize", nodes = g.len()).entered();
    let mut stats = PipelineStats { nodes_in: g.len(), ..Default::default() };
    let (g, merged) = eliminate_common_subexpressions(g)?;
    stats.cse_merged = merged;
    debug_verify(&g)?;
    // CSE can leave nodes without users; DCE must not renumber parameters here,
    // so it only runs when no parameter became unused.
    let pruned = eliminate_dead_code(&g)?;
    let g = if pruned.kept_params.len() == g.params().len() {
        stats.dead_removed = pruned.removed;
        pruned.graph
    } else {
        g
    };
    debug_verify(&g)?;
    stats.nodes_out = g.len();
    Ok((g, stats))
}

fn debug_verify(g: &Graph) -> Result<(), CompileError> {
    if cfg!(debug_assertions) {
        crate::verify(g)?;
    }
    Ok(())
}
