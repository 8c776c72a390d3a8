//! Device-side checks: values that are wrong only at run time (a label or an
//! index out of range, a NaN) found by the step itself and raised as typed
//! errors, as PyTorch's device-side asserts and anomaly mode do.
//!
//! How a check works:
//! 1. While recording, an op that reads indices (`cross_entropy`'s labels, the
//!    indices of `gather`, hence every `Embedding`) calls
//!    [`check_index_range`]: it records a small summary of the indices into the
//!    trace (how many lie outside `0..bound`, their minimum and maximum, as
//!    s64) and registers it with what to say if it fails (op, layer, bound).
//! 2. When the step is cut, [`seal`] concatenates every registered summary of
//!    the trace (and, in anomaly mode, a count of non-finite values of every
//!    floating-point value of the trace) into one s64 vector: one more output
//!    of the step, computed by the same program, with no extra execution.
//! 3. Once the step's outputs are known, [`verify`] reads that vector (a few
//!    bytes per replica) and raises [`FrontendError::IndexOutOfRange`] or
//!    [`FrontendError::NonFinite`] for the first failed check. The step has run:
//!    its outputs (parameters included) hold what the bad input produced.
//!
//! Invariants:
//! - Checks add nodes and one output to the trace and change nothing else:
//!   the computed values are bit-identical with checks on and off, and the
//!   flag output is never aliased to a parameter (donation is unchanged).
//! - The summary nodes are recorded in the same order every time the same
//!   step is recorded, so the trace's key, and with it the compile cache, is
//!   as stable as without checks (no recompile after the first steps).
//! - With checks off and anomaly mode off nothing is recorded: the program is
//!   the one kiln compiled before checks existed.
//! - A summary registered in a trace that ended without running (`lower`) is
//!   dropped when the next step is sealed; it never reaches another trace.
//! - A step whose only outputs would be checks runs nothing (as without them).
//!
//! Sealing runs in the `device_checks` span of the step timeline
//! (`metrics::start_timeline`, `kiln profile --trace`), reading the flags in
//! the `device_checks_read` span.
//!
//! Settings (`core::settings`): `KILN_DEVICE_CHECKS` (on by default;
//! `0`/`off` turns the range checks off) and
//! [`set_device_checks`](crate::set_device_checks); `KILN_DETECT_ANOMALY` (off
//! by default) and [`set_detect_anomaly`](crate::set_detect_anomaly). Each
//! thread reads the variables once, on first use; a call overrides them for
//! the calling thread.
//!
//! Layering: the summaries ([`check_index_range`]) and the flag output
//! ([`seal`]) are recorded with `Tensor`'s ops, which `api::tensor` defines on
//! the core handle. This module imports nothing of the API layer, but it runs
//! API code: the one call from the engine up into the API (`lib.rs` says
//! why it stays).

use std::cell::RefCell;
use std::rc::Rc;

use kiln_compiler::ir::{DType, Op, TensorType, ValueId};

use crate::core::error::{FrontendError, Result};
use crate::core::settings::{detect_anomaly, device_checks};
use crate::core::storage::{State, Storage};
use crate::core::tensor::Tensor;
use crate::engine::context;
use crate::engine::scope;

/// What to say when an index check fails.
#[derive(Clone, Debug)]
struct IndexSite {
    op: &'static str,
    layer: Option<Rc<str>>,
    /// What the values are, for the message (`label`, `index`).
    what: &'static str,
    /// Valid values are `0..bound`.
    bound: u64,
    /// Values checked per replica.
    per_replica: u64,
}

/// A floating-point value of the trace checked in anomaly mode.
#[derive(Clone, Debug)]
struct AnomalySite {
    value: ValueId,
    op: &'static str,
    ty: TensorType,
    layer: Option<Rc<str>>,
    /// Step inputs (parameters) are checked so that a message can name a
    /// non-finite input, but an input is never "the first op".
    input_name: Option<Option<Rc<str>>>,
    operands: Vec<ValueId>,
}

/// The checks of a trace, sealed into the trace's flag output.
pub(crate) struct Sealed {
    /// s64 `[3 × index checks + anomaly sites]`: per index check `count`,
    /// `min`, `max`; per anomaly site the number of non-finite elements.
    flags: Tensor,
    index: Vec<IndexSite>,
    anomaly: Vec<AnomalySite>,
    /// The flags' copy to the host, started when the step was enqueued (one
    /// per replica), so that reading them at the step's completion does not
    /// pay a device-to-host round trip on the host's path.
    copies: Option<Vec<kiln_runtime::HostCopy>>,
}

impl Sealed {
    /// The flag output of the sealed trace.
    pub(crate) fn flags(&self) -> &Tensor {
        &self.flags
    }

    /// The same checks, read from `flags` (a captured step's replay returns
    /// its own flag output). When `flags` is on the device (the step was just
    /// enqueued), its copy to the host starts now; a copy that cannot start
    /// leaves the read to [`verify`].
    pub(crate) fn rebind(&self, flags: Tensor) -> Sealed {
        let copies = match &*flags.inner.state.borrow() {
            State::Ready(Storage::Device(value)) => {
                value.0.iter().map(|b| b.start_to_host_bytes()).collect::<kiln_runtime::Result<Vec<_>>>().ok()
            }
            State::Ready(Storage::Host(_) | Storage::HostShards(_)) | State::Pending { .. } => None,
        };
        Sealed { flags, index: self.index.clone(), anomaly: self.anomaly.clone(), copies }
    }
}

struct Registered {
    epoch: u64,
    /// The s64 `[3]` summary in that trace.
    summary: ValueId,
    site: IndexSite,
}

thread_local! {
    static REGISTERED: RefCell<Vec<Registered>> = const { RefCell::new(Vec::new()) };
}

/// Records a check that every value of the integer tensor `indices` lies in
/// `0..bound`, raised after the step as [`FrontendError::IndexOutOfRange`]
/// naming `op`, the layer recording now, and `what` the values are. Nothing is
/// recorded when checks are off, for float tensors (they are not indices),
/// or for empty ones.
pub fn check_index_range(op: &'static str, what: &'static str, indices: &Tensor, bound: usize) -> Result<()> {
    let dtype = indices.dtype();
    if !device_checks()? || !dtype.is_integer() || indices.elem_count() == 0 {
        return Ok(());
    }
    let flat = indices.reshape([indices.elem_count()])?;
    let zero = Tensor::full(0.0, dtype, [])?;
    let mut out_of_range: Option<Tensor> = None;
    if dtype.is_signed_integer() {
        out_of_range = Some(flat.lt(&zero)?);
    }
    // A bound beyond the dtype's range cannot be exceeded (and is not
    // representable as a constant of the dtype).
    if (bound as f64) <= max_of(dtype) {
        let high = flat.ge(&Tensor::full(bound as f64, dtype, [])?)?;
        out_of_range = Some(match out_of_range {
            Some(low) => low.binary(kiln_compiler::ir::BinaryOp::Or, &high)?,
            None => high,
        });
    }
    let count = match out_of_range {
        Some(bad) => bad.to_dtype(DType::I64)?.sum_all()?,
        None => Tensor::full(0.0, DType::I64, [])?,
    };
    let min = flat.min(&[0], false)?.to_dtype(DType::I64)?;
    let max = flat.max(&[0], false)?.to_dtype(DType::I64)?;
    let summary = Tensor::cat(&[count.reshape([1])?, min.reshape([1])?, max.reshape([1])?], 0)?;
    let summary = pending_value(&summary)?;
    let epoch = context::with(|c| c.trace.epoch);
    let site =
        IndexSite { op, layer: scope::current(), what, bound: bound as u64, per_replica: indices.elem_count() as u64 };
    REGISTERED.with(|r| r.borrow_mut().push(Registered { epoch, summary, site }));
    Ok(())
}

/// The largest value of an integer dtype, as f64.
fn max_of(dtype: DType) -> f64 {
    kiln_compiler::ir::ReduceOp::Min.identity(dtype)
}

fn pending_value(t: &Tensor) -> Result<ValueId> {
    match &*t.inner.state.borrow() {
        State::Pending { value, .. } => Ok(*value),
        State::Ready(_) => Err(FrontendError::StaleTensor { op: "device_checks" }),
    }
}

/// Records the trace's checks into one flag output (see the module docs).
/// Called by `mark_step` before the trace is closed; `None` when the step has
/// nothing to check or nothing else to compute.
pub(crate) fn seal() -> Result<Option<Sealed>> {
    let t = std::time::Instant::now();
    let sealed = seal_trace();
    crate::core::metrics::span("device_checks", t);
    sealed
}

fn seal_trace() -> Result<Option<Sealed>> {
    let epoch = context::with(|c| c.trace.epoch);
    let registered: Vec<Registered> = REGISTERED.with(|r| std::mem::take(&mut *r.borrow_mut()));
    let registered: Vec<Registered> = registered.into_iter().filter(|r| r.epoch == epoch).collect();
    let anomaly = detect_anomaly()?;
    if registered.is_empty() && !anomaly {
        return Ok(None);
    }
    if !context::with(|c| {
        c.trace.live.iter().any(|w| {
            w.upgrade().is_some_and(|t| matches!(&*t.state.borrow(), State::Pending { epoch: e, .. } if *e == epoch))
        })
    }) {
        return Ok(None);
    }
    let sites = if anomaly { anomaly_sites()? } else { Vec::new() };
    let mut parts = Vec::with_capacity(registered.len() + sites.len());
    for r in &registered {
        parts.push(Tensor::wrap(context::with(|c| c.pending(r.summary))));
    }
    for s in &sites {
        let x = Tensor::wrap(context::with(|c| c.pending(s.value)));
        parts.push(count_non_finite(&x)?.reshape([1])?);
    }
    if parts.is_empty() {
        return Ok(None);
    }
    let flags = Tensor::cat(&parts, 0)?;
    drop(parts);
    Ok(Some(Sealed { flags, index: registered.into_iter().map(|r| r.site).collect(), anomaly: sites, copies: None }))
}

/// Every floating-point value recorded so far in the trace, in recording order.
fn anomaly_sites() -> Result<Vec<AnomalySite>> {
    Ok(context::with(|c| {
        let epoch = c.trace.epoch;
        let graph = &c.trace.graph;
        let mut sites = Vec::new();
        for (id, node) in graph.nodes() {
            let input_name = match &node.op {
                Op::Parameter { index, .. } => Some(
                    c.trace
                        .bindings
                        .get(*index as usize)
                        .and_then(|b| b.tensor.upgrade())
                        .and_then(|t| t.name.borrow().clone()),
                ),
                // Constants are what the program says; checking them finds nothing.
                Op::Constant { .. } => continue,
                _ => None,
            };
            for (o, ty) in node.outputs.iter().enumerate() {
                if !ty.dtype.is_float() {
                    continue;
                }
                sites.push(AnomalySite {
                    value: ValueId::new(id, o as u32),
                    op: node.op.name(),
                    ty: ty.clone(),
                    layer: scope::layer_of(epoch, id.index()),
                    input_name: input_name.clone(),
                    operands: node.op.inputs().to_vec(),
                });
            }
        }
        sites
    }))
}

/// The number of NaN and ±inf elements of `x`, as an s64 scalar.
fn count_non_finite(x: &Tensor) -> Result<Tensor> {
    let max = match x.dtype() {
        DType::F16 => f64::from(half::f16::MAX),
        DType::BF16 => f64::from(half::bf16::MAX),
        DType::F32 => f64::from(f32::MAX),
        DType::F64 => f64::MAX,
        other => return Err(FrontendError::DType { op: "detect_anomaly", expected: "a float type", got: other }),
    };
    // NaN compares false, so `!(|x| <= max)` is exactly "not finite".
    let finite = x.abs()?.le(&Tensor::full(max, x.dtype(), [])?)?;
    let bad = finite.logical_not()?.to_dtype(DType::I64)?;
    if bad.rank() == 0 {
        Ok(bad)
    } else {
        bad.sum_all()
    }
}

/// Raises the first failed check of a step whose outputs are now known
/// (range checks first: an out-of-range index is the cause of what follows).
/// The executor calls this once per step, after the outputs became ready.
pub(crate) fn verify(sealed: Option<Sealed>) -> Result<()> {
    let Some(sealed) = sealed else { return Ok(()) };
    let t = std::time::Instant::now();
    let replicas = match sealed.copies {
        Some(copies) => copies
            .into_iter()
            .map(kiln_runtime::HostCopy::wait)
            .collect::<kiln_runtime::Result<Vec<_>>>()
            .map(|b| s64s(&b))
            .map_err(FrontendError::from),
        None => read_s64(&sealed.flags),
    };
    crate::core::metrics::span("device_checks_read", t);
    let replicas = replicas?;
    let n = replicas.len() as u64;
    let at = |i: usize| replicas.iter().map(move |r| r[i]);
    for (k, site) in sealed.index.iter().enumerate() {
        let count: i64 = at(3 * k).sum();
        if count == 0 {
            continue;
        }
        let min = at(3 * k + 1).min().expect("one replica at least");
        let max = at(3 * k + 2).max().expect("one replica at least");
        let value = if max >= 0 && max as u64 >= site.bound { max } else { min };
        return Err(FrontendError::IndexOutOfRange {
            op: site.op,
            layer: site.layer.as_deref().map(str::to_string),
            what: site.what,
            value,
            bound: site.bound,
            count: count as u64,
            total: site.per_replica * n,
            min,
            max,
        });
    }
    let base = 3 * sealed.index.len();
    let counts: Vec<i64> = (0..sealed.anomaly.len()).map(|i| at(base + i).sum()).collect();
    let Some(first) = sealed.anomaly.iter().zip(&counts).position(|(s, &c)| c > 0 && s.input_name.is_none()) else {
        return Ok(());
    };
    let site = &sealed.anomaly[first];
    let describe = |v: &ValueId| -> String {
        match sealed.anomaly.iter().zip(&counts).find(|(s, _)| s.value == *v) {
            Some((s, &c)) => {
                let what = match &s.input_name {
                    Some(Some(name)) => format!("input '{name}'"),
                    Some(None) => "an input".to_string(),
                    None => s.op.to_string(),
                };
                let finite = if c > 0 { format!(", {c} non-finite") } else { String::new() };
                format!("{v} = {what} ({}{finite})", s.ty)
            }
            None => format!("{v} (not floating-point)"),
        }
    };
    Err(FrontendError::NonFinite {
        op: site.op,
        value: site.value.to_string(),
        ty: Box::new(site.ty.clone()),
        layer: site.layer.as_deref().map(str::to_string),
        count: counts[first] as u64,
        operands: site.operands.iter().map(describe).collect::<Vec<_>>().join("; "),
    })
}

/// Every replica's values of an s64 vector, read without counting as a user
/// read (it is the step's own bookkeeping).
fn read_s64(t: &Tensor) -> Result<Vec<Vec<i64>>> {
    let storage = match &*t.inner.state.borrow() {
        State::Ready(s) => s.clone(),
        State::Pending { .. } => return Err(FrontendError::StaleTensor { op: "device_checks" }),
    };
    let bytes: Vec<Vec<u8>> = match storage {
        Storage::Host(lit) => vec![lit.bytes().to_vec()],
        Storage::HostShards(shards) => shards.iter().map(|l| l.bytes().to_vec()).collect(),
        Storage::Device(value) => value.0.iter().map(|b| b.to_host_bytes()).collect::<kiln_runtime::Result<_>>()?,
    };
    Ok(s64s(&bytes))
}

/// Every replica's bytes as s64 values.
fn s64s(bytes: &[Vec<u8>]) -> Vec<Vec<i64>> {
    bytes
        .iter()
        .map(|b| b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
        .collect()
}
