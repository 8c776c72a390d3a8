//! Boolean environment variables: one parser for all of them.
//!
//! Every on/off variable kiln reads (`KILN_CACHE`, `KILN_CACHE_READONLY`,
//! `KILN_DONATE`, ...) goes through [`bool_var`], so each accepts the same
//! spellings and refuses anything else with an error naming the variable and
//! its value: `KILN_DONATE=maybe` is an error, never silently off.
//!
//! Accepted (ASCII case-insensitive): `1`, `true`, `yes`, `on` and `0`,
//! `false`, `no`, `off`. Unset or empty counts as unset (`None`), as it does
//! for every other kiln variable.

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
    match std::env::var_os(var) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => parse_bool(var, &v.to_string_lossy()).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
