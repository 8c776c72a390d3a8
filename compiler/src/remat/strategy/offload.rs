//! Host offload: a saved activation lives in pinned host memory between its
//! forward write and its backward read, copied out over the host link while
//! the forward runs and back before the backward needs it. The copies run on
//! the GPU's copy engines beside the kernels, so a value whose recomputation
//! is dear (a GEMM's output, the inputs of attention) leaves the peak for no
//! kernel time, as far as the link can carry it.
//!
//! XLA's form (what JAX emits for `memory_kind="pinned_host"`):
//! `stablehlo.custom_call @annotate_device_placement(%v)` with the frontend
//! attribute `_xla_buffer_placement = "pinned_host"` after the write, and
//! the same call with `"device"` before the read; the host copy passes
//! through an `optimization_barrier` with a value of the backward (the
//! anchor), which is where XLA may start the copy back. kiln's IR spells
//! them [`Op::Place`]; the CUDA lowering emits the annotations.
//!
//! The plan ([`HostOffload`]), on the step's unplanned peak position `P`:
//! - Candidates are greedy remat's (values whose readers split into an early
//!   group before `P` and a late group after it), dearest recomputation per
//!   byte first (the cheap ones, GELU's internals, are left to recomputation).
//!   A value with a late reader that is fused into kernels (inserted before
//!   `P`, run after it) is skipped: the rewrite redirects only readers that
//!   come after the copy back. On gpt2-small that leaves out the attention
//!   outputs and the projections' outputs; the q/k/v head transposes go
//!   instead.
//! - The link is one copy engine each way at [`HOST_LINK_BYTES_PER_SECOND`],
//!   with the kernels' times from the kernel model. Out: copies run in the
//!   order of the values' writes, each from the end of its writing kernel;
//!   all must end before `P` starts, or the value is still on the device at
//!   the peak. Back: each copy is placed as late as the copies after it
//!   allow, ending when its first late reader starts; its anchor is the
//!   last kernel after `P` that ends before the copy starts. A value that
//!   does not fit is not offloaded.
//! - Values are taken until the freed bytes cover the excess over the
//!   budget; then greedy recomputation ([`super::Greedy`]) plans the rest on
//!   the rewritten graph.
//!
//! Measured on the H100 (2026-11-23, `runtime/examples/host_offload.rs`): a
//! chain of 8 layers of 64 MiB saved values, offloaded with the copy back
//! two layers early, ran with 320 MiB of device temp instead of 544 MiB and
//! 512 MiB of host temp, outputs bit-identical; brought back one layer early
//! or just before the read, XLA kept most of them on the device. Pinned
//! copies moved 54.7 GB/s one way and 46.5 GB/s each way at once.
//!
//! On the gpt2-small train step the strategy loses to greedy recomputation
//! alone at every budget measured (60%: 2.73-2.90 GiB of XLA temp and
//! 21.97-24.24 ms against 2.26 GiB and 21.41 ms; 22% on an H200: 3.76 GB and
//! 24.28 ms against 0.87 GB and 22.36 ms): XLA's latency-hiding scheduler
//! reorders the backward to hide the copies (more memory), and without it
//! the copies do not overlap (22%: 785 MB, the plan, at +11 ms). So it is
//! opt-in (docs/memory-journal.md, "Host offload" and "Host offload at the tight
//! budgets").
//!
//! The XLA CPU plugin has no host memory space and refuses the annotation
//! (`NOT_FOUND: No registered implementation for untyped custom call to
//! annotate_device_placement for Host`), so on the CPU target the strategy
//! answers [`CompileError::Remat`], typed.
//!
//! Invariants: the rewrite computes the same values (a placement and a
//! barrier are identities); parameters, outputs and aliases keep their
//! indices; the planned peak is never above the unplanned one (a plan that
//! does not lower it is dropped).

use crate::ir::{Graph, MemorySpace, NodeId, Op, ValueId};
use crate::target::LowerTarget;
use crate::target::HOST_LINK_BYTES_PER_SECOND;
use crate::CompileError;

use crate::analysis::kernel_times;
use crate::analysis::{live_peak, peak_of};
use crate::analysis::{liveness, users_of, BufferKind, Liveness};
use crate::remat::chain::candidates;
use crate::remat::plan::{budget_bytes, finish, RematChoice, RematOptions, RematPlan, RematStrategy};
use crate::remat::Greedy;

/// The smallest value worth a copy each way: a layer norm's row statistics
/// (32 KiB at gpt2-small) would otherwise fill the queue of copies with
/// nothing the peak notices.
pub const MIN_OFFLOAD_BYTES: u64 = 1 << 20;

/// Offload saved activations to pinned host memory as far as the host link
/// carries them, then recompute what is still over the budget (see the
/// module docs).
#[derive(Clone, Copy, Debug)]
pub struct HostOffload {
    /// The target the planned program is lowered for.
    pub target: LowerTarget,
}

impl HostOffload {
    /// Why the strategy cannot run on its target, if it cannot.
    pub fn unavailable_reason(&self) -> Option<&'static str> {
        match self.target {
            LowerTarget::Cpu => Some(
                "the XLA CPU plugin has no host memory space: a program with XLA's \
                 `annotate_device_placement` annotation fails to compile (NOT_FOUND: No registered \
                 implementation for untyped custom call to annotate_device_placement for Host)",
            ),
            LowerTarget::Cuda => None,
        }
    }
}

impl RematStrategy for HostOffload {
    fn name(&self) -> &'static str {
        "host-offload"
    }

    fn plan(&self, g: &Graph, opts: &RematOptions) -> Result<RematPlan, CompileError> {
        if let Some(reason) = self.unavailable_reason() {
            return Err(CompileError::Remat { strategy: self.name(), reason: reason.to_string() });
        }
        let base = liveness(g, opts.fusion);
        let before = peak_of(&base);
        let budget = budget_bytes(opts.budget, &before);
        let (offloaded_graph, offloaded) = offload(g, &base, opts, budget)?;
        let rest = Greedy.plan(&offloaded_graph, opts)?;
        let mut plan = finish(self.name(), g, rest.graph, rest.choices, before, opts);
        plan.offloaded = offloaded;
        Ok(plan)
    }
}

/// One value sent to the host and back.
#[derive(Clone, Debug)]
struct Move {
    value: ValueId,
    bytes: u64,
    /// Position of the kernel that writes it.
    def: usize,
    /// Its first late reader's position.
    late_pos: usize,
    /// Direct users that read it after the peak (they read the copy back).
    late_users: Vec<NodeId>,
    /// The earliest position any of `late_users` is inserted at.
    first_late_user: usize,
}

/// `g` (whose liveness is `l`) with values offloaded until the freed bytes
/// cover the excess over `budget` or the link is full, and what was
/// offloaded.
fn offload(
    g: &Graph,
    l: &Liveness,
    opts: &RematOptions,
    budget: u64,
) -> Result<(Graph, Vec<RematChoice>), CompileError> {
    let peak = peak_of(l);
    if peak.peak_bytes <= budget {
        return Ok((g.clone(), Vec::new()));
    }
    let at = peak.peak_position;
    let mut start = vec![0.0f64];
    for s in kernel_times(g, l, &opts.target) {
        start.push(start.last().copied().unwrap_or(0.0) + s);
    }
    let users = users_of(g);
    let pos = l.positions();
    let mut cands: Vec<_> = candidates(g, l, opts)
        .into_iter()
        .filter(|c| c.early_end < at && at < c.late_pos && c.bytes >= MIN_OFFLOAD_BYTES)
        .collect();
    cands.sort_by(|a, b| {
        (b.seconds / b.bytes as f64).total_cmp(&(a.seconds / a.bytes as f64)).then(a.value.cmp(&b.value))
    });
    let excess = peak.peak_bytes - budget;
    let mut chosen: Vec<Move> = Vec::new();
    let mut anchors: Vec<ValueId> = Vec::new();
    let mut freed = 0u64;
    for c in cands {
        if freed >= excess {
            break;
        }
        let Some(m) = move_for(g, l, &users, &pos, c.value, at) else { continue };
        let mut trial = chosen.clone();
        trial.push(m);
        if !out_fits(&trial, &start, at) {
            continue;
        }
        let Some(a) = back_anchors(&trial, &start, at) else { continue };
        let Some(a) = a.iter().map(|&p| anchor_at(l, p, at)).collect::<Option<Vec<_>>>() else { continue };
        freed += trial.last().map_or(0, |m| m.bytes);
        chosen = trial;
        anchors = a;
    }
    if chosen.is_empty() {
        return Ok((g.clone(), Vec::new()));
    }
    let out = rewrite(g, &chosen, &anchors)?;
    // The plan must lower the modelled peak; otherwise it is dropped.
    if live_peak(&liveness(&out, opts.fusion)).1 >= peak.peak_bytes {
        return Ok((g.clone(), Vec::new()));
    }
    let choices = chosen.iter().map(|m| RematChoice::moved(g, m.value, m.bytes)).collect();
    Ok((out, choices))
}

/// The move for `v` around the peak at `at`, if its direct users split
/// cleanly: each runs before `at` or after it, and those after it are all
/// inserted after the peak (so the copy back can precede them).
fn move_for(
    g: &Graph,
    l: &Liveness,
    users: &[Vec<NodeId>],
    pos: &[Option<usize>],
    v: ValueId,
    at: usize,
) -> Option<Move> {
    let b = l.buffers[l.buffer_of[v.node.index()][v.output as usize]?].clone();
    if b.kind != BufferKind::Temp || g.outputs().contains(&v) {
        return None;
    }
    let mut late_users = Vec::new();
    let mut late_pos = usize::MAX;
    for &u in &users[v.node.index()] {
        if !g.node(u).op.inputs().contains(&v) {
            continue;
        }
        let run = l.exec_pos[u.index()]?;
        match run.cmp(&at) {
            std::cmp::Ordering::Less => {}
            std::cmp::Ordering::Equal => return None,
            std::cmp::Ordering::Greater => {
                if pos[u.index()].is_none_or(|p| p <= at + 1) {
                    return None;
                }
                late_users.push(u);
                late_pos = late_pos.min(run);
            }
        }
    }
    let first_late_user = late_users.iter().filter_map(|u| pos[u.index()]).min()?;
    Some(Move { value: v, bytes: b.bytes, def: b.def, late_pos, late_users, first_late_user })
}

/// Seconds the link takes for `bytes`.
fn link_seconds(bytes: u64) -> f64 {
    bytes as f64 / HOST_LINK_BYTES_PER_SECOND
}

/// Whether the copies out, in the order of the writes, all end before the
/// kernel at `at` starts.
fn out_fits(moves: &[Move], start: &[f64], at: usize) -> bool {
    let mut by_def: Vec<&Move> = moves.iter().collect();
    by_def.sort_by_key(|m| m.def);
    let mut free = 0.0f64;
    for m in by_def {
        free = free.max(start[m.def + 1]) + link_seconds(m.bytes);
    }
    free <= start[at]
}

/// The anchor position of each move's copy back (in `moves`' order): the
/// copies are laid out backwards from their deadlines (each first late
/// reader's start), one at a time, and each anchored on the last position
/// after `at` that ends before its copy starts and precedes its late users.
/// `None` when one cannot start after the peak.
fn back_anchors(moves: &[Move], start: &[f64], at: usize) -> Option<Vec<usize>> {
    let mut order: Vec<usize> = (0..moves.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(moves[i].late_pos));
    let mut anchors = vec![0; moves.len()];
    let mut next = f64::INFINITY;
    for i in order {
        let m = &moves[i];
        let begin = start[m.late_pos].min(next) - link_seconds(m.bytes);
        next = begin;
        // The last kernel ending by `begin`, after the peak kernel.
        let q = (at + 1..m.first_late_user.min(m.late_pos)).rev().find(|&q| start[q + 1] <= begin)?;
        anchors[i] = q;
    }
    Some(anchors)
}

/// A buffer written at position `p` or the latest one before it, after `at`.
fn anchor_at(l: &Liveness, p: usize, at: usize) -> Option<ValueId> {
    l.buffers
        .iter()
        .filter(|b| {
            b.def > at && b.def <= p && matches!(b.kind, BufferKind::Temp | BufferKind::Output | BufferKind::Donated)
        })
        .max_by_key(|b| b.def)
        .map(|b| b.value)
}

/// `g` with each move's placements: to the host right after the value's
/// write, back to the device through a barrier with its anchor right after
/// the anchor's write; the late users read the copy back, and every later
/// reader of the anchor reads the barrier's pass-through of it (as JAX's
/// offloaded residuals pass through one barrier with the cotangent that the
/// backward then reads), so that XLA cannot drop the anchor from the barrier
/// and start the copy back early.
fn rewrite(g: &Graph, moves: &[Move], anchors: &[ValueId]) -> Result<Graph, CompileError> {
    let mut out = Graph::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(g.len());
    // The anchors' values as later readers see them (through their barriers).
    let mut passed: Vec<(ValueId, ValueId)> = Vec::new();
    let remap_plain = |map: &[NodeId], v: ValueId| ValueId::new(map[v.node.index()], v.output);
    let remap = |map: &[NodeId], passed: &[(ValueId, ValueId)], v: ValueId| {
        passed.iter().rev().find(|(a, _)| *a == v).map_or_else(|| remap_plain(map, v), |&(_, p)| p)
    };
    let mut host: Vec<Option<ValueId>> = vec![None; moves.len()];
    let mut back: Vec<Option<ValueId>> = vec![None; moves.len()];
    for (id, node) in g.nodes() {
        let mut op = node.op.clone();
        let mut missing = false;
        op.map_inputs(|u| match moves.iter().position(|m| m.value == u && m.late_users.contains(&id)) {
            Some(k) => back[k].unwrap_or_else(|| {
                missing = true;
                remap(&map, &passed, u)
            }),
            None => remap(&map, &passed, u),
        });
        if missing {
            return Err(CompileError::Remat {
                strategy: "host-offload",
                reason: format!("a late reader ({id:?}) comes before its value's copy back"),
            });
        }
        map.push(out.add(op)?);
        for (k, m) in moves.iter().enumerate() {
            if m.value.node == id {
                let v = remap(&map, &passed, m.value);
                host[k] = Some(out.value(Op::Place { input: v, to: MemorySpace::PinnedHost })?);
            }
        }
        for (k, a) in anchors.iter().enumerate() {
            if a.node == id {
                let h = host[k].ok_or_else(|| CompileError::Remat {
                    strategy: "host-offload",
                    reason: "an anchor comes before its value's write".into(),
                })?;
                let held = out.add(Op::OptimizationBarrier { inputs: vec![h, remap(&map, &passed, *a)] })?;
                back[k] = Some(out.value(Op::Place { input: ValueId::new(held, 0), to: MemorySpace::Device })?);
                passed.push((*a, ValueId::new(held, 1)));
            }
        }
    }
    out.set_outputs(g.outputs().iter().map(|&v| remap(&map, &passed, v)).collect())?;
    for &a in g.aliases() {
        out.add_alias(a)?;
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::analysis::{peak_memory, XlaGpuFusion};
    use crate::ir::{BinaryOp, DType, DotDims, Literal, TensorType, UnaryOp};
    use crate::remat::{rematerialize, RematBudget};

    /// A forward of `layers` layers `a = tanh(h · w)` (or `tanh(h)` without
    /// `dot`) whose outputs a backward reads in reverse, `g = (g · w) · a`:
    /// the shape of a train step's saved activations.
    pub(in crate::remat) fn chain(rows: usize, d: usize, layers: usize, dot: bool) -> Graph {
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::F32, [rows, d]));
        let w = g.parameter(TensorType::new(DType::F32, [d, d]));
        let dims = DotDims { lhs_contract: vec![1], rhs_contract: vec![0], ..DotDims::default() };
        let mm = |g: &mut Graph, a: ValueId| {
            if dot {
                g.value(Op::DotGeneral { lhs: a, rhs: w, dims: dims.clone() }).unwrap()
            } else {
                a
            }
        };
        let mut saved = Vec::new();
        let mut h = x;
        for _ in 0..layers {
            let m = mm(&mut g, h);
            h = g.value(Op::Unary { op: UnaryOp::Tanh, input: m }).unwrap();
            saved.push(h);
        }
        let mut grad = h;
        for &a in saved.iter().rev() {
            let n = mm(&mut g, grad);
            let n = if dot { n } else { g.value(Op::Unary { op: UnaryOp::Exp, input: n }).unwrap() };
            grad = g.value(Op::Binary { op: BinaryOp::Mul, lhs: n, rhs: a }).unwrap();
        }
        g.set_outputs(vec![grad]).unwrap();
        g
    }

    fn places(g: &Graph, to: MemorySpace) -> usize {
        g.nodes().filter(|(_, n)| matches!(n.op, Op::Place { to: t, .. } if t == to)).count()
    }

    #[test]
    fn the_cpu_plugin_has_no_host_memory_space() {
        let g = chain(4, 4, 2, true);
        let opts = RematOptions::for_target(RematBudget::Bytes(0), LowerTarget::Cpu);
        match rematerialize(&g, &HostOffload { target: LowerTarget::Cpu }, &opts) {
            Err(CompileError::Remat { strategy: "host-offload", reason }) => {
                assert!(reason.contains("annotate_device_placement"), "{reason}")
            }
            other => panic!("{:?}", other.map(|p| p.strategy)),
        }
    }

    #[test]
    fn saved_layers_go_to_the_host_as_far_as_the_link_carries_them() {
        // 32 MiB saved per layer, 0.75 ms on the link; a layer's GEMM (275
        // GFLOP) takes 0.66 ms by the kernel model, so the forward reaches
        // the peak at 5.28 ms. Seven values are read across it; the first
        // is written at 0.66 ms, and six copies end at 5.13 ms, seven would
        // end at 5.87: six go.
        let g = chain(512, 16384, 8, true);
        let opts = RematOptions::for_target(RematBudget::Bytes(0), LowerTarget::Cuda);
        let plan = rematerialize(&g, &HostOffload { target: LowerTarget::Cuda }, &opts).unwrap();
        crate::verify(&plan.graph).unwrap();
        let n = plan.offloaded.len();
        assert_eq!(n, 6, "{:?}", plan.offloaded);
        assert!(plan.offloaded.iter().all(|c| c.op == "tanh" && c.bytes == 32 << 20));
        assert_eq!(places(&plan.graph, MemorySpace::PinnedHost), n);
        assert_eq!(places(&plan.graph, MemorySpace::Device), n);
        assert!(plan.after.peak_bytes < plan.before.peak_bytes, "{:?} -> {:?}", plan.before, plan.after);
        assert_eq!(peak_memory(&plan.graph, &XlaGpuFusion), plan.after);
        let cuda = crate::lower(
            &plan.graph,
            &crate::LowerOptions { target: LowerTarget::Cuda, ..crate::LowerOptions::default() },
        )
        .unwrap();
        assert_eq!(cuda.matches("@annotate_device_placement").count(), 2 * n);
        assert_eq!(cuda.matches("_xla_buffer_placement = \"pinned_host\"").count(), n);
    }

    #[test]
    fn values_the_link_cannot_move_around_the_peak_stay() {
        // 64 MiB per layer (1.5 ms on the link) between 55 µs elementwise
        // kernels: no copy out ends before the backward starts, and none
        // back could start after it in time.
        let g = chain(4096, 4096, 4, false);
        let opts = RematOptions::for_target(RematBudget::Bytes(0), LowerTarget::Cuda);
        let (out, offloaded) = offload(&g, &liveness(&g, opts.fusion), &opts, 0).unwrap();
        assert!(offloaded.is_empty(), "{offloaded:?}");
        assert_eq!(places(&out, MemorySpace::PinnedHost), 0);
    }

    #[test]
    fn a_met_budget_offloads_nothing() {
        let g = chain(512, 16384, 8, true);
        let opts = RematOptions::for_target(RematBudget::Bytes(u64::MAX), LowerTarget::Cuda);
        let plan = rematerialize(&g, &HostOffload { target: LowerTarget::Cuda }, &opts).unwrap();
        assert!(plan.offloaded.is_empty() && plan.choices.is_empty());
        assert_eq!(plan.graph.len(), g.len());
    }

    #[test]
    fn offloaded_values_are_bit_identical_and_leave_the_peak() {
        // Small enough to interpret: every saved layer moved, each anchored
        // on the last buffer before its late reader.
        let g = chain(16, 16, 4, true);
        let l = liveness(&g, &XlaGpuFusion);
        let at = peak_of(&l).peak_position;
        let users = users_of(&g);
        let pos = l.positions();
        let moves: Vec<Move> = (0..g.len())
            .filter(|&i| matches!(g.node(NodeId::from_index(i)).op, Op::Unary { op: UnaryOp::Tanh, .. }))
            .filter_map(|i| move_for(&g, &l, &users, &pos, ValueId::new(NodeId::from_index(i), 0), at))
            .collect();
        assert_eq!(moves.len(), 3, "the last layer's output is read at the peak");
        let anchors: Vec<ValueId> =
            moves.iter().map(|m| anchor_at(&l, m.first_late_user.min(m.late_pos) - 1, at).unwrap()).collect();
        let out = rewrite(&g, &moves, &anchors).unwrap();
        crate::verify(&out).unwrap();
        assert!(peak_memory(&out, &XlaGpuFusion).temp_peak_bytes < peak_memory(&g, &XlaGpuFusion).temp_peak_bytes);
        let fresh = |seed: f64| {
            Literal::from_f64s(
                DType::F32,
                [16, 16],
                &(0..256).map(|i| (i as f64 * seed).sin() * 0.3).collect::<Vec<_>>(),
            )
            .unwrap()
        };
        let inputs = [fresh(0.37), fresh(0.91)];
        assert_eq!(crate::interpret(&g, &inputs).unwrap(), crate::interpret(&out, &inputs).unwrap());
        // On the CPU target the placements lower to nothing.
        let cpu = crate::lower(&out, &crate::LowerOptions::default()).unwrap();
        assert!(!cpu.contains("annotate_device_placement"));
    }

    #[test]
    fn the_link_moves_one_copy_at_a_time_each_way() {
        // Ten kernels of 1 ms; the peak kernel at position 5. Each value is
        // 1 ms on the link.
        let start: Vec<f64> = (0..=10).map(|k| k as f64 * 1e-3).collect();
        let bytes = (HOST_LINK_BYTES_PER_SECOND * 1e-3) as u64;
        let mv = |def: usize, late_pos: usize| Move {
            value: ValueId::new(NodeId::from_index(def), 0),
            bytes,
            def,
            late_pos,
            late_users: Vec::new(),
            first_late_user: late_pos,
        };
        // Written at 0, 1 and 2, copies end at 2, 3 and 4 ms: before the peak
        // starts (5 ms). A fourth written at 3 would end at 5: still in time;
        // a fifth at 4 would end at 6.
        assert!(out_fits(&[mv(0, 9), mv(1, 9), mv(2, 9)], &start, 5));
        assert!(out_fits(&[mv(0, 9), mv(1, 9), mv(2, 9), mv(3, 9)], &start, 5));
        assert!(!out_fits(&[mv(0, 9), mv(1, 9), mv(2, 9), mv(3, 9), mv(4, 9)], &start, 5));
        // Back: copies laid out backwards from their readers, one at a time.
        // Read at 9: the copy runs 8-9 ms, anchored on the kernel ending at
        // 8 (position 7). Then one read at 8 runs 7-8 ms (anchor 6); a third
        // read at 8 would have to run 6-7 ms, anchored on a kernel that ends
        // by 6 ms after the peak kernel (which ends at 6): there is none.
        assert_eq!(back_anchors(&[mv(0, 9)], &start, 5), Some(vec![7]));
        assert_eq!(back_anchors(&[mv(0, 9), mv(1, 8)], &start, 5), Some(vec![7, 6]));
        assert_eq!(back_anchors(&[mv(0, 9), mv(1, 8), mv(2, 8)], &start, 5), None);
        // With the peak a kernel earlier, the third fits, anchored on 5.
        assert_eq!(back_anchors(&[mv(0, 9), mv(1, 8), mv(2, 8)], &start, 4), Some(vec![7, 6, 5]));
    }
}
