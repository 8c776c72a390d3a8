//! The eager backend ([`crate::Backend::Eager`]): every op runs the moment it
//! is recorded, on candle-core CPU tensors.
//!
//! The trace is still recorded (autodiff appends the backward to it, and
//! `mark_step` still closes it), but each node is evaluated as soon as it is
//! added, so a pending tensor already has its value: reading it (`to_vec`,
//! `item`) returns that value without cutting the step, and a loop can be
//! stepped through and printed as in eager PyTorch. `mark_step` then only hands
//! the outputs over as host data. Nothing is compiled.
//!
//! Floating-point arithmetic, dots, reductions and data movement run on
//! candle (its CPU kernels, gemm for dots): a realistic eager baseline for
//! `kiln profile`'s payback and `kiln train --compare-eager`. What candle has
//! no kernel or dtype for — integer arithmetic with XLA's wrapping and
//! division rules, `s8`/`u64`, `rng_bit_generator`, gathers, scatters, pads,
//! dynamic slices, `pow`, `rem`, `log1p`, `expm1` — falls back to the
//! reference interpreter's per-op evaluation ([`kiln_compiler::interpret_op`]),
//! so results keep kiln's exact semantics there. The f64 reference
//! interpreter ([`crate::Backend::Reference`]) stays the correctness oracle.
//!
//! Invariants:
//! - One value table per trace (by epoch); node `i`'s outputs are entry `i`,
//!   filled in insertion order, so a node's operands are always evaluated
//!   before it.
//! - Each value is held as a candle tensor, a literal, or both (a conversion
//!   is kept so it is done once).
//! - An op that fails to evaluate while recording is left unevaluated and
//!   evaluated again (failing again, now as an error) when a value is read or
//!   the step is cut.
//! - The eager backend runs one replica; more is an error at the first read
//!   of replicated data.

pub(crate) mod convert;
mod ops;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use kiln_compiler::ir::{Graph, Literal, NodeId, Op, ValueId};

use crate::core::error::{FrontendError, Result};
use crate::core::metrics;
use crate::core::storage::{Inner, State, Storage};
use crate::core::trace::{Binding, Trace};

/// One value, as candle computed it, as a literal, or both.
#[derive(Clone, Default)]
pub(crate) struct Value {
    candle: Option<candle_core::Tensor>,
    host: Option<Literal>,
}

struct Table {
    epoch: u64,
    /// Outputs of node `i`, for the nodes evaluated so far.
    values: Vec<Vec<Value>>,
}

thread_local! {
    /// Tables of the traces being recorded (more than one only while a
    /// lowering records inside a step).
    static TABLES: RefCell<Vec<Table>> = const { RefCell::new(Vec::new()) };
}

fn with_table<R>(epoch: u64, f: impl FnOnce(&mut Table) -> R) -> R {
    TABLES.with(|t| {
        let mut tables = t.borrow_mut();
        let i = match tables.iter().position(|t| t.epoch == epoch) {
            Some(i) => i,
            None => {
                tables.push(Table { epoch, values: Vec::new() });
                tables.len() - 1
            }
        };
        f(&mut tables[i])
    })
}

/// Evaluates the nodes of `trace` recorded since the last call.
pub(crate) fn catch_up(trace: &Trace) -> Result<()> {
    let t = Instant::now();
    let graph = &trace.graph;
    let r = with_table(trace.epoch, |table| {
        for i in table.values.len()..graph.len() {
            let outs = eval_node(graph, NodeId::from_index(i), &trace.bindings, &mut table.values)?;
            table.values.push(outs);
        }
        Ok(())
    });
    metrics::update(|m| m.execute_time += t.elapsed());
    r
}

fn eval_node(graph: &Graph, id: NodeId, bindings: &[Binding], values: &mut [Vec<Value>]) -> Result<Vec<Value>> {
    let node = graph.node(id);
    match &node.op {
        Op::Parameter { index, ty } => {
            let storage = &bindings[*index as usize].storage;
            let lit = match storage {
                Storage::Host(lit) => (**lit).clone(),
                Storage::HostShards(shards) if shards.len() == 1 => shards[0].clone(),
                Storage::Device(value) if value.0.len() == 1 => {
                    Literal::from_bytes(ty.clone(), value.0[0].to_host_bytes()?)?
                }
                Storage::HostShards(_) | Storage::Device(_) => {
                    return Err(FrontendError::Count {
                        op: "eager",
                        what: "replicas",
                        expected: "1 (the eager backend runs one replica)".into(),
                        got: storage.replicas().unwrap_or(1),
                    })
                }
            };
            Ok(vec![Value { candle: None, host: Some(lit) }])
        }
        op => ops::eval(graph, op, &node.outputs, values),
    }
}

/// The bytes of `t` when it is pending in the current trace of an eager
/// context (evaluating what is still missing); `None` otherwise.
pub(crate) fn read_pending(trace: &Trace, t: &Rc<Inner>) -> Result<Option<Vec<u8>>> {
    let value = match &*t.state.borrow() {
        State::Pending { epoch, value } if *epoch == trace.epoch => *value,
        _ => return Ok(None),
    };
    catch_up(trace)?;
    with_table(trace.epoch, |table| {
        let v = &mut table.values[value.node.index()][value.output as usize];
        Ok(Some(ops::host(v, &t.ty)?.bytes().to_vec()))
    })
    .inspect(|_| metrics::update(|m| m.reads += 1))
}

/// The outputs of the trace with `epoch` (already caught up by the caller)
/// as host data, and the end of every table (the step is over).
pub(crate) fn finish(epoch: u64, graph: &Graph) -> Result<Vec<Storage>> {
    let table = TABLES.with(|t| {
        let mut tables = t.borrow_mut();
        let i = tables.iter().position(|t| t.epoch == epoch);
        let table = i.map(|i| tables.swap_remove(i));
        tables.clear();
        table
    });
    let mut table = table.unwrap_or(Table { epoch, values: Vec::new() });
    if table.values.len() < graph.len() {
        return Err(FrontendError::StaleTensor { op: "mark_step" });
    }
    metrics::update(|m| m.executions += 1);
    graph
        .outputs()
        .iter()
        .map(|&o: &ValueId| {
            let ty = graph.ty(o).clone();
            let v = &mut table.values[o.node.index()][o.output as usize];
            Ok(Storage::Host(Arc::new(ops::host(v, &ty)?.clone())))
        })
        .collect()
}
