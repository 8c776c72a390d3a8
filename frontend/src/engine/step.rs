//! Cutting a step: `mark_step` turns the trace into a program, finds or compiles
//! it, runs it, and makes the pending tensors ready.
//!
//! Invariants:
//! - The hit path (same trace as an earlier step) finishes the running hash of
//!   the trace, looks it up and executes; it never prunes, lowers or optimizes.
//! - Parameters whose old buffers nothing else holds are donated to the value
//!   assigned over them (where donation is on), so parameters and optimizer
//!   state update in place.
//! - Failures of earlier asynchronous steps that are already known are
//!   reported first, before anything of this step runs.
//! - The backend is dispatched on in one place (`cut`), which picks what the
//!   executor runs.
//! - A step's outputs reach their tensors even when a failure is reported with
//!   them: the step was enqueued and its receivers must not stay pending.
//! - A trace with no live pending tensor runs nothing.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use kiln_compiler::ir::{Alias, Graph};
use kiln_compiler::passes::eliminate_dead_code;

use crate::core::error::{FrontendError, Result};
use crate::core::metrics;
use crate::core::storage::{Inner, State, Storage};
use crate::core::trace::{Binding, Trace};
use crate::engine::compile;
use crate::engine::context;
use crate::engine::executor::Backend;
use crate::engine::program_cache::CacheEntry;
use crate::engine::run::{self, select, RunInput};

/// What one `mark_step` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Values the step produced.
    pub outputs: usize,
    /// Nodes of the program after pruning.
    pub nodes: usize,
    /// Whether the program was compiled by this step (a cache miss).
    pub compiled: bool,
    /// Parameters donated to outputs.
    pub donated: usize,
    /// Why the step needed a new program, when it resembles an earlier one
    /// (also logged and kept in `metrics::snapshot().recompile_explanations`).
    pub recompile: Option<String>,
}

/// A finished trace with its outputs chosen (not yet pruned).
pub(crate) struct Closed {
    pub graph: Graph,
    pub bindings: Vec<Binding>,
    /// For each output, the tensors that receive it.
    pub receivers: Vec<Vec<Rc<Inner>>>,
    /// Key of the trace as recorded (see [`Trace::raw_key`]), with the
    /// layouts under a mesh.
    key: u64,
    /// Under a mesh, each output's layout (`engine::partition`).
    pub out_shardings: Option<Vec<crate::core::mesh::Sharding>>,
}

impl Closed {
    /// Which bindings an output is assigned over (their tensors receive one).
    pub fn assigned(&self) -> Vec<bool> {
        let received: std::collections::HashSet<u64> = self.receivers.iter().flatten().map(|r| r.id).collect();
        self.bindings.iter().map(|b| received.contains(&b.tensor_id)).collect()
    }
}

/// Closes `trace`: its live pending tensors become outputs.
pub(crate) fn close(mut trace: Trace, donate: bool) -> Result<Option<Closed>> {
    let epoch = trace.epoch;
    let mut outputs = Vec::new();
    let mut receivers: Vec<Vec<Rc<Inner>>> = Vec::new();
    for weak in &trace.live {
        let Some(t) = weak.upgrade() else { continue };
        let value = match &*t.state.borrow() {
            State::Pending { epoch: e, value } if *e == epoch => *value,
            _ => continue,
        };
        match outputs.iter().position(|&v| v == value) {
            Some(i) => {
                if !receivers[i].iter().any(|r: &Rc<Inner>| Rc::ptr_eq(r, &t)) {
                    receivers[i].push(t);
                }
            }
            None => {
                outputs.push(value);
                receivers.push(vec![t]);
            }
        }
    }
    if outputs.is_empty() {
        return Ok(None);
    }
    trace.graph.set_outputs(outputs)?;
    if donate {
        add_donations(&mut trace, &receivers)?;
    }
    let out_shardings = crate::engine::partition::output_shardings(&receivers);
    let key = trace.raw_key() ^ crate::engine::partition::layout_key(&trace.bindings, out_shardings.as_deref());
    Ok(Some(Closed { graph: trace.graph, bindings: trace.bindings, receivers, key, out_shardings }))
}

/// Prunes dead code; returns the program and the bindings that feed it.
fn prune(graph: &Graph, bindings: Vec<Binding>) -> Result<(Graph, Vec<u32>, Vec<Binding>)> {
    let pruned = eliminate_dead_code(graph)?;
    let bindings = select(bindings, &pruned.kept_params);
    Ok((pruned.graph, pruned.kept_params, bindings))
}

/// Donates a parameter's buffer to the output assigned over it, when nothing
/// but the trace still holds the data.
fn add_donations(trace: &mut Trace, receivers: &[Vec<Rc<Inner>>]) -> Result<()> {
    for (p, b) in trace.bindings.iter().enumerate() {
        // Host data counts too: it is uploaded into a fresh buffer that nothing
        // else will hold, so step 1 (host-initialised state) compiles to the same
        // program as every later step (device state).
        // Under `lower`, the undo log's copy of the old state is one more
        // holder that a step outside it would not have.
        let holders = 1 + usize::from(crate::engine::undo_assigns::saved_holds(&b.storage));
        let sole_holder = match &b.storage {
            Storage::Device(value) => Rc::strong_count(value) == holders,
            Storage::Host(lit) => Arc::strong_count(lit) == holders,
            Storage::HostShards(shards) => Arc::strong_count(shards) == holders,
        };
        if !sole_holder {
            continue;
        }
        let Some(out) = receivers.iter().position(|rs| rs.iter().any(|r| r.id == b.tensor_id)) else { continue };
        let alias = Alias { param: p as u32, output: out as u32 };
        if trace.graph.ty(trace.graph.outputs()[out]) == &trace.graph.node(trace.graph.params()[p]).outputs[0]
            && trace.graph.aliases().iter().all(|a| a.output != alias.output)
        {
            trace.graph.add_alias(alias)?;
        }
    }
    Ok(())
}

/// Whether assigned-over parameters donate their buffers.
///
/// `KILN_DONATE` (a boolean, `kiln_runtime::env::parse_bool`) decides; otherwise donation is on for every platform
/// but the XLA CPU plugin. With `xla-cpu-pjrt` 0.0.1, a program whose large
/// (about 800 KB) donated parameters came back from its own aliased outputs was
/// seen computing with wrong values from its second run on, while the same text
/// compiled afresh computed correctly; the CUDA plugin gives bit-identical
/// training with and without donation (docs/donation.md). Without donation old
/// buffers are still freed when a step replaces them, so live buffers stay flat.
pub fn donation_enabled() -> Result<bool> {
    let on_cpu = || Ok::<_, FrontendError>(context::with(|c| c.client())?.platform_name() == "cpu");
    match kiln_runtime::env::bool_var("KILN_DONATE")? {
        Some(true) => {
            // Once per process: this is asked at every step.
            static WARNED: std::sync::Once = std::sync::Once::new();
            if !WARNED.is_completed() && on_cpu()? {
                WARNED.call_once(|| ());
                let text = "KILN_DONATE=1 with the XLA CPU plugin, which has computed wrong values on donated buffers \
                            (an MLP trained to 20% accuracy; docs/donation.md): donation is off there by default";
                tracing::warn!("kiln: {text}");
                crate::core::warnings::show_once(crate::core::warnings::Warning::DonationOnCpu, || text.to_string());
            }
            Ok(true)
        }
        Some(false) => Ok(false),
        None => Ok(!on_cpu()?),
    }
}

/// Runs the current step: every live pending tensor becomes ready.
pub fn mark_step() -> Result<StepReport> {
    Ok(cut_step()?.map(|c| c.report).unwrap_or_default())
}

/// What a step that ran was made of (for captured steps: `crate::engine::capture`).
pub(crate) struct CutStep {
    pub report: StepReport,
    /// The raw trace's key.
    pub key: u64,
    /// The program and how it was fed (`None` on the reference backend).
    pub entry: Option<Rc<CacheEntry>>,
    /// The tensor behind each program parameter, in parameter order.
    pub params: Vec<(std::rc::Weak<Inner>, u64)>,
    /// For each output, the tensors that received it.
    pub receivers: Vec<Vec<Rc<Inner>>>,
    /// The step's device-side checks (a replay reads them from its own flag
    /// output).
    pub checks: Option<crate::engine::device_checks::Sealed>,
}

/// `mark_step`, returning what the step was made of (`None`: nothing to run).
pub(crate) fn cut_step() -> Result<Option<CutStep>> {
    let t0 = Instant::now();
    metrics::cut_started(t0);
    let cut = cut(t0);
    metrics::cut_finished();
    cut
}

fn cut(t0: Instant) -> Result<Option<CutStep>> {
    // Failures of earlier asynchronous steps that are already known come first.
    run::poll()?;
    // Device-side checks (device_checks.rs): sealed into this trace's outputs
    // before it closes, verified once the step's results are known (below).
    let checks = crate::engine::device_checks::seal()?;
    let (trace, backend) = context::with(|c| (std::mem::replace(&mut c.trace, Trace::new()), c.exec.backend));
    let hooks = run::take_hooks();
    let epoch = trace.epoch;
    if backend == Backend::Eager {
        crate::engine::eager::catch_up(&trace)?;
    }
    let donate = backend == Backend::Pjrt && donation_enabled()?;
    let Some(closed) = close(trace, donate)? else {
        return Ok(None);
    };
    metrics::update(|m| {
        m.steps += 1;
        m.trace_time += t0.elapsed();
    });
    let step = metrics::steps();
    let assigned = closed.assigned();
    let Closed { graph, bindings, receivers, key, out_shardings } = closed;
    let mut report = StepReport { outputs: receivers.len(), ..StepReport::default() };
    let param_of = |b: &Binding| (b.tensor.clone(), b.tensor_id);
    // The one place that dispatches on the backend.
    let (results, entry, params) = match backend {
        Backend::Pjrt => {
            let entry = compiled(&graph, &bindings, &assigned, out_shardings.as_deref(), key, &mut report)?;
            report.nodes = entry.nodes;
            report.donated = entry.donated.iter().filter(|&&d| d).count();
            let bindings = select(bindings, &entry.kept_params);
            let params = bindings.iter().map(param_of).collect();
            (run::execute(RunInput::Compiled { entry: &entry, bindings }, step, hooks), Some(entry), params)
        }
        Backend::Reference => {
            let (program, _, bindings) = prune(&graph, bindings)?;
            report.nodes = program.len();
            let params = bindings.iter().map(param_of).collect();
            (run::execute(RunInput::Reference { graph: &program, bindings }, step, hooks), None, params)
        }
        Backend::Eager => {
            let outputs = crate::engine::eager::finish(epoch, &graph)?;
            let reported = hooks
                .into_iter()
                .try_for_each(|hook| hook().map_err(|e| FrontendError::StepFailed { step, reason: e.to_string() }));
            (Ok(run::Executed { outputs, reported }), None, Vec::new())
        }
    };
    // Outputs are handed out even when a failure is reported now: this step
    // was enqueued and its receivers must not stay pending.
    let executed = results?;
    for (storage, receivers) in executed.outputs.into_iter().zip(&receivers) {
        for t in receivers {
            *t.state.borrow_mut() = State::Ready(storage.clone());
        }
    }
    // Device-side checks run when the step's results are known: now on a
    // synchronous backend, at the next read or mark_step otherwise.
    if let Some(sealed) = &checks {
        let sealed = sealed.rebind(sealed.flags().clone());
        run::after_step(step, Box::new(move || crate::engine::device_checks::verify(Some(sealed))))?;
    }
    executed.reported?;
    Ok(Some(CutStep { report, key, entry, params, receivers, checks }))
}

/// The compiled program for `graph`: from the raw-trace cache (the hit path),
/// or found or built by [`compile::obtain`].
fn compiled(
    graph: &Graph,
    bindings: &[Binding],
    assigned: &[bool],
    out_shardings: Option<&[crate::core::mesh::Sharding]>,
    key: u64,
    report: &mut StepReport,
) -> Result<Rc<CacheEntry>> {
    let hit = context::with(|c| {
        let entry = c.cache.traces.get(&key).cloned();
        if entry.is_some() {
            c.cache.new_programs_in_a_row = 0;
        }
        entry
    });
    if let Some(entry) = hit {
        metrics::update(|m| m.cache_hits += 1);
        return Ok(entry);
    }
    let client = context::with(|c| c.client())?;
    let got = compile::obtain(
        graph,
        bindings,
        assigned,
        out_shardings,
        &client,
        crate::engine::replicas::global_replicas()?,
    )?;
    report.compiled = got.compiled;
    report.recompile = got.explanation;
    let new_program = got.compiled || report.recompile.is_some();
    let streak = context::with(|c| {
        c.cache.new_programs_in_a_row = if new_program { c.cache.new_programs_in_a_row + 1 } else { 0 };
        c.cache.new_programs_in_a_row
    });
    if streak >= RECOMPILE_STREAK && streak.is_power_of_two() {
        metrics::update(|m| m.recompile_warnings += 1);
        tracing::warn!(
            "kiln: the last {streak} steps each needed a new program: shapes or constants change every step, so \
             every step compiles (metrics::snapshot().recompile_explanations says what changed)"
        );
        crate::core::warnings::show_once(crate::core::warnings::Warning::RecompileStreak, || {
            format!("the last {streak} steps each needed a new program: shapes or constants change every step")
        });
    }
    tracing::debug!(nodes = got.entry.nodes, compiled = got.compiled, "kiln: new step program");
    let entry = Rc::new(got.entry);
    context::with(|c| c.cache.traces.insert(key, entry.clone()));
    Ok(entry)
}

/// Steps in a row with a new program before kiln warns that a loop recompiles
/// every step (then again at every power of two).
const RECOMPILE_STREAK: u32 = 4;

/// Runs `f` as one step: records it, then `mark_step`.
pub fn step<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let r = f()?;
    mark_step()?;
    Ok(r)
}
