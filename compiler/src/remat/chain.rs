//! The mechanism of rematerialization: which values are candidates (read
//! early and again late, across an idle stretch), the chain of producers a
//! candidate's clone needs, its fence (the barrier and the runtime guards of
//! [`crate::fence`]), and the rewrite that places the clones before the late
//! readers. Strategies choose; this module only answers and rewrites.
//!
//! Invariant: a rewrite computes the same values (see the module docs of
//! [`super`]).

use crate::analysis::{kernel_time, liveness, users_of, BufferKind, Liveness};
use crate::cost;
use crate::ir::{Graph, NodeId, Op, ValueId};
use crate::CompileError;

use super::plan::{LeafGuards, RecomputeCost, RematChoice, RematOptions};

/// A value that can be recomputed for its late users.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    pub(crate) value: ValueId,
    /// Other values whose buffers the chain frees ([`RematChoice::also`]).
    pub(crate) also: Vec<ValueId>,
    /// Bytes of the buffers freed.
    pub(crate) bytes: u64,
    /// Position after which no early user reads it.
    pub(crate) early_end: usize,
    /// The first late user (the clones go just before it) and its position.
    pub(crate) late_node: NodeId,
    pub(crate) late_pos: usize,
    /// Nodes to clone, in insertion order; the last one produces `value`.
    pub(crate) chain: Vec<NodeId>,
    /// Values the chain reads from memory, fenced by the barrier but for
    /// `unfenced`.
    pub(crate) leaves: Vec<ValueId>,
    /// The leaves computed from gathered parameters alone
    /// ([`RematOptions::gathered_params`]), read where they are.
    pub(crate) unfenced: Vec<ValueId>,
    /// A value of the late region that the barrier waits for.
    pub(crate) anchor: Option<ValueId>,
    pub(crate) flops: u64,
    pub(crate) seconds: f64,
}

impl Candidate {
    pub(crate) fn choice(&self, g: &Graph) -> RematChoice {
        RematChoice {
            value: self.value,
            also: self.also.clone(),
            op: g.node(self.value.node).op.name(),
            bytes: self.bytes,
            recomputed_nodes: self.chain.len(),
            flops: self.flops,
        }
    }
}

/// Whether a node may be cloned: same inputs give the same outputs. The
/// forward composites (attention, layer norm, the LM head's loss) are
/// deterministic and are cloned whole with every output (attention's
/// statistics, layer norm's mean and rstd): recomputing a transformer block
/// means recomputing them, and their price is the cost model's. Their
/// backward counterparts only ever run once, late; random-bit generators
/// would draw again.
pub(crate) fn clonable(op: &Op) -> bool {
    op.props().clonable
}

/// Where the backward starts in `l`'s order: the first late read of any
/// candidate (in a training step, the first backward kernel that reads a
/// forward value).
pub(crate) fn first_backward_read(g: &Graph, l: &Liveness, opts: &RematOptions) -> Option<usize> {
    candidates(g, l, opts).iter().map(|c| c.late_pos).min()
}

/// Whether `g` keeps any value for a reader well after its writer that remat
/// could recompute (a training step's backward reading the forward's values).
/// A program without a backward (an evaluation, the parameters' init) keeps
/// none: a budget in a share of its activation memory has nothing to act on.
pub fn keeps_values_for_later(g: &Graph, opts: &RematOptions) -> bool {
    first_backward_read(g, &liveness(g, opts.fusion), opts).is_some()
}

pub(crate) fn candidates(g: &Graph, l: &Liveness, opts: &RematOptions) -> Vec<Candidate> {
    let users = users_of(g);
    let pos = l.positions();
    let weights = gathered_weights(g, &opts.gathered_params);
    let mut out = Vec::new();
    for b in &l.buffers {
        if b.kind != BufferKind::Temp {
            continue;
        }
        let v = b.value;
        if let Some(only) = opts.only {
            if !only.contains(&v) {
                continue;
            }
        }
        let node = g.node(v.node);
        if !clonable(&node.op) || matches!(node.op, Op::Constant { .. } | Op::Iota { .. }) || fixed(g, &weights, v.node)
        {
            continue;
        }
        // Kernels that read the buffer, directly or through fused nodes and
        // reshapes (views): `views` are those intermediaries.
        let (mut kernels, views) = readers(g, l, &users, v.node);
        kernels.sort_by_key(|&(p, _)| p);
        if kernels.len() < 2 {
            continue;
        }
        let mut best: Option<(usize, usize, usize)> = None; // (gap, split, early_end)
        for k in 1..kernels.len() {
            let early_end = kernels[k - 1].0.max(b.def);
            let late = kernels[k].0;
            if late > early_end + 1 {
                let gap = late - early_end;
                if best.is_none_or(|(g0, _, _)| gap > g0) {
                    best = Some((gap, k, early_end));
                }
            }
        }
        let Some((_, split, early_end)) = best else { continue };
        let (late_pos, late_node) = kernels[split];
        let Some((mut chain, leaves)) = chain_for(g, l, &weights, v, late_pos, opts.max_chain_nodes) else { continue };
        let unfenced = unfenced(&leaves, &weights);
        // Views placed before the late point that a late node reads (directly
        // or through other such views) are cloned too, for the late kernels.
        let mut early_views: Vec<NodeId> =
            views.into_iter().filter(|n| pos[n.index()].is_some_and(|p| p < late_pos)).collect();
        early_views.sort_by(|a, b| b.cmp(a));
        let mut view_clones: Vec<NodeId> = Vec::new();
        for &w in &early_views {
            let needed = users[w.index()]
                .iter()
                .any(|u| pos[u.index()].is_some_and(|p| p >= late_pos) || view_clones.contains(u));
            if needed {
                view_clones.push(w);
            }
        }
        // The anchor must be a buffer of its own outside the chain: fencing a
        // fused value would make it a kernel that reads the chain's originals.
        // The late kernel often reads its other operand through a view or a
        // fused producer (a reshaped or transposed cotangent), so those are
        // looked through to the buffers the late kernel reads.
        let anchor = anchor_for(g, l, late_node, late_pos, early_end, &chain, &view_clones);
        // Without a fenced leaf and an anchor nothing stops XLA's CSE from
        // merging the clones back (constant-only chains such as masks).
        if leaves.len() == unfenced.len() || anchor.is_none() {
            continue;
        }
        // Recompute time, as `opts.cost` prices a chain.
        let (flops, seconds) = recompute_cost(g, &chain, &leaves, b.bytes, opts);
        chain.extend(view_clones);
        chain.sort();
        chain.dedup();
        out.push(Candidate {
            value: v,
            also: Vec::new(),
            bytes: b.bytes,
            early_end,
            late_node,
            late_pos,
            chain,
            leaves,
            unfenced,
            anchor,
            flops,
            seconds,
        });
    }
    out
}

/// FLOPs and roofline seconds of recomputing `chain`, which reads `leaves`
/// and yields a buffer of `bytes`. [`RecomputeCost::Arithmetic`]:
/// loop-fusible ops fuse into the kernel that reads them and add only their
/// arithmetic; the others (dots, reductions, gathers) pay the slower of
/// arithmetic and memory. [`RecomputeCost::Kernels`]: the chain as one
/// kernel, the slower of its arithmetic and its traffic (the leaves read,
/// the value written) at the rates the kernel model achieves
/// ([`kernel_time`]): greedy's order before it measures kernel time.
pub(crate) fn recompute_cost(
    g: &Graph,
    chain: &[NodeId],
    leaves: &[ValueId],
    bytes: u64,
    opts: &RematOptions,
) -> (u64, f64) {
    // One pass: the FLOPs, the arithmetic roofline and the kernel model's
    // achieved compute time of the chain.
    let (flops, roofline, compute) = chain.iter().fold((0u64, 0.0f64, 0.0f64), |(f, s, a), &n| {
        let c = cost::node_cost(g, n);
        let peak = c.flops as f64 / opts.target.peak_flops_per_s(c.peak);
        let t = if crate::analysis::loop_fusible(&g.node(n).op) {
            peak
        } else {
            peak.max(c.bytes() as f64 / opts.target.mem_bytes_per_s)
        };
        (f.saturating_add(c.flops), s + t, a + kernel_time::achieved_compute_seconds(&g.node(n).op, &c, &opts.target))
    });
    match opts.cost {
        RecomputeCost::Arithmetic => (flops, roofline),
        RecomputeCost::Kernels => {
            let read: u64 = leaves.iter().map(|&v| g.ty(v).size_in_bytes() as u64).sum();
            (flops, compute.max(kernel_time::traffic_seconds(read.saturating_add(bytes), &opts.target)))
        }
    }
}

/// A buffer the kernel `late` reads (directly, or through fused producers and
/// reshapes), written after `early_end` and outside the nodes to clone: the
/// latest such one.
pub(crate) fn anchor_for(
    g: &Graph,
    l: &Liveness,
    late: NodeId,
    late_pos: usize,
    early_end: usize,
    chain: &[NodeId],
    view_clones: &[NodeId],
) -> Option<ValueId> {
    let mut best: Option<ValueId> = None;
    let mut stack = g.node(late).op.inputs();
    let mut seen: Vec<NodeId> = Vec::new();
    while let Some(a) = stack.pop() {
        if chain.contains(&a.node) || seen.contains(&a.node) {
            continue;
        }
        seen.push(a.node);
        let i = a.node.index();
        // The value's fused readers are cloned with the chain, but what else
        // they read is the late region's: GELU's derivative reads the
        // recomputed `tanh` and, through them, the cotangent. Waiting for the
        // cotangent keeps the clones in the kernel XLA fuses the derivative
        // into (docs/memory-journal.md, "One pass over a recomputed leaf").
        let view = !l.materialized[i] || matches!(g.node(a.node).op, Op::Reshape { .. } | Op::Whole { .. });
        if view {
            stack.extend(g.node(a.node).op.inputs());
        } else if l.exec_pos[i].is_some_and(|p| p > early_end)
            && best.is_none_or(|b| l.exec_pos[b.node.index()] < l.exec_pos[i])
        {
            best = Some(a);
        }
    }
    if best.is_some() {
        return best;
    }
    // A late kernel that reads nothing else of the late region (a derivative
    // factor computed from the activation alone): the barrier waits for the
    // latest buffer written in the gap instead, one still live at the late
    // kernel if there is one (no buffer's life is then extended); the peak
    // model judges the plan with whatever extension remains.
    let outside = |b: &&crate::analysis::Buffer| {
        b.def > early_end
            && b.def < late_pos
            && matches!(b.kind, BufferKind::Temp | BufferKind::Output | BufferKind::Donated)
            && !chain.contains(&b.value.node)
            && !view_clones.contains(&b.value.node)
    };
    let latest = |live_at_late: bool| {
        l.buffers.iter().filter(outside).filter(|b| !live_at_late || b.last_use >= late_pos).max_by_key(|b| b.def)
    };
    latest(true).or_else(|| latest(false)).map(|b| b.value)
}

/// The kernels reading node `n`'s buffer as `(position, node)`, following
/// fused users and reshapes, and those fused users and reshapes.
pub(crate) fn readers(
    g: &Graph,
    l: &Liveness,
    users: &[Vec<NodeId>],
    n: NodeId,
) -> (Vec<(usize, NodeId)>, Vec<NodeId>) {
    let mut kernels = Vec::new();
    let mut views = Vec::new();
    let mut stack = vec![n];
    while let Some(x) = stack.pop() {
        for &u in &users[x.index()] {
            let Some(p) = l.exec_pos[u.index()] else { continue };
            let view = !l.materialized[u.index()] || matches!(g.node(u).op, Op::Reshape { .. } | Op::Whole { .. });
            if view {
                if !views.contains(&u) {
                    views.push(u);
                    stack.push(u);
                }
            } else if !kernels.iter().any(|&(_, k)| k == u) {
                kernels.push((p, u));
            }
        }
    }
    (kernels, views)
}

/// The nodes to clone to recompute `v` at position `at`, and the values they
/// read from memory; `None` when the chain would exceed `max_nodes`.
fn chain_for(
    g: &Graph,
    l: &Liveness,
    weights: &[bool],
    v: ValueId,
    at: usize,
    max_nodes: usize,
) -> Option<(Vec<NodeId>, Vec<ValueId>)> {
    clone_closure(g, vec![v.node], weights, max_nodes, |u| {
        Some(match l.buffer_of[u.node.index()][u.output as usize] {
            Some(b) => {
                let b = &l.buffers[b];
                b.value != v && b.def < at && b.last_use >= at
            }
            None => false,
        })
    })
}

/// What recomputing `roots` takes: walking back through operands, a value
/// is a leaf (read, not cloned) when its producer may not be cloned, when it
/// is [`fixed`] by `weights` ([`gathered_weights`]) or when `kept` says it is in
/// memory at the recomputation (constants and iotas excepted: cloning them
/// is free); every other producer is cloned too. The nodes to clone, roots
/// included, and the leaves, each sorted; `None` when the clones would
/// exceed `max_nodes` or `kept` answers `None`.
pub(crate) fn clone_closure(
    g: &Graph,
    roots: Vec<NodeId>,
    weights: &[bool],
    max_nodes: usize,
    mut kept: impl FnMut(ValueId) -> Option<bool>,
) -> Option<(Vec<NodeId>, Vec<ValueId>)> {
    let mut chain = roots.clone();
    let mut leaves = Vec::new();
    let mut stack = roots;
    while let Some(n) = stack.pop() {
        for u in g.node(n).op.inputs() {
            if chain.contains(&u.node) || leaves.contains(&u) {
                continue;
            }
            let un = g.node(u.node);
            let is_leaf = !clonable(&un.op)
                || fixed(g, weights, u.node)
                || (kept(u)? && !matches!(un.op, Op::Constant { .. } | Op::Iota { .. }));
            if is_leaf {
                leaves.push(u);
            } else {
                if chain.len() >= max_nodes {
                    return None;
                }
                chain.push(u.node);
                stack.push(u.node);
            }
        }
    }
    chain.sort();
    leaves.sort();
    Some((chain, leaves))
}

/// Per node of `g`, whether it computes from the gathered parameters
/// `params` alone ([`RematOptions::gathered_params`]): such a parameter, or a
/// clonable node that reads such values (one at least), constants and iotas.
pub(crate) fn gathered_weights(g: &Graph, params: &[u32]) -> Vec<bool> {
    let mut out = vec![false; g.len()];
    if params.is_empty() {
        return out;
    }
    let free = |n: NodeId| matches!(g.node(n).op, Op::Constant { .. } | Op::Iota { .. });
    for (id, node) in g.nodes() {
        out[id.index()] = match &node.op {
            Op::Parameter { index, .. } => params.contains(index),
            op if clonable(op) && !free(id) => {
                let inputs = op.inputs();
                inputs.iter().any(|u| out[u.node.index()]) && inputs.iter().all(|u| out[u.node.index()] || free(u.node))
            }
            _ => false,
        };
    }
    out
}

/// Whether node `n` is never recomputed where `weights` marks the gathered
/// weights ([`gathered_weights`]): a gathered weight, or rows picked from one
/// (an embedding's lookup). XLA's SPMD partitioner does not gather a table
/// for a lookup: it gathers every device's ids, picks the rows of its share
/// of the table for the whole batch, and reduce-scatters the result. A
/// recomputed lookup pays that again (`docs/memory.md`, "Remat under FSDP
/// reads the gathered weights").
pub(crate) fn fixed(g: &Graph, weights: &[bool], n: NodeId) -> bool {
    weights[n.index()] || matches!(g.node(n).op, Op::Gather { operand, .. } if weights[operand.node.index()])
}

/// The leaves of a chain that `weights` marks: read where they are.
pub(crate) fn unfenced(leaves: &[ValueId], weights: &[bool]) -> Vec<ValueId> {
    leaves.iter().copied().filter(|u| weights[u.node.index()]).collect()
}

/// `g` with `c`'s chain cloned before its first late user and every user at
/// or after that point reading the clone, its leaves read through the barrier
/// (and the runtime guard on the leaves `guard_leaves` picks); also the node
/// map old -> new.
pub(crate) fn rewrite(
    g: &Graph,
    c: &Candidate,
    guard_leaves: LeafGuards,
) -> Result<(Graph, Vec<NodeId>), CompileError> {
    // The clones, the barrier and the guards' few nodes besides g's.
    let mut out = Graph::with_capacity_of(g, c.chain.len() + c.leaves.len() + 4);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.len());
    // Original chain node -> its clone, once the late point is reached.
    let mut clones: Vec<(NodeId, NodeId)> = Vec::new();
    // The anchor and the barrier's pass-through of it that later readers
    // read ([`LeafGuards::PassAnchor`]).
    let mut passed: Option<(ValueId, ValueId)> = None;
    let remap = |map: &[NodeId], v: ValueId| ValueId::new(map[v.node.index()], v.output);
    // The leaves behind the barrier; the unfenced ones are read where they
    // are, as the clones' other operands.
    let leaves: Vec<ValueId> = c.leaves.iter().copied().filter(|u| !c.unfenced.contains(u)).collect();
    for (id, node) in g.nodes() {
        if id == c.late_node {
            let mut fenced: Vec<ValueId> = leaves.iter().map(|&u| remap(&map, u)).collect();
            let n_leaves = fenced.len();
            if let Some(a) = c.anchor {
                fenced.push(remap(&map, a));
            }
            let barrier = if n_leaves > 0 { Some(out.add(Op::OptimizationBarrier { inputs: fenced })?) } else { None };
            // A passed anchor holds the clones back only if something from
            // here on reads it; otherwise the chain's entries are guarded.
            let pass = match (guard_leaves, barrier, c.anchor) {
                (LeafGuards::PassAnchor, Some(b), Some(a))
                    if g.users(a.node).iter().any(|&u| u >= id && g.node(u).op.inputs().contains(&a)) =>
                {
                    Some((a, ValueId::new(b, n_leaves as u32)))
                }
                _ => None,
            };
            let guard_leaves = match guard_leaves {
                LeafGuards::PassAnchor if pass.is_none() => LeafGuards::Entries,
                other => other,
            };
            passed = pass;
            // The runtime guard (see the module docs): the fenced leaves to
            // guard are read through `select(always, leaf, 0)`, `always`
            // computed from the anchor.
            let to_guard: Vec<bool> = match guard_leaves {
                LeafGuards::Every => vec![true; n_leaves],
                LeafGuards::Off | LeafGuards::PassAnchor => vec![false; n_leaves],
                LeafGuards::Entries => {
                    let mut pick = vec![false; n_leaves];
                    for &n in &c.chain {
                        let inputs = g.node(n).op.inputs();
                        if inputs.iter().any(|u| c.chain.contains(&u.node)) {
                            continue;
                        }
                        let smallest = inputs
                            .iter()
                            .filter_map(|u| leaves.iter().position(|x| x == u))
                            .min_by_key(|&k| g.ty(leaves[k]).size_in_bytes());
                        if let Some(k) = smallest {
                            pick[k] = true;
                        }
                    }
                    pick
                }
            };
            let guard = match (barrier, c.anchor) {
                (Some(b), Some(_)) if to_guard.contains(&true) => {
                    Some(crate::fence::always_true(&mut out, ValueId::new(b, n_leaves as u32))?)
                }
                _ => None,
            };
            let mut guarded: Vec<ValueId> = Vec::with_capacity(n_leaves);
            if let Some(b) = barrier {
                for (k, &wanted) in to_guard.iter().enumerate() {
                    let leaf = ValueId::new(b, k as u32);
                    guarded.push(match guard {
                        Some(p) if wanted => crate::fence::read_through(&mut out, p, leaf)?,
                        _ => leaf,
                    });
                }
            }
            for &n in &c.chain {
                let mut op = g.node(n).op.clone();
                op.map_inputs(|u| {
                    if let Some(k) = leaves.iter().position(|&x| x == u) {
                        guarded[k]
                    } else if let Some(&(_, cn)) = clones.iter().find(|(o, _)| *o == u.node) {
                        ValueId::new(cn, u.output)
                    } else {
                        // A view's other operands and the unfenced leaves
                        // are read where they are.
                        remap(&map, u)
                    }
                });
                clones.push((n, out.add_copy(op, &g.node(n).outputs)?));
            }
        }
        let mut op = node.op.clone();
        op.map_inputs(|u| match (clones.iter().find(|(o, _)| *o == u.node), passed) {
            (Some(&(_, cn)), _) => ValueId::new(cn, u.output),
            (None, Some((a, through))) if a == u => through,
            (None, _) => remap(&map, u),
        });
        map.push(out.add_copy(op, &node.outputs)?);
    }
    out.set_outputs(g.outputs().iter().map(|&v| remap(&map, v)).collect())?;
    out.copy_aliases(g)?;
    Ok((out, map))
}
