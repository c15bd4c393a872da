use amp_macros::Params;

use crate::error::{Error, Result, or_panic};
use crate::ops::batch_norm::BatchNormOptions;
use crate::{Cpu, Device, Param, Precision, Tensor};

/// Batch norm over the channels of `[N, C, H, W]`, PyTorch's `nn.BatchNorm2d`: learnable
/// `weight` (ones) and `bias` (zeros), and the buffers `running_mean` (zeros), `running_var`
/// (ones) and `num_batches_tracked`, saved under PyTorch's names, moved with the module and
/// never trained. f32 master weights by default (`to_precision::<bf16>()` for a pure-bf16
/// model); statistics and buffers are f32 whatever the input precision, and the weight and bias
/// reach the kernel in the input's accumulation precision (an f16/bf16 input takes f32
/// parameters as they are, as PyTorch's mixed batch norm does); the output has the input's
/// precision.
///
/// In training mode (`train()`, the default) each forward normalises with the batch's
/// statistics and moves the running ones by `momentum`; in evaluation mode (`eval()`) it
/// normalises with the running statistics and changes nothing, so evaluation is repeatable.
#[derive(Params, Debug, Clone)]
pub struct BatchNorm2d<W: Precision = f32, D: Device = Cpu> {
    /// Scale, `[C]`.
    pub weight: Param<W, D>,
    /// Shift, `[C]`.
    pub bias: Param<W, D>,
    /// Running mean of each channel, `[C]`.
    #[param(buffer)]
    pub running_mean: Tensor<f32, D>,
    /// Running unbiased variance of each channel, `[C]`.
    #[param(buffer)]
    pub running_var: Tensor<f32, D>,
    /// Training forwards so far (0-dim; PyTorch stores it as int64).
    #[param(buffer)]
    pub num_batches_tracked: Tensor<f32, D>,
    /// Weight of a new batch in the running statistics (PyTorch's default 0.1).
    #[param(skip)]
    pub momentum: f64,
    /// Added to the variance (PyTorch's default 1e-5).
    #[param(skip)]
    pub eps: f64,
    /// Training or evaluation mode, set by `train()` / `eval()`.
    pub mode: TrainingMode,
}

/// Whether a module is in training mode: a field that `train()` / `eval()` reach (through
/// [`crate::Params::set_training`]) in a module that behaves differently in the two modes. It holds
/// no parameters, of any element type on any device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrainingMode {
    training: bool,
}

impl TrainingMode {
    /// Training mode (what a new module starts in, as in PyTorch).
    pub fn training() -> Self {
        TrainingMode { training: true }
    }
    /// Whether it is training mode.
    pub fn is_training(&self) -> bool {
        self.training
    }
}

impl<E: Precision, D: Device> crate::Params<E, D> for TrainingMode {
    fn named_params(&self) -> Vec<(String, &Param<E, D>)> {
        Vec::new()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)> {
        Vec::new()
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}

impl BatchNorm2d {
    /// Batch norm over `channels`, with PyTorch's defaults, in training mode.
    pub fn new(channels: usize) -> Self {
        BatchNorm2d {
            weight: Param::new(Tensor::ones(&[channels])),
            bias: Param::new(Tensor::zeros(&[channels])),
            running_mean: Tensor::zeros(&[channels]),
            running_var: Tensor::ones(&[channels]),
            num_batches_tracked: Tensor::scalar(0.0),
            momentum: 0.1,
            eps: 1e-5,
            mode: TrainingMode::training(),
        }
    }
}

impl<W: Precision, D: Device> BatchNorm2d<W, D> {
    /// Whether forwards use (and update) batch statistics.
    pub fn is_training(&self) -> bool {
        self.mode.is_training()
    }
    /// Normalises `x: [N, C, H, W]` (any precision; the output has it): with the batch's
    /// statistics in training mode (updating the running ones), with the running ones in
    /// evaluation mode. Takes `&mut self` because training mode updates the buffers, as
    /// PyTorch's forward does. Errs, with the buffers untouched, on another rank, a channel
    /// count other than the module's, or one value per channel in training.
    pub fn try_forward<X: Precision>(&mut self, x: &Tensor<X, D>) -> Result<Tensor<X, D>> {
        // The op takes [N, C, ...] of any rank (F.batch_norm); the 2-D module, as PyTorch's,
        // takes images only, so a flattened or 5-D input is a mistake caught here.
        if x.rank() != 4 {
            return Err(Error::Shape {
                op: "BatchNorm2d::forward",
                detail: "expected a 4-D input [N, C, H, W]".into(),
                shapes: vec![x.shape().to_vec()],
            });
        }
        let opts = BatchNormOptions { training: self.mode.is_training(), momentum: self.momentum, eps: self.eps };
        // In the input's accumulation precision: f32 parameters as they are for an f16, bf16 or
        // f32 input (bf16 ones widened exactly), f64 for an f64 input.
        let (w, b) = (self.weight.cast::<X::Acc>(), self.bias.cast::<X::Acc>());
        let y =
            x.try_batch_norm(Some(&mut self.running_mean), Some(&mut self.running_var), Some(&w), Some(&b), opts)?;
        if self.mode.is_training() {
            self.num_batches_tracked = self.num_batches_tracked.add_scalar(1.0);
        }
        Ok(y)
    }
    /// [`BatchNorm2d::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<X: Precision>(&mut self, x: &Tensor<X, D>) -> Tensor<X, D> {
        or_panic(self.try_forward(x))
    }
    /// A copy with its weight and bias rounded to precision `P` (new parameters: their own
    /// ids); the running statistics stay f32, as they are.
    pub fn to_precision<P: Precision>(&self) -> BatchNorm2d<P, D> {
        BatchNorm2d {
            weight: self.weight.to_precision(),
            bias: self.bias.to_precision(),
            running_mean: self.running_mean.clone(),
            running_var: self.running_var.clone(),
            num_batches_tracked: self.num_batches_tracked.clone(),
            momentum: self.momentum,
            eps: self.eps,
            mode: self.mode,
        }
    }
}
