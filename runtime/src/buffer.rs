//! `Buffer`: an array on a device, owned by kiln.
//!
//! Invariants: a buffer holds its client (so the PJRT client outlives the
//! PJRT buffer); its element type, dims and device are read once when it is
//! made; every live `Buffer` is counted by [`live_buffer_count`].

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::client::{Client, Device};
use crate::element_type::ArgType;
use crate::element_type::{ElementType, NativeType};
use crate::error::{Result, RuntimeError};
use crate::pjrt::handles::{PendingHostCopy, RawBuffer};
use crate::pjrt::host::values_from_bytes as from_bytes;

static LIVE_BUFFERS: AtomicUsize = AtomicUsize::new(0);

/// Number of `Buffer`s alive in this process (for leak tests and metrics).
pub fn live_buffer_count() -> usize {
    LIVE_BUFFERS.load(Ordering::SeqCst)
}

/// A device buffer. `Send + Sync`; freed on drop.
pub struct Buffer {
    pub(crate) client: Client,
    pub(crate) raw: RawBuffer,
    ty: ElementType,
    dims: Vec<usize>,
    device_index: usize,
}

impl Buffer {
    pub(crate) fn from_parts(
        client: Client,
        raw: RawBuffer,
        ty: ElementType,
        dims: Vec<usize>,
        device_index: usize,
    ) -> Buffer {
        LIVE_BUFFERS.fetch_add(1, Ordering::SeqCst);
        Buffer { client, raw, ty, dims, device_index }
    }

    /// Wraps a buffer the plugin made (an execution output), reading its
    /// type, dims and device.
    pub(crate) fn from_plugin(client: &Client, raw: RawBuffer) -> Result<Buffer> {
        let raw_type = raw.element_type()?;
        let ty = ElementType::from_pjrt(raw_type).ok_or(RuntimeError::UnsupportedElementType { raw: raw_type })?;
        let dims = raw.dims()?.into_iter().map(|d| usize::try_from(d).unwrap_or(0)).collect();
        let device = raw.device()?;
        let device_index = client.inner.device_index(device).ok_or_else(|| RuntimeError::Pjrt {
            function: "PJRT_Buffer_Device",
            code: crate::error::PjrtErrorCode::Internal,
            message: "output buffer lives on a device that is not addressable by this client".into(),
        })?;
        Ok(Buffer::from_parts(client.clone(), raw, ty, dims, device_index))
    }

    pub fn element_type(&self) -> ElementType {
        self.ty
    }

    pub fn dims(&self) -> Vec<usize> {
        self.dims.clone()
    }

    /// Element type and dims together.
    pub fn arg_type(&self) -> ArgType {
        ArgType { ty: self.ty, dims: self.dims.clone() }
    }

    pub fn device(&self) -> Device {
        Device { client: self.client.clone(), index: self.device_index }
    }

    pub(crate) fn device_index(&self) -> usize {
        self.device_index
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Bytes the buffer occupies on the device.
    pub fn on_device_size_in_bytes(&self) -> Result<usize> {
        self.raw.on_device_size_in_bytes()
    }

    /// Copies the buffer to the host (dense, row-major). A host sync.
    pub fn to_host_bytes(&self) -> Result<Vec<u8>> {
        self.raw.to_host()
    }

    /// Starts the copy of [`Buffer::to_host_bytes`] and returns at once: the
    /// plugin copies once the buffer is defined (after the step in flight that
    /// produces it), and [`HostCopy::wait`] then finds the bytes ready
    /// instead of paying the copy's round trip.
    pub fn start_to_host_bytes(&self) -> Result<HostCopy> {
        Ok(HostCopy(self.raw.start_to_host()?))
    }

    /// Copies the buffer to the host as `T`, which must match its element type.
    pub fn to_vec<T: NativeType>(&self) -> Result<Vec<T>> {
        if T::TYPE != self.ty {
            return Err(RuntimeError::DTypeMismatch { requested: T::TYPE, actual: self.ty });
        }
        let bytes = self.to_host_bytes()?;
        let expected = self.arg_type().size_in_bytes();
        if bytes.len() != expected {
            return Err(RuntimeError::HostDataLength {
                ty: self.ty,
                dims: self.dims.clone(),
                expected,
                got: bytes.len(),
            });
        }
        Ok(from_bytes(&bytes))
    }
}

/// A copy to the host in flight ([`Buffer::start_to_host_bytes`]). Dropping
/// it unread waits for the copy.
pub struct HostCopy(PendingHostCopy);

impl HostCopy {
    /// Waits for the copy (if it has not finished) and returns the bytes.
    pub fn wait(self) -> Result<Vec<u8>> {
        self.0.wait()
    }
}

impl fmt::Debug for HostCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HostCopy")
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        LIVE_BUFFERS.fetch_sub(1, Ordering::SeqCst);
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Buffer({} on {:?})", self.arg_type(), self.device())
    }
}
