//! Counters of what the frontend and runtime did: traces, compiles, cache hits,
//! executions, transfers, forced syncs.
//!
//! Counters are per thread (the lazy-tensor context is per thread). Reading them
//! never syncs the device.

use std::cell::RefCell;
use std::fmt;
use std::time::Duration;

/// A snapshot of the counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics {
    /// Ops recorded into traces.
    pub ops_recorded: u64,
    /// Steps cut by `mark_step` (or a forced sync) that had work to do.
    pub steps: u64,
    /// Programs compiled (cache misses).
    pub compiles: u64,
    pub compile_time: Duration,
    /// Steps served by an already compiled program.
    pub cache_hits: u64,
    pub executions: u64,
    pub execute_time: Duration,
    /// Time spent turning a trace into a program key (prune, hash).
    pub trace_time: Duration,
    pub host_to_device_bytes: u64,
    pub device_to_host_bytes: u64,
    /// Reads (`to_vec`, `item`) of a value that was still pending, which forced
    /// the step to run early.
    pub forced_syncs: u64,
    /// Explicit reads of values (each a host sync).
    pub reads: u64,
}

thread_local! {
    static METRICS: RefCell<Metrics> = RefCell::new(Metrics::default());
}

pub(crate) fn update(f: impl FnOnce(&mut Metrics)) {
    METRICS.with(|m| f(&mut m.borrow_mut()));
}

/// The counters so far on this thread.
pub fn snapshot() -> Metrics {
    METRICS.with(|m| m.borrow().clone())
}

/// Resets the counters on this thread.
pub fn reset() {
    METRICS.with(|m| *m.borrow_mut() = Metrics::default());
}

/// A human-readable report of the counters.
pub fn report() -> String {
    snapshot().to_string()
}

impl fmt::Display for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        writeln!(f, "steps            {}", self.steps)?;
        writeln!(f, "ops recorded     {}", self.ops_recorded)?;
        writeln!(f, "compiles         {} ({:.1} ms)", self.compiles, ms(self.compile_time))?;
        writeln!(f, "cache hits       {}", self.cache_hits)?;
        writeln!(f, "executions       {} ({:.1} ms)", self.executions, ms(self.execute_time))?;
        writeln!(f, "trace            {:.1} ms", ms(self.trace_time))?;
        writeln!(f, "host->device     {} bytes", self.host_to_device_bytes)?;
        writeln!(f, "device->host     {} bytes", self.device_to_host_bytes)?;
        writeln!(f, "reads            {}", self.reads)?;
        write!(f, "forced syncs     {}", self.forced_syncs)
    }
}
