//! Counters of what the frontend and runtime did: traces, compiles, cache hits
//! (memory and disk), executions, transfers, forced syncs, recompile
//! explanations, remat plans, and an optional per-step timeline for the
//! profiler. The counting side: `api::metrics` reads them for a person.
//!
//! Invariants:
//! - Counters are per thread (the lazy-tensor context is per thread), and
//!   only grow until [`reset`]; the kept lists (recompile explanations, remat
//!   plans) hold the newest entries, oldest first, at a fixed bound.
//! - Counting never syncs the device, records or compiles, and reading the
//!   counters ([`snapshot`]) costs a copy.
//! - A timeline span belongs to the step being cut when it ends (reads after
//!   step n belong to n).

use std::cell::RefCell;
use std::time::{Duration, Instant};

/// How many recompile explanations are kept (the newest).
const KEPT_EXPLANATIONS: usize = 16;

/// A snapshot of the counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics {
    /// Ops recorded into traces.
    pub ops_recorded: u64,
    /// Steps cut by `mark_step` (or a forced sync) that had work to do.
    pub steps: u64,
    /// Programs compiled (misses of every cache).
    pub compiles: u64,
    pub compile_time: Duration,
    /// Steps served by a program already in memory.
    pub cache_hits: u64,
    /// Calls of captured steps (`compile_step`) that replayed their program
    /// without tracing.
    pub replays: u64,
    /// Calls of captured steps that had to trace again (each explained in a
    /// log line and `CompiledStep::last_retrace`).
    pub retraces: u64,
    /// Programs loaded from the persistent cache instead of compiled.
    pub disk_hits: u64,
    /// Time spent loading programs from the persistent cache.
    pub disk_load_time: Duration,
    /// What the disk hits' programs took to compile when they were stored.
    pub compile_time_saved: Duration,
    /// Time spent writing newly compiled programs to the persistent cache.
    pub disk_store_time: Duration,
    /// Damaged persistent-cache entries met (each recompiled and replaced).
    pub corrupt_cache_entries: u64,
    pub executions: u64,
    /// Host time inside the plugin's execute calls: the enqueue of an
    /// asynchronous step (a plugin that runs inline spends the run here).
    pub execute_time: Duration,
    /// Host time moving step arguments that were host data to the devices
    /// (the copies are enqueued; a plugin may wait for them).
    pub upload_time: Duration,
    /// Time the host blocked waiting on the devices: for a step in flight to
    /// finish (the bound on steps in flight, `sync`) or for a read's data.
    pub device_wait_time: Duration,
    /// FLOPs the executions performed, summed over replicas (cost model).
    pub flops_executed: f64,
    /// Time spent closing traces and finding their programs on hits.
    pub trace_time: Duration,
    pub host_to_device_bytes: u64,
    pub device_to_host_bytes: u64,
    /// Composites `grad` found in plain ops and rewrote (attention).
    pub composites_found: u64,
    /// Candidates `grad` looked at and left plain (each with a reason, in a
    /// warning and in `kiln compile`).
    pub composites_missed: u64,
    /// Reads (`to_vec`, `item`) of a value that was still pending, which forced
    /// the step to run early.
    pub forced_syncs: u64,
    /// Explicit reads of values (each a host sync).
    pub reads: u64,
    /// New programs that resembled an earlier one (same ops, other shapes or
    /// attributes): recompiles a user could avoid.
    pub recompiles: u64,
    /// What changed, for the newest recompiles (at most 16).
    pub recompile_explanations: Vec<String>,
    /// Warnings that a loop needs a new program every step.
    pub recompile_warnings: u64,
    /// The median time of one step run eagerly on the reference interpreter,
    /// when measured (`kiln profile` does): the baseline that compilation must
    /// pay for itself against.
    pub eager_step_time: Option<Duration>,
    /// Optimizer pipeline runs (one per program built on a miss) and their time.
    pub pipeline_runs: u64,
    pub pipeline_time: Duration,
    /// What the newest pipeline run did, pass by pass.
    pub last_pipeline: Option<kiln_compiler::pipeline::PipelineStats>,
    /// The fusion groups the fusion analysis ([`kiln_compiler::fusion::plan_fusion`])
    /// expects in the last optimized graph.
    pub last_fusion_groups: Option<usize>,
    /// The remat plans of the programs built under a memory limit, oldest
    /// first (the newest [`KEPT_REMAT_PLANS`]). [`Metrics::step_remat_plan`]
    /// picks the training step's.
    pub remat_plans: Vec<RematRecord>,
}

/// How many remat plans [`Metrics::remat_plans`] keeps (the newest).
pub const KEPT_REMAT_PLANS: usize = 16;

/// One program's remat plan and the budget it was asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct RematRecord {
    pub plan: kiln_compiler::pipeline::RematSummary,
    /// The share of the activation memory the budget kept
    /// ([`crate::set_activation_budget`]), `None` for a byte limit.
    pub activation_fraction: Option<f64>,
    /// The mesh the step was partitioned over (`data=2,model=2`), `None`
    /// without one. The plan is made before XLA partitions the step, so its
    /// figures are the whole step's, every device's shards together.
    pub mesh: Option<String>,
}

/// One span of the per-step timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// `trace`, `compile`, `disk_load`, `upload`, `execute`, `device_wait`,
    /// `download`, `device_checks`, `device_checks_read`.
    pub name: &'static str,
    /// The step the span belongs to (1-based; reads after step n belong to n).
    pub step: u64,
    /// Start, from the moment the timeline was started.
    pub start: Duration,
    pub duration: Duration,
}

struct Timeline {
    origin: Instant,
    /// End of the previous `mark_step`: where the next `trace` span starts.
    last_cut: Instant,
    events: Vec<Event>,
}

thread_local! {
    static METRICS: RefCell<Metrics> = RefCell::new(Metrics::default());
    static TIMELINE: RefCell<Option<Timeline>> = const { RefCell::new(None) };
}

pub(crate) fn update(f: impl FnOnce(&mut Metrics)) {
    METRICS.with(|m| f(&mut m.borrow_mut()));
}

pub(crate) fn explain(text: String) {
    update(|m| {
        m.recompiles += 1;
        if m.recompile_explanations.len() == KEPT_EXPLANATIONS {
            m.recompile_explanations.remove(0);
        }
        m.recompile_explanations.push(text);
    });
}

/// Records a span that started at `start` and ends now, if a timeline is on.
pub(crate) fn span(name: &'static str, start: Instant) {
    TIMELINE.with(|t| {
        if let Some(t) = t.borrow_mut().as_mut() {
            let step = METRICS.with(|m| m.borrow().steps);
            t.events.push(Event {
                name,
                step,
                start: start.saturating_duration_since(t.origin),
                duration: start.elapsed(),
            });
        }
    });
}

/// Marks the start of a step's cut: the time since the previous cut was spent
/// recording (the `trace` span).
pub(crate) fn cut_started(now: Instant) {
    TIMELINE.with(|t| {
        if let Some(t) = t.borrow_mut().as_mut() {
            let step = METRICS.with(|m| m.borrow().steps) + 1;
            t.events.push(Event {
                name: "trace",
                step,
                start: t.last_cut.saturating_duration_since(t.origin),
                duration: now.saturating_duration_since(t.last_cut),
            });
        }
    });
}

pub(crate) fn cut_finished() {
    TIMELINE.with(|t| {
        if let Some(t) = t.borrow_mut().as_mut() {
            t.last_cut = Instant::now();
        }
    });
}

/// Starts recording a per-step timeline on this thread (clearing any earlier one).
pub fn start_timeline() {
    let now = Instant::now();
    TIMELINE.with(|t| *t.borrow_mut() = Some(Timeline { origin: now, last_cut: now, events: Vec::new() }));
}

/// Stops the timeline and returns its spans in the order they ended.
pub fn take_timeline() -> Vec<Event> {
    TIMELINE.with(|t| t.borrow_mut().take().map(|t| t.events).unwrap_or_default())
}

/// Records the eager baseline (see [`Metrics::eager_step_time`]).
pub fn set_eager_step_time(d: Duration) {
    update(|m| m.eager_step_time = Some(d));
}

/// The counters so far on this thread.
pub fn snapshot() -> Metrics {
    METRICS.with(|m| m.borrow().clone())
}

/// Steps cut so far on this thread (cheaper than a snapshot).
pub(crate) fn steps() -> u64 {
    METRICS.with(|m| m.borrow().steps)
}

/// Resets the counters on this thread.
pub fn reset() {
    METRICS.with(|m| *m.borrow_mut() = Metrics::default());
}

impl Metrics {
    /// Counts one optimizer pipeline run.
    pub fn record_pipeline(
        &mut self,
        stats: &kiln_compiler::pipeline::PipelineStats,
        fusion_groups: usize,
        took: Duration,
    ) {
        self.last_fusion_groups = Some(fusion_groups);
        self.pipeline_runs += 1;
        self.pipeline_time += took;
        self.last_pipeline = Some(stats.clone());
        if let Some(r) = stats.passes.iter().find_map(|p| p.remat()) {
            if self.remat_plans.len() == KEPT_REMAT_PLANS {
                self.remat_plans.remove(0);
            }
            self.remat_plans.push(RematRecord {
                plan: r.clone(),
                activation_fraction: crate::core::settings::activation_budget(),
                mesh: crate::core::settings::active_mesh().filter(|m| m.size() > 1).map(|m| m.to_string()),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explanations_keep_the_newest() {
        reset();
        for i in 0..20 {
            explain(format!("e{i}"));
        }
        let m = snapshot();
        assert_eq!(m.recompiles, 20);
        assert_eq!(m.recompile_explanations.len(), KEPT_EXPLANATIONS);
        assert_eq!(m.recompile_explanations[0], "e4");
        reset();
    }
}
