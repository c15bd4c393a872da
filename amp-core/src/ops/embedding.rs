//! Embedding lookup: rows of a weight `[V, D]` gathered by token ids, with a scatter-add
//! backward into a `[V, D]` gradient (the device's `gather_rows` and `scatter_add_rows`).

use crate::backend::Device;
use crate::error::{Error, Result, or_panic};
use crate::indices::Indices;
use crate::precision::Precision;
use crate::tensor::Tensor;

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Looks up rows of this weight `[V, D]` by `ids` (any shape, values in `0..V`): the output
    /// has shape `[ids.shape()..., D]`. Derivative: the output gradient's rows are added into a
    /// zero `[V, D]` gradient at their ids (repeated ids accumulate, in f32 for f16/bf16).
    /// An id outside `0..V` is [`Error::IndexOutOfRange`].
    pub fn try_embedding(&self, ids: &Indices) -> Result<Self> {
        if self.rank() != 2 {
            return Err(Error::Shape {
                op: "embedding",
                detail: "the weight must be 2-D [num_embeddings, dim]".into(),
                shapes: vec![self.shape().to_vec(), ids.shape().to_vec()],
            });
        }
        let (v, d) = (self.shape()[0], self.shape()[1]);
        ids.check_bound("embedding", v, None)?;
        let mut shape = ids.shape().to_vec();
        shape.push(d);
        let out = self.output(self.device.gather_rows(self.raw(), ids.as_slice(), d), &shape);
        if !self.requires_grad() {
            return Ok(out);
        }
        let ids = ids.clone();
        Ok(out.record("embedding", vec![self.node.clone()], move |g| {
            let gw = g.device.scatter_add_rows(g.raw(), ids.as_slice(), v, d);
            vec![Some(g.output(gw, &[v, d]).into())]
        }))
    }
    /// Embedding lookup; panics if the weight is not 2-D or an id is out of range.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::{Indices, Tensor};
    /// let w = Tensor::<f32>::from_vec(vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0], &[3, 2]);
    /// let ids = Indices::from_vec(vec![2, 0], &[1, 2]);
    /// let y = w.embedding(&ids);
    /// assert_eq!(y.shape(), &[1, 2, 2]);
    /// assert_eq!(y.to_vec(), vec![20.0, 21.0, 0.0, 1.0]);
    /// ```
    #[track_caller]
    pub fn embedding(&self, ids: &Indices) -> Self {
        or_panic(self.try_embedding(ids))
    }
}
