//! Captured step functions: [`compile_step`] traces a closure once per input
//! signature and replays the compiled program on later calls without running
//! the closure.
//!
//! A call first runs any ops recorded outside the step (`mark_step`), then
//! looks up a plan by the guard: the inputs' types, the replica count, the
//! autocast dtype, whether donation is on and the backend. With a plan whose
//! state still checks out, the call binds the current buffers of the state
//! tensors the trace read, enqueues the cached executable, and makes the
//! tensors the trace assigned ready with its outputs: no op is recorded, no
//! trace is hashed. Otherwise the closure runs as an ordinary step and its
//! cut becomes the plan; the reason is logged and kept (`last_retrace`).
//!
//! Invariants:
//! - A plan feeds every program parameter from an input or a state tensor that
//!   outlives the call (weakly held); a trace that read a value created inside
//!   the closure from host data (which the next call would create afresh, with
//!   a value the plan cannot know) is never replayed: such a closure is traced
//!   on every call and the reason is reported once.
//! - State tensors keep their identity: a replay assigns the same tensors the
//!   trace assigned; returned tensors are new handles on each call.
//! - A parameter the program donates is replayed only while its tensor is the
//!   sole holder of its buffer (as tracing would decide); otherwise the call
//!   retraces, which compiles (or finds) the program without that donation.
//! - Rust control flow and Rust values (scalars in `mul_scalar`, shapes) are
//!   baked in at trace time. `verify` (or `KILN_CAPTURE_VERIFY=1`) traces every
//!   call and refuses a call whose trace differs from the plan's.

use std::collections::HashMap;
use std::rc::{Rc, Weak};
use std::time::Instant;

use kiln_compiler::ir::{DType, TensorType};

use crate::core::error::{FrontendError, Result};
use crate::core::settings;
use crate::core::storage::{Inner, State, Storage};
use crate::core::tensor::Tensor;
use crate::core::trace::Binding;
use crate::core::{metrics, storage, trace};
use crate::engine::context;
use crate::engine::executor::Backend;
use crate::engine::program_cache::CacheEntry;
use crate::engine::run::{self, RunInput};
use crate::engine::step::{cut_step, mark_step, CutStep};

/// A step function traced once per input signature (see the module docs).
pub struct CompiledStep<F> {
    f: F,
    plans: HashMap<Guard, Plan>,
    /// `None`: `KILN_CAPTURE_VERIFY` is read at the first call.
    verify: Option<bool>,
    traces: u64,
    replays: u64,
    last_retrace: Option<String>,
    /// Guards whose trace cannot be replayed, with the reason (reported once).
    untraceable: HashMap<Guard, String>,
}

/// Makes `f` a captured step: `f` receives the call's inputs and returns the
/// tensors the caller wants back (a loss, metrics). Every tensor it assigns
/// (parameters, optimizer state) is updated by each call.
///
/// What `f` may do: record any ops on its inputs and on tensors that outlive
/// the call (parameters, optimizer state, the RNG state), assign them, create
/// constants (`Tensor::full`, `mul_scalar`), and return tensors.
/// What it may not do: read values to the host (`to_vec`, `item`: a read
/// inside forces a step and the captured program would be a different one),
/// call `mark_step`, or depend on Rust values that change between calls (a
/// learning rate from a schedule, a step counter): pass those as inputs
/// (`Tensor::scalar(lr)`), since Rust control flow and constants are baked in
/// when the closure is traced. [`CompiledStep::verify`] finds closures that
/// break this: it traces every call and fails when a trace differs.
pub fn compile_step<F>(f: F) -> CompiledStep<F>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    CompiledStep {
        f,
        plans: HashMap::new(),
        verify: None,
        traces: 0,
        replays: 0,
        last_retrace: None,
        untraceable: HashMap::new(),
    }
}

/// What a plan is valid for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Guard {
    inputs: Vec<TensorType>,
    replicas: usize,
    autocast: Option<DType>,
    donate: bool,
    backend: Backend,
}

impl Guard {
    /// What changed from `old` to `self`, in words.
    fn differences(&self, old: &Guard) -> String {
        let mut out = Vec::new();
        if self.inputs.len() != old.inputs.len() {
            out.push(format!("{} inputs instead of {}", self.inputs.len(), old.inputs.len()));
        } else {
            for (i, (a, b)) in self.inputs.iter().zip(&old.inputs).enumerate() {
                if a != b {
                    out.push(format!("input {i} is {a}, was {b}"));
                }
            }
        }
        if self.replicas != old.replicas {
            out.push(format!("{} replicas, were {}", self.replicas, old.replicas));
        }
        if self.autocast != old.autocast {
            out.push(format!("autocast {:?}, was {:?}", self.autocast, old.autocast));
        }
        if self.donate != old.donate {
            out.push(format!("donation {}, was {}", self.donate, old.donate));
        }
        if self.backend != old.backend {
            out.push(format!("backend {:?}, was {:?}", self.backend, old.backend));
        }
        out.join("; ")
    }
}

/// Where a program parameter's value comes from.
enum Source {
    Input(usize),
    State(Weak<Inner>),
}

/// Who receives an output.
enum Target {
    Input(usize),
    State(Weak<Inner>),
}

/// Where a returned tensor comes from.
enum Returned {
    Output(usize, TensorType),
    Input(usize),
    State(Weak<Inner>),
}

struct Plan {
    entry: Rc<CacheEntry>,
    key: u64,
    params: Vec<Source>,
    targets: Vec<Vec<Target>>,
    returned: Vec<Returned>,
    /// The device-side checks and the output that carries their flags.
    checks: Option<(usize, crate::engine::device_checks::Sealed)>,
}

fn name_of(t: &Inner) -> String {
    t.name.borrow().as_deref().map_or_else(|| format!("a {} tensor", t.ty), |n| format!("'{n}' ({})", t.ty))
}

impl<F> CompiledStep<F>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    /// Traces every call and fails when its trace differs from the captured one
    /// (a debug mode: finds closures whose Rust control flow or constants change).
    pub fn verify(mut self, on: bool) -> Self {
        self.verify = Some(on);
        self
    }

    /// Calls that ran the closure (traced).
    pub fn traces(&self) -> u64 {
        self.traces
    }

    /// Calls that replayed a captured program.
    pub fn replays(&self) -> u64 {
        self.replays
    }

    /// Why the newest retrace happened (a new signature, a dropped or shared
    /// state tensor).
    pub fn last_retrace(&self) -> Option<&str> {
        self.last_retrace.as_deref()
    }

    /// The StableHLO text of the program a call on `inputs` compiles (the
    /// closure recorded as a traced call records it, closed as its step is:
    /// [`crate::lower`]), without running anything or changing any tensor.
    pub fn lower(&mut self, inputs: &[Tensor]) -> Result<String> {
        let f = &mut self.f;
        crate::engine::lower::lower(|| f(inputs))
    }

    /// Runs the step on `inputs`; returns what the closure returns.
    pub fn call(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        // Ops recorded outside the step run first, so every tensor the plan
        // reads is ready.
        if context::with(|c| !c.trace.graph.is_empty()) {
            mark_step()?;
        }
        let verify = match self.verify {
            Some(on) => on,
            None => *self.verify.insert(kiln_runtime::env::bool_var("KILN_CAPTURE_VERIFY")?.unwrap_or(false)),
        };
        let guard = self.guard(inputs)?;
        if !verify {
            if let Some(plan) = self.plans.get(&guard) {
                match check(plan, inputs) {
                    Ok(bindings) => {
                        let out = replay(plan, inputs, bindings)?;
                        self.replays += 1;
                        return Ok(out);
                    }
                    Err(reason) => self.retrace_because(format!("captured step retraced: {reason}")),
                }
            } else if let Some(old) = self.plans.keys().next() {
                let what = guard.differences(old);
                self.retrace_because(format!("captured step traced for a new signature: {what}"));
            }
        }
        self.trace(guard, inputs)
    }

    fn retrace_because(&mut self, text: String) {
        tracing::warn!("kiln: {text}");
        metrics::update(|m| m.retraces += 1);
        self.last_retrace = Some(text);
    }

    fn guard(&self, inputs: &[Tensor]) -> Result<Guard> {
        let (replicas, backend) = context::with(|c| Ok::<_, FrontendError>((c.replicas()?, c.exec.backend)))?;
        Ok(Guard {
            inputs: inputs.iter().map(|t| t.ty().clone()).collect(),
            replicas,
            autocast: settings::autocast_dtype(),
            donate: backend == Backend::Pjrt && crate::engine::step::donation_enabled()?,
            backend,
        })
    }

    /// Runs the closure. When it fails, the call has no effect: the ops it
    /// recorded are discarded and every tensor it assigned (parameters,
    /// optimizer state, the generator) reads as before, unless the closure
    /// itself ran a step (`mark_step`, a read) before failing, which cannot
    /// be undone.
    fn record(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let epoch = context::with(|c| c.trace.epoch);
        let undo = crate::engine::undo_assigns::UndoAssigns::begin();
        match (self.f)(inputs) {
            Ok(returned) => {
                undo.keep();
                Ok(returned)
            }
            Err(e) if context::with(|c| c.trace.epoch) == epoch => {
                drop(undo);
                context::with(|c| c.trace = trace::Trace::new());
                drop(run::take_hooks());
                Err(e)
            }
            Err(e) => {
                undo.keep();
                Err(e)
            }
        }
    }

    /// Runs the closure as an ordinary step and makes its cut the plan.
    fn trace(&mut self, guard: Guard, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.traces += 1;
        let watermark = storage::next_tensor_id();
        let epoch = context::with(|c| c.trace.epoch);
        let returned = self.record(inputs)?;
        // A step ran inside the closure (a read, or mark_step): the call was
        // several steps, and what the last cut sees is only its tail.
        let ran_a_step = context::with(|c| c.trace.epoch) != epoch;
        let cut = cut_step()?;
        if ran_a_step {
            self.untraceable_because(
                guard,
                "the closure ran a step itself (a read such as item() or to_vec(), or mark_step), so a call is \
                 several steps; read the values the closure returns after the call instead"
                    .into(),
            );
            return Ok(returned);
        }
        let Some(cut) = cut else {
            return Ok(returned);
        };
        if self.verify == Some(true) {
            if let Some(plan) = self.plans.get(&guard) {
                if plan.key != cut.key {
                    return Err(FrontendError::InvalidArgument {
                        op: "compile_step",
                        reason: "this call's trace differs from the captured one: the closure's Rust control flow or \
                                 constants (scalars, shapes) changed between calls; pass changing values as input \
                                 tensors"
                            .into(),
                    });
                }
                return Ok(returned);
            }
        }
        match plan_of(cut, inputs, &returned, watermark) {
            Ok(Some(plan)) => {
                self.plans.insert(guard, plan);
            }
            Ok(None) => {}
            Err(reason) => self.untraceable_because(guard, reason),
        }
        Ok(returned)
    }

    /// Notes (once per signature, with a warning) that calls with `guard`
    /// are traced every time, and why.
    fn untraceable_because(&mut self, guard: Guard, reason: String) {
        if !self.untraceable.contains_key(&guard) {
            let text = format!("captured step cannot be replayed and is traced on every call: {reason}");
            tracing::warn!("kiln: {text}");
            crate::core::warnings::show_once(crate::core::warnings::Warning::CaptureUnreplayable, || text.clone());
            self.last_retrace = Some(text.clone());
            self.untraceable.insert(guard, text);
        }
    }
}

/// The plan of a traced call; `Ok(None)` on the reference backend (which has
/// no program to replay); `Err(reason)` when the trace cannot be replayed.
fn plan_of(
    cut: CutStep,
    inputs: &[Tensor],
    returned: &[Tensor],
    watermark: u64,
) -> std::result::Result<Option<Plan>, String> {
    let Some(entry) = cut.entry else { return Ok(None) };
    let input_of = |id: u64| inputs.iter().position(|t| t.inner.id == id);
    let mut params = Vec::with_capacity(cut.params.len());
    for (weak, id) in &cut.params {
        params.push(match input_of(*id) {
            Some(k) => Source::Input(k),
            None => match weak.upgrade() {
                Some(_) => Source::State(weak.clone()),
                None => {
                    return Err(format!(
                        "program parameter {} was a value created inside the closure from host data (for example \
                         Tensor::scalar(lr), or the f64 learning rate of an optimizer's `step`); pass it as an \
                         input (an optimizer takes one through `step_lr`)",
                        params.len()
                    ))
                }
            },
        });
    }
    let is_returned = |t: &Rc<Inner>| returned.iter().any(|r| Rc::ptr_eq(&r.inner, t));
    let targets = cut
        .receivers
        .iter()
        .map(|rs| {
            rs.iter()
                .filter_map(|t| match input_of(t.id) {
                    Some(k) => Some(Target::Input(k)),
                    // Made inside and handed back: a fresh handle each call.
                    None if t.id >= watermark && is_returned(t) => None,
                    None => Some(Target::State(Rc::downgrade(t))),
                })
                .collect()
        })
        .collect();
    let returned = returned
        .iter()
        .map(|r| match cut.receivers.iter().position(|rs| rs.iter().any(|t| Rc::ptr_eq(t, &r.inner))) {
            Some(o) => Returned::Output(o, r.ty().clone()),
            None => match input_of(r.inner.id) {
                Some(k) => Returned::Input(k),
                None => Returned::State(Rc::downgrade(&r.inner)),
            },
        })
        .collect();
    let checks = match cut.checks {
        Some(sealed) => {
            let flags = &sealed.flags().inner;
            let o = cut
                .receivers
                .iter()
                .position(|rs| rs.iter().any(|t| Rc::ptr_eq(t, flags)))
                .ok_or_else(|| "the device-side check flags are not an output of the step".to_string())?;
            Some((o, sealed))
        }
        None => None,
    };
    Ok(Some(Plan { entry, key: cut.key, params, targets, returned, checks }))
}

/// The bindings a replay of `plan` feeds, or why it cannot replay.
fn check(plan: &Plan, inputs: &[Tensor]) -> std::result::Result<Vec<Binding>, String> {
    let mut bindings = Vec::with_capacity(plan.params.len());
    for (i, source) in plan.params.iter().enumerate() {
        let t = match source {
            Source::Input(k) => inputs[*k].inner.clone(),
            Source::State(w) => w
                .upgrade()
                .ok_or_else(|| format!("a state tensor the step reads (program parameter {i}) was dropped"))?,
        };
        let storage = match &*t.state.borrow() {
            State::Ready(s) => s.clone(),
            State::Pending { .. } => return Err(format!("{} is pending in another step", name_of(&t))),
        };
        if plan.entry.donated[i] {
            // The tensor's reference and `storage` above: nothing else holds it.
            let holders = match &storage {
                Storage::Device(v) => Rc::strong_count(v),
                Storage::Host(l) => std::sync::Arc::strong_count(l),
                Storage::HostShards(s) => std::sync::Arc::strong_count(s),
            };
            if holders != 2 {
                return Err(format!(
                    "{} is shared (another handle holds its old value), so its buffer cannot be donated",
                    name_of(&t)
                ));
            }
        }
        bindings.push(Binding { tensor: Rc::downgrade(&t), tensor_id: t.id, storage });
    }
    // Donated values leave their tensors, which the step's outputs refill.
    for (i, b) in bindings.iter().enumerate() {
        if plan.entry.donated[i] {
            if let Some(t) = b.tensor.upgrade() {
                *t.state.borrow_mut() = State::Pending {
                    epoch: 0,
                    value: kiln_compiler::ir::ValueId::from(kiln_compiler::ir::NodeId::from_index(0)),
                };
            }
        }
    }
    Ok(bindings)
}

/// Enqueues the plan's program on `bindings` and hands out the outputs.
fn replay(plan: &Plan, inputs: &[Tensor], bindings: Vec<Binding>) -> Result<Vec<Tensor>> {
    let t0 = Instant::now();
    metrics::update(|m| {
        m.steps += 1;
        m.cache_hits += 1;
        m.replays += 1;
    });
    let step = metrics::steps();
    let executed = run::execute(RunInput::Compiled { entry: &plan.entry, bindings }, step, run::take_hooks())?;
    metrics::update(|m| m.trace_time += t0.elapsed());
    for (storage, targets) in executed.outputs.iter().zip(&plan.targets) {
        for target in targets {
            let t = match target {
                Target::Input(k) => Some(inputs[*k].inner.clone()),
                Target::State(w) => w.upgrade(),
            };
            if let Some(t) = t {
                *t.state.borrow_mut() = State::Ready(storage.clone());
                t.bound.set(None);
            }
        }
    }
    let out = plan
        .returned
        .iter()
        .map(|r| match r {
            Returned::Output(o, ty) => {
                Ok(Tensor::wrap(Inner::new(ty.clone(), State::Ready(executed.outputs[*o].clone()))))
            }
            Returned::Input(k) => Ok(inputs[*k].clone()),
            Returned::State(w) => w.upgrade().map(Tensor::wrap).ok_or(FrontendError::InvalidArgument {
                op: "compile_step",
                reason: "a tensor the step returns was dropped".into(),
            }),
        })
        .collect::<Result<Vec<_>>>();
    if let Some((o, sealed)) = &plan.checks {
        let flags = Tensor::wrap(Inner::new(sealed.flags().ty().clone(), State::Ready(executed.outputs[*o].clone())));
        let sealed = sealed.rebind(flags);
        run::after_step(step, Box::new(move || crate::engine::device_checks::verify(Some(sealed))))?;
    }
    executed.reported?;
    out
}
