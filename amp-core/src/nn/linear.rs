use amp_macros::Params;

use crate::{Param, Precision, Rng, Tensor};

/// `y = x Wᵀ + b` with `W: [out, in]` (PyTorch's layout and names: `weight`, `bias`).
/// Runs in the compute precision `L` (lower-precision category of the policy table).
#[derive(Params, Debug, Clone)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Param,
    /// `[out_features]`, if the layer has a bias.
    pub bias: Option<Param>,
}

impl Linear {
    /// PyTorch's default init: weight and bias uniform in `±1/√in`.
    pub fn new(in_features: usize, out_features: usize, bias: bool, rng: &mut Rng) -> Self {
        let bound = 1.0 / (in_features as f64).sqrt();
        let uniform =
            |shape: &[usize], rng: &mut Rng| Tensor::<f32>::rand(shape, rng).mul_scalar(2.0 * bound).add_scalar(-bound);
        Linear {
            weight: Param::new(uniform(&[out_features, in_features], rng)),
            bias: bias.then(|| Param::new(uniform(&[out_features], rng))),
        }
    }
    /// GPT-2's init: weight normal with standard deviation `std`, bias zero.
    pub fn normal(in_features: usize, out_features: usize, bias: bool, std: f64, rng: &mut Rng) -> Self {
        Linear {
            weight: Param::new(Tensor::<f32>::randn(&[out_features, in_features], rng).mul_scalar(std)),
            bias: bias.then(|| Param::new(Tensor::zeros(&[out_features]))),
        }
    }
    /// Applies the layer to `x: [..., in]`, giving `[..., out]` in precision `L`.
    #[track_caller]
    pub fn forward<L: Precision, X: Precision>(&self, x: &Tensor<X>) -> Tensor<L> {
        let in_features = self.weight.shape()[1];
        let shape = x.shape();
        assert!(
            shape.last() == Some(&in_features),
            "Linear: input shape {shape:?} does not end in in_features = {in_features}"
        );
        // Flatten leading dims: one large GEMM instead of a batch of small ones.
        let rows = x.numel() / in_features.max(1);
        let x2 = x.cast::<L>().reshape(&[rows, in_features]);
        let mut y = x2.matmul(&self.weight.cast::<L>().t());
        if let Some(b) = &self.bias {
            y = y.add(&b.cast::<L>());
        }
        let mut out_shape = shape.to_vec();
        *out_shape.last_mut().unwrap() = self.weight.shape()[0];
        y.reshape(&out_shape)
    }
}
