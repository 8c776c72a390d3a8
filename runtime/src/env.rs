//! Environment variables and the sizes kiln reads: one parser for each kind.
//!
//! Every on/off variable kiln reads (`KILN_CACHE`, `KILN_CACHE_READONLY`,
//! `KILN_DONATE`, ...) goes through [`bool_var`], so each accepts the same
//! spellings and refuses anything else with an error naming the variable and
//! its value: `KILN_DONATE=maybe` is an error, never silently off.
//!
//! Accepted (ASCII case-insensitive): `1`, `true`, `yes`, `on` and `0`,
//! `false`, `no`, `off`. Unset or empty counts as unset (`None`), as it does
//! for every other kiln variable.
//!
//! Every byte size (`KILN_CACHE_MAX_BYTES`, the CLI's `--memory-limit` and
//! `--device-memory`) goes through [`parse_size`]: `KILN_CACHE_MAX_BYTES=2GiB`
//! and `--memory-limit 2G` mean what they say, the same in both places.

use crate::error::{Result, RuntimeError};

/// The spellings [`parse_bool`] accepts, for error messages.
pub const BOOL_SPELLINGS: &str = "1, true, yes, on, 0, false, no or off";

/// Parses `value` of variable `var`.
pub fn parse_bool(var: &'static str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(RuntimeError::BadBoolEnv { var, value: value.to_string(), expected: BOOL_SPELLINGS }),
    }
}

/// The value of boolean variable `var`: `None` when unset or empty.
pub fn bool_var(var: &'static str) -> Result<Option<bool>> {
    string_var(var)?.map(|v| parse_bool(var, &v)).transpose()
}

/// The text of variable `var`: `None` when unset or empty; a value that is
/// not UTF-8 is an error naming the variable, never taken as unset.
pub fn string_var(var: &'static str) -> Result<Option<String>> {
    match std::env::var_os(var) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => v.into_string().map(Some).map_err(|_| RuntimeError::NonUnicodeEnv { var }),
    }
}

/// The spellings [`parse_size`] accepts, for error messages.
pub const SIZE_SPELLINGS: &str =
    "bytes (123, 1.5e9), or a number with K, M, G, T, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)";

/// A byte size: a non-negative number, optionally followed by a unit, ASCII
/// case-insensitive: `K`, `M`, `G`, `T` and `KiB` … `TiB` are powers of
/// 1024, `KB` … `TB` powers of 1000, `B` is one. A fractional count of bytes
/// rounds down. `None` for anything else, or more than `u64::MAX`.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E').unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    // Integers exactly (a cap of u64::MAX bytes is a size); the rest as f64.
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(scale);
    }
    let x: f64 = num.parse().ok()?;
    let bytes = x * scale as f64;
    // 2^64 is the first f64 above u64::MAX.
    (x.is_finite() && x >= 0.0 && bytes < 18_446_744_073_709_551_616.0).then_some(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_mean_the_same_in_every_spelling() {
        assert_eq!(parse_size("123"), Some(123));
        assert_eq!(parse_size(" 64m "), Some(64 << 20));
        assert_eq!(parse_size("512K"), Some(512 << 10));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("2 gib"), Some(2 << 30));
        assert_eq!(parse_size("1TiB"), Some(1 << 40));
        assert_eq!(parse_size("2GB"), Some(2_000_000_000));
        assert_eq!(parse_size("0.5TB"), Some(500_000_000_000));
        assert_eq!(parse_size("1.5e9"), Some(1_500_000_000));
        assert_eq!(parse_size("1.5MiB"), Some(3 << 19));
        assert_eq!(parse_size("2.5"), Some(2));
        assert_eq!(parse_size("0"), Some(0));
        assert_eq!(parse_size("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "lots",
            "12Q",
            "2 parsecs",
            "-1",
            "-1K",
            "inf",
            "NaN",
            "1e30",
            "18446744073709551616",
            "16777216T",
            "GiB",
        ] {
            assert_eq!(parse_size(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn every_spelling_parses_and_nothing_else_does() {
        for v in ["1", "true", "YES", "On", " on "] {
            assert!(parse_bool("KILN_X", v).unwrap(), "{v}");
        }
        for v in ["0", "false", "No", "OFF"] {
            assert!(!parse_bool("KILN_X", v).unwrap(), "{v}");
        }
        for v in ["maybe", "2", "y", "enable", "-1"] {
            let e = parse_bool("KILN_X", v).unwrap_err().to_string();
            assert!(e.contains("KILN_X") && e.contains(v) && e.contains(BOOL_SPELLINGS), "{e}");
        }
    }
}
