//! kiln: a graph-compiling training accelerator for Rust.
//!
//! Record ops on lazy [`Tensor`]s, call [`mark_step`], and kiln compiles the
//! step (once) through XLA and runs it. This crate re-exports the frontend API
//! and names the compiler and runtime crates for users who go lower.
//!
//! ```no_run
//! use kiln::{DType, Tensor};
//! let x = Tensor::from_vec(vec![1f32, 2.0, 3.0], [3])?;
//! let y = x.tanh()?.sum_all()?;
//! kiln::mark_step()?;
//! println!("{}", y.item()?);
//! # Ok::<(), kiln::FrontendError>(())
//! ```

pub use kiln_compiler as compiler;
pub use kiln_compiler::ir::{DType, Shape, TensorType};
pub use kiln_frontend::*;
/// The model zoo (`kiln_models`): the MLP and GPT the CLI trains, and the
/// transformers written as users write them.
pub use kiln_models as models;
/// The training loop as a library: [`train::Trainer`] fits a model's
/// parameters with evaluation, checkpoints and callbacks.
pub use kiln_models::trainer as train;
pub use kiln_runtime as runtime;
