//! `kiln::lower` returns the program `mark_step` compiles for the same
//! recorded ops, byte for byte: for an optimizer step (it once returned the
//! forward alone, with one output: the update's assignments were undone and
//! pruned), a captured step and a sharded step. The compiled text is read
//! from `KILN_DUMP_DIR`'s `NN-stablehlo.mlir`, which the compile path writes
//! from the same module it hands the plugin.
//!
//! One test in this binary: it sets process-wide variables (the dump folder,
//! donation, the disk cache off) before any client exists.

#![allow(clippy::unwrap_used)] // Test helpers may unwrap (the workspace denies it in library code).

use std::path::{Path, PathBuf};

use kiln::nn::{Linear, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::shard::{self, Mesh, Sharding};
use kiln::Tensor;

mod common;
use common::Rng;

/// The StableHLO module of the newest pipeline folder under `dump`.
fn last_compiled(dump: &Path) -> String {
    let mut runs: Vec<PathBuf> = std::fs::read_dir(dump).unwrap().map(|e| e.unwrap().path()).collect();
    runs.sort();
    for run in runs.iter().rev() {
        let found = std::fs::read_dir(run)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with("-stablehlo.mlir"));
        if let Some(p) = found {
            return std::fs::read_to_string(p).unwrap();
        }
    }
    panic!("no compiled module under {}", dump.display())
}

struct Model {
    params: ParamStore,
    l1: Linear,
    l2: Linear,
    opt: AdamW,
}

fn model(seed: u64) -> Model {
    let mut params = ParamStore::new(seed);
    let l1 = Linear::new(&mut params, "l1", 16, 32, true).unwrap();
    let l2 = Linear::new(&mut params, "l2", 32, 8, true).unwrap();
    let opt = AdamW::new(&params.tensors(), AdamWConfig::default()).unwrap();
    Model { params, l1, l2, opt }
}

/// One AdamW step of a two-layer MLP with a dropout draw (the generator's
/// state is assigned too); returns the loss.
fn record_step(m: &mut Model, x: &Tensor, y: &Tensor) -> kiln::Result<Vec<Tensor>> {
    let h = kiln::nn::dropout(&kiln::nn::gelu(&m.l1.forward(x)?)?, 0.1, true)?;
    let loss = kiln::nn::cross_entropy(&m.l2.forward(&h)?, y, None)?;
    let ps = m.params.tensors();
    let grads = kiln::grad(&loss, &ps)?;
    m.opt.step(&ps, &grads, 1e-3)?;
    Ok(vec![loss])
}

fn batch(rng: &mut Rng, rows: usize) -> (Tensor, Tensor) {
    let x = Tensor::from_vec(rng.normal_vec(rows * 16), [rows, 16]).unwrap();
    let y = Tensor::from_vec((0..rows).map(|i| (i * 5 % 8) as i32).collect::<Vec<_>>(), [rows]).unwrap();
    (x, y)
}

fn optimizer_step(dump: &Path) {
    let mut rng = Rng::new(7);
    let mut m = model(3);
    let (x, y) = batch(&mut rng, 4);
    let lowered = kiln::lower(|| record_step(&mut m, &x, &y)).unwrap();
    // The whole step: the forward's two products and the backward's three
    // (both weight gradients, and the input gradient of the second layer).
    assert_eq!(lowered.matches("stablehlo.dot_general").count(), 5, "{lowered}");
    // The loss, the four parameters, AdamW's eight moments and its counter,
    // the generator's state: the update is in the program.
    let outputs = lowered.lines().find(|l| l.contains("func.func public @main")).unwrap();
    assert!(outputs.matches("tensor<").count() > 14, "{outputs}");
    // Donation (KILN_DONATE=1): each parameter's buffer aliases its new value.
    assert!(lowered.contains("tf.aliasing_output"), "{lowered}");
    let loss = record_step(&mut m, &x, &y).unwrap();
    kiln::mark_step().unwrap();
    assert!(loss[0].item().unwrap().is_finite());
    assert_eq!(lowered, last_compiled(dump), "lower's text is not the compiled step");
}

fn captured_step(dump: &Path) {
    let mut rng = Rng::new(8);
    let mut m = model(4);
    let (x, y) = batch(&mut rng, 6);
    let mut step = kiln::compile_step(|i: &[Tensor]| record_step(&mut m, &i[0], &i[1]));
    let lowered = step.lower(&[x.clone(), y.clone()]).unwrap();
    let out = step.call(&[x, y]).unwrap();
    assert!(out[0].item().unwrap().is_finite());
    assert_eq!(lowered, last_compiled(dump), "lower's text is not the captured step's program");
}

fn sharded_step(dump: &Path) {
    std::thread::scope(|s| {
        s.spawn(|| {
            shard::set_mesh(Mesh::new(&[("data", 2)]).unwrap()).unwrap();
            let mut rng = Rng::new(9);
            let mut m = model(5);
            let (x, y) = batch(&mut rng, 8);
            x.set_sharding(Sharding::split(2, 0, "data")).unwrap();
            y.set_sharding(Sharding::split(1, 0, "data")).unwrap();
            let lowered = kiln::lower(|| record_step(&mut m, &x, &y)).unwrap();
            assert!(lowered.contains("mhlo.sharding"), "{lowered}");
            let loss = record_step(&mut m, &x, &y).unwrap();
            kiln::mark_step().unwrap();
            assert!(loss[0].item().unwrap().is_finite());
            assert_eq!(lowered, last_compiled(dump), "lower's text is not the sharded step");
        })
        .join()
        .unwrap();
    });
}

#[test]
fn lower_returns_the_program_mark_step_compiles() {
    let dump = tempfile::tempdir().unwrap();
    std::env::set_var("KILN_DUMP_DIR", dump.path());
    std::env::set_var("KILN_DONATE", "1");
    std::env::set_var("KILN_CACHE", "off");
    optimizer_step(dump.path());
    captured_step(dump.path());
    sharded_step(dump.path());
}
