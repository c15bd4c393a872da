//! Softmax and log-softmax over a dim, max-subtracted, with fused forward and backward kernels
//! (the device's `softmax` kernels) that accumulate in `E::Acc` and round once.
//!
//! The kernels work on the last dim; another dim is moved last by a transpose (a view) and
//! back, so autograd goes through the transposes.

use crate::backend::Device;
use crate::error::{Error, Result, or_panic};
use crate::indices::Mask;
use crate::layout::{broadcast_shapes, check_dim};
use crate::precision::Precision;
use crate::tensor::Tensor;

impl<E: Precision, D: Device> Tensor<E, D> {
    #[track_caller]
    fn softmax_impl<const LOG: bool>(&self, op: &'static str, dim: usize) -> Result<Self> {
        crate::__private::check_reach(op, E::DTYPE);
        if self.rank() == 0 {
            // PyTorch accepts dim 0 on a 0-dim tensor: the one element is its own row.
            if dim != 0 {
                return Err(Error::DimOutOfRange { op, dim, rank: 0, shape: vec![] });
            }
            return Ok(self.reshape(&[1]).softmax_impl::<LOG>(op, 0)?.reshape(&[]));
        }
        check_dim(op, dim, self.shape())?;
        let last = self.rank() - 1;
        if dim != last {
            return Ok(self.transpose(dim, last).softmax_impl::<LOG>(op, last)?.transpose(dim, last).contiguous());
        }
        let d = self.shape()[last];
        let out = self.output(self.device.softmax(&self.storage, &self.layout, d, LOG), self.shape());
        if !self.requires_grad() {
            return Ok(out);
        }
        let y = out.detach();
        Ok(out.record(op, vec![self.node.clone()], move |g| {
            let gx = y.device.softmax_backward(y.raw(), g.raw(), d, LOG);
            vec![Some(y.output(gx, y.shape()).into())]
        }))
    }

    /// [`Tensor::softmax_impl`] computed and returned in f32 from any input precision: the
    /// values of `self.cast::<f32>()` then the softmax, in one kernel where the device fuses
    /// the cast (the CPU, for f16 and bf16). Its backward rounds the f32 input gradient once
    /// into `E`, as the cast's backward would.
    #[track_caller]
    fn softmax_f32_impl<const LOG: bool>(&self, op: &'static str, dim: usize) -> Result<Tensor<f32, D>> {
        // No reach check (`check_reach`): whatever `E`, this op already computes in f32, as
        // autocast would run it, so an f16/bf16 input inside a region is not a missed cast.
        if self.rank() == 0 {
            if dim != 0 {
                return Err(Error::DimOutOfRange { op, dim, rank: 0, shape: vec![] });
            }
            return Ok(self.reshape(&[1]).softmax_f32_impl::<LOG>(op, 0)?.reshape(&[]));
        }
        check_dim(op, dim, self.shape())?;
        let last = self.rank() - 1;
        if dim != last {
            return Ok(self.transpose(dim, last).softmax_f32_impl::<LOG>(op, last)?.transpose(dim, last).contiguous());
        }
        if E::DTYPE == crate::precision::DType::F32 {
            // Already f32: the softmax itself (the cast is the identity).
            return self.cast::<f32>().softmax_impl::<LOG>(op, dim);
        }
        let d = self.shape()[last];
        let out = self.output(self.device.softmax_to_f32(&self.storage, &self.layout, d, LOG), self.shape());
        if !self.requires_grad() {
            return Ok(out);
        }
        let y = out.detach();
        Ok(out.record(op, vec![self.node.clone()], move |g| {
            let gx = y.device.softmax_backward_from_f32::<E>(y.raw(), g.raw(), d, LOG);
            vec![Some(y.output(gx, y.shape()).into())]
        }))
    }

    /// Softmax over `dim`: `y_i = exp(x_i - max) / sum_j exp(x_j - max)`, accumulated in f32
    /// for f16/bf16 and rounded once. Derivative: `dx = y * (g - sum(g * y))`.
    #[track_caller]
    pub fn try_softmax(&self, dim: usize) -> Result<Self> {
        self.softmax_impl::<false>("softmax", dim)
    }
    /// Softmax over `dim`; panics if `dim` is out of range.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 1.0, 1000.0, 1000.0], &[2, 2]);
    /// assert_eq!(x.softmax(1).to_vec(), vec![0.5, 0.5, 0.5, 0.5]); // no overflow
    /// ```
    #[track_caller]
    pub fn softmax(&self, dim: usize) -> Self {
        or_panic(self.try_softmax(dim))
    }
    /// Log-softmax over `dim`: `y_i = x_i - max - log(sum_j exp(x_j - max))`.
    /// Derivative: `dx = g - exp(y) * sum(g)`.
    #[track_caller]
    pub fn try_log_softmax(&self, dim: usize) -> Result<Self> {
        self.softmax_impl::<true>("log_softmax", dim)
    }
    /// Log-softmax over `dim`; panics if `dim` is out of range.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f64>::from_vec(vec![0.0, 0.0], &[2]);
    /// let y = x.log_softmax(0).to_vec();
    /// assert!((y[0] + 2f64.ln()).abs() < 1e-15);
    /// ```
    #[track_caller]
    pub fn log_softmax(&self, dim: usize) -> Self {
        or_panic(self.try_log_softmax(dim))
    }

    /// Softmax over `dim` computed and returned in f32, whatever `E` is: PyTorch's
    /// `softmax(x, dim, dtype=torch.float32)`, and what autocast runs for the softmax of an f16
    /// or bf16 tensor. The same values as `self.cast::<f32>().softmax(dim)`, without a cast
    /// pass where the device fuses it (the CPU does for f16 and bf16). Derivative: softmax's,
    /// in f32, rounded once into `E`.
    #[track_caller]
    pub fn try_softmax_f32(&self, dim: usize) -> Result<Tensor<f32, D>> {
        self.softmax_f32_impl::<false>("softmax", dim)
    }
    /// [`Tensor::try_softmax_f32`]; panics if `dim` is out of range.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// use amp::bf16;
    /// let x = Tensor::<f32>::from_vec(vec![0.0, 1.0, 2.0], &[3]).cast::<bf16>();
    /// let p: Tensor<f32> = x.softmax_f32(0);
    /// assert_eq!(p.to_vec(), x.cast::<f32>().softmax(0).to_vec());
    /// ```
    #[track_caller]
    pub fn softmax_f32(&self, dim: usize) -> Tensor<f32, D> {
        or_panic(self.try_softmax_f32(dim))
    }
    /// Log-softmax over `dim` computed and returned in f32 (PyTorch's
    /// `log_softmax(x, dim, dtype=torch.float32)`): the values of
    /// `self.cast::<f32>().log_softmax(dim)`, without a cast pass where the device fuses it.
    #[track_caller]
    pub fn try_log_softmax_f32(&self, dim: usize) -> Result<Tensor<f32, D>> {
        self.softmax_f32_impl::<true>("log_softmax", dim)
    }
    /// [`Tensor::try_log_softmax_f32`]; panics if `dim` is out of range.
    #[track_caller]
    pub fn log_softmax_f32(&self, dim: usize) -> Tensor<f32, D> {
        or_panic(self.try_log_softmax_f32(dim))
    }

    /// The attention probabilities of scores over their last dim, in one pass each way where
    /// the device fuses it (the CPU does for f32, f16 and bf16): the values and gradients of
    /// `self.mul_scalar(scale).masked_fill(mask, -inf).softmax_f32(last).cast::<E>()` bit for
    /// bit, which is PyTorch's unfused attention under autocast (`(q @ k.T) * scale`,
    /// `masked_fill(mask, -inf)`, the softmax in f32, the probabilities cast back for `@ v`).
    /// `mask` (true where a score is hidden) broadcasts to `self`'s shape. The f32
    /// probabilities are kept for the backward (as the chain's softmax keeps them); no f32 copy
    /// of the scores is made.
    ///
    /// A row masked everywhere gives NaN, as the chain does.
    #[track_caller]
    pub fn try_scaled_masked_softmax(&self, scale: f64, mask: &Mask) -> Result<Self> {
        // No reach check (`check_reach`): the softmax runs in f32 whatever `E` is, as autocast
        // would run it; the scale's rounding into `E` is the chain's own.
        let op = "scaled_masked_softmax";
        if self.rank() == 0 {
            return Err(Error::InvalidArgument {
                op,
                name: "self",
                detail: "a 0-dim tensor has no last dim to take the softmax over".into(),
            });
        }
        let shape = broadcast_shapes(op, mask.shape(), self.shape())?;
        if shape != self.shape() {
            return Err(Error::Shape {
                op,
                detail: "the mask must broadcast to the scores' shape".into(),
                shapes: vec![mask.shape().to_vec(), self.shape().to_vec()],
            });
        }
        let m = (mask.as_slice(), mask.shape());
        let (probs, out) = self.device.scaled_masked_softmax(&self.storage, &self.layout, scale, m);
        let out = self.output(out, self.shape());
        if !self.requires_grad() {
            return Ok(out);
        }
        let (probs, mask) = (self.output(probs, self.shape()), mask.clone());
        Ok(out.record(op, vec![self.node.clone()], move |g| {
            let m = (mask.as_slice(), mask.shape());
            let gx = probs.device.scaled_masked_softmax_backward::<E>(probs.raw(), g.raw(), scale, m);
            vec![Some(probs.output(gx, probs.shape()).into())]
        }))
    }
    /// [`Tensor::try_scaled_masked_softmax`]; panics if the mask does not broadcast to `self`.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::{Mask, Tensor};
    /// use amp::bf16;
    /// let scores = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2]).cast::<bf16>();
    /// let causal = Mask::causal(2);
    /// let p = scores.scaled_masked_softmax(0.5, &causal);
    /// let chain = scores.mul_scalar(0.5).masked_fill(&causal, f64::NEG_INFINITY).softmax_f32(1).cast::<bf16>();
    /// assert_eq!(p.to_vec(), chain.to_vec());
    /// assert_eq!(p.to_vec()[..2], [bf16::ONE, bf16::ZERO]); // the first row sees itself only
    /// ```
    #[track_caller]
    pub fn scaled_masked_softmax(&self, scale: f64, mask: &Mask) -> Self {
        or_panic(self.try_scaled_masked_softmax(scale, mask))
    }
}
