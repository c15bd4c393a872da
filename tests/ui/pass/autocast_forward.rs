//! A complete program: a module's forward under `#[autocast]`, the facade's paths.
use amp::prelude::*;

struct Mlp {
    w1: Param,
    w2: Param,
}

impl Mlp {
    #[autocast]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        let h = x.matmul(&self.w1).relu();
        h.matmul(&self.w2).log_softmax(1)
    }
}

#[autocast(bf16, fp32 = [helper])]
fn generic<E: Precision>(x: &Tensor<E>) -> Tensor<E> {
    let s: f32 = [1.0f32, 2.0].iter().sum();
    helper(&x.matmul(&x.t())).mul_scalar(f64::from(s))
}

fn helper(x: &Tensor<f32>) -> Tensor<f32> {
    x.exp()
}

pub fn main() {
    let mut rng = Rng::seed(0);
    let m = Mlp { w1: Param::new(Tensor::randn(&[4, 8], &mut rng)), w2: Param::new(Tensor::randn(&[8, 3], &mut rng)) };
    let x = Tensor::<f32>::randn(&[2, 4], &mut rng);
    let loss = m.forward(&x).mean_all();
    let g = loss.backward();
    assert_eq!(g.get(&m.w1).unwrap().dtype(), DType::F32);
    assert_eq!(generic(&x.cast::<f16>()).dtype(), DType::F16);
}
