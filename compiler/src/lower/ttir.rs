//! The Triton IR (`tt`, `arith` and `math` dialects, as text) of a
//! [`Kernel`](super::loop_kernel::Kernel), which XLA's CUDA plugin parses from
//! the `ir` field of a `__gpu$xla.gpu.triton` custom call and compiles itself.
//!
//! The function takes one pointer per operand, then one per stored value,
//! then the column sums' (XLA passes a custom call's operand buffers, then
//! its result buffers). Program `(i, j)` of the grid owns columns
//! `j·BN..(j+1)·BN` and `chunks` tiles of `BM` rows from row `i·BM·chunks`:
//! rows and scalars are computed once, before a loop over those tiles that
//! computes and stores each tile and adds it into an f32 accumulator, whose
//! column sums are the program's row of the sums. The finder only takes
//! shapes the tiles divide, so nothing is masked. Values are f32 in
//! registers: a `[BM, BN]` tensor over the tile, `[1, BN]` for a row, `[1, 1]`
//! for a scalar, broadcast where an op meets a wider operand. Results are
//! rounded to their dtype only where the graph converts (`truncf`, then
//! `extf` to go on in f32) and where they are stored.

use std::collections::HashMap;
use std::fmt::Write;

use super::loop_kernel::{Inst, Kernel, Space, TANH_C3, TANH_C5, TANH_SMALL};
use crate::ir::{BinaryOp, DType, UnaryOp};

/// The kernel function's name in the module.
pub(crate) const NAME: &str = "kiln_loop";

/// Warps per program.
pub(crate) const WARPS: usize = 4;

/// MLIR's name of an element type the kernels read or write.
fn elem(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    }
}

/// An f32 constant as its bit pattern (MLIR reads a hex literal of a float
/// type as the bits, so nothing is rounded twice).
fn hex(x: f32) -> String {
    format!("0x{:08X}", x.to_bits())
}

struct Writer<'k> {
    k: &'k Kernel,
    out: String,
    next: usize,
    /// The f32 value of each step in its own space.
    value: Vec<String>,
    /// The stored form of each step (in its dtype).
    stored: Vec<String>,
    /// Broadcasts already written: (step, space) -> name.
    wide: HashMap<(usize, Space), String>,
    /// Splat constants already written: (f32 bits, space) -> name.
    consts: HashMap<(u32, Space), String>,
}

impl Writer<'_> {
    fn fresh(&mut self) -> String {
        self.next += 1;
        format!("%{}", self.next)
    }

    fn line(&mut self, s: String) {
        self.out.push_str("    ");
        self.out.push_str(&s);
        self.out.push('\n');
    }

    fn shape(&self, space: Space) -> String {
        let (bm, bn) = self.k.block;
        match space {
            Space::Full => format!("{bm}x{bn}"),
            Space::Row => format!("1x{bn}"),
            Space::Scalar => "1x1".to_string(),
        }
    }

    fn ty(&self, space: Space, e: &str) -> String {
        format!("tensor<{}x{e}>", self.shape(space))
    }

    /// An f32 splat constant over `space`.
    fn constant(&mut self, x: f32, space: Space) -> String {
        if let Some(n) = self.consts.get(&(x.to_bits(), space)) {
            return n.clone();
        }
        let n = self.fresh();
        let t = self.ty(space, "f32");
        self.line(format!("{n} = arith.constant dense<{}> : {t}", hex(x)));
        self.consts.insert((x.to_bits(), space), n.clone());
        n
    }

    /// Step `s`'s f32 value over `space` (at least as wide as its own).
    fn at(&mut self, s: usize, space: Space) -> String {
        let step = &self.k.body[s];
        if let Inst::Const(bits) = step.inst {
            return self.constant(f64::from_bits(bits) as f32, space);
        }
        if step.space == space {
            return self.value[s].clone();
        }
        if let Some(n) = self.wide.get(&(s, space)) {
            return n.clone();
        }
        let n = self.fresh();
        let (from, to) = (self.ty(step.space, "f32"), self.ty(space, "f32"));
        let v = self.value[s].clone();
        self.line(format!("{n} = tt.broadcast {v} : {from} -> {to}"));
        self.wide.insert((s, space), n.clone());
        n
    }

    fn op(&mut self, name: &str, args: &[&str], space: Space) -> String {
        let n = self.fresh();
        let t = self.ty(space, "f32");
        self.line(format!("{n} = {name} {} : {t}", args.join(", ")));
        n
    }

    /// `tanh` of `z` as [`super::loop_kernel::tanh`] computes it.
    fn tanh(&mut self, z: &str, space: Space) -> String {
        let t = self.ty(space, "f32");
        let i1 = self.ty(space, "i1");
        let (small, c3, c5, one, zero, m2) = (
            self.constant(TANH_SMALL, space),
            self.constant(TANH_C3, space),
            self.constant(TANH_C5, space),
            self.constant(1.0, space),
            self.constant(0.0, space),
            self.constant(-2.0, space),
        );
        let a = self.op("math.absf", &[z], space);
        let is_small = self.fresh();
        self.line(format!("{is_small} = arith.cmpf olt, {a}, {small} : {t}"));
        let z2 = self.op("arith.mulf", &[z, z], space);
        let p = self.op("arith.mulf", &[&z2, &c5], space);
        let p = self.op("arith.addf", &[&c3, &p], space);
        let p = self.op("arith.mulf", &[&z2, &p], space);
        let p = self.op("arith.addf", &[&one, &p], space);
        let p = self.op("arith.mulf", &[z, &p], space);
        let m = self.op("arith.mulf", &[&m2, &a], space);
        let e = self.op("math.exp", &[&m], space);
        let num = self.op("arith.subf", &[&one, &e], space);
        let den = self.op("arith.addf", &[&one, &e], space);
        let q = self.op("arith.divf", &[&num, &den], space);
        let neg = self.fresh();
        self.line(format!("{neg} = arith.cmpf olt, {z}, {zero} : {t}"));
        let nq = self.op("arith.negf", &[&q], space);
        let sq = self.fresh();
        self.line(format!("{sq} = arith.select {neg}, {nq}, {q} : {i1}, {t}"));
        let r = self.fresh();
        self.line(format!("{r} = arith.select {is_small}, {p}, {sq} : {i1}, {t}"));
        r
    }

    /// Step `s` in its dtype, to be stored.
    fn narrow(&mut self, s: usize) -> String {
        if !self.stored[s].is_empty() {
            return self.stored[s].clone();
        }
        let step = &self.k.body[s];
        let (dtype, space) = (step.dtype, step.space);
        let x = self.value[s].clone();
        let (_, narrow) = self.round(x, dtype, space);
        self.stored[s] = narrow.clone();
        narrow
    }

    /// Rounds f32 `x` to `dtype`: (the f32 value, the stored form).
    fn round(&mut self, x: String, dtype: DType, space: Space) -> (String, String) {
        if dtype == DType::F32 {
            return (x.clone(), x);
        }
        let (t32, tn) = (self.ty(space, "f32"), self.ty(space, elem(dtype)));
        let narrow = self.fresh();
        self.line(format!("{narrow} = arith.truncf {x} : {t32} to {tn}"));
        let wide = self.fresh();
        self.line(format!("{wide} = arith.extf {narrow} : {tn} to {t32}"));
        (wide, narrow)
    }
}

/// The module text of `k`.
pub(crate) fn module(k: &Kernel) -> String {
    let (bm, bn) = k.block;
    let mut w = Writer {
        k,
        out: String::new(),
        next: 0,
        value: vec![String::new(); k.body.len()],
        stored: vec![String::new(); k.body.len()],
        wide: HashMap::new(),
        consts: HashMap::new(),
    };
    let mut args: Vec<String> = Vec::new();
    let ptr = |d: DType| format!("!tt.ptr<{}>", elem(d));
    for (i, input) in k.inputs.iter().enumerate() {
        args.push(format!("%in{i}: {} {{tt.divisibility = 16 : i32}}", ptr(input.dtype)));
    }
    for (i, (s, _)) in k.stores.iter().enumerate() {
        args.push(format!("%out{i}: {} {{tt.divisibility = 16 : i32}}", ptr(k.body[*s].dtype)));
    }
    args.push("%sums: !tt.ptr<f32> {tt.divisibility = 16 : i32}".to_string());
    let _ = writeln!(w.out, "module {{");
    let _ = writeln!(w.out, "  tt.func public @{NAME}({}) attributes {{noinline = false}} {{", args.join(", "));
    let full_i = format!("tensor<{bm}x{bn}xi32>");
    let row_i = format!("tensor<1x{bn}xi32>");
    let acc_t = format!("tensor<{bm}x{bn}xf32>");
    // The program's columns, and the first of its rows.
    w.line("%pm = tt.get_program_id x : i32".into());
    w.line("%pn = tt.get_program_id y : i32".into());
    w.line(format!("%bm = arith.constant {bm} : i32"));
    w.line(format!("%bn = arith.constant {bn} : i32"));
    w.line(format!("%prows = arith.constant {} : i32", k.program_rows()));
    w.line(format!("%ncols = arith.constant {} : i32", k.cols));
    w.line("%row0 = arith.muli %pm, %prows : i32".into());
    w.line("%col0 = arith.muli %pn, %bn : i32".into());
    w.line(format!("%ri = tt.make_range {{end = {bm} : i32, start = 0 : i32}} : tensor<{bm}xi32>"));
    w.line(format!("%ci = tt.make_range {{end = {bn} : i32, start = 0 : i32}} : tensor<{bn}xi32>"));
    w.line(format!("%col0s = tt.splat %col0 : i32 -> tensor<{bn}xi32>"));
    w.line(format!("%cols1 = arith.addi %col0s, %ci : tensor<{bn}xi32>"));
    w.line(format!("%cols = tt.expand_dims %cols1 {{axis = 0 : i32}} : tensor<{bn}xi32> -> {row_i}"));
    w.line(format!("%colsb = tt.broadcast %cols : {row_i} -> {full_i}"));
    w.line(format!("%ncols2 = tt.splat %ncols : i32 -> tensor<{bm}x1xi32>"));
    // Rows and scalars once, before the loop over the tiles.
    for (s, step) in k.body.iter().enumerate() {
        if step.space != Space::Full {
            emit_step(&mut w, s, &full_i, &row_i);
        }
    }
    w.line(format!("%acc0 = arith.constant dense<0x00000000> : {acc_t}"));
    w.line("%it0 = arith.constant 0 : i32".into());
    w.line(format!("%its = arith.constant {} : i32", k.chunks));
    w.line("%it1 = arith.constant 1 : i32".into());
    w.line(format!("%accf = scf.for %it = %it0 to %its step %it1 iter_args(%acc = %acc0) -> ({acc_t}) : i32 {{"));
    w.line("%itrows = arith.muli %it, %bm : i32".into());
    w.line("%r0 = arith.addi %row0, %itrows : i32".into());
    w.line(format!("%r0s = tt.splat %r0 : i32 -> tensor<{bm}xi32>"));
    w.line(format!("%rows = arith.addi %r0s, %ri : tensor<{bm}xi32>"));
    w.line(format!("%rows2 = tt.expand_dims %rows {{axis = 1 : i32}} : tensor<{bm}xi32> -> tensor<{bm}x1xi32>"));
    w.line(format!("%rowoff = arith.muli %rows2, %ncols2 : tensor<{bm}x1xi32>"));
    w.line(format!("%rowoffb = tt.broadcast %rowoff : tensor<{bm}x1xi32> -> {full_i}"));
    w.line(format!("%off = arith.addi %rowoffb, %colsb : {full_i}"));
    for (s, step) in k.body.iter().enumerate() {
        if step.space == Space::Full {
            emit_step(&mut w, s, &full_i, &row_i);
        }
    }
    for (i, (s, _)) in k.stores.iter().enumerate() {
        let e = elem(k.body[*s].dtype);
        let pt = w.ty(Space::Full, &format!("!tt.ptr<{e}>"));
        // A stored value is full-shaped in the graph even where the kernel
        // computes it once a row (a converted bias): broadcast it first.
        let v = if k.body[*s].space == Space::Full {
            w.narrow(*s)
        } else {
            let x = w.at(*s, Space::Full);
            w.round(x, k.body[*s].dtype, Space::Full).1
        };
        let (p, a) = (w.fresh(), w.fresh());
        w.line(format!("{p} = tt.splat %out{i} : !tt.ptr<{e}> -> {pt}"));
        w.line(format!("{a} = tt.addptr {p}, %off : {pt}, {full_i}"));
        w.line(format!("tt.store {a}, {v} : {pt}"));
    }
    let v = w.at(k.sum.1, Space::Full);
    w.line(format!("%accn = arith.addf %acc, {v} : {acc_t}"));
    w.line(format!("scf.yield %accn : {acc_t}"));
    w.line("}".into());
    // The program's column sums, into its row of the sums.
    w.line(format!(
        "%sum = \"tt.reduce\"(%accf) <{{axis = 0 : i32}}> ({{\n    ^bb0(%x: f32, %y: f32):\n      %xy = arith.addf %x, %y : f32\n      tt.reduce.return %xy : f32\n    }}) : ({acc_t}) -> tensor<{bn}xf32>"
    ));
    w.line("%srow = arith.muli %pm, %ncols : i32".into());
    w.line(format!("%srows = tt.splat %srow : i32 -> tensor<{bn}xi32>"));
    w.line(format!("%soff = arith.addi %srows, %cols1 : tensor<{bn}xi32>"));
    w.line(format!("%sp = tt.splat %sums : !tt.ptr<f32> -> tensor<{bn}x!tt.ptr<f32>>"));
    w.line(format!("%sa = tt.addptr %sp, %soff : tensor<{bn}x!tt.ptr<f32>>, tensor<{bn}xi32>"));
    w.line(format!("tt.store %sa, %sum : tensor<{bn}x!tt.ptr<f32>>"));
    w.line("tt.return".into());
    w.out.push_str("  }\n}\n");
    w.out
}

/// Writes step `s` (its f32 value and its stored form).
fn emit_step(w: &mut Writer, s: usize, full_i: &str, row_i: &str) {
    let k = w.k;
    let step = &k.body[s];
    let space = step.space;
    let (value, stored) = match step.inst {
        Inst::Load(i) => {
            let input = &k.inputs[i];
            let e = elem(input.dtype);
            let pt = w.ty(space, &format!("!tt.ptr<{e}>"));
            let (off, it) = if space == Space::Full { ("%off", full_i) } else { ("%cols", row_i) };
            let (p, a, l) = (w.fresh(), w.fresh(), w.fresh());
            w.line(format!("{p} = tt.splat %in{i} : !tt.ptr<{e}> -> {pt}"));
            w.line(format!("{a} = tt.addptr {p}, {off} : {pt}, {it}"));
            w.line(format!("{l} = tt.load {a} : {pt}"));
            if input.dtype == DType::F32 {
                (l.clone(), l)
            } else {
                let x = w.fresh();
                let (tn, t32) = (w.ty(space, e), w.ty(space, "f32"));
                w.line(format!("{x} = arith.extf {l} : {tn} to {t32}"));
                (x, l)
            }
        }
        // Written at each use's width ([`Writer::at`]).
        Inst::Const(_) => (String::new(), String::new()),
        Inst::Convert(a) => {
            let x = w.at(a, space);
            w.round(x, step.dtype, space)
        }
        Inst::Unary(op, a) => {
            let x = w.at(a, space);
            let r = match op {
                UnaryOp::Neg => w.op("arith.negf", &[&x], space),
                UnaryOp::Exp => w.op("math.exp", &[&x], space),
                UnaryOp::Tanh => w.tanh(&x, space),
                other => unreachable!("`{other:?}` is not a loop-kernel op"),
            };
            (r, String::new())
        }
        Inst::Binary(op, a, b) => {
            let (x, y) = (w.at(a, space), w.at(b, space));
            let name = match op {
                BinaryOp::Add => "arith.addf",
                BinaryOp::Sub => "arith.subf",
                BinaryOp::Mul => "arith.mulf",
                BinaryOp::Div => "arith.divf",
                other => unreachable!("`{other:?}` is not a loop-kernel op"),
            };
            (w.op(name, &[&x, &y], space), String::new())
        }
    };
    w.value[s] = value;
    w.stored[s] = stored;
}
