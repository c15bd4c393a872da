//! Parameters: named, trainable leaf tensors, and the [`Params`] trait that enumerates them.
//!
//! Design notes: a [`Param`] is a leaf tensor with a stable [`TensorId`], so the gradients from
//! any backward pass are found by it, and optimizers keep their state by it. Updates write in
//! place when no graph still holds the old values (copy on write otherwise).

use std::ops::Deref;

use crate::autograd::TensorId;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A trainable tensor (master weights are `Param<f32>`, the default).
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
}

impl<E: Precision> Deref for Param<E> {
    type Target = Tensor<E>;
    fn deref(&self) -> &Tensor<E> {
        &self.tensor
    }
}

/// Anything that holds parameters: enumerates them with PyTorch `state_dict` names
/// (`blocks.0.ln1.weight`), in a stable order.
pub trait Params {
    /// Every parameter with its dotted name.
    fn named_params(&self) -> Vec<(String, &Param)>;
    /// Every parameter with its dotted name, mutably.
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)>;
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

impl Params for Param {
    fn named_params(&self) -> Vec<(String, &Param)> {
        vec![(String::new(), self)]
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)> {
        vec![(String::new(), self)]
    }
}

impl<T: Params> Params for Vec<T> {
    fn named_params(&self) -> Vec<(String, &Param)> {
        self.iter().enumerate().flat_map(|(i, m)| prefixed(i.to_string(), m.named_params())).collect()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)> {
        self.iter_mut().enumerate().flat_map(|(i, m)| prefixed(i.to_string(), m.named_params_mut())).collect()
    }
    fn set_training(&mut self, training: bool) {
        self.iter_mut().for_each(|m| m.set_training(training))
    }
}

impl<T: Params> Params for Option<T> {
    fn named_params(&self) -> Vec<(String, &Param)> {
        self.as_ref().map(|m| m.named_params()).unwrap_or_default()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)> {
        self.as_mut().map(|m| m.named_params_mut()).unwrap_or_default()
    }
    fn set_training(&mut self, training: bool) {
        if let Some(m) = self {
            m.set_training(training)
        }
    }
}

impl<T: Params + ?Sized> Params for Box<T> {
    fn named_params(&self) -> Vec<(String, &Param)> {
        (**self).named_params()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)> {
        (**self).named_params_mut()
    }
    fn set_training(&mut self, training: bool) {
        (**self).set_training(training)
    }
}
