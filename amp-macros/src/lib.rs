//! Procedural macros for amp: `#[autocast]` (see its own issue) and helper derives.
