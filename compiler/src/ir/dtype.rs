//! Element types of the IR.
//!
//! `DType` is closed: every pass, the interpreter and the lowering match on it
//! exhaustively, so adding a type fails to compile wherever it needs handling.
//!
//! Each dtype has one user-visible name, its StableHLO spelling (`i32`, `ui8`,
//! `i1`, `bf16`: Rust's names for the integers and floats it shares): `Display`,
//! `Debug` (so an `unwrap` or `{:?}` of an error shows the same word), the text
//! form of the graph and every error use it. The variants are named as Rust
//! names the same types (`DType::I32` prints `i32`; `U8` prints `ui8`, the one
//! place StableHLO's spelling differs from Rust's). The runtime's
//! `ElementType` keeps the PJRT C API's names (`S32`), as the plugin spells
//! them.

use std::fmt;

/// Element type of a tensor value; each variant's doc gives the name it prints
/// as (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// Boolean, `i1`.
    Pred,
    /// `i8`.
    I8,
    /// `i32`.
    I32,
    /// `i64`.
    I64,
    /// `ui8`.
    U8,
    /// `ui32`.
    U32,
    /// `ui64`.
    U64,
    /// `f16`.
    F16,
    /// `bf16`.
    BF16,
    /// `f32`.
    F32,
    /// `f64`.
    F64,
}

impl DType {
    /// Every dtype, in declaration order (for tests and parsers).
    pub const ALL: [DType; 11] = [
        DType::Pred,
        DType::I8,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U32,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element in the dense little-endian host layout.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::Pred | DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        match self {
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 => true,
            DType::Pred | DType::I8 | DType::I32 | DType::I64 | DType::U8 | DType::U32 | DType::U64 => false,
        }
    }

    pub fn is_integer(self) -> bool {
        match self {
            DType::I8 | DType::I32 | DType::I64 | DType::U8 | DType::U32 | DType::U64 => true,
            DType::Pred | DType::F16 | DType::BF16 | DType::F32 | DType::F64 => false,
        }
    }

    pub fn is_signed_integer(self) -> bool {
        matches!(self, DType::I8 | DType::I32 | DType::I64)
    }

    /// The element type's spelling inside a StableHLO `tensor<...>` type, which is
    /// also kiln's text form.
    pub fn mlir_name(self) -> &'static str {
        match self {
            DType::Pred => "i1",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "ui8",
            DType::U32 => "ui32",
            DType::U64 => "ui64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    /// Inverse of [`DType::mlir_name`].
    pub fn from_mlir_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.mlir_name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.mlir_name())
    }
}

/// The same name as `Display`: a user reading a panic or a `{:?}` of an error
/// (`ReadDType { tensor: i32, requested: f32 }`) sees the word the messages use.
impl fmt::Debug for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.mlir_name())
    }
}

#[cfg(test)]
mod tests {
    use super::DType;

    #[test]
    fn each_dtype_prints_one_name_that_parses_back() {
        assert_eq!(DType::I32.to_string(), "i32");
        assert_eq!(format!("{:?}", DType::I32), "i32");
        assert_eq!(format!("{:?}", Some(DType::Pred)), "Some(i1)");
        for d in DType::ALL {
            assert_eq!(format!("{d:?}"), d.to_string());
            assert_eq!(DType::from_mlir_name(&d.to_string()), Some(d));
        }
    }
}
