//! Loop kernels of kiln's own on the CUDA target: a column sum and the
//! elementwise work around it, run as one Triton kernel (`ttir.rs` writes it,
//! `emit.rs` calls it through XLA's `__gpu$xla.gpu.triton` custom call).
//!
//! Why: a bias gradient is the sum over the tokens of a value that the
//! backward computes elementwise. When remat recomputes a GELU for that
//! backward, XLA's CUDA backend makes the recomputation, the backward and the
//! sum one reduction kernel with several outputs, and that kernel runs at
//! about 2.0 TB/s where a loop kernel reaches 2.8 (gpt2-small on the H100:
//! 102 µs a layer against 72; `docs/memory-journal.md`, "The bias gradient split off
//! a recomputed GELU"). Two clones of one chain, each behind its own barrier,
//! also make XLA compute the chain twice. The kernel here tiles the rows and
//! columns, computes the elementwise body once per element (common
//! subexpressions merged, barrier outputs of one value read once), writes the
//! values the rest of the step reads and one row of column sums per tile of
//! rows; XLA adds those rows up.
//!
//! What is taken (everything else stays XLA's):
//! - a `reduce sum` of a floating value over every axis but the last;
//! - the elementwise nodes its operand is made of, back to values that are
//!   not elementwise (a GEMM, a barrier, a parameter): `add`, `sub`, `mul`,
//!   `div`, `neg`, `exp`, `tanh` and float converts, all of the operand's
//!   shape; broadcasts of scalar constants; broadcasts of a vector along the
//!   last axis, whose converts are taken too;
//! - then the elementwise nodes computable from what is taken whose results
//!   leave for a non-elementwise reader (the GELU output a weight gradient
//!   reads);
//! - only where the body recomputes a transcendental (where XLA's kernel is
//!   slow; a body without one is left to XLA), and only when taking it cannot
//!   make a cycle (no path leaves the kernel and comes back).
//!
//! Semantics: every value is computed in f32 and rounded to its node's dtype
//! only where the graph converts and where it is stored. That is more
//! precise than the graph's 16-bit ops say: the interpreter and XLA's CUDA
//! kernels round after every bf16 op (XLA's optimized module of the step keeps
//! them as bf16 multiplies and adds). The kernel's values are at least as
//! close to f64 as the interpreter's (tested below), and a build that rounded
//! after every op was 5 µs a layer slower on the H100 (82.6 against 77.2 µs).
//! `tanh` uses [`tanh`]'s formula (within 5e-7 relative of the exact value in
//! f32). The column sums are f32 sums of the unrounded values, added in
//! another order than XLA's reduction.

use std::collections::HashMap;

use crate::ir::{BinaryOp, CompareDir, DType, Graph, NodeId, Op, ReduceOp, UnaryOp, ValueId};

/// Where a kernel value varies: over the tile (`Full`), along the columns
/// only (`Row`: a vector broadcast over the rows) or nowhere (`Scalar`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Space {
    Scalar,
    Row,
    Full,
}

/// One instruction of a kernel's body. Operands are earlier instructions.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Inst {
    /// The kernel's `k`-th operand, read in its dtype.
    Load(usize),
    /// A scalar constant (f64 bits), already of the instruction's dtype.
    Const(u64),
    Unary(UnaryOp, usize),
    Binary(BinaryOp, usize, usize),
    /// To the instruction's dtype.
    Convert(usize),
}

/// An instruction with the dtype its result is rounded to and its space.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Step {
    pub inst: Inst,
    pub dtype: DType,
    pub space: Space,
}

/// An operand of the custom call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Input {
    /// The graph value passed (a barrier's output is passed as it is).
    pub value: ValueId,
    pub space: Space,
    pub dtype: DType,
}

/// One loop kernel: what it reads, computes and writes, and the graph nodes
/// it stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Kernel {
    /// The product of the leading dimensions.
    pub rows: usize,
    /// The last dimension.
    pub cols: usize,
    /// Rows and columns of one tile: a program computes `chunks` tiles, one
    /// below the other, adding their values column by column as it goes.
    pub block: (usize, usize),
    pub chunks: usize,
    pub inputs: Vec<Input>,
    pub body: Vec<Step>,
    /// What the kernel writes, in the order of the call's results: a body
    /// step and the graph values (full-shaped) it holds. Values the body
    /// merged into one step are written once.
    pub stores: Vec<(usize, Vec<ValueId>)>,
    /// The `reduce` node replaced and the step whose column sums it takes.
    pub sum: (NodeId, usize),
    /// Every node the call stands for (the reduce included), ascending.
    pub members: Vec<NodeId>,
}

impl Kernel {
    /// Rows of one program.
    pub fn program_rows(&self) -> usize {
        self.block.0 * self.chunks
    }

    /// Rows of column sums the kernel writes (one per program row).
    pub fn partial_rows(&self) -> usize {
        self.rows / self.program_rows()
    }

    /// The program grid: programs down the rows, across the columns.
    pub fn grid(&self) -> (usize, usize) {
        (self.partial_rows(), self.cols / self.block.1)
    }
}

/// Tile rows; columns tried, widest first (a tile of 1024 elements is 8 a
/// thread at 4 warps, as Triton's elementwise kernels run); tiles a program
/// computes, most first (fewer rows of column sums).
const TILE_ROWS: usize = 8;
const TILE_COLS: [usize; 3] = [128, 64, 32];
const CHUNKS: [usize; 6] = [32, 16, 8, 4, 2, 1];

/// Programs a grid should have at least (132 SMs on the H100, several
/// programs each), so a program takes fewer tiles where there are few rows.
const MIN_PROGRAMS: usize = 512;

/// The smallest region taken, in elements. The kernel saves about a fifth
/// of the region's traffic time (2.5 against 2.0 TB/s) and costs a launch
/// more (the sums' reduce, a few µs): at GELU's backward's 8 bytes an
/// element the two meet near 4 M elements. gpt2-small's regions have 25 M.
/// The tiny GPT's have 131 K: a build without this bound (and with 32 tiles
/// a program, so four programs a kernel) read 1.043 against 0.666 ms a step
/// in bf16 and 0.814 against 1.715 ms in f16 on the H100, single runs of a
/// launch-bound step, where nothing was to be gained.
const MIN_ELEMENTS: usize = 1 << 22;

/// The tile width and the tiles a program takes for a `rows` x `cols`
/// region, `None` where no tile divides it: the widest tile; the most tiles
/// a program that still leave [`MIN_PROGRAMS`] programs, else one.
fn tiling(rows: usize, cols: usize) -> Option<(usize, usize)> {
    let bn = TILE_COLS.into_iter().find(|bn| cols % bn == 0)?;
    let fits = |c: &usize| rows % (TILE_ROWS * c) == 0;
    let chunks = CHUNKS
        .into_iter()
        .filter(fits)
        .find(|c| rows / (TILE_ROWS * c) * (cols / bn) >= MIN_PROGRAMS)
        .or_else(|| CHUNKS.into_iter().rev().find(fits))?;
    Some((bn, chunks))
}

/// The loop kernels of `g`'s live nodes, their members disjoint, in the order
/// of their reduces.
pub(crate) fn find(g: &Graph, live: &[bool]) -> Vec<Kernel> {
    find_with(g, live, MIN_ELEMENTS)
}

/// [`find`], taking regions of `min_elements` or more.
fn find_with(g: &Graph, live: &[bool], min_elements: usize) -> Vec<Kernel> {
    let users = users_of(g, live);
    let mut output = vec![false; g.len()];
    for v in g.outputs() {
        output[v.node.index()] = true;
    }
    let mut taken = vec![false; g.len()];
    let mut kernels = Vec::new();
    for (id, node) in g.nodes() {
        if !live[id.index()] {
            continue;
        }
        let finder = Finder { g, live, users: &users, output: &output, taken: &taken, min_elements };
        if let Some(k) = finder.kernel(id, &node.op) {
            for m in &k.members {
                taken[m.index()] = true;
            }
            kernels.push(k);
        }
    }
    kernels
}

/// Live readers of each node, ascending, without repeats.
fn users_of(g: &Graph, live: &[bool]) -> Vec<Vec<NodeId>> {
    let mut users = vec![Vec::new(); g.len()];
    for (id, node) in g.nodes() {
        if live[id.index()] {
            for v in node.op.inputs() {
                let u = &mut users[v.node.index()];
                if u.last() != Some(&id) {
                    u.push(id);
                }
            }
        }
    }
    users
}

/// Whether `op` is an elementwise op the kernel computes.
fn elementwise(op: &Op) -> bool {
    match op {
        Op::Unary { op, .. } => matches!(op, UnaryOp::Neg | UnaryOp::Exp | UnaryOp::Tanh),
        Op::Binary { op, .. } => matches!(op, BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div),
        Op::Convert { .. } => true,
        _ => false,
    }
}

fn float(d: DType) -> bool {
    matches!(d, DType::BF16 | DType::F16 | DType::F32)
}

struct Finder<'a> {
    g: &'a Graph,
    live: &'a [bool],
    users: &'a [Vec<NodeId>],
    /// Whether a node's value is one of the graph's outputs.
    output: &'a [bool],
    taken: &'a [bool],
    min_elements: usize,
}

impl<'a> Finder<'a> {
    /// A full-shaped elementwise node the kernel may compute.
    fn member(&self, v: ValueId, shape: &crate::ir::Shape) -> bool {
        let node = self.g.node(v.node);
        let t = &node.outputs[0];
        self.live[v.node.index()]
            && !self.taken[v.node.index()]
            && elementwise(&node.op)
            && &t.shape == shape
            && float(t.dtype)
            && node.op.inputs().iter().all(|x| float(self.g.ty(*x).dtype))
    }

    fn kernel(&self, id: NodeId, op: &Op) -> Option<Kernel> {
        let Op::Reduce { op: ReduceOp::Sum, input, axes } = op else { return None };
        let t = self.g.ty(*input);
        let rank = t.shape.rank();
        if rank < 2 || !float(t.dtype) || *axes != (0..rank - 1).collect::<Vec<_>>() || self.taken[id.index()] {
            return None;
        }
        let dims = t.shape.dims();
        let cols = dims[rank - 1];
        let rows: usize = dims[..rank - 1].iter().product();
        if rows.checked_mul(cols)? >= i32::MAX as usize {
            return None;
        }
        if rows * cols < self.min_elements {
            return None;
        }
        let (bn, chunks) = tiling(rows, cols)?;
        let block = (TILE_ROWS, bn);
        let shape = t.shape.clone();
        // The cone of the reduce's operand.
        let mut inside: Vec<NodeId> = Vec::new();
        let mut stack = vec![*input];
        while let Some(v) = stack.pop() {
            if inside.contains(&v.node) || !self.member(v, &shape) {
                continue;
            }
            inside.push(v.node);
            stack.extend(self.g.node(v.node).op.inputs());
        }
        if inside.is_empty() {
            return None;
        }
        // Every leaf the cone reads must be loadable (checked on a builder
        // that is thrown away: the body is built once the members are known).
        let mut probe = Builder::new(self);
        for &n in &inside {
            for x in self.g.node(n).op.inputs() {
                if !inside.contains(&x.node) && probe.leaf(x, &shape).is_none() {
                    return None;
                }
            }
        }
        // Siblings: readers computable from what is taken, kept when their
        // result leaves for a non-elementwise reader.
        let first = *inside.iter().min()?;
        let mut extra: Vec<NodeId> = Vec::new();
        let computable = |n: NodeId, inside: &[NodeId], extra: &[NodeId], b: &mut Builder| {
            self.g
                .node(n)
                .op
                .inputs()
                .iter()
                .all(|x| inside.contains(&x.node) || extra.contains(&x.node) || b.constant_or_row(*x, &shape))
        };
        for i in first.index()..self.g.len() {
            let n = NodeId::from_index(i);
            if n == id || inside.contains(&n) || !self.member(n.into(), &shape) {
                continue;
            }
            if computable(n, &inside, &extra, &mut probe) {
                extra.push(n);
            }
        }
        // Keep a sibling only where it is needed by a kept one or read by a
        // node that is not elementwise.
        let mut keep = vec![false; extra.len()];
        for j in (0..extra.len()).rev() {
            let n = extra[j];
            keep[j] = self.users[n.index()].iter().any(|u| {
                if let Some(k) = extra.iter().position(|e| e == u) {
                    keep[k]
                } else {
                    !inside.contains(u) && !elementwise(&self.g.node(*u).op)
                }
            }) || self.output[n.index()];
        }
        let extra: Vec<NodeId> = extra.into_iter().zip(keep).filter(|(_, k)| *k).map(|(n, _)| n).collect();
        let mut members: Vec<NodeId> = inside.iter().chain(&extra).copied().collect();
        members.push(id);
        members.sort();
        // No path may leave the kernel and come back.
        if self.cycle(&members) {
            return None;
        }
        // The body, in node order, and what leaves it.
        let mut b = Builder::new(self);
        let mut stores: Vec<(usize, Vec<ValueId>)> = Vec::new();
        for &n in &members {
            if n == id {
                continue;
            }
            let step = b.value(n.into(), &shape)?;
            let read_outside =
                self.users[n.index()].iter().any(|u| members.binary_search(u).is_err()) || self.output[n.index()];
            if read_outside {
                match stores.iter_mut().find(|(s, _)| *s == step) {
                    Some((_, values)) => values.push(n.into()),
                    None => stores.push((step, vec![n.into()])),
                }
            }
        }
        let sum = b.value(*input, &shape)?;
        let transcendental = b
            .body
            .iter()
            .any(|s| matches!(s.inst, Inst::Unary(UnaryOp::Tanh | UnaryOp::Exp, _)) && s.space == Space::Full);
        if !transcendental || stores.is_empty() || b.body.len() > 256 {
            return None;
        }
        Some(Kernel { rows, cols, block, chunks, inputs: b.inputs, body: b.body, stores, sum: (id, sum), members })
    }

    /// Whether a path from a member through non-members reaches a member.
    fn cycle(&self, members: &[NodeId]) -> bool {
        let last = *members.last().expect("members");
        let mut seen = vec![false; last.index() + 1];
        let mut stack: Vec<NodeId> = members
            .iter()
            .flat_map(|m| self.users[m.index()].iter().copied())
            .filter(|u| members.binary_search(u).is_err() && *u < last)
            .collect();
        while let Some(n) = stack.pop() {
            if seen[n.index()] {
                continue;
            }
            seen[n.index()] = true;
            for &u in &self.users[n.index()] {
                if members.binary_search(&u).is_ok() {
                    return true;
                }
                if u < last && !seen[u.index()] {
                    stack.push(u);
                }
            }
        }
        false
    }
}

/// Builds a kernel's body with common subexpressions merged.
struct Builder<'f, 'a> {
    f: &'f Finder<'a>,
    inputs: Vec<Input>,
    body: Vec<Step>,
    memo: HashMap<Step, usize>,
    /// Step of each graph value already built.
    built: HashMap<ValueId, usize>,
    /// Input index of each source value (barrier outputs resolved).
    loaded: HashMap<ValueId, usize>,
}

impl<'f, 'a> Builder<'f, 'a> {
    fn new(f: &'f Finder<'a>) -> Self {
        Builder {
            f,
            inputs: Vec::new(),
            body: Vec::new(),
            memo: HashMap::new(),
            built: HashMap::new(),
            loaded: HashMap::new(),
        }
    }

    fn push(&mut self, inst: Inst, dtype: DType, space: Space) -> usize {
        let step = Step { inst, dtype, space };
        if let Some(&i) = self.memo.get(&step) {
            return i;
        }
        self.body.push(step.clone());
        self.memo.insert(step, self.body.len() - 1);
        self.body.len() - 1
    }

    /// The value an optimization barrier's output carries, through barriers.
    fn source(&self, mut v: ValueId) -> ValueId {
        while let Op::OptimizationBarrier { inputs } = &self.f.g.node(v.node).op {
            v = inputs[v.output as usize];
        }
        v
    }

    fn load(&mut self, v: ValueId, space: Space) -> usize {
        let src = self.source(v);
        let dtype = self.f.g.ty(v).dtype;
        let k = match self.loaded.get(&src) {
            Some(&k) => k,
            None => {
                self.inputs.push(Input { value: v, space, dtype });
                self.loaded.insert(src, self.inputs.len() - 1);
                self.inputs.len() - 1
            }
        };
        self.push(Inst::Load(k), dtype, space)
    }

    /// Whether `v` is a broadcast constant or a broadcast row, which any
    /// kernel can compute without a new full-shaped input.
    fn constant_or_row(&mut self, v: ValueId, shape: &crate::ir::Shape) -> bool {
        matches!(self.f.g.node(v.node).op, Op::BroadcastInDim { .. }) && self.leaf(v, shape).is_some()
    }

    /// A value the cone reads but does not compute: a broadcast scalar
    /// constant, a broadcast row, or a full-shaped value loaded.
    fn leaf(&mut self, v: ValueId, shape: &crate::ir::Shape) -> Option<usize> {
        if let Some(&s) = self.built.get(&v) {
            return Some(s);
        }
        let g = self.f.g;
        let t = g.ty(v).clone();
        if !float(t.dtype) {
            return None;
        }
        let s = match &g.node(v.node).op {
            Op::BroadcastInDim { input, dims, .. } if &t.shape == shape => {
                let it = g.ty(*input);
                if it.shape.rank() == 0 {
                    self.scalar(*input)?
                } else if it.shape.rank() == 1 && dims[..] == [shape.rank() - 1] {
                    self.row(*input)?
                } else {
                    return None;
                }
            }
            _ if &t.shape == shape => self.load(v, Space::Full),
            _ => return None,
        };
        self.built.insert(v, s);
        Some(s)
    }

    /// A scalar constant.
    fn scalar(&mut self, v: ValueId) -> Option<usize> {
        let g = self.f.g;
        let t = g.ty(v);
        match &g.node(v.node).op {
            Op::Constant { literal } if literal.ty().shape.rank() == 0 && float(t.dtype) => {
                let x = literal.to_f64s()[0];
                Some(self.push(Inst::Const(x.to_bits()), t.dtype, Space::Scalar))
            }
            _ => None,
        }
    }

    /// A vector along the columns: its float converts are computed, any other
    /// producer's value is loaded. A `select` whose predicate is `x == x or
    /// x != x` (true for every x: the remat guards' form) is its true operand.
    fn row(&mut self, v: ValueId) -> Option<usize> {
        let g = self.f.g;
        let t = g.ty(v).clone();
        if !float(t.dtype) {
            return None;
        }
        match &g.node(v.node).op {
            Op::Convert { input, .. } if float(g.ty(*input).dtype) => {
                let x = self.row(*input)?;
                Some(self.push(Inst::Convert(x), t.dtype, Space::Row))
            }
            Op::Select { pred, on_true, .. } if self.always_true(*pred) => self.row(*on_true),
            Op::Constant { .. } | Op::Iota { .. } => None,
            _ => Some(self.load(v, Space::Row)),
        }
    }

    /// `x == x or x != x`, true for every x, NaN included.
    fn always_true(&self, p: ValueId) -> bool {
        let g = self.f.g;
        let Op::Binary { op: BinaryOp::Or, lhs, rhs } = &g.node(p.node).op else { return false };
        let cmp = |v: &ValueId| match &g.node(v.node).op {
            Op::Compare { dir, lhs, rhs } if lhs == rhs => Some(*dir),
            _ => None,
        };
        let same = |a: &ValueId, b: &ValueId| match (&g.node(a.node).op, &g.node(b.node).op) {
            (Op::Compare { lhs: x, .. }, Op::Compare { lhs: y, .. }) => x == y,
            _ => false,
        };
        matches!(
            (cmp(lhs), cmp(rhs)),
            (Some(CompareDir::Eq), Some(CompareDir::Ne)) | (Some(CompareDir::Ne), Some(CompareDir::Eq))
        ) && same(lhs, rhs)
    }

    /// The step computing `v` (a member, or a leaf).
    fn value(&mut self, v: ValueId, shape: &crate::ir::Shape) -> Option<usize> {
        if let Some(&s) = self.built.get(&v) {
            return Some(s);
        }
        let g = self.f.g;
        let node = g.node(v.node);
        if !self.f.member(v, shape) {
            return self.leaf(v, shape);
        }
        let dtype = node.outputs[0].dtype;
        let s = match &node.op {
            Op::Unary { op, input } => {
                let x = self.value(*input, shape)?;
                let space = self.body[x].space;
                self.push(Inst::Unary(*op, x), dtype, space)
            }
            Op::Binary { op, lhs, rhs } => {
                let (a, b) = (self.value(*lhs, shape)?, self.value(*rhs, shape)?);
                let space = self.body[a].space.max(self.body[b].space);
                self.push(Inst::Binary(*op, a, b), dtype, space)
            }
            Op::Convert { input, .. } => {
                let x = self.value(*input, shape)?;
                let space = self.body[x].space;
                self.push(Inst::Convert(x), dtype, space)
            }
            _ => return None,
        };
        self.built.insert(v, s);
        Some(s)
    }
}

/// Below this `|z|` the kernel's `tanh` is its Taylor polynomial.
pub(crate) const TANH_SMALL: f32 = 0.0625;
/// `-1/3` and `2/15`, the polynomial's coefficients.
pub(crate) const TANH_C3: f32 = -1.0 / 3.0;
pub(crate) const TANH_C5: f32 = 2.0 / 15.0;

#[cfg(test)]
mod tests;
