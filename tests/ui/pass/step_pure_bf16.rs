// Pure bf16 training through the same chain: bf16 weights (no f32 master copy), bf16
// gradients, an optimizer made for bf16 parameters, with `NoScale` or a `GradScaler`, one
// model or several (`step_many`), through `dyn Optimizer<bf16>` too.
use amp::nn::{Gpt, GptConfig, Linear};
use amp::optim::{AdamW, Bf16Rounding, Optimizer, Sgd};
use amp::scaler::{GradScaler, NoScale};
use amp::{Indices, Params, Rng, Tensor, bf16};

pub fn main() {
    let mut rng = Rng::seed(0);
    let config = GptConfig { vocab_size: 7, block_size: 4, d_model: 8, n_layers: 1, n_heads: 2, dropout: 0.0 };
    let mut gpt: Gpt<bf16> = Gpt::new(config, &mut rng).to_precision();
    let mut opt = AdamW::new(1e-3).build().unwrap().for_bf16(Bf16Rounding::Kahan);
    let ids = Indices::from_vec(vec![1, 2, 3, 4, 5, 6, 0, 1], &[2, 4]);
    let mut no_scale = NoScale;
    for _ in 0..2 {
        let loss = gpt.loss::<bf16>(&ids, &ids, &mut rng);
        let mut grads = no_scale.scale(loss).backward().unscale();
        grads.clip_grad_norm(1.0);
        grads.step(&mut opt, &mut gpt).update().unwrap();
    }
    assert_eq!(opt.steps(), 2);

    let mut enc = Linear::new(4, 4, true, &mut rng).to_precision::<bf16>();
    let mut dec = Linear::new(4, 2, false, &mut rng).to_precision::<bf16>();
    let mut opt_enc = Sgd::new(0.1).build().unwrap().for_bf16(Bf16Rounding::Stochastic { seed: 3 });
    let mut opt_dec: Box<dyn Optimizer<bf16>> =
        Box::new(Sgd::new(0.1).build().unwrap().for_bf16(Bf16Rounding::Nearest));
    let mut scaler = GradScaler::new();
    let x = Tensor::<f32>::randn(&[8, 4], &mut rng);
    let loss = dec.forward::<bf16, bf16>(&enc.forward::<bf16, f32>(&x)).cast::<f32>().square().mean_all();
    scaler
        .scale(loss)
        .backward()
        .unscale()
        .step_many(&mut [(&mut opt_enc, &mut enc), (&mut *opt_dec, &mut dec)])
        .update()
        .unwrap();
    assert_eq!((opt_enc.steps(), opt_dec.steps()), (1, 1));
    assert_eq!(enc.num_params() + dec.num_params(), 20 + 8);
}
