//! Loading a plugin (`GetPjrtApi`), the version gate, `PJRT_Plugin_Initialize`,
//! the process-wide registry of loaded plugins, and PJRT error conversion.
//!
//! Invariants: a plugin path is loaded and initialized at most once per
//! process and never unloaded, so `&'static Api` is sound; a plugin whose API
//! is older than [`REQUIRED_API_VERSION`] or whose table is shorter than ours
//! is refused before any of its functions is called.

use std::collections::BTreeMap;
use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use libloading::Library;

use super::ffi;
use crate::error::{PjrtErrorCode, Result, RuntimeError};

/// The oldest PJRT C API this binding accepts (major, minor).
pub const REQUIRED_API_VERSION: (i32, i32) = (0, 81);

/// The longest extension chain [`Api::extensions`] follows.
const MAX_EXTENSIONS: usize = 64;

/// One extension a plugin offers beside its function table: the features
/// outside the core C API (typed custom calls, FFI handlers, profiler hooks,
/// layouts, ...), each a struct of its own that PJRT chains from the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PluginExtension {
    /// `PJRT_Extension_Type`.
    pub kind: u32,
    /// The extension struct's size in bytes, which grows with its version.
    pub struct_size: usize,
}

impl PluginExtension {
    /// The name of [`PluginExtension::kind`] in `PJRT_Extension_Type`, lower
    /// case (`ffi`, `layouts`); `None` for a type newer than this table.
    pub fn name(&self) -> Option<&'static str> {
        const NAMES: [&str; 16] = [
            "gpu_custom_call",
            "profiler",
            "custom_partitioner",
            "stream",
            "layouts",
            "ffi",
            "memory_descriptions",
            "triton",
            "raw_buffer",
            "phase_compile",
            "example",
            "unknown",
            "cross_host_transfers",
            "executable_metadata",
            "callback",
            "host_allocator",
        ];
        NAMES.get(self.kind as usize).copied()
    }
}

impl std::fmt::Display for PluginExtension {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name}"),
            None => write!(f, "type {}", self.kind),
        }
    }
}

/// A loaded, initialized PJRT plugin.
pub(crate) struct Api {
    table: *const ffi::PJRT_Api,
    path: PathBuf,
    version: (i32, i32),
    _library: Library,
}

// SAFETY: the function table is immutable after `GetPjrtApi` returns and the
// PJRT C API requires its functions to be callable from any thread.
unsafe impl Send for Api {}
// SAFETY: as above; `Api` has no interior mutability.
unsafe impl Sync for Api {}

/// Calls one PJRT entry point by its table field name and converts the
/// returned `PJRT_Error*` into `Result<()>`.
///
/// Callers must pass a `&mut` args struct built from `zeroed()` whose input
/// pointers are valid for the duration of the call.
macro_rules! pjrt_call {
    ($api:expr, $func:ident, $args:expr) => {{
        let api: &$crate::pjrt::api::Api = $api;
        match api.table().$func {
            Some(f) => {
                // SAFETY: `f` is the plugin's implementation of `$func`, whose
                // table slot has the C signature declared in `ffi`; `$args` is
                // an exclusive reference to a fully initialized args struct of
                // the declared type (with `struct_size` set), and the caller
                // keeps every pointer inside it valid until the call returns.
                let err = unsafe { f($args) };
                api.check(stringify!($func), err)
            }
            None => Err($crate::error::RuntimeError::MissingFunction {
                path: api.path().to_path_buf(),
                function: stringify!($func),
            }),
        }
    }};
}
pub(crate) use pjrt_call;

static REGISTRY: OnceLock<Mutex<BTreeMap<PathBuf, &'static Api>>> = OnceLock::new();

impl Api {
    /// Loads (or returns the already loaded) plugin at `path`.
    pub(crate) fn load(path: &Path) -> Result<&'static Api> {
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let registry = REGISTRY.get_or_init(|| Mutex::new(BTreeMap::new()));
        // A panic while holding the lock cannot leave the map inconsistent
        // (insert is the only mutation), so a poisoned lock is still usable.
        let mut loaded = registry.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(api) = loaded.get(&key) {
            return Ok(api);
        }
        let api: &'static Api = Box::leak(Box::new(Api::open(&key)?));
        api.initialize()?;
        loaded.insert(key, api);
        Ok(api)
    }

    fn open(path: &Path) -> Result<Api> {
        crate::plugin_logs::quiet_unless_asked()?;
        // SAFETY: loading a library runs its initializers. The path was chosen
        // by the user or by plugin discovery as a PJRT plugin; there is no way
        // to load native code without trusting it.
        let library = unsafe { Library::new(path) }
            .map_err(|source| RuntimeError::PluginLoad { path: path.to_path_buf(), source })?;
        type GetPjrtApi = unsafe extern "C" fn() -> *const ffi::PJRT_Api;
        // SAFETY: `GetPjrtApi` is declared by the PJRT C API as
        // `const PJRT_Api* GetPjrtApi(void)`, matching `GetPjrtApi` above.
        let get_api = unsafe { library.get::<GetPjrtApi>(b"GetPjrtApi\0") }
            .map_err(|_| RuntimeError::MissingSymbol { path: path.to_path_buf(), symbol: "GetPjrtApi" })?;
        // SAFETY: calling the plugin's entry point; it takes no arguments.
        let table = unsafe { get_api() };
        if table.is_null() {
            return Err(RuntimeError::MissingSymbol { path: path.to_path_buf(), symbol: "GetPjrtApi (returned null)" });
        }
        // SAFETY: every PJRT API version starts its table with `struct_size`,
        // `extension_start` and `pjrt_api_version`; only that prefix is read
        // before the size check below.
        let (struct_size, version) = unsafe {
            let v = (*table).pjrt_api_version;
            ((*table).struct_size, (v.major_version, v.minor_version))
        };
        if version < REQUIRED_API_VERSION || struct_size < ffi::PJRT_Api::STRUCT_SIZE {
            return Err(RuntimeError::ApiTooOld {
                path: path.to_path_buf(),
                found: version,
                required: REQUIRED_API_VERSION,
            });
        }
        if version.0 != REQUIRED_API_VERSION.0 {
            return Err(RuntimeError::ApiIncompatible {
                path: path.to_path_buf(),
                found: version,
                supported_major: REQUIRED_API_VERSION.0,
            });
        }
        tracing::debug!(path = %path.display(), ?version, "loaded PJRT plugin");
        Ok(Api { table, path: path.to_path_buf(), version, _library: library })
    }

    fn initialize(&self) -> Result<()> {
        let mut args = ffi::PJRT_Plugin_Initialize_Args::zeroed();
        pjrt_call!(self, PJRT_Plugin_Initialize, &mut args)
    }

    /// The function table, at least as long as our 0.81 declaration.
    pub(crate) fn table(&self) -> &ffi::PJRT_Api {
        // SAFETY: `open` checked that the plugin's table is non-null and at
        // least `PJRT_Api::STRUCT_SIZE` bytes long; it lives as long as the
        // library, which `self` owns and which is never unloaded.
        unsafe { &*self.table }
    }

    /// The extensions the plugin chains from its table's `extension_start`,
    /// in chain order (at most [`MAX_EXTENSIONS`]: a chain longer than that
    /// is cut there rather than followed into a cycle).
    pub(crate) fn extensions(&self) -> Vec<PluginExtension> {
        self.extension_chain()
            .map(|node| {
                // SAFETY: `extension_chain` yields live nodes of the chain.
                let base = unsafe { &*node };
                PluginExtension { kind: base.kind, struct_size: base.struct_size }
            })
            .collect()
    }

    /// The first extension of type `kind` in the chain, if the plugin offers
    /// one: a pointer to its `PJRT_Extension_Base`, which the plugin keeps
    /// alive as long as its table; the caller reads the rest of its struct by
    /// `struct_size`.
    pub(crate) fn extension(&self, kind: u32) -> Option<*const ffi::PJRT_Extension_Base> {
        self.extension_chain().find(|&node| {
            // SAFETY: `extension_chain` yields live nodes of the chain.
            unsafe { (*node).kind == kind }
        })
    }

    /// The chain's nodes, at most [`MAX_EXTENSIONS`] (a longer chain is cut
    /// there rather than followed into a cycle).
    fn extension_chain(&self) -> impl Iterator<Item = *const ffi::PJRT_Extension_Base> + '_ {
        let first = self.table().extension_start as *const ffi::PJRT_Extension_Base;
        std::iter::successors((!first.is_null()).then_some(first), |&node| {
            // SAFETY: every node of the chain starts with `PJRT_Extension_Base`
            // (`struct_size`, a C enum, `next`), which the plugin keeps alive
            // as long as its table; only that prefix is read.
            let next = unsafe { (*node).next };
            (!next.is_null()).then_some(next)
        })
        .take(MAX_EXTENSIONS)
    }

    /// Whether each event-related slot of the table is set.
    pub(crate) fn event_functions(&self) -> Vec<(&'static str, bool)> {
        let t = self.table();
        vec![
            ("PJRT_Event_IsReady", t.PJRT_Event_IsReady.is_some()),
            ("PJRT_Event_Error", t.PJRT_Event_Error.is_some()),
            ("PJRT_Event_Await", t.PJRT_Event_Await.is_some()),
            ("PJRT_Event_OnReady", t.PJRT_Event_OnReady.is_some()),
            ("PJRT_Buffer_ReadyEvent", t.PJRT_Buffer_ReadyEvent.is_some()),
        ]
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Converts a returned `PJRT_Error*` (null = success) and frees it.
    pub(crate) fn check(&self, function: &'static str, err: *mut ffi::PJRT_Error) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        let table = self.table();
        let mut message_args = ffi::PJRT_Error_Message_Args::zeroed();
        message_args.error = err;
        let message = match table.PJRT_Error_Message {
            Some(f) => {
                // SAFETY: `err` is a live error returned by the plugin; the
                // message it reports lives as long as `err`, which is copied
                // out below before `err` is destroyed.
                unsafe { f(&mut message_args) };
                copy_string(message_args.message, message_args.message_size)
            }
            None => String::new(),
        };
        let mut code_args = ffi::PJRT_Error_GetCode_Args::zeroed();
        code_args.error = err;
        let code = match table.PJRT_Error_GetCode {
            Some(f) => {
                // SAFETY: `err` is live; the function only writes `code`.
                let code_err = unsafe { f(&mut code_args) };
                if code_err.is_null() {
                    code_args.code
                } else {
                    self.destroy_error(code_err);
                    2 // UNKNOWN
                }
            }
            None => 2,
        };
        self.destroy_error(err);
        Err(RuntimeError::Pjrt { function, code: PjrtErrorCode::from_raw(code), message })
    }

    fn destroy_error(&self, err: *mut ffi::PJRT_Error) {
        if let Some(f) = self.table().PJRT_Error_Destroy {
            let mut args = ffi::PJRT_Error_Destroy_Args::zeroed();
            args.error = err;
            // SAFETY: `err` was returned by this plugin and is destroyed once.
            unsafe { f(&mut args) };
        }
    }
}

/// Copies a `(pointer, length)` string owned by the plugin.
pub(crate) fn copy_string(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    // SAFETY: the plugin reports `ptr[..len]` as a live byte string; it is
    // copied immediately, before the object that owns it can be freed.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// Copies a `(pointer, length)` byte array owned by the plugin.
pub(crate) fn copy_bytes(ptr: *const c_char, len: usize) -> Vec<u8> {
    if ptr.is_null() || len == 0 {
        return Vec::new();
    }
    // SAFETY: as in `copy_string`.
    unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }.to_vec()
}

/// Copies a `(pointer, count)` array owned by the plugin.
pub(crate) fn copy_slice<T: Copy>(ptr: *const T, len: usize) -> Vec<T> {
    if ptr.is_null() || len == 0 {
        return Vec::new();
    }
    // SAFETY: the plugin reports `ptr[..len]` as a live, initialized array
    // whose owner outlives this copy.
    unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec()
}
