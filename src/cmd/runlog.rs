//! `kiln train ... --log run.jsonl`: one JSON object per line as the run goes,
//! for `kiln plot` and for whatever a user reads logs with.
//!
//! Lines: `{"kind":"step","step":N,"epoch":E,"loss":L,"lr":R,"step_ms":T,
//! "<unit>_per_second":X,"skipped_steps":S,"grad_norm":G,
//! "device_memory_bytes":M,"device_peak_bytes":P}` (the busiest device's
//! bytes now and at peak, `null` where the plugin does not report them) once
//! a step's loss is read (one
//! step late: the loop reads step n while step n+1 runs), and
//! `{"kind":"eval","step":N,"test_accuracy":A}` for an evaluation. A loss that
//! is not finite is written as `null` (JSON has no NaN).
//!
//! Invariants:
//! - The destination is checked at start (a regular file or nothing, in a
//!   directory that takes a new file), so a bad path fails before training.
//! - Each line reaches the file whole (one `write_all` of the line and its
//!   newline, flushed), so a reader or a killed run sees whole lines only.
//! - A write error does not stop the run: it is printed once and returned by
//!   [`RunLog::finish`], so the run's exit status says the log is incomplete.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde_json::{json, Value};

/// An open log, or none (`--log` not given).
pub struct RunLog {
    out: Option<(PathBuf, std::fs::File)>,
    error: Option<std::io::Error>,
    /// What the throughput counts (`tokens`, `examples`) and how many a step takes.
    unit: &'static str,
    per_step: f64,
    /// Whether the devices report their memory (`None`: not asked yet).
    memory_stats: Option<bool>,
}

impl RunLog {
    /// Opens `path` (replacing a file there) after checking it can be written.
    pub fn create(path: Option<&Path>, unit: &'static str, per_step: f64) -> anyhow::Result<RunLog> {
        let out = match path {
            None => None,
            Some(p) => {
                let target = kiln::atomic_write::check_writable(p).with_context(|| format!("--log {}", p.display()))?;
                let file =
                    std::fs::File::create(&target).with_context(|| format!("--log {}: creating it", p.display()))?;
                Some((p.to_path_buf(), file))
            }
        };
        Ok(RunLog { out, error: None, unit, per_step, memory_stats: None })
    }

    /// A step's line.
    pub fn step(&mut self, s: &kiln::models::mlp::StepInfo) {
        if self.out.is_none() {
            return;
        }
        let throughput = (s.step_ms > 0.0).then(|| self.per_step / (s.step_ms / 1e3));
        let mut v = json!({
            "kind": "step",
            "step": s.step,
            "epoch": s.epoch + 1,
            "loss": finite(s.loss),
            "lr": finite(s.lr),
            "step_ms": finite(s.step_ms),
            "skipped_steps": s.skipped_steps,
            "grad_norm": s.grad_norm.map_or(Value::Null, finite),
        });
        v[format!("{}_per_second", self.unit)] = throughput.map_or(Value::Null, finite);
        let (now, peak) = self.device_memory();
        v["device_memory_bytes"] = now.map_or(Value::Null, |b| json!(b));
        v["device_peak_bytes"] = peak.map_or(Value::Null, |b| json!(b));
        self.line(&v);
    }

    /// The bytes the busiest local device holds now and its peak so far,
    /// where the plugin reports them (the CUDA plugin; not the XLA CPU
    /// plugin, which is asked once).
    fn device_memory(&mut self) -> (Option<u64>, Option<u64>) {
        if self.memory_stats == Some(false) || kiln::backend() != kiln::Backend::Pjrt {
            return (None, None);
        }
        let stats: Option<Vec<(u64, Option<u64>)>> = kiln::client()
            .ok()
            .and_then(|c| c.devices().iter().map(|d| d.memory_in_use().ok()).collect::<Option<Vec<_>>>());
        self.memory_stats = Some(stats.is_some());
        let stats = stats.unwrap_or_default();
        (stats.iter().map(|s| s.0).max(), stats.iter().filter_map(|s| s.1).max())
    }

    /// An evaluation's line.
    pub fn eval(&mut self, step: u64, metric: &str, value: f64) {
        let mut v = json!({ "kind": "eval", "step": step });
        v[metric] = finite(value);
        self.line(&v);
    }

    fn line(&mut self, v: &Value) {
        let Some((path, file)) = &mut self.out else { return };
        if self.error.is_some() {
            return;
        }
        let mut text = v.to_string();
        text.push('\n');
        if let Err(e) = file.write_all(text.as_bytes()).and_then(|()| file.flush()) {
            eprintln!("kiln: --log {}: {e}; the log stops here, the run goes on", path.display());
            self.error = Some(e);
        }
    }

    /// The first write error, if any (the log is then incomplete).
    pub fn finish(self) -> anyhow::Result<()> {
        match (self.error, self.out) {
            (Some(e), Some((path, _))) => Err(e).with_context(|| format!("--log {}: incomplete", path.display())),
            _ => Ok(()),
        }
    }
}

fn finite(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}
