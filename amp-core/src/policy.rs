//! The autocast op policy table at run time: what `#[autocast]` does with each op.
//!
//! The table is not written here: it is expanded from the one array in amp-macros that the
//! attribute itself reads (`amp_macros::__policy_table!`), so the rules the macro applies and
//! the rules printed here are one list. [`print_policy`] prints it; this is it:
//!
#![doc = amp_macros::__policy_doc!()]
//!
//! Eligible inputs are floating tensors (`Tensor<E>`, `Param<E>` and references to them);
//! anything else passes through. Casts are differentiable: a parameter's gradient comes back
//! in the parameter's own precision (f32 master gradients for f32 parameters).

use std::fmt;

use crate::precision::DType;

/// How an op treats its floating-point tensor inputs inside `#[autocast]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Category {
    /// Inputs cast to the autocast type (f16 or bf16); kernels still accumulate in f32.
    LowerPrecision,
    /// Inputs cast to f32: the op loses range or precision in 16 bits.
    Fp32,
    /// Inputs cast to f32 so a long reduction keeps f32 range and precision.
    Fp32Accumulate,
    /// Inputs cast to the widest of their precisions (`Promoted<A, B>`).
    Promote,
    /// Runs in the precision of its inputs.
    Passthrough,
}

impl Category {
    /// How the table spells it.
    pub fn label(self) -> &'static str {
        match self {
            Category::LowerPrecision => "lower precision",
            Category::Fp32 => "fp32",
            Category::Fp32Accumulate => "fp32 accumulate",
            Category::Promote => "promote",
            Category::Passthrough => "passthrough",
        }
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpPolicy {
    /// The `Tensor` method (its `try_` form follows the same row).
    pub op: &'static str,
    /// What autocast does with its inputs.
    pub category: Category,
    /// How a call looks (`x.matmul(&tensor)`), tensor arguments marked `&tensor`.
    pub call: &'static str,
    /// How many arguments after the receiver are floating tensors.
    pub tensor_args: usize,
    /// Why the op is in its category.
    pub why: &'static str,
}

/// Every op amp-core implements, with its autocast category.
pub static POLICY: &[OpPolicy] = amp_macros::__policy_table!();

/// The row for `op` (a `try_` form finds its op's row).
pub fn lookup(op: &str) -> Option<&'static OpPolicy> {
    let base = op.strip_prefix("try_").unwrap_or(op);
    POLICY.iter().find(|p| p.op == base)
}

/// The wider of two precisions, as `Promoted<A, B>` computes it at compile time (f16 with
/// bf16 meet in f32).
pub fn promote_dtype(a: DType, b: DType) -> DType {
    fn bits(d: DType) -> (u32, u32) {
        match d {
            DType::F16 => (5, 10),
            DType::BF16 => (8, 7),
            DType::F32 => (8, 23),
            DType::F64 => (11, 52),
        }
    }
    let ((ea, ma), (eb, mb)) = (bits(a), bits(b));
    if ea >= eb && ma >= mb {
        a
    } else if eb >= ea && mb >= ma {
        b
    } else {
        DType::F32
    }
}

impl OpPolicy {
    /// The precision the op runs in (and returns, for ops that return a tensor) inside an
    /// `#[autocast]` region of type `autocast`, given its floating tensor inputs' precisions
    /// (the receiver first).
    pub fn output_dtype(&self, autocast: DType, inputs: &[DType]) -> DType {
        let first = inputs.first().copied().unwrap_or(DType::F32);
        match self.category {
            Category::LowerPrecision => autocast,
            Category::Fp32 | Category::Fp32Accumulate => DType::F32,
            Category::Promote => inputs.iter().copied().reduce(promote_dtype).unwrap_or(first),
            Category::Passthrough => first,
        }
    }
}

/// The whole table, displayed as markdown.
#[derive(Clone, Copy, Debug, Default)]
pub struct PolicyTable;

impl fmt::Display for PolicyTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "| op | call | category | why |")?;
        writeln!(f, "| --- | --- | --- | --- |")?;
        for row in POLICY {
            writeln!(f, "| `{}` | `{}` | {} | {} |", row.op, row.call, row.category, row.why)?;
        }
        Ok(())
    }
}

/// Prints the op policy table (markdown) to standard output.
///
/// ```
/// # extern crate amp_core as amp;
/// amp::policy::print_policy();
/// let row = amp::policy::lookup("matmul").unwrap();
/// assert_eq!(row.category, amp::policy::Category::LowerPrecision);
/// ```
pub fn print_policy() {
    print!("{PolicyTable}");
}

/// Runs the statements as written inside an `#[autocast]` function: no casts are inserted in
/// them (tensors keep the precision they arrive with). Outside `#[autocast]` it is a plain block.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::{DType, Tensor, autocast, autocast_off, f16};
/// #[autocast]
/// fn f(x: &Tensor<f32>) -> Tensor<f16> {
///     let h = x.matmul(x); // f16
///     autocast_off! { let e = h.exp(); } // stays f16: no cast to f32 here
///     e
/// }
/// assert_eq!(f(&Tensor::ones(&[2, 2])).dtype(), DType::F16);
/// ```
#[macro_export]
macro_rules! autocast_off {
    // Statements: their bindings stay visible after the macro; the guard (which tells the
    // reach check that this code runs as written on purpose) ends with them.
    (let $($rest:tt)*) => {
        let __amp_off = $crate::__private::OffGuard::new();
        let $($rest)*
        ::core::mem::drop(__amp_off);
    };
    // One expression: its value.
    ($e:expr) => {{
        let __amp_off = $crate::__private::OffGuard::new();
        $e
    }};
    ($($body:tt)*) => {
        let __amp_off = $crate::__private::OffGuard::new();
        $($body)*
        ::core::mem::drop(__amp_off);
    };
}
