//! The CLI's subcommands that are more than a few lines, one file each.

pub mod cache;
pub mod profile;
