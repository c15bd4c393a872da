//! Checks that `#[autocast]` is on something it can rewrite and that the options make sense
//! together (the parser checked each option alone).

use std::collections::HashMap;

use syn::spanned::Spanned;

use crate::parse::{Options, suggest};
use crate::policy::{self, Category};

/// The function `#[autocast]` rewrites, or the error that says why it cannot.
pub(crate) fn item(tokens: proc_macro2::TokenStream) -> Result<syn::ItemFn, syn::Error> {
    // A trait method without a body (syn would take it for an unparsed item).
    if let Ok(f) = syn::parse2::<syn::TraitItemFn>(tokens.clone())
        && f.default.is_none()
    {
        return Err(syn::Error::new(
            f.sig.ident.span(),
            "`#[autocast]` needs a function body to rewrite: put it on the method in the `impl` block",
        ));
    }
    let item: syn::Item = syn::parse2(tokens)?;
    let what = match &item {
        syn::Item::Fn(f) => return function(f.clone()),
        syn::Item::Struct(s) => ("a struct", s.struct_token.span),
        syn::Item::Enum(e) => ("an enum", e.enum_token.span),
        syn::Item::Union(u) => ("a union", u.union_token.span),
        syn::Item::Impl(i) => ("an `impl` block", i.impl_token.span),
        syn::Item::Trait(t) => ("a trait", t.trait_token.span),
        syn::Item::Mod(m) => ("a module", m.mod_token.span),
        syn::Item::Const(c) => ("a const", c.const_token.span),
        syn::Item::Static(s) => ("a static", s.static_token.span),
        other => ("this item", other.span()),
    };
    Err(syn::Error::new(
        what.1,
        format!(
            "`#[autocast]` goes on a function or method, not on {}: put it on the forward method, \
             e.g. `#[autocast] fn forward(&self, x: &Tensor<f32>) -> Tensor<f32>`",
            what.0
        ),
    ))
}

fn function(f: syn::ItemFn) -> Result<syn::ItemFn, syn::Error> {
    if let Some(a) = &f.sig.asyncness {
        return Err(syn::Error::new(
            a.span,
            "`#[autocast]` cannot go on an `async fn`: its region and cast cache belong to one thread, and a \
             future can move between threads; put it on the synchronous forward the async code calls",
        ));
    }
    if let Some(c) = &f.sig.constness {
        return Err(syn::Error::new(c.span, "`#[autocast]` cannot go on a `const fn`: casts run at run time"));
    }
    Ok(f)
}

/// Cross-option checks: a name in two lists, `passthrough` naming something that is not an op.
pub(crate) fn options(opts: &Options) -> Result<(), syn::Error> {
    let mut errors: Vec<syn::Error> = Vec::new();
    let mut seen: HashMap<String, (Category, proc_macro2::Span)> = HashMap::new();
    for list in &opts.lists {
        for path in &list.names {
            let name = path_key(path);
            if let Some((cat, first)) = seen.get(&name) {
                let mut e = syn::Error::new(
                    path.span(),
                    format!("`{name}` is listed twice (in `{}` and `{}`): keep it in one", cat.label(), list.key),
                );
                e.combine(syn::Error::new(*first, "first listed here"));
                errors.push(e);
                continue;
            }
            seen.insert(name.clone(), (list.category, path.span()));
            if list.category == Category::Passthrough {
                let last = path.segments.last().map(|s| s.ident.to_string()).unwrap_or_default();
                if path.segments.len() != 1 || policy::lookup(&last).is_none() {
                    let msg = format!(
                        "`{name}` is not an op in the policy table: `passthrough` turns a table op off here \
                         (functions of your own are already left alone)"
                    );
                    let msg = match suggest(&last, policy::rows().map(|o| o.name)) {
                        Some(s) if s != last => format!("{msg}; did you mean `{s}`?"),
                        _ => msg,
                    };
                    errors.push(syn::Error::new(path.span(), msg));
                }
            } else if list.category == Category::Promote {
                errors.push(syn::Error::new(
                    list.key.span(),
                    "functions of your own can be put in `lower` or `fp32`; `promote` applies to the table's \
                     binary ops and the operators",
                ));
                break;
            }
        }
    }
    match errors.into_iter().reduce(|mut a, b| {
        a.combine(b);
        a
    }) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// `a::b::c` as text, for messages and duplicate checks.
pub(crate) fn path_key(path: &syn::Path) -> String {
    path.segments.iter().map(|s| s.ident.to_string()).collect::<Vec<_>>().join("::")
}
