//! 2-D pooling over the last two dims of `[N, C, H, W]` (or `[C, H, W]`), as PyTorch's
//! `F.max_pool2d`, `F.avg_pool2d` (`count_include_pad=True`, `ceil_mode=False`) and
//! `F.adaptive_avg_pool2d`, on the device's pooling kernels.
//!
//! Derivatives: max pooling routes each output's gradient to its window's max (the first in
//! row-major order among equal values); averages spread `g / divisor` over their window.
//! Gradients meeting at one input (overlapping windows) are summed.

use crate::backend::{Device, Pool2dSpec, PoolWindow};
use crate::error::{Error, Result, or_panic};
use crate::precision::Precision;
use crate::tensor::Tensor;

impl<E: Precision, D: Device> Tensor<E, D> {
    /// The pooling's sizes for this input, or the error naming `op` and the input's shape.
    fn pool_spec(&self, op: &'static str, window: PoolWindow, output: Option<(usize, usize)>) -> Result<Pool2dSpec> {
        let shapes = vec![self.shape().to_vec()];
        if !(3..=4).contains(&self.rank()) {
            return Err(Error::Shape { op, detail: "needs an input [N, C, H, W] or [C, H, W]".into(), shapes });
        }
        let r = self.rank();
        let (h, w) = (self.shape()[r - 2], self.shape()[r - 1]);
        if h == 0 || w == 0 {
            return Err(Error::Shape { op, detail: "needs a non-empty H and W".into(), shapes });
        }
        let planes = self.shape()[..r - 2].iter().product();
        let output = match window {
            PoolWindow::Fixed { kernel, stride, padding } => {
                for (name, v) in [("kernel", kernel), ("stride", stride)] {
                    if v.0 == 0 || v.1 == 0 {
                        return Err(Error::InvalidArgument {
                            op,
                            name,
                            detail: format!(
                                "must be at least 1 in both dims, got {v:?} (input shape {:?})",
                                self.shape()
                            ),
                        });
                    }
                }
                if 2 * padding.0 > kernel.0 || 2 * padding.1 > kernel.1 {
                    return Err(Error::InvalidArgument {
                        op,
                        name: "padding",
                        detail: format!(
                            "must be at most half the kernel {kernel:?}, got {padding:?} (input shape {:?})",
                            self.shape()
                        ),
                    });
                }
                let size = |i: usize, k: usize, s: usize, p: usize| (i + 2 * p).checked_sub(k).map(|span| span / s + 1);
                match (size(h, kernel.0, stride.0, padding.0), size(w, kernel.1, stride.1, padding.1)) {
                    (Some(oh), Some(ow)) => (oh, ow),
                    _ => {
                        return Err(Error::Shape {
                            op,
                            detail: format!(
                                "the kernel {kernel:?} is larger than the input {h}x{w} padded by {padding:?}"
                            ),
                            shapes,
                        });
                    }
                }
            }
            PoolWindow::Adaptive => {
                let out = output.expect("adaptive pooling names its output size");
                if out.0 == 0 || out.1 == 0 {
                    return Err(Error::InvalidArgument {
                        op,
                        name: "output_size",
                        detail: format!(
                            "must be at least 1 in both dims, got {out:?} (input shape {:?})",
                            self.shape()
                        ),
                    });
                }
                out
            }
        };
        Ok(Pool2dSpec { planes, input: (h, w), output, window })
    }

    /// The output shape: the input's with the last two dims replaced.
    fn pooled_shape(&self, spec: &Pool2dSpec) -> Vec<usize> {
        let mut shape = self.shape().to_vec();
        let r = shape.len();
        (shape[r - 2], shape[r - 1]) = spec.output;
        shape
    }

    /// 2-D max pooling (PyTorch's `F.max_pool2d` without dilation or ceil mode): the max of
    /// each `kernel` window every `stride`, the input padded with -inf by `padding` on each
    /// side (at most half the kernel, so every window holds an input element). NaN wins.
    /// Output `[.., (H + 2 padding.0 - kernel.0) / stride.0 + 1, ..]`, likewise for W.
    pub fn try_max_pool2d(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Self> {
        let spec = self.pool_spec("max_pool2d", PoolWindow::Fixed { kernel, stride, padding }, None)?;
        let out = self.output(self.device.max_pool2d(&self.storage, &self.layout, &spec), &self.pooled_shape(&spec));
        if !self.requires_grad() {
            return Ok(out);
        }
        let (x, in_shape) = (self.detach(), self.shape().to_vec());
        Ok(out.record("max_pool2d", vec![self.node.clone()], move |g| {
            vec![Some(x.output(x.device.max_pool2d_backward(x.raw(), g.raw(), &spec), &in_shape).into())]
        }))
    }
    /// 2-D max pooling; panics with [`Tensor::try_max_pool2d`]'s error.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f32>::from_vec((0..16).map(|v| v as f32).collect(), &[1, 1, 4, 4]);
    /// assert_eq!(x.max_pool2d((2, 2), (2, 2), (0, 0)).to_vec(), vec![5.0, 7.0, 13.0, 15.0]);
    /// ```
    #[track_caller]
    pub fn max_pool2d(&self, kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize)) -> Self {
        or_panic(self.try_max_pool2d(kernel, stride, padding))
    }

    fn avg_pool_impl(&self, op: &'static str, window: PoolWindow, output: Option<(usize, usize)>) -> Result<Self> {
        let spec = self.pool_spec(op, window, output)?;
        let out = self.output(self.device.avg_pool2d(&self.storage, &self.layout, &spec), &self.pooled_shape(&spec));
        if !self.requires_grad() {
            return Ok(out);
        }
        let in_shape = self.shape().to_vec();
        Ok(out.record(op, vec![self.node.clone()], move |g| {
            vec![Some(g.output(g.device.avg_pool2d_backward(&g.storage, &g.layout, &spec), &in_shape).into())]
        }))
    }

    /// 2-D average pooling (PyTorch's `F.avg_pool2d` with `count_include_pad=True`, no ceil
    /// mode): the mean of each `kernel` window every `stride` over the input zero-padded by
    /// `padding` (at most half the kernel), always divided by `kernel.0 * kernel.1`. Summed in
    /// f32 (f64 for f64), rounded once.
    pub fn try_avg_pool2d(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Self> {
        self.avg_pool_impl("avg_pool2d", PoolWindow::Fixed { kernel, stride, padding }, None)
    }
    /// 2-D average pooling; panics with [`Tensor::try_avg_pool2d`]'s error.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f32>::from_vec((0..16).map(|v| v as f32).collect(), &[1, 1, 4, 4]);
    /// assert_eq!(x.avg_pool2d((2, 2), (2, 2), (0, 0)).to_vec(), vec![2.5, 4.5, 10.5, 12.5]);
    /// ```
    #[track_caller]
    pub fn avg_pool2d(&self, kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize)) -> Self {
        or_panic(self.try_avg_pool2d(kernel, stride, padding))
    }

    /// 2-D adaptive average pooling to `output_size` (oH, oW) (PyTorch's
    /// `F.adaptive_avg_pool2d`): output `i` along a dim of input size `n` averages the input
    /// range `[floor(i n / o), ceil((i + 1) n / o))`.
    pub fn try_adaptive_avg_pool2d(&self, output_size: (usize, usize)) -> Result<Self> {
        self.avg_pool_impl("adaptive_avg_pool2d", PoolWindow::Adaptive, Some(output_size))
    }
    /// 2-D adaptive average pooling; panics with [`Tensor::try_adaptive_avg_pool2d`]'s error.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f32>::from_vec((0..6).map(|v| v as f32).collect(), &[1, 1, 2, 3]);
    /// // Columns [0, 2) and [1, 3) of each row, then both rows.
    /// assert_eq!(x.adaptive_avg_pool2d((1, 2)).to_vec(), vec![2.0, 3.0]);
    /// ```
    #[track_caller]
    pub fn adaptive_avg_pool2d(&self, output_size: (usize, usize)) -> Self {
        or_panic(self.try_adaptive_avg_pool2d(output_size))
    }
}
