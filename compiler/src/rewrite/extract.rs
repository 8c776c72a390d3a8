//! Graph to e-graph and back: the lossless conversion and cost-model extraction.
//!
//! Extraction gives each e-node the cost model's cost of running it as a
//! kernel ([`op_cost`]: bytes moved plus FLOPs, plus one so every node costs
//! something) and picks, per class, the node whose tree cost (own cost plus its
//! children's) is least. Costs are exact `u128` sums (saturating), computed by
//! Knuth's generalization of Dijkstra: a class is final once popped at its least
//! cost, and a node is only costed once all its children are final, so the
//! chosen nodes never form a cycle. Ties go to the lower class id, then to the
//! earlier node, so extraction is deterministic.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use egg::Id;

use super::{enode, to_op, EGraph, TensorLang, TypeAnalysis};
use crate::cost::op_cost;
use crate::ir::{Alias, Graph, Op, ValueId};
use crate::CompileError;

fn bug(reason: impl Into<String>) -> CompileError {
    CompileError::Rewrite { rule: "extract", reason: reason.into() }
}

/// Builds the e-graph of `g`; returns it and the class of each graph output.
pub fn to_egraph(g: &Graph) -> Result<(EGraph, Vec<Id>), CompileError> {
    let mut eg = EGraph::new(TypeAnalysis::default());
    // vals[node][output] = the class of that value.
    let mut vals: Vec<Vec<Id>> = Vec::with_capacity(g.len());
    for (id, node) in g.nodes() {
        let children: Vec<Id> = node.op.inputs().iter().map(|v| vals[v.node.index()][v.output as usize]).collect();
        let token = u32::try_from(id.index() + 1).map_err(|_| bug("too many nodes"))?;
        let class = eg.add(enode(&node.op, children, token));
        if node.outputs.len() == 1 {
            vals.push(vec![class]);
        } else {
            vals.push(
                (0..node.outputs.len() as u32)
                    .map(|i| eg.add(TensorLang::Project { index: i, tuple: [class] }))
                    .collect(),
            );
        }
    }
    if let Some(e) = eg.analysis.errors.first() {
        return Err(bug(format!("the input graph does not type-check in the e-graph: {e}")));
    }
    eg.rebuild();
    let roots = g.outputs().iter().map(|v| vals[v.node.index()][v.output as usize]).collect();
    Ok((eg, roots))
}

/// The own cost of one e-node under the cost model.
fn own_cost(eg: &EGraph, class: Id, node: &TensorLang) -> u128 {
    match node {
        TensorLang::Project { .. } => 1,
        TensorLang::Op { op, children, .. } => {
            let operands: Vec<_> = children.iter().filter_map(|&c| eg[c].data.ty().cloned()).collect();
            let c = op_cost(op, &operands, &eg[class].data.types);
            u128::from(c.bytes()) + u128::from(c.flops) + 1
        }
    }
}

/// The chosen node of every class reachable from anywhere.
fn choose(eg: &EGraph) -> HashMap<Id, (u128, TensorLang)> {
    let mut classes: Vec<Id> = eg.classes().map(|c| c.id).collect();
    classes.sort();
    // Flat list of nodes: (class, node, own cost, distinct children left).
    let mut nodes: Vec<(Id, &TensorLang, u128)> = Vec::new();
    let mut pending: Vec<usize> = Vec::new();
    let mut parents: HashMap<Id, Vec<usize>> = HashMap::new();
    let mut heap: BinaryHeap<Reverse<(u128, Id, usize)>> = BinaryHeap::new();
    for &c in &classes {
        for n in &eg[c].nodes {
            let i = nodes.len();
            let mut kids: Vec<Id> = egg::Language::children(n).iter().map(|&k| eg.find(k)).collect();
            kids.sort();
            kids.dedup();
            for &k in &kids {
                parents.entry(k).or_default().push(i);
            }
            let own = own_cost(eg, c, n);
            nodes.push((c, n, own));
            pending.push(kids.len());
            if kids.is_empty() {
                heap.push(Reverse((own, c, i)));
            }
        }
    }
    let mut best: HashMap<Id, (u128, TensorLang)> = HashMap::new();
    while let Some(Reverse((cost, class, i))) = heap.pop() {
        if best.contains_key(&class) {
            continue;
        }
        best.insert(class, (cost, nodes[i].1.clone()));
        for &p in parents.get(&class).map(Vec::as_slice).unwrap_or(&[]) {
            pending[p] -= 1;
            if pending[p] == 0 {
                let (pc, pn, own) = nodes[p];
                if best.contains_key(&pc) {
                    continue;
                }
                let total =
                    egg::Language::children(pn).iter().fold(own, |acc, &k| acc.saturating_add(best[&eg.find(k)].0));
                heap.push(Reverse((total, pc, p)));
            }
        }
    }
    best
}

/// Extracts the cheapest graph equal to `original` (whose outputs are the
/// classes `roots`). Parameters keep their indices, aliases their positions.
pub fn from_egraph(eg: &EGraph, original: &Graph, roots: &[Id]) -> Result<Graph, CompileError> {
    let best = choose(eg);
    let mut out = Graph::new();
    let mut memo: HashMap<Id, ValueId> = HashMap::new();
    // Parameters first, in index order, whether or not they are still used.
    for &p in original.params() {
        let op = original.node(p).op.clone();
        let v = out.value(op.clone())?;
        let class =
            eg.lookup(enode(&op, vec![], p.index() as u32 + 1)).ok_or_else(|| bug("a parameter left the e-graph"))?;
        if let Some((_, TensorLang::Op { op: Op::Parameter { index, .. }, .. })) = best.get(&class) {
            if let Op::Parameter { index: mine, .. } = op {
                if *index == mine {
                    memo.insert(class, v);
                }
            }
        }
    }
    // Post-order walk without recursion (graphs are thousands deep).
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    let mut marks: HashMap<Id, Mark> = HashMap::new();
    for &root in roots {
        let mut stack = vec![(eg.find(root), false)];
        while let Some((c, expanded)) = stack.pop() {
            if memo.contains_key(&c) {
                continue;
            }
            let (_, node) = best.get(&c).ok_or_else(|| bug(format!("class {c} has no finite-cost node")))?;
            let kids: Vec<Id> = egg::Language::children(node).iter().map(|&k| eg.find(k)).collect();
            if !expanded {
                if marks.get(&c) == Some(&Mark::Open) {
                    return Err(bug(format!("class {c} depends on itself")));
                }
                marks.insert(c, Mark::Open);
                stack.push((c, true));
                for &k in kids.iter().rev() {
                    if !memo.contains_key(&k) {
                        if marks.get(&k) == Some(&Mark::Open) {
                            return Err(bug(format!("class {k} depends on itself")));
                        }
                        stack.push((k, false));
                    }
                }
                continue;
            }
            let v = match node {
                TensorLang::Project { index, .. } => ValueId::new(memo[&kids[0]].node, *index),
                TensorLang::Op { op, .. } => {
                    let operands: Vec<ValueId> = kids.iter().map(|k| memo[k]).collect();
                    let op = to_op(op, &operands).ok_or_else(|| bug("operand count differs from the op's"))?;
                    if matches!(op, Op::Parameter { .. }) {
                        return Err(bug("a parameter chosen for a class other than its own"));
                    }
                    ValueId::from(out.add(op)?)
                }
            };
            marks.insert(c, Mark::Done);
            memo.insert(c, v);
        }
    }
    let outputs = roots.iter().map(|r| memo[&eg.find(*r)]).collect();
    out.set_outputs(outputs)?;
    for &a in original.aliases() {
        out.add_alias(Alias { ..a })?;
    }
    Ok(out)
}
