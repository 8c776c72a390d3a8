//! The optimizer against the reference interpreter: on random well-typed
//! graphs built to give every rule set something to match, the optimized
//! graph verifies and computes what the original computes (fresh random
//! inputs each case); `Op -> e-node -> Op` is lossless; and golden tests show
//! what each rule set does to a small graph.

use kiln_compiler::ir::{BinaryOp, DType, DotDims, Graph, Literal, Op, ReduceOp, Shape, TensorType, UnaryOp, ValueId};
use kiln_compiler::pipeline::{run, PipelineOptions};
use kiln_compiler::rewrite::{enode, holed, rewrite, to_op, RewriteOptions, RULE_SETS};
use kiln_compiler::text::{parse, print};
use kiln_compiler::{interpret, verify};
use proptest::prelude::*;

/// One step of a random program; operands pick among the values built so far.
#[derive(Clone, Debug)]
enum Step {
    Param(u8),
    Unary(usize, usize),
    Binary(usize, usize, usize),
    ByConst(usize, u8, bool),
    NegNeg(usize),
    SelectSame(usize, usize),
    Transpose(usize, usize),
    Reshape(usize, bool),
    Broadcast(usize, usize),
    Convert(usize, u8),
    Dot(usize, usize, bool, bool),
    Reduce(usize, u8),
    Folded(u8, u8),
}

const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        any::<u8>().prop_map(Step::Param),
        (any::<usize>(), any::<usize>()).prop_map(|(o, a)| Step::Unary(o, a)),
        (any::<usize>(), any::<usize>(), any::<usize>()).prop_map(|(o, a, b)| Step::Binary(o, a, b)),
        (any::<usize>(), any::<u8>(), any::<bool>()).prop_map(|(a, k, l)| Step::ByConst(a, k, l)),
        any::<usize>().prop_map(Step::NegNeg),
        (any::<usize>(), any::<usize>()).prop_map(|(p, a)| Step::SelectSame(p, a)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, r)| Step::Transpose(a, r)),
        (any::<usize>(), any::<bool>()).prop_map(|(a, f)| Step::Reshape(a, f)),
        (any::<usize>(), 1usize..3).prop_map(|(a, n)| Step::Broadcast(a, n)),
        (any::<usize>(), any::<u8>()).prop_map(|(a, d)| Step::Convert(a, d)),
        (any::<usize>(), any::<usize>(), any::<bool>(), any::<bool>()).prop_map(|(a, b, x, y)| Step::Dot(a, b, x, y)),
        (any::<usize>(), any::<u8>()).prop_map(|(a, m)| Step::Reduce(a, m)),
        (any::<u8>(), any::<u8>()).prop_map(|(x, y)| Step::Folded(x, y)),
    ]
}

fn scalar_bcast(g: &mut Graph, ty: &TensorType, v: f64) -> ValueId {
    let c = g.value(Op::Constant { literal: Literal::scalar(ty.dtype, v) }).unwrap();
    g.value(Op::BroadcastInDim { input: c, shape: ty.shape.clone(), dims: vec![] }).unwrap()
}

/// Builds a graph from `steps`, skipping steps that do not type-check, and
/// returns it with the last three values as outputs.
fn build(steps: &[Step]) -> Graph {
    let mut g = Graph::new();
    let shapes: [&[usize]; 4] = [&[2, 3], &[3, 2], &[2, 3, 2], &[3]];
    let mut vals: Vec<ValueId> = vec![g.parameter(TensorType::new(DType::F32, [2, 3]))];
    for s in steps {
        let pick = |i: usize| vals[i % vals.len()];
        let op = match s.clone() {
            Step::Param(k) => {
                let d = DTYPES[k as usize % DTYPES.len()];
                vals.push(g.parameter(TensorType::new(d, shapes[(k as usize / 4) % shapes.len()])));
                continue;
            }
            Step::Unary(o, a) => {
                let ops = [UnaryOp::Neg, UnaryOp::Exp, UnaryOp::Tanh, UnaryOp::Abs, UnaryOp::Logistic];
                Op::Unary { op: ops[o % ops.len()], input: pick(a) }
            }
            Step::Binary(o, a, b) => {
                let lhs = pick(a);
                let same: Vec<ValueId> = vals.iter().copied().filter(|&v| g.ty(v) == g.ty(lhs)).collect();
                let ops = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max];
                Op::Binary { op: ops[o % ops.len()], lhs, rhs: same[b % same.len()] }
            }
            Step::ByConst(a, k, left) => {
                // x op c for the identities' constants (and a few that are not).
                let x = pick(a);
                let ty = g.ty(x).clone();
                let (op, c) = [
                    (BinaryOp::Mul, 1.0),
                    (BinaryOp::Div, 1.0),
                    (BinaryOp::Sub, 0.0),
                    (BinaryOp::Add, -0.0),
                    (BinaryOp::Add, 0.0),
                    (BinaryOp::Sub, -0.0),
                    (BinaryOp::Mul, 2.0),
                ][k as usize % 7];
                let c = scalar_bcast(&mut g, &ty, c);
                let (lhs, rhs) = if left { (c, x) } else { (x, c) };
                Op::Binary { op, lhs, rhs }
            }
            Step::NegNeg(a) => {
                let n = g.value(Op::Unary { op: UnaryOp::Neg, input: pick(a) }).unwrap();
                Op::Unary { op: UnaryOp::Neg, input: n }
            }
            Step::SelectSame(p, a) => {
                let x = pick(a);
                let y = pick(p);
                let ty = g.ty(x).clone();
                if g.ty(y) != &ty {
                    continue;
                }
                let pred = g.value(Op::Compare { dir: kiln_compiler::ir::CompareDir::Lt, lhs: y, rhs: x }).unwrap();
                let _ = ty;
                Op::Select { pred, on_true: x, on_false: x }
            }
            Step::Transpose(a, r) => {
                let input = pick(a);
                let rank = g.ty(input).shape.rank();
                let perm: Vec<usize> = (0..rank).map(|i| (i + r) % rank.max(1)).collect();
                let t = g.value(Op::Transpose { input, perm: perm.clone() }).unwrap();
                if r % 2 == 0 {
                    vals.push(t);
                    continue;
                }
                Op::Transpose {
                    input: t,
                    perm: (0..rank).map(|i| (i + rank - r % rank.max(1)) % rank.max(1)).collect(),
                }
            }
            Step::Reshape(a, twice) => {
                let input = pick(a);
                let n = g.ty(input).shape.num_elements();
                if twice {
                    let flat = g.value(Op::Reshape { input, shape: Shape::new([n]) }).unwrap();
                    Op::Reshape { input: flat, shape: g.ty(input).shape.clone() }
                } else {
                    Op::Reshape { input, shape: Shape::new([n]) }
                }
            }
            Step::Broadcast(a, n) => {
                let input = pick(a);
                let ty = g.ty(input).clone();
                if ty.shape.rank() > 2 {
                    continue;
                }
                let shape = Shape::new([&[n][..], ty.shape.dims()].concat());
                let b = g
                    .value(Op::BroadcastInDim { input, shape: shape.clone(), dims: (1..=ty.shape.rank()).collect() })
                    .unwrap();
                let outer = Shape::new([&[2][..], shape.dims()].concat());
                Op::BroadcastInDim { input: b, shape: outer, dims: (1..=shape.rank()).collect() }
            }
            Step::Convert(a, d) => {
                let input = pick(a);
                let to = DTYPES[d as usize % DTYPES.len()];
                let from = g.ty(input).dtype;
                if d % 2 == 0 {
                    let c = g.value(Op::Convert { input, to }).unwrap();
                    Op::Convert { input: c, to: from }
                } else {
                    Op::Convert { input, to }
                }
            }
            Step::Dot(a, b, tl, tr) => {
                // [2,3] x [3,2] style matmuls with optional transposes on either side.
                let (l, r) = (pick(a), pick(b));
                let (lt, rt) = (g.ty(l).clone(), g.ty(r).clone());
                if lt.shape.rank() != 2 || rt.shape.rank() != 2 || lt.dtype != rt.dtype {
                    continue;
                }
                let l = if tl { g.value(Op::Transpose { input: l, perm: vec![1, 0] }).unwrap() } else { l };
                let r = if tr { g.value(Op::Transpose { input: r, perm: vec![1, 0] }).unwrap() } else { r };
                Op::DotGeneral { lhs: l, rhs: r, dims: DotDims::matmul() }
            }
            Step::Reduce(a, m) => {
                let input = pick(a);
                let axes = (0..g.ty(input).shape.rank()).filter(|i| m >> i & 1 == 1).collect();
                Op::Reduce { op: ReduceOp::ALL[m as usize % 2], input, axes }
            }
            Step::Folded(x, y) => {
                // (x + y) * 3 on small f32 constants: folds to one constant.
                let cx = g
                    .value(Op::Constant {
                        literal: Literal::from_f64s(DType::F32, [3], &[f64::from(x) / 7.0, 1.5, -2.0]).unwrap(),
                    })
                    .unwrap();
                let cy = g
                    .value(Op::Constant {
                        literal: Literal::from_f64s(DType::F32, [3], &[f64::from(y) / 3.0, 0.1, 8.0]).unwrap(),
                    })
                    .unwrap();
                let s = g.value(Op::Binary { op: BinaryOp::Add, lhs: cx, rhs: cy }).unwrap();
                let three =
                    g.value(Op::Constant { literal: Literal::from_f64s(DType::F32, [3], &[3.0; 3]).unwrap() }).unwrap();
                Op::Binary { op: BinaryOp::Mul, lhs: s, rhs: three }
            }
        };
        if let Ok(v) = g.value(op) {
            vals.push(v);
        }
    }
    let outs = vals.iter().rev().take(3).copied().collect();
    g.set_outputs(outs).unwrap();
    g
}

/// Random inputs for `g`'s parameters: floats in [-2, 2), never all zeros.
fn inputs(g: &Graph, seed: u64) -> Vec<Literal> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
    };
    g.param_types()
        .iter()
        .map(|t| {
            let vals: Vec<f64> = (0..t.shape.num_elements()).map(|_| next()).collect();
            Literal::from_f64s(t.dtype, t.shape.clone(), &vals).unwrap()
        })
        .collect()
}

/// Equal bit for bit, except that dots may differ in the last place of their
/// dtype (the interpreter sums in f64 in its own loop order): relative 1e-6
/// for f32/f64 and 1e-2 for 16-bit floats; NaNs must match NaNs.
fn assert_close(a: &[Literal], b: &[Literal], what: &str) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.ty(), y.ty(), "{what}");
        if x == y {
            continue;
        }
        let tol = match x.ty().dtype {
            DType::F16 | DType::BF16 => 1e-2,
            _ => 1e-6,
        };
        for (p, q) in x.to_f64s().iter().zip(y.to_f64s()) {
            let ok = (p.is_nan() && q.is_nan()) || p == &q || (p - q).abs() <= tol * p.abs().max(q.abs()).max(1e-30);
            assert!(ok, "{what}: {p} vs {q}");
        }
    }
}

fn checked(opts: PipelineOptions) -> PipelineOptions {
    PipelineOptions { verify: true, prune_params: false, ..opts }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// The whole pipeline keeps the program's values.
    #[test]
    fn the_pipeline_keeps_values(steps in prop::collection::vec(step(), 1..30), seed in any::<u64>()) {
        let g = build(&steps);
        verify(&g).unwrap();
        let out = run(&g, &checked(PipelineOptions::default()), &mut |_, _| {}).unwrap();
        let x = inputs(&g, seed);
        let want = interpret(&g, &x).unwrap();
        let got = interpret(&out.graph, &x).unwrap();
        assert_close(&want, &got, &print(&g));
        prop_assert!(out.graph.len() <= g.len());
    }

    /// Each rule set alone keeps the program's values.
    #[test]
    fn each_rule_set_keeps_values(steps in prop::collection::vec(step(), 1..30), seed in any::<u64>()) {
        let g = build(&steps);
        let x = inputs(&g, seed);
        let want = interpret(&g, &x).unwrap();
        for (name, _) in RULE_SETS {
            let opts = RewriteOptions { rule_sets: Some(vec![name.to_string()]), ..RewriteOptions::default() };
            let out = rewrite(&g, &opts).unwrap();
            verify(&out.graph).unwrap();
            assert_close(&want, &interpret(&out.graph, &x).unwrap(), name);
        }
    }

    /// `Op -> e-node -> Op` gives back the op, operands and attributes alike;
    /// and the e-graph without rules extracts the graph CSE and DCE would give.
    #[test]
    fn ops_round_trip_through_e_nodes(steps in prop::collection::vec(step(), 1..30), seed in any::<u64>()) {
        let g = build(&steps);
        for (_, node) in g.nodes() {
            let inputs = node.op.inputs();
            let children: Vec<egg::Id> = (0..inputs.len()).map(egg::Id::from).collect();
            let kiln_compiler::rewrite::TensorLang::Op { op, children: kids, .. } = enode(&node.op, children.clone(), 7) else {
                panic!("an op became a projection");
            };
            prop_assert_eq!(&kids, &children);
            prop_assert_eq!(&op, &holed(&node.op));
            prop_assert_eq!(to_op(&op, &inputs).unwrap(), node.op.clone());
        }
        let none = RewriteOptions { rule_sets: Some(vec![]), ..RewriteOptions::default() };
        let out = rewrite(&g, &none).unwrap();
        let reference = run(&g, &checked(PipelineOptions { passes: vec!["cse".into(), "dce".into()], ..PipelineOptions::default() }), &mut |_, _| {}).unwrap();
        prop_assert_eq!(out.graph.len(), reference.graph.len());
        let x = inputs(&g, seed);
        prop_assert_eq!(interpret(&g, &x).unwrap(), interpret(&out.graph, &x).unwrap());
    }
}

/// Runs one rule set on `text` and prints the result.
fn golden(rule_set: &str, text: &str) -> String {
    let g = parse(text).unwrap();
    let opts = RewriteOptions { rule_sets: Some(vec![rule_set.to_string()]), ..RewriteOptions::default() };
    let out = rewrite(&g, &opts).unwrap();
    verify(&out.graph).unwrap();
    print(&out.graph)
}

#[test]
fn golden_identities() {
    let out = golden(
        "identities",
        "graph(%0: tensor<2x3xf32>, %1: tensor<2x3xi32>) {
  %2 = constant dense<1.0> : tensor<f32>
  %3 = broadcast_in_dim %2, dims = [] : tensor<2x3xf32>
  %4 = mul %3, %0 : tensor<2x3xf32>
  %5 = constant dense<0.0> : tensor<f32>
  %6 = broadcast_in_dim %5, dims = [] : tensor<2x3xf32>
  %7 = add %4, %6 : tensor<2x3xf32>
  %8 = sub %7, %6 : tensor<2x3xf32>
  %9 = neg %8 : tensor<2x3xf32>
  %10 = neg %9 : tensor<2x3xf32>
  %11 = constant dense<0> : tensor<2x3xi32>
  %12 = add %1, %11 : tensor<2x3xi32>
  %13 = reshape %12 : tensor<2x3xi32>
  return %10, %13
}",
    );
    // x + (+0) stays for floats (-0 + +0 = +0); the rest goes.
    insta::assert_snapshot!(out, @r"
    graph(%0: tensor<2x3xf32>, %1: tensor<2x3xi32>) {
      %2 = constant dense<0.0> : tensor<f32>
      %3 = broadcast_in_dim %2, dims = [] : tensor<2x3xf32>
      %4 = add %0, %3 : tensor<2x3xf32>
      return %4, %1
    }
    ");
}

#[test]
fn golden_layout() {
    let out = golden(
        "layout",
        "graph(%0: tensor<2x3x4xf32>, %1: tensor<4x5xf32>, %2: tensor<f32>) {
  %3 = transpose %0, perm = [2, 0, 1] : tensor<4x2x3xf32>
  %4 = transpose %3, perm = [0, 2, 1] : tensor<4x3x2xf32>
  %5 = reshape %0 : tensor<6x4xf32>
  %6 = reshape %5 : tensor<24xf32>
  %7 = transpose %1, perm = [1, 0] : tensor<5x4xf32>
  %8 = dot_general %5, %7, batch = [] x [], contract = [1] x [1] : tensor<6x5xf32>
  %9 = broadcast_in_dim %2, dims = [] : tensor<3xf32>
  %10 = broadcast_in_dim %9, dims = [1] : tensor<2x3xf32>
  return %4, %6, %8, %10
}",
    );
    insta::assert_snapshot!(out, @r"
    graph(%0: tensor<2x3x4xf32>, %1: tensor<4x5xf32>, %2: tensor<f32>) {
      %3 = transpose %0, perm = [2, 1, 0] : tensor<4x3x2xf32>
      %4 = reshape %0 : tensor<24xf32>
      %5 = reshape %0 : tensor<6x4xf32>
      %6 = dot_general %5, %1, batch = [] x [], contract = [1] x [0] : tensor<6x5xf32>
      %7 = broadcast_in_dim %2, dims = [] : tensor<2x3xf32>
      return %3, %4, %6, %7
    }
    ");
}

#[test]
fn golden_convert() {
    let out = golden(
        "convert",
        "graph(%0: tensor<4xbf16>, %1: tensor<4xf32>) {
  %2 = convert %0 : tensor<4xf32>
  %3 = convert %2 : tensor<4xbf16>
  %4 = convert %2 : tensor<4xf64>
  %5 = convert %1 : tensor<4xbf16>
  %6 = convert %5 : tensor<4xf32>
  %7 = convert %1 : tensor<4xf32>
  return %3, %4, %6, %7
}",
    );
    // f32 -> bf16 -> f32 rounds, so it stays.
    insta::assert_snapshot!(out, @r"
    graph(%0: tensor<4xbf16>, %1: tensor<4xf32>) {
      %2 = convert %0 : tensor<4xf64>
      %3 = convert %1 : tensor<4xbf16>
      %4 = convert %3 : tensor<4xf32>
      return %0, %2, %4, %1
    }
    ");
}

#[test]
fn golden_fold() {
    let out = golden(
        "fold",
        "graph(%0: tensor<3xf32>) {
  %1 = constant dense<[1.5, 2.0, -3.0]> : tensor<3xf32>
  %2 = constant dense<2.0> : tensor<f32>
  %3 = broadcast_in_dim %2, dims = [] : tensor<3xf32>
  %4 = mul %1, %3 : tensor<3xf32>
  %5 = exp %4 : tensor<3xf32>
  %6 = add %0, %5 : tensor<3xf32>
  %7 = constant dense<3.0> : tensor<f32>
  %8 = broadcast_in_dim %7, dims = [] : tensor<3x4xf32>
  %9 = constant dense<0.5> : tensor<3x4xf32>
  %10 = sub %8, %9 : tensor<3x4xf32>
  return %6, %10
}",
    );
    // The multiply folds; exp is transcendental and stays; splats fold to a
    // broadcast scalar.
    insta::assert_snapshot!(out, @r"
    graph(%0: tensor<3xf32>) {
      %1 = constant dense<[3.0, 4.0, -6.0]> : tensor<3xf32>
      %2 = exp %1 : tensor<3xf32>
      %3 = add %0, %2 : tensor<3xf32>
      %4 = constant dense<2.5> : tensor<f32>
      %5 = broadcast_in_dim %4, dims = [] : tensor<3x4xf32>
      return %3, %5
    }
    ");
}
