//! The frontend's API layer.

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
