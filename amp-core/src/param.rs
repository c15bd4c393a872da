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
use crate::backend::{Cpu, Device};
use crate::error::{Error, Result, or_panic};
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A trainable tensor: master weights are `Param<f32>` (the default); pure-bf16 training uses
/// `Param<bf16>` (see [`crate::optim`]).
///
/// Cloning a `Param` makes a new parameter: the same values (shared until either is updated,
/// then copied on write) under a new id, so gradients and optimizer state of the copy are its
/// own (a frozen target network never feeds gradients back into the online one).
///
/// Like a tensor, a parameter lives on a device (`D`, the CPU by default);
/// [`Param::to_device`] and [`ToDevice`] move it.
#[derive(Debug)]
pub struct Param<E: Precision = f32, D: Device = Cpu> {
    tensor: Tensor<E, D>,
}

impl<E: Precision, D: Device> Clone for Param<E, D> {
    fn clone(&self) -> Self {
        Param { tensor: self.tensor.detach().requires_grad_() }
    }
}

impl<E: Precision, D: Device> Param<E, D> {
    /// A parameter holding `value` (detached from any graph, copied into a contiguous buffer
    /// of its own).
    pub fn new(value: Tensor<E, D>) -> Self {
        let value = crate::autograd::no_grad(|| value.detach());
        let dev = value.device().clone();
        let own = Tensor::from_storage(&dev, dev.contiguous(&value.storage, &value.layout), value.shape());
        Param { tensor: own.requires_grad_() }
    }
    /// The id gradients and optimizer state are keyed by.
    pub fn id(&self) -> TensorId {
        self.tensor.id().expect("a Param always has an autograd node")
    }
    /// The parameter as a tensor that records into the graph.
    pub fn tensor(&self) -> &Tensor<E, D> {
        &self.tensor
    }
    /// Replaces the values with `value` of the same shape, keeping the id; refuses another
    /// shape (a weight loaded by hand from a file that stores it transposed, say) and leaves
    /// the parameter as it was.
    pub fn try_set(&mut self, value: &Tensor<E, D>) -> Result<()> {
        if value.shape() != self.tensor.shape() {
            return Err(Error::Shape {
                op: "Param::set",
                detail: "the new values must have the parameter's shape".into(),
                shapes: vec![self.tensor.shape().to_vec(), value.shape().to_vec()],
            });
        }
        self.tensor.set_values(value);
        self.mark_updated();
        Ok(())
    }
    /// Replaces the values with `value` of the same shape, keeping the id.
    #[track_caller]
    pub fn set(&mut self, value: &Tensor<E, D>) {
        or_panic(self.try_set(value))
    }
    /// A new parameter (with its own id) holding these values rounded once to precision `P`
    /// (round to nearest even; exact when widening). For pure-bf16 training,
    /// `Param::to_precision::<bf16>()` makes the bf16 weight from an f32 initialisation.
    pub fn to_precision<P: Precision>(&self) -> Param<P, D> {
        Param::new(crate::autograd::no_grad(|| self.tensor.cast::<P>()))
    }
    /// A new parameter (with its own id) holding these values on `device`. As in PyTorch,
    /// move a model before building its optimizer: the optimizer binds to the parameters it
    /// first steps.
    pub fn to_device<D2: Device>(&self, device: &D2) -> Param<E, D2> {
        Param::new(self.tensor.to_device(device))
    }
    /// The values' storage, for an in-place update (copy on write if a graph still shares it).
    pub(crate) fn storage_mut(&mut self) -> &mut D::Storage<E> {
        self.mark_updated();
        self.tensor.make_exclusive();
        &mut self.tensor.storage
    }
    /// The autograd clock at this parameter's last update in place (0: never).
    pub(crate) fn updated_at(&self) -> u64 {
        self.tensor.node.as_ref().map_or(0, |n| n.updated_at.load(std::sync::atomic::Ordering::Relaxed))
    }
    /// Graphs made before now used the old values: their backward pass is refused.
    fn mark_updated(&self) {
        if let Some(node) = &self.tensor.node {
            node.mark_updated();
        }
    }
}

impl<E: Precision> Param<E, Cpu> {
    /// The values, in row-major order, read in place (a parameter is always contiguous).
    pub fn data(&self) -> &[E] {
        debug_assert!(self.tensor.layout.is_contiguous() && self.tensor.layout.offset == 0);
        &self.tensor.storage[..self.tensor.numel()]
    }
    /// The values, in place, for an update (copy on write if a graph still shares them).
    pub fn data_mut(&mut self) -> &mut [E] {
        self.mark_updated();
        self.tensor.make_mut()
    }
}

impl<E: Precision, D: Device> Deref for Param<E, D> {
    type Target = Tensor<E, D>;
    fn deref(&self) -> &Tensor<E, D> {
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
pub trait Params<E: Precision = f32, D: Device = Cpu> {
    /// Every parameter with its dotted name.
    fn named_params(&self) -> Vec<(String, &Param<E, D>)>;
    /// Every parameter with its dotted name, mutably.
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)>;
    /// Every buffer with its dotted name: state that is saved in checkpoints and moved with the
    /// module but never trained (no gradient, no optimizer state), such as batch norm's
    /// running statistics. None by default; `#[derive(Params)]` lists the fields marked
    /// `#[param(buffer)]` and every submodule's buffers.
    fn named_buffers(&self) -> Vec<(String, &Tensor<f32, D>)> {
        Vec::new()
    }
    /// Every buffer with its dotted name, mutably.
    fn named_buffers_mut(&mut self) -> Vec<(String, &mut Tensor<f32, D>)> {
        Vec::new()
    }
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

/// What a `#[param(buffer)]` field must be: an f32 tensor on the module's device.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "a `#[param(buffer)]` field must be a `Tensor<f32>` (on the module's device), not `{Self}`",
    label = "not an f32 tensor",
    note = "buffers (running statistics, counters) are kept in f32 whatever the parameters' precision, as PyTorch keeps batch norm's"
)]
pub trait IsBuffer<D: Device> {
    /// The field as a buffer.
    fn as_buffer(&self) -> &Tensor<f32, D>;
    /// The field as a buffer, mutably.
    fn as_buffer_mut(&mut self) -> &mut Tensor<f32, D>;
}

impl<D: Device> IsBuffer<D> for Tensor<f32, D> {
    fn as_buffer(&self) -> &Tensor<f32, D> {
        self
    }
    fn as_buffer_mut(&mut self) -> &mut Tensor<f32, D> {
        self
    }
}

/// How `#[derive(Params)]` passes `train()` / `eval()` on to a `#[param(skip)]` field: one whose
/// type is a module (it implements `Params<E, D>`, as `Dropout` and the pooling layers do) still
/// follows the mode, so skipping a `Dropout` field cannot leave dropout on after `eval()`;
/// anything else (a rate, a config) is left alone. The impl is picked by autoref
/// specialisation on the field's type (`(&&SkippedField::new(..)).__amp_set_training(..)`: the
/// module impl is on `&SkippedField`, the fallback on `SkippedField`), so a field of a type
/// parameter without a `Params` bound gets the fallback. Not a public API.
#[doc(hidden)]
pub struct SkippedField<'a, T: ?Sized, E, D>(std::cell::Cell<Option<&'a mut T>>, std::marker::PhantomData<(E, D)>);

impl<'a, T: ?Sized, E, D> SkippedField<'a, T, E, D> {
    /// Wraps a skipped field for one `set_training` call.
    pub fn new(field: &'a mut T) -> Self {
        SkippedField(std::cell::Cell::new(Some(field)), std::marker::PhantomData)
    }
}

/// A skipped field that is a module: it takes the mode ([`SkippedField`]).
#[doc(hidden)]
pub trait SkippedModule {
    /// Sets the field's training mode.
    fn __amp_set_training(&self, training: bool);
}

impl<T: ?Sized + Params<E, D>, E: Precision, D: Device> SkippedModule for &SkippedField<'_, T, E, D> {
    fn __amp_set_training(&self, training: bool) {
        if let Some(field) = self.0.take() {
            field.set_training(training)
        }
    }
}

/// A skipped field that is not a module: nothing to do ([`SkippedField`]).
#[doc(hidden)]
pub trait SkippedOther {
    /// Does nothing.
    fn __amp_set_training(&self, _training: bool) {}
}

impl<T: ?Sized, E, D> SkippedOther for SkippedField<'_, T, E, D> {}

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

impl<E: Precision, D: Device> Params<E, D> for Param<E, D> {
    fn named_params(&self) -> Vec<(String, &Param<E, D>)> {
        vec![(String::new(), self)]
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)> {
        vec![(String::new(), self)]
    }
}

/// Elements named by index (`0.weight`, `1.weight`), as PyTorch's `nn.ModuleList` names them;
/// `Vec<T>` and arrays `[T; N]` are these.
impl<E: Precision, D: Device, T: Params<E, D>> Params<E, D> for [T] {
    fn named_params(&self) -> Vec<(String, &Param<E, D>)> {
        self.iter().enumerate().flat_map(|(i, m)| prefixed(i.to_string(), m.named_params())).collect()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)> {
        self.iter_mut().enumerate().flat_map(|(i, m)| prefixed(i.to_string(), m.named_params_mut())).collect()
    }
    fn named_buffers(&self) -> Vec<(String, &Tensor<f32, D>)> {
        self.iter().enumerate().flat_map(|(i, m)| prefixed(i.to_string(), m.named_buffers())).collect()
    }
    fn named_buffers_mut(&mut self) -> Vec<(String, &mut Tensor<f32, D>)> {
        self.iter_mut().enumerate().flat_map(|(i, m)| prefixed(i.to_string(), m.named_buffers_mut())).collect()
    }
    fn set_training(&mut self, training: bool) {
        self.iter_mut().for_each(|m| m.set_training(training))
    }
}

/// A list of modules ([`Params`] for `[T]`).
macro_rules! params_as_slice {
    () => {
        fn named_params(&self) -> Vec<(String, &Param<E, D>)> {
            self[..].named_params()
        }
        fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)> {
            self[..].named_params_mut()
        }
        fn named_buffers(&self) -> Vec<(String, &Tensor<f32, D>)> {
            self[..].named_buffers()
        }
        fn named_buffers_mut(&mut self) -> Vec<(String, &mut Tensor<f32, D>)> {
            self[..].named_buffers_mut()
        }
        fn set_training(&mut self, training: bool) {
            self[..].set_training(training)
        }
    };
}

impl<E: Precision, D: Device, T: Params<E, D>> Params<E, D> for Vec<T> {
    params_as_slice!();
}

impl<E: Precision, D: Device, T: Params<E, D>, const N: usize> Params<E, D> for [T; N] {
    params_as_slice!();
}

impl<E: Precision, D: Device, T: Params<E, D>> Params<E, D> for Option<T> {
    fn named_params(&self) -> Vec<(String, &Param<E, D>)> {
        self.as_ref().map(|m| m.named_params()).unwrap_or_default()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)> {
        self.as_mut().map(|m| m.named_params_mut()).unwrap_or_default()
    }
    fn named_buffers(&self) -> Vec<(String, &Tensor<f32, D>)> {
        self.as_ref().map(|m| m.named_buffers()).unwrap_or_default()
    }
    fn named_buffers_mut(&mut self) -> Vec<(String, &mut Tensor<f32, D>)> {
        self.as_mut().map(|m| m.named_buffers_mut()).unwrap_or_default()
    }
    fn set_training(&mut self, training: bool) {
        if let Some(m) = self {
            m.set_training(training)
        }
    }
}

impl<E: Precision, D: Device, T: Params<E, D> + ?Sized> Params<E, D> for Box<T> {
    fn named_params(&self) -> Vec<(String, &Param<E, D>)> {
        (**self).named_params()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)> {
        (**self).named_params_mut()
    }
    fn named_buffers(&self) -> Vec<(String, &Tensor<f32, D>)> {
        (**self).named_buffers()
    }
    fn named_buffers_mut(&mut self) -> Vec<(String, &mut Tensor<f32, D>)> {
        (**self).named_buffers_mut()
    }
    fn set_training(&mut self, training: bool) {
        (**self).set_training(training)
    }
}

/// A module (or parameter) that can be rebuilt on another device: the same structure with
/// every parameter moved (new ids; build the optimizer after moving, as in PyTorch).
/// `#[derive(Params)]` implements it for a struct with a type parameter bounded by
/// [`Device`] (`struct Mlp<D: Device = Cpu> { fc1: Linear<f32, D>, .. }`): fields whose type
/// names that parameter are moved, the others (rates, configs) are cloned.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::{Cpu, Param, Tensor, param::ToDevice};
/// let w = Param::new(Tensor::<f32>::ones(&[2, 2]));
/// let moved: Param<f32, Cpu> = w.to_device(&Cpu);
/// assert_ne!(moved.id(), w.id());
/// assert_eq!(moved.to_vec(), w.to_vec());
/// ```
pub trait ToDevice {
    /// The same type on device `D2`.
    type On<D2: Device>;
    /// A copy of `self` with every parameter on `device`.
    fn to_device<D2: Device>(&self, device: &D2) -> Self::On<D2>;
}

impl<E: Precision, D: Device> ToDevice for Param<E, D> {
    type On<D2: Device> = Param<E, D2>;
    fn to_device<D2: Device>(&self, device: &D2) -> Param<E, D2> {
        Param::to_device(self, device)
    }
}

impl<E: Precision, D: Device> ToDevice for Tensor<E, D> {
    type On<D2: Device> = Tensor<E, D2>;
    fn to_device<D2: Device>(&self, device: &D2) -> Tensor<E, D2> {
        Tensor::to_device(self, device)
    }
}

impl<T: ToDevice> ToDevice for Vec<T> {
    type On<D2: Device> = Vec<T::On<D2>>;
    fn to_device<D2: Device>(&self, device: &D2) -> Self::On<D2> {
        self.iter().map(|m| m.to_device(device)).collect()
    }
}

impl<T: ToDevice> ToDevice for Option<T> {
    type On<D2: Device> = Option<T::On<D2>>;
    fn to_device<D2: Device>(&self, device: &D2) -> Self::On<D2> {
        self.as_ref().map(|m| m.to_device(device))
    }
}

impl<T: ToDevice> ToDevice for Box<T> {
    type On<D2: Device> = Box<T::On<D2>>;
    fn to_device<D2: Device>(&self, device: &D2) -> Self::On<D2> {
        Box::new((**self).to_device(device))
    }
}
