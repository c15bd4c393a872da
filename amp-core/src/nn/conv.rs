use amp_macros::Params;

use crate::ops::conv::Conv2dOptions;
use crate::{Cpu, Device, Param, Precision, Rng, Tensor};

/// 2-D convolution, PyTorch's `nn.Conv2d`: `weight` `[out, in / groups, kH, kW]` and an
/// optional `bias` `[out]` (PyTorch's names), f32 master weights by default. Runs in the compute
/// precision `L` (conv is in autocast's lower-precision category) with f32 accumulation.
#[derive(Params, Debug, Clone)]
pub struct Conv2d<W: Precision = f32, D: Device = Cpu> {
    /// `[out_channels, in_channels / groups, kH, kW]`.
    pub weight: Param<W, D>,
    /// `[out_channels]`, if the layer has a bias.
    pub bias: Option<Param<W, D>>,
    /// Stride, padding, dilation and groups.
    #[param(skip)]
    pub options: Conv2dOptions,
}

impl Conv2d {
    /// PyTorch's default init (`kaiming_uniform_(a=√5)`, i.e. uniform in `±1/√fan_in`, and the
    /// bias the same), for a square `kernel`.
    #[track_caller]
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        options: Conv2dOptions,
        bias: bool,
        rng: &mut Rng,
    ) -> Self {
        assert!(kernel > 0, "Conv2d: the kernel size must be at least 1, got 0");
        assert!(
            options.groups > 0
                && in_channels.is_multiple_of(options.groups)
                && out_channels.is_multiple_of(options.groups),
            "Conv2d: in_channels {in_channels} and out_channels {out_channels} must be multiples of groups {}",
            options.groups
        );
        let fan_in = in_channels / options.groups * kernel * kernel;
        let bound = 1.0 / (fan_in as f64).sqrt();
        let uniform =
            |shape: &[usize], rng: &mut Rng| Tensor::<f32>::rand(shape, rng).mul_scalar(2.0 * bound).add_scalar(-bound);
        Conv2d {
            weight: Param::new(uniform(&[out_channels, in_channels / options.groups, kernel, kernel], rng)),
            bias: bias.then(|| Param::new(uniform(&[out_channels], rng))),
            options,
        }
    }
}

impl<W: Precision, D: Device> Conv2d<W, D> {
    /// `x: [N, in, H, W]` to `[N, out, oH, oW]` in precision `L`.
    #[track_caller]
    pub fn forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>) -> Tensor<L, D> {
        let bias = self.bias.as_ref().map(|b| b.cast::<L>());
        x.cast::<L>().conv2d(&self.weight.cast::<L>(), bias.as_ref(), self.options)
    }
    /// A copy with its weights rounded to precision `P` (new parameters: their own ids).
    pub fn to_precision<P: Precision>(&self) -> Conv2d<P, D> {
        Conv2d {
            weight: self.weight.to_precision(),
            bias: self.bias.as_ref().map(Param::to_precision),
            options: self.options,
        }
    }
}
