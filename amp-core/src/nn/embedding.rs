use amp_macros::Params;

use crate::{Indices, Param, Rng, Tensor};

/// A lookup table `[num_embeddings, dim]`; rows are gathered by index (f32 output: embedding
/// is a pass-through op, and the table is an f32 master weight).
#[derive(Params, Debug, Clone)]
pub struct Embedding {
    /// `[num_embeddings, dim]`.
    pub weight: Param,
}

impl Embedding {
    /// A table initialised normal with standard deviation `std` (GPT-2 uses 0.02).
    pub fn new(num_embeddings: usize, dim: usize, std: f64, rng: &mut Rng) -> Self {
        Embedding { weight: Param::new(Tensor::<f32>::randn(&[num_embeddings, dim], rng).mul_scalar(std)) }
    }
    /// Rows for `ids: [...]`, giving `[..., dim]`.
    pub fn forward(&self, ids: &Indices) -> Tensor<f32> {
        self.weight.embedding(ids)
    }
}
