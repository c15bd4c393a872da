//! [`TensorDataset`]: in-memory inputs and labels sharing their first dim (PyTorch's
//! `torch.utils.data.TensorDataset`), which a [`super::DataLoader`] cuts into batched tensors.
//!
//! Design notes: a batch is gathered straight from the stored buffers (one copy of each
//! selected row into the batch's buffer) rather than built from per-sample tensors and stacked.
//! The [`Rows`] trait is what both halves of the pair need: a first dim and a row gather.

use super::{BatchDataset, Dataset};
use crate::error::{Error, Result, or_panic};
use crate::indices::Indices;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A value whose first dim counts rows that can be gathered by index: [`Tensor`] of any
/// precision (inputs, regression targets) and [`Indices`] (class labels, token ids).
pub trait Rows: Sized {
    /// The full shape; the first dim is the number of rows.
    fn shape(&self) -> &[usize];
    /// The rows `rows` (indices into the first dim, in that order, repeats allowed) as a new
    /// `[rows.len(), ...]` value with its own buffer and no autograd history. Errors name the
    /// first out-of-range index and where it is in `rows`.
    fn take_rows(&self, rows: &[usize]) -> Result<Self>;
    /// Row `index` without the first dim (shape `shape()[1..]`), no autograd history. Panics if
    /// `index` is not below the number of rows, as [`Dataset::get`] does.
    fn row(&self, index: usize) -> Self;
}

/// Copies the rows `rows` of a row-major buffer of `shape` into one new buffer, returning it
/// with its shape `[rows.len(), shape[1..]...]`. `shape` must have at least one dim.
fn gather_rows<T: Copy>(op: &'static str, data: &[T], shape: &[usize], rows: &[usize]) -> Result<(Vec<T>, Vec<usize>)> {
    let Some((&n, rest)) = shape.split_first() else {
        return Err(Error::Shape { op, detail: "a 0-dim value has no rows".into(), shapes: vec![shape.to_vec()] });
    };
    let row_len: usize = rest.iter().product();
    let mut out = Vec::with_capacity(rows.len() * row_len);
    for (position, &r) in rows.iter().enumerate() {
        if r >= n {
            return Err(Error::IndexOutOfRange { op, index: r as i64, position, bound: n });
        }
        out.extend_from_slice(&data[r * row_len..(r + 1) * row_len]);
    }
    let mut out_shape = shape.to_vec();
    out_shape[0] = rows.len();
    Ok((out, out_shape))
}

impl<E: Precision> Rows for Tensor<E> {
    fn shape(&self) -> &[usize] {
        Tensor::shape(self)
    }
    fn take_rows(&self, rows: &[usize]) -> Result<Self> {
        let (data, shape) = gather_rows("Tensor::take_rows", &self.contiguous_data(), Tensor::shape(self), rows)?;
        Ok(Tensor::from_parts(data, &shape))
    }
    #[track_caller]
    fn row(&self, index: usize) -> Self {
        or_panic(self.take_rows(&[index])).reshape(&Tensor::shape(self)[1..])
    }
}

impl Rows for Indices {
    fn shape(&self) -> &[usize] {
        Indices::shape(self)
    }
    fn take_rows(&self, rows: &[usize]) -> Result<Self> {
        let (data, shape) = gather_rows("Indices::take_rows", self.as_slice(), Indices::shape(self), rows)?;
        Indices::try_from_vec(data, &shape)
    }
    #[track_caller]
    fn row(&self, index: usize) -> Self {
        or_panic(self.take_rows(&[index])).reshape(&Indices::shape(self)[1..])
    }
}

/// Inputs and labels held in memory, row `i` of each being sample `i` (PyTorch's
/// `TensorDataset(inputs, labels)`). `A` and `B` are any [`Rows`]: a `Tensor<E>` of any
/// precision, or [`Indices`] for class labels.
///
/// As a [`Dataset`] its sample is one row of each; as a [`BatchDataset`] it gathers a batch's
/// rows into `[B, ...]` tensors, which [`super::DataLoader::next_tensor_batch`] and
/// [`super::DataLoader::epoch_batches`] hand out.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::data::{DataLoader, TensorDataset};
/// use amp::{Indices, Tensor};
///
/// // 10 samples of 3 features; the label of row i is i % 2.
/// let x = Tensor::<f32>::from_vec((0..30).map(|v| v as f32).collect(), &[10, 3]);
/// let y = Indices::from_vec((0..10).map(|i| i % 2).collect(), &[10]);
/// let mut loader = DataLoader::new(TensorDataset::new(x, y).unwrap(), 4, 0).unwrap();
/// let mut sizes = Vec::new();
/// for batch in loader.epoch_batches() {
///     let (xb, yb) = batch.unwrap(); // [B, 3] f32 inputs, [B] labels
///     assert_eq!(xb.shape()[1..], [3]);
///     sizes.push(yb.shape()[0]);
/// }
/// assert_eq!(sizes, [4, 4, 2]); // one epoch, the short last batch kept (see drop_last)
/// ```
#[derive(Clone, Debug)]
pub struct TensorDataset<A, B> {
    inputs: A,
    labels: B,
}

impl<A: Rows, B: Rows> TensorDataset<A, B> {
    /// Pairs `inputs` `[N, ...]` with `labels` `[N, ...]`. Refuses a 0-dim value, `N = 0`, or
    /// first dims that differ (the error names both). Tensors are stored as given; batches
    /// and samples are always fresh values without autograd history.
    pub fn new(inputs: A, labels: B) -> Result<Self> {
        let shapes = || vec![inputs.shape().to_vec(), labels.shape().to_vec()];
        for (name, shape) in [("inputs", inputs.shape()), ("labels", labels.shape())] {
            match shape.first() {
                None => {
                    return Err(Error::Shape {
                        op: "TensorDataset::new",
                        detail: format!("{name} are 0-dim, but the first dim must count the samples"),
                        shapes: shapes(),
                    });
                }
                Some(0) => {
                    return Err(Error::Shape {
                        op: "TensorDataset::new",
                        detail: format!("{name} have no rows (first dim 0): the dataset would be empty"),
                        shapes: shapes(),
                    });
                }
                Some(_) => {}
            }
        }
        let (n_inputs, n_labels) = (inputs.shape()[0], labels.shape()[0]);
        if n_inputs != n_labels {
            return Err(Error::Shape {
                op: "TensorDataset::new",
                detail: format!(
                    "inputs have {n_inputs} rows (first dim) but labels have {n_labels}; both must count the same samples"
                ),
                shapes: shapes(),
            });
        }
        Ok(TensorDataset { inputs, labels })
    }
    /// The stored inputs and labels (PyTorch's `dataset.tensors`).
    pub fn tensors(&self) -> (&A, &B) {
        (&self.inputs, &self.labels)
    }
    /// The stored inputs and labels, giving up the dataset.
    pub fn into_tensors(self) -> (A, B) {
        (self.inputs, self.labels)
    }
}

impl<A: Rows, B: Rows> Dataset for TensorDataset<A, B> {
    /// Row `index` of the inputs and of the labels, each without the first dim.
    type Sample = (A, B);
    fn len(&self) -> usize {
        self.inputs.shape()[0]
    }
    #[track_caller]
    fn get(&self, index: usize) -> (A, B) {
        (self.inputs.row(index), self.labels.row(index))
    }
}

impl<A: Rows, B: Rows> BatchDataset for TensorDataset<A, B> {
    /// `[B, ...]` inputs and `[B, ...]` labels, row `k` of each being sample `indices[k]`.
    type Batch = (A, B);
    fn batch(&self, indices: &[usize]) -> Result<(A, B)> {
        Ok((self.inputs.take_rows(indices)?, self.labels.take_rows(indices)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_rows_gathers_in_the_given_order_and_names_a_bad_index() {
        let t = Tensor::<f32>::from_vec((0..12).map(|v| v as f32).collect(), &[4, 3]);
        let rows = t.take_rows(&[2, 0, 2]).unwrap();
        assert_eq!(rows.shape(), &[3, 3]);
        assert_eq!(rows.to_vec(), [6.0, 7.0, 8.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0]);
        // A strided view is gathered by its logical rows, not its storage order.
        let tt = t.t(); // [3, 4]: row 1 is column 1 of t
        assert_eq!(tt.take_rows(&[1]).unwrap().to_vec(), [1.0, 4.0, 7.0, 10.0]);
        let err = t.take_rows(&[1, 4]).unwrap_err().to_string();
        assert_eq!(err, "Tensor::take_rows: index 4 at position 1 is out of range 0..4");

        let labels = Indices::from_vec(vec![5, 6, 7], &[3]);
        assert_eq!(labels.take_rows(&[2, 1]).unwrap(), Indices::from_vec(vec![7, 6], &[2]));
        assert_eq!(labels.row(1), Indices::from_vec(vec![6], &[]));
        assert!(labels.take_rows(&[3]).unwrap_err().to_string().contains("index 3 at position 0"));
    }

    #[test]
    fn rows_of_a_grad_tensor_carry_no_history() {
        let w = Tensor::<f32>::ones(&[3, 2]).requires_grad_();
        assert!(!w.take_rows(&[0, 2]).unwrap().requires_grad());
        let r = w.row(1);
        assert_eq!(r.shape(), &[2]);
        assert!(!r.requires_grad());
    }
}
