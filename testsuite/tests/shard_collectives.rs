//! Tensor parallelism splits attention by heads, as Megatron does: the
//! partitioned train step of the tiny GPT communicates only through the
//! all-reduces Megatron's column/row split needs, none around attention.
//!
//! The evidence is XLA's own: the CPU plugin's optimized HLO of the step
//! (`XLA_FLAGS=--xla_dump_to`, after SPMD partitioning and every later pass),
//! whose collective instructions are counted. Under `model=M` tensor
//! parallelism with whole heads per device, each block needs exactly four
//! all-reduces of its `[batch, seq, dim]` activations over the model group:
//! in the forward after the two row Linears (`attn.proj`, `mlp.proj`: each
//! device holds a partial sum over its input-feature slice), in the backward
//! after the two column Linears' input gradients (`attn.qkv`, `mlp.fc`: a
//! partial sum over the output-feature slice). Nothing else is split, so no
//! all-gather, all-to-all, collective-permute or reduce-scatter appears.
//! With the fused qkv projection split on its flat output features (q, k, v
//! as contiguous thirds, the layout before the heads axis), the partitioner
//! all-gathered the qkv activation in the forward and its gradient in the
//! backward of every layer instead (2 layers: 4 all-gathers), and this test
//! failed on that.
//!
//! Under FSDP the blocked LM head runs each device's rows in blocks: no rows
//! move and nothing is reduced per block but a scalar.
//!
//! One test in this file: XLA reads `XLA_FLAGS` once per process, when the
//! plugin first compiles, so the variable is set before anything runs.

use std::path::{Path, PathBuf};

use kiln::models::gpt::{captured_step, CharVocab, GptConfig, GptTrainer, LmHeadLoss};
use kiln::shard::{self, Mesh, PolicyKind};
use kiln::Tensor;

fn text() -> String {
    let mut s = String::new();
    for i in 0..40 {
        s.push_str(&format!("line {i}: the quick brown fox {} jumps over {} lazy dogs.\n", i * 7 % 13, i % 5));
    }
    s
}

/// One collective instruction of an optimized HLO module.
#[derive(Debug)]
struct Collective {
    /// `all-reduce`, `all-gather`, ... (`-start` of the async forms folded in).
    opcode: String,
    /// The result shape as printed, without the layout (`f32[8,32,64]`).
    shape: String,
    /// `{{0,1},{2,3}}`, or empty when the instruction prints none.
    groups: String,
}

const COLLECTIVES: [&str; 5] = ["all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"];

/// Every collective instruction of `hlo` (HLO text).
fn collectives(hlo: &str) -> Vec<Collective> {
    let mut out = Vec::new();
    for line in hlo.lines() {
        // `  %name = <shape> <opcode>(<operands>), <attributes>`
        let Some((_, rhs)) = line.trim_start().split_once(" = ") else { continue };
        // `<shape> <opcode>(`; a tuple shape has spaces and parentheses of
        // its own, so the opcode is found by name.
        let Some((opcode, at)) = COLLECTIVES.iter().find_map(|op| {
            [format!(" {op}("), format!(" {op}-start(")]
                .iter()
                .find_map(|pat| rhs.find(pat.as_str()))
                .map(|at| (*op, at))
        }) else {
            continue;
        };
        // Without the layouts: `f32[8,32,64]`, `(f32[], f32[64])`.
        let mut shape = String::new();
        let mut in_layout = false;
        for c in rhs[..at].chars() {
            match c {
                '{' => in_layout = true,
                '}' => in_layout = false,
                c if !in_layout => shape.push(c),
                _ => {}
            }
        }
        let groups = rhs
            .split_once("replica_groups=")
            .map(|(_, g)| g.split(' ').next().unwrap_or("").trim_end_matches(',').to_string())
            .unwrap_or_default();
        out.push(Collective { opcode: opcode.to_string(), shape, groups });
    }
    out
}

/// The optimized-HLO files XLA dumped into `dir`.
fn after_optimizations(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with("cpu_after_optimizations.txt")) {
            out.push(p);
        }
    }
    Ok(out)
}

/// Runs two captured training steps of the tiny GPT (the step `kiln train
/// gpt` runs) on `mesh` under `policy` on a fresh thread and returns the
/// collectives of the largest program it compiled: the train step (any
/// other program, such as an init program, is far smaller). The dump
/// directory is emptied first, so only this run's programs are looked at.
fn step_collectives(dump: &Path, mesh: &str, policy: PolicyKind, cfg: &GptConfig) -> anyhow::Result<Vec<Collective>> {
    planned_step_collectives(dump, mesh, policy, cfg, None)
}

/// [`step_collectives`] with the step planned under `budget` (a share of
/// its activation memory, `kiln::set_activation_budget`).
fn planned_step_collectives(
    dump: &Path,
    mesh: &str,
    policy: PolicyKind,
    cfg: &GptConfig,
    budget: Option<f64>,
) -> anyhow::Result<Vec<Collective>> {
    for e in std::fs::read_dir(dump)? {
        let p = e?.path();
        if p.is_dir() {
            std::fs::remove_dir_all(&p)?;
        } else {
            std::fs::remove_file(&p)?;
        }
    }
    let mesh = Mesh::parse(mesh)?;
    std::thread::scope(|s| {
        s.spawn(|| -> anyhow::Result<()> {
            kiln::set_disk_cache(None)?;
            kiln::set_activation_budget(budget)?;
            shard::set_mesh(mesh)?;
            shard::set_policy(Some(policy));
            let text = text();
            let vocab = CharVocab::new(&text);
            let mut t =
                GptTrainer::new(vocab.encode(&text), &GptConfig { vocab: cfg.vocab.max(vocab.len()), ..cfg.clone() })?;
            let batches = (0..2).map(|_| t.next_batch()).collect::<kiln::Result<Vec<_>>>()?;
            let mut step = captured_step(&t.model, t.params.tensors(), &mut t.opt, None, None);
            for (x, y) in batches {
                let out = step.call(&[x, y, Tensor::scalar(3e-3f32)])?;
                assert!(out[0].item()?.is_finite());
            }
            Ok(())
        })
        .join()
        .expect("the training thread panicked")
    })?;
    let step = after_optimizations(dump)?
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .ok_or_else(|| anyhow::anyhow!("XLA dumped no optimized HLO into {}", dump.display()))?;
    Ok(collectives(&std::fs::read_to_string(step)?))
}

fn count(c: &[Collective], opcode: &str) -> usize {
    c.iter().filter(|c| c.opcode == opcode).count()
}

#[test]
fn tensor_parallel_step_all_reduces_four_times_per_layer_and_never_reshards_heads() -> anyhow::Result<()> {
    let dump = tempfile::tempdir()?;
    let flags = std::env::var("XLA_FLAGS").unwrap_or_default();
    std::env::set_var("XLA_FLAGS", format!("{flags} --xla_dump_to={} --xla_dump_hlo_as_text", dump.path().display()));
    let cfg = GptConfig { batch: 8, ..GptConfig::tiny(1) };
    let activation = format!("f32[{},{},{}]", cfg.batch, cfg.seq, cfg.dim);
    let per_layer = 4;

    // TP over all four devices: the whole batch on every device.
    let tp = step_collectives(dump.path(), "model=4", PolicyKind::TensorParallel, &cfg)?;
    for opcode in COLLECTIVES {
        eprintln!("model=4: {opcode} x{}", count(&tp, opcode));
    }
    for forbidden in ["all-gather", "all-to-all", "collective-permute", "reduce-scatter"] {
        let found: Vec<&Collective> = tp.iter().filter(|c| c.opcode == forbidden).collect();
        assert!(found.is_empty(), "model=4: the step reshards ({forbidden}): {found:?}");
    }
    let reduces: Vec<&Collective> = tp.iter().filter(|c| c.opcode == "all-reduce").collect();
    assert_eq!(reduces.len(), per_layer * cfg.layers, "model=4 all-reduces: {reduces:?}");
    for r in &reduces {
        assert_eq!(r.shape, activation, "model=4: an all-reduce of something else than the activations: {r:?}");
        assert_eq!(r.groups, "{{0,1,2,3}}", "{r:?}");
    }

    // TP over `model=2` beside data parallelism over `data=2`: the same four
    // activation all-reduces per layer, inside each model group ({0,1},
    // {2,3}: the last mesh axis varies fastest), each over the device's half
    // of the global batch; the data axis adds only the gradient reduction of
    // the parameters (and of the device checks' scalars), over {0,2},{1,3}.
    let dp_tp = step_collectives(dump.path(), "data=2,model=2", PolicyKind::TensorParallel, &cfg)?;
    for opcode in COLLECTIVES {
        eprintln!("data=2,model=2: {opcode} x{}", count(&dp_tp, opcode));
    }
    for forbidden in ["all-gather", "all-to-all", "collective-permute", "reduce-scatter"] {
        let found: Vec<&Collective> = dp_tp.iter().filter(|c| c.opcode == forbidden).collect();
        assert!(found.is_empty(), "data=2,model=2: the step reshards ({forbidden}): {found:?}");
    }
    let model_group: Vec<&Collective> = dp_tp.iter().filter(|c| c.groups == "{{0,1},{2,3}}").collect();
    assert_eq!(model_group.len(), per_layer * cfg.layers, "data=2,model=2 model-group collectives: {model_group:?}");
    let half = format!("f32[{},{},{}]", cfg.batch / 2, cfg.seq, cfg.dim);
    for r in &model_group {
        assert_eq!((r.opcode.as_str(), r.shape.as_str()), ("all-reduce", half.as_str()), "{r:?}");
    }
    let data_group = dp_tp.iter().filter(|c| c.groups == "{{0,2},{1,3}}").count();
    assert!(data_group >= 1, "data=2,model=2: no gradient reduction over data: {dp_tp:?}");
    assert_eq!(model_group.len() + data_group, dp_tp.len(), "collectives over other groups: {dp_tp:?}");

    // The blocked LM head under FSDP over `data=4`: each device holds 64 of
    // the step's 256 rows and runs its own rows in blocks of 32 (the rows'
    // parts, `docs/sharding.md`, "The LM head on each device's rows"). The
    // step gathers the parameters as the explicit-logits step does, moves no
    // rows between devices, and reduces nothing per block but the scalar
    // that chains the blocks on the CPU target; dw joins the gradients'
    // reduction. Blocks of rows contiguous over all devices lived on one
    // device each: the partitioner spread every block's rows over the
    // devices (12 collective-permutes, 5 all-to-alls) and all-reduced every
    // block's dw share and picked logits.
    let vocab = CharVocab::new(&text()).len() as u64;
    let explicit = step_collectives(dump.path(), "data=4", PolicyKind::Fsdp, &cfg)?;
    let blocked_cfg = GptConfig { lm_head: Some(LmHeadLoss::Blocks { block_bytes: 4 * 32 * vocab }), ..cfg.clone() };
    let blocked = step_collectives(dump.path(), "data=4", PolicyKind::Fsdp, &blocked_cfg)?;
    blocked_head_moves_nothing("data=4 fsdp", &explicit, &blocked);
    assert_eq!(count(&blocked, "all-gather"), count(&explicit, "all-gather"), "{blocked:?}");
    let per_block: Vec<&Collective> = blocked
        .iter()
        .filter(|c| c.opcode == "all-reduce" && !c.shape.starts_with('(') && elements(&c.shape) > 1)
        .collect();
    assert!(per_block.is_empty(), "data=4 blocked head: all-reduces of more than a scalar: {per_block:?}");

    // The same with a vocabulary whose table (FSDP-split over the vocabulary)
    // outweighs a block's rows, as gpt2-small's does: the partitioner, left
    // to choose, gathered each block's rows, made half the vocabulary's
    // logits on each device, then all-gathered and all-to-all'ed them (4
    // all-to-alls and 10 more all-gathers here; 3.6 GB and 1.6 GB a step for
    // gpt2-small on two H200s). With the table whole where the blocks read
    // it, it is gathered once and the rows stay put.
    let big = GptConfig { vocab: 4096, ..cfg.clone() };
    let explicit = step_collectives(dump.path(), "data=2", PolicyKind::Fsdp, &big)?;
    let blocked_cfg = GptConfig { lm_head: Some(LmHeadLoss::Blocks { block_bytes: 4 * 64 * 4096 }), ..big.clone() };
    let blocked = step_collectives(dump.path(), "data=2", PolicyKind::Fsdp, &blocked_cfg)?;
    blocked_head_moves_nothing("data=2 fsdp, vocab 4096", &explicit, &blocked);
    let table = format!("f32[4096,{}]", cfg.dim);
    let gathers: Vec<&Collective> = blocked.iter().filter(|c| c.opcode == "all-gather").collect();
    assert_eq!(gathers.iter().filter(|c| c.shape == table).count(), 1, "the table gathered once: {gathers:?}");
    let logits: Vec<&&Collective> =
        gathers.iter().filter(|c| c.shape.contains(",4096]") || c.shape.contains(",2048]")).collect();
    assert!(logits.is_empty(), "vocab 4096 blocked head: logits gathered: {logits:?}");
    assert!(gathers.len() <= count(&explicit, "all-gather"), "{gathers:?}");

    // Remat under FSDP: a plan that recomputes activations in the backward
    // reads the weights the forward gathered and gathers none of them again.
    // With the weights read through the remat fence (and through the CPU
    // target's ordering guards), the 25% plan of this step made 33
    // all-gathers more than the unplanned step's 28, and gpt2-small's on two
    // H200s 90 more than its 9 (`docs/memory-journal.md`, "Remat under FSDP reads the
    // gathered weights"). One gather more is allowed, the embedding's gradient
    // (`[vocab, dim]`): on the CPU target the ordering pass anchors a guard on
    // its scatter, so XLA no longer folds the scatter into the LM head's dw,
    // and the partitioner makes that gradient split and gathers it.
    let planned = planned_step_collectives(dump.path(), "data=2", PolicyKind::Fsdp, &cfg, Some(0.25))?;
    let unplanned = step_collectives(dump.path(), "data=2", PolicyKind::Fsdp, &cfg)?;
    for opcode in COLLECTIVES {
        eprintln!(
            "data=2 fsdp: {opcode} x{} unplanned, x{} at 25%",
            count(&unplanned, opcode),
            count(&planned, opcode)
        );
    }
    let mut extra: Vec<&str> = planned.iter().filter(|c| c.opcode == "all-gather").map(|c| c.shape.as_str()).collect();
    for c in unplanned.iter().filter(|c| c.opcode == "all-gather") {
        if let Some(k) = extra.iter().position(|&s| s == c.shape) {
            extra.remove(k);
        }
    }
    let table = format!("f32[{vocab},{}]", cfg.dim);
    assert!(extra.is_empty() || extra == [table.as_str()], "gathered again under the plan: {extra:?}");
    Ok(())
}

/// Prints both steps' collective counts and asserts that the blocked head's
/// step moves no rows or logits between devices: no all-to-all,
/// collective-permute or reduce-scatter.
fn blocked_head_moves_nothing(label: &str, explicit: &[Collective], blocked: &[Collective]) {
    for opcode in COLLECTIVES {
        eprintln!(
            "{label}: {opcode} x{} explicit logits, x{} blocked head",
            count(explicit, opcode),
            count(blocked, opcode)
        );
    }
    for forbidden in ["all-to-all", "collective-permute", "reduce-scatter"] {
        let found: Vec<&Collective> = blocked.iter().filter(|c| c.opcode == forbidden).collect();
        assert!(
            found.is_empty(),
            "{label}, blocked head: rows or logits move between devices ({forbidden}): {found:?}"
        );
    }
}

/// Elements of an array shape as printed without its layout (`f32[1,1,1]`: 1).
fn elements(shape: &str) -> usize {
    let dims = shape.split_once('[').map_or("", |(_, d)| d.trim_end_matches(']'));
    dims.split(',').filter(|d| !d.is_empty()).map(|d| d.parse::<usize>().unwrap_or(usize::MAX)).product()
}
