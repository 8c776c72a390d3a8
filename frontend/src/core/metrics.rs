//! Counters of what the frontend and runtime did: traces, compiles, cache hits
//! (memory and disk), executions, transfers, forced syncs, recompile
//! explanations, and an optional per-step timeline for the profiler.
//!
//! Counters are per thread (the lazy-tensor context is per thread). Reading them
//! never syncs the device.

use std::cell::RefCell;
use std::fmt;
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

impl RematRecord {
    /// One line on the plan: whether it met its budget, what it recomputed
    /// and the peaks by kiln's model (the training loops' `remat:` line).
    pub fn line(&self) -> String {
        let r = &self.plan;
        let flops = r.extra_flops() as f64;
        let share = self
            .activation_fraction
            .map(|f| format!(" (arguments and outputs, and {:.0}% of the activation memory)", f * 100.0))
            .unwrap_or_default();
        let recomputed = match r.values_recomputed() {
            0 => "nothing recomputed".to_string(),
            n => format!("{n} value(s) recomputed ({flops:.2e} extra FLOPs)"),
        };
        // Live temporaries are what a percentage is of; XLA places some in
        // the outputs' allocations (on the CPU plugin most of a small step's),
        // so what it allocates for them is given too.
        format!(
            "peak budget {}{share} {}: {recomputed}{}, predicted peak {} -> {}, live temporaries {} -> {} \
             (as XLA allocates them, {} -> {}){}",
            bytes(r.budget_bytes),
            if r.met {
                "met".to_string()
            } else {
                format!(
                    "not met (the lowest peak found, {} over it)",
                    bytes(r.after.peak_bytes.saturating_sub(r.budget_bytes))
                )
            },
            if r.offloaded.is_empty() { String::new() } else { format!(", {} kept in host memory", r.offloaded.len()) },
            bytes(r.before.peak_bytes),
            bytes(r.after.peak_bytes),
            bytes(r.before.temp_peak_bytes),
            bytes(r.after.temp_peak_bytes),
            bytes(r.before.allocated_temp_bytes),
            bytes(r.after.allocated_temp_bytes),
            match &self.mesh {
                Some(mesh) => format!("; the whole step's figures, before XLA partitions it over {mesh}"),
                None => String::new(),
            },
        )
    }
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

/// A human-readable report of the counters.
pub fn report() -> String {
    snapshot().to_string()
}

/// When compilation has paid for itself against running eagerly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Payback {
    /// No eager baseline was measured, or nothing ran.
    Unknown,
    /// Compiled steps are not faster than eager ones: compilation never pays.
    Never,
    /// After this many executed steps, the time compiled steps saved over eager
    /// ones exceeds the time spent compiling.
    AfterSteps(u64),
}

impl Metrics {
    /// Counts one optimizer pipeline run.
    pub fn record_pipeline(&mut self, stats: &kiln_compiler::pipeline::PipelineStats, took: Duration) {
        self.pipeline_runs += 1;
        self.pipeline_time += took;
        self.last_pipeline = Some(stats.clone());
        if let Some(r) = stats.passes.iter().find_map(|p| p.remat.as_ref()) {
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

    /// The remat plan of the program with the largest unplanned peak: in a
    /// training run, the train step's (the parameters' init and an
    /// evaluation program keep nothing for a backward and peak lower).
    pub fn step_remat_plan(&self) -> Option<&RematRecord> {
        self.remat_plans.iter().max_by_key(|r| r.plan.before.peak_bytes)
    }

    /// [`RematRecord::line`] of [`Metrics::step_remat_plan`].
    pub fn step_remat_line(&self) -> Option<String> {
        self.step_remat_plan().map(RematRecord::line)
    }

    /// Mean time of one execution: the execute call plus the time blocked on
    /// the devices (steps are asynchronous, so the call alone is the enqueue).
    pub fn execute_time_per_step(&self) -> Option<Duration> {
        (self.executions > 0).then(|| (self.execute_time + self.device_wait_time) / self.executions as u32)
    }

    /// The break-even point of compilation against the eager baseline.
    pub fn payback(&self) -> Payback {
        let (Some(eager), Some(compiled)) = (self.eager_step_time, self.execute_time_per_step()) else {
            return Payback::Unknown;
        };
        if eager <= compiled {
            return Payback::Never;
        }
        let saved_per_step = (eager - compiled).as_secs_f64();
        Payback::AfterSteps((self.compile_time.as_secs_f64() / saved_per_step).ceil() as u64)
    }
}

/// `n` bytes for a person, as the remat line gives them: GiB with two
/// decimals from one GiB up, then MiB and KiB with one, then bytes.
pub fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

impl fmt::Display for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        writeln!(
            f,
            "steps            {} ({} ops recorded, {:.1} ms closing traces)",
            self.steps,
            self.ops_recorded,
            ms(self.trace_time)
        )?;
        writeln!(f, "compiles         {} ({:.1} ms)", self.compiles, ms(self.compile_time))?;
        writeln!(
            f,
            "cache hits       {} in memory, {} from disk ({:.1} ms loading, {:.1} ms of compiling saved)",
            self.cache_hits,
            self.disk_hits,
            ms(self.disk_load_time),
            ms(self.compile_time_saved)
        )?;
        if self.corrupt_cache_entries > 0 {
            writeln!(f, "corrupt entries  {} (recompiled and replaced)", self.corrupt_cache_entries)?;
        }
        if let Some(p) = &self.last_pipeline {
            let fired: usize = p.rules_fired().values().sum();
            let groups = p.passes.iter().filter_map(|s| s.fusion_groups).next_back();
            writeln!(
                f,
                "optimizer        {} run(s), {:.1} ms; last: {} -> {} nodes, {} rewrites, {} fusion groups",
                self.pipeline_runs,
                ms(self.pipeline_time),
                p.nodes_pruned,
                p.nodes_out,
                fired,
                groups.map_or("no".to_string(), |g| g.to_string())
            )?;
            for s in &p.passes {
                let stop = s.stop_reason.as_deref().map(|r| format!(", {r}")).unwrap_or_default();
                writeln!(
                    f,
                    "  {:<14} {:>7} -> {:>7} nodes {:>8.2} ms{stop}",
                    s.name,
                    s.nodes_in,
                    s.nodes_out,
                    ms(s.time)
                )?;
            }
        }
        if let Some(line) = self.step_remat_line() {
            writeln!(f, "remat            {line}")?;
        }
        writeln!(f, "recompiles       {}", self.recompiles)?;
        for e in &self.recompile_explanations {
            writeln!(f, "  - {e}")?;
        }
        writeln!(
            f,
            "executions       {} ({:.1} ms in execute calls, {:.1} ms waiting on the devices)",
            self.executions,
            ms(self.execute_time),
            ms(self.device_wait_time)
        )?;
        writeln!(f, "host->device     {}", bytes(self.host_to_device_bytes))?;
        writeln!(f, "device->host     {}", bytes(self.device_to_host_bytes))?;
        writeln!(f, "reads            {} ({} forced syncs)", self.reads, self.forced_syncs)?;
        match self.execute_time_per_step() {
            Some(per) if self.compile_time > Duration::ZERO => {
                let steps_worth = self.compile_time.as_secs_f64() / per.as_secs_f64().max(1e-12);
                write!(
                    f,
                    "compilation      {:.1} ms = {:.0} steps of execution ({:.3} ms each); amortized over {} executions: {:.3} ms per step",
                    ms(self.compile_time),
                    steps_worth,
                    ms(per),
                    self.executions,
                    ms(self.compile_time) / self.executions as f64
                )?;
            }
            _ => write!(f, "compilation      none in this run")?,
        }
        match self.payback() {
            Payback::Unknown => Ok(()),
            Payback::Never => write!(
                f,
                "\npaid for itself  never: eager steps ({:.3} ms) are not slower than compiled ones",
                ms(self.eager_step_time.unwrap_or_default())
            ),
            Payback::AfterSteps(n) => {
                let status = if self.executions >= n { "reached" } else { "not yet reached" };
                write!(
                    f,
                    "\npaid for itself  after {n} steps against the eager reference ({:.3} ms per step): {status} ({} run)",
                    ms(self.eager_step_time.unwrap_or_default()),
                    self.executions
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payback_is_compile_time_over_time_saved_per_step() {
        let mut m = Metrics { executions: 10, execute_time: Duration::from_millis(20), ..Metrics::default() };
        assert_eq!(m.payback(), Payback::Unknown);
        m.compile_time = Duration::from_millis(100);
        m.eager_step_time = Some(Duration::from_millis(12));
        // 2 ms compiled vs 12 ms eager: 10 ms saved per step, 100 ms to repay.
        assert_eq!(m.payback(), Payback::AfterSteps(10));
        assert!(m.to_string().contains("after 10 steps"), "{m}");
        m.eager_step_time = Some(Duration::from_millis(1));
        assert_eq!(m.payback(), Payback::Never);
    }

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
