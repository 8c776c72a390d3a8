//! Analyses of a step graph that the planners and reports read: liveness
//! of its buffers in an execution order, its peak memory, the kernels' times
//! by the kernel model, and the fusion models that say which values reach
//! memory.
//!
//! Where it runs: called by the remat strategies, the pipeline and the CLI
//! (`kiln compile --memory-limit`, `kiln profile --max-batch`) on any graph;
//! nothing here rewrites a graph.
//!
//! Invariants:
//! - The execution order is the graph's insertion order over the nodes the
//!   outputs reach (a topological order; dead nodes are never executed).
//! - Which values get a buffer of their own is decided by one
//!   [`Materialization`] answer per value (see [`fusion_model`]).
//! - A kernel's workspace (cuBLAS's, cuDNN's) is a `Scratch` buffer live at
//!   that kernel only; it counts as a temporary and is never a remat
//!   candidate.
//! - `reshape` and `optimization_barrier` never allocate: their results alias
//!   their operands' buffers (a bitcast, a pass-through).
//! - Everything here is pure: graph in, numbers out.

mod fusion_model;
pub mod kernel_time;
mod liveness;
mod peak;
mod xla_gpu;

pub use fusion_model::{fusion_for, loop_fusible, EveryNodeAKernel, Materialization, XlaCpuFusion};
pub use kernel_time::{kernel_seconds, kernel_starts, kernel_times};
pub use liveness::{liveness, users_of, Allocation, Buffer, BufferKind, Liveness};
pub use peak::{live_peak, peak_memory, peak_of, PeakMemory};
pub use xla_gpu::XlaGpuFusion;
