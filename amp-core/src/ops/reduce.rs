//! Reductions over a dim (sum, mean, max, min, argmax, argmin) and over everything.
//! f16/bf16 accumulate in f32 and round once. Derivatives: sum broadcasts the gradient back,
//! mean also divides by the count, max/min route it to the selected element.

use crate::backend::{Device, DimSplit, ReduceOp};
use crate::error::{Result, or_panic};
use crate::indices::Indices;
use crate::layout::check_dim;
use crate::precision::Precision;
use crate::tensor::Tensor;

fn reduced_shape(shape: &[usize], dim: usize, keepdim: bool) -> Vec<usize> {
    let mut s = shape.to_vec();
    if keepdim {
        s[dim] = 1;
    } else {
        s.remove(dim);
    }
    s
}

impl<E: Precision, D: Device> Tensor<E, D> {
    #[track_caller]
    fn sum_or_mean(&self, op: &'static str, dim: usize, keepdim: bool, mean: bool) -> Result<Self> {
        crate::__private::check_reach(op, E::DTYPE);
        check_dim(op, dim, self.shape())?;
        let split = DimSplit::of(self.shape(), dim);
        let scale = if mean { 1.0 / split.dim as f64 } else { 1.0 };
        let data = self.device.reduce(&self.storage, &self.layout, split, ReduceOp::Sum, scale);
        let out = self.output(data, &reduced_shape(self.shape(), dim, keepdim));
        let in_shape = self.shape().to_vec();
        let keep_shape = reduced_shape(&in_shape, dim, true);
        Ok(out.record(op, vec![self.node.clone()], move |g| {
            let g = g.reshape(&keep_shape);
            let g = if mean { g.mul_scalar(scale) } else { g };
            vec![Some(g.broadcast_to(&in_shape).contiguous().into())]
        }))
    }
    /// Sum over `dim` (kept as size 1 if `keepdim`).
    #[track_caller]
    pub fn try_sum(&self, dim: usize, keepdim: bool) -> Result<Self> {
        self.sum_or_mean("sum", dim, keepdim, false)
    }
    /// Sum over `dim`.
    #[track_caller]
    pub fn sum(&self, dim: usize, keepdim: bool) -> Self {
        or_panic(self.try_sum(dim, keepdim))
    }
    /// Mean over `dim`.
    #[track_caller]
    pub fn try_mean(&self, dim: usize, keepdim: bool) -> Result<Self> {
        self.sum_or_mean("mean", dim, keepdim, true)
    }
    /// Mean over `dim`.
    #[track_caller]
    pub fn mean(&self, dim: usize, keepdim: bool) -> Self {
        or_panic(self.try_mean(dim, keepdim))
    }
    /// Sum of every element, as a 0-dim tensor.
    #[track_caller]
    pub fn sum_all(&self) -> Self {
        self.flatten().sum(0, false)
    }
    /// Mean of every element, as a 0-dim tensor (NaN for an empty tensor, as in PyTorch).
    #[track_caller]
    pub fn mean_all(&self) -> Self {
        self.flatten().mean(0, false)
    }

    fn select_extreme(&self, op: &'static str, dim: usize, keepdim: bool, max: bool) -> Result<Self> {
        check_dim(op, dim, self.shape())?;
        let split = DimSplit::of(self.shape(), dim);
        if split.dim == 0 {
            return Err(crate::Error::Shape {
                op,
                detail: format!("cannot reduce an empty dim {dim}"),
                shapes: vec![self.shape().to_vec()],
            });
        }
        let (vals, idx) = self.device.arg_reduce(&self.storage, &self.layout, split, max);
        let out = self.output(vals, &reduced_shape(self.shape(), dim, keepdim));
        let in_shape = self.shape().to_vec();
        Ok(out.record(op, vec![self.node.clone()], move |g| {
            let full = g.device.scatter_dim(&g.storage, &g.layout, &idx, split);
            vec![Some(g.output(full, &in_shape).into())]
        }))
    }
    /// Max over `dim` (NaN wins, as in PyTorch); the gradient goes to the selected element.
    pub fn try_max(&self, dim: usize, keepdim: bool) -> Result<Self> {
        self.select_extreme("max", dim, keepdim, true)
    }
    /// Max over `dim`.
    #[track_caller]
    pub fn max(&self, dim: usize, keepdim: bool) -> Self {
        or_panic(self.try_max(dim, keepdim))
    }
    /// Min over `dim` (NaN wins); the gradient goes to the selected element.
    pub fn try_min(&self, dim: usize, keepdim: bool) -> Result<Self> {
        self.select_extreme("min", dim, keepdim, false)
    }
    /// Min over `dim`.
    #[track_caller]
    pub fn min(&self, dim: usize, keepdim: bool) -> Self {
        or_panic(self.try_min(dim, keepdim))
    }
    /// Index of the max over `dim` (first occurrence; NaN wins).
    pub fn try_argmax(&self, dim: usize, keepdim: bool) -> Result<Indices> {
        self.arg("argmax", dim, keepdim, true)
    }
    /// Index of the max over `dim`.
    #[track_caller]
    pub fn argmax(&self, dim: usize, keepdim: bool) -> Indices {
        or_panic(self.try_argmax(dim, keepdim))
    }
    /// Index of the min over `dim`.
    #[track_caller]
    pub fn argmin(&self, dim: usize, keepdim: bool) -> Indices {
        or_panic(self.arg("argmin", dim, keepdim, false))
    }
    fn arg(&self, op: &'static str, dim: usize, keepdim: bool, max: bool) -> Result<Indices> {
        check_dim(op, dim, self.shape())?;
        let split = DimSplit::of(self.shape(), dim);
        if split.dim == 0 {
            return Err(crate::Error::Shape {
                op,
                detail: format!("cannot reduce an empty dim {dim}"),
                shapes: vec![self.shape().to_vec()],
            });
        }
        let (_, idx) = self.device.arg_reduce(&self.storage, &self.layout, split, max);
        Indices::try_from_vec(idx.into_iter().map(|i| i as i64).collect(), &reduced_shape(self.shape(), dim, keepdim))
    }
}
