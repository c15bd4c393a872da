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

// On the struct, `crate` takes the path to amp (`crate = my_framework::amp`), not a string.
#[derive(Params)]
#[param(crate = "amp")]
struct Wrapped {
    weight: Param,
}

fn main() {}
