//! Finding the PJRT plugin to load.
//!
//! Precedence: an explicit path > `KILN_PJRT_PLUGIN` > `PJRT_DEVICE` (`CPU`
//! by default, or `CUDA`), whose plugin is searched for at known relative
//! locations under every directory of `KILN_PLUGIN_DIR` and every
//! site-packages directory of `python3`. Discovery itself
//! ([`find_plugin`]) takes the directory list as an argument so it can be
//! tested without touching the environment. Loaded plugins are cached per
//! path by `pjrt::Api::load`.

use std::env;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Result, RuntimeError};

/// Env var naming the plugin `.so` directly.
pub const ENV_PLUGIN: &str = "KILN_PJRT_PLUGIN";
/// Env var listing extra directories to search (`:`-separated).
pub const ENV_PLUGIN_DIR: &str = "KILN_PLUGIN_DIR";
/// Env var choosing the device kind (`CPU` or `CUDA`).
pub const ENV_DEVICE: &str = "PJRT_DEVICE";

/// The device kind a plugin is searched for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PjrtDevice {
    Cpu,
    Cuda,
}

impl fmt::Display for PjrtDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PjrtDevice::Cpu => "CPU",
            PjrtDevice::Cuda => "CUDA",
        })
    }
}

impl PjrtDevice {
    /// Parses a `PJRT_DEVICE` value (case-insensitive; `GPU` means CUDA).
    pub fn parse(value: &str) -> Result<Self> {
        match value.trim().to_ascii_uppercase().as_str() {
            "CPU" => Ok(PjrtDevice::Cpu),
            "CUDA" | "GPU" => Ok(PjrtDevice::Cuda),
            _ => Err(RuntimeError::BadPluginEnv { var: ENV_DEVICE, value: value.to_string(), expected: "CPU or CUDA" }),
        }
    }

    /// Reads `PJRT_DEVICE` (unset or empty = CPU).
    pub fn from_env() -> Result<Self> {
        match crate::env::string_var(ENV_DEVICE)? {
            Some(v) if !v.trim().is_empty() => Self::parse(&v),
            _ => Ok(PjrtDevice::Cpu),
        }
    }

    /// Plugin locations relative to a site-packages directory, in order of preference.
    pub fn relative_locations(&self) -> &'static [&'static str] {
        match self {
            PjrtDevice::Cpu => &["xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"],
            PjrtDevice::Cuda => &[
                "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
                "xla_plugins/xla_cuda13_pjrt/xla_cuda13_pjrt.so",
                "jax_plugins/xla_cuda12/xla_cuda_plugin.so",
            ],
        }
    }

    /// The command that installs this device's plugin.
    pub fn install_hint(&self) -> &'static str {
        match self {
            PjrtDevice::Cpu => "python3 -m pip install xla-cpu-pjrt==0.0.1",
            PjrtDevice::Cuda => "python3 -m pip install jax-cuda13-pjrt",
        }
    }
}

/// The site-packages directories of `python3` (system, then user); empty if
/// there is no `python3`.
pub fn python_site_dirs() -> Vec<PathBuf> {
    let script = "import site\n\
        dirs = list(site.getsitepackages()) if hasattr(site, 'getsitepackages') else []\n\
        dirs.append(site.getusersitepackages())\n\
        print('\\n'.join(dirs))";
    match Command::new("python3").arg("-c").arg(script).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}

/// The directories searched by default: `KILN_PLUGIN_DIR` entries, then python's.
pub fn default_search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> =
        env::var_os(ENV_PLUGIN_DIR).map(|v| env::split_paths(&v).collect()).unwrap_or_default();
    dirs.extend(python_site_dirs());
    dirs
}

/// Every path looked at for `device` under `dirs`, in search order: the known
/// relative locations, then the bare file name directly in the directory.
pub fn candidate_paths(device: PjrtDevice, dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    for dir in dirs {
        for rel in device.relative_locations() {
            paths.push(dir.join(rel));
        }
        for rel in device.relative_locations() {
            if let Some(name) = Path::new(rel).file_name() {
                let direct = dir.join(name);
                if !paths.contains(&direct) {
                    paths.push(direct);
                }
            }
        }
    }
    paths
}

/// Finds `device`'s plugin under `dirs`; the error lists every path tried.
pub fn find_plugin(device: PjrtDevice, dirs: &[PathBuf]) -> Result<PathBuf> {
    let candidates = candidate_paths(device, dirs);
    match candidates.iter().find(|p| p.is_file()) {
        Some(found) => Ok(found.clone()),
        None => Err(RuntimeError::PluginNotFound {
            device: device.to_string(),
            searched: candidates,
            install_hint: device.install_hint().to_string(),
        }),
    }
}

/// Resolves the plugin path: `explicit` > `KILN_PJRT_PLUGIN` > `PJRT_DEVICE` search.
pub fn resolve_plugin(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path.to_path_buf());
    }
    if let Some(path) = env::var_os(ENV_PLUGIN).filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    find_plugin(PjrtDevice::from_env()?, &default_search_dirs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        assert_eq!(PjrtDevice::parse("cpu").unwrap(), PjrtDevice::Cpu);
        assert_eq!(PjrtDevice::parse("CUDA").unwrap(), PjrtDevice::Cuda);
        let err = PjrtDevice::parse("TPU").unwrap_err();
        assert!(err.to_string().contains("PJRT_DEVICE") && err.to_string().contains("TPU"), "{err}");
    }

    #[test]
    fn candidates_cover_all_cuda_locations() {
        let c = candidate_paths(PjrtDevice::Cuda, &[PathBuf::from("/x")]);
        assert!(c.contains(&PathBuf::from("/x/jax_plugins/xla_cuda13/xla_cuda_plugin.so")));
        assert!(c.contains(&PathBuf::from("/x/xla_plugins/xla_cuda13_pjrt/xla_cuda13_pjrt.so")));
        assert!(c.contains(&PathBuf::from("/x/jax_plugins/xla_cuda12/xla_cuda_plugin.so")));
    }
}
