//! The parser of kiln's text form (grammar in [`crate::text`]).
//!
//! The input is user input (the CLI reads files), so nothing here panics: every
//! malformed line, unknown op, undefined value or ill-typed node is a
//! `CompileError::Parse` naming its 1-based line. Nodes go through `Graph::add`,
//! so the graph is type-checked as it is built; the types written after `:` must
//! then equal the inferred ones, which keeps hand-written tests honest.
//! Names are renumbered densely in line order, so any names defined before use
//! are accepted.

use std::collections::HashMap;

use half::{bf16, f16};

use crate::ir::{
    Alias, AttentionAttrs, BinaryOp, CompareDir, DType, DotDims, Graph, HostCopyStep, KvHeads, Literal, MemorySpace,
    NodeId, Op, ReduceOp, RngAlgorithm, Shape, TensorType, UnaryOp, ValueId,
};
use crate::CompileError;

type Result<T> = std::result::Result<T, CompileError>;

/// Parses the text form into a graph; see [`crate::text`] for the grammar.
pub fn parse(text: &str) -> Result<Graph> {
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.find("//").map_or(l, |c| &l[..c]).trim()))
        .filter(|(_, l)| !l.is_empty());
    let eof_line = text.lines().count().max(1);
    let mut p = Parser { g: Graph::new(), names: HashMap::new() };

    let Some((line, header)) = lines.next() else {
        return Err(CompileError::Parse { line: eof_line, reason: "empty input: expected `graph(...) {`".into() });
    };
    p.header(&mut Cursor::new(header, line))?;
    loop {
        let Some((line, text)) = lines.next() else {
            return Err(CompileError::Parse {
                line: eof_line,
                reason: "unexpected end of input: expected `return`".into(),
            });
        };
        let mut c = Cursor::new(text, line);
        if c.eat_word("return") {
            p.ret(&mut c)?;
            break;
        }
        p.node(&mut c)?;
    }
    match lines.next() {
        Some((_, "}")) => {}
        Some((line, text)) => {
            return Err(CompileError::Parse { line, reason: format!("expected `}}` after `return`, found `{text}`") })
        }
        None => {
            return Err(CompileError::Parse { line: eof_line, reason: "unexpected end of input: expected `}`".into() })
        }
    }
    if let Some((line, text)) = lines.next() {
        return Err(CompileError::Parse {
            line,
            reason: format!("unexpected `{text}` after the graph's closing `}}`"),
        });
    }
    Ok(p.g)
}

struct Parser {
    g: Graph,
    /// Text name (without `%`) to the node it names; looked up, never iterated.
    names: HashMap<String, NodeId>,
}

impl Parser {
    /// `graph(%0: tensor<..>, ..) {`
    fn header(&mut self, c: &mut Cursor) -> Result<()> {
        c.expect_word("graph")?;
        c.expect("(")?;
        if !c.eat(")") {
            loop {
                let name = c.name()?;
                self.fresh(c, name)?;
                c.expect(":")?;
                let ty = c.ty()?;
                let v = self.g.parameter(ty);
                self.names.insert(name.to_string(), v.node);
                if c.eat(")") {
                    break;
                }
                c.expect(",")?;
            }
        }
        c.expect("{")?;
        c.end()
    }

    /// `return %a, %b {aliases = [0 -> 1]}`, after `return`.
    fn ret(&mut self, c: &mut Cursor) -> Result<()> {
        let mut outputs = Vec::new();
        if c.peek() == Some('%') {
            outputs = self.values(c)?;
        }
        self.g.set_outputs(outputs).map_err(|e| c.err(e.to_string()))?;
        if c.eat("{") {
            c.expect_word("aliases")?;
            c.expect("=")?;
            let aliases = c.list(|c| {
                let param = c.u32()?;
                c.expect("->")?;
                let output = c.u32()?;
                Ok(Alias { param, output })
            })?;
            c.expect("}")?;
            for alias in aliases {
                self.g.add_alias(alias).map_err(|e| c.err(e.to_string()))?;
            }
        }
        c.end()
    }

    /// `%3 = add %1, %2 : tensor<4xf32>` or `%5:2 = ... : (t, t)`.
    fn node(&mut self, c: &mut Cursor) -> Result<()> {
        let name = c.name()?;
        self.fresh(c, name)?;
        let count = if c.eat(":") { c.usize()? } else { 1 };
        c.expect("=")?;
        let kw = c.ident()?;
        let (op, types) = self.op(c, kw, count)?;
        let id = self.g.add(op).map_err(|e| c.err(e.to_string()))?;
        let inferred = &self.g.node(id).outputs;
        if inferred[..] != types[..] {
            return Err(c.err(format!("written type {} but `{kw}` infers {}", fmt_types(&types), fmt_types(inferred))));
        }
        self.names.insert(name.to_string(), id);
        Ok(())
    }

    /// The op after its keyword, through the end of the line, with the written types.
    fn op(&self, c: &mut Cursor, kw: &str, count: usize) -> Result<(Op, Vec<TensorType>)> {
        let op = match kw {
            "parameter" => {
                let index = c.u32()?;
                let ts = c.types(count)?;
                return Ok((Op::Parameter { index, ty: one(c, &ts)?.clone() }, ts));
            }
            "constant" => {
                c.expect_word("dense")?;
                c.expect("<")?;
                let body = c.until('>')?;
                let ts = c.types(count)?;
                let literal = dense(c, body, one(c, &ts)?)?;
                return Ok((Op::Constant { literal }, ts));
            }
            "iota" => {
                let axis = c.attr("axis", Cursor::usize)?;
                let ts = c.types(count)?;
                return Ok((Op::Iota { ty: one(c, &ts)?.clone(), axis }, ts));
            }
            "compare" => {
                let dir = c.keyword(&CompareDir::ALL, |d| d.name(), "comparison direction")?;
                let (lhs, rhs) = self.two(c)?;
                Op::Compare { dir, lhs, rhs }
            }
            "select" => {
                let [pred, on_true, on_false] = self.three(c)?;
                Op::Select { pred, on_true, on_false }
            }
            "clamp" => {
                let [min, input, max] = self.three(c)?;
                Op::Clamp { min, input, max }
            }
            "convert" => {
                let input = self.value(c)?;
                let ts = c.types(count)?;
                return Ok((Op::Convert { input, to: one(c, &ts)?.dtype }, ts));
            }
            "broadcast_in_dim" => {
                let input = self.value(c)?;
                let dims = c.comma_attr("dims", |c| c.list(Cursor::usize))?;
                let ts = c.types(count)?;
                return Ok((Op::BroadcastInDim { input, shape: one(c, &ts)?.shape.clone(), dims }, ts));
            }
            "reshape" => {
                let input = self.value(c)?;
                let ts = c.types(count)?;
                return Ok((Op::Reshape { input, shape: one(c, &ts)?.shape.clone() }, ts));
            }
            "transpose" => {
                let input = self.value(c)?;
                let perm = c.comma_attr("perm", |c| c.list(Cursor::usize))?;
                Op::Transpose { input, perm }
            }
            "slice" => {
                let input = self.value(c)?;
                let start = c.comma_attr("start", |c| c.list(Cursor::usize))?;
                let limit = c.comma_attr("limit", |c| c.list(Cursor::usize))?;
                let stride = c.comma_attr("stride", |c| c.list(Cursor::usize))?;
                Op::Slice { input, start, limit, stride }
            }
            "dynamic_slice" => {
                let mut vs = self.values(c)?.into_iter();
                let input = vs.next().ok_or_else(|| c.err("`dynamic_slice` needs an operand"))?;
                let ts = c.types(count)?;
                let sizes = one(c, &ts)?.shape.0.to_vec();
                return Ok((Op::DynamicSlice { input, starts: vs.collect(), sizes }, ts));
            }
            "dynamic_update_slice" => {
                let vs = self.values(c)?;
                let [input, update, starts @ ..] = vs.as_slice() else {
                    return Err(c.err("`dynamic_update_slice` needs an operand and an update"));
                };
                Op::DynamicUpdateSlice { input: *input, update: *update, starts: starts.to_vec() }
            }
            "concatenate" => {
                let inputs = self.values(c)?;
                let axis = c.comma_attr("axis", Cursor::usize)?;
                Op::Concatenate { inputs, axis }
            }
            "pad" => {
                let (input, value) = self.two(c)?;
                let low = c.comma_attr("low", |c| c.list(Cursor::i64))?;
                let high = c.comma_attr("high", |c| c.list(Cursor::i64))?;
                let interior = c.comma_attr("interior", |c| c.list(Cursor::usize))?;
                Op::Pad { input, value, low, high, interior }
            }
            "reduce" => {
                let op = c.keyword(&ReduceOp::ALL, |r| r.name(), "reduction")?;
                let input = self.value(c)?;
                let axes = c.comma_attr("axes", |c| c.list(Cursor::usize))?;
                Op::Reduce { op, input, axes }
            }
            "dot_general" => {
                let (lhs, rhs) = self.two(c)?;
                let (lhs_batch, rhs_batch) = c.comma_attr("batch", Cursor::dim_pair)?;
                let (lhs_contract, rhs_contract) = c.comma_attr("contract", Cursor::dim_pair)?;
                Op::DotGeneral { lhs, rhs, dims: DotDims { lhs_batch, rhs_batch, lhs_contract, rhs_contract } }
            }
            "gather" => {
                let (operand, indices) = self.two(c)?;
                let axis = c.comma_attr("axis", Cursor::usize)?;
                Op::Gather { operand, indices, axis }
            }
            "scatter_add" => {
                let [operand, indices, updates] = self.three(c)?;
                let axis = c.comma_attr("axis", Cursor::usize)?;
                Op::ScatterAdd { operand, indices, updates, axis }
            }
            "rng_bit_generator" => {
                let algorithm =
                    c.keyword(&[RngAlgorithm::ThreeFry, RngAlgorithm::Philox], |a| a.name(), "algorithm")?;
                let state = self.value(c)?;
                let ts = c.types(count)?;
                let [_, bits] = ts.as_slice() else {
                    return Err(c.err("`rng_bit_generator` has two results: the new state and the bits"));
                };
                return Ok((Op::RngBitGenerator { algorithm, state, ty: bits.clone() }, ts));
            }
            "optimization_barrier" => {
                let inputs = if c.peek() == Some('%') { self.values(c)? } else { Vec::new() };
                Op::OptimizationBarrier { inputs }
            }
            "place" => {
                let to = c.keyword(&[MemorySpace::Device, MemorySpace::PinnedHost], |m| m.name(), "memory space")?;
                let input = self.value(c)?;
                Op::Place { input, to }
            }
            "host_copy" => {
                let step = c.keyword(&HostCopyStep::ALL, |s| s.name(), "host copy step")?;
                let inputs = self.values(c)?;
                let slot = c.comma_attr("slot", Cursor::usize)?;
                let slot = u32::try_from(slot).map_err(|_| c.err(format!("slot {slot} is too large")))?;
                let ts = c.types(count)?;
                let ty = match (step, inputs.first()) {
                    (HostCopyStep::In, _) => one(c, &ts)?.clone(),
                    (_, Some(&v)) => self.g.ty(v).clone(),
                    (_, None) => return Err(c.err(format!("`host_copy {}` needs the value it moves", step.name()))),
                };
                return Ok((Op::HostCopy { inputs, step, slot, ty }, ts));
            }
            "whole" => Op::Whole { input: self.value(c)? },
            "all_reduce" => {
                let op = c.keyword(&ReduceOp::ALL, |r| r.name(), "reduction")?;
                let input = self.value(c)?;
                Op::AllReduce { op, input }
            }
            "attention" => {
                let [q, k, v] = self.three(c)?;
                let (bias, mask, attrs) = self.attention_attrs(c)?;
                Op::Attention { q, k, v, bias, mask, attrs }
            }
            "attention_grad" => {
                let vs = self.values(c)?;
                let [q, k, v, out, stats, dout] = vs.as_slice() else {
                    return Err(c.err("`attention_grad` takes q, k, v, out, stats, dout"));
                };
                let (bias, mask, attrs) = self.attention_attrs(c)?;
                Op::AttentionGrad { q: *q, k: *k, v: *v, bias, mask, out: *out, stats: *stats, dout: *dout, attrs }
            }
            "layer_norm" => {
                let [x, gamma, beta] = self.three(c)?;
                let eps = c.comma_attr("eps", float)?;
                Op::LayerNorm { x, gamma, beta, eps_bits: eps.to_bits() }
            }
            "layer_norm_grad" => {
                let vs = self.values(c)?;
                let [x, gamma, mean, rstd, dy] = vs.as_slice() else {
                    return Err(c.err("`layer_norm_grad` takes x, gamma, mean, rstd, dy"));
                };
                Op::LayerNormGrad { x: *x, gamma: *gamma, mean: *mean, rstd: *rstd, dy: *dy }
            }
            "rms_norm" => {
                let (x, gamma) = self.two(c)?;
                let eps = c.comma_attr("eps", float)?;
                Op::RmsNorm { x, gamma, eps_bits: eps.to_bits() }
            }
            "rms_norm_grad" => {
                let vs = self.values(c)?;
                let [x, gamma, rstd, dy] = vs.as_slice() else {
                    return Err(c.err("`rms_norm_grad` takes x, gamma, rstd, dy"));
                };
                Op::RmsNormGrad { x: *x, gamma: *gamma, rstd: *rstd, dy: *dy }
            }
            "lm_head_cross_entropy" => {
                let [h, w, labels] = self.three(c)?;
                let (chunk, shards) = lm_head_attrs(c)?;
                Op::LmHeadCrossEntropy { h, w, labels, chunk, shards }
            }
            "lm_head_cross_entropy_grad" => {
                let vs = self.values(c)?;
                let [h, w, labels, lse, dnll] = vs.as_slice() else {
                    return Err(c.err("`lm_head_cross_entropy_grad` takes h, w, labels, lse, dnll"));
                };
                let (chunk, shards) = lm_head_attrs(c)?;
                Op::LmHeadCrossEntropyGrad { h: *h, w: *w, labels: *labels, lse: *lse, dnll: *dnll, chunk, shards }
            }
            "lm_head_cross_entropy_fused" => {
                let vs = self.values(c)?;
                let [h, w, labels, scale] = vs.as_slice() else {
                    return Err(c.err("`lm_head_cross_entropy_fused` takes h, w, labels, scale"));
                };
                let (chunk, shards) = lm_head_attrs(c)?;
                Op::LmHeadCrossEntropyFused { h: *h, w: *w, labels: *labels, scale: *scale, chunk, shards }
            }
            other => {
                if let Some(&op) = UnaryOp::ALL.iter().find(|u| u.name() == other) {
                    let input = self.value(c)?;
                    Op::Unary { op, input }
                } else if let Some(&op) = BinaryOp::ALL.iter().find(|b| b.name() == other) {
                    let (lhs, rhs) = self.two(c)?;
                    Op::Binary { op, lhs, rhs }
                } else {
                    return Err(c.err(format!("unknown op `{other}`")));
                }
            }
        };
        let ts = c.types(count)?;
        Ok((op, ts))
    }

    /// Rejects a second definition of `name`.
    fn fresh(&self, c: &Cursor, name: &str) -> Result<()> {
        if self.names.contains_key(name) {
            return Err(c.err(format!("%{name} is defined twice")));
        }
        Ok(())
    }

    /// A use: `%name` or `%name#k`, defined on an earlier line.
    fn value(&self, c: &mut Cursor) -> Result<ValueId> {
        let name = c.name()?;
        let output = if c.eat("#") { c.u32()? } else { 0 };
        let Some(&node) = self.names.get(name) else {
            return Err(c.err(format!("undefined value %{name}")));
        };
        let outputs = self.g.node(node).outputs.len();
        if output as usize >= outputs {
            return Err(c.err(format!("%{name} has {outputs} result(s), so %{name}#{output} does not exist")));
        }
        Ok(ValueId::new(node, output))
    }

    /// `%a, %b, ..`: stops before a comma that does not start another value, so
    /// attributes may follow.
    fn values(&self, c: &mut Cursor) -> Result<Vec<ValueId>> {
        let mut vs = vec![self.value(c)?];
        loop {
            let save = c.pos;
            if c.eat(",") && c.peek() == Some('%') {
                vs.push(self.value(c)?);
            } else {
                c.pos = save;
                return Ok(vs);
            }
        }
    }

    fn two(&self, c: &mut Cursor) -> Result<(ValueId, ValueId)> {
        let a = self.value(c)?;
        c.expect(",")?;
        Ok((a, self.value(c)?))
    }

    fn three(&self, c: &mut Cursor) -> Result<[ValueId; 3]> {
        let (a, b) = self.two(c)?;
        c.expect(",")?;
        Ok([a, b, self.value(c)?])
    }

    /// `, scale = <f64>, causal = <bool>` of the attention composites, then
    /// the optional `bias = [..]`, `mask = %m`, `fill = <f64>`, `keep =
    /// <bool>`, `kv_heads = grouped|tiled`, `k_transposed = <bool>` in that
    /// order.
    fn attention_attrs(&self, c: &mut Cursor) -> Result<(Vec<ValueId>, Option<ValueId>, AttentionAttrs)> {
        let scale = c.comma_attr("scale", float)?;
        let causal = c.comma_attr("causal", boolean)?;
        let mut attrs = AttentionAttrs::new(scale, causal);
        let (mut bias, mut mask) = (Vec::new(), None);
        let order = ["bias", "mask", "fill", "keep", "kv_heads", "k_transposed"];
        let mut next = 0;
        while c.eat(",") {
            let save = c.pos;
            let name = c.ident()?;
            let Some(at) = order.iter().skip(next).position(|&n| n == name).map(|p| p + next) else {
                c.pos = save;
                return Err(c.err(format!("unexpected attention attribute `{name}` (in order: {})", order.join(", "))));
            };
            next = at + 1;
            c.expect("=")?;
            match name {
                "bias" => bias = c.list(|c| self.value(c))?,
                "mask" => mask = Some(self.value(c)?),
                "fill" => attrs.fill_bits = float(c)?.to_bits(),
                "keep" => attrs.keep = boolean(c)?,
                "kv_heads" => {
                    attrs.kv_heads = c.keyword(&[KvHeads::Grouped, KvHeads::Tiled], KvHeads::name, "kv heads")?
                }
                _ => attrs.k_transposed = boolean(c)?,
            }
        }
        Ok((bias, mask, attrs))
    }
}

/// The single written type of a one-result op.
/// An f64 attribute written as Rust prints it (`0.125`, `1e-5`, `inf`).
fn float(c: &mut Cursor) -> Result<f64> {
    c.skip_ws();
    let rest = c.rest();
    let len = rest.find(|ch: char| !(ch.is_ascii_alphanumeric() || "+-.".contains(ch))).unwrap_or(rest.len());
    let value: f64 = rest[..len].parse().map_err(|_| c.err(format!("expected a number, found {}", c.found())))?;
    c.pos += len;
    Ok(value)
}

fn boolean(c: &mut Cursor) -> Result<bool> {
    c.keyword(&[true, false], |b| if b { "true" } else { "false" }, "true or false")
}

/// `, chunk = C` and an optional `, shards = S` (1 when absent) of the LM-head
/// composites.
fn lm_head_attrs(c: &mut Cursor) -> Result<(usize, usize)> {
    let chunk = c.comma_attr("chunk", Cursor::usize)?;
    let shards = if c.eat(",") { c.attr("shards", Cursor::usize)? } else { 1 };
    Ok((chunk, shards))
}

fn one<'t>(c: &Cursor, ts: &'t [TensorType]) -> Result<&'t TensorType> {
    match ts {
        [t] => Ok(t),
        _ => Err(c.err(format!("expected one result type, found {}", ts.len()))),
    }
}

fn fmt_types(ts: &[TensorType]) -> String {
    match ts {
        [t] => t.to_string(),
        _ => format!("({})", ts.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// The largest splat constant the parser expands (1 GiB).
const MAX_SPLAT_BYTES: usize = 1 << 30;

/// The inside of `dense<..>`: one value (a splat, repeated to fill `ty`) or a
/// bracketed row-major list of exactly `ty`'s element count.
///
/// A list is read one value at a time straight into the literal's bytes and
/// counted against `ty` as it goes: a list longer than its type is refused at
/// the first value too many (a 194 KB gzip'd graph of `dense<[0, 0, ...]>`
/// once took 1.8 GB before its count was checked), and nothing is held but the
/// bytes, reserved for at most the values the text can spell.
fn dense(c: &Cursor, body: &str, ty: &TensorType) -> Result<Literal> {
    let body = body.trim();
    let n = ty.shape.num_elements();
    let width = ty.dtype.size_in_bytes();
    let mut bytes = Vec::new();
    if let Some(list) = body.strip_prefix('[') {
        let list = list.strip_suffix(']').ok_or_else(|| c.err(format!("unterminated list in `dense<{body}>`")))?;
        let list = list.trim();
        // Every value takes at least one character and a comma.
        let spelled = if list.is_empty() { 0 } else { list.len().div_ceil(2) };
        bytes.reserve_exact(n.min(spelled).saturating_mul(width));
        let mut count = 0usize;
        for e in list.split(',').filter(|_| !list.is_empty()) {
            if count == n {
                return Err(c.err(format!("`dense` has more than {n} values, the element count of {ty}")));
            }
            element(ty.dtype, e.trim(), &mut bytes).map_err(|r| c.err(r))?;
            count += 1;
        }
        if count != n {
            return Err(c.err(format!("`dense` has {count} values but {ty} has {n} elements")));
        }
    } else {
        // A splat is stored expanded, so its size is not bounded by the text's:
        // refuse sizes that would exhaust memory rather than abort the process.
        if ty.size_in_bytes() > MAX_SPLAT_BYTES {
            return Err(c.err(format!("splat constant of {ty} exceeds {MAX_SPLAT_BYTES} bytes")));
        }
        let mut one = Vec::new();
        element(ty.dtype, body, &mut one).map_err(|r| c.err(r))?;
        bytes.reserve_exact(ty.size_in_bytes());
        for _ in 0..n {
            bytes.extend_from_slice(&one);
        }
    }
    Literal::from_bytes(ty.clone(), bytes).map_err(|e| c.err(e.to_string()))
}

/// `s`, or its first 24 characters and `..`: a malformed value quoted in an
/// error can be a whole line of digits.
fn snippet(s: &str) -> String {
    match s.char_indices().nth(24) {
        Some((at, _)) => format!("{}..", &s[..at]),
        None => s.to_string(),
    }
}

/// Appends one element of `dtype` spelled `s` in little-endian bytes.
fn element(dtype: DType, s: &str, out: &mut Vec<u8>) -> std::result::Result<(), String> {
    let bad = || format!("`{}` is not a valid {dtype} value", snippet(s));
    match dtype {
        DType::Pred => out.push(match s {
            "true" => 1,
            "false" => 0,
            _ => return Err(bad()),
        }),
        DType::I8 => out.extend(s.parse::<i8>().map_err(|_| bad())?.to_le_bytes()),
        DType::I32 => out.extend(s.parse::<i32>().map_err(|_| bad())?.to_le_bytes()),
        DType::I64 => out.extend(s.parse::<i64>().map_err(|_| bad())?.to_le_bytes()),
        DType::U8 => out.extend(s.parse::<u8>().map_err(|_| bad())?.to_le_bytes()),
        DType::U32 => out.extend(s.parse::<u32>().map_err(|_| bad())?.to_le_bytes()),
        DType::U64 => out.extend(s.parse::<u64>().map_err(|_| bad())?.to_le_bytes()),
        // f16 and bf16 decimals go through f64 and then round once more; values
        // the printer wrote are exact in both, so they come back bit for bit.
        DType::F16 => {
            let bits = float_bits(s, 16, f16::NAN.to_bits().into(), |s| {
                s.parse::<f64>().ok().map(|v| crate::ir::f16_from_f64(v).to_bits().into())
            })?;
            out.extend((bits as u16).to_le_bytes())
        }
        DType::BF16 => {
            let bits = float_bits(s, 16, bf16::NAN.to_bits().into(), |s| {
                s.parse::<f64>().ok().map(|v| crate::ir::bf16_from_f64(v).to_bits().into())
            })?;
            out.extend((bits as u16).to_le_bytes())
        }
        DType::F32 => {
            let bits =
                float_bits(s, 32, f32::NAN.to_bits().into(), |s| s.parse::<f32>().ok().map(|v| v.to_bits().into()))?;
            out.extend((bits as u32).to_le_bytes())
        }
        DType::F64 => {
            let bits = float_bits(s, 64, f64::NAN.to_bits(), |s| s.parse::<f64>().ok().map(f64::to_bits))?;
            out.extend(bits.to_le_bytes())
        }
    }
    Ok(())
}

/// Bits of a float of `width` bits: `nan` (the canonical NaN), `0x..` (raw bits,
/// how other NaNs print), or a decimal / `inf` / `-inf` read by `decimal`.
/// Rust's float parser also reads `NaN` and `-nan`, whose bits are not pinned
/// down, so those spellings are refused.
fn float_bits(
    s: &str,
    width: u32,
    nan: u64,
    decimal: impl Fn(&str) -> Option<u64>,
) -> std::result::Result<u64, String> {
    let bad = || format!("`{}` is not a valid f{width} value", snippet(s));
    if s == "nan" {
        return Ok(nan);
    }
    if let Some(hex) = s.strip_prefix("0x") {
        let bits = u64::from_str_radix(hex, 16).map_err(|_| bad())?;
        return if width == 64 || bits >> width == 0 { Ok(bits) } else { Err(bad()) };
    }
    if s.to_ascii_lowercase().contains("nan") {
        return Err(bad());
    }
    decimal(s).ok_or_else(bad)
}

/// A position in one line of text.
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
    line: usize,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a str, line: usize) -> Cursor<'a> {
        Cursor { s, pos: 0, line }
    }

    fn err(&self, reason: impl Into<String>) -> CompileError {
        CompileError::Parse { line: self.line, reason: reason.into() }
    }

    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn skip_ws(&mut self) {
        let r = self.rest();
        self.pos += r.len() - r.trim_start().len();
    }

    /// The next non-blank character, not consumed.
    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.rest().chars().next()
    }

    /// What comes next, for error messages.
    fn found(&self) -> String {
        let r = self.rest().trim_start();
        if r.is_empty() {
            "end of line".into()
        } else {
            let snippet: String = r.chars().take(24).collect();
            format!("`{snippet}`")
        }
    }

    fn eat(&mut self, punct: &str) -> bool {
        self.skip_ws();
        if self.rest().starts_with(punct) {
            self.pos += punct.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, punct: &str) -> Result<()> {
        if self.eat(punct) {
            Ok(())
        } else {
            Err(self.err(format!("expected `{punct}`, found {}", self.found())))
        }
    }

    /// Consumes `word` only when it is a whole identifier (`x` does not eat `xor`).
    fn eat_word(&mut self, word: &str) -> bool {
        let save = self.pos;
        match self.ident() {
            Ok(w) if w == word => true,
            _ => {
                self.pos = save;
                false
            }
        }
    }

    fn expect_word(&mut self, word: &str) -> Result<()> {
        if self.eat_word(word) {
            Ok(())
        } else {
            Err(self.err(format!("expected `{word}`, found {}", self.found())))
        }
    }

    /// Consumes a run of identifier characters (`[A-Za-z0-9_]`); empty is an error.
    fn word(&mut self, what: &str) -> Result<&'a str> {
        self.skip_ws();
        let r = self.rest();
        let len = r.find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')).unwrap_or(r.len());
        if len == 0 {
            return Err(self.err(format!("expected {what}, found {}", self.found())));
        }
        self.pos += len;
        Ok(&r[..len])
    }

    fn ident(&mut self) -> Result<&'a str> {
        self.word("an identifier")
    }

    /// `%name`, returning `name`.
    fn name(&mut self) -> Result<&'a str> {
        if !self.eat("%") {
            return Err(self.err(format!("expected a value name `%..`, found {}", self.found())));
        }
        self.word("a value name after `%`")
    }

    fn number<T: std::str::FromStr>(&mut self, what: &str) -> Result<T> {
        self.skip_ws();
        let save = self.pos;
        self.eat("-");
        let digits = self.rest().find(|ch: char| !ch.is_ascii_digit()).unwrap_or(self.rest().len());
        self.pos += digits;
        let text = &self.s[save..self.pos];
        text.parse().map_err(|_| {
            self.pos = save;
            self.err(format!("expected {what}, found {}", self.found()))
        })
    }

    fn usize(&mut self) -> Result<usize> {
        self.number("a non-negative integer")
    }

    fn u32(&mut self) -> Result<u32> {
        self.number("a non-negative integer")
    }

    fn i64(&mut self) -> Result<i64> {
        self.number("an integer")
    }

    /// `[item, ..]`, possibly empty.
    fn list<T>(&mut self, mut item: impl FnMut(&mut Self) -> Result<T>) -> Result<Vec<T>> {
        self.expect("[")?;
        let mut items = Vec::new();
        if self.eat("]") {
            return Ok(items);
        }
        loop {
            items.push(item(self)?);
            if self.eat("]") {
                return Ok(items);
            }
            self.expect(",")?;
        }
    }

    /// `name = value`.
    fn attr<T>(&mut self, name: &str, value: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.expect_word(name)?;
        self.expect("=")?;
        value(self)
    }

    /// `, name = value`, an attribute after operands.
    fn comma_attr<T>(&mut self, name: &str, value: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.expect(",")?;
        self.attr(name, value)
    }

    /// `[..] x [..]`, the lhs and rhs dimensions of `dot_general`.
    fn dim_pair(&mut self) -> Result<(Vec<usize>, Vec<usize>)> {
        let lhs = self.list(Cursor::usize)?;
        self.expect_word("x")?;
        Ok((lhs, self.list(Cursor::usize)?))
    }

    /// One of `options`, spelled as `name` spells it.
    fn keyword<T: Copy>(&mut self, options: &[T], name: impl Fn(T) -> &'static str, what: &str) -> Result<T> {
        let save = self.pos;
        let word = self.ident()?;
        options.iter().copied().find(|&o| name(o) == word).ok_or_else(|| {
            self.pos = save;
            let all: Vec<&str> = options.iter().map(|&o| name(o)).collect();
            self.err(format!("unknown {what} `{word}`, expected one of {}", all.join(", ")))
        })
    }

    /// Everything up to (not including) `close`, which is consumed.
    fn until(&mut self, close: char) -> Result<&'a str> {
        let r = self.rest();
        let Some(end) = r.find(close) else {
            return Err(self.err(format!("missing `{close}`")));
        };
        self.pos += end + close.len_utf8();
        Ok(&r[..end])
    }

    /// `tensor<2x3xf32>`, `tensor<f32>`.
    fn ty(&mut self) -> Result<TensorType> {
        self.expect_word("tensor")?;
        self.expect("<")?;
        let body = self.until('>')?;
        let mut parts: Vec<&str> = body.split('x').map(str::trim).collect();
        let dtype_name = parts.pop().unwrap_or_default();
        let dtype = DType::from_mlir_name(dtype_name)
            .ok_or_else(|| self.err(format!("unknown element type `{dtype_name}` in `tensor<{body}>`")))?;
        let dims = parts
            .iter()
            .map(|d| d.parse::<usize>().map_err(|_| self.err(format!("bad dimension `{d}` in `tensor<{body}>`"))))
            .collect::<Result<Vec<usize>>>()?;
        // Element and byte counts must fit a usize, or shape arithmetic in
        // inference and literals would overflow on a typo'd dimension.
        let fits = dims.iter().try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d)).is_some();
        if !fits {
            return Err(self.err(format!("`tensor<{body}>` is too large")));
        }
        Ok(TensorType { dtype, shape: Shape::new(dims) })
    }

    /// `: type` or `: (type, ..)` holding `count` types, then the end of the line.
    fn types(&mut self, count: usize) -> Result<Vec<TensorType>> {
        self.expect(":")?;
        let ts = if self.eat("(") {
            let mut ts = Vec::new();
            if !self.eat(")") {
                loop {
                    ts.push(self.ty()?);
                    if self.eat(")") {
                        break;
                    }
                    self.expect(",")?;
                }
            }
            ts
        } else {
            vec![self.ty()?]
        };
        if ts.len() != count {
            return Err(self.err(format!("{count} result(s) declared but {} type(s) written", ts.len())));
        }
        self.end()?;
        Ok(ts)
    }

    fn end(&mut self) -> Result<()> {
        if self.peek().is_none() {
            Ok(())
        } else {
            Err(self.err(format!("unexpected {} at the end of the line", self.found())))
        }
    }
}
