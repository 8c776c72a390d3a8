//! Buffers of a step graph and the interval each is live, in execution order.
//!
//! Invariants:
//! - Positions are indices into `order` (the live nodes in insertion order);
//!   a buffer is live at position `i` when `def <= i <= last_use`: the kernel
//!   that writes it and the last kernel that reads it both hold it.
//! - A value without a buffer (fused into its users) makes its reads where
//!   its users execute, so the operands it reads stay live until then.
//! - Arguments live for the whole program, outputs from their definition to
//!   the end (in the curves; XLA's allocation of an output that is not
//!   donated spans the whole run, which `Liveness::allocation` counts),
//!   constants are XLA's read-only allocations (neither temp nor
//!   argument), temps from definition to last use, an output written into a
//!   donated argument's buffer (`Graph::aliases`) in no curve (the argument
//!   holds its bytes), a kernel's scratch
//!   (workspace) at that kernel's position only, values placed in pinned
//!   host memory (`place pinned_host`) in no device curve.

use smallvec::{smallvec, SmallVec};

use crate::ir::{Graph, HostCopyStep, MemorySpace, NodeId, Op, ValueId};

use super::Materialization;

/// What a buffer holds, which decides how long it lives and whom XLA bills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferKind {
    Argument,
    Constant,
    Output,
    /// An output written into the buffer of the argument donated to it
    /// (`Graph::aliases`): the argument already holds its bytes, so it is in
    /// no curve; XLA counts it in the output size and the alias size.
    Donated,
    Temp,
    /// A kernel's workspace (cuBLAS's, cuDNN's): live only while that
    /// kernel runs, holds no value (`value` names the kernel's node), and is
    /// in no `buffer_of` entry.
    Scratch,
    /// A value in pinned host memory (`place pinned_host`): in no device
    /// curve.
    Host,
}

/// One allocation: a materialized value and the values that alias it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    /// The value whose kernel writes the buffer.
    pub value: ValueId,
    pub bytes: u64,
    pub kind: BufferKind,
    /// Position of the kernel that writes it.
    pub def: usize,
    /// Position of the last kernel that reads it (`def` when nothing does).
    pub last_use: usize,
}

/// Buffers of a graph in one execution order.
#[derive(Clone, Debug)]
pub struct Liveness {
    /// The execution order: live nodes in insertion order.
    pub order: Vec<NodeId>,
    /// Position at which each node's work runs (`None` for dead nodes). A
    /// fused node runs inside its last consumer's kernel.
    pub exec_pos: Vec<Option<usize>>,
    /// Whether each node's work is a kernel of its own (false: fused into its
    /// users, or dead).
    pub materialized: Vec<bool>,
    /// `buffer_of[node][output]`: the buffer holding that value, if any.
    pub buffer_of: Vec<SmallVec<[Option<usize>; 1]>>,
    pub buffers: Vec<Buffer>,
}

impl Liveness {
    /// Each node's position in `order` (`None` for dead nodes), indexed by
    /// node.
    pub fn positions(&self) -> Vec<Option<usize>> {
        let mut pos = vec![None; self.exec_pos.len()];
        for (p, id) in self.order.iter().enumerate() {
            pos[id.index()] = Some(p);
        }
        pos
    }

    /// Bytes of temporaries live at each position.
    pub fn temp_curve(&self) -> Vec<u64> {
        self.curve(|_, b| is_temp(b).then_some((b.def, b.last_use)))
    }

    /// Bytes of outputs already written at each position.
    pub fn output_curve(&self) -> Vec<u64> {
        let end = self.order.len().saturating_sub(1);
        self.curve(|_, b| (b.kind == BufferKind::Output).then_some((b.def, end)))
    }

    /// What XLA allocates for the step, as its compiled memory stats count
    /// it. XLA gives every output that is not donated an allocation of its
    /// own for the whole run, and places temporaries in those allocations
    /// before the outputs are written (`packed_into_outputs`); the rest of
    /// the temporaries share its temp allocation.
    pub fn allocation(&self) -> Allocation {
        let packed = self.packed_into_outputs();
        let temp_bytes =
            self.curve(|k, b| (is_temp(b) && !packed[k]).then_some((b.def, b.last_use))).into_iter().max().unwrap_or(0);
        let held = |b: &Buffer| matches!(b.kind, BufferKind::Argument | BufferKind::Constant | BufferKind::Output);
        let fixed: u64 = self.buffers.iter().filter(|b| held(b)).map(|b| b.bytes).sum();
        Allocation { temp_bytes, total_bytes: fixed + temp_bytes }
    }

    /// Which buffers XLA places in the allocation of an output that is not
    /// donated, indexed like `buffers`: temporaries largest first, each in
    /// the smallest output allocation at least its size that is free for its
    /// whole life (before the output is written, and clear of the
    /// temporaries already placed there). XLA's buffer assignment does this
    /// before it packs the rest into its temp allocation; on the CPU plugin's
    /// steps, whose outputs are not donated, it is what their figures show
    /// (`the_peak_model_predicts_xla_memory_within_15_percent`).
    pub fn packed_into_outputs(&self) -> Vec<bool> {
        /// An output's allocation: its size, where the output is written,
        /// and the lives of the temporaries placed in it so far.
        struct Slot {
            bytes: u64,
            written: usize,
            lives: Vec<(usize, usize)>,
        }
        let mut packed = vec![false; self.buffers.len()];
        let mut slots: Vec<Slot> = self
            .buffers
            .iter()
            .filter(|b| b.kind == BufferKind::Output)
            .map(|b| Slot { bytes: b.bytes, written: b.def, lives: Vec::new() })
            .collect();
        let Some(largest) = slots.iter().map(|s| s.bytes).max() else { return packed };
        slots.sort_by_key(|s| (s.bytes, s.written));
        let mut temps: Vec<usize> = (0..self.buffers.len())
            .filter(|&k| is_temp(&self.buffers[k]) && self.buffers[k].bytes <= largest)
            .collect();
        temps.sort_by_key(|&k| (std::cmp::Reverse(self.buffers[k].bytes), self.buffers[k].def, k));
        for k in temps {
            let b = &self.buffers[k];
            let free = |s: &&mut Slot| {
                b.last_use < s.written && s.lives.iter().all(|&(def, last)| b.last_use < def || b.def > last)
            };
            let first = slots.partition_point(|s| s.bytes < b.bytes);
            if let Some(s) = slots[first..].iter_mut().find(free) {
                s.lives.push((b.def, b.last_use));
                packed[k] = true;
            }
        }
        packed
    }

    /// Bytes of every buffer live at each position, arguments and constants
    /// included: the device memory the step holds there.
    pub fn live_curve(&self) -> Vec<u64> {
        let fixed: u64 = self
            .buffers
            .iter()
            .filter(|b| matches!(b.kind, BufferKind::Argument | BufferKind::Constant))
            .map(|b| b.bytes)
            .sum();
        self.temp_curve().iter().zip(self.output_curve()).map(|(t, o)| fixed + t + o).collect()
    }

    /// Bytes at each position of the buffers `span` gives (by index) a
    /// first and a last position.
    fn curve(&self, span: impl Fn(usize, &Buffer) -> Option<(usize, usize)>) -> Vec<u64> {
        let n = self.order.len();
        let mut delta = vec![0i128; n + 1];
        for (k, b) in self.buffers.iter().enumerate() {
            if let Some((first, last)) = span(k, b) {
                delta[first] += i128::from(b.bytes);
                delta[last + 1] -= i128::from(b.bytes);
            }
        }
        let mut acc = 0i128;
        delta[..n]
            .iter()
            .map(|d| {
                acc += d;
                acc as u64
            })
            .collect()
    }
}

/// What XLA allocates for a step (`Liveness::allocation`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Its temp allocation: the largest sum of live temporaries (scratch
    /// included) not placed in an output's allocation.
    pub temp_bytes: u64,
    /// Arguments, constants, outputs that are not donated, and `temp_bytes`:
    /// XLA's arguments + outputs − aliased + temps.
    pub total_bytes: u64,
}

fn is_temp(b: &Buffer) -> bool {
    matches!(b.kind, BufferKind::Temp | BufferKind::Scratch)
}

/// Users of every node (each user once), indexed by node.
pub fn users_of(g: &Graph) -> Vec<Vec<NodeId>> {
    let mut users: Vec<Vec<NodeId>> = vec![Vec::new(); g.len()];
    for (id, node) in g.nodes() {
        for v in node.op.inputs() {
            let us = &mut users[v.node.index()];
            if us.last() != Some(&id) {
                us.push(id);
            }
        }
    }
    users
}

/// Liveness of `g`'s buffers when `fusion` decides which values reach memory.
pub fn liveness(g: &Graph, fusion: &dyn Materialization) -> Liveness {
    let live = crate::lower::live::live_nodes(g);
    let mut users = users_of(g);
    for us in &mut users {
        us.retain(|u| live[u.index()]);
    }
    let n = g.len();
    let mut is_output = vec![false; n];
    for v in g.outputs() {
        is_output[v.node.index()] = true;
    }
    // Reverse sweep: a node's users are decided before the node, so operands
    // that a materialized reshape or a barrier passes through are forced into
    // memory before their own answer is asked.
    let planned = fusion.plan(g, &users, &live);
    let mut materialized = vec![false; n];
    let mut forced = vec![false; n];
    for i in (0..n).rev() {
        if !live[i] {
            continue;
        }
        let id = NodeId::from_index(i);
        let node = g.node(id);
        materialized[i] = forced[i]
            || is_output[i]
            || matches!(
                node.op,
                Op::Parameter { .. } | Op::OptimizationBarrier { .. } | Op::Place { .. } | Op::HostCopy { .. }
            )
            || node.outputs.len() > 1
            || planned[i];
        if materialized[i] && matches!(node.op, Op::Reshape { .. } | Op::Whole { .. } | Op::OptimizationBarrier { .. })
        {
            for v in node.op.inputs() {
                forced[v.node.index()] = true;
            }
        }
    }
    let order: Vec<NodeId> = (0..n).filter(|&i| live[i]).map(NodeId::from_index).collect();
    let mut pos = vec![None; n];
    for (p, id) in order.iter().enumerate() {
        pos[id.index()] = Some(p);
    }
    let mut exec_pos = vec![None; n];
    for &id in order.iter().rev() {
        let i = id.index();
        exec_pos[i] =
            if materialized[i] { pos[i] } else { users[i].iter().filter_map(|u| exec_pos[u.index()]).max().or(pos[i]) };
    }
    let mut buffer_of: Vec<SmallVec<[Option<usize>; 1]>> =
        g.nodes().map(|(_, nd)| smallvec![None; nd.outputs.len()]).collect();
    let mut buffers: Vec<Buffer> = Vec::new();
    for &id in &order {
        let i = id.index();
        let node = g.node(id);
        let at = exec_pos[i].expect("live nodes have a position");
        for v in node.op.inputs() {
            if let Some(b) = buffer_of[v.node.index()][v.output as usize] {
                buffers[b].last_use = buffers[b].last_use.max(at);
            }
        }
        if !materialized[i] {
            continue;
        }
        match &node.op {
            Op::Reshape { input, .. } | Op::Whole { input } => {
                buffer_of[i][0] = buffer_of[input.node.index()][input.output as usize]
            }
            Op::OptimizationBarrier { inputs } => {
                for (k, v) in inputs.iter().enumerate() {
                    buffer_of[i][k] = buffer_of[v.node.index()][v.output as usize];
                }
            }
            // The copy back's end hands on the buffer the copy was written to.
            Op::HostCopy { inputs, step: HostCopyStep::InDone, .. } => {
                buffer_of[i][0] = buffer_of[inputs[0].node.index()][inputs[0].output as usize]
            }
            op => {
                let kind = match op {
                    Op::Parameter { .. } => BufferKind::Argument,
                    Op::Constant { .. } => BufferKind::Constant,
                    Op::Place { to: MemorySpace::PinnedHost, .. } => BufferKind::Host,
                    _ => BufferKind::Temp,
                };
                for (k, t) in node.outputs.iter().enumerate() {
                    buffer_of[i][k] = Some(buffers.len());
                    buffers.push(Buffer {
                        value: ValueId::new(id, k as u32),
                        bytes: t.size_in_bytes() as u64,
                        kind,
                        def: at,
                        last_use: at,
                    });
                }
                let scratch = fusion.scratch_bytes(g, id);
                if scratch > 0 {
                    buffers.push(Buffer {
                        value: ValueId::new(id, 0),
                        bytes: scratch,
                        kind: BufferKind::Scratch,
                        def: at,
                        last_use: at,
                    });
                }
            }
        }
    }
    let end = order.len().saturating_sub(1);
    let mut donated = vec![false; g.outputs().len()];
    for a in g.aliases() {
        if let Some(d) = donated.get_mut(a.output as usize) {
            *d = true;
        }
    }
    for (k, v) in g.outputs().iter().enumerate() {
        if let Some(b) = buffer_of[v.node.index()][v.output as usize] {
            buffers[b].last_use = end;
            if buffers[b].kind == BufferKind::Temp {
                buffers[b].kind = if donated[k] { BufferKind::Donated } else { BufferKind::Output };
            }
        }
    }
    share_dying_operands(g, &mut buffers, &buffer_of, fusion.shares_through_fusion());
    for b in &mut buffers {
        if b.kind == BufferKind::Argument {
            b.def = 0;
            b.last_use = end;
        }
    }
    Liveness { order, exec_pos, materialized, buffer_of, buffers }
}

/// XLA writes an elementwise kernel's result into an operand buffer of the
/// same size that dies in that kernel (and updates in place into the operand
/// of `dynamic_update_slice` and `scatter_add`): the two share one
/// allocation, so the dying buffer's interval ends just before the kernel.
///
/// `through_fusion` false: only buffers the kernel's own node reads qualify
/// (not those its fused producers read).
fn share_dying_operands(
    g: &Graph,
    buffers: &mut [Buffer],
    buffer_of: &[SmallVec<[Option<usize>; 1]>],
    through_fusion: bool,
) {
    let mut dying: Vec<Vec<usize>> = Vec::new();
    for (k, b) in buffers.iter().enumerate() {
        if b.kind == BufferKind::Temp && b.last_use > b.def {
            if dying.len() <= b.last_use {
                dying.resize(b.last_use + 1, Vec::new());
            }
            dying[b.last_use].push(k);
        }
    }
    for k in 0..buffers.len() {
        let (def, bytes, kind) = (buffers[k].def, buffers[k].bytes, buffers[k].kind);
        if !matches!(kind, BufferKind::Temp | BufferKind::Output) || !writes_in_place(&g.node(buffers[k].value.node).op)
        {
            continue;
        }
        let Some(candidates) = dying.get_mut(def) else { continue };
        let direct: Vec<usize> = if through_fusion {
            Vec::new()
        } else {
            g.node(buffers[k].value.node)
                .op
                .inputs()
                .iter()
                .filter_map(|v| buffer_of[v.node.index()][v.output as usize])
                .collect()
        };
        let allowed = |o: usize| through_fusion || direct.contains(&o);
        if let Some(i) =
            candidates.iter().position(|&o| o != k && buffers[o].bytes == bytes && buffers[o].def < def && allowed(o))
        {
            let o = candidates.swap_remove(i);
            buffers[o].last_use = def - 1;
        }
    }
}

/// Kernels whose result may take the place of a dying operand.
fn writes_in_place(op: &Op) -> bool {
    op.props().in_place
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{EveryNodeAKernel, XlaCpuFusion};
    use crate::ir::{DType, TensorType, UnaryOp};

    fn chain() -> Graph {
        // p -> exp -> tanh -> neg (output); each value 4 x f32 = 16 bytes.
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [4]));
        let a = g.value(Op::Unary { op: UnaryOp::Exp, input: p }).unwrap();
        let b = g.value(Op::Unary { op: UnaryOp::Tanh, input: a }).unwrap();
        let c = g.value(Op::Unary { op: UnaryOp::Neg, input: b }).unwrap();
        g.set_outputs(vec![c]).unwrap();
        g
    }

    #[test]
    fn unfused_elementwise_chain_writes_into_its_dying_operands() {
        let l = liveness(&chain(), &EveryNodeAKernel);
        // positions: p 0, exp 1, tanh 2, neg 3; tanh takes exp's buffer,
        // neg (the output) takes tanh's.
        assert_eq!(l.temp_curve(), vec![0, 16, 16, 0]);
        assert_eq!(l.output_curve(), vec![0, 0, 0, 16]);
        assert_eq!(l.live_curve(), vec![16, 32, 32, 32]);
    }

    #[test]
    fn xla_places_temporaries_in_an_output_allocation_only_before_the_output_is_written() {
        // a = exp(p) [2, 4] -> s = sum(a) [4] -> o = s * b (an output, 16
        // bytes), b = tanh(q) [4] also read by t = sum(b) (a 4-byte output)
        // after o is written.
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [2, 4]));
        let a = g.value(Op::Unary { op: UnaryOp::Exp, input: p }).unwrap();
        let sum = |g: &mut Graph, input| g.value(Op::Reduce { op: crate::ir::ReduceOp::Sum, input, axes: vec![0] });
        let s = sum(&mut g, a).unwrap();
        let q = g.parameter(TensorType::new(DType::F32, [4]));
        let b = g.value(Op::Unary { op: UnaryOp::Tanh, input: q }).unwrap();
        let o = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: s, rhs: b }).unwrap();
        let t = sum(&mut g, b).unwrap();
        g.set_outputs(vec![o, t]).unwrap();
        let l = liveness(&g, &EveryNodeAKernel);
        let packed = l.packed_into_outputs();
        let is_packed = |v: ValueId| packed[l.buffer_of[v.node.index()][0].unwrap()];
        assert!(!is_packed(a), "32 bytes do not fit a 16-byte output");
        assert!(is_packed(s), "the sum dies before o is written (o takes its buffer)");
        assert!(!is_packed(b), "tanh is read after o is written, and t is too small");
        // positions: p 0, a 1, s 2, q 3, b 4, o 5, t 6. The live bytes
        // count s; XLA's temp allocation holds a, then b.
        assert_eq!(l.temp_curve(), vec![0, 32, 48, 16, 32, 16, 16]);
        let allocation = l.allocation();
        assert_eq!(allocation.temp_bytes, 32);
        assert_eq!(allocation.total_bytes, 48 + 20 + 32, "arguments, both outputs from the start, a");
        let peak = crate::analysis::peak_of(&l);
        assert_eq!(peak.peak_bytes, 48 + 48);
        assert_eq!((peak.allocated_temp_bytes, peak.allocated_bytes), (32, 100));
    }

    #[test]
    fn an_operand_that_lives_on_is_not_shared() {
        // exp is read again after tanh: both are live at tanh.
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [4]));
        let a = g.value(Op::Unary { op: UnaryOp::Exp, input: p }).unwrap();
        let b = g.value(Op::Unary { op: UnaryOp::Tanh, input: a }).unwrap();
        let c = g.value(Op::Binary { op: crate::ir::BinaryOp::Add, lhs: a, rhs: b }).unwrap();
        g.set_outputs(vec![c]).unwrap();
        let l = liveness(&g, &EveryNodeAKernel);
        // The output add takes one of the two buffers that die in it.
        assert_eq!(l.temp_curve(), vec![0, 16, 32, 16]);
    }

    #[test]
    fn fused_chain_has_no_temps() {
        let l = liveness(&chain(), &XlaCpuFusion);
        assert_eq!(l.temp_curve(), vec![0, 0, 0, 0]);
        assert_eq!(l.buffers.len(), 2, "the argument and the output");
    }

    #[test]
    fn a_reshape_extends_its_operand_instead_of_allocating() {
        let mut g = Graph::new();
        let p = g.parameter(TensorType::new(DType::F32, [4]));
        let a = g.value(Op::Unary { op: UnaryOp::Exp, input: p }).unwrap();
        let r = g.value(Op::Reshape { input: a, shape: crate::ir::Shape::new(vec![2, 2]) }).unwrap();
        let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: r }).unwrap();
        g.set_outputs(vec![t]).unwrap();
        let l = liveness(&g, &EveryNodeAKernel);
        assert_eq!(l.buffers.len(), 3);
        // exp's buffer lives through the reshape; tanh (the output) takes it.
        assert_eq!(l.temp_curve(), vec![0, 16, 16, 0]);
    }

    #[test]
    fn an_output_written_into_a_donated_argument_is_billed_to_the_argument() {
        // An update in place: w' = w - exp(w), w' donated w's buffer, and a
        // second output (the loss-like sum) that is not.
        let mut g = Graph::new();
        let w = g.parameter(TensorType::new(DType::F32, [4]));
        let e = g.value(Op::Unary { op: UnaryOp::Exp, input: w }).unwrap();
        let n = g.value(Op::Binary { op: crate::ir::BinaryOp::Sub, lhs: w, rhs: e }).unwrap();
        let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: e }).unwrap();
        g.set_outputs(vec![n, t]).unwrap();
        let plain = crate::analysis::peak_memory(&g, &EveryNodeAKernel);
        g.add_alias(crate::ir::Alias { param: 0, output: 0 }).unwrap();
        let l = liveness(&g, &EveryNodeAKernel);
        let donated = crate::analysis::peak_of(&l);
        // positions: w 0, exp 1, sub 2, tanh 3. Without the alias w' is a
        // buffer of its own from position 2; with it, only exp and tanh
        // (which takes exp's buffer) add to the argument.
        assert_eq!(plain.peak_bytes, 16 + 32);
        assert_eq!(l.live_curve(), vec![16, 32, 32, 32]);
        assert_eq!(donated.peak_bytes, 32);
        assert_eq!((donated.output_bytes, donated.alias_bytes), (32, 16));
        assert_eq!((plain.output_bytes, plain.alias_bytes), (32, 0));
        assert!(l.buffers.iter().any(|b| b.kind == BufferKind::Donated && b.value == n));
    }
}
