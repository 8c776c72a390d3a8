//! kiln's frontend: lazy tensors, autodiff, nn layers, optimizers, mixed
//! precision, data loading, checkpoints.
//!
//! A training loop records ops on [`Tensor`]s until [`mark_step`]; the step is
//! then compiled (once) and run, and the pending tensors become device data.

pub mod amp;
pub mod atomic_write;
pub mod autodiff;
pub mod checkpoint;
pub mod clip;
mod context;
mod eager;
pub mod data;
mod element;
mod error;
mod explain;
mod grad;
mod lowering;
pub mod metrics;
pub mod models;
pub mod nn;
pub mod optim;
mod program;
pub mod random;
pub mod replicas;
mod step;
mod tensor;
pub mod train_step;
pub mod warnings;

/// candle-core, for [`Tensor::to_candle`] and [`Tensor::from_candle`].
pub use candle_core;
pub use context::{backend, clear_compile_cache, set_backend, set_client, set_disk_cache, Backend};
pub use element::Element;
pub use error::{FrontendError, Result};
pub use grad::grad;
pub use random::manual_seed;
pub use step::{element_type, lower, lower_with, mark_step, step, LowerOpts, StepReport};
pub use tensor::Tensor;
