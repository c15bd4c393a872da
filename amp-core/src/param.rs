//! Parameters: named, trainable leaf tensors, and the [`Params`] trait that enumerates them.
//!
//! Design notes:
//! - A [`Param`] is a leaf tensor with a stable [`TensorId`], so the gradients from any backward
//!   pass are found by it, and optimizers keep their state by it. Updates write in place when no
//!   graph still holds the old values (copy on write otherwise).
//! - [`Params<E>`] enumerates the parameters of one element type `E`, f32 by default, so
//!   `impl Params` and `dyn Params` mean f32 master weights. A pure-bf16 model (see
//!   [`crate::optim`]) is `Params<bf16>`. One module has one element type: its parameters are
//!   listed as one `Vec<(String, &Param<E>)>`, which is what checkpoints and optimizers walk.

use std::ops::Deref;

use crate::autograd::TensorId;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A trainable tensor: master weights are `Param<f32>` (the default); pure-bf16 training uses
/// `Param<bf16>` (see [`crate::optim`]).
///
/// Cloning a `Param` makes a new parameter: the same values (shared until either is updated,
/// then copied on write) under a new id, so gradients and optimizer state of the copy are its
/// own (a frozen target network never feeds gradients back into the online one).
#[derive(Debug)]
pub struct Param<E: Precision = f32> {
    tensor: Tensor<E>,
}

impl<E: Precision> Clone for Param<E> {
    fn clone(&self) -> Self {
        Param { tensor: self.tensor.detach().requires_grad_() }
    }
}

impl<E: Precision> Param<E> {
    /// A parameter holding `value` (detached from any graph, made contiguous).
    pub fn new(value: Tensor<E>) -> Self {
        let value = crate::autograd::no_grad(|| value.detach().contiguous());
        let value = Tensor::from_parts(value.to_vec(), value.shape());
        Param { tensor: value.requires_grad_() }
    }
    /// The id gradients and optimizer state are keyed by.
    pub fn id(&self) -> TensorId {
        self.tensor.id().expect("a Param always has an autograd node")
    }
    /// The parameter as a tensor that records into the graph.
    pub fn tensor(&self) -> &Tensor<E> {
        &self.tensor
    }
    /// The values, in row-major order, read in place (a parameter is always contiguous).
    pub fn data(&self) -> &[E] {
        debug_assert!(self.tensor.layout.is_contiguous() && self.tensor.layout.offset == 0);
        &self.tensor.storage[..self.tensor.numel()]
    }
    /// The values, in place, for an update (copy on write if a graph still shares them).
    pub fn data_mut(&mut self) -> &mut [E] {
        self.tensor.make_mut()
    }
    /// Replaces the values with `value` of the same shape, keeping the id.
    #[track_caller]
    pub fn set(&mut self, value: &Tensor<E>) {
        assert_eq!(
            value.shape(),
            self.tensor.shape(),
            "Param::set: shape {:?} does not match the parameter's {:?}",
            value.shape(),
            self.tensor.shape()
        );
        let v = value.to_vec();
        self.data_mut().copy_from_slice(&v);
    }
    /// A new parameter (with its own id) holding these values rounded once to precision `P`
    /// (round to nearest even; exact when widening). For pure-bf16 training,
    /// `Param::to_precision::<bf16>()` makes the bf16 weight from an f32 initialisation.
    pub fn to_precision<P: Precision>(&self) -> Param<P> {
        Param::new(crate::autograd::no_grad(|| self.tensor.cast::<P>()))
    }
}

impl<E: Precision> Deref for Param<E> {
    type Target = Tensor<E>;
    fn deref(&self) -> &Tensor<E> {
        &self.tensor
    }
}

/// Anything that holds parameters of element type `E` (f32 unless said otherwise): enumerates
/// them with PyTorch `state_dict` names (`blocks.0.ln1.weight`), in a stable order.
///
/// `#[derive(Params)]` finds `E` from the struct (see the derive's docs): a type parameter
/// bounded by [`Precision`] (`struct Linear<W: Precision = f32>`), `bf16` named in a field's
/// type, `#[param(precision = ..)]`, or f32. Modules without parameters (dropout) implement it
/// for every `E`, so they fit in a module of any precision.
#[diagnostic::on_unimplemented(
    message = "`{Self}` holds no parameters of element type `{E}`",
    label = "not `Params<{E}>`",
    note = "`#[derive(Params)]` implements `Params` for a struct of parameters; one module's parameters share one element type (f32 master weights by default, `bf16` for pure-bf16 training)",
    note = "when stepping a model, the optimizer's element type must be the model's: `Optim::new(rule)` steps f32 parameters, `.for_bf16(Bf16Rounding::Kahan)` makes it step bf16 ones, and none steps f16 parameters (pure f16 training is not supported: keep f32 master weights and autocast to f16)"
)]
pub trait Params<E: Precision = f32> {
    /// Every parameter with its dotted name.
    fn named_params(&self) -> Vec<(String, &Param<E>)>;
    /// Every parameter with its dotted name, mutably.
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E>)>;
    /// Total number of scalar parameters.
    fn num_params(&self) -> usize {
        self.named_params().iter().map(|(_, p)| p.numel()).sum()
    }
    /// Switches training-only behaviour (dropout) on or off in this module and every
    /// submodule. Modules without such behaviour keep the default, which does nothing;
    /// `#[derive(Params)]` forwards it to every field.
    fn set_training(&mut self, _training: bool) {}
    /// Training mode: dropout active (PyTorch's `model.train()`).
    fn train(&mut self) {
        self.set_training(true)
    }
    /// Evaluation mode: dropout is the identity (PyTorch's `model.eval()`).
    fn eval(&mut self) {
        self.set_training(false)
    }
}

/// Joins a name prefix and a field name with a dot (an empty side is left out).
pub fn join_name(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (true, _) => name.to_string(),
        (_, true) => prefix.to_string(),
        _ => format!("{prefix}.{name}"),
    }
}

fn prefixed<'a, T: 'a>(prefix: String, items: Vec<(String, T)>) -> impl Iterator<Item = (String, T)> + 'a {
    items.into_iter().map(move |(n, p)| (join_name(&prefix, &n), p))
}

impl<E: Precision> Params<E> for Param<E> {
    fn named_params(&self) -> Vec<(String, &Param<E>)> {
        vec![(String::new(), self)]
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E>)> {
        vec![(String::new(), self)]
    }
}

impl<E: Precision, T: Params<E>> Params<E> for Vec<T> {
    fn named_params(&self) -> Vec<(String, &Param<E>)> {
        self.iter().enumerate().flat_map(|(i, m)| prefixed(i.to_string(), m.named_params())).collect()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E>)> {
        self.iter_mut().enumerate().flat_map(|(i, m)| prefixed(i.to_string(), m.named_params_mut())).collect()
    }
    fn set_training(&mut self, training: bool) {
        self.iter_mut().for_each(|m| m.set_training(training))
    }
}

impl<E: Precision, T: Params<E>> Params<E> for Option<T> {
    fn named_params(&self) -> Vec<(String, &Param<E>)> {
        self.as_ref().map(|m| m.named_params()).unwrap_or_default()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E>)> {
        self.as_mut().map(|m| m.named_params_mut()).unwrap_or_default()
    }
    fn set_training(&mut self, training: bool) {
        if let Some(m) = self {
            m.set_training(training)
        }
    }
}

impl<E: Precision, T: Params<E> + ?Sized> Params<E> for Box<T> {
    fn named_params(&self) -> Vec<(String, &Param<E>)> {
        (**self).named_params()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E>)> {
        (**self).named_params_mut()
    }
    fn set_training(&mut self, training: bool) {
        (**self).set_training(training)
    }
}
