//! Merging matmuls that share an operand, where the cost model says it pays.
//!
//! Algebra: for `x: [..., k]` and `w_i: [k, n_i]` (or `[n_i, k]`, contracted
//! on the other side), with no batch dimensions,
//!
//! ```text
//! dot(x, w_i) = slice(dot(x, concat(w_1, ..., w_n)), [.., o_i .. o_i + n_i])
//! ```
//!
//! along the last (the rhs's free) dimension of the result, `o_i = n_1 + ... +
//! n_(i-1)`. Every element of the merged product is the same sum of the same
//! products as in the separate one; the order in which the backend accumulates
//! a sum is its own choice in either form (the layout rules use the same
//! freedom), so the rule is exact up to that order.
//!
//! When it pays: the FLOPs are equal, so the cost model's bytes decide. The
//! separate products read `x` once each; the merged one reads it once, but the
//! weights are concatenated every step (read and written once more), and each
//! slice of the result is a copy unless all of its users are fusible
//! consumers (elementwise, reduction or movement ops, which XLA fuses with the
//! slice; a matmul or library call reads its operand from memory). So with
//! `m` rows of `x`, `k` its width and `N = Σ n_i`, merging pays roughly when
//! `(n - 1)·m·k > 2·k·N` (+ the unfused slices' `2·m·n_i`): many rows against
//! narrow weights, as the q/k/v projections of a training step (`m` = batch ×
//! sequence = 8192, `k` = 768, `N` = 2304: it pays while the slices fuse), and
//! not for a few rows (decoding, a batch of 64) or for slices that feed
//! matmuls. Kernel launches saved are not counted (the cost model has none).
//!
//! Why this is a graph rule and not an e-graph equality: extraction costs a
//! class as a tree, so a merged product shared by `n` slices would be charged
//! `n` times and never chosen. The decision is about the whole group at once,
//! so it is made here, on the extracted graph, by comparing the group's costs
//! as a DAG.

use std::collections::BTreeMap;

use crate::cost::op_cost;
use crate::fusion::{kind, FusionKind};
use crate::ir::{DType, DotDims, Graph, NodeId, Op, ValueId};
use crate::CompileError;

/// How [`merge_matmuls`] decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MergeDecision {
    /// Merge a group only when the cost model's bytes say it pays.
    CostModel,
    /// Merge every eligible group (tests of the algebra).
    Always,
}

/// One group of products of the same `x` with the same dimension numbers.
#[derive(Debug)]
struct Group {
    /// The products, in node order.
    dots: Vec<NodeId>,
}

/// Products `dot(x, w)` eligible for merging: no batch dimensions, a rank-2
/// rhs with one contracting dimension.
fn eligible(g: &Graph, op: &Op) -> Option<(ValueId, DotDims, DType)> {
    let Op::DotGeneral { lhs, rhs, dims } = op else { return None };
    let rt = g.ty(*rhs);
    (dims.lhs_batch.is_empty() && rt.shape.rank() == 2 && dims.rhs_contract.len() == 1)
        .then(|| (*lhs, dims.clone(), rt.dtype))
}

/// The rhs's free dimension (the one not contracted).
fn free_dim(dims: &DotDims) -> usize {
    1 - dims.rhs_contract[0]
}

/// Rebuilds `g` with each group of products that share their lhs merged into
/// one product and slices, as `decide` says; returns the graph and how many
/// products were merged away.
pub fn merge_matmuls(g: &Graph, decide: MergeDecision) -> Result<(Graph, usize), CompileError> {
    // Candidate groups, keyed by (lhs, dims, rhs dtype); BTreeMap: deterministic.
    let mut groups: BTreeMap<(ValueId, DotDims, DType), Group> = BTreeMap::new();
    for (id, node) in g.nodes() {
        if let Some(key) = eligible(g, &node.op) {
            groups.entry(key).or_insert_with(|| Group { dots: Vec::new() }).dots.push(id);
        }
    }
    // The merged product is emitted where the group's first product was, so
    // only products whose rhs is defined before that point join (and then no
    // rhs can depend on a product of the group: the graph is in topological
    // order, so the merge cannot make a cycle).
    let mut plan: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for group in groups.into_values() {
        let first = group.dots[0];
        let dots: Vec<NodeId> = group
            .dots
            .into_iter()
            .filter(|&d| match &g.node(d).op {
                Op::DotGeneral { rhs, .. } => rhs.node.index() < first.index(),
                _ => false,
            })
            .collect();
        if dots.len() >= 2 && (decide == MergeDecision::Always || pays(g, &dots)?) {
            plan.insert(first, dots);
        }
    }
    if plan.is_empty() {
        return Ok((g.clone(), 0));
    }
    let mut out = Graph::new();
    // Where each old value went: whole nodes map node to node; merged products
    // map to their slice.
    let mut nodes: Vec<Option<NodeId>> = vec![None; g.len()];
    let mut sliced: BTreeMap<NodeId, ValueId> = BTreeMap::new();
    let mut merged = 0;
    let map = |nodes: &[Option<NodeId>], sliced: &BTreeMap<NodeId, ValueId>, v: ValueId| -> ValueId {
        match sliced.get(&v.node) {
            Some(&s) => s,
            None => ValueId::new(nodes[v.node.index()].expect("operands come first"), v.output),
        }
    };
    for (id, node) in g.nodes() {
        if sliced.contains_key(&id) {
            continue;
        }
        if let Some(dots) = plan.get(&id) {
            let (lhs, dims) = match &node.op {
                Op::DotGeneral { lhs, dims, .. } => (map(&nodes, &sliced, *lhs), dims.clone()),
                _ => unreachable!("groups hold products only"),
            };
            let axis = free_dim(&dims);
            let rhs: Vec<ValueId> = dots
                .iter()
                .map(|&d| match &g.node(d).op {
                    Op::DotGeneral { rhs, .. } => map(&nodes, &sliced, *rhs),
                    _ => unreachable!("groups hold products only"),
                })
                .collect();
            let widths: Vec<usize> = rhs.iter().map(|&r| out.ty(r).shape.dims()[axis]).collect();
            let cat = out.value(Op::Concatenate { inputs: rhs, axis })?;
            let prod = out.value(Op::DotGeneral { lhs, rhs: cat, dims })?;
            let shape = out.ty(prod).shape.dims().to_vec();
            let last = shape.len() - 1;
            let mut at = 0;
            for (&d, &w) in dots.iter().zip(&widths) {
                let mut start = vec![0; shape.len()];
                let mut limit = shape.clone();
                start[last] = at;
                limit[last] = at + w;
                at += w;
                let s = out.value(Op::Slice { input: prod, start, limit, stride: vec![1; shape.len()] })?;
                sliced.insert(d, s);
            }
            merged += dots.len() - 1;
            continue;
        }
        let mut op = node.op.clone();
        op.map_inputs(|v| map(&nodes, &sliced, v));
        nodes[id.index()] = Some(out.add(op)?);
    }
    let outputs = g.outputs().iter().map(|&v| map(&nodes, &sliced, v)).collect();
    out.set_outputs(outputs)?;
    for &a in g.aliases() {
        out.add_alias(a)?;
    }
    Ok((out, merged))
}

/// Whether merging `dots` moves fewer bytes than running them apart (the
/// cost model's bytes; FLOPs are equal).
fn pays(g: &Graph, dots: &[NodeId]) -> Result<bool, CompileError> {
    let mut apart: u64 = 0;
    let mut rhs_types = Vec::new();
    let mut slices: u64 = 0;
    let (mut lhs_ty, mut dims) = (None, None);
    for &d in dots {
        let node = g.node(d);
        let Op::DotGeneral { lhs, rhs, dims: dd } = &node.op else { return Ok(false) };
        let operands = [g.ty(*lhs).clone(), g.ty(*rhs).clone()];
        apart = apart.saturating_add(op_cost(&node.op, &operands, &node.outputs).bytes());
        rhs_types.push(operands[1].clone());
        lhs_ty = Some(operands[0].clone());
        dims = Some(dd.clone());
        // A slice feeding anything but fusible consumers is its own copy.
        let fused = !g.outputs().iter().any(|v| v.node == d)
            && g.users(d).iter().all(|&u| {
                matches!(kind(&g.node(u).op), FusionKind::Elementwise | FusionKind::Reduction | FusionKind::Movement)
            });
        if !fused {
            let out_ty = &node.outputs[0];
            slices =
                slices.saturating_add(2 * out_ty.shape.num_elements() as u64 * out_ty.dtype.size_in_bytes() as u64);
        }
    }
    let (Some(lhs_ty), Some(dims)) = (lhs_ty, dims) else { return Ok(false) };
    // The merged product and the concatenation, typed by inference.
    let axis = free_dim(&dims);
    let mut scratch = Graph::new();
    let w: Vec<ValueId> = rhs_types.iter().map(|t| scratch.parameter(t.clone())).collect();
    let x = scratch.parameter(lhs_ty.clone());
    let cat_op = Op::Concatenate { inputs: w, axis };
    let cat = scratch.value(cat_op.clone())?;
    let prod_op = Op::DotGeneral { lhs: x, rhs: cat, dims };
    let prod = scratch.value(prod_op.clone())?;
    let cat_cost = op_cost(&cat_op, &rhs_types, &[scratch.ty(cat).clone()]).bytes();
    let prod_cost = op_cost(&prod_op, &[lhs_ty, scratch.ty(cat).clone()], &[scratch.ty(prod).clone()]).bytes();
    Ok(prod_cost.saturating_add(cat_cost).saturating_add(slices) < apart)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{TensorType, UnaryOp};

    fn dot(g: &mut Graph, x: ValueId, w: ValueId) -> ValueId {
        g.value(Op::DotGeneral { lhs: x, rhs: w, dims: DotDims::matmul() }).unwrap()
    }

    #[test]
    fn a_weight_defined_after_the_first_product_stays_apart() {
        // w2 = tanh(x · w1)ᵀ-shaped: it depends on the first product, so
        // merging it in would make a cycle; only the independent w3 joins.
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::F32, [4, 4]));
        let w1 = g.parameter(TensorType::new(DType::F32, [4, 4]));
        let w3 = g.parameter(TensorType::new(DType::F32, [4, 2]));
        let d1 = dot(&mut g, x, w1);
        let w2 = g.value(Op::Unary { op: UnaryOp::Tanh, input: d1 }).unwrap();
        let d2 = dot(&mut g, x, w2);
        let d3 = dot(&mut g, x, w3);
        g.set_outputs(vec![d2, d3]).unwrap();
        let (out, merged) = merge_matmuls(&g, MergeDecision::Always).unwrap();
        crate::verify(&out).unwrap();
        assert_eq!(merged, 1);
        let dots = out.nodes().filter(|(_, n)| matches!(n.op, Op::DotGeneral { .. })).count();
        assert_eq!(dots, 2, "{}", crate::text::print(&out));
    }

    #[test]
    fn the_cost_model_counts_output_slices_as_copies() {
        // Two [8192, 768] x [768, 768] products that are program outputs: each
        // slice is a copy of 25 MB, more than the 25 MB read of x saved.
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::BF16, [8192, 768]));
        let w1 = g.parameter(TensorType::new(DType::BF16, [768, 768]));
        let w2 = g.parameter(TensorType::new(DType::BF16, [768, 768]));
        let (d1, d2) = (dot(&mut g, x, w1), dot(&mut g, x, w2));
        g.set_outputs(vec![d1, d2]).unwrap();
        assert_eq!(merge_matmuls(&g, MergeDecision::CostModel).unwrap().1, 0);
        // The same products feeding tanh: the slices fuse, and merging pays.
        let mut g2 = Graph::new();
        let x = g2.parameter(TensorType::new(DType::BF16, [8192, 768]));
        let w1 = g2.parameter(TensorType::new(DType::BF16, [768, 768]));
        let w2 = g2.parameter(TensorType::new(DType::BF16, [768, 768]));
        let (d1, d2) = (dot(&mut g2, x, w1), dot(&mut g2, x, w2));
        let t1 = g2.value(Op::Unary { op: UnaryOp::Tanh, input: d1 }).unwrap();
        let t2 = g2.value(Op::Unary { op: UnaryOp::Tanh, input: d2 }).unwrap();
        g2.set_outputs(vec![t1, t2]).unwrap();
        assert_eq!(merge_matmuls(&g2, MergeDecision::CostModel).unwrap().1, 1);
    }
}
