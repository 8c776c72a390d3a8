//! One op of the eager backend: on candle where candle computes it with
//! kiln's semantics, else on the reference interpreter's per-op evaluation.
//!
//! Invariants:
//! - Every op is matched exhaustively; each arm says which engine runs it.
//! - candle ops see operands of exactly the types shape inference gave them
//!   (kiln records broadcasts explicitly), so no implicit broadcasting happens
//!   here except for scalar bounds and predicates, which XLA allows too.

use candle_core::Tensor as Ct;
use kiln_compiler::ir::{
    BinaryOp, CompareDir, DType, DotDims, Graph, Literal, Op, ReduceOp, TensorType, UnaryOp, ValueId,
};

use super::convert::{candle_dtype, candle_err, candle_to_literal, literal_to_candle};
use super::Value;
use crate::core::error::Result;

/// The literal of `v` (converting, and keeping, candle's result).
pub(crate) fn host<'a>(v: &'a mut Value, ty: &TensorType) -> Result<&'a Literal> {
    if v.host.is_none() {
        let t = v.candle.as_ref().expect("a value holds candle data or a literal");
        v.host = Some(candle_to_literal(t, ty)?);
    }
    Ok(v.host.as_ref().expect("set above"))
}

/// The candle tensor of `v`, `None` for a dtype candle lacks.
fn candle(v: &mut Value) -> Result<Option<&Ct>> {
    if v.candle.is_none() {
        let lit = v.host.as_ref().expect("a value holds candle data or a literal");
        v.candle = literal_to_candle(lit)?;
    }
    Ok(v.candle.as_ref())
}

/// `y`, a max or min of `operands`, with NaN wherever an operand is NaN:
/// candle's `maximum`/`minimum` (and `max`/`min` along an axis) skip NaN, and
/// kiln's max and min propagate it, as StableHLO specifies and the reference
/// interpreter and the XLA plugins (`SEMANTIC_OVERRIDES`) compute. Operands
/// broadcast to `y` (scalar clamp bounds).
fn with_nans(y: Ct, operands: &[&Ct]) -> candle_core::Result<Ct> {
    let mut y = y;
    for x in operands.iter().filter(|x| x.dtype().is_float()) {
        let x = x.broadcast_as(y.dims())?;
        y = x.ne(&x)?.where_cond(&x, &y)?;
    }
    Ok(y)
}

/// [`with_nans`] for `reduced`, the max or min of `x` along `axis`.
fn reduced_with_nans(reduced: Ct, x: &Ct, axis: usize) -> candle_core::Result<Ct> {
    if !x.dtype().is_float() {
        return Ok(reduced);
    }
    let any_nan = x.ne(x)?.max(axis)?;
    any_nan.where_cond(&reduced.affine(0.0, f64::NAN)?, &reduced)
}

fn one_candle(t: Ct) -> Result<Vec<Value>> {
    Ok(vec![Value { candle: Some(t), host: None }])
}

/// Which engine runs an op.
enum Engine {
    Candle,
    Interpreter,
}

fn is_float(d: DType) -> bool {
    d.is_float()
}

/// The engine for `op` with result types `outs`, given operand dtypes.
fn engine(op: &Op, outs: &[TensorType], graph: &Graph) -> Engine {
    let dtype_of = |v: ValueId| graph.ty(v).dtype;
    let all_candle = op.inputs().iter().all(|&v| candle_dtype(dtype_of(v)).is_some())
        && outs.iter().all(|t| candle_dtype(t.dtype).is_some());
    if !all_candle {
        return Engine::Interpreter;
    }
    let float_out = is_float(outs[0].dtype);
    let ok = match op {
        // Host data: a literal, converted when a candle op needs it.
        Op::Parameter { .. } | Op::Constant { .. } | Op::Iota { .. } => false,
        Op::Unary { op, .. } => {
            float_out
                && match op {
                    UnaryOp::Neg
                    | UnaryOp::Abs
                    | UnaryOp::Exp
                    | UnaryOp::Log
                    | UnaryOp::Tanh
                    | UnaryOp::Logistic
                    | UnaryOp::Sqrt
                    | UnaryOp::Rsqrt
                    | UnaryOp::Sin
                    | UnaryOp::Cos
                    | UnaryOp::Floor
                    | UnaryOp::Ceil
                    | UnaryOp::Erf => true,
                    // Precision near 0 (candle has no log1p/expm1), bitwise
                    // not, and sign (candle's gives 0 for NaN and +0 for -0):
                    // the interpreter's.
                    UnaryOp::Log1p | UnaryOp::Expm1 | UnaryOp::Not | UnaryOp::Sign => false,
                }
        }
        Op::Binary { op, .. } => {
            float_out
                && match op {
                    BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div | BinaryOp::Max | BinaryOp::Min => true,
                    BinaryOp::Pow
                    | BinaryOp::Rem
                    | BinaryOp::And
                    | BinaryOp::Or
                    | BinaryOp::Xor
                    | BinaryOp::ShiftRightLogical => false,
                }
        }
        Op::Compare { lhs, .. } => dtype_of(*lhs) != DType::Pred,
        Op::Select { .. } => true,
        Op::Clamp { .. } => float_out,
        // Conversions to pred test != 0, which a cast does not.
        Op::Convert { to, .. } => *to != DType::Pred,
        Op::BroadcastInDim { .. } | Op::Reshape { .. } | Op::Transpose { .. } | Op::Concatenate { .. } => true,
        Op::Slice { stride, .. } => stride.iter().all(|&s| s == 1),
        Op::Reduce { op, input, .. } => {
            // candle's max and min fail on an empty axis, where the
            // interpreter gives the reduction's identity (-inf, +inf).
            dtype_of(*input) != DType::Pred
                && match op {
                    ReduceOp::Sum => float_out,
                    ReduceOp::Max | ReduceOp::Min => graph.ty(*input).shape.num_elements() > 0,
                    ReduceOp::Prod => false,
                }
        }
        Op::DotGeneral { .. } => float_out,
        Op::OptimizationBarrier { .. } | Op::AllReduce { .. } => true,
        Op::DynamicSlice { .. }
        | Op::DynamicUpdateSlice { .. }
        | Op::Pad { .. }
        | Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::RngBitGenerator { .. }
        // Composites: the interpreter runs their definitions.
        | Op::Attention { .. }
        | Op::AttentionGrad { .. }
        | Op::LayerNorm { .. }
        | Op::LayerNormGrad { .. }
        | Op::RmsNorm { .. }
        | Op::RmsNormGrad { .. }
        | Op::LmHeadCrossEntropy { .. }
        | Op::LmHeadCrossEntropyGrad { .. }
        | Op::LmHeadCrossEntropyFused { .. }
        | Op::Place { .. }
        | Op::HostCopy { .. }
        | Op::Whole { .. } => false,
    };
    if ok {
        Engine::Candle
    } else {
        Engine::Interpreter
    }
}

/// Evaluates `op` with result types `outs` over the values of earlier nodes
/// of `graph` (which gives every operand's kiln type: a candle `u8` may be a
/// kiln `pred`).
pub(crate) fn eval(graph: &Graph, op: &Op, outs: &[TensorType], values: &mut [Vec<Value>]) -> Result<Vec<Value>> {
    match engine(op, outs, graph) {
        Engine::Interpreter => {
            for &v in &op.inputs() {
                host(&mut values[v.node.index()][v.output as usize], graph.ty(v))?;
            }
            let get = |v: ValueId| -> &Literal {
                values[v.node.index()][v.output as usize].host.as_ref().expect("converted above")
            };
            let lits = kiln_compiler::interpret_op(op, outs, &get)?;
            Ok(lits.into_iter().map(|l| Value { candle: None, host: Some(l) }).collect())
        }
        Engine::Candle => {
            for &v in &op.inputs() {
                candle(&mut values[v.node.index()][v.output as usize])?;
            }
            let get = |v: ValueId| -> &Ct {
                values[v.node.index()][v.output as usize].candle.as_ref().expect("converted above")
            };
            eval_candle(op, outs, &get)
        }
    }
}

fn eval_candle<'a>(op: &Op, outs: &[TensorType], get: &dyn Fn(ValueId) -> &'a Ct) -> Result<Vec<Value>> {
    let name = op.name();
    let e = candle_err(name);
    let out = &outs[0];
    match op {
        Op::Unary { op: u, input } => {
            let x = get(*input);
            let y = match u {
                UnaryOp::Neg => x.neg(),
                UnaryOp::Abs => x.abs(),
                UnaryOp::Exp => x.exp(),
                UnaryOp::Log => x.log(),
                UnaryOp::Tanh => x.tanh(),
                UnaryOp::Logistic => {
                    x.neg().and_then(|n| n.exp()).and_then(|e| e.affine(1.0, 1.0)).and_then(|d| d.recip())
                }
                UnaryOp::Sqrt => x.sqrt(),
                UnaryOp::Rsqrt => x.sqrt().and_then(|s| s.recip()),
                UnaryOp::Sin => x.sin(),
                UnaryOp::Cos => x.cos(),
                UnaryOp::Floor => x.floor(),
                UnaryOp::Ceil => x.ceil(),
                UnaryOp::Erf => x.erf(),
                UnaryOp::Log1p | UnaryOp::Expm1 | UnaryOp::Not | UnaryOp::Sign => {
                    unreachable!("run by the interpreter")
                }
            };
            one_candle(y.map_err(e)?)
        }
        Op::Binary { op: b, lhs, rhs } => {
            let (l, r) = (get(*lhs), get(*rhs));
            let y = match b {
                BinaryOp::Add => l.add(r),
                BinaryOp::Sub => l.sub(r),
                BinaryOp::Mul => l.mul(r),
                BinaryOp::Div => l.div(r),
                BinaryOp::Max => l.maximum(r).and_then(|y| with_nans(y, &[l, r])),
                BinaryOp::Min => l.minimum(r).and_then(|y| with_nans(y, &[l, r])),
                BinaryOp::Pow
                | BinaryOp::Rem
                | BinaryOp::And
                | BinaryOp::Or
                | BinaryOp::Xor
                | BinaryOp::ShiftRightLogical => {
                    unreachable!("run by the interpreter")
                }
            };
            one_candle(y.map_err(e)?)
        }
        Op::Compare { dir, lhs, rhs } => {
            let (l, r) = (get(*lhs), get(*rhs));
            let y = match dir {
                CompareDir::Eq => l.eq(r),
                CompareDir::Ne => l.ne(r),
                CompareDir::Lt => l.lt(r),
                CompareDir::Le => l.le(r),
                CompareDir::Gt => l.gt(r),
                CompareDir::Ge => l.ge(r),
            };
            one_candle(y.map_err(e)?)
        }
        Op::Select { pred, on_true, on_false } => {
            let (t, f) = (get(*on_true), get(*on_false));
            let p = get(*pred).broadcast_as(t.dims()).map_err(&e)?;
            one_candle(p.where_cond(t, f).map_err(e)?)
        }
        Op::Clamp { min, input, max } => {
            let (lo, x, hi) = (get(*min), get(*input), get(*max));
            let y =
                x.broadcast_maximum(lo).and_then(|y| y.broadcast_minimum(hi)).and_then(|y| with_nans(y, &[lo, x, hi]));
            one_candle(y.map_err(e)?)
        }
        Op::Convert { input, to } => {
            let d = candle_dtype(*to).expect("checked by the engine choice");
            one_candle(get(*input).to_dtype(d).map_err(e)?)
        }
        Op::BroadcastInDim { input, shape, dims } => {
            one_candle(broadcast_in_dim(get(*input), shape.dims(), dims).map_err(e)?)
        }
        Op::Reshape { input, shape } => one_candle(get(*input).reshape(shape.dims()).map_err(e)?),
        Op::Transpose { input, perm } => one_candle(get(*input).permute(perm.clone()).map_err(e)?),
        Op::Slice { input, start, limit, .. } => {
            let mut x = get(*input).clone();
            for (d, (&s, &l)) in start.iter().zip(limit).enumerate() {
                if s != 0 || l != x.dims()[d] {
                    x = x.narrow(d, s, l - s).map_err(&e)?;
                }
            }
            one_candle(x)
        }
        Op::Concatenate { inputs, axis } => {
            let xs: Vec<&Ct> = inputs.iter().map(|&v| get(v)).collect();
            one_candle(Ct::cat(&xs, *axis).map_err(e)?)
        }
        Op::Reduce { op: r, input, axes } => {
            let x = get(*input);
            if axes.is_empty() {
                return one_candle(x.clone());
            }
            let y = match r {
                // 16-bit floats are summed in f32 and rounded once, as XLA
                // does: candle sums in the element type (4096 bf16 values in
                // [1, 1.5) summed to 512).
                ReduceOp::Sum if matches!(x.dtype(), candle_core::DType::F16 | candle_core::DType::BF16) => x
                    .to_dtype(candle_core::DType::F32)
                    .and_then(|w| w.sum(axes.clone()))
                    .and_then(|w| w.to_dtype(x.dtype())),
                ReduceOp::Sum => x.sum(axes.clone()),
                ReduceOp::Max | ReduceOp::Min => {
                    let mut y = x.clone();
                    // Highest axis first, so the lower axes keep their index.
                    for &a in axes.iter().rev() {
                        let reduced = if matches!(r, ReduceOp::Max) { y.max(a) } else { y.min(a) }.map_err(&e)?;
                        y = reduced_with_nans(reduced, &y, a).map_err(&e)?;
                    }
                    Ok(y)
                }
                ReduceOp::Prod => unreachable!("run by the interpreter"),
            };
            one_candle(y.map_err(e)?)
        }
        Op::DotGeneral { lhs, rhs, dims } => one_candle(dot_general(get(*lhs), get(*rhs), dims, out).map_err(e)?),
        Op::OptimizationBarrier { inputs } => {
            Ok(inputs.iter().map(|&v| Value { candle: Some(get(v).clone()), host: None }).collect())
        }
        // One replica: the sum (or max, min, product) over one value is itself.
        Op::AllReduce { input, .. } => one_candle(get(*input).clone()),
        Op::Parameter { .. }
        | Op::Constant { .. }
        | Op::Iota { .. }
        | Op::DynamicSlice { .. }
        | Op::DynamicUpdateSlice { .. }
        | Op::Pad { .. }
        | Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::RngBitGenerator { .. }
        | Op::Attention { .. }
        | Op::AttentionGrad { .. }
        | Op::LayerNorm { .. }
        | Op::LayerNormGrad { .. }
        | Op::RmsNorm { .. }
        | Op::RmsNormGrad { .. }
        | Op::LmHeadCrossEntropy { .. }
        | Op::LmHeadCrossEntropyGrad { .. }
        | Op::LmHeadCrossEntropyFused { .. }
        | Op::Place { .. }
        | Op::HostCopy { .. }
        | Op::Whole { .. } => unreachable!("run by the interpreter"),
    }
}

/// `stablehlo.broadcast_in_dim`: input dimension `k` becomes output
/// dimension `dims[k]`.
fn broadcast_in_dim(x: &Ct, shape: &[usize], dims: &[usize]) -> candle_core::Result<Ct> {
    // Order the input's dimensions as they appear in the output first.
    let mut order: Vec<usize> = (0..dims.len()).collect();
    order.sort_by_key(|&k| dims[k]);
    let x = if order.iter().enumerate().all(|(i, &k)| i == k) { x.clone() } else { x.permute(order.clone())? };
    let mut inter = vec![1usize; shape.len()];
    for (i, &k) in order.iter().enumerate() {
        inter[dims[k]] = x.dims()[i];
    }
    x.reshape(inter)?.broadcast_as(shape)?.contiguous()
}

/// `stablehlo.dot_general` as one batched matmul: both operands permuted to
/// `[batch, free, contract]` / `[batch, contract, free]` and flattened to 3-D;
/// the result `[batch..., lhs free..., rhs free...]`.
fn dot_general(l: &Ct, r: &Ct, d: &DotDims, out: &TensorType) -> candle_core::Result<Ct> {
    let free = |rank: usize, batch: &[usize], contract: &[usize]| -> Vec<usize> {
        (0..rank).filter(|i| !batch.contains(i) && !contract.contains(i)).collect()
    };
    let (lr, rr) = (l.rank(), r.rank());
    let lf = free(lr, &d.lhs_batch, &d.lhs_contract);
    let rf = free(rr, &d.rhs_batch, &d.rhs_contract);
    let size = |t: &Ct, axes: &[usize]| axes.iter().map(|&a| t.dims()[a]).product::<usize>();
    let (b, m, k, n) = (size(l, &d.lhs_batch), size(l, &lf), size(l, &d.lhs_contract), size(r, &rf));
    let lp: Vec<usize> = d.lhs_batch.iter().chain(&lf).chain(&d.lhs_contract).copied().collect();
    let rp: Vec<usize> = d.rhs_batch.iter().chain(&d.rhs_contract).chain(&rf).copied().collect();
    let permuted = |t: &Ct, p: Vec<usize>| -> candle_core::Result<Ct> {
        if p.iter().enumerate().all(|(i, &a)| i == a) {
            Ok(t.clone())
        } else {
            t.permute(p)?.contiguous()
        }
    };
    let a = permuted(l, lp)?.reshape((b, m, k))?;
    let bm = permuted(r, rp)?.reshape((b, k, n))?;
    a.matmul(&bm)?.reshape(out.shape.dims())
}
