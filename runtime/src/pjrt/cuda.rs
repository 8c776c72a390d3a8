//! The `unsafe` edges of the GPU probe ([`crate::gpu`]): opening the CUDA
//! driver library, and the two driver queries cudarc offers only as
//! `unsafe fn`. They sit here, not in `gpu.rs`, because every `unsafe` block
//! of the crate lives under `pjrt/` (STYLE rule 12).
//!
//! Invariants: the driver library is opened at most once per process and
//! never closed, so when cudarc's own loader opens it again by name the
//! library is already mapped and its initializers have run once. Nothing here
//! panics; cudarc's lazy symbol loader can, which is why [`crate::gpu`] calls
//! these on a thread of its own.

use std::ffi::c_int;
use std::sync::OnceLock;

use cudarc::driver::{result, sys, DriverError};
use libloading::Library;

/// The CUDA driver's library, by the soname the NVIDIA driver installs.
pub const CUDA_DRIVER_LIBRARY: &str = if cfg!(windows) { "nvcuda.dll" } else { "libcuda.so.1" };

static DRIVER: OnceLock<Result<Library, String>> = OnceLock::new();

/// Opens the CUDA driver library (once per process); the error is the
/// loader's message (`libcuda.so.1: cannot open shared object file ...`).
///
/// cudarc's loader panics when it finds no driver, so the probe asks this
/// first and calls cudarc only after it succeeded.
pub(crate) fn open_cuda_driver() -> Result<(), String> {
    let opened = DRIVER.get_or_init(|| {
        // SAFETY: opening a library runs its initializers. This is the NVIDIA
        // driver library found by the dynamic loader's own search, the one
        // every CUDA program loads; there is no way to load it without
        // trusting it.
        unsafe { Library::new(CUDA_DRIVER_LIBRARY) }.map_err(|e| e.to_string())
    });
    match opened {
        Ok(_) => Ok(()),
        Err(message) => Err(message.clone()),
    }
}

/// The CUDA version the driver supports, as (major, minor): 13000 → (13, 0).
/// `None` if the driver does not answer.
pub(crate) fn driver_version() -> Option<(i32, i32)> {
    let mut version: c_int = 0;
    // SAFETY: `cuDriverGetVersion(int*)` writes one int through a pointer that
    // is valid for the whole call and may be called before `cuInit`; the
    // driver library was opened by `open_cuda_driver` before the probe runs.
    let status = unsafe { sys::cuDriverGetVersion(&mut version) };
    status.result().ok().map(|()| (version / 1000, (version % 1000) / 10))
}

/// Total memory of `device` in bytes.
pub(crate) fn device_total_bytes(device: sys::CUdevice) -> Result<usize, DriverError> {
    // SAFETY: cudarc's only requirement is that `device` came from
    // `cuDeviceGet`, which is where every caller in `gpu` gets it, after a
    // successful `cuInit`; the call only writes the size it returns.
    unsafe { result::device::total_mem(device) }
}
