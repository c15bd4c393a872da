use crate::error::{Result, or_panic};
use crate::{Device, Param, Params, Precision, Tensor};

/// No parameters, of any element type on any device (pooling and flattening modules).
macro_rules! no_params {
    ($t:ty) => {
        impl<E: Precision, D: Device> Params<E, D> for $t {
            fn named_params(&self) -> Vec<(String, &Param<E, D>)> {
                Vec::new()
            }
            fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)> {
                Vec::new()
            }
        }
    };
}

/// Max pooling over `kernel` windows, PyTorch's `nn.MaxPool2d` (stride defaults to the kernel;
/// padding counts as -inf). Runs in the input's precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool2d {
    /// Window height and width.
    pub kernel: (usize, usize),
    /// Steps between windows.
    pub stride: (usize, usize),
    /// Padding on each side.
    pub padding: (usize, usize),
}

impl MaxPool2d {
    /// Square `kernel` windows with stride `kernel` and no padding (PyTorch's defaults).
    pub fn new(kernel: usize) -> Self {
        MaxPool2d { kernel: (kernel, kernel), stride: (kernel, kernel), padding: (0, 0) }
    }
    /// `x: [N, C, H, W]` pooled.
    /// Errs on an input that is not `[N, C, H, W]` or `[C, H, W]`, or smaller than the window.
    pub fn try_forward<E: Precision, D: Device>(&self, x: &Tensor<E, D>) -> Result<Tensor<E, D>> {
        x.try_max_pool2d(self.kernel, self.stride, self.padding)
    }
    /// [`MaxPool2d::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<E: Precision, D: Device>(&self, x: &Tensor<E, D>) -> Tensor<E, D> {
        or_panic(self.try_forward(x))
    }
}
no_params!(MaxPool2d);

/// Average pooling over `kernel` windows, PyTorch's `nn.AvgPool2d` (stride defaults to the
/// kernel; zero padding counted in the average). Runs in the input's precision, accumulating
/// in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AvgPool2d {
    /// Window height and width.
    pub kernel: (usize, usize),
    /// Steps between windows.
    pub stride: (usize, usize),
    /// Padding on each side.
    pub padding: (usize, usize),
}

impl AvgPool2d {
    /// Square `kernel` windows with stride `kernel` and no padding (PyTorch's defaults).
    pub fn new(kernel: usize) -> Self {
        AvgPool2d { kernel: (kernel, kernel), stride: (kernel, kernel), padding: (0, 0) }
    }
    /// `x: [N, C, H, W]` pooled.
    /// Errs on an input that is not `[N, C, H, W]` or `[C, H, W]`, or smaller than the window.
    pub fn try_forward<E: Precision, D: Device>(&self, x: &Tensor<E, D>) -> Result<Tensor<E, D>> {
        x.try_avg_pool2d(self.kernel, self.stride, self.padding)
    }
    /// [`AvgPool2d::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<E: Precision, D: Device>(&self, x: &Tensor<E, D>) -> Tensor<E, D> {
        or_panic(self.try_forward(x))
    }
}
no_params!(AvgPool2d);

/// Average pooling to a fixed output size, PyTorch's `nn.AdaptiveAvgPool2d` (`(1, 1)` is
/// global average pooling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveAvgPool2d {
    /// Output height and width.
    pub output_size: (usize, usize),
}

impl AdaptiveAvgPool2d {
    /// Pools to `output_size`.
    pub fn new(output_size: (usize, usize)) -> Self {
        AdaptiveAvgPool2d { output_size }
    }
    /// `x: [N, C, H, W]` to `[N, C, oH, oW]`.
    /// Errs on an input that is not `[N, C, H, W]` or `[C, H, W]`, or an output size of 0.
    pub fn try_forward<E: Precision, D: Device>(&self, x: &Tensor<E, D>) -> Result<Tensor<E, D>> {
        x.try_adaptive_avg_pool2d(self.output_size)
    }
    /// [`AdaptiveAvgPool2d::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<E: Precision, D: Device>(&self, x: &Tensor<E, D>) -> Tensor<E, D> {
        or_panic(self.try_forward(x))
    }
}
no_params!(AdaptiveAvgPool2d);
