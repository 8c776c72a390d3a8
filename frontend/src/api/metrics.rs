//! Counters of what the frontend and runtime did: traces, compiles, cache hits
//! (memory and disk), executions, transfers, forced syncs, recompile
//! explanations, and an optional per-step timeline for the profiler.
//!
//! Counters are per thread (the lazy-tensor context is per thread). Reading them
//! never syncs the device.
//!
//! The reporting side: the counters are kept by `core::metrics` (counted by
//! every layer); here they are read for a person: [`report`], the `Display`
//! of [`Metrics`], what a step costs ([`Metrics::execute_time_per_step`]),
//! when compilation pays for itself ([`Metrics::payback`]) and the remat line.
//!
//! Invariant: reporting only reads a snapshot of the counters; it never
//! changes them.

use std::fmt;
use std::time::Duration;

pub use crate::core::metrics::{
    reset, set_eager_step_time, snapshot, start_timeline, take_timeline, Event, Metrics, RematRecord, KEPT_REMAT_PLANS,
};

impl RematRecord {
    /// One line on the plan: whether it met its budget, what it recomputed
    /// and the peaks by kiln's model (the training loops' `remat:` line).
    pub fn line(&self) -> String {
        let r = &self.plan;
        let flops = r.recomputed_flops() as f64;
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
            let groups = self.last_fusion_groups;
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
                let stop = s.stop_reason().map(|r| format!(", {r}")).unwrap_or_default();
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
}
