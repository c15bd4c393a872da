//! `#[derive(Params)]` through the facade: PyTorch `state_dict` names for nested structs,
//! `Vec`/`Option`/`Box` fields, tuple structs, generics, `skip` and `rename`, element types
//! other than f32 (pure bf16); and the compile errors for misuse (trybuild cases in
//! tests/ui/derive_params/).

use amp::{Param, Params, Precision, Rng, Tensor, bf16};

fn param(shape: &[usize], rng: &mut Rng) -> Param {
    Param::new(Tensor::<f32>::randn(shape, rng))
}

#[derive(Params)]
struct Linear {
    weight: Param,
    bias: Option<Param>,
}

impl Linear {
    fn new(i: usize, o: usize, bias: bool, rng: &mut Rng) -> Self {
        Linear { weight: param(&[o, i], rng), bias: bias.then(|| param(&[o], rng)) }
    }
}

#[derive(Params)]
struct LayerNorm {
    weight: Param,
    bias: Param,
    #[param(skip)]
    eps: f64,
}

/// A module with no parameters but a mode: implements `Params` by hand.
struct Dropout {
    training: bool,
}

impl Params for Dropout {
    fn named_params(&self) -> Vec<(String, &Param)> {
        Vec::new()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)> {
        Vec::new()
    }
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}

#[derive(Params)]
struct Block {
    ln1: LayerNorm,
    drop: Dropout,
    #[param(rename = "c_fc")]
    fc: Linear,
    proj: Box<Linear>,
    #[param(skip)]
    dropout: f32,
}

#[derive(Params)]
struct Gpt {
    wte: Param,
    blocks: Vec<Block>,
    head: Linear,
    #[param(skip)]
    config: (usize, usize),
}

/// Tuple struct: fields are named by position, as `nn.Sequential` names its children.
#[derive(Params)]
struct Pair(Linear, #[param(skip)] u8, Linear);

/// A generic wrapper: the derive bounds `M: Params<E>`, for any element type `E` (every field
/// is generic).
#[derive(Params)]
struct Wrapped<M> {
    module: M,
    #[param(skip)]
    tag: &'static str,
}

#[derive(Params)]
struct Empty;

fn ln(d: usize) -> LayerNorm {
    LayerNorm { weight: Param::new(Tensor::ones(&[d])), bias: Param::new(Tensor::zeros(&[d])), eps: 1e-5 }
}

fn gpt(rng: &mut Rng) -> Gpt {
    let blocks = (0..2)
        .map(|_| Block {
            ln1: ln(4),
            drop: Dropout { training: true },
            fc: Linear::new(4, 8, true, rng),
            proj: Box::new(Linear::new(8, 4, false, rng)),
            dropout: 0.1,
        })
        .collect();
    Gpt { wte: param(&[10, 4], rng), blocks, head: Linear::new(4, 10, true, rng), config: (2, 4) }
}

#[test]
fn names_follow_pytorch_state_dict() {
    let mut rng = Rng::seed(0);
    let model = gpt(&mut rng);
    let names: Vec<String> = model.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "wte",
            "blocks.0.ln1.weight",
            "blocks.0.ln1.bias",
            "blocks.0.c_fc.weight",
            "blocks.0.c_fc.bias",
            "blocks.0.proj.weight",
            "blocks.1.ln1.weight",
            "blocks.1.ln1.bias",
            "blocks.1.c_fc.weight",
            "blocks.1.c_fc.bias",
            "blocks.1.proj.weight",
            "head.weight",
            "head.bias",
        ]
    );
    assert_eq!(model.num_params(), 40 + 2 * (4 + 4 + 32 + 8 + 32) + 40 + 10);
    // Skipped fields are still there, untouched.
    assert_eq!(model.config, (2, 4));
    assert_eq!(model.blocks[1].dropout, 0.1);
    assert_eq!(model.blocks[0].ln1.eps, 1e-5);
}

#[test]
fn shared_and_mutable_enumerations_agree_and_mutation_lands() {
    let mut rng = Rng::seed(1);
    let mut model = gpt(&mut rng);
    let ids: Vec<(String, _)> = model.named_params().into_iter().map(|(n, p)| (n, p.id())).collect();
    let ids_mut: Vec<(String, _)> = model.named_params_mut().into_iter().map(|(n, p)| (n, p.id())).collect();
    assert_eq!(ids, ids_mut);
    for (name, p) in model.named_params_mut() {
        if name == "head.bias" {
            p.data_mut().fill(3.0);
        }
    }
    assert!(model.head.bias.as_ref().unwrap().to_vec().iter().all(|&v| v == 3.0));
    assert!(model.blocks[0].fc.bias.as_ref().unwrap().to_vec().iter().all(|&v| v != 3.0));
}

#[test]
fn train_and_eval_reach_every_submodule() {
    let mut rng = Rng::seed(3);
    let mut model = Wrapped { module: gpt(&mut rng), tag: "m" };
    model.eval();
    assert!(model.module.blocks.iter().all(|b| !b.drop.training));
    model.train();
    assert!(model.module.blocks.iter().all(|b| b.drop.training));
}

#[test]
fn tuple_generic_and_unit_structs() {
    let mut rng = Rng::seed(2);
    let pair = Pair(Linear::new(2, 2, true, &mut rng), 7, Linear::new(2, 3, false, &mut rng));
    let names: Vec<String> = pair.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.weight", "0.bias", "2.weight"]);
    assert_eq!(pair.1, 7);

    let wrapped = Wrapped { module: vec![Linear::new(2, 2, false, &mut rng)], tag: "x" };
    let names: Vec<String> = wrapped.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["module.0.weight"]);
    assert_eq!(wrapped.tag, "x");

    let mut empty = Empty;
    assert!(empty.named_params().is_empty());
    assert!(empty.named_params_mut().is_empty());
}

/// Generic over its weight precision: `Params<W>`.
#[derive(Params)]
struct Scale<W: Precision = f32> {
    weight: Param<W>,
    #[param(skip)]
    dim: usize,
}

/// `bf16` named in its fields' types: `Params<bf16>`. (`nn::Dropout` has no parameters of any
/// element type.)
#[derive(Params)]
struct Bf16Head {
    scale: Scale<bf16>,
    bias: Param<bf16>,
    drop: amp::nn::Dropout,
}

/// A type alias hides `bf16` from the derive: the struct says it.
type Half = bf16;
#[derive(Params)]
#[param(precision = bf16)]
struct Aliased {
    w: Param<Half>,
}

fn names<E: Precision>(m: &dyn Params<E>) -> Vec<String> {
    m.named_params().into_iter().map(|(n, _)| n).collect()
}

#[test]
fn element_type_from_a_precision_parameter_a_bf16_field_or_the_struct() {
    let mut rng = Rng::seed(4);
    let f32_scale = Scale { weight: param(&[3], &mut rng), dim: 3 };
    let _: Vec<(String, &Param<f32>)> = f32_scale.named_params(); // the default: f32
    let mut head = Bf16Head {
        scale: Scale { weight: f32_scale.weight.to_precision(), dim: f32_scale.dim },
        bias: param(&[3], &mut rng).to_precision(),
        drop: amp::nn::Dropout::new(0.1),
    };
    assert_eq!(names::<bf16>(&head), ["scale.weight", "bias"]);
    assert!(head.named_params().iter().all(|(_, p)| p.dtype() == amp::DType::BF16));
    head.eval();
    assert!(!head.drop.is_training());
    assert_eq!(head.num_params(), 6);

    let wrapped = Wrapped { module: head, tag: "bf16" };
    assert_eq!(names::<bf16>(&wrapped), ["module.scale.weight", "module.bias"]);
    let aliased = Aliased { w: param(&[2], &mut rng).to_precision() };
    assert_eq!(names::<bf16>(&aliased), ["w"]);
}

#[test]
fn misuse_is_a_compile_error_on_the_field() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/derive_params/*.rs");
}

/// PyTorch habit: layers without parameters marked `skip` (here a `Dropout`, beside a real
/// non-module field and a generic one).
#[derive(Params)]
struct SkippedLayers<X: Clone> {
    w: Param<bf16>,
    #[param(skip)]
    drop: amp::nn::Dropout,
    #[param(skip)]
    pool: amp::nn::MaxPool2d,
    #[param(skip)]
    rate: f32,
    #[param(skip)]
    extra: X,
}

#[test]
fn eval_reaches_a_module_field_marked_skip() {
    let mut m = SkippedLayers {
        w: param(&[2], &mut Rng::seed(9)).to_precision(),
        drop: amp::nn::Dropout::new(0.5),
        pool: amp::nn::MaxPool2d::new(2),
        rate: 0.5,
        extra: 7u8,
    };
    assert_eq!(names::<bf16>(&m), ["w"], "still no parameters from skipped fields");
    m.eval();
    assert!(!m.drop.is_training(), "a skipped Dropout left on after eval() drops half of every eval batch");
    m.train();
    assert!(m.drop.is_training());
    assert_eq!((m.rate, m.extra), (0.5, 7));
}

/// A fixed number of layers as an array, named by index as a `Vec`'s (`nn.ModuleList`).
#[derive(Params)]
struct TwoLayers {
    layers: [amp::nn::Linear; 2],
}

#[test]
fn an_array_of_modules_is_a_module_list() {
    let mut rng = Rng::seed(10);
    let mut m =
        TwoLayers { layers: [amp::nn::Linear::new(3, 4, true, &mut rng), amp::nn::Linear::new(4, 2, false, &mut rng)] };
    assert_eq!(names::<f32>(&m), ["layers.0.weight", "layers.0.bias", "layers.1.weight"]);
    assert_eq!(m.named_params_mut().len(), 3);
    m.eval();
}

/// A framework that re-exports amp (`pub use amp;`), as a crate between amp and its users
/// would: a user of the framework names that path with `crate = ..`, since amp is not among
/// its own dependencies for the macros to find.
mod framework {
    pub use ::amp;
}

#[derive(Params)]
#[param(crate = self::framework::amp)]
struct ThroughReexport {
    w: Param,
    inner: Linear,
}

#[amp::autocast(bf16, crate = self::framework::amp)]
fn forward_through_reexport(m: &ThroughReexport, x: &Tensor<f32>) -> Tensor<f32> {
    x.matmul(&m.w).relu()
}

#[test]
fn crate_names_amp_reached_through_a_reexport() {
    let mut rng = Rng::seed(3);
    let m = ThroughReexport { w: param(&[4, 3], &mut rng), inner: Linear::new(3, 2, true, &mut rng) };
    let names: Vec<String> = m.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["w", "inner.weight", "inner.bias"]);
    let x = Tensor::<f32>::randn(&[2, 4], &mut rng);
    let want = x.cast::<bf16>().matmul(&m.w.cast::<bf16>()).relu().cast::<f32>();
    assert_eq!(forward_through_reexport(&m, &x).to_vec(), want.to_vec(), "the matmul ran in bf16");
}
