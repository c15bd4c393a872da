use amp_macros::Params;

use super::uniform_init;
use crate::error::{Error, Result, or_panic};
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
    /// bias the same), for a square `kernel`. Errs on a kernel of 0, groups of 0, or channels
    /// that are not multiples of `groups`.
    pub fn try_new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        options: Conv2dOptions,
        bias: bool,
        rng: &mut Rng,
    ) -> Result<Self> {
        let bad = |name: &'static str, detail: String| Err(Error::InvalidArgument { op: "Conv2d::new", name, detail });
        if kernel == 0 {
            return bad("kernel", "the kernel size must be at least 1, got 0".into());
        }
        let groups = options.groups;
        if groups == 0 || !in_channels.is_multiple_of(groups) || !out_channels.is_multiple_of(groups) {
            return bad(
                "groups",
                format!(
                    "in_channels {in_channels} and out_channels {out_channels} must be multiples of groups {groups}"
                ),
            );
        }
        let fan_in = in_channels / groups * kernel * kernel;
        Ok(Conv2d {
            weight: Param::new(uniform_init(&[out_channels, in_channels / groups, kernel, kernel], fan_in, rng)),
            bias: bias.then(|| Param::new(uniform_init(&[out_channels], fan_in, rng))),
            options,
        })
    }
    /// [`Conv2d::try_new`], panicking with its error's message.
    #[track_caller]
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        options: Conv2dOptions,
        bias: bool,
        rng: &mut Rng,
    ) -> Self {
        or_panic(Self::try_new(in_channels, out_channels, kernel, options, bias, rng))
    }
}

impl<W: Precision, D: Device> Conv2d<W, D> {
    /// `x: [N, in, H, W]` to `[N, out, oH, oW]` in precision `L`. Errs on another rank, a
    /// channel count other than `in_channels`, or an input smaller than the (dilated) kernel.
    pub fn try_forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>) -> Result<Tensor<L, D>> {
        let bias = self.bias.as_ref().map(|b| b.cast::<L>());
        x.cast::<L>().try_conv2d(&self.weight.cast::<L>(), bias.as_ref(), self.options)
    }
    /// [`Conv2d::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>) -> Tensor<L, D> {
        or_panic(self.try_forward(x))
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
