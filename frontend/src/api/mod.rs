//! The API layer: what a training loop calls, built on the engine.
//!
//! - `tensor/`: `Tensor`'s ops, one file per kind; `grad`, `autodiff/`:
//!   gradients; `amp`: mixed precision;
//! - `nn/`: layers and the parameter store; `optim`: optimizers; `clip`:
//!   gradient clipping; `train_step`: one training step in order;
//! - `data`: data loading; `checkpoint`: checkpoints; `random`: the in-graph
//!   generator;
//! - `shard/`: shard policies and the `--shard` flag; `replicas`: the
//!   replicas' collectives and reads; `metrics`: the counters, reported.
//!
//! Invariant: nothing below this layer imports it (the `layers` test in
//! `lib.rs`).

pub mod amp;
pub mod autodiff;
pub mod checkpoint;
pub mod clip;
pub mod data;
pub(crate) mod grad;
pub mod metrics;
pub mod nn;
pub mod optim;
pub mod random;
pub mod replicas;
pub mod shard;
pub(crate) mod tensor;
pub mod train_step;
