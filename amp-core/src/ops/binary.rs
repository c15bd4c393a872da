//! Elementwise binary ops with NumPy broadcasting: add, sub, mul, div (ops as values, their
//! Rust and CUDA expressions side by side), and the operators.
//! Both operands have one precision (mixing precisions does not compile); gradients are
//! summed back over broadcast dims.

use std::ops;

use crate::backend::{BinaryOp, Device};
use crate::error::{Result, or_panic};
use crate::layout::broadcast_shapes;
use crate::precision::{Accum, Precision};
use crate::tensor::Tensor;

macro_rules! binary_op {
    ($(#[$doc:meta])* $name:ident, $NAME:literal, |$a:ident, $b:ident| $f:expr, cuda: $cuda:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name;
        impl BinaryOp for $name {
            const NAME: &'static str = $NAME;
            const CUDA: &'static str = $cuda;
            #[inline(always)]
            fn apply<A: Accum>(&self, $a: A, $b: A) -> A {
                $f
            }
        }
    };
}

binary_op!(
    /// `a + b`.
    Add, "add", |a, b| a + b, cuda: "a + b"
);
binary_op!(
    /// `a - b`.
    Sub, "sub", |a, b| a - b, cuda: "a - b"
);
binary_op!(
    /// `a * b`.
    Mul, "mul", |a, b| a * b, cuda: "a * b"
);
binary_op!(
    /// `a / b`.
    Div, "div", |a, b| a / b, cuda: "a / b"
);

/// How a binary op's backward turns `(needs, g, a, b, y)` into the gradients of `a` and `b` at
/// the output's shape (the driver sums them back to each operand's shape). A gradient is computed
/// only where `needs` asks for it: the other one would be a full-size kernel pass thrown away.
type BinaryBackward<E, D> = fn(
    (bool, bool),
    &Tensor<E, D>,
    &Tensor<E, D>,
    &Tensor<E, D>,
    &Tensor<E, D>,
) -> (Option<Tensor<E, D>>, Option<Tensor<E, D>>);

impl<E: Precision, D: Device> Tensor<E, D> {
    /// `op(self, rhs)` broadcast together, with the tape.
    fn binary<O: BinaryOp>(&self, rhs: &Self, op: O, backward: BinaryBackward<E, D>) -> Result<Self> {
        let shape = broadcast_shapes(O::NAME, self.shape(), rhs.shape())?;
        let out = self.output(self.device.binary(op, self.raw(), rhs.raw(), &shape), &shape);
        if !self.requires_grad() && !rhs.requires_grad() {
            return Ok(out);
        }
        let (a, b, y) = (self.detach(), rhs.detach(), out.clone());
        let needs = (self.requires_grad(), rhs.requires_grad());
        Ok(out.record(O::NAME, vec![self.node.clone(), rhs.node.clone()], move |g| {
            let (ga, gb) = backward(needs, &g, &a, &b, &y);
            vec![ga.map(|ga| ga.sum_to_shape(a.shape()).into()), gb.map(|gb| gb.sum_to_shape(b.shape()).into())]
        }))
    }

    /// `self + rhs`, broadcasting. Derivatives: 1, 1.
    pub fn try_add(&self, rhs: &Self) -> Result<Self> {
        self.binary(rhs, Add, |n, g, _, _, _| (n.0.then(|| g.clone()), n.1.then(|| g.clone())))
    }
    /// `self - rhs`, broadcasting. Derivatives: 1, -1.
    pub fn try_sub(&self, rhs: &Self) -> Result<Self> {
        self.binary(rhs, Sub, |n, g, _, _, _| (n.0.then(|| g.clone()), n.1.then(|| g.neg())))
    }
    /// `self * rhs`, broadcasting. Derivatives: b, a.
    pub fn try_mul(&self, rhs: &Self) -> Result<Self> {
        self.binary(rhs, Mul, |n, g, a, b, _| (n.0.then(|| g.mul(b)), n.1.then(|| g.mul(a))))
    }
    /// `self / rhs`, broadcasting. Derivatives: 1/b, -y/b.
    pub fn try_div(&self, rhs: &Self) -> Result<Self> {
        self.binary(rhs, Div, |n, g, _, b, y| (n.0.then(|| g.div(b)), n.1.then(|| g.mul(y).div(b).neg())))
    }
    /// `self + rhs`, broadcasting; panics on incompatible shapes.
    #[track_caller]
    pub fn add(&self, rhs: &Self) -> Self {
        or_panic(self.try_add(rhs))
    }
    /// `self - rhs`, broadcasting; panics on incompatible shapes.
    #[track_caller]
    pub fn sub(&self, rhs: &Self) -> Self {
        or_panic(self.try_sub(rhs))
    }
    /// `self * rhs`, broadcasting; panics on incompatible shapes.
    #[track_caller]
    pub fn mul(&self, rhs: &Self) -> Self {
        or_panic(self.try_mul(rhs))
    }
    /// `self / rhs`, broadcasting; panics on incompatible shapes.
    #[track_caller]
    pub fn div(&self, rhs: &Self) -> Self {
        or_panic(self.try_div(rhs))
    }
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// `self + rhs.cast::<E>()`, broadcasting: the values and gradients of the cast then the
    /// add, in one pass where the device reads `rhs` as it is (the CPU does for an f16 or bf16
    /// `rhs` and an f32 `self`). Autocast's residual add, `x + branch(x)`, where the f32
    /// stream `x` meets a low-precision branch (PyTorch promotes inside its add kernel; here
    /// the types say which side is cast). Derivatives: `g`, and `g` cast into `rhs`'s precision.
    pub fn try_add_cast<O: Precision>(&self, rhs: &Tensor<O, D>) -> Result<Self> {
        let shape = broadcast_shapes("add_cast", self.shape(), rhs.shape())?;
        if O::DTYPE == E::DTYPE {
            return self.try_add(&rhs.cast::<E>()); // no cast to fuse (this `cast` moves)
        }
        let out = self.output(self.device.add_cast(self.raw(), rhs.raw(), &shape), &shape);
        if !self.requires_grad() && !rhs.requires_grad() {
            return Ok(out);
        }
        let needs = (self.requires_grad(), rhs.requires_grad());
        let (a_shape, b_shape) = (self.shape().to_vec(), rhs.shape().to_vec());
        Ok(out.record("add_cast", vec![self.node.clone(), rhs.node.clone()], move |g| {
            vec![
                needs.0.then(|| g.sum_to_shape(&a_shape).into()),
                needs.1.then(|| g.sum_to_shape(&b_shape).cast::<O>().into()),
            ]
        }))
    }
    /// `self + rhs.cast::<E>()`, broadcasting ([`Tensor::try_add_cast`]); panics on
    /// incompatible shapes.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// use amp::bf16;
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2]);
    /// let branch = Tensor::<f32>::from_vec(vec![0.1, 0.2], &[2]).cast::<bf16>();
    /// assert_eq!(x.add_cast(&branch).to_vec(), x.add(&branch.cast::<f32>()).to_vec());
    /// ```
    #[track_caller]
    pub fn add_cast<O: Precision>(&self, rhs: &Tensor<O, D>) -> Self {
        or_panic(self.try_add_cast(rhs))
    }
}

// Operators on owned and borrowed tensors. Only `Tensor<E, D> op Tensor<E, D>` exists: a `Tensor<f16>`
// plus a `Tensor<f32>` has no impl, so mixing precisions is a compile error.
macro_rules! tensor_operator {
    ($Trait:ident, $method:ident, $scalar:ident) => {
        impl<E: Precision, D: Device> ops::$Trait<&Tensor<E, D>> for &Tensor<E, D> {
            type Output = Tensor<E, D>;
            #[track_caller]
            fn $method(self, rhs: &Tensor<E, D>) -> Tensor<E, D> {
                Tensor::$method(self, rhs)
            }
        }
        impl<E: Precision, D: Device> ops::$Trait<Tensor<E, D>> for Tensor<E, D> {
            type Output = Tensor<E, D>;
            #[track_caller]
            fn $method(self, rhs: Tensor<E, D>) -> Tensor<E, D> {
                Tensor::$method(&self, &rhs)
            }
        }
        impl<E: Precision, D: Device> ops::$Trait<&Tensor<E, D>> for Tensor<E, D> {
            type Output = Tensor<E, D>;
            #[track_caller]
            fn $method(self, rhs: &Tensor<E, D>) -> Tensor<E, D> {
                Tensor::$method(&self, rhs)
            }
        }
        impl<E: Precision, D: Device> ops::$Trait<Tensor<E, D>> for &Tensor<E, D> {
            type Output = Tensor<E, D>;
            #[track_caller]
            fn $method(self, rhs: Tensor<E, D>) -> Tensor<E, D> {
                Tensor::$method(self, &rhs)
            }
        }
        impl<E: Precision, D: Device> ops::$Trait<f64> for &Tensor<E, D> {
            type Output = Tensor<E, D>;
            fn $method(self, rhs: f64) -> Tensor<E, D> {
                self.$scalar(rhs)
            }
        }
        impl<E: Precision, D: Device> ops::$Trait<f64> for Tensor<E, D> {
            type Output = Tensor<E, D>;
            fn $method(self, rhs: f64) -> Tensor<E, D> {
                self.$scalar(rhs)
            }
        }
    };
}

tensor_operator!(Add, add, add_scalar);
tensor_operator!(Sub, sub, sub_scalar);
tensor_operator!(Mul, mul, mul_scalar);
tensor_operator!(Div, div, div_scalar);

impl<E: Precision, D: Device> ops::Neg for &Tensor<E, D> {
    type Output = Tensor<E, D>;
    fn neg(self) -> Tensor<E, D> {
        Tensor::neg(self)
    }
}
impl<E: Precision, D: Device> ops::Neg for Tensor<E, D> {
    type Output = Tensor<E, D>;
    fn neg(self) -> Tensor<E, D> {
        Tensor::neg(&self)
    }
}
