//! `Tensor<E, D>`: an n-dimensional view over shared storage, with its precision and device
//! in its type.
//!
//! Design notes:
//! - Cloning a tensor is cheap (reference counts); storage is immutable once shared, and a
//!   parameter update writes in place only when nothing else holds the storage (copy on write
//!   otherwise), so a graph from an earlier step never sees later values.
//! - Views (transpose, permute, narrow, broadcast, and reshape where strides can say it) share
//!   storage.
//! - Constructors and views are here; ops live in `crate::ops`, one file per op family.

use std::fmt;
use std::sync::Arc;

use crate::autograd::{AnyTensor, Backward, GradDests, Grads, Node, TensorId, ViewOp, is_grad_enabled, run_backward};
use crate::backend::{Cpu, Device};
use crate::error::{Error, Result, or_panic};
use crate::layout::{Layout, check_dim, contiguous_strides};
use crate::precision::{Precision, convert_slice};
use crate::rng::Rng;

/// An n-dimensional tensor of precision `E` on device `D`.
///
/// `Tensor<f16>` and `Tensor<f32>` are different types: binary ops need both operands in one
/// precision, and [`Tensor::cast`] is the one way to change it.
pub struct Tensor<E: Precision, D: Device = Cpu> {
    pub(crate) storage: D::Storage<E>,
    pub(crate) layout: Layout,
    pub(crate) node: Option<Arc<Node<D>>>,
    pub(crate) device: D,
}

impl<E: Precision, D: Device> Clone for Tensor<E, D> {
    fn clone(&self) -> Self {
        Tensor {
            storage: self.storage.clone(),
            layout: self.layout.clone(),
            node: self.node.clone(),
            device: self.device.clone(),
        }
    }
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// The dims.
    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }
    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.layout.shape.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }
    /// The view's layout (shape, strides, offset).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// The device the storage lives on.
    pub fn device(&self) -> &D {
        &self.device
    }
    /// The precision's run-time mirror.
    pub fn dtype(&self) -> crate::DType {
        E::DTYPE
    }
    /// Whether gradients flow to or through this tensor.
    pub fn requires_grad(&self) -> bool {
        self.node.is_some()
    }
    /// The autograd id, if this tensor takes part in autograd.
    pub fn id(&self) -> Option<TensorId> {
        self.node.as_ref().map(|n| n.id)
    }
    /// The same values cut off from the graph (no gradient flows back through it).
    pub fn detach(&self) -> Self {
        Tensor { node: None, ..self.clone() }
    }
    /// A contiguous tensor on `device` over `storage` (which holds exactly `shape`'s elements);
    /// no autograd.
    pub(crate) fn from_storage(device: &D, storage: D::Storage<E>, shape: &[usize]) -> Self {
        debug_assert_eq!(D::len(&storage), shape.iter().product::<usize>());
        Tensor { storage, layout: Layout::contiguous(shape), node: None, device: device.clone() }
    }
    /// A new output of this tensor's device: `storage` viewed as `shape`, no autograd.
    pub(crate) fn output<T: Precision>(&self, storage: D::Storage<T>, shape: &[usize]) -> Tensor<T, D> {
        Tensor::from_storage(&self.device, storage, shape)
    }
    /// The storage and layout, as kernels take them.
    pub(crate) fn raw(&self) -> (&D::Storage<E>, &Layout) {
        (&self.storage, &self.layout)
    }
    /// A tensor holding `data` in row-major order on `device`.
    pub fn try_from_vec_on(device: &D, data: Vec<E>, shape: &[usize]) -> Result<Self> {
        check_count(data.len(), shape)?;
        Ok(Self::from_storage(device, device.from_host(data), shape))
    }
    /// A tensor filled with `value` (rounded once into `E`) on `device`.
    pub fn full_on(device: &D, shape: &[usize], value: f64) -> Self {
        Self::from_storage(device, device.full(shape.iter().product(), E::from_f64(value)), shape)
    }
    /// The same values on another device (a copy through the host; not recorded by
    /// autograd, so it is for moving data and parameters, not for a step inside a graph).
    pub fn to_device<D2: Device>(&self, device: &D2) -> Tensor<E, D2> {
        Tensor::from_storage(device, device.from_host(self.to_vec()), self.shape())
    }
    /// A fill of this tensor's device: a new tensor of `shape` holding `value`.
    pub(crate) fn filled_like<T: Precision>(&self, shape: &[usize], value: f64) -> Tensor<T, D> {
        Tensor::full_on(&self.device, shape, value)
    }
}

// ---- construction -------------------------------------------------------------------------

/// Refuses `len` values for a tensor of `shape` unless they fill it exactly.
fn check_count(len: usize, shape: &[usize]) -> Result<()> {
    let expected: usize = shape.iter().product();
    if len != expected {
        return Err(Error::ElementCount { op: "from_vec", len, expected, shape: shape.to_vec() });
    }
    Ok(())
}

impl<E: Precision> Tensor<E> {
    /// A contiguous CPU tensor from raw parts; no autograd. The buffer becomes pooled storage:
    /// it goes to the caching allocator when the last tensor holding it is dropped.
    pub(crate) fn from_parts(data: Vec<E>, shape: &[usize]) -> Self {
        Self::from_storage(&Cpu, Cpu.from_host(data), shape)
    }

    /// A tensor holding `data` in row-major order.
    pub fn try_from_vec(data: Vec<E>, shape: &[usize]) -> Result<Self> {
        Self::try_from_vec_on(&Cpu, data, shape)
    }
    /// A tensor holding `data` in row-major order. Panics if the length does not fill `shape`.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let t = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    /// assert_eq!(t.shape(), &[2, 3]);
    /// ```
    #[track_caller]
    pub fn from_vec(data: Vec<E>, shape: &[usize]) -> Self {
        or_panic(Self::try_from_vec(data, shape))
    }
    /// Like [`Tensor::try_from_vec`], rounding each f64 value once into `E`.
    pub fn try_from_f64s(data: &[f64], shape: &[usize]) -> Result<Self> {
        check_count(data.len(), shape)?;
        Ok(Self::from_parts(data.iter().map(|v| E::from_f64(*v)).collect(), shape))
    }
    /// Like [`Tensor::from_vec`], rounding each f64 value once into `E`.
    #[track_caller]
    pub fn from_f64s(data: &[f64], shape: &[usize]) -> Self {
        or_panic(Self::try_from_f64s(data, shape))
    }
    /// Like [`Tensor::try_from_vec`], rounding each f32 value once into `E` (vectorised).
    pub fn try_from_f32s(data: &[f32], shape: &[usize]) -> Result<Self> {
        check_count(data.len(), shape)?;
        let mut out = vec![E::default(); data.len()];
        convert_slice(data, &mut out);
        Ok(Self::from_parts(out, shape))
    }
    /// Like [`Tensor::from_vec`], rounding each f32 value once into `E` (vectorised).
    #[track_caller]
    pub fn from_f32s(data: &[f32], shape: &[usize]) -> Self {
        or_panic(Self::try_from_f32s(data, shape))
    }
    /// A tensor filled with `value` (rounded once into `E`).
    pub fn full(shape: &[usize], value: f64) -> Self {
        Self::full_on(&Cpu, shape, value)
    }
    /// Zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Self::full(shape, 0.0)
    }
    /// Ones.
    pub fn ones(shape: &[usize]) -> Self {
        Self::full(shape, 1.0)
    }
    /// A 0-dim tensor.
    pub fn scalar(value: f64) -> Self {
        Self::full(&[], value)
    }
    /// `[start, start + step, ...]` up to (not including) `end`, as a 1-D tensor.
    pub fn try_arange(start: f64, end: f64, step: f64) -> Result<Self> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::InvalidArgument {
                op: "arange",
                name: "step",
                detail: format!("needs finite bounds and a non-zero step, got {start}..{end} step {step}"),
            });
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        Ok(Self::from_parts((0..n).map(|i| E::from_f64(start + i as f64 * step)).collect(), &[n]))
    }
    /// `[start, start + step, ...]` up to (not including) `end`, as a 1-D tensor.
    #[track_caller]
    pub fn arange(start: f64, end: f64, step: f64) -> Self {
        or_panic(Self::try_arange(start, end, step))
    }
    /// Uniform samples in `[0, 1)` from a seeded generator.
    pub fn rand(shape: &[usize], rng: &mut Rng) -> Self {
        let n = shape.iter().product();
        Self::from_parts((0..n).map(|_| E::from_f64(rng.uniform())).collect(), shape)
    }
    /// Standard normal samples from a seeded generator.
    pub fn randn(shape: &[usize], rng: &mut Rng) -> Self {
        let n = shape.iter().product();
        Self::from_parts((0..n).map(|_| E::from_f64(rng.normal())).collect(), shape)
    }
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// This tensor as a leaf that gradients are collected for (PyTorch's `requires_grad_()`).
    /// Gradients come back from [`Tensor::backward`] keyed by this tensor's [`Tensor::id`].
    pub fn requires_grad_(self) -> Self {
        let node = Node::leaf(E::DTYPE, self.shape());
        Tensor { node: Some(node), ..self }
    }
}

// ---- reading ------------------------------------------------------------------------------

impl<E: Precision, D: Device> Tensor<E, D> {
    /// The values in row-major order (copied to the host).
    pub fn to_vec(&self) -> Vec<E> {
        self.device.to_host(&self.storage, &self.layout)
    }
    /// The values widened to f64, in row-major order.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.to_vec().into_iter().map(|v| v.to_f64()).collect()
    }
    /// The values converted to f32, in row-major order.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let v = self.to_vec();
        let mut out = vec![0f32; v.len()];
        convert_slice(&v, &mut out);
        out
    }
    /// The value of a one-element tensor.
    pub fn try_item(&self) -> Result<E> {
        if self.numel() != 1 {
            return Err(Error::Shape {
                op: "item",
                detail: "needs exactly one element".into(),
                shapes: vec![self.shape().to_vec()],
            });
        }
        let one = Layout { shape: vec![], strides: vec![], offset: self.layout.offset };
        Ok(self.device.to_host(&self.storage, &one)[0])
    }
    /// The value of a one-element tensor.
    #[track_caller]
    pub fn item(&self) -> E {
        or_panic(self.try_item())
    }
}

/// Whether an op with these parents records a node: recording is on and a parent takes part.
fn records<D: Device>(parents: &[Option<Arc<Node<D>>>]) -> bool {
    is_grad_enabled() && parents.iter().any(Option::is_some)
}

// ---- autograd entry points --------------------------------------------------------------------

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Records `self` as the output of `op` with `parents`; `backward` maps the output's
    /// gradient to one gradient per parent (same order, `None` where not needed).
    pub(crate) fn record(
        self,
        op: &'static str,
        parents: Vec<Option<Arc<Node<D>>>>,
        backward: impl Fn(Tensor<E, D>) -> Vec<Option<AnyTensor<D>>> + Send + Sync + 'static,
    ) -> Self {
        self.record_fn(op, parents, backward, None)
    }

    /// [`Tensor::record`] for a view op (reshape, permute): `view` says how the output's layout
    /// follows from its one parent's, so the engine can follow a gradient destination through
    /// it ([`Backward::FnDest`]).
    pub(crate) fn record_view(
        self,
        op: &'static str,
        parent: Option<Arc<Node<D>>>,
        view: ViewOp,
        backward: impl Fn(Tensor<E, D>) -> Vec<Option<AnyTensor<D>>> + Send + Sync + 'static,
    ) -> Self {
        self.record_fn(op, vec![parent], backward, Some(view))
    }

    fn record_fn(
        self,
        op: &'static str,
        parents: Vec<Option<Arc<Node<D>>>>,
        backward: impl Fn(Tensor<E, D>) -> Vec<Option<AnyTensor<D>>> + Send + Sync + 'static,
        view: Option<ViewOp>,
    ) -> Self {
        if !records(&parents) {
            return self;
        }
        let backward = Backward::Fn(Box::new(move |g: AnyTensor<D>| {
            let g = g.downcast::<E>().unwrap_or_else(|e| panic!("{op} backward: {e}"));
            backward(g)
        }));
        self.record_node(op, parents, backward, view)
    }

    /// [`Tensor::record`] for an op whose backward adds its first input's gradient into that
    /// input's gradient so far ([`Backward::FnInto`]): `backward` gets the output's gradient
    /// and the running gradient (if any), and returns the first input's total first.
    pub(crate) fn record_into(
        self,
        op: &'static str,
        parents: Vec<Option<Arc<Node<D>>>>,
        backward: impl Fn(Tensor<E, D>, Option<AnyTensor<D>>) -> Vec<Option<AnyTensor<D>>> + Send + Sync + 'static,
    ) -> Self {
        if !records(&parents) {
            return self;
        }
        let backward = Backward::FnInto(Box::new(move |g: AnyTensor<D>, acc| {
            let g = g.downcast::<E>().unwrap_or_else(|e| panic!("{op} backward: {e}"));
            backward(g, acc)
        }));
        self.record_node(op, parents, backward, None)
    }

    /// Records `self` as entries `start..` of `dim` of `parent` (a narrow): the engine adds
    /// its gradient into that window of the parent's gradient buffer.
    fn record_window(self, parent: Option<Arc<Node<D>>>, parent_layout: &Layout, dim: usize, start: usize) -> Self {
        let parents = vec![parent];
        if !records(&parents) {
            return self;
        }
        let order = parent_layout.memory_order().map(Arc::from);
        self.record_node("narrow", parents, Backward::Window { dim, start, order }, None)
    }

    /// [`Tensor::record`] for an op whose backward may write a parent's gradient into a
    /// destination the engine offers ([`Backward::FnDest`], [`GradDests`]).
    pub(crate) fn record_dest(
        self,
        op: &'static str,
        parents: Vec<Option<Arc<Node<D>>>>,
        backward: impl Fn(Tensor<E, D>, &mut GradDests<'_, D>) -> Vec<Option<AnyTensor<D>>> + Send + Sync + 'static,
    ) -> Self {
        if !records(&parents) {
            return self;
        }
        let backward = Backward::FnDest(Box::new(move |g: AnyTensor<D>, dests: &mut GradDests<'_, D>| {
            let g = g.downcast::<E>().unwrap_or_else(|e| panic!("{op} backward: {e}"));
            backward(g, dests)
        }));
        self.record_node(op, parents, backward, None)
    }

    fn record_node(
        mut self,
        op: &'static str,
        parents: Vec<Option<Arc<Node<D>>>>,
        backward: Backward<D>,
        view: Option<ViewOp>,
    ) -> Self {
        let node = Node {
            id: TensorId::fresh(),
            op,
            dtype: E::DTYPE,
            shape: self.shape().to_vec(),
            parents,
            backward: Some(backward),
            view,
            made_at: crate::autograd::clock(),
            updated_at: Default::default(),
        };
        self.node = Some(Arc::new(node));
        self
    }

    /// Gradients of this scalar with respect to every leaf it depends on, each in its leaf's
    /// precision. Errors if the tensor has more than one element or does not require grad.
    pub fn try_backward(&self) -> Result<Grads<D>> {
        self.try_backward_with_seed(self.filled_like::<E>(self.shape(), 1.0))
    }
    /// Like [`Tensor::try_backward`], with the seed gradient `seed` instead of 1 (this is how a
    /// scaled loss's backward multiplies every gradient by the scale). Crate-private: scaled
    /// gradients exist only inside a training step, never as a [`Grads`].
    pub(crate) fn try_backward_with_seed(&self, seed: Tensor<E, D>) -> Result<Grads<D>> {
        if self.numel() != 1 {
            return Err(Error::Backward {
                detail: format!("needs a one-element (scalar) tensor, got shape {:?}", self.shape()),
            });
        }
        let Some(node) = &self.node else {
            return Err(Error::Backward {
                detail: "the tensor does not require grad: nothing it depends on is a parameter or a leaf marked with requires_grad_()".into(),
            });
        };
        run_backward(node, seed.into())
    }
    /// Gradients of this scalar with respect to every leaf it depends on.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2]).requires_grad_();
    /// let y = x.mul(&x).sum_all(); // x0^2 + x1^2
    /// let g = y.backward();
    /// assert_eq!(g.get(&x).unwrap().to_vec(), vec![2.0, 4.0]);
    /// ```
    #[track_caller]
    pub fn backward(&self) -> Grads<D> {
        or_panic(self.try_backward())
    }
}

// ---- views --------------------------------------------------------------------------------

impl<E: Precision, D: Device> Tensor<E, D> {
    fn view(&self, layout: Layout) -> Self {
        Tensor { storage: self.storage.clone(), layout, node: None, device: self.device.clone() }
    }

    /// A contiguous tensor with the same values (no copy if already contiguous).
    pub fn contiguous(&self) -> Self {
        if self.layout.is_contiguous() {
            return self.clone();
        }
        let out = self.output(self.device.contiguous(&self.storage, &self.layout), self.shape());
        out.record("contiguous", vec![self.node.clone()], |g| vec![Some(g.into())])
    }

    /// The same values with a new shape of the same element count: a view of the same storage
    /// where strides can say it (any contiguous tensor; a permuted or narrowed one whose
    /// reshaped dims each lie in one run of memory, such as dropping a size-1 dim), else a
    /// copy, as PyTorch's `reshape`.
    pub fn try_reshape(&self, shape: &[usize]) -> Result<Self> {
        let expected: usize = shape.iter().product();
        if expected != self.numel() {
            return Err(Error::Shape {
                op: "reshape",
                detail: format!("cannot reshape {} elements into {:?}", self.numel(), shape),
                shapes: vec![self.shape().to_vec(), shape.to_vec()],
            });
        }
        // A view where strides can say it (PyTorch's `reshape`), else a view of a copy.
        let (src, layout) = match self.layout.reshaped(shape) {
            Some(layout) => (self.clone(), layout),
            None => {
                let src = self.contiguous();
                let layout = Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: 0 };
                (src, layout)
            }
        };
        let out = Tensor { layout, node: None, ..src.clone() };
        let in_shape = self.shape().to_vec();
        let backward = move |g: Tensor<E, D>| vec![Some(g.reshape(&in_shape).into())];
        // A view of `src` either way (of a copy, when strides could not say it).
        Ok(out.record_view("reshape", src.node.clone(), ViewOp::Reshape(shape.to_vec()), backward))
    }
    /// The same values with a new shape. Panics if the element count differs.
    #[track_caller]
    pub fn reshape(&self, shape: &[usize]) -> Self {
        or_panic(self.try_reshape(shape))
    }
    /// Flattens to 1-D.
    pub fn flatten(&self) -> Self {
        self.reshape(&[self.numel()])
    }
    /// Merges dims `start..=end` into one (PyTorch's `flatten(start_dim, end_dim)`; a view
    /// of contiguous data): `[2, 3, 4, 5].flatten_dims(1, 2)` is `[2, 12, 5]`. A 0-dim
    /// tensor with `(0, 0)` becomes `[1]`, as in PyTorch.
    pub fn try_flatten_dims(&self, start: usize, end: usize) -> Result<Self> {
        if self.rank() == 0 && start == 0 && end == 0 {
            return self.try_reshape(&[1]);
        }
        check_dim("flatten_dims", start, self.shape())?;
        check_dim("flatten_dims", end, self.shape())?;
        if start > end {
            return Err(Error::Shape {
                op: "flatten_dims",
                detail: format!("the start dim {start} comes after the end dim {end}"),
                shapes: vec![self.shape().to_vec()],
            });
        }
        let s = self.shape();
        let shape = [&s[..start], &[s[start..=end].iter().product()], &s[end + 1..]].concat();
        self.try_reshape(&shape)
    }
    /// Merges dims `start..=end` into one; panics with [`Tensor::try_flatten_dims`]'s error.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f32>::zeros(&[2, 3, 4, 5]);
    /// assert_eq!(x.flatten_dims(1, 3).shape(), &[2, 60]);
    /// ```
    #[track_caller]
    pub fn flatten_dims(&self, start: usize, end: usize) -> Self {
        or_panic(self.try_flatten_dims(start, end))
    }

    /// Reorders dims: output dim `i` is input dim `perm[i]`.
    pub fn try_permute(&self, perm: &[usize]) -> Result<Self> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if perm.len() != rank || perm.iter().any(|&p| p >= rank || std::mem::replace(&mut seen[p], true)) {
            return Err(Error::Shape {
                op: "permute",
                detail: format!("{perm:?} is not a permutation of 0..{rank}"),
                shapes: vec![self.shape().to_vec()],
            });
        }
        let layout = self.layout.permuted(perm);
        let mut inverse = vec![0; rank];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i;
        }
        let backward = move |g: Tensor<E, D>| vec![Some(g.permute(&inverse).into())];
        Ok(self.view(layout).record_view("permute", self.node.clone(), ViewOp::Permute(perm.to_vec()), backward))
    }
    /// Reorders dims: output dim `i` is input dim `perm[i]`.
    #[track_caller]
    pub fn permute(&self, perm: &[usize]) -> Self {
        or_panic(self.try_permute(perm))
    }

    /// Swaps two dims.
    pub fn try_transpose(&self, d0: usize, d1: usize) -> Result<Self> {
        check_dim("transpose", d0, self.shape())?;
        check_dim("transpose", d1, self.shape())?;
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(d0, d1);
        self.try_permute(&perm)
    }
    /// Swaps two dims.
    #[track_caller]
    pub fn transpose(&self, d0: usize, d1: usize) -> Self {
        or_panic(self.try_transpose(d0, d1))
    }
    /// Swaps the last two dims (the matrix transpose); refuses fewer than 2 dims (PyTorch's
    /// `t()` returns a 1-D tensor unchanged, which hides a vector taken for a matrix).
    pub fn try_t(&self) -> Result<Self> {
        let r = self.rank();
        if r < 2 {
            return Err(Error::Shape {
                op: "t",
                detail: format!("needs at least 2 dims, got {r}"),
                shapes: vec![self.shape().to_vec()],
            });
        }
        self.try_transpose(r - 2, r - 1)
    }
    /// Swaps the last two dims (the matrix transpose).
    #[track_caller]
    pub fn t(&self) -> Self {
        or_panic(self.try_t())
    }

    /// `len` entries of `dim` starting at `start` (a view).
    pub fn try_narrow(&self, dim: usize, start: usize, len: usize) -> Result<Self> {
        check_dim("narrow", dim, self.shape())?;
        let size = self.shape()[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::Shape {
                op: "narrow",
                detail: format!(
                    "range {start}..{} is out of bounds for dim {dim} of size {size}",
                    start.saturating_add(len)
                ),
                shapes: vec![self.shape().to_vec()],
            });
        }
        let mut layout = self.layout.clone();
        layout.offset += start * layout.strides[dim];
        layout.shape[dim] = len;
        // The gradient is zero outside the window: autograd adds it into the window of the
        // input's gradient buffer (one buffer for every narrow of one tensor, as `split`).
        Ok(self.view(layout).record_window(self.node.clone(), &self.layout, dim, start))
    }
    /// `len` entries of `dim` starting at `start` (a view).
    #[track_caller]
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Self {
        or_panic(self.try_narrow(dim, start, len))
    }
    /// The entries `range` of `dim` (a view); `slice(1, 2..5)` is PyTorch's `x[:, 2:5]`.
    #[track_caller]
    pub fn slice(&self, dim: usize, range: std::ops::Range<usize>) -> Self {
        or_panic(self.try_narrow(dim, range.start, range.end.saturating_sub(range.start)))
    }

    /// Inserts a dim of size 1 at `dim` (`0..=rank`).
    pub fn try_unsqueeze(&self, dim: usize) -> Result<Self> {
        if dim > self.rank() {
            return Err(Error::Shape {
                op: "unsqueeze",
                detail: format!("dim {dim} is out of range 0..={} for a tensor of rank {}", self.rank(), self.rank()),
                shapes: vec![self.shape().to_vec()],
            });
        }
        let mut s = self.shape().to_vec();
        s.insert(dim, 1);
        self.try_reshape(&s)
    }
    /// Inserts a dim of size 1 at `dim` (`0..=rank`).
    #[track_caller]
    pub fn unsqueeze(&self, dim: usize) -> Self {
        or_panic(self.try_unsqueeze(dim))
    }
    /// Removes the size-1 dim `dim`; refuses a dim of another size (PyTorch's `squeeze(dim)`
    /// leaves such a tensor unchanged, which hides a shape that was not the one expected).
    pub fn try_squeeze(&self, dim: usize) -> Result<Self> {
        check_dim("squeeze", dim, self.shape())?;
        if self.shape()[dim] != 1 {
            return Err(Error::Shape {
                op: "squeeze",
                detail: format!("dim {dim} has size {}, not 1", self.shape()[dim]),
                shapes: vec![self.shape().to_vec()],
            });
        }
        let mut s = self.shape().to_vec();
        s.remove(dim);
        self.try_reshape(&s)
    }
    /// Removes the size-1 dim `dim`.
    #[track_caller]
    pub fn squeeze(&self, dim: usize) -> Self {
        or_panic(self.try_squeeze(dim))
    }

    /// A view broadcast to `shape` (NumPy rules); its gradient sums back.
    pub fn try_broadcast_to(&self, shape: &[usize]) -> Result<Self> {
        let target = crate::layout::broadcast_shapes("broadcast_to", self.shape(), shape)?;
        if target != shape {
            return Err(Error::Broadcast { op: "broadcast_to", lhs: self.shape().to_vec(), rhs: shape.to_vec() });
        }
        let in_shape = self.shape().to_vec();
        Ok(self
            .view(self.layout.broadcast_to(shape))
            .record("broadcast_to", vec![self.node.clone()], move |g| vec![Some(g.sum_to_shape(&in_shape).into())]))
    }
    /// A view broadcast to `shape` (NumPy rules).
    #[track_caller]
    pub fn broadcast_to(&self, shape: &[usize]) -> Self {
        or_panic(self.try_broadcast_to(shape))
    }

    /// Sums a broadcast gradient back down to `shape` (the reverse of broadcasting).
    pub(crate) fn sum_to_shape(&self, shape: &[usize]) -> Self {
        if self.shape() == shape {
            return self.clone();
        }
        let pad = self.rank() - shape.len();
        // Leading dims that broadcasting added are summed in one pass.
        let lead: usize = self.shape()[..pad].iter().product();
        let mut t = self.contiguous().reshape(&[&[lead], &self.shape()[pad..]].concat()).sum(0, false);
        for (d, &s) in shape.iter().enumerate() {
            if s == 1 && t.shape()[d] != 1 {
                t = t.sum(d, true);
            }
        }
        t.reshape(shape)
    }
}

// ---- casting --------------------------------------------------------------------------------

impl<E: Precision, D: Device> Tensor<E, D> {
    /// The values rounded once into precision `E2` (differentiable: the gradient is cast back).
    /// Values beyond `E2`'s range become ±inf, never clamped; NaN stays NaN.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// use amp::f16;
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 70000.0], &[2]);
    /// let h = x.cast::<f16>();
    /// assert!(h.to_vec()[1].is_infinite());
    /// ```
    pub fn cast<E2: Precision>(&self) -> Tensor<E2, D> {
        if E::DTYPE == E2::DTYPE {
            let out = self.clone();
            // Same precision means same type: move it through the type-erased form.
            return E2::from_any(E::into_any(out)).unwrap_or_else(|_| unreachable!());
        }
        let out = self.device.cast::<E, E2>(&self.storage, &self.layout);
        self.output(out, self.shape()).record("cast", vec![self.node.clone()], |g| vec![Some(g.cast::<E>().into())])
    }
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Rounds `self` into `dst`'s precision, writing into `dst`'s buffer (in place when nothing
    /// else shares it): a cast without allocation, for buffers kept across steps. Not recorded
    /// by autograd. Errors if the shapes differ.
    pub fn try_cast_into<E2: Precision>(&self, dst: &mut Tensor<E2, D>) -> Result<()> {
        if self.shape() != dst.shape() {
            return Err(Error::Shape {
                op: "cast_into",
                detail: "source and destination shapes differ".into(),
                shapes: vec![self.shape().to_vec(), dst.shape().to_vec()],
            });
        }
        dst.make_exclusive();
        self.device.cast_into(&self.storage, &self.layout, &mut dst.storage);
        Ok(())
    }
    /// Rounds `self` into `dst`'s precision in `dst`'s buffer; panics if the shapes differ.
    #[track_caller]
    pub fn cast_into<E2: Precision>(&self, dst: &mut Tensor<E2, D>) {
        or_panic(self.try_cast_into(dst))
    }
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Makes this tensor the sole owner of a contiguous buffer holding exactly its view
    /// (copying only if the storage is shared or the view is not the whole of it), so an
    /// in-place write changes nothing anyone else sees.
    pub(crate) fn make_exclusive(&mut self) {
        if !self.is_whole_storage() || !D::is_exclusive(&self.storage) {
            self.storage = self.device.contiguous(&self.storage, &self.layout);
            self.layout = Layout::contiguous(&self.layout.shape.clone());
        }
    }
    /// Overwrites the values with `value`'s (same shape), in place when nothing shares the
    /// buffer; not recorded by autograd (a buffer or parameter load).
    pub(crate) fn set_values(&mut self, value: &Tensor<E, D>) {
        debug_assert_eq!(value.shape(), self.shape());
        self.make_exclusive();
        let dst = self.layout.clone();
        self.device.write_into(&mut self.storage, &dst, &value.storage, &value.layout, false);
    }
    /// A storage holding exactly this view, contiguous: the tensor's own (shared, not copied)
    /// when the view is the whole of it, else a contiguous copy.
    pub(crate) fn contiguous_storage(&self) -> D::Storage<E> {
        if self.is_whole_storage() { self.storage.clone() } else { self.device.contiguous(&self.storage, &self.layout) }
    }
    /// Whether the view is the whole of its storage, contiguous from its start.
    fn is_whole_storage(&self) -> bool {
        self.layout.is_contiguous() && self.layout.offset == 0 && D::len(&self.storage) == self.numel()
    }
}

impl<E: Precision, D: Device> fmt::Debug for Tensor<E, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 8;
        let v = if self.numel() <= SHOWN { self.to_vec() } else { self.flatten().narrow(0, 0, SHOWN).to_vec() };
        write!(f, "Tensor<{}>{:?} {:?}", E::DTYPE, self.shape(), v)?;
        if self.numel() > SHOWN {
            write!(f, "...")?;
        }
        Ok(())
    }
}

impl<E: Precision, D: Device> fmt::Display for Tensor<E, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
