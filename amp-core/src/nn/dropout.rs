use crate::{Device, Param, Params, Precision, Rng, Tensor};

/// Dropout with probability `p` in training mode, the identity in evaluation mode.
#[derive(Debug, Clone)]
pub struct Dropout {
    /// Probability of zeroing an element.
    pub p: f64,
    training: bool,
}

impl Dropout {
    /// A dropout layer, in training mode.
    ///
    /// # Panics
    /// If `p` is not in `[0, 1)` (checked here, as PyTorch's `nn.Dropout(p)` checks it, not at
    /// the first forward).
    #[track_caller]
    pub fn new(p: f64) -> Self {
        assert!((0.0..1.0).contains(&p), "Dropout::new: p must be in [0, 1), got {p}");
        Dropout { p, training: true }
    }
    /// Whether dropout is active.
    pub fn is_training(&self) -> bool {
        self.training
    }
    /// Zeroes elements with probability `p` (scaling the rest by `1/(1-p)`) when training.
    #[track_caller]
    pub fn forward<E: Precision, D: Device>(&self, x: &Tensor<E, D>, rng: &mut Rng) -> Tensor<E, D> {
        x.dropout(self.p, self.training, rng)
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
