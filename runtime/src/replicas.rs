//! Data-parallel replicas on one host: how many, read from the environment.
//!
//! - `PJRT_DEVICE=CUDA`: `GPU_NUM_DEVICES=N` trains N replicas on the first N
//!   GPUs the CUDA driver shows; unset, every visible GPU is a replica (and
//!   the choice is logged).
//! - `PJRT_DEVICE=CPU` (the default): `KILN_CPU_DEVICES=N` asks the XLA CPU
//!   plugin for N devices (its `cpu_device_count` client option) and trains N
//!   replicas on them; unset, one replica on the plugin's default devices.
//!
//! Where it runs: once, before the client is made. The caller creates its
//! client from [`ReplicaPlan::client_options`] and checks the client against
//! the plan ([`ReplicaPlan::create_client`] does both).
//!
//! The decisions are pure functions of the values and the GPU probe
//! ([`cpu_replica_plan`], [`gpu_replica_plan`],
//! [`ReplicaPlan::check_pjrt_devices`]), so every bad value is unit-tested;
//! [`ReplicaEnv::from_env`] and [`replica_plan_from_env`] only read the
//! process environment and run the probe.
//!
//! Invariants: a plan's `replicas` is at least 1 and never more than the
//! devices it was checked against; every refusal is a [`RuntimeError`] naming
//! the variable, its value and the devices found; an empty value counts as
//! unset, as it does for `PJRT_DEVICE`.

use std::env;
use std::ffi::OsString;
use std::fmt;

use crate::client::{Client, ClientOptions, DistributedOptions};
use crate::distributed::{self, Identity, NodeEnv};
use crate::error::{CountProblem, DevicesFound, Result, RuntimeError};
use crate::gpu::{self, GpuProbe};
use crate::plugin::PjrtDevice;

/// Env var: how many GPUs of this host train as replicas (`PJRT_DEVICE=CUDA`).
pub const ENV_GPU_NUM_DEVICES: &str = "GPU_NUM_DEVICES";
/// Env var: how many CPU devices (and replicas) the CPU plugin makes.
pub const ENV_CPU_DEVICES: &str = "KILN_CPU_DEVICES";
/// The most CPU devices kiln asks the CPU plugin for. Each is a thread pool
/// slot (two, with XLA's intra-op pool) and a copy of the parameters and of
/// every step's buffers; 1000 devices took 7.5 GB and 1,257 threads before the
/// first step. CPU replicas exist to test data parallelism on one host, which
/// 64 covers with room to spare.
pub const MAX_CPU_DEVICES: usize = 64;

/// Where a plan's replica count came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaSource {
    /// Set by `var=value`.
    Env { var: &'static str, value: String },
    /// `GPU_NUM_DEVICES` unset: every GPU the driver shows.
    AllGpus,
    /// `KILN_CPU_DEVICES` unset: one replica.
    CpuDefault,
}

impl fmt::Display for ReplicaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplicaSource::Env { var, value } => write!(f, "{var}={value}"),
            ReplicaSource::AllGpus => {
                write!(f, "{ENV_GPU_NUM_DEVICES} unset: every visible GPU")
            }
            ReplicaSource::CpuDefault => write!(f, "{ENV_CPU_DEVICES} unset"),
        }
    }
}

/// How many replicas to train and how to create the client that runs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaPlan {
    pub device: PjrtDevice,
    /// Replicas of the step, one per device: the first `replicas` devices of
    /// the client, in its order. At least 1.
    pub replicas: usize,
    pub source: ReplicaSource,
    /// What to pass to [`Client::new`].
    pub client_options: ClientOptions,
    /// The GPU probe the count was checked against (CUDA plans only).
    pub gpus: Option<GpuProbe>,
    /// This process's place in the run (`KILN_NUM_NODES`...); one process
    /// unless set. `replicas` counts this process's replicas; the run has
    /// `replicas × num_nodes` (every node brings the same number).
    pub identity: Identity,
}

impl ReplicaPlan {
    /// Checks a client made from this plan: on CUDA its device count must be
    /// the driver's GPU count, on CPU the count `KILN_CPU_DEVICES` asked for
    /// (at least one device otherwise). `pjrt_devices` describes the client's
    /// devices in order (`[0] NVIDIA H100 80GB HBM3`).
    pub fn check_pjrt_devices(&self, pjrt_devices: &[String]) -> Result<()> {
        let exposed = pjrt_devices.len();
        match self.device {
            PjrtDevice::Cuda if self.client_options.visible_devices.is_some() => {
                let driver_gpus = self.gpus.as_ref().map(GpuProbe::gpu_names).unwrap_or_default();
                let wanted = self.client_options.visible_devices.as_deref().unwrap_or_default();
                if wanted.len() != exposed {
                    let var = match &self.source {
                        ReplicaSource::Env { var, .. } => *var,
                        ReplicaSource::AllGpus | ReplicaSource::CpuDefault => distributed::identity::ENV_LOCAL_DEVICES,
                    };
                    return Err(RuntimeError::GpuCountMismatch {
                        var,
                        driver_gpus: wanted
                            .iter()
                            .map(|&i| driver_gpus.get(i).cloned().unwrap_or_else(|| format!("[{i}] ?")))
                            .collect(),
                        pjrt_devices: pjrt_devices.to_vec(),
                    });
                }
                Ok(())
            }
            PjrtDevice::Cuda => {
                let driver_gpus = self.gpus.as_ref().map(GpuProbe::gpu_names).unwrap_or_default();
                if driver_gpus.len() != exposed {
                    return Err(RuntimeError::GpuCountMismatch {
                        var: ENV_GPU_NUM_DEVICES,
                        driver_gpus,
                        pjrt_devices: pjrt_devices.to_vec(),
                    });
                }
                Ok(())
            }
            PjrtDevice::Cpu => {
                let asked = self.client_options.cpu_device_count;
                if asked.is_some_and(|n| n != exposed) || self.replicas > exposed {
                    return Err(RuntimeError::CpuDeviceCountIgnored {
                        var: ENV_CPU_DEVICES,
                        requested: asked.unwrap_or(self.replicas),
                        exposed,
                    });
                }
                Ok(())
            }
        }
    }

    /// Creates the client from [`ReplicaPlan::client_options`] and checks its
    /// devices against the plan.
    ///
    /// With several nodes it first joins the run ([`distributed::join`]:
    /// store, start-up barrier, watchdog) and hands the run's store to the
    /// plugin; the run's global device count must then be
    /// `replicas × num_nodes`.
    pub fn create_client(&self) -> Result<Client> {
        let mut options = self.client_options.clone();
        if self.device == PjrtDevice::Cuda {
            crate::gpu_memory::GpuMemory::from_env()?.apply(&mut options);
        }
        if self.identity.is_distributed() {
            let session = distributed::join(&self.identity)?;
            options.distributed = Some(DistributedOptions {
                node_id: self.identity.node_id,
                num_nodes: self.identity.num_nodes,
                store: Some(session.store()),
            });
        }
        let client = Client::new(&options)?;
        let global = client.global_devices().len();
        if self.identity.is_distributed() && global != self.replicas * self.identity.num_nodes as usize {
            return Err(RuntimeError::UnevenNodes {
                global,
                local: client.devices().len(),
                num_nodes: self.identity.num_nodes,
            });
        }
        let devices: Vec<String> = client.devices().iter().map(|d| format!("[{}] {}", d.id(), d.kind())).collect();
        self.check_pjrt_devices(&devices)?;
        Ok(client)
    }
}

/// The environment variables a plan is made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaEnv {
    /// `PJRT_DEVICE`.
    pub device: PjrtDevice,
    /// `GPU_NUM_DEVICES` as set (not yet checked).
    pub gpu_num_devices: Option<String>,
    /// `KILN_CPU_DEVICES` as set (not yet checked).
    pub cpu_devices: Option<String>,
    /// The process-identity variables (`KILN_NUM_NODES`, ...).
    pub node: NodeEnv,
}

fn read_var(name: &str) -> Option<String> {
    // A value that is not UTF-8 is kept (lossily) so the error can show it.
    env::var_os(name).map(|v: OsString| v.to_string_lossy().into_owned())
}

impl ReplicaEnv {
    /// Reads `PJRT_DEVICE`, `GPU_NUM_DEVICES` and `KILN_CPU_DEVICES`.
    pub fn from_env() -> Result<ReplicaEnv> {
        Ok(ReplicaEnv {
            device: PjrtDevice::from_env()?,
            gpu_num_devices: read_var(ENV_GPU_NUM_DEVICES),
            cpu_devices: read_var(ENV_CPU_DEVICES),
            node: NodeEnv::from_env(),
        })
    }

    /// The plan for these values; `probe` is called only for CUDA.
    pub fn plan(&self, probe: impl FnOnce() -> GpuProbe) -> Result<ReplicaPlan> {
        let identity = self.node.identity()?;
        let mut plan = match self.device {
            PjrtDevice::Cpu => {
                if identity.is_distributed() {
                    // The CPU plugin ignores node_id/num_nodes and the store.
                    return Err(RuntimeError::PlatformNotDistributed {
                        platform: "cpu".into(),
                        num_nodes: identity.num_nodes,
                    });
                }
                if set(self.gpu_num_devices.as_deref()).is_some() {
                    tracing::warn!("{ENV_GPU_NUM_DEVICES} is ignored with PJRT_DEVICE=CPU; {ENV_CPU_DEVICES} sets the CPU replicas");
                }
                cpu_replica_plan(self.cpu_devices.as_deref())?
            }
            PjrtDevice::Cuda => {
                if set(self.cpu_devices.as_deref()).is_some() {
                    tracing::warn!("{ENV_CPU_DEVICES} is ignored with PJRT_DEVICE=CUDA; {ENV_GPU_NUM_DEVICES} sets the GPU replicas");
                }
                match &identity.local_devices {
                    Some(list) => local_gpu_plan(list, probe())?,
                    None => gpu_replica_plan(self.gpu_num_devices.as_deref(), probe())?,
                }
            }
        };
        plan.identity = identity;
        Ok(plan)
    }
}

/// Reads the environment, probes the GPUs when `PJRT_DEVICE=CUDA`, and
/// returns the client options and replica count to use.
pub fn replica_plan_from_env() -> Result<ReplicaPlan> {
    ReplicaEnv::from_env()?.plan(gpu::probe_gpus)
}

/// An empty or blank value counts as unset.
fn set(value: Option<&str>) -> Option<&str> {
    value.filter(|v| !v.trim().is_empty())
}

/// Parses a count. Values too large for any integer type are kept as
/// `u128::MAX` so that they fail as "too many", not as "not a number".
fn parse_count(value: &str) -> std::result::Result<u128, CountProblem> {
    use std::num::IntErrorKind;
    match value.trim().parse::<i128>() {
        Ok(n) if n < 1 => Err(CountProblem::NotPositive),
        Ok(n) => Ok(n.unsigned_abs()),
        Err(e) => match e.kind() {
            IntErrorKind::PosOverflow => Ok(u128::MAX),
            IntErrorKind::NegOverflow => Err(CountProblem::NotPositive),
            _ => Err(CountProblem::NotANumber),
        },
    }
}

/// Checks `value` as a count of at most `available` devices.
fn checked_count(
    var: &'static str,
    value: &str,
    available: usize,
    found: impl FnOnce() -> DevicesFound,
) -> Result<usize> {
    let problem = match parse_count(value) {
        Ok(n) if n <= available as u128 => return Ok(n as usize),
        Ok(_) => CountProblem::TooMany { available },
        Err(problem) => problem,
    };
    Err(RuntimeError::BadDeviceCount { var, value: value.to_string(), problem, found: found() })
}

/// The CPU plan for a `KILN_CPU_DEVICES` value (`None` = unset).
pub fn cpu_replica_plan(value: Option<&str>) -> Result<ReplicaPlan> {
    let Some(value) = set(value) else {
        return Ok(ReplicaPlan {
            device: PjrtDevice::Cpu,
            replicas: 1,
            source: ReplicaSource::CpuDefault,
            client_options: ClientOptions::default(),
            gpus: None,
            identity: Identity::single(),
        });
    };
    let n =
        checked_count(ENV_CPU_DEVICES, value, MAX_CPU_DEVICES, || DevicesFound::CpuPlugin { max: MAX_CPU_DEVICES })?;
    Ok(ReplicaPlan {
        device: PjrtDevice::Cpu,
        replicas: n,
        source: ReplicaSource::Env { var: ENV_CPU_DEVICES, value: value.trim().to_string() },
        client_options: ClientOptions { cpu_device_count: Some(n), ..ClientOptions::default() },
        gpus: None,
        identity: Identity::single(),
    })
}

/// The CUDA plan for a `GPU_NUM_DEVICES` value (`None` = unset) and what the
/// GPU probe found: a set count opens only the first `N` GPUs
/// (`visible_devices`), unset opens them all.
pub fn gpu_replica_plan(value: Option<&str>, probe: GpuProbe) -> Result<ReplicaPlan> {
    let available = probe.gpus().len();
    let (replicas, source) = match set(value) {
        None => {
            if available == 0 {
                return Err(RuntimeError::NoGpus { var: ENV_GPU_NUM_DEVICES, found: probe });
            }
            tracing::info!(
                gpus = available,
                names = %probe.gpu_names().join(", "),
                "{ENV_GPU_NUM_DEVICES} is unset: training on every visible GPU"
            );
            (available, ReplicaSource::AllGpus)
        }
        Some(value) => {
            let n = checked_count(ENV_GPU_NUM_DEVICES, value, available, || DevicesFound::Gpus(probe.clone()))?;
            let source = ReplicaSource::Env { var: ENV_GPU_NUM_DEVICES, value: value.trim().to_string() };
            (n, source)
        }
    };
    // A count opens only the GPUs it trains on (the plugin's
    // `visible_devices`): otherwise the plugin opens, and reserves memory on,
    // every GPU of the host.
    let visible_devices = match source {
        ReplicaSource::Env { .. } => Some((0..replicas).collect()),
        ReplicaSource::AllGpus | ReplicaSource::CpuDefault => None,
    };
    Ok(ReplicaPlan {
        device: PjrtDevice::Cuda,
        replicas,
        source,
        client_options: ClientOptions { visible_devices, ..ClientOptions::default() },
        gpus: Some(probe),
        identity: Identity::single(),
    })
}

/// The CUDA plan for `KILN_LOCAL_DEVICES` (one replica per listed GPU, the
/// plugin opening only those: its `visible_devices`).
pub fn local_gpu_plan(ordinals: &[usize], probe: GpuProbe) -> Result<ReplicaPlan> {
    let available = probe.gpus().len();
    if let Some(&ordinal) = ordinals.iter().find(|&&o| o >= available) {
        return Err(RuntimeError::LocalDeviceOutOfRange { ordinal, available });
    }
    if ordinals.is_empty() {
        return Err(RuntimeError::NoGpus { var: distributed::identity::ENV_LOCAL_DEVICES, found: probe });
    }
    Ok(ReplicaPlan {
        device: PjrtDevice::Cuda,
        replicas: ordinals.len(),
        source: ReplicaSource::Env {
            var: distributed::identity::ENV_LOCAL_DEVICES,
            value: ordinals.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
        },
        client_options: ClientOptions { visible_devices: Some(ordinals.to_vec()), ..ClientOptions::default() },
        gpus: Some(probe),
        identity: Identity::single(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_parse_with_their_problem() {
        assert_eq!(parse_count(" 3 "), Ok(3));
        assert_eq!(parse_count("+2"), Ok(2));
        assert_eq!(parse_count("0"), Err(CountProblem::NotPositive));
        assert_eq!(parse_count("-1"), Err(CountProblem::NotPositive));
        assert_eq!(parse_count("-99999999999999999999999999999999999999999"), Err(CountProblem::NotPositive));
        assert_eq!(parse_count("99999999999999999999999999999999999999999"), Ok(u128::MAX));
        assert_eq!(parse_count("two"), Err(CountProblem::NotANumber));
        assert_eq!(parse_count("1.5"), Err(CountProblem::NotANumber));
        assert_eq!(parse_count("0x2"), Err(CountProblem::NotANumber));
    }

    #[test]
    fn blank_values_count_as_unset() {
        assert_eq!(set(Some("  ")), None);
        assert_eq!(set(Some("")), None);
        assert_eq!(set(Some("2")), Some("2"));
    }
}
