//! What the remat examples (`remat_curve`, `remat_llama`) share around their
//! step: the budget and timing arguments, the client, and XLA's memory stats
//! of the step program as JSON, so that both read and report a run the same
//! way.

use kiln::optim::{AdamW, AdamWConfig};
use kiln::{DType, Tensor};
use serde_json::{json, Value};

use super::timing::Res;

/// A budget argument: `none` (no remat pass) or a percentage of the step's
/// activation memory (`50` or `50%`), as a fraction.
pub fn budget(arg: &str, usage: &str) -> Res<Option<f64>> {
    match arg {
        "none" => Ok(None),
        p => Ok(Some(percent(p).map_err(|e| format!("{e}; {usage}"))? / 100.0)),
    }
}

/// `50` or `50%` as the number 50.
pub fn percent(p: &str) -> Res<f64> {
    Ok(p.trim_end_matches('%').parse().map_err(|_| format!("budget `{p}` is not a percentage"))?)
}

/// `ITERS REPS` after the config and the budget (defaults 10 and 3).
pub fn iters_reps(args: &[String]) -> Res<(usize, usize)> {
    let iters = args.get(2).map(|a| a.parse()).transpose()?.unwrap_or(10);
    let reps = args.get(3).map(|a| a.parse()).transpose()?.unwrap_or(3);
    Ok((iters, reps))
}

/// Opens the client the environment names (`PJRT_DEVICE`, the replicas),
/// makes it this thread's and sets the activation budget; the platform's name.
pub fn client_under(fraction: Option<f64>) -> Res<String> {
    let client = kiln::runtime::replica_plan_from_env()?.create_client()?;
    let platform = client.platform_name().to_string();
    kiln::set_client(client);
    kiln::set_activation_budget(fraction)?;
    Ok(platform)
}

/// XLA's compiled memory stats of the step: the program with the most
/// argument bytes (the parameters' init has none).
pub fn step_memory() -> Res<kiln::runtime::CompiledMemoryStats> {
    Ok(kiln::shard::program_memory_stats()?
        .into_iter()
        .max_by_key(|s| s.argument_size_in_bytes)
        .ok_or("no compiled program")?)
}

/// `stats` as the examples' `xla` JSON object.
pub fn xla_json(stats: &kiln::runtime::CompiledMemoryStats) -> Value {
    json!({
        "argument_bytes": stats.argument_size_in_bytes,
        "output_bytes": stats.output_size_in_bytes,
        "alias_bytes": stats.alias_size_in_bytes,
        "temp_bytes": stats.temp_size_in_bytes,
        "peak_bytes": stats.held_bytes(),
    })
}

/// Where a live-bytes curve peaks (the first position of its highest value)
/// and the peak; `None` for an empty curve.
pub fn live_peak(curve: &[u64]) -> Option<(usize, u64)> {
    curve.iter().enumerate().max_by_key(|&(i, b)| (*b, std::cmp::Reverse(i))).map(|(i, &b)| (i, b))
}

/// The remat examples' optimizer: AdamW with weight decay 0.1.
pub fn adamw(params: &[Tensor]) -> kiln::Result<AdamW> {
    AdamW::new(params, AdamWConfig { weight_decay: 0.1, ..Default::default() })
}

/// One train step: `loss` recorded under bf16 autocast, its gradients, the
/// AdamW update at `lr`; the loss.
pub fn train_step(
    params: &[Tensor],
    opt: &mut AdamW,
    lr: &Tensor,
    loss: impl FnOnce() -> kiln::Result<Tensor>,
) -> kiln::Result<Tensor> {
    let loss = kiln::amp::autocast(DType::BF16, loss)?;
    let grads = kiln::grad(&loss, params)?;
    opt.step_lr(params, &grads, lr)?;
    Ok(loss)
}
