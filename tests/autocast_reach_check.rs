//! The reach check: code inside an `#[autocast]` region that the attribute did not rewrite (a
//! helper or a submodule method without it) would run its ops as written, where PyTorch's
//! dynamic region casts them. Such an op panics, naming the fix; code meant to run as written
//! (`autocast_off!`, `#[autocast(off)]`, `passthrough`, a user's categorised function, the
//! backward pass) does not.

use amp::prelude::*;

/// A hand-written log-sum-exp, generic over the precision, without the attribute.
fn logsumexp_plain<E: Precision>(x: &Tensor<E>) -> Tensor<E> {
    x.exp().sum(0, false).log()
}

/// The same helper, reached: generic over the caller's low type.
#[autocast(P)]
fn logsumexp<P: Precision>(x: &Tensor<f32>) -> Tensor<f32> {
    x.exp().sum(0, false).log()
}

fn big() -> Tensor<f32> {
    Tensor::from_f32s(&[10.0, 11.0, 12.0], &[3])
}

#[test]
#[should_panic(
    expected = "`exp` ran on a f16 tensor inside a `#[autocast]` (f16) region, where autocast runs it in f32"
)]
fn an_unannotated_helper_called_from_autocast_panics() {
    #[autocast]
    fn f(x: &Tensor<f32>) -> Tensor<f32> {
        let h = x.matmul(&Tensor::<f32>::ones(&[3, 3])); // f16
        logsumexp_plain(&h) // exp(36) in f16 would be inf
    }
    let _ = f(&big().reshape(&[1, 3]));
}

#[test]
fn the_reached_helper_computes_in_f32() {
    #[autocast(P)]
    fn f<P: Precision>(x: &Tensor<f32>) -> Tensor<f32> {
        let h = x.mul_scalar(1.0); // stays f32
        logsumexp::<P>(&h)
    }
    let want = 12.0 + (1.0f64 + (-1.0f64).exp() + (-2.0f64).exp()).ln();
    for got in [f::<f16>(&big()).item(), f::<bf16>(&big()).item(), f::<f32>(&big()).item()] {
        assert!((got as f64 - want).abs() < 1e-5, "{got} vs {want}");
    }
}

struct Plain {
    w: Param,
}

impl Plain {
    /// A submodule's forward without the attribute.
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x.matmul(&self.w)
    }
}

#[test]
#[should_panic(
    expected = "`matmul` ran on a f32 tensor inside a `#[autocast]` (bf16) region, where autocast runs it in bf16"
)]
fn a_submodule_without_the_attribute_panics() {
    struct Net {
        sub: Plain,
    }
    impl Net {
        #[autocast(bf16)]
        fn loss(&self, x: &Tensor<f32>) -> Tensor<f32> {
            self.sub.forward(x).sum_all()
        }
    }
    let net = Net { sub: Plain { w: Param::new(Tensor::ones(&[3, 2])) } };
    let _ = net.loss(&Tensor::ones(&[4, 3]));
}

#[test]
fn code_meant_to_run_as_written_does_not_panic() {
    #[autocast(fp32 = [logsumexp_plain], passthrough = [softmax])]
    fn f(x: &Tensor<f32>) -> Vec<DType> {
        let h = x.matmul(&Tensor::<f32>::ones(&[3, 3])).mul_scalar(0.01); // f16
        autocast_off! { let a = h.exp(); }
        #[autocast(off)]
        let b = h.exp();
        let c = autocast_off!(h.sum(1, false));
        let d = logsumexp_plain(&h); // listed as fp32: gets f32, runs as written
        let e = h.softmax(1); // passthrough here: f16 softmax
        vec![a.dtype(), b.dtype(), c.dtype(), d.dtype(), e.dtype()]
    }
    assert_eq!(f(&Tensor::ones(&[2, 3])), [DType::F16, DType::F16, DType::F16, DType::F32, DType::F16]);
}

#[test]
fn a_training_loop_inside_a_region_runs_backward_as_written() {
    #[autocast]
    fn train(w: &mut Param, x: &Tensor<f32>) -> usize {
        let (mut opt, mut scaler) = (Sgd::new(0.01).build().unwrap(), GradScaler::new());
        let mut applied = 0;
        for _ in 0..5 {
            let loss = x.matmul(&*w).square().mean_all();
            let r = scaler.scale(loss).backward().unscale().step(&mut opt, w).update().unwrap();
            applied += usize::from(!r.skipped);
        }
        applied
    }
    let mut w = Param::new(Tensor::<f32>::from_f32s(&[0.1, -0.2, 0.3], &[3, 1]));
    let x = Tensor::<f32>::from_f32s(&[1.0, 2.0, 3.0, -1.0, 0.5, 0.25], &[2, 3]);
    assert!(train(&mut w, &x) > 0);
}

#[test]
fn f64_and_autocast_f32_regions_are_never_checked() {
    #[autocast(f32)]
    fn off(x: &Tensor<f32>) -> Tensor<f16> {
        logsumexp_plain(&x.cast::<f16>()) // autocast off: as written, f16
    }
    #[autocast]
    fn wide(x: &Tensor<f64>) -> Tensor<f64> {
        logsumexp_plain(x) // f64 is never cast
    }
    assert_eq!(off(&Tensor::ones(&[3])).dtype(), DType::F16);
    assert_eq!(wide(&Tensor::ones(&[3])).dtype(), DType::F64);
}

#[test]
#[should_panic(expected = "`exp` ran on a f16 tensor")]
fn an_autocast_function_checks_its_body_even_when_called_from_code_run_as_written() {
    #[autocast]
    fn inner(x: &Tensor<f32>) -> Tensor<f32> {
        let h = x.matmul(&Tensor::<f32>::ones(&[3, 3]));
        logsumexp_plain(&h).cast::<f32>()
    }
    #[autocast]
    fn outer(x: &Tensor<f32>) -> Tensor<f32> {
        autocast_off!(inner(x))
    }
    let _ = outer(&big().reshape(&[1, 3]));
}

/// A model behind a trait object: `#[autocast]` on the impl's method, called through `dyn`.
trait Model {
    fn loss(&self, x: &Tensor<f32>) -> Tensor<f32>;
}

struct Mat {
    w: Param,
}

impl Model for Mat {
    #[autocast(bf16)]
    fn loss(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x.matmul(&self.w).softmax(1).sum_all()
    }
}

#[test]
fn autocast_on_a_trait_impl_called_through_dyn() {
    let m: Box<dyn Model> = Box::new(Mat { w: Param::new(Tensor::ones(&[3, 2])) });
    let loss = m.loss(&Tensor::ones(&[4, 3]));
    assert_eq!(loss.dtype(), DType::F32);
    assert!((loss.item() - 4.0).abs() < 1e-3, "{}", loss.item());
    let grads = loss.backward();
    assert_eq!(grads.len(), 1);
}

/// `x.powf(2.0)` runs as a multiply (`square`, which autocast passes through), but it is still
/// `powf` to the policy: an unreached helper squaring a low-precision tensor panics as PyTorch
/// users' `x.pow(2)` would have been cast to f32.
#[test]
#[should_panic(expected = "`powf` ran on a f16 tensor inside a `#[autocast]` (f16) region")]
fn an_unreached_square_through_powf_panics_like_any_powf() {
    fn mean_square_plain<E: Precision>(x: &Tensor<E>) -> Tensor<E> {
        x.powf(2.0).mean_all()
    }
    #[autocast]
    fn f(x: &Tensor<f32>) -> Tensor<f32> {
        let h = x.matmul(&Tensor::<f32>::ones(&[3, 3])); // f16
        mean_square_plain(&h).cast::<f32>()
    }
    let _ = f(&big().reshape(&[1, 3]));
}
