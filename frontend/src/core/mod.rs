//! The core layer: the frontend's plain data and per-thread state, below the
//! engine and the API. Nothing here records an op, compiles, runs a step or
//! touches a device.
//!
//! - `error`: the one error type; `element`: host element types and the
//!   dtype ↔ element-type conversion; `limits`: host size limits;
//! - `settings`: this thread's switches, in one struct; `warnings`: the
//!   warnings kiln prints; `metrics`: the counters and the step timeline;
//!   `atomic_write`: the atomic file writer; `input`: reading the files a
//!   user names as input;
//! - `trace`: the step being recorded; `storage`: a tensor's state and where a
//!   ready value lives; `tensor`: the `Tensor` handle and what can be asked of
//!   it without recording; `mesh`: device meshes and shardings.
//!
//! Invariant: a module here names only `crate::core` (checked by the `layers`
//! test in `lib.rs`).

pub mod atomic_write;
pub(crate) mod element;
pub(crate) mod error;
pub mod input;
pub mod limits;
pub(crate) mod mesh;
pub(crate) mod metrics;
pub(crate) mod settings;
pub(crate) mod storage;
pub(crate) mod tensor;
pub(crate) mod trace;
pub mod warnings;
