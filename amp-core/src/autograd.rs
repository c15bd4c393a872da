//! Reverse-mode autograd across precisions.
//!
//! Design notes:
//! - Every op whose inputs require gradients records a [`Node`]: its parents and a backward
//!   closure. The graph is owned by the tensors (reference counted), so it is freed as soon as
//!   the last tensor of a step is dropped; there is no global tape to clear.
//! - Nodes of every precision live in one graph: a gradient travels as an [`AnyTensor`] and
//!   each backward closure downcasts it to its output's precision. A cast's backward casts the
//!   gradient back, so a parameter's gradient always has the parameter's own precision.
//! - [`Tensor::backward`] returns a fresh [`Grads`] keyed by leaf id: nothing is accumulated
//!   into parameters (PyTorch's `zero_grad(set_to_none=True)` by construction). Gradient
//!   accumulation over micro-batches is an explicit [`Grads::accumulate`].
//! - Backward runs with recording off (no double backward) in a deterministic order (reverse
//!   of a depth-first topological order), so identical runs give bit-identical gradients.
//! - A tensor used several times gets its gradients summed in one buffer: a contribution is
//!   added in place when the running sum owns its buffer alone (nothing else can see it), and
//!   a narrow's gradient is added into its window of that buffer ([`Backward::Window`]), so
//!   `q`, `k` and `v` cut from one `qkv` tensor share one gradient buffer instead of three
//!   zero-padded full-size copies (PyTorch's `split` backward). Same sums in the same order as
//!   adding separate tensors: the values are unchanged.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::precision::{DType, Precision};
use crate::tensor::Tensor;

/// Identifies a tensor that takes part in autograd (a parameter, a leaf that requires
/// gradients, or an op's output). Stable for a [`crate::Param`] across optimizer steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

impl TensorId {
    pub(crate) fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TensorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A type-erased CPU tensor of any precision: how gradients travel through a mixed graph.
#[derive(Clone, Debug)]
pub enum AnyTensor {
    /// An f16 tensor.
    F16(Tensor<f16>),
    /// A bf16 tensor.
    BF16(Tensor<bf16>),
    /// An f32 tensor.
    F32(Tensor<f32>),
    /// An f64 tensor.
    F64(Tensor<f64>),
}

/// Runs `$body` with `$t` bound to the typed tensor inside an [`AnyTensor`].
#[macro_export]
#[doc(hidden)]
macro_rules! with_any {
    ($any:expr, $t:ident => $body:expr) => {
        match $any {
            $crate::AnyTensor::F16($t) => $body,
            $crate::AnyTensor::BF16($t) => $body,
            $crate::AnyTensor::F32($t) => $body,
            $crate::AnyTensor::F64($t) => $body,
        }
    };
}

impl AnyTensor {
    /// The precision of the tensor inside.
    pub fn dtype(&self) -> DType {
        match self {
            AnyTensor::F16(_) => DType::F16,
            AnyTensor::BF16(_) => DType::BF16,
            AnyTensor::F32(_) => DType::F32,
            AnyTensor::F64(_) => DType::F64,
        }
    }
    /// The shape of the tensor inside.
    pub fn shape(&self) -> &[usize] {
        with_any!(self, t => t.shape())
    }
    /// The typed tensor, if it has precision `E`.
    pub fn downcast<E: Precision>(self) -> Result<Tensor<E>> {
        E::from_any(self).map_err(|other| Error::GradPrecision {
            op: "AnyTensor::downcast",
            expected: E::DTYPE,
            found: other.dtype(),
        })
    }
    /// Borrows the typed tensor, if it has precision `E`.
    pub fn as_tensor<E: Precision>(&self) -> Option<&Tensor<E>> {
        E::any_ref(self)
    }
    /// Mutably borrows the typed tensor, if it has precision `E`.
    pub fn as_tensor_mut<E: Precision>(&mut self) -> Option<&mut Tensor<E>> {
        E::any_mut(self)
    }
    /// The values widened to f64 (for tests and reports).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        with_any!(self, t => t.to_vec().into_iter().map(|v| v.to_f64()).collect())
    }
}

impl<E: Precision> From<Tensor<E>> for AnyTensor {
    fn from(t: Tensor<E>) -> Self {
        E::into_any(t)
    }
}

/// A backward function: the output's gradient in, one optional gradient per parent out.
pub(crate) type BackwardFn = Box<dyn Fn(AnyTensor) -> Vec<Option<AnyTensor>> + Send + Sync>;

/// How a node hands its gradient on to its parents.
pub(crate) enum Backward {
    /// The general case: a closure from the output's gradient to one gradient per parent.
    Fn(BackwardFn),
    /// The output is entries `start..` of `dim` of its one parent (a narrow): the gradient is
    /// zero outside that window, so the engine adds it into the window of the parent's
    /// gradient buffer instead of materialising a zero-padded copy of the parent's shape.
    Window { dim: usize, start: usize },
}

/// One recorded operation (or a leaf when `backward` is `None`).
pub(crate) struct Node {
    pub(crate) id: TensorId,
    pub(crate) op: &'static str,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) parents: Vec<Option<Arc<Node>>>,
    /// `None` for a leaf.
    pub(crate) backward: Option<Backward>,
}

impl Node {
    pub(crate) fn leaf(dtype: DType, shape: &[usize]) -> Arc<Node> {
        Arc::new(Node {
            id: TensorId::fresh(),
            op: "leaf",
            dtype,
            shape: shape.to_vec(),
            parents: Vec::new(),
            backward: None,
        })
    }
}

impl Drop for Node {
    // Long chains (hundreds of layers) would recurse once per node; unlink iteratively.
    fn drop(&mut self) {
        let mut stack: Vec<Arc<Node>> = self.parents.drain(..).flatten().collect();
        while let Some(n) = stack.pop() {
            if let Ok(mut inner) = Arc::try_unwrap(n) {
                stack.extend(inner.parents.drain(..).flatten());
            }
        }
    }
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread record the graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Turns recording off on this thread until dropped (restores the previous mode).
#[must_use = "recording resumes as soon as the guard is dropped"]
pub struct NoGradGuard {
    previous: bool,
}

impl NoGradGuard {
    /// Starts a no-grad region.
    pub fn new() -> Self {
        NoGradGuard { previous: GRAD_ENABLED.with(|g| g.replace(false)) }
    }
}

impl Default for NoGradGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

/// Runs `f` with recording off (PyTorch's `torch.no_grad()`): evaluation, metrics, updates.
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _guard = NoGradGuard::new();
    f()
}

/// Gradients from one backward pass, keyed by the leaf they belong to, each in its leaf's
/// precision.
///
/// A `Grads` is always unscaled: a scaled loss's gradients stay inside the training step
/// ([`crate::scaler::TrainStep`]), so whatever holds a `Grads` may clip it or step an optimizer
/// with it. Each set (and its clones) carries the id of the backward pass that made it, so an
/// optimizer applies it once ([`crate::optim::Optimizer::step`]).
#[derive(Clone, Debug)]
pub struct Grads {
    map: HashMap<TensorId, AnyTensor>,
    /// The backward pass (or `Grads::new`) that made this set; kept by clones.
    generation: u64,
}

impl Default for Grads {
    fn default() -> Self {
        Self::new()
    }
}

impl Grads {
    /// An empty set (a new generation: an optimizer may apply it once).
    pub fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Grads { map: HashMap::new(), generation: NEXT.fetch_add(1, Ordering::Relaxed) }
    }
    /// Which backward pass made this set (clones share it): optimizers refuse to apply the
    /// same generation twice.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }
    /// The gradient of `t` (a parameter or a leaf that requires gradients), in `t`'s precision.
    pub fn get<E: Precision>(&self, t: &Tensor<E>) -> Option<&Tensor<E>> {
        self.map.get(&t.id()?).and_then(E::any_ref)
    }
    /// The gradient of the tensor with this id.
    pub fn get_by_id(&self, id: TensorId) -> Option<&AnyTensor> {
        self.map.get(&id)
    }
    /// Mutable access to the gradient with this id.
    pub fn get_mut_by_id(&mut self, id: TensorId) -> Option<&mut AnyTensor> {
        self.map.get_mut(&id)
    }
    /// Inserts (or replaces) a gradient.
    pub fn insert(&mut self, id: TensorId, grad: AnyTensor) {
        self.map.insert(id, grad);
    }
    /// Removes a gradient.
    pub fn remove(&mut self, id: TensorId) -> Option<AnyTensor> {
        self.map.remove(&id)
    }
    /// Number of gradients.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    /// Every (id, gradient), in id order (deterministic).
    pub fn iter(&self) -> impl Iterator<Item = (TensorId, &AnyTensor)> {
        let mut v: Vec<_> = self.map.iter().map(|(k, g)| (*k, g)).collect();
        v.sort_by_key(|(k, _)| *k);
        v.into_iter()
    }
    /// Every (id, gradient) mutably, in id order.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (TensorId, &mut AnyTensor)> {
        let mut v: Vec<_> = self.map.iter_mut().map(|(k, g)| (*k, g)).collect();
        v.sort_by_key(|(k, _)| *k);
        v.into_iter()
    }
    /// Adds `other` into `self` (micro-batch accumulation); ids missing on one side are kept.
    pub fn accumulate(&mut self, other: Grads) {
        for (id, g) in other.map {
            let merged = match self.map.remove(&id) {
                Some(mine) => accumulate(mine, g),
                None => g,
            };
            self.map.insert(id, merged);
        }
    }
}

/// The op of the first node (depth first from `t`) whose output is `dtype`, if any.
pub(crate) fn first_node_of<E: Precision>(t: &Tensor<E>, dtype: DType) -> Option<&'static str> {
    let mut stack: Vec<&Arc<Node>> = t.node.iter().collect();
    let mut seen: HashSet<TensorId> = HashSet::new();
    while let Some(n) = stack.pop() {
        if !seen.insert(n.id) {
            continue;
        }
        if n.dtype == dtype {
            return Some(n.op);
        }
        stack.extend(n.parents.iter().flatten());
    }
    None
}

/// Runs backward from `root` seeded with `seed` (same shape and precision as the root).
pub(crate) fn run_backward(root: &Arc<Node>, seed: AnyTensor) -> Grads {
    let _no_grad = NoGradGuard::new();
    // Backward closures run ops on gradients as written, also inside an autocast region.
    let _as_written = crate::__private::OffGuard::new();
    // Depth-first post-order, iteratively: parents before children.
    let mut order: Vec<Arc<Node>> = Vec::new();
    let mut seen: HashSet<TensorId> = HashSet::new();
    let mut stack: Vec<(Arc<Node>, usize)> = vec![(root.clone(), 0)];
    seen.insert(root.id);
    while let Some((node, next)) = stack.pop() {
        if next < node.parents.len() {
            let parent = node.parents[next].clone();
            stack.push((node, next + 1));
            if let Some(p) = parent
                && seen.insert(p.id)
            {
                stack.push((p, 0));
            }
        } else {
            order.push(node);
        }
    }
    let mut pending: HashMap<TensorId, AnyTensor> = HashMap::new();
    pending.insert(root.id, seed);
    let mut out = Grads::new();
    for node in order.iter().rev() {
        let Some(grad) = pending.remove(&node.id) else { continue };
        debug_assert_eq!(grad.shape(), &node.shape[..], "gradient shape of {} node", node.op);
        let Some(backward) = &node.backward else {
            out.map.insert(node.id, grad);
            continue;
        };
        let backward = match backward {
            Backward::Fn(f) => f,
            Backward::Window { dim, start } => {
                let Some(parent) = &node.parents[0] else { continue };
                assert_eq!(grad.dtype(), parent.dtype, "autograd invariant: {} backward precision", node.op);
                let acc = pending.remove(&parent.id);
                pending.insert(parent.id, add_window(acc, grad, &parent.shape, *dim, *start));
                continue;
            }
        };
        let parent_grads = backward(grad);
        debug_assert_eq!(parent_grads.len(), node.parents.len(), "{} backward arity", node.op);
        for (parent, g) in node.parents.iter().zip(parent_grads) {
            let (Some(parent), Some(g)) = (parent, g) else { continue };
            assert_eq!(
                g.shape(),
                &parent.shape[..],
                "autograd invariant: {} backward produced a gradient of shape {:?} for an input of shape {:?}",
                node.op,
                g.shape(),
                parent.shape
            );
            assert_eq!(g.dtype(), parent.dtype, "autograd invariant: {} backward precision", node.op);
            let merged = match pending.remove(&parent.id) {
                Some(acc) => accumulate(acc, g),
                None => g,
            };
            pending.insert(parent.id, merged);
        }
    }
    out
}

// ---- gradient accumulation ------------------------------------------------------------------

/// `a + b` for two gradients of one tensor, written into whichever buffer is owned alone
/// (a fresh tensor only when neither is). Each element is `a + b` in `E::Acc` rounded once,
/// exactly what the `add` op computes, so the sums do not depend on which path ran.
fn accumulate(a: AnyTensor, b: AnyTensor) -> AnyTensor {
    match (a, b) {
        (AnyTensor::F16(a), AnyTensor::F16(b)) => accumulate_typed(a, b).into(),
        (AnyTensor::BF16(a), AnyTensor::BF16(b)) => accumulate_typed(a, b).into(),
        (AnyTensor::F32(a), AnyTensor::F32(b)) => accumulate_typed(a, b).into(),
        (AnyTensor::F64(a), AnyTensor::F64(b)) => accumulate_typed(a, b).into(),
        (a, b) => {
            panic!("autograd invariant: gradients of one tensor in two precisions ({} and {})", a.dtype(), b.dtype())
        }
    }
}

fn accumulate_typed<E: Precision>(mut a: Tensor<E>, mut b: Tensor<E>) -> Tensor<E> {
    debug_assert_eq!(a.shape(), b.shape(), "accumulated gradients differ in shape");
    if let Some(dst) = owned_whole(&mut a) {
        add_assign(dst, &b.contiguous_data());
        a
    } else if let Some(dst) = owned_whole(&mut b) {
        // Addition commutes exactly (one rounding of the same exact sum).
        add_assign(dst, &a.contiguous_data());
        b
    } else {
        a.add(&b)
    }
}

/// Whether `t` views all of its buffer in order and is the buffer's only holder (so writing
/// into it changes nothing anyone else can see).
fn owns_whole<E: Precision>(t: &Tensor<E>) -> bool {
    t.layout.is_contiguous()
        && t.layout.offset == 0
        && t.storage.len() == t.numel()
        && Arc::strong_count(&t.storage) == 1
        && Arc::weak_count(&t.storage) == 0
}

/// The buffer of `t` as a mutable slice, when [`owns_whole`] holds.
fn owned_whole<E: Precision>(t: &mut Tensor<E>) -> Option<&mut [E]> {
    if owns_whole(t) { Arc::get_mut(&mut t.storage).map(|v| v.as_mut_slice()) } else { None }
}

/// `dst += src` element-wise in `E::Acc`, rounded once per element, in parallel chunks.
fn add_assign<E: Precision>(dst: &mut [E], src: &[E]) {
    assert_eq!(dst.len(), src.len(), "add_assign: length mismatch");
    crate::cpu::par_chunks_mut(dst, |ci, chunk| {
        let start = ci * crate::cpu::CHUNK;
        let src = &src[start..start + chunk.len()];
        let mut ba = [E::Acc::default(); crate::cpu::BUF];
        let mut bb = [E::Acc::default(); crate::cpu::BUF];
        for (d, s) in chunk.chunks_mut(crate::cpu::BUF).zip(src.chunks(crate::cpu::BUF)) {
            let (xa, xb) = (&mut ba[..d.len()], &mut bb[..d.len()]);
            E::load(d, xa);
            E::load(s, xb);
            for (x, y) in xa.iter_mut().zip(xb.iter()) {
                *x += *y;
            }
            E::store(xa, d);
        }
    });
}

/// Adds `g`, the gradient of the window `start..start + len` of `dim` of a tensor of `shape`,
/// into that tensor's running gradient `acc` (in place when `acc` owns its buffer alone; a
/// zero buffer with `g` copied into the window when there is none yet).
fn add_window(acc: Option<AnyTensor>, g: AnyTensor, shape: &[usize], dim: usize, start: usize) -> AnyTensor {
    fn typed<E: Precision>(
        acc: Option<AnyTensor>,
        g: Tensor<E>,
        shape: &[usize],
        dim: usize,
        start: usize,
    ) -> AnyTensor {
        let acc = acc.map(|a| a.downcast::<E>().unwrap_or_else(|e| panic!("narrow backward: {e}")));
        let (outer, size, inner) = crate::layout::outer_dim_inner(shape, dim);
        let run = g.shape()[dim] * inner;
        let gd = g.contiguous_data();
        // Where the window's `o`-th run lies in the parent's buffer, and in `gd`.
        let at = |o: usize| (o * size * inner + start * inner, o * run);
        let mut acc = match acc {
            Some(a) if owns_whole(&a) => a,
            // Shared (or a view): a private copy to add into, still one pass cheaper than
            // padding `g` and adding two full tensors.
            Some(a) => Tensor::from_parts(a.to_vec(), shape),
            None => {
                let mut full = crate::cpu::alloc::zeroed::<E>(shape.iter().product());
                for o in 0..outer {
                    let (dst, src) = at(o);
                    full[dst..dst + run].copy_from_slice(&gd[src..src + run]);
                }
                return Tensor::from_parts(full, shape).into();
            }
        };
        let buf = owned_whole(&mut acc).expect("owned above");
        for o in 0..outer {
            let (dst, src) = at(o);
            add_assign(&mut buf[dst..dst + run], &gd[src..src + run]);
        }
        acc.into()
    }
    with_any!(g, g => typed(acc, g, shape, dim, start))
}
