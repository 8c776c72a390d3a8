//! kiln's own binding to the PJRT C API (≥ 0.81), loaded at run time.
//!
//! This module is the only place in the crate with `unsafe` (the GPU probe's
//! few driver calls included, in `cuda`; the key-value store's callbacks, in `kv`). It offers small
//! RAII handles (`RawClient`, `RawBuffer`, `RawLoadedExecutable`, ...) whose
//! methods are safe: each owns exactly one PJRT object and frees it on drop,
//! and each keeps a `&'static Api` so the plugin it came from outlives it
//! (plugins are never unloaded). The typed, checked API lives one level up
//! (`client`, `buffer`, `executable`).

// The crate denies `unsafe` (Cargo.toml's lints); the C API needs it here.
#![allow(unsafe_code)]

pub(crate) mod api;
pub(crate) mod cuda;
pub mod ffi;
pub(crate) mod handles;
pub(crate) mod host;
pub mod host_copy;
pub mod kv;

pub(crate) use api::Api;
pub use api::{PluginExtension, REQUIRED_API_VERSION};
pub use cuda::CUDA_DRIVER_LIBRARY;

/// Ends the process with `code` at once: no exit handlers, no static
/// destructors (a plugin's may block on a collective whose peer is dead).
pub(crate) fn exit_immediately(code: i32) -> ! {
    // SAFETY: `_exit` takes no pointers, is async-signal-safe and never
    // returns; skipping the process's destructors is what it is for.
    unsafe { libc::_exit(code) }
}

/// Sizes and field offsets of every `#[repr(C)]` struct kiln declares, for the
/// test that compares them with the installed `pjrt_c_api.h`.
pub fn declared_layouts() -> &'static [ffi::StructLayout] {
    ffi::ALL_LAYOUTS
}
