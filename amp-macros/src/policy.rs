//! The op policy table: the one source of truth for what `#[autocast]` does with each op.
//!
//! Design notes:
//! - The table is data in this crate, read by the attribute at expansion time and expanded into
//!   amp-core by the hidden `__policy_table!` / `__policy_doc!` macros, so the table the macro
//!   applies, the table a user prints at run time and the table in the docs are one array.
//! - Each row names a `Tensor` method (its `try_` form follows the same row) and the kinds of
//!   its arguments after the receiver: the macro only treats a call as the op when the name,
//!   the argument count and the absence of a turbofish all match, so `iter.sum()`,
//!   `x.log(2.0)` on a float or `v.iter().max()` are never candidates. Argument kinds say which
//!   inputs are floating tensors, the ones a category casts.
//! - Categories follow PyTorch's autocast lists (reference/autocast_policy.md): matmul-like ops
//!   in the low type with f32 accumulation, exp/log/pow, norms and losses in f32, reductions
//!   and softmax in f32 ("fp32 accumulate": the sum of many values needs f32 range), mixed
//!   binary ops in the widest input type, everything else as its inputs are.

use proc_macro2::TokenStream;
use quote::quote;

/// How an op treats its floating-point tensor inputs inside `#[autocast]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Category {
    /// Inputs cast to the autocast type (f16 or bf16); kernels still accumulate in f32.
    Lower,
    /// Inputs cast to f32: the op loses range or precision in 16 bits.
    Fp32,
    /// Inputs cast to f32 so the result of a long reduction keeps f32 range and precision.
    Fp32Accumulate,
    /// Inputs cast to the widest of their precisions (`Promoted<A, B>`), computed by the types.
    Promote,
    /// Runs in whatever precision its inputs have.
    Passthrough,
}

impl Category {
    /// Every category, in table order.
    pub(crate) const ALL: [Category; 5] =
        [Category::Lower, Category::Fp32, Category::Fp32Accumulate, Category::Promote, Category::Passthrough];

    /// The variant's name in `amp_core::policy::Category`.
    pub(crate) fn variant(self) -> &'static str {
        match self {
            Category::Lower => "LowerPrecision",
            Category::Fp32 => "Fp32",
            Category::Fp32Accumulate => "Fp32Accumulate",
            Category::Promote => "Promote",
            Category::Passthrough => "Passthrough",
        }
    }

    /// How the docs' table spells the category.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Category::Lower => "lower precision",
            Category::Fp32 => "fp32",
            Category::Fp32Accumulate => "fp32 accumulate",
            Category::Promote => "promote",
            Category::Passthrough => "passthrough",
        }
    }

    /// What the category does to the inputs, for the docs.
    pub(crate) fn rule(self) -> &'static str {
        match self {
            Category::Lower => "floating tensor inputs cast to the autocast type (f16 or bf16)",
            Category::Fp32 | Category::Fp32Accumulate => "floating tensor inputs cast to f32",
            Category::Promote => "floating tensor inputs cast to the widest input precision",
            Category::Passthrough => "runs in the precision of its inputs",
        }
    }
}

/// One argument of an op, after the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arg {
    /// A floating tensor (`&Tensor<E>`): cast as the category says.
    T,
    /// An optional floating tensor (`Option<&Tensor<E>>`, a norm's weight): cast when present.
    OptT,
    /// A list of floating tensors (`&[&Tensor<E>]`): every element cast.
    L,
    /// Anything else (a dim, a flag, indices, a mask): left alone.
    O,
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Op {
    /// The method name on `Tensor` (the `try_` form shares the row).
    pub(crate) name: &'static str,
    pub(crate) category: Category,
    /// The arguments after the receiver (every argument, for an associated function).
    pub(crate) args: &'static [Arg],
    /// An associated function (`Tensor::cat(..)`) rather than a method.
    pub(crate) assoc: bool,
    /// Why the op is in its category, for the docs.
    pub(crate) why: &'static str,
}

use Arg::{L, O, OptT, T};
use Category::{Fp32, Fp32Accumulate, Lower, Passthrough, Promote};

const fn op(name: &'static str, category: Category, args: &'static [Arg], why: &'static str) -> Op {
    Op { name, category, args, assoc: false, why }
}

const fn assoc(name: &'static str, category: Category, args: &'static [Arg], why: &'static str) -> Op {
    Op { name, category, args, assoc: true, why }
}

/// The table. Every op method of `Tensor` is here (a unit test parses amp-core's sources to
/// keep it so, arguments included).
pub(crate) const TABLE: &[Op] = &[
    op("matmul", Lower, &[T], "tensor-core shaped: low-precision inputs, f32 accumulation in the kernel"),
    op("linear", Lower, &[T, OptT], "x Wᵀ + b: a matmul with the bias added before the single rounding"),
    op(
        "causal_attention",
        Lower,
        &[T, T],
        "two matmuls around a softmax, fused: low-precision inputs, the scores and softmax in f32 inside the kernel",
    ),
    op(
        "conv2d",
        Lower,
        &[T, OptT, O],
        "a GEMM over the input's columns (im2col): low-precision inputs, f32 accumulation and the bias in the kernel",
    ),
    // fp32: range or precision loss in 16 bits.
    op("exp", Fp32, &[], "overflows f16 above 11.1"),
    op("log", Fp32, &[], "precision near 1 and of small inputs"),
    op("sqrt", Fp32, &[], "used in norms; f32 as PyTorch's rsqrt"),
    op("powf", Fp32, &[O], "overflows and underflows in 16 bits"),
    op("layer_norm", Fp32, &[OptT, OptT, O], "mean and variance of many values"),
    op("layer_norm_to", Fp32, &[OptT, OptT, O], "layer_norm with the cast of its output inside"),
    op("rms_norm", Fp32, &[OptT, O], "mean of squares of many values"),
    op("cross_entropy", Fp32, &[O], "log-sum-exp and the loss in f32: the loss is always f32"),
    op("cross_entropy_with", Fp32, &[O, O], "as cross_entropy, with options"),
    op("mse_loss", Fp32, &[T], "squares overflow f16; the loss is always f32"),
    // fp32 accumulate: reductions.
    op("softmax", Fp32Accumulate, &[O], "exp and a sum over a dim"),
    op("log_softmax", Fp32Accumulate, &[O], "log-sum-exp over a dim"),
    op("softmax_f32", Fp32Accumulate, &[O], "softmax with the cast to f32 inside; its output is f32 anyway"),
    op("log_softmax_f32", Fp32Accumulate, &[O], "log_softmax with the cast to f32 inside; its output is f32 anyway"),
    op(
        "scaled_masked_softmax",
        Fp32Accumulate,
        &[O, O],
        "attention's scale, mask and softmax, fused; the softmax of many scores needs f32",
    ),
    op("sum", Fp32Accumulate, &[O, O], "a sum of many values needs f32 range"),
    op("mean", Fp32Accumulate, &[O, O], "a sum of many values needs f32 range"),
    op("sum_all", Fp32Accumulate, &[], "a sum of every value needs f32 range"),
    op("mean_all", Fp32Accumulate, &[], "a sum of every value needs f32 range"),
    // promote: mixed precisions meet.
    op("add", Promote, &[T], "mixed inputs meet in the wider type (also `a + b`)"),
    op("sub", Promote, &[T], "mixed inputs meet in the wider type (also `a - b`)"),
    op("mul", Promote, &[T], "mixed inputs meet in the wider type (also `a * b`)"),
    op("div", Promote, &[T], "mixed inputs meet in the wider type (also `a / b`)"),
    assoc("where_cond", Promote, &[O, T, T], "both branches in the wider type"),
    assoc("cat", Promote, &[L, O], "every listed tensor in the widest listed type"),
    assoc("stack", Promote, &[L, O], "every listed tensor in the widest listed type"),
    // passthrough: exact or harmless in the input's precision.
    op("neg", Passthrough, &[], "exact"),
    op("relu", Passthrough, &[], "exact"),
    op("gelu", Passthrough, &[], "bounded; computed in f32 inside the kernel"),
    op("gelu_tanh", Passthrough, &[], "bounded; computed in f32 inside the kernel"),
    op("tanh", Passthrough, &[], "bounded"),
    op("sigmoid", Passthrough, &[], "bounded"),
    op("silu", Passthrough, &[], "computed in f32 inside the kernel"),
    op("square", Passthrough, &[], "elementwise, computed in f32 inside the kernel"),
    op("add_cast", Passthrough, &[T], "the argument is cast into the receiver's precision inside, as written"),
    op("add_scalar", Passthrough, &[O], "elementwise"),
    op("sub_scalar", Passthrough, &[O], "elementwise"),
    op("mul_scalar", Passthrough, &[O], "elementwise"),
    op("div_scalar", Passthrough, &[O], "elementwise"),
    op("rdiv_scalar", Passthrough, &[O], "elementwise"),
    op("dropout", Passthrough, &[O, O, O], "a mask and a scale"),
    op(
        "batch_norm",
        Passthrough,
        &[OptT, OptT, OptT, OptT, O],
        "on no autocast list of PyTorch's (unlike layer_norm): runs in the input's precision, as cuDNN's does, with \
         its statistics in f32 inside the kernel, and the weight, bias and running buffers f32",
    ),
    op("max_pool2d", Passthrough, &[O, O, O], "a selection, exact"),
    op("avg_pool2d", Passthrough, &[O, O, O], "a short window's mean, summed in f32 inside the kernel"),
    op("adaptive_avg_pool2d", Passthrough, &[O], "a window's mean, summed in f32 inside the kernel"),
    op("embedding", Passthrough, &[O], "a gather: rows come out in the table's precision"),
    op("masked_fill", Passthrough, &[O, O], "a select"),
    op("max", Passthrough, &[O, O], "a selection, exact"),
    op("min", Passthrough, &[O, O], "a selection, exact"),
    op("argmax", Passthrough, &[O, O], "indices"),
    op("argmin", Passthrough, &[O, O], "indices"),
    op("reshape", Passthrough, &[O], "a view"),
    op("flatten", Passthrough, &[], "a view"),
    op("flatten_dims", Passthrough, &[O, O], "a view"),
    op("permute", Passthrough, &[O], "a view"),
    op("transpose", Passthrough, &[O, O], "a view"),
    op("t", Passthrough, &[], "a view"),
    op("narrow", Passthrough, &[O, O, O], "a view"),
    op("slice", Passthrough, &[O, O], "a view"),
    op("unsqueeze", Passthrough, &[O], "a view"),
    op("squeeze", Passthrough, &[O], "a view"),
    op("broadcast_to", Passthrough, &[O], "a view"),
    op("contiguous", Passthrough, &[], "a copy"),
];

/// The row for `name` (or its `try_` form).
pub(crate) fn lookup(name: &str) -> Option<&'static Op> {
    let base = name.strip_prefix("try_").unwrap_or(name);
    TABLE.iter().find(|op| op.name == base)
}

/// Every row.
pub(crate) fn rows() -> impl Iterator<Item = &'static Op> {
    TABLE.iter()
}

/// How a row's call looks, for the docs: `x.matmul(&tensor)`, `Tensor::cat(&[&tensor, ..], _)`.
pub(crate) fn signature(op: &Op) -> String {
    let args: Vec<&str> = op
        .args
        .iter()
        .map(|a| match a {
            Arg::T => "&tensor",
            Arg::OptT => "Some(&tensor)",
            Arg::L => "&[&tensor, ..]",
            Arg::O => "_",
        })
        .collect();
    if op.assoc {
        format!("Tensor::{}({})", op.name, args.join(", "))
    } else {
        format!("x.{}({})", op.name, args.join(", "))
    }
}

/// The rows as `amp_core::policy::OpPolicy` values (the body of `__policy_table!()`).
pub(crate) fn table_tokens() -> TokenStream {
    let rows = rows().map(|op| {
        let name = op.name;
        let variant = syn::Ident::new(op.category.variant(), proc_macro2::Span::call_site());
        let sig = signature(op);
        let why = op.why;
        let tensor_args = op.args.iter().filter(|a| **a != Arg::O).count();
        quote! {
            crate::policy::OpPolicy {
                op: #name,
                category: crate::policy::Category::#variant,
                call: #sig,
                tensor_args: #tensor_args,
                why: #why,
            }
        }
    });
    quote! { &[ #(#rows),* ] }
}

/// The table as markdown, for rustdoc (the body of `__policy_doc!()`).
pub(crate) fn markdown() -> String {
    let mut s = String::from("| category | rule | ops |\n| --- | --- | --- |\n");
    for cat in Category::ALL {
        let ops: Vec<String> = rows().filter(|o| o.category == cat).map(|o| format!("`{}`", o.name)).collect();
        s.push_str(&format!("| {} | {} | {} |\n", cat.label(), cat.rule(), ops.join(", ")));
    }
    s.push_str("\nPer op:\n\n| op | call | category | why |\n| --- | --- | --- | --- |\n");
    for op in rows() {
        s.push_str(&format!("| `{}` | `{}` | {} | {} |\n", op.name, signature(op), op.category.label(), op.why));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::{Path, PathBuf};

    /// Methods of `Tensor` that are not ops on tensor values: constructors, accessors,
    /// conversions and autograd entry points. Anything else must have a row.
    const NOT_OPS: &[(&str, &str)] = &[
        ("shape", "accessor"),
        ("rank", "accessor"),
        ("numel", "accessor"),
        ("layout", "accessor"),
        ("device", "accessor"),
        ("dtype", "accessor"),
        ("requires_grad", "accessor"),
        ("id", "accessor"),
        ("detach", "cuts the graph, keeps the precision"),
        ("requires_grad_", "marks a leaf"),
        ("to_vec", "reads values out"),
        ("to_f64_vec", "reads values out"),
        ("to_f32_vec", "reads values out"),
        ("item", "reads a value out"),
        ("make_mut", "in-place access: never autocast, as in PyTorch"),
        ("backward", "autograd entry point"),
        ("backward_with_seed", "autograd entry point"),
        ("cast", "the explicit cast the macro itself inserts"),
        ("cast_into", "writes into an existing buffer, outside autograd: never autocast"),
        ("unary", "generic driver behind the unary ops"),
        ("to_device", "moves values to another device, outside autograd: never autocast"),
    ];

    #[derive(Debug, PartialEq)]
    struct Found {
        args: Vec<Arg>,
        assoc: bool,
        file: String,
    }

    fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                rs_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// `Tensor`, `Self`, or a type parameter in `like` (one bounded by `LinearOperand`, which
    /// takes a tensor or a parameter), behind any references.
    fn is_tensor_ty(ty: &syn::Type, like: &[String]) -> bool {
        match ty {
            syn::Type::Reference(r) => is_tensor_ty(&r.elem, like),
            syn::Type::Path(p) => p.path.segments.last().is_some_and(|s| {
                s.ident == "Self" || s.ident == "Tensor" || like.iter().any(|l| s.ident == l.as_str())
            }),
            _ => false,
        }
    }

    fn opt_tensor(ty: &syn::Type, like: &[String]) -> bool {
        let syn::Type::Path(p) = ty else { return false };
        let Some(seg) = p.path.segments.last() else { return false };
        let syn::PathArguments::AngleBracketed(a) = &seg.arguments else { return false };
        seg.ident == "Option" && matches!(a.args.first(), Some(syn::GenericArgument::Type(t)) if is_tensor_ty(t, like))
    }

    fn list_of_tensors(ty: &syn::Type, like: &[String]) -> bool {
        match ty {
            syn::Type::Reference(r) => list_of_tensors(&r.elem, like),
            syn::Type::Slice(s) => is_tensor_ty(&s.elem, like),
            _ => false,
        }
    }

    /// Every `pub fn` in an `impl ... Tensor<..>` block of amp-core, with its argument kinds,
    /// and the methods the `unary_op!` macro generates.
    fn tensor_methods() -> BTreeMap<String, Found> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../amp-core/src");
        let mut files = Vec::new();
        rs_files(&src, &mut files);
        let mut out = BTreeMap::new();
        for path in files {
            let text = std::fs::read_to_string(&path).unwrap();
            let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let short = path.strip_prefix(&src).unwrap().display().to_string();
            for item in &file.items {
                match item {
                    syn::Item::Impl(imp) if imp.trait_.is_none() => {
                        let syn::Type::Path(ty) = &*imp.self_ty else { continue };
                        if ty.path.segments.last().is_none_or(|s| s.ident != "Tensor") {
                            continue;
                        }
                        for it in &imp.items {
                            let syn::ImplItem::Fn(f) = it else { continue };
                            if !matches!(f.vis, syn::Visibility::Public(_)) {
                                continue;
                            }
                            let has_self = f.sig.receiver().is_some();
                            let like: Vec<String> = f
                                .sig
                                .generics
                                .type_params()
                                .filter(|tp| {
                                    tp.bounds.iter().any(|b| {
                                        matches!(b, syn::TypeParamBound::Trait(t)
                                            if t.path.segments.last().is_some_and(|s| s.ident == "LinearOperand"))
                                    })
                                })
                                .map(|tp| tp.ident.to_string())
                                .collect();
                            let mut args = Vec::new();
                            let mut takes_tensor = false;
                            for input in &f.sig.inputs {
                                let syn::FnArg::Typed(pt) = input else { continue };
                                let kind = if list_of_tensors(&pt.ty, &like) {
                                    Arg::L
                                } else if opt_tensor(&pt.ty, &like) {
                                    Arg::OptT
                                } else if is_tensor_ty(&pt.ty, &like) {
                                    Arg::T
                                } else {
                                    Arg::O
                                };
                                takes_tensor |= kind != Arg::O;
                                args.push(kind);
                            }
                            // Constructors (no receiver, no tensor argument) are not ops.
                            if has_self || takes_tensor {
                                out.insert(
                                    f.sig.ident.to_string(),
                                    Found { args, assoc: !has_self, file: short.clone() },
                                );
                            }
                        }
                    }
                    syn::Item::Macro(m) if m.mac.path.is_ident("unary_op") => {
                        // unary_op!(/// docs, Name, method, "name", forward, derivative)
                        let tokens: Vec<proc_macro2::TokenTree> = m.mac.tokens.clone().into_iter().collect();
                        let idents: Vec<String> = tokens
                            .iter()
                            .filter_map(|t| match t {
                                proc_macro2::TokenTree::Ident(i) => Some(i.to_string()),
                                _ => None,
                            })
                            .collect();
                        // The first two idents after the doc attribute are the struct and the method.
                        let method = idents.get(1).expect("unary_op! names a method").clone();
                        out.insert(method, Found { args: vec![], assoc: false, file: short.clone() });
                    }
                    _ => {}
                }
            }
        }
        out
    }

    #[test]
    fn table_covers_every_tensor_op_with_matching_arguments() {
        let methods = tensor_methods();
        assert!(methods.contains_key("matmul") && methods.contains_key("exp"), "the source scan found the ops");
        let not_ops: BTreeSet<&str> = NOT_OPS.iter().map(|(n, _)| *n).collect();
        let mut missing = Vec::new();
        for (name, found) in &methods {
            let base = name.strip_prefix("try_").unwrap_or(name);
            if not_ops.contains(base) {
                continue;
            }
            match rows().find(|o| o.name == base) {
                None => missing.push(format!("{name} ({})", found.file)),
                Some(op) => {
                    assert_eq!(
                        op.args,
                        &found.args[..],
                        "`{name}` in {}: the table's argument kinds differ from the signature",
                        found.file
                    );
                    assert_eq!(op.assoc, found.assoc, "`{name}`: method or associated function");
                }
            }
        }
        assert!(missing.is_empty(), "ops with no row in the autocast policy table: {missing:?}");
        for op in rows() {
            assert!(
                methods.contains_key(op.name) || methods.contains_key(&format!("try_{}", op.name)),
                "table row `{}` names no Tensor method",
                op.name
            );
        }
    }

    #[test]
    fn names_are_unique_and_docs_list_every_row() {
        let mut seen = BTreeSet::new();
        for op in rows() {
            assert!(seen.insert(op.name), "duplicate row {}", op.name);
        }
        let md = markdown();
        for op in rows() {
            assert!(md.contains(&format!("`{}`", op.name)));
        }
        assert_eq!(lookup("try_matmul").unwrap().name, "matmul");
        assert!(lookup("frobnicate").is_none());
    }
}
