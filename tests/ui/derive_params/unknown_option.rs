// Unknown and malformed field options are refused on the offending token.
use amp::{Param, Params};

#[derive(Params)]
struct Linear {
    #[param(skp)]
    weight: Param,
    #[param(rename = "a.b")]
    bias: Param,
    #[param(skip, rename = "x")]
    scale: Param,
}

fn main() {}
