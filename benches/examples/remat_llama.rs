//! The remat pass on a model it was not tuned on: the Llama-style decoder of
//! `common/llama.rs` (RMSNorm, rotary embeddings, SwiGLU, an untied head over
//! explicit logits), trained under bf16 autocast with AdamW and captured with
//! `compile_step`, under one activation budget, timed as `remat_curve` times
//! its step.
//!
//! `remat_llama small|tiny none|PERCENT [ITERS REPS]`: `small` (about 130M
//! parameters) for a GPU, `tiny` for the CPU plugin; one process per budget,
//! with `KILN_CACHE=off`. Prints `RESULT {json}`: XLA's compiled memory stats
//! of the step, the plan (values recomputed, extra FLOPs, the model's peaks),
//! the step time and the losses of the first five steps and the last.
//!
//! `remat_llama small|tiny plan PERCENT...` runs nothing: it prints the remat
//! pass's plan of the same step at each budget for the CUDA target (`PLAN
//! {json}`: recomputed values by op, with their bytes and FLOPs), for reading
//! a plan on a machine without a GPU.

use std::time::Instant;

use kiln::nn::ParamStore;
use kiln::{metrics, Tensor};
use serde_json::json;

#[path = "common/budget_run.rs"]
mod budget_run;
#[path = "common/llama.rs"]
mod llama;
#[path = "common/timing.rs"]
mod timing;
use llama::{Llama, LlamaConfig};
use timing::{bench, Res};

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: remat_llama small|tiny none|PERCENT [ITERS REPS]";
    let (Some(config), Some(budget)) = (args.first(), args.get(1)) else { return Err(usage.into()) };
    let cfg = match config.as_str() {
        "small" => LlamaConfig::small(),
        "tiny" => LlamaConfig::tiny(),
        other => return Err(format!("unknown config `{other}`; {usage}").into()),
    };
    if budget == "plan" {
        return plan_only(cfg, &args[2..]);
    }
    let fraction = budget_run::budget(budget, usage)?;
    let (iters, reps) = budget_run::iters_reps(&args)?;
    let platform = budget_run::client_under(fraction)?;

    let mut ps = ParamStore::new(0);
    let model = Llama::new(&mut ps, cfg)?;
    let params = ps.tensors();
    let parameters: usize = params.iter().map(Tensor::elem_count).sum();
    let mut opt = budget_run::adamw(&params)?;
    let (x, y) = model.batch()?;
    kiln::mark_step()?;
    let inputs = [x, y, Tensor::scalar(3e-4f32)];
    let mut step = kiln::compile_step(|i: &[Tensor]| {
        Ok(vec![budget_run::train_step(&params, &mut opt, &i[2], || model.loss(&i[0], &i[1]))?])
    });

    let t = Instant::now();
    let first = step.call(&inputs)?;
    kiln::sync()?;
    let first_step_ms = t.elapsed().as_secs_f64() * 1e3;
    let m = metrics::snapshot();
    // The first steps' losses, read one by one: where a planned step's
    // numbers part from the unplanned one's, before training on one batch
    // amplifies rounding.
    let mut losses = vec![first[0].to_vec::<f32>()?[0]];
    for _ in 1..5 {
        losses.push(step.call(&inputs)?[0].to_vec::<f32>()?[0]);
    }
    let xla = budget_run::step_memory()?;
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
    let loss_last = last[0].to_vec::<f32>()?[0];
    let plan = m.step_remat_plan().map(|r| {
        let p = &r.plan;
        json!({
            "met": p.met,
            "budget_bytes": p.budget_bytes,
            "values_recomputed": p.values_recomputed(),
            "extra_flops": p.recomputed_flops(),
            "model_extra_ms": p.extra_ns() as f64 / 1e6,
            "model_peak_bytes": [p.before.peak_bytes, p.after.peak_bytes],
            "model_temp_bytes": [p.before.allocated_temp_bytes, p.after.allocated_temp_bytes],
        })
    });
    let out = json!({
        "model": "llama",
        "config": config,
        "parameters": parameters,
        "platform": platform,
        "budget_pct": fraction.map(|f| f * 100.0),
        "ms": ms,
        "runs_ms": runs,
        "first_step_ms": first_step_ms,
        "xla": budget_run::xla_json(&xla),
        "plan": plan,
        "losses_first": losses,
        "loss_last": loss_last,
    });
    println!("RESULT {out}");
    Ok(())
}

/// Plan mode: the captured step (loss, gradients, AdamW update) through the
/// pipeline for the CUDA target at each budget.
fn plan_only(cfg: LlamaConfig, pcts: &[String]) -> Res<()> {
    use kiln::compiler::pipeline::{run, PipelineOptions};
    let mut ps = ParamStore::new(0);
    let model = Llama::new(&mut ps, cfg)?;
    let params = ps.tensors();
    let mut opt = budget_run::adamw(&params)?;
    let (x, y) = model.batch()?;
    let lr = Tensor::scalar(3e-4f32);
    kiln::mark_step()?;
    let graph = kiln::capture_graph(|| {
        let mut out = vec![budget_run::train_step(&params, &mut opt, &lr, || model.loss(&x, &y))?];
        out.extend(params.iter().cloned());
        out.extend(opt.state().into_iter().map(|(_, t)| t));
        Ok(out)
    })?;
    let buffers = std::env::var("LLAMA_BUFFERS").is_ok();
    if buffers {
        let unplanned =
            run(&graph, &PipelineOptions::default().with_target(kiln::compiler::LowerTarget::Cuda), &mut |_, _| {})?;
        print_buffers(&unplanned.graph);
    }
    for p in pcts {
        let pct = budget_run::percent(p)?;
        let opts = PipelineOptions::default()
            .with_activation_budget(Some(pct / 100.0))
            .with_target(kiln::compiler::LowerTarget::Cuda);
        let out = run(&graph, &opts, &mut |_, _| {})?;
        if buffers {
            print_buffers(&out.graph);
        }
        let Some(r) = out.stats.passes.iter().find_map(|p| p.remat().cloned()) else { continue };
        let mut by_op = std::collections::BTreeMap::<&str, (usize, u64, u64)>::new();
        for v in &r.recomputed {
            let e = by_op.entry(v.op).or_default();
            e.0 += 1 + v.also.len();
            e.1 += v.bytes;
            e.2 += v.flops;
        }
        println!(
            "PLAN {}",
            json!({"budget_pct": pct, "met": r.met, "values": r.values_recomputed(), "extra_flops": r.recomputed_flops(),
                   "model_extra_ms": r.extra_ns() as f64 / 1e6,
                   "model_temp_bytes": [r.before.allocated_temp_bytes, r.after.allocated_temp_bytes],
                   "by_op": by_op})
        );
    }
    Ok(())
}

/// `LLAMA_BUFFERS` (plan mode): the unplanned step's temporaries of 10 MB or
/// more by the CUDA model, then each plan's, by writing op and type, with how many there are and
/// how many are live where the live bytes peak.
fn print_buffers(g: &kiln::compiler::ir::Graph) {
    use kiln::compiler::analysis::{fusion_for, liveness, BufferKind};
    let l = liveness(g, fusion_for(kiln::compiler::LowerTarget::Cuda));
    let live = l.live_curve();
    let (peak, _) = budget_run::live_peak(&live).unwrap_or((0, 0));
    // Per (op, type): count, live at the peak, bytes, and the kernels of the
    // last one (where a single buffer is written and last read).
    let mut groups = std::collections::BTreeMap::<(String, String), (usize, usize, u64, usize, usize)>::new();
    for b in l.buffers.iter().filter(|b| b.kind == BufferKind::Temp && b.bytes >= 10_000_000) {
        let op =
            format!("{:?}", g.node(b.value.node).op).chars().take_while(|c| c.is_alphanumeric()).collect::<String>();
        let e = groups.entry((op, g.ty(b.value).to_string())).or_default();
        e.0 += 1;
        e.1 += usize::from(b.def <= peak && b.last_use >= peak);
        (e.2, e.3, e.4) = (b.bytes, b.def, b.last_use);
    }
    println!("BUFFERS peak at kernel {peak} of {}: {} B live", live.len(), live[peak]);
    for ((op, ty), (n, at_peak, bytes, def, last)) in groups {
        let span = if n == 1 { format!(", kernels {def}..={last}") } else { String::new() };
        println!("  {n:>3} x {bytes:>10} B {op} {ty} ({at_peak} live at the peak{span})");
    }
}
