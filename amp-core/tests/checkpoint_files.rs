//! Checkpoints: round trip of weights and training state, refusal of missing, unexpected,
//! misshapen, mistyped, corrupt and truncated files (naming file and tensor, model untouched),
//! PyTorch-style f16/bf16/f64 exports, and atomicity (failed writer, stray temp files, a crash
//! between the two files, and a process killed while saving).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use amp_core::checkpoint::{
    STATE_FILE, TrainingState, checkpoint_exists, load_checkpoint, load_weights, read_checkpoint_state, read_weights,
    save_checkpoint, save_weights, write_atomic, write_atomic_with,
};
use amp_core::data::{DataLoader, Dataset};
use amp_core::{Param, Params, Rng, Tensor};
use safetensors::tensor::Dtype;

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
    let state = load_checkpoint(&dir, &mut other).unwrap();
    assert_eq!(values(&other), values(&model));
    assert_eq!(state, full_state(100));
    let names: Vec<String> = read_weights(&files.weights).unwrap().into_keys().collect();
    assert_eq!(names, ["embed", "layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]);

    // A second save commits a new pair and removes the old weights.
    let model2 = net(3, &[4, 8, 3]);
    save_checkpoint(&dir, &model2, &full_state(200)).unwrap();
    assert_eq!(files_in(&dir), ["model-00000200.safetensors", STATE_FILE]);
    let state = load_checkpoint(&dir, &mut other).unwrap();
    assert_eq!((state.step, values(&other)), (200, values(&model2)));
    // Saving the same step again never overwrites the live weights file.
    let files = save_checkpoint(&dir, &model, &full_state(200)).unwrap();
    assert_eq!(files.weights, dir.join("model-00000200-1.safetensors"));
    assert_eq!(files_in(&dir), ["model-00000200-1.safetensors", STATE_FILE]);
    load_checkpoint(&dir, &mut other).unwrap();
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
        &[int_path.to_str().unwrap(), "tensor `layers.1.bias` has dtype I32", "floating point"],
    );
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
        let err = load_checkpoint(&dir, model).unwrap_err().to_string();
        assert!(err.contains(state_path.to_str().unwrap()) && err.contains(needle), "{err}");
        assert_eq!(values(model), before);
    };
    check(&good[..good.len() / 2], "not a valid checkpoint state", &mut model);
    check(&good.replace("\"version\": 1", "\"version\": 9"), "version 9", &mut model);
    check(
        &good.replace("model-00000007.safetensors", "../elsewhere.safetensors"),
        "not a checkpoint weights file",
        &mut model,
    );
    // The state names a weights file that is gone.
    check(
        &good.replace("model-00000007.safetensors", "model-00000008.safetensors"),
        "names weights file `model-00000008.safetensors`, which does not exist",
        &mut model,
    );
    std::fs::write(&state_path, &good).unwrap();
    assert_eq!(load_checkpoint(&dir, &mut model).unwrap().step, 7);
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
    assert_eq!(load_checkpoint(&dir, &mut loaded).unwrap(), full_state(10));
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
            .args(["--exact", "crash_child_saves_forever", "--ignored", "--nocapture", "--test-threads=1"])
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

        let (state, weights) = read_checkpoint_state(&dir).unwrap();
        let mut model =
            Linear { weight: Param::new(Tensor::zeros(&[1000, 1000])), bias: Param::new(Tensor::zeros(&[1000])) };
        let loaded = load_checkpoint(&dir, &mut model).unwrap();
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
