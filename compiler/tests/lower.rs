//! Lowering to StableHLO text: whole-module snapshots of representative
//! programs, determinism, dead-code exclusion, donation attributes, and one
//! small module per op kind.
//!
//! With `KILN_LOWER_DUMP_DIR=<dir>` every lowered module is also written to
//! `<dir>/<name>.mlir`, so the text can be compiled by a real XLA outside the
//! test (the compiler crate itself has no device access).

use kiln_compiler::ir::Alias;
use kiln_compiler::ir::AttentionAttrs;
use kiln_compiler::ir::{
    BinaryOp, CompareDir, DType, DotDims, Graph, Literal, MemorySpace, Op, ReduceOp, RngAlgorithm, Shape, TensorType,
    UnaryOp, ValueId,
};
use kiln_compiler::{lower, LowerOptions, LowerTarget};

type Result<T> = std::result::Result<T, kiln_compiler::CompileError>;

fn t(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, Shape::new(dims))
}

fn lowered(name: &str, g: &Graph, num_replicas: usize) -> String {
    let text = lower(g, &LowerOptions { num_replicas, ..LowerOptions::default() }).expect("lowering succeeds");
    if let Ok(dir) = std::env::var("KILN_LOWER_DUMP_DIR") {
        std::fs::create_dir_all(&dir).expect("dump dir");
        std::fs::write(format!("{dir}/{name}.mlir"), &text).expect("dump file");
    }
    text
}

// ---------------------------------------------------------------- builders

fn scalar(g: &mut Graph, dtype: DType, v: f64) -> Result<ValueId> {
    g.value(Op::Constant { literal: Literal::scalar(dtype, v) })
}

/// `x` broadcast from a lower rank to `shape` along `dims`.
fn bcast(g: &mut Graph, x: ValueId, shape: &[usize], dims: &[usize]) -> Result<ValueId> {
    g.value(Op::BroadcastInDim { input: x, shape: Shape::new(shape), dims: dims.to_vec() })
}

fn bin(g: &mut Graph, op: BinaryOp, lhs: ValueId, rhs: ValueId) -> Result<ValueId> {
    g.value(Op::Binary { op, lhs, rhs })
}

/// Numerically stable softmax over the last axis.
fn softmax(g: &mut Graph, x: ValueId) -> Result<ValueId> {
    let shape = g.ty(x).shape.dims().to_vec();
    let last = shape.len() - 1;
    let kept: Vec<usize> = (0..last).collect();
    let max = g.value(Op::Reduce { op: ReduceOp::Max, input: x, axes: vec![last] })?;
    let max = bcast(g, max, &shape, &kept)?;
    let shifted = bin(g, BinaryOp::Sub, x, max)?;
    let e = g.value(Op::Unary { op: UnaryOp::Exp, input: shifted })?;
    let sum = g.value(Op::Reduce { op: ReduceOp::Sum, input: e, axes: vec![last] })?;
    let sum = bcast(g, sum, &shape, &kept)?;
    bin(g, BinaryOp::Div, e, sum)
}

fn softmax_graph() -> Result<Graph> {
    let mut g = Graph::new();
    let x = g.parameter(t(DType::F32, &[4, 3]));
    let y = softmax(&mut g, x)?;
    g.set_outputs(vec![y])?;
    Ok(g)
}

/// `x @ w + b` for x `[n, k]`, w `[k, m]`, b `[m]`.
fn dense_layer(g: &mut Graph, x: ValueId, w: ValueId, b: ValueId) -> Result<ValueId> {
    let y = g.value(Op::DotGeneral { lhs: x, rhs: w, dims: DotDims::matmul() })?;
    let shape = g.ty(y).shape.dims().to_vec();
    let b = bcast(g, b, &shape, &[1])?;
    bin(g, BinaryOp::Add, y, b)
}

fn mlp_graph() -> Result<Graph> {
    let mut g = Graph::new();
    let x = g.parameter(t(DType::F32, &[4, 8]));
    let w1 = g.parameter(t(DType::F32, &[8, 16]));
    let b1 = g.parameter(t(DType::F32, &[16]));
    let w2 = g.parameter(t(DType::F32, &[16, 3]));
    let b2 = g.parameter(t(DType::F32, &[3]));
    let h = dense_layer(&mut g, x, w1, b1)?;
    let zero = scalar(&mut g, DType::F32, 0.0)?;
    let zero = bcast(&mut g, zero, &[4, 16], &[])?;
    let h = bin(&mut g, BinaryOp::Max, h, zero)?;
    let logits = dense_layer(&mut g, h, w2, b2)?;
    let p = softmax(&mut g, logits)?;
    g.set_outputs(vec![p])?;
    Ok(g)
}

/// Causal single-head attention over `[batch, seq, dim]` = `[2, 4, 8]`.
fn attention_graph() -> Result<Graph> {
    let (b, s, d) = (2, 4, 8);
    let mut g = Graph::new();
    let q = g.parameter(t(DType::F32, &[b, s, d]));
    let k = g.parameter(t(DType::F32, &[b, s, d]));
    let v = g.parameter(t(DType::F32, &[b, s, d]));
    let kt = g.value(Op::Transpose { input: k, perm: vec![0, 2, 1] })?;
    let batched =
        |lc, rc| DotDims { lhs_batch: vec![0], rhs_batch: vec![0], lhs_contract: vec![lc], rhs_contract: vec![rc] };
    let scores = g.value(Op::DotGeneral { lhs: q, rhs: kt, dims: batched(2, 1) })?;
    let scale = scalar(&mut g, DType::F32, 1.0 / (d as f64).sqrt())?;
    let scale = bcast(&mut g, scale, &[b, s, s], &[])?;
    let scores = bin(&mut g, BinaryOp::Mul, scores, scale)?;
    let row = g.value(Op::Iota { ty: t(DType::I32, &[s, s]), axis: 0 })?;
    let col = g.value(Op::Iota { ty: t(DType::I32, &[s, s]), axis: 1 })?;
    let causal = g.value(Op::Compare { dir: CompareDir::Ge, lhs: row, rhs: col })?;
    let causal = bcast(&mut g, causal, &[b, s, s], &[1, 2])?;
    let neg_inf = scalar(&mut g, DType::F32, f64::NEG_INFINITY)?;
    let neg_inf = bcast(&mut g, neg_inf, &[b, s, s], &[])?;
    let masked = g.value(Op::Select { pred: causal, on_true: scores, on_false: neg_inf })?;
    let p = softmax(&mut g, masked)?;
    let out = g.value(Op::DotGeneral { lhs: p, rhs: v, dims: batched(2, 1) })?;
    g.set_outputs(vec![out])?;
    Ok(g)
}

/// Embedding lookup and its adjoint: rows of a `[10, 4]` table by 6 ids.
fn gather_scatter_graph() -> Result<Graph> {
    let mut g = Graph::new();
    let table = g.parameter(t(DType::F32, &[10, 4]));
    let ids = g.parameter(t(DType::I32, &[6]));
    let grad = g.parameter(t(DType::F32, &[6, 4]));
    let rows = g.value(Op::Gather { operand: table, indices: ids, axis: 0 })?;
    let zero = scalar(&mut g, DType::F32, 0.0)?;
    let zeros = bcast(&mut g, zero, &[10, 4], &[])?;
    let dtable = g.value(Op::ScatterAdd { operand: zeros, indices: ids, updates: grad, axis: 0 })?;
    g.set_outputs(vec![rows, dtable])?;
    Ok(g)
}

/// Data-parallel gradient averaging over 4 replicas, plus a max across them.
fn all_reduce_graph() -> Result<Graph> {
    let mut g = Graph::new();
    let grad = g.parameter(t(DType::F32, &[8]));
    let loss = g.parameter(t(DType::F32, &[]));
    let sum = g.value(Op::AllReduce { op: ReduceOp::Sum, input: grad })?;
    let n = scalar(&mut g, DType::F32, 4.0)?;
    let n = bcast(&mut g, n, &[8], &[])?;
    let mean = bin(&mut g, BinaryOp::Div, sum, n)?;
    let worst = g.value(Op::AllReduce { op: ReduceOp::Max, input: loss })?;
    g.set_outputs(vec![mean, worst])?;
    Ok(g)
}

// ---------------------------------------------------------------- snapshots

#[test]
fn snapshot_mlp() -> Result<()> {
    insta::assert_snapshot!("mlp", lowered("mlp", &mlp_graph()?, 1));
    Ok(())
}

#[test]
fn snapshot_softmax() -> Result<()> {
    insta::assert_snapshot!("softmax", lowered("softmax", &softmax_graph()?, 1));
    Ok(())
}

#[test]
fn snapshot_attention() -> Result<()> {
    insta::assert_snapshot!("attention", lowered("attention", &attention_graph()?, 1));
    Ok(())
}

#[test]
fn snapshot_gather_scatter() -> Result<()> {
    insta::assert_snapshot!("gather_scatter", lowered("gather_scatter", &gather_scatter_graph()?, 1));
    Ok(())
}

#[test]
fn snapshot_all_reduce_4_replicas() -> Result<()> {
    insta::assert_snapshot!("all_reduce", lowered("all_reduce", &all_reduce_graph()?, 4));
    Ok(())
}

// ---------------------------------------------------------------- properties

#[test]
fn lowering_is_byte_identical_across_calls_and_rebuilds() -> Result<()> {
    for build in [mlp_graph, softmax_graph, attention_graph, gather_scatter_graph, all_reduce_graph] {
        let g = build()?;
        let first = lower(&g, &LowerOptions::default())?;
        assert_eq!(first, lower(&g, &LowerOptions::default())?);
        assert_eq!(first, lower(&build()?, &LowerOptions::default())?);
    }
    Ok(())
}

#[test]
fn dead_nodes_are_not_emitted() -> Result<()> {
    let mut g = Graph::new();
    let x = g.parameter(t(DType::F32, &[3]));
    let unused = g.parameter(t(DType::F32, &[3]));
    let dead = g.value(Op::Unary { op: UnaryOp::Tanh, input: x })?;
    let _dead_user = bin(&mut g, BinaryOp::Mul, dead, unused)?;
    let y = g.value(Op::Unary { op: UnaryOp::Exp, input: x })?;
    let _after_output = g.value(Op::Unary { op: UnaryOp::Sin, input: y })?;
    g.set_outputs(vec![y])?;
    let text = lowered("dead_nodes", &g, 1);
    insta::assert_snapshot!(text, @r"
    module @kiln attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
      func.func public @main(%arg0: tensor<3xf32>, %arg1: tensor<3xf32>) -> (tensor<3xf32>) {
        %v4 = stablehlo.exponential %arg0 : tensor<3xf32>
        return %v4 : tensor<3xf32>
      }
    }
    ");
    // Unused parameters stay in the signature: the runtime passes every buffer.
    assert_eq!(g.len(), 6, "lowering must not change the graph");
    Ok(())
}

#[test]
fn donated_parameters_carry_their_output_index() -> Result<()> {
    let mut g = Graph::new();
    let w = g.parameter(t(DType::F32, &[2, 2]));
    let grad = g.parameter(t(DType::F32, &[2, 2]));
    let m = g.parameter(t(DType::F32, &[2, 2]));
    let m2 = bin(&mut g, BinaryOp::Add, m, grad)?;
    let w2 = bin(&mut g, BinaryOp::Sub, w, m2)?;
    g.set_outputs(vec![m2, w2])?;
    g.add_alias(Alias { param: 0, output: 1 })?;
    g.add_alias(Alias { param: 2, output: 0 })?;
    let text = lowered("aliasing", &g, 1);
    insta::assert_snapshot!(text, @r"
    module @kiln attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
      func.func public @main(%arg0: tensor<2x2xf32> {tf.aliasing_output = 1 : i32}, %arg1: tensor<2x2xf32>, %arg2: tensor<2x2xf32> {tf.aliasing_output = 0 : i32}) -> (tensor<2x2xf32>, tensor<2x2xf32>) {
        %v3 = stablehlo.add %arg2, %arg1 : tensor<2x2xf32>
        %v4 = stablehlo.subtract %arg0, %v3 : tensor<2x2xf32>
        return %v3, %v4 : tensor<2x2xf32>, tensor<2x2xf32>
      }
    }
    ");
    Ok(())
}

#[test]
fn unsigned_division_by_a_constant_power_of_two_is_a_logical_shift() -> Result<()> {
    // The divisor as a broadcast scalar and as a full constant; a signed
    // division, a divisor of 1 and one that is not a power of two stay
    // divisions.
    let mut g = Graph::new();
    let x = g.parameter(t(DType::U64, &[4]));
    let i = g.parameter(t(DType::I32, &[4]));
    let c8 = scalar(&mut g, DType::U64, 8.0)?;
    let b8 = bcast(&mut g, c8, &[4], &[])?;
    let full = g.value(Op::Constant { literal: Literal::from_f64s(DType::U64, [4], &[2048.0; 4])? })?;
    let c6 = scalar(&mut g, DType::U64, 6.0)?;
    let b6 = bcast(&mut g, c6, &[4], &[])?;
    let c1 = scalar(&mut g, DType::U64, 1.0)?;
    let b1 = bcast(&mut g, c1, &[4], &[])?;
    let ci = scalar(&mut g, DType::I32, 4.0)?;
    let bi = bcast(&mut g, ci, &[4], &[])?;
    let outs = vec![
        bin(&mut g, BinaryOp::Div, x, b8)?,
        bin(&mut g, BinaryOp::Div, x, full)?,
        bin(&mut g, BinaryOp::Div, x, b6)?,
        bin(&mut g, BinaryOp::Div, x, b1)?,
        bin(&mut g, BinaryOp::Div, i, bi)?,
    ];
    g.set_outputs(outs)?;
    let text = lowered("div_pow2", &g, 1);
    let shifts: Vec<&str> = text.lines().filter(|l| l.contains("shift_right_logical")).collect();
    assert_eq!(shifts.len(), 2, "{text}");
    assert!(text.contains("stablehlo.constant dense<3> : tensor<ui64>"), "{text}");
    assert!(text.contains("stablehlo.constant dense<11> : tensor<ui64>"), "{text}");
    assert_eq!(text.lines().filter(|l| l.contains("stablehlo.divide")).count(), 3, "{text}");
    Ok(())
}

/// Constants of at least `LARGE_CONSTANT_BYTES` are written compactly: a
/// splat as its scalar broadcast to the shape, any other as its bytes in hex
/// (pred as `ui8` bytes converted); a splat just below the size stays
/// `dense<v>`, and no large constant is written as a list.
#[test]
fn large_constants_lower_as_a_broadcast_or_in_hex() -> Result<()> {
    let large = lower::LARGE_CONSTANT_BYTES;
    let n = large / 4;
    let mut g = Graph::new();
    let x = g.parameter(t(DType::F32, &[n]));
    let splat = Literal::from_f64s(DType::F32, [n], &vec![1.5; n])?;
    let ramp = Literal::from_f64s(DType::F32, [n], &(0..n).map(|i| i as f64).collect::<Vec<_>>())?;
    let pred =
        Literal::from_f64s(DType::Pred, [large], &(0..large).map(|i| (i % 3 == 0) as u8 as f64).collect::<Vec<_>>())?;
    let small = Literal::from_f64s(DType::F32, [n - 1], &vec![2.5; n - 1])?;
    assert_eq!(lower::constant_form(&splat), lower::ConstantForm::Broadcast);
    assert_eq!(lower::constant_form(&ramp), lower::ConstantForm::Hex);
    assert_eq!(lower::constant_form(&pred), lower::ConstantForm::Hex);
    assert_eq!(lower::constant_form(&small), lower::ConstantForm::Splat);
    let mut outs = vec![];
    for lit in [splat, ramp, pred, small] {
        outs.push(g.value(Op::Constant { literal: lit })?);
    }
    outs.push(bin(&mut g, BinaryOp::Add, x, outs[0])?);
    g.set_outputs(outs)?;
    let text = lowered("large_constants", &g, 1);
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let has = |want: &str| assert!(lines.contains(&want), "no line {want:?} in\n{}", &text[..text.len().min(2000)]);
    has("%v1_splat = stablehlo.constant dense<1.5e0> : tensor<f32>");
    has("%v1 = stablehlo.broadcast_in_dim %v1_splat, dims = [] : (tensor<f32>) -> tensor<262144xf32>");
    let ramp_line = lines.iter().find(|l| l.starts_with("%v2 = ")).expect("the ramp's line");
    // 0.0, 1.0, 2.0 as little-endian f32 bits.
    assert!(ramp_line.starts_with("%v2 = stablehlo.constant dense<\"0x000000000000803F00000040"), "{ramp_line:.80}");
    assert!(
        ramp_line.ends_with("\"> : tensor<262144xf32>") && ramp_line.len() < 2 * large + 100,
        "{}",
        ramp_line.len()
    );
    let bytes_line = lines.iter().find(|l| l.starts_with("%v3_bytes = ")).expect("the pred's bytes");
    assert!(bytes_line.starts_with("%v3_bytes = stablehlo.constant dense<\"0x010000010000"), "{bytes_line:.80}");
    assert!(bytes_line.ends_with("\"> : tensor<1048576xui8>"), "{:.80}", &bytes_line[bytes_line.len() - 40..]);
    has("%v3 = stablehlo.convert %v3_bytes : (tensor<1048576xui8>) -> tensor<1048576xi1>");
    has("%v4 = stablehlo.constant dense<2.5e0> : tensor<262143xf32>");
    assert!(!text.contains("dense<["), "a large constant written as a list");
    // The module is its hex and little else: a list of these values would be
    // several times longer.
    assert!(text.len() < 2 * (large + large) + 2000, "{} bytes", text.len());
    Ok(())
}

#[test]
fn zero_replicas_is_an_error() -> Result<()> {
    let g = softmax_graph()?;
    assert!(lower(&g, &LowerOptions { num_replicas: 0, ..LowerOptions::default() }).is_err());
    Ok(())
}

// ---------------------------------------------------------------- every op

/// Index of `op`'s variant. Exhaustive on purpose: a new `Op` variant fails to
/// compile here until a case below exercises it.
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

type Build = Box<dyn Fn(&mut Graph) -> Result<Vec<ValueId>>>;

/// One small program per op kind and dtype class: `(name, replicas, build)`.
fn op_cases() -> Vec<(String, usize, Build)> {
    let mut cases: Vec<(String, usize, Build)> = Vec::new();
    let mut add = |name: String, replicas: usize, b: Build| cases.push((name, replicas, b));

    let elementwise_dtypes = [DType::F32, DType::BF16, DType::I32, DType::U32, DType::Pred];
    for op in UnaryOp::ALL {
        for dtype in elementwise_dtypes.into_iter().chain([DType::F64, DType::F16, DType::I8, DType::U64]) {
            let ok = match op {
                UnaryOp::Not => !dtype.is_float(),
                UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign => dtype != DType::Pred,
                _ => dtype.is_float(),
            };
            if ok {
                add(
                    format!("unary_{}_{dtype}", op.name()),
                    1,
                    Box::new(move |g| {
                        let x = g.parameter(t(dtype, &[2, 3]));
                        Ok(vec![g.value(Op::Unary { op, input: x })?])
                    }),
                );
            }
        }
    }
    for op in BinaryOp::ALL {
        for dtype in elementwise_dtypes.into_iter().chain([DType::U64, DType::I64]) {
            let ok = if op.is_shift() {
                dtype.is_integer()
            } else if op.is_logical() {
                !dtype.is_float()
            } else {
                dtype != DType::Pred
            };
            if ok {
                add(
                    format!("binary_{}_{dtype}", op.name()),
                    1,
                    Box::new(move |g| {
                        let a = g.parameter(t(dtype, &[2, 3]));
                        let b = g.parameter(t(dtype, &[2, 3]));
                        Ok(vec![bin(g, op, a, b)?])
                    }),
                );
            }
        }
    }
    for dir in CompareDir::ALL {
        for dtype in elementwise_dtypes {
            add(
                format!("compare_{}_{dtype}", dir.name()),
                1,
                Box::new(move |g| {
                    let a = g.parameter(t(dtype, &[4]));
                    let b = g.parameter(t(dtype, &[4]));
                    Ok(vec![g.value(Op::Compare { dir, lhs: a, rhs: b })?])
                }),
            );
        }
    }
    for op in ReduceOp::ALL {
        for dtype in [DType::F32, DType::BF16, DType::I32, DType::I64, DType::U64, DType::Pred] {
            add(
                format!("reduce_{}_{dtype}", op.name()),
                1,
                Box::new(move |g| {
                    let x = g.parameter(t(dtype, &[2, 3, 4]));
                    let some = g.value(Op::Reduce { op, input: x, axes: vec![0, 2] })?;
                    let all = g.value(Op::Reduce { op, input: x, axes: vec![0, 1, 2] })?;
                    let none = g.value(Op::Reduce { op, input: x, axes: vec![] })?;
                    Ok(vec![some, all, none])
                }),
            );
        }
        for dtype in [DType::F32, DType::I32] {
            add(
                format!("all_reduce_{}_{dtype}", op.name()),
                2,
                Box::new(move |g| {
                    let x = g.parameter(t(dtype, &[3]));
                    Ok(vec![g.value(Op::AllReduce { op, input: x })?])
                }),
            );
        }
    }
    add(
        "constants".into(),
        1,
        Box::new(|g| {
            let specials = [1.0, -0.0, 0.1, f64::INFINITY, f64::NEG_INFINITY, f64::NAN];
            let mut outs = Vec::new();
            for dtype in DType::ALL {
                let values: Vec<f64> =
                    if dtype.is_float() { specials.to_vec() } else { vec![1.0, 0.0, 3.0, 1.0, 0.0, 7.0] };
                outs.push(g.value(Op::Constant { literal: Literal::from_f64s(dtype, [2, 3], &values)? })?);
                outs.push(scalar(g, dtype, 1.0)?);
            }
            outs.push(g.value(Op::Constant { literal: Literal::from_f64s(DType::F32, [2, 0], &[])? })?);
            let extremes = [i64::MIN, i64::MAX].iter().flat_map(|v| v.to_le_bytes()).collect();
            outs.push(g.value(Op::Constant { literal: Literal::from_bytes(t(DType::I64, &[2]), extremes)? })?);
            Ok(outs)
        }),
    );
    add(
        "iota".into(),
        1,
        Box::new(|g| {
            Ok(vec![
                g.value(Op::Iota { ty: t(DType::F32, &[2, 3]), axis: 1 })?,
                g.value(Op::Iota { ty: t(DType::U8, &[5]), axis: 0 })?,
            ])
        }),
    );
    add(
        "select".into(),
        1,
        Box::new(|g| {
            let p = g.parameter(t(DType::Pred, &[2, 3]));
            let s = g.parameter(t(DType::Pred, &[]));
            let a = g.parameter(t(DType::F32, &[2, 3]));
            let b = g.parameter(t(DType::F32, &[2, 3]));
            Ok(vec![
                g.value(Op::Select { pred: p, on_true: a, on_false: b })?,
                g.value(Op::Select { pred: s, on_true: a, on_false: b })?,
            ])
        }),
    );
    add(
        "clamp".into(),
        1,
        Box::new(|g| {
            let x = g.parameter(t(DType::I32, &[2, 3]));
            let lo = scalar(g, DType::I32, -1.0)?;
            let hi = g.parameter(t(DType::I32, &[2, 3]));
            Ok(vec![g.value(Op::Clamp { min: lo, input: x, max: hi })?])
        }),
    );
    add(
        "convert".into(),
        1,
        Box::new(|g| {
            let x = g.parameter(t(DType::F32, &[4]));
            let p = g.parameter(t(DType::Pred, &[4]));
            let mut outs = Vec::new();
            for to in DType::ALL {
                outs.push(g.value(Op::Convert { input: x, to })?);
            }
            outs.push(g.value(Op::Convert { input: p, to: DType::BF16 })?);
            Ok(outs)
        }),
    );
    add(
        "shape_ops".into(),
        1,
        Box::new(|g| {
            let x = g.parameter(t(DType::F32, &[4, 6]));
            let one = g.parameter(t(DType::F32, &[1]));
            let b = bcast(g, x, &[2, 4, 6], &[1, 2])?;
            let b1 = bcast(g, one, &[3, 5], &[1])?;
            let r = g.value(Op::Reshape { input: x, shape: Shape::new([2, 12]) })?;
            let s = g.value(Op::Reshape { input: one, shape: Shape::scalar() })?;
            let tr = g.value(Op::Transpose { input: x, perm: vec![1, 0] })?;
            let sl = g.value(Op::Slice { input: x, start: vec![1, 0], limit: vec![3, 6], stride: vec![1, 2] })?;
            let sc = g.value(Op::Slice { input: s, start: vec![], limit: vec![], stride: vec![] })?;
            let back = g.value(Op::Transpose { input: tr, perm: vec![1, 0] })?;
            let c = g.value(Op::Concatenate { inputs: vec![x, x, back], axis: 0 })?;
            let zero = scalar(g, DType::F32, 0.0)?;
            let p =
                g.value(Op::Pad { input: x, value: zero, low: vec![-1, 2], high: vec![0, -3], interior: vec![1, 0] })?;
            Ok(vec![b, b1, r, s, tr, sl, sc, c, p])
        }),
    );
    add(
        "dynamic_slice".into(),
        1,
        Box::new(|g| {
            let x = g.parameter(t(DType::F32, &[4, 6]));
            let u = g.parameter(t(DType::F32, &[2, 3]));
            let i = g.parameter(t(DType::I32, &[]));
            let j = g.parameter(t(DType::I32, &[]));
            let k = g.parameter(t(DType::U8, &[]));
            let l = g.parameter(t(DType::I64, &[]));
            Ok(vec![
                g.value(Op::DynamicSlice { input: x, starts: vec![i, j], sizes: vec![2, 3] })?,
                g.value(Op::DynamicSlice { input: x, starts: vec![k, l], sizes: vec![2, 3] })?,
                g.value(Op::DynamicUpdateSlice { input: x, update: u, starts: vec![i, j] })?,
                g.value(Op::DynamicUpdateSlice { input: x, update: u, starts: vec![l, k] })?,
            ])
        }),
    );
    add(
        "dot_general".into(),
        1,
        Box::new(|g| {
            let a = g.parameter(t(DType::F32, &[2, 3, 4]));
            let b = g.parameter(t(DType::F32, &[2, 4, 5]));
            let v = g.parameter(t(DType::F32, &[3]));
            let m = g.parameter(t(DType::I32, &[3, 4]));
            let n = g.parameter(t(DType::I32, &[4, 2]));
            let batched =
                DotDims { lhs_batch: vec![0], rhs_batch: vec![0], lhs_contract: vec![2], rhs_contract: vec![1] };
            let outer = DotDims::default();
            Ok(vec![
                g.value(Op::DotGeneral { lhs: a, rhs: b, dims: batched })?,
                g.value(Op::DotGeneral { lhs: v, rhs: v, dims: outer })?,
                g.value(Op::DotGeneral { lhs: m, rhs: n, dims: DotDims::matmul() })?,
            ])
        }),
    );
    for (axis, index_dtype) in [(0, DType::I32), (1, DType::U8), (2, DType::I64)] {
        add(
            format!("gather_scatter_axis{axis}_{index_dtype}"),
            1,
            Box::new(move |g| {
                let x = g.parameter(t(DType::F32, &[5, 6, 7]));
                let ids = g.parameter(t(index_dtype, &[2, 3]));
                let rows = g.value(Op::Gather { operand: x, indices: ids, axis })?;
                let upd_shape = g.ty(rows).clone();
                let upd = g.parameter(upd_shape);
                Ok(vec![rows, g.value(Op::ScatterAdd { operand: x, indices: ids, updates: upd, axis })?])
            }),
        );
    }
    add(
        "rng_bit_generator".into(),
        1,
        Box::new(|g| {
            let s2 = g.parameter(t(DType::U64, &[2]));
            let s3 = g.parameter(t(DType::U64, &[3]));
            let a = g.add(Op::RngBitGenerator {
                algorithm: RngAlgorithm::ThreeFry,
                state: s2,
                ty: t(DType::U32, &[2, 3]),
            })?;
            let b =
                g.add(Op::RngBitGenerator { algorithm: RngAlgorithm::Philox, state: s3, ty: t(DType::U64, &[4]) })?;
            Ok(vec![ValueId::new(a, 0), ValueId::new(a, 1), ValueId::new(b, 1)])
        }),
    );
    add(
        "optimization_barrier".into(),
        1,
        Box::new(|g| {
            let x = g.parameter(t(DType::F32, &[3]));
            let y = g.parameter(t(DType::I32, &[]));
            let one = g.add(Op::OptimizationBarrier { inputs: vec![x] })?;
            let two = g.add(Op::OptimizationBarrier { inputs: vec![x, y] })?;
            Ok(vec![ValueId::new(one, 0), ValueId::new(two, 0), ValueId::new(two, 1)])
        }),
    );
    add("place".into(), 1, Box::new(place_case));
    add("host_copy".into(), 1, Box::new(host_copy_case));
    add(
        "whole".into(),
        1,
        Box::new(|g| {
            let x = g.parameter(t(DType::F32, &[4, 8]));
            let w = g.value(Op::Whole { input: x })?;
            Ok(vec![g.value(Op::Unary { op: UnaryOp::Exp, input: w })?])
        }),
    );
    for causal in [true, false] {
        add(format!("attention_causal_{causal}"), 1, Box::new(move |g| attention_case(g, causal)));
    }
    add(
        "layer_norm".to_string(),
        1,
        Box::new(|g| {
            let x = g.parameter(t(DType::BF16, &[2, 3, 8]));
            let gb = g.parameter(t(DType::BF16, &[8]));
            let ln = g.add(Op::LayerNorm { x, gamma: gb, beta: gb, eps_bits: 1e-5f64.to_bits() })?;
            let (mean, rstd) = (ValueId::new(ln, 1), ValueId::new(ln, 2));
            let lg = g.add(Op::LayerNormGrad { x, gamma: gb, mean, rstd, dy: ValueId::new(ln, 0) })?;
            Ok(vec![ValueId::new(ln, 0), ValueId::new(lg, 0), ValueId::new(lg, 1), ValueId::new(lg, 2)])
        }),
    );
    add(
        "rms_norm".to_string(),
        1,
        Box::new(|g| {
            let x = g.parameter(t(DType::BF16, &[2, 3, 8]));
            let gamma = g.parameter(t(DType::BF16, &[8]));
            let n = g.add(Op::RmsNorm { x, gamma, eps_bits: 1e-6f64.to_bits() })?;
            let rstd = ValueId::new(n, 1);
            let ng = g.add(Op::RmsNormGrad { x, gamma, rstd, dy: ValueId::new(n, 0) })?;
            Ok(vec![ValueId::new(n, 0), ValueId::new(ng, 0), ValueId::new(ng, 1)])
        }),
    );
    add(
        "lm_head_cross_entropy".to_string(),
        1,
        Box::new(|g| {
            let h = g.parameter(t(DType::BF16, &[5, 4]));
            let w = g.parameter(t(DType::BF16, &[7, 4]));
            let labels = g.parameter(t(DType::I32, &[5]));
            let ce = g.add(Op::LmHeadCrossEntropy { h, w, labels, chunk: 2, shards: 1 })?;
            let (nll, lse) = (ValueId::new(ce, 0), ValueId::new(ce, 1));
            let cg = g.add(Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll: nll, chunk: 2, shards: 1 })?;
            Ok(vec![nll, ValueId::new(cg, 0), ValueId::new(cg, 1)])
        }),
    );
    for dtype in [DType::BF16, DType::F32] {
        add(
            format!("lm_head_cross_entropy_fused_{dtype}"),
            1,
            Box::new(move |g| {
                let h = g.parameter(t(dtype, &[5, 4]));
                let w = g.parameter(t(dtype, &[7, 4]));
                let labels = g.parameter(t(DType::I32, &[5]));
                let scale = g.parameter(t(DType::F32, &[]));
                let f = g.add(Op::LmHeadCrossEntropyFused { h, w, labels, scale, chunk: 2, shards: 1 })?;
                Ok((0..4).map(|k| ValueId::new(f, k)).collect())
            }),
        );
    }
    cases
}

/// Attention forward and backward on `[2, 3, 16, 8]` bf16 operands.
fn attention_case(g: &mut Graph, causal: bool) -> Result<Vec<ValueId>> {
    let ty = t(DType::BF16, &[2, 3, 16, 8]);
    let [q, k, v, dout] = [0; 4].map(|_| g.parameter(ty.clone()));
    let attrs = AttentionAttrs::new(1.0 / 8f64.sqrt(), causal);
    let a = g.add(Op::Attention { q, k, v, bias: vec![], mask: None, attrs })?;
    let (out, stats) = (ValueId::new(a, 0), ValueId::new(a, 1));
    let gr = g.add(Op::AttentionGrad { q, k, v, bias: vec![], mask: None, out, stats, dout, attrs })?;
    Ok(vec![out, ValueId::new(gr, 0), ValueId::new(gr, 1), ValueId::new(gr, 2)])
}

/// The attention composite on both targets: the plain expansion on CPU, the
/// cuDNN custom calls on CUDA (pure text, so snapshot-tested here).
#[test]
fn attention_lowers_per_target() -> Result<()> {
    for (target, name) in [(LowerTarget::Cpu, "cpu"), (LowerTarget::Cuda, "cuda")] {
        let mut g = Graph::new();
        let outs = attention_case(&mut g, true)?;
        g.set_outputs(outs)?;
        let text = lower(&g, &LowerOptions { target, ..LowerOptions::default() })?;
        assert_eq!(text.contains("custom_call"), target == LowerTarget::Cuda, "{name}");
        insta::assert_snapshot!(format!("attention_causal_{name}"), text);
    }
    // f32 stays plain on CUDA, and the decision says why.
    let mut g = Graph::new();
    let ty = t(DType::F32, &[1, 2, 4, 8]);
    let [q, k, v] = [0; 3].map(|_| g.parameter(ty.clone()));
    let a = g.add(Op::Attention { q, k, v, bias: vec![], mask: None, attrs: AttentionAttrs::new(0.5, false) })?;
    g.set_outputs(vec![ValueId::new(a, 0)])?;
    let text = lower(&g, &LowerOptions { target: LowerTarget::Cuda, ..LowerOptions::default() })?;
    assert!(!text.contains("custom_call"));
    let why = kiln_compiler::composite::decisions(&g, LowerTarget::Cuda);
    assert!(matches!(&why[0].fused, Err(r) if r.contains("bf16 or f16")), "{why:?}");
    Ok(())
}

/// Under a mesh that splits the batch in two and the heads in three, the
/// CUDA lowering runs each cuDNN call on one device's shard: operands enter
/// the manual region through `@Sharding` + `@SPMDFullToShardShape`, the call
/// and its config see the shard's shapes (`[1, 16, 1, 8]` of `[2, 16, 3, 8]`),
/// results leave through `@SPMDShardToFullShape`. The CPU target, whose
/// attention is plain ops the partitioner splits, ignores the split.
#[test]
fn sharded_attention_runs_on_each_devices_shard_on_cuda() -> Result<()> {
    let mut g = Graph::new();
    let outs = attention_case(&mut g, true)?;
    g.set_outputs(outs)?;
    let split = kiln_compiler::AttentionSplit {
        batch: 2,
        heads: 3,
        btnh: "{devices=[2,1,3,1]<=[6]}".into(),
        bnth: "{devices=[2,3,1,1]<=[6]}".into(),
        bnt: "{devices=[2,3,1]<=[6]}".into(),
    };
    let shardings = kiln_compiler::ModuleShardings {
        num_partitions: 6,
        params: vec!["{replicated}".into(); 4],
        outputs: vec!["{replicated}".into(); 4],
        attention: Some(split),
    };
    let opts = |target| LowerOptions { target, shardings: Some(shardings.clone()), ..LowerOptions::default() };
    let cuda = lower(&g, &opts(LowerTarget::Cuda))?;
    let count = |s: &str| cuda.matches(s).count();
    // q, k, v into the forward; q, k, v, the statistics, dout, out into the backward.
    assert_eq!(count("@SPMDFullToShardShape"), 9, "{cuda}");
    // out and the statistics from the forward; dq, dk, dv from the backward.
    assert_eq!(count("@SPMDShardToFullShape"), 5, "{cuda}");
    assert!(cuda.contains("(tensor<2x16x3x8xbf16>) -> tensor<1x16x1x8xbf16>"), "{cuda}");
    assert!(cuda.contains("(tensor<1x1x16xf32>) -> tensor<2x3x16xf32>"), "the statistics: {cuda}");
    assert!(cuda.contains("mhlo.sharding = \"{{manual}, {manual}, {manual}}\""), "{cuda}");
    assert!(cuda.contains("\\22dimensions\\22: [\\221\\22, \\221\\22, \\2216\\22, \\2216\\22]"), "config: {cuda}");
    insta::assert_snapshot!("attention_causal_cuda_sharded", cuda);
    let cpu = lower(&g, &opts(LowerTarget::Cpu))?;
    assert!(!cpu.contains("custom_call"), "{cpu}");
    // A split that does not divide the heads leaves the calls whole.
    let mut odd = shardings.clone();
    odd.attention.as_mut().unwrap().heads = 2;
    let whole =
        lower(&g, &LowerOptions { target: LowerTarget::Cuda, shardings: Some(odd), ..LowerOptions::default() })?;
    assert!(!whole.contains("SPMDFullToShardShape") && whole.contains("fmhaSoftmax"), "{whole}");
    Ok(())
}

/// A value sent to pinned host memory and back, as host offload emits it:
/// the host copy passes through a barrier with a later value.
fn place_case(g: &mut Graph) -> Result<Vec<ValueId>> {
    let x = g.parameter(t(DType::BF16, &[4, 8]));
    let a = g.value(Op::Unary { op: UnaryOp::Tanh, input: x })?;
    let host = g.value(Op::Place { input: a, to: MemorySpace::PinnedHost })?;
    let later = g.value(Op::Unary { op: UnaryOp::Exp, input: x })?;
    let held = g.add(Op::OptimizationBarrier { inputs: vec![host, later] })?;
    let back = g.value(Op::Place { input: ValueId::new(held, 0), to: MemorySpace::Device })?;
    Ok(vec![g.value(Op::Binary { op: BinaryOp::Mul, lhs: back, rhs: later })?])
}

/// A value's trip to the host and back over kiln's copies, as the remat
/// pass's host copies emit it: each step waits for a later value, and the
/// barriers hold the starts before the next readers.
fn host_copy_case(g: &mut Graph) -> Result<Vec<ValueId>> {
    use kiln_compiler::ir::HostCopyStep;
    let x = g.parameter(t(DType::BF16, &[4, 8]));
    let a = g.value(Op::Unary { op: UnaryOp::Tanh, input: x })?;
    let ty = t(DType::BF16, &[4, 8]);
    let out = g.value(Op::HostCopy { inputs: vec![a], step: HostCopyStep::Out, slot: 0, ty: ty.clone() })?;
    let tied = g.add(Op::OptimizationBarrier { inputs: vec![out, a] })?;
    let later = g.value(Op::Unary { op: UnaryOp::Exp, input: ValueId::new(tied, 1) })?;
    let done = g.value(Op::HostCopy {
        inputs: vec![ValueId::new(tied, 1), ValueId::new(tied, 0), later],
        step: HostCopyStep::OutDone,
        slot: 0,
        ty: ty.clone(),
    })?;
    let back = g.value(Op::HostCopy { inputs: vec![done, later], step: HostCopyStep::In, slot: 0, ty: ty.clone() })?;
    let held = g.add(Op::OptimizationBarrier { inputs: vec![back, later] })?;
    let arrived = g.value(Op::HostCopy {
        inputs: vec![ValueId::new(held, 0), ValueId::new(held, 1)],
        step: HostCopyStep::InDone,
        slot: 0,
        ty,
    })?;
    Ok(vec![g.value(Op::Binary { op: BinaryOp::Mul, lhs: arrived, rhs: ValueId::new(held, 1) })?])
}

#[test]
fn placements_are_xla_annotations_on_cuda_and_nothing_on_the_cpu() -> Result<()> {
    let mut g = Graph::new();
    let outs = place_case(&mut g)?;
    g.set_outputs(outs)?;
    let cuda = lower(&g, &LowerOptions { target: kiln_compiler::LowerTarget::Cuda, ..LowerOptions::default() })?;
    let calls: Vec<&str> = cuda.lines().filter(|l| l.contains("@annotate_device_placement")).collect();
    assert_eq!(calls.len(), 2, "{cuda}");
    assert!(
        calls[0].contains("_xla_buffer_placement = \"pinned_host\"") && calls[0].contains("has_side_effect = true")
    );
    assert!(calls[1].contains("_xla_buffer_placement = \"device\""), "{cuda}");
    assert!(calls[1].contains("(%v4#0)"), "the device copy reads the barrier's pass-through: {cuda}");
    let cpu = lower(&g, &LowerOptions::default())?;
    assert!(!cpu.contains("annotate_device_placement"), "{cpu}");
    assert!(cpu.contains("stablehlo.multiply %v4#0, %v3"), "the CPU reads the barrier's value itself: {cpu}");
    Ok(())
}

#[test]
fn every_op_kind_lowers() -> Result<()> {
    let mut seen = [false; VARIANTS];
    let mut names = Vec::new();
    for (name, replicas, build) in op_cases() {
        let mut g = Graph::new();
        let outs = build(&mut g)?;
        g.set_outputs(outs)?;
        for (_, node) in g.nodes() {
            seen[variant(&node.op)] = true;
        }
        let text = lowered(&format!("op_{name}"), &g, replicas);
        assert!(text.ends_with("  }\n}\n"), "{name}: {text}");
        names.push(name);
    }
    let missing: Vec<usize> = (0..VARIANTS).filter(|&i| !seen[i]).collect();
    assert!(missing.is_empty(), "op variants without a case: {missing:?}");
    insta::assert_snapshot!("op_case_names", names.join("\n"));
    Ok(())
}

#[test]
fn snapshot_every_op_kind() -> Result<()> {
    for name in [
        "constants",
        "shape_ops",
        "dynamic_slice",
        "dot_general",
        "gather_scatter_axis1_ui8",
        "rng_bit_generator",
        "optimization_barrier",
        "convert",
        "unary_sign_ui32",
        "unary_abs_ui32",
        "reduce_min_i1",
        "select",
    ] {
        let (_, replicas, build) = op_cases().into_iter().find(|c| c.0 == name).expect("case exists");
        let mut g = Graph::new();
        let outs = build(&mut g)?;
        g.set_outputs(outs)?;
        insta::assert_snapshot!(
            format!("op_{name}"),
            lower(&g, &LowerOptions { num_replicas: replicas, ..LowerOptions::default() })?
        );
    }
    Ok(())
}

// ---------------------------------------------------------------- SPMD shardings

#[test]
fn shardings_annotate_main_and_set_the_partition_count() -> Result<()> {
    let mut g = softmax_graph()?;
    g.add_alias(Alias { param: 0, output: 0 })?;
    let shardings = kiln_compiler::ModuleShardings {
        num_partitions: 4,
        params: vec!["{devices=[4,1]0,1,2,3}".into()],
        outputs: vec!["{devices=[4,1]0,1,2,3}".into()],
        attention: None,
    };
    let text = lower(&g, &LowerOptions { shardings: Some(shardings.clone()), ..LowerOptions::default() })?;
    assert!(text.starts_with("module @kiln attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32}"));
    // Argument attributes sorted by name, as MLIR prints them.
    assert!(
        text.contains(
            "%arg0: tensor<4x3xf32> {mhlo.sharding = \"{devices=[4,1]0,1,2,3}\", tf.aliasing_output = 0 : i32}"
        ),
        "{text}"
    );
    assert!(text.contains("-> (tensor<4x3xf32> {mhlo.sharding = \"{devices=[4,1]0,1,2,3}\"})"), "{text}");
    // Without shardings the text is what it always was.
    assert!(!lower(&g, &LowerOptions::default())?.contains("mhlo.sharding"));
    // One sharding per parameter and per output, or a named error.
    let short = kiln_compiler::ModuleShardings { outputs: vec![], ..shardings };
    let err = lower(&g, &LowerOptions { shardings: Some(short), ..LowerOptions::default() }).unwrap_err();
    assert!(err.to_string().contains("1 parameter and 0 output shardings for 1 parameters and 1 outputs"), "{err}");
    Ok(())
}
