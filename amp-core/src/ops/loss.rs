//! Losses: cross-entropy on logits with class-index targets (PyTorch's `F.cross_entropy`,
//! mean reduction, `ignore_index`, label smoothing) and the mean squared error.
//! Both run on fused kernels (the device's `cross_entropy` and `mse`) and return a 0-dim tensor in `E`.

use crate::backend::{BinaryOp, CrossEntropySpec, Device};
use crate::error::{Error, Result, or_panic};
use crate::indices::Indices;
use crate::precision::{Accum, Precision};
use crate::tensor::Tensor;

/// `(a - b) * k`: the mean squared error's input gradient in one pass (`k = 2 g / n`), as the
/// CPU's `mse_backward` runs it (a device reads `g` in its own kernel instead).
#[derive(Clone, Copy, Debug)]
pub struct ScaledDiff(pub f64);
impl BinaryOp for ScaledDiff {
    const NAME: &'static str = "scaled_diff";
    const CUDA: &'static str = "(a - b) * acc_t(p)";
    fn param(&self) -> f64 {
        self.0
    }
    #[inline(always)]
    fn apply<A: Accum>(&self, a: A, b: A) -> A {
        (a - b) * A::c(self.0)
    }
}

/// Options of [`Tensor::cross_entropy_with`], with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOptions {
    /// Rows whose target equals this are left out of the loss and of the mean's count
    /// (PyTorch's default: `Some(-100)`). `None` ignores nothing.
    pub ignore_index: Option<i64>,
    /// Label smoothing in `[0, 1]`: the target distribution is
    /// `(1 - s) * one_hot(t) + s / C` (default 0).
    pub label_smoothing: f64,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions { ignore_index: Some(-100), label_smoothing: 0.0 }
    }
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Cross-entropy of logits `[N, C]` (or `[C]` with a 0-dim target) against class indices
    /// `[N]`, mean over the rows not ignored, with PyTorch's defaults (`ignore_index = -100`,
    /// no smoothing). See [`Tensor::try_cross_entropy_with`].
    #[track_caller]
    pub fn try_cross_entropy(&self, targets: &Indices) -> Result<Self> {
        self.try_cross_entropy_with(targets, CrossEntropyOptions::default())
    }
    /// Cross-entropy with PyTorch's defaults; panics on bad shapes or out-of-range targets.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::{Indices, Tensor};
    /// let logits = Tensor::<f64>::from_vec(vec![0.0, 0.0, 5.0, 5.0], &[2, 2]);
    /// let loss = logits.cross_entropy(&Indices::from_vec(vec![0, 1], &[2]));
    /// assert!((loss.item() - 2f64.ln()).abs() < 1e-12);
    /// ```
    #[track_caller]
    pub fn cross_entropy(&self, targets: &Indices) -> Self {
        or_panic(self.try_cross_entropy(targets))
    }

    /// Cross-entropy of logits `[N, C]` against class indices `[N]`:
    /// `loss = sum_i l_i / n` over the `n` rows whose target is not `ignore_index`, with
    /// `l_i = -(1 - s) logp[i, t_i] - (s / C) sum_c logp[i, c]` and `logp = log_softmax(x, 1)`
    /// (PyTorch's formula, so `n = 0` gives NaN, as in PyTorch). Log-softmax is fused inside
    /// and accumulates in f32 for f16/bf16. Derivative:
    /// `dx[i, c] = (softmax(x_i)_c - (1 - s) [c == t_i] - s / C) / n` for counted rows, 0 for
    /// ignored ones. A target outside `0..C` (other than `ignore_index`) is
    /// [`Error::IndexOutOfRange`].
    #[track_caller]
    pub fn try_cross_entropy_with(&self, targets: &Indices, options: CrossEntropyOptions) -> Result<Self> {
        crate::__private::check_reach("cross_entropy", E::DTYPE);
        const OP: &str = "cross_entropy";
        let shapes = || vec![self.shape().to_vec(), targets.shape().to_vec()];
        if self.rank() == 1 && targets.shape().is_empty() {
            let one = targets.reshape(&[1]);
            return self.unsqueeze(0).try_cross_entropy_with(&one, options);
        }
        if self.rank() != 2 || targets.shape() != [self.shape()[0]] {
            return Err(Error::Shape {
                op: OP,
                detail: "expected logits [N, C] with targets [N] (or logits [C] with a 0-dim target)".into(),
                shapes: shapes(),
            });
        }
        let s = options.label_smoothing;
        if !(0.0..=1.0).contains(&s) {
            return Err(Error::InvalidArgument {
                op: OP,
                name: "label_smoothing",
                detail: format!("must be in [0, 1], got {s} (logits shape {:?})", self.shape()),
            });
        }
        let c = self.shape()[1];
        targets.check_bound(OP, c, options.ignore_index)?;
        let spec = CrossEntropySpec { targets: targets.as_slice(), ignore: options.ignore_index, smoothing: s };
        let (loss, stats, counted) = self.device.cross_entropy(self.raw(), c, spec);
        let out = self.output(loss, &[]);
        if !self.requires_grad() {
            return Ok(out);
        }
        let (xs, targets) = (self.detach(), targets.clone());
        Ok(out.record(OP, vec![self.node.clone()], move |g| {
            let spec = CrossEntropySpec { targets: targets.as_slice(), ignore: options.ignore_index, smoothing: s };
            let gx = xs.device.cross_entropy_backward(xs.raw(), c, spec, &stats, g.raw(), counted);
            vec![Some(xs.output(gx, xs.shape()).into())]
        }))
    }
    /// Cross-entropy with explicit options; panics on bad shapes, out-of-range targets or a
    /// smoothing outside `[0, 1]`.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::{Indices, Tensor, ops::loss::CrossEntropyOptions};
    /// let logits = Tensor::<f64>::zeros(&[2, 4]);
    /// let t = Indices::from_vec(vec![1, -100], &[2]); // the second row is ignored
    /// let opts = CrossEntropyOptions { label_smoothing: 0.1, ..Default::default() };
    /// assert!((logits.cross_entropy_with(&t, opts).item() - 4f64.ln()).abs() < 1e-12);
    /// ```
    #[track_caller]
    pub fn cross_entropy_with(&self, targets: &Indices, options: CrossEntropyOptions) -> Self {
        or_panic(self.try_cross_entropy_with(targets, options))
    }

    /// Mean squared error `mean((self - target)²)` over every element, as a 0-dim tensor
    /// (NaN for empty tensors, as in PyTorch); the shapes must be equal.
    /// Derivatives: `2 (self - target) / n` and its negation for `target`.
    #[track_caller]
    pub fn try_mse_loss(&self, target: &Self) -> Result<Self> {
        crate::__private::check_reach("mse_loss", E::DTYPE);
        if self.shape() != target.shape() {
            return Err(Error::Shape {
                op: "mse_loss",
                detail: "input and target must have the same shape".into(),
                shapes: vec![self.shape().to_vec(), target.shape().to_vec()],
            });
        }
        let out = self.output(self.device.mse(self.raw(), target.raw()), &[]);
        if !self.requires_grad() && !target.requires_grad() {
            return Ok(out);
        }
        let (xs, ts) = (self.detach(), target.detach());
        let needs = (self.requires_grad(), target.requires_grad());
        Ok(out.record("mse_loss", vec![self.node.clone(), target.node.clone()], move |g| {
            let shape = xs.shape();
            let gx = xs.output(xs.device.mse_backward(xs.raw(), ts.raw(), g.raw()), shape);
            let gt = needs.1.then(|| gx.neg().into());
            vec![needs.0.then(|| gx.into()), gt]
        }))
    }
    /// Mean squared error; panics if the shapes differ.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2]);
    /// let t = Tensor::<f32>::from_vec(vec![0.0, 4.0], &[2]);
    /// assert_eq!(x.mse_loss(&t).item(), 2.5);
    /// ```
    #[track_caller]
    pub fn mse_loss(&self, target: &Self) -> Self {
        or_panic(self.try_mse_loss(target))
    }
}
