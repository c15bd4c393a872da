//! Checkpoints: round trip of weights and training state, refusal of missing, unexpected,
//! misshapen, mistyped, corrupt and truncated files (naming file and tensor, model untouched),
//! PyTorch-style f16/bf16/f64 exports, and atomicity (failed writer, stray temp files, a crash
//! between the two files, and a process killed while saving). Key mapping and non-strict loads
//! of PyTorch-named files into a GPT, integer tensors as `Indices`, typed training state,
//! state files in the format written before the state was typed, the state file's checksum
//! (and files without one), and optimizer and scaler state holding NaN and ±inf.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use amp_core::checkpoint::{
    LoadOptions, LoadReport, STATE_FILE, StoredTensor, TensorFile, TrainingState, checkpoint_exists, load_checkpoint,
    load_weights, load_weights_with, read_checkpoint_state, read_tensors, read_weights, save_checkpoint, save_tensors,
    save_weights, write_atomic, write_atomic_with,
};
use amp_core::data::{DataLoader, Dataset};
use amp_core::nn::{Gpt, GptConfig};
use amp_core::optim::{AdamState, AdamW, Bf16OptimizerState, Optim, OptimizerState, Sgd, SgdState};
use amp_core::scaler::{GradScaler, GradScalerState};
use amp_core::{Indices, Param, Params, Rng, Tensor, bf16};
use safetensors::tensor::Dtype;
use serde_json::Value;

#[derive(Params)]
struct Linear {
    weight: Param,
    bias: Param,
}

#[derive(Params)]
struct Net {
    embed: Param,
    layers: Vec<Linear>,
    #[param(skip)]
    _config: usize,
}

fn net(seed: u64, widths: &[usize]) -> Net {
    let mut rng = Rng::seed(seed);
    let layers = widths
        .windows(2)
        .map(|w| Linear {
            weight: Param::new(Tensor::randn(&[w[1], w[0]], &mut rng)),
            bias: Param::new(Tensor::randn(&[w[1]], &mut rng)),
        })
        .collect();
    Net { embed: Param::new(Tensor::randn(&[5, widths[0]], &mut rng)), layers, _config: 0 }
}

fn values(model: &impl Params) -> Vec<(String, Vec<f32>)> {
    model.named_params().into_iter().map(|(n, p)| (n, p.to_vec())).collect()
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("checkpoint_files").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

struct Count(usize);
impl Dataset for Count {
    type Sample = usize;
    fn len(&self) -> usize {
        self.0
    }
    fn get(&self, i: usize) -> usize {
        i
    }
}

fn full_state(step: u64) -> TrainingState {
    let mut loader = DataLoader::new(Count(100), 8, 5).unwrap();
    for _ in 0..17 {
        loader.next_indices();
    }
    let mut rng = Rng::seed(9);
    rng.next_u64();
    let mut state = TrainingState::new(step);
    state.loader = Some(loader.position());
    state.rng = Some(rng);
    state.optimizer = serde_json::json!({"kind": "adamw", "step": step, "exp_avg": {"embed": [0.5, -0.25]}});
    state.scaler = serde_json::json!({"scale": 32768.0, "growth_tracker": 7});
    state.extra = serde_json::json!({"precision": "f16"});
    state
}

#[test]
fn round_trip_restores_weights_and_state_and_keeps_one_pair() {
    let dir = fresh_dir("round_trip");
    let model = net(1, &[4, 8, 3]);
    let files = save_checkpoint(&dir, &model, &full_state(100)).unwrap();
    assert_eq!(files.weights, dir.join("model-00000100.safetensors"));
    assert!(checkpoint_exists(&dir));

    let mut other = net(2, &[4, 8, 3]);
    assert_ne!(values(&other), values(&model));
    let state: TrainingState = load_checkpoint(&dir, &mut other).unwrap();
    assert_eq!(values(&other), values(&model));
    assert_eq!(state, full_state(100));
    let names: Vec<String> = read_weights(&files.weights).unwrap().into_keys().collect();
    assert_eq!(names, ["embed", "layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]);

    // A second save commits a new pair and removes the old weights.
    let model2 = net(3, &[4, 8, 3]);
    save_checkpoint(&dir, &model2, &full_state(200)).unwrap();
    assert_eq!(files_in(&dir), ["model-00000200.safetensors", STATE_FILE]);
    let state: TrainingState = load_checkpoint(&dir, &mut other).unwrap();
    assert_eq!((state.step, values(&other)), (200, values(&model2)));
    // Saving the same step again never overwrites the live weights file.
    let files = save_checkpoint(&dir, &model, &full_state(200)).unwrap();
    assert_eq!(files.weights, dir.join("model-00000200-1.safetensors"));
    assert_eq!(files_in(&dir), ["model-00000200-1.safetensors", STATE_FILE]);
    let _: TrainingState = load_checkpoint(&dir, &mut other).unwrap();
    assert_eq!(values(&other), values(&model));
}

/// Asserts the load fails with a message containing every `needle`, and leaves `model` as it was.
#[track_caller]
fn assert_refused(path: &Path, model: &mut Net, needles: &[&str]) {
    let before = values(model);
    let err = load_weights(path, model).unwrap_err().to_string();
    for needle in needles {
        assert!(err.contains(needle), "error {err:?} lacks {needle:?}");
    }
    assert_eq!(values(model), before, "a refused load changed the model");
}

#[test]
fn mismatched_files_are_refused_naming_file_and_tensor() {
    let dir = fresh_dir("mismatch");
    let path = dir.join("w.safetensors");
    save_weights(&path, &net(1, &[4, 8, 3])).unwrap();
    let file = path.to_str().unwrap();

    // The model has a layer the file lacks.
    assert_refused(&path, &mut net(2, &[4, 8, 3, 2]), &[file, "tensor `layers.2.weight` is missing"]);
    // The file has a layer the model lacks.
    assert_refused(&path, &mut net(2, &[4, 8]), &[file, "unexpected tensor `layers.1.bias`"]);
    // Same names, other shapes.
    assert_refused(
        &path,
        &mut net(2, &[4, 6, 3]),
        &[file, "tensor `layers.0.weight` has shape [8, 4] in the file, but the model's parameter has shape [6, 4]"],
    );

    // A tensor of integers under a parameter's name.
    let mut tensors = read_weights(&path).unwrap();
    let bias = tensors.remove("layers.1.bias").unwrap();
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = Vec::new();
    let owned: Vec<(String, Vec<usize>, Vec<u8>, Dtype)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shape.clone(), t.values.iter().flat_map(|v| v.to_le_bytes()).collect(), Dtype::F32))
        .chain(std::iter::once((
            "layers.1.bias".to_string(),
            bias.shape.clone(),
            bias.values.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect(),
            Dtype::I32,
        )))
        .collect();
    for (n, shape, bytes, dtype) in &owned {
        views.push((n.clone(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap()));
    }
    let int_path = dir.join("int.safetensors");
    std::fs::write(&int_path, safetensors::serialize(views, None).unwrap()).unwrap();
    assert_refused(
        &int_path,
        &mut net(2, &[4, 8, 3]),
        &[int_path.to_str().unwrap(), "tensor `layers.1.bias` holds I32 values; parameters are floating point"],
    );
    let err = read_weights(&int_path).unwrap_err().to_string();
    assert!(err.contains("`layers.1.bias` holds I32 values") && err.contains("read_tensors"), "{err}");
}

#[test]
fn corrupt_and_truncated_files_are_refused() {
    let dir = fresh_dir("corrupt");
    let path = dir.join("w.safetensors");
    save_weights(&path, &net(1, &[4, 8, 3])).unwrap();
    let good = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let file = path.to_str().unwrap();
    let mut model = net(2, &[4, 8, 3]);

    // A flipped bit inside tensor data: the format cannot see it, the checksum can.
    for offset in [8 + header_len, 8 + header_len + 37, good.len() - 1] {
        let mut bad = good.clone();
        bad[offset] ^= 0x04;
        std::fs::write(&path, &bad).unwrap();
        assert_refused(&path, &mut model, &[file, "is corrupt (its header or tensor data changed): checksum"]);
    }
    // Truncated anywhere: in the data, in the header, in the length prefix, empty.
    for len in [good.len() - 1, good.len() / 2, 8 + header_len / 2, 5, 0] {
        std::fs::write(&path, &good[..len]).unwrap();
        assert_refused(&path, &mut model, &[file, "not a valid safetensors file (truncated or corrupt)"]);
    }
    // Garbage in the JSON header.
    let mut bad = good.clone();
    bad[9] = b'#';
    std::fs::write(&path, &bad).unwrap();
    assert_refused(&path, &mut model, &[file, "not a valid safetensors file", "invalid JSON in header"]);
    // A header length pointing past the end.
    let mut bad = good.clone();
    bad[..8].copy_from_slice(&(header_len as u64 + 64).to_le_bytes());
    std::fs::write(&path, &bad).unwrap();
    assert_refused(&path, &mut model, &[file, "not a valid safetensors file"]);
    // Missing file.
    let missing = dir.join("nope.safetensors");
    assert_refused(&missing, &mut model, &[missing.to_str().unwrap(), "cannot read the weights"]);

    // The intact file still loads.
    std::fs::write(&path, &good).unwrap();
    load_weights(&path, &mut model).unwrap();
    assert_eq!(values(&model), values(&net(1, &[4, 8, 3])));
}

#[test]
fn an_edited_header_is_refused_by_the_checksum() {
    // Two tensors of the same size: swapping their offsets gives a valid safetensors file
    // that would load with the tensors swapped.
    let dir = fresh_dir("edited_header");
    let path = dir.join("w.safetensors");
    save_weights(&path, &net(1, &[4, 4, 4])).unwrap();
    let good = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&good[8..8 + header_len]).unwrap();
    let (a, b) = ("layers.0.weight", "layers.1.weight");
    let (oa, ob) = (header[a]["data_offsets"].clone(), header[b]["data_offsets"].clone());
    assert_ne!(oa, ob);
    header[a]["data_offsets"] = ob;
    header[b]["data_offsets"] = oa;
    let mut text = serde_json::to_string(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut bad = (text.len() as u64).to_le_bytes().to_vec();
    bad.extend(text.as_bytes());
    bad.extend(&good[8 + header_len..]);
    std::fs::write(&path, &bad).unwrap();
    let (st, orig) =
        (safetensors::SafeTensors::deserialize(&bad).unwrap(), safetensors::SafeTensors::deserialize(&good).unwrap());
    assert_eq!(st.tensor(a).unwrap().data(), orig.tensor(b).unwrap().data(), "valid to the format, swapped");
    let mut model = net(2, &[4, 4, 4]);
    assert_refused(&path, &mut model, &[path.to_str().unwrap(), "is corrupt (its header or tensor data changed)"]);
    // The intact file loads.
    std::fs::write(&path, &good).unwrap();
    load_weights(&path, &mut model).unwrap();
    assert_eq!(values(&model), values(&net(1, &[4, 4, 4])));
}

#[test]
fn corrupt_state_files_are_refused() {
    let dir = fresh_dir("corrupt_state");
    save_checkpoint(&dir, &net(1, &[4, 3]), &full_state(7)).unwrap();
    let state_path = dir.join(STATE_FILE);
    let good = std::fs::read_to_string(&state_path).unwrap();
    let mut model = net(2, &[4, 3]);
    let check = |text: &str, needle: &str, model: &mut Net| {
        std::fs::write(&state_path, text).unwrap();
        let before = values(model);
        let err = load_checkpoint::<Value, Value, Value, _>(&dir, model).unwrap_err().to_string();
        assert!(err.contains(state_path.to_str().unwrap()) && err.contains(needle), "{err}");
        assert_eq!(values(model), before);
    };
    check(&good[..good.len() / 2], "not a valid checkpoint state", &mut model);
    // The version is checked before the checksum (a later version may compute it otherwise).
    check(&good.replace("\"version\": 1", "\"version\": 9"), "version 9", &mut model);
    // Edits the checksum refuses (see `a_state_file_with_one_changed_digit_is_refused_naming_it`);
    // without it, as earlier versions wrote the file, the other checks refuse them.
    let edited = good.replace("model-00000007.safetensors", "../elsewhere.safetensors");
    check(&edited, "was modified or corrupted", &mut model);
    check(&without_checksum(&edited), "not a checkpoint weights file", &mut model);
    // The state names a weights file that is gone.
    check(
        &without_checksum(&good.replace("model-00000007.safetensors", "model-00000008.safetensors")),
        "names weights file `model-00000008.safetensors`, which does not exist",
        &mut model,
    );
    std::fs::write(&state_path, &good).unwrap();
    let state: TrainingState = load_checkpoint(&dir, &mut model).unwrap();
    assert_eq!(state.step, 7);
}

/// Writes a safetensors file the way `safetensors.torch.save_file` does (metadata
/// `format = pt`, no checksum), with each tensor converted by `encode`.
fn pytorch_style_file(path: &Path, model: &impl Params, dtype: Dtype, encode: impl Fn(f32) -> Vec<u8>) {
    let owned: Vec<(String, Vec<usize>, Vec<u8>)> = model
        .named_params()
        .into_iter()
        .map(|(n, p)| (n, p.shape().to_vec(), p.to_vec().into_iter().flat_map(&encode).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, s, b)| (n.clone(), safetensors::tensor::TensorView::new(dtype, s.clone(), b).unwrap()))
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    std::fs::write(path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
}

/// A file dtype, its name, how a value is encoded, and the f32 it should load as.
type ExportCase = (Dtype, &'static str, fn(f32) -> Vec<u8>, fn(f32) -> f32);

#[test]
fn pytorch_exports_in_f32_f16_bf16_f64_load() {
    let dir = fresh_dir("pytorch");
    let source = net(4, &[4, 8, 3]);
    let cases: [ExportCase; 4] = [
        (Dtype::F32, "f32", |v| v.to_le_bytes().to_vec(), |v| v),
        (Dtype::F16, "f16", |v| half::f16::from_f32(v).to_le_bytes().to_vec(), |v| half::f16::from_f32(v).to_f32()),
        (Dtype::BF16, "bf16", |v| half::bf16::from_f32(v).to_le_bytes().to_vec(), |v| half::bf16::from_f32(v).to_f32()),
        (Dtype::F64, "f64", |v| f64::from(v).to_le_bytes().to_vec(), |v| v),
    ];
    for (dtype, name, encode, round) in cases {
        let path = dir.join(format!("{name}.safetensors"));
        pytorch_style_file(&path, &source, dtype, encode);
        let mut model = net(5, &[4, 8, 3]);
        load_weights(&path, &mut model).unwrap();
        for ((n, got), (_, want)) in values(&model).iter().zip(values(&source)) {
            let want: Vec<f32> = want.iter().map(|&v| round(v)).collect();
            assert_eq!(got, &want, "{name}: {n}");
        }
        assert!(read_weights(&path).unwrap().values().all(|t| t.file_dtype == format!("{dtype:?}")));
    }
}

#[test]
fn failed_writer_and_stray_temp_files_leave_the_previous_checkpoint() {
    let dir = fresh_dir("atomic");
    let model = net(1, &[4, 8, 3]);
    save_checkpoint(&dir, &model, &full_state(10)).unwrap();
    let before = files_in(&dir);

    // A writer that fails halfway: the error names the file, the temp file is removed and
    // the target is untouched.
    let target = dir.join(STATE_FILE);
    let old = std::fs::read(&target).unwrap();
    let err = write_atomic_with(&target, |f| {
        use std::io::Write;
        f.write_all(b"{\"half\": ")?;
        Err(std::io::Error::other("disk full"))
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains(STATE_FILE) && err.contains("disk full") && err.contains("previous file is untouched"),
        "{err}"
    );
    assert_eq!(std::fs::read(&target).unwrap(), old);
    assert_eq!(files_in(&dir), before);

    // What a crash leaves: a half-written temp file, and new weights that were never committed
    // (the process died between the weights and the state file).
    std::fs::write(dir.join(".training_state.json.tmp-999-0"), b"{\"format\": \"amp-chec").unwrap();
    save_weights(dir.join("model-00000020.safetensors"), &net(7, &[4, 8, 3])).unwrap();
    let mut loaded = net(2, &[4, 8, 3]);
    assert_eq!(load_checkpoint::<Value, Value, Value, _>(&dir, &mut loaded).unwrap(), full_state(10));
    assert_eq!(values(&loaded), values(&model));

    // The next save clears both leftovers.
    save_checkpoint(&dir, &model, &full_state(30)).unwrap();
    assert_eq!(files_in(&dir), ["model-00000030.safetensors", STATE_FILE]);

    // write_atomic into a directory that does not exist fails, naming the temp file's place.
    let err = write_atomic(&dir.join("missing/x.json"), b"{}").unwrap_err().to_string();
    assert!(err.contains("missing"), "{err}");
}

const CHILD_ENV: &str = "AMP_CHECKPOINT_CRASH_DIR";

/// The child of `killed_while_saving_leaves_a_loadable_checkpoint`: saves a ~4 MB model whose
/// every value is the step, over and over, until killed.
#[test]
#[ignore = "helper process, run by killed_while_saving_leaves_a_loadable_checkpoint"]
fn crash_child_saves_forever() {
    let dir = PathBuf::from(std::env::var(CHILD_ENV).expect("run by the parent test"));
    let mut model =
        Linear { weight: Param::new(Tensor::zeros(&[1000, 1000])), bias: Param::new(Tensor::zeros(&[1000])) };
    for step in 1u64.. {
        for (_, p) in model.named_params_mut() {
            p.data_mut().fill(step as f32);
        }
        save_checkpoint(&dir, &model, &TrainingState::new(step)).unwrap();
        println!("saved {step}");
    }
}

#[test]
fn killed_while_saving_leaves_a_loadable_checkpoint() {
    use std::io::{BufRead, BufReader};
    let exe = std::env::current_exe().unwrap();
    for (round, delay_ms) in [3u64, 17, 41, 90].into_iter().enumerate() {
        let dir = fresh_dir(&format!("crash_{round}"));
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "checkpoint_files::crash_child_saves_forever",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Wait for a first complete save, then kill at an arbitrary point of a later one.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        loop {
            let line = lines.next().expect("child exited before saving").unwrap();
            if line.starts_with("saved") {
                break;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();

        let (state, weights): (TrainingState, _) = read_checkpoint_state(&dir).unwrap();
        let mut model =
            Linear { weight: Param::new(Tensor::zeros(&[1000, 1000])), bias: Param::new(Tensor::zeros(&[1000])) };
        let loaded: TrainingState = load_checkpoint(&dir, &mut model).unwrap();
        assert_eq!(loaded, state);
        assert!(state.step >= 1);
        // Weights and state belong to the same save.
        for (name, p) in model.named_params() {
            assert!(
                p.to_vec().iter().all(|&v| v == state.step as f32),
                "round {round}: {name} is not from step {}",
                state.step
            );
        }
        assert!(weights.exists());
    }
}

// ---- key mapping and non-strict loads ------------------------------------------------------

/// Writes a safetensors file as PyTorch would (metadata `format = pt`, no checksum).
fn write_plain(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    std::fs::write(path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn gpt(seed: u64) -> Gpt {
    let cfg = GptConfig { vocab_size: 7, block_size: 5, d_model: 8, n_layers: 2, n_heads: 2, dropout: 0.0 };
    Gpt::new(cfg, &mut Rng::seed(seed))
}

/// The name a PyTorch GPT of another layout gives a parameter of `amp_core::nn::Gpt`, behind a
/// `model.` prefix (a Lightning module): `tok.weight`, `ln.bias`, `blocks.0.fc1.weight`, ...
fn pytorch_name(ours: &str) -> String {
    let name = ours
        .replace("tok_emb.", "tok.")
        .replace("pos_emb.", "pos.")
        .replace("ln_f.", "ln.")
        .replace(".mlp.fc.", ".fc1.")
        .replace(".mlp.proj.", ".fc2.");
    format!("model.{name}")
}

/// `source`'s parameters under PyTorch names, minus `skip`, plus each block's causal-mask
/// buffer (BOOL) and `extra` tensors.
fn pytorch_gpt_file(path: &Path, source: &Gpt, skip: &[&str], extra: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = source
        .named_params()
        .into_iter()
        .filter(|(n, _)| !skip.contains(&n.as_str()))
        .map(|(n, p)| (pytorch_name(&n), Dtype::F32, p.shape().to_vec(), f32_bytes(p.data())))
        .collect();
    for i in 0..source.blocks.len() {
        let mask: Vec<u8> = (0..25).map(|k| u8::from(k % 5 > k / 5)).collect();
        tensors.push((format!("model.blocks.{i}.attn.mask"), Dtype::BOOL, vec![5, 5], mask));
    }
    tensors.extend(extra.iter().cloned());
    write_plain(path, &tensors);
}

/// The mapping from `pytorch_name`s to ours, built from the conveniences.
fn gpt_mapping() -> LoadOptions {
    LoadOptions::new()
        .strip_prefix("model.")
        .rename("tok", "tok_emb")
        .rename("pos", "pos_emb")
        .rename("ln", "ln_f")
        .rename("fc1", "mlp.fc")
        .rename("fc2", "mlp.proj")
        .map_keys(|n| (!n.ends_with(".attn.mask")).then(|| n.to_string()))
}

#[test]
fn a_pytorch_named_gpt_loads_through_a_key_mapping() {
    let dir = fresh_dir("mapping");
    let path = dir.join("gpt.safetensors");
    let source = gpt(1);
    let names: Vec<String> = source.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names[..8],
        [
            "tok_emb.weight",
            "pos_emb.weight",
            "blocks.0.ln1.weight",
            "blocks.0.ln1.bias",
            "blocks.0.attn.qkv.weight",
            "blocks.0.attn.qkv.bias",
            "blocks.0.attn.proj.weight",
            "blocks.0.attn.proj.bias"
        ]
    );
    assert!(names.contains(&"blocks.1.mlp.fc.weight".to_string()) && names.contains(&"ln_f.bias".to_string()));
    pytorch_gpt_file(&path, &source, &[], &[]);
    let file_names: Vec<String> = read_tensors(&path).unwrap().names().map(str::to_string).collect();
    assert!(file_names.contains(&"model.blocks.0.fc1.weight".to_string()), "{file_names:?}");
    assert!(
        file_names.contains(&"model.ln.weight".to_string()) && file_names.contains(&"model.tok.weight".to_string())
    );

    // Names as they are: a strict load refuses, naming what is missing and unexpected.
    let mut model = gpt(2);
    let before = values(&model);
    let err = load_weights(&path, &mut model).unwrap_err().to_string();
    for needle in [
        path.to_str().unwrap(),
        "tensor `tok_emb.weight` is missing: the model has this parameter (shape [7, 8]), the file does not",
        "unexpected tensor `model.blocks.0.attn.mask`: the model has no parameter of that name",
        "and 24 more missing parameters",
        "and 26 more unexpected tensors",
        "strict(false)",
        "(nothing was loaded)",
    ] {
        assert!(err.contains(needle), "{err:?} lacks {needle:?}");
    }
    assert_eq!(values(&model), before);

    // Mapped, strictly: everything loads; the dropped buffers are reported.
    let report = load_weights_with(&path, &mut model, &gpt_mapping()).unwrap();
    assert_eq!(
        report,
        LoadReport {
            loaded: names.len(),
            missing: vec![],
            unexpected: vec![],
            dropped: vec!["model.blocks.0.attn.mask".into(), "model.blocks.1.attn.mask".into()],
        }
    );
    assert!(report.is_exact());
    assert_eq!(values(&model), values(&source));

    // The same mapping as one hook.
    let hook = LoadOptions::new().map_keys(|name| {
        let name = name.strip_prefix("model.").unwrap_or(name);
        if name.ends_with(".attn.mask") {
            return None;
        }
        let mut parts: Vec<String> = name.split('.').map(str::to_string).collect();
        match parts.as_slice() {
            [first, ..] if first == "tok" || first == "pos" || first == "ln" => {
                parts[0] = format!("{}{}", parts[0], if parts[0] == "ln" { "_f" } else { "_emb" });
            }
            [b, _, fc, ..] if b == "blocks" && (fc == "fc1" || fc == "fc2") => {
                parts[2] = if fc == "fc1" { "mlp.fc".into() } else { "mlp.proj".into() };
            }
            _ => {}
        }
        Some(parts.join("."))
    });
    let mut other = gpt(3);
    assert_eq!(load_weights_with(&path, &mut other, &hook).unwrap(), report);
    assert_eq!(values(&other), values(&source));
}

#[test]
fn a_non_strict_load_reports_missing_and_unexpected_tensors() {
    let dir = fresh_dir("non_strict");
    let path = dir.join("gpt.safetensors");
    let source = gpt(1);
    let extra = [
        ("model.lm_head.weight".to_string(), Dtype::F32, vec![7, 8], f32_bytes(&[0.25; 56])),
        ("model.step_count".to_string(), Dtype::I64, vec![1], 41i64.to_le_bytes().to_vec()),
    ];
    pytorch_gpt_file(&path, &source, &["head.bias", "ln_f.bias"], &extra);

    // Strict: refused, every mismatch named with its mapped name, the model untouched.
    let mut model = gpt(2);
    let before = values(&model);
    let err = load_weights_with(&path, &mut model, &gpt_mapping()).unwrap_err().to_string();
    for needle in [
        path.to_str().unwrap(),
        "tensor `ln_f.bias` is missing: the model has this parameter (shape [8]), the file does not",
        "tensor `head.bias` is missing: the model has this parameter (shape [7]), the file does not",
        "unexpected tensor `model.lm_head.weight` (mapped to `lm_head.weight`): the model has no parameter",
        "unexpected tensor `model.step_count` (mapped to `step_count`)",
        "LoadOptions::new().strict(false)",
        "(nothing was loaded)",
    ] {
        assert!(err.contains(needle), "{err:?} lacks {needle:?}");
    }
    assert_eq!(values(&model), before);

    // Not strict: the rest loads, the missing parameters keep their values.
    let report = load_weights_with(&path, &mut model, &gpt_mapping().strict(false)).unwrap();
    assert_eq!(report.missing, ["ln_f.bias", "head.bias"], "model names, in the model's order");
    assert_eq!(report.unexpected, ["model.lm_head.weight", "model.step_count"], "file names, sorted");
    assert_eq!(report.dropped.len(), 2);
    assert_eq!(report.loaded, before.len() - 2);
    assert!(!report.is_exact());
    let text = report.to_string();
    assert!(text.starts_with(&format!("loaded {} tensors; missing 2 (`ln_f.bias`, `head.bias`)", report.loaded)));
    assert!(text.contains("unexpected 2 (`model.lm_head.weight`, `model.step_count`)"), "{text}");
    for ((name, got), ((_, want), (_, old))) in values(&model).iter().zip(values(&source).iter().zip(&before)) {
        let expected = if name == "ln_f.bias" || name == "head.bias" { old } else { want };
        assert_eq!(got, expected, "{name}");
    }
}

#[test]
fn collisions_bad_shapes_and_integer_parameters_refuse_even_a_non_strict_load() {
    let dir = fresh_dir("refused_mapping");
    let source = gpt(1);
    let mut model = gpt(2);
    let before = values(&model);
    let lenient = gpt_mapping().strict(false);

    // `model.head.bias` and `head.bias` both become `head.bias`.
    let path = dir.join("collision.safetensors");
    pytorch_gpt_file(&path, &source, &[], &[("head.bias".into(), Dtype::F32, vec![7], f32_bytes(&[1.0; 7]))]);
    let err = load_weights_with(&path, &mut model, &lenient).unwrap_err().to_string();
    assert!(err.contains(path.to_str().unwrap()), "{err}");
    assert!(err.contains("tensors `head.bias` and `model.head.bias` both map to `head.bias`"), "{err}");
    assert_eq!(values(&model), before);

    // A wrong shape: refused naming both shapes, and no other tensor was written.
    let path = dir.join("shape.safetensors");
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = source
        .named_params()
        .into_iter()
        .map(|(n, p)| (pytorch_name(&n), Dtype::F32, p.shape().to_vec(), f32_bytes(p.data())))
        .collect();
    let head = tensors.iter_mut().find(|t| t.0 == "model.head.weight").unwrap();
    (head.2, head.3) = (vec![8, 7], f32_bytes(&[0.5; 56]));
    write_plain(&path, &tensors);
    let err = load_weights_with(&path, &mut model, &lenient).unwrap_err().to_string();
    assert!(
        err.contains(
            "tensor `model.head.weight` (mapped to `head.weight`) has shape [8, 7] in the file, but the model's \
             parameter has shape [7, 8]"
        ),
        "{err}"
    );
    assert_eq!(values(&model), before, "the tensors that matched were not written either");

    // Integers under a parameter's name.
    let path = dir.join("int.safetensors");
    let ln = tensors.iter_mut().find(|t| t.0 == "model.ln.bias").unwrap();
    (ln.1, ln.3) = (Dtype::I64, (0..8i64).flat_map(|v| v.to_le_bytes()).collect());
    let head = tensors.iter_mut().find(|t| t.0 == "model.head.weight").unwrap();
    (head.2, head.3) = (vec![7, 8], f32_bytes(&[0.5; 56]));
    write_plain(&path, &tensors);
    let err = load_weights_with(&path, &mut model, &lenient).unwrap_err().to_string();
    assert!(
        err.contains("tensor `model.ln.bias` (mapped to `ln_f.bias`) holds I64 values; parameters are floating point"),
        "{err}"
    );
    assert_eq!(values(&model), before);

    // A file saved from a wrapped model: the strict error suggests the prefix to strip.
    let path = dir.join("prefixed.safetensors");
    let prefixed: Vec<_> = source
        .named_params()
        .into_iter()
        .map(|(n, p)| (format!("module.{n}"), Dtype::F32, p.shape().to_vec(), f32_bytes(p.data())))
        .collect();
    write_plain(&path, &prefixed);
    let err = load_weights(&path, &mut model).unwrap_err().to_string();
    assert!(err.contains(r#"LoadOptions::strip_prefix("module.") removes it"#), "{err}");
    assert_eq!(values(&model), before);
    let report = load_weights_with(&path, &mut model, &LoadOptions::new().strip_prefix("module.")).unwrap();
    assert!(report.is_exact() && report.dropped.is_empty());
    assert_eq!(values(&model), values(&source));
}

// ---- integer tensors -----------------------------------------------------------------------

#[test]
fn integer_tensors_read_as_indices() {
    let dir = fresh_dir("integers");
    let path = dir.join("ints.safetensors");
    let le = |v: &[i64], size: usize| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()[..size].to_vec()).collect() };
    let signed = [-3i64, 0, 7, -128, 127, 100];
    let tensors = vec![
        ("i64".to_string(), Dtype::I64, vec![2, 2], le(&[-1, 5_000_000_000, i64::MIN, i64::MAX], 8)),
        ("i32".to_string(), Dtype::I32, vec![6], le(&[-3, 0, 7, -128, 127, i64::from(i32::MIN)], 4)),
        ("i16".to_string(), Dtype::I16, vec![3, 2], le(&signed, 2)),
        ("i8".to_string(), Dtype::I8, vec![6], le(&signed, 1)),
        ("u8".to_string(), Dtype::U8, vec![3], vec![0, 200, 255]),
        ("u16".to_string(), Dtype::U16, vec![2], le(&[65535, 1], 2)),
        ("u32".to_string(), Dtype::U32, vec![1], le(&[4_000_000_000], 4)),
        ("u64".to_string(), Dtype::U64, vec![1], le(&[i64::MAX], 8)),
        ("mask".to_string(), Dtype::BOOL, vec![2, 2], vec![1, 0, 0, 1]),
        ("x".to_string(), Dtype::F32, vec![2], f32_bytes(&[0.5, -1.5])),
        ("empty".to_string(), Dtype::I64, vec![0, 3], vec![]),
    ];
    write_plain(&path, &tensors);
    let file = read_tensors(&path).unwrap();
    assert_eq!(file.path(), Some(path.as_path()));
    assert_eq!(file.len(), tensors.len());
    let ints = |n: &str| file.indices(n).unwrap();
    assert_eq!(ints("i64"), Indices::from_vec(vec![-1, 5_000_000_000, i64::MIN, i64::MAX], &[2, 2]));
    assert_eq!(ints("i32").to_vec(), [-3, 0, 7, -128, 127, i64::from(i32::MIN)]);
    assert_eq!(ints("i16"), Indices::from_vec(signed.to_vec(), &[3, 2]));
    assert_eq!(ints("i8").to_vec(), signed);
    assert_eq!(ints("u8").to_vec(), [0, 200, 255]);
    assert_eq!(ints("u16").to_vec(), [65535, 1]);
    assert_eq!(ints("u32").to_vec(), [4_000_000_000]);
    assert_eq!(ints("u64").to_vec(), [i64::MAX]);
    assert_eq!(ints("mask"), Indices::from_vec(vec![1, 0, 0, 1], &[2, 2]));
    assert_eq!(ints("empty").shape(), &[0, 3]);
    assert_eq!(file.get("i32").unwrap().file_dtype(), "I32");
    assert_eq!(file.get("mask").unwrap().file_dtype(), "BOOL");
    assert_eq!(file.tensor("x").unwrap().to_vec(), [0.5, -1.5]);
    assert_eq!(file.get("x").unwrap().shape(), &[2]);

    // Asking for the wrong kind, or a name that is not there, names the file and the tensor.
    let file_name = path.to_str().unwrap();
    let err = file.tensor("i32").unwrap_err().to_string();
    assert!(err.contains(file_name) && err.contains("tensor `i32` holds I32 values (integers)"), "{err}");
    let err = file.indices("x").unwrap_err().to_string();
    assert!(err.contains(file_name) && err.contains("tensor `x` holds F32 values (floating point)"), "{err}");
    let err = file.indices("labels").unwrap_err().to_string();
    assert!(err.contains("there is no tensor `labels` (the tensors are `empty`, `i16`"), "{err}");
    // read_weights wants parameters: the first integer tensor is refused.
    let err = read_weights(&path).unwrap_err().to_string();
    assert!(err.contains("tensor `empty` holds I64 values; parameters are floating point"), "{err}");

    // Values an i64 cannot hold, bytes that are no bool, and dtypes not read here.
    let refused = |name: &str, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>, needle: &str| {
        let path = dir.join(format!("{name}.safetensors"));
        write_plain(&path, &[(name.to_string(), dtype, shape, bytes)]);
        let err = read_tensors(&path).unwrap_err().to_string();
        assert!(err.contains(path.to_str().unwrap()) && err.contains(needle), "{err:?} lacks {needle:?}");
    };
    let mut big = 1u64.to_le_bytes().to_vec();
    big.extend(u64::MAX.to_le_bytes());
    refused("big", Dtype::U64, vec![2], big, "tensor `big` (U64) holds 18446744073709551615 at position 1");
    refused("flags", Dtype::BOOL, vec![3], vec![1, 0, 2], "tensor `flags` is BOOL but holds the byte 2 at position 2");
    refused("fp8", Dtype::F8_E4M3, vec![2], vec![0, 0], "tensor `fp8` has dtype F8_E4M3, which is not read here");
}

#[test]
fn a_dataset_of_floats_and_integers_round_trips() {
    let dir = fresh_dir("dataset");
    let path = dir.join("data.safetensors");
    let mut rng = Rng::seed(3);
    let x = Tensor::<f32>::randn(&[6, 4], &mut rng);
    let y = Indices::from_vec(vec![0, 2, 1, -100, 2, 5_000_000_000], &[6]);
    let mut data = TensorFile::new();
    assert!(data.is_empty());
    data.insert("x", &x);
    data.insert("y", &y);
    assert!(data.insert("z", Indices::from_vec(vec![1], &[1])).is_none());
    assert!(matches!(data.insert("z", Indices::from_vec(vec![2], &[1])), Some(StoredTensor::Int { .. })));
    assert!(data.remove("z").is_some());
    save_tensors(&path, &data).unwrap();
    let back = read_tensors(&path).unwrap();
    assert_eq!(back.names().collect::<Vec<_>>(), ["x", "y"]);
    assert_eq!(back.tensor("x").unwrap().to_vec(), x.to_vec());
    assert_eq!(back.tensor("x").unwrap().shape(), &[6, 4]);
    assert_eq!(back.indices("y").unwrap(), y);
    assert_eq!(back.tensors(), data.tensors());
    assert_eq!(std::fs::read(&path).unwrap(), data.to_bytes(), "deterministic bytes");

    // The format's own parser reads it: I64 first (8-byte aligned), then F32.
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!((st.tensor("y").unwrap().dtype(), st.tensor("x").unwrap().dtype()), (Dtype::I64, Dtype::F32));
    // Written with the checksum: a flipped bit in the labels is refused.
    let mut bad = bytes.clone();
    let header_len = u64::from_le_bytes(bad[..8].try_into().unwrap()) as usize;
    bad[8 + header_len + 3] ^= 0x01;
    std::fs::write(&path, &bad).unwrap();
    let err = read_tensors(&path).unwrap_err().to_string();
    assert!(err.contains("is corrupt (its header or tensor data changed): checksum"), "{err}");
}

// ---- typed training state ------------------------------------------------------------------

/// What a run keeps besides optimizer and scaler.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct RunInfo {
    name: String,
    lr: f64,
}

/// Net(1) after one AdamW step with a GradScaler, and the optimizer and scaler.
fn stepped(seed: u64) -> (Net, Optim<AdamW>, GradScaler) {
    let mut model = net(seed, &[4, 3]);
    let mut opt = Optim::new(AdamW::new(1e-2)).unwrap();
    let mut scaler = GradScaler::new();
    let loss = model.layers[0].weight.tensor().mul(&model.embed.tensor().sum_all()).sum_all();
    let grads = scaler.scale(loss).backward().unscale();
    grads.step(&mut opt, &mut model).update().unwrap();
    (model, opt, scaler)
}

type Typed = TrainingState<OptimizerState<AdamState>, GradScalerState, RunInfo>;

#[test]
fn typed_state_round_trips_and_a_part_of_another_type_is_refused_naming_it() {
    let dir = fresh_dir("typed");
    let (model, opt, scaler) = stepped(1);
    let info = RunInfo { name: "typed".into(), lr: 1e-2 };
    let mut state = TrainingState::with_parts(1, opt.state_dict(), scaler.state_dict(), info.clone());
    state.rng = Some(Rng::seed(4));
    save_checkpoint(&dir, &model, &state).unwrap();

    let mut other = net(2, &[4, 3]);
    let back: Typed = load_checkpoint(&dir, &mut other).unwrap();
    assert_eq!(back, state);
    assert_eq!(values(&other), values(&model));
    let mut opt2 = Optim::new(AdamW::new(1e-2)).unwrap();
    opt2.load_state_dict(back.optimizer).unwrap();
    assert_eq!(opt2.state_dict(), opt.state_dict());
    let mut scaler2 = GradScaler::new();
    scaler2.load_state_dict(&back.scaler).unwrap();
    assert_eq!(scaler2.state_dict(), scaler.state_dict());

    // Untyped, the same file is JSON.
    let (json, _): (TrainingState, _) = read_checkpoint_state(&dir).unwrap();
    assert_eq!(json.optimizer["kind"], "adamw");
    assert_eq!(json.extra, serde_json::json!({"name": "typed", "lr": 0.01}));

    // Another optimizer's, scaler's or run's type: refused naming the part and the file, the
    // model untouched.
    let state_file = dir.join(STATE_FILE);
    let before = values(&other);
    let check = |err: amp_core::Error, needles: &[&str], model: &Net| {
        let err = err.to_string();
        assert!(err.contains(state_file.to_str().unwrap()), "{err}");
        for needle in needles {
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
        assert_eq!(values(model), before);
    };
    let err = load_checkpoint::<OptimizerState<SgdState>, GradScalerState, RunInfo, _>(&dir, &mut other).unwrap_err();
    check(
        err,
        &["`state.optimizer` does not hold a `amp_core::optim::OptimizerState<", "SgdState", "unknown field"],
        &other,
    );
    let err = load_checkpoint::<OptimizerState<AdamState>, (), RunInfo, _>(&dir, &mut other).unwrap_err();
    check(err, &["`state.scaler` does not hold a `()`", "another optimizer, loss scaler or state type"], &other);
    let err = load_checkpoint::<OptimizerState<AdamState>, GradScalerState, u32, _>(&dir, &mut other).unwrap_err();
    check(err, &["`state.extra` does not hold a `u32`"], &other);

    // An SGD checkpoint read as AdamW's.
    let mut sgd = Optim::new(Sgd::new(0.1).momentum(0.9)).unwrap();
    let mut m = net(1, &[4, 3]);
    let loss = m.embed.tensor().sum_all();
    GradScaler::new().scale(loss).backward().unscale().step(&mut sgd, &mut m).update().unwrap();
    save_checkpoint(&dir, &m, &TrainingState::with_parts(1, sgd.state_dict(), (), ())).unwrap();
    let err = read_checkpoint_state::<OptimizerState<AdamState>, (), ()>(&dir).unwrap_err();
    check(err, &["`state.optimizer` does not hold", "AdamState", "unknown field `momentum_buffer`"], &other);
    let (ok, _) = read_checkpoint_state::<OptimizerState<SgdState>, (), ()>(&dir).unwrap();
    assert_eq!(ok.optimizer, sgd.state_dict());
}

/// `training_state.json` as the code before typed state wrote it (optimizer, scaler and extra
/// stored as `serde_json::Value`), for Net-like weights `w` [2, 2] and `b` [2] after one AdamW
/// step with a GradScaler.
const STATE_BEFORE_TYPED: &str = r#"{
  "format": "amp-checkpoint",
  "version": 1,
  "weights": "model-00000001.safetensors",
  "state": {
    "step": 1,
    "loader": {
      "seed": 5,
      "epoch": 0,
      "index": 3,
      "dataset_len": 10,
      "batch_size": 3,
      "drop_last": false,
      "shuffle": true
    },
    "rng": {
      "s": [
        11991771301521844838,
        3273821458927322032,
        18013965594730293714,
        15078123125932622355
      ]
    },
    "optimizer": {
      "kind": "adamw",
      "params": {
        "b": {
          "exp_avg": [
            0.10000000149011612,
            0.10000000149011612
          ],
          "exp_avg_sq": [
            0.0010000000474974513,
            0.0010000000474974513
          ],
          "step": 1
        },
        "w": {
          "exp_avg": [
            0.10000000149011612,
            -0.25,
            0.4000000059604645,
            0.699999988079071
          ],
          "exp_avg_sq": [
            0.0010000000474974513,
            0.006250000558793545,
            0.01600000075995922,
            0.049000002443790436
          ],
          "step": 1
        }
      },
      "steps": 1
    },
    "scaler": {
      "_growth_tracker": 1,
      "backoff_factor": 0.5,
      "growth_factor": 2.0,
      "growth_interval": 2000,
      "scale": 65536.0
    },
    "extra": {
      "note": "before typed state"
    }
  }
}"#;

/// `v` with every non-integer number rounded to f32.
fn as_f32(v: &Value) -> Value {
    match v {
        Value::Number(n) if !(n.is_u64() || n.is_i64()) => Value::from(n.as_f64().unwrap() as f32),
        Value::Array(a) => Value::Array(a.iter().map(as_f32).collect()),
        Value::Object(o) => Value::Object(o.iter().map(|(k, v)| (k.clone(), as_f32(v))).collect()),
        other => other.clone(),
    }
}

#[derive(Params)]
struct WB {
    w: Param,
    b: Param,
}

#[test]
fn state_files_written_before_the_state_was_typed_still_load() {
    let dir = fresh_dir("before_typed");
    let model = WB {
        w: Param::new(Tensor::from_vec(vec![0.5, -1.25, 2.0, 3.5], &[2, 2])),
        b: Param::new(Tensor::from_vec(vec![0.125, -0.0], &[2])),
    };
    save_weights(dir.join("model-00000001.safetensors"), &model).unwrap();
    std::fs::write(dir.join(STATE_FILE), STATE_BEFORE_TYPED).unwrap();

    let mut loaded = WB { w: Param::new(Tensor::zeros(&[2, 2])), b: Param::new(Tensor::zeros(&[2])) };
    let state: TrainingState<OptimizerState<AdamState>, GradScalerState, Value> =
        load_checkpoint(&dir, &mut loaded).unwrap();
    assert_eq!(values(&loaded), values(&model));
    assert_eq!((state.optimizer.kind.as_str(), state.optimizer.steps), ("adamw", 1));
    let w = &state.optimizer.params["w"];
    assert_eq!((w.step, w.exp_avg.clone()), (1, vec![0.1, -0.25, 0.4, 0.7]));
    let sq = [0.0010000000474974513, 0.006250000558793545, 0.01600000075995922, 0.049000002443790436];
    assert_eq!(w.exp_avg_sq, sq.map(|v: f64| v as f32));
    assert_eq!((state.scaler.scale, state.scaler.growth_tracker, state.scaler.hysteresis_tracker), (65536.0, 1, None));
    let loader = state.loader.clone().unwrap();
    assert_eq!((loader.seed, loader.index, loader.dataset_len), (5, 3, 10));
    let mut rng = Rng::seed(9);
    rng.next_u64();
    assert_eq!(state.rng, Some(rng));
    assert_eq!(state.extra, serde_json::json!({"note": "before typed state"}));
    // The optimizer and scaler accept what was read.
    let mut opt = Optim::new(AdamW::new(1e-2)).unwrap();
    opt.load_state_dict(state.optimizer.clone()).unwrap();
    opt.check_params(&loaded).unwrap();
    GradScaler::new().load_state_dict(&state.scaler).unwrap();

    // Saved again from the typed state, the file has the same layout: the same keys and
    // values (f32 fields are now written in f32's shortest form, `0.1` where the JSON values
    // had `0.10000000149011612`: the same f32 either way) plus the file's checksum, and reads
    // back the same.
    save_checkpoint(&dir, &loaded, &state).unwrap();
    let mut again: Value = serde_json::from_slice(&std::fs::read(dir.join(STATE_FILE)).unwrap()).unwrap();
    let before: Value = serde_json::from_str(STATE_BEFORE_TYPED).unwrap();
    assert_eq!(again["weights"], "model-00000001-1.safetensors");
    again["weights"] = before["weights"].clone();
    assert!(again.as_object_mut().unwrap().remove("checksum").is_some_and(|c| c.as_str().unwrap().len() == 16));
    assert_eq!(as_f32(&again), as_f32(&before));
    assert_ne!(again, before, "the f32 values are written shorter");
    let (reread, _): (TrainingState<OptimizerState<AdamState>, GradScalerState, Value>, _) =
        read_checkpoint_state(&dir).unwrap();
    assert_eq!(reread, state);

    // A state without optimizer, scaler and extra (JSON null): fine where the type takes null,
    // refused naming the part where it does not.
    let mut bare = before.clone();
    bare["weights"] = Value::from("model-00000001-1.safetensors");
    for part in ["optimizer", "scaler", "extra"] {
        bare["state"].as_object_mut().unwrap().remove(part);
    }
    std::fs::write(dir.join(STATE_FILE), serde_json::to_vec(&bare).unwrap()).unwrap();
    let (ok, _) = read_checkpoint_state::<Value, (), Option<RunInfo>>(&dir).unwrap();
    assert_eq!((ok.optimizer, ok.extra), (Value::Null, None));
    let err = read_checkpoint_state::<OptimizerState<AdamState>, (), ()>(&dir).unwrap_err().to_string();
    assert!(err.contains(STATE_FILE) && err.contains("`state.optimizer` does not hold"), "{err}");
    assert!(err.contains("invalid type: null"), "{err}");
}

// ---- integrity of training_state.json and non-finite state ---------------------------------

/// `training_state.json` text without its checksum line, as versions before the checksum wrote it.
fn without_checksum(text: &str) -> String {
    let start = text.find("\n  \"checksum\": \"").expect("the state file has a checksum");
    let end = start + 1 + text[start + 1..].find('\n').unwrap();
    format!("{}{}", &text[..start], &text[end..])
}

/// `text` with the first nonzero digit after `key` changed to another nonzero digit (still a
/// number, so the JSON still parses).
fn change_a_digit_after(text: &str, key: &str) -> String {
    let at = text.find(key).unwrap_or_else(|| panic!("no {key} in {text}"));
    let i = at + text[at..].find(|c: char| c.is_ascii_digit() && c != '0').unwrap();
    let mut bytes = text.as_bytes().to_vec();
    bytes[i] = b'0' + (bytes[i] - b'0') % 9 + 1;
    String::from_utf8(bytes).unwrap()
}

type AdamRun = TrainingState<OptimizerState<AdamState>, GradScalerState, ()>;

#[test]
fn a_state_file_with_one_changed_digit_is_refused_naming_it() {
    let dir = fresh_dir("state_digit");
    let (model, opt, scaler) = stepped(1);
    let state = TrainingState::with_parts(1, opt.state_dict(), scaler.state_dict(), ());
    save_checkpoint(&dir, &model, &state).unwrap();
    let state_path = dir.join(STATE_FILE);
    let file = state_path.to_str().unwrap();
    let good = std::fs::read_to_string(&state_path).unwrap();
    let mut other = net(2, &[4, 3]);
    let before = values(&other);
    let refused = |text: &str, needles: &[&str], other: &mut Net| {
        std::fs::write(&state_path, text).unwrap();
        let err = load_checkpoint::<OptimizerState<AdamState>, GradScalerState, (), _>(&dir, other).unwrap_err();
        let err = err.to_string();
        assert!(err.contains(file), "the error names the file: {err}");
        for needle in needles {
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
        assert_eq!(values(other), before, "a refused load changed the model");
    };

    // One digit of a second moment: still valid JSON holding another value, refused.
    let edited = change_a_digit_after(&good, "\"exp_avg_sq\"");
    let (a, b): (Value, Value) = (serde_json::from_str(&good).unwrap(), serde_json::from_str(&edited).unwrap());
    assert_ne!(a["state"]["optimizer"], b["state"]["optimizer"], "the edit changed a moment");
    refused(&edited, &["was modified or corrupted"], &mut other);
    // The scaler's scale, a step count, a digit of the checksum itself.
    refused(&change_a_digit_after(&good, "\"scale\""), &["was modified or corrupted"], &mut other);
    refused(&change_a_digit_after(&good, "\"steps\""), &["was modified or corrupted"], &mut other);
    refused(&change_a_digit_after(&good, "\"checksum\""), &["was modified or corrupted"], &mut other);
    // Reformatted (the same JSON value, other bytes): the checksum no longer covers it.
    refused(&serde_json::to_string(&a).unwrap(), &["was modified or corrupted"], &mut other);
    // Truncated anywhere: named, whether or not the checksum survives the cut.
    for len in [good.len() - 2, good.len() / 2, 20, 5, 0] {
        refused(&good[..len], &["not a valid checkpoint state (truncated or corrupt?)"], &mut other);
    }

    // The intact file loads, bit for bit.
    std::fs::write(&state_path, &good).unwrap();
    let back: AdamRun = load_checkpoint(&dir, &mut other).unwrap();
    assert_eq!(back, state);
    assert_eq!(values(&other), values(&model));
}

#[test]
fn a_state_file_without_a_checksum_still_loads() {
    // As versions before the checksum wrote it: the same layout without the field.
    let dir = fresh_dir("state_no_checksum");
    let (model, opt, scaler) = stepped(1);
    let state = TrainingState::with_parts(1, opt.state_dict(), scaler.state_dict(), ());
    save_checkpoint(&dir, &model, &state).unwrap();
    let state_path = dir.join(STATE_FILE);
    let good = std::fs::read_to_string(&state_path).unwrap();
    assert!(good.starts_with("{\n  \"checksum\": \""), "the checksum is the file's first field: {good}");
    let old = without_checksum(&good);
    assert!(old.starts_with("{\n  \"format\": \"amp-checkpoint\",\n  \"version\": 1,\n"), "{old}");
    std::fs::write(&state_path, &old).unwrap();
    let mut other = net(2, &[4, 3]);
    let back: AdamRun = load_checkpoint(&dir, &mut other).unwrap();
    assert_eq!(back, state);
    assert_eq!(values(&other), values(&model));
    // Unchecked, so an edit of such a file is not noticed (the file says nothing to check).
    std::fs::write(&state_path, change_a_digit_after(&old, "\"exp_avg_sq\"")).unwrap();
    let edited: AdamRun = load_checkpoint(&dir, &mut other).unwrap();
    assert_ne!(edited.optimizer, state.optimizer);
}

/// Every float of an Adam state as bits (NaN != NaN, so states are compared this way).
fn adam_bits(state: &OptimizerState<AdamState>) -> Vec<(String, u64, Vec<u32>, Vec<u32>)> {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    state.params.iter().map(|(n, s)| (n.clone(), s.step, bits(&s.exp_avg), bits(&s.exp_avg_sq))).collect()
}

fn scaler_bits(s: &GradScalerState) -> (u32, u64, u64, i32, i32, Option<i32>) {
    (
        s.scale.to_bits(),
        s.growth_factor.to_bits(),
        s.backoff_factor.to_bits(),
        s.growth_interval,
        s.growth_tracker,
        s.hysteresis_tracker,
    )
}

#[test]
fn non_finite_optimizer_and_scaler_state_round_trips_bit_for_bit() {
    let dir = fresh_dir("non_finite");
    let (model, opt, scaler) = stepped(1);
    // What an inf gradient fed to Adam outside the scaler's checks leaves, and NaNs of every
    // kind: Rust's, x86's default (sign bit set), one with a payload.
    let x86_nan = f32::from_bits(0xffc0_0000);
    let payload_nan = f32::from_bits(0x7f80_0123);
    let mut optimizer = opt.state_dict();
    let w = optimizer.params.get_mut("layers.0.weight").unwrap();
    w.exp_avg_sq[0] = f32::INFINITY;
    w.exp_avg[0] = f32::NAN;
    w.exp_avg[1] = f32::NEG_INFINITY;
    w.exp_avg[2] = x86_nan;
    w.exp_avg_sq[3] = payload_nan;
    w.exp_avg_sq[4] = -0.0;
    let mut scaler_state = scaler.state_dict();
    scaler_state.scale = f32::INFINITY;
    scaler_state.backoff_factor = f64::NAN;
    let state = TrainingState::with_parts(1, optimizer, scaler_state, ());
    save_checkpoint(&dir, &model, &state).unwrap();

    let mut other = net(2, &[4, 3]);
    let back: AdamRun = load_checkpoint(&dir, &mut other).unwrap();
    assert_eq!(adam_bits(&back.optimizer), adam_bits(&state.optimizer));
    assert_eq!(scaler_bits(&back.scaler), scaler_bits(&state.scaler));
    assert_eq!(values(&other), values(&model));
    // The scaler refuses the loaded state for what it is.
    let err = GradScaler::new().load_state_dict(&back.scaler).unwrap_err().to_string();
    assert!(err.contains("backoff_factor") || err.contains("scale"), "{err}");

    // Finite values are JSON numbers as before; non-finite ones strings.
    let text = std::fs::read_to_string(dir.join(STATE_FILE)).unwrap();
    let json: Value = serde_json::from_str(&text).unwrap();
    let sq = &json["state"]["optimizer"]["params"]["layers.0.weight"]["exp_avg_sq"];
    assert_eq!((&sq[0], &sq[3], &sq[4]), (&Value::from("inf"), &Value::from("NaN:0x7f800123"), &Value::from(-0.0)));
    assert!(sq[1].is_f64() && sq[2].is_f64(), "{sq}");
    let m = &json["state"]["optimizer"]["params"]["layers.0.weight"]["exp_avg"];
    assert_eq!((&m[0], &m[1], &m[2]), (&Value::from("NaN"), &Value::from("-inf"), &Value::from("-NaN")));
    assert_eq!(json["state"]["scaler"]["scale"], "inf");
    assert_eq!(json["state"]["scaler"]["growth_factor"], 2.0);
    let parts = format!("{}{}", json["state"]["optimizer"], json["state"]["scaler"]);
    assert!(!parts.contains("null"), "nothing is written as null: {parts}");

    // SGD's momentum and a pure-bf16 optimizer's state (Kahan compensation, bf16 bit patterns).
    let mut sgd = Optim::new(Sgd::new(0.1).momentum(0.9)).unwrap();
    let mut m = net(1, &[4, 3]);
    let loss = m.embed.tensor().sum_all();
    GradScaler::new().scale(loss).backward().unscale().step(&mut sgd, &mut m).update().unwrap();
    let mut sgd_state = sgd.state_dict();
    let buf = sgd_state.params.get_mut("embed").unwrap().momentum_buffer.as_mut().unwrap();
    buf[0] = f32::NEG_INFINITY;
    buf[1] = x86_nan;
    save_checkpoint(&dir, &m, &TrainingState::with_parts(1, sgd_state.clone(), (), ())).unwrap();
    let (back, _) = read_checkpoint_state::<OptimizerState<SgdState>, (), ()>(&dir).unwrap();
    let bits = |s: &OptimizerState<SgdState>| {
        s.params
            .values()
            .map(|p| p.momentum_buffer.as_ref().map(|b| b.iter().map(|x| x.to_bits()).collect()))
            .collect::<Vec<Option<Vec<u32>>>>()
    };
    assert_eq!(bits(&back.optimizer), bits(&sgd_state));

    let mut compensation = std::collections::BTreeMap::new();
    compensation.insert("embed".to_string(), vec![bf16::NAN, bf16::INFINITY, bf16::from_bits(0xffc1), bf16::ONE]);
    let bf = Bf16OptimizerState {
        optimizer: state.optimizer.clone(),
        rounding: amp_core::optim::Bf16Rounding::Kahan,
        compensation,
    };
    save_checkpoint(&dir, &m, &TrainingState::with_parts(1, bf.clone(), (), ())).unwrap();
    let (back, _) = read_checkpoint_state::<Bf16OptimizerState<AdamState>, (), ()>(&dir).unwrap();
    assert_eq!(adam_bits(&back.optimizer.optimizer), adam_bits(&bf.optimizer));
    let comp_bits =
        |s: &Bf16OptimizerState<AdamState>| s.compensation["embed"].iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(comp_bits(&back.optimizer), comp_bits(&bf));
}

#[test]
fn a_non_finite_float_that_json_cannot_hold_is_refused_at_save_naming_it() {
    // A caller's own type with a plain f64 field: serde_json would write NaN as null, which
    // does not load back; the save is refused naming the field and writes nothing.
    let dir = fresh_dir("non_finite_extra");
    let (model, opt, scaler) = stepped(1);
    let info = RunInfo { name: "nan".into(), lr: f64::NAN };
    let state = TrainingState::with_parts(1, opt.state_dict(), scaler.state_dict(), info);
    let err = save_checkpoint(&dir, &model, &state).unwrap_err().to_string();
    assert!(err.contains("`state.extra.lr`") && err.contains("NaN") && err.contains("floats"), "{err}");
    assert!(files_in(&dir).is_empty(), "a refused save writes nothing: {:?}", files_in(&dir));
    // Inside maps and sequences too, with the path to the value.
    let mut extra = std::collections::BTreeMap::new();
    extra.insert("losses".to_string(), vec![1.0, f32::INFINITY]);
    let err = save_checkpoint(&dir, &model, &TrainingState::with_parts(1, (), (), extra)).unwrap_err().to_string();
    assert!(err.contains(r#"`state.extra["losses"][1]`"#) && err.contains("inf"), "{err}");
}

#[test]
fn a_null_moment_from_an_earlier_version_is_refused_saying_why() {
    // Versions before non-finite floats were written as strings wrote them as null.
    let dir = fresh_dir("null_moment");
    let model = WB {
        w: Param::new(Tensor::from_vec(vec![0.5, -1.25, 2.0, 3.5], &[2, 2])),
        b: Param::new(Tensor::from_vec(vec![0.125, -0.0], &[2])),
    };
    save_weights(dir.join("model-00000001.safetensors"), &model).unwrap();
    let mut v: Value = serde_json::from_str(STATE_BEFORE_TYPED).unwrap();
    v["state"]["optimizer"]["params"]["w"]["exp_avg_sq"][2] = Value::Null;
    std::fs::write(dir.join(STATE_FILE), serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    let err = read_checkpoint_state::<OptimizerState<AdamState>, GradScalerState, Value>(&dir).unwrap_err();
    let err = err.to_string();
    assert!(err.contains(STATE_FILE) && err.contains("`state.optimizer`"), "{err}");
    assert!(err.contains("null where a float was expected") && err.contains("NaN"), "{err}");
    assert!(!err.contains("another optimizer"), "the hint points at the real cause: {err}");
}

#[test]
fn a_state_file_whose_checksum_key_was_changed_is_refused() {
    // Without this, changing the key (one byte) made the reader ignore the field and load the
    // file unchecked, with any other edit in it.
    let dir = fresh_dir("state_checksum_key");
    let (model, opt, scaler) = stepped(1);
    let state = TrainingState::with_parts(1, opt.state_dict(), scaler.state_dict(), ());
    save_checkpoint(&dir, &model, &state).unwrap();
    let state_path = dir.join(STATE_FILE);
    let good = std::fs::read_to_string(&state_path).unwrap();
    let edited = change_a_digit_after(&good, "\"exp_avg_sq\"").replacen("\"checksum\"", "\"checksun\"", 1);
    std::fs::write(&state_path, edited).unwrap();
    let mut other = net(2, &[4, 3]);
    let err = load_checkpoint::<OptimizerState<AdamState>, GradScalerState, (), _>(&dir, &mut other).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(STATE_FILE) && msg.contains("modified or corrupted"), "{msg}");
}
