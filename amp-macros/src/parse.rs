//! Parsing `#[autocast(...)]`'s options.
//!
//! Grammar: a comma-separated list of
//! - a precision: `f16` (the default), `bf16`, `f32` (autocast off in effect: every op gets
//!   f32 inputs), or a type parameter of the function (`#[autocast(P)] fn f<P: Precision>`),
//!   checked against the function's generics once the item is parsed ([`resolve_low`]);
//! - a category list, `lower = [..]`, `fp32 = [..]`, `promote = [..]` (a user's own functions
//!   or methods, by name or path) or `passthrough = [..]` (table ops left alone here);
//! - `cache = true | false` (the weight cast cache; on by default);
//! - `crate = path::to::amp` (where amp is, when the caller reaches it through a re-export).
//!
//! Every problem is reported on its own token, all of them at once, with a suggestion when a
//! word is close to a known one.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Ident, LitBool, Path, Token, bracketed};

use crate::policy::Category;

/// The low type an autocast region uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LowType {
    F16,
    Bf16,
    /// Autocast off in effect: lower-precision ops run in f32 too.
    F32,
    /// A type parameter of the function (its caller picks the precision).
    Param(Ident),
    /// A word that is none of the above by itself: a type parameter if the function has one
    /// of that name ([`resolve_low`]), an error otherwise.
    Unresolved(Ident),
}

/// A user's names put in one category (`fp32 = [my_norm, Self::rescale]`).
pub(crate) struct CategoryList {
    pub(crate) category: Category,
    pub(crate) key: Ident,
    pub(crate) names: Vec<Path>,
}

/// Everything `#[autocast(...)]` said.
pub(crate) struct Options {
    pub(crate) low: LowType,
    /// Whether the attribute named the precision (a bare `#[autocast]` takes f16 by default).
    pub(crate) chosen: bool,
    pub(crate) lists: Vec<CategoryList>,
    pub(crate) cache: bool,
    /// `crate = path`: the path to the `amp` facade (a re-export of it), if given.
    pub(crate) krate: Option<Path>,
}

/// Known precisions that can be the low type.
const PRECISIONS: &[&str] = &["f16", "bf16", "f32"];
const KEYS: &[&str] = &["lower", "fp32", "promote", "passthrough", "cache", "crate"];

fn key_category(key: &str) -> Option<Category> {
    match key {
        "lower" => Some(Category::Lower),
        "fp32" => Some(Category::Fp32),
        "promote" => Some(Category::Promote),
        "passthrough" => Some(Category::Passthrough),
        _ => None,
    }
}

/// Edit distance, for "did you mean".
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push((prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The closest of `candidates` to `word`, if close enough to be a likely typo.
pub(crate) fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lower = word.to_ascii_lowercase();
    // Other libraries' spellings of the same types.
    let alias = match lower.as_str() {
        "half" | "float16" | "fp16" | "float16_t" => Some("f16"),
        "bfloat16" | "bfloat" | "brain_float" => Some("bf16"),
        _ => None,
    };
    let candidates: Vec<&'a str> = candidates.into_iter().collect();
    if let Some(a) = alias.and_then(|a| candidates.iter().find(|c| **c == a)) {
        return Some(a);
    }
    candidates
        .into_iter()
        .map(|c| (distance(&lower, c), c))
        .filter(|(d, c)| *d <= 2.max(c.len() / 3) && *d < c.len())
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn with_suggestion(msg: String, word: &str, candidates: &[&str]) -> String {
    match suggest(word, candidates.iter().copied()) {
        Some(s) => format!("{msg}; did you mean `{s}`?"),
        None => msg,
    }
}

/// One comma-separated entry, before meaning is checked.
enum Entry {
    Flag(Ident),
    List(Ident, Vec<Path>, Span),
    Bool(Ident, LitBool),
    /// `crate = path`.
    Crate(Ident, Path),
    /// `key = <something else>`: kept to report it on its own span.
    BadValue(Ident, Span, &'static str),
}

impl Parse for Entry {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let key: Ident = input.call(syn::ext::IdentExt::parse_any)?;
        if !input.peek(Token![=]) {
            return Ok(Entry::Flag(key));
        }
        input.parse::<Token![=]>()?;
        if input.peek(syn::token::Bracket) {
            let content;
            let brackets = bracketed!(content in input);
            let names = Punctuated::<Path, Token![,]>::parse_terminated(&content)?;
            return Ok(Entry::List(key, names.into_iter().collect(), brackets.span.join()));
        }
        if input.peek(LitBool) {
            return Ok(Entry::Bool(key, input.parse()?));
        }
        // Consume one expression so the rest of the list still parses, then report it.
        let value: syn::Expr = input.parse()?;
        if let (true, syn::Expr::Path(p)) = (key == "crate", &value)
            && p.qself.is_none()
        {
            return Ok(Entry::Crate(key, p.path.clone()));
        }
        let hint = if matches!(value, syn::Expr::Path(_)) {
            "expected a list in brackets, e.g. `fp32 = [my_norm]`"
        } else {
            "expected a list in brackets (`fp32 = [my_norm]`), `true`/`false` (`cache = false`) or a path \
             (`crate = my_framework::amp`)"
        };
        Ok(Entry::BadValue(key, value.span(), hint))
    }
}

/// Parses the attribute's arguments, collecting every error.
pub(crate) fn options(args: proc_macro2::TokenStream) -> Result<Options, syn::Error> {
    let entries = syn::parse::Parser::parse2(Punctuated::<Entry, Token![,]>::parse_terminated, args)?;
    let mut errors: Vec<syn::Error> = Vec::new();
    let mut low: Option<(LowType, Ident)> = None;
    let mut cache: Option<(bool, Ident)> = None;
    let mut krate: Option<Path> = None;
    let mut lists: Vec<CategoryList> = Vec::new();
    for entry in entries {
        match entry {
            Entry::Flag(id) => {
                let word = id.to_string();
                let ty = match word.as_str() {
                    "f16" => LowType::F16,
                    "bf16" => LowType::Bf16,
                    "f32" => LowType::F32,
                    "f64" => {
                        errors.push(syn::Error::new(
                            id.span(),
                            "`f64` cannot be the autocast type: autocast runs ops in `f16`, `bf16` or `f32` \
                             (`f32`: autocast off); f64 tensors are always left as they are",
                        ));
                        continue;
                    }
                    _ if KEYS.contains(&word.as_str()) => {
                        let example = match word.as_str() {
                            "cache" => "cache = false",
                            "crate" => "crate = my_framework::amp",
                            _ => "fp32 = [my_norm]",
                        };
                        errors.push(syn::Error::new(id.span(), format!("`{word}` needs a value: `{example}`")));
                        continue;
                    }
                    _ => LowType::Unresolved(id.clone()),
                };
                if let Some((_, first)) = &low {
                    errors.push(syn::Error::new(
                        id.span(),
                        format!("the autocast type is given twice (`{first}` and `{word}`): keep one"),
                    ));
                } else {
                    low = Some((ty, id));
                }
            }
            Entry::List(key, names, span) => {
                let word = key.to_string();
                let Some(category) = key_category(&word) else {
                    errors.push(if word == "crate" { crate_needs_path(span) } else { unknown_key(&key) });
                    continue;
                };
                if names.is_empty() {
                    errors.push(syn::Error::new(span, format!("`{word} = []` lists nothing: remove it")));
                }
                if let Some(prev) = lists.iter().find(|l| l.key == key) {
                    let mut e = syn::Error::new(
                        key.span(),
                        format!("duplicate `{word}`: put every name in one list, `{word} = [a, b]`"),
                    );
                    e.combine(syn::Error::new(prev.key.span(), format!("`{word}` first given here")));
                    errors.push(e);
                    continue;
                }
                lists.push(CategoryList { category, key, names });
            }
            Entry::Bool(key, value) => {
                if key != "cache" {
                    let msg = if key == "crate" {
                        crate_needs_path(value.span())
                    } else if key_category(&key.to_string()).is_some() {
                        syn::Error::new(value.span(), format!("`{key}` takes a list of names, e.g. `{key} = [my_fn]`"))
                    } else {
                        unknown_key(&key)
                    };
                    errors.push(msg);
                    continue;
                }
                if cache.is_some() {
                    errors.push(syn::Error::new(key.span(), "duplicate `cache`: keep one"));
                } else {
                    cache = Some((value.value, key));
                }
            }
            Entry::Crate(key, path) => {
                if krate.is_some() {
                    errors.push(syn::Error::new(key.span(), "duplicate `crate`: keep one"));
                } else {
                    krate = Some(path);
                }
            }
            Entry::BadValue(key, span, hint) => {
                if KEYS.contains(&key.to_string().as_str()) {
                    let hint = match key.to_string().as_str() {
                        "cache" => "expected `true` or `false`: `cache = false`",
                        "crate" => CRATE_HINT,
                        _ => hint,
                    };
                    errors.push(syn::Error::new(span, hint));
                } else {
                    errors.push(unknown_key(&key));
                }
            }
        }
    }
    if let Some(e) = errors.into_iter().reduce(|mut a, b| {
        a.combine(b);
        a
    }) {
        return Err(e);
    }
    let chosen = low.is_some();
    let cache = cache.is_none_or(|(c, _)| c);
    Ok(Options { low: low.map_or(LowType::F16, |(t, _)| t), chosen, lists, cache, krate })
}

const CRATE_HINT: &str = "expected the path to amp, as this crate reaches it: `crate = my_framework::amp`";

fn crate_needs_path(span: Span) -> syn::Error {
    syn::Error::new(span, CRATE_HINT)
}

/// Settles a precision word that is not a known type: a type parameter of `func`, or an error
/// on the word (with a suggestion when it looks like a misspelt type or option).
pub(crate) fn resolve_low(opts: &mut Options, func: &syn::ItemFn) -> Result<(), syn::Error> {
    let LowType::Unresolved(id) = &opts.low else { return Ok(()) };
    if func.sig.generics.type_params().any(|p| p.ident == *id) {
        opts.low = LowType::Param(id.clone());
        return Ok(());
    }
    Err(unknown_precision(id, func.sig.generics.type_params().map(|p| p.ident.to_string()).collect()))
}

fn unknown_precision(id: &Ident, generics: Vec<String>) -> syn::Error {
    let word = id.to_string();
    let msg = format!(
        "unknown precision `{word}`: expected `f16`, `bf16`, `f32` (autocast off), or a type parameter of this \
         function bound by `Precision`"
    );
    let mut all: Vec<&str> = PRECISIONS.iter().chain(KEYS).copied().collect();
    all.extend(generics.iter().map(String::as_str));
    syn::Error::new(id.span(), with_suggestion(msg, &word, &all))
}

/// The error for an unresolved precision when there is no function to resolve it against.
pub(crate) fn unresolved_error(opts: &Options) -> Option<syn::Error> {
    match &opts.low {
        LowType::Unresolved(id) => Some(unknown_precision(id, Vec::new())),
        _ => None,
    }
}

fn unknown_key(key: &Ident) -> syn::Error {
    let word = key.to_string();
    let msg =
        format!("unknown option `{word}`: expected one of `lower`, `fp32`, `promote`, `passthrough`, `cache`, `crate`");
    syn::Error::new(key.span(), with_suggestion(msg, &word, KEYS))
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn err(tokens: proc_macro2::TokenStream) -> String {
        match options(tokens) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect::<Vec<_>>().join(" | "),
        }
    }

    #[test]
    fn defaults_and_values() {
        let o = options(quote!()).unwrap();
        assert_eq!(o.low, LowType::F16);
        assert!(o.cache && o.lists.is_empty());
        let o = options(quote!(bf16, fp32 = [my_norm, Self::rescale], lower = [proj], cache = false)).unwrap();
        assert_eq!(o.low, LowType::Bf16);
        assert!(!o.cache);
        assert_eq!(o.lists.len(), 2);
        assert_eq!(o.lists[0].category, Category::Fp32);
        assert_eq!(o.lists[0].names.len(), 2);
    }

    #[test]
    fn crate_takes_a_path_once() {
        let o = options(quote!(bf16, crate = ::my_framework::amp)).unwrap();
        let krate = o.krate.expect("the path");
        assert_eq!(quote!(#krate).to_string(), ":: my_framework :: amp");
        assert!(options(quote!()).unwrap().krate.is_none());
        let expect = "expected the path to amp, as this crate reaches it: `crate = my_framework::amp`";
        for bad in [quote!(crate = "amp"), quote!(crate = true), quote!(crate = [amp]), quote!(crate = 1 + 1)] {
            assert_eq!(err(bad), expect);
        }
        assert_eq!(err(quote!(crate)), "`crate` needs a value: `crate = my_framework::amp`");
        assert_eq!(err(quote!(crate = a::amp, crate = b::amp)), "duplicate `crate`: keep one");
    }

    /// Options resolved against `func` (the item `#[autocast]` is on).
    fn resolved(tokens: proc_macro2::TokenStream, func: proc_macro2::TokenStream) -> Result<Options, String> {
        let mut o = options(tokens).map_err(|e| e.to_string())?;
        resolve_low(&mut o, &syn::parse2(func).unwrap()).map_err(|e| e.to_string())?;
        Ok(o)
    }

    #[test]
    fn precisions_f32_and_type_parameters() {
        let o = options(quote!(f32)).unwrap();
        assert_eq!((o.low, o.chosen), (LowType::F32, true));
        assert!(!options(quote!()).unwrap().chosen);
        let f = quote!(
            fn f<P: Precision>(x: &Tensor<f32>) {}
        );
        let o = resolved(quote!(P), f.clone()).unwrap();
        assert!(matches!(o.low, LowType::Param(ref p) if p == "P"));
        let e = resolved(quote!(Q), f).err().unwrap();
        assert_eq!(
            e,
            "unknown precision `Q`: expected `f16`, `bf16`, `f32` (autocast off), or a type parameter of this function \
             bound by `Precision`"
        );
        let e = resolved(
            quote!(fp16),
            quote!(
                fn f() {}
            ),
        )
        .err()
        .unwrap();
        assert!(e.ends_with("; did you mean `f16`?"), "{e}");
        assert!(err(quote!(f64)).contains("cannot be the autocast type"));
    }

    #[test]
    fn mistakes_get_suggestions() {
        assert!(err(quote!(f16, bf16)).contains("given twice"));
        assert!(err(quote!(fp23 = [a])).contains("did you mean `fp32`?"));
        assert!(err(quote!(fp32 = my_norm)).contains("expected a list in brackets"));
        assert!(err(quote!(fp32 = [a], fp32 = [b])).contains("duplicate `fp32`"));
        assert!(err(quote!(cache = 1)).contains("expected `true` or `false`"));
        assert!(err(quote!(cache)).contains("needs a value"));
        // Every error at once.
        assert_eq!(err(quote!(f64, lowr = [x])).matches(" | ").count(), 1);
    }
}
