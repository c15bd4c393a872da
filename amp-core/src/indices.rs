//! Integer index tensors (class labels, token ids, argmax results) and boolean masks.
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
    #[track_caller]
    pub fn reshape(&self, shape: &[usize]) -> Self {
        let expected: usize = shape.iter().product();
        assert_eq!(expected, self.numel(), "Indices::reshape: cannot reshape {:?} into {:?}", self.shape, shape);
        Indices { data: self.data.clone(), shape: shape.to_vec() }
    }
    /// Checks every index is in `0..bound` (or equal to `allowed`), naming the op on failure.
    #[expect(dead_code, reason = "for embedding and cross_entropy, which come next")]
    pub(crate) fn check_bound(&self, op: &'static str, bound: usize, allowed: Option<i64>) -> Result<()> {
        for (position, &index) in self.data.iter().enumerate() {
            if Some(index) != allowed && (index < 0 || index as usize >= bound) {
                return Err(Error::IndexOutOfRange { op, index, position, bound });
            }
        }
        Ok(())
    }
}
