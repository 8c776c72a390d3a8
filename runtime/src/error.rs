//! `RuntimeError`: every way the runtime can fail, as structured values.
//!
//! Invariants: PJRT errors keep the function that failed, the plugin's status
//! code and its message verbatim; argument errors name the argument index and
//! both the expected and the actual type; nothing is a free-form catch-all.

use std::fmt;
use std::path::PathBuf;

use crate::element_type::ElementType;
use crate::signature::ArgType;

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

fn display_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "  (no search directories: python3 gave none and KILN_PLUGIN_DIR is unset)".into();
    }
    paths
        .iter()
        .map(|p| format!("  {}", p.display()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every error of the runtime crate.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "no PJRT plugin found for device {device}; looked at:\n{}\ninstall it with: {install_hint}\n(or point KILN_PJRT_PLUGIN at the .so)",
        display_paths(searched)
    )]
    PluginNotFound {
        device: String,
        searched: Vec<PathBuf>,
        install_hint: String,
    },

    #[error("environment variable {var}={value:?} is not valid; expected {expected}")]
    BadPluginEnv {
        var: &'static str,
        value: String,
        expected: &'static str,
    },

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
    ApiTooOld {
        path: PathBuf,
        found: (i32, i32),
        required: (i32, i32),
    },

    #[error(
        "PJRT plugin {} implements C API {}.{}, kiln supports major version {supported_major} only",
        path.display(), found.0, found.1
    )]
    ApiIncompatible {
        path: PathBuf,
        found: (i32, i32),
        supported_major: i32,
    },

    #[error("PJRT plugin {} does not provide `{function}`", path.display())]
    MissingFunction {
        path: PathBuf,
        function: &'static str,
    },

    #[error("{function} failed ({code}): {message}")]
    Pjrt {
        function: &'static str,
        code: PjrtErrorCode,
        message: String,
    },

    #[error("wrong number of arguments: the program takes {expected}, got {got}")]
    ArgCount { expected: usize, got: usize },

    #[error(
        "wrong number of replicas: the executable has {expected}, got argument lists for {got}"
    )]
    ReplicaCount { expected: usize, got: usize },

    #[error("argument {index}: expected {expected}, got {got}")]
    ArgType {
        index: usize,
        expected: ArgType,
        got: ArgType,
    },

    #[error("argument {index} is a buffer of another client")]
    ForeignBuffer { index: usize },

    #[error("argument {index} of replica {replica} lives on device {got}, the executable runs that replica on device {expected}")]
    WrongDevice {
        replica: usize,
        index: usize,
        expected: i32,
        got: i32,
    },

    #[error("device {device} belongs to another client")]
    ForeignDevice { device: i32 },

    #[error("host data has {got} bytes, but {ty} with dims {dims:?} needs {expected}")]
    HostDataLength {
        ty: ElementType,
        dims: Vec<usize>,
        expected: usize,
        got: usize,
    },

    #[error("buffer holds {actual}, asked to read it as {requested}")]
    DTypeMismatch {
        requested: ElementType,
        actual: ElementType,
    },

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

    #[error("environment variable {var}={value:?} is not valid; expected {expected}")]
    BadCacheEnv {
        var: &'static str,
        value: String,
        expected: &'static str,
    },

    /// The cause is the source (not repeated in the message).
    #[error("compile cache {}", path.display())]
    CacheIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("compile cache {} is read-only (KILN_CACHE_READONLY=1)", dir.display())]
    CacheReadOnly { dir: PathBuf },
}
