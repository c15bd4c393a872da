use amp_macros::Params;

use crate::{Param, Precision, Tensor};

/// Layer normalisation over the last dim with learnable `weight` (ones) and `bias` (zeros).
/// Always computed in f32 (fp32 category of the policy table), whatever the input precision.
#[derive(Params, Debug, Clone)]
pub struct LayerNorm {
    /// Scale, `[dim]`.
    pub weight: Param,
    /// Shift, `[dim]`.
    pub bias: Param,
    /// Added to the variance (PyTorch default 1e-5).
    #[param(skip)]
    pub eps: f64,
}

impl LayerNorm {
    /// A LayerNorm over `dim` features with PyTorch's init and eps 1e-5.
    pub fn new(dim: usize) -> Self {
        LayerNorm { weight: Param::new(Tensor::ones(&[dim])), bias: Param::new(Tensor::zeros(&[dim])), eps: 1e-5 }
    }
    /// Normalises `x: [..., dim]`, returning f32.
    pub fn forward<X: Precision>(&self, x: &Tensor<X>) -> Tensor<f32> {
        x.cast::<f32>().layer_norm(Some(&self.weight), Some(&self.bias), self.eps)
    }
}
