//! Reverse-mode autograd across precisions.
//!
//! Design notes:
//! - Every op whose inputs require gradients records a `Node`: its parents and a backward
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
//!   a narrow's gradient is added into its window of that buffer (`Backward::Window`), so
//!   `q`, `k` and `v` cut from one `qkv` tensor share one gradient buffer instead of three
//!   zero-padded full-size copies; windows that tile the parent exactly (and nothing else
//!   contributes) are concatenated instead, with no zero fill (PyTorch's `split` backward).
//!   Same sums in the same order as adding separate tensors: the values are unchanged, but
//!   for the sign of a zero (a concatenated -0 stays -0, where 0 + -0 gave +0).
//! - A norm's backward may add its input's gradient into that running sum as its kernel
//!   writes it (`Backward::FnInto`): the residual stream's norms, whose input already has
//!   the skip connection's gradient. The same one rounding per element as the separate add.
//! - Where narrows tile a tensor and each reaches one op through views alone (W2's `q`, `k`
//!   and `v`, each reshaped, `k` also transposed, each the operand of one product), that op
//!   may write its operand's gradient straight into the tensor's gradient buffer
//!   (`Backward::FnDest`): the engine allocates the buffer (in the tensor's memory order, as
//!   the concatenation would lay it out) when the first such op asks, and follows each window
//!   down the views to the layout the op writes. The same values as the concatenation: each
//!   element is written once, by the product that computed it; a window whose gradient came
//!   the usual way is copied in, and one that got none is zero.
//! - A graph made before one of its leaves was updated (an optimizer step, `Param::set`, a
//!   weight load) is refused by the backward pass, as PyTorch refuses a tensor "modified by an
//!   inplace operation": copy on write would otherwise keep the old values alive for it, and
//!   its gradients would be for weights that no longer exist (a micro-batch's loss computed
//!   before the last step, accumulated after it). A process-wide clock orders the two: every
//!   node keeps the clock it was made at, a leaf the clock of its last update.
//! - Each [`Grads`] (and its clones) records which parameters it was applied to, so no
//!   parameter gets one backward pass's gradients twice, whichever optimizer (or clone of
//!   one) applies them; and whether its graph ran through f16 ops with no loss scaling, which
//!   an optimizer refuses (f16 gradients underflow without it; the training step's
//!   `GradScaler` is the way).

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use half::{bf16, f16};

use crate::backend::{Cpu, Device};
use crate::error::{Error, Result};
use crate::layout::Layout;
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

/// A type-erased tensor of any precision on device `D`: how gradients travel through a mixed
/// graph.
#[derive(Clone, Debug)]
pub enum AnyTensor<D: Device = Cpu> {
    /// An f16 tensor.
    F16(Tensor<f16, D>),
    /// A bf16 tensor.
    BF16(Tensor<bf16, D>),
    /// An f32 tensor.
    F32(Tensor<f32, D>),
    /// An f64 tensor.
    F64(Tensor<f64, D>),
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

impl<D: Device> AnyTensor<D> {
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
    pub fn downcast<E: Precision>(self) -> Result<Tensor<E, D>> {
        E::from_any(self).map_err(|other| Error::GradPrecision {
            op: "AnyTensor::downcast",
            expected: E::DTYPE,
            found: other.dtype(),
        })
    }
    /// Borrows the typed tensor, if it has precision `E`.
    pub fn as_tensor<E: Precision>(&self) -> Option<&Tensor<E, D>> {
        E::any_ref(self)
    }
    /// Mutably borrows the typed tensor, if it has precision `E`.
    pub fn as_tensor_mut<E: Precision>(&mut self) -> Option<&mut Tensor<E, D>> {
        E::any_mut(self)
    }
    /// The values widened to f64 (for tests and reports).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        with_any!(self, t => t.to_vec().into_iter().map(|v| v.to_f64()).collect())
    }
}

impl<E: Precision, D: Device> From<Tensor<E, D>> for AnyTensor<D> {
    fn from(t: Tensor<E, D>) -> Self {
        E::into_any(t)
    }
}

/// A backward function: the output's gradient in, one optional gradient per parent out.
pub(crate) type BackwardFn<D> = Box<dyn Fn(AnyTensor<D>) -> Vec<Option<AnyTensor<D>>> + Send + Sync>;

/// A backward function handed its first parent's gradient so far (if any) with the output's
/// gradient; the first gradient it returns is that parent's total.
pub(crate) type BackwardIntoFn<D> =
    Box<dyn Fn(AnyTensor<D>, Option<AnyTensor<D>>) -> Vec<Option<AnyTensor<D>>> + Send + Sync>;

/// A backward function that may write some parents' gradients into the destinations the
/// engine offers ([`GradDests`]), returning `None` for those.
pub(crate) type BackwardDestFn<D> =
    Box<dyn Fn(AnyTensor<D>, &mut GradDests<'_, D>) -> Vec<Option<AnyTensor<D>>> + Send + Sync>;

/// How a view op's output layout follows from its input's (reshape, permute): what the engine
/// applies to a narrow's window to follow it down to the op that reads the view.
#[derive(Clone, Debug)]
pub(crate) enum ViewOp {
    /// [`Layout::reshaped`] to this shape.
    Reshape(Vec<usize>),
    /// [`Layout::permuted`] by this permutation.
    Permute(Vec<usize>),
}

impl ViewOp {
    fn apply(&self, l: &Layout) -> Option<Layout> {
        match self {
            ViewOp::Reshape(shape) => l.reshaped(shape),
            ViewOp::Permute(perm) => Some(l.permuted(perm)),
        }
    }
}

/// How a node hands its gradient on to its parents.
pub(crate) enum Backward<D: Device> {
    /// The general case: a closure from the output's gradient to one gradient per parent.
    Fn(BackwardFn<D>),
    /// [`Backward::Fn`] for an op whose kernel adds its first input's gradient into that
    /// input's gradient so far as it writes it: a norm of the residual stream, whose gradient
    /// the skip connection delivered first. The engine hands that running gradient over and
    /// takes the first gradient returned as the total (it must return one), which saves the
    /// separate add's pass over memory.
    FnInto(BackwardIntoFn<D>),
    /// The output is entries `start..` of `dim` of its one parent (a narrow): the gradient is
    /// zero outside that window, so the engine adds it into the window of the parent's
    /// gradient buffer instead of materialising a zero-padded copy of the parent's shape.
    /// `order` is the parent's [`Layout::memory_order`], if it has one: windows that tile the
    /// parent are concatenated in that order, so the parent's gradient has the parent's
    /// strides and the ops that made the parent as a view (W2's permute and reshape of `qkv`)
    /// pass it on without a copy.
    Window { dim: usize, start: usize, order: Option<Arc<[usize]>> },
    /// [`Backward::Fn`] for an op that can write a parent's gradient into a view of a buffer
    /// the engine owns, when the engine offers one ([`GradDests`]): a product whose operand is
    /// a view of a narrow (module notes).
    FnDest(BackwardDestFn<D>),
}

/// One recorded operation (or a leaf when `backward` is `None`).
pub(crate) struct Node<D: Device = Cpu> {
    pub(crate) id: TensorId,
    pub(crate) op: &'static str,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) parents: Vec<Option<Arc<Node<D>>>>,
    /// `None` for a leaf.
    pub(crate) backward: Option<Backward<D>>,
    /// For a view op (its output shares its one parent's storage): how its layout follows
    /// from the parent's.
    pub(crate) view: Option<ViewOp>,
    /// The [`clock`] when this node was made.
    pub(crate) made_at: u64,
    /// For a leaf, the [`clock`] at its last update in place (0: never); unused otherwise.
    pub(crate) updated_at: AtomicU64,
}

/// The clock that orders nodes and leaf updates (see the module notes): nodes read it, an
/// update advances it.
static CLOCK: AtomicU64 = AtomicU64::new(1);

/// The clock's time now, for a node being made.
pub(crate) fn clock() -> u64 {
    CLOCK.load(Ordering::Relaxed)
}

impl<D: Device> Node<D> {
    pub(crate) fn leaf(dtype: DType, shape: &[usize]) -> Arc<Node<D>> {
        Arc::new(Node {
            id: TensorId::fresh(),
            op: "leaf",
            dtype,
            shape: shape.to_vec(),
            parents: Vec::new(),
            backward: None,
            view: None,
            made_at: clock(),
            updated_at: AtomicU64::new(0),
        })
    }
    /// Marks this leaf's values as updated in place: graphs made before now are stale.
    pub(crate) fn mark_updated(&self) {
        self.updated_at.store(CLOCK.fetch_add(1, Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

impl<D: Device> Drop for Node<D> {
    // Long chains (hundreds of layers) would recurse once per node; unlink iteratively.
    fn drop(&mut self) {
        let mut stack: Vec<Arc<Node<D>>> = self.parents.drain(..).flatten().collect();
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
#[derive(Debug)]
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
/// with it. Each set (and its clones) records the parameters it was applied to and when its
/// backward pass ran, so an optimizer ([`crate::optim::Optimizer::step`]) applies it to a
/// parameter once, and not after that parameter was updated.
#[derive(Clone, Debug)]
pub struct Grads<D: Device = Cpu> {
    map: HashMap<TensorId, AnyTensor<D>>,
    /// The parameters these gradients were applied to, shared by clones: each gets them once.
    applied: Arc<Mutex<HashSet<TensorId>>>,
    /// The op of an f16 node of the graph they came from, when its loss was not scaled.
    unscaled_f16: Option<&'static str>,
    /// The [`clock`] when the oldest backward pass whose gradients are in this set ran: a
    /// parameter updated since has moved on from the values they are for.
    made_at: u64,
}

impl Default for Grads {
    fn default() -> Self {
        Self::new()
    }
}

impl Grads {
    /// An empty set of CPU gradients (a new generation: an optimizer may apply it once).
    pub fn new() -> Self {
        Self::empty()
    }
}

impl<D: Device> Grads<D> {
    /// An empty set on any device, applied to nothing yet.
    pub(crate) fn empty() -> Self {
        Grads { map: HashMap::new(), applied: Arc::default(), unscaled_f16: None, made_at: clock() }
    }
    /// The first of `ids` these gradients (or a clone of them) were already applied to.
    pub(crate) fn first_applied(&self, ids: impl IntoIterator<Item = TensorId>) -> Option<TensorId> {
        let applied = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        ids.into_iter().find(|id| applied.contains(id))
    }
    /// The [`clock`] of the oldest backward pass in this set.
    pub(crate) fn made_at(&self) -> u64 {
        self.made_at
    }
    /// Records that these gradients were applied to `ids`.
    pub(crate) fn mark_applied(&self, ids: impl IntoIterator<Item = TensorId>) {
        self.applied.lock().unwrap_or_else(|e| e.into_inner()).extend(ids);
    }
    /// The op of an f16 node of the graph these gradients came from, when its loss was not
    /// scaled (an optimizer refuses them: f16 gradients underflow without loss scaling).
    pub(crate) fn unscaled_f16(&self) -> Option<&'static str> {
        self.unscaled_f16
    }
    /// Marks these gradients as those of a scaled loss (the training step's, with a
    /// `GradScaler`).
    pub(crate) fn mark_scaled(&mut self) {
        self.unscaled_f16 = None;
    }
    /// The gradient of `t` (a parameter or a leaf that requires gradients), in `t`'s precision.
    pub fn get<E: Precision>(&self, t: &Tensor<E, D>) -> Option<&Tensor<E, D>> {
        self.map.get(&t.id()?).and_then(E::any_ref)
    }
    /// The gradient of the tensor with this id.
    pub fn get_by_id(&self, id: TensorId) -> Option<&AnyTensor<D>> {
        self.map.get(&id)
    }
    /// Mutable access to the gradient with this id.
    pub fn get_mut_by_id(&mut self, id: TensorId) -> Option<&mut AnyTensor<D>> {
        self.map.get_mut(&id)
    }
    /// Inserts (or replaces) a gradient.
    pub fn insert(&mut self, id: TensorId, grad: AnyTensor<D>) {
        self.map.insert(id, grad);
    }
    /// Removes a gradient.
    pub fn remove(&mut self, id: TensorId) -> Option<AnyTensor<D>> {
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
    pub fn iter(&self) -> impl Iterator<Item = (TensorId, &AnyTensor<D>)> {
        let mut v: Vec<_> = self.map.iter().map(|(k, g)| (*k, g)).collect();
        v.sort_by_key(|(k, _)| *k);
        v.into_iter()
    }
    /// Every (id, gradient) mutably, in id order.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (TensorId, &mut AnyTensor<D>)> {
        let mut v: Vec<_> = self.map.iter_mut().map(|(k, g)| (*k, g)).collect();
        v.sort_by_key(|(k, _)| *k);
        v.into_iter()
    }
    /// Adds `other` into `self` (micro-batch accumulation); ids missing on one side are kept.
    pub fn accumulate(&mut self, other: Grads<D>) {
        self.unscaled_f16 = self.unscaled_f16.or(other.unscaled_f16);
        self.made_at = self.made_at.min(other.made_at);
        // What `other` was applied to, its sum with these is too (unless they share a record).
        if !Arc::ptr_eq(&self.applied, &other.applied) {
            let theirs: Vec<TensorId> =
                other.applied.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect();
            self.mark_applied(theirs);
        }
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
pub(crate) fn first_node_of<E: Precision, D: Device>(t: &Tensor<E, D>, dtype: DType) -> Option<&'static str> {
    let mut stack: Vec<&Arc<Node<D>>> = t.node.iter().collect();
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

/// Refuses a graph that uses a leaf updated in place after the graph was made (module notes).
fn check_fresh<D: Device>(order: &[Arc<Node<D>>]) -> Result<()> {
    for node in order {
        for leaf in node.parents.iter().flatten().filter(|p| p.backward.is_none()) {
            if leaf.updated_at.load(Ordering::Relaxed) > node.made_at {
                return Err(Error::Backward {
                    detail: format!(
                        "this loss was computed before one of the parameters it uses (shape {:?}, an input of \
                         `{}`) was updated in place (an optimizer step, `Param::set` or a weight load), so its \
                         gradients would be for values that no longer exist. Compute the loss again after the \
                         update; a model that is only read (an EMA teacher, a target network) goes under \
                         `no_grad` or `.detach()`, as it would have `requires_grad_(False)` in PyTorch (which \
                         refuses such a graph too: \"one of the variables needed for gradient computation has \
                         been modified by an inplace operation\")",
                        leaf.shape, node.op
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Runs backward from `root` seeded with `seed` (same shape and precision as the root).
pub(crate) fn run_backward<D: Device>(root: &Arc<Node<D>>, seed: AnyTensor<D>) -> Result<Grads<D>> {
    let _no_grad = NoGradGuard::new();
    // Backward closures run ops on gradients as written, also inside an autocast region.
    let _as_written = crate::__private::OffGuard::new();
    // Depth-first post-order, iteratively: parents before children.
    let mut order: Vec<Arc<Node<D>>> = Vec::new();
    let mut seen: HashSet<TensorId> = HashSet::new();
    let mut stack: Vec<(Arc<Node<D>>, usize)> = vec![(root.clone(), 0)];
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
    check_fresh(&order)?;
    let mut pending: HashMap<TensorId, AnyTensor<D>> = HashMap::new();
    // Narrows' gradients not yet added into their parent's gradient, in arrival order: they
    // are added when the parent's gradient is needed or another contribution to it arrives,
    // so windows that tile the parent exactly (q, k and v of one qkv) become one
    // concatenation instead of a zero fill and a write per window.
    let mut windows: HashMap<TensorId, Vec<Window<D>>> = HashMap::new();
    // Tensors whose narrows' gradients may be written in place, and where (module notes).
    let (mut tiled, dest_of) = plan_in_place(&order);
    let dev = with_any!(&seed, t => t.device.clone());
    pending.insert(root.id, seed);
    let mut out = Grads::empty();
    out.unscaled_f16 = order.iter().find(|n| n.dtype == DType::F16).map(|n| n.op);
    for node in order.iter().rev() {
        if let Some(t) = tiled.remove(&node.id)
            && t.buf.is_some()
        {
            // Every contribution to this tensor's gradient is one of its narrows' (the plan).
            let arrived = windows.remove(&node.id).unwrap_or_default();
            pending.insert(node.id, t.finish(&dev, arrived));
        }
        if let Some(ws) = windows.remove(&node.id) {
            let acc = pending.remove(&node.id);
            pending.insert(node.id, add_windows(acc, ws, node));
        }
        let Some(grad) = pending.remove(&node.id) else { continue };
        debug_assert_eq!(grad.shape(), &node.shape[..], "gradient shape of {} node", node.op);
        let Some(backward) = &node.backward else {
            out.map.insert(node.id, grad);
            continue;
        };
        let (parent_grads, first_is_total) = match backward {
            Backward::Fn(f) => (f(grad), false),
            Backward::FnDest(f) => {
                let slots = node.parents.iter().map(|p| p.as_ref().and_then(|p| dest_of.get(&p.id).cloned())).collect();
                let mut dests = GradDests { slots, tiled: &mut tiled, dev: &dev };
                let grads = f(grad, &mut dests);
                for (i, slot) in dests.slots.iter().enumerate() {
                    if let Some(d) = slot {
                        let written = dests.tiled[&d.tensor].windows[d.window].written;
                        assert!(
                            !(written && grads[i].is_some()),
                            "autograd invariant: {} backward wrote a gradient in place and returned it",
                            node.op
                        );
                    }
                }
                (grads, false)
            }
            Backward::FnInto(f) => {
                let acc = node.parents[0].as_ref().and_then(|p| running_grad(&mut pending, &mut windows, p));
                let grads = f(grad, acc);
                assert!(grads[0].is_some(), "autograd invariant: {} backward returned no total", node.op);
                (grads, true)
            }
            Backward::Window { dim, start, order } => {
                let Some(parent) = &node.parents[0] else { continue };
                assert_eq!(grad.dtype(), parent.dtype, "autograd invariant: {} backward precision", node.op);
                let order = order.clone();
                windows.entry(parent.id).or_default().push(Window { dim: *dim, start: *start, order, grad });
                continue;
            }
        };
        debug_assert_eq!(parent_grads.len(), node.parents.len(), "{} backward arity", node.op);
        for (i, (parent, g)) in node.parents.iter().zip(parent_grads).enumerate() {
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
            let merged = if i == 0 && first_is_total {
                g // the running gradient is in it already
            } else {
                match running_grad(&mut pending, &mut windows, parent) {
                    Some(acc) => accumulate(acc, g),
                    None => g,
                }
            };
            pending.insert(parent.id, merged);
        }
    }
    Ok(out)
}

/// Takes `node`'s gradient so far out of `pending`, with its narrows' windows added in
/// first (earlier windows first: contributions are summed in arrival order).
fn running_grad<D: Device>(
    pending: &mut HashMap<TensorId, AnyTensor<D>>,
    windows: &mut HashMap<TensorId, Vec<Window<D>>>,
    node: &Node<D>,
) -> Option<AnyTensor<D>> {
    let acc = pending.remove(&node.id);
    match windows.remove(&node.id) {
        Some(ws) => Some(add_windows(acc, ws, node)),
        None => acc,
    }
}

// ---- narrows' gradients written in place -----------------------------------------------------

/// A tensor whose narrows tile it and are its only consumers, each reaching one op through
/// views (module notes): its gradient buffer, once an op asked for it, and its windows.
struct Tiled<D: Device> {
    dtype: DType,
    /// The buffer's layout: the tensor's shape in its memory order.
    layout: Layout,
    buf: Option<AnyTensor<D>>,
    windows: Vec<TiledWindow>,
}

struct TiledWindow {
    dim: usize,
    start: usize,
    len: usize,
    /// Whether an op wrote this window's gradient into the buffer.
    written: bool,
}

/// Where an op may write its operand's gradient: window `window` of tensor `tensor`'s buffer,
/// seen through the views between them as `layout`.
#[derive(Clone)]
pub(crate) struct Dest {
    tensor: TensorId,
    window: usize,
    layout: Layout,
}

/// The destinations the engine offers one node's backward, one slot per parent
/// (`Backward::FnDest`).
pub(crate) struct GradDests<'a, D: Device> {
    slots: Vec<Option<Dest>>,
    tiled: &'a mut HashMap<TensorId, Tiled<D>>,
    dev: &'a D,
}

impl<D: Device> GradDests<'_, D> {
    /// Lets `write` fill parent `i`'s destination, every element of it (the storage and the
    /// destination's layout in it); the backward then returns `None` for that parent.
    /// Returns false, calling nothing, when no destination is offered for it.
    pub(crate) fn write<E: Precision>(&mut self, i: usize, write: impl FnOnce(&mut D::Storage<E>, &Layout)) -> bool {
        let Some(Some(d)) = self.slots.get(i) else { return false };
        let t = self.tiled.get_mut(&d.tensor).expect("a destination's tensor is planned");
        assert_eq!(t.dtype, E::DTYPE, "autograd invariant: gradient destination precision");
        let (dev, layout) = (self.dev, &t.layout);
        let buf = t.buf.get_or_insert_with(|| scratch(dev, t.dtype, layout.clone()));
        let buf = buf.as_tensor_mut::<E>().expect("the buffer has the tensor's precision");
        write(&mut buf.storage, &d.layout);
        t.windows[d.window].written = true;
        true
    }
}

/// A tensor with `layout` whose values are not set yet: every element is written before the
/// tensor is read.
fn scratch<D: Device>(dev: &D, dtype: DType, layout: Layout) -> AnyTensor<D> {
    fn typed<E: Precision, D: Device>(dev: &D, layout: Layout) -> AnyTensor<D> {
        let storage = dev.scratch::<E>(layout.numel());
        Tensor { storage, layout, node: None, device: dev.clone() }.into()
    }
    match dtype {
        DType::F16 => typed::<f16, D>(dev, layout),
        DType::BF16 => typed::<bf16, D>(dev, layout),
        DType::F32 => typed::<f32, D>(dev, layout),
        DType::F64 => typed::<f64, D>(dev, layout),
    }
}

impl<D: Device> Tiled<D> {
    /// The tensor's gradient: the buffer, with the windows no op wrote copied in from the
    /// narrows' gradients that `arrived` the usual way, and zero where none did.
    fn finish(self, dev: &D, arrived: Vec<Window<D>>) -> AnyTensor<D> {
        let mut buf = self.buf.expect("finished only once allocated");
        for w in self.windows.iter().filter(|w| !w.written) {
            let mut window = self.layout.clone();
            window.offset += w.start * window.strides[w.dim];
            window.shape[w.dim] = w.len;
            let g = arrived.iter().find(|a| a.dim == w.dim && a.start == w.start).map(|a| &a.grad);
            with_any!(&mut buf, b => fill_window(dev, b, &window, g));
        }
        buf
    }
}

/// Copies `g` (a narrow's gradient) into `window` of `buf`, or zeros where there is none.
fn fill_window<E: Precision, D: Device>(dev: &D, buf: &mut Tensor<E, D>, window: &Layout, g: Option<&AnyTensor<D>>) {
    match g {
        Some(g) => {
            let g = g.as_tensor::<E>().expect("a narrow's gradient has its tensor's precision");
            dev.write_into(&mut buf.storage, window, &g.storage, &g.layout, false);
        }
        None => {
            let zeros = dev.full::<E>(window.numel(), E::default());
            dev.write_into(&mut buf.storage, window, &zeros, &Layout::contiguous(&window.shape), false);
        }
    }
}

/// Finds the tensors whose narrows' gradients may be written in place (module notes) and, for
/// each node an op may write its gradient for, where: the last node of the views below each
/// window, the one whose only consumer is that op.
#[allow(clippy::type_complexity)] // the two maps the engine keeps
fn plan_in_place<D: Device>(order: &[Arc<Node<D>>]) -> (HashMap<TensorId, Tiled<D>>, HashMap<TensorId, Dest>) {
    let (mut tiled, mut dest_of) = (HashMap::new(), HashMap::new());
    if !order.iter().any(|n| matches!(n.backward, Some(Backward::Window { .. }))) {
        return (tiled, dest_of);
    }
    let mut children: HashMap<TensorId, Vec<&Arc<Node<D>>>> = HashMap::new();
    for n in order {
        for p in n.parents.iter().flatten() {
            children.entry(p.id).or_default().push(n);
        }
    }
    let only_child = |n: &Node<D>| match children.get(&n.id).map(Vec::as_slice) {
        Some([c]) => Some(*c),
        _ => None,
    };
    for p in order.iter().filter(|p| p.backward.is_some()) {
        let Some(ch) = children.get(&p.id) else { continue };
        // Every consumer a narrow of `p` along one dim, in one memory order, tiling it.
        let mut spans = Vec::new();
        let mut first_order = None;
        for c in ch {
            let Some(Backward::Window { dim, start, order }) = &c.backward else { break };
            if *first_order.get_or_insert(order) != order || spans.first().is_some_and(|&(d, _, _)| d != *dim) {
                break;
            }
            spans.push((*dim, *start, c.shape[*dim]));
        }
        if spans.len() != ch.len() {
            continue;
        }
        if !tiles(spans.iter().map(|&(_, s, l)| (s, l)).collect(), p.shape[spans[0].0]) {
            continue;
        }
        // The buffer in the memory order the concatenation would give it.
        let identity: Vec<usize> = (0..p.shape.len()).collect();
        let mem = first_order.and_then(|o| o.as_ref()).map_or(&identity[..], |o| &o[..]);
        let layout = layout_in_order(&p.shape, mem);
        let mut windows = Vec::new();
        for (wi, (c, &(dim, start, len))) in ch.iter().zip(&spans).enumerate() {
            windows.push(TiledWindow { dim, start, len, written: false });
            // Down the views below the window to the node whose only consumer is an op.
            let mut l = layout.clone();
            l.offset += start * l.strides[dim];
            l.shape[dim] = len;
            let mut node: &Node<D> = c;
            while let Some(next) = only_child(node) {
                match next.view.as_ref().and_then(|v| v.apply(&l)) {
                    Some(nl) => (node, l) = (next, nl),
                    None => {
                        dest_of.insert(node.id, Dest { tensor: p.id, window: wi, layout: l });
                        break;
                    }
                }
            }
        }
        tiled.insert(p.id, Tiled { dtype: p.dtype, layout, buf: None, windows });
    }
    (tiled, dest_of)
}

// ---- gradient accumulation ------------------------------------------------------------------

/// `a + b` for two gradients of one tensor, written into whichever buffer is owned alone
/// (a fresh tensor only when neither is). Each element is `a + b` in `E::Acc` rounded once,
/// exactly what the `add` op computes, so the sums do not depend on which path ran.
pub(crate) fn accumulate<D: Device>(a: AnyTensor<D>, b: AnyTensor<D>) -> AnyTensor<D> {
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

fn accumulate_typed<E: Precision, D: Device>(mut a: Tensor<E, D>, mut b: Tensor<E, D>) -> Tensor<E, D> {
    debug_assert_eq!(a.shape(), b.shape(), "accumulated gradients differ in shape");
    if owns_whole(&a) {
        add_into(&mut a, &b);
        a
    } else if owns_whole(&b) {
        // Addition commutes exactly (one rounding of the same exact sum).
        add_into(&mut b, &a);
        b
    } else {
        a.add(&b)
    }
}

/// Whether `t` views all of its buffer in order and is the buffer's only holder (so writing
/// into it changes nothing anyone else can see).
pub(crate) fn owns_whole<E: Precision, D: Device>(t: &Tensor<E, D>) -> bool {
    t.layout.is_contiguous() && t.layout.offset == 0 && D::len(&t.storage) == t.numel() && D::is_exclusive(&t.storage)
}

/// `dst += src` element-wise (same shape; `dst` owns its whole buffer), one rounding each.
fn add_into<E: Precision, D: Device>(dst: &mut Tensor<E, D>, src: &Tensor<E, D>) {
    let dl = dst.layout.clone();
    dst.device.clone().write_into(&mut dst.storage, &dl, &src.storage, &src.layout, true);
}

/// A narrow's gradient waiting to be added into its parent's: entries `start..` of `dim`
/// (`order`: the parent's memory order, `Backward::Window`).
struct Window<D: Device> {
    dim: usize,
    start: usize,
    order: Option<Arc<[usize]>>,
    grad: AnyTensor<D>,
}

/// Adds the windows `ws` (in arrival order) into the running gradient `acc` of `node`. With no
/// running gradient and windows of one dim that tile it exactly, that is their concatenation
/// (no zero fill), in the node's memory order when it has one and is not a leaf (a leaf's
/// gradient is handed to the caller, row-major); otherwise each is added in turn
/// ([`add_window`]).
fn add_windows<D: Device>(acc: Option<AnyTensor<D>>, mut ws: Vec<Window<D>>, node: &Node<D>) -> AnyTensor<D> {
    let shape = &node.shape[..];
    let dim = ws[0].dim;
    let spans = ws.iter().map(|w| (w.start, w.grad.shape()[dim])).collect();
    if acc.is_none() && ws.iter().all(|w| w.dim == dim) && tiles(spans, shape[dim]) {
        let order =
            ws[0].order.clone().filter(|o| node.backward.is_some() && ws.iter().all(|w| w.order.as_ref() == Some(o)));
        ws.sort_by_key(|w| w.start);
        return cat_parts(ws.into_iter().map(|w| w.grad).collect(), shape, dim, order.as_deref());
    }
    ws.into_iter()
        .fold(acc, |acc, w| Some(add_window(acc, w.grad, shape, w.dim, w.start)))
        .expect("at least one window")
}

/// Whether windows `(start, len)` of one dim tile a dim of `size` exactly: no gap, no overlap.
fn tiles(mut spans: Vec<(usize, usize)>, size: usize) -> bool {
    spans.sort_unstable();
    let mut end = 0;
    spans.iter().all(|&(start, len)| std::mem::replace(&mut end, start + len) == start) && end == size
}

/// The dense layout of a tensor of `shape` whose dims lie in memory in `order` (outermost
/// first): dim `order[j]` gets the stride of dim `j` of the row-major memory shape.
fn layout_in_order(shape: &[usize], order: &[usize]) -> Layout {
    let mem_shape: Vec<usize> = order.iter().map(|&d| shape[d]).collect();
    let mut strides = vec![0; shape.len()];
    for (&d, s) in order.iter().zip(crate::layout::contiguous_strides(&mem_shape)) {
        strides[d] = s;
    }
    Layout { shape: shape.to_vec(), strides, offset: 0 }
}

/// The concatenation along `dim` of `parts` (one precision), a tensor of `shape`: row-major,
/// or laid out in memory in `order` (outermost dim first; the parts are then read as seen in
/// that order, and the result has the strides of a tensor of `shape` permuted so).
fn cat_parts<D: Device>(
    parts: Vec<AnyTensor<D>>,
    shape: &[usize],
    dim: usize,
    order: Option<&[usize]>,
) -> AnyTensor<D> {
    fn typed<E: Precision, D: Device>(
        first: Tensor<E, D>,
        rest: Vec<AnyTensor<D>>,
        shape: &[usize],
        dim: usize,
        order: Option<&[usize]>,
    ) -> AnyTensor<D> {
        let rest: Vec<Tensor<E, D>> =
            rest.into_iter().map(|p| p.downcast::<E>().unwrap_or_else(|e| panic!("narrow backward: {e}"))).collect();
        let all: Vec<&Tensor<E, D>> = std::iter::once(&first).chain(&rest).collect();
        let identity: Vec<usize> = (0..shape.len()).collect();
        let order = order.unwrap_or(&identity);
        // Everything seen in memory order: the parts, the result's shape, the cat dim.
        let mem_shape: Vec<usize> = order.iter().map(|&d| shape[d]).collect();
        let mem_dim = order.iter().position(|&d| d == dim).expect("the order holds every dim");
        let (outer, _, inner) = crate::layout::outer_dim_inner(&mem_shape, mem_dim);
        let layouts: Vec<Layout> = all.iter().map(|t| t.layout.permuted(order)).collect();
        let views: Vec<_> = all.iter().zip(&layouts).map(|(t, l)| (&t.storage, l, t.shape()[dim])).collect();
        let dev = first.device.clone();
        let storage = dev.cat(&views, outer, inner);
        // Back to `shape`'s dims.
        let layout = layout_in_order(shape, order);
        Tensor { storage, layout, node: None, device: dev }.into()
    }
    let mut parts = parts.into_iter();
    let first = parts.next().expect("at least one window");
    let rest: Vec<_> = parts.collect();
    with_any!(first, first => typed(first, rest, shape, dim, order))
}

/// Adds `g`, the gradient of the window `start..start + len` of `dim` of a tensor of `shape`,
/// into that tensor's running gradient `acc` (in place when `acc` owns its buffer alone; a
/// zero buffer with `g` copied into the window when there is none yet).
fn add_window<D: Device>(
    acc: Option<AnyTensor<D>>,
    g: AnyTensor<D>,
    shape: &[usize],
    dim: usize,
    start: usize,
) -> AnyTensor<D> {
    fn typed<E: Precision, D: Device>(
        acc: Option<AnyTensor<D>>,
        g: Tensor<E, D>,
        shape: &[usize],
        dim: usize,
        start: usize,
    ) -> AnyTensor<D> {
        let acc = acc.map(|a| a.downcast::<E>().unwrap_or_else(|e| panic!("narrow backward: {e}")));
        let dev = g.device.clone();
        let (mut acc, add) = match acc {
            Some(a) if owns_whole(&a) => (a, true),
            // Shared (or a view): a private copy to add into, still one pass cheaper than
            // padding `g` and adding two full tensors.
            Some(a) => (Tensor::from_storage(&dev, dev.contiguous(&a.storage, &a.layout), shape), true),
            None => (Tensor::from_storage(&dev, dev.full(shape.iter().product(), E::default()), shape), false),
        };
        let mut window = Layout::contiguous(shape);
        window.offset += start * window.strides[dim];
        window.shape[dim] = g.shape()[dim];
        dev.write_into(&mut acc.storage, &window, &g.storage, &g.layout, add);
        acc.into()
    }
    with_any!(g, g => typed(acc, g, shape, dim, start))
}
