//! The text of constant data: MLIR `dense<...>` element attributes, and the
//! form each constant takes in the module ([`ConstantForm`]).
//!
//! Invariant: parsing the text gives back exactly the literal's bits.
//! - f32/f64 print in Rust's shortest round-trip scientific form, with a `.`
//!   forced into the mantissa because MLIR lexes `1e0` as an integer.
//! - Non-finite floats and all f16/bf16 elements print as hex bit patterns,
//!   which MLIR reads bit for bit (no decimal rounding in a 16-bit format).
//! - Integers print in decimal from their own bytes, never through f64, so
//!   64-bit values are exact; pred prints as `true`/`false`.
//! - A splat prints as one element; a constant of at least
//!   [`LARGE_CONSTANT_BYTES`] as its little-endian bytes in hex
//!   (`dense<"0x0000803F..">`, MLIR's raw-buffer form; a pred one as `ui8`
//!   bytes the lowering converts); otherwise a nested list shaped like the
//!   tensor (`[[1.0e0, 2.0e0], [3.0e0, 4.0e0]]`).
//! - Elements are written straight into the text: a constant of tens of
//!   millions of elements costs its text, not a `String` per element.

use std::fmt::Write as _;

use half::{bf16, f16};

use crate::ir::{DType, Literal, ReduceOp};

/// The size (bytes of the constant's type) from which a constant is written
/// compactly: a splat as a scalar broadcast to its shape
/// ([`ConstantForm::Broadcast`]), any other in hex ([`ConstantForm::Hex`]).
/// Below it the readable forms are kept: they cost little each, and they are
/// what the snapshots show.
pub const LARGE_CONSTANT_BYTES: usize = 1 << 20;

/// How the lowering writes a constant, which decides what reading it costs
/// the plugin (the CLI's memory check prices each form; measured there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConstantForm {
    /// A large splat: `stablehlo.constant` of its one element and a
    /// `broadcast_in_dim` to its shape, so the module never holds the
    /// tensor's bytes, by construction rather than by what a plugin's
    /// importer does with `dense<v>` (the XLA CPU plugin's measured no larger:
    /// 306 MiB peak for a 200 MiB splat either way).
    Broadcast,
    /// A small splat, `dense<v>`.
    Splat,
    /// A large constant as `dense<"0x..">`: two characters a byte, which MLIR
    /// decodes straight into its buffer (a 100 MiB f32 constant peaked at
    /// 781 MiB in `kiln compile` this way, 2022 MiB as a list). Pred is
    /// written as `ui8` bytes and converted (`x != 0`, how kiln reads a pred
    /// byte): MLIR's raw layout of `i1`, bit- or byte-packed, differs between
    /// versions.
    Hex,
    /// A small constant as a list of decimal elements; MLIR's parser holds a
    /// token per element, many times the element's bytes.
    List,
}

/// The form the lowering of a `constant` gives `lit`.
pub fn constant_form(lit: &Literal) -> ConstantForm {
    let large = lit.bytes().len() >= LARGE_CONSTANT_BYTES;
    let splat = lit.ty().shape.num_elements() > 0 && lit.is_splat();
    match (splat, large) {
        (true, true) => ConstantForm::Broadcast,
        (true, false) => ConstantForm::Splat,
        (false, true) => ConstantForm::Hex,
        (false, false) => ConstantForm::List,
    }
}

/// `dense<...>` for `lit` (without the trailing `: tensor<..>`); a
/// [`ConstantForm::Broadcast`] splat prints as its one element here, and the
/// caller writes the broadcast.
pub(super) fn dense(lit: &Literal) -> String {
    let ty = lit.ty();
    let width = ty.dtype.size_in_bytes();
    match constant_form(lit) {
        ConstantForm::Broadcast | ConstantForm::Splat => {
            let mut out = String::from("dense<");
            element(&mut out, ty.dtype, &lit.bytes()[..width]);
            out.push('>');
            out
        }
        ConstantForm::Hex => dense_hex(lit.bytes()),
        ConstantForm::List => {
            let mut out = String::from("dense<");
            nested(&mut out, ty.dtype, ty.shape.dims(), lit.bytes());
            out.push('>');
            out
        }
    }
}

/// `dense<"0x...">`: `bytes` as upper-case hex digits, in order (MLIR reads
/// them as the tensor's little-endian raw buffer).
pub(super) fn dense_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(bytes.len() * 2 + 12);
    out.push_str("dense<\"0x");
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    out.push_str("\">");
    out
}

/// The scalar identity of `op` over `dtype`, the init value of a reduction.
pub(super) fn identity(op: ReduceOp, dtype: DType) -> Literal {
    // `ReduceOp::identity` is exact for every dtype once written back:
    // 64-bit extremes pass through f64 as +-2^63 / 2^64, and the saturating
    // float-to-int conversion of `Literal::scalar` lands on i64::MAX / u64::MAX.
    Literal::scalar(dtype, op.identity(dtype))
}

/// Writes `bytes` (row-major elements of `dtype`) as a nested list of
/// `dims`' shape.
fn nested(out: &mut String, dtype: DType, dims: &[usize], bytes: &[u8]) {
    let Some((&outer, inner)) = dims.split_first() else {
        element(out, dtype, bytes);
        return;
    };
    let chunk = inner.iter().product::<usize>() * dtype.size_in_bytes();
    out.push('[');
    for i in 0..outer {
        if i > 0 {
            out.push_str(", ");
        }
        nested(out, dtype, inner, &bytes[i * chunk..(i + 1) * chunk]);
    }
    out.push(']');
}

/// Appends one element from its little-endian bytes.
fn element(out: &mut String, dtype: DType, c: &[u8]) {
    // Writing to a `String` cannot fail.
    let _ = match dtype {
        DType::Pred => write!(out, "{}", if c[0] != 0 { "true" } else { "false" }),
        DType::I8 => write!(out, "{}", c[0] as i8),
        DType::I32 => write!(out, "{}", i32::from_le_bytes(c.try_into().expect("4 bytes"))),
        DType::I64 => write!(out, "{}", i64::from_le_bytes(c.try_into().expect("8 bytes"))),
        DType::U8 => write!(out, "{}", c[0]),
        DType::U32 => write!(out, "{}", u32::from_le_bytes(c.try_into().expect("4 bytes"))),
        DType::U64 => write!(out, "{}", u64::from_le_bytes(c.try_into().expect("8 bytes"))),
        DType::F16 => write!(out, "0x{:04X}", f16::from_le_bytes([c[0], c[1]]).to_bits()),
        DType::BF16 => write!(out, "0x{:04X}", bf16::from_le_bytes([c[0], c[1]]).to_bits()),
        DType::F32 => {
            let v = f32::from_le_bytes(c.try_into().expect("4 bytes"));
            if v.is_finite() {
                write_with_point(out, format_args!("{v:e}"))
            } else {
                write!(out, "0x{:08X}", v.to_bits())
            }
        }
        DType::F64 => {
            let v = f64::from_le_bytes(c.try_into().expect("8 bytes"));
            if v.is_finite() {
                write_with_point(out, format_args!("{v:e}"))
            } else {
                write!(out, "0x{:016X}", v.to_bits())
            }
        }
    };
}

/// Writes `v` (a float in `{:e}` form), with `1e0` -> `1.0e0`: MLIR's float
/// literals need a decimal point.
fn write_with_point(out: &mut String, v: std::fmt::Arguments<'_>) -> std::fmt::Result {
    let start = out.len();
    out.write_fmt(v)?;
    if let Some(e) = out[start..].find('e') {
        if !out[start..start + e].contains('.') {
            out.insert_str(start + e, ".0");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Shape;

    fn text(dtype: DType, dims: &[usize], values: &[f64]) -> String {
        dense(&Literal::from_f64s(dtype, Shape::new(dims), values).unwrap())
    }

    #[test]
    fn floats_are_exact_and_have_a_point() {
        assert_eq!(text(DType::F32, &[], &[1.0]), "dense<1.0e0>");
        assert_eq!(text(DType::F32, &[], &[0.1]), "dense<1.0e-1>");
        assert_eq!(text(DType::F32, &[2], &[-0.25, 3.0e7]), "dense<[-2.5e-1, 3.0e7]>");
        assert_eq!(text(DType::F64, &[], &[0.1]), "dense<1.0e-1>");
        assert_eq!(text(DType::F32, &[], &[1.0 / 3.0]), "dense<3.3333334e-1>");
    }

    #[test]
    fn non_finite_and_half_floats_are_hex() {
        assert_eq!(text(DType::F32, &[], &[f64::NEG_INFINITY]), "dense<0xFF800000>");
        assert_eq!(text(DType::F64, &[], &[f64::INFINITY]), "dense<0x7FF0000000000000>");
        assert_eq!(text(DType::BF16, &[2], &[1.0, -2.0]), "dense<[0x3F80, 0xC000]>");
        assert_eq!(text(DType::F16, &[], &[1.0]), "dense<0x3C00>");
    }

    #[test]
    fn nested_lists_follow_the_shape() {
        assert_eq!(text(DType::I32, &[2, 2], &[1.0, 2.0, 3.0, 4.0]), "dense<[[1, 2], [3, 4]]>");
        assert_eq!(text(DType::Pred, &[3], &[1.0, 0.0, 1.0]), "dense<[true, false, true]>");
        assert_eq!(text(DType::F32, &[2, 0], &[]), "dense<[[], []]>");
    }

    #[test]
    fn reduction_identities_are_exact() {
        let id = |op, dtype| dense(&identity(op, dtype));
        assert_eq!(id(ReduceOp::Max, DType::I64), "dense<-9223372036854775808>");
        assert_eq!(id(ReduceOp::Min, DType::I64), "dense<9223372036854775807>");
        assert_eq!(id(ReduceOp::Min, DType::U64), "dense<18446744073709551615>");
        assert_eq!(id(ReduceOp::Max, DType::F32), "dense<0xFF800000>");
        assert_eq!(id(ReduceOp::Prod, DType::BF16), "dense<0x3F80>");
        assert_eq!(id(ReduceOp::Min, DType::Pred), "dense<true>");
    }
}
