//! The engine layer: what records, compiles and runs a step, over the core's
//! types.
//!
//! - `context`: the per-thread context (trace, program cache, executor);
//!   `replicas` and `partition`: where steps run (replica plan, active mesh
//!   and the layouts a step needs);
//! - `step`: cutting a step (`mark_step`); `compile`, `explain`, `dump`: the
//!   miss path; `program_cache`: the compiled programs; `compile_settings`:
//!   the setters that invalidate them; `param_init`: the parameters'-init
//!   mark;
//! - `executor`: the executor's state (backend, client, replica plan, the
//!   queue); `run`: running a program and tracking the steps in flight;
//!   `eager/`: the eager backend;
//! - `lower`: recording a function without running it; `undo_assigns`: the
//!   undo log that keeps a lowering free of side effects; `capture`: captured
//!   step functions;
//! - `device_checks`: values checked on the device; `scope`: which layer
//!   recorded which nodes.
//!
//! Invariant: a module here names only `crate::core` and `crate::engine`
//! (checked by the `layers` test in `lib.rs`); the one call up into the API,
//! device checks recording with `Tensor`'s ops, is documented in
//! `device_checks` and `lib.rs`.

pub(crate) mod capture;
pub(crate) mod compile;
pub(crate) mod compile_settings;
pub(crate) mod context;
pub(crate) mod device_checks;
pub mod dump;
pub(crate) mod eager;
pub(crate) mod executor;
pub(crate) mod explain;
pub(crate) mod lower;
pub(crate) mod param_init;
pub(crate) mod partition;
pub(crate) mod program_cache;
pub(crate) mod replicas;
pub(crate) mod run;
pub mod scope;
pub(crate) mod step;
pub(crate) mod undo_assigns;
