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
//! - The impl is `Params<E>` for one element type `E`, found from the struct's syntax, first
//!   match wins: `#[param(precision = T)]` on the struct; its one type parameter bounded by
//!   `Precision` (`struct Linear<W: Precision = f32>` gives `impl<W: Precision> Params<W>`);
//!   `bf16` named in a visited field's type (`lin: Linear<bf16>`, `w: Param<bf16>`); every
//!   visited field's type mentioning a type parameter (`struct Wrap<M> { inner: M }` gives
//!   `impl<__AmpE, M: Params<__AmpE>> Params<__AmpE>`, a wrapper of any precision); otherwise
//!   f32, so every struct written before element types existed derives what it did.
//! - Why not always `impl<__E> Params<__E> for S where FieldTy: Params<__E>, ..`: a where clause
//!   on a concrete field type (`rate: f32`) makes the impl compile and never apply, so the error
//!   would appear only where the struct is used (or never), naming no field. With `E` fixed by
//!   the syntax, each field's check is a plain bound inside the impl, and a field of the wrong
//!   type (a `Param<f32>` in a bf16 module, a rate without `skip`) is an error on that field.
//! - f16 anywhere in a visited field's type (`Param<f16>`, `Linear<f16>`) is refused: no
//!   optimizer updates f16 parameters (pure f16 training is not supported), and `#[param(skip)]`
//!   would freeze the weight, so the message says to keep it f32 and autocast.
//! - A `#[param(skip)]` field is left out of everything but train/eval: if its type is a module
//!   after all (a `Dropout` skipped by habit), `set_training` still reaches it.
//! - `#[param(buffer)]` marks an f32 tensor field as a buffer (running statistics): listed by
//!   `named_buffers` (with every submodule's), saved in checkpoints and moved by `to_device`,
//!   never given a gradient or optimizer state.
//! - The impl is `Params<E, D>` for one device `D`: the struct's type parameter bounded by
//!   `Device` (`struct Mlp<D: Device = Cpu>`), which also gets `ToDevice` (`model.to_device(&dev)`
//!   rebuilds it on another device); any device for a generic wrapper; otherwise the CPU.
//! - Generated code reaches the library through `::amp_core` or, for users who depend only on
//!   the facade, `::amp::amp_core` (found with `proc-macro-crate`).

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, LitStr, Type, parse_quote};

/// What `#[param(...)]` says about one field.
#[derive(Default)]
struct FieldOpts {
    skip: Option<Span>,
    buffer: Option<Span>,
    rename: Option<LitStr>,
}

const KEYS: &[&str] = &["skip", "buffer", "rename"];

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
            } else if meta.path.is_ident("buffer") {
                if opts.buffer.is_some() {
                    return Err(meta.error("duplicate `buffer`"));
                }
                opts.buffer = Some(meta.path.span());
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
                Err(meta.error(format!(
                    "unknown `param` option `{key}`: expected `skip`, `buffer` or `rename = \"...\"`{hint}"
                )))
            }
        });
        if let Err(e) = res {
            errors.push(e);
        }
    }
    if let (Some(span), Some(_)) = (opts.skip, &opts.rename) {
        errors.push(syn::Error::new(span, "`skip` and `rename` cannot be combined: a skipped field has no name"));
    }
    if let (Some(span), Some(_)) = (opts.buffer, opts.skip) {
        errors.push(syn::Error::new(
            span,
            "`buffer` and `skip` cannot be combined: a buffer is saved and moved with the module, a skipped field is not",
        ));
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

/// Where the element type of the generated `Params<E>` impl came from (see the module notes).
enum Elem {
    /// `#[param(precision = T)]` on the struct.
    Attribute(Type),
    /// The struct's one type parameter bounded by `Precision`.
    TypeParam(syn::Ident),
    /// `bf16`, named in the type of this field.
    Bf16Field(String),
    /// Every visited field's type mentions a type parameter: the impl is generic over `__AmpE`.
    Generic,
    /// f32 master weights.
    F32,
}

impl Elem {
    /// The element type as it is written in the impl.
    fn tokens(&self, krate: &TokenStream) -> TokenStream {
        match self {
            Elem::Attribute(ty) => quote!(#ty),
            Elem::TypeParam(ident) => quote!(#ident),
            Elem::Bf16Field(_) => quote!(#krate::bf16),
            Elem::Generic => quote!(__AmpE),
            Elem::F32 => quote!(f32),
        }
    }
    /// The type parameter that is the element type, if one is (it is not bounded `Params`).
    fn type_param(&self) -> Option<&syn::Ident> {
        match self {
            Elem::TypeParam(ident) => Some(ident),
            Elem::Attribute(Type::Path(tp)) if tp.qself.is_none() => tp.path.get_ident(),
            _ => None,
        }
    }
    fn is_f32(&self) -> bool {
        match self {
            Elem::F32 => true,
            Elem::Attribute(Type::Path(tp)) => tp.path.is_ident("f32"),
            _ => false,
        }
    }
    /// Why the parameters have this element type, for the field check's note.
    fn reason(&self, struct_name: &str) -> String {
        match self {
            Elem::Attribute(ty) => {
                format!(
                    "`{struct_name}`'s parameters have element type `{}`, as its `#[param(precision = ..)]` says",
                    quote!(#ty)
                )
            }
            Elem::TypeParam(ident) => format!(
                "`{struct_name}`'s parameters have element type `{ident}`, its type parameter bounded by `Precision`"
            ),
            Elem::Bf16Field(field) => {
                format!("`{struct_name}`'s parameters are bf16 because the type of field `{field}` names `bf16`")
            }
            Elem::Generic => format!("`{struct_name}`'s parameters have the element type of its type parameters"),
            Elem::F32 => format!("`{struct_name}`'s parameters are f32"),
        }
    }
}

/// What `#[param(...)]` on the struct says.
#[derive(Default)]
struct StructOpts {
    /// `precision = T`: the parameters' element type.
    precision: Option<Type>,
    /// `crate = path`: the path to the `amp` facade (a re-export of it).
    krate: Option<syn::Path>,
}

/// Parses `#[param(precision = T)]` and `#[param(crate = path)]` on the struct; other keys are
/// field options, misplaced.
fn struct_opts(attrs: &[syn::Attribute], errors: &mut Vec<syn::Error>) -> StructOpts {
    let mut opts = StructOpts::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("param")) {
        let res = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("precision") {
                if opts.precision.is_some() {
                    return Err(meta.error("duplicate `precision`"));
                }
                opts.precision = Some(meta.value()?.parse()?);
                Ok(())
            } else if meta.path.is_ident("crate") {
                if opts.krate.is_some() {
                    return Err(meta.error("duplicate `crate`"));
                }
                opts.krate = Some(meta.value()?.parse().map_err(|e| {
                    syn::Error::new(
                        e.span(),
                        "expected the path to amp, as this crate reaches it: `crate = my_framework::amp`",
                    )
                })?);
                Ok(())
            } else {
                Err(meta.error(
                    "on the struct, `#[param(...)]` takes only `precision = <type>` (the parameters' element type) and \
                     `crate = <path to amp>`; `skip` and `rename = \"...\"` belong on fields",
                ))
            }
        });
        if let Err(e) = res {
            errors.push(e);
        }
    }
    opts
}

/// The type parameters bounded by `Precision` (`W: Precision`, `W: amp::Precision`, or in the
/// where clause).
fn precision_params(generics: &syn::Generics) -> Vec<syn::Ident> {
    bounded_params(generics, "Precision")
}

/// The type parameters bounded by the trait named `bound` (last path segment), in the
/// parameter list or the where clause.
fn bounded_params(generics: &syn::Generics, bound: &str) -> Vec<syn::Ident> {
    let is_precision = |b: &syn::TypeParamBound| matches!(b, syn::TypeParamBound::Trait(t) if t.path.segments.last().is_some_and(|s| s.ident == bound));
    let mut out: Vec<syn::Ident> =
        generics.type_params().filter(|t| t.bounds.iter().any(is_precision)).map(|t| t.ident.clone()).collect();
    for pred in generics.where_clause.iter().flat_map(|w| &w.predicates) {
        if let syn::WherePredicate::Type(pt) = pred
            && let Type::Path(tp) = &pt.bounded_ty
            && let Some(ident) = tp.path.get_ident()
            && pt.bounds.iter().any(is_precision)
            && !out.contains(ident)
        {
            out.push(ident.clone());
        }
    }
    out
}

fn try_expand(input: DeriveInput) -> syn::Result<TokenStream> {
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
    let StructOpts { precision: attr_precision, krate } = struct_opts(&input.attrs, &mut errors);
    // `crate = path` names the facade as the user reaches it; amp-core is re-exported there.
    let krate = krate.map_or_else(core_path, |k| quote!(#k::amp_core));

    // (member, name, type) of every visited field.
    let mut visited = Vec::new();
    // (member, name, type) of every `#[param(buffer)]` field.
    let mut buffer_fields = Vec::new();
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
    let mut skipped = Vec::new();
    for (member, name, field) in members {
        let opts = field_opts(&field.attrs, &mut errors);
        if opts.skip.is_some() {
            skipped.push(member);
            continue;
        }
        if names_f16(&field.ty) {
            errors.push(syn::Error::new(field.ty.span(), F16_REFUSED));
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
        if opts.buffer.is_some() {
            buffer_fields.push((member, name, field.ty.clone()));
            continue;
        }
        visited.push((member, name, field.ty.clone()));
    }
    if let Some(ty) = &attr_precision
        && names_f16(ty)
    {
        errors.push(syn::Error::new(ty.span(), F16_REFUSED));
    }

    let type_params: Vec<syn::Ident> = input.generics.type_params().map(|t| t.ident.clone()).collect();
    let precision_params = precision_params(&input.generics);
    if attr_precision.is_none() && precision_params.len() > 1 {
        errors.push(syn::Error::new(
            precision_params[1].span(),
            format!(
                "`{}` and `{}` are both bounded by `Precision`: say which is the parameters' element type with \
                 `#[param(precision = ...)]` on the struct",
                precision_params[0], precision_params[1]
            ),
        ));
    }
    let device_params = bounded_params(&input.generics, "Device");
    if device_params.len() > 1 {
        errors.push(syn::Error::new(
            device_params[1].span(),
            format!(
                "`{}` and `{}` are both bounded by `Device`: one module's parameters live on one device",
                device_params[0], device_params[1]
            ),
        ));
    }
    if let Some(combined) = errors.into_iter().reduce(|mut a, b| {
        a.combine(b);
        a
    }) {
        return Err(combined);
    }

    let elem = if let Some(ty) = attr_precision {
        Elem::Attribute(ty)
    } else if let Some(p) = precision_params.first() {
        Elem::TypeParam(p.clone())
    } else if let Some((_, name, _)) = visited.iter().find(|(_, _, ty)| names_ident(ty, "bf16")) {
        Elem::Bf16Field(name.clone())
    } else if !visited.is_empty()
        && visited.iter().all(|(_, _, ty)| {
            // The device parameter says where the parameters live, not their element type.
            type_params.iter().filter(|p| !device_params.contains(p)).any(|p| mentions(ty, p))
        })
    {
        Elem::Generic
    } else {
        Elem::F32
    };
    let e = elem.tokens(&krate);
    // The device: the struct's type parameter bounded by `Device`; any device for a generic
    // wrapper (`__AmpD`); else the CPU.
    let device_param = device_params.first().cloned();
    let generic_device = device_param.is_none() && matches!(elem, Elem::Generic);
    let dev = match (&device_param, generic_device) {
        (Some(d), _) => quote!(#d),
        (None, true) => quote!(__AmpD),
        (None, false) => quote!(#krate::Cpu),
    };

    // Bound every type parameter a visited field mentions (`struct Wrap<M> { inner: M }`
    // needs `M: Params<E>`), as serde bounds its type parameters; the element type itself is
    // not a module.
    let mut impl_generics_src = input.generics.clone();
    let where_clause = impl_generics_src.make_where_clause();
    for param in &type_params {
        if Some(param) != elem.type_param()
            && Some(param) != device_param.as_ref()
            && visited.iter().any(|(_, _, ty)| mentions(ty, param))
        {
            where_clause.predicates.push(parse_quote!(#param: #krate::Params<#e, #dev>));
        }
    }
    if let Elem::Generic = elem {
        impl_generics_src.params.push(parse_quote!(__AmpE: #krate::Precision));
    }
    if generic_device {
        impl_generics_src.params.push(parse_quote!(__AmpD: #krate::Device));
    }

    let to_device = match &device_param {
        Some(d) => to_device_impl(&krate, &input, &fields, d),
        None => TokenStream::new(),
    };
    let ident = &input.ident;
    let (impl_generics, _, where_clause) = impl_generics_src.split_for_impl();
    let (_, ty_generics, _) = input.generics.split_for_impl();
    let struct_name = ident.to_string();

    // One check trait per field, so its message can name the field. Its blanket impl over
    // `Params<E>` means the bound fails exactly when the field's type holds no parameters of
    // the struct's element type, and the call is spanned on the field's type, so the error
    // lands on the field.
    let mut checks = Vec::new();
    let mut visit = Vec::new();
    let mut visit_mut = Vec::new();
    let mut set_training = Vec::new();
    let mut buffers = Vec::new();
    let mut buffers_mut = Vec::new();
    for (member, name, ty) in &visited {
        // Named after the Rust field (always a valid identifier), read in the compiler's help.
        let check = match member {
            syn::Member::Named(ident) => {
                format_ident!("field_{}_holds_params", ident.to_string().trim_start_matches("r#"))
            }
            syn::Member::Unnamed(index) => format_ident!("field_{}_holds_params", index.index),
        };
        // f32 modules keep the plain message; otherwise it says which element type and why.
        let (message, notes) = if elem.is_f32() {
            (
                format!("field `{name}` of `{struct_name}` has type `{{Self}}`, which holds no parameters"),
                vec![
                    "mark the field `#[param(skip)]` if it is not a parameter (a rate, a config), or implement `Params` \
                     for its type (`#[derive(Params)]`)"
                        .to_string(),
                ],
            )
        } else {
            (
                format!(
                    "field `{name}` of `{struct_name}` has type `{{Self}}`, which holds no parameters of element type `{{E}}`"
                ),
                vec![
                    elem.reason(&struct_name),
                    "one module's parameters share one element type: convert a submodule with `.to_precision::<..>()`, \
                     or mark the field `#[param(skip)]` if it is not a parameter (a rate, a config)"
                        .to_string(),
                ],
            )
        };
        checks.push(quote! {
            #[diagnostic::on_unimplemented(
                message = #message,
                label = "not a `Params` type",
                #(note = #notes),*
            )]
            trait #check<E: #krate::Precision, D: #krate::Device> {
                fn __amp_visit(&self) -> ::std::vec::Vec<(::std::string::String, &#krate::Param<E, D>)>;
                fn __amp_visit_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #krate::Param<E, D>)>;
                fn __amp_set_training(&mut self, training: bool);
                fn __amp_buffers(&self) -> ::std::vec::Vec<(::std::string::String, &#krate::Tensor<f32, D>)>;
                fn __amp_buffers_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #krate::Tensor<f32, D>)>;
            }
            // Report `f32: check` (with the message above), not the `Params` bound behind it.
            #[diagnostic::do_not_recommend]
            impl<E: #krate::Precision, D: #krate::Device, __AmpT: #krate::Params<E, D> + ?::std::marker::Sized> #check<E, D> for __AmpT {
                fn __amp_visit(&self) -> ::std::vec::Vec<(::std::string::String, &#krate::Param<E, D>)> {
                    #krate::Params::<E, D>::named_params(self)
                }
                fn __amp_visit_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #krate::Param<E, D>)> {
                    #krate::Params::<E, D>::named_params_mut(self)
                }
                fn __amp_set_training(&mut self, training: bool) {
                    #krate::Params::<E, D>::set_training(self, training)
                }
                fn __amp_buffers(&self) -> ::std::vec::Vec<(::std::string::String, &#krate::Tensor<f32, D>)> {
                    #krate::Params::<E, D>::named_buffers(self)
                }
                fn __amp_buffers_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #krate::Tensor<f32, D>)> {
                    #krate::Params::<E, D>::named_buffers_mut(self)
                }
            }
        });
        let call = quote_spanned!(ty.span()=> <#ty as #check<#e, #dev>>::__amp_visit);
        let call_mut = quote_spanned!(ty.span()=> <#ty as #check<#e, #dev>>::__amp_visit_mut);
        visit.push(quote! {
            for (__amp_name, __amp_param) in #call(&self.#member) {
                __amp_out.push((#krate::param::join_name(#name, &__amp_name), __amp_param));
            }
        });
        let call_training = quote_spanned!(ty.span()=> <#ty as #check<#e, #dev>>::__amp_set_training);
        set_training.push(quote! { #call_training(&mut self.#member, __amp_training); });
        visit_mut.push(quote! {
            for (__amp_name, __amp_param) in #call_mut(&mut self.#member) {
                __amp_out.push((#krate::param::join_name(#name, &__amp_name), __amp_param));
            }
        });
        let call_buffers = quote_spanned!(ty.span()=> <#ty as #check<#e, #dev>>::__amp_buffers);
        let call_buffers_mut = quote_spanned!(ty.span()=> <#ty as #check<#e, #dev>>::__amp_buffers_mut);
        buffers.push(quote! {
            for (__amp_name, __amp_buffer) in #call_buffers(&self.#member) {
                __amp_out.push((#krate::param::join_name(#name, &__amp_name), __amp_buffer));
            }
        });
        buffers_mut.push(quote! {
            for (__amp_name, __amp_buffer) in #call_buffers_mut(&mut self.#member) {
                __amp_out.push((#krate::param::join_name(#name, &__amp_name), __amp_buffer));
            }
        });
    }
    // A skipped field still follows train/eval when its type is a module (a `Dropout` marked
    // `skip` by habit): `param::SkippedField` picks that by the field's type.
    for member in &skipped {
        set_training.push(quote! {{
            #[allow(unused_imports)]
            use #krate::param::{SkippedModule as _, SkippedOther as _};
            (&&#krate::param::SkippedField::<_, #e, #dev>::new(&mut self.#member)).__amp_set_training(__amp_training);
        }});
    }
    // A buffer field must be an f32 tensor on the module's device; the error lands on its type.
    for (member, name, ty) in &buffer_fields {
        let as_buffer = quote_spanned!(ty.span()=> <#ty as #krate::param::IsBuffer<#dev>>::as_buffer);
        let as_buffer_mut = quote_spanned!(ty.span()=> <#ty as #krate::param::IsBuffer<#dev>>::as_buffer_mut);
        buffers.push(quote! { __amp_out.push((::std::string::String::from(#name), #as_buffer(&self.#member))); });
        buffers_mut
            .push(quote! { __amp_out.push((::std::string::String::from(#name), #as_buffer_mut(&mut self.#member))); });
    }

    Ok(quote! {
        #[doc(hidden)]
        #[allow(non_camel_case_types, non_local_definitions)]
        const _: () = {
            #(#checks)*
            #[automatically_derived]
            impl #impl_generics #krate::Params<#e, #dev> for #ident #ty_generics #where_clause {
                fn named_params(&self) -> ::std::vec::Vec<(::std::string::String, &#krate::Param<#e, #dev>)> {
                    #[allow(unused_mut)]
                    let mut __amp_out = ::std::vec::Vec::new();
                    #(#visit)*
                    __amp_out
                }
                fn named_params_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #krate::Param<#e, #dev>)> {
                    #[allow(unused_mut)]
                    let mut __amp_out = ::std::vec::Vec::new();
                    #(#visit_mut)*
                    __amp_out
                }
                fn set_training(&mut self, __amp_training: bool) {
                    #(#set_training)*
                }
                fn named_buffers(&self) -> ::std::vec::Vec<(::std::string::String, &#krate::Tensor<f32, #dev>)> {
                    #[allow(unused_mut)]
                    let mut __amp_out = ::std::vec::Vec::new();
                    #(#buffers)*
                    __amp_out
                }
                fn named_buffers_mut(&mut self) -> ::std::vec::Vec<(::std::string::String, &mut #krate::Tensor<f32, #dev>)> {
                    #[allow(unused_mut)]
                    let mut __amp_out = ::std::vec::Vec::new();
                    #(#buffers_mut)*
                    __amp_out
                }
            }
            #to_device
        };
    })
}

/// `impl ToDevice` for a struct with a type parameter `device` bounded by `Device`: the same
/// struct with `device` replaced by the target, every field whose type names `device` moved
/// and every other field (rates, configs, skipped fields) cloned.
fn to_device_impl(krate: &TokenStream, input: &DeriveInput, fields: &Fields, device: &syn::Ident) -> TokenStream {
    let ident = &input.ident;
    let target = format_ident!("__AmpD2");
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    // The struct's generic arguments with the device replaced by the target.
    let args = input.generics.params.iter().map(|p| match p {
        syn::GenericParam::Type(t) if &t.ident == device => quote!(#target),
        syn::GenericParam::Type(t) => {
            let i = &t.ident;
            quote!(#i)
        }
        syn::GenericParam::Lifetime(l) => {
            let l = &l.lifetime;
            quote!(#l)
        }
        syn::GenericParam::Const(c) => {
            let i = &c.ident;
            quote!(#i)
        }
    });
    let members: Vec<(syn::Member, &Type)> = match fields {
        Fields::Named(named) => {
            named.named.iter().map(|f| (syn::Member::Named(f.ident.clone().expect("named field")), &f.ty)).collect()
        }
        Fields::Unnamed(unnamed) => {
            unnamed.unnamed.iter().enumerate().map(|(i, f)| (syn::Member::Unnamed(i.into()), &f.ty)).collect()
        }
        Fields::Unit => Vec::new(),
    };
    let inits = members.iter().map(|(member, ty)| {
        if mentions(ty, device) {
            quote_spanned!(ty.span()=> #member: <#ty as #krate::param::ToDevice>::to_device(&self.#member, __amp_device))
        } else {
            quote_spanned!(ty.span()=> #member: ::std::clone::Clone::clone(&self.#member))
        }
    });
    quote! {
        #[automatically_derived]
        impl #impl_generics #krate::param::ToDevice for #ident #ty_generics #where_clause {
            type On<#target: #krate::Device> = #ident<#(#args),*>;
            fn to_device<#target: #krate::Device>(&self, __amp_device: &#target) -> Self::On<#target> {
                #ident { #(#inits),* }
            }
        }
    }
}

/// The refusal of an f16 parameter (`Param<f16>`, `Linear<f16>`, `#[param(precision = f16)]`).
const F16_REFUSED: &str = "f16 parameters cannot be trained: optimizers update f32 master weights (`Param`, i.e. \
     `Param<f32>`) and, for pure low-precision training, bf16 weights (`Param<bf16>`), not f16 (f16 needs loss \
     scaling, which works on f32 master weights). Keep the weight f32 and let `#[autocast]` (or `.cast::<f16>()` \
     in the forward pass) make the f16 copy at each use, with f32 gradients for the optimizer. Do not mark it \
     `#[param(skip)]`: that would freeze the weight and leave it out of checkpoints";

/// Whether `ty` names `f16` anywhere (`Param<f16>`, `Option<Param<half::f16>>`, `Linear<f16>`).
fn names_f16(ty: &Type) -> bool {
    names_ident(ty, "f16")
}

/// Whether `ty` names the identifier `name` anywhere (a token walk).
fn names_ident(ty: &Type, name: &str) -> bool {
    fn walk(ts: TokenStream, name: &str) -> bool {
        ts.into_iter().any(|tt| match tt {
            proc_macro2::TokenTree::Ident(i) => i == name,
            proc_macro2::TokenTree::Group(g) => walk(g.stream(), name),
            _ => false,
        })
    }
    walk(quote!(#ty), name)
}
