use amp_macros::Params;

use super::{CausalSelfAttention, Dropout, Embedding, LayerNorm, Linear, Mlp};
use crate::error::{Error, Result, or_panic};
use crate::ops::loss::CrossEntropyOptions;
use crate::{Cpu, Device, Indices, Precision, Rng, Tensor};

/// Size of a [`Gpt`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence (learned positions).
    pub block_size: usize,
    /// Model width.
    pub d_model: usize,
    /// Decoder blocks.
    pub n_layers: usize,
    /// Attention heads per block.
    pub n_heads: usize,
    /// Dropout probability (0 disables).
    pub dropout: f64,
}

impl GptConfig {
    /// Checks the sizes make a model.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &'static str, detail: String| Err(Error::InvalidArgument { op: "GptConfig", name, detail });
        if self.vocab_size == 0 || self.block_size == 0 || self.d_model == 0 || self.n_layers == 0 {
            return bad("sizes", format!("every size must be positive: {self:?}"));
        }
        if self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) {
            return bad("n_heads", format!("d_model {} must be a multiple of n_heads {}", self.d_model, self.n_heads));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad("dropout", format!("must be in [0, 1), got {}", self.dropout));
        }
        Ok(())
    }
}

/// A pre-LayerNorm decoder block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`, residual in f32.
/// Its weights are `W` (f32 by default).
#[derive(Params, Debug, Clone)]
pub struct Block<W: Precision = f32, D: Device = Cpu> {
    /// Norm before attention.
    pub ln1: LayerNorm<W, D>,
    /// Causal self-attention.
    pub attn: CausalSelfAttention<W, D>,
    /// Norm before the MLP.
    pub ln2: LayerNorm<W, D>,
    /// The MLP.
    pub mlp: Mlp<W, D>,
}

impl Block {
    /// A block of width `d`. Errs when `d` is not a positive multiple of `n_heads` or
    /// `dropout` is not in `[0, 1)`.
    pub fn try_new(d: usize, n_heads: usize, dropout: f64, rng: &mut Rng) -> Result<Self> {
        Ok(Block {
            ln1: LayerNorm::new(d),
            attn: CausalSelfAttention::try_new(d, n_heads, dropout, rng)?,
            ln2: LayerNorm::new(d),
            mlp: Mlp::try_new(d, 4 * d, dropout, rng)?,
        })
    }
    /// [`Block::try_new`], panicking with its error's message.
    #[track_caller]
    pub fn new(d: usize, n_heads: usize, dropout: f64, rng: &mut Rng) -> Self {
        or_panic(Self::try_new(d, n_heads, dropout, rng))
    }
}

impl<W: Precision, D: Device> Block<W, D> {
    /// A copy with its weights rounded to precision `P` (new parameters: their own ids).
    pub fn to_precision<P: Precision>(&self) -> Block<P, D> {
        Block {
            ln1: self.ln1.to_precision(),
            attn: self.attn.to_precision(),
            ln2: self.ln2.to_precision(),
            mlp: self.mlp.to_precision(),
        }
    }
    /// `x: [B, T, d]` (f32 residual stream) to the same shape. Errs on another rank or width.
    pub fn try_forward<L: Precision>(&self, x: &Tensor<f32, D>, rng: &mut Rng) -> Result<Tensor<f32, D>> {
        // The norms write `L`, which the attention's and MLP's first linears read.
        // The branches' outputs are added to the f32 stream as they are (`add_cast`).
        let a = self.attn.try_forward::<L, L>(&self.ln1.try_forward_to::<L, f32>(x)?, rng)?;
        let x = x.add_cast(&a);
        let m = self.mlp.try_forward::<L, L>(&self.ln2.try_forward_to::<L, f32>(&x)?, rng)?;
        Ok(x.add_cast(&m))
    }
    /// [`Block::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<L: Precision>(&self, x: &Tensor<f32, D>, rng: &mut Rng) -> Tensor<f32, D> {
        or_panic(self.try_forward::<L>(x, rng))
    }
}

/// A small decoder-only transformer (GPT-2 layout, learned positions), with weights of
/// precision `W`: f32 master weights by default; `gpt.to_precision::<bf16>()` gives the
/// pure-bf16 model (see [`crate::optim`]).
#[derive(Params, Debug, Clone)]
pub struct Gpt<W: Precision = f32, D: Device = Cpu> {
    /// Token embeddings `[vocab, d]`.
    pub tok_emb: Embedding<W, D>,
    /// Position embeddings `[block_size, d]`.
    pub pos_emb: Embedding<W, D>,
    /// Dropout on the embeddings.
    pub drop: Dropout,
    /// The decoder blocks.
    pub blocks: Vec<Block<W, D>>,
    /// Final norm.
    pub ln_f: LayerNorm<W, D>,
    /// Output projection to the vocabulary.
    pub head: Linear<W, D>,
    /// The sizes.
    #[param(skip)]
    pub config: GptConfig,
}

impl Gpt {
    /// A model with GPT-2's initialisation; errors on an invalid config.
    pub fn try_new(config: GptConfig, rng: &mut Rng) -> Result<Self> {
        config.validate()?;
        let d = config.d_model;
        Ok(Gpt {
            tok_emb: Embedding::new(config.vocab_size, d, 0.02, rng),
            pos_emb: Embedding::new(config.block_size, d, 0.02, rng),
            drop: Dropout::new(config.dropout),
            blocks: (0..config.n_layers)
                .map(|_| Block::try_new(d, config.n_heads, config.dropout, rng))
                .collect::<Result<_>>()?,
            ln_f: LayerNorm::new(d),
            head: Linear::normal(d, config.vocab_size, true, 0.02, rng),
            config,
        })
    }
    /// A model with GPT-2's initialisation; panics on an invalid config.
    #[track_caller]
    pub fn new(config: GptConfig, rng: &mut Rng) -> Self {
        crate::error::or_panic(Self::try_new(config, rng))
    }
}

impl<W: Precision, D: Device> Gpt<W, D> {
    /// A copy with every weight rounded to precision `P` (new parameters: their own ids, so an
    /// optimizer of the original does not step the copy). `Gpt::new(config, rng)
    /// .to_precision::<bf16>()` is the pure-bf16 model with the f32 model's initialisation,
    /// rounded to nearest.
    pub fn to_precision<P: Precision>(&self) -> Gpt<P, D> {
        Gpt {
            tok_emb: self.tok_emb.to_precision(),
            pos_emb: self.pos_emb.to_precision(),
            drop: self.drop.clone(),
            blocks: self.blocks.iter().map(Block::to_precision).collect(),
            ln_f: self.ln_f.to_precision(),
            head: self.head.to_precision(),
            config: self.config.clone(),
        }
    }
    /// The same model with every block's attention computed by the fused
    /// [`Tensor::causal_attention`] kernel (or, with `false`, by separate ops): see
    /// [`CausalSelfAttention::with_fused`]. Errs when the model has attention dropout.
    pub fn with_fused_attention(mut self, fused: bool) -> Result<Self> {
        for b in &mut self.blocks {
            b.attn = b.attn.clone().with_fused(fused)?;
        }
        Ok(self)
    }
    /// Logits `[B, T, vocab]` in precision `L` for token ids `[B, T]`. Errs when `ids` is not
    /// `[B, T]` with `1 <= T <= block_size`, or holds an id outside the vocabulary.
    pub fn try_forward<L: Precision>(&self, ids: &Indices, rng: &mut Rng) -> Result<Tensor<L, D>> {
        let block = self.config.block_size;
        if ids.shape().len() != 2 || !(1..=block).contains(&ids.shape()[1]) {
            return Err(Error::Shape {
                op: "Gpt::forward",
                detail: format!("expected token ids [B, T] with 1 <= T <= block_size {block}"),
                shapes: vec![ids.shape().to_vec()],
            });
        }
        let t = ids.shape()[1];
        let pos = self.pos_emb.weight.narrow(0, 0, t).cast::<f32>();
        let mut x = self.drop.try_forward(&self.tok_emb.try_forward(ids)?.add(&pos), rng)?;
        for block in &self.blocks {
            x = block.try_forward::<L>(&x, rng)?;
        }
        self.head.try_forward::<L, L>(&self.ln_f.try_forward_to::<L, f32>(&x)?)
    }
    /// [`Gpt::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<L: Precision>(&self, ids: &Indices, rng: &mut Rng) -> Tensor<L, D> {
        or_panic(self.try_forward::<L>(ids, rng))
    }
    /// Mean cross-entropy (in f32) of next-token predictions; `targets` has the shape of `ids`
    /// (`[B, T]`), with -100 to ignore a position. Errs on targets of another shape (the same
    /// number of ids laid out otherwise, `[T, B]` or flattened, would silently train on the
    /// wrong pairs) or outside the vocabulary, and as [`Gpt::try_forward`] does.
    pub fn try_loss<L: Precision>(&self, ids: &Indices, targets: &Indices, rng: &mut Rng) -> Result<Tensor<f32, D>> {
        if targets.shape() != ids.shape() {
            return Err(Error::Shape {
                op: "Gpt::loss",
                detail: "targets must have the shape of the token ids [B, T]".into(),
                shapes: vec![ids.shape().to_vec(), targets.shape().to_vec()],
            });
        }
        let logits = self.try_forward::<L>(ids, rng)?;
        let v = self.config.vocab_size;
        let n = targets.numel();
        logits
            .cast::<f32>()
            .reshape(&[n, v])
            .try_cross_entropy_with(&targets.reshape(&[n]), CrossEntropyOptions::default())
    }
    /// [`Gpt::try_loss`], panicking with its error's message.
    #[track_caller]
    pub fn loss<L: Precision>(&self, ids: &Indices, targets: &Indices, rng: &mut Rng) -> Tensor<f32, D> {
        or_panic(self.try_loss::<L>(ids, targets, rng))
    }

    /// `prompt` (`[B, P]`, `P >= 1`) followed by `new_tokens` tokens chosen one at a time from
    /// the logits (computed in precision `L`) at the last position, as nanoGPT's `generate`
    /// does: `[B, P + new_tokens]`. The model sees at most the last `block_size` tokens. Runs
    /// without a graph; `rng` draws the samples. Off the CPU each token reads the logits back
    /// (a synchronisation per token).
    ///
    /// Errs on a prompt that is not `[B, P]` with `P >= 1` or holds an id outside the
    /// vocabulary, on an invalid [`Sampling`], and on a model in training mode with dropout
    /// (it would drop activations while generating: call `eval()` first, PyTorch's
    /// `model.eval()`).
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// use amp::nn::{Gpt, GptConfig, Sampling};
    /// use amp::{Indices, Rng};
    /// let config = GptConfig { vocab_size: 10, block_size: 8, d_model: 16, n_layers: 1, n_heads: 2, dropout: 0.0 };
    /// let gpt = Gpt::new(config, &mut Rng::seed(0));
    /// let prompt = Indices::from_vec(vec![1, 2, 3], &[1, 3]);
    /// let out = gpt.try_generate::<f32>(&prompt, 12, Sampling::Random { temperature: 0.8, top_k: Some(5) }, &mut Rng::seed(1))?;
    /// assert_eq!((out.shape(), &out.as_slice()[..3]), (&[1, 15][..], &[1, 2, 3][..]));
    /// # Ok::<(), amp::Error>(())
    /// ```
    pub fn try_generate<L: Precision>(
        &self,
        prompt: &Indices,
        new_tokens: usize,
        sampling: Sampling,
        rng: &mut Rng,
    ) -> Result<Indices> {
        let bad = |detail: String| Err(Error::InvalidArgument { op: "Gpt::generate", name: "sampling", detail });
        match sampling {
            Sampling::Greedy => {}
            Sampling::Random { temperature, top_k } => {
                if !(temperature.is_finite() && temperature > 0.0) {
                    return bad(format!("temperature must be finite and above 0, got {temperature} (Greedy for 0)"));
                }
                if top_k == Some(0) {
                    return bad("top_k must be at least 1".into());
                }
            }
        }
        if prompt.shape().len() != 2 || prompt.shape()[1] == 0 {
            return Err(Error::Shape {
                op: "Gpt::generate",
                detail: "expected a prompt of token ids [B, P] with P >= 1".into(),
                shapes: vec![prompt.shape().to_vec()],
            });
        }
        if self.drop.is_training() && self.config.dropout > 0.0 {
            return Err(Error::State {
                context: "Gpt::generate".into(),
                detail: format!(
                    "the model is in training mode with dropout {}: it would drop activations while generating. \
                     Call `eval()` first (PyTorch's `model.eval()`), and `train()` to train again",
                    self.config.dropout
                ),
            });
        }
        let (b, p, v, block) = (prompt.shape()[0], prompt.shape()[1], self.config.vocab_size, self.config.block_size);
        if let Some(position) = prompt.as_slice().iter().position(|&id| !(0..v as i64).contains(&id)) {
            let index = prompt.as_slice()[position];
            return Err(Error::IndexOutOfRange { op: "Gpt::generate", index, position, bound: v });
        }
        if b == 0 {
            return Indices::try_from_vec(Vec::new(), &[0, p + new_tokens]);
        }
        let mut seqs: Vec<Vec<i64>> = prompt.as_slice().chunks(p).map(<[i64]>::to_vec).collect();
        crate::no_grad(|| -> Result<()> {
            for _ in 0..new_tokens {
                let len = seqs[0].len();
                let t = len.min(block);
                let window: Vec<i64> = seqs.iter().flat_map(|s| s[len - t..].iter().copied()).collect();
                let ids = Indices::try_from_vec(window, &[b, t])?;
                let last = self.try_forward::<L>(&ids, rng)?.narrow(1, t - 1, 1).reshape(&[b, v]);
                let next: Vec<i64> = match sampling {
                    Sampling::Greedy => last.argmax(1, false).as_slice().to_vec(),
                    Sampling::Random { temperature, top_k } => {
                        let logits = last.cast::<f32>().to_vec();
                        logits.chunks(v).map(|row| sample_row(row, temperature, top_k, rng)).collect()
                    }
                };
                for (s, tok) in seqs.iter_mut().zip(next) {
                    s.push(tok);
                }
            }
            Ok(())
        })?;
        Indices::try_from_vec(seqs.concat(), &[b, p + new_tokens])
    }
    /// [`Gpt::try_generate`], panicking with its error's message.
    #[track_caller]
    pub fn generate<L: Precision>(
        &self,
        prompt: &Indices,
        new_tokens: usize,
        sampling: Sampling,
        rng: &mut Rng,
    ) -> Indices {
        or_panic(self.try_generate::<L>(prompt, new_tokens, sampling, rng))
    }
}

/// How [`Gpt::generate`] picks each token from the logits at the last position.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (the first one on a tie), as `argmax`.
    Greedy,
    /// A draw from `softmax(logits / temperature)`, over the `top_k` most likely tokens only
    /// when set (every token tied with the k-th is kept, as nanoGPT's filter keeps them).
    Random {
        /// Above 0: below 1 sharpens the distribution, above 1 flattens it.
        temperature: f64,
        /// Keep only the k most likely tokens (at least 1; more than the vocabulary is all).
        top_k: Option<usize>,
    },
}

/// One token drawn from `softmax(row / temperature)` restricted to the `top_k` largest logits
/// (in f64; a row of non-finite logits falls back to its first maximum).
fn sample_row(row: &[f32], temperature: f64, top_k: Option<usize>, rng: &mut Rng) -> i64 {
    let cutoff = match top_k {
        Some(k) if k < row.len() => {
            // The k-th largest logit (a selection, not a sort of the whole vocabulary).
            let mut values: Vec<f32> = row.to_vec();
            *values.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a)).1
        }
        _ => f32::NEG_INFINITY,
    };
    let max = row.iter().copied().filter(|&x| x >= cutoff).fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> =
        row.iter().map(|&x| if x >= cutoff { ((x as f64 - max) / temperature).exp() } else { 0.0 }).collect();
    let total: f64 = weights.iter().sum();
    if !(total.is_finite() && total > 0.0) {
        let first_max = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)));
        return first_max.map_or(0, |(i, _)| i as i64);
    }
    let mut u = rng.uniform() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as i64;
        }
        u -= w;
    }
    // Rounding left `u` just above the last weight: the last token with any weight.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as i64
}
