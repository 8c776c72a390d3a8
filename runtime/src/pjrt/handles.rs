//! RAII handles over PJRT objects: client, device, buffer, event, loaded
//! executable and executable.
//!
//! Invariants: each handle owns one non-null PJRT object and destroys it
//! exactly once on drop; every event is awaited or destroyed; every handle
//! carries the `&'static Api` of the plugin that made it. Handles do no
//! argument validation beyond what memory safety needs: the checked API in
//! `client`/`buffer`/`executable` does that before calling in.

use std::ffi::c_char;
use std::ptr::{self, NonNull};

use super::api::{copy_bytes, copy_slice, copy_string, pjrt_call, Api};
use super::ffi;
use crate::error::{PjrtErrorCode, Result, RuntimeError};
use crate::memory_stats::CompiledMemoryStats;

fn null_handle(api: &Api, function: &'static str) -> RuntimeError {
    RuntimeError::Pjrt {
        function,
        code: PjrtErrorCode::Internal,
        message: format!("plugin {} returned a null handle", api.path().display()),
    }
}

fn non_null<T>(api: &Api, function: &'static str, ptr: *mut T) -> Result<NonNull<T>> {
    NonNull::new(ptr).ok_or_else(|| null_handle(api, function))
}

/// A value for a client-creation option (`PJRT_NamedValue`).
#[derive(Debug, Clone)]
pub(crate) enum OptionValue {
    Int64(i64),
    Int64List(Vec<i64>),
    Float(f32),
    Bool(bool),
}

/// An owned `PJRT_Client`.
pub(crate) struct RawClient {
    api: &'static Api,
    ptr: NonNull<ffi::PJRT_Client>,
    // The store the plugin's key-value callbacks reach (their `user_arg`
    // points into this box). Fields drop after `Drop::drop`, so it outlives
    // `PJRT_Client_Destroy`.
    _kv: Option<Box<super::kv::UserArg>>,
}

// SAFETY: PJRT clients are thread-safe (the C API contract of PjRtClient).
unsafe impl Send for RawClient {}
// SAFETY: as above.
unsafe impl Sync for RawClient {}

impl RawClient {
    /// Creates a client with `options`; with `kv`, the plugin's key-value
    /// callbacks are kiln's trampolines over that store.
    pub(crate) fn create(
        api: &'static Api,
        options: &[(String, OptionValue)],
        kv: Option<super::kv::UserArg>,
    ) -> Result<Self> {
        let named: Vec<ffi::PJRT_NamedValue> = options
            .iter()
            .map(|(name, value)| {
                let mut nv = ffi::PJRT_NamedValue::zeroed();
                nv.name = name.as_ptr().cast::<c_char>();
                nv.name_size = name.len();
                match value {
                    OptionValue::Int64(v) => {
                        nv.type_ = ffi::PJRT_NAMED_VALUE_INT64;
                        nv.value = ffi::NamedValueUnion { int64_value: *v };
                        nv.value_size = 1;
                    }
                    OptionValue::Int64List(list) => {
                        nv.type_ = ffi::PJRT_NAMED_VALUE_INT64_LIST;
                        nv.value = ffi::NamedValueUnion { int64_array_value: list.as_ptr() };
                        nv.value_size = list.len();
                    }
                    OptionValue::Float(v) => {
                        nv.type_ = ffi::PJRT_NAMED_VALUE_FLOAT;
                        nv.value = ffi::NamedValueUnion { float_value: *v };
                        nv.value_size = 1;
                    }
                    OptionValue::Bool(v) => {
                        nv.type_ = ffi::PJRT_NAMED_VALUE_BOOL;
                        nv.value = ffi::NamedValueUnion { bool_value: *v };
                        nv.value_size = 1;
                    }
                }
                nv
            })
            .collect();
        let mut args = ffi::PJRT_Client_Create_Args::zeroed();
        args.create_options = named.as_ptr();
        args.num_options = named.len();
        let kv = kv.map(Box::new);
        if let Some(user_arg) = &kv {
            super::kv::install(&mut args, user_arg);
        }
        // `named`, the strings and lists it points into, and `kv` outlive the call.
        pjrt_call!(api, PJRT_Client_Create, &mut args)?;
        Ok(RawClient { api, ptr: non_null(api, "PJRT_Client_Create", args.client)?, _kv: kv })
    }

    /// This process's index in a multi-process client (0 otherwise).
    pub(crate) fn process_index(&self) -> Result<i32> {
        let mut args = ffi::PJRT_Client_ProcessIndex_Args::zeroed();
        args.client = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Client_ProcessIndex, &mut args)?;
        Ok(args.process_index)
    }

    /// Every device of the run, addressable by this process or not.
    pub(crate) fn global_devices(&self) -> Result<Vec<RawDevice>> {
        let mut args = ffi::PJRT_Client_Devices_Args::zeroed();
        args.client = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Client_Devices, &mut args)?;
        Ok(copy_slice(args.devices, args.num_devices).into_iter().filter_map(NonNull::new).map(RawDevice).collect())
    }

    pub(crate) fn platform_name(&self) -> Result<String> {
        let mut args = ffi::PJRT_Client_PlatformName_Args::zeroed();
        args.client = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Client_PlatformName, &mut args)?;
        Ok(copy_string(args.platform_name, args.platform_name_size))
    }

    pub(crate) fn addressable_devices(&self) -> Result<Vec<RawDevice>> {
        let mut args = ffi::PJRT_Client_AddressableDevices_Args::zeroed();
        args.client = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Client_AddressableDevices, &mut args)?;
        Ok(copy_slice(args.addressable_devices, args.num_addressable_devices)
            .into_iter()
            .filter_map(NonNull::new)
            .map(RawDevice)
            .collect())
    }

    /// Copies `bytes` (dense, row-major) to a new buffer on `device` and waits
    /// until the plugin no longer reads `bytes`.
    pub(crate) fn buffer_from_host(
        &self,
        bytes: &[u8],
        element_type: i32,
        dims: &[i64],
        device: RawDevice,
    ) -> Result<RawBuffer> {
        let mut args = ffi::PJRT_Client_BufferFromHostBuffer_Args::zeroed();
        args.client = self.ptr.as_ptr();
        args.data = bytes.as_ptr().cast();
        args.type_ = element_type;
        args.dims = dims.as_ptr();
        args.num_dims = dims.len();
        args.host_buffer_semantics = ffi::PJRT_HOST_BUFFER_IMMUTABLE_UNTIL_TRANSFER_COMPLETES;
        args.device = device.0.as_ptr();
        // `bytes` stays borrowed until the done event below has completed.
        pjrt_call!(self.api, PJRT_Client_BufferFromHostBuffer, &mut args)?;
        let buffer =
            RawBuffer { api: self.api, ptr: non_null(self.api, "PJRT_Client_BufferFromHostBuffer", args.buffer)? };
        RawEvent::from_ptr(self.api, args.done_with_host_buffer).map_or(Ok(()), |e| e.wait())?;
        Ok(buffer)
    }

    pub(crate) fn compile(&self, code: &str, format: &str, options: &[u8]) -> Result<RawLoadedExecutable> {
        let mut program = ffi::PJRT_Program::zeroed();
        // The plugin only reads `code` during Compile (the C field is not const).
        program.code = code.as_ptr().cast_mut().cast::<c_char>();
        program.code_size = code.len();
        program.format = format.as_ptr().cast::<c_char>();
        program.format_size = format.len();
        let mut args = ffi::PJRT_Client_Compile_Args::zeroed();
        args.client = self.ptr.as_ptr();
        args.program = &program;
        args.compile_options = options.as_ptr().cast::<c_char>();
        args.compile_options_size = options.len();
        pjrt_call!(self.api, PJRT_Client_Compile, &mut args)?;
        Ok(RawLoadedExecutable { api: self.api, ptr: non_null(self.api, "PJRT_Client_Compile", args.executable)? })
    }

    pub(crate) fn deserialize_and_load(&self, bytes: &[u8]) -> Result<RawLoadedExecutable> {
        let mut args = ffi::PJRT_Executable_DeserializeAndLoad_Args::zeroed();
        args.client = self.ptr.as_ptr();
        args.serialized_executable = bytes.as_ptr().cast::<c_char>();
        args.serialized_executable_size = bytes.len();
        pjrt_call!(self.api, PJRT_Executable_DeserializeAndLoad, &mut args)?;
        Ok(RawLoadedExecutable {
            api: self.api,
            ptr: non_null(self.api, "PJRT_Executable_DeserializeAndLoad", args.loaded_executable)?,
        })
    }
}

impl Drop for RawClient {
    fn drop(&mut self) {
        let mut args = ffi::PJRT_Client_Destroy_Args::zeroed();
        args.client = self.ptr.as_ptr();
        if let Err(err) = pjrt_call!(self.api, PJRT_Client_Destroy, &mut args) {
            tracing::warn!(%err, "destroying a PJRT client failed");
        }
    }
}

/// A `PJRT_Device*`, owned by its client (valid while the client lives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawDevice(NonNull<ffi::PJRT_Device>);

// SAFETY: a device pointer is an immutable identity owned by a thread-safe client.
unsafe impl Send for RawDevice {}
// SAFETY: as above.
unsafe impl Sync for RawDevice {}

/// What kiln reads from a device description.
pub(crate) struct DeviceInfo {
    pub(crate) id: i32,
    pub(crate) process_index: i32,
    pub(crate) kind: String,
    pub(crate) debug_string: String,
}

impl RawDevice {
    /// Reads id, kind and debug string. `api` must be the plugin of the
    /// client that owns this device, and that client must be alive.
    pub(crate) fn info(self, api: &Api) -> Result<DeviceInfo> {
        let mut desc = ffi::PJRT_Device_GetDescription_Args::zeroed();
        desc.device = self.0.as_ptr();
        pjrt_call!(api, PJRT_Device_GetDescription, &mut desc)?;
        let mut id = ffi::PJRT_DeviceDescription_Id_Args::zeroed();
        id.device_description = desc.device_description;
        pjrt_call!(api, PJRT_DeviceDescription_Id, &mut id)?;
        let mut kind = ffi::PJRT_DeviceDescription_Kind_Args::zeroed();
        kind.device_description = desc.device_description;
        pjrt_call!(api, PJRT_DeviceDescription_Kind, &mut kind)?;
        let mut debug = ffi::PJRT_DeviceDescription_DebugString_Args::zeroed();
        debug.device_description = desc.device_description;
        pjrt_call!(api, PJRT_DeviceDescription_DebugString, &mut debug)?;
        let mut process = ffi::PJRT_DeviceDescription_ProcessIndex_Args::zeroed();
        process.device_description = desc.device_description;
        pjrt_call!(api, PJRT_DeviceDescription_ProcessIndex, &mut process)?;
        Ok(DeviceInfo {
            id: id.id,
            process_index: process.process_index,
            kind: copy_string(kind.device_kind, kind.device_kind_size),
            debug_string: copy_string(debug.debug_string, debug.debug_string_size),
        })
    }

    /// The allocator's limit on the bytes this device's buffers may take
    /// (`bytes_limit` of `PJRT_Device_MemoryStats`), `None` where the plugin
    /// does not set it. `api` must be the plugin of the client that owns this
    /// device, and that client must be alive.
    pub(crate) fn bytes_limit(self, api: &Api) -> Result<Option<i64>> {
        let stats = self.memory_stats(api)?;
        Ok(stats.bytes_limit_is_set.then_some(stats.bytes_limit))
    }

    /// The bytes this device's buffers take now and at most so far (`None`
    /// where the plugin does not track the peak). Same contract as
    /// [`RawDevice::bytes_limit`].
    pub(crate) fn bytes_in_use(self, api: &Api) -> Result<(i64, Option<i64>)> {
        let stats = self.memory_stats(api)?;
        Ok((stats.bytes_in_use, stats.peak_bytes_in_use_is_set.then_some(stats.peak_bytes_in_use)))
    }

    fn memory_stats(self, api: &Api) -> Result<ffi::PJRT_Device_MemoryStats_Args> {
        let mut stats = ffi::PJRT_Device_MemoryStats_Args::zeroed();
        stats.device = self.0.as_ptr();
        pjrt_call!(api, PJRT_Device_MemoryStats, &mut stats)?;
        Ok(stats)
    }
}

/// An owned `PJRT_Event`; destroyed on drop.
pub(crate) struct RawEvent {
    api: &'static Api,
    ptr: NonNull<ffi::PJRT_Event>,
}

// SAFETY: PJRT events are thread-safe (PjRtFuture's contract: awaiting and
// querying from any thread).
unsafe impl Send for RawEvent {}
// SAFETY: as above.
unsafe impl Sync for RawEvent {}

impl RawEvent {
    fn from_ptr(api: &'static Api, ptr: *mut ffi::PJRT_Event) -> Option<RawEvent> {
        NonNull::new(ptr).map(|ptr| RawEvent { api, ptr })
    }

    /// Blocks until the event is ready and returns its status. Awaiting an
    /// event that is already ready returns the same status again.
    pub(crate) fn wait(&self) -> Result<()> {
        let mut args = ffi::PJRT_Event_Await_Args::zeroed();
        args.event = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Event_Await, &mut args)
    }

    /// Whether the event has completed (successfully or not), without blocking.
    pub(crate) fn is_ready(&self) -> Result<bool> {
        let mut args = ffi::PJRT_Event_IsReady_Args::zeroed();
        args.event = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Event_IsReady, &mut args)?;
        Ok(args.is_ready)
    }
}

impl Drop for RawEvent {
    fn drop(&mut self) {
        let mut args = ffi::PJRT_Event_Destroy_Args::zeroed();
        args.event = self.ptr.as_ptr();
        if let Err(err) = pjrt_call!(self.api, PJRT_Event_Destroy, &mut args) {
            tracing::warn!(%err, "destroying a PJRT event failed");
        }
    }
}

/// An owned `PJRT_Buffer`. Its client must outlive it (the checked `Buffer`
/// holds the client).
pub(crate) struct RawBuffer {
    api: &'static Api,
    ptr: NonNull<ffi::PJRT_Buffer>,
}

// SAFETY: PJRT buffers are thread-safe (PjRtBuffer's contract).
unsafe impl Send for RawBuffer {}
// SAFETY: as above.
unsafe impl Sync for RawBuffer {}

impl RawBuffer {
    pub(crate) fn element_type(&self) -> Result<i32> {
        let mut args = ffi::PJRT_Buffer_ElementType_Args::zeroed();
        args.buffer = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Buffer_ElementType, &mut args)?;
        Ok(args.type_)
    }

    pub(crate) fn dims(&self) -> Result<Vec<i64>> {
        let mut args = ffi::PJRT_Buffer_Dimensions_Args::zeroed();
        args.buffer = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Buffer_Dimensions, &mut args)?;
        Ok(copy_slice(args.dims, args.num_dims))
    }

    pub(crate) fn device(&self) -> Result<RawDevice> {
        let mut args = ffi::PJRT_Buffer_Device_Args::zeroed();
        args.buffer = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Buffer_Device, &mut args)?;
        Ok(RawDevice(non_null(self.api, "PJRT_Buffer_Device", args.device)?))
    }

    pub(crate) fn on_device_size_in_bytes(&self) -> Result<usize> {
        let mut args = ffi::PJRT_Buffer_OnDeviceSizeInBytes_Args::zeroed();
        args.buffer = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Buffer_OnDeviceSizeInBytes, &mut args)?;
        Ok(args.on_device_size_in_bytes)
    }

    /// Copies the buffer to a new host vector (dense, row-major) and waits.
    pub(crate) fn to_host(&self) -> Result<Vec<u8>> {
        self.start_to_host()?.wait()
    }

    /// Enqueues the copy of the buffer to a new host vector and returns at
    /// once; the plugin runs it once the buffer is defined (after the step that
    /// produces it), without the host waiting for that.
    pub(crate) fn start_to_host(&self) -> Result<PendingHostCopy> {
        let mut query = ffi::PJRT_Buffer_ToHostBuffer_Args::zeroed();
        query.src = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Buffer_ToHostBuffer, &mut query)?;
        drop(RawEvent::from_ptr(self.api, query.event));
        let mut host = vec![0u8; query.dst_size];
        let mut args = ffi::PJRT_Buffer_ToHostBuffer_Args::zeroed();
        args.src = self.ptr.as_ptr();
        args.dst = host.as_mut_ptr().cast();
        args.dst_size = host.len();
        // `host`'s heap block (which moving the Vec does not move) is not
        // touched or freed until the event has completed (PendingHostCopy).
        pjrt_call!(self.api, PJRT_Buffer_ToHostBuffer, &mut args)?;
        Ok(PendingHostCopy { host, event: RawEvent::from_ptr(self.api, args.event) })
    }
}

/// A copy to the host in flight ([`RawBuffer::start_to_host`]): owns the
/// destination until the plugin's event says the copy is done; dropping it
/// unawaited waits first, so the plugin never writes into freed memory.
pub(crate) struct PendingHostCopy {
    host: Vec<u8>,
    event: Option<RawEvent>,
}

impl PendingHostCopy {
    /// Waits for the copy and returns the bytes.
    pub(crate) fn wait(mut self) -> Result<Vec<u8>> {
        if let Some(event) = self.event.take() {
            event.wait()?;
        }
        Ok(std::mem::take(&mut self.host))
    }
}

impl Drop for PendingHostCopy {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            if let Err(err) = event.wait() {
                tracing::warn!(%err, "a copy to the host failed before its result was read");
            }
        }
    }
}

impl Drop for RawBuffer {
    fn drop(&mut self) {
        let mut args = ffi::PJRT_Buffer_Destroy_Args::zeroed();
        args.buffer = self.ptr.as_ptr();
        if let Err(err) = pjrt_call!(self.api, PJRT_Buffer_Destroy, &mut args) {
            tracing::warn!(%err, "destroying a PJRT buffer failed");
        }
    }
}

/// An owned `PJRT_LoadedExecutable`.
pub(crate) struct RawLoadedExecutable {
    api: &'static Api,
    ptr: NonNull<ffi::PJRT_LoadedExecutable>,
}

// SAFETY: PJRT loaded executables are thread-safe (concurrent Execute is allowed).
unsafe impl Send for RawLoadedExecutable {}
// SAFETY: as above.
unsafe impl Sync for RawLoadedExecutable {}

impl RawLoadedExecutable {
    pub(crate) fn executable(&self) -> Result<RawExecutable> {
        let mut args = ffi::PJRT_LoadedExecutable_GetExecutable_Args::zeroed();
        args.loaded_executable = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_LoadedExecutable_GetExecutable, &mut args)?;
        Ok(RawExecutable {
            api: self.api,
            ptr: non_null(self.api, "PJRT_LoadedExecutable_GetExecutable", args.executable)?,
        })
    }

    pub(crate) fn addressable_devices(&self) -> Result<Vec<RawDevice>> {
        let mut args = ffi::PJRT_LoadedExecutable_AddressableDevices_Args::zeroed();
        args.executable = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_LoadedExecutable_AddressableDevices, &mut args)?;
        Ok(copy_slice(args.addressable_devices, args.num_addressable_devices)
            .into_iter()
            .filter_map(NonNull::new)
            .map(RawDevice)
            .collect())
    }

    /// Enqueues a run on every device of the executable: `arguments[device][arg]`,
    /// and returns `[device][output]` with one completion event per device
    /// (fewer when the plugin returns none, which means it finished inline).
    /// Output buffers may be read or passed to later executions at once: the
    /// plugin orders those after the run.
    ///
    /// Arguments whose index is not in `non_donatable` may be donated (the
    /// plugin deletes them if the program aliases them); the caller still
    /// owns and later destroys every argument handle. Destroying an argument
    /// handle while the run is in flight is allowed: PJRT defers freeing the
    /// memory until the run's uses of it have completed.
    pub(crate) fn execute(
        &self,
        arguments: &[Vec<&RawBuffer>],
        non_donatable: &[i64],
        num_outputs: usize,
    ) -> Result<(Vec<Vec<RawBuffer>>, Vec<RawEvent>)> {
        let num_devices = arguments.len();
        let num_args = arguments.first().map_or(0, Vec::len);
        let arg_ptrs: Vec<Vec<*mut ffi::PJRT_Buffer>> =
            arguments.iter().map(|list| list.iter().map(|b| b.ptr.as_ptr()).collect()).collect();
        let arg_lists: Vec<*const *mut ffi::PJRT_Buffer> = arg_ptrs.iter().map(|l| l.as_ptr()).collect();
        let mut out_ptrs: Vec<Vec<*mut ffi::PJRT_Buffer>> = vec![vec![ptr::null_mut(); num_outputs]; num_devices];
        let out_lists: Vec<*mut *mut ffi::PJRT_Buffer> = out_ptrs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut events: Vec<*mut ffi::PJRT_Event> = vec![ptr::null_mut(); num_devices];

        let mut options = ffi::PJRT_ExecuteOptions::zeroed();
        // XLA keys every collective's rendezvous by the launch id (its run
        // id): with the same id for every execution, a replica of one run and
        // a replica of the next could meet in one rendezvous. Each execution
        // gets its own (positive, wrapping) id.
        options.launch_id = next_launch_id();
        options.non_donatable_input_indices = non_donatable.as_ptr();
        options.num_non_donatable_input_indices = non_donatable.len();
        let mut args = ffi::PJRT_LoadedExecutable_Execute_Args::zeroed();
        args.executable = self.ptr.as_ptr();
        args.options = &mut options;
        args.argument_lists = arg_lists.as_ptr();
        args.num_devices = num_devices;
        args.num_args = num_args;
        args.output_lists = out_lists.as_ptr();
        args.device_complete_events = events.as_mut_ptr();
        // All lists above outlive the call; the plugin writes outputs and
        // events into `out_ptrs` and `events`.
        pjrt_call!(self.api, PJRT_LoadedExecutable_Execute, &mut args)?;

        // Take ownership of everything the plugin returned before checking
        // anything, so that an error path frees all of it.
        let events: Vec<RawEvent> = events.into_iter().filter_map(|e| RawEvent::from_ptr(self.api, e)).collect();
        let outputs: Vec<Vec<Option<RawBuffer>>> = out_ptrs
            .into_iter()
            .map(|list| list.into_iter().map(|p| NonNull::new(p).map(|ptr| RawBuffer { api: self.api, ptr })).collect())
            .collect();
        let outputs = outputs
            .into_iter()
            .map(|list| {
                list.into_iter()
                    .map(|b| b.ok_or_else(|| null_handle(self.api, "PJRT_LoadedExecutable_Execute")))
                    .collect()
            })
            .collect::<Result<Vec<Vec<RawBuffer>>>>()?;
        Ok((outputs, events))
    }
}

impl Drop for RawLoadedExecutable {
    fn drop(&mut self) {
        let mut args = ffi::PJRT_LoadedExecutable_Destroy_Args::zeroed();
        args.executable = self.ptr.as_ptr();
        if let Err(err) = pjrt_call!(self.api, PJRT_LoadedExecutable_Destroy, &mut args) {
            tracing::warn!(%err, "destroying a PJRT loaded executable failed");
        }
    }
}

/// An owned `PJRT_Executable` (the compiled program, without device binding).
pub(crate) struct RawExecutable {
    api: &'static Api,
    ptr: NonNull<ffi::PJRT_Executable>,
}

// SAFETY: queries on a compiled executable are thread-safe and it is immutable.
unsafe impl Send for RawExecutable {}
// SAFETY: as above.
unsafe impl Sync for RawExecutable {}

impl RawExecutable {
    pub(crate) fn num_replicas(&self) -> Result<usize> {
        let mut args = ffi::PJRT_Executable_NumReplicas_Args::zeroed();
        args.executable = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Executable_NumReplicas, &mut args)?;
        Ok(args.num_replicas)
    }

    pub(crate) fn num_outputs(&self) -> Result<usize> {
        let mut args = ffi::PJRT_Executable_NumOutputs_Args::zeroed();
        args.executable = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Executable_NumOutputs, &mut args)?;
        Ok(args.num_outputs)
    }

    /// `None` when the plugin does not implement fingerprints.
    pub(crate) fn fingerprint(&self) -> Result<Option<String>> {
        let mut args = ffi::PJRT_Executable_Fingerprint_Args::zeroed();
        args.executable = self.ptr.as_ptr();
        match pjrt_call!(self.api, PJRT_Executable_Fingerprint, &mut args) {
            Ok(()) => Ok(Some(copy_string(args.executable_fingerprint, args.executable_fingerprint_size))),
            Err(RuntimeError::Pjrt { code: PjrtErrorCode::Unimplemented, .. }) => Ok(None),
            Err(err) => Err(err),
        }
    }

    pub(crate) fn compiled_memory_stats(&self) -> Result<CompiledMemoryStats> {
        let mut a = ffi::PJRT_Executable_GetCompiledMemoryStats_Args::zeroed();
        a.executable = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Executable_GetCompiledMemoryStats, &mut a)?;
        Ok(CompiledMemoryStats {
            generated_code_size_in_bytes: a.generated_code_size_in_bytes,
            argument_size_in_bytes: a.argument_size_in_bytes,
            output_size_in_bytes: a.output_size_in_bytes,
            alias_size_in_bytes: a.alias_size_in_bytes,
            temp_size_in_bytes: a.temp_size_in_bytes,
            host_generated_code_size_in_bytes: a.host_generated_code_size_in_bytes,
            host_argument_size_in_bytes: a.host_argument_size_in_bytes,
            host_output_size_in_bytes: a.host_output_size_in_bytes,
            host_alias_size_in_bytes: a.host_alias_size_in_bytes,
            host_temp_size_in_bytes: a.host_temp_size_in_bytes,
            peak_memory_in_bytes: a.peak_memory_in_bytes,
        })
    }

    /// The plugin's serialization of the executable (copied; the plugin's
    /// memory is freed with its deleter).
    pub(crate) fn serialize(&self) -> Result<Vec<u8>> {
        let mut args = ffi::PJRT_Executable_Serialize_Args::zeroed();
        args.executable = self.ptr.as_ptr();
        pjrt_call!(self.api, PJRT_Executable_Serialize, &mut args)?;
        let bytes = copy_bytes(args.serialized_bytes, args.serialized_bytes_size);
        if let (Some(deleter), false) = (args.serialized_executable_deleter, args.serialized_executable.is_null()) {
            // SAFETY: the plugin handed us `serialized_executable` together
            // with its deleter; it is freed once, after the bytes were copied.
            unsafe { deleter(args.serialized_executable) };
        }
        Ok(bytes)
    }
}

impl Drop for RawExecutable {
    fn drop(&mut self) {
        let mut args = ffi::PJRT_Executable_Destroy_Args::zeroed();
        args.executable = self.ptr.as_ptr();
        if let Err(err) = pjrt_call!(self.api, PJRT_Executable_Destroy, &mut args) {
            tracing::warn!(%err, "destroying a PJRT executable failed");
        }
    }
}

/// A fresh launch id for each execution of this process: 1, 2, ... wrapping
/// back to 1 before `c_int::MAX` (ids only need to differ between runs that
/// could be in flight together).
fn next_launch_id() -> std::ffi::c_int {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) % (std::ffi::c_int::MAX as u32);
    (n + 1) as std::ffi::c_int
}
