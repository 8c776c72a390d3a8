//! The `extern "C"` trampolines PJRT calls for its key-value store
//! (`PJRT_Client_Create_Args::kv_get_callback` and friends), forwarding to a
//! [`KeyValueStore`].
//!
//! Ownership rules (the header's contract, kept here):
//! - `user_arg` points to an `Arc<dyn KeyValueStore>` owned by the
//!   `RawClient`, which outlives the PJRT client (it is freed after
//!   `PJRT_Client_Destroy` returns);
//! - a value returned by `get`/`try_get` is a heap block kiln allocated,
//!   handed over with [`delete_value`] as `value_deleter_callback`; the plugin
//!   copies it and calls the deleter once. Every live block is registered, so
//!   a second delete (or a pointer that is not ours) is logged and ignored
//!   instead of freeing twice;
//! - errors are `PJRT_Error*`s made by the plugin's `callback_error` with a
//!   PJRT code (`NOT_FOUND` for try-get, `DEADLINE_EXCEEDED` for a timed-out
//!   get); on error no value is handed over;
//! - no panic unwinds into the plugin: each trampoline runs under
//!   `catch_unwind` and turns a panic into an `INTERNAL` error.

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::ffi;
use crate::distributed::store::KeyValueStore;
use crate::distributed::wire::Status;
use crate::error::RuntimeError;

/// What `user_arg` points to.
pub(crate) type UserArg = Arc<dyn KeyValueStore>;

const HEADER: usize = std::mem::size_of::<usize>();

/// Addresses of the value blocks handed to the plugin and not yet deleted.
static OUTSTANDING: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn outstanding() -> std::sync::MutexGuard<'static, Option<HashSet<usize>>> {
    // Insert/remove cannot be left half-done, so a poisoned set is usable.
    OUTSTANDING.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `value` was handed to the plugin and not yet deleted.
pub fn is_outstanding(value: *const c_char) -> bool {
    outstanding().as_ref().is_some_and(|s| s.contains(&(value as usize)))
}

/// Copies `bytes` into a block `[len: usize][bytes]` and returns a pointer
/// to the bytes; [`delete_value`] finds the length in front of them.
fn alloc_value(bytes: &[u8]) -> (*mut c_char, usize) {
    let mut block = Vec::with_capacity(HEADER + bytes.len());
    block.extend_from_slice(&bytes.len().to_ne_bytes());
    block.extend_from_slice(bytes);
    let base = Box::into_raw(block.into_boxed_slice()).cast::<u8>();
    // SAFETY: the block is HEADER + len bytes long, so base + HEADER is in
    // bounds (one past the end when len == 0, which is allowed).
    let data = unsafe { base.add(HEADER) }.cast::<c_char>();
    outstanding().get_or_insert_with(HashSet::new).insert(data as usize);
    (data, bytes.len())
}

/// The deleter handed out with every value: frees a block made by
/// `alloc_value`, exactly once.
///
/// # Safety
/// `value` is null or a pointer this module handed out; anything else that
/// is not registered is ignored.
pub(crate) unsafe extern "C" fn delete_value(value: *mut c_char) {
    let _ = catch_unwind(|| {
        if value.is_null() {
            return;
        }
        let known = outstanding().as_mut().is_some_and(|s| s.remove(&(value as usize)));
        if !known {
            tracing::error!(
                ptr = ?value,
                "PJRT deleted a key-value store value twice, or one kiln did not hand out; ignored"
            );
            return;
        }
        // SAFETY: `value` was registered by `alloc_value` and has just been
        // unregistered, so it is a live block's data pointer, HEADER bytes
        // after the block's start, freed by no one else; the length stored
        // there gives the boxed slice's exact size.
        unsafe {
            let base = value.cast::<u8>().sub(HEADER);
            let len = ptr::read_unaligned(base.cast::<usize>());
            drop(Box::from_raw(ptr::slice_from_raw_parts_mut(base, HEADER + len)));
        }
    });
}

/// The PJRT code for a store error.
fn code_of(err: &RuntimeError) -> c_int {
    match err {
        RuntimeError::KvNotFound { .. } => 5,      // NOT_FOUND
        RuntimeError::KvDeadline { .. } => 4,      // DEADLINE_EXCEEDED
        RuntimeError::KvAlreadyExists { .. } => 6, // ALREADY_EXISTS
        RuntimeError::KvUnavailable { .. } => 14,  // UNAVAILABLE
        RuntimeError::KvProtocol { .. } => 13,     // INTERNAL
        RuntimeError::KvStoreFull { .. } => 8,     // RESOURCE_EXHAUSTED
        RuntimeError::KvRefused { refusal, .. } => match refusal {
            Status::Unauthenticated => 16,        // UNAUTHENTICATED
            Status::TooLarge | Status::Full => 8, // RESOURCE_EXHAUSTED
            Status::NodeClaimed => 7,             // PERMISSION_DENIED
            Status::Busy => 14,                   // UNAVAILABLE
            Status::BadRequest => 3,              // INVALID_ARGUMENT
            Status::Ok | Status::NotFound | Status::Deadline | Status::AlreadyExists => 13, // not refusals
        },
        _ => 13,
    }
}

/// Builds the plugin's error object for `code` and `message`; null when the
/// plugin gave no error constructor (then nothing better can be returned).
unsafe fn make_error(callback_error: *mut ffi::PJRT_CallbackError, code: c_int, message: &str) -> *mut ffi::PJRT_Error {
    if callback_error.is_null() {
        tracing::error!(message, "PJRT gave the key-value callback no error constructor");
        return ptr::null_mut();
    }
    // SAFETY: non-null, and the plugin keeps the pointed-to function pointer
    // alive for the duration of the callback.
    match unsafe { *callback_error } {
        // SAFETY: `message` outlives the call; the plugin copies it.
        Some(f) => unsafe { f(code, message.as_ptr().cast::<c_char>(), message.len()) },
        None => ptr::null_mut(),
    }
}

/// Reads the store behind `user_arg`.
unsafe fn store<'a>(user_arg: *mut c_void) -> Result<&'a UserArg, RuntimeError> {
    if user_arg.is_null() {
        return Err(RuntimeError::KvProtocol { addr: "PJRT callback".into(), reason: "user_arg is null".into() });
    }
    // SAFETY: kiln sets user_arg to a `*const UserArg` owned by the
    // RawClient, which outlives every callback of its PJRT client.
    Ok(unsafe { &*user_arg.cast::<UserArg>() })
}

/// Copies the key the plugin passed.
unsafe fn key(ptr: *const c_char, len: usize) -> Result<String, RuntimeError> {
    let bytes = if ptr.is_null() || len == 0 {
        &[][..]
    } else {
        // SAFETY: the plugin passes `ptr[..len]`, alive during the callback.
        unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }
    };
    String::from_utf8(bytes.to_vec()).map_err(|_| RuntimeError::KvProtocol {
        addr: "PJRT callback".into(),
        reason: format!("key is not UTF-8: {}", String::from_utf8_lossy(bytes)),
    })
}

/// Turns a trampoline's outcome into its return value.
unsafe fn finish(
    outcome: std::thread::Result<Result<(), RuntimeError>>,
    callback_error: *mut ffi::PJRT_CallbackError,
    what: &str,
) -> *mut ffi::PJRT_Error {
    match outcome {
        Ok(Ok(())) => ptr::null_mut(),
        // SAFETY: `callback_error` came from the plugin's args.
        Ok(Err(err)) => unsafe { make_error(callback_error, code_of(&err), &err.to_string()) },
        Err(_) => {
            let message = format!("kiln's key-value {what} callback panicked");
            // SAFETY: as above.
            unsafe { make_error(callback_error, 13, &message) }
        }
    }
}

/// The two value-returning callbacks' argument structs, which differ only in
/// `timeout_in_ms`: what [`serve_value`] reads from and writes to.
trait ValueArgs {
    fn callback_error(&self) -> *mut ffi::PJRT_CallbackError;
    fn user_arg(&self) -> *mut c_void;
    fn key(&self) -> (*const c_char, usize);
    fn hand_over(&mut self, value: *mut c_char, len: usize);
}

macro_rules! value_args {
    ($args:ty) => {
        impl ValueArgs for $args {
            fn callback_error(&self) -> *mut ffi::PJRT_CallbackError {
                self.callback_error
            }
            fn user_arg(&self) -> *mut c_void {
                self.user_arg
            }
            fn key(&self) -> (*const c_char, usize) {
                (self.key, self.key_size)
            }
            fn hand_over(&mut self, value: *mut c_char, len: usize) {
                self.value = value;
                self.value_size = len;
                self.value_deleter_callback = Some(delete_value);
            }
        }
    };
}
value_args!(ffi::PJRT_KeyValueGetCallback_Args);
value_args!(ffi::PJRT_KeyValueTryGetCallback_Args);

/// The body of both value-returning trampolines: `fetch` the key's value
/// from the store and hand the plugin a copy (see the module's ownership
/// rules), or return the plugin's error object.
///
/// # Safety
/// `args` is null or a valid, exclusive args struct whose `user_arg` kiln set
/// (see [`install`]) and whose pointers stay valid for the call.
unsafe fn serve_value<A: ValueArgs>(
    args: *mut A,
    what: &str,
    fetch: impl FnOnce(&UserArg, &str, &A) -> Result<Vec<u8>, RuntimeError>,
) -> *mut ffi::PJRT_Error {
    if args.is_null() {
        return ptr::null_mut();
    }
    // SAFETY: the plugin passes a valid, exclusive args struct.
    let callback_error = unsafe { (*args).callback_error() };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as above; only this callback touches it until we return.
        let a = unsafe { &mut *args };
        let (key_ptr, key_len) = a.key();
        // SAFETY: user_arg and key come from the plugin as set up by kiln.
        let (store, key) = unsafe { (store(a.user_arg())?, key(key_ptr, key_len)?) };
        let value = fetch(store, &key, a)?;
        let (ptr, len) = alloc_value(&value);
        a.hand_over(ptr, len);
        Ok(())
    }));
    // SAFETY: `callback_error` was read from the plugin's args above.
    unsafe { finish(outcome, callback_error, what) }
}

/// `PJRT_KeyValueGetCallback`: blocks up to `timeout_in_ms` (a negative
/// timeout waits as long as an `int` of milliseconds allows).
///
/// # Safety
/// `args` is null or a valid, exclusive `PJRT_KeyValueGetCallback_Args` whose `user_arg` kiln set
/// (see [`install`]) and whose pointers stay valid for the call.
pub(crate) unsafe extern "C" fn kv_get(args: *mut ffi::PJRT_KeyValueGetCallback_Args) -> *mut ffi::PJRT_Error {
    // SAFETY: the caller's contract is serve_value's.
    unsafe {
        serve_value(args, "get", |store, key, a| {
            let ms = if a.timeout_in_ms < 0 { c_int::MAX } else { a.timeout_in_ms };
            store.get(key, Duration::from_millis(ms as u64))
        })
    }
}

/// `PJRT_KeyValueTryGetCallback`: `NOT_FOUND` at once when the key is absent.
///
/// # Safety
/// `args` is null or a valid, exclusive `PJRT_KeyValueTryGetCallback_Args` whose `user_arg` kiln set
/// (see [`install`]) and whose pointers stay valid for the call.
pub(crate) unsafe extern "C" fn kv_try_get(args: *mut ffi::PJRT_KeyValueTryGetCallback_Args) -> *mut ffi::PJRT_Error {
    // SAFETY: the caller's contract is serve_value's.
    unsafe { serve_value(args, "try-get", |store, key, _| store.try_get(key)) }
}

/// `PJRT_KeyValuePutCallback`: copies the value into the store.
///
/// # Safety
/// `args` is null or a valid, exclusive `PJRT_KeyValuePutCallback_Args` whose `user_arg` kiln set
/// (see [`install`]) and whose pointers stay valid for the call.
pub(crate) unsafe extern "C" fn kv_put(args: *mut ffi::PJRT_KeyValuePutCallback_Args) -> *mut ffi::PJRT_Error {
    if args.is_null() {
        return ptr::null_mut();
    }
    // SAFETY: the plugin passes a valid args struct.
    let callback_error = unsafe { (*args).callback_error };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as above.
        let a = unsafe { &*args };
        // SAFETY: user_arg and key come from the plugin as set up by kiln.
        let (store, key) = unsafe { (store(a.user_arg)?, key(a.key, a.key_size)?) };
        let value = if a.value.is_null() || a.value_size == 0 {
            &[][..]
        } else {
            // SAFETY: the plugin passes `value[..value_size]`, alive during the call.
            unsafe { std::slice::from_raw_parts(a.value.cast::<u8>(), a.value_size) }
        };
        store.put(&key, value)
    }));
    // SAFETY: `callback_error` was read from the plugin's args above.
    unsafe { finish(outcome, callback_error, "put") }
}

/// Fills the client-creation args' three callbacks with the trampolines
/// and `user_arg` (which must outlive the client).
pub(crate) fn install(args: &mut ffi::PJRT_Client_Create_Args, user_arg: &UserArg) {
    let p = (user_arg as *const UserArg).cast_mut().cast::<c_void>();
    args.kv_get_callback = Some(kv_get);
    args.kv_get_user_arg = p;
    args.kv_try_get_callback = Some(kv_try_get);
    args.kv_try_get_user_arg = p;
    args.kv_put_callback = Some(kv_put);
    args.kv_put_user_arg = p;
}

#[cfg(test)]
mod tests {
    //! The trampolines called directly, as the plugin would call them, with
    //! a stand-in `PJRT_CallbackError` that records code and message.
    use super::*;
    use crate::distributed::store::MemoryStore;
    use std::time::Instant;

    /// What the stand-in error constructor returns (as `PJRT_Error*`).
    struct FakeError {
        code: c_int,
        message: String,
    }

    unsafe extern "C" fn fake_error(code: c_int, message: *const c_char, size: usize) -> *mut ffi::PJRT_Error {
        // SAFETY: the trampoline passes `message[..size]`, alive for the call.
        let bytes = unsafe { std::slice::from_raw_parts(message.cast::<u8>(), size) };
        let e = Box::new(FakeError { code, message: String::from_utf8_lossy(bytes).into_owned() });
        Box::into_raw(e).cast()
    }

    fn take_error(e: *mut ffi::PJRT_Error) -> Option<FakeError> {
        // SAFETY: every non-null error in these tests was made by `fake_error`.
        (!e.is_null()).then(|| *unsafe { Box::from_raw(e.cast::<FakeError>()) })
    }

    struct Harness {
        user_arg: Box<UserArg>,
        callback: ffi::PJRT_CallbackError,
    }

    impl Harness {
        fn new(store: UserArg) -> Harness {
            Harness { user_arg: Box::new(store), callback: Some(fake_error) }
        }
        fn arg(&self) -> *mut c_void {
            (&*self.user_arg as *const UserArg).cast_mut().cast()
        }
        fn cb(&mut self) -> *mut ffi::PJRT_CallbackError {
            &mut self.callback
        }
        fn put(&mut self, key: &str, value: &[u8]) -> Option<FakeError> {
            let mut a = ffi::PJRT_KeyValuePutCallback_Args::zeroed();
            a.key = key.as_ptr().cast();
            a.key_size = key.len();
            a.value = value.as_ptr().cast();
            a.value_size = value.len();
            a.callback_error = self.cb();
            a.user_arg = self.arg();
            // SAFETY: `a` is a valid args struct whose pointers outlive the call.
            take_error(unsafe { kv_put(&mut a) })
        }
        fn get(&mut self, key: &str, timeout_ms: c_int) -> (ffi::PJRT_KeyValueGetCallback_Args, Option<FakeError>) {
            let mut a = ffi::PJRT_KeyValueGetCallback_Args::zeroed();
            a.key = key.as_ptr().cast();
            a.key_size = key.len();
            a.timeout_in_ms = timeout_ms;
            a.callback_error = self.cb();
            a.user_arg = self.arg();
            // SAFETY: as above.
            let e = take_error(unsafe { kv_get(&mut a) });
            (a, e)
        }
        fn try_get(&mut self, key: &str) -> (ffi::PJRT_KeyValueTryGetCallback_Args, Option<FakeError>) {
            let mut a = ffi::PJRT_KeyValueTryGetCallback_Args::zeroed();
            a.key = key.as_ptr().cast();
            a.key_size = key.len();
            a.callback_error = self.cb();
            a.user_arg = self.arg();
            // SAFETY: as above.
            let e = take_error(unsafe { kv_try_get(&mut a) });
            (a, e)
        }
    }

    /// Copies a returned value out and frees it through its deleter, as the
    /// plugin does.
    fn copy_and_delete(value: *mut c_char, size: usize, deleter: ffi::PJRT_KeyValue_ValueDeleter) -> Vec<u8> {
        assert!(!value.is_null(), "a successful get returns a non-null value");
        assert!(is_outstanding(value));
        // SAFETY: the trampoline handed out `value[..size]`.
        let v = unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec();
        // SAFETY: the deleter handed out with the value, called once.
        unsafe { deleter.expect("a deleter comes with every value")(value) };
        assert!(!is_outstanding(value), "the deleter freed the value");
        v
    }

    #[test]
    fn a_refusal_reaches_the_plugin_as_its_own_code() {
        let refused = |refusal| RuntimeError::KvRefused { addr: "a".into(), refusal, reason: String::new() };
        assert_eq!(code_of(&refused(Status::Unauthenticated)), 16);
        assert_eq!(code_of(&refused(Status::TooLarge)), 8);
        assert_eq!(code_of(&refused(Status::NodeClaimed)), 7);
        assert_eq!(code_of(&refused(Status::Busy)), 14);
        let full = RuntimeError::KvStoreFull { key: "k".into(), bytes: 1, used_bytes: 1, limit_bytes: 1 };
        assert_eq!(code_of(&full), 8);
    }

    #[test]
    fn put_then_get_and_try_get_return_owned_copies_freed_once() {
        let mut h = Harness::new(Arc::new(MemoryStore::new()));
        assert!(h.put("local_topology/cuda/1", b"\x01topo\x00bytes").is_none());
        let (a, e) = h.get("local_topology/cuda/1", 1000);
        assert!(e.is_none());
        assert_eq!(copy_and_delete(a.value, a.value_size, a.value_deleter_callback), b"\x01topo\x00bytes");
        let (a, e) = h.try_get("local_topology/cuda/1");
        assert!(e.is_none());
        let deleter = a.value_deleter_callback;
        assert_eq!(copy_and_delete(a.value, a.value_size, deleter), b"\x01topo\x00bytes");
        // A second delete of the same pointer is ignored, not a double free.
        // SAFETY: the deleter tolerates unknown pointers by design.
        unsafe { deleter.unwrap()(a.value) };
        assert!(!is_outstanding(a.value));
        // An empty value is still a real, freeable block.
        assert!(h.put("empty", b"").is_none());
        let (a, e) = h.get("empty", 10);
        assert!(e.is_none());
        assert_eq!(copy_and_delete(a.value, a.value_size, a.value_deleter_callback), b"");
    }

    #[test]
    fn missing_keys_are_not_found_or_deadline_and_hand_out_nothing() {
        let mut h = Harness::new(Arc::new(MemoryStore::new()));
        let (a, e) = h.try_get("nccl_id/7");
        let e = e.expect("try_get of a missing key is an error");
        assert_eq!(e.code, 5, "NOT_FOUND");
        assert!(e.message.contains("nccl_id/7"), "{}", e.message);
        assert!(a.value.is_null() && a.value_deleter_callback.is_none());
        let t = Instant::now();
        let (a, e) = h.get("global_topology/cuda", 60);
        let e = e.expect("get of a missing key times out");
        assert_eq!(e.code, 4, "DEADLINE_EXCEEDED");
        assert!(t.elapsed() >= Duration::from_millis(60) && t.elapsed() < Duration::from_secs(2));
        assert!(a.value.is_null());
    }

    #[test]
    fn changing_a_key_is_already_exists() {
        let mut h = Harness::new(Arc::new(MemoryStore::new()));
        assert!(h.put("k", b"a").is_none());
        assert!(h.put("k", b"a").is_none(), "the same value again is accepted");
        assert_eq!(h.put("k", b"b").expect("a different value is refused").code, 6);
    }

    struct Panicking;
    impl KeyValueStore for Panicking {
        fn put(&self, _: &str, _: &[u8]) -> crate::error::Result<()> {
            panic!("store bug")
        }
        fn get(&self, _: &str, _: Duration) -> crate::error::Result<Vec<u8>> {
            panic!("store bug")
        }
        fn try_get(&self, _: &str) -> crate::error::Result<Vec<u8>> {
            panic!("store bug")
        }
    }

    #[test]
    fn a_panicking_store_becomes_an_internal_error_not_an_unwind() {
        let mut h = Harness::new(Arc::new(Panicking));
        assert_eq!(h.put("k", b"v").unwrap().code, 13);
        let (a, e) = h.get("k", 10);
        assert_eq!(e.unwrap().code, 13);
        assert!(a.value.is_null());
        let (_, e) = h.try_get("k");
        assert!(e.unwrap().message.contains("panicked"));
    }

    #[test]
    fn null_user_arg_is_an_error() {
        let mut cb: ffi::PJRT_CallbackError = Some(fake_error);
        let mut a = ffi::PJRT_KeyValueTryGetCallback_Args::zeroed();
        a.callback_error = &mut cb;
        // SAFETY: a valid args struct with a null user_arg, as a buggy caller would pass.
        let e = take_error(unsafe { kv_try_get(&mut a) }).expect("an error");
        assert_eq!(e.code, 13);
        assert!(e.message.contains("user_arg"));
    }
}
