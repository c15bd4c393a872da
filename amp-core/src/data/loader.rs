//! [`DataLoader`]: seeded per-epoch shuffling, batching, and a position a checkpoint can store.

use super::{Dataset, TokenBatch, TokenSample};
use crate::error::{Error, Result};
use crate::rng::Rng;

/// Where a [`DataLoader`] is in its stream, plus the settings that define the stream, so a
/// restore can refuse a loader that would produce a different order.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoaderPosition {
    /// Seed of the shuffle; epoch `e`'s permutation is a function of `(seed, e)`.
    pub seed: u64,
    /// The current epoch (0-based).
    pub epoch: u64,
    /// Samples already handed out in the current epoch.
    pub index: usize,
    /// Dataset length the order was made for.
    pub dataset_len: usize,
    /// Samples per batch.
    pub batch_size: usize,
    /// Whether a short last batch is dropped.
    pub drop_last: bool,
    /// Whether epochs are shuffled (otherwise in index order).
    pub shuffle: bool,
}

/// Batches of a [`Dataset`], shuffled per epoch from a seed, endless (epochs follow one
/// another), with a serialisable [`LoaderPosition`] to resume the exact order.
pub struct DataLoader<D> {
    dataset: D,
    pos: LoaderPosition,
    /// The current epoch's order (recomputed from `(seed, epoch)`, never stored).
    order: Vec<usize>,
}

/// Shows the position, not the dataset or the (possibly huge) permutation.
impl<D> std::fmt::Debug for DataLoader<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader").field("position", &self.pos).finish_non_exhaustive()
    }
}

impl<D: Dataset> DataLoader<D> {
    /// A shuffling loader over `dataset` with `batch_size` samples per batch, keeping a short
    /// last batch (see [`DataLoader::drop_last`]).
    pub fn new(dataset: D, batch_size: usize, seed: u64) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::InvalidArgument {
                op: "DataLoader::new",
                name: "batch_size",
                detail: "must be at least 1".into(),
            });
        }
        if dataset.is_empty() {
            return Err(Error::InvalidArgument {
                op: "DataLoader::new",
                name: "dataset",
                detail: "the dataset is empty".into(),
            });
        }
        let pos = LoaderPosition {
            seed,
            epoch: 0,
            index: 0,
            dataset_len: dataset.len(),
            batch_size,
            drop_last: false,
            shuffle: true,
        };
        let mut loader = DataLoader { dataset, pos, order: Vec::new() };
        loader.make_order();
        Ok(loader)
    }
    /// Drops the last batch of an epoch when it would be short (PyTorch's `drop_last`). Fails if
    /// that leaves no batch at all (`batch_size > len`).
    pub fn drop_last(mut self, drop: bool) -> Result<Self> {
        if drop && self.pos.batch_size > self.pos.dataset_len {
            return Err(Error::InvalidArgument {
                op: "DataLoader::drop_last",
                name: "batch_size",
                detail: format!(
                    "batch size {} exceeds the dataset's {} samples, so dropping the last batch leaves none",
                    self.pos.batch_size, self.pos.dataset_len
                ),
            });
        }
        self.pos.drop_last = drop;
        Ok(self)
    }
    /// Shuffles each epoch (the default) or serves samples in index order.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.pos.shuffle = shuffle;
        self.make_order();
        self
    }
    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }
    /// The current epoch (0-based).
    pub fn epoch(&self) -> u64 {
        self.pos.epoch
    }
    /// Batches in one epoch.
    pub fn batches_per_epoch(&self) -> usize {
        let (n, b) = (self.pos.dataset_len, self.pos.batch_size);
        if self.pos.drop_last { n / b } else { n.div_ceil(b) }
    }
    /// The position to store in a checkpoint.
    pub fn position(&self) -> LoaderPosition {
        self.pos.clone()
    }
    /// Continues from a stored position. Refuses one made for another dataset length, batch
    /// size or batching mode (the order would differ), naming the mismatch.
    pub fn restore(&mut self, position: &LoaderPosition) -> Result<()> {
        let mine = &self.pos;
        let mismatch = |what: &str, stored: String, here: String| Error::State {
            context: "DataLoader::restore".into(),
            detail: format!("the stored position is for {what} {stored}, but this loader has {here}"),
        };
        if position.dataset_len != mine.dataset_len {
            return Err(mismatch(
                "a dataset of length",
                position.dataset_len.to_string(),
                mine.dataset_len.to_string(),
            ));
        }
        if position.batch_size != mine.batch_size {
            return Err(mismatch("batch size", position.batch_size.to_string(), mine.batch_size.to_string()));
        }
        if position.drop_last != mine.drop_last {
            return Err(mismatch("drop_last =", position.drop_last.to_string(), mine.drop_last.to_string()));
        }
        if position.shuffle != mine.shuffle {
            return Err(mismatch("shuffle =", position.shuffle.to_string(), mine.shuffle.to_string()));
        }
        if position.index > position.dataset_len {
            return Err(Error::State {
                context: "DataLoader::restore".into(),
                detail: format!("index {} is past the dataset's {} samples", position.index, position.dataset_len),
            });
        }
        self.pos = position.clone();
        self.make_order();
        Ok(())
    }
    /// The indices of the next batch, moving to the next epoch (reshuffled) when this one is
    /// used up.
    pub fn next_indices(&mut self) -> Vec<usize> {
        let (n, b) = (self.pos.dataset_len, self.pos.batch_size);
        let left = n - self.pos.index;
        if left == 0 || (self.pos.drop_last && left < b) {
            self.pos.epoch += 1;
            self.pos.index = 0;
            self.make_order();
        }
        let start = self.pos.index;
        let end = (start + b).min(n);
        self.pos.index = end;
        self.order[start..end].to_vec()
    }
    /// The samples of the next batch.
    pub fn next_batch(&mut self) -> Vec<D::Sample> {
        let indices = self.next_indices();
        indices.into_iter().map(|i| self.dataset.get(i)).collect()
    }

    fn make_order(&mut self) {
        self.order = (0..self.pos.dataset_len).collect();
        if self.pos.shuffle {
            // splitmix-style mixing of (seed, epoch) into a fresh seed: neighbouring epochs and
            // seeds give unrelated permutations.
            let mixed =
                self.pos.seed ^ self.pos.epoch.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
            Rng::seed(mixed).shuffle(&mut self.order);
        }
    }
}

impl<D: Dataset<Sample = TokenSample>> DataLoader<D> {
    /// The next batch, stacked into `[B, T]` token ids and targets.
    pub fn next_token_batch(&mut self) -> Result<TokenBatch> {
        TokenBatch::collate(&self.next_batch())
    }
}
