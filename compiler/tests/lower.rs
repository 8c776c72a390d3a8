//! Lowering to StableHLO text: whole-module snapshots of representative
//! programs, determinism, dead-code exclusion, donation attributes, and one
//! small module per op kind.
//!
//! With `KILN_LOWER_DUMP_DIR=<dir>` every lowered module is also written to
//! `<dir>/<name>.mlir`, so the text can be compiled by a real XLA outside the
//! test (the compiler crate itself has no device access).

use kiln_compiler::ir::Alias;
use kiln_compiler::ir::{
    BinaryOp, CompareDir, DType, DotDims, Graph, Literal, Op, ReduceOp, Shape, TensorType, UnaryOp,
    ValueId,
};
use kiln_compiler::{lower, LowerOptions};

type Result<T> = std::result::Result<T, kiln_compiler::CompileError>;

fn t(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, Shape::new(dims))
}

fn lowered(name: &str, g: &Graph, num_replicas: usize) -> String {
    let text = lower(g, &LowerOptions { num_replicas }).expect("lowering succeeds");
    if let Ok(dir) = std::env::var("KILN_LOWER_DUMP_DIR") {
        std::fs::create_dir_all(&dir).expect("dump dir");
        std::fs::write(format!("{dir}/{name}.mlir"), &text).expect("dump file");
    }
    text
}

// ---------------------------------------------------------------- builders

fn scalar(g: &mut Graph, dtype: DType, v: f64) -> Result<ValueId> {
    g.value(Op::Constant {
        literal: Literal::scalar(dtype, v),
    })
}

/// `x` broadcast from a lower rank to `shape` along `dims`.
fn bcast(g: &mut Graph, x: ValueId, shape: &[usize], dims: &[usize]) -> Result<ValueId> {
    g.value(Op::BroadcastInDim {
        input: x,
        shape: Shape::new(shape),
        dims: dims.to_vec(),
    })
}

fn bin(g: &mut Graph, op: BinaryOp, lhs: ValueId, rhs: ValueId) -> Result<ValueId> {
    g.value(Op::Binary { op, lhs, rhs })
}

/// Numerically stable softmax over the last axis.
fn softmax(g: &mut Graph, x: ValueId) -> Result<ValueId> {
    let shape = g.ty(x).shape.dims().to_vec();
    let last = shape.len() - 1;
    let kept: Vec<usize> = (0..last).collect();
    let max = g.value(Op::Reduce {
        op: ReduceOp::Max,
        input: x,
        axes: vec![last],
    })?;
    let max = bcast(g, max, &shape, &kept)?;
    let shifted = bin(g, BinaryOp::Sub, x, max)?;
    let e = g.value(Op::Unary {
        op: UnaryOp::Exp,
        input: shifted,
    })?;
    let sum = g.value(Op::Reduce {
        op: ReduceOp::Sum,
        input: e,
        axes: vec![last],
    })?;
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
    let y = g.value(Op::DotGeneral {
        lhs: x,
        rhs: w,
        dims: DotDims::matmul(),
    })?;
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
    let kt = g.value(Op::Transpose {
        input: k,
        perm: vec![0, 2, 1],
    })?;
    let batched = |lc, rc| DotDims {
        lhs_batch: vec![0],
        rhs_batch: vec![0],
        lhs_contract: vec![lc],
        rhs_contract: vec![rc],
    };
    let scores = g.value(Op::DotGeneral {
        lhs: q,
        rhs: kt,
        dims: batched(2, 1),
    })?;
    let scale = scalar(&mut g, DType::F32, 1.0 / (d as f64).sqrt())?;
    let scale = bcast(&mut g, scale, &[b, s, s], &[])?;
    let scores = bin(&mut g, BinaryOp::Mul, scores, scale)?;
    let row = g.value(Op::Iota {
        ty: t(DType::S32, &[s, s]),
        axis: 0,
    })?;
    let col = g.value(Op::Iota {
        ty: t(DType::S32, &[s, s]),
        axis: 1,
    })?;
    let causal = g.value(Op::Compare {
        dir: CompareDir::Ge,
        lhs: row,
        rhs: col,
    })?;
    let causal = bcast(&mut g, causal, &[b, s, s], &[1, 2])?;
    let neg_inf = scalar(&mut g, DType::F32, f64::NEG_INFINITY)?;
    let neg_inf = bcast(&mut g, neg_inf, &[b, s, s], &[])?;
    let masked = g.value(Op::Select {
        pred: causal,
        on_true: scores,
        on_false: neg_inf,
    })?;
    let p = softmax(&mut g, masked)?;
    let out = g.value(Op::DotGeneral {
        lhs: p,
        rhs: v,
        dims: batched(2, 1),
    })?;
    g.set_outputs(vec![out])?;
    Ok(g)
}

/// Embedding lookup and its adjoint: rows of a `[10, 4]` table by 6 ids.
fn gather_scatter_graph() -> Result<Graph> {
    let mut g = Graph::new();
    let table = g.parameter(t(DType::F32, &[10, 4]));
    let ids = g.parameter(t(DType::S32, &[6]));
    let grad = g.parameter(t(DType::F32, &[6, 4]));
    let rows = g.value(Op::Gather {
        operand: table,
        indices: ids,
        axis: 0,
    })?;
    let zero = scalar(&mut g, DType::F32, 0.0)?;
    let zeros = bcast(&mut g, zero, &[10, 4], &[])?;
    let dtable = g.value(Op::ScatterAdd {
        operand: zeros,
        indices: ids,
        updates: grad,
        axis: 0,
    })?;
    g.set_outputs(vec![rows, dtable])?;
    Ok(g)
}

/// Data-parallel gradient averaging over 4 replicas, plus a max across them.
fn all_reduce_graph() -> Result<Graph> {
    let mut g = Graph::new();
    let grad = g.parameter(t(DType::F32, &[8]));
    let loss = g.parameter(t(DType::F32, &[]));
    let sum = g.value(Op::AllReduce {
        op: ReduceOp::Sum,
        input: grad,
    })?;
    let n = scalar(&mut g, DType::F32, 4.0)?;
    let n = bcast(&mut g, n, &[8], &[])?;
    let mean = bin(&mut g, BinaryOp::Div, sum, n)?;
    let worst = g.value(Op::AllReduce {
        op: ReduceOp::Max,
        input: loss,
    })?;
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
    insta::assert_snapshot!(
        "gather_scatter",
        lowered("gather_scatter", &gather_scatter_graph()?, 1)
    );
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
    for build in [
        mlp_graph,
        softmax_graph,
        attention_graph,
        gather_scatter_graph,
        all_reduce_graph,
    ] {
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
    let dead = g.value(Op::Unary {
        op: UnaryOp::Tanh,
        input: x,
    })?;
    let _dead_user = bin(&mut g, BinaryOp::Mul, dead, unused)?;
    let y = g.value(Op::Unary {
        op: UnaryOp::Exp,
        input: x,
    })?;
    let _after_output = g.value(Op::Unary {
        op: UnaryOp::Sin,
        input: y,
    })?;
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
    g.add_alias(Alias {
        param: 0,
        output: 1,
    })?;
    g.add_alias(Alias {
        param: 2,
        output: 0,
    })?;
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
fn zero_replicas_is_an_error() -> Result<()> {
    let g = softmax_graph()?;
    assert!(lower(&g, &LowerOptions { num_replicas: 0 }).is_err());
    Ok(())
}
