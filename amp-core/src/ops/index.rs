//! Selection and joining: `masked_fill` and `where_cond` with broadcast [`Mask`]s, and `cat` /
//! `stack` along a dim (the device's `select` and `cat` kernels). Gradients are routed back to the selected or
//! concatenated inputs and summed over broadcast dims.

use crate::backend::Device;
use crate::error::{Error, Result, or_panic};
use crate::indices::Mask;
use crate::layout::{broadcast_shapes, check_dim, outer_dim_inner};
use crate::precision::Precision;
use crate::tensor::Tensor;

impl<E: Precision, D: Device> Tensor<E, D> {
    /// `mask ? a : b` elementwise on contiguous-or-strided operands broadcast to `shape`.
    fn select_raw(mask: &Mask, a: &Tensor<E, D>, b: &Tensor<E, D>, shape: &[usize]) -> Tensor<E, D> {
        a.output(a.device.select((mask.as_slice(), mask.shape()), a.raw(), b.raw(), shape), shape)
    }

    /// `mask ? a : b` elementwise, with `mask`, `a` and `b` broadcast together (NumPy rules),
    /// PyTorch's `torch.where(mask, a, b)`. Derivatives: the gradient goes to `a` where the
    /// mask is true and to `b` where it is false (summed over broadcast dims).
    pub fn try_where_cond(mask: &Mask, a: &Tensor<E, D>, b: &Tensor<E, D>) -> Result<Tensor<E, D>> {
        let ab = broadcast_shapes("where_cond", a.shape(), b.shape())?;
        let shape = broadcast_shapes("where_cond", mask.shape(), &ab).map_err(|_| Error::Shape {
            op: "where_cond",
            detail: "mask, a and b cannot be broadcast together".into(),
            shapes: vec![mask.shape().to_vec(), a.shape().to_vec(), b.shape().to_vec()],
        })?;
        let out = Self::select_raw(mask, a, b, &shape);
        if !a.requires_grad() && !b.requires_grad() {
            return Ok(out);
        }
        let needs = (a.requires_grad(), b.requires_grad());
        let (mask, sa, sb) = (mask.clone(), a.shape().to_vec(), b.shape().to_vec());
        Ok(out.record("where_cond", vec![a.node.clone(), b.node.clone()], move |g| {
            let zero = g.filled_like::<E>(&[], 0.0);
            let shape = g.shape().to_vec();
            vec![
                needs.0.then(|| Self::select_raw(&mask, &g, &zero, &shape).sum_to_shape(&sa).into()),
                needs.1.then(|| Self::select_raw(&mask, &zero, &g, &shape).sum_to_shape(&sb).into()),
            ]
        }))
    }
    /// `mask ? a : b` elementwise with broadcasting; panics if the shapes do not broadcast.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::{Mask, Tensor};
    /// let m = Mask::from_vec(vec![true, false], &[2]);
    /// let a = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2]);
    /// let b = Tensor::<f32>::zeros(&[1]);
    /// assert_eq!(Tensor::where_cond(&m, &a, &b).to_vec(), vec![1.0, 0.0, 3.0, 0.0]);
    /// ```
    #[track_caller]
    pub fn where_cond(mask: &Mask, a: &Tensor<E, D>, b: &Tensor<E, D>) -> Tensor<E, D> {
        or_panic(Self::try_where_cond(mask, a, b))
    }

    /// `value` where `mask` is true, `self` elsewhere (the mask broadcasts against `self`; the
    /// output has the broadcast shape). `value` is rounded once into `E` (`-inf` stays `-inf`).
    /// Derivative: the gradient passes where the mask is false and is zero where it filled.
    pub fn try_masked_fill(&self, mask: &Mask, value: f64) -> Result<Self> {
        let shape = broadcast_shapes("masked_fill", self.shape(), mask.shape())?;
        let fill = self.filled_like::<E>(&[], value);
        let out = Self::select_raw(mask, &fill, self, &shape);
        if !self.requires_grad() {
            return Ok(out);
        }
        let (mask, in_shape) = (mask.clone(), self.shape().to_vec());
        Ok(out.record("masked_fill", vec![self.node.clone()], move |g| {
            let zero = g.filled_like::<E>(&[], 0.0);
            let shape = g.shape().to_vec();
            vec![Some(Self::select_raw(&mask, &zero, &g, &shape).sum_to_shape(&in_shape).into())]
        }))
    }
    /// `value` where `mask` is true, `self` elsewhere; panics if the shapes do not broadcast.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::{Mask, Tensor};
    /// let scores = Tensor::<f32>::zeros(&[2, 2]);
    /// let masked = scores.masked_fill(&Mask::causal(2), f64::NEG_INFINITY);
    /// assert_eq!(masked.to_vec(), vec![0.0, f32::NEG_INFINITY, 0.0, 0.0]);
    /// ```
    #[track_caller]
    pub fn masked_fill(&self, mask: &Mask, value: f64) -> Self {
        or_panic(self.try_masked_fill(mask, value))
    }

    /// Concatenates `tensors` along `dim`: every shape must match except in `dim`.
    /// Derivative: the gradient is split back along `dim` into each input's slice.
    pub fn try_cat(tensors: &[&Tensor<E, D>], dim: usize) -> Result<Tensor<E, D>> {
        let shapes = || tensors.iter().map(|t| t.shape().to_vec()).collect::<Vec<_>>();
        let Some(first) = tensors.first() else {
            return Err(Error::InvalidArgument {
                op: "cat",
                name: "tensors",
                detail: "needs at least one tensor".into(),
            });
        };
        check_dim("cat", dim, first.shape())?;
        let same_except_dim = |t: &&Tensor<E, D>| {
            t.rank() == first.rank() && (0..t.rank()).all(|d| d == dim || t.shape()[d] == first.shape()[d])
        };
        if !tensors.iter().all(same_except_dim) {
            return Err(Error::Shape {
                op: "cat",
                detail: format!("shapes must match except in dim {dim}"),
                shapes: shapes(),
            });
        }
        let (outer, _, inner) = outer_dim_inner(first.shape(), dim);
        let parts: Vec<_> = tensors.iter().map(|t| (&t.storage, &t.layout, t.shape()[dim])).collect();
        let sizes: Vec<usize> = parts.iter().map(|p| p.2).collect();
        let mut shape = first.shape().to_vec();
        shape[dim] = sizes.iter().sum();
        let out = first.output(first.device.cat(&parts, outer, inner), &shape);
        let parents: Vec<_> = tensors.iter().map(|t| t.node.clone()).collect();
        let needs: Vec<bool> = tensors.iter().map(|t| t.requires_grad()).collect();
        Ok(out.record("cat", parents, move |g| {
            let mut start = 0;
            sizes
                .iter()
                .zip(&needs)
                .map(|(&len, &need)| {
                    let piece = need.then(|| g.narrow(dim, start, len).contiguous().into());
                    start += len;
                    piece
                })
                .collect()
        }))
    }
    /// Concatenates `tensors` along `dim`; panics on an empty list or mismatched shapes.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let a = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[1, 2]);
    /// let b = Tensor::<f32>::from_vec(vec![3.0, 4.0, 5.0, 6.0], &[2, 2]);
    /// let c = Tensor::cat(&[&a, &b], 0);
    /// assert_eq!(c.shape(), &[3, 2]);
    /// assert_eq!(c.to_vec(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    /// ```
    #[track_caller]
    pub fn cat(tensors: &[&Tensor<E, D>], dim: usize) -> Tensor<E, D> {
        or_panic(Self::try_cat(tensors, dim))
    }

    /// Stacks equally shaped `tensors` along a new dim `dim` (`0..=rank`).
    /// Derivative: the gradient is split back along `dim`.
    pub fn try_stack(tensors: &[&Tensor<E, D>], dim: usize) -> Result<Tensor<E, D>> {
        let Some(first) = tensors.first() else {
            return Err(Error::InvalidArgument {
                op: "stack",
                name: "tensors",
                detail: "needs at least one tensor".into(),
            });
        };
        if dim > first.rank() {
            return Err(Error::Shape {
                op: "stack",
                detail: format!("dim {dim} is out of range 0..={} for stacking", first.rank()),
                shapes: tensors.iter().map(|t| t.shape().to_vec()).collect(),
            });
        }
        if tensors.iter().any(|t| t.shape() != first.shape()) {
            return Err(Error::Shape {
                op: "stack",
                detail: "every tensor must have the same shape".into(),
                shapes: tensors.iter().map(|t| t.shape().to_vec()).collect(),
            });
        }
        let unsqueezed: Vec<Tensor<E, D>> = tensors.iter().map(|t| t.unsqueeze(dim)).collect();
        Self::try_cat(&unsqueezed.iter().collect::<Vec<_>>(), dim)
    }
    /// Stacks equally shaped `tensors` along a new dim; panics on an empty list or mismatched
    /// shapes.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let a = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2]);
    /// let b = Tensor::<f32>::from_vec(vec![3.0, 4.0], &[2]);
    /// assert_eq!(Tensor::stack(&[&a, &b], 1).to_vec(), vec![1.0, 3.0, 2.0, 4.0]);
    /// ```
    #[track_caller]
    pub fn stack(tensors: &[&Tensor<E, D>], dim: usize) -> Tensor<E, D> {
        or_panic(Self::try_stack(tensors, dim))
    }
}
