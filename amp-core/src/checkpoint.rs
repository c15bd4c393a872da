//! Checkpoints: model weights in safetensors with PyTorch's `state_dict` names, and the
//! training state (step, data order, RNG, optimizer and scaler) in JSON, written atomically.
//!
//! ```no_run
//! use amp_core::checkpoint::{TrainingState, load_checkpoint, save_checkpoint};
//! # fn demo(model: &mut impl amp_core::Params) -> amp_core::Result<()> {
//! let mut state = TrainingState::new(500);
//! state.rng = Some(amp_core::Rng::seed(0));
//! save_checkpoint("runs/demo/checkpoint", model, &state)?;
//! let resumed: TrainingState = load_checkpoint("runs/demo/checkpoint", model)?;
//! assert_eq!(resumed.step, 500);
//! # Ok(()) }
//! ```
//!
//! Design notes:
//! - A checkpoint directory holds `training_state.json` and the weights file it names
//!   (`model-00000500.safetensors`). A save writes the weights under a new name, then replaces
//!   `training_state.json`: that rename is the commit point. A crash before it leaves the old
//!   state file naming the old weights, which are deleted only after the commit; a crash
//!   after it leaves the new pair. Every file is written as temp file, fsync, rename, fsync of
//!   the directory, so no reader ever sees half a file under a real name.
//! - Weight files carry a checksum of the whole file in the safetensors metadata
//!   (`amp.checksum`: the header, with the checksum's own 16 digits read as zeros, then the
//!   data), so flipped bytes inside tensor data, which the format itself cannot notice, and an
//!   edited header (two same-size tensors' offsets swapped) are refused. Files written before
//!   it carry `amp.data_checksum` (the data section only), which is still verified; files
//!   without either (exported from PyTorch) load unchecked.
//! - Loading checks every tensor (present, expected, shape, dtype) before writing any, so a
//!   refused load leaves the model as it was. Files of any float dtype are converted to the
//!   model's element type (f32, or bf16 for a pure-bf16 model; saved in it too).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::data::LoaderPosition;
use crate::error::{Error, Result};
use crate::param::Params;
use crate::precision::Precision;
use crate::rng::Rng;
use crate::tensor::Tensor;

/// The file in a checkpoint directory that holds the [`TrainingState`] and names the weights.
pub const STATE_FILE: &str = "training_state.json";

/// Metadata key of the checksum of the data section only (files of earlier versions).
const DATA_CHECKSUM_KEY: &str = "amp.data_checksum";
/// Metadata key of the checksum of header and data.
const CHECKSUM_KEY: &str = "amp.checksum";
/// What the checksum's 16 hex digits are read as while the checksum is computed.
const CHECKSUM_PLACEHOLDER: &str = "0000000000000000";
/// Format marker in `training_state.json`.
const FORMAT: &str = "amp-checkpoint";
const VERSION: u32 = 1;

/// Everything besides the weights that a run needs to continue exactly where it stopped.
/// Optimizer and scaler state are opaque JSON (their types serialise themselves).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainingState {
    /// Optimizer steps taken (including skipped ones).
    pub step: u64,
    /// Where the training data loader is.
    #[serde(default)]
    pub loader: Option<LoaderPosition>,
    /// The training RNG (dropout, sampling), as it was after `step`.
    #[serde(default)]
    pub rng: Option<Rng>,
    /// Optimizer state (moments, step counts), as its type serialises it.
    #[serde(default)]
    pub optimizer: serde_json::Value,
    /// Loss scaler state (scale, growth tracker), as its type serialises it.
    #[serde(default)]
    pub scaler: serde_json::Value,
    /// Anything else the run wants back (its configuration, a vocabulary, metrics so far).
    #[serde(default)]
    pub extra: serde_json::Value,
}

impl TrainingState {
    /// State at `step` with everything else empty.
    pub fn new(step: u64) -> Self {
        TrainingState {
            step,
            loader: None,
            rng: None,
            optimizer: serde_json::Value::Null,
            scaler: serde_json::Value::Null,
            extra: serde_json::Value::Null,
        }
    }
}

/// The JSON file's layout: the state plus which weights belong to it.
#[derive(serde::Serialize, serde::Deserialize)]
struct StateFile {
    format: String,
    version: u32,
    /// File name of the weights, in the same directory.
    weights: String,
    state: TrainingState,
}

/// The files a [`save_checkpoint`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointFiles {
    /// The weights (safetensors).
    pub weights: PathBuf,
    /// `training_state.json`.
    pub state: PathBuf,
}

fn io_err(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Io { path: path.display().to_string(), detail: format!("{what}: {e}") }
}

fn file_err(path: &Path, detail: String) -> Error {
    Error::State { context: path.display().to_string(), detail }
}

// ---- atomic files -------------------------------------------------------------------------

/// Writes `path` atomically: a temp file in the same directory gets the bytes `write`
/// produces, is flushed to disk, and is renamed over `path`; the directory is then synced so
/// the rename survives a power cut. If `write` fails the temp file is removed and `path` is
/// untouched; if the process dies, at most a stray `.<name>.tmp-*` file is left, which the next
/// [`save_checkpoint`] in that directory removes.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&mut File) -> std::io::Result<()>) -> Result<()> {
    let dir = parent_dir(path);
    let name = path.file_name().ok_or_else(|| io_err(path, "cannot write", "the path has no file name"))?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(".{}.tmp-{}-{nanos:08x}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut file = File::create(&tmp).map_err(|e| io_err(&tmp, "cannot create a temp file", e))?;
        write(&mut file).map_err(|e| io_err(path, "write failed (the previous file is untouched)", e))?;
        file.sync_all().map_err(|e| io_err(&tmp, "fsync failed", e))?;
        drop(file);
        fs::rename(&tmp, path).map_err(|e| io_err(path, "cannot rename the temp file into place", e))?;
        sync_dir(&dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp); // best effort: the error that matters is `result`
    }
    result
}

/// Writes `bytes` to `path` atomically (see [`write_atomic_with`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| f.write_all(bytes))
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Makes renames and deletions in `dir` durable (a no-op where directories cannot be opened,
/// as on Windows).
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io_err(dir, "cannot fsync the directory", e))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

// ---- weights -----------------------------------------------------------------------------

/// A checksum of the weights' data section: FNV-1a over little-endian 64-bit words with an
/// xorshift per word. Each step is a bijection of the running state, so any changed word
/// changes the result.
fn checksum(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8-byte chunk"));
        h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    let mut tail = [0u8; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    h = (h ^ u64::from_le_bytes(tail)).wrapping_mul(0x0000_0100_0000_01b3);
    h ^ bytes.len() as u64
}

/// The model's parameters as a safetensors file: in their element type (`F32`, or `BF16` for a
/// pure-bf16 model), PyTorch names, metadata `format = pt` (what `safetensors.torch` writes)
/// and the data checksum.
///
/// The bytes are a function of the parameters alone (tensors sorted by name, metadata keys in
/// a fixed order), so saving the same model twice gives the same file. The `safetensors`
/// crate's writer takes the metadata as a `HashMap`, whose order varies from run to run, so
/// the header is written here; the layout is the format's own (8-byte little-endian header
/// length, JSON header padded with spaces to 8 bytes, then the data) and every test reads the
/// result back through the `safetensors` parser (and Python's).
pub fn weights_to_bytes<E: Precision>(model: &impl Params<E>) -> Result<Vec<u8>> {
    let mut named = model.named_params();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = named.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(Error::State {
            context: "checkpoint".into(),
            detail: format!("the model has two parameters named `{}`", w[0].0),
        });
    }
    let json = |v: &str| serde_json::Value::from(v).to_string();
    let mut data = Vec::new();
    let mut entries = Vec::with_capacity(named.len());
    for (name, p) in &named {
        let start = data.len();
        crate::precision::extend_le_bytes(p.data(), &mut data);
        let shape: Vec<String> = p.shape().iter().map(usize::to_string).collect();
        entries.push(format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{start},{}]}}",
            json(name),
            E::DTYPE.name().to_uppercase(),
            shape.join(","),
            data.len()
        ));
    }
    let metadata = format!(
        "\"__metadata__\":{{{}:{},{}:{}}}",
        json("format"),
        json("pt"),
        json(CHECKSUM_KEY),
        json(CHECKSUM_PLACEHOLDER)
    );
    let mut header = format!("{{{metadata}{}{}}}", if entries.is_empty() { "" } else { "," }, entries.join(","));
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = Vec::with_capacity(8 + header.len() + data.len());
    out.extend((header.len() as u64).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(data);
    // The checksum is computed with its own digits zero, then written over them (same length).
    let sum = format!("{:016x}", checksum(&out));
    let at = 8 + checksum_digits_at(&header).expect("the header was just written with the checksum key");
    out[at..at + 16].copy_from_slice(sum.as_bytes());
    Ok(out)
}

/// Saves the model's parameters to `path` (safetensors in their element type, PyTorch names),
/// atomically.
pub fn save_weights<E: Precision>(path: impl AsRef<Path>, model: &impl Params<E>) -> Result<()> {
    write_atomic(path.as_ref(), &weights_to_bytes(model)?)
}

/// One tensor read from a weights file, converted to f32.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedTensor {
    /// Dims.
    pub shape: Vec<usize>,
    /// The dtype in the file (`F32`, `F16`, `BF16`, `F64`).
    pub file_dtype: String,
    /// Values, row-major, as f32.
    pub values: Vec<f32>,
}

impl LoadedTensor {
    /// As a tensor.
    pub fn to_tensor(&self) -> Tensor<f32> {
        Tensor::from_vec(self.values.clone(), &self.shape)
    }
}

/// Reads every tensor of a safetensors file (f32, f16, bf16 or f64, converted to f32),
/// verifying the checksum when the file has one. Errors name the file, and the tensor where
/// one is at fault.
pub fn read_weights(path: impl AsRef<Path>) -> Result<BTreeMap<String, LoadedTensor>> {
    let path = path.as_ref();
    let bytes = fs::read(path).map_err(|e| io_err(path, "cannot read the weights", e))?;
    parse_weights(path, &bytes)
}

/// Where the checksum's 16 digits are in a header this module wrote: right after the one
/// occurrence of `"amp.checksum":"`.
fn checksum_digits_at(header: &str) -> Option<usize> {
    let key = format!("\"{CHECKSUM_KEY}\":\"");
    let at = header.find(&key)? + key.len();
    (header.matches(&key).count() == 1 && header.len() >= at + 16).then_some(at)
}

fn parse_weights(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, LoadedTensor>> {
    let corrupt = |e: safetensors::SafeTensorError| {
        file_err(path, format!("not a valid safetensors file (truncated or corrupt): {e}"))
    };
    let (header_len, metadata) = SafeTensors::read_metadata(bytes).map_err(corrupt)?;
    let meta = metadata.metadata().as_ref();
    if let Some(expected) = meta.and_then(|m| m.get(CHECKSUM_KEY)) {
        // read_metadata checked that the header is 8 + header_len bytes of UTF-8 JSON.
        let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap_or("");
        let Some(at) = checksum_digits_at(header).map(|a| a + 8) else {
            return Err(file_err(
                path,
                format!("the header is corrupt or was rewritten: its `{CHECKSUM_KEY}` entry cannot be located"),
            ));
        };
        let mut zeroed = bytes.to_vec();
        zeroed[at..at + 16].copy_from_slice(CHECKSUM_PLACEHOLDER.as_bytes());
        let actual = format!("{:016x}", checksum(&zeroed));
        if &actual != expected {
            return Err(file_err(
                path,
                format!(
                    "the file is corrupt (its header or tensor data changed): checksum {actual}, but the \
                     file recorded {expected}"
                ),
            ));
        }
    } else if let Some(expected) = meta.and_then(|m| m.get(DATA_CHECKSUM_KEY)) {
        let actual = format!("{:016x}", checksum(&bytes[8 + header_len..]));
        if &actual != expected {
            return Err(file_err(
                path,
                format!("the tensor data is corrupt: checksum {actual}, but the file recorded {expected}"),
            ));
        }
    }
    let st = SafeTensors::deserialize(bytes).map_err(corrupt)?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let values = to_f32(path, &name, &view)?;
        out.insert(
            name,
            LoadedTensor { shape: view.shape().to_vec(), file_dtype: format!("{:?}", view.dtype()), values },
        );
    }
    Ok(out)
}

fn to_f32(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f32>> {
    let data = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(),
        Dtype::F16 => data.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => data.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::F64 => data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect(),
        other => {
            return Err(file_err(
                path,
                format!(
                    "tensor `{name}` has dtype {other:?}; parameters must be floating point (F32, F16, BF16 or F64)"
                ),
            ));
        }
    })
}

/// Loads a safetensors file into the model's parameters, by name. Refuses, naming the file
/// and the tensor, a tensor the model lacks, a parameter the file lacks, a shape or dtype
/// mismatch, and a truncated or corrupt file; nothing is written unless everything matches.
/// Files of any float dtype (PyTorch exports in f16/bf16/f64) are converted to the model's
/// element type: f32, or bf16 (rounded to nearest) for a pure-bf16 model.
pub fn load_weights<E: Precision>(path: impl AsRef<Path>, model: &mut impl Params<E>) -> Result<()> {
    let path = path.as_ref();
    let tensors = read_weights(path)?;
    assign(path, tensors, model)
}

fn assign<E: Precision>(
    path: &Path,
    mut tensors: BTreeMap<String, LoadedTensor>,
    model: &mut impl Params<E>,
) -> Result<()> {
    let mut params = model.named_params_mut();
    for (name, p) in &params {
        let Some(t) = tensors.get(name) else {
            return Err(file_err(
                path,
                format!(
                    "tensor `{name}` is missing: the model has this parameter (shape {:?}), the file does not",
                    p.shape()
                ),
            ));
        };
        if t.shape != p.shape() {
            return Err(file_err(
                path,
                format!(
                    "tensor `{name}` has shape {:?} in the file, but the model's parameter has shape {:?}",
                    t.shape,
                    p.shape()
                ),
            ));
        }
    }
    let expected: std::collections::HashSet<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
    if let Some(extra) = tensors.keys().find(|k| !expected.contains(k.as_str())) {
        return Err(file_err(path, format!("unexpected tensor `{extra}`: the model has no parameter of that name")));
    }
    for (name, p) in &mut params {
        let t = tensors.remove(name.as_str()).expect("checked above");
        E::from_f32_slice(&t.values, p.data_mut());
    }
    Ok(())
}

// ---- checkpoints -------------------------------------------------------------------------

/// Whether `dir` holds a checkpoint (a `training_state.json`).
pub fn checkpoint_exists(dir: impl AsRef<Path>) -> bool {
    dir.as_ref().join(STATE_FILE).is_file()
}

/// Weight files this module writes: `model-<step>.safetensors` or `model-<step>-<n>.safetensors`.
fn is_weights_name(name: &str) -> bool {
    name.strip_prefix("model-")
        .and_then(|s| s.strip_suffix(".safetensors"))
        .is_some_and(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit() || c == '-'))
}

/// Saves `model` and `state` into the directory `dir` (created if needed), atomically as a
/// pair: a crash at any point leaves either the previous checkpoint or this one, complete.
pub fn save_checkpoint(dir: impl AsRef<Path>, model: &impl Params, state: &TrainingState) -> Result<CheckpointFiles> {
    let dir = dir.as_ref();
    fs::create_dir_all(dir).map_err(|e| io_err(dir, "cannot create the checkpoint directory", e))?;
    // Stray temp files of writers that died mid-write.
    for entry in fs::read_dir(dir).map_err(|e| io_err(dir, "cannot list the checkpoint directory", e))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.contains(".tmp-") {
            let _ = fs::remove_file(entry.path()); // leftovers: failing to remove one is harmless
        }
    }
    // A name no live file has, so the committed weights are never overwritten.
    let mut weights_name = format!("model-{:08}.safetensors", state.step);
    let mut n = 1;
    while dir.join(&weights_name).exists() {
        weights_name = format!("model-{:08}-{n}.safetensors", state.step);
        n += 1;
    }
    let weights = dir.join(&weights_name);
    save_weights(&weights, model)?;

    let file =
        StateFile { format: FORMAT.into(), version: VERSION, weights: weights_name.clone(), state: state.clone() };
    let json = serde_json::to_vec_pretty(&file).map_err(|e| Error::State {
        context: "checkpoint".into(),
        detail: format!("cannot serialise the training state: {e}"),
    })?;
    let state_path = dir.join(STATE_FILE);
    write_atomic(&state_path, &json)?; // the commit point

    // Older weights are unreferenced now.
    for entry in fs::read_dir(dir).map_err(|e| io_err(dir, "cannot list the checkpoint directory", e))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != weights_name && is_weights_name(&name) {
            let _ = fs::remove_file(entry.path()); // an old file left over wastes space only
        }
    }
    sync_dir(dir)?;
    Ok(CheckpointFiles { weights, state: state_path })
}

/// Reads a checkpoint's state and the weights file it names, without touching a model.
pub fn read_checkpoint_state(dir: impl AsRef<Path>) -> Result<(TrainingState, PathBuf)> {
    let dir = dir.as_ref();
    let state_path = dir.join(STATE_FILE);
    let bytes = fs::read(&state_path).map_err(|e| io_err(&state_path, "cannot read the checkpoint", e))?;
    let file: StateFile = serde_json::from_slice(&bytes)
        .map_err(|e| file_err(&state_path, format!("not a valid checkpoint state (truncated or corrupt?): {e}")))?;
    if file.format != FORMAT || file.version != VERSION {
        return Err(file_err(
            &state_path,
            format!(
                "format `{}` version {}, but this build reads `{FORMAT}` version {VERSION}",
                file.format, file.version
            ),
        ));
    }
    if !is_weights_name(&file.weights) {
        return Err(file_err(
            &state_path,
            format!("names weights file `{}`, which is not a checkpoint weights file", file.weights),
        ));
    }
    let weights = dir.join(&file.weights);
    if !weights.is_file() {
        return Err(file_err(&state_path, format!("names weights file `{}`, which does not exist", file.weights)));
    }
    Ok((file.state, weights))
}

/// Loads the checkpoint in `dir` into `model` and returns its training state. The model is
/// untouched if anything is refused (see [`load_weights`]).
pub fn load_checkpoint(dir: impl AsRef<Path>, model: &mut impl Params) -> Result<TrainingState> {
    let (state, weights) = read_checkpoint_state(dir)?;
    load_weights(&weights, model)?;
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Param, Rng};

    // `#[derive(Params)]` inside amp-core itself: generated `::amp_core` paths resolve through
    // the crate's `extern crate self as amp_core`.
    #[derive(crate::Params)]
    struct Tiny {
        w: Param,
        #[param(skip)]
        _note: u8,
    }

    #[test]
    fn derive_inside_amp_core_and_round_trip_through_bytes() {
        let mut rng = Rng::seed(0);
        let a = Tiny { w: Param::new(Tensor::randn(&[3, 2], &mut rng)), _note: 0 };
        let mut b = Tiny { w: Param::new(Tensor::zeros(&[3, 2])), _note: 0 };
        let bytes = weights_to_bytes(&a).unwrap();
        assign(Path::new("mem"), parse_weights(Path::new("mem"), &bytes).unwrap(), &mut b).unwrap();
        assert_eq!(a.w.to_vec(), b.w.to_vec());
        // Deterministic bytes, readable by the safetensors parser, also with no tensors.
        assert_eq!(weights_to_bytes(&a).unwrap(), bytes);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.names(), ["w"]);
        let empty: Vec<Param> = Vec::new();
        let bytes = weights_to_bytes(&empty).unwrap();
        assert!(parse_weights(Path::new("mem"), &bytes).unwrap().is_empty());
        assert_eq!(bytes.len() % 8, 0);
    }

    #[test]
    fn checksum_sees_every_byte() {
        let base: Vec<u8> = (0..37u8).collect();
        let sum = checksum(&base);
        for i in 0..base.len() {
            let mut changed = base.clone();
            changed[i] ^= 0x10;
            assert_ne!(checksum(&changed), sum, "byte {i}");
        }
        assert_ne!(checksum(&base[..36]), sum);
    }

    #[test]
    fn weights_names() {
        assert!(is_weights_name("model-00000500.safetensors"));
        assert!(is_weights_name("model-00000500-2.safetensors"));
        assert!(!is_weights_name("model.safetensors"));
        assert!(!is_weights_name("model-final.safetensors"));
        assert!(!is_weights_name("../model-1.safetensors"));
    }
}
