//! kiln's frontend: lazy tensors, autodiff, nn layers, optimizers, mixed
//! precision, data loading, checkpoints.
//!
//! A training loop records ops on [`Tensor`]s until [`mark_step`]; the step is
//! then compiled (once) and run, and the pending tensors become device data.

mod api;
mod core;
mod engine;

pub use crate::api::{amp, autodiff, checkpoint, clip, data, metrics, nn, optim, random, replicas, shard, train_step};
pub use crate::core::{atomic_write, limits, warnings};
pub use crate::engine::{dump, scope};

pub use crate::api::grad::grad;
pub use crate::api::random::manual_seed;
pub use crate::core::element::{element_type, Element};
pub use crate::core::error::{FrontendError, Result};
pub use crate::core::settings::{
    activation_budget, check_memory_limit_for_mesh, detect_anomaly, device_checks, host_copies, host_offload,
    loop_kernels, memory_limit, set_detect_anomaly, set_device_checks,
};
pub use crate::core::tensor::Tensor;
pub use crate::engine::capture::{compile_step, CompiledStep};
pub use crate::engine::compile::host_link_rate;
pub use crate::engine::compile_settings::{
    set_activation_budget, set_host_copies, set_host_offload, set_loop_kernels, set_memory_limit,
};
pub use crate::engine::context::{backend, clear_compile_cache, client, set_backend, set_client, set_disk_cache};
pub use crate::engine::device_checks::check_index_range;
pub use crate::engine::executor::Backend;
pub use crate::engine::executor::{set_max_steps_in_flight, steps_in_flight, sync};
pub use crate::engine::lower::{capture_graph, lower, lower_with, LowerOpts};
pub use crate::engine::step::{donation_enabled, mark_step, step, StepReport};
/// candle-core, for [`Tensor::to_candle`] and [`Tensor::from_candle`].
pub use candle_core;
