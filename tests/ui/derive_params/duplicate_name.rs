// Two fields may not map to the same state_dict name.
use amp::{Param, Params};

#[derive(Params)]
struct Linear {
    weight: Param,
    #[param(rename = "weight")]
    other: Param,
}

fn main() {}
