//! Cutting a step: `mark_step` turns the trace into a program, finds or compiles
//! it, runs it, and makes the pending tensors ready.
//!
//! The hit path (same trace as an earlier step) finishes the running hash of the
//! trace, looks it up and executes; it never prunes, lowers or optimizes. Parameters whose old buffers nothing
//! else holds are donated to the value assigned over them, so parameters and
//! optimizer state update in place.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use kiln_compiler::ir::{Alias, DType, Graph, Literal};
use kiln_compiler::passes::eliminate_dead_code;
use kiln_compiler::{lower as lower_graph, pipeline, LowerOptions};
use kiln_runtime::{ElementType, ExecArg};

use crate::context::{self, Backend, Binding, CacheEntry, DeviceValue, Inner, State, Storage, Trace};
use crate::error::{FrontendError, Result};
use crate::{metrics, program};
use crate::tensor::Tensor;

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

/// The runtime's element type of a kiln dtype (the two crates do not know
/// each other).
pub fn element_type(d: DType) -> ElementType {
    match d {
        DType::Pred => ElementType::Pred,
        DType::S8 => ElementType::S8,
        DType::S32 => ElementType::S32,
        DType::S64 => ElementType::S64,
        DType::U8 => ElementType::U8,
        DType::U32 => ElementType::U32,
        DType::U64 => ElementType::U64,
        DType::F16 => ElementType::F16,
        DType::BF16 => ElementType::BF16,
        DType::F32 => ElementType::F32,
        DType::F64 => ElementType::F64,
    }
}

pub(crate) fn dtype_of(e: ElementType) -> DType {
    match e {
        ElementType::Pred => DType::Pred,
        ElementType::S8 => DType::S8,
        ElementType::S32 => DType::S32,
        ElementType::S64 => DType::S64,
        ElementType::U8 => DType::U8,
        ElementType::U32 => DType::U32,
        ElementType::U64 => DType::U64,
        ElementType::F16 => DType::F16,
        ElementType::BF16 => DType::BF16,
        ElementType::F32 => DType::F32,
        ElementType::F64 => DType::F64,
    }
}

/// A finished trace with its outputs chosen (not yet pruned).
struct Closed {
    graph: Graph,
    bindings: Vec<Binding>,
    /// For each output, the tensors that receive it.
    receivers: Vec<Vec<Rc<Inner>>>,
    /// Key of the trace as recorded (see [`Trace::raw_key`]).
    key: u64,
}

/// Closes `trace`: its live pending tensors become outputs.
fn close(mut trace: Trace, donate: bool) -> Result<Option<Closed>> {
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
    let key = trace.raw_key();
    Ok(Some(Closed { graph: trace.graph, bindings: trace.bindings, receivers, key }))
}

/// Prunes dead code; returns the program and the bindings that feed it.
fn prune(graph: &Graph, bindings: Vec<Binding>) -> Result<(Graph, Vec<u32>, Vec<Binding>)> {
    let pruned = eliminate_dead_code(graph)?;
    let bindings = select(bindings, &pruned.kept_params);
    Ok((pruned.graph, pruned.kept_params, bindings))
}

/// The bindings named by `kept`, in that order.
fn select(bindings: Vec<Binding>, kept: &[u32]) -> Vec<Binding> {
    let mut slots: Vec<Option<Binding>> = bindings.into_iter().map(Some).collect();
    kept.iter().map(|&p| slots[p as usize].take().expect("each parameter is kept once")).collect()
}

/// Donates a parameter's buffer to the output assigned over it, when nothing
/// but the trace still holds the data.
fn add_donations(trace: &mut Trace, receivers: &[Vec<Rc<Inner>>]) -> Result<()> {
    for (p, b) in trace.bindings.iter().enumerate() {
        // Host data counts too: it is uploaded into a fresh buffer that nothing
        // else will hold, so step 1 (host-initialised state) compiles to the same
        // program as every later step (device state).
        let sole_holder = match &b.storage {
            Storage::Device(value) => Arc::strong_count(value) == 1,
            Storage::Host(lit) => Arc::strong_count(lit) == 1,
            Storage::HostShards(shards) => Arc::strong_count(shards) == 1,
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
/// `KILN_DONATE=1` or `0` decides; otherwise donation is on for every platform
/// but the XLA CPU plugin. With `xla-cpu-pjrt` 0.0.1, a program whose large
/// (about 800 KB) donated parameters came back from its own aliased outputs was
/// seen computing with wrong values from its second run on, while the same text
/// compiled afresh computed correctly; the CUDA plugin gives bit-identical
/// training with and without donation (docs/donation.md). Without donation old
/// buffers are still freed when a step replaces them, so live buffers stay flat.
fn donation_enabled() -> Result<bool> {
    match std::env::var("KILN_DONATE").as_deref() {
        Ok("1") => Ok(true),
        Ok("0") => Ok(false),
        _ => Ok(context::with(|c| c.client())?.platform_name() != "cpu"),
    }
}

/// Runs the current step: every live pending tensor becomes ready.
pub fn mark_step() -> Result<StepReport> {
    let t0 = Instant::now();
    metrics::cut_started(t0);
    let report = cut(t0);
    metrics::cut_finished();
    report
}

fn cut(t0: Instant) -> Result<StepReport> {
    let (trace, backend) = context::with(|c| (std::mem::replace(&mut c.trace, Trace::new()), c.backend));
    let donate = backend == Backend::Pjrt && donation_enabled()?;
    let Some(closed) = close(trace, donate)? else {
        return Ok(StepReport::default());
    };
    metrics::update(|m| {
        m.steps += 1;
        m.trace_time += t0.elapsed();
    });
    let Closed { graph, bindings, receivers, key } = closed;
    let mut report = StepReport { outputs: receivers.len(), ..StepReport::default() };
    let results = match backend {
        Backend::Pjrt => run_pjrt(&graph, bindings, key, &mut report)?,
        Backend::Reference => {
            let (program, _, bindings) = prune(&graph, bindings)?;
            report.nodes = program.len();
            run_reference(&program, bindings)?
        }
    };
    for (storage, receivers) in results.into_iter().zip(&receivers) {
        for t in receivers {
            *t.state.borrow_mut() = State::Ready(storage.clone());
        }
    }
    Ok(report)
}

/// The compiled program for `graph`: from the raw-trace cache (the hit path),
/// or found or built by [`program::obtain`].
fn compiled(graph: &Graph, bindings: &[Binding], key: u64, report: &mut StepReport) -> Result<Rc<CacheEntry>> {
    let hit = context::with(|c| {
        let entry = c.cache.get(&key).cloned();
        if entry.is_some() {
            c.new_programs_in_a_row = 0;
        }
        entry
    });
    if let Some(entry) = hit {
        metrics::update(|m| m.cache_hits += 1);
        return Ok(entry);
    }
    let client = context::with(|c| c.client())?;
    let got = program::obtain(graph, bindings, &client, crate::replicas::global_replicas()?)?;
    report.compiled = got.compiled;
    report.recompile = got.explanation;
    let new_program = got.compiled || report.recompile.is_some();
    let streak = context::with(|c| {
        c.new_programs_in_a_row = if new_program { c.new_programs_in_a_row + 1 } else { 0 };
        c.new_programs_in_a_row
    });
    if streak >= RECOMPILE_STREAK && streak.is_power_of_two() {
        metrics::update(|m| m.recompile_warnings += 1);
        tracing::warn!(
            "kiln: the last {streak} steps each needed a new program: shapes or constants change every step, so \
             every step compiles (metrics::snapshot().recompile_explanations says what changed)"
        );
    }
    tracing::debug!(nodes = got.entry.nodes, compiled = got.compiled, "kiln: new step program");
    let entry = Rc::new(got.entry);
    context::with(|c| c.cache.insert(key, entry.clone()));
    Ok(entry)
}

/// Steps in a row with a new program before kiln warns that a loop recompiles
/// every step (then again at every power of two).
const RECOMPILE_STREAK: u32 = 4;

fn run_pjrt(graph: &Graph, bindings: Vec<Binding>, key: u64, report: &mut StepReport) -> Result<Vec<Storage>> {
    let entry = compiled(graph, &bindings, key, report)?;
    report.nodes = entry.nodes;
    report.donated = entry.donated.iter().filter(|&&d| d).count();
    let client = context::with(|c| c.client())?;
    let bindings = select(bindings, &entry.kept_params);
    let exe = &entry.program.exe;
    // This process's replicas (all of them unless the run spans processes).
    let replicas = exe.num_local_replicas();
    // Asked for only when host data must be uploaded (not on a steady step).
    let mut devices: Option<Vec<kiln_runtime::Device>> = None;
    // Host data is uploaded once (to every replica's device); the tensor then
    // keeps the device copy.
    let t_upload = Instant::now();
    let mut owned: Vec<Arc<DeviceValue>> = Vec::with_capacity(bindings.len());
    for (i, b) in bindings.into_iter().enumerate() {
        let mismatch = |got: usize| FrontendError::InvalidArgument {
            op: "mark_step",
            reason: format!(
                "argument {i} ({}) holds values for {got} replicas but the step runs on {replicas}: \
                 set the replica count before creating tensors",
                b.tensor.upgrade().map_or_else(|| "a dropped tensor".to_string(), |t| t.ty.to_string())
            ),
        };
        if let Some(got) = b.storage.replicas().filter(|&n| n != replicas) {
            return Err(mismatch(got));
        }
        let value = match &b.storage {
            Storage::Device(value) => value.clone(),
            Storage::Host(lit) => {
                Arc::new(upload(&client, devices.get_or_insert_with(|| exe.replica_devices()), |_| lit)?)
            }
            Storage::HostShards(shards) => {
                Arc::new(upload(&client, devices.get_or_insert_with(|| exe.replica_devices()), |r| &shards[r])?)
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
    metrics::span("upload", t_upload);
    // Donated buffers are moved in: the step's bindings held the last reference
    // (checked when the alias was added), so `try_unwrap` succeeds.
    let mut slots: Vec<Option<Arc<DeviceValue>>> = owned.into_iter().map(Some).collect();
    let mut moved: Vec<Option<std::vec::IntoIter<kiln_runtime::Buffer>>> = (0..slots.len()).map(|_| None).collect();
    for (i, &d) in entry.donated.iter().enumerate() {
        if d {
            let arc = slots[i].take().expect("each argument taken once");
            let value = Arc::try_unwrap(arc).map_err(|_| FrontendError::InvalidArgument {
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
    let per_replica = exe.execute_replicated(args)?;
    metrics::update(|m| {
        m.executions += 1;
        m.execute_time += t.elapsed();
        m.flops_executed += entry.program.flops * replicas as f64;
    });
    metrics::span("execute", t);
    // `[replica][output]` -> one value per output, its buffers in replica order.
    let mut outputs: Vec<Vec<kiln_runtime::Buffer>> = (0..exe.num_outputs()).map(|_| Vec::with_capacity(replicas)).collect();
    for list in per_replica {
        for (o, buf) in list.into_iter().enumerate() {
            outputs[o].push(buf);
        }
    }
    Ok(outputs.into_iter().map(|bufs| Storage::Device(Arc::new(DeviceValue(bufs)))).collect())
}

/// Uploads `value(r)` to replica `r`'s device, for every replica.
fn upload<'a>(
    client: &kiln_runtime::Client,
    devices: &[kiln_runtime::Device],
    value: impl Fn(usize) -> &'a Literal,
) -> Result<DeviceValue> {
    let bufs = devices
        .iter()
        .enumerate()
        .map(|(r, device)| {
            let lit = value(r);
            let buf = client.buffer_from_bytes(lit.bytes(), element_type(lit.ty().dtype), lit.ty().shape.dims(), device)?;
            metrics::update(|m| m.host_to_device_bytes += lit.bytes().len() as u64);
            Ok(buf)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(DeviceValue(bufs))
}

/// Runs the step on the reference interpreter, all replicas in lockstep.
fn run_reference(graph: &Graph, bindings: Vec<Binding>) -> Result<Vec<Storage>> {
    let replicas = context::with(|c| c.replicas())?;
    let types = graph.param_types();
    let mut inputs: Vec<Vec<Literal>> = vec![Vec::with_capacity(bindings.len()); replicas];
    for (b, ty) in bindings.iter().zip(types) {
        if let Some(got) = b.storage.replicas().filter(|&n| n != replicas) {
            return Err(FrontendError::InvalidArgument {
                op: "mark_step",
                reason: format!("an argument ({ty}) holds values for {got} replicas but the step runs on {replicas}"),
            });
        }
        for (r, list) in inputs.iter_mut().enumerate() {
            list.push(match &b.storage {
                Storage::Host(lit) => (**lit).clone(),
                Storage::HostShards(shards) => shards[r].clone(),
                Storage::Device(value) => Literal::from_bytes(ty.clone(), value.0[r].to_host_bytes()?)?,
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

/// Runs `f` as one step: records it, then `mark_step`.
pub fn step<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let r = f()?;
    mark_step()?;
    Ok(r)
}

/// Options of [`lower_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerOpts {
    /// Run kiln's optimization pipeline before lowering (what `mark_step`
    /// compiles); `false` lowers the trace as recorded (dead code removed).
    pub optimize: bool,
}

/// The StableHLO text that a step returning `f`'s tensors would compile, without
/// running anything (for snapshot tests). Equivalent to
/// `lower_with(LowerOpts { optimize: true }, f)`.
pub fn lower(f: impl FnOnce() -> Result<Vec<Tensor>>) -> Result<String> {
    lower_with(LowerOpts { optimize: true }, f)
}

/// Like [`lower`], with options.
pub fn lower_with(opts: LowerOpts, f: impl FnOnce() -> Result<Vec<Tensor>>) -> Result<String> {
    let outer = context::with(|c| std::mem::replace(&mut c.trace, Trace::new()));
    let result = f();
    let inner = context::with(|c| std::mem::replace(&mut c.trace, outer));
    let outputs = result?;
    let mut graph = inner.graph;
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
    graph.set_outputs(values)?;
    let pruned = eliminate_dead_code(&graph)?.graph;
    let g = if opts.optimize { pipeline::optimize(&pruned)?.0 } else { pruned };
    Ok(lower_graph(&g, &LowerOptions::default())?)
}
