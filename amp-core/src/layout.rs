//! Shapes, strides and broadcasting.
//!
//! Design notes: a tensor is a view (shape, strides, offset) over shared storage, so
//! transpose, permute, narrow and broadcast cost nothing; kernels that need contiguous input
//! call `contiguous()`, which copies only when the view is not already contiguous. Broadcast
//! dims have stride 0. Strides are in elements and never negative.

use crate::error::{Error, Result};

/// Shape, strides and offset of a view into storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    pub(crate) offset: usize,
}

impl Layout {
    /// A contiguous (row-major) layout of `shape` at offset 0.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: 0 }
    }
    /// The dims.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Where the view starts in its storage, in elements (a device outside this crate
    /// addresses storage with it).
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Whether the view is row-major contiguous (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }
    /// The same view with its dims reordered: dim `i` of the result is dim `perm[i]` of this
    /// one (no element moves).
    pub(crate) fn permuted(&self, perm: &[usize]) -> Layout {
        Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }
    /// This view with the same elements, in the same row-major order, seen as `shape` (same
    /// element count) without moving any: its strides, or `None` when no strides do it
    /// (PyTorch's `view` rule, which `reshape` follows before it copies). Each run of dims
    /// that the view walks as one (each dim's stride its inner neighbour's times that one's
    /// size) may be split or merged freely; a new dim may not straddle two runs.
    pub(crate) fn reshaped(&self, shape: &[usize]) -> Option<Layout> {
        debug_assert_eq!(self.numel(), shape.iter().product::<usize>());
        let view = |strides: Vec<usize>| Some(Layout { shape: shape.to_vec(), strides, offset: self.offset });
        if self.numel() == 0 || self.is_contiguous() {
            return view(contiguous_strides(shape));
        }
        // Size-1 dims hold no run: leave them out of the walk (a new size-1 dim takes any
        // stride).
        let old: Vec<(usize, usize)> =
            self.shape.iter().zip(&self.strides).filter(|&(&d, _)| d != 1).map(|(&d, &s)| (d, s)).collect();
        let mut strides = vec![0; shape.len()];
        // Walk both from the innermost dim, one run of old dims at a time.
        let mut new_dim = shape.len();
        let mut i = old.len();
        while i > 0 {
            // The run ends (going outwards) where a dim's stride is not the product below it.
            let base = old[i - 1].1;
            let mut run = old[i - 1].0;
            i -= 1;
            while i > 0 && old[i - 1].1 == base * run {
                run *= old[i - 1].0;
                i -= 1;
            }
            // New dims fill the run exactly, each stride the product of the new dims inside.
            let mut filled = 1;
            while new_dim > 0 && (filled < run || shape[new_dim - 1] == 1) {
                strides[new_dim - 1] = base * filled;
                filled *= shape[new_dim - 1];
                new_dim -= 1;
            }
            if filled != run {
                return None;
            }
        }
        // Only size-1 dims may remain.
        (0..new_dim).for_each(|d| strides[d] = 1);
        shape[..new_dim].iter().all(|&d| d == 1).then_some(())?;
        view(strides)
    }
    /// The order of the dims in memory, outermost first, when the view covers a span of memory
    /// exactly once and not in row-major order (a permutation of a contiguous tensor, such as
    /// W2's `qkv` seen as `[3, B, H, T, hd]`): `None` for a row-major view, and for one with
    /// gaps, overlaps or broadcast dims. Size-1 dims come first.
    pub(crate) fn memory_order(&self) -> Option<Vec<usize>> {
        let mut order: Vec<usize> = (0..self.shape.len()).collect();
        // Size-1 dims outermost (their strides say nothing), then by stride, largest first.
        order.sort_by_key(|&d| (self.shape[d] != 1, std::cmp::Reverse(self.strides[d])));
        let shape: Vec<usize> = order.iter().map(|&d| self.shape[d]).collect();
        let dense =
            order.iter().zip(contiguous_strides(&shape)).all(|(&d, s)| self.shape[d] == 1 || self.strides[d] == s);
        (dense && !self.is_contiguous()).then_some(order)
    }
    /// The layout seen through broadcasting to `shape` (which must be a valid broadcast target).
    pub(crate) fn broadcast_to(&self, shape: &[usize]) -> Layout {
        let pad = shape.len() - self.shape.len();
        let mut strides = vec![0; shape.len()];
        for i in 0..self.shape.len() {
            strides[pad + i] = if self.shape[i] == 1 { 0 } else { self.strides[i] };
        }
        Layout { shape: shape.to_vec(), strides, offset: self.offset }
    }
}

/// Row-major strides for `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i];
    }
    strides
}

/// The NumPy broadcast of two shapes.
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return Err(Error::Broadcast { op, lhs: a.to_vec(), rhs: b.to_vec() }),
        };
    }
    Ok(out)
}

/// Checks `dim < rank`.
pub(crate) fn check_dim(op: &'static str, dim: usize, shape: &[usize]) -> Result<()> {
    if dim < shape.len() {
        Ok(())
    } else {
        Err(Error::DimOutOfRange { op, dim, rank: shape.len(), shape: shape.to_vec() })
    }
}

/// Splits `shape` around `dim` into (outer, dim size, inner) element counts.
pub(crate) fn outer_dim_inner(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        assert_eq!(broadcast_shapes("t", &[2, 1, 3], &[4, 1]).unwrap(), vec![2, 4, 3]);
        assert_eq!(broadcast_shapes("t", &[], &[3]).unwrap(), vec![3]);
        assert_eq!(broadcast_shapes("t", &[0, 3], &[1, 3]).unwrap(), vec![0, 3]);
        let e = broadcast_shapes("add", &[2, 3], &[4]).unwrap_err();
        assert_eq!(e.to_string(), "add: shapes [2, 3] and [4] cannot be broadcast together");
    }

    /// Element `flat` (row-major) of a view: its storage index.
    fn index_of(l: &Layout, mut flat: usize) -> usize {
        let mut at = l.offset;
        for (&d, &s) in l.shape.iter().zip(&l.strides).rev() {
            at += flat % d * s;
            flat /= d;
        }
        at
    }

    /// Every factorisation of `n` into `rank` dims (with 1s), for the shapes a view is
    /// reshaped into.
    fn shapes_of(n: usize, rank: usize) -> Vec<Vec<usize>> {
        if rank == 0 {
            return if n == 1 { vec![vec![]] } else { vec![] };
        }
        let mut out = vec![];
        for d in (1..=n).filter(|d| n.is_multiple_of(*d)) {
            for mut rest in shapes_of(n / d, rank - 1) {
                rest.insert(0, d);
                out.push(rest);
            }
        }
        out
    }

    /// Against the definition: a reshaped view, when there is one, reads the same storage
    /// element for every flat index; and there is one whenever some strides would do it,
    /// checked here by brute force over a small stride range for a few targets.
    #[test]
    fn reshaped_views_read_the_same_elements() {
        let bases: [(&[usize], &[usize]); 3] = [(&[2, 3, 4], &[0, 1, 2]), (&[2, 1, 6], &[2, 0, 1]), (&[4, 6], &[1, 0])];
        let mut views = vec![];
        for (shape, perm) in bases {
            let permuted = Layout::contiguous(shape).permuted(perm);
            // Narrow the outermost dim of size > 1 to its second half, too.
            let mut narrowed = permuted.clone();
            if let Some(d) = narrowed.shape.iter().position(|&d| d > 1) {
                narrowed.offset += narrowed.shape[d] / 2 * narrowed.strides[d];
                narrowed.shape[d] -= narrowed.shape[d] / 2;
            }
            views.extend([permuted, narrowed]);
        }
        // W2's q: [1, B, H, T, hd] narrowed from the permuted [3, B, H, T, hd] of [B, T, 3, H, hd].
        views.push(Layout { shape: vec![1, 2, 2, 3, 4], strides: vec![8, 72, 4, 24, 1], offset: 8 });
        let (mut viewed, mut searched) = (0, 0);
        for l in &views {
            for shape in (1..=4).flat_map(|rank| shapes_of(l.numel(), rank)) {
                match l.reshaped(&shape) {
                    Some(v) => {
                        viewed += 1;
                        assert_eq!(v.shape, shape);
                        for flat in 0..l.numel() {
                            assert_eq!(index_of(&v, flat), index_of(l, flat), "{l:?} as {shape:?}: {v:?}");
                        }
                    }
                    None if shape.len() <= 2 && l.numel() <= 12 => {
                        // No strides below 80 reproduce the elements either.
                        let fits = |strides: &[usize]| {
                            let v = Layout { shape: shape.clone(), strides: strides.to_vec(), offset: l.offset };
                            (0..l.numel()).all(|f| index_of(&v, f) == index_of(l, f))
                        };
                        let found = match shape.len() {
                            1 => (0..80).any(|a| fits(&[a])),
                            _ => (0..80).any(|a| (0..80).any(|b| fits(&[a, b]))),
                        };
                        assert!(!found, "{l:?} as {shape:?} has a view the rule missed");
                        searched += 1;
                    }
                    None => {}
                }
            }
        }
        assert!(viewed > 100 && searched > 10, "{viewed} views, {searched} searched");
        // The q of W2's attention drops its size-1 dim as a view.
        let q = &views[views.len() - 1];
        assert_eq!(q.reshaped(&[2, 2, 3, 4]).unwrap().strides, vec![72, 4, 24, 1]);
        // A transposed matrix flattens only by a copy.
        assert!(Layout { shape: vec![3, 2], strides: vec![1, 3], offset: 0 }.reshaped(&[6]).is_none());
    }

    #[test]
    fn memory_order_of_dense_permuted_views() {
        let l =
            |shape: &[usize], strides: &[usize]| Layout { shape: shape.to_vec(), strides: strides.to_vec(), offset: 0 };
        // Row-major: no order to keep.
        assert_eq!(Layout::contiguous(&[2, 3, 4]).memory_order(), None);
        // W2's qkv [B, T, 3, H, hd] seen as [3, B, H, T, hd].
        let qkv = l(&[3, 2, 4, 5, 8], &[32, 5 * 96, 8, 96, 1]);
        assert_eq!(qkv.memory_order(), Some(vec![1, 3, 0, 2, 4]));
        assert_eq!(l(&[3, 2], &[1, 3]).memory_order(), Some(vec![1, 0]));
        // A size-1 dim goes first, whatever its stride.
        assert_eq!(l(&[3, 1, 2], &[1, 7, 3]).memory_order(), Some(vec![1, 2, 0]));
        // Gaps (a narrow), broadcast dims and overlaps have none.
        assert_eq!(l(&[2, 3], &[1, 4]).memory_order(), None);
        assert_eq!(l(&[2, 3], &[0, 1]).memory_order(), None);
        assert_eq!(l(&[2, 3], &[1, 1]).memory_order(), None);
    }

    #[test]
    fn contiguity() {
        let l = Layout::contiguous(&[2, 3]);
        assert!(l.is_contiguous());
        let t = Layout { shape: vec![3, 2], strides: vec![1, 3], offset: 0 };
        assert!(!t.is_contiguous());
        assert_eq!(l.broadcast_to(&[4, 2, 3]).strides, vec![0, 3, 1]);
    }
}
