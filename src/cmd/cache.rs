//! `kiln cache stats|clear`: the persistent compile cache that
//! `KILN_CACHE_DIR` (or the user's cache directory) names.

use anyhow::Context as _;
use clap::Subcommand;
use kiln::runtime::{DiskCache, DiskCacheConfig};
use serde_json::json;

#[derive(Subcommand)]
pub enum CacheCommand {
    /// Entries, bytes and settings of the cache directory.
    Stats {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Remove every entry.
    Clear {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: CacheCommand) -> anyhow::Result<()> {
    let config = DiskCacheConfig::from_env()?
        .context("the compile cache is off (KILN_CACHE=off, or no KILN_CACHE_DIR, XDG_CACHE_HOME or HOME)")?;
    // Looking never makes the directory: opened read-only unless clearing
    // (`stats` still reports the setting the environment gives).
    let writes = matches!(cmd, CacheCommand::Clear { .. }) && config.dir.exists();
    let read_only = config.read_only;
    let cache = DiskCache::open(DiskCacheConfig { read_only: read_only || !writes, ..config })?;
    match cmd {
        CacheCommand::Stats { json } => {
            let s = kiln::runtime::CacheStats { read_only, ..cache.stats()? };
            if json {
                println!(
                    "{}",
                    json!({"dir": s.dir, "entries": s.entries, "bytes": s.bytes, "max_bytes": s.max_bytes, "read_only": s.read_only})
                );
            } else {
                println!("compile cache {}{}", s.dir.display(), if s.read_only { " (read-only)" } else { "" });
                println!("  {} entries, {:.1} MiB of {:.1} MiB", s.entries, mib(s.bytes), mib(s.max_bytes));
            }
        }
        CacheCommand::Clear { json } => {
            // A directory that is not there holds nothing to remove.
            let removed = if writes || read_only { cache.clear()? } else { 0 };
            if json {
                println!("{}", json!({"dir": cache.config().dir, "removed": removed}));
            } else {
                println!("removed {removed} entries from {}", cache.config().dir.display());
            }
        }
    }
    Ok(())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}
