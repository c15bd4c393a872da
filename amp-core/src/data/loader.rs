//! [`DataLoader`]: seeded per-epoch shuffling, batching, and a position a checkpoint can store.

use super::{BatchDataset, Dataset, TokenBatch, TokenSample};
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
        self.batches_for(self.pos.dataset_len)
    }
    /// Batches `samples` samples make: full ones, plus a short one unless `drop_last`.
    fn batches_for(&self, samples: usize) -> usize {
        let b = self.pos.batch_size;
        if self.pos.drop_last { samples / b } else { samples.div_ceil(b) }
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
        if self.epoch_used_up() {
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

    /// Whether the current epoch has no batch left to serve (every sample handed out, or
    /// only a short remainder that `drop_last` drops): the next batch starts a new epoch.
    fn epoch_used_up(&self) -> bool {
        let left = self.pos.dataset_len - self.pos.index;
        left == 0 || (self.pos.drop_last && left < self.pos.batch_size)
    }
    /// Batches the next [`DataLoader::epoch_batches`] serves: those left in the current epoch,
    /// or a whole epoch if the current one is used up.
    fn batches_left_in_epoch(&self) -> usize {
        if self.epoch_used_up() {
            return self.batches_per_epoch();
        }
        self.batches_for(self.pos.dataset_len - self.pos.index)
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

impl<D: BatchDataset> DataLoader<D> {
    /// The next batch, gathered by the dataset in one pass ([`BatchDataset::batch`]); for a
    /// [`TensorDataset`](super::TensorDataset) the `[B, ...]` inputs and labels, leaf tensors
    /// without autograd history. Moves to the next epoch (reshuffled) when this one is used up.
    pub fn next_tensor_batch(&mut self) -> Result<D::Batch> {
        let indices = self.next_indices();
        self.dataset.batch(&indices)
    }
    /// One epoch's batches, as PyTorch's `for x, y in loader:`: the batches left in the current
    /// epoch (all of them on a fresh loader, the rest after a restore mid-epoch), or the whole
    /// next epoch if the current one is used up. Respects `drop_last`; the loader's position
    /// advances batch by batch, so a checkpoint taken inside the loop
    /// ([`EpochBatches::position`]) resumes after the last batch served.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// use amp::data::{DataLoader, TensorDataset};
    /// use amp::{Indices, Tensor};
    ///
    /// let data = TensorDataset::new(Tensor::<f32>::zeros(&[10, 2]), Indices::from_vec(vec![0; 10], &[10])).unwrap();
    /// let mut loader = DataLoader::new(data, 4, 0).unwrap().drop_last(true).unwrap();
    /// for epoch in 0..2 {
    ///     assert_eq!(loader.epoch_batches().count(), 2); // the 2 left over are dropped
    ///     assert_eq!(loader.epoch(), epoch);
    /// }
    /// ```
    pub fn epoch_batches(&mut self) -> EpochBatches<'_, D> {
        let left = self.batches_left_in_epoch();
        EpochBatches { loader: self, left }
    }
}

/// The batches of one epoch of a [`DataLoader`], from [`DataLoader::epoch_batches`]; each
/// item is [`DataLoader::next_tensor_batch`]'s result.
pub struct EpochBatches<'a, D> {
    loader: &'a mut DataLoader<D>,
    /// Batches still to serve in this epoch.
    left: usize,
}

impl<D> EpochBatches<'_, D> {
    /// The loader's position after the batches served so far (what a checkpoint taken inside
    /// the loop stores; [`DataLoader::position`] while the loader is borrowed).
    pub fn position(&self) -> LoaderPosition {
        self.loader.pos.clone()
    }
}

impl<D: BatchDataset> Iterator for EpochBatches<'_, D> {
    type Item = Result<D::Batch>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        Some(self.loader.next_tensor_batch())
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

/// Shows the batches left and the loader's position.
impl<D> std::fmt::Debug for EpochBatches<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochBatches").field("left", &self.left).field("loader", &self.loader).finish()
    }
}

impl<D: BatchDataset> ExactSizeIterator for EpochBatches<'_, D> {}
