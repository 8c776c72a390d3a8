//! Host element types a tensor can be built from and read into ([`Element`]),
//! and the conversion between kiln's dtypes and the runtime's element types
//! at the crate boundary (the compiler and the runtime do not know each other).
//!
//! Invariants:
//! - An element is `size_of::<T>()` little-endian bytes, the layout of its
//!   dtype in a literal and in a device buffer, so host data is copied, never
//!   converted.
//! - [`element_type`] and `dtype_of` match every variant (no default arm) and
//!   are inverse: a new dtype fails to compile here until it has its element
//!   type.

use half::{bf16, f16};
use kiln_compiler::ir::DType;
use kiln_runtime::ElementType;

/// A Rust scalar type with a kiln dtype and a little-endian byte layout.
pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn write_le(self, out: &mut Vec<u8>);
    /// Reads one element from exactly `size_of::<Self>()` bytes.
    fn read_le(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn read_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("caller passes exactly one element"))
            }
        }
    };
}

element!(f32, DType::F32);
element!(f64, DType::F64);
element!(i8, DType::I8);
element!(i32, DType::I32);
element!(i64, DType::I64);
element!(u8, DType::U8);
element!(u32, DType::U32);
element!(u64, DType::U64);
element!(f16, DType::F16);
element!(bf16, DType::BF16);

pub(crate) fn to_bytes<T: Element>(data: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(std::mem::size_of_val(data));
    for &x in data {
        x.write_le(&mut out);
    }
    out
}

pub(crate) fn from_bytes<T: Element>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(std::mem::size_of::<T>()).map(T::read_le).collect()
}

/// The runtime's element type of a kiln dtype (the two crates do not know
/// each other).
pub fn element_type(d: DType) -> ElementType {
    match d {
        DType::Pred => ElementType::Pred,
        DType::I8 => ElementType::S8,
        DType::I32 => ElementType::S32,
        DType::I64 => ElementType::S64,
        DType::U8 => ElementType::U8,
        DType::U32 => ElementType::U32,
        DType::U64 => ElementType::U64,
        DType::F16 => ElementType::F16,
        DType::BF16 => ElementType::BF16,
        DType::F32 => ElementType::F32,
        DType::F64 => ElementType::F64,
    }
}

pub(crate) fn dtype_of(e: ElementType) -> DType {
    match e {
        ElementType::Pred => DType::Pred,
        ElementType::S8 => DType::I8,
        ElementType::S32 => DType::I32,
        ElementType::S64 => DType::I64,
        ElementType::U8 => DType::U8,
        ElementType::U32 => DType::U32,
        ElementType::U64 => DType::U64,
        ElementType::F16 => DType::F16,
        ElementType::BF16 => DType::BF16,
        ElementType::F32 => DType::F32,
        ElementType::F64 => DType::F64,
    }
}
