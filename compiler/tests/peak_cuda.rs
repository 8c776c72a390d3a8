//! The peak model against XLA's CUDA plugin on the H100, offline: step graphs
//! saved by `KILN_SAVE_GRAPHS` on the device and XLA's compiled memory stats of
//! the same programs, recorded in the same call (2026-11-23, H100 80GB HBM3,
//! CUDA PJRT plugin, `benches/RESULTS.md` "peak model on CUDA").

use std::io::Read as _;

use kiln_compiler::analysis::{liveness, peak_memory, BufferKind, Materialization, XlaCpuFusion, XlaGpuFusion};
use kiln_compiler::ir::Graph;
use kiln_compiler::pipeline::{run, PipelineOptions};

fn load(name: &str) -> Graph {
    let path = format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut text = String::new();
    flate2::read::GzDecoder::new(&bytes[..]).read_to_string(&mut text).expect("gzip text");
    let g = kiln_compiler::text::parse(&text).expect("a saved step graph");
    // The frontend saves the pruned graph and compiles what the default
    // pipeline makes of it.
    let opts = PipelineOptions { prune_params: false, ..PipelineOptions::default() };
    run(&g, &opts, &mut |_, _| {}).expect("the default pipeline").graph
}

/// Temporaries live at the model's peak, as (op name, type) -> (bytes, count).
fn live_at_peak(g: &Graph, fusion: &dyn Materialization) -> std::collections::BTreeMap<String, (u64, usize)> {
    let l = liveness(g, fusion);
    let at = peak_memory(g, fusion).peak_position;
    let mut by: std::collections::BTreeMap<String, (u64, usize)> = Default::default();
    for b in &l.buffers {
        if b.kind == BufferKind::Temp && b.def <= at && at <= b.last_use {
            let e = by.entry(format!("{} {}", g.node(b.value.node).op.name(), g.ty(b.value))).or_default();
            e.0 += b.bytes;
            e.1 += 1;
        }
    }
    by
}

/// XLA CUDA's `PJRT_Executable_GetCompiledMemoryStats` of one program:
/// arguments, outputs, aliased bytes, temporaries.
struct XlaStats {
    argument: u64,
    output: u64,
    alias: u64,
    temp: u64,
}

impl XlaStats {
    fn peak(&self) -> u64 {
        self.argument + self.output - self.alias + self.temp
    }
}

/// The saved graphs and XLA's figures for them on the H100 (`kiln compile
/// FILE --json` with `PJRT_DEVICE=CUDA`, which keeps the outputs apart from
/// the arguments, and for gpt2-small also the training step itself, which
/// donates them: the same temp bytes).
fn measured() -> Vec<(&'static str, XlaStats)> {
    vec![
        (
            "mlp-1024x2-b1024-step.kiln.gz",
            XlaStats { argument: 25_579_648, output: 22_364_480, alias: 0, temp: 46_140_952 },
        ),
        (
            "mlp-4096x2-b4096-step.kiln.gz",
            XlaStats { argument: 253_313_152, output: 240_451_904, alias: 0, temp: 100_667_416 },
        ),
        (
            "gpt2-small-bf16-adamw-step.kiln.gz",
            XlaStats { argument: 1_493_776_392, output: 1_493_714_504, alias: 1_493_710_852, temp: 5_134_297_120 },
        ),
    ]
}

#[test]
fn the_cuda_model_predicts_xla_cuda_within_15_percent() {
    for (name, xla) in measured() {
        let g = load(name);
        let gpu = peak_memory(&g, &XlaGpuFusion);
        let cpu = peak_memory(&g, &XlaCpuFusion);
        let err = |model: u64, xla: u64| (model as f64 - xla as f64) / xla as f64 * 100.0;
        eprintln!(
            "{name}: XLA CUDA temp {} peak {}; XlaGpuFusion temp {} ({:+.1}%) peak {} ({:+.1}%); \
             XlaCpuFusion temp {} ({:+.1}%) peak {} ({:+.1}%)",
            xla.temp,
            xla.peak(),
            gpu.temp_peak_bytes,
            err(gpu.temp_peak_bytes, xla.temp),
            gpu.peak_bytes,
            err(gpu.peak_bytes, xla.peak()),
            cpu.temp_peak_bytes,
            err(cpu.temp_peak_bytes, xla.temp),
            cpu.peak_bytes,
            err(cpu.peak_bytes, xla.peak()),
        );
        assert!(err(gpu.peak_bytes, xla.peak()).abs() <= 15.0, "{name}: peak {} vs XLA {}", gpu.peak_bytes, xla.peak());
    }
}

/// What XLA CUDA keeps at its peak (the LM head's backward), replayed from its
/// buffer assignment: the bf16 logits and their bf16 gradient, no f32 `exp`
/// over the logits, one f32 residual per block (plus the embedding's), the
/// two-output GELU kernel's `tanh` and output per block. The model's peak
/// holds the same. (The saved step differentiates `log_softmax` through its
/// max shift, as kiln did until 2026-11-28; on the H200 XLA kept that
/// step's f32 `exp` of the logits, 1.54 GiB, for the shift's gradient:
/// `benches/RESULTS.md`, "The input's node on extraction ties".)
#[test]
fn the_cuda_models_peak_holds_what_xla_cudas_peak_holds() {
    let g = load("gpt2-small-bf16-adamw-step.kiln.gz");
    let live = live_at_peak(&g, &XlaGpuFusion);
    for (k, (b, n)) in &live {
        eprintln!("{:9.1} MiB {n:3} {k}", *b as f64 / 1048576.0);
    }
    let count = |k: &str| live.get(k).map_or(0, |e| e.1);
    assert_eq!(count("dot_general tensor<8x1024x50304xbf16>"), 1, "the logits");
    assert_eq!(count("convert tensor<8x1024x50304xbf16>"), 1, "their gradient");
    assert!(!live.keys().any(|k| k.contains("8192x50304xf32")), "no f32 [tokens, vocab] buffer");
    assert_eq!(count("add tensor<8x1024x768xf32>"), 12, "one residual per block");
    assert_eq!(count("tanh tensor<8x1024x3072xbf16>"), 12);
    assert_eq!(count("mul tensor<8x1024x3072xbf16>"), 12);
    // The CPU model writes the loss's exp and both residuals of each block.
    let cpu = live_at_peak(&g, &XlaCpuFusion);
    assert!(cpu.keys().any(|k| k.contains("8192x50304xf32")));
    assert!(cpu.get("add tensor<8x1024x768xf32>").map_or(0, |e| e.1) > 12);
}

/// The greedy plans for gpt2-small's step at activation budgets, judged by
/// the CUDA model: prints the curve (`PEAK_CUDA_BUDGETS="90 80 70"`, and
/// `PEAK_CUDA_SEGMENTS=1` for block segments); a plan never predicts more
/// than no plan, and the budgets met on the H100 (60% and above) are met.
#[test]
fn greedy_plans_of_gpt2_small_by_the_cuda_model() {
    use kiln_compiler::remat::{rematerialize, Greedy, RematBudget, RematOptions};
    let g = load("gpt2-small-bf16-adamw-step.kiln.gz");
    let before = peak_memory(&g, &XlaGpuFusion);
    let flops = kiln_compiler::cost::graph_cost(&g).total.flops as f64;
    let pcts: Vec<f64> = std::env::var("PEAK_CUDA_BUDGETS")
        .unwrap_or_else(|_| "90 70 50".into())
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    for pct in pcts {
        let limit = kiln_compiler::pipeline::activation_budget_bytes(&before, pct / 100.0);
        let mut opts = RematOptions::new(RematBudget::Bytes(limit), &XlaGpuFusion);
        opts.segments = std::env::var_os("PEAK_CUDA_SEGMENTS").is_some();
        let t = std::time::Instant::now();
        let plan = rematerialize(&g, &Greedy, &opts).unwrap();
        let mut by: std::collections::BTreeMap<&str, (usize, u64)> = Default::default();
        for c in &plan.choices {
            let e = by.entry(c.op).or_default();
            e.0 += 1;
            e.1 += c.bytes;
        }
        eprintln!(
            "{pct}%: met {} temp {:.0} -> {:.0} MiB ({:.2}x), {} values, extra FLOPs {:.1}%, {:.1} s; {:?}",
            plan.met,
            before.temp_peak_bytes as f64 / 1048576.0,
            plan.after.temp_peak_bytes as f64 / 1048576.0,
            before.temp_peak_bytes as f64 / plan.after.temp_peak_bytes as f64,
            plan.choices.len(),
            plan.extra_flops as f64 / flops * 100.0,
            t.elapsed().as_secs_f64(),
            by
        );
        assert!(plan.after.peak_bytes <= plan.before.peak_bytes);
        // Measured on the H100: 80, 70 and 60% are met (RESULTS).
        if pct >= 60.0 {
            assert!(plan.met, "{pct}%: {} > {}", plan.after.peak_bytes, plan.budget_bytes);
        }
    }
}

/// The saved step donates every parameter and AdamW moment to its update: the
/// model bills those outputs to the arguments, as many bytes as XLA CUDA
/// aliased, and after the update holds only the outputs of their own.
#[test]
fn the_donated_update_is_billed_as_xla_cuda_aliases_it() {
    let g = load("gpt2-small-bf16-adamw-step.kiln.gz");
    let (_, xla) = measured().pop().unwrap();
    let p = peak_memory(&g, &XlaGpuFusion);
    assert_eq!(p.alias_bytes, xla.alias);
    let l = liveness(&g, &XlaGpuFusion);
    let donated = l.buffers.iter().filter(|b| b.kind == BufferKind::Donated).count();
    assert_eq!(donated, g.aliases().len());
    assert_eq!(l.output_curve().last().copied(), Some(p.output_bytes - p.alias_bytes));
    assert!(p.output_bytes - p.alias_bytes < 1 << 20, "the loss and the step count, not the parameters");
}

/// Greedy priced by kernels (`RecomputeCost::Kernels`, the CUDA target's)
/// against greedy priced by arithmetic, on gpt2-small's step by the CUDA
/// model: at 70% and 50% of activation memory both meet the budget and the
/// kernel-priced plan adds less predicted kernel time (this saved step,
/// 2026-11-23, with the trace's achieved bandwidth and GEMM rate: 0.70
/// against 0.93 ms at 70%, 2.76 against 4.64 ms at 50%; `remat_curve`'s
/// step, whose plans were measured on the H100, before that calibration:
/// 0.22 against 0.63 ms and 1.09 against 1.54 ms: `benches/RESULTS.md`).
#[test]
fn kernel_priced_plans_of_gpt2_small_add_less_predicted_time() {
    use kiln_compiler::analysis::kernel_seconds;
    use kiln_compiler::remat::{rematerialize, Greedy, RecomputeCost, RematBudget, RematOptions};
    use kiln_compiler::target::Target;
    let g = load("gpt2-small-bf16-adamw-step.kiln.gz");
    let before = peak_memory(&g, &XlaGpuFusion);
    let t = |g: &Graph| kernel_seconds(g, &liveness(g, &XlaGpuFusion), &Target::H100_SXM_MEASURED);
    let base = t(&g);
    for pct in [70.0, 50.0] {
        let limit = kiln_compiler::pipeline::activation_budget_bytes(&before, pct / 100.0);
        let mut opts = RematOptions::new(RematBudget::Bytes(limit), &XlaGpuFusion);
        let arith = rematerialize(&g, &Greedy, &opts).unwrap();
        opts.cost = RecomputeCost::Kernels;
        let kern = rematerialize(&g, &Greedy, &opts).unwrap();
        let (a, k) = (t(&arith.graph) - base, t(&kern.graph) - base);
        eprintln!(
            "{pct}%: arithmetic {} values, +{:.3} ms; kernels {} values, +{:.3} ms (plan says {:.3})",
            arith.choices.len(),
            a * 1e3,
            kern.choices.len(),
            k * 1e3,
            kern.extra_seconds * 1e3
        );
        assert!(arith.met && kern.met, "{pct}%");
        assert!((kern.extra_seconds - k).abs() < 1e-9, "the plan reports its kernel time");
        assert!(k < a, "{pct}%: kernels +{k} s, arithmetic +{a} s");
    }
}

/// Greedy priced by kernels, lazy (the default: earlier rounds' scores stand
/// in until they matter) against measuring every candidate each round, on
/// gpt2-small's step by the CUDA model: both meet 70% and 50% of activation
/// memory, the lazy plan adding no more than 5% more predicted time (this
/// saved step, 2026-11-24, fused values counted once per kernel: the same
/// 0.451 ms at 70%, 2.631 against 2.546 ms at 50%, in 0.9 against 3.0 s and
/// 3.2 against 12.3 s; `STALE_SLACK` 2.0 made them equal here but the
/// pipeline's 50% plan 1% dearer. 2026-11-23, fused values counted once per
/// reader: 0.696 ms at 70%, 2.750 against 2.772 ms at 50%; without
/// `STALE_SLACK`, 2.939 ms).
#[test]
fn lazy_kernel_priced_plans_are_the_plans_of_measuring_every_round() {
    use kiln_compiler::remat::{rematerialize, Greedy, RecomputeCost, RematBudget, RematOptions};
    let g = load("gpt2-small-bf16-adamw-step.kiln.gz");
    let before = peak_memory(&g, &XlaGpuFusion);
    for pct in [70.0, 50.0] {
        let limit = kiln_compiler::pipeline::activation_budget_bytes(&before, pct / 100.0);
        let mut opts = RematOptions::new(RematBudget::Bytes(limit), &XlaGpuFusion);
        opts.cost = RecomputeCost::Kernels;
        let t = std::time::Instant::now();
        let lazy = rematerialize(&g, &Greedy, &opts).unwrap();
        let lazy_s = t.elapsed().as_secs_f64();
        opts.lazy = false;
        let t = std::time::Instant::now();
        let every = rematerialize(&g, &Greedy, &opts).unwrap();
        let every_s = t.elapsed().as_secs_f64();
        eprintln!(
            "{pct}%: lazy {} values +{:.3} ms in {lazy_s:.1} s; every round {} values +{:.3} ms in {every_s:.1} s",
            lazy.choices.len(),
            lazy.extra_seconds * 1e3,
            every.choices.len(),
            every.extra_seconds * 1e3
        );
        assert!(lazy.met && every.met, "{pct}%");
        // Ties may be taken in another order, and a stale score can let a
        // later round choose otherwise: the plans may differ, by little.
        assert!(lazy.extra_seconds <= every.extra_seconds * 1.05, "{pct}%");
    }
}

/// Barriers whose last operand (a remat barrier's anchor) nothing reads
/// through them: XLA CUDA drops such an operand, and the barrier then no
/// longer holds its clones back.
fn barriers_with_an_unread_anchor(g: &Graph) -> usize {
    use kiln_compiler::ir::{Op, ValueId};
    let mut read = std::collections::HashSet::new();
    for (_, node) in g.nodes() {
        read.extend(node.op.inputs());
    }
    read.extend(g.outputs().iter().copied());
    g.nodes()
        .filter(|(id, node)| match &node.op {
            Op::OptimizationBarrier { inputs } => !read.contains(&ValueId::new(*id, inputs.len() as u32 - 1)),
            _ => false,
        })
        .count()
}

/// The CUDA target's plan holds every recomputation back: each remat barrier's
/// anchor is read through the barrier, by the anchor's later readers or by
/// an entry guard, at 50% of the saved step's activation memory.
#[test]
fn every_remat_barrier_on_cuda_keeps_its_anchor() {
    use kiln_compiler::remat::{rematerialize, Greedy, LeafGuards, RematBudget, RematOptions};
    use kiln_compiler::LowerTarget;
    let g = load("gpt2-small-bf16-adamw-step.kiln.gz");
    let before = peak_memory(&g, &XlaGpuFusion);
    let limit = kiln_compiler::pipeline::activation_budget_bytes(&before, 0.5);
    let opts = RematOptions::for_target(RematBudget::Bytes(limit), LowerTarget::Cuda);
    assert_eq!(opts.guard_leaves, LeafGuards::PassAnchor);
    let plan = rematerialize(&g, &Greedy, &opts).unwrap();
    assert!(plan.choices.len() > 10, "{} values", plan.choices.len());
    assert_eq!(barriers_with_an_unread_anchor(&plan.graph), barriers_with_an_unread_anchor(&g));
    // The barrier alone leaves them unread.
    let bare = rematerialize(&g, &Greedy, &RematOptions { guard_leaves: LeafGuards::Off, ..opts }).unwrap();
    assert!(barriers_with_an_unread_anchor(&bare.graph) > barriers_with_an_unread_anchor(&g));
}
