//! Shapes, strides and broadcasting.
//!
//! Design notes: a tensor is a view (shape, strides, offset) over shared storage, so
//! transpose, permute, narrow and broadcast cost nothing; kernels that need contiguous input
//! call `contiguous()`, which copies only when the view is not already contiguous. Broadcast
//! dims have stride 0. Strides are in elements and never negative.

use crate::error::{Error, Result};

/// Shape, strides and offset of a view into storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    pub(crate) offset: usize,
}

impl Layout {
    /// A contiguous (row-major) layout of `shape` at offset 0.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: 0 }
    }
    /// The dims.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Where the view starts in its storage, in elements (a device outside this crate
    /// addresses storage with it).
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Whether the view is row-major contiguous (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }
    /// The layout seen through broadcasting to `shape` (which must be a valid broadcast target).
    pub(crate) fn broadcast_to(&self, shape: &[usize]) -> Layout {
        let pad = shape.len() - self.shape.len();
        let mut strides = vec![0; shape.len()];
        for i in 0..self.shape.len() {
            strides[pad + i] = if self.shape[i] == 1 { 0 } else { self.strides[i] };
        }
        Layout { shape: shape.to_vec(), strides, offset: self.offset }
    }
}

/// Row-major strides for `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i];
    }
    strides
}

/// The NumPy broadcast of two shapes.
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return Err(Error::Broadcast { op, lhs: a.to_vec(), rhs: b.to_vec() }),
        };
    }
    Ok(out)
}

/// Checks `dim < rank`.
pub(crate) fn check_dim(op: &'static str, dim: usize, shape: &[usize]) -> Result<()> {
    if dim < shape.len() {
        Ok(())
    } else {
        Err(Error::DimOutOfRange { op, dim, rank: shape.len(), shape: shape.to_vec() })
    }
}

/// Splits `shape` around `dim` into (outer, dim size, inner) element counts.
pub(crate) fn outer_dim_inner(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        assert_eq!(broadcast_shapes("t", &[2, 1, 3], &[4, 1]).unwrap(), vec![2, 4, 3]);
        assert_eq!(broadcast_shapes("t", &[], &[3]).unwrap(), vec![3]);
        assert_eq!(broadcast_shapes("t", &[0, 3], &[1, 3]).unwrap(), vec![0, 3]);
        let e = broadcast_shapes("add", &[2, 3], &[4]).unwrap_err();
        assert_eq!(e.to_string(), "add: shapes [2, 3] and [4] cannot be broadcast together");
    }

    #[test]
    fn contiguity() {
        let l = Layout::contiguous(&[2, 3]);
        assert!(l.is_contiguous());
        let t = Layout { shape: vec![3, 2], strides: vec![1, 3], offset: 0 };
        assert!(!t.is_contiguous());
        assert_eq!(l.broadcast_to(&[4, 2, 3]).strides, vec![0, 3, 1]);
    }
}
