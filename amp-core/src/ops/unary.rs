//! Elementwise unary ops: one unit struct per op implementing [`UnaryOp`] (value and
//! derivative); [`Tensor::unary`] does iteration, precision handling and the tape.

use crate::cpu;
use crate::precision::{Accum, Precision};
use crate::tensor::Tensor;

/// An elementwise function and its derivative, computed in the accumulation type.
pub trait UnaryOp: Copy + Send + Sync + 'static {
    /// The op's name (in errors and the autograd graph).
    const NAME: &'static str;
    /// `y = f(x)`.
    fn forward<A: Accum>(&self, x: A) -> A;
    /// `dy/dx`, given the input `x` and the output `y`.
    fn derivative<A: Accum>(&self, x: A, y: A) -> A;
}

impl<E: Precision> Tensor<E> {
    /// Applies a [`UnaryOp`] elementwise (f32 arithmetic for f16/bf16, one rounding).
    #[track_caller]
    pub fn unary<O: UnaryOp>(&self, op: O) -> Self {
        crate::__private::check_reach(O::NAME, E::DTYPE);
        let x = self.contiguous_data();
        let out = Self::from_parts(cpu::map_unary(&x, |v| op.forward(v)), self.shape());
        if !self.requires_grad() {
            return out;
        }
        let (xs, ys) = (self.detach(), out.clone());
        out.record(O::NAME, vec![self.node.clone()], move |g| {
            let gx = cpu::map_ternary(&xs.contiguous_data(), &ys.contiguous_data(), &g.contiguous_data(), |x, y, g| {
                g * op.derivative(x, y)
            });
            vec![Some(Tensor::from_parts(gx, xs.shape()).into())]
        })
    }
}

macro_rules! unary_op {
    ($(#[$doc:meta])* $name:ident, $method:ident, $NAME:literal, |$x:ident| $f:expr, |$dx:ident, $dy:ident| $df:expr) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name;
        impl UnaryOp for $name {
            const NAME: &'static str = $NAME;
            #[inline(always)]
            fn forward<A: Accum>(&self, $x: A) -> A {
                $f
            }
            #[inline(always)]
            #[allow(unused_variables)]
            fn derivative<A: Accum>(&self, $dx: A, $dy: A) -> A {
                $df
            }
        }
        impl<E: Precision> Tensor<E> {
            $(#[$doc])*
            #[track_caller]
            pub fn $method(&self) -> Self {
                self.unary($name)
            }
        }
    };
}

unary_op!(
    /// `-x`; derivative -1.
    Neg, neg, "neg", |x| -x, |x, y| -A::one()
);
unary_op!(
    /// `max(x, 0)` (NaN stays NaN); derivative 1 where x > 0, else 0.
    Relu, relu, "relu",
    |x| if x > A::zero() || x.is_nan() { x } else { A::zero() },
    |x, y| if x > A::zero() { A::one() } else { A::zero() }
);
unary_op!(
    /// Exact GELU, `x Φ(x) = x/2 (1 + erf(x/√2))`; derivative `Φ(x) + x φ(x)`.
    Gelu, gelu, "gelu",
    |x| A::c(0.5) * x * (A::one() + (x * A::c(std::f64::consts::FRAC_1_SQRT_2)).erf()),
    |x, y| {
        // One exponential for both: erf(x/√2) needs e^(-x²/2), which is √(2π) φ(x).
        let (erf, gauss) = (x * A::c(std::f64::consts::FRAC_1_SQRT_2)).erf_gauss();
        let cdf = A::c(0.5) * (A::one() + erf);
        let pdf = gauss * A::c(0.398_942_280_401_432_7);
        cdf + x * pdf
    }
);
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
unary_op!(
    /// GELU, tanh approximation: `x/2 (1 + tanh(√(2/π)(x + 0.044715 x³)))`.
    GeluTanh, gelu_tanh, "gelu_tanh",
    |x| A::c(0.5) * x * (A::one() + (A::c(SQRT_2_OVER_PI) * (x + A::c(0.044715) * x * x * x)).tanh()),
    |x, y| {
        let t = (A::c(SQRT_2_OVER_PI) * (x + A::c(0.044715) * x * x * x)).tanh();
        let dinner = A::c(SQRT_2_OVER_PI) * (A::one() + A::c(3.0 * 0.044715) * x * x);
        A::c(0.5) * (A::one() + t) + A::c(0.5) * x * (A::one() - t * t) * dinner
    }
);
unary_op!(
    /// `tanh(x)`; derivative `1 - y²`.
    Tanh, tanh, "tanh", |x| x.tanh(), |x, y| A::one() - y * y
);
unary_op!(
    /// `1 / (1 + e^-x)`; derivative `y (1 - y)`.
    Sigmoid, sigmoid, "sigmoid", |x| A::one() / (A::one() + (-x).vexp()), |x, y| y * (A::one() - y)
);
unary_op!(
    /// SiLU (swish), `x σ(x)`; derivative `σ(x) (1 + x (1 - σ(x)))`.
    Silu, silu, "silu",
    |x| x / (A::one() + (-x).vexp()),
    |x, y| {
        let s = A::one() / (A::one() + (-x).vexp());
        s * (A::one() + x * (A::one() - s))
    }
);
unary_op!(
    /// `e^x`; derivative `y`.
    Exp, exp, "exp", |x| x.vexp(), |x, y| y
);
unary_op!(
    /// Natural log; derivative `1/x`.
    Log, log, "log", |x| x.ln(), |x, y| A::one() / x
);
unary_op!(
    /// Square root; derivative `1 / (2y)`.
    Sqrt, sqrt, "sqrt", |x| x.sqrt(), |x, y| A::c(0.5) / y
);

/// `x^p` for a constant exponent; derivative `p x^(p-1)`.
#[derive(Clone, Copy, Debug)]
pub struct Powf(pub f64);
impl UnaryOp for Powf {
    const NAME: &'static str = "powf";
    fn forward<A: Accum>(&self, x: A) -> A {
        x.powf(A::c(self.0))
    }
    fn derivative<A: Accum>(&self, x: A, _y: A) -> A {
        A::c(self.0) * x.powf(A::c(self.0 - 1.0))
    }
}

/// `x + c` for a constant; derivative 1.
#[derive(Clone, Copy, Debug)]
pub struct AddScalar(pub f64);
impl UnaryOp for AddScalar {
    const NAME: &'static str = "add_scalar";
    fn forward<A: Accum>(&self, x: A) -> A {
        x + A::c(self.0)
    }
    fn derivative<A: Accum>(&self, _x: A, _y: A) -> A {
        A::one()
    }
}

/// `x * c` for a constant; derivative `c`.
#[derive(Clone, Copy, Debug)]
pub struct MulScalar(pub f64);
impl UnaryOp for MulScalar {
    const NAME: &'static str = "mul_scalar";
    fn forward<A: Accum>(&self, x: A) -> A {
        x * A::c(self.0)
    }
    fn derivative<A: Accum>(&self, _x: A, _y: A) -> A {
        A::c(self.0)
    }
}

/// `x / c` for a constant; derivative `1 / c`.
#[derive(Clone, Copy, Debug)]
pub struct DivScalar(pub f64);
impl UnaryOp for DivScalar {
    const NAME: &'static str = "div_scalar";
    fn forward<A: Accum>(&self, x: A) -> A {
        x / A::c(self.0)
    }
    fn derivative<A: Accum>(&self, _x: A, _y: A) -> A {
        A::one() / A::c(self.0)
    }
}

/// `c / x` for a constant; derivative `-y / x`.
#[derive(Clone, Copy, Debug)]
pub struct ScalarDiv(pub f64);
impl UnaryOp for ScalarDiv {
    const NAME: &'static str = "scalar_div";
    fn forward<A: Accum>(&self, x: A) -> A {
        A::c(self.0) / x
    }
    fn derivative<A: Accum>(&self, x: A, y: A) -> A {
        -y / x
    }
}

impl<E: Precision> Tensor<E> {
    /// `x^p` elementwise for a constant `p`.
    pub fn powf(&self, p: f64) -> Self {
        self.unary(Powf(p))
    }
    /// `x + c`.
    pub fn add_scalar(&self, c: f64) -> Self {
        self.unary(AddScalar(c))
    }
    /// `x - c`.
    pub fn sub_scalar(&self, c: f64) -> Self {
        self.unary(AddScalar(-c))
    }
    /// `x * c`.
    pub fn mul_scalar(&self, c: f64) -> Self {
        self.unary(MulScalar(c))
    }
    /// `x / c`.
    pub fn div_scalar(&self, c: f64) -> Self {
        self.unary(DivScalar(c))
    }
    /// `c / x`.
    pub fn rdiv_scalar(&self, c: f64) -> Self {
        self.unary(ScalarDiv(c))
    }
    /// `x²`.
    pub fn square(&self) -> Self {
        self.mul(self)
    }
}
