//! SPMD partitioning on the XLA CPU plugin: one replica × 4 partitions,
//! `mhlo.sharding` on `@main`'s arguments and results, per-device shard
//! buffers in and out. What these tests pin down is written up in
//! docs/sharding.md (which sharding forms and compile options the pinned
//! plugin takes).

mod common;

use common::{cpu_client, XorShift};
use kiln_runtime::{ArgType, CompileOptions, ElementType, ExecArg, Signature};

const F32: ElementType = ElementType::F32;

fn spmd(parts: usize) -> CompileOptions {
    CompileOptions {
        num_replicas: 1,
        num_partitions: parts,
        device_assignment: Some(vec![(0..parts as i64).collect()]),
        keep_order: false,
    }
}

/// x: [8x4] rows split 4 ways, w: [4x6] replicated; y = x·w rows split,
/// s = sum(y) replicated (the partitioner inserts the all-reduce).
const ROWS: &str = r#"module @m attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%x: tensor<8x4xf32> {mhlo.sharding = "{devices=[4,1]0,1,2,3}"}, %w: tensor<4x6xf32> {mhlo.sharding = "{replicated}"}) -> (tensor<8x6xf32> {mhlo.sharding = "{devices=[4,1]0,1,2,3}"}, tensor<f32> {mhlo.sharding = "{replicated}"}) {
    %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x6xf32>) -> tensor<8x6xf32>
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %s = stablehlo.reduce(%y init: %z) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x6xf32>, tensor<f32>) -> tensor<f32>
    return %y, %s : tensor<8x6xf32>, tensor<f32>
  }
}"#;

fn matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| f64::from(x[i * k + p]) * f64::from(w[p * n + j])).sum();
        }
    }
    out
}

#[test]
fn row_sharded_matmul_runs_on_four_partitions() {
    let client = cpu_client(4);
    let global = Signature::from_stablehlo(ROWS).unwrap();
    let local = Signature {
        inputs: vec![ArgType::new(F32, &[2, 4]), ArgType::new(F32, &[4, 6])],
        outputs: vec![ArgType::new(F32, &[2, 6]), ArgType::new(F32, &[])],
    };
    let exe = client.compile(ROWS, &spmd(4)).unwrap().with_local_signature(local).unwrap();
    assert_eq!(exe.signature(), &global);
    assert_eq!(exe.num_local_devices(), 4);
    let mut rng = XorShift::new(13);
    let x = rng.vec_f32(32);
    let w = rng.vec_f32(24);
    let devices = exe.replica_devices();
    let args: Vec<Vec<ExecArg>> = devices
        .iter()
        .enumerate()
        .map(|(p, d)| {
            vec![
                ExecArg::Donated(client.buffer_from_host(&x[p * 8..p * 8 + 8], &[2, 4], d).unwrap()),
                ExecArg::Donated(client.buffer_from_host(&w, &[4, 6], d).unwrap()),
            ]
        })
        .collect();
    let outs = exe.execute_replicated(args).unwrap();
    let want = matmul(&x, &w, 8, 4, 6);
    let total: f64 = want.iter().sum();
    for (p, out) in outs.iter().enumerate() {
        assert_eq!(out[0].dims(), vec![2, 6]);
        let y: Vec<f32> = out[0].to_vec().unwrap();
        for (i, v) in y.iter().enumerate() {
            assert!((f64::from(*v) - want[p * 12 + i]).abs() < 1e-5, "partition {p} element {i}: {v}");
        }
        let s: Vec<f32> = out[1].to_vec().unwrap();
        assert!((f64::from(s[0]) - total).abs() < 1e-4, "partition {p} sum {} want {total}", s[0]);
    }
}

/// A 2×2 mesh (data, model), device `d·2 + m`: x rows over `data`, w
/// columns over `model`, y tiled both ways; the partial tiles of x and w are
/// replicated over the other axis (`last_tile_dim_replicate`).
const MESH2X2: &str = r#"module @m attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%x: tensor<8x4xf32> {mhlo.sharding = "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"}, %w: tensor<4x6xf32> {mhlo.sharding = "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"}) -> (tensor<8x6xf32> {mhlo.sharding = "{devices=[2,2]0,1,2,3}"}) {
    %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x6xf32>) -> tensor<8x6xf32>
    return %y : tensor<8x6xf32>
  }
}"#;

#[test]
fn two_axis_mesh_tiles_and_partial_replication() {
    let client = cpu_client(4);
    let local = Signature {
        inputs: vec![ArgType::new(F32, &[4, 4]), ArgType::new(F32, &[4, 3])],
        outputs: vec![ArgType::new(F32, &[4, 3])],
    };
    let exe = client.compile(MESH2X2, &spmd(4)).unwrap().with_local_signature(local).unwrap();
    // The compiled program's arguments are one device's shards: 16 + 12 floats.
    let stats = exe.compiled_memory_stats().unwrap();
    assert_eq!(stats.argument_size_in_bytes, (16 + 12) * 4, "{stats:?}");
    let mut rng = XorShift::new(14);
    let x = rng.vec_f32(32);
    let w = rng.vec_f32(24);
    let devices = exe.replica_devices();
    let args: Vec<Vec<ExecArg>> = devices
        .iter()
        .enumerate()
        .map(|(p, d)| {
            let (data, model) = (p / 2, p % 2);
            let w_cols: Vec<f32> = (0..4).flat_map(|r| w[r * 6 + model * 3..r * 6 + model * 3 + 3].to_vec()).collect();
            vec![
                ExecArg::Donated(client.buffer_from_host(&x[data * 16..data * 16 + 16], &[4, 4], d).unwrap()),
                ExecArg::Donated(client.buffer_from_host(&w_cols, &[4, 3], d).unwrap()),
            ]
        })
        .collect();
    let outs = exe.execute_replicated(args).unwrap();
    let want = matmul(&x, &w, 8, 4, 6);
    for (p, out) in outs.iter().enumerate() {
        let (data, model) = (p / 2, p % 2);
        let y: Vec<f32> = out[0].to_vec().unwrap();
        for r in 0..4 {
            for c in 0..3 {
                let expect = want[(data * 4 + r) * 6 + model * 3 + c];
                assert!((f64::from(y[r * 3 + c]) - expect).abs() < 1e-5, "device {p} ({r},{c})");
            }
        }
    }
}

#[test]
fn shard_shaped_arguments_are_checked_against_the_local_signature() {
    let client = cpu_client(4);
    let local = Signature {
        inputs: vec![ArgType::new(F32, &[2, 4]), ArgType::new(F32, &[4, 6])],
        outputs: vec![ArgType::new(F32, &[2, 6]), ArgType::new(F32, &[])],
    };
    let exe = client.compile(ROWS, &spmd(4)).unwrap().with_local_signature(local).unwrap();
    let devices = exe.replica_devices();
    // The global shape is not what one device takes.
    let args: Vec<Vec<ExecArg>> = devices
        .iter()
        .map(|d| {
            vec![
                ExecArg::Donated(client.buffer_from_host(&[0.5f32; 32], &[8, 4], d).unwrap()),
                ExecArg::Donated(client.buffer_from_host(&[0.5f32; 24], &[4, 6], d).unwrap()),
            ]
        })
        .collect();
    let err = exe.execute_replicated(args).unwrap_err().to_string();
    assert!(err.contains("2x4"), "{err}");
}
