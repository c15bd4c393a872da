//! Dropout's kernel: `out = x * keep / (1 - p)` with the keep mask drawn from a seed.
//!
//! Design notes: the mask is a pure function of `(seed, element index)`: each chunk of
//! [`CHUNK`] elements has its own generator seeded from `(seed, chunk index)`, and each 64-bit
//! draw decides two elements with 32 bits each. So chunks run in parallel, the mask does not
//! depend on the thread count, and backward regenerates the same mask from the seed instead of
//! storing it (as PyTorch's CUDA dropout keeps a Philox seed and offset).

use super::{BUF, CHUNK, par_chunks_mut};
use crate::precision::{Accum, Precision};
use crate::rng::Rng;

/// The keep threshold: an element is kept when its 32 random bits are `>= threshold`, which
/// happens with probability `1 - p` (to within 2^-32).
fn threshold(p: f64) -> u32 {
    (p * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

/// `x * keep * scale` over contiguous `x`, with the mask drawn from `seed` and drop probability
/// `p` (the same seed, length and `p` always give the same mask).
pub(crate) fn apply<E: Precision>(x: &[E], p: f64, seed: u64) -> Vec<E> {
    let thr = threshold(p);
    let scale = E::Acc::c(1.0 / (1.0 - p));
    let zero = E::Acc::c(0.0);
    let mut out = super::alloc::take::<E>(x.len()); // every element is stored
    par_chunks_mut(
        &mut out,
        #[inline(always)]
        |ci, chunk| {
            let start = ci * CHUNK;
            let mut rng = Rng::seed(seed ^ (ci as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut buf = [E::Acc::default(); BUF];
            let mut bits = [0u32; BUF];
            // BUF is even, so every buffer but the last starts on a fresh 64-bit draw.
            for (j, o) in chunk.chunks_mut(BUF).enumerate() {
                let s = start + j * BUF;
                let n = o.len();
                // Draw first, then apply in a branch-free loop the compiler vectorises.
                for pair in bits[..n.next_multiple_of(2)].chunks_exact_mut(2) {
                    let r = rng.next_u64();
                    pair[0] = r as u32;
                    pair[1] = (r >> 32) as u32;
                }
                let b = &mut buf[..n];
                E::load(&x[s..s + n], b);
                for (v, &r) in b.iter_mut().zip(&bits[..n]) {
                    // Multiply rather than select so NaN inputs stay NaN, as in PyTorch.
                    *v *= if r >= thr { scale } else { zero };
                }
                E::store(b, o);
            }
        },
    );
    out
}
