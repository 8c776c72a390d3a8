//! Quiets the PJRT plugins' own log lines unless the user asks for them.
//!
//! XLA's plugins log through TSL/absl at INFO level to stderr: on the H100
//! every run prints dozens of `se_gpu_pjrt_client.cc` lines, on the CPU the
//! `cpu_device_count set via create_options` note. They are read once, when
//! the plugin's logging starts, from `TF_CPP_MIN_LOG_LEVEL` (0 INFO, 1
//! WARNING, 2 ERROR).
//!
//! Invariants:
//! - Runs before a plugin is loaded (the first `Api::load` of a path).
//! - Never overrides a level the user set: with `TF_CPP_MIN_LOG_LEVEL` in the
//!   environment, or `KILN_PLUGIN_LOGS=1`, nothing changes.
//! - Warnings and errors of the plugin stay visible (level 1, not 2).

/// Sets `TF_CPP_MIN_LOG_LEVEL=1` unless the user chose a level or asked for
/// the plugin's INFO lines with `KILN_PLUGIN_LOGS=1`.
/// `KILN_PLUGIN_LOGS` is a boolean: a value that is not one is an error.
pub fn quiet_unless_asked() -> crate::error::Result<()> {
    let asked = crate::env::bool_var("KILN_PLUGIN_LOGS")?.unwrap_or(false);
    if asked || std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_some() {
        return Ok(());
    }
    // Called while loading a plugin, before any plugin thread exists.
    std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "1");
    Ok(())
}
