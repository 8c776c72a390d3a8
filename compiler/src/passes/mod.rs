//! Graph-to-graph passes, one per file, each named for what it does.
//!
//! The pipeline order lives in [`crate::pipeline`].

mod cse;
mod dce;
mod lm_head_loss;

pub use cse::eliminate_common_subexpressions;
pub use dce::{eliminate_dead_code, eliminate_dead_code_keep_params, Pruned};
pub use lm_head_loss::fuse_lm_head_loss;
