//! Running a step's program on its backend and tracking the steps still
//! running on the devices, through the executor's state
//! ([`crate::engine::executor`]) in the per-thread context.
//!
//! `mark_step` hands the executor a compiled program and the trace's
//! bindings; on the PJRT backend the executor uploads host data, moves
//! donated buffers in, enqueues the run and returns at once: the outputs are
//! device values that carry their step's [`StepRun`], and the host goes on
//! recording step n+1 while step n runs.
//!
//! Invariants:
//! - At most `max_in_flight` steps are unfinished when `mark_step` returns
//!   (default 2, `KILN_MAX_STEPS_IN_FLIGHT`, [`set_max_steps_in_flight`]);
//!   0 makes every step synchronous. The queue holds each step's events, so
//!   the memory they pin stays bounded however many steps run.
//! - Steps complete in the order they were enqueued (one queue per device in
//!   PJRT), so the queue is reaped from its front.
//! - A step's outcome is known once its completion events fired. A failure, or
//!   an error from a hook registered with [`on_step_complete`] while the step
//!   was recorded, is reported once, as `FrontendError::StepFailed` naming the
//!   step, by the first `mark_step`, read or [`sync`] that learns it. Nothing
//!   is silently dropped: a step whose outcome is unknown stays queued.
//! - A read waits only for the buffers it reads (PJRT orders the transfer
//!   after the run that defines them), not for the whole step or the queue.
//! - Host time and device waits are counted apart: `execute_time` is the time
//!   spent inside the plugin's execute call (the enqueue; a plugin that runs
//!   inline spends the run there), `device_wait_time` the time blocked on
//!   completion events.
//! - Backend dispatch happens in one place: `engine::step`'s `cut` picks a [`RunInput`]
//!   by [`Backend`], and [`execute`] runs it.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use kiln_compiler::ir::{Graph, Literal};
use kiln_runtime::{Buffer, Client, ExecArg};

use crate::core::element::element_type;
use crate::core::error::{FrontendError, Result};
use crate::core::metrics;
use crate::core::storage::{DeviceValue, Hook, State, StepRun, Storage};
use crate::core::trace::Binding;
use crate::engine::program_cache::CacheEntry;

/// Sets how many steps may still be running when `mark_step` returns (0: every
/// step waits for its devices before `mark_step` returns). Takes effect at the
/// next `mark_step`.
pub fn set_max_steps_in_flight(n: usize) {
    crate::engine::context::with(|c| c.exec.max_in_flight = Some(n));
}

/// Registers `hook` to run once the results of the step being recorded are
/// known (its devices finished without error), on this thread, at the first
/// `mark_step`, read or [`sync`] after that. An `Err` from the hook is reported
/// like a failure of the step: `FrontendError::StepFailed` naming it. Hooks of
/// a step that records nothing are dropped with it.
#[allow(dead_code)] // the hook for device-side checks; see docs/step.md
pub(crate) fn on_step_complete(hook: Hook) {
    crate::engine::context::with(|c| c.exec.hooks.push(hook));
}

/// Hooks registered for the step being recorded, taken by the step that
/// records them (an empty step drops them).
pub(crate) fn take_hooks() -> Vec<Hook> {
    crate::engine::context::with(|c| std::mem::take(&mut c.exec.hooks))
}

/// Steps enqueued on this thread whose outcome is not yet known to kiln (a
/// step may have finished on the device and still be counted until the next
/// `mark_step`, read or [`sync`] reaps it).
pub fn steps_in_flight() -> usize {
    crate::engine::context::with(|c| c.exec.in_flight.len())
}

/// Waits for every step in flight and reports the first failure.
pub fn sync() -> Result<()> {
    settle(0)
}

/// Waits, on every exit path, for the steps still running on the devices,
/// and drops what they report: the caller is already ending (with the error
/// it is about to print, or after a [`sync`] that reported the failures that
/// mattered). Call it before the process exits: the plugin's exit handlers
/// tear down state its threads use, and a step still running when they do
/// crashes the process (a SIGSEGV after the error was printed). Returns the
/// number of steps it waited for.
pub fn quiesce() -> usize {
    let mut waited = 0;
    loop {
        let front = crate::engine::context::with(|c| c.exec.in_flight.pop_front());
        let Some(run) = front else { return waited };
        waited += 1;
        if let Err(e) = finish(&run) {
            tracing::debug!(step = run.step, error = %e, "kiln: a step still in flight at exit failed");
        }
    }
}

/// Runs `hook` once step `step`'s results are known: attached to the step
/// while it is in flight, run now when it has finished (synchronous backends,
/// or a queue bound that already waited for it). Unlike [`on_step_complete`],
/// the hook is given after the step's outputs reached their tensors.
pub(crate) fn after_step(step: u64, hook: Hook) -> Result<()> {
    let run = crate::engine::context::with(|c| c.exec.in_flight.iter().find(|r| r.step == step).cloned());
    match run {
        Some(run) => {
            run.hooks.borrow_mut().push(hook);
            Ok(())
        }
        // A check's own error is already typed (it names the op and value).
        None => hook(),
    }
}

/// Reaps finished steps without blocking; reports the first failure among them.
pub(crate) fn poll() -> Result<()> {
    loop {
        let front = crate::engine::context::with(|c| c.exec.in_flight.front().cloned());
        let Some(run) = front else { return Ok(()) };
        let ready = match &*run.done.borrow() {
            Some(done) => done.is_ready()?,
            None => true,
        };
        if !ready {
            return Ok(());
        }
        crate::engine::context::with(|c| c.exec.in_flight.pop_front());
        finish(&run)?;
    }
}

/// Waits until at most `bound` steps are in flight, oldest first.
fn settle(bound: usize) -> Result<()> {
    loop {
        let front = crate::engine::context::with(|c| {
            (c.exec.in_flight.len() > bound).then(|| c.exec.in_flight.pop_front()).flatten()
        });
        let Some(run) = front else { return poll() };
        finish(&run)?;
    }
}

/// Learns `run`'s outcome (waiting if needed), runs its hooks, and reports.
fn finish(run: &StepRun) -> Result<()> {
    let done = run.done.borrow_mut().take();
    if let Some(done) = done {
        let t = Instant::now();
        let status = done.wait();
        metrics::update(|m| m.device_wait_time += t.elapsed());
        metrics::span("device_wait", t);
        // The events are destroyed here; outputs stay valid.
        drop(done);
        status.map_err(|e| run.failed(e))?;
    }
    let hooks = std::mem::take(&mut *run.hooks.borrow_mut());
    for hook in hooks {
        hook().map_err(|e| match e {
            e @ (FrontendError::StepFailed { .. }
            | FrontendError::IndexOutOfRange { .. }
            | FrontendError::NonFinite { .. }) => e,
            e => run.failed(e),
        })?;
    }
    Ok(())
}

/// A step handed to its backend.
pub(crate) struct Executed {
    /// One storage per output of the program.
    pub outputs: Vec<Storage>,
    /// A failure learnt while bounding the queue (this step's, when it runs
    /// synchronously, or an earlier one's): reported after the outputs are
    /// handed out.
    pub reported: Result<()>,
}

/// Runs a step's program on `input`'s backend. `Err`: the step could not be
/// started (nothing of it runs).
pub(crate) fn execute(input: RunInput<'_>, step: u64, hooks: Vec<Hook>) -> Result<Executed> {
    match input {
        RunInput::Compiled { entry, bindings } => {
            // The bound is read before the step starts: a bad
            // `KILN_MAX_STEPS_IN_FLIGHT` fails with nothing running.
            let bound = crate::engine::context::with(|c| c.exec.max_in_flight())?;
            let outputs = run_pjrt(entry, bindings, step, hooks)?;
            // Bound the queue (0: wait for this step too).
            let reported = settle(bound);
            Ok(Executed { outputs, reported })
        }
        RunInput::Reference { graph, bindings } => {
            let outputs = run_reference(graph, bindings)?;
            let reported = hooks
                .into_iter()
                .try_for_each(|hook| hook().map_err(|e| FrontendError::StepFailed { step, reason: e.to_string() }));
            Ok(Executed { outputs, reported })
        }
    }
}

/// What a backend runs (`mark_step` picks it by [`Backend`]: the one place
/// that dispatches on the backend).
pub(crate) enum RunInput<'a> {
    /// A compiled program and the bindings feeding its parameters, in
    /// parameter order ([`Backend::Pjrt`]).
    Compiled { entry: &'a CacheEntry, bindings: Vec<Binding> },
    /// The pruned trace and the bindings feeding its parameters
    /// ([`Backend::Reference`]).
    Reference { graph: &'a Graph, bindings: Vec<Binding> },
}

/// The bindings named by `kept`, in that order.
pub(crate) fn select(bindings: Vec<Binding>, kept: &[u32]) -> Vec<Binding> {
    let mut slots: Vec<Option<Binding>> = bindings.into_iter().map(Some).collect();
    kept.iter().map(|&p| slots[p as usize].take().expect("each parameter is kept once")).collect()
}

fn run_pjrt(entry: &CacheEntry, bindings: Vec<Binding>, step: u64, hooks: Vec<Hook>) -> Result<Vec<Storage>> {
    let client = crate::engine::context::with(|c| c.exec.client())?;
    let exe = &entry.program.exe;
    // This process's replicas (all of them unless the run spans processes).
    let replicas = exe.num_local_replicas();
    // Asked for only when host data must be uploaded (not on a steady step).
    let mut devices: Option<Vec<kiln_runtime::Device>> = None;
    // Host data is uploaded once (to every replica's device); the tensor then
    // refers to the device copy, so later steps reuse it.
    let t_upload = Instant::now();
    let mut owned: Vec<Rc<DeviceValue>> = Vec::with_capacity(bindings.len());
    for (i, b) in bindings.into_iter().enumerate() {
        let mismatch = |got: usize| FrontendError::ReplicaCount {
            op: "mark_step",
            what: format!(
                "argument {i} ({})",
                b.tensor.upgrade().map_or_else(|| "a dropped tensor".to_string(), |t| t.ty.to_string())
            ),
            got,
            expected: replicas,
        };
        if let Some(got) = b.storage.replicas().filter(|&n| n != replicas) {
            return Err(mismatch(got));
        }
        let layout = entry.program.layout.as_ref().map(|l| (&l.mesh, &l.params[i]));
        let value = match &b.storage {
            Storage::Device(value) => value.clone(),
            // Under a mesh each device gets its shard of host data.
            Storage::Host(lit) if layout.is_some_and(|(_, s)| !s.is_replicated()) => {
                let (mesh, sharding) = layout.expect("checked by the guard");
                let shards = (0..replicas).map(|d| sharding.slice(lit, mesh, d)).collect::<Result<Vec<_>>>()?;
                Rc::new(upload(&client, devices.get_or_insert_with(|| exe.replica_devices()), |d| &shards[d])?)
            }
            Storage::Host(lit) => {
                Rc::new(upload(&client, devices.get_or_insert_with(|| exe.replica_devices()), |_| lit)?)
            }
            Storage::HostShards(shards) => {
                Rc::new(upload(&client, devices.get_or_insert_with(|| exe.replica_devices()), |r| &shards[r])?)
            }
        };
        if !matches!(b.storage, Storage::Device(_)) {
            if let Some(t) = b.tensor.upgrade() {
                let mut st = t.state.borrow_mut();
                let same = match (&*st, &b.storage) {
                    (State::Ready(Storage::Host(a)), Storage::Host(b)) => Arc::ptr_eq(a, b),
                    (State::Ready(Storage::HostShards(a)), Storage::HostShards(b)) => Arc::ptr_eq(a, b),
                    _ => false,
                };
                if same {
                    *st = State::Ready(Storage::Device(value.clone()));
                }
            }
        }
        owned.push(value);
    }
    metrics::update(|m| m.upload_time += t_upload.elapsed());
    metrics::span("upload", t_upload);
    // Donated buffers are moved in: the step's bindings held the last reference
    // (checked when the alias was added), so `try_unwrap` succeeds.
    let mut slots: Vec<Option<Rc<DeviceValue>>> = owned.into_iter().map(Some).collect();
    let mut moved: Vec<Option<std::vec::IntoIter<Buffer>>> = (0..slots.len()).map(|_| None).collect();
    for (i, &d) in entry.donated.iter().enumerate() {
        if d {
            let arc = slots[i].take().expect("each argument taken once");
            let value = Rc::try_unwrap(arc).map_err(|_| FrontendError::InvalidArgument {
                op: "mark_step",
                reason: format!("parameter {i} was marked for donation but is still shared"),
            })?;
            moved[i] = Some(value.0.into_iter());
        }
    }
    let args: Vec<Vec<ExecArg>> = (0..replicas)
        .map(|r| {
            moved
                .iter_mut()
                .zip(&slots)
                .map(|(m, b)| match m {
                    Some(bufs) => ExecArg::Donated(bufs.next().expect("one donated buffer per replica")),
                    None => ExecArg::Borrowed(&b.as_deref().expect("borrowed values stay in their slot").0[r]),
                })
                .collect()
        })
        .collect();
    let t = Instant::now();
    let (per_replica, done) = exe.execute_replicated_async(args)?;
    metrics::update(|m| {
        m.executions += 1;
        m.execute_time += t.elapsed();
        // A partitioned program's FLOPs are the whole step's (global shapes).
        let copies = if entry.program.layout.is_some() { 1 } else { replicas };
        m.flops_executed += entry.program.flops * copies as f64;
    });
    metrics::span("execute", t);
    let run = Rc::new(StepRun { step, done: RefCell::new(Some(done)), hooks: RefCell::new(hooks) });
    crate::engine::context::with(|c| c.exec.in_flight.push_back(run.clone()));
    // `[replica][output]` -> one value per output, its buffers in replica order.
    let mut outputs: Vec<Vec<Buffer>> = (0..exe.num_outputs()).map(|_| Vec::with_capacity(replicas)).collect();
    for list in per_replica {
        for (o, buf) in list.into_iter().enumerate() {
            outputs[o].push(buf);
        }
    }
    Ok(outputs.into_iter().map(|bufs| Storage::Device(Rc::new(DeviceValue(bufs, Some(run.clone()))))).collect())
}

/// Uploads `value(r)` to replica `r`'s device, for every replica.
fn upload<'a>(
    client: &Client,
    devices: &[kiln_runtime::Device],
    value: impl Fn(usize) -> &'a Literal,
) -> Result<DeviceValue> {
    let bufs = devices
        .iter()
        .enumerate()
        .map(|(r, device)| {
            let lit = value(r);
            let buf =
                client.buffer_from_bytes(lit.bytes(), element_type(lit.ty().dtype), lit.ty().shape.dims(), device)?;
            metrics::update(|m| m.host_to_device_bytes += lit.bytes().len() as u64);
            Ok(buf)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(DeviceValue(bufs, None))
}

/// Copies replica buffers `pick` of `value` to the host: waits only for those
/// buffers. A failure of the step that produced them is reported naming it.
pub(crate) fn download(value: &DeviceValue, pick: std::ops::Range<usize>) -> Result<Vec<Vec<u8>>> {
    // Failures of earlier steps that are already known come first.
    poll()?;
    let t = Instant::now();
    let out =
        value.0[pick].iter().map(|b| b.to_host_bytes()).collect::<kiln_runtime::Result<Vec<_>>>().map_err(|e| {
            match &value.1 {
                Some(run) => run.failed(e),
                None => FrontendError::Runtime(e),
            }
        })?;
    metrics::update(|m| {
        m.device_to_host_bytes += out.iter().map(|b| b.len() as u64).sum::<u64>();
        m.device_wait_time += t.elapsed();
    });
    metrics::span("download", t);
    // The step that made these buffers may be complete now: learn its outcome
    // (its device-side checks) with the read that waited for it.
    poll()?;
    Ok(out)
}

/// Runs the step on the reference interpreter, all replicas in lockstep.
fn run_reference(graph: &Graph, bindings: Vec<Binding>) -> Result<Vec<Storage>> {
    let replicas = crate::engine::context::with(|c| c.replicas())?;
    let types = graph.param_types();
    let mut inputs: Vec<Vec<Literal>> = vec![Vec::with_capacity(bindings.len()); replicas];
    for (b, ty) in bindings.iter().zip(types) {
        if let Some(got) = b.storage.replicas().filter(|&n| n != replicas) {
            let what = format!("an argument ({ty})");
            return Err(FrontendError::ReplicaCount { op: "mark_step", what, got, expected: replicas });
        }
        for (r, list) in inputs.iter_mut().enumerate() {
            list.push(match &b.storage {
                Storage::Host(lit) => (**lit).clone(),
                Storage::HostShards(shards) => shards[r].clone(),
                Storage::Device(value) => Literal::from_bytes(ty.clone(), download(value, r..r + 1)?.swap_remove(0))?,
            });
        }
    }
    let t = Instant::now();
    let per_replica = kiln_compiler::interpret_replicated(graph, &inputs)?;
    metrics::update(|m| {
        m.executions += 1;
        m.execute_time += t.elapsed();
    });
    let mut outputs: Vec<Vec<Literal>> = (0..graph.outputs().len()).map(|_| Vec::with_capacity(replicas)).collect();
    for list in per_replica {
        for (o, lit) in list.into_iter().enumerate() {
            outputs[o].push(lit);
        }
    }
    Ok(outputs
        .into_iter()
        .map(|mut lits| {
            if lits.len() == 1 {
                Storage::Host(Arc::new(lits.pop().expect("one replica")))
            } else {
                Storage::HostShards(Arc::new(lits))
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::tensor::Tensor;
    use crate::engine::executor::{reserves_pool_for_limit, DEFAULT_MAX_IN_FLIGHT};
    use crate::engine::step::mark_step;

    #[test]
    fn only_a_cuda_step_under_a_byte_limit_reserves_its_pool_unless_told() {
        use kiln_runtime::PjrtDevice::{Cpu, Cuda};
        assert!(reserves_pool_for_limit(Cuda, None, None, true));
        assert!(!reserves_pool_for_limit(Cuda, None, None, false), "no limit, or a fraction of activations");
        assert!(!reserves_pool_for_limit(Cpu, None, None, true), "the CPU plugin has no pool");
        assert!(!reserves_pool_for_limit(Cuda, None, Some(false), true), "KILN_GPU_PREALLOCATE=false wins");
        assert!(!reserves_pool_for_limit(Cuda, Some(false), None, true), "the API's setting wins");
    }

    /// A failure learnt when step n completes (here a completion hook, the path
    /// device-side checks use; a device error takes the same path through
    /// `finish`) reaches the caller typed, naming step n, exactly once, at the
    /// first `mark_step` or read that learns it; later steps run normally.
    #[test]
    fn a_failure_learnt_at_completion_is_reported_once_naming_the_step() -> Result<()> {
        set_max_steps_in_flight(2);
        let w = Tensor::from_vec(vec![1.5f32, -2.0, 0.25, 3.0], [4])?;
        w.assign(&w.mul_scalar(2.0)?)?;
        mark_step()?;
        let failing = crate::core::metrics::steps() + 1;
        w.assign(&w.add_scalar(1.0)?)?;
        on_step_complete(Box::new(|| {
            Err(FrontendError::InvalidArgument { op: "check", reason: "a flag was raised".into() })
        }));
        let mut errors = Vec::new();
        // The step itself, a read, and two more steps: the failure surfaces at
        // whichever learns it first, and only there.
        errors.extend(mark_step().err());
        errors.extend(w.to_vec::<f32>().err());
        for _ in 0..2 {
            w.assign(&w.add_scalar(1.0)?)?;
            errors.extend(mark_step().err());
        }
        errors.extend(sync().err());
        assert_eq!(errors.len(), 1, "{errors:?}");
        match &errors[0] {
            FrontendError::StepFailed { step, reason } => {
                assert_eq!(*step, failing);
                assert!(reason.contains("a flag was raised"), "{reason}");
            }
            other => panic!("expected StepFailed, got {other}"),
        }
        // The values themselves are fine: only the hook failed.
        assert_eq!(w.to_vec::<f32>()?, vec![6.0, -1.0, 3.5, 9.0]);
        Ok(())
    }

    #[test]
    fn zero_steps_in_flight_is_synchronous() -> Result<()> {
        set_max_steps_in_flight(0);
        let w = Tensor::from_vec(vec![1f32; 8], [8])?;
        for _ in 0..3 {
            w.assign(&w.mul_scalar(3.0)?)?;
            mark_step()?;
            assert_eq!(steps_in_flight(), 0);
        }
        assert_eq!(w.to_vec::<f32>()?, vec![27.0; 8]);
        set_max_steps_in_flight(DEFAULT_MAX_IN_FLIGHT);
        Ok(())
    }
}
