//! The printer of kiln's text form (grammar in [`crate::text`]).
//!
//! Output depends only on the graph (node order, ops, types), never on hashing,
//! so a graph built in a given order always prints the same bytes.

use std::fmt::{self, Write};

use half::{bf16, f16};

use crate::ir::{DType, Graph, Literal, Node, NodeId, Op, TensorType, ValueId};

/// The text form of `g`, ending in a newline.
pub fn print(g: &Graph) -> String {
    let mut out = String::new();
    write_graph(&mut out, g).expect("writing to a String cannot fail");
    out
}

/// Same as [`print`].
impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_graph(f, self)
    }
}

fn write_graph(out: &mut impl Write, g: &Graph) -> fmt::Result {
    // Parameters that open the graph go in the header; any later one stays a
    // node line so that node order, and thus every id, round-trips.
    let header = g.nodes().take_while(|(_, n)| matches!(n.op, Op::Parameter { .. })).count();
    out.write_str("graph(")?;
    for (i, (id, node)) in g.nodes().take(header).enumerate() {
        if i > 0 {
            out.write_str(", ")?;
        }
        write!(out, "{id}: {}", node.outputs[0])?;
    }
    out.write_str(") {\n")?;
    for (id, node) in g.nodes().skip(header) {
        out.write_str("  ")?;
        write_node(out, id, node)?;
        out.write_char('\n')?;
    }
    out.write_str("  return")?;
    for (i, v) in g.outputs().iter().enumerate() {
        out.write_str(if i == 0 { " " } else { ", " })?;
        write!(out, "{v}")?;
    }
    if !g.aliases().is_empty() {
        out.write_str(" {aliases = [")?;
        for (i, a) in g.aliases().iter().enumerate() {
            if i > 0 {
                out.write_str(", ")?;
            }
            write!(out, "{} -> {}", a.param, a.output)?;
        }
        out.write_str("]}")?;
    }
    out.write_str("\n}\n")
}

fn write_node(out: &mut impl Write, id: NodeId, node: &Node) -> fmt::Result {
    if node.outputs.len() == 1 {
        write!(out, "{id} = ")?;
    } else {
        write!(out, "{id}:{} = ", node.outputs.len())?;
    }
    out.write_str(node.op.name())?;
    // Every field is named; `field: _` marks an attribute that the result type
    // already spells (the parser reads it back from there).
    match &node.op {
        Op::Parameter { index, ty: _ } => write!(out, " {index}")?,
        Op::Constant { literal } => {
            out.write_char(' ')?;
            write_literal(out, literal)?;
        }
        Op::Iota { ty: _, axis } => write!(out, " axis = {axis}")?,
        Op::Unary { op: _, input } => write!(out, " {input}")?,
        Op::Binary { op: _, lhs, rhs } => write!(out, " {lhs}, {rhs}")?,
        Op::Compare { dir, lhs, rhs } => write!(out, " {} {lhs}, {rhs}", dir.name())?,
        Op::Select { pred, on_true, on_false } => write!(out, " {pred}, {on_true}, {on_false}")?,
        Op::Clamp { min, input, max } => write!(out, " {min}, {input}, {max}")?,
        Op::Convert { input, to: _ } => write!(out, " {input}")?,
        Op::BroadcastInDim { input, shape: _, dims } => write!(out, " {input}, dims = {}", ints(dims))?,
        Op::Reshape { input, shape: _ } => write!(out, " {input}")?,
        Op::Transpose { input, perm } => write!(out, " {input}, perm = {}", ints(perm))?,
        Op::Slice { input, start, limit, stride } => {
            write!(out, " {input}, start = {}, limit = {}, stride = {}", ints(start), ints(limit), ints(stride))?
        }
        Op::DynamicSlice { input: _, starts: _, sizes: _ }
        | Op::DynamicUpdateSlice { input: _, update: _, starts: _ } => write!(out, " {}", values(&node.op.inputs()))?,
        Op::Concatenate { inputs, axis } => write!(out, " {}, axis = {axis}", values(inputs))?,
        Op::Pad { input, value, low, high, interior } => {
            write!(out, " {input}, {value}, low = {}, high = {}, interior = {}", ints(low), ints(high), ints(interior))?
        }
        Op::Reduce { op, input, axes } => write!(out, " {} {input}, axes = {}", op.name(), ints(axes))?,
        Op::DotGeneral { lhs, rhs, dims } => write!(
            out,
            " {lhs}, {rhs}, batch = {} x {}, contract = {} x {}",
            ints(&dims.lhs_batch),
            ints(&dims.rhs_batch),
            ints(&dims.lhs_contract),
            ints(&dims.rhs_contract)
        )?,
        Op::Gather { operand, indices, axis } => write!(out, " {operand}, {indices}, axis = {axis}")?,
        Op::ScatterAdd { operand, indices, updates, axis } => {
            write!(out, " {operand}, {indices}, {updates}, axis = {axis}")?
        }
        Op::RngBitGenerator { algorithm, state, ty: _ } => write!(out, " {} {state}", algorithm.name())?,
        // No operands (and no outputs) is legal, so the space goes with each operand.
        Op::OptimizationBarrier { inputs } => {
            if !inputs.is_empty() {
                write!(out, " {}", values(inputs))?
            }
        }
        Op::AllReduce { op, input } => write!(out, " {} {input}", op.name())?,
        Op::Place { input, to } => write!(out, " {} {input}", to.name())?,
        // The moved value's type is the first operand's (or, copying back,
        // the result's).
        Op::HostCopy { inputs, step, slot, ty: _ } => {
            write!(out, " {} {}, slot = {slot}", step.name(), values(inputs))?
        }
        Op::Whole { input } => write!(out, " {input}")?,
        Op::Attention { q, k, v, bias, mask, attrs } => {
            write!(out, " {q}, {k}, {v}")?;
            attention_attrs(out, bias, *mask, *attrs)?
        }
        Op::AttentionGrad { q, k, v, bias, mask, out: o, stats, dout, attrs } => {
            write!(out, " {q}, {k}, {v}, {o}, {stats}, {dout}")?;
            attention_attrs(out, bias, *mask, *attrs)?
        }
        Op::LayerNorm { x, gamma, beta, eps_bits } => {
            write!(out, " {x}, {gamma}, {beta}, eps = {}", f64::from_bits(*eps_bits))?
        }
        Op::LayerNormGrad { x, gamma, mean, rstd, dy } => write!(out, " {x}, {gamma}, {mean}, {rstd}, {dy}")?,
        Op::RmsNorm { x, gamma, eps_bits } => write!(out, " {x}, {gamma}, eps = {}", f64::from_bits(*eps_bits))?,
        Op::RmsNormGrad { x, gamma, rstd, dy } => write!(out, " {x}, {gamma}, {rstd}, {dy}")?,
        Op::LmHeadCrossEntropy { h, w, labels, chunk, shards } => {
            write!(out, " {h}, {w}, {labels}, chunk = {chunk}{}", shards_attr(*shards))?
        }
        Op::LmHeadCrossEntropyGrad { h, w, labels, lse, dnll, chunk, shards } => {
            write!(out, " {h}, {w}, {labels}, {lse}, {dnll}, chunk = {chunk}{}", shards_attr(*shards))?
        }
        Op::LmHeadCrossEntropyFused { h, w, labels, scale, chunk, shards } => {
            write!(out, " {h}, {w}, {labels}, {scale}, chunk = {chunk}{}", shards_attr(*shards))?
        }
    }
    out.write_str(" : ")?;
    write_types(out, &node.outputs)
}

/// One type bare, any other count in parentheses.
fn write_types(out: &mut impl Write, types: &[TensorType]) -> fmt::Result {
    if let [t] = types {
        return write!(out, "{t}");
    }
    out.write_char('(')?;
    for (i, t) in types.iter().enumerate() {
        if i > 0 {
            out.write_str(", ")?;
        }
        write!(out, "{t}")?;
    }
    out.write_char(')')
}

/// `[1, 2]`.
/// `, shards = S` of the LM-head composites, left out when S is 1.
fn shards_attr(shards: usize) -> String {
    if shards == 1 {
        String::new()
    } else {
        format!(", shards = {shards}")
    }
}

fn ints<T: fmt::Display>(xs: &[T]) -> String {
    let parts: Vec<String> = xs.iter().map(ToString::to_string).collect();
    format!("[{}]", parts.join(", "))
}

/// `%1, %2#1`.
fn values(vs: &[ValueId]) -> String {
    let parts: Vec<String> = vs.iter().map(ToString::to_string).collect();
    parts.join(", ")
}

fn write_literal(out: &mut impl Write, lit: &Literal) -> fmt::Result {
    let dtype = lit.ty().dtype;
    let mut elems = lit.bytes().chunks_exact(dtype.size_in_bytes());
    // A one-element tensor is a splat, and `dense<[]>` spells an empty one.
    if lit.is_splat() {
        if let Some(first) = elems.next() {
            out.write_str("dense<")?;
            write_element(out, dtype, first)?;
            return out.write_char('>');
        }
    }
    out.write_str("dense<[")?;
    for (i, e) in elems.enumerate() {
        if i > 0 {
            out.write_str(", ")?;
        }
        write_element(out, dtype, e)?;
    }
    out.write_str("]>")
}

/// One little-endian element, exactly: integers from their bytes (no detour through
/// f64, which would round 64-bit values), floats in their shortest round-trip form.
fn write_element(out: &mut impl Write, dtype: DType, c: &[u8]) -> fmt::Result {
    let b2 = || [c[0], c[1]];
    let b4 = || [c[0], c[1], c[2], c[3]];
    let b8 = || [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
    match dtype {
        DType::Pred => out.write_str(if c[0] != 0 { "true" } else { "false" }),
        DType::I8 => write!(out, "{}", c[0] as i8),
        DType::I32 => write!(out, "{}", i32::from_le_bytes(b4())),
        DType::I64 => write!(out, "{}", i64::from_le_bytes(b8())),
        DType::U8 => write!(out, "{}", c[0]),
        DType::U32 => write!(out, "{}", u32::from_le_bytes(b4())),
        DType::U64 => write!(out, "{}", u64::from_le_bytes(b8())),
        DType::F16 => {
            let v = f16::from_le_bytes(b2());
            write_float(out, v.is_nan(), v.to_bits() == f16::NAN.to_bits(), u64::from(v.to_bits()), 4, v.to_f32())
        }
        DType::BF16 => {
            let v = bf16::from_le_bytes(b2());
            write_float(out, v.is_nan(), v.to_bits() == bf16::NAN.to_bits(), u64::from(v.to_bits()), 4, v.to_f32())
        }
        DType::F32 => {
            let v = f32::from_le_bytes(b4());
            write_float(out, v.is_nan(), v.to_bits() == f32::NAN.to_bits(), u64::from(v.to_bits()), 8, v)
        }
        DType::F64 => {
            let v = f64::from_le_bytes(b8());
            if v.is_nan() {
                write_nan(out, v.to_bits() == f64::NAN.to_bits(), v.to_bits(), 16)
            } else {
                write!(out, "{v:?}")
            }
        }
    }
}

/// f16, bf16 and f32 print through f32, whose shortest round-trip spelling is
/// exact for all three (f16 and bf16 embed in f32 exactly).
fn write_float(out: &mut impl Write, nan: bool, canonical: bool, bits: u64, hex_digits: usize, v: f32) -> fmt::Result {
    if nan {
        write_nan(out, canonical, bits, hex_digits)
    } else {
        write!(out, "{v:?}")
    }
}

/// The canonical quiet NaN is `nan`; other NaNs keep sign and payload as hex bits.
fn write_nan(out: &mut impl Write, canonical: bool, bits: u64, hex_digits: usize) -> fmt::Result {
    if canonical {
        out.write_str("nan")
    } else {
        write!(out, "0x{bits:0hex_digits$x}")
    }
}

/// `, scale = S, causal = C`, then what differs from the defaults of
/// [`AttentionAttrs::new`]: `bias = [..]`, `mask = %m`, `fill`, `keep`,
/// `kv_heads`, `k_transposed`.
fn attention_attrs(
    out: &mut impl Write,
    bias: &[ValueId],
    mask: Option<ValueId>,
    attrs: crate::ir::AttentionAttrs,
) -> fmt::Result {
    write!(out, ", scale = {}, causal = {}", attrs.scale(), attrs.causal)?;
    if !bias.is_empty() {
        write!(out, ", bias = [{}]", values(bias))?;
    }
    if let Some(m) = mask {
        write!(out, ", mask = {m}")?;
    }
    let plain = crate::ir::AttentionAttrs::new(attrs.scale(), attrs.causal);
    if attrs.fill_bits != plain.fill_bits {
        write!(out, ", fill = {}", attrs.fill())?;
    }
    if attrs.keep != plain.keep {
        write!(out, ", keep = {}", attrs.keep)?;
    }
    if attrs.kv_heads != plain.kv_heads {
        write!(out, ", kv_heads = {}", attrs.kv_heads.name())?;
    }
    if attrs.k_transposed != plain.k_transposed {
        write!(out, ", k_transposed = {}", attrs.k_transposed)?;
    }
    Ok(())
}
