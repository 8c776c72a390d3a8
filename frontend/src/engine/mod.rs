//! The frontend's engine layer.

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
pub mod scope;
pub(crate) mod step;
pub(crate) mod undo_assigns;
