//! The IR's text form: golden snapshots, exact round trips (every op, every
//! attribute, awkward constants, random graphs) and parse errors with lines.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use half::{bf16, f16};
use kiln_compiler::ir::{
    Alias, AttentionAttrs, BinaryOp, CompareDir, DType, DotDims, Graph, HostCopyStep, Literal, MemorySpace, Op,
    ReduceOp, RngAlgorithm, Shape, TensorType, UnaryOp, ValueId,
};
use kiln_compiler::text::{parse, print};
use kiln_compiler::{verify, CompileError};
use proptest::prelude::*;

fn t(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims)
}

fn add(g: &mut Graph, op: Op) -> ValueId {
    g.value(op).unwrap()
}

/// Node for node, parameter for parameter, output for output, alias for alias.
fn assert_same_graph(a: &Graph, b: &Graph) {
    let na: Vec<_> = a.nodes().collect();
    let nb: Vec<_> = b.nodes().collect();
    assert_eq!(na, nb);
    assert_eq!(a.params(), b.params());
    assert_eq!(a.outputs(), b.outputs());
    assert_eq!(a.aliases(), b.aliases());
}

/// `parse(print(g))` equals `g` and prints the same text.
fn assert_round_trips(g: &Graph) {
    let text = print(g);
    let back = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(print(&back), text);
    assert_same_graph(g, &back);
    verify(&back).unwrap();
}

#[test]
fn mlp_layer() {
    // relu(x @ w + b)
    let mut g = Graph::new();
    let x = g.parameter(t(DType::F32, &[8, 4]));
    let w = g.parameter(t(DType::F32, &[4, 3]));
    let b = g.parameter(t(DType::F32, &[3]));
    let xw = add(&mut g, Op::DotGeneral { lhs: x, rhs: w, dims: DotDims::matmul() });
    let bb = add(&mut g, Op::BroadcastInDim { input: b, shape: Shape::new([8, 3]), dims: vec![1] });
    let h = add(&mut g, Op::Binary { op: BinaryOp::Add, lhs: xw, rhs: bb });
    let zero = add(&mut g, Op::Constant { literal: Literal::scalar(DType::F32, 0.0) });
    let zb = add(&mut g, Op::BroadcastInDim { input: zero, shape: Shape::new([8, 3]), dims: vec![] });
    let y = add(&mut g, Op::Binary { op: BinaryOp::Max, lhs: h, rhs: zb });
    g.set_outputs(vec![y]).unwrap();
    verify(&g).unwrap();
    insta::assert_snapshot!(print(&g), @r"
        graph(%0: tensor<8x4xf32>, %1: tensor<4x3xf32>, %2: tensor<3xf32>) {
          %3 = dot_general %0, %1, batch = [] x [], contract = [1] x [0] : tensor<8x3xf32>
          %4 = broadcast_in_dim %2, dims = [1] : tensor<8x3xf32>
          %5 = add %3, %4 : tensor<8x3xf32>
          %6 = constant dense<0.0> : tensor<f32>
          %7 = broadcast_in_dim %6, dims = [] : tensor<8x3xf32>
          %8 = max %5, %7 : tensor<8x3xf32>
          return %8
        }
    ");
    assert_eq!(g.to_string(), print(&g));
    assert_round_trips(&g);
}

#[test]
fn softmax() {
    let mut g = Graph::new();
    let x = g.parameter(t(DType::F32, &[2, 5]));
    let m = add(&mut g, Op::Reduce { op: ReduceOp::Max, input: x, axes: vec![1] });
    let mb = add(&mut g, Op::BroadcastInDim { input: m, shape: Shape::new([2, 5]), dims: vec![0] });
    let d = add(&mut g, Op::Binary { op: BinaryOp::Sub, lhs: x, rhs: mb });
    let e = add(&mut g, Op::Unary { op: UnaryOp::Exp, input: d });
    let s = add(&mut g, Op::Reduce { op: ReduceOp::Sum, input: e, axes: vec![1] });
    let sb = add(&mut g, Op::BroadcastInDim { input: s, shape: Shape::new([2, 5]), dims: vec![0] });
    let y = add(&mut g, Op::Binary { op: BinaryOp::Div, lhs: e, rhs: sb });
    g.set_outputs(vec![y]).unwrap();
    insta::assert_snapshot!(print(&g), @r"
        graph(%0: tensor<2x5xf32>) {
          %1 = reduce max %0, axes = [1] : tensor<2xf32>
          %2 = broadcast_in_dim %1, dims = [0] : tensor<2x5xf32>
          %3 = sub %0, %2 : tensor<2x5xf32>
          %4 = exp %3 : tensor<2x5xf32>
          %5 = reduce sum %4, axes = [1] : tensor<2xf32>
          %6 = broadcast_in_dim %5, dims = [0] : tensor<2x5xf32>
          %7 = div %4, %6 : tensor<2x5xf32>
          return %7
        }
    ");
    assert_round_trips(&g);
}

/// Which `Op` variant this is. Exhaustive on purpose: a new variant fails to
/// compile here until `every_op` below covers it.
fn variant(op: &Op) -> usize {
    match op {
        Op::Parameter { .. } => 0,
        Op::Constant { .. } => 1,
        Op::Iota { .. } => 2,
        Op::Unary { .. } => 3,
        Op::Binary { .. } => 4,
        Op::Compare { .. } => 5,
        Op::Select { .. } => 6,
        Op::Clamp { .. } => 7,
        Op::Convert { .. } => 8,
        Op::BroadcastInDim { .. } => 9,
        Op::Reshape { .. } => 10,
        Op::Transpose { .. } => 11,
        Op::Slice { .. } => 12,
        Op::DynamicSlice { .. } => 13,
        Op::DynamicUpdateSlice { .. } => 14,
        Op::Concatenate { .. } => 15,
        Op::Pad { .. } => 16,
        Op::Reduce { .. } => 17,
        Op::DotGeneral { .. } => 18,
        Op::Gather { .. } => 19,
        Op::ScatterAdd { .. } => 20,
        Op::RngBitGenerator { .. } => 21,
        Op::OptimizationBarrier { .. } => 22,
        Op::AllReduce { .. } => 23,
        Op::Attention { .. } => 24,
        Op::AttentionGrad { .. } => 25,
        Op::LayerNorm { .. } => 26,
        Op::LayerNormGrad { .. } => 27,
        Op::LmHeadCrossEntropy { .. } => 28,
        Op::LmHeadCrossEntropyGrad { .. } => 29,
        Op::LmHeadCrossEntropyFused { .. } => 30,
        Op::Place { .. } => 31,
        Op::Whole { .. } => 32,
        Op::HostCopy { .. } => 33,
        Op::RmsNorm { .. } => 34,
        Op::RmsNormGrad { .. } => 35,
    }
}
const VARIANTS: usize = 36;

/// A graph with every `Op` variant and every unary, binary, compare and reduce op.
fn every_op() -> Graph {
    let mut g = Graph::new();
    let x = g.parameter(t(DType::F32, &[2, 3]));
    let y = g.parameter(t(DType::F32, &[2, 3]));
    let idx = g.parameter(t(DType::I32, &[4]));
    let state = g.parameter(t(DType::U64, &[2]));
    let i = g.parameter(t(DType::I32, &[]));

    let c = add(&mut g, Op::Constant { literal: Literal::scalar(DType::F32, 1.5) });
    let v = add(&mut g, Op::Constant { literal: Literal::from_f64s(DType::F32, [3], &[1.0, -2.5, 1e-7]).unwrap() });
    add(&mut g, Op::Iota { ty: t(DType::I32, &[4, 2]), axis: 1 });
    for op in UnaryOp::ALL {
        let input = if op == UnaryOp::Not { idx } else { x };
        add(&mut g, Op::Unary { op, input });
    }
    for op in BinaryOp::ALL {
        let (lhs, rhs) = if op.is_logical() { (idx, idx) } else { (x, y) };
        add(&mut g, Op::Binary { op, lhs, rhs });
    }
    let mut pred = x;
    for dir in CompareDir::ALL {
        pred = add(&mut g, Op::Compare { dir, lhs: x, rhs: y });
    }
    add(&mut g, Op::Select { pred, on_true: x, on_false: y });
    add(&mut g, Op::Clamp { min: c, input: x, max: c });
    add(&mut g, Op::Convert { input: x, to: DType::BF16 });
    add(&mut g, Op::BroadcastInDim { input: v, shape: Shape::new([2, 3]), dims: vec![1] });
    add(&mut g, Op::Reshape { input: x, shape: Shape::new([3, 2]) });
    let xt = add(&mut g, Op::Transpose { input: x, perm: vec![1, 0] });
    add(&mut g, Op::Slice { input: x, start: vec![0, 1], limit: vec![2, 3], stride: vec![1, 2] });
    let ds = add(&mut g, Op::DynamicSlice { input: x, starts: vec![i, i], sizes: vec![1, 2] });
    add(&mut g, Op::DynamicUpdateSlice { input: x, update: ds, starts: vec![i, i] });
    add(&mut g, Op::Concatenate { inputs: vec![x, y, x], axis: 0 });
    add(&mut g, Op::Pad { input: x, value: c, low: vec![1, -1], high: vec![0, 2], interior: vec![1, 0] });
    for op in ReduceOp::ALL {
        add(&mut g, Op::Reduce { op, input: x, axes: vec![1] });
    }
    add(&mut g, Op::Reduce { op: ReduceOp::Sum, input: x, axes: vec![] });
    add(&mut g, Op::DotGeneral { lhs: x, rhs: xt, dims: DotDims::matmul() });
    let dims = DotDims { lhs_batch: vec![0], rhs_batch: vec![0], lhs_contract: vec![1], rhs_contract: vec![1] };
    add(&mut g, Op::DotGeneral { lhs: x, rhs: y, dims });
    let rows = add(&mut g, Op::Gather { operand: x, indices: idx, axis: 0 });
    add(&mut g, Op::ScatterAdd { operand: x, indices: idx, updates: rows, axis: 0 });
    let rng = g.add(Op::RngBitGenerator { algorithm: RngAlgorithm::ThreeFry, state, ty: t(DType::U32, &[4]) }).unwrap();
    g.add(Op::RngBitGenerator {
        algorithm: RngAlgorithm::Philox,
        state: ValueId::new(rng, 0),
        ty: t(DType::U64, &[2, 2]),
    })
    .unwrap();
    let barrier = g.add(Op::OptimizationBarrier { inputs: vec![x, ValueId::new(rng, 1)] }).unwrap();
    g.add(Op::OptimizationBarrier { inputs: vec![] }).unwrap();
    let host = add(&mut g, Op::Place { input: x, to: MemorySpace::PinnedHost });
    add(&mut g, Op::Place { input: host, to: MemorySpace::Device });
    add(&mut g, Op::Whole { input: x });
    for op in ReduceOp::ALL {
        add(&mut g, Op::AllReduce { op, input: x });
    }
    // A parameter after other nodes stays where it is.
    let late = g.parameter(t(DType::F32, &[2, 3]));
    let out = add(&mut g, Op::Binary { op: BinaryOp::Add, lhs: ValueId::new(barrier, 0), rhs: late });
    g.set_outputs(vec![out, ValueId::new(rng, 1), late]).unwrap();
    g.add_alias(Alias { param: 0, output: 0 }).unwrap();
    g.add_alias(Alias { param: 5, output: 2 }).unwrap();
    g
}

/// The composites (kept out of `every_op`, whose printed form is pinned above
/// them): attention and its backward, causal and not, scales that need every digit.
fn composites() -> Graph {
    let mut g = Graph::new();
    let ty = t(DType::BF16, &[2, 3, 5, 8]);
    let [q, k, v, dout] = [0; 4].map(|_| g.parameter(ty.clone()));
    let mut outs = Vec::new();
    for attrs in [AttentionAttrs::new(1.0 / 3f64.sqrt(), true), AttentionAttrs::new(0.125, false)] {
        let a = g.add(Op::Attention { q, k, v, bias: vec![], mask: None, attrs }).unwrap();
        let (out, stats) = (ValueId::new(a, 0), ValueId::new(a, 1));
        let gr = g.add(Op::AttentionGrad { q, k, v, bias: vec![], mask: None, out, stats, dout, attrs }).unwrap();
        outs.extend([out, stats, ValueId::new(gr, 2)]);
    }
    let x = g.parameter(t(DType::F32, &[4, 6]));
    let gb = g.parameter(t(DType::F32, &[6]));
    let ln = g.add(Op::LayerNorm { x, gamma: gb, beta: gb, eps_bits: 1e-5f64.to_bits() }).unwrap();
    let (mean, rstd) = (ValueId::new(ln, 1), ValueId::new(ln, 2));
    let lg = g.add(Op::LayerNormGrad { x, gamma: gb, mean, rstd, dy: ValueId::new(ln, 0) }).unwrap();
    outs.extend([ValueId::new(lg, 0), ValueId::new(lg, 1)]);
    let rn = g.add(Op::RmsNorm { x, gamma: gb, eps_bits: 1e-6f64.to_bits() }).unwrap();
    let rg = g.add(Op::RmsNormGrad { x, gamma: gb, rstd: ValueId::new(rn, 1), dy: ValueId::new(rn, 0) }).unwrap();
    outs.extend([ValueId::new(rn, 0), ValueId::new(rg, 1)]);
    let h = g.parameter(t(DType::BF16, &[6, 4]));
    let w = g.parameter(t(DType::BF16, &[10, 4]));
    let labels = g.parameter(t(DType::I32, &[6]));
    let ce = g.add(Op::LmHeadCrossEntropy { h, w, labels, chunk: 4, shards: 1 }).unwrap();
    let (nll, lse) = (ValueId::new(ce, 0), ValueId::new(ce, 1));
    let cg = g.add(Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll: nll, chunk: 4, shards: 2 }).unwrap();
    outs.extend([nll, ValueId::new(cg, 0), ValueId::new(cg, 1)]);
    let scale = g.parameter(t(DType::F32, &[]));
    let cf = g.add(Op::LmHeadCrossEntropyFused { h, w, labels, scale, chunk: 1, shards: 3 }).unwrap();
    outs.extend((0..4).map(|k| ValueId::new(cf, k)));
    // A trip to the host and back (kiln's host copies).
    let ty = t(DType::F32, &[4, 6]);
    let token = g.add(Op::HostCopy { inputs: vec![x], step: HostCopyStep::Out, slot: 7, ty: ty.clone() }).unwrap();
    let done = g
        .add(Op::HostCopy {
            inputs: vec![x, ValueId::new(token, 0), gb],
            step: HostCopyStep::OutDone,
            slot: 7,
            ty: ty.clone(),
        })
        .unwrap();
    let back = g
        .add(Op::HostCopy { inputs: vec![ValueId::new(done, 0)], step: HostCopyStep::In, slot: 7, ty: ty.clone() })
        .unwrap();
    let arrived = g
        .add(Op::HostCopy { inputs: vec![ValueId::new(back, 0), gb], step: HostCopyStep::InDone, slot: 7, ty })
        .unwrap();
    outs.push(ValueId::new(arrived, 0));
    // The general attention: grouped heads read tiled, k transposed, two
    // bias terms, a mask that drops where true with its own fill.
    let q = g.parameter(t(DType::F32, &[2, 4, 3, 8]));
    let kt = g.parameter(t(DType::F32, &[2, 2, 8, 5]));
    let v = g.parameter(t(DType::F32, &[2, 2, 5, 8]));
    let rel = g.parameter(t(DType::F32, &[1, 4, 3, 5]));
    let pad = g.parameter(t(DType::F32, &[2, 1, 1, 5]));
    let mask = g.parameter(t(DType::Pred, &[2, 1, 3, 5]));
    let dout = g.parameter(t(DType::F32, &[2, 4, 3, 8]));
    let mut attrs = AttentionAttrs::new(0.3, false).with_mask(-1e9, false);
    attrs.kv_heads = kiln_compiler::ir::KvHeads::Tiled;
    attrs.k_transposed = true;
    let bias = vec![rel, pad];
    let a = g.add(Op::Attention { q, k: kt, v, bias: bias.clone(), mask: Some(mask), attrs }).unwrap();
    let (out, stats) = (ValueId::new(a, 0), ValueId::new(a, 1));
    let gr = g.add(Op::AttentionGrad { q, k: kt, v, bias, mask: Some(mask), out, stats, dout, attrs }).unwrap();
    outs.extend([out, ValueId::new(gr, 1), ValueId::new(gr, 3), ValueId::new(gr, 4)]);
    g.set_outputs(outs).unwrap();
    g
}

#[test]
fn composites_round_trip_and_print() {
    let g = composites();
    verify(&g).unwrap();
    assert_round_trips(&g);
    insta::assert_snapshot!(print(&g));
}

#[test]
fn every_op_round_trips() {
    let g = every_op();
    verify(&g).unwrap();
    let mut seen = [false; VARIANTS];
    for (_, node) in g.nodes().chain(composites().nodes()) {
        seen[variant(&node.op)] = true;
    }
    assert!(seen.iter().all(|&s| s), "variants missing from every_op: {seen:?}");
    assert_round_trips(&g);
}

#[test]
fn every_op_prints() {
    insta::assert_snapshot!(print(&every_op()), @r"
        graph(%0: tensor<2x3xf32>, %1: tensor<2x3xf32>, %2: tensor<4xi32>, %3: tensor<2xui64>, %4: tensor<i32>) {
          %5 = constant dense<1.5> : tensor<f32>
          %6 = constant dense<[1.0, -2.5, 1e-7]> : tensor<3xf32>
          %7 = iota axis = 1 : tensor<4x2xi32>
          %8 = neg %0 : tensor<2x3xf32>
          %9 = abs %0 : tensor<2x3xf32>
          %10 = exp %0 : tensor<2x3xf32>
          %11 = log %0 : tensor<2x3xf32>
          %12 = log1p %0 : tensor<2x3xf32>
          %13 = expm1 %0 : tensor<2x3xf32>
          %14 = tanh %0 : tensor<2x3xf32>
          %15 = logistic %0 : tensor<2x3xf32>
          %16 = sqrt %0 : tensor<2x3xf32>
          %17 = rsqrt %0 : tensor<2x3xf32>
          %18 = sin %0 : tensor<2x3xf32>
          %19 = cos %0 : tensor<2x3xf32>
          %20 = floor %0 : tensor<2x3xf32>
          %21 = ceil %0 : tensor<2x3xf32>
          %22 = sign %0 : tensor<2x3xf32>
          %23 = not %2 : tensor<4xi32>
          %24 = erf %0 : tensor<2x3xf32>
          %25 = add %0, %1 : tensor<2x3xf32>
          %26 = sub %0, %1 : tensor<2x3xf32>
          %27 = mul %0, %1 : tensor<2x3xf32>
          %28 = div %0, %1 : tensor<2x3xf32>
          %29 = pow %0, %1 : tensor<2x3xf32>
          %30 = max %0, %1 : tensor<2x3xf32>
          %31 = min %0, %1 : tensor<2x3xf32>
          %32 = rem %0, %1 : tensor<2x3xf32>
          %33 = and %2, %2 : tensor<4xi32>
          %34 = or %2, %2 : tensor<4xi32>
          %35 = xor %2, %2 : tensor<4xi32>
          %36 = shift_right_logical %2, %2 : tensor<4xi32>
          %37 = compare EQ %0, %1 : tensor<2x3xi1>
          %38 = compare NE %0, %1 : tensor<2x3xi1>
          %39 = compare LT %0, %1 : tensor<2x3xi1>
          %40 = compare LE %0, %1 : tensor<2x3xi1>
          %41 = compare GT %0, %1 : tensor<2x3xi1>
          %42 = compare GE %0, %1 : tensor<2x3xi1>
          %43 = select %42, %0, %1 : tensor<2x3xf32>
          %44 = clamp %5, %0, %5 : tensor<2x3xf32>
          %45 = convert %0 : tensor<2x3xbf16>
          %46 = broadcast_in_dim %6, dims = [1] : tensor<2x3xf32>
          %47 = reshape %0 : tensor<3x2xf32>
          %48 = transpose %0, perm = [1, 0] : tensor<3x2xf32>
          %49 = slice %0, start = [0, 1], limit = [2, 3], stride = [1, 2] : tensor<2x1xf32>
          %50 = dynamic_slice %0, %4, %4 : tensor<1x2xf32>
          %51 = dynamic_update_slice %0, %50, %4, %4 : tensor<2x3xf32>
          %52 = concatenate %0, %1, %0, axis = 0 : tensor<6x3xf32>
          %53 = pad %0, %5, low = [1, -1], high = [0, 2], interior = [1, 0] : tensor<4x4xf32>
          %54 = reduce sum %0, axes = [1] : tensor<2xf32>
          %55 = reduce max %0, axes = [1] : tensor<2xf32>
          %56 = reduce min %0, axes = [1] : tensor<2xf32>
          %57 = reduce prod %0, axes = [1] : tensor<2xf32>
          %58 = reduce sum %0, axes = [] : tensor<2x3xf32>
          %59 = dot_general %0, %48, batch = [] x [], contract = [1] x [0] : tensor<2x2xf32>
          %60 = dot_general %0, %1, batch = [0] x [0], contract = [1] x [1] : tensor<2xf32>
          %61 = gather %0, %2, axis = 0 : tensor<4x3xf32>
          %62 = scatter_add %0, %2, %61, axis = 0 : tensor<2x3xf32>
          %63:2 = rng_bit_generator THREE_FRY %3 : (tensor<2xui64>, tensor<4xui32>)
          %64:2 = rng_bit_generator PHILOX %63 : (tensor<2xui64>, tensor<2x2xui64>)
          %65:2 = optimization_barrier %0, %63#1 : (tensor<2x3xf32>, tensor<4xui32>)
          %66:0 = optimization_barrier : ()
          %67 = place pinned_host %0 : tensor<2x3xf32>
          %68 = place device %67 : tensor<2x3xf32>
          %69 = whole %0 : tensor<2x3xf32>
          %70 = all_reduce sum %0 : tensor<2x3xf32>
          %71 = all_reduce max %0 : tensor<2x3xf32>
          %72 = all_reduce min %0 : tensor<2x3xf32>
          %73 = all_reduce prod %0 : tensor<2x3xf32>
          %74 = parameter 5 : tensor<2x3xf32>
          %75 = add %65, %74 : tensor<2x3xf32>
          return %75, %63#1, %74 {aliases = [0 -> 0, 5 -> 2]}
        }
    ");
}

/// One constant per dtype, splat and not, holding the values a printer is most
/// likely to get wrong.
#[test]
fn awkward_constants_round_trip_bit_exactly() {
    let f32_bits = [
        0.1f32.to_bits(),
        (-0.0f32).to_bits(),
        f32::INFINITY.to_bits(),
        f32::NEG_INFINITY.to_bits(),
        f32::NAN.to_bits(),
        0x7fc0_0001, // NaN with a payload
        0xffc0_0000, // negative NaN
        1,           // smallest subnormal
        f32::MAX.to_bits(),
        16_777_217.0f32.to_bits(), // 2^24 + 1 rounds to 2^24
    ];
    let f64_bits = [0.1f64.to_bits(), f64::MIN_POSITIVE.to_bits(), 0x7ff8_0000_0000_0001, f64::NAN.to_bits(), 1];
    let f16_bits = [f16::from_f32(0.1).to_bits(), f16::NAN.to_bits(), 0x7e01, 1, f16::MAX.to_bits(), 0x8000];
    let bf16_bits = [bf16::from_f32(0.1).to_bits(), bf16::NAN.to_bits(), 0xffc1, 1, bf16::MIN.to_bits()];
    let lits = [
        (t(DType::F32, &[f32_bits.len()]), f32_bits.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>()),
        (t(DType::F64, &[f64_bits.len()]), f64_bits.iter().flat_map(|b| b.to_le_bytes()).collect()),
        (t(DType::F16, &[f16_bits.len()]), f16_bits.iter().flat_map(|b| b.to_le_bytes()).collect()),
        (t(DType::BF16, &[bf16_bits.len()]), bf16_bits.iter().flat_map(|b| b.to_le_bytes()).collect()),
        (t(DType::I64, &[3]), [i64::MIN, i64::MAX, (1 << 53) + 1].iter().flat_map(|b| b.to_le_bytes()).collect()),
        (t(DType::I32, &[2]), [i32::MIN, -1].iter().flat_map(|b| b.to_le_bytes()).collect()),
        (t(DType::I8, &[2]), vec![0x80, 0x7f]),
        (t(DType::U8, &[2]), vec![0, 255]),
        (t(DType::U32, &[1, 2]), [u32::MAX, 7].iter().flat_map(|b| b.to_le_bytes()).collect()),
        (t(DType::Pred, &[2, 2]), vec![1, 0, 0, 1]),
        (t(DType::Pred, &[3]), vec![1, 1, 1]),
        (t(DType::F32, &[2, 2]), [f32::NAN; 4].iter().flat_map(|b| b.to_le_bytes()).collect()),
        (t(DType::F16, &[0, 3]), vec![]),
    ];
    let mut g = Graph::new();
    for (ty, bytes) in lits {
        add(&mut g, Op::Constant { literal: Literal::from_bytes(ty, bytes).unwrap() });
    }
    insta::assert_snapshot!(print(&g), @r"
        graph() {
          %0 = constant dense<[0.1, -0.0, inf, -inf, nan, 0x7fc00001, 0xffc00000, 1e-45, 3.4028235e38, 16777216.0]> : tensor<10xf32>
          %1 = constant dense<[0.1, 2.2250738585072014e-308, 0x7ff8000000000001, nan, 5e-324]> : tensor<5xf64>
          %2 = constant dense<[0.099975586, nan, 0x7e01, 5.9604645e-8, 65504.0, -0.0]> : tensor<6xf16>
          %3 = constant dense<[0.100097656, nan, 0xffc1, 9.1835e-41, -3.3895314e38]> : tensor<5xbf16>
          %4 = constant dense<[-9223372036854775808, 9223372036854775807, 9007199254740993]> : tensor<3xi64>
          %5 = constant dense<[-2147483648, -1]> : tensor<2xi32>
          %6 = constant dense<[-128, 127]> : tensor<2xi8>
          %7 = constant dense<[0, 255]> : tensor<2xui8>
          %8 = constant dense<[4294967295, 7]> : tensor<1x2xui32>
          %9 = constant dense<[true, false, false, true]> : tensor<2x2xi1>
          %10 = constant dense<true> : tensor<3xi1>
          %11 = constant dense<nan> : tensor<2x2xf32>
          %12 = constant dense<[]> : tensor<0x3xf16>
          return
        }
    ");
    assert_round_trips(&g);
}

#[test]
fn parser_renumbers_names_densely() {
    let text = "
        // Any names, in any order, as long as each is defined before its use.
        graph(%x: tensor<2xf32>, %w: tensor<2xf32>) {
          %sum = add %x, %w : tensor<2xf32>
          %7 = exp %sum : tensor<2xf32>   // a trailing comment
          %s:2 = optimization_barrier %7, %sum : (tensor<2xf32>, tensor<2xf32>)
          return %s#1, %s
        }";
    let g = parse(text).unwrap();
    insta::assert_snapshot!(print(&g), @r"
        graph(%0: tensor<2xf32>, %1: tensor<2xf32>) {
          %2 = add %0, %1 : tensor<2xf32>
          %3 = exp %2 : tensor<2xf32>
          %4:2 = optimization_barrier %3, %2 : (tensor<2xf32>, tensor<2xf32>)
          return %4#1, %4
        }
    ");
}

#[test]
fn empty_graph_round_trips() {
    let g = Graph::new();
    insta::assert_snapshot!(print(&g), @r"
        graph() {
          return
        }
    ");
    assert_round_trips(&g);
}

#[test]
fn splat_constants_fill_their_type() {
    let g = parse("graph() {\n  %c = constant dense<2> : tensor<2x2xi32>\n  return %c\n}").unwrap();
    let (_, node) = g.nodes().next().unwrap();
    assert_eq!(node.op, Op::Constant { literal: Literal::from_f64s(DType::I32, [2, 2], &[2.0; 4]).unwrap() });
}

/// Parses `text` and returns the line and reason of its error.
fn parse_error(text: &str) -> (usize, String) {
    match parse(text) {
        Err(CompileError::Parse { line, reason }) => (line, reason),
        other => panic!("expected a parse error, got {other:?}"),
    }
}

#[test]
fn parse_errors_name_their_line() {
    let head = "graph(%0: tensor<2xf32>, %1: tensor<3xf32>) {\n";
    let cases: &[(&str, usize, &str)] = &[
        ("", 1, "empty input"),
        ("grph() {", 1, "expected `graph`"),
        ("graph(%0: tensor<2xf33>) {", 1, "unknown element type `f33`"),
        ("graph(%0: tensor<2xf32>, %0: tensor<2xf32>) {", 1, "%0 is defined twice"),
        ("  %2 = frobnicate %0 : tensor<2xf32>", 2, "unknown op `frobnicate`"),
        ("  %2 = exp %9 : tensor<2xf32>", 2, "undefined value %9"),
        ("  %2 = exp %0#1 : tensor<2xf32>", 2, "%0 has 1 result(s)"),
        ("  %2 exp %0 : tensor<2xf32>", 2, "expected `=`"),
        ("  %2 = exp %0", 2, "expected `:`"),
        ("  %2 = exp %0 : tensor<2xf32> junk", 2, "unexpected `junk`"),
        ("  %2 = add %0, %1 : tensor<2xf32>", 2, "add: shapes [2] and [3] do not match"),
        ("  %2 = exp %0 : tensor<3xf32>", 2, "written type tensor<3xf32> but `exp` infers tensor<2xf32>"),
        ("  %2 = reduce avg %0, axes = [0] : tensor<f32>", 2, "unknown reduction `avg`"),
        ("  %2 = transpose %0, perm = [0 : tensor<2xf32>", 2, "expected `,`"),
        ("  %2 = constant dense<[1.0]> : tensor<2xf32>", 2, "`dense` has 1 values but tensor<2xf32> has 2 elements"),
        (
            "  %2 = constant dense<[1, 2, 3]> : tensor<2xf32>",
            2,
            "`dense` has more than 2 values, the element count of tensor<2xf32>",
        ),
        ("  %2 = constant dense<[]> : tensor<2xf32>", 2, "`dense` has 0 values but tensor<2xf32> has 2 elements"),
        ("  %2 = constant dense<[1, x]> : tensor<2xf32>", 2, "`x` is not a valid f32 value"),
        ("  %2 = constant dense<1.0.0> : tensor<f32>", 2, "`1.0.0` is not a valid f32 value"),
        ("  %2 = constant dense<NaN> : tensor<f32>", 2, "`NaN` is not a valid f32 value"),
        ("  %2 = constant dense<300> : tensor<ui8>", 2, "`300` is not a valid ui8 value"),
        ("  %2 = constant dense<0> : tensor<65536x65536xi32>", 2, "exceeds 1073741824 bytes"),
        ("  %2 = reshape %0 : tensor<4294967296x4294967296xf32>", 2, "is too large"),
        ("  %2 = constant dense<1.0> : tensor<2xf32", 2, "missing `>`"),
        ("  %2 = constant dense<0x1ffff> : tensor<f16>", 2, "`0x1ffff` is not a valid f16 value"),
        ("  %2:2 = rng_bit_generator PHILOX %0 : (tensor<2xf32>, tensor<2xf32>)", 2, "state must be ui64"),
        ("  %2 = compare XX %0, %0 : tensor<2xi1>", 2, "unknown comparison direction `XX`"),
        ("  %2 = dot_general %0, %0, batch = [] y [], contract = [0] x [0] : tensor<f32>", 2, "expected `x`"),
        ("  %2 = \u{e9}xp %0 : tensor<2xf32>", 2, "expected an identifier"),
        ("  %2:2 = exp %0 : tensor<2xf32>", 2, "2 result(s) declared but 1 type(s) written"),
        ("  %0 = exp %0 : tensor<2xf32>", 2, "%0 is defined twice"),
        ("  %2 = parameter 0 : tensor<f32>", 2, "parameter 0 added out of order"),
        ("  return %0, %0 {aliases = [0 -> 0, 0 -> 1]}\n}", 2, "parameter or output aliased twice"),
        ("  return %1 {aliases = [0 -> 0]}\n}", 2, "types differ"),
        ("  return %0\n}\n%3 = exp %0", 4, "after the graph's closing `}`"),
        ("  return %0\n  %3 = exp %0", 3, "expected `}` after `return`"),
        ("  %2 = exp %0 : tensor<2xf32>\n", 2, "expected `return`"),
    ];
    for &(body, line, needle) in cases {
        // Cases that start at the header stand alone; the others follow `head`.
        let text = if body.is_empty() || !body.starts_with(' ') { body.to_string() } else { format!("{head}{body}") };
        let (at, reason) = parse_error(&text);
        assert!(reason.contains(needle), "{text:?}: reason {reason:?} lacks {needle:?}");
        assert_eq!(at, line, "{text:?}: {reason}");
    }
}

/// The LM-head composite's `shards` must divide its rows: a typed error
/// naming the op and the counts.
#[test]
fn lm_head_shards_that_do_not_divide_the_rows_are_refused() {
    let text = "graph(%0: tensor<6x4xf32>, %1: tensor<10x4xf32>, %2: tensor<6xi32>) {\n  \
                %3:2 = lm_head_cross_entropy %0, %1, %2, chunk = 2, shards = 4 : (tensor<6xf32>, tensor<6xf32>)\n  \
                return %3\n}\n";
    let (line, reason) = parse_error(text);
    assert_eq!(line, 2, "{reason}");
    assert!(
        reason.contains("lm_head_cross_entropy") && reason.contains("shards (4) must be >= 1 and divide the 6 rows"),
        "{reason}"
    );
    let ok = text.replace("shards = 4", "shards = 3");
    assert_eq!(parse(&ok).unwrap().len(), 4);
}

/// One step of a random program; operands pick among the values built so far.
#[derive(Clone, Debug)]
enum Step {
    Param(DType, Vec<usize>),
    Const(DType, Vec<usize>, Vec<u64>),
    Unary(usize, usize),
    Binary(usize, usize, usize),
    Compare(usize, usize),
    Broadcast(usize, usize),
    Reduce(usize, usize, u8),
    Transpose(usize, usize),
    Reshape(usize),
    Convert(usize, DType),
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::F32, DType::F16, DType::BF16, DType::F64, DType::I32, DType::I64, DType::Pred])
}

fn dims() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..4, 0..3)
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (dtype(), dims()).prop_map(|(d, s)| Step::Param(d, s)),
        (dtype(), dims(), prop::collection::vec(any::<u64>(), 9)).prop_map(|(d, s, b)| Step::Const(d, s, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(o, a)| Step::Unary(o, a)),
        (any::<usize>(), any::<usize>(), any::<usize>()).prop_map(|(o, a, b)| Step::Binary(o, a, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(d, a)| Step::Compare(d, a)),
        (any::<usize>(), 1usize..4).prop_map(|(a, n)| Step::Broadcast(a, n)),
        (any::<usize>(), any::<usize>(), any::<u8>()).prop_map(|(o, a, m)| Step::Reduce(o, a, m)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, r)| Step::Transpose(a, r)),
        any::<usize>().prop_map(Step::Reshape),
        (any::<usize>(), dtype()).prop_map(|(a, d)| Step::Convert(a, d)),
    ]
}

/// Builds a graph from `steps`, skipping steps that do not type-check (so every
/// graph is valid by construction) and returning the last three values.
fn build(steps: &[Step]) -> Graph {
    let mut g = Graph::new();
    let mut vals: Vec<ValueId> = Vec::new();
    for s in steps {
        let pick = |i: usize| vals.get(i % vals.len().max(1)).copied();
        let op = match s.clone() {
            Step::Param(d, dims) => {
                vals.push(g.parameter(t(d, &dims)));
                continue;
            }
            Step::Const(d, dims, bits) => {
                let ty = t(d, &dims);
                let w = d.size_in_bytes();
                let bytes: Vec<u8> = (0..ty.shape.num_elements())
                    .flat_map(|k| {
                        // Pred holds 0 or 1 only; other types take arbitrary bits (NaNs included).
                        let b = if d == DType::Pred { bits[k] & 1 } else { bits[k] };
                        b.to_le_bytes().into_iter().take(w)
                    })
                    .collect();
                Op::Constant { literal: Literal::from_bytes(ty, bytes).unwrap() }
            }
            Step::Unary(o, a) => match pick(a) {
                Some(input) => Op::Unary { op: UnaryOp::ALL[o % UnaryOp::ALL.len()], input },
                None => continue,
            },
            Step::Binary(o, a, b) => {
                let Some(lhs) = pick(a) else { continue };
                let same: Vec<ValueId> = vals.iter().copied().filter(|&v| g.ty(v) == g.ty(lhs)).collect();
                Op::Binary { op: BinaryOp::ALL[o % BinaryOp::ALL.len()], lhs, rhs: same[b % same.len()] }
            }
            Step::Compare(d, a) => match pick(a) {
                Some(v) => Op::Compare { dir: CompareDir::ALL[d % CompareDir::ALL.len()], lhs: v, rhs: v },
                None => continue,
            },
            Step::Broadcast(a, n) => {
                let Some(input) = pick(a) else { continue };
                let ty = g.ty(input);
                let shape = Shape::new([&[n][..], ty.shape.dims()].concat());
                Op::BroadcastInDim { input, shape, dims: (1..=ty.shape.rank()).collect() }
            }
            Step::Reduce(o, a, mask) => {
                let Some(input) = pick(a) else { continue };
                let axes = (0..g.ty(input).shape.rank()).filter(|i| mask >> i & 1 == 1).collect();
                Op::Reduce { op: ReduceOp::ALL[o % ReduceOp::ALL.len()], input, axes }
            }
            Step::Transpose(a, r) => {
                let Some(input) = pick(a) else { continue };
                let rank = g.ty(input).shape.rank();
                Op::Transpose { input, perm: (0..rank).map(|i| (i + r) % rank.max(1)).collect() }
            }
            Step::Reshape(a) => {
                let Some(input) = pick(a) else { continue };
                Op::Reshape { input, shape: Shape::new([g.ty(input).shape.num_elements()]) }
            }
            Step::Convert(a, to) => match pick(a) {
                Some(input) => Op::Convert { input, to },
                None => continue,
            },
        };
        if let Ok(v) = g.value(op) {
            vals.push(v);
        }
    }
    let outs = vals.iter().rev().take(3).copied().collect();
    g.set_outputs(outs).unwrap();
    g
}

proptest! {
    #[test]
    fn random_graphs_round_trip(steps in prop::collection::vec(step(), 1..40)) {
        let g = build(&steps);
        verify(&g).unwrap();
        let text = print(&g);
        let back = parse(&text).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(print(&back), text);
        assert_same_graph(&g, &back);
    }
}

proptest! {
    /// The parser's input is user input: damaged text is an error, never a panic.
    #[test]
    fn damaged_text_never_panics(
        at in prop::collection::vec((any::<prop::sample::Index>(), prop::sample::select(vec!['%', '#', ':', ',', '[', ']', '<', '>', 'x', '9', '-', ' ', '\n', 'é'])), 1..4),
        delete in any::<bool>(),
    ) {
        let mut text: Vec<char> = print(&every_op()).chars().collect();
        for (i, ch) in at {
            let i = i.index(text.len());
            if delete { text.remove(i); } else { text[i] = ch; }
        }
        let text: String = text.into_iter().collect();
        if let Ok(g) = parse(&text) {
            verify(&g).unwrap();
        }
    }
}
