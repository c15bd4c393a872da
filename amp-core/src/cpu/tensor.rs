//! Host access to CPU tensors: their values as slices, for the CPU-only code (the optimizers'
//! and the autocast cache's loops) and the CPU kernels.

use std::sync::Arc;

use super::backend::{Contiguous, view};
use crate::backend::Cpu;
use crate::precision::Precision;
use crate::tensor::Tensor;

impl<E: Precision> Tensor<E, Cpu> {
    /// The view's values as one contiguous slice (copied into a pooled buffer first if the
    /// view is strided).
    pub(crate) fn contiguous_data(&self) -> Contiguous<'_, E> {
        view(&self.storage, &self.layout)
    }
    /// Mutable contiguous data, copying only if the storage is shared or the view is not the
    /// whole storage. Used by in-place updates (optimizers, unscale) on tensors they own.
    pub fn make_mut(&mut self) -> &mut [E] {
        self.make_exclusive();
        Arc::get_mut(&mut self.storage).expect("made exclusive above").as_mut_slice()
    }
}
