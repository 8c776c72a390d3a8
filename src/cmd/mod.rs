//! Subcommands of the `kiln` binary that live in their own files, one per
//! command; `main.rs` only names them and dispatches.

pub mod cache;
pub mod compile;
pub mod profile;
