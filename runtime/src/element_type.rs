//! Element types of device buffers and their host counterparts, and the
//! type of one program argument (an element type and static dimensions).
//!
//! Invariants: each `ElementType` maps to exactly one `PJRT_Buffer_Type` and one
//! MLIR scalar type name; `NativeType::TYPE` has the same size in bytes as the
//! Rust type, so a `&[T]` can be viewed as the buffer's host bytes.

use std::fmt;

/// Element type of a buffer or tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElementType {
    /// Boolean, one byte per element on the host (0 or 1).
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

impl ElementType {
    /// Every element type, in declaration order.
    pub const ALL: [ElementType; 11] = [
        ElementType::Pred,
        ElementType::S8,
        ElementType::S32,
        ElementType::S64,
        ElementType::U8,
        ElementType::U32,
        ElementType::U64,
        ElementType::F16,
        ElementType::BF16,
        ElementType::F32,
        ElementType::F64,
    ];

    /// Size of one element in host memory.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            ElementType::Pred | ElementType::S8 | ElementType::U8 => 1,
            ElementType::F16 | ElementType::BF16 => 2,
            ElementType::S32 | ElementType::U32 | ElementType::F32 => 4,
            ElementType::S64 | ElementType::U64 | ElementType::F64 => 8,
        }
    }

    /// The MLIR scalar type (`i1`, `i32`, `ui8`, `bf16`, ...).
    pub fn mlir_name(&self) -> &'static str {
        match self {
            ElementType::Pred => "i1",
            ElementType::S8 => "i8",
            ElementType::S32 => "i32",
            ElementType::S64 => "i64",
            ElementType::U8 => "ui8",
            ElementType::U32 => "ui32",
            ElementType::U64 => "ui64",
            ElementType::F16 => "f16",
            ElementType::BF16 => "bf16",
            ElementType::F32 => "f32",
            ElementType::F64 => "f64",
        }
    }

    /// Parses an MLIR scalar type name.
    pub fn from_mlir_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.mlir_name() == name)
    }

    /// The `PJRT_Buffer_Type` enum value.
    pub(crate) fn to_pjrt(self) -> i32 {
        match self {
            ElementType::Pred => 1,
            ElementType::S8 => 2,
            ElementType::S32 => 4,
            ElementType::S64 => 5,
            ElementType::U8 => 6,
            ElementType::U32 => 8,
            ElementType::U64 => 9,
            ElementType::F16 => 10,
            ElementType::F32 => 11,
            ElementType::F64 => 12,
            ElementType::BF16 => 13,
        }
    }

    /// Maps a `PJRT_Buffer_Type` value back; types kiln does not model are errors.
    pub(crate) fn from_pjrt(raw: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.to_pjrt() == raw)
    }
}

impl fmt::Display for ElementType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.mlir_name())
    }
}

/// A plain host type whose values can be copied to and from device buffers.
///
/// Booleans use `u8` host storage with `ElementType::U8`; build a `Pred` buffer
/// with [`crate::Client::buffer_from_bytes`].
///
/// Sealed: the byte reinterpretation in `pjrt::host` is sound only for the
/// padding-free types listed here, for which every bit pattern is valid.
pub trait NativeType: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The device element type with the same size and bit layout.
    const TYPE: ElementType;
}

macro_rules! native {
    ($($t:ty => $e:ident),* $(,)?) => {
        $(
            impl sealed::Sealed for $t {}
            impl NativeType for $t { const TYPE: ElementType = ElementType::$e; }
        )*
    };
}
native!(
    i8 => S8, i32 => S32, i64 => S64, u8 => U8, u32 => U32, u64 => U64,
    half::f16 => F16, half::bf16 => BF16, f32 => F32, f64 => F64,
);

mod sealed {
    pub trait Sealed {}
}

/// The type of one argument or result: element type and static dimensions.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ArgType {
    pub ty: ElementType,
    pub dims: Vec<usize>,
}

impl ArgType {
    pub fn new(ty: ElementType, dims: &[usize]) -> Self {
        ArgType { ty, dims: dims.to_vec() }
    }

    /// Number of elements (1 for a scalar).
    pub fn element_count(&self) -> usize {
        self.dims.iter().product()
    }

    /// Dense size in host bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.element_count() * self.ty.size_in_bytes()
    }
}

impl fmt::Display for ArgType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tensor<")?;
        for d in &self.dims {
            write!(f, "{d}x")?;
        }
        write!(f, "{}>", self.ty)
    }
}
