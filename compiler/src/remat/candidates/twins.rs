//! Twin recomputations of one GEMM, merged after a plan.
//!
//! Greedy frees values one candidate at a time, and each candidate clones its
//! own chain behind its own barrier. Two chains can so clone the same GEMM
//! from the same leaves: on gpt2-small at 27% of the activation memory (CUDA
//! model), one chain recomputed a layer's up-projection for GELU's output
//! (which the down-projection's weight gradient reads) and another the same
//! up-projection for GELU's backward, in six layers: six GEMMs and six GELU
//! kernels more than one chain a layer needs (`docs/memory.md`, "Twin
//! GEMMs").
//!
//! Two fenced nodes are twins when they are the same op on the same values,
//! where a barrier's result counts as the value it passes (a barrier is the
//! identity on values). A GEMM's result is written to memory whichever kernel
//! reads it, so the later twin's readers can read the earlier twin's result
//! and one GEMM is gone; the readers' own clones then read the same values,
//! and the common-subexpression pass that follows merges them too (one GELU
//! chain, which the CUDA lowering's loop kernel writes as a sibling output).
//! Only clones are merged (nodes that read a barrier's result, directly or
//! through others): the forward's original never is, or the recomputation
//! would be undone. Each merge keeps the earlier twin's result live until the
//! later twin's readers, so it is kept only where the planned peak stays
//! within the budget (or, where the plan missed it, does not rise).

use std::collections::HashMap;

use crate::ir::{Graph, NodeId, Op, ValueId};
use crate::passes::{eliminate_common_subexpressions, eliminate_dead_code_keep_params};
use crate::CompileError;

use crate::analysis::liveness;
use crate::analysis::peak_of;
use crate::analysis::Materialization;

/// The later twin of each pair of fenced GEMMs in `g`, with its earlier
/// twin, in node order.
fn twin_gemms(g: &Graph) -> Vec<(NodeId, NodeId)> {
    // The value each value stands for (a barrier's result stands for what it
    // passes, a twin for its first), and whether it reads a barrier's result.
    let mut rep: HashMap<ValueId, ValueId> = HashMap::new();
    let mut fenced: HashMap<ValueId, bool> = HashMap::new();
    let mut seen: HashMap<(Op, bool), NodeId> = HashMap::new();
    let mut twins = Vec::new();
    for (id, node) in g.nodes() {
        let outputs = g.node(id).outputs.len() as u32;
        if let Op::OptimizationBarrier { inputs } = &node.op {
            for (i, v) in inputs.iter().enumerate() {
                let out = ValueId::new(id, i as u32);
                rep.insert(out, rep.get(v).copied().unwrap_or(*v));
                fenced.insert(out, true);
            }
            continue;
        }
        let is_fenced = node.op.inputs().iter().any(|v| fenced.get(v).copied().unwrap_or(false));
        let mut key = node.op.clone();
        key.map_inputs(|v| rep.get(&v).copied().unwrap_or(v));
        let mergeable = !matches!(key, Op::Parameter { .. } | Op::RngBitGenerator { .. }) && !key.is_collective();
        let first = if mergeable { *seen.entry((key, is_fenced)).or_insert(id) } else { id };
        if first != id && is_fenced && matches!(node.op, Op::DotGeneral { .. }) {
            twins.push((id, first));
        }
        for i in 0..outputs {
            let out = ValueId::new(id, i);
            rep.insert(out, ValueId::new(first, i));
            fenced.insert(out, is_fenced);
        }
    }
    twins
}

/// `g` with every reader of `later`'s results reading `earlier`'s.
fn redirect(g: &Graph, later: NodeId, earlier: NodeId) -> Result<Graph, CompileError> {
    let mut out = Graph::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(g.len());
    for (id, node) in g.nodes() {
        if id == later {
            map.push(map[earlier.index()]);
            continue;
        }
        let mut op = node.op.clone();
        op.map_inputs(|v| ValueId::new(map[v.node.index()], v.output));
        map.push(out.add(op)?);
    }
    out.set_outputs(g.outputs().iter().map(|v| ValueId::new(map[v.node.index()], v.output)).collect())?;
    for &a in g.aliases() {
        out.add_alias(a)?;
    }
    Ok(out)
}

/// `g` with its twin GEMMs merged where the peak allows (see the module
/// docs), and the number merged. `budget`: the plan's byte budget.
pub(crate) fn merge_twin_gemms(
    g: &Graph,
    fusion: &dyn Materialization,
    budget: u64,
) -> Result<(Graph, usize), CompileError> {
    let mut cur = g.clone();
    let mut limit = peak_of(&liveness(&cur, fusion)).peak_bytes.max(budget);
    let mut merged = 0;
    // Each merge renumbers the graph, so the pairs are found again after
    // it; a pair refused is skipped by counting the refusals before it.
    let mut skip = 0;
    loop {
        let twins = twin_gemms(&cur);
        let Some(&(later, earlier)) = twins.get(skip) else { break };
        let next = redirect(&cur, later, earlier)?;
        let next = eliminate_common_subexpressions(&eliminate_dead_code_keep_params(&next)?)?.0;
        let peak = peak_of(&liveness(&next, fusion)).peak_bytes;
        if peak <= limit {
            limit = limit.min(peak.max(budget));
            cur = next;
            merged += 1;
        } else {
            skip += 1;
        }
    }
    Ok((cur, merged))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::EveryNodeAKernel;
    use crate::ir::{BinaryOp, DType, DotDims, Literal, TensorType, UnaryOp};

    fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
        eliminate_dead_code_keep_params(g).unwrap().nodes().filter(|(_, n)| f(&n.op)).count()
    }

    fn dots(g: &Graph) -> usize {
        count(g, |op| matches!(op, Op::DotGeneral { .. }))
    }

    fn matmul(g: &mut Graph, a: ValueId, b: ValueId) -> ValueId {
        g.value(Op::DotGeneral { lhs: a, rhs: b, dims: DotDims::matmul() }).unwrap()
    }

    fn unary(g: &mut Graph, op: UnaryOp, input: ValueId) -> ValueId {
        g.value(Op::Unary { op, input }).unwrap()
    }

    /// `h = x·w` read in the forward, then recomputed twice in the
    /// backward, each clone behind its own barrier as remat writes them,
    /// with a `[64, 64]` temporary computed between the two chains; the
    /// second chain applies `later` to its clone (the first `tanh`).
    fn twin_step(later: UnaryOp) -> Graph {
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::F32, [4, 8]));
        let w = g.parameter(TensorType::new(DType::F32, [8, 64]));
        let v = g.parameter(TensorType::new(DType::F32, [64, 1]));
        let q = g.parameter(TensorType::new(DType::F32, [64, 64]));
        let h = matmul(&mut g, x, w);
        let y = unary(&mut g, UnaryOp::Tanh, h);
        let a1 = matmul(&mut g, y, v);
        let b1 = g.add(Op::OptimizationBarrier { inputs: vec![x, a1] }).unwrap();
        let h1 = matmul(&mut g, ValueId::new(b1, 0), w);
        let u1 = unary(&mut g, UnaryOp::Tanh, h1);
        let r1 = matmul(&mut g, u1, v);
        let big = unary(&mut g, UnaryOp::Exp, q);
        let big = unary(&mut g, UnaryOp::Tanh, big);
        let a2 = matmul(&mut g, big, v);
        let a2 = g.value(Op::Binary { op: BinaryOp::Add, lhs: a2, rhs: a2 }).unwrap();
        let b2 = g.add(Op::OptimizationBarrier { inputs: vec![x, a2] }).unwrap();
        let h2 = matmul(&mut g, ValueId::new(b2, 0), w);
        let u2 = unary(&mut g, later, h2);
        let r2 = matmul(&mut g, u2, v);
        g.set_outputs(vec![r1, r2, ValueId::new(b2, 1)]).unwrap();
        g
    }

    /// Fresh normal-ish values for `g`'s parameters (a seed from the clock).
    fn inputs(g: &Graph) -> Vec<Literal> {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos());
        let mut s = (t as u64) | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        };
        g.param_types()
            .iter()
            .map(|t| {
                let n = t.shape.dims().iter().product::<usize>();
                Literal::from_f64s(t.dtype, t.shape.clone(), &(0..n).map(|_| next()).collect::<Vec<_>>()).unwrap()
            })
            .collect()
    }

    #[test]
    fn two_clones_of_one_gemm_become_one_and_the_values_hold() {
        let g = twin_step(UnaryOp::Tanh);
        let pair = |a, b| (NodeId::from_index(a), NodeId::from_index(b));
        assert_eq!(twin_gemms(&g), vec![pair(16, 8), pair(18, 10)], "x·w and tanh(x·w)·v again");
        let (merged, n) = merge_twin_gemms(&g, &EveryNodeAKernel, u64::MAX).unwrap();
        crate::verify(&merged).unwrap();
        assert_eq!(n, 1);
        assert_eq!((dots(&g), dots(&merged)), (7, 5), "one x·w and its readers' tanh·v less");
        let tanhs = |g: &Graph| count(g, |op| matches!(op, Op::Unary { op: UnaryOp::Tanh, .. }));
        assert_eq!((tanhs(&g), tanhs(&merged)), (4, 3), "the second clone's tanh is the first's");
        let x = inputs(&g);
        assert_eq!(crate::interpret(&g, &x).unwrap(), crate::interpret(&merged, &x).unwrap());
    }

    #[test]
    fn the_forwards_gemm_is_never_a_twin_of_a_clone() {
        let mut g = twin_step(UnaryOp::Tanh);
        // Only the first chain: its clone and the forward's original are the
        // same op on the same values, but only one is fenced.
        let outs = g.outputs().to_vec();
        g.set_outputs(vec![outs[0]]).unwrap();
        let g = eliminate_dead_code_keep_params(&g).unwrap();
        assert!(twin_gemms(&g).is_empty());
        assert_eq!(merge_twin_gemms(&g, &EveryNodeAKernel, u64::MAX).unwrap().1, 0);
    }

    #[test]
    fn a_merge_that_would_raise_the_peak_is_refused() {
        let g = twin_step(UnaryOp::Exp);
        assert_eq!(twin_gemms(&g).len(), 1);
        let l = liveness(&g, &EveryNodeAKernel);
        let before = peak_of(&l).peak_bytes;
        // The first clone's result would stay live across the [64, 64]
        // temporaries, which make the peak.
        let (merged, n) = merge_twin_gemms(&g, &EveryNodeAKernel, before).unwrap();
        assert_eq!((n, dots(&merged)), (0, 7));
        assert_eq!(peak_of(&liveness(&merged, &EveryNodeAKernel)).peak_bytes, before);
        // A plan that missed its budget keeps the same rule: no rise.
        assert_eq!(merge_twin_gemms(&g, &EveryNodeAKernel, 0).unwrap().1, 0);
        // With room for it, the same merge is taken.
        let (merged, n) = merge_twin_gemms(&g, &EveryNodeAKernel, before + 1024).unwrap();
        assert_eq!((n, dots(&merged)), (1, 6));
        assert!(peak_of(&liveness(&merged, &EveryNodeAKernel)).peak_bytes <= before + 1024);
        let x = inputs(&g);
        assert_eq!(crate::interpret(&g, &x).unwrap(), crate::interpret(&merged, &x).unwrap());
    }
}
