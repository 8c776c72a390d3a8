//! kiln values <-> candle tensors: literal bytes in, candle CPU tensors out,
//! and back (the eager backend's conversions, and those of the public interop
//! `Tensor::to_candle` / `Tensor::from_candle` in `api::tensor::candle`).
//!
//! Invariants:
//! - A round trip is exact (a byte copy): kiln and candle store the same
//!   little-endian elements in row-major order.
//! - `pred` travels as candle `u8` holding 0 or 1 (candle's comparison
//!   results), the byte layout of kiln's `pred`. `s8` and `u64` have no candle
//!   dtype: [`candle_dtype`] says `None` and the caller falls back.

use candle_core::{DType as CDType, Device};
use half::{bf16, f16};
use kiln_compiler::ir::{DType, Literal, TensorType};

use crate::core::element::{self, Element};
use crate::core::error::{FrontendError, Result};

/// candle's dtype for a kiln dtype, `None` where candle has none.
pub(crate) fn candle_dtype(d: DType) -> Option<CDType> {
    match d {
        DType::Pred | DType::U8 => Some(CDType::U8),
        DType::I32 => Some(CDType::I32),
        DType::I64 => Some(CDType::I64),
        DType::U32 => Some(CDType::U32),
        DType::F16 => Some(CDType::F16),
        DType::BF16 => Some(CDType::BF16),
        DType::F32 => Some(CDType::F32),
        DType::F64 => Some(CDType::F64),
        DType::I8 | DType::U64 => None,
    }
}

/// kiln's dtype for a candle dtype (`u8` reads as `u8`, never `pred`).
pub(crate) fn kiln_dtype(d: CDType) -> Result<DType> {
    Ok(match d {
        CDType::U8 => DType::U8,
        CDType::U32 => DType::U32,
        CDType::I32 => DType::I32,
        CDType::I64 => DType::I64,
        CDType::F16 => DType::F16,
        CDType::BF16 => DType::BF16,
        CDType::F32 => DType::F32,
        CDType::F64 => DType::F64,
        other => return Err(FrontendError::CandleDType { dtype: format!("{other:?}") }),
    })
}

pub(crate) fn candle_err(op: &'static str) -> impl Fn(candle_core::Error) -> FrontendError {
    move |source| FrontendError::Candle { op, source: Box::new(source) }
}

fn tensor_of<T: Element + candle_core::WithDType>(lit: &Literal) -> Result<candle_core::Tensor> {
    let data: Vec<T> = element::from_bytes(lit.bytes());
    candle_core::Tensor::from_vec(data, lit.ty().shape.dims(), &Device::Cpu).map_err(candle_err("to_candle"))
}

/// A candle CPU tensor with `lit`'s values; `None` for a dtype candle lacks.
pub(crate) fn literal_to_candle(lit: &Literal) -> Result<Option<candle_core::Tensor>> {
    Ok(Some(match lit.ty().dtype {
        DType::Pred | DType::U8 => tensor_of::<u8>(lit)?,
        DType::I32 => tensor_of::<i32>(lit)?,
        DType::I64 => tensor_of::<i64>(lit)?,
        DType::U32 => tensor_of::<u32>(lit)?,
        DType::F16 => tensor_of::<f16>(lit)?,
        DType::BF16 => tensor_of::<bf16>(lit)?,
        DType::F32 => tensor_of::<f32>(lit)?,
        DType::F64 => tensor_of::<f64>(lit)?,
        DType::I8 | DType::U64 => return Ok(None),
    }))
}

fn bytes_of<T: Element + candle_core::WithDType>(t: &candle_core::Tensor) -> Result<Vec<u8>> {
    let v = t.flatten_all().and_then(|f| f.to_vec1::<T>()).map_err(candle_err("from_candle"))?;
    Ok(element::to_bytes(&v))
}

/// The little-endian bytes of a candle tensor, row-major.
pub(crate) fn candle_bytes(t: &candle_core::Tensor) -> Result<Vec<u8>> {
    match t.dtype() {
        CDType::U8 => bytes_of::<u8>(t),
        CDType::U32 => bytes_of::<u32>(t),
        CDType::I32 => bytes_of::<i32>(t),
        CDType::I64 => bytes_of::<i64>(t),
        CDType::F16 => bytes_of::<f16>(t),
        CDType::BF16 => bytes_of::<bf16>(t),
        CDType::F32 => bytes_of::<f32>(t),
        CDType::F64 => bytes_of::<f64>(t),
        other => Err(FrontendError::CandleDType { dtype: format!("{other:?}") }),
    }
}

/// A literal of type `ty` from a candle tensor of the matching dtype and shape.
pub(crate) fn candle_to_literal(t: &candle_core::Tensor, ty: &TensorType) -> Result<Literal> {
    Ok(Literal::from_bytes(ty.clone(), candle_bytes(t)?)?)
}
