//! Support for the code `#[autocast]` generates. Not a public API: only amp-macros calls it,
//! through `::amp_core::__private` (or `::amp::__private`), and it changes without notice.
//!
//! Design notes:
//! - The macro sees names, not types, so the type decides: the generated code wraps each
//!   operand as `(&W::new(x)).__amp_to::<T>()`. Method lookup tries three receiver types in
//!   turn (autoref specialisation), and the first level whose impl applies wins:
//!   1. `&W<X>` (impls on `W<X>`): [`KeepF64`], for f64 operands (`Tensor<f64>`, `Param<f64>`,
//!      references to them), handed back untouched: autocast only changes f32/f16/bf16, as
//!      PyTorch's only touches those, so f64 code runs as written.
//!   2. `&&W<X>` (impls on `&W<X>`, `&self`): [`CastSpec`], for other tensor-like operands
//!      (`X:` [`AsTensor`]), cast to `T`. A generic `Tensor<E>` with `E: Precision` lands here
//!      (the compiler cannot prove `E = f64`), so generic code keeps its declared `Tensor<T>`.
//!   3. `&mut &W<X>` (impls on `&W<X>`, `&mut self`): [`CastPass`], for anything else (an
//!      iterator, an `f32`, a user type), handed back untouched.
//!
//!   The value sits in a `Cell<Option<_>>` so every impl can move it out from behind a
//!   reference. Everything inlines to the cast (or to nothing).
//! - Arguments keep their form: a `&Tensor` comes back as a reference to the cast temporary
//!   ([`Borrowed`], read with `&self`), an owned tensor as an owned one ([`Owned`]), anything
//!   else as itself ([`Same`]); `__amp_get` picks the right one by plain method lookup, as the
//!   three are distinct types.
//! - `recv.forward(..)` / `recv.loss(..)` without a turbofish: the receiver goes through the
//!   same two-level lookup, `(&W::new(recv)).__amp_in::<L>()`. An `amp::nn` module whose
//!   compute precision is a type parameter ([`AsModule`]: the module, or a reference or
//!   pointer to one) comes back as [`In`], whose `forward` / `loss` call the module's own with
//!   `::<L>` (so `block.forward(&x, rng)`, whose value is the f32 residual stream, runs in
//!   `L` too); anything else comes back as it went in, and its own method is found as written.
//!   A place receiver goes in as a method call would take it: mutably when the macro sees the
//!   place is mutable (`&mut place`), else through [`PlaceMut`] / [`PlaceRef`]
//!   (`place.__amp_place()`: a `&mut T` reborrowed, anything else borrowed); a temporary is
//!   moved in, so a `forward(self)` of its own still works. The call's value then goes through
//!   [`Hint`], for modules of the user's own: a `Tensor<?L>` whose `L` is still open is
//!   unified with the region's low type; any other value passes through.
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
//! - Each entry keeps the source storage alive, so an in-place update of the parameter inside
//!   the region copies on write and can never be served a stale cast (the storage pointer no
//!   longer matches). An entry whose source storage nothing but the cache holds any more (the
//!   parameter moved on to its copy, or the tensor was dropped) can never be hit again: such
//!   entries are evicted at every insert and every region exit, so the cache holds at most one
//!   entry per live source storage, target type and extent, plus those gone stale since the
//!   last insert or exit (at most one per parameter updated since), however long a loop inside
//!   one region runs ([`cache_entries`] counts them).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

use crate::autograd::{AnyTensor, Node};
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

/// A tensor-like operand: `Tensor<E>`, `Param<E>`, or a reference to one.
pub trait AsTensor {
    /// Its precision.
    type Elem: Precision;
    /// How a cast of it is handed on: owned for an owned value, borrowed for a reference.
    type Held<P: Precision>;
    /// The tensor inside.
    fn as_tensor(&self) -> &Tensor<Self::Elem>;
    /// Wraps a cast of it in the matching form.
    fn hold<P: Precision>(t: Tensor<P>) -> Self::Held<P>;
}

impl<E: Precision> AsTensor for Tensor<E> {
    type Elem = E;
    type Held<P: Precision> = Owned<P>;
    fn as_tensor(&self) -> &Tensor<E> {
        self
    }
    fn hold<P: Precision>(t: Tensor<P>) -> Owned<P> {
        Owned(t)
    }
}

impl<E: Precision> AsTensor for Param<E> {
    type Elem = E;
    type Held<P: Precision> = Owned<P>;
    fn as_tensor(&self) -> &Tensor<E> {
        self.tensor()
    }
    fn hold<P: Precision>(t: Tensor<P>) -> Owned<P> {
        Owned(t)
    }
}

impl<T: AsTensor + ?Sized> AsTensor for &T {
    type Elem = T::Elem;
    type Held<P: Precision> = Borrowed<P>;
    fn as_tensor(&self) -> &Tensor<T::Elem> {
        (**self).as_tensor()
    }
    fn hold<P: Precision>(t: Tensor<P>) -> Borrowed<P> {
        Borrowed(t)
    }
}

impl<T: AsTensor + ?Sized> AsTensor for &mut T {
    type Elem = T::Elem;
    type Held<P: Precision> = Borrowed<P>;
    fn as_tensor(&self) -> &Tensor<T::Elem> {
        (**self).as_tensor()
    }
    fn hold<P: Precision>(t: Tensor<P>) -> Borrowed<P> {
        Borrowed(t)
    }
}

/// A cast argument that was owned: handed on by value.
pub struct Owned<P: Precision>(Tensor<P>);
/// A cast argument that was a reference: handed on as a reference to this temporary.
pub struct Borrowed<P: Precision>(Tensor<P>);
/// An argument that is not a tensor: handed on as it came.
pub struct Same<T>(T);

/// Unwraps [`Owned`] and [`Same`] by value.
pub trait TakeHeld {
    /// What comes out.
    type Out;
    /// The value.
    fn __amp_get(self) -> Self::Out;
}
impl<P: Precision> TakeHeld for Owned<P> {
    type Out = Tensor<P>;
    #[inline(always)]
    fn __amp_get(self) -> Tensor<P> {
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
    /// A reference to the cast tensor.
    fn __amp_get(&self) -> &Tensor<Self::P>;
}
impl<P: Precision> BorrowHeld for Borrowed<P> {
    type P = P;
    #[inline(always)]
    fn __amp_get(&self) -> &Tensor<P> {
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

/// Tensor-like operands: cast (level 2).
pub trait CastSpec {
    /// The held form of a cast argument.
    type Held<L: Precision>;
    /// The receiver, cast to `L`.
    fn __amp_to<L: Precision>(&self) -> Tensor<L>;
    /// An argument, cast to `L`, in its original form.
    fn __amp_arg<L: Precision>(&self) -> Self::Held<L>;
}
impl<T: AsTensor> CastSpec for &W<T> {
    type Held<L: Precision> = T::Held<L>;
    #[inline]
    fn __amp_to<L: Precision>(&self) -> Tensor<L> {
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
pub struct OptHeld<P: Precision>(Option<Tensor<P>>);

/// Lends out [`OptHeld`].
pub trait BorrowOpt {
    /// The precision.
    type P: Precision;
    /// The cast tensor, if there was one.
    fn __amp_get(&self) -> Option<&Tensor<Self::P>>;
}
impl<P: Precision> BorrowOpt for OptHeld<P> {
    type P = P;
    #[inline(always)]
    fn __amp_get(&self) -> Option<&Tensor<P>> {
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
    /// An optional argument, cast to `L`.
    fn __amp_opt<L: Precision>(&self) -> OptHeld<L>;
}
impl<T: AsTensor + ?Sized> OptSpec for &W<Option<&T>> {
    #[inline]
    fn __amp_opt<L: Precision>(&self) -> OptHeld<L> {
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
/// [`Gpt`](crate::nn::Gpt)), or a reference or pointer to one.
pub trait AsModule {
    /// The module.
    type Module;
    /// A reference to it.
    fn module(&self) -> &Self::Module;
}

macro_rules! as_module {
    ($($m:ident),*) => {$(
        impl<W: Precision> AsModule for crate::nn::$m<W> {
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

impl<W: Precision, H: AsModule<Module = crate::nn::Linear<W>>, P: Precision> In<crate::nn::Linear<W>, H, P> {
    /// [`Linear::forward`](crate::nn::Linear::forward) in `P`.
    #[inline]
    #[track_caller]
    pub fn forward<X: Precision>(self, x: &Tensor<X>) -> Tensor<P> {
        self.0.module().forward::<P, X>(x)
    }
}

impl<W: Precision, H: AsModule<Module = crate::nn::Mlp<W>>, P: Precision> In<crate::nn::Mlp<W>, H, P> {
    /// [`Mlp::forward`](crate::nn::Mlp::forward) in `P`.
    #[inline]
    #[track_caller]
    pub fn forward<X: Precision>(self, x: &Tensor<X>, rng: &mut crate::Rng) -> Tensor<P> {
        self.0.module().forward::<P, X>(x, rng)
    }
}

impl<W: Precision, H: AsModule<Module = crate::nn::CausalSelfAttention<W>>, P: Precision>
    In<crate::nn::CausalSelfAttention<W>, H, P>
{
    /// [`CausalSelfAttention::forward`](crate::nn::CausalSelfAttention::forward) in `P`.
    #[inline]
    #[track_caller]
    pub fn forward<X: Precision>(self, x: &Tensor<X>, rng: &mut crate::Rng) -> Tensor<P> {
        self.0.module().forward::<P, X>(x, rng)
    }
}

impl<W: Precision, H: AsModule<Module = crate::nn::Block<W>>, P: Precision> In<crate::nn::Block<W>, H, P> {
    /// [`Block::forward`](crate::nn::Block::forward) in `P` (its value is the f32 residual
    /// stream, so only the region can say what `P` is).
    #[inline]
    #[track_caller]
    pub fn forward(self, x: &Tensor<f32>, rng: &mut crate::Rng) -> Tensor<f32> {
        self.0.module().forward::<P>(x, rng)
    }
}

impl<W: Precision, H: AsModule<Module = crate::nn::Gpt<W>>, P: Precision> In<crate::nn::Gpt<W>, H, P> {
    /// [`Gpt::forward`](crate::nn::Gpt::forward) in `P`.
    #[inline]
    #[track_caller]
    pub fn forward(self, ids: &crate::Indices, rng: &mut crate::Rng) -> Tensor<P> {
        self.0.module().forward::<P>(ids, rng)
    }
    /// [`Gpt::loss`](crate::nn::Gpt::loss) in `P` (an f32 loss, so only the region can say
    /// what `P` is).
    #[inline]
    #[track_caller]
    pub fn loss(self, ids: &crate::Indices, targets: &crate::Indices, rng: &mut crate::Rng) -> Tensor<f32> {
        self.0.module().loss::<P>(ids, targets, rng)
    }
}

/// The value of a `forward` / `loss` call of a module of your own, waiting for its type: a
/// `Tensor<L>` whose precision the call left open (`fn forward<L: Precision>(..) ->
/// Tensor<L>`) is fixed to the region's `L`.
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
impl<L: Precision> HintSpec for Hint<L, Tensor<L>> {
    type Out = Tensor<L>;
    #[inline(always)]
    fn __amp_low(&self) -> Tensor<L> {
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

/// Two tensor-like operands of a promote method (`a.add(&b)`): both to `Promoted<A, B>`.
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
    type Out = (Tensor<Promoted<A::Elem, B::Elem>>, B::Held<Promoted<A::Elem, B::Elem>>);
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
    type Out = (Tensor<Promoted<A::Elem, B::Elem>>, Tensor<Promoted<A::Elem, B::Elem>>);
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

/// Tensor-like operands: all to the widest precision, each in its original form.
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

/// A tensor in the declared return precision `T` (moved, not copied, when it already is).
pub fn conform<T: Precision, E: Precision>(t: Tensor<E>) -> Tensor<T> {
    match T::from_any(E::into_any(t)) {
        Ok(same) => same,
        Err(any) => {
            let t = any.downcast::<E>().unwrap_or_else(|_| unreachable!("the tensor came in as E"));
            count_cast();
            t.cast::<T>()
        }
    }
}

/// [`conform`] inside a `Result`.
pub fn conform_result<T: Precision, E: Precision, Er>(r: Result<Tensor<E>, Er>) -> Result<Tensor<T>, Er> {
    r.map(conform)
}

/// [`conform`] on each element of a `Vec`.
pub fn conform_vec<T: Precision, E: Precision>(v: Vec<Tensor<E>>) -> Vec<Tensor<T>> {
    v.into_iter().map(conform).collect()
}

/// [`conform`] inside an `Option`.
pub fn conform_option<T: Precision, E: Precision>(o: Option<Tensor<E>>) -> Option<Tensor<T>> {
    o.map(conform)
}

// ---- region, cache and counters ------------------------------------------------------------

/// What a cache entry converted: the whole storage of a parameter (every view of it is then
/// served from one conversion), or one view of it (a small slice of a large parameter).
#[derive(Clone, PartialEq, Eq, Hash)]
enum Extent {
    Whole,
    View { shape: Vec<usize>, strides: Vec<usize>, offset: usize },
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    storage: usize,
    to: DType,
    extent: Extent,
}

struct CacheEntry {
    /// Keeps the source storage alive (and shared), so its address cannot be reused and an
    /// in-place update copies on write instead of changing what this entry was cast from.
    source: Arc<crate::cpu_memory::PooledVec<f32>>,
    /// The converted values (no autograd node): the whole storage, or the view made contiguous.
    cast: AnyTensor,
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
    cache: HashMap<CacheKey, CacheEntry>,
    casts: u64,
    hits: u64,
}

impl State {
    /// Takes out the entries nothing but the cache holds the source of (see the notes at the
    /// top); the caller drops them outside the borrow.
    fn take_stale(&mut self) -> Vec<CacheEntry> {
        let stale: Vec<CacheKey> =
            self.cache.iter().filter(|(_, e)| Arc::strong_count(&e.source) == 1).map(|(k, _)| k.clone()).collect();
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
/// [`check_reach`]).
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
             the function that called it is not rewritten by `#[autocast]` (a helper, or a module's method, without \
             the attribute), so its ops would run as written. Put `#[autocast(P)]` on that function (generic: \
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
fn is_leaf_view(node: &Arc<Node>) -> bool {
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

/// The cast autocast inserts: a no-op for the same precision, served from the weight cast
/// cache for f32 parameters (and views of them) going to a 16-bit type, a counted conversion
/// otherwise.
///
/// A cached cast shares the converted values but records its own `cast` node on the tensor it
/// was asked for, so each use's gradient is cast back to f32 and summed in f32 at the
/// parameter, exactly as if `.cast()` had been written at each use; only the conversion is
/// done once.
pub fn cast<E: Precision, T: Precision>(t: &Tensor<E>) -> Tensor<T> {
    if E::DTYPE == T::DTYPE {
        return T::from_any(E::into_any(t.clone())).unwrap_or_else(|_| unreachable!("same precision"));
    }
    let cacheable = E::DTYPE == DType::F32
        && matches!(T::DTYPE, DType::F16 | DType::BF16)
        && t.node.as_ref().is_some_and(is_leaf_view)
        && STATE.with(|s| s.borrow().regions.last().is_some_and(|r| r.cache));
    // `t` as a Tensor<f32> (E is f32 when cacheable).
    let Some(source) = cacheable.then(|| f32::from_any(E::into_any(t.clone())).ok()).flatten() else {
        count_cast();
        return t.cast::<T>();
    };
    // Convert the whole parameter when the view covers most of it (every other view of it is
    // then free); a small slice of a large parameter is converted on its own.
    let whole = source.numel() * 2 >= source.storage.len();
    let layout = &source.layout;
    let extent = if whole {
        Extent::Whole
    } else {
        Extent::View { shape: layout.shape.clone(), strides: layout.strides.clone(), offset: layout.offset }
    };
    let key = CacheKey { storage: Arc::as_ptr(&source.storage) as *const () as usize, to: T::DTYPE, extent };
    let cached = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let found = s.cache.get(&key).and_then(|e| {
            let same_storage = Arc::ptr_eq(&e.source, &source.storage);
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
            let all = crate::layout::Layout::contiguous(&[source.storage.len()]);
            let cast = crate::backend::Device::cast::<f32, T>(&crate::Cpu, &source.storage, &all);
            Tensor::<T>::from_storage(&crate::Cpu, cast, &[source.storage.len()])
        } else {
            source.detach().cast::<T>()
        };
        let entry = CacheEntry { source: source.storage.clone(), cast: T::into_any(converted.clone()) };
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
    let out = Tensor { storage: values.storage, layout, node: None, device: crate::Cpu };
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
