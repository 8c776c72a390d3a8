//! Memory planning against XLA's CPU plugin: the peak model predicts the temp
//! bytes XLA compiles a step to, rematerialization cuts them, and the numbers
//! the step computes do not change.

use kiln::compiler::analysis::{liveness, peak_memory, XlaCpuFusion};
use kiln::compiler::ir::{DType, Graph, Literal, Op};
use kiln::compiler::remat::{rematerialize, Exact, Greedy, RematBudget, RematOptions};
use kiln::compiler::schedule::{sequence_backward, sequence_for};
use kiln::compiler::{interpret, lower, pipeline, LowerOptions, LowerTarget};
use kiln::models::{gpt, mlp};
use kiln::nn::{cross_entropy, ParamStore};
use kiln::optim::{AdamW, AdamWConfig};
use kiln::runtime::{Client, ClientOptions, CompileOptions};
use kiln::Tensor;

mod common;
use common::Rng;

/// Forward, loss and gradients of the tiny GPT at batch 16 (vocabulary 64),
/// optimized as a step would be.
fn gpt_tiny_step() -> anyhow::Result<Graph> {
    gpt_step(&gpt::GptConfig::tiny(64))
}

/// Forward, loss and gradients of the GPT `cfg` on fixed token ids, optimized
/// as a step would be, composites expanded as the CPU plugin compiles them.
fn gpt_step(cfg: &gpt::GptConfig) -> anyhow::Result<Graph> {
    let mut ps = ParamStore::new(0);
    let m = gpt::Gpt::new(&mut ps, cfg)?;
    let params = ps.tensors();
    let (n, v) = (cfg.batch * cfg.seq, cfg.vocab);
    let ids = Tensor::from_vec((0..n).map(|i| (i * 7 % v) as i32).collect::<Vec<_>>(), [cfg.batch, cfg.seq])?;
    let tgt = Tensor::from_vec((0..n).map(|i| (i * 5 % v) as i32).collect::<Vec<_>>(), [n])?;
    let g = kiln::capture_graph(|| {
        let loss = m.loss(&ids, &tgt, true)?;
        let mut out = vec![loss.clone()];
        out.extend(kiln::grad(&loss, &params)?);
        Ok(out)
    })?;
    // What the CPU plugin compiles: composites (attention, layer norm) in
    // their plain expansion, which the remat pass can recompute piecewise.
    let g = pipeline::optimize(&g)?.0;
    Ok(kiln::compiler::composite::expand(&g, kiln::compiler::LowerTarget::Cpu)?)
}

/// Forward, loss and gradients of an MLP `784-hidden-10` at `batch`.
fn mlp_step(hidden: &[usize], batch: usize) -> anyhow::Result<Graph> {
    let mut ps = ParamStore::new(1);
    let mut sizes = vec![784];
    sizes.extend(hidden);
    sizes.push(10);
    let m = mlp::Mlp::new(&mut ps, &sizes)?;
    let params = ps.tensors();
    let x = Tensor::from_vec(Rng::new(2).normal_vec(batch * 784), [batch, 784])?;
    let y = Tensor::from_vec((0..batch).map(|i| (i % 10) as i32).collect::<Vec<_>>(), [batch])?;
    let g = kiln::capture_graph(|| {
        let loss = cross_entropy(&m.forward(&x)?, &y, None)?;
        let mut out = vec![loss.clone()];
        out.extend(kiln::grad(&loss, &params)?);
        Ok(out)
    })?;
    Ok(pipeline::optimize(&g)?.0)
}

/// The GPT `cfg`'s whole train step as `capture_graph` records it: the loss
/// (under `cfg.amp`'s autocast), its gradients and the AdamW update, each
/// parameter and moment assigned over, so the step donates its old buffer.
/// Also those updated tensors.
fn gpt_adamw_step(cfg: &gpt::GptConfig, adamw: AdamWConfig, lr: f64) -> anyhow::Result<(Graph, Vec<Tensor>)> {
    let mut ps = ParamStore::new(0);
    let m = gpt::Gpt::new(&mut ps, cfg)?;
    let params = ps.tensors();
    let mut opt = AdamW::new(&params, adamw)?;
    let (n, top) = (cfg.batch * cfg.seq, cfg.vocab.min(50257));
    let ids = Tensor::from_vec((0..n).map(|i| (i * 7919 % top) as i32).collect::<Vec<_>>(), [cfg.batch, cfg.seq])?;
    let tgt = Tensor::from_vec((0..n).map(|i| ((i * 7919 + 1) % top) as i32).collect::<Vec<_>>(), [n])?;
    let g = kiln::capture_graph(|| {
        let loss = match cfg.amp {
            Some(dt) => kiln::amp::autocast(dt, || m.loss(&ids, &tgt, true))?,
            None => m.loss(&ids, &tgt, true)?,
        };
        let grads = kiln::grad(&loss, &params)?;
        opt.step(&params, &grads, lr)?;
        let mut out = vec![loss];
        out.extend(params.iter().cloned());
        out.extend(opt.state().into_iter().map(|(_, t)| t));
        Ok(out)
    })?;
    let mut updated = params;
    updated.extend(opt.state().into_iter().map(|(_, t)| t));
    Ok((g, updated))
}

/// The lowest-peak greedy plan as the pipeline plans under a budget on the
/// CPU target: the backward held to the program's order, then remat.
fn tightest_cpu_plan(g: &Graph) -> anyhow::Result<kiln::compiler::remat::RematPlan> {
    let (sequenced, _) = sequence_for(g, LowerTarget::Cpu, &[])?;
    Ok(rematerialize(&sequenced, &Greedy, &RematOptions::for_target(RematBudget::Bytes(0), LowerTarget::Cpu))?)
}

fn xla_stats(client: &Client, g: &Graph) -> anyhow::Result<kiln::runtime::CompiledMemoryStats> {
    let module = lower(g, &LowerOptions::default())?;
    Ok(client.compile(&module, &CompileOptions::default())?.compiled_memory_stats()?)
}

/// Fresh random inputs for `g`'s parameters: normal floats, integers in
/// `0..8` (valid token ids and positions).
fn inputs(g: &Graph, seed: u64) -> anyhow::Result<Vec<Literal>> {
    let mut rng = Rng::new(seed);
    g.param_types()
        .iter()
        .map(|t| {
            let n = t.shape.num_elements();
            let values: Vec<f64> = if t.dtype.is_float() {
                (0..n).map(|_| rng.normal() * 0.5).collect()
            } else {
                (0..n).map(|_| (rng.next_u64() % 8) as f64).collect()
            };
            Ok(Literal::from_f64s(t.dtype, t.shape.clone(), &values)?)
        })
        .collect()
}

#[test]
fn the_peak_model_predicts_xla_memory_within_15_percent() -> anyhow::Result<()> {
    // XLA's arguments + outputs + temps against the model's allocation
    // (`PeakMemory::allocated_bytes`): every output allocated for the whole
    // run, temporaries placed in outputs' allocations before those are
    // written. Before the model counted that (2026-11-24) it compared the
    // live peak, 7.5% and 9.1% under XLA on the MLPs and 16.9% on the tiny
    // GPT (held to 20%).
    let client = Client::new(&ClientOptions::default())?;
    for (name, g) in [
        ("mlp b128", mlp_step(&[256, 128], 128)?),
        ("mlp b1024", mlp_step(&[1024, 1024], 1024)?),
        ("gpt tiny", gpt_tiny_step()?),
    ] {
        let p = peak_memory(&g, &XlaCpuFusion);
        let m = xla_stats(&client, &g)?;
        let xla = m.held_bytes() as f64;
        let predicted = p.allocated_bytes as f64;
        let err = (predicted - xla).abs() / xla;
        eprintln!(
            "{name}: predicted {predicted} B (temp {}; live peak {} B), XLA args + outputs + temps {xla} B (temp {}), error {:.1}%",
            p.allocated_temp_bytes,
            p.peak_bytes,
            m.temp_size_in_bytes,
            err * 100.0
        );
        assert!(err <= 0.15, "{name}: predicted {predicted} vs XLA {xla}");
        // XLA CPU orders the step itself (a depth-first walk from the
        // outputs), the model follows the program: on the MLPs the two
        // orders are the same.
        if name.starts_with("mlp") {
            assert!(err <= 0.01, "{name}: predicted {predicted} vs XLA {xla}");
        }
    }
    Ok(())
}

#[test]
fn a_donated_update_is_billed_to_its_argument_as_xla_aliases_it() -> anyhow::Result<()> {
    // The tiny GPT's whole train step: loss, gradients, the AdamW update of
    // every parameter and its two moments, each new value assigned over the
    // old tensor, so the step donates the old buffer to it.
    let (g, updated) = gpt_adamw_step(&gpt::GptConfig::tiny(64), AdamWConfig::default(), 1e-3)?;
    let g = pipeline::optimize(&g)?.0;
    assert_eq!(g.aliases().len(), updated.len(), "every parameter and moment donates its buffer");
    let state_bytes: u64 = updated.iter().map(|t| t.ty().size_in_bytes() as u64).sum();

    let p = peak_memory(&g, &XlaCpuFusion);
    assert_eq!(p.alias_bytes, state_bytes);
    // The step's device checks (`device_checks`) add their flags as the last
    // output: count, min and max (s64) of each of its three index checks.
    let flags = g.ty(*g.outputs().last().unwrap());
    assert_eq!((flags.dtype, flags.shape.dims()), (DType::I64, &[9][..]));
    assert_eq!(p.output_bytes, state_bytes + 4 + 72, "the updates, the f32 loss and the flags");
    // After the update only the loss and the flags are outputs of their own:
    // the new values sit in the old ones' buffers.
    let l = liveness(&g, &XlaCpuFusion);
    assert_eq!(l.output_curve().last().copied(), Some(4 + 72));

    // XLA CPU compiles the same aliases (compiling is safe; only running
    // donated buffers on that plugin is not, `step::donation_enabled`).
    let client = Client::new(&ClientOptions::default())?;
    let x = xla_stats(&client, &g)?;
    assert_eq!(x.alias_size_in_bytes as u64, p.alias_bytes);
    // XLA's output size also holds the result tuple's table of pointers.
    assert_eq!(x.output_size_in_bytes as u64, p.output_bytes + 8 * g.outputs().len() as u64);
    Ok(())
}

#[test]
fn greedy_remat_cuts_xla_temp_bytes_of_the_tiny_gpt() -> anyhow::Result<()> {
    let client = Client::new(&ClientOptions::default())?;
    let g = gpt_tiny_step()?;
    let plan = tightest_cpu_plan(&g)?;
    let (m0, m1) = (xla_stats(&client, &g)?, xla_stats(&client, &plan.graph)?);
    let (before, after) = (m0.temp_size_in_bytes, m1.temp_size_in_bytes);
    eprintln!(
        "gpt tiny: {} recomputed, +{} FLOPs; predicted temp {} -> {}, XLA temp {before} -> {after}, \
         args + outputs + temps {} -> {}",
        plan.choices.len(),
        plan.extra_flops,
        plan.before.temp_peak_bytes,
        plan.after.temp_peak_bytes,
        m0.held_bytes(),
        m1.held_bytes()
    );
    // Measured 2026-11-23: peak 2.01x (8,102,252 -> 4,024,684 B), temp 2.29x
    // (7,248,000 -> 3,170,432 B; 23 values, +1.73e8 FLOPs), with the plan
    // that offers block segments too (the CPU target's options): the model
    // gives it the same peak as the value-by-value plan (25 values, +2.03e8
    // FLOPs, XLA peak 4,159,852 B, 1.95x), so the fewer FLOPs win. Without
    // the sequencing, 1.90x temp; before the rewrite kept the program's order,
    // 1.28x: the weight gradients ran after the whole input-gradient chain and
    // their operands stayed live through the backward (docs/memory.md, "The
    // program's order"). The issue's bar: the XLA-reported peak cut 2x.
    assert!(m1.held_bytes() * 2 <= m0.held_bytes(), "XLA args + outputs + temps {m0:?} -> {m1:?}");
    assert!(after * 100 <= before * 50, "XLA temp {before} -> {after}");
    // The fence is what keeps XLA from merging the clones back.
    assert!(plan.graph.nodes().any(|(_, n)| matches!(n.op, Op::OptimizationBarrier { .. })));
    Ok(())
}

/// Greedy's path depends on its budget: a small excess goes to the cheapest
/// candidate that covers it, and on the tiny GPT's train step that path ended
/// above 40% and 45% of the activation memory (4.0 and 3.6 MiB by the model,
/// "not met") where the lowest-peak path reaches 3.5 MiB with fewer FLOPs
/// (`kiln compile … --memory-limit 40%`, 2026-11-28). A budget is now called
/// unreachable only when the lowest-peak path misses it too.
#[test]
fn a_budget_the_lowest_peak_plan_meets_is_never_reported_unmet() -> anyhow::Result<()> {
    let cfg = gpt::GptConfig { vocab: 25, ..gpt::GptConfig::tiny(25) };
    let (g, _) = gpt_adamw_step(&cfg, AdamWConfig::default(), 1e-3)?;
    let g = pipeline::optimize(&g)?.0;
    let (g, _) = sequence_for(&g, LowerTarget::Cpu, &[])?;
    let plan = |budget| rematerialize(&g, &Greedy, &RematOptions::for_target(budget, LowerTarget::Cpu));
    let lowest = plan(RematBudget::Bytes(0))?.after.peak_bytes;
    let mut reachable = 0;
    for percent in [30, 35, 40, 45, 50, 55, 60] {
        let p = plan(RematBudget::FractionOfActivations(percent as f64 / 100.0))?;
        eprintln!(
            "{percent}%: budget {} B, peak {} B ({}), lowest {lowest} B, {} FLOPs",
            p.budget_bytes, p.after.peak_bytes, p.met, p.extra_flops
        );
        if lowest <= p.budget_bytes {
            reachable += 1;
            assert!(
                p.met,
                "{percent}%: the lowest peak {lowest} B is under the budget {} B, the plan's {} B",
                p.budget_bytes, p.after.peak_bytes
            );
        } else {
            assert!(!p.met && p.after.peak_bytes >= lowest, "{percent}%");
        }
    }
    assert!(reachable >= 3, "the budgets should mostly be reachable");
    Ok(())
}

#[test]
fn a_planned_step_computes_the_same_values_on_the_interpreter() -> anyhow::Result<()> {
    let g = gpt_tiny_step()?;
    let plan = rematerialize(&g, &Greedy, &RematOptions::new(RematBudget::Bytes(0), &XlaCpuFusion))?;
    assert!(!plan.choices.is_empty());
    let x = inputs(&g, 11)?;
    assert_eq!(interpret(&g, &x)?, interpret(&plan.graph, &x)?, "bit-identical on the reference interpreter");
    Ok(())
}

#[test]
fn training_under_the_tightest_memory_limit_matches_training_without() -> anyhow::Result<()> {
    kiln::set_disk_cache(None)?;
    let text: String = (0..4000).map(|i| (b'a' + ((i * 7 + i / 13) % 23) as u8) as char).collect();
    let vocab = gpt::CharVocab::new(&text);
    let cfg = gpt::GptConfig { steps: 3, ..gpt::GptConfig::tiny(vocab.len()) };
    let run = |limit: Option<u64>| -> anyhow::Result<Vec<f64>> {
        kiln::set_memory_limit(limit);
        let mut t = gpt::GptTrainer::new(vocab.encode(&text), &cfg)?;
        let losses = (0..3).map(|_| Ok(t.train_step(1e-3)?)).collect::<anyhow::Result<Vec<f64>>>()?;
        kiln::set_memory_limit(None);
        Ok(losses)
    };
    let plain = run(None)?;
    let planned = run(Some(1))?;
    for (a, b) in plain.iter().zip(&planned) {
        assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "losses {plain:?} vs {planned:?}");
    }
    Ok(())
}

/// A "forward" chain of `n` tanh over `[256]`, then a "backward" chain that
/// reads each activation again in reverse order: the classic remat shape.
fn ladder(n: usize) -> anyhow::Result<Graph> {
    use kiln::compiler::ir::{BinaryOp, DType, TensorType, UnaryOp};
    let mut g = Graph::new();
    let p = g.parameter(TensorType::new(DType::F32, [256]));
    let mut acts = vec![p];
    for _ in 0..n {
        let last = *acts.last().expect("starts with the parameter");
        acts.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: last })?);
    }
    let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: acts[n] })?;
    for &a in acts[1..n].iter().rev() {
        ct = g.value(Op::Binary { op: BinaryOp::Mul, lhs: ct, rhs: a })?;
    }
    g.set_outputs(vec![ct])?;
    Ok(g)
}

/// The exact strategy (an integer program over every candidate and the
/// conditional versions of them, each solution checked by the peak model)
/// against greedy on small graphs at several budgets: wherever greedy meets a
/// budget the exact plan meets it too, with at most 10% more extra FLOPs (the
/// issue's bar); where neither meets it, the exact plan's peak is no higher
/// than greedy's; the values never change.
///
/// Measured 2026-11-23 (the figures are printed): before the conditional
/// variables, greedy was the cheaper on the tiny GPT from 80% down (at 80%
/// greedy +2,101,391 FLOPs, exact +11,276,912; at 60% +40.4e6 against
/// +107.0e6) and on the MLP with XLA-like fusion at 70% (+139.0e6 against
/// +274.1e6): greedy's later choices read clones its earlier ones made, which
/// a program over the unplanned graph's candidates alone cannot choose
/// (`docs/memory-journal.md`, "The exact strategy's conditional candidates").
#[test]
fn the_exact_strategy_is_within_10_percent_of_greedy_on_small_graphs() -> anyhow::Result<()> {
    let every = kiln::compiler::analysis::EveryNodeAKernel;
    let xla = XlaCpuFusion;
    type Case<'a> = (&'a str, Graph, &'a dyn kiln::compiler::analysis::Materialization);
    let graphs: Vec<Case> = vec![
        ("ladder 12", ladder(12)?, &every),
        ("gpt tiny, XLA-like fusion", gpt_tiny_step()?, &xla),
        ("mlp 784-256x6-10 b1024, XLA-like fusion", mlp_step(&[256; 6], 1024)?, &xla),
        ("mlp 784-256x6-10 b1024, every node a kernel", mlp_step(&[256; 6], 1024)?, &every),
    ];
    let mut compared = 0;
    for (name, g, fusion) in &graphs {
        let before = peak_memory(g, *fusion).peak_bytes;
        let mut exact_plans = Vec::new();
        for frac in [0.95, 0.9, 0.8, 0.7, 0.6] {
            let opts = RematOptions::new(RematBudget::Bytes((before as f64 * frac) as u64), *fusion);
            let greedy = rematerialize(g, &Greedy, &opts)?;
            let t = std::time::Instant::now();
            let exact = rematerialize(g, &Exact, &opts)?;
            eprintln!(
                "{name} budget {frac}: greedy met {} +{} FLOPs peak {}; exact met {} +{} FLOPs peak {} ({} ms)",
                greedy.met,
                greedy.extra_flops,
                greedy.after.peak_bytes,
                exact.met,
                exact.extra_flops,
                exact.after.peak_bytes,
                t.elapsed().as_millis()
            );
            assert_eq!(exact.after, peak_memory(&exact.graph, *fusion), "{name}: the plan's peak is the model's");
            if greedy.met {
                compared += 1;
                assert!(exact.met, "{name} budget {frac}: greedy meets it, the exact plan does not");
                assert!(
                    exact.extra_flops as f64 <= 1.10 * greedy.extra_flops as f64,
                    "{name} budget {frac}: exact +{} FLOPs vs greedy +{}",
                    exact.extra_flops,
                    greedy.extra_flops
                );
            } else if !exact.met {
                assert!(
                    exact.after.peak_bytes <= greedy.after.peak_bytes,
                    "{name} budget {frac}: neither meets it, exact's peak {} over greedy's {}",
                    exact.after.peak_bytes,
                    greedy.after.peak_bytes
                );
            }
            if exact.met && !exact.choices.is_empty() {
                exact_plans.push(exact.graph);
            }
        }
        // Numerics: the tightest exact plan computes the same values.
        if let Some(planned) = exact_plans.last() {
            let x = inputs(g, 5)?;
            assert_eq!(interpret(g, &x)?, interpret(planned, &x)?, "{name}: bit-identical on the interpreter");
        }
    }
    assert!(compared >= 17, "only {compared} budgets were met by greedy");
    Ok(())
}

/// GPT-2 small's shape (b8, T1024, 12 layers, vocabulary 50,304), forward and
/// gradients, compiled only (no step runs on the CPU): the peak model against
/// XLA's unplanned figures (within 15%, as for the small steps above), and
/// XLA's own temp bytes with and without the tightest greedy plan.
#[test]
fn greedy_remat_cuts_xla_temp_bytes_of_gpt2_small() -> anyhow::Result<()> {
    let g = gpt_step(&gpt::GptConfig::gpt2_small(50304))?;
    let client = Client::new(&ClientOptions::default())?;
    let before = peak_memory(&g, &XlaCpuFusion);
    let plan = tightest_cpu_plan(&g)?;
    let (m0, m1) = (xla_stats(&client, &g)?, xla_stats(&client, &plan.graph)?);
    eprintln!(
        "gpt2-small: {} recomputed, +{} FLOPs; model {:?} -> {:?}; XLA temp {} -> {}, args + outputs + temps {} -> {}",
        plan.choices.len(),
        plan.extra_flops,
        plan.before,
        plan.after,
        m0.temp_size_in_bytes,
        m1.temp_size_in_bytes,
        m0.held_bytes(),
        m1.held_bytes()
    );
    // Measured 2026-11-24: the model's allocation 8,394,563,792 B against
    // XLA's arguments + outputs + temps 9,407,227,132 B (-10.8%; the live
    // peak, 8,091,525,252 B, is 14.0% under).
    let err = (before.allocated_bytes as f64 - m0.held_bytes() as f64).abs() / m0.held_bytes() as f64;
    assert!(err <= 0.15, "model {} vs XLA {} B", before.allocated_bytes, m0.held_bytes());
    // The bar, the XLA-reported peak cut at least 2x at the tightest
    // budget, from the step kiln compiles without one: measured 2.52x
    // (8,810,724,524 -> 3,490,899,116 B; temp 7,814,850,560 -> 2,495,025,152
    // B; 139 values, +3.39e12 FLOPs), the plan with block segments, whose
    // model peak is the lower. The value-by-value plan alone: 2.54x (124
    // values, +2.33e12 FLOPs); without the sequencing, 2.41x; before the
    // rewrite kept the program's order, 1.11x (docs/memory-journal.md ("The program's order")).
    assert!(m1.held_bytes() * 2 <= m0.held_bytes(), "{m0:?} -> {m1:?}");
    Ok(())
}

/// The backward held to the program's order (`sequence`, the pipeline's pass
/// under a memory budget on the CPU target): XLA CPU frees each layer's
/// operands where the program does, and the values are the same.
#[test]
fn sequencing_the_backward_cuts_xla_temp_of_the_tiny_gpt() -> anyhow::Result<()> {
    let client = Client::new(&ClientOptions::default())?;
    let g = gpt_tiny_step()?;
    let (s, guarded) = sequence_backward(&g, &XlaCpuFusion, &[])?;
    let (m0, m1) = (xla_stats(&client, &g)?, xla_stats(&client, &s)?);
    let model = peak_memory(&s, &XlaCpuFusion).peak_bytes as f64;
    let xla = m1.held_bytes() as f64;
    eprintln!(
        "gpt tiny: {guarded} kernels guarded; XLA temp {} -> {}; model {model} against XLA {xla} ({:+.1}%)",
        m0.temp_size_in_bytes,
        m1.temp_size_in_bytes,
        (model - xla) / xla * 100.0
    );
    // Measured 2026-11-23: 7,248,000 -> 6,205,568 B (-14.4%), 66 kernels; the
    // model 2.8% under XLA (16.9% under the unsequenced step).
    assert!(m1.temp_size_in_bytes * 100 <= m0.temp_size_in_bytes * 90, "{m0:?} -> {m1:?}");
    assert!((model - xla).abs() / xla <= 0.10);
    let x = inputs(&g, 17)?;
    assert_eq!(interpret(&g, &x)?, interpret(&s, &x)?, "bit-identical on the reference interpreter");
    Ok(())
}

/// gpt2-small's bf16 train step with AdamW, planned for CUDA at a third and
/// a quarter of its activation memory (the remat-curve's 33% and 25%). Both
/// limits lie below the step's arguments and outputs together, which the
/// model held after the update until it billed donated outputs to their
/// arguments: greedy then stopped at the update whatever the budget (`met:
/// false`, XLA CUDA temp 1.43 / 1.42 GiB on the H100). Now both are met. At
/// 25% the value-by-value plan once cost +5.65 ms by the kernel model and
/// lost to block segments (+4.34 ms); with q, k and v recomputed together
/// (sibling candidates) it costs +3.87 ms and is chosen. At 20% segments
/// still pay.
#[test]
fn a_third_and_a_quarter_of_gpt2_smalls_activation_memory_are_met_on_cuda() -> anyhow::Result<()> {
    let cfg = gpt::GptConfig { amp: Some(kiln::DType::BF16), ..gpt::GptConfig::gpt2_small(50304) };
    let (g, _) = gpt_adamw_step(&cfg, AdamWConfig { weight_decay: 0.1, ..Default::default() }, 3e-4)?;
    for pct in [33.0, 25.0, 20.0] {
        let opts = pipeline::PipelineOptions::default()
            .with_activation_budget(Some(pct / 100.0))
            .with_target(LowerTarget::Cuda);
        let out = pipeline::run(&g, &opts, &mut |_, _| {})?;
        let plan =
            out.stats.passes.iter().find(|p| p.name == "remat").and_then(|p| p.remat().cloned()).expect("a remat plan");
        // A segment frees several buffers; the step's largest recomputable
        // activation is 48 MiB (an MLP's [8192, 3072] bf16).
        let segments = plan.recomputed.iter().filter(|v| v.bytes > 64 << 20).count();
        eprintln!(
            "{pct}%: met {}, budget {} B, model peak {} -> {} B, temp {} -> {} B, {} values ({segments} segments), +{:.3} ms",
            plan.met,
            plan.budget_bytes,
            plan.before.peak_bytes,
            plan.after.peak_bytes,
            plan.before.temp_peak_bytes,
            plan.after.temp_peak_bytes,
            plan.recomputed.len(),
            plan.extra_ns() as f64 / 1e6
        );
        assert!(plan.budget_bytes < plan.before.argument_bytes + plan.before.output_bytes);
        assert!(plan.met, "{pct}%: {} > {}", plan.after.peak_bytes, plan.budget_bytes);
        if pct == 25.0 {
            // The best plan before siblings: segments at +4.34 ms.
            assert!(plan.extra_ns() < 4_340_000, "+{} ns: no cheaper than the plans before siblings", plan.extra_ns());
        }
        if pct == 20.0 {
            assert!(segments > 0, "the 20% plan recomputes block segments");
        }
    }
    Ok(())
}

/// `layers` layers `a = tanh(h · w)` over `[rows, d]` whose outputs a
/// backward reads in reverse, `g = (g · w) · a`.
fn saved_chain(rows: usize, d: usize, layers: usize) -> anyhow::Result<Graph> {
    use kiln::compiler::ir::{BinaryOp, DotDims, TensorType, UnaryOp};
    let mut g = Graph::new();
    let x = g.parameter(TensorType::new(DType::F32, [rows, d]));
    let w = g.parameter(TensorType::new(DType::F32, [d, d]));
    let dims = DotDims { lhs_contract: vec![1], rhs_contract: vec![0], ..DotDims::default() };
    let mut saved = Vec::new();
    let mut h = x;
    for _ in 0..layers {
        let m = g.value(Op::DotGeneral { lhs: h, rhs: w, dims: dims.clone() })?;
        h = g.value(Op::Unary { op: UnaryOp::Tanh, input: m })?;
        saved.push(h);
    }
    let mut grad = h;
    for &a in saved.iter().rev() {
        let n = g.value(Op::DotGeneral { lhs: grad, rhs: w, dims: dims.clone() })?;
        grad = g.value(Op::Binary { op: BinaryOp::Mul, lhs: n, rhs: a })?;
    }
    g.set_outputs(vec![grad])?;
    Ok(g)
}

/// kiln's host copies (`memory::HostCopies`) run on the CPU plugin, whose
/// handlers copy at once: the planned program moves saved layers to the host
/// and back, and computes what the program without them computes, bit for
/// bit, with fresh inputs.
#[test]
fn a_program_with_host_copies_computes_the_same_values_on_the_cpu_plugin() -> anyhow::Result<()> {
    use kiln::compiler::remat::HostCopies;
    use kiln::runtime::ExecArg;
    let client = Client::new(&ClientOptions::default())?;
    // 1 MiB saved per layer, the smallest value worth a copy, planned by the
    // CUDA fusion model on a device a thousand times slower than an H100 (so
    // the link carries layers while this chain's small GEMMs run), lowered
    // and run on the CPU plugin.
    let g = saved_chain(256, 1024, 6)?;
    let slow = kiln::compiler::target::Target {
        name: "slow",
        peak_bf16_flops_per_s: 1e12,
        peak_tf32_flops_per_s: 5e11,
        peak_f32_flops_per_s: 7e10,
        mem_bytes_per_s: 3e9,
        interconnect_bytes_per_s: 4e8,
    };
    let opts =
        RematOptions { target: slow, ..RematOptions::for_target(RematBudget::Bytes(44_000_000), LowerTarget::Cuda) };
    let plan = rematerialize(&g, &HostCopies::default(), &opts)?;
    eprintln!(
        "{} moved ({} B), {} recomputed; peak {} -> {} B",
        plan.offloaded.len(),
        plan.offloaded.iter().map(|c| c.bytes).sum::<u64>(),
        plan.choices.len(),
        plan.before.peak_bytes,
        plan.after.peak_bytes
    );
    assert!(!plan.offloaded.is_empty(), "the CPU model's link carries some of the chain");
    let run = |g: &Graph, x: &[Literal]| -> anyhow::Result<Vec<u8>> {
        let exe = client.compile(&lower(g, &LowerOptions::default())?, &CompileOptions::default())?;
        let dev = &client.devices()[0];
        let bufs = x
            .iter()
            .map(|l| client.buffer_from_bytes(l.bytes(), kiln::element_type(l.ty().dtype), l.ty().shape.dims(), dev))
            .collect::<Result<Vec<_>, _>>()?;
        let args: Vec<ExecArg> = bufs.iter().map(ExecArg::Borrowed).collect();
        Ok(exe.execute(&args)?.remove(0).to_host_bytes()?)
    };
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
    for s in [seed, seed ^ 0x9e37_79b9] {
        let x = inputs(&g, s)?;
        assert!(run(&g, &x)? == run(&plan.graph, &x)?, "outputs differ (seed {s})");
    }
    let (m0, m1) = (xla_stats(&client, &g)?, xla_stats(&client, &plan.graph)?);
    eprintln!("XLA temp {} -> {} B", m0.temp_size_in_bytes, m1.temp_size_in_bytes);
    // Five of the six layers go (the last is read at the backward's first
    // kernel). XLA CPU's temp fell 6,291,456 -> 2,097,352 B with each copy's
    // end waited for where it was modelled, and to 3,145,928 B since the
    // waits share the next copy's stop (`share_stops`: a value is freed a
    // little later, for fewer custom calls). The bar: half of the 5 MiB moved
    // leaves XLA's temp.
    assert!(
        m1.temp_size_in_bytes + (5 << 19) <= m0.temp_size_in_bytes,
        "XLA temp {} -> {}",
        m0.temp_size_in_bytes,
        m1.temp_size_in_bytes
    );
    Ok(())
}

/// The compiler names the custom calls the runtime registers handlers for.
#[test]
fn the_compilers_host_copy_targets_are_the_runtimes() {
    use kiln::compiler::ir::HostCopyStep;
    let named: Vec<&str> = HostCopyStep::ALL.iter().map(|s| s.target()).collect();
    assert_eq!(named, kiln::runtime::pjrt::host_copy::TARGETS);
}
