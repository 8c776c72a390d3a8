//! Cutting a step: `mark_step` turns the trace into a program, finds or compiles
//! it, runs it, and makes the pending tensors ready.
//!
//! The hit path (same program as an earlier step) prunes the trace, hashes it and
//! executes; it never lowers or optimizes. Parameters whose old buffers nothing
//! else holds are donated to the value assigned over them, so parameters and
//! optimizer state update in place.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use kiln_compiler::ir::{Alias, DType, Graph, Literal};
use kiln_compiler::passes::eliminate_dead_code;
use kiln_compiler::{lower as lower_graph, pipeline, LowerOptions};
use kiln_runtime::{CompileOptions, ElementType, ExecArg};

use crate::context::{self, Backend, Binding, Inner, State, Storage, Trace};
use crate::error::{FrontendError, Result};
use crate::metrics;
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
}

pub(crate) fn element_type(d: DType) -> ElementType {
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

/// A finished trace with its outputs chosen and its dead code pruned.
struct Program {
    graph: Graph,
    /// Bindings feeding the pruned graph's parameters, in order.
    bindings: Vec<Binding>,
    /// For each output, the tensors that receive it.
    receivers: Vec<Vec<Rc<Inner>>>,
    key: u64,
}

/// Closes `trace`: its live pending tensors become outputs.
fn close(mut trace: Trace, donate: bool) -> Result<Option<Program>> {
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
    let pruned = eliminate_dead_code(&trace.graph)?;
    let mut slots: Vec<Option<Binding>> = trace.bindings.into_iter().map(Some).collect();
    let bindings = pruned
        .kept_params
        .iter()
        .map(|&p| slots[p as usize].take().expect("each parameter is kept once"))
        .collect();
    let key = structural_key(&pruned.graph);
    Ok(Some(Program { graph: pruned.graph, bindings, receivers, key }))
}

/// Donates a parameter's buffer to the output assigned over it, when nothing
/// but the trace still holds the data.
fn add_donations(trace: &mut Trace, receivers: &[Vec<Rc<Inner>>]) -> Result<()> {
    for (p, b) in trace.bindings.iter().enumerate() {
        // Host data counts too: it is uploaded into a fresh buffer that nothing
        // else will hold, so step 1 (host-initialised state) compiles to the same
        // program as every later step (device state).
        let sole_holder = match &b.storage {
            Storage::Device(buf) => Arc::strong_count(buf) == 1,
            Storage::Host(lit) => Arc::strong_count(lit) == 1,
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

/// A hash of the program's structure: ops, attributes, types, outputs and
/// aliases in node order. Independent of tensor values and of dead code.
fn structural_key(g: &Graph) -> u64 {
    let mut h = DefaultHasher::new();
    for (_, node) in g.nodes() {
        node.op.hash(&mut h);
    }
    g.outputs().hash(&mut h);
    g.aliases().hash(&mut h);
    h.finish()
}

/// Runs the current step: every live pending tensor becomes ready.
pub fn mark_step() -> Result<StepReport> {
    let t0 = Instant::now();
    let (trace, backend) = context::with(|c| (std::mem::replace(&mut c.trace, Trace::new()), c.backend));
    let Some(program) = close(trace, backend == Backend::Pjrt)? else {
        return Ok(StepReport::default());
    };
    metrics::update(|m| {
        m.steps += 1;
        m.trace_time += t0.elapsed();
    });
    let mut report = StepReport {
        outputs: program.receivers.len(),
        nodes: program.graph.len(),
        compiled: false,
        donated: program.graph.aliases().len(),
    };
    let results = match backend {
        Backend::Pjrt => run_pjrt(&program, &mut report)?,
        Backend::Reference => run_reference(&program)?,
    };
    for (storage, receivers) in results.into_iter().zip(&program.receivers) {
        for t in receivers {
            *t.state.borrow_mut() = State::Ready(storage.clone());
        }
    }
    Ok(report)
}

fn run_pjrt(p: &Program, report: &mut StepReport) -> Result<Vec<Storage>> {
    let client = context::with(|c| c.client())?;
    let cached = context::with(|c| c.cache.get(&p.key).cloned());
    let exe = match cached {
        Some(exe) => {
            metrics::update(|m| m.cache_hits += 1);
            exe
        }
        None => {
            let t = Instant::now();
            let (optimized, _stats) = pipeline::optimize(&p.graph)?;
            let text = lower_graph(&optimized, &LowerOptions::default())?;
            let exe = Rc::new(client.compile(&text, &CompileOptions::default())?);
            metrics::update(|m| {
                m.compiles += 1;
                m.compile_time += t.elapsed();
            });
            report.compiled = true;
            tracing::debug!(key = p.key, nodes = p.graph.len(), "kiln: compiled a step");
            context::with(|c| c.cache.insert(p.key, exe.clone()));
            exe
        }
    };
    let device = client.devices().into_iter().next().ok_or_else(|| FrontendError::InvalidArgument {
        op: "mark_step",
        reason: "the PJRT client has no devices".into(),
    })?;
    let donated: Vec<bool> =
        (0..p.bindings.len()).map(|i| p.graph.aliases().iter().any(|a| a.param as usize == i)).collect();
    // Host data is uploaded once; the tensor then keeps the device copy.
    let mut owned = Vec::with_capacity(p.bindings.len());
    for b in &p.bindings {
        let buf = match &b.storage {
            Storage::Device(buf) => buf.clone(),
            Storage::Host(lit) => {
                let dims = lit.ty().shape.dims().to_vec();
                let buf = Arc::new(client.buffer_from_bytes(lit.bytes(), element_type(lit.ty().dtype), &dims, &device)?);
                metrics::update(|m| m.host_to_device_bytes += lit.bytes().len() as u64);
                if let Some(t) = b.tensor.upgrade() {
                    let mut st = t.state.borrow_mut();
                    if matches!(&*st, State::Ready(Storage::Host(l)) if Arc::ptr_eq(l, lit)) {
                        *st = State::Ready(Storage::Device(buf.clone()));
                    }
                }
                buf
            }
        };
        owned.push(buf);
    }
    // Donated buffers are moved in: the step's bindings held the last reference
    // (checked when the alias was added), so `try_unwrap` succeeds.
    let mut bufs: Vec<Option<Arc<kiln_runtime::Buffer>>> = owned.into_iter().map(Some).collect();
    let mut moved: Vec<Option<kiln_runtime::Buffer>> = (0..bufs.len()).map(|_| None).collect();
    for (i, &d) in donated.iter().enumerate() {
        if d {
            let arc = bufs[i].take().expect("each argument taken once");
            moved[i] = Some(Arc::try_unwrap(arc).map_err(|_| FrontendError::InvalidArgument {
                op: "mark_step",
                reason: format!("parameter {i} was marked for donation but is still shared"),
            })?);
        }
    }
    let args: Vec<ExecArg> = moved
        .into_iter()
        .zip(&bufs)
        .map(|(m, b)| match m {
            Some(buf) => ExecArg::Donated(buf),
            None => ExecArg::Borrowed(b.as_deref().expect("borrowed buffers stay in their slot")),
        })
        .collect();
    let t = Instant::now();
    let outputs = exe.execute(&args)?;
    metrics::update(|m| {
        m.executions += 1;
        m.execute_time += t.elapsed();
    });
    Ok(outputs.into_iter().map(|b| Storage::Device(Arc::new(b))).collect())
}

fn run_reference(p: &Program) -> Result<Vec<Storage>> {
    let types = p.graph.param_types();
    let inputs = p
        .bindings
        .iter()
        .zip(types)
        .map(|(b, ty)| match &b.storage {
            Storage::Host(lit) => Ok((**lit).clone()),
            Storage::Device(buf) => {
                let bytes = buf.to_host_bytes()?;
                Ok(Literal::from_bytes(ty, bytes)?)
            }
        })
        .collect::<Result<Vec<Literal>>>()?;
    let t = Instant::now();
    let outputs = kiln_compiler::interpret(&p.graph, &inputs)?;
    metrics::update(|m| {
        m.executions += 1;
        m.execute_time += t.elapsed();
    });
    Ok(outputs.into_iter().map(|l| Storage::Host(Arc::new(l))).collect())
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
