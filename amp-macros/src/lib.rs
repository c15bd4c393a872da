//! Procedural macros for amp: `#[autocast]` (see its own issue) and helper derives.

mod derive_params;

/// `#[derive(Params)]`: implements `amp_core::Params` for a struct by visiting every field, its
/// name as the prefix (`blocks.0.ln1.weight`, PyTorch's `state_dict` names). Field options:
/// `#[param(skip)]` for fields that hold no parameters (a rate, a config; required, so a
/// forgotten impl is a compile error, not a weight missing from checkpoints) and
/// `#[param(rename = "name")]`.
#[proc_macro_derive(Params, attributes(param))]
pub fn derive_params(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    derive_params::expand(syn::parse_macro_input!(input as syn::DeriveInput)).into()
}
