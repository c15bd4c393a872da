//! `#[derive(Params)]`: enumerate a module's parameters with PyTorch `state_dict` names.
//!
//! Design notes:
//! - Every field is visited in declaration order, its name the prefix of whatever its own
//!   `Params` impl yields (`blocks` + `0.ln1.weight` → `blocks.0.ln1.weight`), so nesting
//!   structs, `Vec`s, `Option`s and `Box`es gives PyTorch's names with no hand-written lists.
//! - A field whose type does not hold parameters must say so (`#[param(skip)]`): silently
//!   skipping it would let a forgotten `Params` impl drop weights from checkpoints and
//!   optimizers. The check is a trait bound spanned on the field's type, so the compiler's
//!   error points at the field, with a message that names it and the fix.
//! - Generated code reaches the library through `::amp_core` or, for users who depend only on
//!   the facade, `::amp::amp_core` (found with `proc-macro-crate`).

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, GenericParam, LitStr, Type, parse_quote};

/// What `#[param(...)]` says about one field.
#[derive(Default)]
struct FieldOpts {
    skip: Option<Span>,
    rename: Option<LitStr>,
}

const KEYS: &[&str] = &["skip", "rename"];

/// Parses every `#[param(...)]` on a field, collecting all errors rather than the first.
fn field_opts(attrs: &[syn::Attribute], errors: &mut Vec<syn::Error>) -> FieldOpts {
    let mut opts = FieldOpts::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("param")) {
        let res = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("skip") {
                if opts.skip.is_some() {
                    return Err(meta.error("duplicate `skip`"));
                }
                opts.skip = Some(meta.path.span());
                Ok(())
            } else if meta.path.is_ident("rename") {
                if opts.rename.is_some() {
                    return Err(meta.error("duplicate `rename`"));
                }
                let lit: LitStr = meta.value()?.parse()?;
                if lit.value().is_empty() || lit.value().contains('.') {
                    return Err(syn::Error::new(
                        lit.span(),
                        "`rename` needs a non-empty name without dots (the dots between levels are added for you)",
                    ));
                }
                opts.rename = Some(lit);
                Ok(())
            } else {
                let key = meta.path.get_ident().map(|i| i.to_string()).unwrap_or_default();
                let hint = suggest(&key).map(|s| format!("; did you mean `{s}`?")).unwrap_or_default();
                Err(meta.error(format!("unknown `param` option `{key}`: expected `skip` or `rename = \"...\"`{hint}")))
            }
        });
        if let Err(e) = res {
            errors.push(e);
        }
    }
    if let (Some(span), Some(_)) = (opts.skip, &opts.rename) {
        errors.push(syn::Error::new(span, "`skip` and `rename` cannot be combined: a skipped field has no name"));
    }
    opts
}

/// The known key closest to `key` (edit distance at most 2), for a "did you mean" hint.
fn suggest(key: &str) -> Option<&'static str> {
    fn distance(a: &str, b: &str) -> usize {
        let b: Vec<char> = b.chars().collect();
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut prev = row[0];
            row[0] = i + 1;
            for (j, &cb) in b.iter().enumerate() {
                let cur = row[j + 1];
                row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
                prev = cur;
            }
        }
        row[b.len()]
    }
    KEYS.iter().copied().filter(|k| distance(key, k) <= 2).min_by_key(|k| distance(key, k))
}

/// The path generated code uses for amp-core: `::amp_core`, or `::amp::amp_core` when only the
/// facade is a dependency. Inside amp-core itself `::amp_core` resolves through its
/// `extern crate self as amp_core`.
fn core_path() -> TokenStream {
    use proc_macro_crate::{FoundCrate, crate_name};
    match crate_name("amp-core") {
        Ok(FoundCrate::Itself) => quote!(::amp_core),
        Ok(FoundCrate::Name(name)) => {
            let ident = format_ident!("{}", name);
            quote!(::#ident)
        }
        Err(_) => match crate_name("amp") {
            Ok(FoundCrate::Name(name)) => {
                let ident = format_ident!("{}", name);
                quote!(::#ident::amp_core)
            }
            // The facade itself (or nothing found): the facade re-exports amp_core at its root.
            Ok(FoundCrate::Itself) => quote!(crate::amp_core),
            Err(_) => quote!(::amp_core),
        },
    }
}

/// Whether `ty` mentions the type parameter `param` anywhere (a token walk: `Vec<M>`, `[M; 2]`).
fn mentions(ty: &Type, param: &syn::Ident) -> bool {
    fn walk(ts: TokenStream, ident: &syn::Ident) -> bool {
        ts.into_iter().any(|tt| match tt {
            proc_macro2::TokenTree::Ident(i) => &i == ident,
            proc_macro2::TokenTree::Group(g) => walk(g.stream(), ident),
            _ => false,
        })
    }
    walk(quote!(#ty), param)
}

/// Expands `#[derive(Params)]`; on error, the combined `compile_error!`s.
pub fn expand(input: DeriveInput) -> TokenStream {
    match try_expand(input) {
        Ok(ts) => ts,
        Err(e) => e.to_compile_error(),
    }
}

fn try_expand(mut input: DeriveInput) -> syn::Result<TokenStream> {
    let krate = core_path();
    let fields = match &input.data {
        Data::Struct(s) => s.fields.clone(),
        Data::Enum(e) => {
            return Err(syn::Error::new(
                e.enum_token.span(),
                "`#[derive(Params)]` supports structs only: an enum's parameters depend on its variant; implement `Params` by hand",
            ));
        }
        Data::Union(u) => {
            return Err(syn::Error::new(u.union_token.span(), "`#[derive(Params)]` supports structs only"));
        }
    };
    let mut errors = Vec::new();
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("param")) {
        errors.push(syn::Error::new(
            attr.span(),
            "`#[param(...)]` belongs on fields (`skip`, `rename = \"...\"`), not on the struct",
        ));
    }

    // (member, name, type) of every visited field.
    let mut visited = Vec::new();
    let members: Vec<(syn::Member, String, &syn::Field)> = match &fields {
        Fields::Named(named) => named
            .named
            .iter()
            .map(|f| {
                let ident = f.ident.clone().expect("named field");
                let name = ident.to_string().trim_start_matches("r#").to_string();
                (syn::Member::Named(ident), name, f)
            })
            .collect(),
        Fields::Unnamed(unnamed) => unnamed
            .unnamed
            .iter()
            .enumerate()
            .map(|(i, f)| (syn::Member::Unnamed(i.into()), i.to_string(), f))
            .collect(),
        Fields::Unit => Vec::new(),
    };
    let mut seen = std::collections::HashMap::new();
    for (member, name, field) in members {
        let opts = field_opts(&field.attrs, &mut errors);
        if opts.skip.is_some() {
            continue;
        }
        if let Some(low) = low_precision_param(&field.ty) {
            errors.push(syn::Error::new(
                field.ty.span(),
                format!(
                    "`Param<{low}>` cannot be trained here: master weights are f32 (`Param`, i.e. `Param<f32>`), and \
                     `#[autocast]` (or `.cast::<{low}>()` in the forward pass) makes the {low} copy at each use, with \
                     f32 gradients for the optimizer. Do not mark it `#[param(skip)]`: that would freeze the weight \
                     and leave it out of checkpoints"
                ),
            ));
            continue;
        }
        let (name, name_span) = match &opts.rename {
            Some(lit) => (lit.value(), lit.span()),
            None => (name, field.span()),
        };
        if let Some(first) = seen.insert(name.clone(), name_span) {
            let mut e = syn::Error::new(name_span, format!("two fields are both named `{name}` in the state_dict"));
            e.combine(syn::Error::new(first, "the first one is here"));
            errors.push(e);
        }
        visited.push((member, name, field.ty.clone()));
    }
    if let Some(combined) = errors.into_iter().reduce(|mut a, b| {
        a.combine(b);
        a
    }) {
        return Err(combined);
    }

    // Bound every type parameter a visited field mentions (`struct Wrap<M> { inner: M }`
    // needs `M: Params`), as serde bounds its type parameters.
    let type_params: Vec<syn::Ident> = input
        .generics
        .params
        .iter()
        .filter_map(|p| match p {
            GenericParam::Type(t) => Some(t.ident.clone()),
            _ => None,
        })
        .collect();
    let where_clause = input.generics.make_where_clause();
    for param in &type_params {
        if visited.iter().any(|(_, _, ty)| mentions(ty, param)) {
            where_clause.predicates.push(parse_quote!(#param: #krate::Params));
        }
    }

    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let struct_name = ident.to_string();

    // One check trait per field, so its message can name the field. Its blanket impl over
    // `Params` means the bound fails exactly when the field's type holds no parameters, and
    // the call is spanned on the field's type, so the error lands on the field.
    let mut checks = Vec::new();
    let mut visit = Vec::new();
    let mut visit_mut = Vec::new();
    let mut set_training = Vec::new();
    for (member, name, ty) in &visited {
        // Named after the Rust field (always a valid identifier), read in the compiler's help.
        let check = match member {
            syn::Member::Named(ident) => {
                format_ident!("field_{}_holds_params", ident.to_string().trim_start_matches("r#"))
            }
            syn::Member::Unnamed(index) => format_ident!("field_{}_holds_params", index.index),
        };
        let message = format!("field `{name}` of `{struct_name}` has type `{{Self}}`, which holds no parameters");
        checks.push(quote! {
            #[diagnostic::on_unimplemented(
                message = #message,
                label = "not a `Params` type",
                note = "mark the field `#[param(skip)]` if it is not a parameter (a rate, a config), or implement `Params` for its type (`#[derive(Params)]`)"
            )]
            trait #check {
                fn __amp_visit(&self) -> ::std::vec::Vec<(::std::string::String, &#krate::Param)>;
                fn __amp_visit_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #krate::Param)>;
                fn __amp_set_training(&mut self, training: bool);
            }
            // Report `f32: check` (with the message above), not the `Params` bound behind it.
            #[diagnostic::do_not_recommend]
            impl<__AmpT: #krate::Params + ?::std::marker::Sized> #check for __AmpT {
                fn __amp_visit(&self) -> ::std::vec::Vec<(::std::string::String, &#krate::Param)> {
                    #krate::Params::named_params(self)
                }
                fn __amp_visit_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #krate::Param)> {
                    #krate::Params::named_params_mut(self)
                }
                fn __amp_set_training(&mut self, training: bool) {
                    #krate::Params::set_training(self, training)
                }
            }
        });
        let call = quote_spanned!(ty.span()=> <#ty as #check>::__amp_visit);
        let call_mut = quote_spanned!(ty.span()=> <#ty as #check>::__amp_visit_mut);
        visit.push(quote! {
            for (__amp_name, __amp_param) in #call(&self.#member) {
                __amp_out.push((#krate::param::join_name(#name, &__amp_name), __amp_param));
            }
        });
        let call_training = quote_spanned!(ty.span()=> <#ty as #check>::__amp_set_training);
        set_training.push(quote! { #call_training(&mut self.#member, __amp_training); });
        visit_mut.push(quote! {
            for (__amp_name, __amp_param) in #call_mut(&mut self.#member) {
                __amp_out.push((#krate::param::join_name(#name, &__amp_name), __amp_param));
            }
        });
    }

    Ok(quote! {
        #[doc(hidden)]
        #[allow(non_camel_case_types, non_local_definitions)]
        const _: () = {
            #(#checks)*
            #[automatically_derived]
            impl #impl_generics #krate::Params for #ident #ty_generics #where_clause {
                fn named_params(&self) -> ::std::vec::Vec<(::std::string::String, &#krate::Param)> {
                    #[allow(unused_mut)]
                    let mut __amp_out = ::std::vec::Vec::new();
                    #(#visit)*
                    __amp_out
                }
                fn named_params_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #krate::Param)> {
                    #[allow(unused_mut)]
                    let mut __amp_out = ::std::vec::Vec::new();
                    #(#visit_mut)*
                    __amp_out
                }
                fn set_training(&mut self, __amp_training: bool) {
                    #(#set_training)*
                }
            }
        };
    })
}

/// `Param<f16>` / `Param<bf16>` anywhere in a field's type (`Option<Param<bf16>>`, `Vec<..>`):
/// the low precision's name.
fn low_precision_param(ty: &syn::Type) -> Option<&'static str> {
    struct Find(Option<&'static str>);
    impl<'ast> syn::visit::Visit<'ast> for Find {
        fn visit_path_segment(&mut self, seg: &'ast syn::PathSegment) {
            if seg.ident == "Param"
                && let syn::PathArguments::AngleBracketed(args) = &seg.arguments
            {
                for arg in &args.args {
                    if let syn::GenericArgument::Type(syn::Type::Path(tp)) = arg
                        && let Some(last) = tp.path.segments.last()
                    {
                        if last.ident == "f16" {
                            self.0 = Some("f16");
                        } else if last.ident == "bf16" {
                            self.0 = Some("bf16");
                        }
                    }
                }
            }
            syn::visit::visit_path_segment(self, seg);
        }
    }
    let mut f = Find(None);
    syn::visit::Visit::visit_type(&mut f, ty);
    f.0
}
