//! kiln's compiler: the graph IR, its verifier, text form, reference interpreter,
//! optimization passes, cost model and lowering to StableHLO text.
//!
//! The compiler is pure: no I/O, no devices, no globals. A graph goes in, a module
//! (text) comes out, so everything here is testable on a CPU-only machine.

pub mod analysis;
pub mod composite;
pub mod cost;
mod error;
mod fence;
pub mod fingerprint;
pub mod fusion;
pub mod interp;
pub mod ir;
pub mod lower;
pub mod passes;
pub mod pipeline;
pub mod remat;
pub mod rewrite;
pub mod schedule;
pub mod target;
pub mod text;
mod verify;

pub use error::CompileError;
pub use fingerprint::{fingerprint, Fingerprint, BUILD_FINGERPRINT};
pub use interp::{interpret, interpret_op, interpret_replicated};
pub use lower::{lower, AttentionSplit, LowerOptions, ModuleShardings};
pub use target::LowerTarget;
pub use verify::verify;
