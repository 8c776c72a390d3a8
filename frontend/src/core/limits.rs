//! Size limits checked before allocating host memory for user-sized data.
//!
//! Invariant: a size a user writes (`--hidden 99999999999`, a graph's
//! parameter type, an IDX header) never reaches an allocation that aborts the
//! process or gets it killed for memory: sizes are computed with checked arithmetic and
//! compared with [`host_limit_bytes`] first, and a refusal is
//! [`FrontendError::TooLarge`] naming what was too large.
//!
//! The limit is the memory the kernel says is available (`MemAvailable` in
//! `/proc/meminfo`) when it can be read, else [`FALLBACK_LIMIT_BYTES`];
//! [`ENV_HOST_MEMORY`] caps it lower, never higher. It is read once per check
//! (cheap, and the value moves as other processes run).

use crate::core::error::{FrontendError, Result};

/// The limit where `/proc/meminfo` cannot be read (not Linux): 16 GiB.
pub const FALLBACK_LIMIT_BYTES: u64 = 16 << 30;

/// `KILN_HOST_MEMORY`: a byte size (`2GiB`, `500M`: the spellings of
/// `kiln_runtime::env::parse_size`) that caps the host limit: for a
/// container whose `/proc/meminfo` shows the whole machine's memory, and for
/// tests that must be refused without allocating gigabytes first.
pub const ENV_HOST_MEMORY: &str = "KILN_HOST_MEMORY";

/// The host-memory limit for one allocation, and where it came from; an
/// error when [`ENV_HOST_MEMORY`] is set to something that is not a size.
pub fn host_limit_bytes() -> Result<(u64, &'static str)> {
    let cap = match kiln_runtime::env::string_var(ENV_HOST_MEMORY)? {
        None => None,
        Some(v) => Some(kiln_runtime::env::parse_size(&v).ok_or(FrontendError::BadEnv {
            var: ENV_HOST_MEMORY,
            value: v,
            expected: kiln_runtime::env::SIZE_SPELLINGS,
        })?),
    };
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines().find_map(|l| {
            let kib = l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
            kib.checked_mul(1024)
        })
    });
    let (limit, source) = match available {
        Some(bytes) => (bytes, "the host's available memory"),
        None => (FALLBACK_LIMIT_BYTES, "kiln's fallback host limit"),
    };
    Ok(match cap {
        Some(cap) if cap < limit => (cap, ENV_HOST_MEMORY),
        _ => (limit, source),
    })
}

/// Refuses `bytes` (`None`: the size overflowed while computing it) above
/// the host limit; `what` names the data (`"the MLP's parameters"`).
pub fn check_host_bytes(what: impl Into<String>, bytes: Option<u64>) -> Result<()> {
    let (limit, source) = host_limit_bytes()?;
    match bytes {
        Some(b) if b <= limit => Ok(()),
        _ => Err(FrontendError::TooLarge { what: what.into(), bytes, limit, limit_source: source }),
    }
}

/// `dims`' element count times `elem_bytes`, `None` on overflow.
pub fn checked_bytes(dims: &[usize], elem_bytes: usize) -> Option<u64> {
    let n = dims.iter().try_fold(elem_bytes, |acc, &d| acc.checked_mul(d))?;
    u64::try_from(n).ok()
}
