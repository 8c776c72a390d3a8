//! The executor's state: which backend runs a step, the PJRT client and the
//! replica plan it was opened for, and the queue of steps still running on
//! the devices. [`crate::engine::run`] runs programs through it and keeps the
//! queue's invariants; this module holds the data and how it is set up, and
//! imports nothing of the engine that holds it (the per-thread context).

use std::collections::VecDeque;
use std::rc::Rc;

use kiln_runtime::replicas::ReplicaPlan;
use kiln_runtime::Client;

use crate::core::error::{FrontendError, Result};
use crate::core::storage::{Hook, StepRun};

/// Which machinery runs a finished step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Compile to StableHLO and run through the PJRT plugin (the default).
    Pjrt,
    /// Evaluate on kiln's reference interpreter on the host (f64 arithmetic:
    /// the correctness oracle for side-by-side convergence checks).
    Reference,
    /// Run every op the moment it is recorded, on candle-core CPU tensors:
    /// values can be read mid-step without cutting it (step-through
    /// debugging), and it is the eager baseline compilation is measured
    /// against (`engine::eager`).
    Eager,
}

/// Where a step runs and what is still running.
pub(crate) struct Executor {
    pub backend: Backend,
    pub client: Option<Client>,
    /// How many replicas every step runs on and how the client is made:
    /// from the environment on first use, or set by `engine::replicas`.
    pub plan: Option<ReplicaPlan>,
    /// Unfinished steps, oldest first (kept by [`crate::engine::run`]).
    pub(crate) in_flight: VecDeque<Rc<StepRun>>,
    /// `None`: read `KILN_MAX_STEPS_IN_FLIGHT` on first use.
    pub(crate) max_in_flight: Option<usize>,
    /// Hooks registered for the step being recorded.
    pub(crate) hooks: Vec<Hook>,
}

impl Executor {
    pub fn new() -> Executor {
        Executor {
            backend: Backend::Pjrt,
            client: None,
            plan: None,
            in_flight: VecDeque::new(),
            max_in_flight: None,
            hooks: Vec::new(),
        }
    }

    /// The replica plan: `PJRT_DEVICE`, `GPU_NUM_DEVICES` and
    /// `KILN_CPU_DEVICES` on first use, unless set explicitly.
    pub fn plan(&mut self) -> Result<&ReplicaPlan> {
        if self.plan.is_none() {
            crate::core::warnings::check_env()?;
            if let Some(mesh) = crate::core::mesh::Mesh::from_env()? {
                let plan = crate::core::mesh::plan_for(&mesh, &kiln_runtime::ReplicaEnv::from_env()?)?;
                tracing::info!(%mesh, "kiln: device mesh from KILN_MESH");
                self.plan = Some(plan);
                crate::core::settings::with(|s| s.mesh = Some(mesh));
                return Ok(self.plan.as_ref().expect("set above"));
            }
            let plan = kiln_runtime::replicas::replica_plan_from_env()?;
            if plan.replicas > 1 {
                tracing::info!(replicas = plan.replicas, source = ?plan.source, "kiln: data-parallel replicas");
            }
            self.plan = Some(plan);
        }
        Ok(self.plan.as_ref().expect("set above"))
    }

    pub fn client(&mut self) -> Result<Client> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let mut plan = self.plan()?.clone();
        let byte_limit =
            crate::core::settings::memory_limit().is_some() && crate::core::settings::activation_budget().is_none();
        let env = kiln_runtime::GpuMemory::from_env()?.preallocate;
        if reserves_pool_for_limit(plan.device, plan.client_options.preallocate, env, byte_limit) {
            plan.client_options.preallocate = Some(true);
        }
        let client = plan.create_client()?;
        tracing::info!(platform = %client.platform_name(), devices = client.devices().len(), "kiln: PJRT client ready");
        self.client = Some(client.clone());
        Ok(client)
    }

    pub(crate) fn max_in_flight(&mut self) -> Result<usize> {
        if let Some(n) = self.max_in_flight {
            return Ok(n);
        }
        let n = match kiln_runtime::env::string_var("KILN_MAX_STEPS_IN_FLIGHT")? {
            // Unset or empty: the default, as for every kiln variable.
            None => DEFAULT_MAX_IN_FLIGHT,
            Some(v) if v.trim().is_empty() => DEFAULT_MAX_IN_FLIGHT,
            Some(v) => v.trim().parse::<usize>().map_err(|_| FrontendError::BadEnv {
                var: "KILN_MAX_STEPS_IN_FLIGHT",
                value: v.clone(),
                expected: "a count of steps (0 runs every step synchronously)",
            })?,
        };
        self.max_in_flight = Some(n);
        Ok(n)
    }
}

/// The state goes when its thread ends (for the main thread: at process
/// exit, before the plugin's exit handlers). Steps still running are waited
/// for first, so the client is never destroyed, nor the plugin torn down,
/// under a running step; their outcomes are dropped (the program is ending;
/// [`crate::engine::run::quiesce`] is the explicit form).
impl Drop for Executor {
    fn drop(&mut self) {
        for run in self.in_flight.drain(..) {
            if let Some(done) = run.done.borrow_mut().take() {
                if let Err(e) = done.wait() {
                    tracing::debug!(step = run.step, error = %e, "kiln: a step still in flight at exit failed");
                }
            }
        }
    }
}

/// Steps that may run on the devices while the host records the next ones.
pub(crate) const DEFAULT_MAX_IN_FLIGHT: usize = 2;

/// Whether a client opened for a step planned to a byte limit (`byte_limit`)
/// reserves its memory pool at start: on CUDA, where neither the API
/// (`asked`) nor `KILN_GPU_PREALLOCATE` (`env`) says. Such a step is sized to
/// the allocator's whole pool, and grown region by region the pool cannot
/// give one temporary buffer that near its limit (H100, gpt2-small at batch
/// 512 under a 59.4 GiB limit: 56.0 GiB refused; with the pool reserved at
/// start the step ran, `docs/memory.md`).
pub(crate) fn reserves_pool_for_limit(
    device: kiln_runtime::PjrtDevice,
    asked: Option<bool>,
    env: Option<bool>,
    byte_limit: bool,
) -> bool {
    byte_limit && device == kiln_runtime::PjrtDevice::Cuda && asked.is_none() && env.is_none()
}
