//! The frontend's one error type, [`FrontendError`], and its [`Result`].
//!
//! Invariants:
//! - Every error the crate returns is a variant of this enum, with fields a
//!   caller can match (the op, the shapes, the names involved) rather than one
//!   message; `InvalidArgument` is kept for one-off misuses no variant
//!   describes.
//! - Errors of the compiler and the runtime pass through unchanged
//!   (`Compile`, `Runtime`), keeping their codes and messages.
//! - Large fields are boxed, so that every `Result` of the crate stays small.

use thiserror::Error;

use kiln_compiler::ir::{DType, Shape, TensorType};
use kiln_compiler::CompileError;
use kiln_runtime::RuntimeError;

#[derive(Debug, Error)]
pub enum FrontendError {
    /// A shape or dtype error raised when an op was recorded.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// The device runtime failed (plugin, compile, transfer, execute).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// Autodiff met an op it has no derivative for.
    #[error("autodiff: {op} is not differentiable with respect to operand {operand} ({ty})")]
    NotDifferentiable { op: &'static str, operand: usize, ty: TensorType },
    /// Autodiff was asked for the gradient of a non-scalar or non-float value.
    #[error("autodiff: the loss must be a floating-point scalar, got {ty}")]
    LossNotScalar { ty: TensorType },
    #[error("{op}: shapes {lhs} and {rhs} do not broadcast")]
    Broadcast { op: &'static str, lhs: Shape, rhs: Shape },
    #[error("{op}: {len} values do not fill shape {shape} ({} elements)", .shape.num_elements())]
    DataLength { op: &'static str, shape: Shape, len: usize },
    #[error("reading a {tensor} tensor as {requested}")]
    ReadDType { tensor: DType, requested: DType },
    #[error("{op}: the tensor was recorded in a step or lowering that has ended without running it")]
    StaleTensor { op: &'static str },
    /// A one-off misuse that no structured variant below describes.
    #[error("{op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },
    /// An operand of the wrong rank, with the layout the op expects
    /// (`q f32[2, 8] must be rank 4: [batch, heads, seq, head_dim]`).
    #[error("{op}: {what} {got} must be rank {expected}: {layout}")]
    OperandRank { op: &'static str, what: &'static str, got: TensorType, expected: usize, layout: &'static str },
    /// A step argument whose per-replica values do not match the step's
    /// replica count.
    #[error(
        "{op}: {what} holds values for {got} replicas but the step runs on {expected}: set the replica count \
         before creating tensors"
    )]
    ReplicaCount { op: &'static str, what: String, got: usize, expected: usize },
    /// A mesh spec that is not a mesh (`data=2,model=2`).
    #[error("mesh {spec:?}: {reason}")]
    BadMesh { spec: String, reason: String },
    /// A mesh whose device count differs from the one the environment sets.
    #[error("mesh {mesh} has {mesh_devices} devices but {setting} gives another count: make them agree")]
    MeshDevices { mesh: String, mesh_devices: usize, setting: String },
    /// A sharded dimension its mesh axis does not divide.
    #[error(
        "sharding {tensor} ({ty}): dimension {dim} (size {size}) is not divisible by mesh axis {axis} (size {axis_size})"
    )]
    ShardNotDivisible { tensor: String, ty: Box<TensorType>, dim: usize, size: usize, axis: String, axis_size: usize },
    /// A sharding naming an axis the mesh does not have.
    #[error("sharding {tensor}: the mesh {mesh} has no axis {axis}")]
    UnknownMeshAxis { tensor: String, axis: String, mesh: String },
    /// A sharding that does not fit its tensor (rank, an axis used twice).
    #[error("sharding {tensor}: {reason}")]
    BadSharding { tensor: String, reason: String },
    /// A shard policy naming a parameter the store does not have.
    #[error("shard policy {policy}: the parameter store has no {name}")]
    UnknownShardParam { policy: String, name: String },
    /// An error raised inside a layer's forward, naming the layer
    /// (`LayerNorm(257): mul: shapes ... do not broadcast`); nested layers
    /// nest.
    #[error("{layer}: {source}")]
    InLayer { layer: String, source: Box<FrontendError> },
    /// An attention mask, bias or key padding mask that does not fit the
    /// scores `[batch, heads, q_seq, kv_seq]` it applies to.
    #[error("{op}: {what} {got} {why} (scores {scores})")]
    AttentionOperand { op: &'static str, what: &'static str, got: Box<TensorType>, scores: Shape, why: String },
    /// Query heads that the key/value heads do not divide into groups, or
    /// q, k, v that disagree on batch, length or head size.
    #[error("{op}: {reason}: q {q}, k {k}, v {v}")]
    AttentionShapes { op: &'static str, reason: String, q: Box<TensorType>, k: Box<TensorType>, v: Box<TensorType> },
    /// A matrix product whose contracted dimensions differ.
    #[error("{op}: inner dimensions {lhs_inner} and {rhs_inner} differ ({lhs} times {rhs})")]
    InnerDims { op: &'static str, lhs: Shape, rhs: Shape, lhs_inner: usize, rhs_inner: usize },
    /// candle (the eager backend, interop) refused an op.
    #[error("{op}: candle: {source}")]
    Candle {
        op: &'static str,
        #[source]
        source: Box<candle_core::Error>,
    },
    /// A candle dtype kiln has no counterpart for (the 8/6/4-bit floats).
    #[error("candle dtype {dtype} has no kiln dtype")]
    CandleDType { dtype: String },
    /// `grad` asked for the gradient with respect to a non-float tensor.
    #[error("grad: wrt[{index}] is {ty}: only floating-point tensors have gradients")]
    NoGradient { index: usize, ty: TensorType },
    #[error("{op}: expected a rank-{expected} tensor, got {got}")]
    Rank { op: &'static str, expected: usize, got: TensorType },
    /// Two tensors that must have the same type do not. (The types are boxed,
    /// as in `NonFinite`, to keep every `Result` of the crate small.)
    #[error("{op}: {what} is {got}, expected {expected}")]
    TypeMismatch { op: &'static str, what: String, expected: Box<TensorType>, got: Box<TensorType> },
    /// Two lists (parameters and gradients, shards and replicas) of different lengths.
    #[error("{op}: {got} {what} for {expected}")]
    Count { op: &'static str, what: &'static str, expected: String, got: usize },
    #[error("{op}: needs at least one {what}")]
    Empty { op: &'static str, what: &'static str },
    #[error("{op}: needs a one-element tensor, got {got}")]
    NotOneElement { op: &'static str, got: TensorType },
    #[error("{op}: the name {name:?} is taken")]
    DuplicateName { op: &'static str, name: String },
    /// Logits and labels that do not pair up (`[n, classes]` with `[n]`).
    #[error("{op}: logits {logits} and labels {labels} must be [n, classes] and [n]")]
    LabelShape { op: &'static str, logits: TensorType, labels: TensorType },
    #[error("{op}: axis {axis} is out of range for a tensor of rank {rank}")]
    Axis { op: &'static str, axis: isize, rank: usize },
    /// The message says the cause (a caller that prints only `Display` sees
    /// it); it is also the error's source.
    #[error("{}: {source}", .path.display())]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {reason}", .path.display())]
    Data { path: std::path::PathBuf, reason: String },
    #[error("checkpoint {}: {reason}", .path.display())]
    Checkpoint { path: std::path::PathBuf, reason: String },
    /// A training loop's loss that is NaN or infinite where no loss scaler
    /// skipped the update: the run diverged, and the steps after it would
    /// only train on garbage.
    #[error(
        "step {step}: the loss is {loss} (not finite): training diverged; lower the learning rate or clip \
         the gradients (--max-grad-norm), or pass --allow-non-finite-loss to keep going"
    )]
    NonFiniteLoss { step: u64, loss: f64 },
    #[error("{op}: expected dtype {expected}, got {got}")]
    DType { op: &'static str, expected: &'static str, got: DType },
    /// A step that ran asynchronously failed on the device (or a check run
    /// when its results were known failed); reported at the first `mark_step`,
    /// read or `sync` after the failure was learnt.
    #[error("step {step} failed: {reason}")]
    StepFailed { step: u64, reason: String },
    /// Data a user sized would not fit in host memory (checked before
    /// allocating; `bytes` is `None` when the size overflowed).
    #[error("{what} needs {} bytes, more than the limit of {limit} bytes ({limit_source})", .bytes.map_or_else(|| "more than 2^64".to_string(), |b| b.to_string()))]
    TooLarge { what: String, bytes: Option<u64>, limit: u64, limit_source: &'static str },
    /// A training set too small for one step.
    #[error("the training set has {examples} examples, fewer than one step takes ({batch} per replica x {replicas} replica(s)): lower --batch or use more data")]
    DatasetTooSmall { examples: usize, batch: usize, replicas: usize },
    /// A path that a write would destroy or cannot be written through.
    #[error("{}: {reason}", .path.display())]
    NotAFile { path: std::path::PathBuf, reason: String },
    /// A destination whose directory refuses a new file, found when the run
    /// starts (a probe file), not when its result is written.
    #[error("{}: no file can be written in this directory ({source}); checked before the run so that nothing it computes is lost at the end", .dir.display())]
    NotWritable {
        dir: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An input path that is not a regular file (`kind`: "a FIFO", "a
    /// directory", ...): refused before it is opened, since opening a FIFO
    /// blocks until a writer comes and a device can read without end.
    #[error("{}: is {kind}, not a regular file (kiln reads its inputs from regular files)", .path.display())]
    NotARegularFile { path: std::path::PathBuf, kind: &'static str },
    /// A setting out of its range (learning-rate, clipping or scaling settings).
    #[error("{op}: {name} = {value} must be {expected}")]
    HyperParameter { op: &'static str, name: &'static str, value: f64, expected: &'static str },
    /// An environment variable kiln reads holds a value it does not accept.
    #[error("{var}={value:?}: expected {expected}")]
    BadEnv { var: &'static str, value: String, expected: &'static str },
    /// A device-side check (`device_checks`): `count` of the `total` values
    /// that `op` read as `what` (labels, indices) lay outside `0..bound`;
    /// `value` is one of them, `min` and `max` the extremes of all values.
    #[error(
        "{op}{}: {what} {value} is out of range [0, {bound}): {count} of {total} values are out of range \
         (values seen from {min} to {max}; checked on the device, KILN_DEVICE_CHECKS=0 turns the check off)",
        in_layer(.layer)
    )]
    IndexOutOfRange {
        op: &'static str,
        layer: Option<String>,
        what: &'static str,
        value: i64,
        bound: u64,
        count: u64,
        total: u64,
        min: i64,
        max: i64,
    },
    /// Anomaly mode: the first op of the step whose output held NaN or ±inf.
    /// `ty` is boxed: the variant would otherwise be the crate's largest and
    /// make every `Result` of the crate carry it.
    #[error(
        "anomaly: {op} {value} ({ty}){} produced {count} non-finite values (NaN or ±inf), the first op of the \
         step to do so; its operands: {operands}",
        in_layer(.layer)
    )]
    NonFinite {
        op: &'static str,
        value: String,
        ty: Box<TensorType>,
        layer: Option<String>,
        count: u64,
        operands: String,
    },
}

/// ` in layer NAME` when the layer is known.
fn in_layer(layer: &Option<String>) -> String {
    layer.as_ref().map_or_else(String::new, |l| format!(" in layer {l}"))
}

pub type Result<T, E = FrontendError> = std::result::Result<T, E>;
