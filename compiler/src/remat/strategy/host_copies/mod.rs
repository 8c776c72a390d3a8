//! Host copies beside a greedy plan: what a recomputation plan still holds
//! across its peak goes to pinned host memory over copies of kiln's own
//! ([`Op::HostCopy`]), while the kernels run, and comes back before its
//! first later reader.
//!
//! Why this and not [`super::HostOffload`]: XLA's host offload turns its
//! annotations into async copies that XLA's latency-hiding scheduler reorders
//! the backward around (more memory), or, with that scheduler off, runs
//! between the kernels (docs/memory-journal.md, "Host offload at the tight budgets").
//! kiln's copies are custom calls, ordinary instructions to that scheduler,
//! whose handlers (`kiln_runtime::pjrt::host_copy`) run the copies on copy
//! streams of the runtime's, so the program keeps this module's order and
//! the copies still overlap the kernels.
//!
//! The plan ([`HostCopies`]):
//! - Greedy recomputation plans the step at budgets looser than the asked
//!   one by up to what the host link can carry before the unplanned peak, in
//!   [`RUNGS`] steps; beside each plan, [`copies`] moves what the link
//!   carries; the plan that meets the budget with the least added time by
//!   the model wins (the kernels' time, and [`HostCopies::trip_seconds`] a
//!   copy, [`HOST_COPY_TRIP_SECONDS`] by default), else the lowest peak.
//!   Greedy at the asked budget, without copies, is one of the plans, and
//!   wins at loose budgets, where copies save less recomputation than they
//!   cost.
//! - [`copies`], on a plan whose peak kernel is at `P`: the candidates are the
//!   temporaries held across `P` (written before it, read before it and after
//!   it, not at it), each read only by its own node's users, of at least
//!   [`MIN_OFFLOAD_BYTES`]. The link is one copy at a time each way at
//!   [`HostCopies::link_bytes_per_second`] ([`HOST_COPY_LINK_BYTES_PER_SECOND`]
//!   by default) over the kernel model's times. Out, in
//!   write order: a copy starts when its value is written and the link is
//!   free, and must end before `P` starts. Back, latest first reader first:
//!   a copy ends when its first later reader starts (or the next copy back
//!   begins) and must begin after `P` ends.
//! - The rewrite, for a value `v` moved with slot `s`:
//!   `t = out(v)` right after `v`'s write, and a barrier `(t', v') = (t, v)`
//!   whose `v'` every later reader of `v` reads, so the copy starts before
//!   the next kernel; `t2 = out_done(v', t', z)` after `z`, the value of the
//!   kernel the copy is modelled to end during (or the next after it that
//!   depends on `v`), so XLA's stream waits only where the copy is modelled
//!   done (`v`'s buffer is free from there); `b = in(t2, a)` after `a`, the
//!   value of the last kernel before the copy back begins that depends on
//!   the peak kernel and is read within [`READ_SOON`] kernels, with a
//!   barrier `(b', a') = (b, a)` whose `a'` every later reader of `a` reads,
//!   so the copy back starts there;
//!   `d = in_done(b', w)` after `w`, the value of the kernel before the first
//!   later reader, which reads `d`. (A tie on any kernel is not enough: XLA
//!   runs a weight's cast, say, whenever it likes, and on the H200 every
//!   `out_done` then ran right after its `out`.) Readers of `v` fused into a
//!   later kernel but placed earlier in the graph move after `d`.
//! - Stops shared ([`share_stops`]) where the model loses nothing by it: a
//!   copy out starts at a later copy's stop when the link is busy until then,
//!   and waits move onto other copies' stops. Each call cuts XLA's command
//!   buffers; on the 21% gpt2-small plan this takes 64 stops to 29 (measured
//!   0.06 ms a step).
//!
//! Measured on the H200 (gpt2-small bf16, docs/memory-journal.md, "Host copies of
//! kiln's own" and "Host copies honest about the link"): with the waits
//! after the kernel a copy ends during and the link at 40 GB/s, 22% of the
//! activation memory reads 4.65× less XLA temp at +14.3% to +14.9% of the
//! unplanned step in three calls and +15.7% in a fourth; in the remat curve
//! beside JAX, +13.6% to +14.8% in five rows. At 49–50% copies ran slower
//! than greedy alone ("Host copies at a loose budget"); priced at
//! [`HOST_COPY_TRIP_SECONDS`] a trip, the strategy keeps greedy's plan there.
//!
//! Invariants: the rewrite computes the same values (every step is the
//! identity on the value, and barriers are identities); parameters, outputs
//! and aliases keep their indices; moves that do not lower the modelled peak
//! are dropped. On the CPU target the copies run too (the CPU plugin's
//! handlers copy at once), which is how CI checks the lowering and values.

use crate::target::HOST_COPY_LINK_BYTES_PER_SECOND;
use std::collections::HashMap;

use crate::ir::{Graph, HostCopyStep, NodeId, Op, ValueId};
use crate::CompileError;

use super::offload::MIN_OFFLOAD_BYTES;
use crate::analysis::kernel_starts;
use crate::analysis::peak_of;
use crate::analysis::{liveness, users_of, BufferKind, Liveness};
use crate::remat::plan::{budget_bytes, finish, RematBudget, RematChoice, RematOptions, RematPlan, RematStrategy};
use crate::remat::Greedy;

pub use crate::target::HOST_COPY_TRIP_SECONDS;

/// Greedy plans tried beside copies: budgets from the asked one up to the
/// link's capacity before the unplanned peak above it, in this many equal
/// steps (plus the asked one).
pub const RUNGS: u64 = 6;

/// How many positions after the kernel a copy back starts at its value must
/// be read, so that the barrier holding the copy's start there binds.
const READ_SOON: usize = 3;

/// Greedy recomputation with kiln's host copies beside it (see the module
/// docs).
#[derive(Clone, Copy, Debug)]
pub struct HostCopies {
    /// What one direction of the host link carries while the other carries
    /// as much, in bytes per second.
    pub link_bytes_per_second: f64,
    /// What a value's trip adds beyond the kernels, in seconds.
    pub trip_seconds: f64,
}

impl Default for HostCopies {
    fn default() -> HostCopies {
        HostCopies { link_bytes_per_second: HOST_COPY_LINK_BYTES_PER_SECOND, trip_seconds: HOST_COPY_TRIP_SECONDS }
    }
}

impl RematStrategy for HostCopies {
    fn name(&self) -> &'static str {
        "host-copy"
    }

    fn plan(&self, g: &Graph, opts: &RematOptions) -> Result<RematPlan, CompileError> {
        let base = liveness(g, opts.fusion);
        let before = peak_of(&base);
        let budget = budget_bytes(opts.budget, &before);
        let link = link_capacity(g, &base, opts, self.link_bytes_per_second);
        let mut best: Option<RematPlan> = None;
        let mut consider = |plan: RematPlan, k: u64, loose: u64| {
            let better = match &best {
                None => true,
                Some(b) if plan.met != b.met => plan.met,
                Some(b) if plan.met => plan.extra_seconds < b.extra_seconds,
                Some(b) => plan.after.peak_bytes < b.after.peak_bytes,
            };
            tracing::debug!(
                rung = k,
                greedy_budget = loose,
                peak = plan.after.peak_bytes,
                moved = plan.offloaded.len(),
                extra_seconds = plan.extra_seconds,
                "host-copy rung"
            );
            if better {
                best = Some(plan);
            }
        };
        for k in 0..=RUNGS {
            let loose = budget.saturating_add(link * k / RUNGS);
            let greedy = Greedy.plan(g, &opts.with_budget(RematBudget::Bytes(loose)))?;
            let (graph, moved) =
                copies_of_at_least(&greedy.graph, opts, MIN_OFFLOAD_BYTES, self.link_bytes_per_second)?;
            let choices = greedy.choices.clone();
            if k == 0 && !moved.is_empty() {
                // Greedy alone at the asked budget (the rung's, at `k` 0),
                // which copies must beat.
                consider(RematPlan { strategy: self.name(), ..greedy }, k, loose);
            }
            // Judged against the asked budget (`opts`'), not the rung's.
            let mut plan = finish(self.name(), g, graph, choices, before, opts);
            plan.extra_seconds += moved.len() as f64 * self.trip_seconds;
            plan.offloaded = moved;
            consider(plan, k, loose);
        }
        best.ok_or_else(|| CompileError::Remat { strategy: "host-copy", reason: "no rung was planned".into() })
    }
}

/// Bytes the host link carries while the step's kernels before its peak run.
fn link_capacity(g: &Graph, l: &Liveness, opts: &RematOptions, rate: f64) -> u64 {
    (kernel_starts(g, l, &opts.target)[peak_of(l).peak_position] * rate) as u64
}

/// One value's trip, in positions of the plan it was chosen on.
#[derive(Clone, Debug)]
struct Trip {
    value: ValueId,
    bytes: u64,
    /// Direct users that read it after the peak (they read the copy back).
    late_users: Vec<NodeId>,
    /// The node after which the copy out starts (the value's own, or a later
    /// one written before the link is free for it).
    out_after: NodeId,
    /// When the link is modelled free for the copy out, in seconds.
    out_start: f64,
    /// When the copy back is modelled done, in seconds.
    in_end: f64,
    /// The node after which the copy out is known done (`z`).
    out_done_after: NodeId,
    /// The node after which the copy back starts (`a`).
    in_after: NodeId,
    /// The node after which the copy back is waited for (`w`).
    in_done_after: NodeId,
}

/// `g` with what the host link carries around its peak moved to the host
/// and back, and the moves; `g` unchanged when nothing lowers its peak.
pub fn copies(g: &Graph, opts: &RematOptions) -> Result<(Graph, Vec<RematChoice>), CompileError> {
    copies_of_at_least(g, opts, MIN_OFFLOAD_BYTES, HOST_COPY_LINK_BYTES_PER_SECOND)
}

/// [`copies`] of values of at least `min_bytes` over a link of `rate` bytes
/// per second each way.
fn copies_of_at_least(
    g: &Graph,
    opts: &RematOptions,
    min_bytes: u64,
    rate: f64,
) -> Result<(Graph, Vec<RematChoice>), CompileError> {
    let l = liveness(g, opts.fusion);
    let peak = peak_of(&l);
    let (trips, found) = plan_trips(g, &l, opts, peak.peak_position, min_bytes, rate);
    if trips.is_empty() {
        return Ok((g.clone(), Vec::new()));
    }
    // The trips with shared stops where that holds the same peak, else as
    // planned (also where the shared stops cannot be written in order).
    // A plan the rewrite cannot write in order (a stop before its step's
    // inputs) moves nothing: the copies are an optimization, never a reason
    // for the step not to compile.
    let mut out = match rewrite(g, &trips) {
        Ok(o) => o,
        Err(e) => {
            tracing::debug!(error = %e, "host copies not written");
            return Ok((g.clone(), Vec::new()));
        }
    };
    let mut after = peak_of(&liveness(&out, opts.fusion));
    let shared = share_stops(&trips, peak.peak_position, &found);
    if let Ok(o) = rewrite(g, &shared) {
        let a = peak_of(&liveness(&o, opts.fusion));
        if a.peak_bytes <= after.peak_bytes {
            (out, after) = (o, a);
        }
    }
    tracing::debug!(
        trips = trips.len(),
        bytes = trips.iter().map(|t| t.bytes).sum::<u64>(),
        before = peak.peak_bytes,
        after = after.peak_bytes,
        "host copies around the peak"
    );
    if after.peak_bytes >= peak.peak_bytes {
        return Ok((g.clone(), Vec::new()));
    }
    let moved = trips.iter().map(|t| RematChoice::moved(g, t.value, t.bytes)).collect();
    Ok((out, moved))
}

/// A candidate before the link is priced.
struct Held {
    value: ValueId,
    bytes: u64,
    def: usize,
    last_early: usize,
    first_late: usize,
    late_users: Vec<NodeId>,
}

/// What [`plan_trips`] worked out about the plan, which [`share_stops`]
/// reads again.
struct Found {
    users: Vec<Vec<NodeId>>,
    /// Each node's position.
    pos: Vec<Option<usize>>,
    /// Which nodes depend on the peak kernel.
    from_peak: Vec<bool>,
    /// Which of those the next [`READ_SOON`] kernels read.
    read_soon: Vec<bool>,
    /// When each position's kernel ends.
    end: Vec<f64>,
}

/// The trips the link carries around the kernel at `at`.
fn plan_trips(
    g: &Graph,
    l: &Liveness,
    opts: &RematOptions,
    at: usize,
    min_bytes: u64,
    rate: f64,
) -> (Vec<Trip>, Found) {
    let start = kernel_starts(g, l, &opts.target);
    let users = users_of(g);
    let pos = l.positions();
    let outputs = g.outputs();
    let mut held = Vec::new();
    for b in &l.buffers {
        if b.kind != BufferKind::Temp || b.def >= at || b.last_use <= at || b.bytes < min_bytes {
            continue;
        }
        if outputs.contains(&b.value) || one_kernel_over_inputs(g, b.value) {
            continue;
        }
        if let Some(h) = held_value(g, l, &users, &pos, b.value, b.def, b.last_use, at) {
            held.push(h);
        }
    }
    let secs = |bytes: u64| bytes as f64 / rate;
    // Out: in write order, each after the last, all ending before the peak.
    held.sort_by_key(|h| (h.def, h.value));
    let mut link = 0.0f64;
    let mut out: Vec<(Held, f64)> = Vec::new();
    for h in held {
        let end = link.max(start[h.def + 1]) + secs(h.bytes);
        if end <= start[at] {
            link = end;
            out.push((h, end));
        }
    }
    // Back: latest first reader first, each ending by its reader and before
    // the next copy back begins, all beginning after the peak kernel ends.
    out.sort_by_key(|(h, _)| std::cmp::Reverse((h.first_late, h.value)));
    let mut free_from = f64::INFINITY;
    let mut trips = Vec::new();
    let from_peak = descendants(&users, l.order[at]);
    // The copy back starts after `a` and before `a`'s next reader (through a
    // barrier): an `a` whose value the next kernels read pins it there.
    let read_soon: Vec<bool> = (0..g.len())
        .map(|i| {
            from_peak[i]
                && pos[i].is_some_and(|p| {
                    users[i].iter().any(|u| l.exec_pos[u.index()].is_some_and(|q| q > p && q <= p + READ_SOON))
                })
        })
        .collect();
    for (h, out_end) in out {
        let begin = free_from.min(start[h.first_late]) - secs(h.bytes);
        if begin < start[at + 1] {
            continue;
        }
        // The kernels the steps wait for: the one the copy out is modelled
        // to end during (or the first after it that depends on the value,
        // before the peak), the last one ending by the copy back's begin
        // (after the peak), and the one before the first later reader. A wait
        // after the last kernel ending before the copy's end, as first built,
        // stalled XLA's stream for up to a kernel's time, and the model
        // counted the buffer free a kernel early: before the LM head's kernel
        // (2.7 ms by the model), a whole LM head early.
        let z = (h.last_early..at).find(|&p| start[p + 1] >= out_end).unwrap_or(at - 1);
        let a = (at..h.first_late).rev().find(|&p| start[p + 1] <= begin).unwrap_or(at);
        let w = h.first_late - 1;
        let from_value = descendants(&users, h.value.node);
        let (Some(z), Some(a), Some(w)) = (
            kernel_from(g, l, z, at - 1, &from_value).or_else(|| kernel_at(g, l, z, h.def, &from_value)),
            kernel_at(g, l, a, at, &read_soon),
            kernel_at(g, l, w, at, &from_peak),
        ) else {
            continue;
        };
        free_from = begin;
        trips.push(Trip {
            value: h.value,
            bytes: h.bytes,
            late_users: h.late_users,
            out_after: h.value.node,
            out_start: out_end - secs(h.bytes),
            in_end: begin + secs(h.bytes),
            out_done_after: z,
            in_after: a,
            in_done_after: w,
        });
    }
    trips.sort_by_key(|t| t.value);
    let end = start[1..].to_vec();
    (trips, Found { users, pos, from_peak, read_soon, end })
}

/// `trips` with their waits moved onto other trips' stops where that costs
/// little: each custom call cuts XLA's command buffers (CUDA graphs) there,
/// and on the H200 the 68 calls of 17 trips cost about 0.6 ms a step that way
/// (with command buffers off, the same plan ran 0.2 ms faster than greedy's,
/// where with them on it ran 0.4 ms slower; docs/memory-journal.md ("Host copies of kiln's own")). A copy out's end
/// moves to the first later copy out's start before the peak that depends on
/// the value (a little more memory held, no less overlap); a copy back's
/// start moves to the latest earlier copy back's end after the peak whose
/// kernel's value is read soon (an earlier start, the buffer a little sooner).
fn share_stops(trips: &[Trip], at: usize, found: &Found) -> Vec<Trip> {
    let Found { users, pos, from_peak, read_soon, end } = found;
    let at_pos = |n: NodeId| pos[n.index()].unwrap_or(0);
    let from_value: Vec<Vec<bool>> = trips.iter().map(|t| descendants(users, t.value.node)).collect();
    let mut starts: Vec<(usize, NodeId)> = trips.iter().map(|t| (at_pos(t.value.node), t.value.node)).collect();
    starts.sort();
    let mut ends: Vec<(usize, NodeId)> = trips.iter().map(|t| (at_pos(t.in_done_after), t.in_done_after)).collect();
    ends.sort();
    // First the copies out's starts, then their ends onto those starts, then
    // the copies back's starts onto their ends.
    let mut out: Vec<Trip> = trips
        .iter()
        .zip(&from_value)
        .map(|(t, from_value)| {
            let mut t = t.clone();
            // The latest later write that ends before the link is free for
            // this copy: starting there loses no time on the link.
            if let Some(&(_, n)) = starts
                .iter()
                .rev()
                .find(|&&(p, n)| p > at_pos(t.value.node) && end[p] <= t.out_start && from_value[n.index()])
            {
                t.out_after = n;
            }
            t
        })
        .collect();
    let mut issued: Vec<(usize, NodeId)> = out.iter().map(|t| (at_pos(t.out_after), t.out_after)).collect();
    issued.sort();
    issued.dedup();
    for (t, from_value) in out.iter_mut().zip(&from_value) {
        let z = at_pos(t.out_done_after);
        if let Some(&(_, n)) = issued.iter().find(|&&(p, n)| p >= z && p < at && from_value[n.index()]) {
            t.out_done_after = n;
        }
        let a = at_pos(t.in_after);
        if let Some(&(_, n)) = ends.iter().rev().find(|&&(p, n)| p <= a && p > at && read_soon[n.index()]) {
            t.in_after = n;
        }
    }
    // A copy back's end onto an earlier stop of the backward by which the
    // copy is modelled done.
    let mut back: Vec<(usize, NodeId)> =
        out.iter().flat_map(|t| [t.in_after, t.in_done_after]).map(|n| (at_pos(n), n)).collect();
    back.sort();
    back.dedup();
    for t in &mut out {
        let (a, w) = (at_pos(t.in_after), at_pos(t.in_done_after));
        if let Some(&(_, n)) =
            back.iter().find(|&&(p, n)| p >= a && p < w && end[p] >= t.in_end && from_peak[n.index()])
        {
            t.in_done_after = n;
        }
    }
    out
}

/// Whether `v` is one kernel's work over the step's inputs: a node whose
/// operands are parameters, constants or iotas, directly or through views
/// (a bf16 copy of a weight, an embedding lookup). Such a value is no
/// candidate for the link: recomputing it reads buffers that live the whole
/// step and takes microseconds, where its trips out and back take the link's
/// time from the activations. On the H200 the 50% gpt2-small plan sent ten
/// weight copies and both embedding lookups first, and XLA's stream waited
/// 0.18 ms a step in the third block for a copy behind them (docs/memory-journal.md,
/// "Host copies at a loose budget").
fn one_kernel_over_inputs(g: &Graph, v: ValueId) -> bool {
    fn input_or_view(g: &Graph, v: ValueId) -> bool {
        match &g.node(v.node).op {
            Op::Parameter { .. } | Op::Constant { .. } | Op::Iota { .. } => true,
            Op::Reshape { input, .. } | Op::Transpose { input, .. } | Op::BroadcastInDim { input, .. } => {
                input_or_view(g, *input)
            }
            _ => false,
        }
    }
    let op = &g.node(v.node).op;
    let ins = op.inputs();
    !ins.is_empty() && ins.iter().all(|&i| input_or_view(g, i))
}

/// `v` as a candidate, if every read of its buffer is a direct user's, none
/// runs at the peak `at`, some run before it and some after, and every
/// reader fused into a later kernel feeds later kernels only.
#[allow(clippy::too_many_arguments)]
fn held_value(
    g: &Graph,
    l: &Liveness,
    users: &[Vec<NodeId>],
    pos: &[Option<usize>],
    v: ValueId,
    def: usize,
    last_use: usize,
    at: usize,
) -> Option<Held> {
    l.buffer_of[v.node.index()].get(v.output as usize).copied().flatten()?;
    let (mut last_early, mut first_late, mut latest) = (def, usize::MAX, def);
    let mut late_users = Vec::new();
    for &u in &users[v.node.index()] {
        if !g.node(u).op.inputs().contains(&v) {
            continue;
        }
        // A reader that hands the buffer on (a barrier, a view) reads it
        // where its own readers do.
        let (first, run) = read_span(g, l, users, u, v)?;
        latest = latest.max(run);
        if run < at {
            last_early = last_early.max(run);
        } else if first > at {
            if !l.materialized[u.index()] && !feeds_only_after(l, users, pos, u, at) {
                return None;
            }
            first_late = first_late.min(first);
            late_users.push(u);
        } else {
            // Read at the peak, or before and after it through a barrier.
            return None;
        }
    }
    // (A last reader that writes its result over the buffer ends it a
    // position early.)
    if late_users.is_empty() || last_use > latest || first_late <= at + 1 {
        return None;
    }
    let bytes = g.ty(v).size_in_bytes() as u64;
    Some(Held { value: v, bytes, def, last_early, first_late, late_users })
}

/// The first and last positions at which node `u` reads `v`'s buffer: its
/// own, and through a barrier or a view it hands the buffer on to, its
/// readers' (`None`: a reader that never runs).
fn read_span(g: &Graph, l: &Liveness, users: &[Vec<NodeId>], u: NodeId, v: ValueId) -> Option<(usize, usize)> {
    let own = l.exec_pos[u.index()]?;
    let mut span = (own, own);
    if !l.materialized[u.index()] {
        // Fused into its readers' kernels (one or several): read where the
        // first of them runs.
        let mut stack = vec![u];
        let mut seen = vec![u];
        while let Some(x) = stack.pop() {
            for &y in &users[x.index()] {
                if seen.contains(&y) {
                    continue;
                }
                seen.push(y);
                match (l.materialized[y.index()], l.exec_pos[y.index()]) {
                    (true, Some(p)) => span.0 = span.0.min(p),
                    (false, Some(_)) => stack.push(y),
                    (_, None) => {}
                }
            }
        }
        return Some(span);
    }
    let handed: Vec<ValueId> = match &g.node(u).op {
        Op::OptimizationBarrier { inputs } => {
            (0..inputs.len()).filter(|&k| inputs[k] == v).map(|k| ValueId::new(u, k as u32)).collect()
        }
        Op::Reshape { .. } | Op::Whole { .. } => vec![ValueId::new(u, 0)],
        Op::Place { .. } | Op::HostCopy { .. } => return None,
        _ => Vec::new(),
    };
    for out in handed {
        for &y in &users[u.index()] {
            if g.node(y).op.inputs().contains(&out) {
                let (a, b) = read_span(g, l, users, y, out)?;
                span = (span.0.min(a), span.1.max(b));
            }
        }
    }
    Some(span)
}

/// Whether every kernel the fused node `u` ends up in runs after `at`.
fn feeds_only_after(l: &Liveness, users: &[Vec<NodeId>], pos: &[Option<usize>], u: NodeId, at: usize) -> bool {
    let mut stack = vec![u];
    let mut seen = vec![u];
    while let Some(x) = stack.pop() {
        if pos[x.index()].is_none() {
            continue;
        }
        if l.materialized[x.index()] {
            if l.exec_pos[x.index()].is_none_or(|p| p <= at) {
                return false;
            }
            continue;
        }
        for &y in &users[x.index()] {
            if !seen.contains(&y) {
                seen.push(y);
                stack.push(y);
            }
        }
    }
    true
}

/// The node of the last kernel at or before position `p` and at or after
/// position `floor` (a materialized node that runs: not a parameter or a
/// constant) that `after` marks, if any.
///
/// A step waits for such a kernel so that XLA cannot run the step early, and
/// XLA may run a kernel as early as its operands allow: a weight's cast, say,
/// at the program's start. So the kernels waited for are ones that depend on
/// the moved value (for the end of the copy out) or on the peak kernel (for
/// the copy back), which no schedule can run before those.
fn kernel_at(g: &Graph, l: &Liveness, p: usize, floor: usize, after: &[bool]) -> Option<NodeId> {
    (floor..=p.min(l.order.len().saturating_sub(1))).rev().map(|q| l.order[q]).find(|&id| waitable(g, l, after, id))
}

/// The node of the first kernel at or after position `p` and at or before
/// position `ceil` that `after` marks, if any ([`kernel_at`]'s kind).
fn kernel_from(g: &Graph, l: &Liveness, p: usize, ceil: usize, after: &[bool]) -> Option<NodeId> {
    (p..=ceil.min(l.order.len().saturating_sub(1))).map(|q| l.order[q]).find(|&id| waitable(g, l, after, id))
}

/// Whether a step may wait for `id`: a kernel (a materialized node that runs,
/// not a parameter or a constant) that `after` marks.
fn waitable(g: &Graph, l: &Liveness, after: &[bool], id: NodeId) -> bool {
    after[id.index()]
        && l.materialized[id.index()]
        && l.exec_pos[id.index()].is_some()
        && !matches!(g.node(id).op, Op::Parameter { .. } | Op::Constant { .. })
}

/// Which nodes depend on `from` (itself included).
fn descendants(users: &[Vec<NodeId>], from: NodeId) -> Vec<bool> {
    let mut seen = vec![false; users.len()];
    seen[from.index()] = true;
    // Users always come later in insertion order, so one pass in order does.
    for i in from.index()..users.len() {
        if seen[i] {
            for u in &users[i] {
                seen[u.index()] = true;
            }
        }
    }
    seen
}

/// `g` with each trip's steps (see the module docs).
fn rewrite(g: &Graph, trips: &[Trip]) -> Result<Graph, CompileError> {
    let mut out = Graph::new();
    let mut map: Vec<Option<NodeId>> = vec![None; g.len()];
    // Later readers of a value read its pass-through (old value -> new value).
    let mut passed: HashMap<ValueId, ValueId> = HashMap::new();
    // Per trip: its token after `out` (through the barrier), after `out_done`,
    // the copy back through its barrier, and the value after `in_done`.
    let mut token: Vec<Option<ValueId>> = vec![None; trips.len()];
    let mut done: Vec<Option<ValueId>> = vec![None; trips.len()];
    let mut back: Vec<Option<ValueId>> = vec![None; trips.len()];
    let mut arrived: Vec<Option<ValueId>> = vec![None; trips.len()];
    let late_of: HashMap<(NodeId, ValueId), usize> =
        trips.iter().enumerate().flat_map(|(k, t)| t.late_users.iter().map(move |&u| ((u, t.value), k))).collect();
    let mut pending: Vec<NodeId> = Vec::new();
    let remap = |map: &[Option<NodeId>], passed: &HashMap<ValueId, ValueId>, v: ValueId| -> Option<ValueId> {
        passed.get(&v).copied().or_else(|| map[v.node.index()].map(|n| ValueId::new(n, v.output)))
    };
    let fail = |reason: String| CompileError::Remat { strategy: "host-copy", reason };
    // Whether node `id` can be added now: every operand is, and every moved
    // value it reads late has arrived.
    let ready = |id: NodeId, map: &[Option<NodeId>], arrived: &[Option<ValueId>]| {
        g.node(id).op.inputs().iter().all(|&v| match late_of.get(&(id, v)) {
            Some(&k) => arrived[k].is_some(),
            None => map[v.node.index()].is_some(),
        })
    };
    let mut queue: Vec<NodeId> = g.nodes().map(|(id, _)| id).collect();
    queue.reverse();
    while let Some(id) = queue.pop() {
        if !ready(id, &map, &arrived) {
            pending.push(id);
            continue;
        }
        let mut op = g.node(id).op.clone();
        let mut missing = false;
        op.map_inputs(|v| match late_of.get(&(id, v)) {
            Some(&k) => arrived[k].unwrap_or(v),
            None => remap(&map, &passed, v).unwrap_or_else(|| {
                missing = true;
                v
            }),
        });
        if missing {
            return Err(fail(format!("{id:?} reads a value not yet written")));
        }
        map[id.index()] = Some(out.add(op)?);
        let here = |n: NodeId| ValueId::new(n, 0);
        for (k, t) in trips.iter().enumerate() {
            let slot = k as u32;
            let ty = g.ty(t.value).clone();
            if t.out_after == id {
                let v = remap(&map, &passed, t.value).ok_or_else(|| fail("a moved value vanished".into()))?;
                let o = out.value(Op::HostCopy { inputs: vec![v], step: HostCopyStep::Out, slot, ty: ty.clone() })?;
                let tied = out.add(Op::OptimizationBarrier { inputs: vec![o, v] })?;
                token[k] = Some(ValueId::new(tied, 0));
                passed.insert(t.value, ValueId::new(tied, 1));
            }
            if t.out_done_after == id {
                let (Some(tok), Some(v), Some(z)) =
                    (token[k], remap(&map, &passed, t.value), remap(&map, &passed, here(id)))
                else {
                    return Err(fail(format!("slot {slot}: the copy out would end before it starts")));
                };
                done[k] = Some(out.value(Op::HostCopy {
                    inputs: vec![v, tok, z],
                    step: HostCopyStep::OutDone,
                    slot,
                    ty: ty.clone(),
                })?);
            }
            if t.in_after == id {
                let (Some(d), Some(a)) = (done[k], remap(&map, &passed, here(id))) else {
                    return Err(fail(format!("slot {slot}: the copy back would start before the copy out ends")));
                };
                let b = out.value(Op::HostCopy { inputs: vec![d, a], step: HostCopyStep::In, slot, ty: ty.clone() })?;
                let tied = out.add(Op::OptimizationBarrier { inputs: vec![b, a] })?;
                back[k] = Some(ValueId::new(tied, 0));
                passed.insert(here(id), ValueId::new(tied, 1));
            }
            if t.in_done_after == id {
                let (Some(b), Some(w)) = (back[k], remap(&map, &passed, here(id))) else {
                    return Err(fail(format!("slot {slot}: the copy back would end before it starts")));
                };
                arrived[k] =
                    Some(out.value(Op::HostCopy { inputs: vec![b, w], step: HostCopyStep::InDone, slot, ty })?);
            }
        }
        // Readers held back for a copy back may be added now.
        if !pending.is_empty() {
            let mut again = std::mem::take(&mut pending);
            again.reverse();
            queue.extend(again);
        }
    }
    if let Some(id) = pending.first() {
        return Err(fail(format!("{id:?} reads a moved value that never comes back")));
    }
    let outputs = g
        .outputs()
        .iter()
        .map(|&v| remap(&map, &passed, v).ok_or_else(|| fail("an output was never written".into())))
        .collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(outputs)?;
    for &a in g.aliases() {
        out.add_alias(a)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
