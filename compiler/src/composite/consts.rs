//! Reading constant subgraphs by value, for the matchers.
//!
//! A matcher that must know what a value *is* (a scale of 0.125, a causal
//! mask) does not trust its spelling: it copies the value's ancestor cone
//! into a small graph and runs the reference interpreter on it. Two things
//! keep that linear in the step, whatever the model:
//! - the cone is walked from the value up, never over the whole graph, and a
//!   cone that reaches a parameter, a generator or a collective, or that is
//!   larger than [`CONE_NODES`], is not a constant (the caller treats it as
//!   data);
//! - what a table evaluates to is remembered in a [`ConstCache`] keyed by the
//!   cone's structure (its ops with operands renumbered), which the caller
//!   keeps across steps: a decoder's causal mask is evaluated once per
//!   process, not once per layer and step.
//!
//! Invariants: pure functions of the graph and the cache; the cache holds
//! summaries, never graph ids, so one cache serves any graph; it is bounded
//! ([`CACHE_ENTRIES`]).

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::interp::interpret;
use crate::ir::{Graph, Literal, NodeId, Op, ValueId};

/// The largest cone read as a constant. Masks and scales are a handful of
/// nodes (iota, compare, broadcast, convert); a larger cone is data.
pub const CONE_NODES: usize = 64;

/// The largest constant table evaluated (elements): 4096 × 4096.
pub const TABLE_ELEMENTS: usize = 1 << 24;

/// Entries a [`ConstCache`] keeps before it starts over.
pub const CACHE_ENTRIES: usize = 1024;

/// Below this, an additive term or a select's value counts as "masked out"
/// (exp(-1e4) underflows even in f32 relative to any unmasked score).
pub const MASKED: f64 = -1e4;

/// What a constant `[t, s]` table holds, read as a pred (non-zero is true) and
/// as an additive term.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableClass {
    pub pred: PredTable,
    pub additive: AdditiveTable,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PredTable {
    AllTrue,
    AllFalse,
    /// True exactly where key `j <= i` (the causal triangle).
    Lower,
    /// True exactly where key `j > i` (its complement).
    Upper,
    Other,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdditiveTable {
    AllZero,
    /// 0 where `j <= i`, at most [`MASKED`] elsewhere.
    Causal,
    Other,
}

impl TableClass {
    fn of(values: &[f64], t: usize, s: usize) -> TableClass {
        let lower = |i: usize, j: usize| j <= i;
        let truth = |x: f64| x != 0.0;
        let all = |f: &dyn Fn(usize, usize, f64) -> bool| (0..t).all(|i| (0..s).all(|j| f(i, j, values[i * s + j])));
        let pred = if all(&|_, _, x| truth(x)) {
            PredTable::AllTrue
        } else if all(&|_, _, x| !truth(x)) {
            PredTable::AllFalse
        } else if all(&|i, j, x| truth(x) == lower(i, j)) {
            PredTable::Lower
        } else if all(&|i, j, x| truth(x) != lower(i, j)) {
            PredTable::Upper
        } else {
            PredTable::Other
        };
        let additive = if all(&|_, _, x| x == 0.0) {
            AdditiveTable::AllZero
        } else if all(&|i, j, x| if lower(i, j) { x == 0.0 } else { x <= MASKED }) {
            AdditiveTable::Causal
        } else {
            AdditiveTable::Other
        };
        TableClass { pred, additive }
    }
}

/// Summaries of constant cones already evaluated, by structure. Owned by the
/// caller (the frontend keeps one per thread), so that the compiler stays
/// free of global state.
#[derive(Debug, Default)]
pub struct ConstCache {
    tables: HashMap<u64, Option<TableClass>>,
    scalars: HashMap<u64, Option<f64>>,
    /// Evaluations run (cache misses), for tests and benchmarks.
    pub evaluations: u64,
}

impl ConstCache {
    pub fn new() -> ConstCache {
        ConstCache::default()
    }

    fn bound(&mut self) {
        if self.tables.len() + self.scalars.len() >= CACHE_ENTRIES {
            self.tables.clear();
            self.scalars.clear();
        }
    }
}

/// `v`'s ancestor cone copied into a graph of its own (outputs: `v`), with
/// its structural key, if `v` is a constant of at most [`CONE_NODES`] nodes.
struct Cone {
    sub: Graph,
    key: u64,
}

fn cone(g: &Graph, v: ValueId) -> Option<Cone> {
    // Collect the cone by a walk up from `v`; sort it into insertion order.
    let mut nodes: Vec<NodeId> = vec![v.node];
    let mut stack = vec![v.node];
    while let Some(n) = stack.pop() {
        let op = &g.node(n).op;
        if matches!(op, Op::Parameter { .. } | Op::RngBitGenerator { .. }) || op.is_collective() {
            return None;
        }
        for x in op.inputs() {
            if !nodes.contains(&x.node) {
                if nodes.len() == CONE_NODES {
                    return None;
                }
                nodes.push(x.node);
                stack.push(x.node);
            }
        }
    }
    nodes.sort_unstable();
    let mut sub = Graph::new();
    let mut map: Vec<(NodeId, NodeId)> = Vec::with_capacity(nodes.len());
    let mut h = DefaultHasher::new();
    for &n in &nodes {
        let mut op = g.node(n).op.clone();
        op.map_inputs(|x| {
            let at = map.binary_search_by_key(&x.node, |&(old, _)| old).expect("operands come first");
            ValueId::new(map[at].1, x.output)
        });
        op.hash(&mut h);
        map.push((n, sub.add(op).ok()?));
    }
    let at = map.binary_search_by_key(&v.node, |&(old, _)| old).ok()?;
    let out = ValueId::new(map[at].1, v.output);
    out.hash(&mut h);
    sub.set_outputs(vec![out]).ok()?;
    Some(Cone { sub, key: h.finish() })
}

/// The value of `v` if it is computed from constants alone, in at most
/// [`CONE_NODES`] nodes and [`TABLE_ELEMENTS`] elements, evaluated by the
/// reference interpreter (uncached: the lowering's guard asks once per
/// division); `None` otherwise, or if the interpreter refuses it.
pub fn constant_value(g: &Graph, v: ValueId) -> Option<Literal> {
    if let Op::Constant { literal } = &g.node(v.node).op {
        return Some(literal.clone());
    }
    if g.ty(v).shape.num_elements() > TABLE_ELEMENTS {
        return None;
    }
    evaluate(&cone(g, v)?)
}

fn evaluate(c: &Cone) -> Option<Literal> {
    interpret(&c.sub, &[]).ok()?.pop()
}

/// What a chain of broadcasts and reshapes ending at `v` reads: the values
/// `v` holds, as a set (a broadcast repeats them, a reshape moves them).
pub fn through_broadcasts(g: &Graph, v: ValueId) -> ValueId {
    let mut x = v;
    while let Op::BroadcastInDim { input, .. } | Op::Reshape { input, .. } = &g.node(x.node).op {
        x = *input;
    }
    x
}

/// The value of `v` if it is a constant whose elements are all equal (a
/// splat, however it is spelled: a broadcast scalar, `sqrt(64)`, a converted
/// literal).
pub fn splat_value(g: &Graph, v: ValueId, cache: &mut ConstCache) -> Option<f64> {
    // A broadcast or reshape of a smaller value is a splat if that value is.
    let x = through_broadcasts(g, v);
    if let Op::Constant { literal } = &g.node(x.node).op {
        return (literal.is_splat() && literal.ty().shape.num_elements() > 0).then(|| literal.to_f64s()[0]);
    }
    if g.ty(x).shape.num_elements() != 1 {
        return None;
    }
    let c = cone(g, x)?;
    if let Some(hit) = cache.scalars.get(&c.key) {
        return *hit;
    }
    cache.bound();
    cache.evaluations += 1;
    let value = evaluate(&c).map(|l| l.to_f64s()[0]);
    cache.scalars.insert(c.key, value);
    value
}

/// What a rank-4 `[b, h, t, s]` value holds when it is a constant that varies
/// only over its last two axes (a broadcast `[t, s]` table, or a value whose
/// batch and head axes have size 1); `None` if it is not one.
pub fn table(g: &Graph, v: ValueId, cache: &mut ConstCache) -> Option<TableClass> {
    let ty = g.ty(v);
    let d = ty.shape.dims();
    let (t, s) = (d[2], d[3]);
    if t * s > TABLE_ELEMENTS {
        return None;
    }
    let source = match &g.node(v.node).op {
        Op::BroadcastInDim { input, dims, .. } => {
            let it = g.ty(*input);
            // Only dimensions mapped to the query and key axes may be non-1,
            // and they must keep the full sizes.
            let ok = dims.iter().zip(it.shape.dims()).all(|(&to, &n)| match to {
                2 => n == t,
                3 => n == s,
                _ => n == 1,
            }) && dims.contains(&2)
                && dims.contains(&3);
            if !ok {
                return None;
            }
            *input
        }
        _ if d[0] * d[1] == 1 => v,
        _ => return None,
    };
    let c = cone(g, source)?;
    if let Some(hit) = cache.tables.get(&c.key) {
        return *hit;
    }
    cache.bound();
    cache.evaluations += 1;
    let class = evaluate(&c).and_then(|l| {
        let values = l.to_f64s();
        (values.len() == t * s).then(|| TableClass::of(&values, t, s))
    });
    cache.tables.insert(c.key, class);
    class
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{CompareDir, DType, Shape, TensorType};

    fn causal(g: &mut Graph, t: usize, dir: CompareDir) -> ValueId {
        let it = TensorType::new(DType::I32, vec![t, t]);
        let rows = g.value(Op::Iota { ty: it.clone(), axis: 0 }).unwrap();
        let cols = g.value(Op::Iota { ty: it, axis: 1 }).unwrap();
        let c = g.value(Op::Compare { dir, lhs: cols, rhs: rows }).unwrap();
        let shape = Shape::from(vec![2, 3, t, t]);
        g.value(Op::BroadcastInDim { input: c, shape, dims: vec![2, 3] }).unwrap()
    }

    #[test]
    fn tables_are_read_by_value_and_evaluated_once_per_structure() {
        let mut g = Graph::new();
        let mut cache = ConstCache::new();
        let a = causal(&mut g, 5, CompareDir::Le);
        let b = causal(&mut g, 5, CompareDir::Le);
        let c = causal(&mut g, 5, CompareDir::Gt);
        assert_eq!(table(&g, a, &mut cache).map(|c| c.pred), Some(PredTable::Lower));
        assert_eq!(table(&g, b, &mut cache).map(|c| c.pred), Some(PredTable::Lower));
        assert_eq!(cache.evaluations, 1, "the same structure is evaluated once");
        assert_eq!(table(&g, c, &mut cache).map(|c| c.pred), Some(PredTable::Upper));
        assert_eq!(cache.evaluations, 2);
    }

    #[test]
    fn a_cone_with_a_parameter_is_data() {
        let mut g = Graph::new();
        let mut cache = ConstCache::new();
        let p = g.parameter(TensorType::new(DType::Pred, vec![4, 4]));
        let shape = Shape::from(vec![1, 1, 4, 4]);
        let m = g.value(Op::BroadcastInDim { input: p, shape, dims: vec![2, 3] }).unwrap();
        assert_eq!(table(&g, m, &mut cache), None);
        assert_eq!(cache.evaluations, 0);
    }

    #[test]
    fn splats_are_read_through_their_spelling() {
        let mut g = Graph::new();
        let mut cache = ConstCache::new();
        let c = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 64.0) }).unwrap();
        let r = g.value(Op::Unary { op: crate::ir::UnaryOp::Rsqrt, input: c }).unwrap();
        let shape = Shape::from(vec![2, 2]);
        let b = g.value(Op::BroadcastInDim { input: r, shape, dims: vec![] }).unwrap();
        assert_eq!(splat_value(&g, b, &mut cache), Some(0.125));
    }
}
