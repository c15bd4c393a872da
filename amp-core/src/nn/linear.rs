use amp_macros::Params;

use super::uniform_init;
use crate::error::{Result, or_panic};
use crate::{Cpu, Device, Param, Precision, Rng, Tensor};

/// `y = x Wᵀ + b` with `W: [out, in]` (PyTorch's layout and names: `weight`, `bias`).
/// Runs in the compute precision `L` (lower-precision category of the policy table). The
/// weights are `W`: f32 master weights by default, bf16 for pure-bf16 training
/// ([`Linear::to_precision`]).
#[derive(Params, Debug, Clone)]
pub struct Linear<W: Precision = f32, D: Device = Cpu> {
    /// `[out_features, in_features]`.
    pub weight: Param<W, D>,
    /// `[out_features]`, if the layer has a bias.
    pub bias: Option<Param<W, D>>,
}

impl Linear {
    /// PyTorch's default init: weight and bias uniform in `±1/√in` (0 when `in_features` is 0,
    /// as PyTorch's, so the bias is zero rather than NaN).
    pub fn new(in_features: usize, out_features: usize, bias: bool, rng: &mut Rng) -> Self {
        Linear {
            weight: Param::new(uniform_init(&[out_features, in_features], in_features, rng)),
            bias: bias.then(|| Param::new(uniform_init(&[out_features], in_features, rng))),
        }
    }
    /// GPT-2's init: weight normal with standard deviation `std`, bias zero.
    pub fn normal(in_features: usize, out_features: usize, bias: bool, std: f64, rng: &mut Rng) -> Self {
        Linear {
            weight: Param::new(Tensor::<f32>::randn(&[out_features, in_features], rng).mul_scalar(std)),
            bias: bias.then(|| Param::new(Tensor::zeros(&[out_features]))),
        }
    }
}

impl<W: Precision, D: Device> Linear<W, D> {
    /// A copy with its weights rounded to precision `P` (new parameters: their own ids).
    pub fn to_precision<P: Precision>(&self) -> Linear<P, D> {
        Linear { weight: self.weight.to_precision(), bias: self.bias.as_ref().map(Param::to_precision) }
    }
    /// Applies the layer to `x: [..., in]`, giving `[..., out]` in precision `L` (one GEMM with
    /// the bias in the accumulator: the `linear` op, lower-precision category). Errs when `x`'s
    /// last dim is not `in_features`, naming both shapes.
    pub fn try_forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>) -> Result<Tensor<L, D>> {
        let bias = self.bias.as_ref().map(|b| b.cast::<L>());
        x.cast::<L>().try_linear(&self.weight.cast::<L>(), bias.as_ref())
    }
    /// [`Linear::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>) -> Tensor<L, D> {
        or_panic(self.try_forward(x))
    }
}
