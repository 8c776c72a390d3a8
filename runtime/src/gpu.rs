//! GPU probe: the NVIDIA GPUs the CUDA driver shows this process, with their
//! names and memory, read through cudarc's driver API loaded at run time.
//!
//! Where it runs: before a CUDA client is created, to check `GPU_NUM_DEVICES`
//! ([`crate::replicas`]), and in `kiln devices`. It never touches PJRT.
//!
//! Invariants:
//! - [`probe_gpus`] never fails and never panics: a machine without the
//!   driver gets [`GpuProbe::NoDriver`], a driver that errors gets
//!   [`GpuProbe::DriverFailed`]; CPU use never depends on the outcome.
//! - The driver library is opened with a plain `dlopen` first, because
//!   cudarc's loader panics when it finds no library; whatever else panics
//!   inside cudarc (a symbol missing from an unusual driver) is caught as
//!   well, because the probe runs on a thread of its own and a panic there
//!   ends only that thread.
//! - That thread also keeps the CUDA contexts the probe makes current away
//!   from the caller's thread, where the PJRT CUDA plugin makes its own.
//! - GPUs are listed in driver ordinal order, the order `CUDA_VISIBLE_DEVICES`
//!   leaves them in, which is also the PJRT CUDA plugin's device order.

use std::fmt;

use cudarc::driver::{result, sys, CudaContext, DriverError};

use crate::pjrt::cuda;
use crate::pjrt::CUDA_DRIVER_LIBRARY;

/// One GPU as the CUDA driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Driver ordinal (0-based, after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    pub total_bytes: u64,
    /// Free memory when probed, seen from inside the probe's own context
    /// (which itself takes a few hundred MiB). `None` when no context could
    /// be made on the GPU, e.g. it is in exclusive-process mode and busy.
    pub free_bytes: Option<u64>,
}

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuProbe {
    /// The driver library could not be opened: no NVIDIA driver here.
    NoDriver {
        /// The library looked for (`libcuda.so.1`).
        library: &'static str,
        /// The dynamic loader's message.
        reason: String,
    },
    /// The driver loaded but a call failed (no usable device, a driver and
    /// kernel module mismatch, ...).
    DriverFailed {
        /// The driver function that failed (`cuInit`, ...).
        call: &'static str,
        /// The driver's error name and text.
        error: String,
    },
    /// The driver answered; `gpus` may be empty.
    Found {
        /// CUDA version the driver supports, e.g. (13, 0).
        driver_version: Option<(i32, i32)>,
        gpus: Vec<GpuInfo>,
    },
}

impl GpuProbe {
    /// The GPUs found (empty unless [`GpuProbe::Found`]).
    pub fn gpus(&self) -> &[GpuInfo] {
        match self {
            GpuProbe::Found { gpus, .. } => gpus,
            GpuProbe::NoDriver { .. } | GpuProbe::DriverFailed { .. } => &[],
        }
    }

    /// Whether the CUDA driver library could be loaded at all.
    pub fn driver_found(&self) -> bool {
        !matches!(self, GpuProbe::NoDriver { .. })
    }

    /// The GPUs as `[0] NVIDIA H100 80GB HBM3`, in ordinal order.
    pub fn gpu_names(&self) -> Vec<String> {
        self.gpus().iter().map(|g| format!("[{}] {}", g.ordinal, g.name)).collect()
    }
}

impl fmt::Display for GpuProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuProbe::NoDriver { library, reason } => {
                write!(f, "no CUDA driver found ({library}): {reason}")
            }
            GpuProbe::DriverFailed { call, error } => {
                write!(f, "the CUDA driver failed in {call}: {error}")
            }
            GpuProbe::Found { gpus, .. } if gpus.is_empty() => f.write_str("the CUDA driver shows no GPUs"),
            GpuProbe::Found { gpus, .. } => {
                let plural = if gpus.len() == 1 { "" } else { "s" };
                write!(f, "{} GPU{plural}: {}", gpus.len(), self.gpu_names().join(", "))
            }
        }
    }
}

/// Asks the CUDA driver for its GPUs. Never panics; without a driver the
/// answer is [`GpuProbe::NoDriver`] naming `libcuda.so.1`.
pub fn probe_gpus() -> GpuProbe {
    if let Err(reason) = cuda::open_cuda_driver() {
        return GpuProbe::NoDriver { library: CUDA_DRIVER_LIBRARY, reason };
    }
    let spawned = std::thread::Builder::new().name("kiln-gpu-probe".into()).spawn(probe_with_driver);
    let outcome = match spawned {
        Ok(handle) => handle.join().unwrap_or_else(|payload| GpuProbe::DriverFailed {
            call: "cudarc",
            error: format!("panicked: {}", panic_text(payload.as_ref())),
        }),
        Err(e) => GpuProbe::DriverFailed { call: "spawning the probe thread", error: e.to_string() },
    };
    tracing::debug!(%outcome, "GPU probe");
    outcome
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

/// `CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected`.
fn describe(e: &DriverError) -> String {
    match e.error_string() {
        Ok(text) => format!("{:?}: {}", e.0, text.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    }
}

/// The probe proper; runs on its own thread, the driver library known present.
fn probe_with_driver() -> GpuProbe {
    let driver_version = cuda::driver_version();
    if let Err(e) = result::init() {
        // The driver is installed but sees no GPU (none in the machine, or
        // `CUDA_VISIBLE_DEVICES` hides them all): an answer, not a failure.
        if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            return GpuProbe::Found { driver_version, gpus: Vec::new() };
        }
        return GpuProbe::DriverFailed { call: "cuInit", error: describe(&e) };
    }
    let count = match result::device::get_count() {
        Ok(n) => n,
        Err(e) => return GpuProbe::DriverFailed { call: "cuDeviceGetCount", error: describe(&e) },
    };
    let mut gpus = Vec::new();
    for ordinal in 0..count {
        match probe_one(ordinal) {
            Ok(gpu) => gpus.push(gpu),
            Err((call, e)) => {
                return GpuProbe::DriverFailed { call, error: format!("GPU {ordinal}: {}", describe(&e)) }
            }
        }
    }
    GpuProbe::Found { driver_version, gpus }
}

fn probe_one(ordinal: i32) -> Result<GpuInfo, (&'static str, DriverError)> {
    let device = result::device::get(ordinal).map_err(|e| ("cuDeviceGet", e))?;
    let name = result::device::get_name(device).map_err(|e| ("cuDeviceGetName", e))?;
    let total = cuda::device_total_bytes(device).map_err(|e| ("cuDeviceTotalMem", e))?;
    // Lossless: `ordinal` ranges over `0..count`.
    let index = ordinal as usize;
    // Free memory needs a context; the primary one is shared with whatever
    // else in the process uses the GPU, and is released when `ctx` drops.
    let free_bytes = match CudaContext::new(index).and_then(|ctx| ctx.mem_get_info()) {
        Ok((free, _total)) => Some(free as u64),
        Err(e) => {
            tracing::warn!(gpu = ordinal, error = %describe(&e), "no CUDA context for the free-memory query");
            None
        }
    };
    Ok(GpuInfo { ordinal: index, name, total_bytes: total as u64, free_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(ordinal: usize, name: &str) -> GpuInfo {
        GpuInfo { ordinal, name: name.into(), total_bytes: 80 << 30, free_bytes: Some(79 << 30) }
    }

    #[test]
    fn display_names_the_library_or_the_gpus() {
        let none = GpuProbe::NoDriver {
            library: "libcuda.so.1",
            reason: "libcuda.so.1: cannot open shared object file".into(),
        };
        assert_eq!(
            none.to_string(),
            "no CUDA driver found (libcuda.so.1): libcuda.so.1: cannot open shared object file"
        );
        let two =
            GpuProbe::Found { driver_version: Some((13, 0)), gpus: vec![gpu(0, "NVIDIA H100"), gpu(1, "NVIDIA H100")] };
        assert_eq!(two.to_string(), "2 GPUs: [0] NVIDIA H100, [1] NVIDIA H100");
        let zero = GpuProbe::Found { driver_version: None, gpus: vec![] };
        assert_eq!(zero.to_string(), "the CUDA driver shows no GPUs");
        assert!(zero.driver_found() && !none.driver_found());
    }
}
