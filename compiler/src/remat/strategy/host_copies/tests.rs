//! Host copies on small graphs: the trips planned, the rewrite, the plan's
//! peak against greedy's.

use super::*;
use crate::analysis::{peak_memory, XlaGpuFusion};
use crate::ir::{DType, Literal, UnaryOp};
use crate::remat::{rematerialize, RematBudget};
use crate::target::LowerTarget;

/// `layers` layers `a = tanh(h · w)` whose outputs a backward reads in
/// reverse, `g = (g · w) · a`: a train step's saved activations.
fn chain(rows: usize, d: usize, layers: usize) -> Graph {
    super::super::offload::tests::chain(rows, d, layers, true)
}

fn steps(g: &Graph) -> Vec<(usize, HostCopyStep, u32)> {
    g.nodes()
        .filter_map(|(id, n)| match &n.op {
            Op::HostCopy { step, slot, .. } => Some((id.index(), *step, *slot)),
            _ => None,
        })
        .collect()
}

/// `n` fresh `[rows, d]` f32 inputs in (-0.4, 0.4), drawn from the clock,
/// and the seed, for the failure message.
fn fresh_inputs(n: usize, rows: usize, d: usize) -> (Vec<Literal>, u32) {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let salts = [0.5, 7.25, 3.125];
    let inputs = salts[..n]
        .iter()
        .map(|salt| {
            let vals: Vec<f64> =
                (0..rows * d).map(|i| ((i as f64 + salt) * (1.0 + f64::from(seed % 997))).sin() * 0.4).collect();
            Literal::from_f64s(DType::F32, [rows, d], &vals).unwrap()
        })
        .collect();
    (inputs, seed)
}

fn cuda(budget: RematBudget) -> RematOptions<'static> {
    RematOptions::for_target(budget, LowerTarget::Cuda)
}

#[test]
fn moved_values_come_back_bit_identical_and_leave_the_peak() {
    let g = chain(16, 16, 6);
    let (out, moved) =
        copies_of_at_least(&g, &cuda(RematBudget::Bytes(0)), 0, HOST_COPY_LINK_BYTES_PER_SECOND).unwrap();
    crate::verify(&out).unwrap();
    // Five layers' outputs are read across the backward's first kernel
    // (the last one is read at it); every one fits a link that moves a
    // KiB in 26 ns.
    assert_eq!(moved.len(), 5, "{moved:?}");
    assert!(moved.iter().all(|m| m.op == "tanh" && m.bytes == 1024));
    let before = peak_memory(&g, &XlaGpuFusion);
    let after = peak_memory(&out, &XlaGpuFusion);
    assert!(after.peak_bytes < before.peak_bytes, "{before:?} -> {after:?}");
    // Each slot's four steps, in trip order.
    let s = steps(&out);
    for slot in 0..moved.len() as u32 {
        let mine: Vec<HostCopyStep> = s.iter().filter(|x| x.2 == slot).map(|x| x.1).collect();
        assert_eq!(mine, HostCopyStep::ALL.to_vec(), "slot {slot}");
    }
    let (inputs, seed) = fresh_inputs(2, 16, 16);
    assert_eq!(crate::interpret(&g, &inputs).unwrap(), crate::interpret(&out, &inputs).unwrap(), "seed {seed}");
}

#[test]
fn a_kernel_over_the_inputs_stays_for_the_activations() {
    // `chain`'s layers, the first with the weight `c = exp(p)` of a
    // parameter `p` (as a bf16 copy of a weight), which the backward's
    // last GEMM reads again: `c` is written first and held across the
    // peak, so in write order the link would carry it first. It is one
    // kernel over a buffer the step keeps anyway, so it is no candidate;
    // the activations are.
    let (rows, d) = (16, 16);
    let mut g = Graph::new();
    let ty = crate::ir::TensorType::new(DType::F32, [rows, d]);
    let x = g.parameter(ty.clone());
    let w = g.parameter(ty.clone());
    let p = g.parameter(ty);
    let c = g.value(Op::Unary { op: UnaryOp::Exp, input: p }).unwrap();
    let dims = crate::ir::DotDims { lhs_contract: vec![1], rhs_contract: vec![0], ..Default::default() };
    let mut saved = Vec::new();
    let mut h = x;
    for layer in 0..4 {
        let rhs = if layer == 0 { c } else { w };
        let m = g.value(Op::DotGeneral { lhs: h, rhs, dims: dims.clone() }).unwrap();
        h = g.value(Op::Unary { op: UnaryOp::Tanh, input: m }).unwrap();
        saved.push(h);
    }
    let mut grad = h;
    for (k, &a) in saved.iter().enumerate().rev() {
        let rhs = if k == 0 { c } else { w };
        let n = g.value(Op::DotGeneral { lhs: grad, rhs, dims: dims.clone() }).unwrap();
        grad = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: n, rhs: a }).unwrap();
    }
    g.set_outputs(vec![grad]).unwrap();
    assert!(one_kernel_over_inputs(&g, c) && !one_kernel_over_inputs(&g, saved[1]));
    let (out, moved) =
        copies_of_at_least(&g, &cuda(RematBudget::Bytes(0)), 0, HOST_COPY_LINK_BYTES_PER_SECOND).unwrap();
    crate::verify(&out).unwrap();
    assert!(!moved.is_empty() && moved.iter().all(|m| m.value != c && saved.contains(&m.value)), "{moved:?}");
    let (inputs, seed) = fresh_inputs(3, rows, d);
    assert_eq!(crate::interpret(&g, &inputs).unwrap(), crate::interpret(&out, &inputs).unwrap(), "seed {seed}");
}

#[test]
fn a_trip_out_of_order_is_refused_by_the_rewrite() {
    let g = chain(16, 16, 3);
    // The first layer's output, copied back after the second layer's
    // GEMM but waited for as done only after the third's: out of order.
    let tanh: Vec<NodeId> =
        g.nodes().filter(|(_, n)| matches!(n.op, Op::Unary { op: UnaryOp::Tanh, .. })).map(|(id, _)| id).collect();
    let late = g.users(tanh[0]).into_iter().filter(|u| matches!(g.node(*u).op, Op::Binary { .. })).collect();
    let trip = Trip {
        value: ValueId::new(tanh[0], 0),
        bytes: 1024,
        late_users: late,
        out_after: tanh[0],
        out_start: 0.0,
        in_end: 0.0,
        out_done_after: tanh[2],
        in_after: tanh[1],
        in_done_after: tanh[2],
    };
    match rewrite(&g, &[trip]) {
        Err(CompileError::Remat { strategy: "host-copy", reason }) => {
            assert!(reason.contains("before the copy out ends"), "{reason}")
        }
        other => panic!("{:?}", other.map(|g| g.len())),
    }
}

#[test]
fn the_steps_lower_to_kilns_custom_calls_on_both_targets() {
    let g = chain(16, 16, 4);
    let (out, moved) =
        copies_of_at_least(&g, &cuda(RematBudget::Bytes(0)), 0, HOST_COPY_LINK_BYTES_PER_SECOND).unwrap();
    assert!(!moved.is_empty());
    for target in [LowerTarget::Cpu, LowerTarget::Cuda] {
        let text = crate::lower(&out, &crate::LowerOptions { target, ..crate::LowerOptions::default() }).unwrap();
        for step in HostCopyStep::ALL {
            assert_eq!(text.matches(&format!("@{}(", step.target())).count(), moved.len(), "{target:?} {step:?}");
        }
        assert_eq!(text.matches("output_operand_alias<").count(), moved.len());
        assert!(text.contains("backend_config = {slot = 0 : i64}"));
    }
}

#[test]
fn the_link_moves_only_what_it_carries_before_the_peak() {
    // 32 MiB saved per layer, 0.84 ms on the link each way at 40 GB/s; a
    // layer's GEMM takes 0.66 ms by the kernel model. Seven values are
    // read across the backward's first GEMM, which starts at 5.28 ms:
    // copies out of values written at 0.66, 1.32, ... ms, one at a time,
    // end at 1.50, 2.34, 3.18, 4.02 and 4.86 ms for five of them; a sixth
    // would end at 5.69.
    let g = chain(512, 16384, 8);
    let opts = cuda(RematBudget::Bytes(0));
    let (out, moved) = copies(&g, &opts).unwrap();
    assert_eq!(moved.len(), 5, "{moved:?}");
    assert!(peak_memory(&out, &XlaGpuFusion).peak_bytes < peak_memory(&g, &XlaGpuFusion).peak_bytes);
}

#[test]
fn no_copy_is_waited_for_before_the_link_has_carried_it() {
    // The copies of `the_link_moves_only_what_it_carries_before_the_peak`
    // each end during a GEMM (at 1.50, 2.34, ... ms, where the GEMMs end
    // at 1.32, 1.98, 2.64, ...). Replayed over the planned program's
    // kernel times, one copy at a time in the order they are issued, each
    // `out_done` comes after its copy's modelled end: XLA's stream never
    // waits on the link, and the model frees no buffer early. (Waiting
    // after the last kernel that ends before the copy, as first built,
    // fails this by up to a GEMM's time.)
    let g = chain(512, 16384, 8);
    let opts = cuda(RematBudget::Bytes(0));
    let (out, moved) = copies(&g, &opts).unwrap();
    assert!(!moved.is_empty());
    let l = liveness(&out, opts.fusion);
    let start = kernel_starts(&out, &l, &opts.target);
    // Where each step runs: its position in the program's order.
    let at = |id: NodeId| l.exec_pos[id.index()].expect("a host copy step runs");
    let mut outs: Vec<(usize, u32, u64)> = Vec::new();
    let mut done: HashMap<u32, usize> = HashMap::new();
    for (id, n) in out.nodes() {
        if let Op::HostCopy { step, slot, ty, .. } = &n.op {
            match step {
                HostCopyStep::Out => outs.push((at(id), *slot, ty.size_in_bytes() as u64)),
                HostCopyStep::OutDone => {
                    done.insert(*slot, at(id));
                }
                _ => {}
            }
        }
    }
    outs.sort();
    let mut link = 0.0f64;
    for (p, slot, bytes) in outs {
        link = link.max(start[p]) + bytes as f64 / HOST_COPY_LINK_BYTES_PER_SECOND;
        let waited = start[done[&slot]];
        assert!(waited >= link - 1e-12, "slot {slot}: waited at {waited:.6} s, copy ends at {link:.6} s");
    }
}

#[test]
fn copies_that_cost_more_than_they_save_leave_greedys_plan() {
    // Greedy's plan at the asked budget leaves values the link could
    // carry, but what copies would save in recomputation, at this rung or
    // a looser one, is less than their trips cost: the strategy keeps
    // greedy's plan without copies.
    let g = chain(1024, 4096, 12);
    let opts = cuda(RematBudget::FractionOfActivations(0.8));
    let greedy = rematerialize(&g, &Greedy, &opts).unwrap();
    let (_, would_move) =
        copies_of_at_least(&greedy.graph, &opts, MIN_OFFLOAD_BYTES, HOST_COPY_LINK_BYTES_PER_SECOND).unwrap();
    assert!(!would_move.is_empty());
    let plan = rematerialize(&g, &HostCopies::default(), &opts).unwrap();
    assert!(plan.met && plan.offloaded.is_empty(), "{} values moved", plan.offloaded.len());
    assert_eq!(plan.extra_seconds.to_bits(), greedy.extra_seconds.to_bits());
    assert_eq!(plan.after, greedy.after);
    assert!(steps(&plan.graph).is_empty());
    // Where copies win at the default price (0.534 against 0.632 ms by
    // the model), a dear trip leaves greedy's plan too.
    let g = chain(512, 8192, 8);
    let opts = cuda(RematBudget::FractionOfActivations(0.7));
    let greedy = rematerialize(&g, &Greedy, &opts).unwrap();
    let cheap = rematerialize(&g, &HostCopies::default(), &opts).unwrap();
    assert!(!cheap.offloaded.is_empty() && cheap.extra_seconds < greedy.extra_seconds);
    let dear = HostCopies { trip_seconds: 1.0, ..HostCopies::default() };
    let plan = rematerialize(&g, &dear, &opts).unwrap();
    assert!(plan.met && plan.offloaded.is_empty() && steps(&plan.graph).is_empty());
    assert_eq!(plan.extra_seconds.to_bits(), greedy.extra_seconds.to_bits());
}

#[test]
fn the_strategy_meets_a_budget_greedy_alone_meets_with_more_recomputation() {
    let g = chain(512, 16384, 8);
    let base = peak_memory(&g, &XlaGpuFusion);
    let opts = cuda(RematBudget::FractionOfActivations(0.55));
    let greedy = rematerialize(&g, &Greedy, &opts).unwrap();
    let plan = rematerialize(&g, &HostCopies::default(), &opts).unwrap();
    crate::verify(&plan.graph).unwrap();
    assert!(greedy.met && plan.met, "{} {} of {}", greedy.after.peak_bytes, plan.after.peak_bytes, base.peak_bytes);
    assert!(!plan.offloaded.is_empty());
    assert!(
        plan.extra_seconds < greedy.extra_seconds,
        "copies {} s against greedy's {} s",
        plan.extra_seconds,
        greedy.extra_seconds
    );
}
