use amp_macros::Params;

use crate::error::{Result, or_panic};
use crate::{Cpu, Device, Param, Precision, Tensor};

/// Layer normalisation over the last dim with learnable `weight` (ones) and `bias` (zeros) of
/// precision `W` (f32 by default). Always computed in f32 (fp32 category of the policy table),
/// whatever the input and weight precisions.
#[derive(Params, Debug, Clone)]
pub struct LayerNorm<W: Precision = f32, D: Device = Cpu> {
    /// Scale, `[dim]`.
    pub weight: Param<W, D>,
    /// Shift, `[dim]`.
    pub bias: Param<W, D>,
    /// Added to the variance (PyTorch default 1e-5).
    #[param(skip)]
    pub eps: f64,
}

impl LayerNorm {
    /// A LayerNorm over `dim` features with PyTorch's init and eps 1e-5.
    pub fn new(dim: usize) -> Self {
        LayerNorm { weight: Param::new(Tensor::ones(&[dim])), bias: Param::new(Tensor::zeros(&[dim])), eps: 1e-5 }
    }
}

impl<W: Precision, D: Device> LayerNorm<W, D> {
    /// Normalises `x: [..., dim]`, returning f32 (bf16 weights are widened to f32 first). Errs
    /// when `x`'s last dim is not `dim`.
    pub fn try_forward<X: Precision>(&self, x: &Tensor<X, D>) -> Result<Tensor<f32, D>> {
        self.try_forward_to::<f32, X>(x)
    }
    /// [`LayerNorm::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<X: Precision>(&self, x: &Tensor<X, D>) -> Tensor<f32, D> {
        or_panic(self.try_forward(x))
    }
    /// [`LayerNorm::try_forward`] with the output rounded into `O`: the norm in f32 and the
    /// cast that a low-precision layer reading it would make, in one pass where the device
    /// fuses them ([`Tensor::layer_norm_to`]); the same values as `forward(x).cast::<O>()`.
    pub fn try_forward_to<O: Precision, X: Precision>(&self, x: &Tensor<X, D>) -> Result<Tensor<O, D>> {
        let (w, b) = (self.weight.cast::<f32>(), self.bias.cast::<f32>());
        x.cast::<f32>().try_layer_norm_to::<O>(Some(&w), Some(&b), self.eps)
    }
    /// [`LayerNorm::try_forward_to`], panicking with its error's message.
    #[track_caller]
    pub fn forward_to<O: Precision, X: Precision>(&self, x: &Tensor<X, D>) -> Tensor<O, D> {
        or_panic(self.try_forward_to(x))
    }
    /// A copy with its weights rounded to precision `P` (new parameters: their own ids).
    pub fn to_precision<P: Precision>(&self) -> LayerNorm<P, D> {
        LayerNorm { weight: self.weight.to_precision(), bias: self.bias.to_precision(), eps: self.eps }
    }
}
