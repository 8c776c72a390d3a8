//! Every op: lowered and run through the XLA CPU plugin equals kiln's reference
//! interpreter on fresh random inputs of random shapes (proptest).
//!
//! Tolerances per dtype (relative to max(1, |reference|)): f64 1e-12, f32 2e-6
//! (XLA's f32 transcendentals are polynomial approximations), f16 1e-3, bf16
//! 8e-3 (one ulp), integers and pred exact. NaN must match NaN.

use std::cell::RefCell;

use kiln::compiler::ir::{
    BinaryOp, CompareDir, DType, DotDims, Graph, Literal, Op, ReduceOp, Shape, TensorType, UnaryOp, ValueId,
};
use kiln::compiler::{interpret, interpret_replicated, lower, LowerOptions};
use kiln::runtime::{Client, ClientOptions, CompileOptions, ExecArg};
use proptest::prelude::*;

mod common;
use common::Rng;

thread_local! {
    static CLIENT: RefCell<Option<Client>> = const { RefCell::new(None) };
}

fn client() -> Client {
    CLIENT.with(|c| {
        c.borrow_mut().get_or_insert_with(|| Client::new(&ClientOptions::default()).expect("CPU plugin")).clone()
    })
}

fn element_type(d: DType) -> kiln::runtime::ElementType {
    use kiln::runtime::ElementType as E;
    match d {
        DType::Pred => E::Pred,
        DType::I8 => E::S8,
        DType::I32 => E::S32,
        DType::I64 => E::S64,
        DType::U8 => E::U8,
        DType::U32 => E::U32,
        DType::U64 => E::U64,
        DType::F16 => E::F16,
        DType::BF16 => E::BF16,
        DType::F32 => E::F32,
        DType::F64 => E::F64,
    }
}

/// Runs `g` through XLA on one device.
fn run_xla(g: &Graph, inputs: &[Literal]) -> Vec<Literal> {
    let c = client();
    let text = lower(g, &LowerOptions::default()).expect("lowers");
    let exe = c.compile(&text, &CompileOptions::default()).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let dev = &c.devices()[0];
    let bufs: Vec<_> = inputs
        .iter()
        .map(|l| c.buffer_from_bytes(l.bytes(), element_type(l.ty().dtype), l.ty().shape.dims(), dev).unwrap())
        .collect();
    let args: Vec<ExecArg> = bufs.iter().map(ExecArg::Borrowed).collect();
    let outs = exe.execute(&args).expect("executes");
    outs.iter()
        .zip(g.output_types())
        .map(|(b, ty)| Literal::from_bytes(ty, b.to_host_bytes().unwrap()).unwrap())
        .collect()
}

fn tolerance(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-12,
        DType::F32 => 2e-6,
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        DType::Pred | DType::I8 | DType::I32 | DType::I64 | DType::U8 | DType::U32 | DType::U64 => 0.0,
    }
}

fn assert_close(what: &str, xla: &Literal, reference: &Literal) -> Result<(), TestCaseError> {
    prop_assert_eq!(xla.ty(), reference.ty(), "{}: types", what);
    let tol = tolerance(xla.ty().dtype);
    for (i, (a, b)) in xla.to_f64s().iter().zip(reference.to_f64s()).enumerate() {
        let ok = (a.is_nan() && b.is_nan()) || a == &b || (a - b).abs() <= tol * b.abs().max(1.0);
        prop_assert!(ok, "{}: element {} xla {} vs reference {} (tolerance {})", what, i, a, b, tol);
    }
    Ok(())
}

/// Builds a graph with `f`, feeds it random inputs and compares XLA with the
/// interpreter.
fn parity(
    what: &str,
    inputs: Vec<Literal>,
    f: impl FnOnce(&mut Graph, &[ValueId]) -> Vec<ValueId>,
) -> Result<(), TestCaseError> {
    let mut g = Graph::new();
    let params: Vec<ValueId> = inputs.iter().map(|l| g.parameter(l.ty().clone())).collect();
    let outs = f(&mut g, &params);
    g.set_outputs(outs).unwrap();
    let reference = interpret(&g, &inputs).unwrap_or_else(|e| panic!("{what}: {e}"));
    let xla = run_xla(&g, &inputs);
    for (x, r) in xla.iter().zip(&reference) {
        assert_close(what, x, r)?;
    }
    Ok(())
}

fn lit(dtype: DType, shape: &[usize], rng: &mut Rng, lo: f64, hi: f64) -> Literal {
    let n: usize = shape.iter().product();
    let vals: Vec<f64> = (0..n)
        .map(|_| {
            let v = lo + (hi - lo) * rng.uniform();
            if dtype.is_float() {
                v
            } else {
                v.floor()
            }
        })
        .collect();
    Literal::from_f64s(dtype, shape.to_vec(), &vals).unwrap()
}

fn shape_strategy() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..5, 0..4)
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

fn cfg() -> ProptestConfig {
    ProptestConfig { cases: 10, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn unary(shape in shape_strategy(), op in 0usize..UnaryOp::ALL.len(), d in 0usize..4, seed: u64) {
        let op = UnaryOp::ALL[op];
        let mut rng = Rng::new(seed);
        let (dtype, lo, hi) = match op {
            UnaryOp::Not => (DType::I32, -50.0, 50.0),
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => (FLOATS[d], 0.1, 4.0),
            UnaryOp::Log1p => (FLOATS[d], -0.9, 3.0),
            _ => (FLOATS[d], -3.0, 3.0),
        };
        let x = lit(dtype, &shape, &mut rng, lo, hi);
        parity(op.name(), vec![x], |g, p| vec![g.value(Op::Unary { op, input: p[0] }).unwrap()])?;
    }

    #[test]
    fn binary(shape in shape_strategy(), op in 0usize..8, d in 0usize..5, seed: u64) {
        let op = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Pow, BinaryOp::Max, BinaryOp::Min, BinaryOp::Rem][op];
        let dtype = [DType::F32, DType::F64, DType::BF16, DType::I32, DType::U32][d];
        let mut rng = Rng::new(seed);
        let (a, b) = match (op, dtype.is_float()) {
            (BinaryOp::Pow, true) => (lit(dtype, &shape, &mut rng, 0.2, 3.0), lit(dtype, &shape, &mut rng, -2.0, 2.0)),
            (BinaryOp::Pow, false) => (lit(dtype, &shape, &mut rng, 0.0, 5.0), lit(dtype, &shape, &mut rng, 0.0, 4.0)),
            (BinaryOp::Div | BinaryOp::Rem, _) => (lit(dtype, &shape, &mut rng, 0.0, 40.0), lit(dtype, &shape, &mut rng, 1.0, 7.0)),
            _ => (lit(dtype, &shape, &mut rng, 0.0, 40.0), lit(dtype, &shape, &mut rng, 0.0, 40.0)),
        };
        parity(op.name(), vec![a, b], |g, p| vec![g.value(Op::Binary { op, lhs: p[0], rhs: p[1] }).unwrap()])?;
    }

    #[test]
    fn logical(shape in shape_strategy(), op in 0usize..3, pred: bool, seed: u64) {
        let op = [BinaryOp::And, BinaryOp::Or, BinaryOp::Xor][op];
        let (dtype, hi) = if pred { (DType::Pred, 2.0) } else { (DType::I32, 1000.0) };
        let mut rng = Rng::new(seed);
        let (a, b) = (lit(dtype, &shape, &mut rng, 0.0, hi), lit(dtype, &shape, &mut rng, 0.0, hi));
        parity(op.name(), vec![a, b], |g, p| {
            let r = g.value(Op::Binary { op, lhs: p[0], rhs: p[1] }).unwrap();
            vec![r, g.value(Op::Unary { op: UnaryOp::Not, input: r }).unwrap()]
        })?;
    }

    #[test]
    fn shift_right_logical(shape in shape_strategy(), d in 0usize..4, seed: u64) {
        // Every bit pattern (sign bits set too), and amounts past the width.
        let dtype = [DType::I32, DType::U32, DType::U64, DType::I64][d];
        let width = dtype.size_in_bytes();
        let mut rng = Rng::new(seed);
        let n: usize = shape.iter().product();
        let bytes: Vec<u8> = (0..n).flat_map(|_| rng.next_u64().to_le_bytes().into_iter().take(width)).collect();
        let a = Literal::from_bytes(TensorType::new(dtype, shape.clone()), bytes).unwrap();
        let b = lit(dtype, &shape, &mut rng, 0.0, (8 * width + 4) as f64);
        parity("shift_right_logical", vec![a, b], |g, p| {
            vec![g.value(Op::Binary { op: BinaryOp::ShiftRightLogical, lhs: p[0], rhs: p[1] }).unwrap()]
        })?;
    }

    #[test]
    fn unsigned_division_by_a_constant_power_of_two(shape in shape_strategy(), wide: bool, k in 1u32..31, seed: u64) {
        // Lowered as a logical shift right; the interpreter divides.
        let dtype = if wide { DType::U64 } else { DType::U32 };
        let width = dtype.size_in_bytes();
        let mut rng = Rng::new(seed);
        let n: usize = shape.iter().product();
        let bytes: Vec<u8> = (0..n).flat_map(|_| rng.next_u64().to_le_bytes().into_iter().take(width)).collect();
        let a = Literal::from_bytes(TensorType::new(dtype, shape.clone()), bytes).unwrap();
        parity("div by 2^k", vec![a], |g, p| {
            let c = g.value(Op::Constant { literal: Literal::scalar(dtype, f64::from(1u32 << k)) }).unwrap();
            let c = g.value(Op::BroadcastInDim { input: c, shape: Shape::new(shape.clone()), dims: vec![] }).unwrap();
            vec![g.value(Op::Binary { op: BinaryOp::Div, lhs: p[0], rhs: c }).unwrap()]
        })?;
    }

    #[test]
    fn compare_select_clamp(shape in shape_strategy(), dir in 0usize..6, int: bool, seed: u64) {
        let dir = CompareDir::ALL[dir];
        let dtype = if int { DType::I32 } else { DType::F32 };
        let mut rng = Rng::new(seed);
        let (a, b) = (lit(dtype, &shape, &mut rng, -3.0, 3.0), lit(dtype, &shape, &mut rng, -3.0, 3.0));
        parity("compare/select/clamp", vec![a, b], |g, p| {
            let c = g.value(Op::Compare { dir, lhs: p[0], rhs: p[1] }).unwrap();
            let s = g.value(Op::Select { pred: c, on_true: p[0], on_false: p[1] }).unwrap();
            let lo = g.value(Op::Constant { literal: Literal::scalar(dtype, -1.0) }).unwrap();
            let hi = g.value(Op::Constant { literal: Literal::scalar(dtype, 1.0) }).unwrap();
            vec![c, s, g.value(Op::Clamp { min: lo, input: s, max: hi }).unwrap()]
        })?;
    }

    #[test]
    fn convert(shape in shape_strategy(), pair in 0usize..9, seed: u64) {
        let (from, to, lo, hi) = [
            (DType::F32, DType::I32, -100.0, 100.0),
            (DType::I32, DType::F32, -1000.0, 1000.0),
            (DType::F32, DType::BF16, -10.0, 10.0),
            (DType::F32, DType::F16, -10.0, 10.0),
            (DType::F64, DType::F32, -10.0, 10.0),
            (DType::U8, DType::F32, 0.0, 255.0),
            (DType::Pred, DType::F32, 0.0, 2.0),
            (DType::F32, DType::Pred, -1.0, 1.0),
            (DType::BF16, DType::F64, -10.0, 10.0),
        ][pair];
        let mut rng = Rng::new(seed);
        let x = lit(from, &shape, &mut rng, lo, hi);
        parity("convert", vec![x], |g, p| vec![g.value(Op::Convert { input: p[0], to }).unwrap()])?;
    }

    #[test]
    fn shape_ops(shape in prop::collection::vec(1usize..5, 1..4), seed: u64) {
        let mut rng = Rng::new(seed);
        let r = shape.len();
        let x = lit(DType::F32, &shape, &mut rng, -5.0, 5.0);
        let mut perm: Vec<usize> = (0..r).collect();
        perm.rotate_left(1);
        let start: Vec<usize> = shape.iter().map(|&d| (rng.next_u64() as usize) % d).collect();
        let limit: Vec<usize> = shape.iter().zip(&start).map(|(&d, &s)| s + 1 + (rng.next_u64() as usize) % (d - s)).collect();
        let stride: Vec<usize> = (0..r).map(|_| 1 + (rng.next_u64() as usize) % 2).collect();
        let low: Vec<i64> = (0..r).map(|_| (rng.next_u64() % 3) as i64 - 1).collect();
        let high: Vec<i64> = (0..r).map(|_| (rng.next_u64() % 3) as i64).collect();
        let interior: Vec<usize> = (0..r).map(|_| (rng.next_u64() % 2) as usize).collect();
        let mut big = vec![2];
        big.extend(&shape);
        parity("shape ops", vec![x], |g, p| {
            let t = g.value(Op::Transpose { input: p[0], perm: perm.clone() }).unwrap();
            let flat = g.value(Op::Reshape { input: t, shape: Shape::new(vec![shape.iter().product::<usize>()]) }).unwrap();
            let b = g.value(Op::BroadcastInDim { input: p[0], shape: Shape::new(big.clone()), dims: (1..=r).collect() }).unwrap();
            let s = g.value(Op::Slice { input: p[0], start: start.clone(), limit: limit.clone(), stride: stride.clone() }).unwrap();
            let c = g.value(Op::Concatenate { inputs: vec![p[0], p[0]], axis: r - 1 }).unwrap();
            let v = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 0.25) }).unwrap();
            let pad = g.value(Op::Pad { input: p[0], value: v, low: low.clone(), high: high.clone(), interior: interior.clone() });
            let mut outs = vec![t, flat, b, s, c];
            if let Ok(pad) = pad { outs.push(pad); }
            outs.push(g.value(Op::Iota { ty: TensorType::new(DType::I32, shape.clone()), axis: r - 1 }).unwrap());
            outs
        })?;
    }

    #[test]
    fn reduce(shape in prop::collection::vec(1usize..5, 1..4), op in 0usize..4, int: bool, mask in 0u8..8, seed: u64) {
        let op = ReduceOp::ALL[op];
        let mut rng = Rng::new(seed);
        let (dtype, lo, hi) = if int { (DType::I32, -5.0, 5.0) } else { (DType::F32, 0.5, 1.5) };
        let x = lit(dtype, &shape, &mut rng, lo, hi);
        let axes: Vec<usize> = (0..shape.len()).filter(|a| mask & (1 << a) != 0).collect();
        parity(op.name(), vec![x], |g, p| vec![g.value(Op::Reduce { op, input: p[0], axes: axes.clone() }).unwrap()])?;
    }

    #[test]
    fn dot_general(b in 1usize..3, m in 1usize..5, k in 1usize..6, n in 1usize..5, f64_: bool, seed: u64) {
        let dtype = if f64_ { DType::F64 } else { DType::F32 };
        let mut rng = Rng::new(seed);
        // lhs [k, b, m], rhs [b, n, k]: batch 1 x 0, contract 0 x 2.
        let l = lit(dtype, &[k, b, m], &mut rng, -1.0, 1.0);
        let r = lit(dtype, &[b, n, k], &mut rng, -1.0, 1.0);
        let dims = DotDims { lhs_batch: vec![1], rhs_batch: vec![0], lhs_contract: vec![0], rhs_contract: vec![2] };
        parity("dot_general", vec![l, r], |g, p| vec![g.value(Op::DotGeneral { lhs: p[0], rhs: p[1], dims }).unwrap()])?;
    }

    #[test]
    fn gather_scatter(rows in 1usize..6, cols in 1usize..4, picks in 1usize..7, seed: u64) {
        let mut rng = Rng::new(seed);
        let table = lit(DType::F32, &[rows, cols], &mut rng, -1.0, 1.0);
        let idx = lit(DType::I32, &[picks], &mut rng, 0.0, rows as f64);
        let upd = lit(DType::F32, &[picks, cols], &mut rng, -1.0, 1.0);
        parity("gather/scatter_add", vec![table, idx, upd], |g, p| {
            vec![
                g.value(Op::Gather { operand: p[0], indices: p[1], axis: 0 }).unwrap(),
                g.value(Op::ScatterAdd { operand: p[0], indices: p[1], updates: p[2], axis: 0 }).unwrap(),
            ]
        })?;
    }

    #[test]
    fn dynamic_slices(rows in 2usize..6, cols in 2usize..6, s0 in -2i64..8, s1 in -2i64..8, seed: u64) {
        let mut rng = Rng::new(seed);
        let x = lit(DType::F32, &[rows, cols], &mut rng, -1.0, 1.0);
        let u = lit(DType::F32, &[1, 2], &mut rng, -1.0, 1.0);
        let a = Literal::from_f64s(DType::I32, Vec::<usize>::new(), &[s0 as f64]).unwrap();
        let b = Literal::from_f64s(DType::I32, Vec::<usize>::new(), &[s1 as f64]).unwrap();
        parity("dynamic slices", vec![x, u, a, b], |g, p| {
            vec![
                g.value(Op::DynamicSlice { input: p[0], starts: vec![p[2], p[3]], sizes: vec![1, 2] }).unwrap(),
                g.value(Op::DynamicUpdateSlice { input: p[0], update: p[1], starts: vec![p[2], p[3]] }).unwrap(),
            ]
        })?;
    }
}

#[test]
fn rng_bit_generator_reproduces_xla_bits() {
    use kiln::compiler::ir::RngAlgorithm;
    let mut rng = Rng::new(fresh());
    for (algorithm, words) in [(RngAlgorithm::ThreeFry, 2), (RngAlgorithm::Philox, 2), (RngAlgorithm::Philox, 3)] {
        for (dtype, shape) in [
            (DType::U32, vec![3, 4]),
            (DType::U32, vec![5]),
            (DType::U32, vec![3, 5]),
            (DType::U64, vec![3]),
            (DType::U32, vec![]),
        ] {
            let state: Vec<u8> = (0..words).flat_map(|_| rng.next_u64().to_le_bytes()).collect();
            let state = Literal::from_bytes(TensorType::new(DType::U64, [words]), state).unwrap();
            let what = format!("{} {dtype} {shape:?}", algorithm.name());
            parity(&what, vec![state], |g, p| {
                let n = g
                    .add(Op::RngBitGenerator { algorithm, state: p[0], ty: TensorType::new(dtype, shape.clone()) })
                    .unwrap();
                vec![ValueId::new(n, 0), ValueId::new(n, 1)]
            })
            .unwrap();
        }
    }
}

fn fresh() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

#[test]
fn optimization_barrier_passes_values_through() {
    let mut rng = Rng::new(3);
    let (a, b) = (lit(DType::F32, &[3], &mut rng, -1.0, 1.0), lit(DType::I32, &[2], &mut rng, 0.0, 9.0));
    parity("optimization_barrier", vec![a, b], |g, p| {
        let n = g.add(Op::OptimizationBarrier { inputs: vec![p[0], p[1]] }).unwrap();
        vec![ValueId::new(n, 0), ValueId::new(n, 1)]
    })
    .unwrap();
}

#[test]
fn all_reduce_over_four_replicas() {
    let c = Client::new(&ClientOptions { cpu_device_count: Some(4), ..ClientOptions::default() }).unwrap();
    for op in ReduceOp::ALL {
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::F32, [5]));
        let r = g.value(Op::AllReduce { op, input: x }).unwrap();
        g.set_outputs(vec![r]).unwrap();
        let mut rng = Rng::new(op as u64 + 1);
        let inputs: Vec<Vec<Literal>> = (0..4).map(|_| vec![lit(DType::F32, &[5], &mut rng, 0.5, 1.5)]).collect();
        let reference = interpret_replicated(&g, &inputs).unwrap();
        let text = lower(&g, &LowerOptions { num_replicas: 4, ..LowerOptions::default() }).unwrap();
        let exe = c.compile(&text, &CompileOptions { num_replicas: 4, ..CompileOptions::default() }).unwrap();
        let devs = c.devices();
        let bufs: Vec<_> = inputs
            .iter()
            .zip(&devs)
            .map(|(l, d)| c.buffer_from_bytes(l[0].bytes(), element_type(DType::F32), &[5], d).unwrap())
            .collect();
        let args: Vec<Vec<ExecArg>> = bufs.iter().map(|b| vec![ExecArg::Borrowed(b)]).collect();
        let outs = exe.execute_replicated(args).unwrap();
        for (replica, out) in outs.iter().enumerate() {
            let got = Literal::from_bytes(TensorType::new(DType::F32, [5]), out[0].to_host_bytes().unwrap()).unwrap();
            assert_close(op.name(), &got, &reference[replica][0]).unwrap();
        }
    }
}

/// Constants of at least `LARGE_CONSTANT_BYTES` lower compactly (a splat as
/// its scalar broadcast to the shape, any other in hex, pred as `ui8` bytes
/// converted) and still give XLA the interpreter's values in every dtype,
/// used directly and as an operand; so does the large unsigned `sign`, whose
/// 1 is broadcast the same way.
#[test]
fn large_constants_reach_xla_with_their_values() {
    let large = lower::LARGE_CONSTANT_BYTES;
    let mut rng = Rng::new(17);
    for dtype in DType::ALL {
        let n = large / dtype.size_in_bytes();
        let hi = if dtype == DType::Pred { 2.0 } else { 50.0 };
        let dense = lit(dtype, &[n], &mut rng, 0.0, hi);
        let splat = Literal::from_f64s(dtype, [n], &vec![1.0; n]).unwrap();
        assert_eq!(lower::constant_form(&dense), lower::ConstantForm::Hex, "{dtype}");
        assert_eq!(lower::constant_form(&splat), lower::ConstantForm::Broadcast, "{dtype}");
        let x = lit(dtype, &[n], &mut rng, 0.0, hi);
        let op = if dtype == DType::Pred { BinaryOp::Xor } else { BinaryOp::Max };
        parity(&format!("large {dtype} constants"), vec![x], |g, p| {
            let d = g.value(Op::Constant { literal: dense.clone() }).unwrap();
            let s = g.value(Op::Constant { literal: splat.clone() }).unwrap();
            let both = g.value(Op::Binary { op, lhs: d, rhs: s }).unwrap();
            let with_x = g.value(Op::Binary { op, lhs: p[0], rhs: both }).unwrap();
            vec![d, s, with_x]
        })
        .unwrap();
    }
    let x = lit(DType::U32, &[large / 4], &mut rng, 0.0, 3.0);
    parity("large unsigned sign", vec![x], |g, p| vec![g.value(Op::Unary { op: UnaryOp::Sign, input: p[0] }).unwrap()])
        .unwrap();
}
