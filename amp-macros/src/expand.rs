//! The rewrite: every op call in the body gets the casts its policy row asks for.
//!
//! Design notes (the crux: a proc macro sees names, not types):
//! - A call is a candidate when its method name is a table row (or a user's name) and its
//!   argument count matches; the decision whether the receiver and the tensor arguments are
//!   tensors is left to the compiler. Each is wrapped in a hidden helper,
//!   `(&W::new(x)).__amp_to::<T>()`, resolved by autoref specialisation (three levels, see
//!   `amp_core::__private`): an f64 tensor comes back untouched, another tensor-like value
//!   (`Tensor<E, D>`, `Param<E, D>`, references to them, on any device) is cast on its own
//!   device, and anything else (an iterator, an `f32`, a user type) comes back untouched.
//!   Generic forward functions work the same way, the bounds `E: Precision` and `D: Device`
//!   being enough for `Tensor<E, D>` to find the casting impl. The generated code never names
//!   a device: it comes with each operand's type.
//! - The autocast type `T` of lower-precision ops is `f16`, `bf16`, `f32` or the function's
//!   own type parameter (`#[autocast(P)]`); with `P`, promotions of `P` need bounds the
//!   compiler cannot derive from `P: Precision`, so they are added to the signature when the
//!   body has a promote op or an operator (only then: a generic caller of a forward without
//!   promotions needs no more than `P: Precision`).
//! - `m.forward(..)` / `m.loss(..)` (and their `try_` forms) without a turbofish: the receiver
//!   goes through the same
//!   two-level lookup, `(&W::new(m)).__amp_in::<T>()`: an `amp::nn` module whose compute
//!   precision is a type parameter comes back as `In`, whose `forward` / `loss` call the
//!   module's own with `::<T>` (`Block::forward`'s value is the f32 residual stream, so only
//!   this can fix its precision); anything else comes back as it went in, and its own method is
//!   found as written. So the receiver goes in the form a method call would take it in: a
//!   temporary is moved (a `forward(self)` still works); a place is borrowed mutably where the
//!   function's own bindings show it is mutable (a `mut` binding, a parameter or `let` typed
//!   `&mut _`, `&mut self`: `&mut place`, unless an argument uses the same variable), and
//!   otherwise through `place.__amp_place()`, which reborrows a `&mut T` and borrows anything
//!   else. The value then goes through `Hint::<T, _>`, which fixes an open `Tensor<?L>` (a
//!   user type's `fn forward<L>(..) -> Tensor<L>`, or `-> Result<Tensor<L>, E>`) to `T` by
//!   unification during method lookup and passes anything else through.
//! - The region entered at the top records `T` and whether the attribute chose it, so a bare
//!   `#[autocast]` called from a region of another type can panic with the fix.
//! - Receivers that are places (`x`, `self.w`, `v[i]`) are borrowed, never moved (a tensor
//!   method takes `&self`); other receivers are moved into the helper, so a by-value method
//!   on a temporary still works. Arguments are passed as written and come back in the same
//!   form: a `&Tensor` stays a reference (to the cast temporary), an owned value stays owned.
//! - Promote ops and the operators `+ - * /` hand both operands to `Pair::new(a, b)`, whose
//!   casting impl applies only when both are tensor-like and `Promoted<A, B>` exists.
//! - Nothing inside macro calls, nested items, const contexts, types or patterns is touched,
//!   so `vec![..]`, `println!(..)`, array lengths and `autocast_off! { .. }` keep their meaning.
//! - The declared return type is honoured by walking the tail (and each `return`) along the
//!   declared type: a `Tensor<X>` (or `Tensor<X, D>`) position gets a final cast to `X`, each
//!   element of a `Vec<Tensor<X>>` too, and a tuple that is not written out is taken apart and
//!   rebuilt. Tensor constructors whose precision comes from that type (`Tensor::zeros(..)`,
//!   `Tensor::full_on(dev, ..)`) are left as they are.

use std::collections::{HashMap, HashSet};

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::visit_mut::{self, VisitMut};
use syn::{Expr, ExprClosure, Pat, Stmt, Type};

use crate::parse::{LowType, Options};
use crate::policy::{self, Arg, Category};
use crate::validate::path_key;

/// Where generated code finds amp's hidden support module: `::amp::__private` when the
/// user's crate depends on the facade `amp` (or is it: its tests and examples), otherwise
/// `::amp_core::__private` (inside amp-core, `extern crate self as amp_core` makes that work).
pub(crate) fn private_path() -> TokenStream {
    use proc_macro_crate::{FoundCrate, crate_name};
    let named = |name: &str| {
        let id = syn::Ident::new(name, Span::call_site());
        quote!(::#id::__private)
    };
    match (crate_name("amp"), crate_name("amp-core")) {
        (Ok(FoundCrate::Itself), _) => quote!(::amp::__private),
        (Ok(FoundCrate::Name(name)), _) => named(&name),
        (_, Ok(FoundCrate::Name(name))) => named(&name),
        _ => quote!(::amp_core::__private),
    }
}

/// The precision a category asks for, as tokens.
#[derive(Clone)]
enum Target {
    Low,
    F32,
}

struct Rewriter<'a> {
    p: &'a TokenStream,
    low: TokenStream,
    /// Method names the user put in a category.
    user_methods: HashMap<String, Category>,
    /// Function paths the user put in a category (matched as a suffix of the call's path).
    user_fns: Vec<(Vec<String>, Category)>,
    /// Table ops turned off here (`passthrough = [..]`).
    off: HashSet<String>,
    /// Declared return types of the enclosing fn / closures (`None`: not declared).
    returns: Vec<Option<Type>>,
    /// Parameters of closures whose types the compiler may not know yet: operators on them
    /// are left alone (the helper's trait lookup would need the type first).
    untyped: Vec<HashSet<String>>,
    /// Whether any call was rewritten (the helper traits are imported only then).
    rewrote: bool,
    /// Whether a promote op or operator was rewritten (a generic low type then needs the
    /// bounds that compute its promotions).
    promoted: bool,
    /// How each name is bound in the function (for the receiver of a module's method).
    bindings: HashMap<String, Binding>,
}

/// Methods whose receiver may be an `amp::nn` module taking the compute precision as a type
/// parameter (`Linear::forward::<L, _>`, `Block::forward::<L>`, `Gpt::loss::<L>`), and their
/// fallible forms.
const MODULE_METHODS: &[&str] = &["forward", "loss", "try_forward", "try_loss"];

/// How a name is bound, as far as the function's own syntax shows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Binding {
    /// `mut x` (or `mut self`): `&mut x` borrows it mutably.
    Mut,
    /// A `&mut _` (`&mut self`, `x: &mut T`, `let x = &mut ..`, `ref mut x`): the places
    /// under it can be borrowed mutably, `x` itself is reborrowed.
    MutRef,
    /// Anything else, or bound in more than one way (shadowed): borrowed shared.
    Plain,
}

/// Every binding in `f`'s signature and body (not in nested items), by name; a name bound in
/// two ways is `Plain`.
fn bindings(f: &syn::ItemFn) -> HashMap<String, Binding> {
    struct Collect(HashMap<String, Binding>);
    impl Collect {
        fn add(&mut self, name: String, kind: Binding) {
            self.0.entry(name).and_modify(|k| *k = if *k == kind { kind } else { Binding::Plain }).or_insert(kind);
        }
        /// `x: &mut T` / `let x = &mut ..`: a plain identifier pattern bound to a `&mut`.
        fn mut_ref_ident(&mut self, pat: &Pat) -> bool {
            match pat {
                Pat::Ident(pi) if pi.by_ref.is_none() && pi.mutability.is_none() && pi.subpat.is_none() => {
                    self.add(pi.ident.to_string(), Binding::MutRef);
                    true
                }
                _ => false,
            }
        }
    }
    fn is_mut_ref(ty: &Type) -> bool {
        matches!(ty, Type::Reference(r) if r.mutability.is_some())
    }
    impl<'ast> Visit<'ast> for Collect {
        fn visit_receiver(&mut self, r: &'ast syn::Receiver) {
            let kind = match (&r.reference, &r.mutability) {
                (Some(_), Some(_)) => Binding::MutRef,
                (Some(_), None) => Binding::Plain,
                (None, Some(_)) => Binding::Mut,
                (None, None) if is_mut_ref(&r.ty) => Binding::MutRef,
                (None, None) => Binding::Plain,
            };
            self.add("self".into(), kind);
        }
        fn visit_pat_ident(&mut self, pi: &'ast syn::PatIdent) {
            let kind = match (&pi.by_ref, &pi.mutability) {
                (Some(_), Some(_)) => Binding::MutRef,
                (None, Some(_)) => Binding::Mut,
                _ => Binding::Plain,
            };
            self.add(pi.ident.to_string(), kind);
            if let Some((_, sub)) = &pi.subpat {
                self.visit_pat(sub);
            }
        }
        fn visit_pat_type(&mut self, pt: &'ast syn::PatType) {
            if !(is_mut_ref(&pt.ty) && self.mut_ref_ident(&pt.pat)) {
                self.visit_pat(&pt.pat);
            }
        }
        fn visit_local(&mut self, l: &'ast syn::Local) {
            let mut_init = l.init.as_ref().is_some_and(|i| {
                matches!(&*i.expr, Expr::Reference(r) if r.mutability.is_some()) && i.diverge.is_none()
            });
            if !(mut_init && self.mut_ref_ident(&l.pat)) {
                self.visit_pat(&l.pat);
            }
            if let Some(init) = &l.init {
                self.visit_expr(&init.expr);
                if let Some((_, els)) = &init.diverge {
                    self.visit_expr(els);
                }
            }
        }
        // Nested items have their own bindings; macro bodies are not rewritten.
        fn visit_item(&mut self, _: &'ast syn::Item) {}
        fn visit_macro(&mut self, _: &'ast syn::Macro) {}
    }
    let mut c = Collect(HashMap::new());
    c.visit_signature(&f.sig);
    c.visit_block(&f.block);
    c.0
}

/// The variable a place expression starts from (`self` in `self.blocks[i]`), and whether the
/// place is that variable itself.
fn place_root(e: &Expr) -> Option<(String, bool)> {
    match e {
        Expr::Path(p) if p.qself.is_none() => p.path.get_ident().map(|i| (i.to_string(), true)),
        Expr::Field(f) => place_root(&f.base).map(|(r, _)| (r, false)),
        Expr::Index(i) => place_root(&i.expr).map(|(r, _)| (r, false)),
        Expr::Unary(u) if matches!(u.op, syn::UnOp::Deref(_)) => place_root(&u.expr).map(|(r, _)| (r, false)),
        Expr::Paren(p) => place_root(&p.expr),
        _ => None,
    }
}

/// The first field a place takes from its root variable (`bn1` of `self.bn1.inner`,
/// `(*self).bn1` or `self.bn1[0]`), or `None` for the bare variable or an index on it.
fn first_field(e: &Expr) -> Option<String> {
    match e {
        Expr::Field(f) => first_field(&f.base).or_else(|| {
            place_root(&f.base).filter(|(_, bare)| *bare || is_deref_of_root(&f.base)).map(|_| match &f.member {
                syn::Member::Named(i) => i.to_string(),
                syn::Member::Unnamed(i) => i.index.to_string(),
            })
        }),
        Expr::Index(i) => first_field(&i.expr),
        Expr::Unary(u) if matches!(u.op, syn::UnOp::Deref(_)) => first_field(&u.expr),
        Expr::Paren(p) => first_field(&p.expr),
        _ => None,
    }
}

/// `Vec::new` or `Vec::with_capacity` (with or without a turbofish on `Vec`).
fn is_empty_vec(func: &Expr) -> bool {
    let Expr::Path(p) = func else { return false };
    let segs: Vec<String> = p.path.segments.iter().map(|s| s.ident.to_string()).collect();
    matches!(&segs[..], [.., v, f] if v == "Vec" && (f == "new" || f == "with_capacity"))
}

/// `*root` or `(*root)`: a deref of the bare variable.
fn is_deref_of_root(e: &Expr) -> bool {
    match e {
        Expr::Paren(p) => is_deref_of_root(&p.expr),
        Expr::Unary(u) if matches!(u.op, syn::UnOp::Deref(_)) => matches!(place_root(&u.expr), Some((_, true))),
        _ => false,
    }
}

/// Whether every use of the variable `root` in `tokens` reads a field other than `field`
/// (`root.other`, not `root`, `root.field` or a method `root.f(..)`): a mutable borrow of
/// `root.field` taken first then stands beside them. No `field` (a bare receiver): no use at all.
fn disjoint_uses(tokens: TokenStream, root: &str, field: Option<&str>) -> bool {
    use proc_macro2::{Delimiter, TokenTree};
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    tokens.iter().enumerate().all(|(i, t)| match t {
        TokenTree::Group(g) => disjoint_uses(g.stream(), root, field),
        TokenTree::Ident(id) if id == root => {
            let after_dot = matches!(tokens.get(i + 1), Some(TokenTree::Punct(p)) if p.as_char() == '.');
            let name = match tokens.get(i + 2) {
                Some(TokenTree::Ident(n)) if after_dot => n.to_string(),
                // `self.0.1` lexes as `self`, `.`, `0.1`: the field is `0`.
                Some(TokenTree::Literal(n)) if after_dot => n.to_string().split('.').next().unwrap_or("").to_string(),
                _ => return false,
            };
            let method = match tokens.get(i + 3) {
                Some(TokenTree::Group(g)) => g.delimiter() == Delimiter::Parenthesis,
                Some(TokenTree::Punct(p)) => p.as_char() == ':',
                _ => false,
            };
            !method && field.is_some_and(|f| f != name)
        }
        _ => true,
    })
}

/// Runs the rewrite on `f` and wraps its body in an autocast region.
pub(crate) fn expand(opts: &Options, mut f: syn::ItemFn, p: &TokenStream) -> TokenStream {
    let low = match &opts.low {
        LowType::F16 => quote!(#p::f16),
        LowType::Bf16 => quote!(#p::bf16),
        LowType::F32 => quote!(::core::primitive::f32),
        LowType::Param(id) => quote!(#id),
        LowType::Unresolved(_) => unreachable!("resolved before expanding"),
    };
    let mut rw = Rewriter {
        p,
        low: low.clone(),
        user_methods: HashMap::new(),
        user_fns: Vec::new(),
        off: HashSet::new(),
        returns: Vec::new(),
        untyped: Vec::new(),
        rewrote: false,
        promoted: false,
        bindings: bindings(&f),
    };
    for list in &opts.lists {
        for path in &list.names {
            let segs: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
            match list.category {
                Category::Passthrough => {
                    rw.off.insert(path_key(path));
                }
                cat => {
                    rw.user_methods.insert(segs.last().cloned().unwrap_or_default(), cat);
                    rw.user_fns.push((segs, cat));
                }
            }
        }
    }
    let ret = match &f.sig.output {
        syn::ReturnType::Type(_, ty) => Some((**ty).clone()),
        syn::ReturnType::Default => None,
    };
    rw.returns.push(ret.clone());
    for stmt in &mut f.block.stmts {
        rw.visit_stmt_mut(stmt);
    }
    if let (Some(ty), Some(Stmt::Expr(tail, None))) = (&ret, f.block.stmts.last_mut()) {
        rw.conform(tail, ty);
    }
    // A generic low type `P`: promotions of `P` with f32 and with itself are computed for
    // f16, bf16 and f32 by the blanket `Promote` impl, but not for a bare type parameter, so
    // the bounds that state them (true of every low type) are added when the body promotes.
    if let LowType::Param(id) = &opts.low
        && rw.promoted
    {
        let f32_ = quote!(::core::primitive::f32);
        let preds = &mut f.sig.generics.make_where_clause().predicates;
        preds.push(syn::parse_quote!(#id: #p::Promote<#f32_, Output = #f32_> + #p::Promote<#id, Output = #id>));
        preds.push(syn::parse_quote!(#f32_: #p::Promote<#id, Output = #f32_>));
        // The user's `P: Precision` and these are in two places by construction.
        f.attrs.push(syn::parse_quote!(#[allow(clippy::multiple_bound_locations)]));
    }
    let region = syn::Ident::new("__amp_region", Span::mixed_site());
    let (cache, chosen, name) = (opts.cache, opts.chosen, f.sig.ident.to_string());
    let mut prelude: Vec<Stmt> =
        vec![syn::parse_quote!(let #region = #p::Region::enter::<#low>(#cache, #chosen, #name);)];
    if rw.rewrote {
        prelude.push(syn::parse_quote!(
            #[allow(unused_imports)]
            use #p::autocast_traits::*;
        ));
    }
    prelude.append(&mut f.block.stmts);
    f.block.stmts = prelude;
    quote!(#f)
}

/// The item as written, less any `#[autocast(off)]` on its statements (emitted next to the
/// errors when the attribute cannot expand, so the only errors are the real ones).
pub(crate) fn strip_off_attrs(item: TokenStream) -> TokenStream {
    struct Strip;
    impl VisitMut for Strip {
        fn visit_stmt_mut(&mut self, s: &mut Stmt) {
            match s {
                Stmt::Local(l) => l.attrs.retain(|a| !is_off_attr(a)),
                Stmt::Expr(Expr::Block(b), _) => b.attrs.retain(|a| !is_off_attr(a)),
                _ => {}
            }
            visit_mut::visit_stmt_mut(self, s);
        }
    }
    match syn::parse2::<syn::ItemFn>(item.clone()) {
        Ok(mut f) => {
            Strip.visit_item_fn_mut(&mut f);
            quote!(#f)
        }
        Err(_) => item,
    }
}

/// A place expression: borrowing it does not move anything.
/// `e` without the parentheses around it: the rewrites hand a receiver to a helper as a
/// function argument, where the user's `(a + b).relu()` parentheses would trip
/// `unused_parens` in the user's crate.
fn unparen(e: &Expr) -> &Expr {
    match e {
        Expr::Paren(p) => unparen(&p.expr),
        _ => e,
    }
}

fn is_place(e: &Expr) -> bool {
    match e {
        Expr::Path(_) | Expr::Field(_) | Expr::Index(_) => true,
        Expr::Unary(u) => matches!(u.op, syn::UnOp::Deref(_)),
        Expr::Paren(p) => is_place(&p.expr),
        _ => false,
    }
}

/// Syntax that is never a tensor: a literal (its type may still be an unsettled `{float}`, so
/// it must not go through a trait lookup), a negated literal or an `as` cast.
fn is_scalar_syntax(e: &Expr) -> bool {
    match e {
        Expr::Lit(_) | Expr::Cast(_) => true,
        Expr::Unary(u) => matches!(u.op, syn::UnOp::Neg(_)) && is_scalar_syntax(&u.expr),
        Expr::Paren(p) => is_scalar_syntax(&p.expr),
        _ => false,
    }
}

/// The attribute `#[autocast(off)]` on a statement.
fn is_off_attr(attr: &syn::Attribute) -> bool {
    attr.path().is_ident("autocast") && attr.parse_args::<syn::Ident>().is_ok_and(|i| i == "off")
}

fn pat_idents(pat: &Pat, out: &mut HashSet<String>) {
    match pat {
        Pat::Ident(i) => {
            out.insert(i.ident.to_string());
        }
        Pat::Tuple(t) => t.elems.iter().for_each(|p| pat_idents(p, out)),
        Pat::Reference(r) => pat_idents(&r.pat, out),
        _ => {}
    }
}

/// `Tensor::zeros`, `Tensor::from_vec`, ... without a turbofish on `Tensor`: the precision of
/// what they build comes from the context, so a conversion around them would leave it unknown.
/// The `_on` forms build on a given device (`Tensor::full_on(x.device(), ..)`), whatever it is.
fn is_tensor_constructor(func: &Expr) -> bool {
    const CTORS: &[&str] = &[
        "zeros",
        "ones",
        "full",
        "full_on",
        "scalar",
        "from_vec",
        "try_from_vec",
        "try_from_vec_on",
        "from_f64s",
        "from_f32s",
        "rand",
        "randn",
        "arange",
        "try_arange",
    ];
    let Expr::Path(p) = func else { return false };
    let segs: Vec<&syn::PathSegment> = p.path.segments.iter().collect();
    match segs.as_slice() {
        [.., ty, f] => ty.ident == "Tensor" && ty.arguments.is_none() && CTORS.contains(&f.ident.to_string().as_str()),
        _ => false,
    }
}

/// `Tensor<X, ..>` (by its last path segment): `X`.
fn tensor_elem(ty: &Type) -> Option<&Type> {
    let Type::Path(tp) = ty else { return None };
    let seg = tp.path.segments.last()?;
    if seg.ident != "Tensor" {
        return None;
    }
    match &seg.arguments {
        syn::PathArguments::AngleBracketed(a) => a.args.iter().find_map(|g| match g {
            syn::GenericArgument::Type(t) => Some(t),
            _ => None,
        }),
        _ => None,
    }
}

/// `Vec<T>` (by last segment): `T`.
fn vec_elem(ty: &Type) -> Option<&Type> {
    let Type::Path(tp) = ty else { return None };
    let seg = tp.path.segments.last()?;
    if seg.ident != "Vec" {
        return None;
    }
    match &seg.arguments {
        syn::PathArguments::AngleBracketed(a) => match a.args.first()? {
            syn::GenericArgument::Type(t) => Some(t),
            _ => None,
        },
        _ => None,
    }
}

/// Whether `ty` has a `Tensor<X>` position `conform` would cast.
fn has_tensor(ty: &Type) -> bool {
    tensor_elem(ty).is_some()
        || vec_elem(ty).is_some_and(|t| tensor_elem(t).is_some())
        || wrapper_inner(ty).is_some_and(|(_, t)| tensor_elem(t).is_some())
        || matches!(ty, Type::Tuple(tt) if tt.elems.iter().any(has_tensor))
        || matches!(ty, Type::Paren(p) if has_tensor(&p.elem))
}

/// `Result<T, ..>` / `Option<T>` (by last segment): the wrapper's name and `T`.
fn wrapper_inner(ty: &Type) -> Option<(&'static str, &Type)> {
    let Type::Path(tp) = ty else { return None };
    let seg = tp.path.segments.last()?;
    let kind = if seg.ident == "Result" {
        "Result"
    } else if seg.ident == "Option" {
        "Option"
    } else {
        return None;
    };
    match &seg.arguments {
        syn::PathArguments::AngleBracketed(a) => match a.args.first()? {
            syn::GenericArgument::Type(t) => Some((kind, t)),
            _ => None,
        },
        _ => None,
    }
}

impl Rewriter<'_> {
    fn target(&self, t: &Target) -> TokenStream {
        match t {
            Target::Low => self.low.clone(),
            Target::F32 => quote!(::core::primitive::f32),
        }
    }

    /// The receiver, cast to `target` if it is a tensor.
    fn cast_receiver(&mut self, recv: &Expr, target: &Target) -> TokenStream {
        self.rewrote = true;
        let (p, t, span) = (self.p, self.target(target), recv.span());
        let bare = unparen(recv);
        let form = if is_place(recv) { quote_spanned!(span=> &#bare) } else { quote!(#bare) };
        quote_spanned!(span=> (&#p::W::new(#form)).__amp_to::<#t>())
    }

    /// An argument, cast to `target` if it is a tensor, handed on in the form it came in.
    fn cast_arg(&mut self, arg: &Expr, target: &Target) -> TokenStream {
        if is_scalar_syntax(arg) {
            return quote!(#arg);
        }
        self.rewrote = true;
        let (p, t, span) = (self.p, self.target(target), arg.span());
        quote_spanned!(span=> (&#p::W::new(#arg)).__amp_arg::<#t>().__amp_get())
    }

    /// An `Option<&tensor>` argument, cast when present.
    fn cast_opt_arg(&mut self, arg: &Expr, target: &Target) -> TokenStream {
        let is_none = matches!(arg, Expr::Path(p) if p.path.is_ident("None"));
        if is_none || is_scalar_syntax(arg) {
            return quote!(#arg);
        }
        self.rewrote = true;
        let (p, t, span) = (self.p, self.target(target), arg.span());
        quote_spanned!(span=> (&#p::W::new(#arg)).__amp_opt::<#t>().__amp_get())
    }

    /// What a method call `name` with `argc` arguments does here, if it is an op.
    fn method_rule(&self, name: &str, argc: usize) -> Option<(Category, Option<&'static [Arg]>)> {
        if let Some(cat) = self.user_methods.get(name) {
            return Some((*cat, None));
        }
        let op = policy::lookup(name)?;
        if op.assoc || self.off.contains(op.name) || op.args.len() != argc {
            return None;
        }
        Some((op.category, Some(op.args)))
    }

    fn rewrite_method_call(&mut self, mc: &syn::ExprMethodCall) -> Option<TokenStream> {
        if mc.turbofish.is_some() {
            return None;
        }
        let name = mc.method.to_string();
        let (cat, kinds) = self.method_rule(&name, mc.args.len())?;
        let target = match cat {
            Category::Lower => Target::Low,
            Category::Fp32 | Category::Fp32Accumulate => Target::F32,
            Category::Promote => return self.rewrite_promote_call(mc, kinds?),
            Category::Passthrough => return None,
        };
        let recv = self.cast_receiver(&mc.receiver, &target);
        let args: Vec<TokenStream> = mc
            .args
            .iter()
            .enumerate()
            .map(|(i, a)| match kinds.map_or(Arg::T, |k| k[i]) {
                Arg::T => self.cast_arg(a, &target),
                Arg::OptT => self.cast_opt_arg(a, &target),
                Arg::L | Arg::O => quote!(#a),
            })
            .collect();
        let method = &mc.method;
        Some(quote_spanned!(mc.method.span()=> #recv.#method(#(#args),*)))
    }

    /// `e` under an `OffGuard`: it runs as written, and the reach check (`__private::check_reach`)
    /// knows it is meant to.
    fn as_written(&self, e: &Expr) -> TokenStream {
        let p = self.p;
        let guard = syn::Ident::new("__amp_off", Span::mixed_site());
        quote_spanned!(e.span()=> { let #guard = #p::OffGuard::new(); #e })
    }

    /// A call of the user's own categorised method (its body runs as written, on the inputs
    /// the category gives it, as PyTorch's `custom_fwd(cast_inputs=..)`), of a table op the
    /// user turned off here (`passthrough = [..]`), or of a module's `forward` with its
    /// precision chosen by a turbofish. (An `#[autocast]` function called from such code
    /// checks its own body again: entering a region resets the guard count.)
    fn method_runs_as_written(&self, mc: &syn::ExprMethodCall) -> bool {
        let name = mc.method.to_string();
        // `m.forward::<f32, _>(x)`, `gpt.loss::<f32>(..)`: a precision chosen explicitly is kept.
        if MODULE_METHODS.contains(&name.as_str()) && mc.turbofish.is_some() {
            return true;
        }
        if self.user_methods.contains_key(&name) {
            return true;
        }
        self.off.contains(&name) && policy::lookup(&name).is_some_and(|op| !op.assoc && op.args.len() == mc.args.len())
    }

    /// A call of a function the user put in a category.
    fn call_runs_as_written(&self, call: &syn::ExprCall) -> bool {
        let Expr::Path(fp) = &*call.func else { return false };
        let segs: Vec<String> = fp.path.segments.iter().map(|s| s.ident.to_string()).collect();
        self.user_fns.iter().any(|(want, _)| segs.ends_with(want))
    }

    /// `m.forward(..)` / `m.loss(..)` without a turbofish: an `amp::nn` module's method in the
    /// region's low type, any other type's own method as written (see the notes at the top).
    fn rewrite_module_call(&mut self, mc: &syn::ExprMethodCall) -> Option<TokenStream> {
        let name = mc.method.to_string();
        if !MODULE_METHODS.contains(&name.as_str()) || mc.turbofish.is_some() || self.user_methods.contains_key(&name) {
            return None;
        }
        self.rewrote = true;
        let form = self.module_receiver(&mc.receiver, &mc.args);
        // The arguments in the user's own parentheses, so an error about them (a missing
        // argument) points at, and suggests a fix to, the call as written.
        let mut args = TokenStream::new();
        mc.paren_token.surround(&mut args, |t| mc.args.to_tokens(t));
        let (p, low, method) = (self.p, &self.low, &mc.method);
        let call = quote_spanned!(mc.span()=> (&#p::W::new(#form)).__amp_in::<#low>().#method #args);
        Some(quote_spanned!(mc.span()=> (&#p::Hint::<#low, _>::new(#call)).__amp_low()))
    }

    /// The receiver of a module's method, in the form a method call would take it in: a
    /// temporary moved; a place borrowed mutably where the function's bindings show it can be
    /// (and the arguments use its variable only through other fields: the borrow is taken
    /// before the arguments are evaluated, so `self.bn1.forward(&self.conv1.forward(x))` may
    /// borrow `self.bn1` mutably, `self.bn1.forward(&self.stem(x))` may not), else
    /// `place.__amp_place()` (a `&mut T` reborrowed, anything else borrowed).
    fn module_receiver(&self, recv: &Expr, args: &syn::punctuated::Punctuated<Expr, syn::Token![,]>) -> TokenStream {
        if !is_place(recv) {
            // A block in parentheses: `{ v }.forward(..)` (moving a variable) keeps its braces
            // lint-free; anything else bare, so the user's own parentheses do not trip
            // `unused_parens`.
            let bare = unparen(recv);
            return if matches!(bare, Expr::Block(_)) { quote!((#bare)) } else { quote!(#bare) };
        }
        let span = recv.span();
        let mutable = place_root(recv).is_some_and(|(root, bare)| {
            let kind = self.bindings.get(&root).copied().unwrap_or(Binding::Plain);
            let can = kind == Binding::Mut || (kind == Binding::MutRef && !bare);
            can && disjoint_uses(quote!(#args), &root, first_field(recv).as_deref())
        });
        if mutable { quote_spanned!(span=> &mut #recv) } else { quote_spanned!(span=> #recv.__amp_place()) }
    }

    /// `a.add(&b)`: both operands to their promoted type.
    fn rewrite_promote_call(&mut self, mc: &syn::ExprMethodCall, kinds: &[Arg]) -> Option<TokenStream> {
        let ti = kinds.iter().position(|k| *k == Arg::T)?;
        let operand = &mc.args[ti];
        if is_scalar_syntax(operand) {
            return None;
        }
        self.rewrote = true;
        self.promoted = true;
        let p = self.p;
        let recv = &mc.receiver;
        let span = mc.span();
        let bare = unparen(recv);
        let recv_form = if is_place(recv) { quote_spanned!(recv.span()=> &#bare) } else { quote!(#bare) };
        // Hygienic names located at the user's operands, so type errors point at them.
        let r = syn::Ident::new("__amp_r", Span::mixed_site().located_at(recv.span()));
        let a = syn::Ident::new("__amp_a", Span::mixed_site().located_at(operand.span()));
        let args = mc
            .args
            .iter()
            .enumerate()
            .map(|(i, x)| if i == ti { quote_spanned!(operand.span()=> #a.__amp_get()) } else { quote!(#x) });
        let method = &mc.method;
        Some(quote_spanned!(span=>
            (match (&#p::Pair::new(#recv_form, #operand)).__amp_promote() {
                (#r, #a) => #r.#method(#(#args),*),
            })
        ))
    }

    /// `Tensor::where_cond(m, &a, &b)`, `Tensor::cat(&[&a, &b], d)`: every tensor operand to
    /// the widest of their precisions, each handed on in the form it came in.
    fn rewrite_assoc_promote(&mut self, call: &syn::ExprCall, kinds: &[Arg]) -> Option<TokenStream> {
        // Where each operand sits: (argument, element of a `&[..]` list).
        let mut slots: Vec<(usize, Option<usize>)> = Vec::new();
        for (i, (arg, kind)) in call.args.iter().zip(kinds).enumerate() {
            match kind {
                Arg::T => slots.push((i, None)),
                Arg::L => {
                    // Only a written-out list can mix precisions; a slice from elsewhere has one.
                    let Expr::Reference(r) = arg else { return None };
                    let Expr::Array(a) = &*r.expr else { return None };
                    slots.extend((0..a.elems.len()).map(|j| (i, Some(j))));
                }
                _ => {}
            }
        }
        let operands: Vec<&Expr> = slots
            .iter()
            .map(|(i, j)| match (j, &call.args[*i]) {
                (Some(j), Expr::Reference(r)) => match &*r.expr {
                    Expr::Array(a) => &a.elems[*j],
                    _ => unreachable!("checked above"),
                },
                (_, arg) => arg,
            })
            .collect();
        if !(2..=8).contains(&operands.len()) || operands.iter().any(|o| is_scalar_syntax(o)) {
            return None;
        }
        self.rewrote = true;
        self.promoted = true;
        let p = self.p;
        let vars: Vec<syn::Ident> = operands
            .iter()
            .enumerate()
            .map(|(k, o)| syn::Ident::new(&format!("__amp_v{k}"), Span::mixed_site().located_at(o.span())))
            .collect();
        let args = call.args.iter().enumerate().map(|(i, arg)| {
            let mine: Vec<(usize, &syn::Ident)> = slots
                .iter()
                .zip(&vars)
                .filter(|((ai, _), _)| *ai == i)
                .map(|((_, j), v)| (j.unwrap_or(0), v))
                .collect();
            match kinds[i] {
                Arg::T => {
                    let v = mine[0].1;
                    quote!(#v.__amp_get())
                }
                Arg::L => {
                    let vs = mine.iter().map(|(_, v)| v);
                    quote!(&[#(#vs.__amp_get()),*])
                }
                _ => quote!(#arg),
            }
        });
        let func = &call.func;
        Some(quote_spanned!(call.span()=>
            (match (&#p::Many::new((#(#operands,)*))).__amp_promote_all() {
                (#(#vars,)*) => #func(#(#args),*),
            })
        ))
    }

    /// `f(args)`: a table op called as an associated function, or a function the user put in
    /// a category (every non-literal argument that is a tensor is cast).
    fn rewrite_call(&mut self, call: &syn::ExprCall) -> Option<TokenStream> {
        let Expr::Path(fp) = &*call.func else { return None };
        let segs: Vec<String> = fp.path.segments.iter().map(|s| s.ident.to_string()).collect();
        // `Tensor::matmul(x, &w)` or `<Tensor<f32>>::matmul(x, &w)` (not `<T as Trait>::..`):
        // a table method called by its path is rewritten as the method call it is
        // (`(x).matmul(&w)`).
        let on_tensor = match &fp.qself {
            None => segs.len() >= 2 && segs[segs.len() - 2] == "Tensor",
            Some(q) => {
                q.position == 0
                    && segs.len() == 1
                    && matches!(&*q.ty, syn::Type::Path(tp) if tp.qself.is_none()
                        && tp.path.segments.last().is_some_and(|s| s.ident == "Tensor"))
            }
        };
        if on_tensor
            && let Some(name) = segs.last()
            && let Some((receiver, args)) = call.args.iter().collect::<Vec<_>>().split_first()
            && self.method_rule(name, args.len()).is_some()
        {
            let last = &fp.path.segments.last().expect("a named function").ident;
            let mc = syn::ExprMethodCall {
                attrs: Vec::new(),
                receiver: Box::new(Expr::Paren(syn::ExprParen {
                    attrs: Vec::new(),
                    paren_token: Default::default(),
                    expr: Box::new((*receiver).clone()),
                })),
                dot_token: Default::default(),
                method: last.clone(),
                turbofish: None,
                paren_token: call.paren_token,
                args: args.iter().map(|a| (*a).clone()).collect(),
            };
            return self.rewrite_method_call(&mc);
        }
        let user = self.user_fns.iter().find(|(want, _)| segs.ends_with(want)).map(|(_, c)| *c);
        let cat = match user {
            Some(c) => c,
            None => {
                let last = segs.last()?;
                let op = policy::lookup(last)?;
                if !op.assoc || segs.len() < 2 || self.off.contains(op.name) || op.args.len() != call.args.len() {
                    return None;
                }
                return match op.category {
                    Category::Promote => self.rewrite_assoc_promote(call, op.args),
                    _ => None,
                };
            }
        };
        let target = match cat {
            Category::Lower => Target::Low,
            Category::Fp32 | Category::Fp32Accumulate => Target::F32,
            _ => return None,
        };
        let args: Vec<TokenStream> = call.args.iter().map(|a| self.cast_arg(a, &target)).collect();
        let func = &call.func;
        Some(quote_spanned!(call.span()=> #func(#(#args),*)))
    }

    fn rewrite_binary(&mut self, b: &syn::ExprBinary) -> Option<TokenStream> {
        use syn::BinOp::{Add, Div, Mul, Sub};
        if !matches!(b.op, Add(_) | Sub(_) | Mul(_) | Div(_)) {
            return None;
        }
        if is_scalar_syntax(&b.left)
            || is_scalar_syntax(&b.right)
            || self.is_untyped(&b.left)
            || self.is_untyped(&b.right)
        {
            return None;
        }
        self.rewrote = true;
        self.promoted = true;
        let (p, l, r, op) = (self.p, &b.left, &b.right, &b.op);
        let x = syn::Ident::new("__amp_l", Span::mixed_site().located_at(l.span()));
        let y = syn::Ident::new("__amp_r", Span::mixed_site().located_at(r.span()));
        Some(quote_spanned!(b.span()=>
            (match (&#p::Pair::new(#l, #r)).__amp_promote_op() {
                (#x, #y) => #x #op #y,
            })
        ))
    }

    fn is_untyped(&self, e: &Expr) -> bool {
        let Expr::Path(p) = e else { return false };
        let Some(id) = p.path.get_ident() else { return false };
        let name = id.to_string();
        self.untyped.iter().any(|s| s.contains(&name))
    }

    /// Visits a closure; `typed` when it is an argument of a call (its parameter types come
    /// from the callee's bounds).
    fn visit_closure(&mut self, c: &mut ExprClosure, typed: bool) {
        let mut names = HashSet::new();
        if !typed {
            for input in &c.inputs {
                if !matches!(input, Pat::Type(_)) {
                    pat_idents(input, &mut names);
                }
            }
        }
        let ret = match &c.output {
            syn::ReturnType::Type(_, ty) => Some((**ty).clone()),
            syn::ReturnType::Default => None,
        };
        self.untyped.push(names);
        self.returns.push(ret.clone());
        self.visit_expr_mut(&mut c.body);
        if let Some(ty) = &ret {
            self.conform(&mut c.body, ty);
        }
        self.returns.pop();
        self.untyped.pop();
    }

    fn visit_args(&mut self, args: &mut syn::punctuated::Punctuated<Expr, syn::Token![,]>) {
        for a in args.iter_mut() {
            match a {
                Expr::Closure(c) => self.visit_closure(c, true),
                other => self.visit_expr_mut(other),
            }
        }
    }

    /// Makes the value of `e` have the declared type `ty` where `ty` has `Tensor<X>` positions.
    fn conform(&mut self, e: &mut Expr, ty: &Type) {
        match e {
            Expr::Block(b) => return self.conform_block(&mut b.block, ty),
            Expr::Unsafe(b) => return self.conform_block(&mut b.block, ty),
            Expr::Paren(pe) => return self.conform(&mut pe.expr, ty),
            Expr::If(i) => {
                self.conform_block(&mut i.then_branch, ty);
                if let Some((_, els)) = &mut i.else_branch {
                    self.conform(els, ty);
                }
                return;
            }
            Expr::Match(m) => {
                for arm in &mut m.arms {
                    self.conform(&mut arm.body, ty);
                }
                return;
            }
            // A diverging tail needs nothing; a macro's value is left as it is (but `vec![..]`
            // is a `Vec`, conformed below).
            Expr::Return(_) => return,
            // A value with no tensor in it yet (`None`, `Vec::new()`, `vec![]`) takes its type
            // from the declared one; wrapped, it would leave the compiler nothing to infer from.
            Expr::Path(p) if p.qself.is_none() && p.path.is_ident("None") => return,
            Expr::Call(c) if c.args.len() <= 1 && is_empty_vec(&c.func) => return,
            Expr::Macro(m) if m.mac.path.is_ident("vec") && m.mac.tokens.is_empty() => return,
            Expr::Macro(m) if !(m.mac.path.is_ident("vec") && vec_elem(ty).is_some()) => return,
            // `Tensor::zeros(..)` and the like take their precision from the declared type.
            Expr::Call(c) if is_tensor_constructor(&c.func) => return,
            _ => {}
        }
        let p = self.p;
        if let Some(x) = tensor_elem(ty) {
            let span = e.span();
            *e = Expr::Verbatim(quote_spanned!(span=> #p::conform::<#x, _>(#e)));
            self.rewrote = true;
        } else if let Some((kind, inner)) = wrapper_inner(ty) {
            if let Expr::Call(call) = e
                && let Expr::Path(fp) = &*call.func
            {
                let ctor = fp.path.segments.last().map(|s| s.ident.to_string()).unwrap_or_default();
                let wraps = (kind == "Result" && ctor == "Ok") || (kind == "Option" && ctor == "Some");
                if wraps && call.args.len() == 1 {
                    return self.conform(&mut call.args[0], inner);
                }
                if matches!(ctor.as_str(), "Err" | "None") {
                    return;
                }
            }
            if let Some(x) = tensor_elem(inner) {
                let span = e.span();
                *e = Expr::Verbatim(if kind == "Result" {
                    quote_spanned!(span=> #p::conform_result::<#x, _, _>(#e))
                } else {
                    quote_spanned!(span=> #p::conform_option::<#x, _>(#e))
                });
                self.rewrote = true;
            }
        } else if let Some(x) = vec_elem(ty).and_then(tensor_elem) {
            let span = e.span();
            *e = Expr::Verbatim(quote_spanned!(span=> #p::conform_vec::<#x, _>(#e)));
            self.rewrote = true;
        } else if let (Type::Tuple(tt), Expr::Tuple(te)) = (ty, &mut *e) {
            if tt.elems.len() == te.elems.len() {
                for (t, x) in tt.elems.iter().zip(te.elems.iter_mut()) {
                    self.conform(x, t);
                }
            }
        } else if let Type::Tuple(tt) = ty
            && tt.elems.iter().any(has_tensor)
        {
            // A tuple that is not written out (a call's value): taken apart and rebuilt, each
            // element conformed to its declared type.
            let span = e.span();
            let names: Vec<syn::Ident> = (0..tt.elems.len())
                .map(|k| syn::Ident::new(&format!("__amp_t{k}"), Span::mixed_site().located_at(span)))
                .collect();
            let mut rebuilt: syn::ExprTuple = syn::parse_quote!((#(#names,)*));
            for (t, x) in tt.elems.iter().zip(rebuilt.elems.iter_mut()) {
                self.conform(x, t);
            }
            *e = Expr::Verbatim(quote_spanned!(span=> match #e { (#(#names,)*) => #rebuilt }));
        } else if let Type::Paren(inner) = ty {
            self.conform(e, &inner.elem);
        }
    }

    fn conform_block(&mut self, b: &mut syn::Block, ty: &Type) {
        if let Some(Stmt::Expr(tail, None)) = b.stmts.last_mut() {
            self.conform(tail, ty);
        }
    }
}

impl VisitMut for Rewriter<'_> {
    fn visit_expr_mut(&mut self, e: &mut Expr) {
        match e {
            // Macro calls keep their meaning: `vec![..]`, `println!(..)`, `autocast_off! {..}`.
            Expr::Macro(_) => {}
            // Const contexts: a helper call there would not compile.
            Expr::Const(_) => {}
            Expr::Repeat(r) => self.visit_expr_mut(&mut r.expr),
            Expr::Closure(c) => self.visit_closure(c, false),
            Expr::MethodCall(mc) => {
                self.visit_expr_mut(&mut mc.receiver);
                self.visit_args(&mut mc.args);
                let as_written = self.method_runs_as_written(mc);
                if let Some(t) = self.rewrite_method_call(mc) {
                    *e = Expr::Verbatim(t);
                } else if let Some(t) = self.rewrite_module_call(mc) {
                    *e = Expr::Verbatim(t);
                }
                if as_written {
                    *e = Expr::Verbatim(self.as_written(&*e));
                }
            }
            Expr::Call(call) => {
                self.visit_args(&mut call.args);
                let as_written = self.call_runs_as_written(call);
                if let Some(t) = self.rewrite_call(call) {
                    *e = Expr::Verbatim(t);
                }
                if as_written {
                    *e = Expr::Verbatim(self.as_written(&*e));
                }
            }
            Expr::Binary(b) => {
                self.visit_expr_mut(&mut b.left);
                self.visit_expr_mut(&mut b.right);
                if let Some(t) = self.rewrite_binary(b) {
                    *e = Expr::Verbatim(t);
                }
            }
            Expr::Return(r) => {
                if let Some(v) = &mut r.expr {
                    self.visit_expr_mut(v);
                    if let Some(Some(ty)) = self.returns.last().cloned() {
                        self.conform(v, &ty);
                    }
                }
            }
            _ => visit_mut::visit_expr_mut(self, e),
        }
    }

    fn visit_stmt_mut(&mut self, s: &mut Stmt) {
        let attrs = match s {
            Stmt::Local(l) => Some(&mut l.attrs),
            Stmt::Expr(Expr::Block(b), _) => Some(&mut b.attrs),
            _ => None,
        };
        if let Some(attrs) = attrs
            && attrs.iter().any(is_off_attr)
        {
            // `#[autocast(off)]`: this statement runs as written (and says so to the reach
            // check, for as long as it runs).
            attrs.retain(|a| !is_off_attr(a));
            let p = self.p;
            let guard = syn::Ident::new("__amp_off", Span::mixed_site());
            match s {
                Stmt::Local(l) => {
                    if let Some(init) = &mut l.init {
                        let wrapped = self.as_written(&init.expr);
                        *init.expr = Expr::Verbatim(wrapped);
                    }
                }
                Stmt::Expr(Expr::Block(b), _) => {
                    b.block.stmts.insert(0, syn::parse_quote!(let #guard = #p::OffGuard::new();));
                }
                _ => {}
            }
            return;
        }
        match s {
            Stmt::Macro(_) | Stmt::Item(_) => {}
            Stmt::Local(local) => {
                visit_mut::visit_local_mut(self, local);
                // `let h: Tensor<f32> = ..`: a declared type is honoured like a return type.
                if let (Pat::Type(pt), Some(init)) = (&local.pat, &mut local.init)
                    && init.diverge.is_none()
                {
                    let ty = (*pt.ty).clone();
                    self.conform(&mut init.expr, &ty);
                }
            }
            _ => visit_mut::visit_stmt_mut(self, s),
        }
    }

    // Nested items are not part of this function's region; types, patterns and generic
    // arguments hold no run-time ops (and const expressions that must stay const).
    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
    fn visit_type_mut(&mut self, _: &mut Type) {}
    fn visit_pat_mut(&mut self, _: &mut Pat) {}
    fn visit_generic_argument_mut(&mut self, _: &mut syn::GenericArgument) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expands `item` under `#[autocast(attr)]` and pretty-prints the result.
    fn expanded(attr: TokenStream, item: TokenStream) -> String {
        let out = crate::autocast_impl(attr, item, quote!(::amp_core::__private));
        let file: syn::File = syn::parse2(out.clone()).unwrap_or_else(|e| panic!("{e}: {out}"));
        prettyplease::unparse(&file)
    }

    #[test]
    fn crate_names_where_amp_is() {
        let got = expanded(
            quote!(crate = ::my_framework::amp),
            quote! { fn f(x: &Tensor<f32>, w: &Param) -> Tensor<f32> { x.matmul(w) } },
        );
        assert!(got.contains("::my_framework::amp::__private::Region::enter"), "{got}");
        assert!(!got.contains("amp_core"), "{got}");
    }

    #[test]
    fn a_small_forward() {
        // `x.matmul(w1)`: both sides to f16; `.add(b1)`: the f16 product and the f32 bias meet
        // in f32 (promote); `relu` as its input; `softmax` in f32; the tail cast to the
        // declared `Tensor<f32>` (a no-op here, decided by the types).
        let got = expanded(
            quote!(),
            quote! {
                fn mlp(x: &Tensor<f32>, w1: &Param, b1: &Param, w2: &Param) -> Tensor<f32> {
                    let h = x.matmul(w1).add(b1).relu();
                    h.matmul(&w2.t()).softmax(1)
                }
            },
        );
        let want = r#"fn mlp(x: &Tensor<f32>, w1: &Param, b1: &Param, w2: &Param) -> Tensor<f32> {
    let __amp_region = ::amp_core::__private::Region::enter::<
        ::amp_core::__private::f16,
    >(true, false, "mlp");
    #[allow(unused_imports)]
    use ::amp_core::__private::autocast_traits::*;
    let h = (match (&::amp_core::__private::Pair::new(
        (&::amp_core::__private::W::new(&x))
            .__amp_to::<::amp_core::__private::f16>()
            .matmul(
                (&::amp_core::__private::W::new(w1))
                    .__amp_arg::<::amp_core::__private::f16>()
                    .__amp_get(),
            ),
        b1,
    ))
        .__amp_promote()
    {
        (__amp_r, __amp_a) => __amp_r.add(__amp_a.__amp_get()),
    })
        .relu();
    ::amp_core::__private::conform::<
        f32,
        _,
    >(
        (&::amp_core::__private::W::new(
            (&::amp_core::__private::W::new(&h))
                .__amp_to::<::amp_core::__private::f16>()
                .matmul(
                    (&::amp_core::__private::W::new(&w2.t()))
                        .__amp_arg::<::amp_core::__private::f16>()
                        .__amp_get(),
                ),
        ))
            .__amp_to::<::core::primitive::f32>()
            .softmax(1),
    )
}
"#;
        assert_eq!(got, want, "\n{got}");
    }

    #[test]
    fn non_tensor_look_alikes_are_left_alone() {
        let got = expanded(
            quote!(bf16),
            quote! {
                fn stats(v: &[f32], x: f32) -> f32 {
                    let s: f32 = v.iter().sum();
                    let m = v.iter().copied().fold(f32::MIN, f32::max);
                    let n = vec![x.log(2.0)];
                    println!("{}", x.exp());
                    let a = [0.0f32; 2 * 3];
                    s + m + n[0] * 2.0
                }
            },
        );
        // `sum()` and `log(2.0)` have the wrong argument count, macros are not entered, array
        // lengths are const; only `s + m` is a candidate (resolved by type to plain f32 `+`).
        assert!(got.contains("let s: f32 = v.iter().sum();"), "{got}");
        assert!(got.contains("let n = vec![x.log(2.0)];"), "{got}");
        assert!(got.contains("println!(\"{}\", x.exp());"), "{got}");
        assert!(got.contains("[0.0f32; 2 * 3]"), "{got}");
        assert!(got.contains("n[0] * 2.0"), "{got}");
        // `s + m` and `(s + m) + n[0] * 2.0` (plain f32 `+` once the types are known).
        assert_eq!(got.matches("Pair::new").count(), 2, "{got}");
    }

    #[test]
    fn user_categories_and_switching_off() {
        let got = expanded(
            quote!(fp32 = [my_norm], lower = [proj], passthrough = [softmax]),
            quote! {
                fn f(&self, x: &Tensor<f32>) -> Tensor<f16> {
                    let h = my_norm(x, 1e-5);
                    let y = self.proj(&h);
                    #[autocast(off)]
                    let z = y.exp();
                    let s = z.softmax(1);
                    autocast_off! { let q = s.exp(); }
                    s
                }
            },
        );
        // Compared without whitespace: the layout is prettyplease's.
        let flat: String = got.split_whitespace().collect();
        let has = |want: &str| flat.contains(&want.split_whitespace().collect::<String>());
        // The user's categorised calls get cast inputs and run as written (an `OffGuard`).
        assert!(
            has(
                "let h = { let __amp_off = ::amp_core::__private::OffGuard::new(); my_norm((&::amp_core::__private::W::new(x)).__amp_arg::<::core::primitive::f32>()"
            ),
            "{got}"
        );
        assert!(has("1e-5"), "{got}");
        assert!(has(".__amp_to::<::amp_core::__private::f16>().proj("), "{got}");
        // `#[autocast(off)]` and `passthrough` run as written, under a guard.
        assert!(has("let z = { let __amp_off = ::amp_core::__private::OffGuard::new(); y.exp() };"), "{got}");
        assert!(has("let s = { let __amp_off = ::amp_core::__private::OffGuard::new(); z.softmax(1) };"), "{got}");
        assert!(has("autocast_off! { let q = s.exp(); }"), "{got}");
        assert!(got.contains("conform::<f16, _>(s)"), "{got}");
    }

    #[test]
    fn returns_follow_the_declared_type() {
        let got = expanded(
            quote!(),
            quote! {
                fn f(x: &Tensor<f32>, early: bool) -> Result<(Tensor<f32>, usize), Error> {
                    if early {
                        return Ok((x.matmul(x), 1));
                    }
                    let y = x.try_matmul(x)?;
                    Ok((y, 2))
                }
            },
        );
        assert!(got.contains("return Ok((\n            ::amp_core::__private::conform::<"), "{got}");
        assert!(got.contains("Ok((::amp_core::__private::conform::<f32, _>(y), 2))"), "{got}");
        assert!(got.contains(".try_matmul("), "{got}");
    }

    #[test]
    fn generic_low_type_forward_and_region() {
        let got = expanded(
            quote!(P),
            quote! {
                fn f<P: Precision>(&self, x: &Tensor<f32>) -> Vec<Tensor<f32>> {
                    let h = self.fc1.forward(x);
                    let r = x + &h;
                    vec![r, self.pair(x).0]
                }
            },
        );
        // The low type is `P`; the region records it as chosen; promotions get their bounds.
        assert!(got.contains("Region::enter::<P>(true, true, \"f\")"), "{got}");
        assert!(got.contains("P: ::amp_core::__private::Promote<"), "{got}");
        assert!(got.contains("::core::primitive::f32: ::amp_core::__private::Promote<"), "{got}");
        // `forward` without a turbofish: the receiver through the module dispatch (`In` for an
        // `amp::nn` module, itself otherwise), the value through `Hint`.
        let flat: String = got.split_whitespace().collect();
        assert!(flat.contains("leth=(&::amp_core::__private::Hint::<P,_,>::new("), "{got}");
        assert!(
            flat.contains("(&::amp_core::__private::W::new(self.fc1.__amp_place())).__amp_in::<P>().forward(x),))"),
            "{got}"
        );
        assert!(flat.contains(".__amp_low();"), "{got}");
        // `Vec<Tensor<f32>>`: each element conformed.
        assert!(got.contains("::amp_core::__private::conform_vec::<f32, _>(vec![r, self.pair(x).0])"), "{got}");
        // Without promotions, no bounds: a generic caller needs only `P: Precision`.
        let got = expanded(
            quote!(P),
            quote!(
                fn g<P: Precision>(x: &Tensor<f32>) -> Tensor<f32> {
                    x.exp()
                }
            ),
        );
        assert!(!got.contains("where"), "{got}");
        let got = expanded(
            quote!(f32),
            quote!(
                fn h(x: &Tensor<f32>) -> (Tensor<f32>, usize) {
                    pair(x)
                }
            ),
        );
        assert!(got.contains("::core::primitive::f32,\n    >(true, true, \"h\")"), "{got}");
        assert!(got.contains("match pair(x) {"), "{got}");
    }

    #[test]
    fn module_receivers_keep_their_form() {
        let got = expanded(
            quote!(bf16),
            quote! {
                fn f(&mut self, s: &mut S, mut local: L, x: &Tensor<f32>, rng: &mut Rng) -> Tensor<f32> {
                    let a = self.blocks[0].forward(x, rng);
                    let b = self.head.forward(&self.prep(x));
                    let c = s.forward(x);
                    let d = s.inner.forward(x);
                    let e = local.forward(x);
                    let g = Consumed(vec![1.0]).forward(3.0);
                    let g2 = { local }.forward(3.0);
                    let g3 = (Consumed(vec![2.0])).forward(3.0);
                    let shadow = 3;
                    let mut shadow = shadow;
                    let h = shadow.forward(x);
                    let r = &mut local;
                    let i = r.cell.loss(x, x, rng);
                    let j = gpt.loss(&ids, &ids, rng);
                    let k = self.fc.forward::<f32, _>(x);
                    a
                }
            },
        );
        let flat: String = got.split_whitespace().collect();
        let recv = |form: &str, call: &str| {
            let want =
                format!("(&::amp_core::__private::W::new({form})).__amp_in::<::amp_core::__private::bf16>().{call}");
            assert!(flat.contains(&want), "{want} in\n{got}");
        };
        // `&mut self`: places under it borrowed mutably, unless an argument uses `self`.
        recv("&mutself.blocks[0]", "forward(x,rng)");
        recv("self.head.__amp_place()", "forward(&self.prep(x))");
        // A `&mut` parameter itself is reborrowed; a place under it is borrowed mutably.
        recv("s.__amp_place()", "forward(x)");
        recv("&muts.inner", "forward(x)");
        // A `mut` binding: `&mut`; a temporary: moved (its own `forward(self)` still works).
        recv("&mutlocal", "forward(x)");
        recv("Consumed(vec![1.0])", "forward(3.0)");
        // A block stays in parentheses (no `unused_braces`); the user's parentheses go (no
        // `unused_parens`).
        recv("({local})", "forward(3.0)");
        recv("Consumed(vec![2.0])", "forward(3.0)");
        // Bound two ways (shadowed): shared.
        recv("shadow.__amp_place()", "forward(x)");
        // `let r = &mut ..`: places under it borrowed mutably; a name from elsewhere: shared.
        recv("&mutr.cell", "loss(x,x,rng)");
        recv("gpt.__amp_place()", "loss(&ids,&ids,rng)");
        // Each value goes through `Hint`; a turbofish is as written, under an `OffGuard`.
        assert_eq!(flat.matches("Hint::<::amp_core::__private::bf16,_,>::new(").count(), 11, "{got}");
        assert!(flat.contains("OffGuard::new();self.fc.forward::<f32,_>(x)"), "{got}");
    }
}
