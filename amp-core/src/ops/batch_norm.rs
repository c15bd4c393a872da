//! Batch norm, functional (PyTorch's `F.batch_norm`): per-channel statistics over every dim
//! but dim 1 of `[N, C, ...]`, on the device's fused kernels. Statistics are in `E::Acc` (f32
//! for f16, bf16 and f32) and the output is rounded once; the running buffers are f32 whatever
//! the input's precision, updated in place in training with PyTorch's rule. The weight and
//! bias are in `E::Acc` too: an f16/bf16 input takes f32 parameters as they are (PyTorch's
//! mixed batch norm, cuDNN's), so autocast never rounds them, and their gradients come back
//! in f32 unrounded.
//!
//! Derivatives, with `x̂` the normalised input, `rstd = 1/sqrt(var + eps)` and sums over a
//! channel's `M = N·H·W` elements: in training (through the batch statistics)
//! `dx = w·rstd·(g - Σg/M - x̂·Σ(g·x̂)/M)`; in eval (a fixed affine) `dx = w·rstd·g`; in both
//! `dweight = Σ g·x̂`, `dbias = Σ g`.

use crate::backend::{BatchNormStats, Device};
use crate::error::{Error, Result, or_panic};
use crate::precision::Precision;
use crate::tensor::Tensor;

/// The options of [`Tensor::batch_norm`], with PyTorch's defaults (`training = false`,
/// `momentum = 0.1`, `eps = 1e-5`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormOptions {
    /// Normalise with the batch's statistics (and update the running buffers when given);
    /// otherwise with the running buffers, which are left as they are.
    pub training: bool,
    /// The weight of the new batch statistic in the running update:
    /// `running = (1 - momentum) * running + momentum * stat`.
    pub momentum: f64,
    /// Added to the variance before the square root.
    pub eps: f64,
}

impl Default for BatchNormOptions {
    fn default() -> Self {
        BatchNormOptions { training: false, momentum: 0.1, eps: 1e-5 }
    }
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Batch norm of `self` (`[N, C, ...]`, channels on dim 1), as PyTorch's `F.batch_norm`:
    /// `y = (x - mean) / sqrt(var + eps) * weight + bias` per channel, `weight` and `bias` of
    /// shape `[C]` when given, in the input's accumulation precision `E::Acc`: f32 for an f16,
    /// bf16 or f32 input (an f32 parameter as it is, as PyTorch's mixed-precision batch norm
    /// takes it; cast bf16 parameters with `cast::<f32>()`), f64 for f64.
    ///
    /// - Training (`opts.training`): the batch's mean and biased variance normalise. With
    ///   `running_mean` and `running_var` (f32 `[C]`, both or neither), each is updated in
    ///   place to `(1 - momentum) * running + momentum * stat`, with the batch mean and the
    ///   unbiased variance (`M / (M - 1)` times the biased one), computed in f64 and rounded
    ///   once into f32. Needs more than one value per channel. Backward goes through the
    ///   batch statistics.
    /// - Eval: the running buffers (required) normalise and are not changed; backward is that
    ///   of a fixed affine map.
    ///
    /// A running buffer shared with another tensor is copied before the update (the other
    /// tensor keeps the old values).
    pub fn try_batch_norm(
        &self,
        running_mean: Option<&mut Tensor<f32, D>>,
        running_var: Option<&mut Tensor<f32, D>>,
        weight: Option<&Tensor<E::Acc, D>>,
        bias: Option<&Tensor<E::Acc, D>>,
        opts: BatchNormOptions,
    ) -> Result<Self> {
        const OP: &str = "batch_norm";
        let mut shapes = vec![self.shape().to_vec()];
        shapes.extend(running_mean.iter().map(|t| t.shape().to_vec()));
        shapes.extend(running_var.iter().map(|t| t.shape().to_vec()));
        shapes.extend(weight.iter().chain(&bias).map(|t| t.shape().to_vec()));
        let err = |detail: String, shapes: Vec<Vec<usize>>| Err(Error::Shape { op: OP, detail, shapes });
        if self.rank() < 2 {
            return err("needs an input [N, C, ...] with at least two dims".into(), shapes);
        }
        let c = self.shape()[1];
        for (name, p) in [("weight", weight), ("bias", bias)] {
            if p.is_some_and(|p| p.shape() != [c]) {
                return err(format!("{name} must have shape [{c}] (the input's channels, dim 1)"), shapes);
            }
        }
        for (name, p) in [("running_mean", &running_mean), ("running_var", &running_var)] {
            if p.as_ref().is_some_and(|p| p.shape() != [c]) {
                return err(format!("{name} must have shape [{c}] (the input's channels, dim 1)"), shapes);
            }
        }
        if running_mean.is_some() != running_var.is_some() {
            return err("needs both running_mean and running_var, or neither".into(), shapes);
        }
        let BatchNormOptions { training, momentum, eps } = opts;
        let per_channel = self.numel() / c.max(1);
        if training && per_channel <= 1 {
            return err(format!("needs more than 1 value per channel in training, got {per_channel}"), shapes);
        }
        if !training && running_mean.is_none() {
            return err("needs running_mean and running_var in eval (training = false)".into(), shapes);
        }
        for (name, v, ok) in [("eps", eps, eps >= 0.0 && eps.is_finite()), ("momentum", momentum, momentum.is_finite())]
        {
            if !ok {
                return Err(Error::InvalidArgument {
                    op: OP,
                    name,
                    detail: format!("must be finite (eps also >= 0), got {v} (input shape {:?})", self.shape()),
                });
            }
        }
        let (w, b) = (weight.map(Tensor::raw), bias.map(Tensor::raw));
        let (y, stats) = match (running_mean, running_var) {
            (Some(mean), Some(var)) if !training => {
                let stats = BatchNormStats::Given { mean: mean.raw(), var: var.raw() };
                self.device.batch_norm(self.raw(), w, b, stats, eps)
            }
            (mean, var) => {
                let running = mean.zip(var).map(|(mean, var)| {
                    mean.make_exclusive();
                    var.make_exclusive();
                    (&mut mean.storage, &mut var.storage)
                });
                self.device.batch_norm(self.raw(), w, b, BatchNormStats::Batch { running, momentum }, eps)
            }
        };
        let out = self.output(y, self.shape());
        let needs =
            (self.requires_grad(), weight.is_some_and(Tensor::requires_grad), bias.is_some_and(Tensor::requires_grad));
        if needs == (false, false, false) {
            return Ok(out);
        }
        let xs = self.detach();
        let ws = weight.map(Tensor::detach);
        let parents = vec![self.node.clone(), weight.and_then(|w| w.node.clone()), bias.and_then(|b| b.node.clone())];
        Ok(out.record(OP, parents, move |g| {
            let w = ws.as_ref().map(Tensor::raw);
            let (gx, gw, gb) =
                xs.device.batch_norm_backward(xs.raw(), g.raw(), w, &stats, (needs.1, needs.2), training);
            vec![
                needs.0.then(|| xs.output(gx, xs.shape()).into()),
                gw.map(|v| xs.output(v, &[c]).into()),
                gb.map(|v| xs.output(v, &[c]).into()),
            ]
        }))
    }
    /// Batch norm; panics with [`Tensor::try_batch_norm`]'s error.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::{BatchNormOptions, Tensor};
    /// let x = Tensor::<f64>::from_vec(vec![1.0, 2.0, 5.0, 10.0], &[2, 2]); // 2 samples, 2 channels
    /// let (mut mean, mut var) = (Tensor::<f32>::zeros(&[2]), Tensor::<f32>::ones(&[2]));
    /// let opts = BatchNormOptions { training: true, momentum: 0.5, eps: 0.0 };
    /// let y = x.batch_norm(Some(&mut mean), Some(&mut var), None, None, opts);
    /// assert_eq!(y.to_vec(), vec![-1.0, -1.0, 1.0, 1.0]);
    /// assert_eq!(mean.to_vec(), vec![1.5, 3.0]); // 0.5 * 0 + 0.5 * batch mean
    /// assert_eq!(var.to_vec(), vec![4.5, 16.5]); // 0.5 * 1 + 0.5 * unbiased variance
    /// ```
    #[track_caller]
    pub fn batch_norm(
        &self,
        running_mean: Option<&mut Tensor<f32, D>>,
        running_var: Option<&mut Tensor<f32, D>>,
        weight: Option<&Tensor<E::Acc, D>>,
        bias: Option<&Tensor<E::Acc, D>>,
        opts: BatchNormOptions,
    ) -> Self {
        or_panic(self.try_batch_norm(running_mean, running_var, weight, bias, opts))
    }
}
