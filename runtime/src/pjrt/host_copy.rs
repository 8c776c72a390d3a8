//! kiln's host copies: four XLA FFI handlers, registered through the PJRT
//! FFI extension, that move a value to pinned host memory and back on copy
//! streams of kiln's own, beside the kernels XLA runs.
//!
//! Why not XLA's host offload: XLA turns its placement annotations into
//! `copy-start`/`copy-done` pairs that its latency-hiding scheduler reorders
//! the backward around (more memory), and without that scheduler they run
//! between the kernels (docs/memory-journal.md, "Host offload at the tight
//! budgets"). A custom call is an ordinary instruction to that scheduler, so
//! the program keeps the order kiln's planner gave it, and the copies still
//! overlap the kernels because they run on other streams.
//!
//! One value's trip, by custom-call target (the compiler's lowering of
//! `Op::HostCopy`, which names the value's `slot`):
//! - `kiln_host_copy_out(v) -> token`: on the value's copy stream, after the
//!   kernels that precede it on XLA's stream, copy `v` to the slot's pinned
//!   buffer.
//! - `kiln_host_copy_out_done(v, token, ...) -> token`: XLA's stream waits
//!   for that copy. It reads `v`, so XLA keeps `v`'s buffer until here.
//! - `kiln_host_copy_in(token, ...) -> buf`: on the other copy stream, after
//!   the kernels that precede it, copy the slot back into `buf`, the buffer
//!   XLA assigned to the result.
//! - `kiln_host_copy_in_done(buf) -> buf` (aliased): XLA's stream waits for
//!   that copy; the value's readers read this result.
//!
//! On the CUDA plugin the state is per CUDA context (one per device, so
//! data-parallel replicas never share a slot): two copy streams (out and
//! in, one each way over the link), and per slot a pinned buffer and the
//! events that order the streams. Pinned buffers grow to the largest value a
//! slot has held and live as long as the process. On the CPU plugin (where
//! "device" memory is host memory) the handlers copy at once, and the token
//! carries the id of the host copy, so that CI runs the same programs.
//!
//! Invariants: a handler never unwinds into XLA (a panic becomes an FFI
//! error); a size that does not match the slot, an unknown slot or a failed
//! driver call is an FFI error naming the target and the slot, which XLA
//! returns as the execution's error.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;

use super::api::Api;

/// The custom-call targets, in the order of one value's trip.
pub const TARGETS: [&str; 4] =
    ["kiln_host_copy_out", "kiln_host_copy_out_done", "kiln_host_copy_in", "kiln_host_copy_in_done"];

#[derive(Clone, Copy, Debug)]
enum Step {
    Out,
    OutDone,
    In,
    InDone,
}

// ---- The XLA FFI C API (xla/ffi/api/c_api.h, API 0.1): the parts read. ----

#[repr(C)]
struct ExtBase {
    struct_size: usize,
    kind: c_int,
    next: *mut ExtBase,
}

#[repr(C)]
struct ApiVersion {
    struct_size: usize,
    extension_start: *mut ExtBase,
    major: c_int,
    minor: c_int,
}

/// `XLA_FFI_Metadata`: what a handler reports when XLA asks for it.
#[repr(C)]
struct Metadata {
    struct_size: usize,
    api_version: ApiVersion,
    traits: u32,
}

#[repr(C)]
struct MetadataExt {
    base: ExtBase,
    metadata: *mut Metadata,
}

/// `XLA_FFI_Args` and `XLA_FFI_Rets` (the same layout).
#[repr(C)]
struct List {
    struct_size: usize,
    extension_start: *mut ExtBase,
    size: i64,
    types: *const c_int,
    items: *const *mut c_void,
}

#[repr(C)]
struct ByteSpan {
    ptr: *const c_char,
    len: usize,
}

#[repr(C)]
struct Scalar {
    dtype: c_int,
    value: *const c_void,
}

#[repr(C)]
struct Attrs {
    struct_size: usize,
    extension_start: *mut ExtBase,
    size: i64,
    types: *const c_int,
    names: *const *const ByteSpan,
    attrs: *const *mut c_void,
}

#[repr(C)]
struct Buffer {
    struct_size: usize,
    extension_start: *mut ExtBase,
    dtype: c_int,
    data: *mut c_void,
    rank: i64,
    dims: *const i64,
}

#[repr(C)]
struct CallFrame {
    struct_size: usize,
    extension_start: *mut ExtBase,
    api: *const XlaApi,
    ctx: *mut c_void,
    stage: c_int,
    args: List,
    rets: List,
    attrs: Attrs,
}

#[repr(C)]
struct ErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut ExtBase,
    message: *const c_char,
    errc: c_int,
}

#[repr(C)]
struct StreamGetArgs {
    struct_size: usize,
    extension_start: *mut ExtBase,
    ctx: *mut c_void,
    stream: *mut c_void,
}

/// `XLA_FFI_Api`, up to `XLA_FFI_Stream_Get` (the table only grows).
#[repr(C)]
struct XlaApi {
    struct_size: usize,
    extension_start: *mut ExtBase,
    api_version: ApiVersion,
    internal_api: *mut c_void,
    error_create: Option<unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut c_void>,
    error_get_message: *const c_void,
    error_destroy: *const c_void,
    handler_register: *const c_void,
    stream_get: Option<unsafe extern "C" fn(*mut StreamGetArgs) -> *mut c_void>,
}

const EXTENSION_METADATA: c_int = 1;
const STAGE_EXECUTE: c_int = 3;
const ATTR_SCALAR: c_int = 3;
const DTYPE_S32: c_int = 4;
const DTYPE_S64: c_int = 5;
const ERROR_INTERNAL: c_int = 13;
const ERROR_INVALID_ARGUMENT: c_int = 3;

/// Bytes of one element of an `XLA_FFI_DataType` (xla_data.proto's
/// `PrimitiveType` numbers); `None` for a type kiln never moves.
fn element_bytes(dtype: c_int) -> Option<usize> {
    Some(match dtype {
        1 | 2 | 6 | 19 | 20 | 23..=25 | 28 | 29 => 1,
        3 | 7 | 10 | 16 => 2,
        4 | 8 | 11 => 4,
        5 | 9 | 12 | 15 => 8,
        18 => 16,
        _ => return None,
    })
}

/// What went wrong in a handler: the message and the FFI error code.
struct Failure(c_int, String);

type Outcome = Result<(), Failure>;

fn bad(message: String) -> Failure {
    Failure(ERROR_INVALID_ARGUMENT, message)
}

/// A buffer's data pointer and size in bytes.
///
/// # Safety
/// `b` points to a live `XLA_FFI_Buffer` whose `dims` has `rank` entries.
unsafe fn buffer(b: *const Buffer) -> Result<(*mut c_void, usize), Failure> {
    // SAFETY: the caller's contract.
    let b = unsafe { &*b };
    let elem = element_bytes(b.dtype).ok_or_else(|| bad(format!("element type {} has no size here", b.dtype)))?;
    let rank = usize::try_from(b.rank).map_err(|_| bad(format!("rank {}", b.rank)))?;
    // SAFETY: `dims` has `rank` entries (the caller's contract).
    let dims = if rank == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(b.dims, rank) } };
    let mut n = elem;
    for &d in dims {
        n = n
            .checked_mul(usize::try_from(d).map_err(|_| bad(format!("dimension {d}")))?)
            .ok_or_else(|| bad("size overflows".into()))?;
    }
    Ok((b.data, n))
}

/// The `index`th entry of an args or rets list, as a buffer.
///
/// # Safety
/// `list` is a live list of XLA's call frame.
unsafe fn entry(list: &List, index: usize, what: &str) -> Result<(*mut c_void, usize), Failure> {
    if index >= usize::try_from(list.size).unwrap_or(0) {
        return Err(bad(format!("{what} {index} is missing ({} given)", list.size)));
    }
    // SAFETY: `items` has `size` entries, each an `XLA_FFI_Buffer*` (the only
    // argument and result kind XLA passes for array operands).
    unsafe { buffer(*list.items.add(index) as *const Buffer) }
}

/// The `slot` attribute (a 32- or 64-bit integer scalar).
///
/// # Safety
/// `attrs` is the live attribute list of XLA's call frame.
unsafe fn slot_attr(attrs: &Attrs) -> Result<i64, Failure> {
    for i in 0..usize::try_from(attrs.size).unwrap_or(0) {
        // SAFETY: `names`, `types` and `attrs` have `size` entries; a name is
        // a byte span into XLA's attribute storage, live for the call.
        let (name, kind, value) = unsafe {
            let n = &**attrs.names.add(i);
            (std::slice::from_raw_parts(n.ptr as *const u8, n.len), *attrs.types.add(i), *attrs.attrs.add(i))
        };
        if name != b"slot" {
            continue;
        }
        if kind != ATTR_SCALAR {
            return Err(bad(format!("attribute `slot` is of kind {kind}, not a scalar")));
        }
        // SAFETY: a scalar attribute is an `XLA_FFI_Scalar` whose `value`
        // points to one element of `dtype`.
        let s = unsafe { &*(value as *const Scalar) };
        return match s.dtype {
            // SAFETY: as above, by the dtype just checked.
            DTYPE_S64 => Ok(unsafe { *(s.value as *const i64) }),
            // SAFETY: as above, by the dtype just checked.
            DTYPE_S32 => Ok(i64::from(unsafe { *(s.value as *const i32) })),
            t => Err(bad(format!("attribute `slot` has element type {t}, not an integer"))),
        };
    }
    Err(bad("the call has no `slot` attribute".into()))
}

// ---- The CPU plugin: copies at once, the token carries the copy's id. ----

/// The CPU plugin's host copies: the last id given, and each copy by id.
struct HostCopies {
    last: u64,
    held: Vec<(u64, Vec<u8>)>,
}

static HOST_COPIES: Mutex<HostCopies> = Mutex::new(HostCopies { last: 0, held: Vec::new() });

/// # Safety
/// `f` is XLA's live call frame at the execute stage.
unsafe fn run_host(f: &CallFrame, step: Step, slot: i64) -> Outcome {
    let mut copies = HOST_COPIES.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: the pointers come from XLA's call frame, valid for the call,
    // with the sizes `entry` computed from their dims; a token is a 64-bit
    // scalar by the lowering's signature, checked by size.
    unsafe {
        match step {
            Step::Out => {
                let (v, n) = entry(&f.args, 0, "operand")?;
                let (t, tn) = entry(&f.rets, 0, "result")?;
                token_size(tn)?;
                copies.last += 1;
                let id = copies.last;
                copies.held.push((id, std::slice::from_raw_parts(v as *const u8, n).to_vec()));
                *(t as *mut u64) = id;
            }
            Step::OutDone => {
                let (t, tn) = entry(&f.args, 1, "operand")?;
                let (r, rn) = entry(&f.rets, 0, "result")?;
                token_size(tn)?;
                token_size(rn)?;
                *(r as *mut u64) = *(t as *const u64);
            }
            Step::In => {
                let (t, tn) = entry(&f.args, 0, "operand")?;
                let (b, n) = entry(&f.rets, 0, "result")?;
                token_size(tn)?;
                let id = *(t as *const u64);
                let k = copies.held.iter().position(|(i, _)| *i == id).ok_or_else(|| {
                    bad(format!("slot {slot}: no host copy {id} (copied back twice, or never copied out)"))
                })?;
                let (_, data) = copies.held.swap_remove(k);
                if data.len() != n {
                    return Err(bad(format!("slot {slot}: {} bytes copied out, {n} asked back", data.len())));
                }
                std::ptr::copy_nonoverlapping(data.as_ptr(), b as *mut u8, n);
            }
            Step::InDone => copy_through(f)?,
        }
    }
    Ok(())
}

fn token_size(bytes: usize) -> Outcome {
    if bytes == 8 {
        Ok(())
    } else {
        Err(bad(format!("a token of {bytes} bytes, where the lowering makes 8")))
    }
}

/// `in_done` on the CPU: the result is its operand (aliased), or a copy of it.
///
/// # Safety
/// `f` is XLA's live call frame at the execute stage.
unsafe fn copy_through(f: &CallFrame) -> Outcome {
    // SAFETY: operand and result are live buffers of the call, of the sizes
    // `entry` read; they are the same buffer or do not overlap.
    unsafe {
        let (a, n) = entry(&f.args, 0, "operand")?;
        let (r, rn) = entry(&f.rets, 0, "result")?;
        if n != rn {
            return Err(bad(format!("operand of {n} bytes, result of {rn}")));
        }
        if a != r {
            std::ptr::copy_nonoverlapping(a as *const u8, r as *mut u8, n);
        }
    }
    Ok(())
}

// ---- The CUDA plugin: copy streams and pinned slots per context. ----

/// One slot's pinned buffer and the events that order its copies.
struct Slot {
    host: *mut c_void,
    capacity: usize,
    bytes: usize,
    /// Recorded on XLA's stream where a copy may start.
    ready: sys::CUevent,
    /// Recorded on the out stream when the copy to the host is done.
    copied_out: sys::CUevent,
    /// Recorded on the in stream when the copy back is done.
    copied_in: sys::CUevent,
}

/// A CUDA context's copy streams and slots.
struct Lanes {
    out: sys::CUstream,
    back: sys::CUstream,
    slots: HashMap<i64, Slot>,
}

/// Every context's lanes, by context handle.
struct Contexts(HashMap<usize, Lanes>);

// SAFETY: the raw handles inside are CUDA driver handles and pinned host
// pointers, usable from any thread; the map is only reached through the
// mutex below.
unsafe impl Send for Contexts {}

static CONTEXTS: Mutex<Option<Contexts>> = Mutex::new(None);

fn check(call: &str, status: sys::CUresult) -> Outcome {
    if status == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Failure(ERROR_INTERNAL, format!("{call} failed: {status:?}")))
    }
}

fn new_event() -> Result<sys::CUevent, Failure> {
    let mut e = std::ptr::null_mut();
    // SAFETY: writes one event handle; the handler's context is current.
    check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) })?;
    Ok(e)
}

fn new_stream() -> Result<sys::CUstream, Failure> {
    let mut s = std::ptr::null_mut();
    // SAFETY: writes one stream handle; the handler's context is current.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    })?;
    Ok(s)
}

/// # Safety
/// `f` is XLA's live call frame at the execute stage, from the CUDA plugin.
unsafe fn run_cuda(f: &CallFrame, step: Step, slot: i64) -> Outcome {
    // SAFETY: `api` is XLA's FFI table, valid for the call and at least as
    // long as the prefix declared in `XlaApi`.
    let api = unsafe { &*f.api };
    let stream_get = api.stream_get.ok_or_else(|| Failure(ERROR_INTERNAL, "XLA gave no stream getter".into()))?;
    let mut args = StreamGetArgs {
        struct_size: std::mem::size_of::<StreamGetArgs>(),
        extension_start: std::ptr::null_mut(),
        ctx: f.ctx,
        stream: std::ptr::null_mut(),
    };
    // SAFETY: the args struct is complete and lives across the call.
    let err = unsafe { stream_get(&mut args) };
    if !err.is_null() {
        return Err(Failure(ERROR_INTERNAL, "XLA gave no CUDA stream for the call".into()));
    }
    let stream = args.stream as sys::CUstream;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `stream` is XLA's live stream; one context handle is written.
    check("cuStreamGetCtx", unsafe { sys::cuStreamGetCtx(stream, &mut ctx) })?;
    // SAFETY: the context owns `stream`, so it is live; popped below.
    check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
    let out = {
        let mut all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
        let all = &mut all.get_or_insert_with(|| Contexts(HashMap::new())).0;
        // SAFETY: the call frame's contract, with `ctx` current.
        unsafe { step_cuda(f, step, slot, stream, ctx as usize, all) }
    };
    let mut popped = std::ptr::null_mut();
    // SAFETY: pops the context pushed above.
    let pop = check("cuCtxPopCurrent", unsafe { sys::cuCtxPopCurrent_v2(&mut popped) });
    out.and(pop)
}

/// # Safety
/// As [`run_cuda`], with the stream's context current.
unsafe fn step_cuda(
    f: &CallFrame,
    step: Step,
    slot: i64,
    stream: sys::CUstream,
    ctx: usize,
    all: &mut HashMap<usize, Lanes>,
) -> Outcome {
    let lanes = match all.entry(ctx) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(Lanes { out: new_stream()?, back: new_stream()?, slots: HashMap::new() })
        }
    };
    let (out, back) = (lanes.out, lanes.back);
    let known = |slots: &mut HashMap<i64, Slot>| -> Result<*mut Slot, Failure> {
        slots
            .get_mut(&slot)
            .map(|s| s as *mut Slot)
            .ok_or_else(|| bad(format!("slot {slot} was never copied out on this device")))
    };
    // SAFETY: buffer pointers and sizes come from XLA's call frame; the
    // events, streams and pinned buffers are this module's, live for the
    // process; the copies are ordered by the events as the module docs say,
    // so no copy reads a buffer XLA has reused.
    unsafe {
        match step {
            Step::Out => {
                let (v, n) = entry(&f.args, 0, "operand")?;
                if let std::collections::hash_map::Entry::Vacant(e) = lanes.slots.entry(slot) {
                    e.insert(Slot {
                        host: std::ptr::null_mut(),
                        capacity: 0,
                        bytes: 0,
                        ready: new_event()?,
                        copied_out: new_event()?,
                        copied_in: new_event()?,
                    });
                }
                let s = &mut *known(&mut lanes.slots)?;
                if s.capacity < n {
                    if !s.host.is_null() {
                        // The last copies from and into the old buffer end first.
                        check("cuEventSynchronize", sys::cuEventSynchronize(s.copied_out))?;
                        check("cuEventSynchronize", sys::cuEventSynchronize(s.copied_in))?;
                        check("cuMemFreeHost", sys::cuMemFreeHost(s.host))?;
                        s.host = std::ptr::null_mut();
                        s.capacity = 0;
                    }
                    let mut p = std::ptr::null_mut();
                    check("cuMemHostAlloc", sys::cuMemHostAlloc(&mut p, n, 0))?;
                    s.host = p;
                    s.capacity = n;
                }
                s.bytes = n;
                check("cuEventRecord", sys::cuEventRecord(s.ready, stream))?;
                check("cuStreamWaitEvent", sys::cuStreamWaitEvent(out, s.ready, 0))?;
                check("cuMemcpyDtoHAsync", sys::cuMemcpyDtoHAsync_v2(s.host, v as sys::CUdeviceptr, n, out))?;
                check("cuEventRecord", sys::cuEventRecord(s.copied_out, out))?;
            }
            Step::OutDone => {
                let s = &*known(&mut lanes.slots)?;
                check("cuStreamWaitEvent", sys::cuStreamWaitEvent(stream, s.copied_out, 0))?;
            }
            Step::In => {
                let (b, n) = entry(&f.rets, 0, "result")?;
                let s = &*known(&mut lanes.slots)?;
                if s.bytes != n {
                    return Err(bad(format!("slot {slot}: {} bytes copied out, {n} asked back", s.bytes)));
                }
                check("cuEventRecord", sys::cuEventRecord(s.ready, stream))?;
                check("cuStreamWaitEvent", sys::cuStreamWaitEvent(back, s.ready, 0))?;
                check("cuStreamWaitEvent", sys::cuStreamWaitEvent(back, s.copied_out, 0))?;
                check("cuMemcpyHtoDAsync", sys::cuMemcpyHtoDAsync_v2(b as sys::CUdeviceptr, s.host, n, back))?;
                check("cuEventRecord", sys::cuEventRecord(s.copied_in, back))?;
            }
            Step::InDone => {
                let (a, n) = entry(&f.args, 0, "operand")?;
                let (r, rn) = entry(&f.rets, 0, "result")?;
                let s = &*known(&mut lanes.slots)?;
                check("cuStreamWaitEvent", sys::cuStreamWaitEvent(stream, s.copied_in, 0))?;
                if n != rn {
                    return Err(bad(format!("operand of {n} bytes, result of {rn}")));
                }
                if a != r {
                    check(
                        "cuMemcpyDtoDAsync",
                        sys::cuMemcpyDtoDAsync_v2(r as sys::CUdeviceptr, a as sys::CUdeviceptr, n, stream),
                    )?;
                }
            }
        }
    }
    Ok(())
}

// ---- The handlers XLA calls. ----

#[derive(Clone, Copy)]
enum Platform {
    Host,
    Cuda,
}

/// The body of every handler.
///
/// # Safety
/// `frame` is the call frame XLA passes a registered FFI handler.
unsafe fn handle(frame: *mut CallFrame, step: Step, platform: Platform) -> *mut c_void {
    // SAFETY: XLA passes a live call frame.
    let f = unsafe { &*frame };
    // SAFETY: a non-null extension starts with `XLA_FFI_Extension_Base`.
    if !f.extension_start.is_null() && unsafe { (*f.extension_start).kind } == EXTENSION_METADATA {
        // XLA asks which FFI API the handler was built for, and its traits.
        // SAFETY: a metadata extension points to XLA's metadata struct.
        unsafe {
            let m = &mut *(*(f.extension_start as *mut MetadataExt)).metadata;
            m.api_version.major = 0;
            m.api_version.minor = 1;
            m.traits = 0;
        }
        return std::ptr::null_mut();
    }
    if f.stage != STAGE_EXECUTE {
        return std::ptr::null_mut();
    }
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the frame is XLA's, at the execute stage.
        let slot = unsafe { slot_attr(&f.attrs) }?;
        // SAFETY: as above; each platform's handler is registered only for it.
        unsafe {
            match platform {
                Platform::Host => run_host(f, step, slot),
                Platform::Cuda => run_cuda(f, step, slot),
            }
        }
        .map_err(|Failure(code, m)| Failure(code, format!("slot {slot}: {m}")))
    }));
    let Failure(code, message) = match run {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(failure)) => failure,
        Err(_) => Failure(ERROR_INTERNAL, "the handler panicked".into()),
    };
    let target = TARGETS[step as usize];
    let message = CString::new(format!("{target}: {message}").replace('\0', " ")).unwrap_or_default();
    // SAFETY: `api` is XLA's FFI table for the call.
    let Some(create) = (unsafe { &*f.api }).error_create else { return std::ptr::null_mut() };
    let mut args = ErrorCreateArgs {
        struct_size: std::mem::size_of::<ErrorCreateArgs>(),
        extension_start: std::ptr::null_mut(),
        message: message.as_ptr(),
        errc: code,
    };
    // SAFETY: XLA copies the message; the args live across the call.
    unsafe { create(&mut args) }
}

macro_rules! handlers {
    ($($name:ident: $step:expr, $platform:expr;)*) => {
        $(
            unsafe extern "C" fn $name(frame: *mut CallFrame) -> *mut c_void {
                // SAFETY: registered as an FFI handler, so called with XLA's frame.
                unsafe { handle(frame, $step, $platform) }
            }
        )*
    };
}

handlers! {
    host_out: Step::Out, Platform::Host;
    host_out_done: Step::OutDone, Platform::Host;
    host_in: Step::In, Platform::Host;
    host_in_done: Step::InDone, Platform::Host;
    cuda_out: Step::Out, Platform::Cuda;
    cuda_out_done: Step::OutDone, Platform::Cuda;
    cuda_in: Step::In, Platform::Cuda;
    cuda_in_done: Step::InDone, Platform::Cuda;
}

type Handler = unsafe extern "C" fn(*mut CallFrame) -> *mut c_void;

// ---- Registration through the PJRT FFI extension. ----

/// `PJRT_FFI_Register_Handler_Args` as both pinned plugins read it (the CPU
/// plugin 0.81 and the CUDA plugin 0.115, by their code: the handler at byte
/// 24, the platform's name at 32 and 40, the traits at 48, 52 bytes in all;
/// some published headers carry an `api_version` field the plugins do not
/// read). Registration is for typed FFI handlers only.
#[repr(C)]
struct RegisterArgs {
    struct_size: usize,
    target_name: *const c_char,
    target_name_size: usize,
    handler: *mut c_void,
    platform_name: *const c_char,
    platform_name_size: usize,
    traits: u32,
}

/// `PJRT_FFI_Extension`, version 2.
#[repr(C)]
struct FfiExtension {
    base: ExtBase,
    type_id_register: *const c_void,
    user_data_add: *const c_void,
    register_handler: Option<unsafe extern "C" fn(*mut RegisterArgs) -> *mut super::ffi::PJRT_Error>,
}

const PJRT_EXTENSION_FFI: u32 = 5;

/// Registers the four handlers with `api`'s plugin for its platform (`cpu`
/// or `cuda`), once per process and plugin. The error says why they are
/// not there: an FFI extension too old to register handlers, a platform
/// without them, or the plugin's refusal.
pub(crate) fn register(api: &'static Api, platform: &str) -> Result<(), String> {
    static DONE: OnceLock<Mutex<HashMap<String, Result<(), String>>>> = OnceLock::new();
    let done = DONE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = format!("{}:{platform}", api.path().display());
    let mut done = done.lock().unwrap_or_else(|e| e.into_inner());
    done.entry(key).or_insert_with(|| register_once(api, platform)).clone()
}

fn register_once(api: &'static Api, platform: &str) -> Result<(), String> {
    let (xla_platform, handlers): (&str, [Handler; 4]) = match platform {
        "cpu" => ("Host", [host_out, host_out_done, host_in, host_in_done]),
        "cuda" => {
            super::cuda::open_cuda_driver()?;
            ("CUDA", [cuda_out, cuda_out_done, cuda_in, cuda_in_done])
        }
        other => return Err(format!("kiln's host copies have no handlers for platform `{other}`")),
    };
    let ext = api.extension(PJRT_EXTENSION_FFI).ok_or("the plugin has no FFI extension")? as *const FfiExtension;
    // SAFETY: the FFI extension's struct starts with the base read above.
    let size = unsafe { (*ext).base.struct_size };
    if size < std::mem::size_of::<FfiExtension>() {
        return Err(format!("the plugin's FFI extension ({size} bytes) is too old to register handlers"));
    }
    // SAFETY: the struct is at least as long as `FfiExtension`.
    let register =
        unsafe { (*ext).register_handler }.ok_or("the plugin's FFI extension has no handler registration")?;
    for (target, handler) in TARGETS.iter().zip(handlers) {
        let mut args = RegisterArgs {
            struct_size: std::mem::offset_of!(RegisterArgs, traits) + std::mem::size_of::<u32>(),
            target_name: target.as_ptr() as *const c_char,
            target_name_size: target.len(),
            handler: handler as *mut c_void,
            platform_name: xla_platform.as_ptr() as *const c_char,
            platform_name_size: xla_platform.len(),
            traits: 0,
        };
        // SAFETY: the args are complete; the names are byte spans with sizes,
        // copied by the plugin; the handler is a `'static` function.
        let err = unsafe { register(&mut args) };
        api.check("PJRT_FFI_Register_Handler", err).map_err(|e| format!("registering {target}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_call_frame_has_the_headers_layout() {
        // Offsets of XLA_FFI_CallFrame's fields (xla/ffi/api/c_api.h).
        assert_eq!(std::mem::offset_of!(CallFrame, api), 16);
        assert_eq!(std::mem::offset_of!(CallFrame, stage), 32);
        assert_eq!(std::mem::offset_of!(CallFrame, args), 40);
        assert_eq!(std::mem::offset_of!(CallFrame, rets), 80);
        assert_eq!(std::mem::offset_of!(CallFrame, attrs), 120);
        assert_eq!(std::mem::offset_of!(XlaApi, error_create), 48);
        assert_eq!(std::mem::offset_of!(XlaApi, stream_get), 80);
        assert_eq!(std::mem::offset_of!(Buffer, data), 24);
        assert_eq!(std::mem::offset_of!(Metadata, traits), 32);
        assert_eq!(std::mem::offset_of!(RegisterArgs, handler), 24);
        assert_eq!(std::mem::offset_of!(RegisterArgs, traits) + 4, 52);
        assert_eq!(std::mem::size_of::<FfiExtension>(), 48);
    }
}
