//! What users do in their own crates: snapshot the StableHLO a step lowers to
//! (the README's example), before and after kiln's optimization passes.

use kiln::{LowerOpts, Tensor};

fn layer() -> kiln::Result<(Tensor, Tensor)> {
    Ok((Tensor::from_vec(vec![0.5f32; 8], [2, 4])?, Tensor::from_vec(vec![0.25f32; 12], [4, 3])?))
}

#[test]
fn mlp_layer_lowering() -> kiln::Result<()> {
    let (x, w) = layer()?;
    let text = kiln::lower(|| Ok(vec![x.matmul(&w)?.relu()?]))?;
    insta::assert_snapshot!(text, @r"
    module @kiln attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
      func.func public @main(%arg0: tensor<2x4xf32>, %arg1: tensor<4x3xf32>) -> (tensor<2x3xf32>) {
        %v2 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>
        %v3 = stablehlo.constant dense<0.0e0> : tensor<f32>
        %v4 = stablehlo.broadcast_in_dim %v3, dims = [] : (tensor<f32>) -> tensor<2x3xf32>
        %v5 = stablehlo.maximum %v2, %v4 : tensor<2x3xf32>
        return %v5 : tensor<2x3xf32>
      }
    }
    ");
    Ok(())
}

#[test]
fn lowering_is_deterministic_and_optimization_merges_duplicates() -> kiln::Result<()> {
    let (x, w) = layer()?;
    let f = || -> kiln::Result<Vec<Tensor>> {
        // The same product twice: CSE keeps one.
        Ok(vec![x.matmul(&w)?.tanh()?.add(&x.matmul(&w)?.tanh()?)?])
    };
    let raw = kiln::lower_with(LowerOpts { optimize: false }, f)?;
    let optimized = kiln::lower(f)?;
    assert_eq!(optimized, kiln::lower(f)?, "byte-identical across calls");
    assert_eq!(raw.matches("dot_general").count(), 2);
    assert_eq!(optimized.matches("dot_general").count(), 1);
    Ok(())
}

/// A whole training step as a user snapshots it: the forward, the backward and
/// the SGD update, each parameter's new value an output (the program
/// `mark_step` compiles, `lower_is_the_step.rs`).
#[test]
fn sgd_step_lowering() -> kiln::Result<()> {
    let (x, w) = layer()?;
    let mut opt = kiln::optim::Sgd::new(std::slice::from_ref(&w), 0.0, 0.0)?;
    let text = kiln::lower(|| {
        let loss = x.matmul(&w)?.relu()?.sum_all()?;
        let grads = kiln::grad(&loss, std::slice::from_ref(&w))?;
        opt.step(std::slice::from_ref(&w), &grads, 0.1)?;
        Ok(vec![loss])
    })?;
    insta::assert_snapshot!(text);
    Ok(())
}
