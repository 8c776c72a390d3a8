//! Static shapes and tensor types.
//!
//! kiln compiles static shapes only: a changed dimension is a different program
//! (and a recompile the cache reports). Dimensions are `usize`; the rank is the
//! number of dimensions and a scalar has rank 0.

use std::fmt;

use super::DType;

/// Dimensions stored inline up to rank 4: most shapes then cost no heap
/// allocation, which matters for the thousands of nodes a step records.
pub type Dims = smallvec::SmallVec<[usize; 4]>;

/// The dimensions of a tensor, outermost first (row-major).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Shape(pub Dims);

impl Shape {
    pub fn scalar() -> Shape {
        Shape(Dims::new())
    }

    pub fn new(dims: impl Into<Vec<usize>>) -> Shape {
        Shape(Dims::from_vec(dims.into()))
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn num_elements(&self) -> usize {
        self.0.iter().product()
    }

    /// The element count, `None` when it overflows `usize` (shapes from text
    /// or from shape arithmetic on hostile sizes).
    pub fn checked_num_elements(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut strides = vec![1; self.rank()];
        for i in (0..self.rank().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.0[i + 1];
        }
        strides
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(Dims::from_vec(v))
    }
}

impl From<Dims> for Shape {
    fn from(v: Dims) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(Dims::from_slice(v))
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(Dims::from_slice(&v))
    }
}

/// `[2, 3]`; a scalar prints as `[]`.
impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Shape and element type of one value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> TensorType {
        TensorType { dtype, shape: shape.into() }
    }

    pub fn scalar(dtype: DType) -> TensorType {
        TensorType { dtype, shape: Shape::scalar() }
    }

    pub fn size_in_bytes(&self) -> usize {
        self.shape.num_elements() * self.dtype.size_in_bytes()
    }

    /// The byte size, `None` when it overflows `usize`.
    pub fn checked_size_in_bytes(&self) -> Option<usize> {
        self.shape.checked_num_elements()?.checked_mul(self.dtype.size_in_bytes())
    }
}

/// The StableHLO spelling, which is also kiln's text form: `tensor<2x3xf32>`,
/// `tensor<f32>` for a scalar.
impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tensor<")?;
        for d in &self.shape.0 {
            write!(f, "{d}x")?;
        }
        write!(f, "{}>", self.dtype)
    }
}
