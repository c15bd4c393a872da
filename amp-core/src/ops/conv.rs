//! 2-D convolution (PyTorch's `F.conv2d`): zero padding, per-dim stride, padding and
//! dilation, channel groups and an optional bias, on the device's `conv2d` kernels (GEMM
//! inside: f32 accumulation for f16 and bf16, the bias added before the one rounding).
//!
//! Derivatives, with `cols` the input's column matrix (im2col): `dx = col2im(Wᵀ · dY)`,
//! `dW = Σ_n dY · colsᵀ`, `db = Σ_{n, h, w} dY`.

use crate::backend::{Conv2dSpec, Device};
use crate::error::{Error, Result, or_panic};
use crate::precision::Precision;
use crate::tensor::Tensor;

/// The options of [`Tensor::conv2d`], PyTorch's arguments, each pair (height, width). The
/// default is PyTorch's: stride 1, no padding, no dilation, one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// Steps between windows (at least 1).
    pub stride: (usize, usize),
    /// Zeros added on each side of the input.
    pub padding: (usize, usize),
    /// Steps between the taps of a window (at least 1).
    pub dilation: (usize, usize),
    /// Channel groups: both channel counts must be multiples of it.
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Conv2dOptions { stride: (1, 1), padding: (0, 0), dilation: (1, 1), groups: 1 }
    }
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// 2-D convolution of `self` (`[N, C_in, H, W]`) with `weight`
    /// (`[C_out, C_in / groups, kH, kW]`) and an optional `bias` (`[C_out]`), as PyTorch's
    /// `F.conv2d`: output `[N, C_out, oH, oW]` with
    /// `oH = (H + 2 padding.0 - dilation.0 (kH - 1) - 1) / stride.0 + 1` (likewise `oW`).
    ///
    /// Errors (naming the op and the shapes) on ranks other than 4, channel counts that do
    /// not match the weight or the groups, a bias of another shape, a zero stride, dilation or
    /// group count, or a dilated kernel larger than the padded input.
    #[track_caller]
    pub fn try_conv2d(&self, weight: &Tensor<E, D>, bias: Option<&Tensor<E, D>>, opts: Conv2dOptions) -> Result<Self> {
        crate::__private::check_reach("conv2d", E::DTYPE);
        let shapes = || {
            let mut v = vec![self.shape().to_vec(), weight.shape().to_vec()];
            v.extend(bias.map(|b| b.shape().to_vec()));
            v
        };
        let err = |detail: String| Err(Error::Shape { op: "conv2d", detail, shapes: shapes() });
        if self.rank() != 4 || weight.rank() != 4 {
            return err("needs an input [N, C_in, H, W] and a weight [C_out, C_in / groups, kH, kW]".into());
        }
        let Conv2dOptions { stride, padding, dilation, groups } = opts;
        for (name, v) in [("stride", stride), ("dilation", dilation)] {
            if v.0 == 0 || v.1 == 0 {
                return Err(Error::InvalidArgument {
                    op: "conv2d",
                    name,
                    detail: format!("must be at least 1 in both dims, got {v:?} (input shape {:?})", self.shape()),
                });
            }
        }
        let (n, c_in, h, w) = (self.shape()[0], self.shape()[1], self.shape()[2], self.shape()[3]);
        let (c_out, cg, kh, kw) = (weight.shape()[0], weight.shape()[1], weight.shape()[2], weight.shape()[3]);
        if groups == 0 || !c_in.is_multiple_of(groups) || !c_out.is_multiple_of(groups) {
            return err(format!("groups {groups} must divide the input's {c_in} and the weight's {c_out} channels"));
        }
        if cg != c_in / groups {
            return err(format!(
                "the weight's dim 1 must be the input channels per group, {c_in} / {groups} = {}",
                c_in / groups
            ));
        }
        if bias.is_some_and(|b| b.shape() != [c_out]) {
            return err(format!("the bias must have shape [{c_out}]"));
        }
        let out = |i, k, s, p, d| Conv2dSpec::output_size(i, k, s, p, d);
        let (Some(oh), Some(ow)) =
            (out(h, kh, stride.0, padding.0, dilation.0), out(w, kw, stride.1, padding.1, dilation.1))
        else {
            return err(format!(
                "the kernel {kh}x{kw} with dilation {dilation:?} is larger than the input {h}x{w} padded by {padding:?}"
            ));
        };
        let spec = Conv2dSpec {
            batch: n,
            in_channels: c_in,
            out_channels: c_out,
            groups,
            input: (h, w),
            kernel: (kh, kw),
            output: (oh, ow),
            stride,
            padding,
            dilation,
        };
        let data = self.device.conv2d(self.raw(), weight.raw(), bias.map(Tensor::raw), &spec);
        let out = self.output(data, &[n, c_out, oh, ow]);
        let needs = [self.requires_grad(), weight.requires_grad(), bias.is_some_and(Tensor::requires_grad)];
        if needs == [false; 3] {
            return Ok(out);
        }
        // Keep only what backward reads: the weight for dx, the input for dW.
        let w_saved = needs[0].then(|| weight.detach());
        let x_saved = needs[1].then(|| self.detach());
        let parents = vec![self.node.clone(), weight.node.clone(), bias.and_then(|b| b.node.clone())];
        let dev = self.device.clone();
        let (x_shape, w_shape) = (self.shape().to_vec(), weight.shape().to_vec());
        Ok(out.record("conv2d", parents, move |g| {
            let gx = w_saved.as_ref().map(|w| {
                let gx = dev.conv2d_backward_input(g.raw(), w.raw(), &spec);
                g.output(gx, &x_shape).into()
            });
            let (gw, gb) = if needs[1] || needs[2] {
                dev.conv2d_backward_weight(x_saved.as_ref().map(Tensor::raw), g.raw(), &spec, needs[2])
            } else {
                (None, None)
            };
            vec![gx, gw.map(|v| g.output(v, &w_shape).into()), gb.map(|v| g.output(v, &[c_out]).into())]
        }))
    }
    /// 2-D convolution; panics with [`Tensor::try_conv2d`]'s error on bad shapes or options.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::{Conv2dOptions, Tensor};
    /// let x = Tensor::<f32>::from_vec((0..9).map(|v| v as f32).collect(), &[1, 1, 3, 3]);
    /// let w = Tensor::<f32>::ones(&[1, 1, 2, 2]);
    /// let y = x.conv2d(&w, None, Conv2dOptions::default());
    /// assert_eq!(y.shape(), &[1, 1, 2, 2]);
    /// assert_eq!(y.to_vec(), vec![8.0, 12.0, 20.0, 24.0]);
    /// ```
    #[track_caller]
    pub fn conv2d(&self, weight: &Tensor<E, D>, bias: Option<&Tensor<E, D>>, opts: Conv2dOptions) -> Self {
        or_panic(self.try_conv2d(weight, bias, opts))
    }
}
