//! kiln's frontend: lazy tensors, autodiff, nn layers, optimizers, mixed
//! precision, data loading, checkpoints.
//!
//! A training loop records ops on [`Tensor`]s until [`mark_step`]; the step is
//! then compiled (once) and run, and the pending tensors become device data.

pub mod amp;
pub mod atomic_write;
pub mod autodiff;
mod capture;
pub mod checkpoint;
pub mod clip;
mod context;
pub mod data;
mod device_checks;
pub mod dump;
mod eager;
mod element;
mod error;
mod executor;
mod explain;
mod grad;
pub mod limits;
mod lowering;
mod memory_limit;
pub mod metrics;
pub mod nn;
pub mod optim;
mod program;
pub mod random;
pub mod replicas;
pub mod scope;
pub mod shard;
mod step;
mod tensor;
mod trace;
pub mod train_step;
pub mod warnings;

/// candle-core, for [`Tensor::to_candle`] and [`Tensor::from_candle`].
pub use candle_core;
pub use capture::{compile_step, CompiledStep};
pub use context::{backend, clear_compile_cache, client, set_backend, set_client, set_disk_cache};
pub use device_checks::{check_index_range, detect_anomaly, device_checks, set_detect_anomaly, set_device_checks};
pub use element::Element;
pub use error::{FrontendError, Result};
pub use executor::Backend;
pub use executor::{set_max_steps_in_flight, steps_in_flight, sync};
pub use grad::grad;
pub use memory_limit::{
    activation_budget, capture_graph, check_memory_limit_for_mesh, host_copies, host_offload, loop_kernels,
    memory_limit, set_activation_budget, set_host_copies, set_host_offload, set_loop_kernels, set_memory_limit,
};
pub use program::host_link_rate;
pub use random::manual_seed;
pub use step::{donation_enabled, element_type, lower, lower_with, mark_step, step, LowerOpts, StepReport};
pub use tensor::Tensor;
