//! The text of each op: one exhaustive match over [`Op`], plus the module and
//! function frame around it.
//!
//! Invariant: every line written here is accepted by XLA's StableHLO parser
//! for any node that passed shape inference (checked by compiling the lowered
//! text of every op through the XLA CPU plugin). Where a kiln op has no direct
//! StableHLO equivalent for some dtype, the lowering writes the small
//! expansion next to it, with helper names derived from the node.

use std::fmt::{Display, Write};

use super::dense::{constant_form, dense, dense_hex, identity, ConstantForm, LARGE_CONSTANT_BYTES};
use super::loop_kernel::Kernel;
use crate::ir::{
    BinaryOp, DType, DotDims, Graph, Literal, Node, NodeId, Op, ReduceOp, Shape, TensorType, UnaryOp, ValueId,
};
use crate::CompileError;

/// Indentation of the function body.
const BODY: &str = "    ";

/// Writes the whole module of a prepared graph ([`super::prepare`]): the
/// nodes and the loop kernels in the order the preparation found.
pub(super) fn module(p: &super::Prepared) -> Result<String, CompileError> {
    let (g, opts) = (&p.graph, &p.options);
    let mut e = Emitter {
        g,
        num_replicas: opts.num_replicas,
        target: opts.target,
        partitioned: opts.shardings.is_some(),
        attention: match opts.target {
            crate::target::LowerTarget::Cuda => opts.shardings.as_ref().and_then(|s| s.attention.clone()),
            crate::target::LowerTarget::Cpu => None,
        },
        names: vec![Vec::new(); g.len()],
        out: String::new(),
    };
    // MLIR prints attribute dictionaries sorted by name; so do we (JAX's order).
    let _ = writeln!(
        e.out,
        "module @kiln attributes {{mhlo.num_partitions = {} : i32, mhlo.num_replicas = {} : i32}} {{",
        opts.shardings.as_ref().map_or(1, |s| s.num_partitions),
        opts.num_replicas
    );
    e.signature(opts.shardings.as_ref());
    let kernels = &p.kernels;
    for &item in &p.items {
        match item {
            Item::Node(id) => e.node(id, g.node(id))?,
            Item::Kernel(k) => e.loop_kernel(&kernels[k]),
        }
    }
    let results: Vec<String> = g.outputs().iter().map(|&v| e.name(v)).collect();
    if results.is_empty() {
        e.line("return".to_string());
    } else {
        let line = format!("return {} : {}", results.join(", "), join(g.output_types()));
        e.line(line);
    }
    e.out.push_str("  }\n}\n");
    Ok(e.out)
}

/// What the module writes, one at a time: a node, or a loop kernel that
/// stands for several.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Item {
    Node(NodeId),
    Kernel(usize),
}

/// The loop kernels of `g` that can be written in one order, and that order:
/// the finder takes no region that makes a cycle by itself, but two kernels,
/// each one item, could wait for each other through nodes outside both; the
/// later kernels give way until the order exists (without kernels it always
/// does: insertion order is topological).
pub(super) fn kernels_in_order(g: &Graph, live: &[bool], mut kernels: Vec<Kernel>) -> (Vec<Kernel>, Vec<Item>) {
    loop {
        match order(g, live, &kernels) {
            Some(items) => return (kernels, items),
            None => {
                kernels.pop();
            }
        }
    }
}

/// The order the module writes nodes and kernels in: insertion order without
/// kernels; with them, a topological order of the nodes and the kernels (each
/// kernel one item) that takes the lowest ready node id first and a kernel as
/// soon as its operands are written, since a reader of a kernel's value can
/// come before the kernel's last member (and a kernel's operand after its
/// first). `None` if the kernels make a cycle.
fn order(g: &Graph, live: &[bool], kernels: &[Kernel]) -> Option<Vec<Item>> {
    if kernels.is_empty() {
        let wanted = |id: NodeId| live[id.index()] || matches!(g.node(id).op, Op::Parameter { .. });
        return Some(g.nodes().map(|(id, _)| id).filter(|&id| wanted(id)).map(Item::Node).collect());
    }
    let mut owner: Vec<Option<usize>> = vec![None; g.len()];
    for (k, kernel) in kernels.iter().enumerate() {
        for m in &kernel.members {
            owner[m.index()] = Some(k);
        }
    }
    let item = |id: NodeId| owner[id.index()].map_or(Item::Node(id), Item::Kernel);
    // What is still read: the outputs, the kernels' operands and what those
    // read, but not what only the kernels' members read (a remat guard, the
    // constants the kernel holds).
    let mut read = vec![false; g.len()];
    for v in g.outputs() {
        read[v.node.index()] = true;
    }
    for v in kernels.iter().flat_map(|k| &k.inputs) {
        read[v.value.node.index()] = true;
    }
    for i in (0..g.len()).rev() {
        if read[i] && owner[i].is_none() {
            for v in g.node(NodeId::from_index(i)).op.inputs() {
                read[v.node.index()] = true;
            }
        }
    }
    let kept =
        |id: NodeId| owner[id.index()].is_none() && (read[id.index()] || matches!(g.node(id).op, Op::Parameter { .. }));
    // Each item's key (where it would come in insertion order) and the items it waits for.
    let mut items: Vec<Item> = g.nodes().map(|(id, _)| id).filter(|&id| kept(id)).map(Item::Node).collect();
    items.extend((0..kernels.len()).map(Item::Kernel));
    let key = |it: Item| match it {
        Item::Node(id) => id.index(),
        Item::Kernel(k) => kernels[k].members[0].index(),
    };
    let index: std::collections::HashMap<Item, usize> = items.iter().enumerate().map(|(i, &it)| (it, i)).collect();
    let mut waits = vec![0usize; items.len()];
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); items.len()];
    for (i, &it) in items.iter().enumerate() {
        let reads: Vec<ValueId> = match it {
            Item::Node(id) => g.node(id).op.inputs().to_vec(),
            Item::Kernel(k) => kernels[k].inputs.iter().map(|i| i.value).collect(),
        };
        let mut deps: Vec<Item> = reads.iter().map(|v| item(v.node)).filter(|&d| d != it).collect();
        deps.sort();
        deps.dedup();
        for d in deps {
            let j = index[&d];
            readers[j].push(i);
            waits[i] += 1;
        }
    }
    let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<(usize, usize)>> = items
        .iter()
        .enumerate()
        .filter(|(i, _)| waits[*i] == 0)
        .map(|(i, &it)| std::cmp::Reverse((key(it), i)))
        .collect();
    let mut out = Vec::with_capacity(items.len());
    while let Some(std::cmp::Reverse((_, i))) = ready.pop() {
        out.push(items[i]);
        for &r in &readers[i] {
            waits[r] -= 1;
            if waits[r] == 0 {
                ready.push(std::cmp::Reverse((key(items[r]), r)));
            }
        }
    }
    (out.len() == items.len()).then_some(out)
}

pub(super) struct Emitter<'g> {
    pub(super) g: &'g Graph,
    pub(super) num_replicas: usize,
    pub(super) target: crate::target::LowerTarget,
    /// Whether the module is partitioned by XLA's SPMD partitioner (it has
    /// shardings): where [`Op::Whole`] is a sharding constraint.
    pub(super) partitioned: bool,
    /// The cuDNN attention calls' split over the devices (CUDA only).
    pub(super) attention: Option<super::AttentionSplit>,
    /// SSA name of each output of each emitted node, indexed by node id.
    pub(super) names: Vec<Vec<String>>,
    pub(super) out: String,
}

impl Emitter<'_> {
    pub(super) fn signature(&mut self, shardings: Option<&super::ModuleShardings>) {
        let g = self.g;
        let args: Vec<String> = g
            .param_types()
            .iter()
            .enumerate()
            .map(|(i, ty)| {
                // Attributes sorted by name, as MLIR prints them.
                let mut attrs = Vec::new();
                if let Some(s) = shardings {
                    attrs.push(format!("mhlo.sharding = \"{}\"", s.params[i]));
                }
                if let Some(a) = g.aliases().iter().find(|a| a.param as usize == i) {
                    attrs.push(format!("tf.aliasing_output = {} : i32", a.output));
                }
                if attrs.is_empty() {
                    format!("%arg{i}: {ty}")
                } else {
                    format!("%arg{i}: {ty} {{{}}}", attrs.join(", "))
                }
            })
            .collect();
        let results = match shardings {
            None => join(g.output_types()),
            Some(s) => g
                .output_types()
                .iter()
                .zip(&s.outputs)
                .map(|(ty, sh)| format!("{ty} {{mhlo.sharding = \"{sh}\"}}"))
                .collect::<Vec<_>>()
                .join(", "),
        };
        let _ = writeln!(self.out, "  func.func public @main({}) -> ({}) {{", args.join(", "), results);
    }

    pub(super) fn line(&mut self, text: String) {
        self.out.push_str(BODY);
        self.out.push_str(&text);
        self.out.push('\n');
    }

    pub(super) fn name(&self, v: ValueId) -> String {
        self.names[v.node.index()][v.output as usize].clone()
    }

    pub(super) fn ty(&self, v: ValueId) -> &TensorType {
        self.g.ty(v)
    }

    /// Names the outputs of `id` and returns the left-hand side that defines them.
    pub(super) fn define(&mut self, id: NodeId, node: &Node) -> String {
        let base = format!("%v{}", id.index());
        let n = node.outputs.len();
        if n == 1 {
            self.names[id.index()] = vec![base.clone()];
            base
        } else {
            self.names[id.index()] = (0..n).map(|k| format!("{base}#{k}")).collect();
            format!("{base}:{n}")
        }
    }

    /// A helper value of node `id`: `%v<id>_<role>`.
    pub(super) fn helper(id: NodeId, role: &str) -> String {
        format!("%v{}_{role}", id.index())
    }

    /// `name = stablehlo.constant dense<..> : ty`, in the form
    /// [`constant_form`] gives `lit`: a large splat as its one element
    /// broadcast to `ty`, a large pred constant as its `ui8` bytes converted.
    pub(super) fn constant(&mut self, name: &str, lit: &Literal) {
        let ty = lit.ty();
        match constant_form(lit) {
            ConstantForm::Broadcast => {
                let width = ty.dtype.size_in_bytes();
                let one =
                    Literal::from_bytes(TensorType::new(ty.dtype, Shape::scalar()), lit.bytes()[..width].to_vec())
                        .expect("one element's bytes are a scalar of its dtype");
                self.splat(name, &one, ty);
            }
            ConstantForm::Hex if ty.dtype == DType::Pred => {
                let bytes = TensorType::new(DType::U8, ty.shape.clone());
                let raw = format!("{name}_bytes");
                self.line(format!("{raw} = stablehlo.constant {} : {bytes}", dense_hex(lit.bytes())));
                self.line(format!("{name} = stablehlo.convert {raw} : ({bytes}) -> {ty}"));
            }
            ConstantForm::Hex | ConstantForm::Splat | ConstantForm::List => {
                self.line(format!("{name} = stablehlo.constant {} : {ty}", dense(lit)));
            }
        }
    }

    /// `name` = the scalar `value` broadcast to `ty`: a scalar constant
    /// (`<name>_splat`) and a `broadcast_in_dim`, so neither the text nor
    /// XLA's literal holds `ty`'s bytes.
    pub(super) fn splat(&mut self, name: &str, value: &Literal, ty: &TensorType) {
        let scalar = value.ty();
        let one = format!("{name}_splat");
        self.line(format!("{one} = stablehlo.constant {} : {scalar}", dense(value)));
        self.line(format!("{name} = stablehlo.broadcast_in_dim {one}, dims = [] : ({scalar}) -> {ty}"));
    }

    /// A loop kernel: the Triton call, then the sum of its column sums.
    pub(super) fn loop_kernel(&mut self, k: &Kernel) {
        let (reduce, _) = k.sum;
        let call = Self::helper(reduce, "loop");
        let full = self.ty(k.stores[0].1[0]).shape.clone();
        let args: Vec<String> = k.inputs.iter().map(|i| self.name(i.value)).collect();
        let in_types: Vec<TensorType> = k.inputs.iter().map(|i| self.ty(i.value).clone()).collect();
        let mut out_types: Vec<TensorType> =
            k.stores.iter().map(|(s, _)| TensorType::new(k.body[*s].dtype, full.clone())).collect();
        let sums = TensorType::new(DType::F32, vec![k.partial_rows(), k.cols]);
        out_types.push(sums.clone());
        let layouts = |ts: &[TensorType]| ts.iter().map(|t| row_major(t.shape.rank())).collect::<Vec<_>>().join(", ");
        let (gx, gy) = k.grid();
        self.line(format!(
            "{call}:{} = stablehlo.custom_call @__gpu$xla.gpu.triton({}) {{api_version = 4 : i32, backend_config = \
             {{debug = false, grid_x = {gx} : i32, grid_y = {gy} : i32, grid_z = 1 : i32, ir = \"{}\", name = \"{}\", \
             num_ctas = 1 : i32, num_stages = 1 : i32, num_warps = {} : i32}}, operand_layouts = [{}], result_layouts = [{}]}} \
             : ({}) -> ({})",
            out_types.len(),
            args.join(", "),
            mlir_escape(&super::ttir::module(k)),
            super::ttir::NAME,
            super::ttir::WARPS,
            layouts(&in_types),
            layouts(&out_types),
            join(in_types),
            join(out_types),
        ));
        for (j, (_, values)) in k.stores.iter().enumerate() {
            for v in values {
                self.names[v.node.index()] = vec![format!("{call}#{j}")];
            }
        }
        let init = Self::helper(reduce, "init");
        self.constant(&init, &identity(ReduceOp::Sum, DType::F32));
        let total = Self::helper(reduce, "total");
        let row = TensorType::new(DType::F32, vec![k.cols]);
        self.line(format!(
            "{total} = stablehlo.reduce({call}#{} init: {init}) applies stablehlo.add across dimensions = [0] \
             : ({sums}, {}) -> {row}",
            k.stores.len(),
            TensorType::scalar(DType::F32),
        ));
        let want = self.g.node(reduce).outputs[0].clone();
        let mut value = total;
        if want.dtype != DType::F32 {
            let c = Self::helper(reduce, "convert");
            self.line(format!(
                "{c} = stablehlo.convert {value} : ({row}) -> {}",
                TensorType::new(want.dtype, vec![k.cols])
            ));
            value = c;
        }
        if want.shape.dims() != [k.cols] {
            let r = Self::helper(reduce, "reshape");
            self.line(format!(
                "{r} = stablehlo.reshape {value} : ({}) -> {want}",
                TensorType::new(want.dtype, vec![k.cols])
            ));
            value = r;
        }
        self.names[reduce.index()] = vec![value];
    }

    pub(super) fn node(&mut self, id: NodeId, node: &Node) -> Result<(), CompileError> {
        let out_ty = node.outputs.first().cloned();
        let res = || out_ty.clone().expect("single-result op has a result type");
        match &node.op {
            Op::Parameter { index, .. } => {
                self.names[id.index()] = vec![format!("%arg{index}")];
            }
            Op::Constant { literal } => {
                let lhs = self.define(id, node);
                self.constant(&lhs, literal);
            }
            Op::Iota { ty, axis } => {
                let lhs = self.define(id, node);
                self.line(format!("{lhs} = stablehlo.iota dim = {axis} : {ty}"));
            }
            Op::Unary { op, input } => self.unary(id, node, *op, *input),
            Op::Binary { op: BinaryOp::Div, lhs, rhs } if power_of_two_divisor(self.g, *rhs).is_some() => {
                // Unsigned division by a constant 2^k is a logical shift by k:
                // the same bits, and the CUDA plugin's front end spent seconds
                // on a 64-bit divide by a broadcast constant of 10^8 elements
                // (docs/init.md).
                let k = power_of_two_divisor(self.g, *rhs).expect("checked by the guard");
                let t = res();
                let scalar = TensorType::new(t.dtype, Shape::scalar());
                let (amount, spread) = (Self::helper(id, "shift"), Self::helper(id, "shifts"));
                self.line(format!("{amount} = stablehlo.constant dense<{k}> : {scalar}"));
                self.line(format!("{spread} = stablehlo.broadcast_in_dim {amount}, dims = [] : ({scalar}) -> {t}"));
                let a = self.name(*lhs);
                let def = self.define(id, node);
                self.line(format!("{def} = stablehlo.shift_right_logical {a}, {spread} : {t}"));
            }
            Op::Binary { op, lhs, rhs } => {
                let (a, b) = (self.name(*lhs), self.name(*rhs));
                let def = self.define(id, node);
                self.line(format!("{def} = {} {a}, {b} : {}", op.mnemonic(), res()));
            }
            Op::Compare { dir, lhs, rhs } => {
                let (a, b) = (self.name(*lhs), self.name(*rhs));
                let t = self.ty(*lhs).clone();
                let def = self.define(id, node);
                let kind = comparison_type(t.dtype);
                self.line(format!(
                    "{def} = stablehlo.compare {}, {a}, {b}, {kind} : ({t}, {t}) -> {}",
                    dir.name(),
                    res()
                ));
            }
            Op::Select { pred, on_true, on_false } => {
                let vals = [*pred, *on_true, *on_false];
                let text = self.call("stablehlo.select", id, node, &vals);
                self.line(text);
            }
            Op::Clamp { min, input, max } => {
                let text = self.call("stablehlo.clamp", id, node, &[*min, *input, *max]);
                self.line(text);
            }
            Op::Convert { input, .. } => {
                let text = self.call("stablehlo.convert", id, node, &[*input]);
                self.line(text);
            }
            Op::BroadcastInDim { input, dims, .. } => {
                let x = self.name(*input);
                let t = self.ty(*input).clone();
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = stablehlo.broadcast_in_dim {x}, dims = {} : ({t}) -> {}",
                    list(dims),
                    res()
                ));
            }
            Op::Reshape { input, .. } => {
                let text = self.call("stablehlo.reshape", id, node, &[*input]);
                self.line(text);
            }
            Op::Transpose { input, perm } => {
                let x = self.name(*input);
                let t = self.ty(*input).clone();
                let def = self.define(id, node);
                self.line(format!("{def} = stablehlo.transpose {x}, dims = {} : ({t}) -> {}", list(perm), res()));
            }
            Op::Slice { input, start, limit, stride } => {
                let x = self.name(*input);
                let t = self.ty(*input).clone();
                let ranges: Vec<String> = (0..start.len())
                    .map(|i| match stride[i] {
                        1 => format!("{}:{}", start[i], limit[i]),
                        s => format!("{}:{}:{s}", start[i], limit[i]),
                    })
                    .collect();
                let def = self.define(id, node);
                self.line(format!("{def} = stablehlo.slice {x} [{}] : ({t}) -> {}", ranges.join(", "), res()));
            }
            Op::DynamicSlice { input, starts, sizes } => {
                let (starts, start_tys) = self.start_indices(id, starts);
                let x = self.name(*input);
                let t = self.ty(*input).clone();
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = stablehlo.dynamic_slice {x}, {}, sizes = {} : ({t}, {}) -> {}",
                    starts.join(", "),
                    list(sizes),
                    join(start_tys),
                    res()
                ));
            }
            Op::DynamicUpdateSlice { input, update, starts } => {
                let (starts, start_tys) = self.start_indices(id, starts);
                let (x, u) = (self.name(*input), self.name(*update));
                let (tx, tu) = (self.ty(*input).clone(), self.ty(*update).clone());
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = stablehlo.dynamic_update_slice {x}, {u}, {} : ({tx}, {tu}, {}) -> {}",
                    starts.join(", "),
                    join(start_tys),
                    res()
                ));
            }
            Op::Concatenate { inputs, axis } => {
                let xs: Vec<String> = inputs.iter().map(|&v| self.name(v)).collect();
                let ts: Vec<TensorType> = inputs.iter().map(|&v| self.ty(v).clone()).collect();
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = stablehlo.concatenate {}, dim = {axis} : ({}) -> {}",
                    xs.join(", "),
                    join(ts),
                    res()
                ));
            }
            Op::Pad { input, value, low, high, interior } => {
                let (x, v) = (self.name(*input), self.name(*value));
                let (tx, tv) = (self.ty(*input).clone(), self.ty(*value).clone());
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = stablehlo.pad {x}, {v}, low = {}, high = {}, interior = {} : ({tx}, {tv}) -> {}",
                    list(low),
                    list(high),
                    list(interior),
                    res()
                ));
            }
            Op::Reduce { op, input, axes } => {
                let t = self.ty(*input).clone();
                let init = Self::helper(id, "init");
                self.constant(&init, &identity(*op, t.dtype));
                let x = self.name(*input);
                let def = self.define(id, node);
                let scalar = TensorType::scalar(t.dtype);
                self.line(format!(
                    "{def} = stablehlo.reduce({x} init: {init}) applies {} across dimensions = {} : ({t}, {scalar}) -> {}",
                    combiner(*op, t.dtype),
                    list(axes),
                    res()
                ));
            }
            Op::DotGeneral { lhs, rhs, dims } => {
                let (a, b) = (self.name(*lhs), self.name(*rhs));
                let (ta, tb) = (self.ty(*lhs).clone(), self.ty(*rhs).clone());
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = stablehlo.dot_general {a}, {b}, {} : ({ta}, {tb}) -> {}",
                    dot_dims(dims),
                    res()
                ));
            }
            Op::Gather { operand, indices, axis } => {
                let (x, i) = (self.name(*operand), self.name(*indices));
                let (tx, ti) = (self.ty(*operand).clone(), self.ty(*indices).clone());
                let w = Window::new(&tx, &ti, *axis);
                let mut sizes = tx.shape.dims().to_vec();
                sizes[*axis] = 1;
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = \"stablehlo.gather\"({x}, {i}) <{{dimension_numbers = #stablehlo.gather<offset_dims = {}, \
                     collapsed_slice_dims = [{axis}], start_index_map = [{axis}], index_vector_dim = {}>, \
                     indices_are_sorted = false, slice_sizes = {}}}> : ({tx}, {ti}) -> {}",
                    list(&w.window_dims),
                    w.index_vector_dim,
                    i64_array(&sizes),
                    res()
                ));
            }
            Op::ScatterAdd { operand, indices, updates, axis } => {
                let (x, i, u) = (self.name(*operand), self.name(*indices), self.name(*updates));
                let (tx, ti, tu) = (self.ty(*operand).clone(), self.ty(*indices).clone(), self.ty(*updates).clone());
                let w = Window::new(&tx, &ti, *axis);
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = \"stablehlo.scatter\"({x}, {i}, {u}) <{{indices_are_sorted = false, \
                     scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = {}, inserted_window_dims = [{axis}], \
                     scatter_dims_to_operand_dims = [{axis}], index_vector_dim = {}>, unique_indices = false}}> ({{",
                    list(&w.window_dims),
                    w.index_vector_dim,
                ));
                self.combiner_region(id, ReduceOp::Sum, tx.dtype);
                self.line(format!("}}) : ({tx}, {ti}, {tu}) -> {}", res()));
            }
            Op::RngBitGenerator { algorithm, state, ty } => {
                let s = self.name(*state);
                let ts = self.ty(*state).clone();
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = stablehlo.rng_bit_generator {s}, algorithm = {} : ({ts}) -> ({ts}, {ty})",
                    algorithm.name()
                ));
            }
            Op::OptimizationBarrier { inputs } => {
                let xs: Vec<String> = inputs.iter().map(|&v| self.name(v)).collect();
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = stablehlo.optimization_barrier {} : {}",
                    xs.join(", "),
                    join(node.outputs.to_vec())
                ));
            }
            // XLA's host-offload annotation, which its CUDA pipeline turns into
            // an async copy to or from host memory. The CPU plugin has no
            // host memory space and refuses the call; there the value stays
            // where it is.
            Op::Place { input, to } => match self.target {
                crate::target::LowerTarget::Cuda => {
                    let x = self.name(*input);
                    let t = self.ty(*input).clone();
                    let def = self.define(id, node);
                    self.line(format!(
                        "{def} = stablehlo.custom_call @annotate_device_placement({x}) {{backend_config = \"\", \
                         has_side_effect = true, mhlo.frontend_attributes = {{_xla_buffer_placement = \"{}\"}}}} \
                         : ({t}) -> {t}",
                        to.name()
                    ));
                }
                crate::target::LowerTarget::Cpu => self.names[id.index()] = vec![self.name(*input)],
            },
            // kiln's host copies: typed FFI calls whose handlers the runtime
            // registers on both plugins. Side effects keep XLA from merging or
            // dropping them; the copy back's end hands on its operand's buffer.
            Op::HostCopy { inputs, step, slot, .. } => {
                let xs: Vec<String> = inputs.iter().map(|&v| self.name(v)).collect();
                let ts: Vec<TensorType> = inputs.iter().map(|&v| self.ty(v).clone()).collect();
                let alias = if *step == crate::ir::HostCopyStep::InDone {
                    ", output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], \
                     operand_index = 0, operand_tuple_indices = []>]"
                } else {
                    ""
                };
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = stablehlo.custom_call @{}({}) {{api_version = 4 : i32, backend_config = {{slot = {slot} : i64}}, \
                     has_side_effect = true{alias}}} : ({}) -> {}",
                    step.target(),
                    xs.join(", "),
                    join(ts),
                    res()
                ));
            }
            // A replicated sharding constraint, the form of JAX's
            // `with_sharding_constraint`; in a module without shardings there
            // is nothing to constrain.
            Op::Whole { input } => {
                if self.partitioned {
                    let x = self.name(*input);
                    let t = self.ty(*input).clone();
                    let def = self.define(id, node);
                    self.line(format!(
                        "{def} = stablehlo.custom_call @Sharding({x}) {{mhlo.sharding = \"{{replicated}}\"}} : ({t}) -> {t}"
                    ));
                } else {
                    self.names[id.index()] = vec![self.name(*input)];
                }
            }
            Op::AllReduce { op, input } => {
                let x = self.name(*input);
                let t = self.ty(*input).clone();
                let n = self.num_replicas;
                let group = (0..n).map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
                let def = self.define(id, node);
                self.line(format!(
                    "{def} = \"stablehlo.all_reduce\"({x}) <{{replica_groups = dense<[[{group}]]> : tensor<1x{n}xi64>}}> ({{"
                ));
                self.combiner_region(id, *op, t.dtype);
                self.line(format!("}}) : ({t}) -> {}", res()));
            }
            // Only composites the target runs fused reach here
            // (`composite::expand` replaced the others by plain ops).
            Op::Attention { q, k, v, bias, mask, attrs } => {
                self.attention(id, node, [*q, *k, *v], bias, *mask, *attrs)?
            }
            Op::AttentionGrad { q, k, v, bias, mask, out, stats, dout, attrs } => {
                self.attention_grad(id, node, [*q, *k, *v], bias, *mask, [*out, *stats, *dout], *attrs)?
            }
            Op::LayerNorm { .. }
            | Op::LayerNormGrad { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormGrad { .. }
            | Op::LmHeadCrossEntropy { .. }
            | Op::LmHeadCrossEntropyGrad { .. }
            | Op::LmHeadCrossEntropyFused { .. } => {
                return Err(CompileError::Verify {
                    node: id.to_string(),
                    reason: format!(
                        "`{}` reached emission: composite::expand replaces it on every target",
                        node.op.name()
                    ),
                })
            }
        }
        Ok(())
    }

    /// `def = mnemonic %a, %b : (ta, tb) -> result`, the functional-type form.
    pub(super) fn call(&mut self, mnemonic: &str, id: NodeId, node: &Node, inputs: &[ValueId]) -> String {
        let xs: Vec<String> = inputs.iter().map(|&v| self.name(v)).collect();
        let ts: Vec<TensorType> = inputs.iter().map(|&v| self.ty(v).clone()).collect();
        let def = self.define(id, node);
        format!("{def} = {mnemonic} {} : ({}) -> {}", xs.join(", "), join(ts), node.outputs[0])
    }

    pub(super) fn unary(&mut self, id: NodeId, node: &Node, op: UnaryOp, input: ValueId) {
        let x = self.name(input);
        let t = self.ty(input).clone();
        let unsigned = t.dtype.is_integer() && !t.dtype.is_signed_integer();
        match op {
            // StableHLO's abs and sign take signed or float operands only; on
            // unsigned integers abs is the identity and sign is min(x, 1).
            UnaryOp::Abs if unsigned => {
                self.names[id.index()] = vec![x];
            }
            UnaryOp::Sign if unsigned => {
                let one = Self::helper(id, "one");
                if t.size_in_bytes() >= LARGE_CONSTANT_BYTES {
                    self.splat(&one, &Literal::scalar(t.dtype, 1.0), &t);
                } else {
                    let lit = Literal::from_f64s(t.dtype, t.shape.clone(), &vec![1.0; t.shape.num_elements()])
                        .expect("one value per element");
                    self.constant(&one, &lit);
                }
                let def = self.define(id, node);
                self.line(format!("{def} = stablehlo.minimum {x}, {one} : {t}"));
            }
            // CHLO's unary ops print their type as a function type.
            UnaryOp::Erf => {
                let def = self.define(id, node);
                self.line(format!("{def} = {} {x} : {t} -> {t}", op.mnemonic()));
            }
            UnaryOp::Neg
            | UnaryOp::Abs
            | UnaryOp::Exp
            | UnaryOp::Log
            | UnaryOp::Log1p
            | UnaryOp::Expm1
            | UnaryOp::Tanh
            | UnaryOp::Logistic
            | UnaryOp::Sqrt
            | UnaryOp::Rsqrt
            | UnaryOp::Sin
            | UnaryOp::Cos
            | UnaryOp::Floor
            | UnaryOp::Ceil
            | UnaryOp::Sign
            | UnaryOp::Not => {
                let def = self.define(id, node);
                self.line(format!("{def} = {} {x} : {t}", op.mnemonic()));
            }
        }
    }

    /// Start indices of a dynamic (update) slice. StableHLO wants them all of
    /// one type; kiln allows any integer scalars, so mixed ones are converted
    /// to i64 (`%v<id>_start<k>`).
    pub(super) fn start_indices(&mut self, id: NodeId, starts: &[ValueId]) -> (Vec<String>, Vec<TensorType>) {
        let tys: Vec<TensorType> = starts.iter().map(|&v| self.ty(v).clone()).collect();
        let uniform = tys.windows(2).all(|w| w[0] == w[1]);
        if uniform {
            return (starts.iter().map(|&v| self.name(v)).collect(), tys);
        }
        let wide = TensorType::scalar(DType::I64);
        let mut names = Vec::with_capacity(starts.len());
        for (k, (&v, t)) in starts.iter().zip(&tys).enumerate() {
            if *t == wide {
                names.push(self.name(v));
            } else {
                let name = Self::helper(id, &format!("start{k}"));
                let x = self.name(v);
                self.line(format!("{name} = stablehlo.convert {x} : ({t}) -> {wide}"));
                names.push(name);
            }
        }
        (names, vec![wide; starts.len()])
    }

    /// The scalar region `^bb0(%a, %b): return a <op> b` of scatter and
    /// all_reduce, closed by the caller's `}) : ...` line.
    pub(super) fn combiner_region(&mut self, id: NodeId, op: ReduceOp, dtype: DType) {
        let s = TensorType::scalar(dtype);
        let (a, b, r) = (Self::helper(id, "lhs"), Self::helper(id, "rhs"), Self::helper(id, "acc"));
        self.line(format!("^bb0({a}: {s}, {b}: {s}):"));
        self.line(format!("  {r} = {} {a}, {b} : {s}", combiner(op, dtype)));
        self.line(format!("  stablehlo.return {r} : {s}"));
    }
}

/// Dimension numbers shared by kiln's gather and scatter_add along `axis`,
/// with the indices' own dimensions as batch dimensions and an implicit
/// trailing index vector (`index_vector_dim` = rank of indices).
struct Window {
    /// Result (gather) / update (scatter) dimensions that walk the operand's
    /// kept dimensions: those before `axis`, then those after the indices.
    window_dims: Vec<usize>,
    index_vector_dim: usize,
}

impl Window {
    fn new(operand: &TensorType, indices: &TensorType, axis: usize) -> Window {
        let ri = indices.shape.rank();
        let r = operand.shape.rank();
        let window_dims = (0..axis).chain(axis + ri..ri + r - 1).collect();
        Window { window_dims, index_vector_dim: ri }
    }
}

/// The scalar op of a reduction's region. On pred, sum/max are `or` and
/// prod/min are `and` (their identities false/true match).
fn combiner(op: ReduceOp, dtype: DType) -> &'static str {
    match (dtype, op) {
        (DType::Pred, ReduceOp::Sum | ReduceOp::Max) => "stablehlo.or",
        (DType::Pred, ReduceOp::Prod | ReduceOp::Min) => "stablehlo.and",
        _ => op.combiner().mnemonic(),
    }
}

/// `comparison_type` of `stablehlo.compare`; pred compares as unsigned, as XLA does.
fn comparison_type(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 | DType::BF16 | DType::F32 | DType::F64 => "FLOAT",
        DType::I8 | DType::I32 | DType::I64 => "SIGNED",
        DType::Pred | DType::U8 | DType::U32 | DType::U64 => "UNSIGNED",
    }
}

fn dot_dims(d: &DotDims) -> String {
    let contracting = format!("contracting_dims = {} x {}", list(&d.lhs_contract), list(&d.rhs_contract));
    if d.lhs_batch.is_empty() {
        contracting
    } else {
        format!("batching_dims = {} x {}, {contracting}", list(&d.lhs_batch), list(&d.rhs_batch))
    }
}

/// `[a, b, c]`.
/// `minor_to_major` of a row-major array of `rank` dimensions, as a custom
/// call's layout attribute (the cuDNN calls' and the loop kernels').
pub(super) fn row_major(rank: usize) -> String {
    let dims: Vec<String> = (0..rank).rev().map(|d| d.to_string()).collect();
    if rank == 1 {
        "dense<0> : tensor<1xindex>".to_string()
    } else {
        format!("dense<[{}]> : tensor<{rank}xindex>", dims.join(", "))
    }
}

/// `text` as the body of an MLIR string literal (a custom call's backend
/// config: the cuDNN calls' JSON, the loop kernels' Triton IR).
pub(super) fn mlir_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\22"),
            '\\' => out.push_str("\\5C"),
            '\n' => out.push_str("\\0A"),
            c => out.push(c),
        }
    }
    out
}

fn list<T: Display>(xs: &[T]) -> String {
    format!("[{}]", xs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))
}

/// `array<i64: a, b>`, or `array<i64>` when empty.
fn i64_array(xs: &[usize]) -> String {
    if xs.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", xs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))
    }
}

/// `ta, tb, tc`.
pub(super) fn join(types: Vec<TensorType>) -> String {
    types.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// `k` when `v` is an unsigned integer constant whose every element is `2^k`
/// with `k >= 1` (a constant, or a broadcast of one): dividing by it is a
/// logical shift right by `k`.
fn power_of_two_divisor(g: &Graph, v: ValueId) -> Option<u32> {
    let dtype = g.ty(v).dtype;
    if !matches!(dtype, DType::U8 | DType::U32 | DType::U64) {
        return None;
    }
    let literal = match &g.node(v.node).op {
        Op::Constant { literal } => literal,
        Op::BroadcastInDim { input, .. } => match &g.node(input.node).op {
            Op::Constant { literal } => literal,
            _ => return None,
        },
        _ => return None,
    };
    let width = dtype.size_in_bytes();
    let mut chunks = literal.bytes().chunks_exact(width);
    let first = chunks.next()?;
    if chunks.any(|c| c != first) {
        return None;
    }
    let mut le = [0u8; 8];
    le[..width].copy_from_slice(first);
    let value = u64::from_le_bytes(le);
    (value > 1 && value.is_power_of_two()).then(|| value.trailing_zeros())
}

/// The `mhlo.sharding` attribute (with its trailing `, `) of a cuDNN call of
/// `n` results inside the manual region; empty outside one.
pub(super) fn manual_results(manual: bool, n: usize) -> String {
    if manual {
        format!("mhlo.sharding = \"{{{}}}\", ", vec!["{manual}"; n].join(", "))
    } else {
        String::new()
    }
}
