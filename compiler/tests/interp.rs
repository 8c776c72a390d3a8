//! The reference interpreter on hand-computed cases; its agreement with XLA on
//! random inputs is tested in `testsuite/tests/parity.rs`.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use kiln_compiler::interp::{interpret, interpret_replicated};
use kiln_compiler::ir::{DType, Graph, Literal, Op, ReduceOp, RngAlgorithm, TensorType, UnaryOp, ValueId};

fn lit(d: DType, shape: &[usize], v: &[f64]) -> Literal {
    Literal::from_f64s(d, shape.to_vec(), v).unwrap()
}

#[test]
fn pad_with_crop_and_interior() {
    // [1 2 3] low -1 (crop), high 2, interior 1 -> [x 2 x 3 p p] without the first 1
    let mut g = Graph::new();
    let x = g.parameter(TensorType::new(DType::F32, [3]));
    let v = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 9.0) }).unwrap();
    let p = g.value(Op::Pad { input: x, value: v, low: vec![-1], high: vec![2], interior: vec![1] }).unwrap();
    g.set_outputs(vec![p]).unwrap();
    let out = interpret(&g, &[lit(DType::F32, &[3], &[1.0, 2.0, 3.0])]).unwrap();
    assert_eq!(out[0].to_f64s(), vec![9.0, 2.0, 9.0, 3.0, 9.0, 9.0]);
}

#[test]
fn integer_division_and_remainder_truncate() {
    let mut g = Graph::new();
    let a = g.parameter(TensorType::new(DType::I32, [4]));
    let b = g.parameter(TensorType::new(DType::I32, [4]));
    let d = g.value(Op::Binary { op: kiln_compiler::ir::BinaryOp::Div, lhs: a, rhs: b }).unwrap();
    let r = g.value(Op::Binary { op: kiln_compiler::ir::BinaryOp::Rem, lhs: a, rhs: b }).unwrap();
    g.set_outputs(vec![d, r]).unwrap();
    let out =
        interpret(&g, &[lit(DType::I32, &[4], &[7.0, -7.0, 7.0, 5.0]), lit(DType::I32, &[4], &[2.0, 2.0, -2.0, 0.0])])
            .unwrap();
    assert_eq!(out[0].to_f64s(), vec![3.0, -3.0, -3.0, -1.0]);
    assert_eq!(out[1].to_f64s(), vec![1.0, -1.0, 1.0, 5.0]);
}

#[test]
fn u64_values_beyond_2_pow_53_pass_exactly() {
    let mut g = Graph::new();
    let s = g.parameter(TensorType::new(DType::U64, [2]));
    let r = g
        .add(Op::RngBitGenerator { algorithm: RngAlgorithm::ThreeFry, state: s, ty: TensorType::new(DType::U32, [3]) })
        .unwrap();
    let barrier = g.add(Op::OptimizationBarrier { inputs: vec![s] }).unwrap();
    g.set_outputs(vec![ValueId::new(barrier, 0), ValueId::new(r, 0), ValueId::new(r, 1)]).unwrap();
    let big = (1u64 << 60) + 12345;
    let mut bytes = big.to_le_bytes().to_vec();
    bytes.extend(7u64.to_le_bytes());
    let state = Literal::from_bytes(TensorType::new(DType::U64, [2]), bytes.clone()).unwrap();
    let out = interpret(&g, std::slice::from_ref(&state)).unwrap();
    assert_eq!(out[0].bytes(), &bytes[..], "u64 state passes through exactly");
    // Three u32 draws take two Threefry blocks (XLA's layout): counter 7 -> 9.
    assert_eq!(u64::from_le_bytes(out[1].bytes()[8..16].try_into().unwrap()), 9);
    let again = interpret(&g, &[state]).unwrap();
    assert_eq!(out[2], again[2]);
}

#[test]
fn all_reduce_combines_replicas() {
    let mut g = Graph::new();
    let x = g.parameter(TensorType::new(DType::F32, [2]));
    let s = g.value(Op::AllReduce { op: ReduceOp::Sum, input: x }).unwrap();
    let e = g.value(Op::Unary { op: UnaryOp::Neg, input: s }).unwrap();
    g.set_outputs(vec![e]).unwrap();
    let inputs: Vec<Vec<Literal>> = (0..4).map(|r| vec![lit(DType::F32, &[2], &[r as f64, 1.0])]).collect();
    let out = interpret_replicated(&g, &inputs).unwrap();
    for r in out {
        assert_eq!(r[0].to_f64s(), vec![-6.0, -4.0]);
    }
}

#[test]
fn wrong_inputs_are_errors() {
    let mut g = Graph::new();
    let x = g.parameter(TensorType::new(DType::F32, [2]));
    g.set_outputs(vec![x]).unwrap();
    let err = interpret(&g, &[]).unwrap_err().to_string();
    assert!(err.contains("0 inputs for 1 parameters"), "{err}");
    let err = interpret(&g, &[lit(DType::F64, &[2], &[1.0, 2.0])]).unwrap_err().to_string();
    assert!(err.contains("tensor<2xf32>") && err.contains("tensor<2xf64>"), "{err}");
}

#[test]
fn erf_matches_known_values() {
    let mut g = Graph::new();
    let x = g.parameter(TensorType::new(DType::F64, [4]));
    let e = g.value(Op::Unary { op: UnaryOp::Erf, input: x }).unwrap();
    g.set_outputs(vec![e]).unwrap();
    let out = interpret(&g, &[lit(DType::F64, &[4], &[0.5, -1.0, 2.0, 3.0])]).unwrap()[0].to_f64s();
    let want = [0.520_499_877_813_046_5, -0.842_700_792_949_714_9, 0.995_322_265_018_952_7, 0.999_977_909_503_001_4];
    for (a, b) in out.iter().zip(want) {
        assert!((a - b).abs() < 1e-14, "{a} vs {b}");
    }
}
