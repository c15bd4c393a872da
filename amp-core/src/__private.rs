//! Support for the code `#[autocast]` generates. Not a public API: only amp-macros calls it,
//! through `::amp_core::__private` (or `::amp::__private`), and it changes without notice.
//!
//! Design notes:
//! - The macro sees names, not types, so the type decides: the generated code wraps each
//!   operand as `(&W::new(x)).__amp_to::<T>()`. Method lookup tries three receiver types in
//!   turn (autoref specialisation), and the first level whose impl applies wins:
//!   1. `&W<X>` (impls on `W<X>`): [`KeepF64`], for f64 operands (`Tensor<f64, D>`,
//!      `Param<f64, D>`, references to them), handed back untouched: autocast only changes
//!      f32/f16/bf16, as PyTorch's only touches those, so f64 code runs as written.
//!   2. `&&W<X>` (impls on `&W<X>`, `&self`): [`CastSpec`], for other tensor-like operands
//!      (`X:` [`AsTensor`]), cast to `T`. A generic `Tensor<E, D>` with `E: Precision` lands
//!      here (the compiler cannot prove `E = f64`), so generic code keeps its declared
//!      `Tensor<T, D>`.
//!   3. `&mut &W<X>` (impls on `&W<X>`, `&mut self`): [`CastPass`], for anything else (an
//!      iterator, an `f32`, a user type), handed back untouched.
//!
//!   The value sits in a `Cell<Option<_>>` so every impl can move it out from behind a
//!   reference. Everything inlines to the cast (or to nothing).
//! - The device is a second dimension that no level looks at: every helper takes tensors and
//!   parameters of any `D: Device` ([`AsTensor::Dev`] names an operand's device), and a cast
//!   stays on its operand's device (`Owned<P, D>`, `Borrowed<P, D>`, `OptHeld<P, D>`; `D`
//!   defaults to the CPU, so messages about CPU code read as before). Nothing is moved between
//!   devices: operands on two devices meet in the op, which refuses them as written code would.
//! - Arguments keep their form: a `&Tensor` comes back as a reference to the cast temporary
//!   ([`Borrowed`], read with `&self`), an owned tensor as an owned one ([`Owned`]), anything
//!   else as itself ([`Same`]); `__amp_get` picks the right one by plain method lookup, as the
//!   three are distinct types.
//! - `recv.forward(..)` / `recv.loss(..)` without a turbofish: the receiver goes through the
//!   same two-level lookup, `(&W::new(recv)).__amp_in::<L>()`. An `amp::nn` module whose
//!   compute precision is a type parameter ([`AsModule`]: the module, or a reference or
//!   pointer to one) comes back as [`In`], whose `forward` / `loss` (and `try_forward` /
//!   `try_loss`) call the module's own with
//!   `::<L>` (so `block.forward(&x, rng)`, whose value is the f32 residual stream, runs in
//!   `L` too), whatever its weight precision and device; anything else comes back as it went
//!   in, and its own method is found as written.
//!   A place receiver goes in as a method call would take it: mutably when the macro sees the
//!   place is mutable (`&mut place`), else through [`PlaceMut`] / [`PlaceRef`]
//!   (`place.__amp_place()`: a `&mut T` reborrowed, anything else borrowed); a temporary is
//!   moved in, so a `forward(self)` of its own still works. The call's value then goes through
//!   [`Hint`], for modules of the user's own: a `Tensor<?L, D>` (any device) whose `L` is still
//!   open is unified with the region's low type; any other value passes through.
//! - A declared return type's `Tensor<X, ..>` positions go through [`conform`] (`conform::<X,
//!   _>(value)`): the `_` is the value's tensor type ([`IntoTensor`]), so its device comes with
//!   it and the generated code names no device.
//! - A region ([`Region`]) is entered by every `#[autocast]` function and records its low
//!   type: a bare `#[autocast]` (f16 by default, not chosen) entered from a region of another
//!   type panics with the fix, instead of silently running its ops in f16.
//! - The weight cast cache serves casts of f32 leaves (parameters, tensors marked
//!   `requires_grad_()`) and of views of them (`w.t()`, `w.narrow(..)`) to a 16-bit type: the
//!   parameter's storage is converted once and every view of it reads the converted values (a
//!   small slice of a large parameter is converted on its own instead). Each use still records
//!   its own `cast` node, so gradients are exactly those of casts written at each use (cast
//!   back to f32 and summed in f32 at the parameter). Entries are shared by nested regions and
//!   dropped when the outermost one exits, or earlier, as soon as they are stale (below).
//! - The cache works the same on every device and never looks inside a storage: an entry is
//!   keyed by the device's type and [`Device::storage_id`] of the source storage (with the
//!   target type and extent), holds a clone of the source's storage handle, and is stale when
//!   [`Device::is_exclusive`] says that clone is the only one left. One thread-local map holds
//!   the entries of every device (each a `CacheEntry<D>` behind `dyn AnyEntry`).
//! - Each entry keeps the source storage alive, so an in-place update of the parameter inside
//!   the region copies on write and can never be served a stale cast (the storage id no
//!   longer matches, and cannot be reused while the entry holds the old storage). An entry
//!   whose source storage nothing but the cache holds any more (the parameter moved on to its
//!   copy, or the tensor was dropped) can never be hit again: such entries are evicted at
//!   every insert and every region exit, so the cache holds at most one entry per live source
//!   storage, target type and extent, plus those gone stale since the last insert or exit (at
//!   most one per parameter updated since), however long a loop inside one region runs
//!   ([`cache_entries`] counts them, every device's together).

use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

use crate::autograd::{AnyTensor, Node};
use crate::backend::{Cpu, Device};
use crate::param::Param;
use crate::precision::{DType, Promoted};
use crate::tensor::Tensor;

pub use crate::precision::{Precision, Promote};
pub use half::{bf16, f16};

/// The helper traits, imported (anonymously) by generated code.
pub mod autocast_traits {
    pub use super::{
        BorrowHeld as _, BorrowOpt as _, CastPass as _, CastSpec as _, HintPass as _, HintSpec as _, KeepF64 as _,
        KeepF64Opt as _, ManyPass as _, ManySpec as _, ModulePass as _, ModuleSpec as _, OptPass as _, OptSpec as _,
        PlaceMut as _, PlaceRef as _, PromoteOpPass as _, PromoteOpSpec as _, PromotePass as _, PromoteSpec as _,
        TakeHeld as _,
    };
}

// ---- what counts as a tensor -----------------------------------------------------------

/// A tensor-like operand: `Tensor<E, D>`, `Param<E, D>`, or a reference to one, on any device.
pub trait AsTensor {
    /// Its precision.
    type Elem: Precision;
    /// Its device (a cast stays on it).
    type Dev: Device;
    /// How a cast of it is handed on: owned for an owned value, borrowed for a reference.
    type Held<P: Precision>;
    /// The tensor inside.
    fn as_tensor(&self) -> &Tensor<Self::Elem, Self::Dev>;
    /// Wraps a cast of it in the matching form.
    fn hold<P: Precision>(t: Tensor<P, Self::Dev>) -> Self::Held<P>;
}

impl<E: Precision, D: Device> AsTensor for Tensor<E, D> {
    type Elem = E;
    type Dev = D;
    type Held<P: Precision> = Owned<P, D>;
    fn as_tensor(&self) -> &Tensor<E, D> {
        self
    }
    fn hold<P: Precision>(t: Tensor<P, D>) -> Owned<P, D> {
        Owned(t)
    }
}

impl<E: Precision, D: Device> AsTensor for Param<E, D> {
    type Elem = E;
    type Dev = D;
    type Held<P: Precision> = Owned<P, D>;
    fn as_tensor(&self) -> &Tensor<E, D> {
        self.tensor()
    }
    fn hold<P: Precision>(t: Tensor<P, D>) -> Owned<P, D> {
        Owned(t)
    }
}

impl<T: AsTensor + ?Sized> AsTensor for &T {
    type Elem = T::Elem;
    type Dev = T::Dev;
    type Held<P: Precision> = Borrowed<P, T::Dev>;
    fn as_tensor(&self) -> &Tensor<T::Elem, T::Dev> {
        (**self).as_tensor()
    }
    fn hold<P: Precision>(t: Tensor<P, T::Dev>) -> Borrowed<P, T::Dev> {
        Borrowed(t)
    }
}

impl<T: AsTensor + ?Sized> AsTensor for &mut T {
    type Elem = T::Elem;
    type Dev = T::Dev;
    type Held<P: Precision> = Borrowed<P, T::Dev>;
    fn as_tensor(&self) -> &Tensor<T::Elem, T::Dev> {
        (**self).as_tensor()
    }
    fn hold<P: Precision>(t: Tensor<P, T::Dev>) -> Borrowed<P, T::Dev> {
        Borrowed(t)
    }
}

/// A cast argument that was owned: handed on by value.
pub struct Owned<P: Precision, D: Device = Cpu>(Tensor<P, D>);
/// A cast argument that was a reference: handed on as a reference to this temporary.
pub struct Borrowed<P: Precision, D: Device = Cpu>(Tensor<P, D>);
/// An argument that is not a tensor: handed on as it came.
pub struct Same<T>(T);

/// Unwraps [`Owned`] and [`Same`] by value.
pub trait TakeHeld {
    /// What comes out.
    type Out;
    /// The value.
    fn __amp_get(self) -> Self::Out;
}
impl<P: Precision, D: Device> TakeHeld for Owned<P, D> {
    type Out = Tensor<P, D>;
    #[inline(always)]
    fn __amp_get(self) -> Tensor<P, D> {
        self.0
    }
}
impl<T> TakeHeld for Same<T> {
    type Out = T;
    #[inline(always)]
    fn __amp_get(self) -> T {
        self.0
    }
}

/// Lends out [`Borrowed`].
pub trait BorrowHeld {
    /// The precision.
    type P: Precision;
    /// The device.
    type Dev: Device;
    /// A reference to the cast tensor.
    fn __amp_get(&self) -> &Tensor<Self::P, Self::Dev>;
}
impl<P: Precision, D: Device> BorrowHeld for Borrowed<P, D> {
    type P = P;
    type Dev = D;
    #[inline(always)]
    fn __amp_get(&self) -> &Tensor<P, D> {
        &self.0
    }
}

// ---- one operand -------------------------------------------------------------------------

/// One operand, waiting for its type to pick a cast or a pass-through.
pub struct W<T>(Cell<Option<T>>);

impl<T> W<T> {
    /// Wraps an operand.
    #[inline(always)]
    pub fn new(value: T) -> Self {
        W(Cell::new(Some(value)))
    }
    #[inline(always)]
    fn take(&self) -> T {
        self.0.take().expect("autocast operand used once")
    }
}

/// f64 operands: untouched (level 1; autocast changes only f32, f16 and bf16).
pub trait KeepF64 {
    /// The operand's type.
    type Value;
    /// The receiver, untouched.
    fn __amp_to<L>(&self) -> Self::Value;
    /// The argument, untouched.
    fn __amp_arg<L>(&self) -> Same<Self::Value>;
}
impl<T: AsTensor<Elem = f64>> KeepF64 for W<T> {
    type Value = T;
    #[inline(always)]
    fn __amp_to<L>(&self) -> T {
        self.take()
    }
    #[inline(always)]
    fn __amp_arg<L>(&self) -> Same<T> {
        Same(self.take())
    }
}

/// Tensor-like operands: cast (level 2), on their own device.
pub trait CastSpec {
    /// The operand's device.
    type Dev: Device;
    /// The held form of a cast argument.
    type Held<L: Precision>;
    /// The receiver, cast to `L`.
    fn __amp_to<L: Precision>(&self) -> Tensor<L, Self::Dev>;
    /// An argument, cast to `L`, in its original form.
    fn __amp_arg<L: Precision>(&self) -> Self::Held<L>;
}
impl<T: AsTensor> CastSpec for &W<T> {
    type Dev = T::Dev;
    type Held<L: Precision> = T::Held<L>;
    #[inline]
    fn __amp_to<L: Precision>(&self) -> Tensor<L, T::Dev> {
        cast(self.take().as_tensor())
    }
    #[inline]
    fn __amp_arg<L: Precision>(&self) -> T::Held<L> {
        T::hold(cast(self.take().as_tensor()))
    }
}

/// Everything else: passed through (level 3, reached by a mutable autoref).
pub trait CastPass {
    /// The operand's type.
    type Value;
    /// The receiver, untouched.
    fn __amp_to<L>(&mut self) -> Self::Value;
    /// The argument, untouched.
    fn __amp_arg<L>(&mut self) -> Same<Self::Value>;
}
impl<T> CastPass for &W<T> {
    type Value = T;
    #[inline(always)]
    fn __amp_to<L>(&mut self) -> T {
        self.take()
    }
    #[inline(always)]
    fn __amp_arg<L>(&mut self) -> Same<T> {
        Same(self.take())
    }
}

/// An optional tensor argument (a norm's weight), cast when present.
pub struct OptHeld<P: Precision, D: Device = Cpu>(Option<Tensor<P, D>>);

/// Lends out [`OptHeld`].
pub trait BorrowOpt {
    /// The precision.
    type P: Precision;
    /// The device.
    type Dev: Device;
    /// The cast tensor, if there was one.
    fn __amp_get(&self) -> Option<&Tensor<Self::P, Self::Dev>>;
}
impl<P: Precision, D: Device> BorrowOpt for OptHeld<P, D> {
    type P = P;
    type Dev = D;
    #[inline(always)]
    fn __amp_get(&self) -> Option<&Tensor<P, D>> {
        self.0.as_ref()
    }
}

/// `Option<&f64 tensor>` arguments: untouched (level 1).
pub trait KeepF64Opt {
    /// The operand's type.
    type Value;
    /// The argument, untouched.
    fn __amp_opt<L>(&self) -> Same<Self::Value>;
}
impl<'a, T: AsTensor<Elem = f64> + ?Sized> KeepF64Opt for W<Option<&'a T>> {
    type Value = Option<&'a T>;
    #[inline(always)]
    fn __amp_opt<L>(&self) -> Same<Option<&'a T>> {
        Same(self.take())
    }
}

/// `Option<&tensor>` arguments: cast when present (level 2).
pub trait OptSpec {
    /// The argument's device.
    type Dev: Device;
    /// An optional argument, cast to `L`.
    fn __amp_opt<L: Precision>(&self) -> OptHeld<L, Self::Dev>;
}
impl<T: AsTensor + ?Sized> OptSpec for &W<Option<&T>> {
    type Dev = T::Dev;
    #[inline]
    fn __amp_opt<L: Precision>(&self) -> OptHeld<L, T::Dev> {
        OptHeld(self.take().map(|t| cast(t.as_tensor())))
    }
}

/// Anything else in an optional-tensor position: untouched (level 3).
pub trait OptPass {
    /// The operand's type.
    type Value;
    /// The argument, untouched.
    fn __amp_opt<L>(&mut self) -> Same<Self::Value>;
}
impl<T> OptPass for &W<T> {
    type Value = T;
    #[inline(always)]
    fn __amp_opt<L>(&mut self) -> Same<T> {
        Same(self.take())
    }
}

// ---- a module's method (`self.fc1.forward(&x)`, `block.forward(&x, rng)`) --------------------

/// A place receiver of `m.forward(..)` / `m.loss(..)`, handed on the way a method call would
/// take it: a `&mut T` by value (reborrowed, so it can be used again), anything else as `&T`
/// ([`PlaceRef`]).
pub trait PlaceMut {
    /// The reborrowed reference.
    fn __amp_place(self) -> Self;
}
impl<T: ?Sized> PlaceMut for &mut T {
    #[inline(always)]
    fn __amp_place(self) -> Self {
        self
    }
}

/// A place receiver that is not a `&mut T`: borrowed.
pub trait PlaceRef {
    /// A shared borrow of it.
    fn __amp_place(&self) -> &Self;
}
impl<T: ?Sized> PlaceRef for T {
    #[inline(always)]
    fn __amp_place(&self) -> &Self {
        self
    }
}

/// An `amp::nn` module whose methods take the compute precision as a type parameter that
/// their arguments need not fix ([`Linear`](crate::nn::Linear), [`Mlp`](crate::nn::Mlp),
/// [`CausalSelfAttention`](crate::nn::CausalSelfAttention), [`Block`](crate::nn::Block),
/// [`Gpt`](crate::nn::Gpt)), of any weight precision and on any device, or a reference or
/// pointer to one.
pub trait AsModule {
    /// The module.
    type Module;
    /// A reference to it.
    fn module(&self) -> &Self::Module;
}

macro_rules! as_module {
    ($($m:ident),*) => {$(
        impl<W: Precision, D: Device> AsModule for crate::nn::$m<W, D> {
            type Module = Self;
            #[inline(always)]
            fn module(&self) -> &Self {
                self
            }
        }
    )*};
}
as_module!(Linear, Mlp, CausalSelfAttention, Block, Gpt);

macro_rules! as_module_through {
    ($($ptr:ty),*) => {$(
        impl<T: AsModule + ?Sized> AsModule for $ptr {
            type Module = T::Module;
            #[inline(always)]
            fn module(&self) -> &T::Module {
                (**self).module()
            }
        }
    )*};
}
as_module_through!(&T, &mut T, Box<T>, std::rc::Rc<T>, Arc<T>);

/// A module (held as `H`: the module, or a reference or pointer to it) whose `forward` /
/// `loss` run in the region's low type `P`: each method is the module's own with `P` as its
/// compute precision, the other arguments unchanged.
pub struct In<M, H, P>(H, std::marker::PhantomData<(fn() -> M, P)>);

/// An `amp::nn` module ([`AsModule`]): wrapped in [`In`] (level 1).
pub trait ModuleSpec {
    /// The module.
    type Module;
    /// How it is held.
    type Held;
    /// The module, its methods in `P`.
    fn __amp_in<P: Precision>(&self) -> In<Self::Module, Self::Held, P>;
}
impl<T: AsModule> ModuleSpec for W<T> {
    type Module = T::Module;
    type Held = T;
    #[inline(always)]
    fn __amp_in<P: Precision>(&self) -> In<T::Module, T, P> {
        In(self.take(), std::marker::PhantomData)
    }
}

/// Anything else (a module of your own, a tensor): handed back, so its own method is found
/// as written (level 2).
pub trait ModulePass {
    /// The receiver.
    type Value;
    /// The receiver, untouched.
    fn __amp_in<P>(&self) -> Self::Value;
}
impl<T> ModulePass for &W<T> {
    type Value = T;
    #[inline(always)]
    fn __amp_in<P>(&self) -> T {
        self.take()
    }
}

impl<W: Precision, D: Device, H: AsModule<Module = crate::nn::Linear<W, D>>, P: Precision>
    In<crate::nn::Linear<W, D>, H, P>
{
    /// [`Linear::forward`](crate::nn::Linear::forward) in `P`.
    #[inline]
    #[track_caller]
    pub fn forward<X: Precision>(self, x: &Tensor<X, D>) -> Tensor<P, D> {
        self.0.module().forward::<P, X>(x)
    }
    /// [`Linear::try_forward`](crate::nn::Linear::try_forward) in `P`.
    #[inline]
    pub fn try_forward<X: Precision>(self, x: &Tensor<X, D>) -> crate::Result<Tensor<P, D>> {
        self.0.module().try_forward::<P, X>(x)
    }
}

impl<W: Precision, D: Device, H: AsModule<Module = crate::nn::Mlp<W, D>>, P: Precision> In<crate::nn::Mlp<W, D>, H, P> {
    /// [`Mlp::forward`](crate::nn::Mlp::forward) in `P`.
    #[inline]
    #[track_caller]
    pub fn forward<X: Precision>(self, x: &Tensor<X, D>, rng: &mut crate::Rng) -> Tensor<P, D> {
        self.0.module().forward::<P, X>(x, rng)
    }
    /// [`Mlp::try_forward`](crate::nn::Mlp::try_forward) in `P`.
    #[inline]
    pub fn try_forward<X: Precision>(self, x: &Tensor<X, D>, rng: &mut crate::Rng) -> crate::Result<Tensor<P, D>> {
        self.0.module().try_forward::<P, X>(x, rng)
    }
}

impl<W: Precision, D: Device, H: AsModule<Module = crate::nn::CausalSelfAttention<W, D>>, P: Precision>
    In<crate::nn::CausalSelfAttention<W, D>, H, P>
{
    /// [`CausalSelfAttention::forward`](crate::nn::CausalSelfAttention::forward) in `P`.
    #[inline]
    #[track_caller]
    pub fn forward<X: Precision>(self, x: &Tensor<X, D>, rng: &mut crate::Rng) -> Tensor<P, D> {
        self.0.module().forward::<P, X>(x, rng)
    }
    /// [`CausalSelfAttention::try_forward`](crate::nn::CausalSelfAttention::try_forward) in `P`.
    #[inline]
    pub fn try_forward<X: Precision>(self, x: &Tensor<X, D>, rng: &mut crate::Rng) -> crate::Result<Tensor<P, D>> {
        self.0.module().try_forward::<P, X>(x, rng)
    }
}

impl<W: Precision, D: Device, H: AsModule<Module = crate::nn::Block<W, D>>, P: Precision>
    In<crate::nn::Block<W, D>, H, P>
{
    /// [`Block::forward`](crate::nn::Block::forward) in `P` (its value is the f32 residual
    /// stream, so only the region can say what `P` is).
    #[inline]
    #[track_caller]
    pub fn forward(self, x: &Tensor<f32, D>, rng: &mut crate::Rng) -> Tensor<f32, D> {
        self.0.module().forward::<P>(x, rng)
    }
    /// [`Block::try_forward`](crate::nn::Block::try_forward) in `P`.
    #[inline]
    pub fn try_forward(self, x: &Tensor<f32, D>, rng: &mut crate::Rng) -> crate::Result<Tensor<f32, D>> {
        self.0.module().try_forward::<P>(x, rng)
    }
}

impl<W: Precision, D: Device, H: AsModule<Module = crate::nn::Gpt<W, D>>, P: Precision> In<crate::nn::Gpt<W, D>, H, P> {
    /// [`Gpt::forward`](crate::nn::Gpt::forward) in `P`.
    #[inline]
    #[track_caller]
    pub fn forward(self, ids: &crate::Indices, rng: &mut crate::Rng) -> Tensor<P, D> {
        self.0.module().forward::<P>(ids, rng)
    }
    /// [`Gpt::try_forward`](crate::nn::Gpt::try_forward) in `P`.
    #[inline]
    pub fn try_forward(self, ids: &crate::Indices, rng: &mut crate::Rng) -> crate::Result<Tensor<P, D>> {
        self.0.module().try_forward::<P>(ids, rng)
    }
    /// [`Gpt::loss`](crate::nn::Gpt::loss) in `P` (an f32 loss, so only the region can say
    /// what `P` is).
    #[inline]
    #[track_caller]
    pub fn loss(self, ids: &crate::Indices, targets: &crate::Indices, rng: &mut crate::Rng) -> Tensor<f32, D> {
        self.0.module().loss::<P>(ids, targets, rng)
    }
    /// [`Gpt::try_loss`](crate::nn::Gpt::try_loss) in `P`.
    #[inline]
    pub fn try_loss(
        self,
        ids: &crate::Indices,
        targets: &crate::Indices,
        rng: &mut crate::Rng,
    ) -> crate::Result<Tensor<f32, D>> {
        self.0.module().try_loss::<P>(ids, targets, rng)
    }
}

/// The value of a `forward` / `loss` call of a module of your own, waiting for its type: a
/// `Tensor<L, D>` (any device) whose precision the call left open (`fn forward<L:
/// Precision>(..) -> Tensor<L, D>`) is fixed to the region's `L`.
pub struct Hint<L, T>(Cell<Option<T>>, std::marker::PhantomData<L>);

impl<L, T> Hint<L, T> {
    /// Wraps the value of a call.
    #[inline(always)]
    pub fn new(value: T) -> Self {
        Hint(Cell::new(Some(value)), std::marker::PhantomData)
    }
    #[inline(always)]
    fn take(&self) -> T {
        self.0.take().expect("autocast value used once")
    }
}

/// A tensor in the region's low type (or one whose precision is still open: it becomes that).
pub trait HintSpec {
    /// The tensor.
    type Out;
    /// Hands it on.
    fn __amp_low(&self) -> Self::Out;
}
impl<L: Precision, D: Device> HintSpec for Hint<L, Tensor<L, D>> {
    type Out = Tensor<L, D>;
    #[inline(always)]
    fn __amp_low(&self) -> Tensor<L, D> {
        self.take()
    }
}
/// The same for a `try_forward` of your own (`-> Result<Tensor<L, D>, E>`).
impl<L: Precision, D: Device, E> HintSpec for Hint<L, Result<Tensor<L, D>, E>> {
    type Out = Result<Tensor<L, D>, E>;
    #[inline(always)]
    fn __amp_low(&self) -> Result<Tensor<L, D>, E> {
        self.take()
    }
}

/// Anything else: untouched.
pub trait HintPass {
    /// The value.
    type Out;
    /// Hands it on.
    fn __amp_low(&self) -> Self::Out;
}
impl<L, T> HintPass for &Hint<L, T> {
    type Out = T;
    #[inline(always)]
    fn __amp_low(&self) -> T {
        self.take()
    }
}

// ---- two operands (promote) ------------------------------------------------------------------

/// Two operands of a promote op or an operator.
pub struct Pair<A, B>(Cell<Option<(A, B)>>);

impl<A, B> Pair<A, B> {
    /// Wraps two operands.
    #[inline(always)]
    pub fn new(a: A, b: B) -> Self {
        Pair(Cell::new(Some((a, b))))
    }
    #[inline(always)]
    fn take(&self) -> (A, B) {
        self.0.take().expect("autocast operands used once")
    }
}

/// Two tensor-like operands of a promote method (`a.add(&b)`): both to `Promoted<A, B>`, each
/// on its own device (operands on two devices are the op's type error, as written).
pub trait PromoteSpec {
    /// The cast receiver and the held argument.
    type Out;
    /// Casts both.
    fn __amp_promote(&self) -> Self::Out;
}
impl<A: AsTensor, B: AsTensor> PromoteSpec for Pair<A, B>
where
    A::Elem: Promote<B::Elem>,
{
    type Out = (Tensor<Promoted<A::Elem, B::Elem>, A::Dev>, B::Held<Promoted<A::Elem, B::Elem>>);
    #[inline]
    fn __amp_promote(&self) -> Self::Out {
        let (a, b) = self.take();
        (cast(a.as_tensor()), B::hold(cast(b.as_tensor())))
    }
}

/// Anything else: both untouched.
pub trait PromotePass {
    /// The operands.
    type Out;
    /// Hands both back.
    fn __amp_promote(&self) -> Self::Out;
}
impl<A, B> PromotePass for &Pair<A, B> {
    type Out = (A, Same<B>);
    #[inline(always)]
    fn __amp_promote(&self) -> (A, Same<B>) {
        let (a, b) = self.take();
        (a, Same(b))
    }
}

/// Two tensor-like operands of `+ - * /`: both to `Promoted<A, B>`, owned.
pub trait PromoteOpSpec {
    /// The cast operands.
    type Out;
    /// Casts both.
    fn __amp_promote_op(&self) -> Self::Out;
}
impl<A: AsTensor, B: AsTensor> PromoteOpSpec for Pair<A, B>
where
    A::Elem: Promote<B::Elem>,
{
    type Out = (Tensor<Promoted<A::Elem, B::Elem>, A::Dev>, Tensor<Promoted<A::Elem, B::Elem>, B::Dev>);
    #[inline]
    fn __amp_promote_op(&self) -> Self::Out {
        let (a, b) = self.take();
        (cast(a.as_tensor()), cast(b.as_tensor()))
    }
}

/// Anything else (numbers, strings): both untouched, so the operator means what it meant.
pub trait PromoteOpPass {
    /// The operands.
    type Out;
    /// Hands both back.
    fn __amp_promote_op(&self) -> Self::Out;
}
impl<A, B> PromoteOpPass for &Pair<A, B> {
    type Out = (A, B);
    #[inline(always)]
    fn __amp_promote_op(&self) -> (A, B) {
        self.take()
    }
}

// ---- many operands (`Tensor::cat(&[&a, &b, &c], 0)`, `Tensor::where_cond(m, &a, &b)`) --------

/// The widest precision of a tuple of tensor-like operands.
pub trait Widest {
    /// `Promoted` folded over the elements.
    type P: Precision;
}

macro_rules! widest {
    ($A:ident) => {
        impl<$A: AsTensor> Widest for ($A,) {
            type P = $A::Elem;
        }
    };
    ($A:ident, $($R:ident),+) => {
        impl<$A: AsTensor, $($R: AsTensor),+> Widest for ($A, $($R),+)
        where
            ($($R,)+): Widest,
            $A::Elem: Promote<<($($R,)+) as Widest>::P>,
        {
            type P = Promoted<$A::Elem, <($($R,)+) as Widest>::P>;
        }
        widest!($($R),+);
    };
}
widest!(A, B, C, D, E, F, G, H);

/// Several operands of one promote op.
pub struct Many<T>(Cell<Option<T>>);

impl<T> Many<T> {
    /// Wraps a tuple of operands.
    #[inline(always)]
    pub fn new(operands: T) -> Self {
        Many(Cell::new(Some(operands)))
    }
    #[inline(always)]
    fn take(&self) -> T {
        self.0.take().expect("autocast operands used once")
    }
}

/// Tensor-like operands: all to the widest precision, each in its original form and on its
/// own device.
pub trait ManySpec {
    /// The held operands.
    type Out;
    /// Casts every operand.
    fn __amp_promote_all(&self) -> Self::Out;
}

/// Anything else: untouched.
pub trait ManyPass {
    /// The operands.
    type Out;
    /// Hands them back.
    fn __amp_promote_all(&self) -> Self::Out;
}

macro_rules! many {
    ($tuple:ty; $($T:ident $v:ident),+) => {
        impl<$($T: AsTensor),+> ManySpec for Many<($($T,)+)>
        where
            $tuple: Widest,
        {
            type Out = ($($T::Held<<$tuple as Widest>::P>,)+);
            #[inline]
            fn __amp_promote_all(&self) -> Self::Out {
                let ($($v,)+) = self.take();
                ($($T::hold(cast($v.as_tensor())),)+)
            }
        }
        impl<$($T),+> ManyPass for &Many<($($T,)+)> {
            type Out = ($(Same<$T>,)+);
            #[inline(always)]
            fn __amp_promote_all(&self) -> Self::Out {
                let ($($v,)+) = self.take();
                ($(Same($v),)+)
            }
        }
    };
}
many!((A, B); A a, B b);
many!((A, B, C); A a, B b, C c);
many!((A, B, C, D); A a, B b, C c, D d);
many!((A, B, C, D, E); A a, B b, C c, D d, E e);
many!((A, B, C, D, E, F); A a, B b, C c, D d, E e, F f);
many!((A, B, C, D, E, F, G); A a, B b, C c, D d, E e, F f, G g);
many!((A, B, C, D, E, F, G, H); A a, B b, C c, D d, E e, F f, G g, H h);

// ---- return types --------------------------------------------------------------------------

/// A tensor value of any precision on any device: what [`conform`] takes (`conform::<T, _>`
/// names the tensor's type, so the precision and the device both come from it).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a `Tensor`, but the function's declared type has a `Tensor` here",
    label = "expected a `Tensor` value"
)]
pub trait IntoTensor {
    /// Its precision.
    type Elem: Precision;
    /// Its device.
    type Dev: Device;
    /// The tensor.
    fn into_tensor(self) -> Tensor<Self::Elem, Self::Dev>;
}

impl<E: Precision, D: Device> IntoTensor for Tensor<E, D> {
    type Elem = E;
    type Dev = D;
    #[inline(always)]
    fn into_tensor(self) -> Tensor<E, D> {
        self
    }
}

/// A tensor in the declared return precision `T`, on its own device (moved, not copied, when
/// it already is).
pub fn conform<T: Precision, X: IntoTensor>(t: X) -> Tensor<T, X::Dev> {
    match T::from_any(<X::Elem as Precision>::into_any(t.into_tensor())) {
        Ok(same) => same,
        Err(any) => {
            let t = any.downcast::<X::Elem>().unwrap_or_else(|_| unreachable!("the tensor came in as its own type"));
            count_cast();
            t.cast::<T>()
        }
    }
}

/// [`conform`] inside a `Result`.
pub fn conform_result<T: Precision, X: IntoTensor, Er>(r: Result<X, Er>) -> Result<Tensor<T, X::Dev>, Er> {
    r.map(conform::<T, X>)
}

/// [`conform`] on each element of a `Vec`.
pub fn conform_vec<T: Precision, X: IntoTensor>(v: Vec<X>) -> Vec<Tensor<T, X::Dev>> {
    v.into_iter().map(conform::<T, X>).collect()
}

/// [`conform`] inside an `Option`.
pub fn conform_option<T: Precision, X: IntoTensor>(o: Option<X>) -> Option<Tensor<T, X::Dev>> {
    o.map(conform::<T, X>)
}

// ---- region, cache and counters ------------------------------------------------------------

/// What a cache entry converted: the whole storage of a parameter (every view of it is then
/// served from one conversion), or one view of it (a small slice of a large parameter).
#[derive(Clone, PartialEq, Eq, Hash)]
enum Extent {
    Whole,
    View { shape: Vec<usize>, strides: Vec<usize>, offset: usize },
}

/// A source storage, by its device type and [`Device::storage_id`] (unique among the live
/// storages of that type, and the entry keeps its source alive), with what it was cast to.
#[derive(Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    device: TypeId,
    storage: usize,
    to: DType,
    extent: Extent,
}

/// One cached conversion on device `D`.
struct CacheEntry<D: Device> {
    /// Keeps the source storage alive (and shared), so its id cannot be reused and an in-place
    /// update copies on write instead of changing what this entry was cast from.
    source: D::Storage<f32>,
    /// The converted values (no autograd node): the whole storage, or the view made contiguous.
    cast: AnyTensor<D>,
}

/// A cache entry of any device, so one map holds them all (the key's device type says which
/// `CacheEntry<D>` is behind it).
trait AnyEntry: Any {
    /// Whether nothing but this entry holds its source storage any more: it can never be hit
    /// again (see the notes at the top).
    fn is_stale(&self) -> bool;
}

impl<D: Device> AnyEntry for CacheEntry<D> {
    fn is_stale(&self) -> bool {
        D::is_exclusive(&self.source)
    }
}

/// One open region: its cache switch and low type.
#[derive(Clone, Copy)]
struct RegionInfo {
    cache: bool,
    low: DType,
    /// The [`OffGuard`] count outside this region: an `#[autocast]` function's own body is
    /// checked again, wherever it is called from.
    outer_off: u32,
}

#[derive(Default)]
struct State {
    /// Open regions, innermost last.
    regions: Vec<RegionInfo>,
    /// Open [`OffGuard`]s: code that runs as written inside a region (`autocast_off!`,
    /// `#[autocast(off)]`, `passthrough`, a user's own categorised function, the backward
    /// pass), where the reach check does not apply.
    off: u32,
    cache: HashMap<CacheKey, Box<dyn AnyEntry>>,
    casts: u64,
    hits: u64,
}

impl State {
    /// Takes out the entries nothing but the cache holds the source of (see the notes at the
    /// top); the caller drops them outside the borrow.
    fn take_stale(&mut self) -> Vec<Box<dyn AnyEntry>> {
        let stale: Vec<CacheKey> = self.cache.iter().filter(|(_, e)| e.is_stale()).map(|(k, _)| k.clone()).collect();
        stale.into_iter().filter_map(|k| self.cache.remove(&k)).collect()
    }
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// An autocast region, entered by each `#[autocast]` function for the length of its body.
/// The weight cast cache is cleared when the outermost region on the thread exits (stale
/// entries go earlier: see the notes at the top).
#[must_use]
pub struct Region {
    // A region belongs to the thread whose state it pushed.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Region {
    /// Enters a region of low type `L`; `cache` switches the weight cast cache on or off
    /// inside it. `chosen` says whether the function chose `L` (`#[autocast(bf16)]`, `(f16)`,
    /// `(f32)`, a type parameter) or took the default of a bare `#[autocast]`; `name` is the
    /// function's, for the message.
    ///
    /// # Panics
    /// When the default was taken and the innermost open region has another low type: the
    /// caller asked for (say) bf16, and this function would silently run its ops in f16.
    #[inline]
    #[track_caller]
    pub fn enter<L: Precision>(cache: bool, chosen: bool, name: &'static str) -> Region {
        let outer = STATE.with(|s| s.borrow().regions.last().map(|r| r.low));
        if let Some(outer) = outer
            && !chosen
            && outer != L::DTYPE
        {
            let (low, outer) = (L::DTYPE.name(), outer.name());
            panic!(
                "`{name}` is `#[autocast]` ({low}) but was called from a {outer} autocast region: make it generic, \
                 `#[autocast(P)] fn {name}<P: Precision>(..)`, and call it as `{name}::<P>(..)`, or give it \
                 `#[autocast({outer})]`"
            );
        }
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            let outer_off = std::mem::take(&mut s.off);
            s.regions.push(RegionInfo { cache, low: L::DTYPE, outer_off });
        });
        Region { _not_send: std::marker::PhantomData }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // Dropped outside the borrow: the cached tensors may free graph nodes.
        let cleared = STATE.with(|s| {
            let mut s = s.borrow_mut();
            if let Some(r) = s.regions.pop() {
                s.off = r.outer_off;
            }
            if s.regions.is_empty() { std::mem::take(&mut s.cache).into_values().collect() } else { s.take_stale() }
        });
        drop(cleared);
    }
}

/// Marks code that runs as written inside an autocast region for as long as it lives (see
/// `check_reach`).
#[must_use]
pub struct OffGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl OffGuard {
    /// Starts running as written.
    #[inline]
    pub fn new() -> OffGuard {
        STATE.with(|s| s.borrow_mut().off += 1);
        OffGuard { _not_send: std::marker::PhantomData }
    }
}

impl Default for OffGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for OffGuard {
    fn drop(&mut self) {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.off = s.off.saturating_sub(1);
        });
    }
}

/// The reach check: code that `#[autocast]` rewrote always hands a table op the inputs its
/// policy row asks for (the region's low type for lower-precision ops, f32 for fp32 ones), so
/// an op that meets another precision inside an enabled region was called from code the
/// attribute did not reach (a helper function or a module's method without it). That code
/// would silently run as written (PyTorch's dynamic region would have cast it), so it panics,
/// naming the fix. f64 is never cast, regions of low type f32 are autocast off, and
/// [`OffGuard`]s mark code meant to run as written.
#[inline]
#[track_caller]
pub(crate) fn check_reach(op: &'static str, input: DType) {
    if input == DType::F64 {
        return;
    }
    let low = STATE.with(|s| {
        let s = s.borrow();
        if s.off > 0 { None } else { s.regions.last().map(|r| r.low) }
    });
    let Some(low) = low.filter(|l| *l != DType::F32) else { return };
    use crate::policy::Category;
    let want = match crate::policy::lookup(op).map(|p| p.category) {
        Some(Category::LowerPrecision) => low,
        Some(Category::Fp32 | Category::Fp32Accumulate) => DType::F32,
        _ => return,
    };
    if input != want {
        panic!(
            "`{op}` ran on a {input} tensor inside a `#[autocast]` ({low}) region, where autocast runs it in {want}: \
             the code that called it is not rewritten by `#[autocast]` (a helper, or a module's method, without \
             the attribute; or a macro call's arguments, `vec![..]`, `assert!(..)`, which no attribute rewrites: \
             compute the value in a `let` first), so its ops would run as written. Put `#[autocast(P)]` on that function (generic: \
             `fn f<P: Precision>(..)`, called as `f::<P>(..)`), or `#[autocast]`, or list it in the caller's \
             `fp32 = [..]` / `lower = [..]`; code meant to run as written goes in `autocast_off! {{ .. }}`"
        );
    }
}

/// The number of entries in this thread's weight cast cache (bounded: see the notes at the top).
pub fn cache_entries() -> usize {
    STATE.with(|s| s.borrow().cache.len())
}

/// Counts of the casts `#[autocast]` code ran on this thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CastStats {
    /// Conversions performed (each one a pass over the data).
    pub casts: u64,
    /// Casts served by the weight cast cache instead.
    pub cache_hits: u64,
}

/// The counts since the last [`reset_cast_stats`] on this thread.
pub fn cast_stats() -> CastStats {
    STATE.with(|s| {
        let s = s.borrow();
        CastStats { casts: s.casts, cache_hits: s.hits }
    })
}

/// Zeroes this thread's counts.
pub fn reset_cast_stats() {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.casts = 0;
        s.hits = 0;
    })
}

/// Whether an `#[autocast]` region is open on this thread.
pub fn in_region() -> bool {
    STATE.with(|s| !s.borrow().regions.is_empty())
}

fn count_cast() {
    STATE.with(|s| s.borrow_mut().casts += 1);
}

/// Ops that only re-view their input's storage.
const VIEW_OPS: &[&str] = &["permute", "reshape", "narrow", "broadcast_to"];

/// Whether `node` is a leaf, or views of a leaf all the way down.
fn is_leaf_view<D: Device>(node: &Arc<Node<D>>) -> bool {
    let mut n = node;
    loop {
        if n.backward.is_none() {
            return true;
        }
        if !VIEW_OPS.contains(&n.op) || n.parents.len() != 1 {
            return false;
        }
        match &n.parents[0] {
            Some(p) => n = p,
            None => return false,
        }
    }
}

/// The cast autocast inserts, on the tensor's own device: a no-op for the same precision,
/// served from the weight cast cache for f32 parameters (and views of them) going to a 16-bit
/// type, a counted conversion otherwise.
///
/// A cached cast shares the converted values but records its own `cast` node on the tensor it
/// was asked for, so each use's gradient is cast back to f32 and summed in f32 at the
/// parameter, exactly as if `.cast()` had been written at each use; only the conversion is
/// done once.
pub fn cast<E: Precision, T: Precision, D: Device>(t: &Tensor<E, D>) -> Tensor<T, D> {
    if E::DTYPE == T::DTYPE {
        return T::from_any(E::into_any(t.clone())).unwrap_or_else(|_| unreachable!("same precision"));
    }
    let cacheable = E::DTYPE == DType::F32
        && matches!(T::DTYPE, DType::F16 | DType::BF16)
        && t.node.as_ref().is_some_and(is_leaf_view)
        && STATE.with(|s| s.borrow().regions.last().is_some_and(|r| r.cache));
    // `t` as a Tensor<f32, D> (E is f32 when cacheable).
    let Some(source) = cacheable.then(|| f32::from_any(E::into_any(t.clone())).ok()).flatten() else {
        count_cast();
        return t.cast::<T>();
    };
    // Convert the whole parameter when the view covers most of it (every other view of it is
    // then free); a small slice of a large parameter is converted on its own.
    let len = D::len(&source.storage);
    let whole = source.numel() * 2 >= len;
    let layout = &source.layout;
    let extent = if whole {
        Extent::Whole
    } else {
        Extent::View { shape: layout.shape.clone(), strides: layout.strides.clone(), offset: layout.offset }
    };
    let id = D::storage_id(&source.storage);
    let key = CacheKey { device: TypeId::of::<D>(), storage: id, to: T::DTYPE, extent };
    let cached = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let found = s.cache.get(&key).and_then(|e| {
            let e = (&**e as &dyn Any).downcast_ref::<CacheEntry<D>>()?;
            let same_storage = D::storage_id(&e.source) == id;
            same_storage.then(|| T::any_ref(&e.cast).cloned()).flatten()
        });
        if found.is_some() {
            s.hits += 1;
        }
        found
    });
    let values = cached.unwrap_or_else(|| {
        count_cast();
        let converted = if whole {
            // The storage as it lies, whatever view of it `t` is.
            let all = crate::layout::Layout::contiguous(&[len]);
            let cast = source.device.cast::<f32, T>(&source.storage, &all);
            Tensor::<T, D>::from_storage(&source.device, cast, &[len])
        } else {
            source.detach().cast::<T>()
        };
        let entry: Box<dyn AnyEntry> =
            Box::new(CacheEntry::<D> { source: source.storage.clone(), cast: T::into_any(converted.clone()) });
        let stale = STATE.with(|s| {
            let mut s = s.borrow_mut();
            let stale = s.take_stale();
            s.cache.insert(key, entry);
            stale
        });
        drop(stale);
        converted
    });
    let layout = if whole { source.layout.clone() } else { values.layout.clone() };
    let out = Tensor { storage: values.storage, layout, node: None, device: source.device.clone() };
    out.record("cast", vec![t.node.clone()], |g| vec![Some(g.cast::<E>().into())])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_serves_leaves_and_views_and_sees_updates() {
        reset_cast_stats();
        let mut w = Param::new(Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2]));
        {
            let _r = Region::enter::<f16>(true, true, "test");
            let a: Tensor<f16> = cast(w.tensor());
            let b: Tensor<f16> = cast(w.tensor());
            assert_eq!(cast_stats(), CastStats { casts: 1, cache_hits: 1 });
            assert_eq!(a.to_vec(), b.to_vec());
            // Views of the parameter are served from the same conversion.
            let t1: Tensor<f16> = cast(&w.t());
            assert_eq!(cast_stats(), CastStats { casts: 1, cache_hits: 2 });
            assert_eq!(t1.to_vec(), w.t().cast::<f16>().to_vec());
            // A small slice is converted on its own, once.
            let n1: Tensor<f16> = cast(&w.reshape(&[4]).narrow(0, 1, 1));
            let n2: Tensor<f16> = cast(&w.reshape(&[4]).narrow(0, 1, 1));
            assert_eq!(cast_stats(), CastStats { casts: 2, cache_hits: 3 });
            assert_eq!((n1.to_f32_vec(), n2.to_f32_vec()), (vec![2.0], vec![2.0]));
            // An update inside the region is seen: the cache entry shares the old storage,
            // so the update copies on write and the next lookup misses.
            w.data_mut()[0] = 10.0;
            let c: Tensor<f16> = cast(w.tensor());
            assert_eq!(c.to_vec()[0], f16::from_f32(10.0));
            assert_eq!(cast_stats().casts, 3);
            // Not a leaf: never cached.
            let y = w.mul_scalar(2.0);
            let _: Tensor<f16> = cast(&y);
            let _: Tensor<f16> = cast(&y);
            assert_eq!(cast_stats().casts, 5);
        }
        assert!(!in_region());
        // Outside a region: no cache.
        let _: Tensor<f16> = cast(w.tensor());
        let _: Tensor<f16> = cast(w.tensor());
        assert_eq!(cast_stats().casts, 7);
        // Same precision: no cast at all.
        let _: Tensor<f32> = cast(w.tensor());
        assert_eq!(cast_stats().casts, 7);
    }

    #[test]
    fn cached_casts_carry_gradients_like_written_casts() {
        let w = Param::new(Tensor::<f32>::from_vec(vec![0.5, -1.0, 2.0, 0.25], &[2, 2]));
        let x = Tensor::<f32>::from_vec(vec![1.0, 2.0, -3.0, 0.5], &[2, 2]).cast::<f16>();
        let by_hand = x.matmul(&w.cast::<f16>()).add(&x.matmul(&w.t().cast::<f16>())).cast::<f32>().sum_all();
        let _r = Region::enter::<f16>(true, true, "test");
        let cached = x.matmul(&cast(w.tensor())).add(&x.matmul(&cast(&w.t()))).cast::<f32>().sum_all();
        assert_eq!(cached.to_vec(), by_hand.to_vec());
        let (g1, g2) = (by_hand.backward(), cached.backward());
        assert_eq!(g1.get(&w).unwrap().to_vec(), g2.get(&w).unwrap().to_vec());
        assert_eq!(g2.get(&w).unwrap().dtype(), DType::F32);
    }

    #[test]
    fn cache_switch_and_nesting() {
        reset_cast_stats();
        let w = Param::new(Tensor::<f32>::ones(&[3]));
        let outer = Region::enter::<f16>(true, true, "test");
        let _: Tensor<bf16> = cast(w.tensor());
        {
            let _inner = Region::enter::<f16>(false, true, "test");
            let _: Tensor<bf16> = cast(w.tensor());
        }
        {
            let _inner = Region::enter::<f16>(true, true, "test");
            let _: Tensor<bf16> = cast(w.tensor());
            // Another target type is another entry.
            let _: Tensor<f16> = cast(w.tensor());
        }
        assert_eq!(cast_stats(), CastStats { casts: 3, cache_hits: 1 });
        drop(outer);
        let _r = Region::enter::<f16>(true, true, "test");
        let _: Tensor<bf16> = cast(w.tensor());
        assert_eq!(cast_stats().casts, 4, "the cache is cleared when the outermost region exits");
    }

    #[test]
    fn stale_entries_are_evicted() {
        let mut w = Param::new(Tensor::<f32>::ones(&[4]));
        let v = Param::new(Tensor::<f32>::ones(&[2]));
        let _outer = Region::enter::<f16>(true, true, "test");
        for step in 0..10 {
            {
                let _inner = Region::enter::<f16>(true, false, "test");
                let _: Tensor<f16> = cast(w.tensor());
                let _: Tensor<f16> = cast(v.tensor());
            }
            // The inner region's exit swept nothing live: one entry per parameter.
            assert_eq!(cache_entries(), 2, "step {step}");
            // An update copies on write: w's entry is stale from here on, and goes at the next
            // insert or region exit.
            w.data_mut()[0] += 1.0;
        }
        let t = Tensor::<f32>::ones(&[3]).requires_grad_();
        let _: Tensor<f16> = cast(&t);
        assert_eq!(cache_entries(), 2, "w's stale entry went at the insert");
        drop(t);
        {
            let _inner = Region::enter::<f16>(true, true, "test");
        }
        assert_eq!(cache_entries(), 1, "a dropped tensor's entry goes at a region exit");
    }

    #[test]
    fn regions_record_their_type() {
        let outer = Region::enter::<bf16>(true, true, "outer");
        // Chosen types are kept under any region; the default is refused under another type.
        drop(Region::enter::<f16>(true, true, "chosen"));
        drop(Region::enter::<bf16>(true, false, "same"));
        let err = std::panic::catch_unwind(|| drop(Region::enter::<f16>(true, false, "helper"))).unwrap_err();
        let msg = err.downcast_ref::<String>().unwrap();
        assert!(msg.starts_with("`helper` is `#[autocast]` (f16) but was called from a bf16 autocast region"), "{msg}");
        assert!(msg.ends_with("or give it `#[autocast(bf16)]`"), "{msg}");
        drop(outer);
        assert!(!in_region());
        drop(Region::enter::<f16>(true, false, "top level"));
    }
}
