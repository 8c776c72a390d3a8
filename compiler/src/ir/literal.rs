//! Constant tensor data embedded in a graph.
//!
//! A `Literal` holds dense, row-major, little-endian bytes of its type. It is plain
//! data (hashable, ordered) so constants take part in structural hashing, CSE and
//! e-graph matching like any other attribute.
//!
//! Invariant: the bytes are immutable and shared between clones (an `Arc`), so
//! a graph cloned by a pass, the e-graph's copies of a constant node and the
//! prepared graph the printer reads all hold one buffer: a constant costs its
//! bytes once in the compiler, not once per copy of the graph. (Peak RSS of
//! `kiln compile` on `add(x, c)` with `c` a 200 MiB splat: 1608 MiB when each
//! copy owned its bytes, 7.5 times `c` above the 104 MiB of a graph without
//! it: 4 times with no optimizer pass, the rest the rewrite pass's e-graph;
//! shared, 306 MiB. 2026-12-07, 2 cores, `/usr/bin/time -v`.)

use std::sync::Arc;

use half::{bf16, f16};

use super::{DType, Shape, TensorType};
use crate::CompileError;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Literal {
    ty: TensorType,
    bytes: Arc<Vec<u8>>,
}

impl Literal {
    /// Wraps raw little-endian bytes; the length must match the type.
    pub fn from_bytes(ty: TensorType, bytes: Vec<u8>) -> Result<Literal, CompileError> {
        if bytes.len() != ty.size_in_bytes() {
            return Err(CompileError::LiteralSize { ty, bytes: bytes.len() });
        }
        Ok(Literal { ty, bytes: Arc::new(bytes) })
    }

    /// A scalar of `dtype` holding `value` converted as `convert` would.
    pub fn scalar(dtype: DType, value: f64) -> Literal {
        Literal::from_f64s(dtype, Shape::scalar(), &[value]).expect("one value for a scalar is always the right count")
    }

    /// A tensor of `dtype` whose elements are `values` converted as `convert` would
    /// (floats round to nearest, integers truncate toward zero, pred is `v != 0`).
    pub fn from_f64s(dtype: DType, shape: impl Into<Shape>, values: &[f64]) -> Result<Literal, CompileError> {
        let ty = TensorType::new(dtype, shape);
        if values.len() != ty.shape.num_elements() {
            return Err(CompileError::LiteralSize { ty, bytes: values.len() * dtype.size_in_bytes() });
        }
        let mut bytes = Vec::with_capacity(ty.size_in_bytes());
        for &v in values {
            encode(dtype, v, &mut bytes);
        }
        Ok(Literal { ty, bytes: Arc::new(bytes) })
    }

    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Every element widened to f64 (exact for all kiln dtypes but 64-bit integers
    /// beyond 2^53).
    pub fn to_f64s(&self) -> Vec<f64> {
        let n = self.ty.dtype.size_in_bytes();
        self.bytes.chunks_exact(n).map(|c| decode(self.ty.dtype, c)).collect()
    }

    /// True when every element has the same bit pattern (a splat), which the
    /// printers write as one value.
    pub fn is_splat(&self) -> bool {
        let n = self.ty.dtype.size_in_bytes();
        self.bytes.chunks_exact(n).all(|c| c == &self.bytes[..n])
    }
}

/// `v` rounded to f32 by round-to-odd: toward zero, with the last bit set
/// when anything was lost. Rounding that to a format with at least two fewer
/// mantissa bits (f16, bf16) to nearest even gives `v` rounded once.
fn f32_round_to_odd(v: f64) -> f32 {
    let t = v as f32;
    if !v.is_finite() || t as f64 == v {
        return t;
    }
    let mut bits = t.to_bits();
    if (t as f64).abs() > v.abs() {
        bits -= 1; // one step toward zero (sign and magnitude are apart)
    }
    f32::from_bits(bits | 1)
}

/// `v` rounded once to the nearest f16 (ties to even).
pub fn f16_from_f64(v: f64) -> f16 {
    f16::from_f32(f32_round_to_odd(v))
}

/// `v` rounded once to the nearest bf16 (ties to even). `half`'s
/// `bf16::from_f64` drops the f64's low 32 mantissa bits before rounding, so
/// a value just above a tie became the tie and rounded down: 1 + 2⁻⁸ + 2⁻²³
/// gave 1.0 on the reference interpreter and in constant folding, where XLA
/// and the eager backend give 1.0078125.
pub fn bf16_from_f64(v: f64) -> bf16 {
    bf16::from_f32(f32_round_to_odd(v))
}

fn encode(dtype: DType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DType::Pred => out.push(u8::from(v != 0.0)),
        DType::I8 => out.extend((v as i8).to_le_bytes()),
        DType::I32 => out.extend((v as i32).to_le_bytes()),
        DType::I64 => out.extend((v as i64).to_le_bytes()),
        DType::U8 => out.extend((v as u8).to_le_bytes()),
        DType::U32 => out.extend((v as u32).to_le_bytes()),
        DType::U64 => out.extend((v as u64).to_le_bytes()),
        DType::F16 => out.extend(f16_from_f64(v).to_le_bytes()),
        DType::BF16 => out.extend(bf16_from_f64(v).to_le_bytes()),
        DType::F32 => out.extend((v as f32).to_le_bytes()),
        DType::F64 => out.extend(v.to_le_bytes()),
    }
}

/// Reads one little-endian element of `dtype` from `c` (exactly its size).
pub fn decode(dtype: DType, c: &[u8]) -> f64 {
    match dtype {
        DType::Pred => f64::from(u8::from(c[0] != 0)),
        DType::I8 => f64::from(c[0] as i8),
        DType::I32 => f64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        DType::I64 => i64::from_le_bytes(c[..8].try_into().expect("8 bytes")) as f64,
        DType::U8 => f64::from(c[0]),
        DType::U32 => f64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        DType::U64 => u64::from_le_bytes(c[..8].try_into().expect("8 bytes")) as f64,
        DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f64(),
        DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f64(),
        DType::F32 => f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        DType::F64 => f64::from_le_bytes(c[..8].try_into().expect("8 bytes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_dtype() {
        for dtype in DType::ALL {
            let values = if dtype == DType::Pred { [1.0, 0.0, 1.0] } else { [1.0, 0.0, 3.0] };
            let lit = Literal::from_f64s(dtype, [3], &values).unwrap();
            assert_eq!(lit.bytes().len(), 3 * dtype.size_in_bytes());
            assert_eq!(lit.to_f64s(), values, "{dtype}");
        }
    }

    #[test]
    fn half_precision_rounds_once_from_f64() {
        let v = 1.0 + 2f64.powi(-8) + 2f64.powi(-23); // just above a bf16 tie
        assert_eq!(bf16_from_f64(v).to_f64(), 1.0078125);
        assert_eq!(bf16_from_f64(-v).to_f64(), -1.0078125);
        assert_eq!(bf16_from_f64(1.0 + 2f64.powi(-8)).to_f64(), 1.0, "a tie goes to even");
        assert_eq!(bf16_from_f64(1.0 + 3.0 * 2f64.powi(-8)).to_f64(), 1.015625, "a tie goes to even");
        // Just above an f16 tie, below f32's precision: f32 alone would round
        // to the tie.
        let w = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(f16_from_f64(w).to_f64(), 1.0 + 2f64.powi(-10));
        assert_eq!(f16_from_f64(1.0 + 2f64.powi(-11)).to_f64(), 1.0);
        // Every f32 bit pattern of a sample rounds as half's f32 conversion
        // (which rounds once) does.
        let mut x: u32 = 0x1234_5678;
        for _ in 0..100_000 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let f = f32::from_bits(x);
            if f.is_nan() {
                continue;
            }
            assert_eq!(bf16_from_f64(f as f64).to_bits(), bf16::from_f32(f).to_bits(), "{f:e}");
            assert_eq!(f16_from_f64(f as f64).to_bits(), f16::from_f32(f).to_bits(), "{f:e}");
        }
        assert!(bf16_from_f64(f64::NAN).is_nan());
        assert_eq!(bf16_from_f64(f64::INFINITY).to_f64(), f64::INFINITY);
        assert_eq!(bf16_from_f64(1e300).to_f64(), f64::INFINITY);
        assert_eq!(f16_from_f64(-1e-300).to_bits(), 0x8000, "-0");
    }

    #[test]
    fn wrong_count_is_an_error() {
        let err = Literal::from_f64s(DType::F32, [2, 2], &[1.0]).unwrap_err();
        assert!(err.to_string().contains("tensor<2x2xf32>"), "{err}");
    }
}
