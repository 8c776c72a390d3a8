//! The frontend's core layer.

pub mod atomic_write;
pub(crate) mod element;
pub(crate) mod error;
pub mod limits;
pub(crate) mod mesh;
pub(crate) mod metrics;
pub(crate) mod settings;
pub(crate) mod storage;
pub(crate) mod tensor;
pub(crate) mod trace;
pub mod warnings;
