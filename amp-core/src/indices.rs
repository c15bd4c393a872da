//! Integer index tensors (class labels, token ids, argmax results) and boolean masks ([`Mask`]).
//! They never carry gradients, so they are plain values rather than `Tensor`s.

use std::sync::Arc;

use crate::error::{Error, Result, or_panic};

/// A row-major tensor of `i64` indices (class ids, token ids), as PyTorch's `LongTensor`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Indices {
    data: Arc<Vec<i64>>,
    shape: Vec<usize>,
}

impl Indices {
    /// Indices from values and a shape.
    pub fn try_from_vec(data: Vec<i64>, shape: &[usize]) -> Result<Self> {
        let expected: usize = shape.iter().product();
        if data.len() != expected {
            return Err(Error::ElementCount {
                op: "Indices::from_vec",
                len: data.len(),
                expected,
                shape: shape.to_vec(),
            });
        }
        Ok(Indices { data: Arc::new(data), shape: shape.to_vec() })
    }
    /// Indices from values and a shape; panics if the count does not fill the shape.
    #[track_caller]
    pub fn from_vec(data: Vec<i64>, shape: &[usize]) -> Self {
        or_panic(Self::try_from_vec(data, shape))
    }
    /// The values, row-major.
    pub fn as_slice(&self) -> &[i64] {
        &self.data
    }
    /// The values as a vector.
    pub fn to_vec(&self) -> Vec<i64> {
        self.data.to_vec()
    }
    /// The dims.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of indices.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// The same indices with a new shape of the same count.
    pub fn try_reshape(&self, shape: &[usize]) -> Result<Self> {
        let expected: usize = shape.iter().product();
        if expected != self.numel() {
            return Err(Error::Shape {
                op: "Indices::reshape",
                detail: format!("cannot reshape {} indices into {:?}", self.numel(), shape),
                shapes: vec![self.shape.clone(), shape.to_vec()],
            });
        }
        Ok(Indices { data: self.data.clone(), shape: shape.to_vec() })
    }
    /// The same indices with a new shape; panics if the count differs.
    #[track_caller]
    pub fn reshape(&self, shape: &[usize]) -> Self {
        or_panic(self.try_reshape(shape))
    }
    /// Checks every index is in `0..bound` (or equal to `allowed`), naming the op on failure.
    pub(crate) fn check_bound(&self, op: &'static str, bound: usize, allowed: Option<i64>) -> Result<()> {
        for (position, &index) in self.data.iter().enumerate() {
            if Some(index) != allowed && (index < 0 || index as usize >= bound) {
                return Err(Error::IndexOutOfRange { op, index, position, bound });
            }
        }
        Ok(())
    }
}

/// A boolean tensor (attention masks, padding masks) that broadcasts against tensors with NumPy
/// rules in [`Tensor::masked_fill`](crate::Tensor::masked_fill) and
/// [`Tensor::where_cond`](crate::Tensor::where_cond). Cheap to clone (shared storage).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mask {
    data: Arc<Vec<bool>>,
    shape: Vec<usize>,
}

impl Mask {
    /// A mask from values (row-major) and a shape.
    pub fn try_from_vec(data: Vec<bool>, shape: &[usize]) -> Result<Self> {
        let expected: usize = shape.iter().product();
        if data.len() != expected {
            return Err(Error::ElementCount { op: "Mask::from_vec", len: data.len(), expected, shape: shape.to_vec() });
        }
        Ok(Mask { data: Arc::new(data), shape: shape.to_vec() })
    }
    /// A mask from values (row-major) and a shape; panics if the count does not fill the shape.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Mask;
    /// let m = Mask::from_vec(vec![true, false, false, true], &[2, 2]);
    /// assert_eq!(m.shape(), &[2, 2]);
    /// ```
    #[track_caller]
    pub fn from_vec(data: Vec<bool>, shape: &[usize]) -> Self {
        or_panic(Self::try_from_vec(data, shape))
    }
    /// A mask of `shape` with every entry `value`.
    pub fn full(shape: &[usize], value: bool) -> Self {
        Mask { data: Arc::new(vec![value; shape.iter().product()]), shape: shape.to_vec() }
    }
    /// The `[t, t]` causal mask: true where column > row, the future positions a causal
    /// attention must hide (`scores.masked_fill(&Mask::causal(t), f64::NEG_INFINITY)`).
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Mask;
    /// assert_eq!(Mask::causal(2).to_vec(), vec![false, true, false, false]);
    /// ```
    pub fn causal(t: usize) -> Self {
        let data = (0..t * t).map(|i| i % t > i / t).collect();
        Mask { data: Arc::new(data), shape: vec![t, t] }
    }
    /// The values, row-major.
    pub fn as_slice(&self) -> &[bool] {
        &self.data
    }
    /// The values as a vector.
    pub fn to_vec(&self) -> Vec<bool> {
        self.data.to_vec()
    }
    /// The dims.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of entries.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// Number of true entries.
    pub fn count(&self) -> usize {
        self.data.iter().filter(|&&b| b).count()
    }
    /// The same entries with a new shape of the same count.
    pub fn try_reshape(&self, shape: &[usize]) -> Result<Self> {
        let expected: usize = shape.iter().product();
        if expected != self.numel() {
            return Err(Error::Shape {
                op: "Mask::reshape",
                detail: format!("cannot reshape {} entries into {:?}", self.numel(), shape),
                shapes: vec![self.shape.clone(), shape.to_vec()],
            });
        }
        Ok(Mask { data: self.data.clone(), shape: shape.to_vec() })
    }
    /// The same entries with a new shape; panics if the count differs.
    #[track_caller]
    pub fn reshape(&self, shape: &[usize]) -> Self {
        or_panic(self.try_reshape(shape))
    }
}

impl std::ops::Not for &Mask {
    type Output = Mask;
    /// The complement (true where `self` is false).
    fn not(self) -> Mask {
        Mask { data: Arc::new(self.data.iter().map(|b| !b).collect()), shape: self.shape.clone() }
    }
}

impl std::ops::Not for Mask {
    type Output = Mask;
    /// The complement (true where `self` is false).
    fn not(self) -> Mask {
        !&self
    }
}
