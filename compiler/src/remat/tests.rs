//! The remat pass on small graphs: the rewrite computes the same values,
//! the plans meet their budgets, the strategies agree.

use super::chain::*;
use super::plan::*;
use super::*;
use crate::analysis::liveness;
use crate::analysis::{peak_memory, EveryNodeAKernel};
use crate::ir::{DType, Literal, TensorType, UnaryOp};
use crate::ir::{Graph, Op, ValueId};

/// A "forward" chain a0..a3 of tanh, then a "backward" chain that reads
/// each a_i in reverse order: the classic shape remat cuts.
fn ladder(n: usize) -> Graph {
    let mut g = Graph::new();
    let t = TensorType::new(DType::F32, [256]);
    let p = g.parameter(t.clone());
    let mut acts = vec![p];
    for _ in 0..n {
        let last = *acts.last().unwrap();
        acts.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: last }).unwrap());
    }
    let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: acts[n] }).unwrap();
    for i in (1..n).rev() {
        ct = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: ct, rhs: acts[i] }).unwrap();
    }
    g.set_outputs(vec![ct]).unwrap();
    g
}

/// The ladder's backward reads its forward's values; the same chain
/// without a backward (an evaluation's shape) keeps none for later.
#[test]
fn a_backward_is_what_keeps_values_for_later() {
    let opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
    assert!(keeps_values_for_later(&ladder(6), &opts));
    let mut g = Graph::new();
    let mut x = g.parameter(TensorType::new(DType::F32, [256]));
    for _ in 0..6 {
        x = g.value(Op::Unary { op: UnaryOp::Tanh, input: x }).unwrap();
    }
    g.set_outputs(vec![x]).unwrap();
    assert!(!keeps_values_for_later(&g, &opts));
}

#[test]
fn kernel_priced_greedy_cuts_the_ladder_peak_and_keeps_the_values() {
    let g = ladder(8);
    let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
    let arith = rematerialize(&g, &Greedy, &opts).unwrap();
    opts.cost = RecomputeCost::Kernels;
    let plan = rematerialize(&g, &Greedy, &opts).unwrap();
    crate::verify(&plan.graph).unwrap();
    assert!(plan.after.peak_bytes < plan.before.peak_bytes, "{:?} -> {:?}", plan.before, plan.after);
    assert!(plan.after.peak_bytes <= arith.after.peak_bytes, "{:?} vs {:?}", plan.after, arith.after);
    assert!(plan.extra_seconds > 0.0);
    let x =
        Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| (i as f64 * 0.61).cos()).collect::<Vec<_>>()).unwrap();
    let want = crate::interpret(&g, std::slice::from_ref(&x)).unwrap();
    let got = crate::interpret(&plan.graph, &[x]).unwrap();
    assert_eq!(want, got, "recomputation is bit-identical on the interpreter");
}

#[test]
fn kernel_priced_greedy_plans_alike_on_one_thread_and_on_four() {
    // Rounds measure their candidates in parallel batches; the plan must
    // be the one a walk one candidate at a time makes, whatever the
    // number of threads.
    let g = ladder(48);
    let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
    opts.cost = RecomputeCost::Kernels;
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| rematerialize(&g, &Greedy, &opts).unwrap())
    };
    let (one, four) = (on(1), on(4));
    assert!(one.choices.len() > KERNEL_TRIES, "{} choices: too few rounds to fill a window", one.choices.len());
    assert_eq!(one.choices, four.choices);
    assert_eq!(one.after, four.after);
    assert_eq!(one.extra_seconds.to_bits(), four.extra_seconds.to_bits());
    assert_eq!(one.graph.to_string(), four.graph.to_string());
}

#[test]
fn greedy_cuts_the_ladder_peak_and_keeps_the_values() {
    let g = ladder(8);
    let opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
    let plan = rematerialize(&g, &Greedy, &opts).unwrap();
    crate::verify(&plan.graph).unwrap();
    assert!(plan.after.peak_bytes < plan.before.peak_bytes, "{:?} -> {:?}", plan.before, plan.after);
    assert!(!plan.choices.is_empty());
    assert!(plan.extra_flops > 0);
    assert_eq!(peak_memory(&plan.graph, &EveryNodeAKernel), plan.after);
    let x =
        Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| (i as f64 * 0.37).sin()).collect::<Vec<_>>()).unwrap();
    let want = crate::interpret(&g, std::slice::from_ref(&x)).unwrap();
    let got = crate::interpret(&plan.graph, &[x]).unwrap();
    assert_eq!(want, got, "recomputation is bit-identical on the interpreter");
}

/// `t = tanh(h)` is read by a forward row sum and, in the "backward",
/// through fused products (`-(t·t)`, then times the cotangent `dg`) by
/// one row sum; an unrelated GEMM `w` is written after `dg`. The barrier
/// before the late kernel waits for `dg`, which the fused products read,
/// not for `w`, the latest buffer of the gap: on the H100 waiting for a
/// weight gradient made GELU's two recomputations a cycle to XLA.
#[test]
fn the_barrier_waits_for_what_the_fused_readers_read() {
    let mut g = Graph::new();
    let f32 = |dims: [usize; 2]| TensorType::new(DType::F32, dims);
    let h = g.parameter(f32([64, 128]));
    let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: h }).unwrap();
    let s = g.value(Op::Reduce { op: crate::ir::ReduceOp::Sum, input: t, axes: vec![1] }).unwrap();
    let (a, b) = (g.parameter(f32([64, 32])), g.parameter(f32([32, 128])));
    let dg = g.value(Op::DotGeneral { lhs: a, rhs: b, dims: crate::ir::DotDims::matmul() }).unwrap();
    let (c, d) = (g.parameter(f32([64, 32])), g.parameter(f32([32, 128])));
    let w = g.value(Op::DotGeneral { lhs: c, rhs: d, dims: crate::ir::DotDims::matmul() }).unwrap();
    let tt = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: t, rhs: t }).unwrap();
    let factor = g.value(Op::Unary { op: UnaryOp::Neg, input: tt }).unwrap();
    let prod = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: dg, rhs: factor }).unwrap();
    let r = g.value(Op::Reduce { op: crate::ir::ReduceOp::Sum, input: prod, axes: vec![1] }).unwrap();
    g.set_outputs(vec![s, w, r]).unwrap();
    let opts = RematOptions::new(RematBudget::Bytes(0), &crate::analysis::XlaGpuFusion);
    let l = liveness(&g, opts.fusion);
    assert!(l.materialized[t.node.index()] && !l.materialized[prod.node.index()]);
    let cands = candidates(&g, &l, &opts);
    let c = cands.iter().find(|c| c.value == t).expect("tanh is a candidate");
    assert_eq!(c.late_node, r.node);
    assert_eq!(c.anchor, Some(dg));
}

/// [`ladder`] with a weight: eight layers `h = tanh(h ∘ wc)` of one
/// weight's cast `wc = tanh(w)`, and a backward `ct = ct ∘ h_i ∘ wc` from
/// the last layer down; `x` (parameter 0) is the input, `w` (parameter 1)
/// the weight.
fn weighted_ladder() -> (Graph, ValueId, ValueId) {
    let mut g = Graph::new();
    let t = TensorType::new(DType::F32, [256]);
    let x = g.parameter(t.clone());
    let w = g.parameter(t);
    let wc = g.value(Op::Unary { op: UnaryOp::Tanh, input: w }).unwrap();
    let mul = |g: &mut Graph, a, b| g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: a, rhs: b });
    let mut hs = vec![x];
    for _ in 0..8 {
        let y = mul(&mut g, *hs.last().unwrap(), wc).unwrap();
        hs.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: y }).unwrap());
    }
    let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: hs[8] }).unwrap();
    for &h in hs[1..8].iter().rev() {
        let m = mul(&mut g, ct, h).unwrap();
        ct = mul(&mut g, m, wc).unwrap();
    }
    g.set_outputs(vec![ct]).unwrap();
    (g, w, wc)
}

/// Under FSDP a weight read through the barrier or a guard, or
/// recomputed, is a weight gathered again: with the weight's parameter
/// among `gathered_params` the plan recomputes layers but reads the
/// weight's cast where it is. Without, it fences the cast.
#[test]
fn a_gathered_weight_is_read_where_it_is() {
    let (g, w, wc) = weighted_ladder();
    let reads_weight = |plan: &RematPlan| {
        plan.graph.nodes().any(|(_, n)| {
            matches!(n.op, Op::OptimizationBarrier { .. } | Op::Select { .. })
                && n.op.inputs().iter().any(|u| u.node == w.node || u.node == wc.node)
        })
    };
    let casts = |plan: &RematPlan| {
        plan.graph
            .nodes()
            .filter(|(_, n)| matches!(n.op, Op::Unary { op: UnaryOp::Tanh, input } if input.node == w.node))
            .count()
    };
    let x =
        Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| (i as f64 * 0.23).sin()).collect::<Vec<_>>()).unwrap();
    let wv =
        Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| 0.5 + (i as f64 * 0.71).cos()).collect::<Vec<_>>())
            .unwrap();
    let want = crate::interpret(&g, &[x.clone(), wv.clone()]).unwrap();
    let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
    let fenced = rematerialize(&g, &Greedy, &opts).unwrap();
    assert!(reads_weight(&fenced), "without gathered parameters the cast is fenced:\n{}", fenced.graph);
    opts.gathered_params = vec![1];
    let plan = rematerialize(&g, &Greedy, &opts).unwrap();
    crate::verify(&plan.graph).unwrap();
    assert!(!plan.choices.is_empty());
    assert!(plan.after.peak_bytes < plan.before.peak_bytes, "{:?} -> {:?}", plan.before, plan.after);
    assert!(!reads_weight(&plan), "a gathered weight read through a fence:\n{}", plan.graph);
    assert_eq!(casts(&plan), 1, "the weight's cast recomputed:\n{}", plan.graph);
    assert_eq!(crate::interpret(&plan.graph, &[x, wv]).unwrap(), want);
}

/// An embedding's lookup `x0 = table[ids]` (the table parameter 1) under
/// eight layers `h = tanh(h)`, and a backward `ct = ct ∘ h_i` down to
/// `h_1`, which is the one value greedy may recompute. `x0` is dead by
/// then, so recomputing `h_1` means looking the rows up again, unless the
/// table is gathered: then the chain would read `x0`, kept for it, which
/// frees nothing, and greedy leaves the step as it is.
#[test]
fn a_lookup_in_a_gathered_table_is_not_recomputed() {
    let mut g = Graph::new();
    let ids = g.parameter(TensorType::new(DType::I32, [64]));
    let table = g.parameter(TensorType::new(DType::F32, [16, 32]));
    let x0 = g.value(Op::Gather { operand: table, indices: ids, axis: 0 }).unwrap();
    let mut hs = vec![x0];
    for _ in 0..8 {
        let last = *hs.last().unwrap();
        hs.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: last }).unwrap());
    }
    let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: hs[8] }).unwrap();
    for &h in hs[1..8].iter().rev() {
        ct = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: ct, rhs: h }).unwrap();
    }
    g.set_outputs(vec![ct]).unwrap();
    let lookups = |plan: &RematPlan| plan.graph.nodes().filter(|(_, n)| matches!(n.op, Op::Gather { .. })).count();
    let only = [hs[1]];
    let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
    opts.only = Some(&only);
    let idv =
        Literal::from_f64s(DType::I32, [64], &(0..64).map(|i| ((i * 7) % 16) as f64).collect::<Vec<_>>()).unwrap();
    let tv = Literal::from_f64s(DType::F32, [16, 32], &(0..512).map(|i| (i as f64 * 0.37).sin()).collect::<Vec<_>>())
        .unwrap();
    let want = crate::interpret(&g, &[idv.clone(), tv.clone()]).unwrap();
    for gathered in [false, true] {
        opts.gathered_params = if gathered { vec![1] } else { Vec::new() };
        let plan = rematerialize(&g, &Greedy, &opts).unwrap();
        crate::verify(&plan.graph).unwrap();
        // Gathered, keeping x0 for the chain frees nothing: no plan.
        let (recomputed, expected) = if gathered { (0, 1) } else { (1, 2) };
        assert_eq!(plan.values_recomputed(), recomputed, "gathered {gathered}:\n{}", plan.graph);
        assert_eq!(lookups(&plan), expected, "gathered {gathered}:\n{}", plan.graph);
        assert_eq!(crate::interpret(&plan.graph, &[idv.clone(), tv.clone()]).unwrap(), want);
    }
}

#[test]
fn clones_read_their_inputs_through_a_barrier() {
    let g = ladder(6);
    let opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
    let plan = rematerialize(&g, &Greedy, &opts).unwrap();
    let barriers = plan.graph.nodes().filter(|(_, n)| matches!(n.op, Op::OptimizationBarrier { .. })).count();
    assert_eq!(barriers, plan.choices.len());
}

fn selects(g: &Graph) -> usize {
    g.nodes().filter(|(_, n)| matches!(n.op, Op::Select { .. })).count()
}

/// The ladder's lowest-peak plan with every leaf guarded, and with
/// `guards`; checks the second verifies and computes the same values.
fn ladder_plans(guards: LeafGuards) -> (RematPlan, RematPlan) {
    let g = ladder(6);
    let mut opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
    opts.pin_floating = false;
    let every = rematerialize(&g, &Greedy, &opts).unwrap();
    opts.guard_leaves = guards;
    let plan = rematerialize(&g, &Greedy, &opts).unwrap();
    assert!(!plan.choices.is_empty());
    crate::verify(&plan.graph).unwrap();
    let x =
        Literal::from_f64s(DType::F32, [256], &(0..256).map(|i| (i as f64 * 0.61).cos()).collect::<Vec<_>>()).unwrap();
    let want = crate::interpret(&g, std::slice::from_ref(&x)).unwrap();
    assert_eq!(crate::interpret(&plan.graph, &[x]).unwrap(), want);
    (every, plan)
}

#[test]
fn without_guards_the_barrier_alone_fences_and_values_are_unchanged() {
    let (guarded, bare) = ladder_plans(LeafGuards::Off);
    assert!(selects(&guarded.graph) > 0, "the default reads fenced leaves through the guard");
    assert_eq!(selects(&bare.graph), 0);
    let barriers = bare.graph.nodes().filter(|(_, n)| matches!(n.op, Op::OptimizationBarrier { .. })).count();
    assert_eq!(barriers, bare.choices.len());
}

/// On targets that expand barriers before scheduling, each chain's entry
/// reads one guarded leaf: every barrier feeds a select, there are no
/// more selects than with every leaf guarded, and the values are the same.
#[test]
fn entry_guards_hold_every_chain_and_values_are_unchanged() {
    let (every, entries) = ladder_plans(LeafGuards::Entries);
    assert!(selects(&entries.graph) <= selects(&every.graph));
    for (b, _) in entries.graph.nodes().filter(|(_, n)| matches!(n.op, Op::OptimizationBarrier { .. })) {
        let guarded = entries.graph.nodes().any(|(_, n)| match n.op {
            Op::Select { on_true, .. } => on_true.node == b,
            _ => false,
        });
        assert!(guarded, "the barrier {b:?} feeds no guard");
    }
}

/// With the anchor passed through, no leaf is guarded, every barrier's
/// last result (the anchor's pass-through) is read, nothing reads an
/// anchor itself after its barrier, and the values are the same.
#[test]
fn a_passed_anchor_is_read_through_every_barrier_and_values_are_unchanged() {
    let (_, passed) = ladder_plans(LeafGuards::PassAnchor);
    let g = &passed.graph;
    assert_eq!(selects(g), 0);
    let barriers: Vec<_> = g.nodes().filter(|(_, n)| matches!(n.op, Op::OptimizationBarrier { .. })).collect();
    assert_eq!(barriers.len(), passed.choices.len());
    for (b, node) in barriers {
        let Op::OptimizationBarrier { inputs } = &node.op else { unreachable!() };
        let last = inputs.len() as u32 - 1;
        let through = ValueId::new(b, last);
        assert!(g.users(b).iter().any(|&u| g.node(u).op.inputs().contains(&through)), "{b:?}'s anchor is not read");
        let anchor = inputs[last as usize];
        for u in g.users(anchor.node) {
            if u.index() > b.index() {
                assert!(!g.node(u).op.inputs().contains(&anchor), "{u:?} reads the anchor past {b:?}");
            }
        }
    }
}

#[test]
fn off_changes_nothing() {
    let g = ladder(4);
    let opts = RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel);
    let plan = rematerialize(&g, &Off, &opts).unwrap();
    assert_eq!(crate::text::print(&plan.graph), crate::text::print(&g));
    assert_eq!(plan.extra_flops, 0);
    assert!(!plan.met);
}

#[test]
fn exact_meets_a_budget_with_no_more_flops_than_greedy() {
    let g = ladder(6);
    let before = peak_memory(&g, &EveryNodeAKernel).peak_bytes;
    let opts = RematOptions::new(RematBudget::Bytes(before * 3 / 4), &EveryNodeAKernel);
    let greedy = rematerialize(&g, &Greedy, &opts).unwrap();
    let exact = rematerialize(&g, &crate::remat::Exact, &opts).unwrap();
    assert!(
        exact.met && greedy.met,
        "greedy {} exact {} budget {}",
        greedy.after.peak_bytes,
        exact.after.peak_bytes,
        before * 3 / 4
    );
    assert!(exact.extra_flops <= greedy.extra_flops);
}

/// A layer-norm composite read early and late: remat clones it whole
/// (every output), and the values do not change.
#[test]
fn a_multi_output_composite_is_cloned_whole() {
    let mut g = Graph::new();
    let p = g.parameter(TensorType::new(DType::F32, [16, 64]));
    let gamma = g.parameter(TensorType::new(DType::F32, [64]));
    let beta = g.parameter(TensorType::new(DType::F32, [64]));
    let a = g.value(Op::Unary { op: UnaryOp::Tanh, input: p }).unwrap();
    let ln = g.add(Op::LayerNorm { x: a, gamma, beta, eps_bits: 1e-5f64.to_bits() }).unwrap();
    let y = ValueId::new(ln, 0);
    let mut acts = vec![y];
    for _ in 0..6 {
        let last = *acts.last().unwrap();
        acts.push(g.value(Op::Unary { op: UnaryOp::Tanh, input: last }).unwrap());
    }
    let mut ct = g.value(Op::Unary { op: UnaryOp::Exp, input: *acts.last().unwrap() }).unwrap();
    for &h in acts[..acts.len() - 1].iter().rev() {
        ct = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: ct, rhs: h }).unwrap();
    }
    g.set_outputs(vec![ct]).unwrap();
    let plan = rematerialize(&g, &Greedy, &RematOptions::new(RematBudget::Bytes(0), &EveryNodeAKernel)).unwrap();
    crate::verify(&plan.graph).unwrap();
    assert!(plan.after.peak_bytes < plan.before.peak_bytes);
    let lns = plan.graph.nodes().filter(|(_, n)| matches!(n.op, Op::LayerNorm { .. })).count();
    assert_eq!(lns, 2, "the composite is recomputed once: {:?}", plan.choices);
    let x: Vec<Literal> = [(vec![16usize, 64], 0.37), (vec![64], 0.11), (vec![64], 0.23)]
        .iter()
        .map(|(shape, k)| {
            let n: usize = shape.iter().product();
            Literal::from_f64s(DType::F32, shape.clone(), &(0..n).map(|i| (i as f64 * k).sin()).collect::<Vec<_>>())
                .unwrap()
        })
        .collect();
    assert_eq!(crate::interpret(&g, &x).unwrap(), crate::interpret(&plan.graph, &x).unwrap());
}
