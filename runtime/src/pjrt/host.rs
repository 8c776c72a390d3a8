//! Reinterpreting host slices of plain numeric types as bytes and back.
//!
//! Sound only because `NativeType` is sealed to padding-free types for which
//! every bit pattern is a valid value (integers, IEEE and bfloat floats).

use crate::element_type::NativeType;

/// Views a slice of native values as bytes.
pub(crate) fn as_bytes<T: NativeType>(data: &[T]) -> &[u8] {
    bytes_of(data, std::mem::size_of_val(data))
}

/// `data` as its `len` (= `size_of_val(data)`) underlying bytes.
pub(crate) fn bytes_of<T: NativeType>(data: &[T], len: usize) -> &[u8] {
    debug_assert_eq!(len, std::mem::size_of_val(data));
    // SAFETY: `T: NativeType` has no padding, so all `len` bytes of the slice
    // are initialized; `u8` has alignment 1; the lifetime is tied to `data`.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), len) }
}

/// Copies `bytes` into values of `T`; `bytes.len()` must be a multiple of
/// `size_of::<T>()` (trailing bytes are ignored).
pub(crate) fn values_from_bytes<T: NativeType>(bytes: &[u8]) -> Vec<T> {
    let count = bytes.len() / std::mem::size_of::<T>();
    let mut out = Vec::<T>::with_capacity(count);
    // SAFETY: `out` has capacity for `count` values; the copy writes exactly
    // `count * size_of::<T>()` bytes, all from `bytes`, and every bit pattern
    // is a valid `T`, so the first `count` elements are initialized.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast::<u8>(), count * std::mem::size_of::<T>());
        out.set_len(count);
    }
    out
}
