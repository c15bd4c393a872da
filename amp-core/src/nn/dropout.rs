use crate::error::{Error, Result, or_panic};
use crate::{Device, Param, Params, Precision, Rng, Tensor};

/// Dropout with probability `p` in training mode, the identity in evaluation mode.
#[derive(Debug, Clone)]
pub struct Dropout {
    /// Probability of zeroing an element.
    pub p: f64,
    training: bool,
}

impl Dropout {
    /// A dropout layer, in training mode. Errs if `p` is not in `[0, 1)` (checked here, as
    /// PyTorch's `nn.Dropout(p)` checks it, not at the first forward).
    pub fn try_new(p: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "Dropout::new",
                name: "p",
                detail: format!("must be in [0, 1), got {p}"),
            });
        }
        Ok(Dropout { p, training: true })
    }
    /// [`Dropout::try_new`], panicking with its error's message.
    #[track_caller]
    pub fn new(p: f64) -> Self {
        or_panic(Self::try_new(p))
    }
    /// Whether dropout is active.
    pub fn is_training(&self) -> bool {
        self.training
    }
    /// Zeroes elements with probability `p` (scaling the rest by `1/(1-p)`) when training.
    /// Errs if `p` was set outside `[0, 1)` after construction.
    pub fn try_forward<E: Precision, D: Device>(&self, x: &Tensor<E, D>, rng: &mut Rng) -> Result<Tensor<E, D>> {
        x.try_dropout(self.p, self.training, rng)
    }
    /// [`Dropout::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<E: Precision, D: Device>(&self, x: &Tensor<E, D>, rng: &mut Rng) -> Tensor<E, D> {
        or_panic(self.try_forward(x, rng))
    }
    /// Switches dropout on or off. (Dropout is `Params<E>` for every element type `E`, so it
    /// fits in a module of any precision; these inherent methods let `dropout.eval()` be
    /// called without naming one.)
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
    }
    /// Training mode: dropout active.
    pub fn train(&mut self) {
        self.training = true;
    }
    /// Evaluation mode: dropout is the identity.
    pub fn eval(&mut self) {
        self.training = false;
    }
}

/// No parameters, of any element type on any device; `set_training` reaches it from the
/// enclosing module.
impl<E: Precision, D: Device> Params<E, D> for Dropout {
    fn named_params(&self) -> Vec<(String, &Param<E, D>)> {
        Vec::new()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)> {
        Vec::new()
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}
