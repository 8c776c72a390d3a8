//! How much GPU memory the CUDA plugin takes: its allocator's create options.
//!
//! The plugin's default allocator (BFC) reserves `memory_fraction` of each GPU
//! it opens when the client is created (75% unless told otherwise) and grows
//! no further. kiln passes two of its create options (the names XLA's GPU
//! PJRT plugin reads in `PJRT_Client_Create`):
//! - `memory_fraction` (a `float`): from `KILN_GPU_MEMORY_FRACTION`, or
//!   [`MemoryFraction::new`] through [`crate::ClientOptions`];
//! - `preallocate` (a `bool`): from `KILN_GPU_PREALLOCATE`, else
//!   [`DEFAULT_PREALLOCATE`] (`false`): the allocator takes memory as it needs
//!   it, up to the fraction. `true` is the plugin's own default: it reserves
//!   the whole fraction at the first allocation. (The frontend asks for
//!   `true` when a step is planned to a byte limit: grown region by region,
//!   the pool cannot give one buffer near its limit.)
//!
//! Invariants: a [`MemoryFraction`] is always in `(0, 1]` (a finite number; a
//! value outside is a typed error naming where it came from, never clamped);
//! unset or empty variables leave the plugin's defaults; options set through
//! the API win over the environment ([`GpuMemory::apply`] fills only what is
//! unset). Only CUDA clients get these options: the CPU plugin has no such
//! allocator.

use crate::env::bool_var;
use crate::error::{Result, RuntimeError};

/// Env var: the fraction of each GPU the CUDA plugin may take, in `(0, 1]`.
pub const ENV_GPU_MEMORY_FRACTION: &str = "KILN_GPU_MEMORY_FRACTION";
/// Env var: whether the CUDA plugin reserves its fraction at start (a boolean).
pub const ENV_GPU_PREALLOCATE: &str = "KILN_GPU_PREALLOCATE";

/// Whether kiln's CUDA clients reserve their fraction at start when neither
/// the API nor `KILN_GPU_PREALLOCATE` says. Measured on the H100
/// (`benches/RESULTS.md`, "Preallocation", 2026-11-23): gpt2-small bf16 from a
/// filled disk cache, 300 steps, twice each way: set-up 202–225 ms without
/// preallocation against 1,196–1,282 ms with it (the pool's ~1 s at the first
/// allocation), the first step 0.1–0.3 s slower (its buffers are allocated
/// then), the step median the same (20.74–20.75 against 20.76–20.77 ms), and
/// 8.8 GiB held on the GPU (nvidia-smi) instead of 61.4 GiB.
pub const DEFAULT_PREALLOCATE: bool = false;

/// A fraction of a GPU's memory, in `(0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryFraction(f32);

// Never NaN (checked in `parse`), so equality is total.
impl Eq for MemoryFraction {}

impl MemoryFraction {
    /// `value` if it lies in `(0, 1]`; otherwise an error naming the API
    /// option `memory_fraction`.
    pub fn new(value: f64) -> Result<MemoryFraction> {
        MemoryFraction::checked("memory_fraction", value, &value.to_string())
    }

    /// Parses `value` of variable `var`.
    pub fn parse(var: &'static str, value: &str) -> Result<MemoryFraction> {
        let bad = || RuntimeError::BadMemoryFraction { var, value: value.to_string() };
        let v: f64 = value.trim().parse().map_err(|_| bad())?;
        MemoryFraction::checked(var, v, value)
    }

    fn checked(var: &'static str, v: f64, spelled: &str) -> Result<MemoryFraction> {
        // As f32 (the option's type): a value that rounds to 0 is refused too.
        let f = v as f32;
        if v.is_finite() && v > 0.0 && v <= 1.0 && f > 0.0 {
            Ok(MemoryFraction(f))
        } else {
            Err(RuntimeError::BadMemoryFraction { var, value: spelled.to_string() })
        }
    }

    pub fn get(self) -> f32 {
        self.0
    }
}

/// The CUDA allocator settings kiln passes (`None`: the plugin's default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuMemory {
    pub memory_fraction: Option<MemoryFraction>,
    pub preallocate: Option<bool>,
}

impl GpuMemory {
    /// Reads `KILN_GPU_MEMORY_FRACTION` and `KILN_GPU_PREALLOCATE`.
    pub fn from_env() -> Result<GpuMemory> {
        let fraction = match std::env::var_os(ENV_GPU_MEMORY_FRACTION) {
            Some(v) if !v.is_empty() => Some(MemoryFraction::parse(ENV_GPU_MEMORY_FRACTION, &v.to_string_lossy())?),
            _ => None,
        };
        Ok(GpuMemory { memory_fraction: fraction, preallocate: bool_var(ENV_GPU_PREALLOCATE)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ClientOptions;

    #[test]
    fn fractions_in_the_half_open_unit_interval_parse() {
        assert_eq!(MemoryFraction::parse("V", "0.5").unwrap().get(), 0.5);
        assert_eq!(MemoryFraction::parse("V", " 1 ").unwrap().get(), 1.0);
        assert_eq!(MemoryFraction::new(0.25).unwrap().get(), 0.25);
    }

    #[test]
    fn anything_else_is_an_error_naming_the_variable_and_value() {
        for v in ["0", "-0.1", "1.5", "nan", "inf", "half", "", "1e-60"] {
            let e = MemoryFraction::parse("KILN_GPU_MEMORY_FRACTION", v).unwrap_err();
            assert!(matches!(e, RuntimeError::BadMemoryFraction { .. }), "{v}: {e:?}");
            let msg = e.to_string();
            assert!(msg.contains("KILN_GPU_MEMORY_FRACTION") && msg.contains(&format!("{v:?}")), "{msg}");
        }
        let e = MemoryFraction::new(2.0).unwrap_err().to_string();
        assert!(e.contains("memory_fraction") && e.contains('2'), "{e}");
    }

    #[test]
    fn api_settings_win_over_the_environment() {
        let env = GpuMemory { memory_fraction: Some(MemoryFraction::new(0.5).unwrap()), preallocate: Some(false) };
        let mut set = ClientOptions { memory_fraction: Some(MemoryFraction::new(0.9).unwrap()), ..Default::default() };
        env.apply(&mut set);
        assert_eq!(set.memory_fraction.map(MemoryFraction::get), Some(0.9));
        assert_eq!(set.preallocate, Some(false));
        let mut set = ClientOptions { preallocate: Some(true), ..Default::default() };
        env.apply(&mut set);
        assert_eq!(set.preallocate, Some(true));
    }

    #[test]
    fn preallocation_is_off_unless_asked_for() {
        let mut unset = ClientOptions::default();
        GpuMemory::default().apply(&mut unset);
        assert_eq!(unset.preallocate, Some(false));
        assert_eq!(unset.memory_fraction, None, "the plugin's fraction stays the cap");
        let mut asked = ClientOptions::default();
        GpuMemory { preallocate: Some(true), ..Default::default() }.apply(&mut asked);
        assert_eq!(asked.preallocate, Some(true));
    }
}
