//! kiln's frontend: lazy tensors, autodiff, nn layers, optimizers, data loading,
//! checkpoints.

mod error;

pub use error::FrontendError;
