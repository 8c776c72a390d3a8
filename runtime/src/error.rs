//! `RuntimeError`: every way the runtime can fail, as structured values.
//!
//! Invariants: PJRT errors keep the function that failed, the plugin's status
//! code and its message verbatim; argument errors name the argument index and
//! both the expected and the actual type; nothing is a free-form catch-all.

use std::fmt;
use std::path::PathBuf;

use crate::element_type::{ArgType, ElementType};
use crate::gpu::GpuProbe;

/// Result alias for the runtime crate.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// `PJRT_Error_Code` (absl status codes), displayed by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PjrtErrorCode {
    Ok,
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
    /// A code this binding does not know (a newer plugin).
    Other(i32),
}

impl PjrtErrorCode {
    /// Maps the C enum value.
    pub fn from_raw(code: i32) -> Self {
        use PjrtErrorCode::*;
        match code {
            0 => Ok,
            1 => Cancelled,
            2 => Unknown,
            3 => InvalidArgument,
            4 => DeadlineExceeded,
            5 => NotFound,
            6 => AlreadyExists,
            7 => PermissionDenied,
            8 => ResourceExhausted,
            9 => FailedPrecondition,
            10 => Aborted,
            11 => OutOfRange,
            12 => Unimplemented,
            13 => Internal,
            14 => Unavailable,
            15 => DataLoss,
            16 => Unauthenticated,
            other => Other(other),
        }
    }
}

impl fmt::Display for PjrtErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use PjrtErrorCode::*;
        let name = match self {
            Ok => "OK",
            Cancelled => "CANCELLED",
            Unknown => "UNKNOWN",
            InvalidArgument => "INVALID_ARGUMENT",
            DeadlineExceeded => "DEADLINE_EXCEEDED",
            NotFound => "NOT_FOUND",
            AlreadyExists => "ALREADY_EXISTS",
            PermissionDenied => "PERMISSION_DENIED",
            ResourceExhausted => "RESOURCE_EXHAUSTED",
            FailedPrecondition => "FAILED_PRECONDITION",
            Aborted => "ABORTED",
            OutOfRange => "OUT_OF_RANGE",
            Unimplemented => "UNIMPLEMENTED",
            Internal => "INTERNAL",
            Unavailable => "UNAVAILABLE",
            DataLoss => "DATA_LOSS",
            Unauthenticated => "UNAUTHENTICATED",
            Other(code) => return write!(f, "code {code}"),
        };
        f.write_str(name)
    }
}

/// Why the value of a device-count variable (`GPU_NUM_DEVICES`,
/// `KILN_CPU_DEVICES`) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountProblem {
    /// Not a whole number (`two`, `1.5`).
    NotANumber,
    /// Zero or negative.
    NotPositive,
    /// More devices than there are.
    TooMany { available: usize },
}

impl fmt::Display for CountProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CountProblem::NotANumber => f.write_str("is not a whole number"),
            CountProblem::NotPositive => f.write_str("must be at least 1"),
            CountProblem::TooMany { available } => {
                write!(f, "asks for more devices than the {available} available")
            }
        }
    }
}

/// The devices a requested count was checked against, shown in the error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DevicesFound {
    /// What the CUDA driver showed (GPU names, or why there are none).
    Gpus(GpuProbe),
    /// The CPU plugin makes as many devices as asked, up to `max`.
    CpuPlugin { max: usize },
}

impl fmt::Display for DevicesFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DevicesFound::Gpus(probe) => write!(f, "devices found: {probe}"),
            DevicesFound::CpuPlugin { max } => {
                write!(f, "the XLA CPU plugin makes 1 to {max} devices")
            }
        }
    }
}

/// `[0] NVIDIA H100, [1] NVIDIA H100`, or `none`.
fn listed(items: &[String]) -> String {
    if items.is_empty() {
        "none".into()
    } else {
        items.join(", ")
    }
}

fn display_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "  (no search directories: python3 gave none and KILN_PLUGIN_DIR is unset)".into();
    }
    paths.iter().map(|p| format!("  {}", p.display())).collect::<Vec<_>>().join("\n")
}

/// Every error of the runtime crate.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "no PJRT plugin found for device {device}; looked at:\n{}\ninstall it with: {install_hint}\n(or point KILN_PJRT_PLUGIN at the .so)",
        display_paths(searched)
    )]
    PluginNotFound { device: String, searched: Vec<PathBuf>, install_hint: String },

    #[error("environment variable {var}={value:?} is not valid; expected {expected}")]
    BadPluginEnv { var: &'static str, value: String, expected: &'static str },

    #[error("{var}={value:?} {problem}; {found}")]
    BadDeviceCount { var: &'static str, value: String, problem: CountProblem, found: DevicesFound },

    #[error("PJRT_DEVICE=CUDA with {var} unset uses every visible GPU as a replica, but there is none: {found}")]
    NoGpus { var: &'static str, found: GpuProbe },

    #[error(
        "the CUDA driver shows {} GPU(s) ({}) but the PJRT plugin exposes {} device(s) ({}); {var} is checked against the driver's GPUs, so the two must agree (is CUDA_VISIBLE_DEVICES the same for both, and the plugin built for this driver?)",
        driver_gpus.len(), listed(driver_gpus), pjrt_devices.len(), listed(pjrt_devices)
    )]
    GpuCountMismatch { var: &'static str, driver_gpus: Vec<String>, pjrt_devices: Vec<String> },

    #[error("{var}={requested} asked the PJRT CPU client for {requested} devices, but it exposes {exposed}")]
    CpuDeviceCountIgnored { var: &'static str, requested: usize, exposed: usize },

    #[error("cannot load PJRT plugin {}", path.display())]
    PluginLoad {
        path: PathBuf,
        #[source]
        source: libloading::Error,
    },

    #[error("{} is not a PJRT plugin: symbol `{symbol}` is missing", path.display())]
    MissingSymbol { path: PathBuf, symbol: &'static str },

    #[error(
        "PJRT plugin {} implements C API {}.{}, kiln needs at least {}.{}",
        path.display(), found.0, found.1, required.0, required.1
    )]
    ApiTooOld { path: PathBuf, found: (i32, i32), required: (i32, i32) },

    #[error(
        "PJRT plugin {} implements C API {}.{}, kiln supports major version {supported_major} only",
        path.display(), found.0, found.1
    )]
    ApiIncompatible { path: PathBuf, found: (i32, i32), supported_major: i32 },

    #[error("PJRT plugin {} does not provide `{function}`", path.display())]
    MissingFunction { path: PathBuf, function: &'static str },

    #[error("{function} failed ({code}): {message}")]
    Pjrt { function: &'static str, code: PjrtErrorCode, message: String },

    #[error("wrong number of arguments: the program takes {expected}, got {got}")]
    ArgCount { expected: usize, got: usize },

    #[error("wrong number of replicas: the executable has {expected}, got argument lists for {got}")]
    ReplicaCount { expected: usize, got: usize },

    #[error("argument {index}: expected {expected}, got {got}")]
    ArgType { index: usize, expected: ArgType, got: ArgType },

    #[error("argument {index} is a buffer of another client")]
    ForeignBuffer { index: usize },

    #[error("argument {index} of replica {replica} lives on device {got}, the executable runs that replica on device {expected}")]
    WrongDevice { replica: usize, index: usize, expected: i32, got: i32 },

    #[error("device {device} belongs to another client")]
    ForeignDevice { device: i32 },

    #[error("host data has {got} bytes, but {ty} with dims {dims:?} needs {expected}")]
    HostDataLength { ty: ElementType, dims: Vec<usize>, expected: usize, got: usize },

    #[error("buffer holds {actual}, asked to read it as {requested}")]
    DTypeMismatch { requested: ElementType, actual: ElementType },

    #[error("unsupported element type (PJRT_Buffer_Type {raw})")]
    UnsupportedElementType { raw: i32 },

    #[error("cannot read the @main signature: {message}")]
    Signature { message: String },

    #[error("invalid compile options: {message}")]
    CompileOptions { message: String },

    #[error("cannot deserialize executable: {reason}")]
    Deserialize { reason: String },

    #[error("the plugin returned {got} outputs, the signature declares {expected}")]
    OutputCount { expected: usize, got: usize },

    #[error("environment variable {var}={value:?} is not a boolean; expected {expected}")]
    BadBoolEnv { var: &'static str, value: String, expected: &'static str },

    #[error("{var}={value:?} is not a fraction of GPU memory; expected a number in (0, 1]")]
    BadMemoryFraction { var: &'static str, value: String },

    #[error("environment variable {var}={value:?} is not valid; expected {expected}")]
    BadCacheEnv { var: &'static str, value: String, expected: &'static str },

    /// The cause is the source (not repeated in the message).
    #[error("compile cache {}", path.display())]
    CacheIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("compile cache {} is not a directory (set KILN_CACHE_DIR to a directory, or KILN_CACHE=off)", path.display())]
    CacheNotADirectory { path: PathBuf },

    #[error("compile cache {} is read-only (KILN_CACHE_READONLY=1)", dir.display())]
    CacheReadOnly { dir: PathBuf },

    // Several processes (`crate::distributed`).
    #[error("environment variable {var}={value:?} is not valid; expected {expected}")]
    BadNodeEnv { var: &'static str, value: String, expected: &'static str },

    #[error("KILN_NODE_ID={node_id} is out of range: KILN_NUM_NODES={num_nodes} numbers the nodes 0 to {}", num_nodes - 1)]
    NodeIdOutOfRange { node_id: u32, num_nodes: u32 },

    #[error("KILN_NUM_NODES={num_nodes} needs a key-value store: set KILN_COORDINATOR=host:port (the PJRT plugin aborts the process when several nodes have no store)")]
    MissingCoordinator { num_nodes: u32 },

    #[error("the {platform} PJRT plugin cannot join a run of {num_nodes} nodes: it ignores node_id, num_nodes and the key-value store, so its collectives would stay inside one process (use PJRT_DEVICE=CUDA)")]
    PlatformNotDistributed { platform: String, num_nodes: u32 },

    #[error("the coordinator {coordinator} is not on loopback and the run has no token: anyone who can reach it could join or stop the run. Give every process the same secret of at least 16 bytes in KILN_RUN_TOKEN, or in a file named by KILN_RUN_TOKEN_FILE (e.g. `openssl rand -hex 32`); `kiln launch` makes one itself")]
    MissingRunToken { coordinator: String },

    #[error("{var} is not a valid run token: {reason}")]
    BadRunToken { var: &'static str, reason: String },

    #[error("environment variable {var} is not valid UTF-8")]
    NonUnicodeEnv { var: &'static str },

    #[error("the kiln launch that started this node (process {pid}) has exited; the node stops too")]
    LauncherGone { pid: i32 },

    #[error("{call} failed: {reason}")]
    Os { call: &'static str, reason: String },

    #[error("the operating system gave no random bytes: {reason}")]
    NoRandomness { reason: String },

    #[error("key-value store at {addr} refused the request ({refusal}): {reason}")]
    KvRefused { addr: String, refusal: crate::distributed::wire::Status, reason: String },

    #[error("key-value store is full: {key:?} ({bytes} bytes) would pass the limit of {limit_bytes} bytes ({used_bytes} stored)")]
    KvStoreFull { key: String, bytes: usize, used_bytes: usize, limit_bytes: usize },

    #[error("key-value store: key {key:?} not found")]
    KvNotFound { key: String },

    #[error("key-value store: key {key:?} did not appear within {timeout_ms} ms")]
    KvDeadline { key: String, timeout_ms: u64 },

    #[error("key-value store: key {key:?} already holds a different value")]
    KvAlreadyExists { key: String },

    #[error("key-value store at {addr} is unreachable: {reason}")]
    KvUnavailable { addr: String, reason: String },

    #[error("key-value store at {addr}: {reason}")]
    KvProtocol { addr: String, reason: String },

    #[error("node(s) {missing:?} of {num_nodes} did not arrive within {waited_ms} ms (coordinator {coordinator}, this is node {me})")]
    NodesMissing { missing: Vec<u32>, num_nodes: u32, waited_ms: u64, coordinator: String, me: u32 },

    #[error("node(s) {nodes:?} stopped: no heartbeat for more than {timeout_ms} ms; node {me} ends the run")]
    PeersLost { nodes: Vec<u32>, timeout_ms: u64, me: u32 },

    #[error("the coordinator {coordinator} stopped answering for more than {timeout_ms} ms (it runs on node 0 or in `kiln launch`): {reason}; node {me} ends the run")]
    CoordinatorLost { coordinator: String, timeout_ms: u64, reason: String, me: u32 },

    #[error("KILN_LOCAL_DEVICES names GPU {ordinal}, but the CUDA driver shows {available} GPU(s)")]
    LocalDeviceOutOfRange { ordinal: usize, available: usize },

    #[error("{global} global devices over {num_nodes} nodes, but this node addresses {local}: every node must bring the same number of devices")]
    UnevenNodes { global: usize, local: usize, num_nodes: u32 },
}
