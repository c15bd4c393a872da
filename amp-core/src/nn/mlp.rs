use amp_macros::Params;

use super::{Dropout, Linear};
use crate::error::{Result, or_panic};
use crate::{Cpu, Device, Precision, Rng, Tensor};

/// The transformer MLP: `Linear(d, 4d) -> GELU -> Linear(4d, d) -> Dropout`.
/// Its weights are `W` (f32 by default).
#[derive(Params, Debug, Clone)]
pub struct Mlp<W: Precision = f32, D: Device = Cpu> {
    /// Expansion, `[hidden, d]`.
    pub fc: Linear<W, D>,
    /// Projection back, `[d, hidden]`.
    pub proj: Linear<W, D>,
    /// Residual dropout.
    pub dropout: Dropout,
}

impl Mlp {
    /// An MLP `d -> hidden -> d` with GPT-2 init.
    /// Errs when `dropout` is not in `[0, 1)`.
    pub fn try_new(d: usize, hidden: usize, dropout: f64, rng: &mut Rng) -> Result<Self> {
        let dropout = Dropout::try_new(dropout)?;
        Ok(Mlp {
            fc: Linear::normal(d, hidden, true, 0.02, rng),
            proj: Linear::normal(hidden, d, true, 0.02, rng),
            dropout,
        })
    }
    /// [`Mlp::try_new`], panicking with its error's message.
    #[track_caller]
    pub fn new(d: usize, hidden: usize, dropout: f64, rng: &mut Rng) -> Self {
        or_panic(Self::try_new(d, hidden, dropout, rng))
    }
}

impl<W: Precision, D: Device> Mlp<W, D> {
    /// A copy with its weights rounded to precision `P` (new parameters: their own ids).
    pub fn to_precision<P: Precision>(&self) -> Mlp<P, D> {
        Mlp { fc: self.fc.to_precision(), proj: self.proj.to_precision(), dropout: self.dropout.clone() }
    }
    /// `x: [..., d]` to `[..., d]` in precision `L` (GELU runs in `L`: a pass-through op).
    /// Errs when `x`'s last dim is not the first layer's `in_features`.
    pub fn try_forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>, rng: &mut Rng) -> Result<Tensor<L, D>> {
        let h = self.fc.try_forward::<L, X>(x)?.gelu();
        self.dropout.try_forward(&self.proj.try_forward::<L, L>(&h)?, rng)
    }
    /// [`Mlp::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>, rng: &mut Rng) -> Tensor<L, D> {
        or_panic(self.try_forward(x, rng))
    }
}
