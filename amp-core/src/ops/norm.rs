//! Layer norm and RMS norm over the last dim, with optional affine parameters, on fused
//! kernels (the device's `norm` and `norm_backward`): statistics in `E::Acc`, one rounding, gradients for the input,
//! the weight and the bias from one backward pass.

use crate::autograd::AnyTensor;
use crate::backend::Device;
use crate::error::{Error, Result, or_panic};
use crate::precision::Precision;
use crate::tensor::Tensor;

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Checks a norm's arguments; returns the normalised dim's size.
    fn check_norm(
        &self,
        op: &'static str,
        weight: Option<&Tensor<E, D>>,
        bias: Option<&Tensor<E, D>>,
        eps: f64,
    ) -> Result<usize> {
        let mut shapes = vec![self.shape().to_vec()];
        shapes.extend(weight.iter().chain(&bias).map(|t| t.shape().to_vec()));
        if self.rank() == 0 {
            return Err(Error::Shape { op, detail: "the input needs at least one dim".into(), shapes });
        }
        let d = self.shape()[self.rank() - 1];
        for (name, p) in [("weight", weight), ("bias", bias)] {
            if let Some(p) = p
                && p.shape() != [d]
            {
                return Err(Error::Shape {
                    op,
                    detail: format!("{name} must have shape [{d}] (the input's last dim)"),
                    shapes,
                });
            }
        }
        if !(eps >= 0.0 && eps.is_finite()) {
            return Err(Error::InvalidArgument {
                op,
                name: "eps",
                detail: format!("must be finite and >= 0, got {eps} (input shape {:?})", self.shape()),
            });
        }
        Ok(d)
    }

    fn norm_impl<const RMS: bool>(
        &self,
        op: &'static str,
        weight: Option<&Tensor<E, D>>,
        bias: Option<&Tensor<E, D>>,
        eps: f64,
    ) -> Result<Self> {
        let d = self.check_norm(op, weight, bias, eps)?;
        let (y, stats) = self.device.norm(self.raw(), d, weight.map(Tensor::raw), bias.map(Tensor::raw), eps, RMS);
        let out = self.output(y, self.shape());
        Ok(self.record_norm(op, out, weight, bias, false, move |x, g, w, needs, _into| {
            let (gx, gw, gb) = x.device.norm_backward(x.raw(), g.raw(), d, w, &stats, needs, RMS);
            (Some(gx), gw, gb)
        }))
    }

    /// Records a norm's backward on its output `out` (of any precision `O`): `backward(x, g,
    /// weight, (weight needed, bias needed), into)` gives the input's gradient (`None` when it
    /// added it `into` the buffer given) and the weight's and bias's where asked. With `adds`,
    /// the input's gradient so far, when its buffer is this tensor's alone, is handed to
    /// `backward` to add into (the residual stream's norms: the skip connection's gradient
    /// arrives first); otherwise it is `None` and the engine adds.
    #[allow(clippy::type_complexity)]
    fn record_norm<O: Precision>(
        &self,
        op: &'static str,
        out: Tensor<O, D>,
        weight: Option<&Tensor<E, D>>,
        bias: Option<&Tensor<E, D>>,
        adds: bool,
        backward: impl Fn(
            &Tensor<E, D>,
            &Tensor<O, D>,
            Option<(&D::Storage<E>, &crate::layout::Layout)>,
            (bool, bool),
            Option<&mut D::Storage<E>>,
        ) -> (Option<D::Storage<E>>, Option<D::Storage<E>>, Option<D::Storage<E>>)
        + Send
        + Sync
        + 'static,
    ) -> Tensor<O, D> {
        let needs =
            (self.requires_grad(), weight.is_some_and(Tensor::requires_grad), bias.is_some_and(Tensor::requires_grad));
        if needs == (false, false, false) {
            return out;
        }
        let (xs, ws, d) = (self.detach(), weight.map(Tensor::detach), self.shape()[self.rank() - 1]);
        let parents = vec![self.node.clone(), weight.and_then(|w| w.node.clone()), bias.and_then(|b| b.node.clone())];
        let affine = move |xs: &Tensor<E, D>, gw: Option<D::Storage<E>>, gb: Option<D::Storage<E>>| {
            [gw.map(|v| xs.output(v, &[d]).into()), gb.map(|v| xs.output(v, &[d]).into())]
        };
        if !(adds && needs.0) {
            return out.record(op, parents, move |g| {
                let (gx, gw, gb) = backward(&xs, &g, ws.as_ref().map(Tensor::raw), (needs.1, needs.2), None);
                let gx = needs.0.then(|| xs.output(gx.expect("the input's gradient"), xs.shape()).into());
                let [gw, gb] = affine(&xs, gw, gb);
                vec![gx, gw, gb]
            });
        }
        out.record_into(op, parents, move |g, acc| {
            let w = ws.as_ref().map(Tensor::raw);
            let acc = acc.map(|a| a.downcast::<E>().expect("autograd invariant: a norm's input gradient precision"));
            let (total, gw, gb) = match acc {
                Some(mut acc) if crate::autograd::owns_whole(&acc) => {
                    let (_, gw, gb) = backward(&xs, &g, w, (needs.1, needs.2), Some(&mut acc.storage));
                    (acc.into(), gw, gb)
                }
                acc => {
                    let (gx, gw, gb) = backward(&xs, &g, w, (needs.1, needs.2), None);
                    let gx: AnyTensor<D> = xs.output(gx.expect("the input's gradient"), xs.shape()).into();
                    let total = match acc {
                        Some(acc) => crate::autograd::accumulate(acc.into(), gx),
                        None => gx,
                    };
                    (total, gw, gb)
                }
            };
            let [gw, gb] = affine(&xs, gw, gb);
            vec![Some(total), gw, gb]
        })
    }

    /// Layer norm over the last dim `D`: `y = (x - mean) / sqrt(var + eps) * weight + bias`
    /// (biased variance, as PyTorch), with `weight` and `bias` of shape `[D]` when given.
    ///
    /// Derivatives, with `x̂` the normalised input, `ĝ = g * weight` and `rstd = 1/sqrt(var + eps)`:
    /// `dx = rstd * (ĝ - mean(ĝ) - x̂ * mean(ĝ * x̂))`, `dweight = sum(g * x̂)`, `dbias = sum(g)`
    /// (sums over every dim but the last).
    #[track_caller]
    pub fn try_layer_norm(&self, weight: Option<&Tensor<E, D>>, bias: Option<&Tensor<E, D>>, eps: f64) -> Result<Self> {
        crate::__private::check_reach("layer_norm", E::DTYPE);
        self.norm_impl::<false>("layer_norm", weight, bias, eps)
    }
    /// Layer norm over the last dim; panics on a weight/bias shape mismatch or a bad `eps`.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f64>::from_vec(vec![1.0, 3.0], &[1, 2]);
    /// let y = x.layer_norm(None, None, 0.0).to_vec();
    /// assert_eq!(y, vec![-1.0, 1.0]);
    /// ```
    #[track_caller]
    pub fn layer_norm(&self, weight: Option<&Tensor<E, D>>, bias: Option<&Tensor<E, D>>, eps: f64) -> Self {
        or_panic(self.try_layer_norm(weight, bias, eps))
    }

    /// [`Tensor::try_layer_norm`] with the output rounded into `O`: the values of
    /// `self.layer_norm(weight, bias, eps).cast::<O>()` and its gradients, in one pass each way
    /// where the device fuses the cast (the CPU does for an f32 input and an f16 or bf16
    /// output): autocast's f32 layer norm feeding a low-precision matmul, which would otherwise
    /// write the f32 output, read it to cast it, and cast its gradient back.
    #[track_caller]
    pub fn try_layer_norm_to<O: Precision>(
        &self,
        weight: Option<&Tensor<E, D>>,
        bias: Option<&Tensor<E, D>>,
        eps: f64,
    ) -> Result<Tensor<O, D>> {
        crate::__private::check_reach("layer_norm_to", E::DTYPE);
        let op = "layer_norm_to";
        if O::DTYPE == E::DTYPE {
            return Ok(self.norm_impl::<false>(op, weight, bias, eps)?.cast::<O>()); // no cast to fuse
        }
        let d = self.check_norm(op, weight, bias, eps)?;
        let (w, b) = (weight.map(Tensor::raw), bias.map(Tensor::raw));
        let (y, stats) = self.device.norm_to::<E, O>(self.raw(), d, w, b, eps, false);
        let out = self.output(y, self.shape());
        // The residual stream's norm: its input's gradient is added into the skip
        // connection's as the backward writes it.
        Ok(self.record_norm(op, out, weight, bias, true, move |x, g, w, needs, into| match into {
            Some(acc) => {
                let (gw, gb) = x.device.norm_backward_into(x.raw(), g.raw(), d, w, &stats, needs, false, acc);
                (None, gw, gb)
            }
            None => {
                let (gx, gw, gb) = x.device.norm_backward_from(x.raw(), g.raw(), d, w, &stats, needs, false);
                (Some(gx), gw, gb)
            }
        }))
    }
    /// [`Tensor::try_layer_norm_to`]; panics on a weight/bias shape mismatch or a bad `eps`.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// use amp::bf16;
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, 4.0], &[1, 3]);
    /// let y: Tensor<bf16> = x.layer_norm_to(None, None, 1e-5);
    /// assert_eq!(y.to_vec(), x.layer_norm(None, None, 1e-5).cast::<bf16>().to_vec());
    /// ```
    #[track_caller]
    pub fn layer_norm_to<O: Precision>(
        &self,
        weight: Option<&Tensor<E, D>>,
        bias: Option<&Tensor<E, D>>,
        eps: f64,
    ) -> Tensor<O, D> {
        or_panic(self.try_layer_norm_to(weight, bias, eps))
    }

    /// RMS norm over the last dim `D`: `y = x / sqrt(mean(x²) + eps) * weight`, `weight` of
    /// shape `[D]` when given.
    ///
    /// Derivatives, with `x̂ = x * rstd`, `ĝ = g * weight`, `rstd = 1/sqrt(mean(x²) + eps)`:
    /// `dx = rstd * (ĝ - x̂ * mean(ĝ * x̂))`, `dweight = sum(g * x̂)`.
    #[track_caller]
    pub fn try_rms_norm(&self, weight: Option<&Tensor<E, D>>, eps: f64) -> Result<Self> {
        crate::__private::check_reach("rms_norm", E::DTYPE);
        self.norm_impl::<true>("rms_norm", weight, None, eps)
    }
    /// RMS norm over the last dim; panics on a weight shape mismatch or a bad `eps`.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f64>::from_vec(vec![3.0, -3.0], &[2]);
    /// assert_eq!(x.rms_norm(None, 0.0).to_vec(), vec![1.0, -1.0]);
    /// ```
    #[track_caller]
    pub fn rms_norm(&self, weight: Option<&Tensor<E, D>>, eps: f64) -> Self {
        or_panic(self.try_rms_norm(weight, eps))
    }
}
