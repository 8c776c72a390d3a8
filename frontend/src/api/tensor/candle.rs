//! Interop with candle-core: a tensor's values as a candle CPU tensor, and a
//! kiln tensor from a candle one (data or weights from candle code).
//!
//! Invariant: a conversion is a read (a pending tensor runs its step first)
//! or host data (uploaded when a step first reads it); dtypes candle lacks
//! (`s8`, `u64`, and the 8/6/4-bit floats the other way) are typed errors.

use kiln_compiler::ir::TensorType;

use crate::core::error::{FrontendError, Result};
use crate::core::tensor::Tensor;
use crate::engine::eager::convert::{candle_to_literal, kiln_dtype, literal_to_candle};

impl Tensor {
    /// The values as a candle CPU tensor (a read: a pending tensor runs its
    /// step first, as [`Tensor::to_vec`] does). `pred` comes out as `u8`
    /// 0/1; `s8` and `u64`, which candle lacks, are an error.
    pub fn to_candle(&self) -> Result<candle_core::Tensor> {
        let lit = self.to_literal()?;
        literal_to_candle(&lit)?.ok_or(FrontendError::DType {
            op: "to_candle",
            expected: "a dtype candle has (not i8 or ui64)",
            got: self.dtype(),
        })
    }

    /// A ready kiln tensor holding a copy of `t`'s values (data or weights
    /// from candle code); uploaded when a step first reads it.
    pub fn from_candle(t: &candle_core::Tensor) -> Result<Tensor> {
        let ty = TensorType::new(kiln_dtype(t.dtype())?, t.dims().to_vec());
        Ok(Tensor::from_literal(candle_to_literal(t, &ty)?))
    }
}
