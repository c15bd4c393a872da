//! Elementwise unary ops as values: one unit struct per op implementing
//! [`UnaryOp`], its Rust expression (the CPU's, in the accumulation
//! type) and its CUDA C expression side by side; [`Tensor::unary`] does iteration on the
//! device, precision handling and the tape.

use crate::backend::Device;
pub use crate::backend::UnaryOp;
use crate::precision::{Accum, Precision};
use crate::tensor::Tensor;

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Applies a [`UnaryOp`] elementwise (f32 arithmetic for f16/bf16, one rounding).
    #[track_caller]
    pub fn unary<O: UnaryOp>(&self, op: O) -> Self {
        crate::__private::check_reach(O::NAME, E::DTYPE);
        let out = self.output(self.device.unary(op, &self.storage, &self.layout), self.shape());
        if !self.requires_grad() {
            return out;
        }
        let (xs, ys) = (self.detach(), out.clone());
        out.record(O::NAME, vec![self.node.clone()], move |g| {
            let gx = xs.device.unary_backward(op, xs.raw(), ys.raw(), g.raw());
            vec![Some(xs.output(gx, xs.shape()).into())]
        })
    }
}

// The derivative's parameters are written `x` / `y` when it reads them and `_` when it does
// not; that sets `DERIVATIVE_READS_X` / `_Y`, so the flags cannot disagree with the expression
// (an `_` cannot be read).
macro_rules! unary_op {
    (@reads _) => { false };
    (@reads $v:ident) => { true };
    (
        $(#[$doc:meta])* $name:ident, $method:ident, $NAME:literal,
        |$x:ident| $f:expr, |$dx:tt, $dy:tt| $df:expr,
        cuda: $cuda_f:literal, $cuda_df:literal,
        tabulate: $tabulate:literal
    ) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name;
        impl UnaryOp for $name {
            const NAME: &'static str = $NAME;
            const CUDA_FORWARD: &'static str = $cuda_f;
            const CUDA_DERIVATIVE: &'static str = $cuda_df;
            const DERIVATIVE_READS_X: bool = unary_op!(@reads $dx);
            const DERIVATIVE_READS_Y: bool = unary_op!(@reads $dy);
            const TABULATE: bool = $tabulate;
            #[inline(always)]
            fn forward<A: Accum>(&self, $x: A) -> A {
                $f
            }
            #[inline(always)]
            fn derivative<A: Accum>(&self, $dx: A, $dy: A) -> A {
                $df
            }
        }
        impl<E: Precision, D: Device> Tensor<E, D> {
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
    Neg, neg, "neg", |x| -x, |_, _| -A::one(),
    cuda: "-x",
    "acc_t(-1)",
    tabulate: false
);
unary_op!(
    /// `max(x, 0)` (NaN stays NaN); derivative 1 where x > 0, else 0.
    Relu, relu, "relu",
    |x| if x > A::zero() || x.is_nan() { x } else { A::zero() },
    |x, _| if x > A::zero() { A::one() } else { A::zero() },
    cuda: "(x > acc_t(0) || isnan(x)) ? x : acc_t(0)",
    "x > acc_t(0) ? acc_t(1) : acc_t(0)",
    tabulate: false
);
unary_op!(
    /// Exact GELU, `x Φ(x) = x/2 (1 + erf(x/√2))`; derivative `Φ(x) + x φ(x)`.
    Gelu, gelu, "gelu",
    |x| A::c(0.5) * x * (A::one() + (x * A::c(std::f64::consts::FRAC_1_SQRT_2)).erf()),
    |x, _| {
        // One exponential for both: erf(x/√2) needs e^(-x²/2), which is √(2π) φ(x).
        let (erf, gauss) = (x * A::c(std::f64::consts::FRAC_1_SQRT_2)).erf_gauss();
        let cdf = A::c(0.5) * (A::one() + erf);
        let pdf = gauss * A::c(0.398_942_280_401_432_7);
        cdf + x * pdf
    },
    cuda: "acc_t(0.5) * x * (acc_t(1) + erf(x * acc_t(0.7071067811865476)))",
    "acc_t(0.5) * (acc_t(1) + erf(x * acc_t(0.7071067811865476))) + x * exp(acc_t(-0.5) * x * x) * acc_t(0.3989422804014327)",
    tabulate: true
);
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
unary_op!(
    /// GELU, tanh approximation: `x/2 (1 + tanh(√(2/π)(x + 0.044715 x³)))`.
    GeluTanh, gelu_tanh, "gelu_tanh",
    |x| A::c(0.5) * x * (A::one() + (A::c(SQRT_2_OVER_PI) * (x + A::c(0.044715) * x * x * x)).vtanh()),
    |x, _| {
        let t = (A::c(SQRT_2_OVER_PI) * (x + A::c(0.044715) * x * x * x)).vtanh();
        let dinner = A::c(SQRT_2_OVER_PI) * (A::one() + A::c(3.0 * 0.044715) * x * x);
        A::c(0.5) * (A::one() + t) + A::c(0.5) * x * (A::one() - t * t) * dinner
    },
    cuda: "acc_t(0.5) * x * (acc_t(1) + tanh(acc_t(0.7978845608028654) * (x + acc_t(0.044715) * x * x * x)))",
    "acc_t(0.5) * (acc_t(1) + tanh(acc_t(0.7978845608028654) * (x + acc_t(0.044715) * x * x * x))) + acc_t(0.5) * x * (acc_t(1) - tanh(acc_t(0.7978845608028654) * (x + acc_t(0.044715) * x * x * x)) * tanh(acc_t(0.7978845608028654) * (x + acc_t(0.044715) * x * x * x))) * acc_t(0.7978845608028654) * (acc_t(1) + acc_t(0.134145) * x * x)",
    tabulate: true
);
unary_op!(
    /// `x²`; derivative `2x`.
    Square, square, "square", |x| x * x, |x, _| A::c(2.0) * x,
    cuda: "x * x",
    "acc_t(2) * x",
    tabulate: false
);
unary_op!(
    /// `tanh(x)`; derivative `1 - y²`.
    Tanh, tanh, "tanh", |x| x.vtanh(), |_, y| A::one() - y * y,
    cuda: "tanh(x)",
    "acc_t(1) - y * y",
    tabulate: true
);
unary_op!(
    /// `1 / (1 + e^-x)`; derivative `y (1 - y)`.
    Sigmoid, sigmoid, "sigmoid", |x| A::one() / (A::one() + (-x).vexp()), |_, y| y * (A::one() - y),
    cuda: "acc_t(1) / (acc_t(1) + exp(-x))",
    "y * (acc_t(1) - y)",
    tabulate: true
);
unary_op!(
    /// SiLU (swish), `x σ(x)`; derivative `σ(x) (1 + x (1 - σ(x)))`.
    Silu, silu, "silu",
    |x| x / (A::one() + (-x).vexp()),
    |x, _| {
        let s = A::one() / (A::one() + (-x).vexp());
        s * (A::one() + x * (A::one() - s))
    },
    cuda: "x / (acc_t(1) + exp(-x))",
    "(acc_t(1) / (acc_t(1) + exp(-x))) * (acc_t(1) + x * (acc_t(1) - acc_t(1) / (acc_t(1) + exp(-x))))",
    tabulate: true
);
unary_op!(
    /// `e^x`; derivative `y`.
    Exp, exp, "exp", |x| x.vexp(), |_, y| y,
    cuda: "exp(x)",
    "y",
    tabulate: true
);
unary_op!(
    /// Natural log; derivative `1/x`.
    Log, log, "log", |x| x.vln(), |x, _| A::one() / x,
    cuda: "log(x)",
    "acc_t(1) / x",
    tabulate: true
);
unary_op!(
    /// Square root; derivative `1 / (2y)`.
    Sqrt, sqrt, "sqrt", |x| x.sqrt(), |_, y| A::c(0.5) / y,
    cuda: "sqrt(x)",
    "acc_t(0.5) / y",
    tabulate: false
);

/// `x^p` for a constant exponent; derivative `p x^(p-1)`.
#[derive(Clone, Copy, Debug)]
pub struct Powf(pub f64);
impl UnaryOp for Powf {
    const NAME: &'static str = "powf";
    const DERIVATIVE_READS_Y: bool = false;
    // A libm `powf` per element otherwise.
    const TABULATE: bool = true;
    const CUDA_FORWARD: &'static str = "pow(x, acc_t(p))";
    const CUDA_DERIVATIVE: &'static str = "acc_t(p) * pow(x, acc_t(p) - acc_t(1))";
    fn param(&self) -> f64 {
        self.0
    }
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
    const DERIVATIVE_READS_X: bool = false;
    const DERIVATIVE_READS_Y: bool = false;
    const CUDA_FORWARD: &'static str = "x + acc_t(p)";
    const CUDA_DERIVATIVE: &'static str = "acc_t(1)";
    fn param(&self) -> f64 {
        self.0
    }
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
    const DERIVATIVE_READS_X: bool = false;
    const DERIVATIVE_READS_Y: bool = false;
    const CUDA_FORWARD: &'static str = "x * acc_t(p)";
    const CUDA_DERIVATIVE: &'static str = "acc_t(p)";
    fn param(&self) -> f64 {
        self.0
    }
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
    const DERIVATIVE_READS_X: bool = false;
    const DERIVATIVE_READS_Y: bool = false;
    const CUDA_FORWARD: &'static str = "x / acc_t(p)";
    const CUDA_DERIVATIVE: &'static str = "acc_t(1) / acc_t(p)";
    fn param(&self) -> f64 {
        self.0
    }
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
    const CUDA_FORWARD: &'static str = "acc_t(p) / x";
    const CUDA_DERIVATIVE: &'static str = "-y / x";
    fn param(&self) -> f64 {
        self.0
    }
    fn forward<A: Accum>(&self, x: A) -> A {
        A::c(self.0) / x
    }
    fn derivative<A: Accum>(&self, x: A, y: A) -> A {
        -y / x
    }
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// `x^p` elementwise for a constant `p`. `p = 2` is [`Tensor::square`] (the exponent
    /// PyTorch users write most: one multiply, correctly rounded, and a loop that vectorises,
    /// where a general `p` is a libm `powf` call per element).
    #[track_caller]
    pub fn powf(&self, p: f64) -> Self {
        if p == 2.0 {
            // `powf`'s policy row (f32 under autocast), not `square`'s (passthrough): a
            // helper the attribute did not reach still panics here, as for any other `p`.
            crate::__private::check_reach(Powf::NAME, E::DTYPE);
            return self.square();
        }
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
}
