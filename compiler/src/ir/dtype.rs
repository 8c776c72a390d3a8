//! Element types of the IR.
//!
//! `DType` is closed: every pass, the interpreter and the lowering match on it
//! exhaustively, so adding a type fails to compile wherever it needs handling.

use std::fmt;

/// Element type of a tensor value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// Boolean (`i1` in StableHLO).
    Pred,
    S8,
    S32,
    S64,
    U8,
    U32,
    U64,
    F16,
    BF16,
    F32,
    F64,
}

impl DType {
    /// Every dtype, in declaration order (for tests and parsers).
    pub const ALL: [DType; 11] = [
        DType::Pred,
        DType::S8,
        DType::S32,
        DType::S64,
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
            DType::Pred | DType::S8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::S32 | DType::U32 | DType::F32 => 4,
            DType::S64 | DType::U64 | DType::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        match self {
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 => true,
            DType::Pred | DType::S8 | DType::S32 | DType::S64 | DType::U8 | DType::U32 | DType::U64 => false,
        }
    }

    pub fn is_integer(self) -> bool {
        match self {
            DType::S8 | DType::S32 | DType::S64 | DType::U8 | DType::U32 | DType::U64 => true,
            DType::Pred | DType::F16 | DType::BF16 | DType::F32 | DType::F64 => false,
        }
    }

    pub fn is_signed_integer(self) -> bool {
        matches!(self, DType::S8 | DType::S32 | DType::S64)
    }

    /// The element type's spelling inside a StableHLO `tensor<...>` type, which is
    /// also kiln's text form.
    pub fn mlir_name(self) -> &'static str {
        match self {
            DType::Pred => "i1",
            DType::S8 => "i8",
            DType::S32 => "i32",
            DType::S64 => "i64",
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
