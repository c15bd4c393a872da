//! Interoperability with Python: weights saved here are read by Python's `safetensors` +
//! numpy (tests/python/read_checkpoint.py checks names, shapes and values against a manifest),
//! and the f32 and f16 files Python writes back load here. Likewise a data file of f32 and
//! int64 tensors (`save_tensors`), and the int64, int32, uint8 and bool tensors Python writes
//! read here as `Indices`.
//!
//! Needs `pip install safetensors numpy`. Without them the test says so and passes, unless
//! `AMP_REQUIRE_PYTHON` is set, where it fails: tests/python/run.sh (run by CI) sets it.

use std::path::{Path, PathBuf};
use std::process::Command;

use amp_core::checkpoint::{
    TensorFile, TrainingState, load_weights, read_tensors, save_checkpoint, save_tensors, save_weights,
};
use amp_core::{Indices, Param, Params, Rng, Tensor};

#[derive(Params)]
struct Block {
    ln1: LayerNorm,
    #[param(rename = "c_fc")]
    fc: Param,
}

#[derive(Params)]
struct LayerNorm {
    weight: Param,
    bias: Param,
}

#[derive(Params)]
struct Model {
    wte: Param,
    blocks: Vec<Block>,
    head: Param,
}

fn model(seed: u64) -> Model {
    let mut rng = Rng::seed(seed);
    let mut p = |shape: &[usize]| Param::new(Tensor::<f32>::randn(shape, &mut rng));
    Model {
        wte: p(&[11, 6]),
        blocks: (0..2).map(|_| Block { ln1: LayerNorm { weight: p(&[6]), bias: p(&[6]) }, fc: p(&[24, 6]) }).collect(),
        head: p(&[11, 6]),
    }
}

fn python_ready() -> bool {
    let ok =
        Command::new("python3").args(["-c", "import safetensors, numpy"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        let required = std::env::var_os("AMP_REQUIRE_PYTHON").is_some();
        assert!(!required, "python3 with safetensors and numpy is required here: pip install safetensors numpy");
        eprintln!(
            "SKIPPED checkpoint_python: python3 with safetensors and numpy not found (pip install safetensors numpy)"
        );
    }
    ok
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/read_checkpoint.py")
}

#[test]
fn python_reads_our_weights_and_we_read_python_exports() {
    if !python_ready() {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("checkpoint_python");
    let _ = std::fs::remove_dir_all(&dir);
    let source = model(11);
    // A checkpoint's weights file is what Python reads.
    let files = save_checkpoint(dir.join("ckpt"), &source, &TrainingState::new(3)).unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(&files.weights, dir.join("model.safetensors")).unwrap();
    save_weights(dir.join("model_direct.safetensors"), &source).unwrap();
    assert_eq!(
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        std::fs::read(dir.join("model_direct.safetensors")).unwrap()
    );

    let tensors: Vec<serde_json::Value> = source
        .named_params()
        .into_iter()
        .map(|(name, p)| {
            serde_json::json!({"name": name, "shape": p.shape(), "dtype": "F32",
                "values": p.to_vec().iter().map(|&v| f64::from(v)).collect::<Vec<_>>()})
        })
        .collect();
    let names: Vec<&str> = tensors.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "wte",
            "blocks.0.ln1.weight",
            "blocks.0.ln1.bias",
            "blocks.0.c_fc",
            "blocks.1.ln1.weight",
            "blocks.1.ln1.bias",
            "blocks.1.c_fc",
            "head"
        ]
    );
    // A dataset: f32 inputs and int64 labels (beyond i32, and negative).
    let mut data = TensorFile::new();
    let x = Tensor::<f32>::randn(&[3, 4], &mut Rng::seed(5));
    let y = Indices::from_vec(vec![2, -100, 1 << 40, 0, -(1 << 33), 7], &[2, 3]);
    data.insert("x", &x);
    data.insert("y", &y);
    save_tensors(dir.join("data.safetensors"), &data).unwrap();
    let data_tensors = serde_json::json!([
        {"name": "x", "shape": x.shape(), "dtype": "F32",
         "values": x.to_vec().iter().map(|&v| f64::from(v)).collect::<Vec<_>>()},
        {"name": "y", "shape": y.shape(), "dtype": "I64", "values": y.as_slice()},
    ]);
    let manifest = serde_json::json!({
        "weights": "model.safetensors",
        "tensors": tensors,
        "data": {"file": "data.safetensors", "tensors": data_tensors},
    });
    std::fs::write(dir.join("manifest.json"), serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();

    let out = Command::new("python3").arg(script()).arg(&dir).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "read_checkpoint.py failed:\n{text}");
    println!("{}", text.trim_end());
    assert!(text.contains("OK: 8 tensors"), "{text}");
    assert!(text.contains("OK: 2 data tensors (x float32, y int64) match data.safetensors"), "{text}");

    // Python's exports load back: f32 exactly, f16 as f16-rounded values.
    let mut back = model(12);
    load_weights(dir.join("from_python_f32.safetensors"), &mut back).unwrap();
    for ((n, a), (_, b)) in back.named_params().iter().zip(source.named_params()) {
        assert_eq!(a.to_vec(), b.to_vec(), "{n}");
    }
    let mut back16 = model(13);
    load_weights(dir.join("from_python_f16.safetensors"), &mut back16).unwrap();
    for ((n, a), (_, b)) in back16.named_params().iter().zip(source.named_params()) {
        let want: Vec<f32> = b.to_vec().iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        assert_eq!(a.to_vec(), want, "{n}");
    }

    // Python's integer tensors read as Indices (int32 and uint8 widened, bool as 0/1).
    let ints = read_tensors(dir.join("from_python_ints.safetensors")).unwrap();
    assert_eq!(ints.indices("labels").unwrap(), Indices::from_vec(vec![0, -100, 1 << 40, 7, -(1 << 40), 3], &[2, 3]));
    assert_eq!(ints.indices("ids32").unwrap().to_vec(), [-5, 0, i64::from(i32::MAX)]);
    assert_eq!(ints.indices("bytes").unwrap().to_vec(), [0, 200, 255]);
    assert_eq!(ints.indices("mask").unwrap().to_vec(), [1, 0, 1]);
    let dtypes: Vec<&str> =
        ["labels", "ids32", "bytes", "mask", "x"].map(|n| ints.get(n).unwrap().file_dtype()).to_vec();
    assert_eq!(dtypes, ["I64", "I32", "U8", "BOOL", "F32"]);
    assert_eq!(ints.tensor("x").unwrap().to_vec(), [0.5, -2.0]);
}
