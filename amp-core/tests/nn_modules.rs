//! nn modules: PyTorch names, train/eval reaching every dropout, precisions per the policy
//! table, and gradients arriving in f32 for every parameter.

use crate::common;

use amp_core::nn::{CausalSelfAttention, Gpt, GptConfig, Linear};
use amp_core::{DType, Indices, Mask, Params, Precision, Rng, Tensor, bf16, f16};

fn tiny() -> GptConfig {
    GptConfig { vocab_size: 11, block_size: 8, d_model: 16, n_layers: 2, n_heads: 2, dropout: 0.1 }
}

#[test]
fn gpt_parameter_names_follow_pytorch_state_dict() {
    let model = Gpt::new(tiny(), &mut Rng::seed(0));
    let names: Vec<String> = model.named_params().into_iter().map(|(n, _)| n).collect();
    for expected in [
        "tok_emb.weight",
        "pos_emb.weight",
        "blocks.0.ln1.weight",
        "blocks.0.ln1.bias",
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.qkv.bias",
        "blocks.0.attn.proj.weight",
        "blocks.1.mlp.fc.weight",
        "blocks.1.mlp.proj.bias",
        "ln_f.weight",
        "head.weight",
        "head.bias",
    ] {
        assert!(names.iter().any(|n| n == expected), "missing {expected} in {names:?}");
    }
    // 2 embeddings + 2 blocks × 12 tensors + ln_f (2) + head (2)
    assert_eq!(names.len(), 2 + 2 * 12 + 2 + 2);
    let c = tiny();
    let per_block = 2 * c.d_model
        + (3 * c.d_model * c.d_model + 3 * c.d_model)
        + (c.d_model * c.d_model + c.d_model)
        + 2 * c.d_model
        + (4 * c.d_model * c.d_model + 4 * c.d_model)
        + (4 * c.d_model * c.d_model + c.d_model);
    let expected = c.vocab_size * c.d_model
        + c.block_size * c.d_model
        + c.n_layers * per_block
        + 2 * c.d_model
        + c.d_model * c.vocab_size
        + c.vocab_size;
    assert_eq!(model.num_params(), expected);
}

fn ids(b: usize, t: usize, vocab: usize, rng: &mut Rng) -> Indices {
    Indices::from_vec((0..b * t).map(|_| rng.below(vocab as u64) as i64).collect(), &[b, t])
}

#[test]
fn eval_mode_reaches_every_dropout_and_makes_forward_deterministic() {
    let mut model = Gpt::new(tiny(), &mut Rng::seed(1));
    let x = ids(2, 8, 11, &mut Rng::seed(2));
    model.eval();
    let a = model.forward::<f32>(&x, &mut Rng::seed(3)).to_vec();
    let b = model.forward::<f32>(&x, &mut Rng::seed(4)).to_vec();
    assert_eq!(a, b, "eval: different dropout seeds must not change the output");
    model.train();
    let c = model.forward::<f32>(&x, &mut Rng::seed(3)).to_vec();
    let d = model.forward::<f32>(&x, &mut Rng::seed(4)).to_vec();
    assert_ne!(c, d, "train: dropout must be active");
}

fn gpt_step<L: Precision>() {
    let mut model = Gpt::new(tiny(), &mut Rng::seed(5));
    model.eval();
    let x = ids(3, 8, 11, &mut Rng::seed(6));
    let logits = model.forward::<L>(&x, &mut Rng::seed(7));
    assert_eq!(logits.dtype(), L::DTYPE, "head (a Linear) runs in the compute precision");
    assert_eq!(logits.shape(), &[3, 8, 11]);
    let targets = ids(3, 8, 11, &mut Rng::seed(8));
    let loss = model.loss::<L>(&x, &targets, &mut Rng::seed(7));
    assert_eq!(loss.dtype(), DType::F32, "the loss is f32 whatever the compute precision");
    let l = loss.item();
    assert!((l - (11f32).ln()).abs() < 0.5, "initial loss {l} should be near ln(vocab)");
    let grads = loss.backward();
    for (name, p) in model.named_params() {
        let g: &Tensor<f32> = grads.get(p).unwrap_or_else(|| panic!("no f32 gradient for {name}"));
        assert_eq!(g.shape(), p.shape(), "{name}");
        assert!(g.to_vec().iter().all(|v| v.is_finite()), "{name} gradient not finite");
    }
}

#[test]
fn gpt_forward_backward_in_every_precision() {
    gpt_step::<f32>();
    gpt_step::<f16>();
    gpt_step::<bf16>();
}

#[test]
fn low_precision_logits_track_f32() {
    let mut model = Gpt::new(tiny(), &mut Rng::seed(9));
    model.eval();
    let x = ids(2, 8, 11, &mut Rng::seed(10));
    let r = model.forward::<f32>(&x, &mut Rng::seed(0)).to_vec();
    let h = model.forward::<f16>(&x, &mut Rng::seed(0)).to_f32_vec();
    let b = model.forward::<bf16>(&x, &mut Rng::seed(0)).to_f32_vec();
    let err = |v: &[f32]| v.iter().zip(&r).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err(&h) < 2e-3, "f16 max error {}", err(&h));
    assert!(err(&b) < 2e-2, "bf16 max error {}", err(&b));
}

#[test]
fn linear_matches_manual_formula_and_checks_input_width() {
    let lin = Linear::new(3, 2, true, &mut Rng::seed(11));
    let x = Tensor::<f32>::randn(&[4, 3], &mut Rng::seed(12));
    let y = lin.forward::<f32, f32>(&x);
    let want = x.matmul(&lin.weight.t()).add(lin.bias.as_ref().unwrap());
    for (a, b) in y.to_vec().iter().zip(want.to_vec()) {
        assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lin.forward::<f32, f32>(&Tensor::<f32>::zeros(&[4, 5]))
    }));
    let msg = *r.unwrap_err().downcast::<String>().unwrap();
    assert!(
        msg.contains(
            "linear: the input's last dim must equal the weight's in_features 3 (shapes [[4, 5], [2, 3], [2]])"
        ),
        "{msg}"
    );
}

/// Causal attention written out with separate q, k and v weights: `[x, wq, wk, wv, bq, bk, bv,
/// wp, bp]` to `[B, T, d]`, all f64.
fn attention_reference(a: &[Tensor<f64>], h: usize) -> Tensor<f64> {
    let (b, t, d) = (a[0].shape()[0], a[0].shape()[1], a[0].shape()[2]);
    let hd = d / h;
    let heads = |w: &Tensor<f64>, bias: &Tensor<f64>| {
        a[0].matmul(&w.t()).add(bias).reshape(&[b, t, h, hd]).permute(&[0, 2, 1, 3])
    };
    let (q, k, v) = (heads(&a[1], &a[4]), heads(&a[2], &a[5]), heads(&a[3], &a[6]));
    let scores = q.matmul(&k.t()).mul_scalar(1.0 / (hd as f64).sqrt()).masked_fill(&Mask::causal(t), f64::NEG_INFINITY);
    let y = scores.softmax(3).matmul(&v).permute(&[0, 2, 1, 3]).reshape(&[b, t, d]);
    y.matmul(&a[7].t()).add(&a[8])
}

/// The fused `qkv` projection (one GEMM, q, k and v cut out of its output) gives the outputs
/// and gradients of separate projections: checked in f64 against [`attention_reference`],
/// which is itself checked against finite differences.
#[test]
fn attention_matches_separate_qkv_projections_with_gradients() {
    let (b, t, d, h) = (2, 5, 8, 2);
    let mut attn = CausalSelfAttention::new(d, h, 0.0, &mut Rng::seed(40));
    // Random biases too (GPT-2's init zeroes them); f32 values, so f64 sees them exactly.
    let mut rng = Rng::seed(41);
    for (_, p) in attn.named_params_mut() {
        p.set(&Tensor::<f32>::randn(p.shape(), &mut rng).mul_scalar(0.5));
    }
    let f64_of = |p: &Tensor<f32>| p.cast::<f64>();
    let (w, bias) = (f64_of(&attn.qkv.weight), f64_of(attn.qkv.bias.as_ref().unwrap()));
    let x = Tensor::<f32>::randn(&[b, t, d], &mut rng).cast::<f64>();
    let mut inputs = vec![x.clone()];
    inputs.extend((0..3).map(|i| w.narrow(0, i * d, d).contiguous()));
    inputs.extend((0..3).map(|i| bias.narrow(0, i * d, d).contiguous()));
    inputs.push(f64_of(&attn.proj.weight));
    inputs.push(f64_of(attn.proj.bias.as_ref().unwrap()));
    let weights = Tensor::<f64>::randn(&[b, t, d], &mut rng);
    let loss = |y: &Tensor<f64>| y.mul(&weights).sum_all();
    common::gradcheck(&inputs, |a| loss(&attention_reference(a, h)));

    let leaves: Vec<Tensor<f64>> = inputs.iter().map(|t| t.detach().requires_grad_()).collect();
    let want = attention_reference(&leaves, h);
    let want_g = loss(&want).backward();
    let xl = x.detach().requires_grad_();
    let got = attn.forward::<f64, f64>(&xl, &mut Rng::seed(0));
    // The masked softmax runs in f32 (the policy's fp32 category) whatever the compute
    // precision, so f64 results agree to f32's tolerance.
    common::assert_close(&got.cast::<f32>(), &want, "output");
    let got_g = loss(&got).backward();
    common::assert_close(&got_g.get(&xl).unwrap().cast::<f32>(), want_g.get(&leaves[0]).unwrap(), "x gradient");
    let cat = |r: std::ops::Range<usize>| {
        let parts: Vec<&Tensor<f64>> = r.map(|i| want_g.get(&leaves[i]).unwrap()).collect();
        Tensor::cat(&parts, 0)
    };
    let param_grad = |p: &amp_core::Param| got_g.get(p).unwrap().clone();
    common::assert_close(&param_grad(&attn.qkv.weight), &cat(1..4), "qkv.weight gradient");
    common::assert_close(&param_grad(attn.qkv.bias.as_ref().unwrap()), &cat(4..7), "qkv.bias gradient");
    common::assert_close(&param_grad(&attn.proj.weight), want_g.get(&leaves[7]).unwrap(), "proj.weight gradient");
    common::assert_close(
        &param_grad(attn.proj.bias.as_ref().unwrap()),
        want_g.get(&leaves[8]).unwrap(),
        "proj.bias gradient",
    );
}

/// The loss and every parameter's gradient of one GPT forward and backward in precision `L`.
fn gpt_loss_and_grads<L: Precision>(model: &Gpt) -> (f64, Vec<Vec<f64>>) {
    let ids = Indices::from_vec((0..16).map(|i| (i * 7) % 11).collect(), &[2, 8]);
    let targets = Indices::from_vec((0..16).map(|i| (i * 3 + 1) % 11).collect(), &[2, 8]);
    let loss = model.loss::<L>(&ids, &targets, &mut Rng::seed(0));
    let grads = loss.backward();
    let g = model.named_params().iter().map(|(_, p)| grads.get(p).unwrap().to_f64_vec()).collect();
    (loss.item() as f64, g)
}

#[test]
fn a_gpt_with_fused_attention_computes_the_unfused_loss_and_gradients() {
    let config = GptConfig { dropout: 0.0, ..tiny() };
    let unfused = Gpt::new(config.clone(), &mut Rng::seed(3));
    let fused = unfused.clone().with_fused_attention(true).unwrap();
    assert!(fused.blocks.iter().all(|b| b.attn.is_fused()) && !unfused.blocks[0].attn.is_fused());
    // f32: the same sums in another order; f16/bf16: the fused kernel keeps the scores and
    // probabilities in f32 where the separate ops round them to L, so it is the closer one.
    for (dtype, (a, b), tol) in [
        (DType::F32, (gpt_loss_and_grads::<f32>(&unfused), gpt_loss_and_grads::<f32>(&fused)), 1e-5),
        (DType::F16, (gpt_loss_and_grads::<f16>(&unfused), gpt_loss_and_grads::<f16>(&fused)), 2e-2),
        (DType::BF16, (gpt_loss_and_grads::<bf16>(&unfused), gpt_loss_and_grads::<bf16>(&fused)), 1e-1),
    ] {
        assert!((a.0 - b.0).abs() <= tol * a.0.abs(), "{dtype}: loss {} vs {}", a.0, b.0);
        for (i, (ga, gb)) in a.1.iter().zip(&b.1).enumerate() {
            let scale = ga.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
            let worst = ga.iter().zip(gb).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
            assert!(worst <= tol * scale, "{dtype}: gradient {i} differs by {worst} (largest {scale})");
        }
    }
    // Attention dropout needs the probabilities: a model with dropout cannot fuse.
    let err = Gpt::new(tiny(), &mut Rng::seed(3)).with_fused_attention(true).unwrap_err().to_string();
    assert!(err.contains("dropout"), "{err}");
}

/// The most likely next token after each row of `seq` (`[B, T]`), from the last
/// `block_size` tokens, by the model's plain forward.
fn argmax_next(model: &Gpt, seq: &[Vec<i64>]) -> Vec<i64> {
    let block = model.config.block_size;
    let len = seq[0].len();
    let t = len.min(block);
    let window: Vec<i64> = seq.iter().flat_map(|s| s[len - t..].to_vec()).collect();
    let logits = model.forward::<f32>(&Indices::from_vec(window, &[seq.len(), t]), &mut Rng::seed(0));
    let v = model.config.vocab_size;
    logits.narrow(1, t - 1, 1).reshape(&[seq.len(), v]).argmax(1, false).as_slice().to_vec()
}

#[test]
fn generate_extends_the_prompt_greedily_or_by_sampling_past_the_block_size() {
    use amp_core::nn::Sampling;
    let mut model = Gpt::new(tiny(), &mut Rng::seed(21));
    model.eval();
    let prompt = Indices::from_vec(vec![1, 2, 3, 4, 5, 6], &[2, 3]);
    // 12 new tokens: the sequences grow past block_size 8, so the model sees the last 8.
    let greedy = model.generate::<f32>(&prompt, 12, Sampling::Greedy, &mut Rng::seed(0));
    assert_eq!(greedy.shape(), &[2, 15]);
    let rows: Vec<Vec<i64>> = greedy.as_slice().chunks(15).map(<[i64]>::to_vec).collect();
    assert_eq!((&rows[0][..3], &rows[1][..3]), (&[1, 2, 3][..], &[4, 5, 6][..]));
    for n in 3..15 {
        let before: Vec<Vec<i64>> = rows.iter().map(|r| r[..n].to_vec()).collect();
        assert_eq!(argmax_next(&model, &before), vec![rows[0][n], rows[1][n]], "token {n}");
    }

    let random = |temperature: f64, top_k: Option<usize>, seed: u64| {
        model.generate::<f32>(&prompt, 12, Sampling::Random { temperature, top_k }, &mut Rng::seed(seed))
    };
    // One candidate, or a temperature that leaves only the maximum: greedy.
    assert_eq!(random(1.5, Some(1), 7), greedy);
    assert_eq!(random(1e-9, None, 7), greedy);
    // A seed is a sample; another seed another one (random weights: logits near uniform).
    assert_eq!(random(1.0, None, 7), random(1.0, None, 7));
    assert_ne!(random(1.0, None, 7), random(1.0, None, 8));
    assert_ne!(random(1.0, None, 7), greedy);
    // With top_k = 3 every token is among the 3 most likely at its position.
    let top3 = random(2.0, Some(3), 9);
    let rows3: Vec<Vec<i64>> = top3.as_slice().chunks(15).map(<[i64]>::to_vec).collect();
    let v = model.config.vocab_size;
    for n in 3..15 {
        for row in &rows3 {
            let t = n.min(8);
            let ids = Indices::from_vec(row[n - t..n].to_vec(), &[1, t]);
            let logits = model.forward::<f32>(&ids, &mut Rng::seed(0)).narrow(1, t - 1, 1).reshape(&[v]).to_vec();
            let chosen = logits[row[n] as usize];
            assert!(logits.iter().filter(|&&x| x > chosen).count() < 3, "token {n}: {chosen} in {logits:?}");
        }
    }
    // Draws follow softmax(logits / temperature): 4000 rows of one prompt, one token each.
    let rows = 4000;
    let same = Indices::from_vec([1, 2, 3].repeat(rows), &[rows, 3]);
    let temperature = 0.5;
    let drawn = model.generate::<f32>(&same, 1, Sampling::Random { temperature, top_k: None }, &mut Rng::seed(3));
    let logits = model.forward::<f64>(&Indices::from_vec(vec![1, 2, 3], &[1, 3]), &mut Rng::seed(0));
    let probs = logits.narrow(1, 2, 1).reshape(&[v]).mul_scalar(1.0 / temperature).softmax(0).to_vec();
    let mut counts = vec![0usize; v];
    for row in drawn.as_slice().chunks(4) {
        counts[row[3] as usize] += 1;
    }
    for (tok, (&c, &p)) in counts.iter().zip(&probs).enumerate() {
        let sigma = (rows as f64 * p * (1.0 - p)).sqrt();
        assert!((c as f64 - rows as f64 * p).abs() <= 5.0 * sigma + 1.0, "token {tok}: {c} draws, p = {p}");
    }
    // Low precision runs the forward in that precision.
    assert_eq!(model.generate::<bf16>(&prompt, 4, Sampling::Greedy, &mut Rng::seed(0)).shape(), &[2, 7]);
}

#[test]
fn generate_refuses_bad_sampling_prompts_and_a_model_in_training_mode_with_dropout() {
    use amp_core::nn::Sampling;
    let mut model = Gpt::new(tiny(), &mut Rng::seed(22));
    let prompt = Indices::from_vec(vec![1, 2], &[1, 2]);
    let err = |r: amp_core::Result<Indices>| r.unwrap_err().to_string();
    let training = err(model.try_generate::<f32>(&prompt, 3, Sampling::Greedy, &mut Rng::seed(0)));
    assert!(training.contains("training mode with dropout 0.1") && training.contains("eval()"), "{training}");
    model.eval();
    for (sampling, want) in [
        (Sampling::Random { temperature: 0.0, top_k: None }, "temperature must be finite and above 0, got 0"),
        (Sampling::Random { temperature: f64::NAN, top_k: None }, "got NaN"),
        (Sampling::Random { temperature: 1.0, top_k: Some(0) }, "top_k must be at least 1"),
    ] {
        let e = err(model.try_generate::<f32>(&prompt, 3, sampling, &mut Rng::seed(0)));
        assert!(e.contains("Gpt::generate") && e.contains(want), "{e}");
    }
    for bad in [Indices::from_vec(vec![1, 2], &[2]), Indices::from_vec(vec![], &[1, 0])] {
        let e = err(model.try_generate::<f32>(&bad, 3, Sampling::Greedy, &mut Rng::seed(0)));
        assert!(e.contains("expected a prompt of token ids [B, P] with P >= 1"), "{e}");
    }
    let e =
        err(model.try_generate::<f32>(&Indices::from_vec(vec![11], &[1, 1]), 1, Sampling::Greedy, &mut Rng::seed(0)));
    assert_eq!(e, "Gpt::generate: index 11 at position 0 is out of range 0..11");
    let e = err(model.try_generate::<f32>(
        &Indices::from_vec(vec![3, -1], &[1, 2]),
        0,
        Sampling::Greedy,
        &mut Rng::seed(0),
    ));
    assert_eq!(e, "Gpt::generate: index -1 at position 1 is out of range 0..11");
    // An empty batch: nothing to extend.
    let none = model.generate::<f32>(&Indices::from_vec(vec![], &[0, 2]), 3, Sampling::Greedy, &mut Rng::seed(0));
    assert_eq!(none.shape(), &[0, 5]);
    // No new tokens: the prompt itself.
    assert_eq!(model.generate::<f32>(&prompt, 0, Sampling::Greedy, &mut Rng::seed(0)), prompt);
}
