//! Recording a function apart from the current step, without running it:
//! [`lower`] gives the StableHLO text of the program `mark_step` would
//! compile for what the function records (snapshot tests), [`capture_graph`]
//! the pruned step graph (what `kiln profile --max-batch` sizes).
//!
//! Invariants:
//! - `lower`'s text is the program `mark_step` would compile, byte for byte:
//!   the trace is closed as `mark_step` closes it (every live pending tensor
//!   an output, parameters assigned over donated where the backend donates,
//!   the device checks' flags, each output's layout under a mesh) and taken
//!   through the same pipeline, partitioner and target passes
//!   (`compile::program_text`, which shares its planning with the compile
//!   path). An optimizer step's text has its backward, its update and the
//!   aliasing of each parameter to its new value.
//! - The current step is set aside while the function records (its trace is
//!   swapped out) and restored afterwards, whatever the function returns.
//! - `lower` has no side effects: tensors the function assigns read as before
//!   afterwards (an undo log, `engine::undo_assigns`). `capture_graph` keeps
//!   no log: a function that assigns leaves its tensors pointing into a trace
//!   that ended without running (stale), as before.
//! - The function's outputs must be values it computed in its own trace;
//!   ready data or a value of another trace is a typed error.

use kiln_compiler::ir::Graph;
use kiln_compiler::{lower as lower_graph, pipeline, LowerOptions};

use crate::core::error::{FrontendError, Result};
use crate::core::storage::State;
use crate::core::tensor::Tensor;
use crate::core::trace::Trace;
use crate::engine::context;

/// Options of [`lower_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerOpts {
    /// Run kiln's optimization pipeline before lowering (what `mark_step`
    /// compiles); `false` lowers the trace as recorded (dead code removed).
    pub optimize: bool,
}

/// The StableHLO text of the program `mark_step` would compile right after
/// `f` records, without running anything (for snapshot tests): its outputs
/// are every value a live tensor is waiting for (what `f` returns, the
/// parameters and optimizer state it assigns, in the trace's order), with
/// donation, device checks and shardings as the step would have them, on
/// this thread's client (its platform's target passes). Side-effect free:
/// tensors that `f` assigns (parameters under an optimizer step, the
/// generator's state) read as before afterwards. Equivalent to
/// `lower_with(LowerOpts { optimize: true }, f)`.
pub fn lower(f: impl FnOnce() -> Result<Vec<Tensor>>) -> Result<String> {
    lower_with(LowerOpts { optimize: true }, f)
}

/// Like [`lower`], with options. `optimize: false` lowers the trace as
/// recorded, with `f`'s tensors as its only outputs (no pass, no donation):
/// the raw program, not the step.
pub fn lower_with(opts: LowerOpts, f: impl FnOnce() -> Result<Vec<Tensor>>) -> Result<String> {
    let outer = context::with(|c| std::mem::replace(&mut c.trace, Trace::new()));
    // Restores every tensor `f` assigns when this function returns.
    let _undo = crate::engine::undo_assigns::UndoAssigns::begin();
    // The device checks' flag output, as `mark_step` seals it (sealed in the
    // raw form too: the checks belong to this trace).
    let result = f().and_then(|outputs| Ok((outputs, crate::engine::device_checks::seal()?)));
    let inner = context::with(|c| std::mem::replace(&mut c.trace, outer));
    let (outputs, _checks) = result?;
    let mut values = Vec::with_capacity(outputs.len());
    for t in &outputs {
        match &*t.inner.state.borrow() {
            State::Pending { epoch, value } if *epoch == inner.epoch => values.push(*value),
            State::Pending { .. } => return Err(FrontendError::StaleTensor { op: "lower" }),
            State::Ready(_) => {
                return Err(FrontendError::InvalidArgument {
                    op: "lower",
                    reason: "an output is ready data, not a value computed by the lowered function".into(),
                })
            }
        }
    }
    if opts.optimize {
        return step_text(inner);
    }
    let mut graph = inner.graph;
    graph.set_outputs(values)?;
    let popts = pipeline::PipelineOptions { passes: vec![], ..pipeline::PipelineOptions::default() };
    let g = pipeline::run(&graph, &popts, &mut |_, _| {})?.graph;
    Ok(lower_graph(&g, &LowerOptions::default())?)
}

/// The text of the program `mark_step` would compile for `trace` (closed as
/// `mark_step` closes it, while the undo log still holds the assigned
/// tensors' old states: donation discounts them).
fn step_text(trace: Trace) -> Result<String> {
    let donate = context::with(|c| c.exec.backend) == crate::engine::executor::Backend::Pjrt
        && crate::engine::step::donation_enabled()?;
    let Some(closed) = crate::engine::step::close(trace, donate)? else {
        return Err(FrontendError::InvalidArgument { op: "lower", reason: "the function recorded no output".into() });
    };
    let assigned = closed.assigned();
    let client = context::with(|c| c.client())?;
    crate::engine::compile::program_text(
        &closed.graph,
        &closed.bindings,
        &assigned,
        closed.out_shardings.as_deref(),
        &client,
        crate::engine::replicas::global_replicas()?,
    )
}

/// The pruned step graph whose outputs are `f`'s tensors, recorded apart from
/// the current step and never run (what `kiln profile --max-batch` sizes).
/// Where the step checks values on the device (`engine::device_checks`), the
/// flag output `mark_step` would add comes last.
///
/// A tensor that `f` reads and then assigns over (an optimizer's update of a
/// parameter) and returns donates its buffer to that output, as a step does on
/// a backend that donates (every one but the XLA CPU plugin): the peak model
/// bills the new value to the old one's buffer.
pub fn capture_graph(f: impl FnOnce() -> Result<Vec<Tensor>>) -> Result<Graph> {
    let outer = context::with(|c| std::mem::replace(&mut c.trace, Trace::new()));
    // The flag output of the step's device checks, last, as `mark_step` adds it.
    let result = f().and_then(|mut outputs| {
        outputs.extend(crate::engine::device_checks::seal()?.map(|s| s.flags().clone()));
        Ok(outputs)
    });
    let inner = context::with(|c| std::mem::replace(&mut c.trace, outer));
    let outputs = result?;
    let mut graph = inner.graph;
    let mut values = Vec::with_capacity(outputs.len());
    for t in &outputs {
        match &*t.inner.state.borrow() {
            State::Pending { epoch, value } if *epoch == inner.epoch => values.push(*value),
            State::Pending { .. } | State::Ready(_) => return Err(FrontendError::StaleTensor { op: "capture_graph" }),
        }
    }
    graph.set_outputs(values)?;
    for (p, b) in inner.bindings.iter().enumerate() {
        let Some(out) = outputs.iter().position(|t| t.inner.id == b.tensor_id) else { continue };
        let alias = kiln_compiler::ir::Alias { param: p as u32, output: out as u32 };
        if graph.ty(graph.outputs()[out]) == &graph.node(graph.params()[p]).outputs[0] {
            graph.add_alias(alias)?;
        }
    }
    Ok(kiln_compiler::passes::eliminate_dead_code(&graph)?.graph)
}
