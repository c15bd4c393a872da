//! Procedural macros for amp: `#[autocast]` and helper derives (used through the `amp` facade,
//! which re-exports them).
//!
//! ```
//! use amp::prelude::*;
//!
//! #[derive(Params)]
//! struct Mlp {
//!     w1: Param,
//!     w2: Param,
//! }
//!
//! impl Mlp {
//!     #[autocast(bf16)]
//!     fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
//!         let h = x.matmul(&self.w1).relu(); // bf16 matmul (f32 accumulation), relu in bf16
//!         h.matmul(&self.w2).log_softmax(1) // bf16 matmul, log_softmax in f32
//!     }
//! }
//!
//! let mut rng = Rng::seed(0);
//! let model = Mlp {
//!     w1: Param::new(Tensor::<f32>::randn(&[4, 8], &mut rng)),
//!     w2: Param::new(Tensor::<f32>::randn(&[8, 3], &mut rng)),
//! };
//! let y = model.forward(&Tensor::<f32>::randn(&[2, 4], &mut rng));
//! assert_eq!((y.dtype(), y.shape()), (DType::F32, &[2, 3][..]));
//! assert_eq!(model.named_params()[0].0, "w1"); // `#[derive(Params)]`: PyTorch's names
//! ```
//!
//! `lib.rs` holds only the entry points; each macro's stages live in their own files
//! (`#[autocast]`: `parse` → `validate` → `policy` → `expand`).

mod derive_params;
mod expand;
mod parse;
mod policy;
mod validate;

use proc_macro2::TokenStream as TokenStream2;
use quote::quote;

/// `#[derive(Params)]`: implements `amp_core::Params` for a struct by visiting every field, its
/// name as the prefix (`blocks.0.ln1.weight`, PyTorch's `state_dict` names). Field options:
/// `#[param(skip)]` for fields that hold no parameters (a rate, a config; required, so a
/// forgotten impl is a compile error, not a weight missing from checkpoints) and
/// `#[param(rename = "name")]`.
///
/// The impl is `Params<E>` for the parameters' element type `E`: the struct's type parameter
/// bounded by `Precision` (`struct Linear<W: Precision = f32>`), else `bf16` if a field's type
/// names it (`Param<bf16>`, `Linear<bf16>`), else generic when every field is generic
/// (`struct Wrap<M> { inner: M }`), else f32; `#[param(precision = T)]` on the struct says it
/// outright. f16 parameters are refused (no optimizer updates them).
///
/// `#[param(crate = my_framework::amp)]` on the struct says where amp is when your crate
/// reaches it only through another crate's `pub use amp` (otherwise the derive looks for `amp`
/// or `amp-core`, renamed or not, among your dependencies).
#[proc_macro_derive(Params, attributes(param))]
pub fn derive_params(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    derive_params::expand(syn::parse_macro_input!(input as syn::DeriveInput)).into()
}

/// Rewrites a forward function so that each op runs in the precision the op policy table
/// gives it (PyTorch's autocast, decided at compile time): lower-precision ops (`matmul`) get
/// their tensor inputs cast to the autocast type, fp32 ops (exp, log, norms, losses, softmax,
/// reductions) get f32 inputs, promote ops (`add`, `a + b`, ...) meet in the widest input type,
/// and every other op runs as its inputs are. The table: `amp_core::policy`
/// (`amp_core::policy::print_policy()` prints it).
///
/// ```
/// # use amp::prelude::*;
/// # use amp::nn::Linear;
/// # struct Model { w1: Param, w2: Param, fc1: Linear, fc2: Linear }
/// # impl Model {
/// #[autocast]                      // f16; `#[autocast(bf16)]` for bf16
/// fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
///     let h = x.matmul(&self.w1).relu();        // f16 matmul (f32 accumulation)
///     h.matmul(&self.w2).log_softmax(1)         // f16 matmul, f32 log_softmax
/// }
///
/// #[autocast(P)]                   // written once, run at any precision: `model.loss::<bf16>(..)`
/// fn loss<P: Precision>(&self, x: &Tensor<f32>, y: &Indices) -> Tensor<f32> {
///     let h = self.fc1.forward(x).gelu();       // an `amp::nn::Linear`, in P
///     h.linear(&self.fc2.weight, self.fc2.bias.as_ref()).cross_entropy(y)
/// }
/// # }
/// # let mut rng = Rng::seed(0);
/// # let p = |shape: &[usize], rng: &mut Rng| Param::new(Tensor::<f32>::randn(shape, rng));
/// # let (w1, w2) = (p(&[4, 8], &mut rng), p(&[8, 3], &mut rng));
/// # let (fc1, fc2) = (Linear::normal(4, 8, true, 0.02, &mut rng), Linear::normal(8, 3, true, 0.02, &mut rng));
/// # let model = Model { w1, w2, fc1, fc2 };
/// # let x = Tensor::<f32>::randn(&[2, 4], &mut rng);
/// # assert_eq!(model.forward(&x).dtype(), DType::F32);
/// # let loss = model.loss::<bf16>(&x, &Indices::from_vec(vec![0, 2], &[2]));
/// # assert_eq!((loss.dtype(), loss.shape()), (DType::F32, &[][..]));
/// ```
///
/// - The autocast type: `f16` (the default), `bf16`, `f32` (autocast off in effect: every op
///   gets f32 inputs, so with f32 inputs the function computes what it would without the
///   attribute, bit for bit), or a type parameter of the function, `#[autocast(P)]` with
///   `P: Precision`, so the caller picks it (`P = f32` is the same as `#[autocast(f32)]`: a
///   `.cast::<f16>()` written in the body is widened again by the next op the table puts in a
///   precision). When the body promotes (`x + &h`), `#[autocast(P)]` adds the bounds that
///   compute `P`'s promotions, `P: Promote<f32, Output = f32> + Promote<P, Output = P>,
///   f32: Promote<P, Output = f32>` (true of f16, bf16 and f32).
/// - f64 tensors are left as they are (as PyTorch's autocast leaves them): an op on f64
///   operands runs in f64 whatever its category. (A generic `Tensor<E>` is cast like the other
///   precisions: the compiler cannot see that `E` is f64.)
/// - `m.forward(..)` and `m.loss(..)` without a turbofish on an `amp::nn` module (`Linear`,
///   `Mlp`, `CausalSelfAttention`, `Block`, `Gpt`; held directly, by reference, `Box`, `Rc` or
///   `Arc`) run in the autocast type: `block.forward(&x, rng)` is `block.forward::<P>(&x, rng)`,
///   `gpt.loss(..)` is `gpt.loss::<P>(..)`, whatever their values' precision. A turbofish keeps
///   the precision written (`m.forward::<f32, _>(x)` runs as written). A `forward` or `loss` of
///   your own is called as written (`&self`, `&mut self` or `self`, inherent or from a trait);
///   if it returns a tensor whose precision is left open, that follows the autocast type too.
/// - The declared return type is honoured: a `Tensor<X>` in it gets a final cast to `X`.
/// - Each f32 parameter is cast once per call to the outermost `#[autocast]` function, however
///   often it is used, in nested `#[autocast]` calls too (the weight cast cache; `cache = false`
///   turns it off). An entry goes as soon as its parameter has moved on (an in-place update
///   copies on write), so a training loop inside one region keeps the cache bounded.
/// - Options: `lower = [my_proj]`, `fp32 = [my_norm, Self::rescale]` put functions or methods
///   of your own in a category (their tensor arguments are cast); `passthrough = [softmax]`
///   turns a table op off in this function; `crate = my_framework::amp` says where amp is when
///   your crate reaches it only through another crate's `pub use amp` (the macro otherwise
///   looks for `amp` or `amp-core`, renamed or not, among your dependencies).
/// - `autocast_off! { .. }` (statements or one expression) or `#[autocast(off)]` on a statement
///   runs that code as written.
/// - Code that is not a tensor op but shares a name (`iter.sum()`, `f32::max`, `x.exp()` on a
///   float, macro calls) behaves as without the attribute: whether a value is a tensor is
///   decided by the compiler, through the types, at each call.
/// - Declared types are honoured: a `Tensor<X>` in the return type (also inside `Result`,
///   `Option`, `Vec` and tuples, at the tail and at each `return`), in a closure's `-> T` and in
///   `let h: Tensor<X> = ..` gets a final cast to `X`.
///
/// Limits (each with its way out):
/// - The rewrite is lexical: nothing inside macro calls or nested items is rewritten, and a
///   function without the attribute is not rewritten when called from one with it. Such a
///   callee's ops would run as written; instead, at run time, a table op that meets inputs
///   the policy would not have given it inside an enabled region (an f16 `exp`, an f32
///   `matmul` in an f16 region) panics, naming the op and the fix: put `#[autocast(P)]` on the
///   callee (called with `::<P>`), or list it in `lower`/`fp32` (a listed function runs as
///   written on the inputs its category gives it, as PyTorch's `custom_fwd(cast_inputs=..)`).
///   `autocast_off!`, `#[autocast(off)]`, `passthrough`, f64 and the backward pass are never
///   checked. The compiler cannot see into callees, so this check is a panic, not an error.
/// - A bare `#[autocast]` (f16 by default) called from a region of another type panics, naming
///   the fix (make it `#[autocast(P)]` and call it with `::<P>`, or give it the caller's type);
///   a chosen type (`#[autocast(f16)]`) is kept under any caller.
/// - `#[autocast(P)]` sees only the function's own generics, not the `impl` block's. A generic
///   caller of an `#[autocast(P)]` function that promotes states the same `Promote` bounds;
///   so does a trait's declaration of such a method.
/// - The receiver of a turbofish-less `forward` / `loss` is taken the way a method call takes
///   it as far as the function's own syntax shows: a temporary is moved; a `&mut` variable is
///   reborrowed; a place under a `mut` binding, a parameter or `let` typed `&mut _`, or
///   `&mut self` is borrowed mutably (unless an argument uses the same variable), any other
///   place shared. So a `forward(self)` of your own on a variable needs `{ v }.forward(..)`; a
///   `&mut self` one on a place the syntax does not show mutable (a field of a `&mut` binding
///   whose type is inferred) needs `(&mut v.field).forward(..)`; and where the mutable borrow
///   of a module held by a mutable place meets a live shared borrow, `(&self.m).forward(..)`
///   borrows it shared.
/// - In a generic function, promoting `Tensor<E>` with another precision needs the bound that
///   computes it, `E: Promote<f32>`; without it the operands are left as they are.
/// - A receiver that is a variable is borrowed: a by-value method of a non-`Copy`, non-tensor
///   value that shares an op's name and argument count (`s.add(t)` on an owned `String`) does
///   not compile; write it as an operator (`s + t`) or list the op in `passthrough`.
/// - Operators on parameters of a closure whose parameter types are not yet known
///   (`let f = |a, b| a + b;`) are left alone; annotate the parameters to have them promote.
/// - A value whose precision is inferred only from the declared type (`let t = Tensor::zeros(..);
///   t` as the tail) needs a turbofish.
#[proc_macro_attribute]
pub fn autocast(attr: proc_macro::TokenStream, item: proc_macro::TokenStream) -> proc_macro::TokenStream {
    autocast_impl(attr.into(), item.into(), expand::private_path()).into()
}

/// Parse, validate and expand; on any error the item is still emitted (so the IDE keeps
/// working) next to one `compile_error!` per problem, each on the offending token.
fn autocast_impl(attr: TokenStream2, item: TokenStream2, private: TokenStream2) -> TokenStream2 {
    let opts = parse::options(attr).and_then(|o| validate::options(&o).map(|()| o));
    let func = validate::item(item.clone());
    // A precision word that is not a type is a type parameter of the function, or an error.
    let opts = match (opts, &func) {
        (Ok(mut o), Ok(f)) => parse::resolve_low(&mut o, f).map(|()| o),
        (Ok(o), Err(_)) => parse::unresolved_error(&o).map_or(Ok(o), Err),
        (Err(e), _) => Err(e),
    };
    match (opts, func) {
        (Ok(opts), Ok(func)) => {
            // `crate = path`: amp as the caller reaches it (a re-export), not as a dependency.
            let private = opts.krate.as_ref().map_or(private, |krate| quote!(#krate::__private));
            expand::expand(&opts, func, &private)
        }
        (opts, func) => {
            let errors = [opts.err(), func.err()].into_iter().flatten().map(|e| e.to_compile_error());
            let original = expand::strip_off_attrs(item);
            quote! { #original #(#errors)* }
        }
    }
}

/// The op policy table as `&[amp_core::policy::OpPolicy]` (amp-core expands it; hidden).
#[doc(hidden)]
#[proc_macro]
pub fn __policy_table(_: proc_macro::TokenStream) -> proc_macro::TokenStream {
    policy::table_tokens().into()
}

/// The op policy table as a markdown string, for rustdoc (hidden).
#[doc(hidden)]
#[proc_macro]
pub fn __policy_doc(_: proc_macro::TokenStream) -> proc_macro::TokenStream {
    let md = policy::markdown();
    quote!(#md).into()
}
