use amp_macros::Params;

use crate::error::{Result, or_panic};
use crate::{Cpu, Device, Indices, Param, Precision, Rng, Tensor};

/// A lookup table `[num_embeddings, dim]` of precision `W` (f32 by default); rows are gathered
/// by index, as f32 (embedding is a pass-through op, and the residual stream is f32).
#[derive(Params, Debug, Clone)]
pub struct Embedding<W: Precision = f32, D: Device = Cpu> {
    /// `[num_embeddings, dim]`.
    pub weight: Param<W, D>,
}

impl Embedding {
    /// A table initialised normal with standard deviation `std` (GPT-2 uses 0.02).
    pub fn new(num_embeddings: usize, dim: usize, std: f64, rng: &mut Rng) -> Self {
        Embedding { weight: Param::new(Tensor::<f32>::randn(&[num_embeddings, dim], rng).mul_scalar(std)) }
    }
}

impl<W: Precision, D: Device> Embedding<W, D> {
    /// Rows for `ids: [...]`, giving `[..., dim]` in f32. A bf16 table is widened first, so its
    /// gradient is summed over repeated ids in f32 and rounded to bf16 once. Errs on an id
    /// outside `0..num_embeddings`, naming it and its position.
    pub fn try_forward(&self, ids: &Indices) -> Result<Tensor<f32, D>> {
        self.weight.cast::<f32>().try_embedding(ids)
    }
    /// [`Embedding::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward(&self, ids: &Indices) -> Tensor<f32, D> {
        or_panic(self.try_forward(ids))
    }
    /// A copy with its table rounded to precision `P` (a new parameter: its own id).
    pub fn to_precision<P: Precision>(&self) -> Embedding<P, D> {
        Embedding { weight: self.weight.to_precision() }
    }
}
