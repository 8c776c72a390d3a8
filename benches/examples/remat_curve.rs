//! One point of the `remat-curve` benchmark (`benches/device/remat.sh`): the
//! GPT train step of `device_bench` (bf16 autocast, AdamW with weight decay
//! 0.1, captured with `compile_step`) under one activation budget, timed the
//! way `device_bench` times it (warm-up, then the median of `reps` runs of
//! `iters` steps, each run ended by a device sync, steps asynchronous).
//!
//! `remat_curve CONFIG BUDGET [ITERS REPS]`: CONFIG is `gpt2-small` (vocab
//! 50304) or `tiny` (vocab 64, for the CPU plugin); BUDGET is `none` (no remat
//! pass) or a percentage of the step's activation memory (`50`: the remat pass
//! plans for the unplanned predicted peak less half of the unplanned predicted
//! temporaries, `docs/memory.md`). One process per budget, so no compiled
//! program is shared between budgets; run it with `KILN_CACHE=off`.
//!
//! `remat_curve CONFIG plan PERCENT...` runs nothing: it records the same
//! train step (forward, gradients, the AdamW update) and prints the remat
//! pass's plan at each budget (`PLAN {json}`), judged by the CUDA fusion model
//! (`XlaGpuFusion`), for choosing budgets for the H100 on a machine without it.
//! The step has the GPU's LM-head blocks and, as a step does, the device
//! checks' flag output (`capture_graph`). Before the flags were kept, the
//! checks' nodes were dropped here and node ids shifted, and with them how
//! greedy breaks ties: a few plans differed a little from the H100's (at 40%
//! of gpt2-small's activation memory, 1.92 against 2.00 ms added by the
//! model). With the flags, 50/33/25% give 0.864/2.860/4.542 ms (before:
//! 0.864/2.775/4.556), the H100's own plans to the nanosecond and the byte
//! (2026-11-24, `benches/RESULTS.md`).
//!
//! `REMAT_PLAN_DUMP=DIR` (plan mode): also writes each plan's CUDA module,
//! as the lowering gives it to XLA, to `DIR/plan_PERCENT.mlir`.
//!
//! `REMAT_PEAK_LIST=1` (plan mode): also prints where each plan's live bytes
//! peak by the CUDA model, the temp curve's highest points and the largest
//! temporaries live at the peak, with the ops that write them. Plan mode's
//! step takes its LM-head blocks from `KILN_LM_HEAD` where it is set, as the
//! timed step does.
//!
//! `REMAT_OFFLOAD=1`: the remat pass offloads saved activations to pinned
//! host memory before it recomputes (`kiln::set_host_offload`, CUDA only).
//!
//! `REMAT_HOST_COPIES=1`: the remat pass moves what its plan holds across the
//! peak to pinned host memory over kiln's own copies
//! (`kiln::set_host_copies`, `memory::HostCopies`).
//!
//! Prints one line `RESULT {json}`: XLA's compiled memory stats of the step
//! program, the remat plan (the model's bytes before/after, each recomputed
//! value), the step's FLOPs and the step time.

use std::time::Instant;

use kiln::models::gpt::{Gpt, GptConfig, LmHeadLoss};
use kiln::nn::ParamStore;
use kiln::{metrics, Tensor};
use serde_json::{json, Value};

#[path = "common/budget_run.rs"]
mod budget_run;
#[path = "common/gpt_step.rs"]
mod gpt_step;
#[path = "common/timing.rs"]
mod timing;
use timing::{bench, Res};

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: remat_curve gpt2-small|tiny none|PERCENT [ITERS REPS]";
    let (Some(config), Some(budget)) = (args.first(), args.get(1)) else { return Err(usage.into()) };
    let cfg = gpt_step::config(config).map_err(|e| format!("{e}; {usage}"))?;
    if budget == "plan" {
        return plan_only(&cfg, &args[2..]);
    }
    let fraction = budget_run::budget(budget, usage)?;
    let (iters, reps) = budget_run::iters_reps(&args)?;
    let platform = budget_run::client_under(fraction)?;
    kiln::set_host_offload(offload_from_env());
    kiln::set_host_copies(host_copies_from_env());

    let mut ps = ParamStore::new(0);
    let model = Gpt::new(&mut ps, &cfg)?;
    let params = ps.tensors();
    let mut opt = budget_run::adamw(&params)?;
    let (x, y) = gpt_step::batch(&cfg)?;
    let lr = Tensor::scalar(3e-4f32);
    kiln::mark_step()?;
    let inputs = [x, y, lr];
    let mut losses = Vec::new();
    let mut step = kiln::compile_step(|i: &[Tensor]| {
        Ok(vec![budget_run::train_step(&params, &mut opt, &i[2], || model.loss(&i[0], &i[1], true))?])
    });

    let t = Instant::now();
    let first = step.call(&inputs)?;
    kiln::sync()?;
    let first_step_ms = t.elapsed().as_secs_f64() * 1e3;
    let m = metrics::snapshot();
    let pipeline = m.last_pipeline.clone().ok_or("no pipeline ran for the step")?;
    let xla = budget_run::step_memory()?;
    losses.push(first[0].to_vec::<f32>()?[0]);

    let flops_before = m.flops_executed;
    let executions_before = m.executions;
    let (ms, runs) = bench(
        || {
            step.call(&inputs)?;
            Ok(())
        },
        3,
        iters,
        reps,
    )?;
    let last = step.call(&inputs)?;
    losses.push(last[0].to_vec::<f32>()?[0]);
    let after = metrics::snapshot();
    let steps = (after.executions - executions_before).max(1) as f64;
    let flops_per_step = (after.flops_executed - flops_before) / steps;

    let plan = plan_json(&pipeline);
    let out = json!({
        "system": "kiln",
        "config": config,
        "platform": platform,
        "budget_pct": fraction.map(|f| f * 100.0),
        "host_copies": host_copies_from_env(),
        "ms": ms,
        "runs_ms": runs,
        "first_step_ms": first_step_ms,
        "xla": budget_run::xla_json(&xla),
        "step_flops": flops_per_step,
        "extra_flops": pipeline.remat_extra_flops,
        "remat_pass_ms": pipeline.passes.iter().find(|p| p.name == "remat").map(|p| p.time.as_secs_f64() * 1e3),
        "plan": plan,
        "loss_first": losses[0],
        "loss_last": losses[1],
    });
    println!("RESULT {out}");
    Ok(())
}

/// Whether `REMAT_OFFLOAD` asks for host offload.
fn offload_from_env() -> bool {
    std::env::var("REMAT_OFFLOAD").is_ok_and(|v| v == "1")
}

/// Whether `REMAT_HOST_COPIES` asks for kiln's host copies.
fn host_copies_from_env() -> bool {
    std::env::var("REMAT_HOST_COPIES").is_ok_and(|v| v == "1")
}

/// The remat pass's plan in `pipeline`, as JSON (`null`: no remat pass).
fn plan_json(pipeline: &kiln::compiler::pipeline::PipelineStats) -> Value {
    let remat = pipeline.passes.iter().find(|p| p.name == "remat").and_then(|p| p.remat().cloned());
    match &remat {
        None => Value::Null,
        Some(r) => {
            let mut by_op = std::collections::BTreeMap::<&str, (usize, u64)>::new();
            for v in &r.recomputed {
                let e = by_op.entry(v.op).or_default();
                e.0 += 1;
                e.1 += v.bytes;
            }
            json!({
                "budget_bytes": r.budget_bytes,
                "met": r.met,
                "model_before": {"peak_bytes": r.before.peak_bytes, "temp_bytes": r.before.temp_peak_bytes,
                                 "argument_bytes": r.before.argument_bytes, "output_bytes": r.before.output_bytes},
                "model_after": {"peak_bytes": r.after.peak_bytes, "temp_bytes": r.after.temp_peak_bytes},
                "recomputed": r.recomputed.len(),
                "values_freed": r.values_recomputed(),
                "model_extra_ms": r.extra_ns() as f64 / 1e6,
                "cloned_nodes": r.recomputed.iter().map(|v| v.recomputed_nodes).sum::<usize>(),
                "recomputed_bytes": r.recomputed.iter().map(|v| v.bytes).sum::<u64>(),
                "offloaded": r.offloaded.len(),
                "offloaded_bytes": r.offloaded.iter().map(|v| v.bytes).sum::<u64>(),
                "offloaded_ops": r.offloaded.iter().map(|v| v.op).collect::<Vec<_>>(),
                "by_op": by_op.iter().map(|(op, (n, b))| json!({"op": op, "values": n, "bytes": b})).collect::<Vec<_>>(),
            })
        }
    }
}
/// The remat pass's plan of `cfg`'s forward and gradients at each budget in
/// `pcts` (percent of activation memory), without compiling or running.
fn plan_only(cfg: &GptConfig, pcts: &[String]) -> Res<()> {
    use kiln::compiler::pipeline::{run, PipelineOptions};
    // The GPU's LM-head blocks (the CPU plugin's are smaller: gpt2-small's
    // model temp was 77 MB under the H100's step's, every plan another),
    // unless `KILN_LM_HEAD` names others, as it does for the timed step.
    let lm_head = cfg.lm_head.or(LmHeadLoss::from_env()?).unwrap_or(LmHeadLoss::DEFAULT_GPU);
    let cfg = &GptConfig { lm_head: Some(lm_head), ..cfg.clone() };
    let mut ps = ParamStore::new(0);
    let model = Gpt::new(&mut ps, cfg)?;
    let params = ps.tensors();
    let (x, y) = gpt_step::batch(cfg)?;
    let mut opt = budget_run::adamw(&params)?;
    let lr = Tensor::scalar(3e-4f32);
    kiln::mark_step()?;
    let graph = kiln::capture_graph(|| {
        let mut out = vec![budget_run::train_step(&params, &mut opt, &lr, || model.loss(&x, &y, true))?];
        out.extend(params.iter().cloned());
        out.extend(opt.state().into_iter().map(|(_, t)| t));
        Ok(out)
    })?;
    for p in pcts {
        let pct = budget_run::percent(p)?;
        let t = Instant::now();
        let opts = PipelineOptions::default()
            .with_activation_budget(Some(pct / 100.0))
            .with_host_offload(offload_from_env())
            .with_host_copies(host_copies_from_env())
            .with_target(kiln::compiler::LowerTarget::Cuda);
        // The link's rate as the timed step reads it (`KILN_HOST_LINK_GBPS`).
        let opts = if host_copies_from_env() { opts.with_host_link_rate(kiln::host_link_rate()?) } else { opts };
        let out = run(&graph, &opts, &mut |_, _| {})?;
        let plan = plan_json(&out.stats);
        if let Ok(dir) = std::env::var("REMAT_PLAN_DUMP") {
            // The CUDA module of the plan, for reading what the lowering
            // made of it (the loop kernels, the recomputed chains).
            let lowered = kiln::compiler::lower::lower(
                &out.graph,
                &kiln::compiler::lower::LowerOptions {
                    num_replicas: 1,
                    target: kiln::compiler::LowerTarget::Cuda,
                    shardings: None,
                    loop_kernels: true,
                },
            )?;
            std::fs::write(format!("{dir}/plan_{p}.mlir"), lowered)?;
        }
        if std::env::var("REMAT_PEAK_LIST").is_ok() {
            print_peak(&out.graph);
        }
        println!(
            "PLAN {}",
            json!({"budget_pct": pct, "extra_flops": out.stats.remat_extra_flops,
                   "pipeline_ms": t.elapsed().as_secs_f64() * 1e3,
                   "remat_pass_ms": out.stats.passes.iter().find(|p| p.name == "remat").map(|p| p.time.as_secs_f64() * 1e3),
                   "plan": plan})
        );
    }
    Ok(())
}

/// `REMAT_PEAK_LIST` (plan mode): where the plan's live bytes peak by the
/// CUDA model, the temp curve's eight highest points at least 200 kernels
/// apart, and the 40 largest temporaries live at the peak, each with the op
/// that writes it. What a budget below the plan would have to cut.
fn print_peak(g: &kiln::compiler::ir::Graph) {
    use kiln::compiler::analysis::{fusion_for, liveness, BufferKind};
    let l = liveness(g, fusion_for(kiln::compiler::LowerTarget::Cuda));
    let (live, temp) = (l.live_curve(), l.temp_curve());
    let Some((pos, peak)) = budget_run::live_peak(&live) else {
        return;
    };
    let op = |id: kiln::compiler::ir::NodeId| format!("{:?}", g.node(id).op).chars().take(60).collect::<String>();
    println!("PEAK at kernel {pos} of {}: live {peak} B, temp {} B, {}", live.len(), temp[pos], op(l.order[pos]));
    let mut highest: Vec<(u64, usize)> = temp.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    highest.sort_by(|a, b| b.cmp(a));
    let mut shown: Vec<usize> = Vec::new();
    for (t, i) in highest {
        if shown.iter().all(|&s| s.abs_diff(i) >= 200) {
            shown.push(i);
            println!("  temp {t} B at kernel {i}: {}", op(l.order[i]));
        }
        if shown.len() == 8 {
            break;
        }
    }
    let mut held: Vec<_> = l
        .buffers
        .iter()
        .filter(|b| b.def <= pos && b.last_use >= pos)
        .filter(|b| !matches!(b.kind, BufferKind::Argument | BufferKind::Donated | BufferKind::Host))
        .collect();
    held.sort_by_key(|b| std::cmp::Reverse(b.bytes));
    for b in held.iter().take(40) {
        let ty = g.ty(b.value);
        println!("  {:>11} B {:?} {ty} kernels {}..={}: {}", b.bytes, b.kind, b.def, b.last_use, op(b.value.node));
    }
    link_estimate(g, &l, pos, &held);
}

/// What copies of kiln's own (overlapping the kernels, costing none) could
/// take off this peak: of the temporaries held there that no kernel reads
/// during it (read before it and again after it), those a host link of
/// `HOST_LINK_BYTES_PER_SECOND` each way, one copy at a time, can carry out
/// between their write and the peak kernel's start, and back between the peak
/// kernel's end and their first later read. Times are the CUDA kernel model's.
/// Prints the bytes moved and the temp curve's highest point without them,
/// wherever it now is: an upper bound for offload beside this plan (copies
/// cost nothing here, and only buffers held at this peak move).
fn link_estimate(
    g: &kiln::compiler::ir::Graph,
    l: &kiln::compiler::analysis::Liveness,
    pos: usize,
    held: &[&kiln::compiler::analysis::Buffer],
) {
    use kiln::compiler::target::HOST_LINK_BYTES_PER_SECOND;
    let target = kiln::compiler::remat::RematOptions::for_target(
        kiln::compiler::remat::RematBudget::Bytes(0),
        kiln::compiler::LowerTarget::Cuda,
    )
    .target;
    // start[i]: when kernel i starts; its end is start[i + 1].
    let start = kiln::compiler::analysis::kernel_starts(g, l, &target);
    // Each candidate: (bytes, write end, first read after the peak, last
    // read before it).
    let mut saved = Vec::new();
    for b in held {
        let reads: Vec<usize> = g.users(b.value.node).iter().filter_map(|&u| l.exec_pos[u.index()]).collect();
        let (early, late): (Vec<usize>, Vec<usize>) = reads.iter().partition(|&&r| r < pos);
        if reads.contains(&pos) || late.is_empty() || b.def >= pos {
            continue;
        }
        let last_early = early.iter().max().copied().unwrap_or(b.def);
        saved.push((b.bytes, start[b.def + 1], late.iter().min().copied().unwrap_or(pos), last_early));
    }
    let secs = |bytes: u64| bytes as f64 / HOST_LINK_BYTES_PER_SECOND;
    // Out: in write order, each after the last, all ending by the peak.
    saved.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut link = 0.0f64;
    let mut out = Vec::new();
    for &(bytes, written, first_late, last_early) in &saved {
        let end = link.max(written) + secs(bytes);
        if end <= start[pos] {
            link = end;
            out.push((bytes, first_late, last_early, end));
        }
    }
    // Back: latest reader first, each ending by its reader and before the
    // next copy back starts, all starting after the peak kernel ends.
    out.sort_by_key(|&(_, first_late, _, _)| std::cmp::Reverse(first_late));
    let mut free_from = f64::INFINITY;
    let (mut moved, mut n) = (0u64, 0usize);
    // The temp curve with each moved buffer gone from the first kernel after
    // its copy out (and its early reads) to the last before its copy back.
    let mut temp = l.temp_curve();
    for &(bytes, first_late, last_early, out_end) in &out {
        let begin = free_from.min(start[first_late]) - secs(bytes);
        if begin >= start[pos + 1] {
            free_from = begin;
            moved += bytes;
            n += 1;
            for (i, t) in temp.iter_mut().enumerate() {
                if i > last_early && start[i] >= out_end && start[i + 1] <= begin {
                    *t -= bytes;
                }
            }
        }
    }
    let (at, top) = temp.iter().enumerate().max_by_key(|&(_, &t)| t).map(|(i, &t)| (i, t)).unwrap_or((0, 0));
    let all: u64 = saved.iter().map(|s| s.0).sum();
    println!(
        "  LINK {} of {} temporaries held across the peak ({} B) fit a {:.0} GB/s link each way: {} B, \
         {:.3} ms of kernels before the peak; without them the temp curve's highest point is {} B at kernel {} of {}",
        n,
        saved.len(),
        all,
        HOST_LINK_BYTES_PER_SECOND / 1e9,
        moved,
        start[pos] * 1e3,
        top,
        at,
        temp.len()
    );
}
