//! The crate's one error type.
//!
//! Every fallible op has a `try_` form that returns [`Error`]; the plain form panics with the
//! same message, so a panic reads exactly like the error a `try_` caller would have seen.

use crate::precision::DType;

/// Errors raised by amp-core. Each variant names the operation and the shapes, dims or
/// precisions involved, so a message alone says what went wrong and where.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- shapes -------------------------------------------------------------------------
    /// Two shapes that the op needs to broadcast together are incompatible.
    #[error("{op}: shapes {lhs:?} and {rhs:?} cannot be broadcast together")]
    Broadcast {
        /// The op that failed.
        op: &'static str,
        /// Left operand shape.
        lhs: Vec<usize>,
        /// Right operand shape.
        rhs: Vec<usize>,
    },
    /// Shapes are incompatible for a reason the message spells out.
    #[error("{op}: {detail} (shapes {shapes:?})")]
    Shape {
        /// The op that failed.
        op: &'static str,
        /// What the op expected.
        detail: String,
        /// Every shape involved, in argument order.
        shapes: Vec<Vec<usize>>,
    },
    /// A dimension index is out of range for the tensor's rank.
    #[error("{op}: dim {dim} is out of range for a tensor of rank {rank} (shape {shape:?})")]
    DimOutOfRange {
        /// The op that failed.
        op: &'static str,
        /// The requested dim.
        dim: usize,
        /// The tensor's rank.
        rank: usize,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// The number of elements supplied does not match the shape.
    #[error("{op}: {len} elements cannot fill shape {shape:?} ({expected} elements)")]
    ElementCount {
        /// The op that failed.
        op: &'static str,
        /// Elements given.
        len: usize,
        /// Elements the shape holds.
        expected: usize,
        /// The requested shape.
        shape: Vec<usize>,
    },
    /// An index (class id, token id, position) is out of range.
    #[error("{op}: index {index} at position {position} is out of range 0..{bound}")]
    IndexOutOfRange {
        /// The op that failed.
        op: &'static str,
        /// The offending index value.
        index: i64,
        /// Where it was found (flat position in the index tensor).
        position: usize,
        /// The exclusive upper bound.
        bound: usize,
    },
    /// An argument is outside its valid domain (a probability above 1, a negative eps...).
    #[error("{op}: invalid argument `{name}`: {detail}")]
    InvalidArgument {
        /// The op or constructor that refused it.
        op: &'static str,
        /// The argument's name.
        name: &'static str,
        /// Why it was refused.
        detail: String,
    },

    // ---- autograd -----------------------------------------------------------------------
    /// `backward` was called on something it cannot start from.
    #[error("backward: {detail}")]
    Backward {
        /// Why.
        detail: String,
    },
    /// A gradient had a different precision than its tensor (an internal invariant).
    #[error("{op}: expected a {expected:?} gradient, found {found:?}")]
    GradPrecision {
        /// Where the mismatch was found.
        op: &'static str,
        /// The tensor's precision.
        expected: DType,
        /// The gradient's precision.
        found: DType,
    },

    // ---- devices ------------------------------------------------------------------------
    /// The op is not available on this device (for example a CUDA build without a GPU).
    #[error("{op}: not available on device {device}: {detail}")]
    Device {
        /// The op that failed.
        op: &'static str,
        /// The device's name.
        device: String,
        /// Why.
        detail: String,
    },

    // ---- training -----------------------------------------------------------------------
    /// Training state (scaler, optimizer, checkpoint) is invalid.
    #[error("{context}: {detail}")]
    State {
        /// What was being configured or loaded.
        context: String,
        /// Why it was refused.
        detail: String,
    },
    /// An I/O error, with the path it happened on.
    #[error("{path}: {detail}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error's message.
        detail: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Unwraps a `try_` result, panicking with the error's message: the plain form of every op.
#[track_caller]
pub(crate) fn or_panic<T>(r: Result<T>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    }
}
