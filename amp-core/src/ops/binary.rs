//! Elementwise binary ops with NumPy broadcasting: add, sub, mul, div, and the operators.
//! Both operands have one precision (mixing precisions does not compile); gradients are
//! summed back over broadcast dims.

use std::ops;

use crate::cpu;
use crate::error::{Result, or_panic};
use crate::layout::broadcast_shapes;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// How a binary op's backward turns `(needs, g, a, b, y)` into the gradients of `a` and `b` at
/// the output's shape (the driver sums them back to each operand's shape). A gradient is computed
/// only where `needs` asks for it: the other one would be a full-size kernel pass thrown away.
type BinaryBackward<E> =
    fn((bool, bool), &Tensor<E>, &Tensor<E>, &Tensor<E>, &Tensor<E>) -> (Option<Tensor<E>>, Option<Tensor<E>>);

impl<E: Precision> Tensor<E> {
    fn binary(
        &self,
        rhs: &Self,
        op: &'static str,
        f: impl Fn(E::Acc, E::Acc) -> E::Acc + Sync + Send,
        backward: BinaryBackward<E>,
    ) -> Result<Self> {
        let shape = broadcast_shapes(op, self.shape(), rhs.shape())?;
        let data = cpu::map_binary(&self.storage, &self.layout, &rhs.storage, &rhs.layout, &shape, f);
        let out = Self::from_parts(data, &shape);
        if !self.requires_grad() && !rhs.requires_grad() {
            return Ok(out);
        }
        let (a, b, y) = (self.detach(), rhs.detach(), out.clone());
        let needs = (self.requires_grad(), rhs.requires_grad());
        Ok(out.record(op, vec![self.node.clone(), rhs.node.clone()], move |g| {
            let (ga, gb) = backward(needs, &g, &a, &b, &y);
            vec![ga.map(|ga| ga.sum_to_shape(a.shape()).into()), gb.map(|gb| gb.sum_to_shape(b.shape()).into())]
        }))
    }

    /// `self + rhs`, broadcasting. Derivatives: 1, 1.
    pub fn try_add(&self, rhs: &Self) -> Result<Self> {
        self.binary(rhs, "add", |a, b| a + b, |n, g, _, _, _| (n.0.then(|| g.clone()), n.1.then(|| g.clone())))
    }
    /// `self - rhs`, broadcasting. Derivatives: 1, -1.
    pub fn try_sub(&self, rhs: &Self) -> Result<Self> {
        self.binary(rhs, "sub", |a, b| a - b, |n, g, _, _, _| (n.0.then(|| g.clone()), n.1.then(|| g.neg())))
    }
    /// `self * rhs`, broadcasting. Derivatives: b, a.
    pub fn try_mul(&self, rhs: &Self) -> Result<Self> {
        self.binary(rhs, "mul", |a, b| a * b, |n, g, a, b, _| (n.0.then(|| g.mul(b)), n.1.then(|| g.mul(a))))
    }
    /// `self / rhs`, broadcasting. Derivatives: 1/b, -y/b.
    pub fn try_div(&self, rhs: &Self) -> Result<Self> {
        self.binary(
            rhs,
            "div",
            |a, b| a / b,
            |n, g, _, b, y| (n.0.then(|| g.div(b)), n.1.then(|| g.mul(y).div(b).neg())),
        )
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

// Operators on owned and borrowed tensors. Only `Tensor<E> op Tensor<E>` exists: a `Tensor<f16>`
// plus a `Tensor<f32>` has no impl, so mixing precisions is a compile error.
macro_rules! tensor_operator {
    ($Trait:ident, $method:ident, $scalar:ident) => {
        impl<E: Precision> ops::$Trait<&Tensor<E>> for &Tensor<E> {
            type Output = Tensor<E>;
            #[track_caller]
            fn $method(self, rhs: &Tensor<E>) -> Tensor<E> {
                Tensor::$method(self, rhs)
            }
        }
        impl<E: Precision> ops::$Trait<Tensor<E>> for Tensor<E> {
            type Output = Tensor<E>;
            #[track_caller]
            fn $method(self, rhs: Tensor<E>) -> Tensor<E> {
                Tensor::$method(&self, &rhs)
            }
        }
        impl<E: Precision> ops::$Trait<&Tensor<E>> for Tensor<E> {
            type Output = Tensor<E>;
            #[track_caller]
            fn $method(self, rhs: &Tensor<E>) -> Tensor<E> {
                Tensor::$method(&self, rhs)
            }
        }
        impl<E: Precision> ops::$Trait<Tensor<E>> for &Tensor<E> {
            type Output = Tensor<E>;
            #[track_caller]
            fn $method(self, rhs: Tensor<E>) -> Tensor<E> {
                Tensor::$method(self, &rhs)
            }
        }
        impl<E: Precision> ops::$Trait<f64> for &Tensor<E> {
            type Output = Tensor<E>;
            fn $method(self, rhs: f64) -> Tensor<E> {
                self.$scalar(rhs)
            }
        }
        impl<E: Precision> ops::$Trait<f64> for Tensor<E> {
            type Output = Tensor<E>;
            fn $method(self, rhs: f64) -> Tensor<E> {
                self.$scalar(rhs)
            }
        }
    };
}

tensor_operator!(Add, add, add_scalar);
tensor_operator!(Sub, sub, sub_scalar);
tensor_operator!(Mul, mul, mul_scalar);
tensor_operator!(Div, div, div_scalar);

impl<E: Precision> ops::Neg for &Tensor<E> {
    type Output = Tensor<E>;
    fn neg(self) -> Tensor<E> {
        Tensor::neg(self)
    }
}
impl<E: Precision> ops::Neg for Tensor<E> {
    type Output = Tensor<E>;
    fn neg(self) -> Tensor<E> {
        Tensor::neg(&self)
    }
}
