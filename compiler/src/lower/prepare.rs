//! The target preparation: what the lowering's target needs done to a graph
//! before it is printed, as listed passes of their own ([`TARGET_PASSES`]),
//! each with its [`PassStats`], verified after and seen by the observer like
//! the pipeline's.
//!
//! - `expand_composites`: composites the target cannot run fused become plain
//!   ops, and fused attentions take the cuDNN lowering's form
//!   ([`crate::composite::expand`]).
//! - `loop_kernels`: on CUDA, the column sums and the elementwise work around
//!   them that run as Triton kernels of kiln's own ([`super::loop_kernel`]),
//!   and an order of nodes and kernels to write them in. It changes no node:
//!   its result is the kernels the printer writes, so the observer sees no
//!   graph from it.
//!
//! The options' own checks (replicas, shardings against the signature) and
//! the guard against trapping integer division run here too, so that
//! [`super::print`] only prints.

use std::time::Instant;

use super::emit::{kernels_in_order, Item};
use super::loop_kernel::{self, Kernel};
use super::{guard, live, LowerOptions};
use crate::ir::Graph;
use crate::pipeline::PassStats;
use crate::target::LowerTarget;
use crate::CompileError;

/// The preparation's passes, in the order they run.
pub const TARGET_PASSES: [&str; 2] = ["expand_composites", "loop_kernels"];

/// A graph ready to print for one set of options.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The graph after `expand_composites`.
    pub graph: Graph,
    /// The options it was prepared for (what [`super::print`] writes).
    pub options: LowerOptions,
    /// What each target pass did.
    pub stats: Vec<PassStats>,
    pub(super) kernels: Vec<Kernel>,
    pub(super) items: Vec<Item>,
}

impl Prepared {
    /// Loop kernels the module runs.
    pub fn loop_kernels(&self) -> usize {
        self.kernels.len()
    }
}

/// Prepares `g` for `opts`' target; `observe(pass, graph)` sees the graph
/// after each pass that changes it, and with `verify` the verifier checks it
/// there (an error names the pass: [`CompileError::AfterPass`]).
pub fn prepare(
    g: &Graph,
    opts: &LowerOptions,
    verify: bool,
    observe: &mut dyn FnMut(&str, &Graph),
) -> Result<Prepared, CompileError> {
    check_options(g, opts)?;
    let mut stats = Vec::with_capacity(TARGET_PASSES.len());

    let t = Instant::now();
    let graph = crate::composite::expand(g, opts.target)?;
    let composites = |g: &Graph| g.nodes().filter(|(_, n)| n.op.props().composite).count();
    stats.push(PassStats {
        name: TARGET_PASSES[0],
        nodes_in: g.len(),
        nodes_out: graph.len(),
        time: t.elapsed(),
        changed: composites(g).saturating_sub(composites(&graph)),
        ..PassStats::default()
    });
    if verify {
        crate::verify(&graph).map_err(|e| CompileError::AfterPass { pass: TARGET_PASSES[0], source: Box::new(e) })?;
    }
    observe(TARGET_PASSES[0], &graph);

    let t = Instant::now();
    let live = live::live_nodes(&graph);
    guard::refuse_trapping_division(&graph, &live)?;
    // Loop kernels of kiln's own run on CUDA, one program per device: XLA's
    // SPMD partitioner cannot split a Triton call.
    let found = if opts.target == LowerTarget::Cuda && opts.loop_kernels && opts.shardings.is_none() {
        loop_kernel::find(&graph, &live)
    } else {
        Vec::new()
    };
    let (kernels, items) = kernels_in_order(&graph, &live, found);
    stats.push(PassStats {
        name: TARGET_PASSES[1],
        nodes_in: graph.len(),
        nodes_out: graph.len(),
        time: t.elapsed(),
        changed: kernels.len(),
        ..PassStats::default()
    });
    Ok(Prepared { graph, options: opts.clone(), stats, kernels, items })
}

/// Options that no module can be written for.
fn check_options(g: &Graph, opts: &LowerOptions) -> Result<(), CompileError> {
    let bad = if opts.num_replicas == 0 {
        Some("num_replicas must be at least 1".to_string())
    } else {
        match &opts.shardings {
            Some(sh) if sh.num_partitions == 0 => Some("num_partitions must be at least 1".to_string()),
            Some(sh) if sh.params.len() != g.param_types().len() || sh.outputs.len() != g.outputs().len() => {
                Some(format!(
                    "{} parameter and {} output shardings for {} parameters and {} outputs",
                    sh.params.len(),
                    sh.outputs.len(),
                    g.param_types().len(),
                    g.outputs().len()
                ))
            }
            _ => None,
        }
    };
    match bad {
        Some(reason) => Err(CompileError::Verify { node: "module".to_string(), reason }),
        None => Ok(()),
    }
}
