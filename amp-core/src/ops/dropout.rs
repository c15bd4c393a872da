//! Dropout (inverted scaling), reproducible from the caller's [`Rng`]: one draw from it seeds
//! the mask, which backward regenerates rather than stores (the device's `dropout` kernel).

use crate::backend::Device;
use crate::error::{Error, Result, or_panic};
use crate::precision::Precision;
use crate::rng::Rng;
use crate::tensor::Tensor;

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Dropout: in training, each element is zeroed with probability `p` and the rest are
    /// scaled by `1 / (1 - p)`, so the expected value is unchanged; with `training == false` or
    /// `p == 0` it is the identity (and draws nothing from `rng`). `p` must be in `[0, 1)`.
    /// Derivative: the same mask and scale applied to the gradient.
    ///
    /// One `u64` is drawn from `rng` per call, so a seeded run is reproducible and a
    /// checkpointed `Rng` resumes the same masks.
    pub fn try_dropout(&self, p: f64, training: bool, rng: &mut Rng) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "dropout",
                name: "p",
                detail: format!("must be in [0, 1), got {p} (input shape {:?})", self.shape()),
            });
        }
        if !training || p == 0.0 {
            return Ok(self.clone());
        }
        let seed = rng.next_u64();
        let out = self.output(self.device.dropout(&self.storage, &self.layout, p, seed), self.shape());
        let shape = self.shape().to_vec();
        Ok(out.record("dropout", vec![self.node.clone()], move |g| {
            vec![Some(g.output(g.device.dropout(&g.storage, &g.layout, p, seed), &shape).into())]
        }))
    }
    /// Dropout; panics if `p` is outside `[0, 1)`.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::{Rng, Tensor};
    /// let x = Tensor::<f32>::ones(&[1000]);
    /// let y = x.dropout(0.5, true, &mut Rng::seed(0)).to_vec();
    /// assert!(y.iter().all(|&v| v == 0.0 || v == 2.0));
    /// assert_eq!(x.dropout(0.5, false, &mut Rng::seed(0)).to_vec(), x.to_vec());
    /// ```
    #[track_caller]
    pub fn dropout(&self, p: f64, training: bool, rng: &mut Rng) -> Self {
        or_panic(self.try_dropout(p, training, rng))
    }
}
