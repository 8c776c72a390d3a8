//! What the built-in models' training loops share (the CLI's `kiln train`,
//! tests and benches): the client's start, the set-up's breakdown, one
//! recorded or captured update, the training state a checkpoint holds.

use std::time::Instant;

use kiln_compiler::ir::DType;

use kiln_frontend::amp::LossScalerConfig;
use kiln_frontend::grad;
use kiln_frontend::mark_step;
use kiln_frontend::nn::{InitPlacement, ParamStore};
use kiln_frontend::optim::AdamW;
use kiln_frontend::replicas;
use kiln_frontend::train_step::{TrainStep, TrainStepOptions};
use kiln_frontend::Backend;
use kiln_frontend::Tensor;
use kiln_frontend::{FrontendError, Result};

/// Env var: where the built-in models initialise their parameters, `host` or
/// `device` (see [`init_placement`]).
pub const ENV_INIT: &str = "KILN_INIT";

/// The PJRT client's start as a built-in loop sees it.
pub(crate) struct ClientStart {
    /// Seconds creating the client took (0 when it was open already or the
    /// backend is not PJRT).
    pub seconds: f64,
    /// The devices' memory pool being reserved on a thread of its own
    /// (accelerators only): its milliseconds when joined.
    pool: Option<std::thread::JoinHandle<f64>>,
}

impl ClientStart {
    /// Waits for the memory pool's reservation; its milliseconds, measured on
    /// its own thread (`None` when there was none).
    pub fn pool_ms(self) -> Option<f64> {
        self.pool.and_then(|h| h.join().ok())
    }
}

/// Opens the PJRT client when that is the backend (a no-op when it is open
/// already or the backend is another) and returns the seconds it took. The
/// loops call it before timing their set-up, so that `setup_seconds` is the
/// model, its parameters and the optimizer, not the plugin's own start
/// (CUDA context), which `client_seconds` reports. On an accelerator it then
/// starts reserving the devices' memory pool on a thread of its own
/// (`Client::reserve_device_memory`): with preallocation
/// (`KILN_GPU_PREALLOCATE=true`; off by default) the plugin reserves it at the
/// first allocation, about 1 s on an H100, which this overlaps with the set-up's
/// host work (recording the model, compiling or loading the init program);
/// the set-up's first allocation waits for the rest. An error there is left
/// to that allocation, which meets it again and reports it.
pub(crate) fn open_client() -> Result<ClientStart> {
    let started = Instant::now();
    let client = match kiln_frontend::backend() {
        Backend::Pjrt => Some(kiln_frontend::client()?),
        Backend::Reference | Backend::Eager => None,
    };
    let seconds = started.elapsed().as_secs_f64();
    let pool = client.filter(|c| c.platform_name() != "cpu").map(|client| {
        std::thread::spawn(move || {
            let t = Instant::now();
            if let Err(err) = client.reserve_device_memory() {
                tracing::debug!(%err, "kiln: reserving the devices' memory pool failed");
            }
            t.elapsed().as_secs_f64() * 1e3
        })
    });
    Ok(ClientStart { seconds, pool })
}

/// Where a built-in loop's set-up went (`TrainReport::setup`, the CLI JSON's
/// `setup_breakdown`), in milliseconds of host wall time. The phases
/// (`model_ms` … `wait_ms`) add up to the set-up but for `other_ms`; the
/// counters after them say what the steps inside those phases (the init
/// program on the device placement) spent, from [`kiln_frontend::metrics`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SetupBreakdown {
    /// Building the model: its parameters' host data (host init) or their
    /// init recorded as lazy ops (device init).
    pub model_ms: f64,
    /// Applying the run's sharding policy (`--shard`).
    pub shard_ms: f64,
    /// Making the optimizer's state.
    pub optimizer_ms: f64,
    /// `ParamStore::materialize`: the init program's step cut, compiled or
    /// loaded, and enqueued.
    pub init_step_ms: f64,
    /// Waiting for that step to finish on the devices.
    pub wait_ms: f64,
    /// The rest (the generator's seed, the ordered step, the timers).
    pub other_ms: f64,
    /// The devices' memory pool reserved on its own thread from the client's
    /// start (`ClientStart`): overlaps the phases, not part of their sum.
    pub memory_pool_ms: Option<f64>,
    /// Counters over the phases: closing traces and looking programs up.
    pub trace_ms: f64,
    /// kiln's optimizer pipeline on new programs.
    pub pipeline_ms: f64,
    /// Lowering and the plugin's compile.
    pub compile_ms: f64,
    /// Loading programs from the persistent cache.
    pub disk_load_ms: f64,
    /// Writing new programs to the persistent cache.
    pub disk_store_ms: f64,
    /// Moving host arguments to the devices.
    pub upload_ms: f64,
    /// Inside the plugin's execute calls.
    pub execute_ms: f64,
    /// Blocked on the devices.
    pub device_wait_ms: f64,
    /// Programs compiled and loaded from disk during the set-up.
    pub compiles: u64,
    pub disk_hits: u64,
    /// Bytes moved host to device during the set-up.
    pub host_to_device_bytes: u64,
}

impl SetupBreakdown {
    /// Fills the counters with what happened since `before`, and `other_ms`
    /// with what `total_ms` leaves after the phases.
    pub(crate) fn finish(&mut self, before: &kiln_frontend::metrics::Metrics, total_ms: f64) {
        let after = kiln_frontend::metrics::snapshot();
        let ms = |a: std::time::Duration, b: std::time::Duration| a.saturating_sub(b).as_secs_f64() * 1e3;
        self.trace_ms = ms(after.trace_time, before.trace_time);
        self.pipeline_ms = ms(after.pipeline_time, before.pipeline_time);
        self.compile_ms = ms(after.compile_time, before.compile_time);
        self.disk_load_ms = ms(after.disk_load_time, before.disk_load_time);
        self.disk_store_ms = ms(after.disk_store_time, before.disk_store_time);
        self.upload_ms = ms(after.upload_time, before.upload_time);
        self.execute_ms = ms(after.execute_time, before.execute_time);
        self.device_wait_ms = ms(after.device_wait_time, before.device_wait_time);
        self.compiles = after.compiles - before.compiles;
        self.disk_hits = after.disk_hits - before.disk_hits;
        self.host_to_device_bytes = after.host_to_device_bytes - before.host_to_device_bytes;
        let phases = self.model_ms + self.shard_ms + self.optimizer_ms + self.init_step_ms + self.wait_ms;
        self.other_ms = (total_ms - phases).max(0.0);
    }
}

/// The seed of step `step`'s own generator in a run seeded `seed`: both
/// through SplitMix64's output mix, so the generators of neighbouring steps
/// draw unrelated sequences. (A seed plus the step times SplitMix's own
/// increment, as the GPT's windows were drawn at first, makes step n+1's
/// draws step n's shifted by one: 15 of a batch's 16 windows repeated from
/// the step before.)
pub fn step_seed(seed: u64, step: u64) -> u64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    mix(seed ^ mix(step))
}

/// Milliseconds since `t`, and restarts `t`.
pub(crate) fn lap(t: &mut Instant) -> f64 {
    let now = Instant::now();
    let ms = now.saturating_duration_since(*t).as_secs_f64() * 1e3;
    *t = now;
    ms
}

/// Where a built-in model initialises: `chosen` when set, else `KILN_INIT`,
/// else on the devices when steps run through PJRT on an accelerator (the
/// init program: the same values as host init, nothing uploaded but the
/// seed), and on the host with the XLA CPU plugin (its devices are host
/// memory: the init program saves no upload there and costs a compile) and
/// on the reference and eager backends (which compute on the host anyway).
pub fn init_placement(chosen: Option<InitPlacement>) -> Result<InitPlacement> {
    if let Some(p) = chosen {
        return Ok(p);
    }
    if let Some(v) = std::env::var_os(ENV_INIT).filter(|v| !v.is_empty()) {
        let v = v.to_string_lossy();
        return InitPlacement::parse(v.trim()).ok_or_else(|| FrontendError::InvalidArgument {
            op: "init",
            reason: format!("{ENV_INIT}={v:?} is not a placement; expected host or device"),
        });
    }
    Ok(match kiln_frontend::backend() {
        Backend::Pjrt if kiln_frontend::client()?.platform_name() != "cpu" => InitPlacement::Device,
        Backend::Pjrt | Backend::Reference | Backend::Eager => InitPlacement::Host,
    })
}

/// The step every built-in loop runs: gradients of `loss`, averaged over
/// replicas, the update, and `mark_step`; returns the loss averaged over
/// replicas (a value of the finished step, so no forced sync).
pub(crate) fn update_and_step(params: &ParamStore, opt: &mut AdamW, loss: &Tensor, lr: f64) -> Result<f64> {
    let tensors = params.tensors();
    let grads = replicas::all_reduce_mean(&grad(loss, &tensors)?)?;
    opt.step(&tensors, &grads, lr)?;
    // The gradients are dead once the update is recorded; held across
    // `mark_step` they would become outputs of the step (written back, and
    // gathered whole under a mesh).
    drop(grads);
    let mean_loss = replicas::all_reduce_mean(std::slice::from_ref(loss))?.remove(0);
    mark_step()?;
    mean_loss.item()
}

/// The ordered step for a loop with mixed precision (`amp`) or clipping, `None`
/// when it has neither (the loop then keeps [`update_and_step`]). f16 gets a
/// dynamic loss scaler (its range is narrow); bf16 has f32's range and needs
/// none.
pub(crate) fn ordered_step(amp: Option<DType>, max_grad_norm: Option<f64>) -> Result<Option<TrainStep>> {
    if amp.is_none() && max_grad_norm.is_none() {
        return Ok(None);
    }
    let loss_scaling = (amp == Some(DType::F16)).then(LossScalerConfig::default);
    TrainStep::new(TrainStepOptions { loss_scaling, max_grad_norm }).map(Some)
}

/// What one step of a built-in loop returns: the loss, and whether the update
/// was skipped (non-finite gradients; only with an ordered step).
pub(crate) struct StepOutcome {
    pub loss: f64,
    pub skipped: bool,
    /// The global gradient norm before clipping (only with an ordered step).
    pub grad_norm: Option<f64>,
}

/// [`update_and_step`], or the ordered step when there is one; reads the loss
/// (and the skip flag) of the finished step.
pub(crate) fn run_step(
    ordered: Option<&mut TrainStep>,
    params: &ParamStore,
    opt: &mut AdamW,
    loss: &Tensor,
    lr: f64,
) -> Result<StepOutcome> {
    match ordered {
        None => Ok(StepOutcome { loss: update_and_step(params, opt, loss, lr)?, skipped: false, grad_norm: None }),
        Some(ts) => {
            let stats = ts.step(loss, &params.tensors(), opt, lr)?;
            Ok(StepOutcome {
                loss: stats.loss.item()?,
                skipped: stats.skipped.item()? != 0.0,
                grad_norm: Some(stats.grad_norm.item()?),
            })
        }
    }
}

/// The update of a built-in loop's captured step (`kiln::compile_step`), after
/// the forward that produced `loss`: the plain update of [`update_and_step`] or
/// the ordered step, at the learning rate `lr` (an f32 scalar input of the
/// step), without `mark_step`. Returns the loss averaged over replicas and,
/// with an ordered step, whether the update was skipped and the gradients'
/// global norm ([`read_outcome`] reads them). Records what [`run_step`] records, so replays are
/// bit-identical to traced steps.
pub(crate) fn record_update(
    ordered: Option<&mut TrainStep>,
    params: &[Tensor],
    opt: &mut AdamW,
    loss: &Tensor,
    lr: &Tensor,
) -> Result<Vec<Tensor>> {
    match ordered {
        None => {
            let grads = replicas::all_reduce_mean(&grad(loss, params)?)?;
            opt.step_lr(params, &grads, lr)?;
            Ok(vec![replicas::all_reduce_mean(std::slice::from_ref(loss))?.remove(0)])
        }
        Some(ts) => {
            let stats = ts.record_lr(loss, params, opt, lr)?;
            Ok(vec![stats.loss, stats.skipped, stats.grad_norm])
        }
    }
}

/// One step of a built-in loop recorded and never run (what `kiln profile
/// --max-batch` sizes): the forward `loss(x, y)` under autocast to `amp`, then
/// the update [`record_update`] records, with every parameter, moment and
/// other state it assigns over returned. Each of them donates its
/// buffer to its new value where the loops' steps donate
/// ([`kiln_frontend::donation_enabled`]; not on the XLA CPU plugin, whose step
/// then holds the old and the new state at once).
pub(crate) fn recorded_step(
    loss: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
    params: &ParamStore,
    opt: &mut AdamW,
    mut ordered: Option<TrainStep>,
    amp: Option<DType>,
    (x, y): (&Tensor, &Tensor),
) -> Result<kiln_compiler::ir::Graph> {
    let tensors = params.tensors();
    let lr = Tensor::scalar(1e-3f32);
    let mut graph = kiln_frontend::capture_graph(|| {
        let loss = kiln_frontend::amp::autocast_if(amp, || loss(x, y))?;
        let mut out = record_update(ordered.as_mut(), &tensors, opt, &loss, &lr)?;
        // The state the step assigned over (the generator's only where the
        // model draws random numbers).
        let state = training_state(params, opt).into_iter().chain(ordered.iter().flat_map(TrainStep::state));
        out.extend(state.map(|(_, t)| t).filter(Tensor::is_pending));
        Ok(out)
    })?;
    if !kiln_frontend::donation_enabled()? {
        graph.clear_aliases();
    }
    Ok(graph)
}

/// A built-in loop's step captured (`kiln::compile_step`): inputs `[x, y,
/// lr]` (`lr` an f32 scalar), the forward `loss(x, y)` under autocast to
/// `amp`, then [`record_update`]. The borrows are of the trainer's fields, so
/// the loop keeps its sampler and step counter.
pub(crate) fn captured_update<'a>(
    loss: impl Fn(&Tensor, &Tensor) -> Result<Tensor> + 'a,
    params: Vec<Tensor>,
    opt: &'a mut AdamW,
    mut ordered: Option<&'a mut TrainStep>,
    amp: Option<DType>,
) -> kiln_frontend::CompiledStep<impl FnMut(&[Tensor]) -> Result<Vec<Tensor>> + 'a> {
    kiln_frontend::compile_step(move |i: &[Tensor]| {
        let loss = kiln_frontend::amp::autocast_if(amp, || loss(&i[0], &i[1]))?;
        record_update(ordered.as_deref_mut(), &params, opt, &loss, &i[2])
    })
}

/// Reads what [`record_update`] returned, once its step has run (waiting for it
/// if it has not).
pub(crate) fn read_outcome(outputs: &[Tensor]) -> Result<StepOutcome> {
    let loss = outputs.first().map(Tensor::item).transpose()?.unwrap_or(f64::NAN);
    let skipped = outputs.get(1).map(Tensor::item).transpose()?.is_some_and(|s| s != 0.0);
    let grad_norm = outputs.get(2).map(Tensor::item).transpose()?;
    Ok(StepOutcome { loss, skipped, grad_norm })
}

/// Reads step `step`'s outcome (one step late, once a later step is
/// enqueued), takes its completion time from `clock` and records both in
/// `report`; returns the loss, the step time in ms and the gradient norm
/// (with an ordered step). A loss that is not
/// finite, where no loss scaler skipped the update, is
/// [`FrontendError::NonFiniteLoss`] unless `allow_non_finite`.
pub(crate) fn record_outcome(
    outputs: &[Tensor],
    step: u64,
    allow_non_finite: bool,
    report: &mut crate::mlp::TrainReport,
    clock: &mut StepClock,
) -> Result<(f64, f64, Option<f64>)> {
    let out = read_outcome(outputs)?;
    if !out.loss.is_finite() && !out.skipped && !allow_non_finite {
        return Err(kiln_frontend::FrontendError::NonFiniteLoss { step, loss: out.loss });
    }
    let ms = clock.completed();
    report.skipped_steps += u64::from(out.skipped);
    report.losses.push(out.loss);
    report.step_ms.push(ms);
    Ok((out.loss, ms, out.grad_norm))
}

/// Step times of a loop whose steps run asynchronously, completion to
/// completion: a step's time runs from the completion of the step before it
/// (seen when that step's loss was read) to its own, the first step's from
/// its start. Timing the enqueue instead would report host time only, since
/// `mark_step` and a captured call return before the step has run. Host and
/// device time both count, so a run's step times add up to its wall time from
/// the first step's start to the last step's completion, and a step's time is
/// the loop's period whichever side is the bottleneck.
#[derive(Debug, Default)]
pub(crate) struct StepClock {
    last: Option<Instant>,
}

impl StepClock {
    /// A step is about to be enqueued; only the run's first start counts.
    pub(crate) fn start(&mut self) {
        self.last.get_or_insert_with(Instant::now);
    }

    /// The step read last has completed (its loss was just read): its time in
    /// milliseconds.
    pub(crate) fn completed(&mut self) -> f64 {
        let now = Instant::now();
        let ms = self.last.map_or(0.0, |last| now.saturating_duration_since(last).as_secs_f64() * 1e3);
        self.last = Some(now);
        ms
    }
}

/// The whole training state by name: parameters, optimizer state, RNG state
/// (the names of [`kiln_frontend::checkpoint::training_state`]).
pub(crate) fn training_state(params: &ParamStore, opt: &AdamW) -> Vec<(String, Tensor)> {
    kiln_frontend::checkpoint::state_of(params.iter().map(|(n, t)| (n.to_string(), t.clone())).collect(), opt)
}

#[cfg(test)]
mod tests {
    use super::step_seed;
    use kiln_frontend::nn::HostRng;

    /// Neighbouring steps draw unrelated windows: none of step n+1's first
    /// 16 draws is among step n's (with seed + n·increment, 15 were).
    #[test]
    fn neighbouring_steps_draw_unrelated_sequences() {
        for seed in [0, 1, 0x5eed] {
            let draws = |step: u64| {
                let mut r = HostRng::new(step_seed(seed, step));
                (0..16).map(|_| r.next_u64()).collect::<Vec<u64>>()
            };
            for n in 0..200 {
                let (a, b) = (draws(n), draws(n + 1));
                assert!(b.iter().all(|x| !a.contains(x)), "seed {seed}, steps {n} and {}", n + 1);
            }
        }
        assert_ne!(step_seed(1, 0), step_seed(0, 1));
    }
}
