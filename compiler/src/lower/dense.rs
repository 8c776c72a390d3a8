//! The text of constant data: MLIR `dense<...>` element attributes.
//!
//! Invariant: parsing the text gives back exactly the literal's bits.
//! - f32/f64 print in Rust's shortest round-trip scientific form, with a `.`
//!   forced into the mantissa because MLIR lexes `1e0` as an integer.
//! - Non-finite floats and all f16/bf16 elements print as hex bit patterns,
//!   which MLIR reads bit for bit (no decimal rounding in a 16-bit format).
//! - Integers print in decimal from their own bytes, never through f64, so
//!   64-bit values are exact; pred prints as `true`/`false`.
//! - A splat prints as one element; otherwise a nested list shaped like the
//!   tensor (`[[1.0e0, 2.0e0], [3.0e0, 4.0e0]]`).

use half::{bf16, f16};

use crate::ir::{DType, Literal, ReduceOp};

/// `dense<...>` for `lit` (without the trailing `: tensor<..>`).
pub(super) fn dense(lit: &Literal) -> String {
    let ty = lit.ty();
    let width = ty.dtype.size_in_bytes();
    let mut out = String::from("dense<");
    if ty.shape.num_elements() > 0 && lit.is_splat() {
        out.push_str(&element(ty.dtype, &lit.bytes()[..width]));
    } else {
        let elements: Vec<String> = lit.bytes().chunks_exact(width).map(|c| element(ty.dtype, c)).collect();
        nested(&mut out, ty.shape.dims(), &elements);
    }
    out.push('>');
    out
}

/// The scalar identity of `op` over `dtype`, the init value of a reduction.
pub(super) fn identity(op: ReduceOp, dtype: DType) -> Literal {
    // `ReduceOp::identity` is exact for every dtype once written back:
    // 64-bit extremes pass through f64 as +-2^63 / 2^64, and the saturating
    // float-to-int conversion of `Literal::scalar` lands on i64::MAX / u64::MAX.
    Literal::scalar(dtype, op.identity(dtype))
}

/// Writes `elements` (row-major) as a nested list of `dims`' shape.
fn nested(out: &mut String, dims: &[usize], elements: &[String]) {
    let Some((&outer, inner)) = dims.split_first() else {
        out.push_str(&elements[0]);
        return;
    };
    let chunk: usize = inner.iter().product();
    out.push('[');
    for i in 0..outer {
        if i > 0 {
            out.push_str(", ");
        }
        nested(out, inner, &elements[i * chunk..(i + 1) * chunk]);
    }
    out.push(']');
}

/// One element from its little-endian bytes.
fn element(dtype: DType, c: &[u8]) -> String {
    match dtype {
        DType::Pred => (if c[0] != 0 { "true" } else { "false" }).to_string(),
        DType::I8 => (c[0] as i8).to_string(),
        DType::I32 => i32::from_le_bytes(c.try_into().expect("4 bytes")).to_string(),
        DType::I64 => i64::from_le_bytes(c.try_into().expect("8 bytes")).to_string(),
        DType::U8 => c[0].to_string(),
        DType::U32 => u32::from_le_bytes(c.try_into().expect("4 bytes")).to_string(),
        DType::U64 => u64::from_le_bytes(c.try_into().expect("8 bytes")).to_string(),
        DType::F16 => format!("0x{:04X}", f16::from_le_bytes([c[0], c[1]]).to_bits()),
        DType::BF16 => format!("0x{:04X}", bf16::from_le_bytes([c[0], c[1]]).to_bits()),
        DType::F32 => {
            let v = f32::from_le_bytes(c.try_into().expect("4 bytes"));
            if v.is_finite() {
                with_point(format!("{v:e}"))
            } else {
                format!("0x{:08X}", v.to_bits())
            }
        }
        DType::F64 => {
            let v = f64::from_le_bytes(c.try_into().expect("8 bytes"));
            if v.is_finite() {
                with_point(format!("{v:e}"))
            } else {
                format!("0x{:016X}", v.to_bits())
            }
        }
    }
}

/// `1e0` -> `1.0e0`: MLIR's float literals need a decimal point.
fn with_point(s: String) -> String {
    match s.find('e') {
        Some(e) if !s[..e].contains('.') => format!("{}.0{}", &s[..e], &s[e..]),
        _ => s,
    }
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
