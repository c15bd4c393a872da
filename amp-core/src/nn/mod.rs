//! Neural-network modules: Linear, LayerNorm, Embedding, Dropout, a GELU MLP, causal
//! multi-head self-attention, a pre-LayerNorm decoder block and a small GPT; for vision,
//! Conv2d, BatchNorm2d (running statistics as buffers) and pooling.
//!
//! Design notes:
//! - Parameters are f32 master weights (`Param<f32>`) enumerated by `#[derive(Params)]` with
//!   PyTorch's `state_dict` names (`blocks.0.ln1.weight`), so checkpoints interoperate.
//! - Every module is generic over its weight precision `W`, f32 by default (`Linear` is
//!   `Linear<f32>`), for pure-bf16 training: `gpt.to_precision::<bf16>()` is the same model
//!   with bf16 weights (an `Optim::for_bf16` steps it; see [`crate::optim`]). Constructors
//!   build f32 modules, so `Linear::new(..)` needs no annotation. The forward passes are the
//!   same for every `W`: weights are cast to the compute precision `L` (a no-op when `W = L`),
//!   and layer norm and embeddings widen theirs to f32, so their gradients arrive in `W`.
//! - Each `forward` takes the low (compute) precision `L` as a type parameter and applies the
//!   autocast policy table (`crate::policy`): matmul-like ops (Linear, attention scores and
//!   values) run in `L` with f32 accumulation; layer norm, softmax and the loss run in f32; the
//!   residual stream stays f32 (an f32 + `L` add promotes to f32). With `L = f32` this is plain
//!   f32 training. Weight casts are differentiable, so gradients arrive in f32.
//! - Inside `#[autocast]` no method needs a turbofish: `self.fc.forward(&x)`,
//!   `block.forward(&x, rng)` and `gpt.loss(&ids, &targets, rng)` run in the region's type.
//!   The macro hands the module's own method that type as `L`, which matters most where `L`
//!   shows in no argument and no value ([`Block::forward`] returns the f32 residual stream,
//!   [`Gpt::loss`] an f32 loss). Written out (`block.forward::<f32>(..)`), a precision is kept.
//! - `train()` / `eval()` (from [`crate::Params`]) reach every submodule; dropout and batch
//!   norm read it ([`TrainingMode`] is the field that carries it).
//! - Every `forward` (and [`Gpt::loss`]) has a `try_` form returning [`crate::Error`], and the
//!   plain form panics with its message, as the ops do. A module checks what its ops would
//!   report in terms of something else (a GPT's ids and targets, attention's `[B, T, d]`);
//!   the rest is the op's own error. Constructors that check arguments have `try_new`.

mod attention;
mod batch_norm;
mod conv;
mod dropout;
mod embedding;
mod gpt;
mod layer_norm;
mod linear;
mod mlp;
mod pool;

pub use attention::CausalSelfAttention;
pub use batch_norm::{BatchNorm2d, TrainingMode};
pub use conv::Conv2d;
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use gpt::{Block, Gpt, GptConfig, Sampling};
pub use layer_norm::LayerNorm;
pub use linear::Linear;
pub use mlp::Mlp;
pub use pool::{AdaptiveAvgPool2d, AvgPool2d, MaxPool2d};

/// PyTorch's default init of `Linear` and `Conv2d` weights and biases
/// (`kaiming_uniform_(a=√5)` and its bias rule): uniform in `±1/√fan_in`, and 0 when `fan_in`
/// is 0 (a layer with no inputs), as PyTorch's, rather than ±inf and NaN.
fn uniform_init(shape: &[usize], fan_in: usize, rng: &mut crate::Rng) -> crate::Tensor<f32> {
    let bound = if fan_in == 0 { 0.0 } else { 1.0 / (fan_in as f64).sqrt() };
    crate::Tensor::<f32>::rand(shape, rng).mul_scalar(2.0 * bound).add_scalar(-bound)
}
