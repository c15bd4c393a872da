//! Data: datasets, a seeded, resumable data loader, in-memory tensors as a dataset
//! ([`TensorDataset`]), the two token tasks the training example uses (generated
//! multi-digit addition, and a character-level text file), and a generated image task for
//! convolutional models ([`ShapesTask`]).
//!
//! In-memory inputs and labels, batched as in PyTorch's
//! `DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)`:
//!
//! ```
//! # extern crate amp_core as amp;
//! use amp::data::{DataLoader, TensorDataset};
//! use amp::{Indices, Rng, Tensor};
//!
//! let mut rng = Rng::seed(0);
//! let x = Tensor::<f32>::randn(&[100, 8], &mut rng); // 100 samples of 8 features
//! let y = Indices::from_vec((0..100).map(|i| i % 3).collect(), &[100]); // class labels
//! let mut loader = DataLoader::new(TensorDataset::new(x, y).unwrap(), 32, 0).unwrap();
//! for epoch in 0..2 {
//!     for batch in loader.epoch_batches() {
//!         let (xb, yb) = batch.unwrap(); // shuffled rows, still paired
//!         assert_eq!((xb.shape()[1], yb.shape()[0]), (8, xb.shape()[0])); // [B, 8] and [B]
//!         // let loss = model.loss(&xb, &yb); ...
//!     }
//!     assert_eq!(loader.epoch(), epoch);
//! }
//! ```
//!
//! Token tasks stack their samples into a [`TokenBatch`]:
//!
//! ```
//! # extern crate amp_core as amp;
//! use amp::data::{AdditionConfig, AdditionTask, DataLoader, Dataset};
//!
//! let task = AdditionTask::new(AdditionConfig { digits: 2, ..AdditionConfig::default() }).unwrap();
//! let mut loader = DataLoader::new(task.train_set(), 32, 0).unwrap();
//! let batch = loader.next_token_batch().unwrap();
//! assert_eq!(batch.inputs.shape(), &[32, task.seq_len()]);
//! // A checkpoint stores the position; a fresh loader restored from it continues identically.
//! let position = loader.position();
//! let mut resumed = DataLoader::new(task.train_set(), 32, 0).unwrap();
//! resumed.restore(&position).unwrap();
//! assert_eq!(resumed.next_indices(), loader.next_indices());
//! ```
//!
//! Design notes: the loader's whole state is its [`LoaderPosition`] (seed, epoch, offset within
//! the epoch). Each epoch's permutation is recomputed from `(seed, epoch)`, so the position is
//! a few integers however large the dataset, and restoring it reproduces the exact order.

mod addition;
mod loader;
mod shapes;
mod tensor_dataset;
mod text;

pub use addition::{Accuracy, AdditionConfig, AdditionDataset, AdditionTask, AdditionVocab};
pub use loader::{DataLoader, EpochBatches, LoaderPosition};
pub use shapes::{SHAPE_NAMES, ShapesConfig, ShapesTask};
pub use tensor_dataset::{Rows, TensorDataset};
pub use text::{CharTextDataset, CharVocab};

use crate::error::{Error, Result};
use crate::indices::Indices;

/// A finite, indexable collection of samples (PyTorch's map-style `Dataset`).
pub trait Dataset {
    /// One example.
    type Sample;
    /// Number of samples.
    fn len(&self) -> usize;
    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The sample at `index` (`index < len()`; panics otherwise).
    fn get(&self, index: usize) -> Self::Sample;
}

/// A [`Dataset`] that builds a whole batch from sample indices in one pass, e.g. gathering
/// rows of in-memory tensors into `[B, ...]` tensors ([`TensorDataset`]), rather than
/// collecting samples one by one. [`DataLoader::next_tensor_batch`] and
/// [`DataLoader::epoch_batches`] serve these batches.
pub trait BatchDataset: Dataset {
    /// A batch (for [`TensorDataset`], the `[B, ...]` inputs and labels).
    type Batch;
    /// The batch of samples `indices`, in that order. Errors name an index out of range.
    fn batch(&self, indices: &[usize]) -> Result<Self::Batch>;
}

/// The target value the loss ignores (PyTorch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

/// One sequence for a language model: `input[t]` is the token at `t`, `target[t]` the token
/// the model should predict there (the next one), or [`IGNORE_INDEX`] where the loss skips it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenSample {
    /// Token ids, length `T`.
    pub input: Vec<i64>,
    /// Next-token ids or [`IGNORE_INDEX`], length `T`.
    pub target: Vec<i64>,
}

/// A batch of [`TokenSample`]s of one length, stacked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBatch {
    /// `[B, T]` token ids.
    pub inputs: Indices,
    /// `[B, T]` next-token ids, [`IGNORE_INDEX`] where the loss skips a position.
    pub targets: Indices,
}

impl TokenBatch {
    /// Stacks samples of equal length into `[B, T]` inputs and targets.
    pub fn collate(samples: &[TokenSample]) -> Result<TokenBatch> {
        let Some(first) = samples.first() else {
            return Err(Error::InvalidArgument {
                op: "TokenBatch::collate",
                name: "samples",
                detail: "no samples to stack".into(),
            });
        };
        let t = first.input.len();
        let mut inputs = Vec::with_capacity(samples.len() * t);
        let mut targets = Vec::with_capacity(samples.len() * t);
        for (i, s) in samples.iter().enumerate() {
            if s.input.len() != t || s.target.len() != t {
                return Err(Error::Shape {
                    op: "TokenBatch::collate",
                    detail: format!(
                        "sample {i} has input length {} and target length {}, but sample 0 has length {t}",
                        s.input.len(),
                        s.target.len()
                    ),
                    shapes: vec![vec![t], vec![s.input.len()], vec![s.target.len()]],
                });
            }
            inputs.extend_from_slice(&s.input);
            targets.extend_from_slice(&s.target);
        }
        let shape = [samples.len(), t];
        Ok(TokenBatch {
            inputs: Indices::try_from_vec(inputs, &shape)?,
            targets: Indices::try_from_vec(targets, &shape)?,
        })
    }
    /// Batch size `B`.
    pub fn batch_size(&self) -> usize {
        self.inputs.shape()[0]
    }
    /// Sequence length `T`.
    pub fn seq_len(&self) -> usize {
        self.inputs.shape()[1]
    }
    /// Number of positions the loss counts (targets not [`IGNORE_INDEX`]).
    pub fn num_targets(&self) -> usize {
        self.targets.as_slice().iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}
