//! Checkpoints: model weights in safetensors with PyTorch's `state_dict` names, and the
//! training state (step, data order, RNG, optimizer and scaler) in JSON, written atomically;
//! plus safetensors files of data (f32 tensors and integer [`Indices`]).
//!
//! ```no_run
//! # extern crate amp_core as amp;
//! use amp::checkpoint::{TrainingState, load_checkpoint, save_checkpoint};
//! # fn demo(model: &mut impl amp::Params) -> amp::Result<()> {
//! let mut state = TrainingState::new(500);
//! state.rng = Some(amp::Rng::seed(0));
//! save_checkpoint("runs/demo/checkpoint", model, &state)?;
//! let resumed: TrainingState = load_checkpoint("runs/demo/checkpoint", model)?;
//! assert_eq!(resumed.step, 500);
//! # Ok(()) }
//! ```
//!
//! The optimizer, scaler and extra parts of a [`TrainingState`] are typed by the caller
//! (`serde_json::Value` when not):
//!
//! ```no_run
//! # extern crate amp_core as amp;
//! use amp::checkpoint::{TrainingState, load_checkpoint, save_checkpoint};
//! use amp::optim::{AdamState, AdamW, Optim, OptimizerState};
//! use amp::scaler::{GradScaler, GradScalerState};
//! # fn demo(model: &mut impl amp::Params, opt: &mut Optim<AdamW>, scaler: &mut GradScaler)
//! # -> amp::Result<()> {
//! let state = TrainingState::with_parts(500, opt.state_dict(), scaler.state_dict(), ());
//! save_checkpoint("runs/demo/checkpoint", model, &state)?;
//! let resumed: TrainingState<OptimizerState<AdamState>, GradScalerState, ()> =
//!     load_checkpoint("runs/demo/checkpoint", model)?;
//! opt.load_state_dict(resumed.optimizer)?;
//! scaler.load_state_dict(&resumed.scaler)?;
//! # Ok(()) }
//! ```
//!
//! Loading a file whose names differ from the model's (a PyTorch export) maps them and
//! reports what did not match, as `model.load_state_dict(sd, strict=False)` does:
//!
//! ```no_run
//! # extern crate amp_core as amp;
//! use amp::checkpoint::{LoadOptions, load_weights_with};
//! # fn demo(model: &mut impl amp::Params) -> amp::Result<()> {
//! let opts = LoadOptions::new().strict(false).strip_prefix("module.").rename("fc1", "mlp.fc");
//! let report = load_weights_with("pytorch_export.safetensors", model, &opts)?;
//! println!("{report}"); // loaded 10 tensors; missing 0; unexpected 1 (`module.lm_head.bias`); ...
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
//! - Files written here carry a checksum of the whole file in the safetensors metadata
//!   (`amp.checksum`: the header, with the checksum's own 16 digits read as zeros, then the
//!   data), so flipped bytes inside tensor data, which the format itself cannot notice, and an
//!   edited header (two same-size tensors' offsets swapped) are refused. Files written before
//!   it carry `amp.data_checksum` (the data section only), which is still verified; files
//!   without either (exported from PyTorch) load unchecked.
//! - `training_state.json` carries a checksum of its own the same way: its first field,
//!   `"checksum"`, holds 16 hex digits, and the checksum (the same function) is over the
//!   file's bytes as written, with those 16 digits read as zeros. The field is first so the
//!   digits sit at a fixed place (after `{\n  "checksum": "`) that the reader finds without
//!   trusting the rest of the file. A changed digit anywhere (a moment, the step, the
//!   checksum itself) and a file rewritten in another layout (reformatted, keys reordered) are
//!   refused naming the file as modified or corrupted; a file that does not parse (truncated)
//!   is refused naming the file before the checksum is looked at, and the format version is
//!   checked first, as a later version may lay the file out otherwise. State files of earlier
//!   versions have no `checksum` field and load unchecked, as weights without one do (their
//!   first key is `format`; a file without the field whose first key is another, one whose
//!   `checksum` key was changed, is refused); earlier versions reading a file with it ignore
//!   the field.
//! - JSON has no number for NaN or ±inf, and serde_json writes them as `null`, which does not
//!   read back as a float. Every float field of the state types a checkpoint holds (Adam's,
//!   AdamW's and SGD's moments, the [`GradScalerState`](crate::scaler::GradScalerState)'s
//!   scale and factors) goes through [`floats`], which writes finite values as the same JSON
//!   numbers as before and non-finite ones as strings (`"inf"`, `"-inf"`, `"NaN"`, `"-NaN"`,
//!   or `"NaN:0x…"` with the bits of any other NaN) that read back bit for bit, as
//!   `torch.save` does. A pure-bf16 optimizer's Kahan compensation is written as bf16 bit
//!   patterns (integers) and round-trips already. A float the state still holds outside such
//!   a field (a caller's own `extra` type with a plain `f64`) cannot round-trip:
//!   [`save_checkpoint`] refuses it before writing anything, naming the field
//!   (`state.extra.lr`) and the helper to use. A `null` where a float is expected (a
//!   non-finite value written by an earlier version) is refused at load saying so, rather than
//!   blaming another state type.
//! - Loading checks every tensor (name, shape, dtype, and that no two file names map to one
//!   parameter) before writing any, so a refused load leaves the model as it was. Files of
//!   any float dtype are converted to the model's element type (f32, or bf16 for a pure-bf16
//!   model, which is saved as BF16 too). A strict load ([`load_weights`], the default of
//!   [`LoadOptions`]) refuses a parameter the file lacks and a tensor the model lacks; a
//!   non-strict one loads the tensors that match and lists the others in a [`LoadReport`]. A
//!   wrong shape or an integer tensor under a parameter's name is refused either way.
//! - [`read_tensors`] reads every tensor of a file: floating point as f32, integers (I64; I32,
//!   I16, I8, U64, U32, U16 and U8 widened; BOOL as 0/1) as [`Indices`], so data and labels
//!   stored in safetensors load; [`save_tensors`] writes f32 and I64 tensors with the same
//!   header layout and checksum as the weights.
//! - The typed parts of a [`TrainingState`] are read through JSON values, each on its own,
//!   so a part that does not hold the type asked for (SGD state read as AdamW's) is refused
//!   naming the part and the file; a part the file lacks reads as JSON `null`. The layout of
//!   `training_state.json` is the same as when the parts were untyped JSON.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backend::Device;
use crate::data::LoaderPosition;
use crate::error::{Error, Result};
use crate::indices::Indices;
use crate::param::Params;
use crate::precision::{Precision, as_same};
use crate::rng::Rng;
use crate::tensor::Tensor;

pub mod floats;

/// The file in a checkpoint directory that holds the [`TrainingState`] and names the weights.
pub const STATE_FILE: &str = "training_state.json";

/// Metadata key of the checksum of the data section only (files of earlier versions).
const DATA_CHECKSUM_KEY: &str = "amp.data_checksum";
/// Metadata key of the checksum of header and data.
const CHECKSUM_KEY: &str = "amp.checksum";
/// What the checksum's 16 hex digits are read as while the checksum is computed.
const CHECKSUM_PLACEHOLDER: &str = "0000000000000000";
/// How `training_state.json` begins: its checksum is the first field, so the 16 digits are
/// at a fixed place.
const STATE_CHECKSUM_PREFIX: &[u8] = b"{\n  \"checksum\": \"";
/// Format marker in `training_state.json`.
const FORMAT: &str = "amp-checkpoint";
const VERSION: u32 = 1;

/// Everything besides the weights that a run needs to continue exactly where it stopped.
///
/// The optimizer, scaler and extra parts have the caller's types: `O` is typically
/// [`OptimizerState`](crate::optim::OptimizerState)`<R::State>` (from
/// [`Optim::state_dict`](crate::optim::Optim::state_dict)), `S` the scaler's
/// [`LossScaler::State`](crate::scaler::LossScaler::State)
/// ([`GradScalerState`](crate::scaler::GradScalerState), or `()` for
/// [`NoScale`](crate::scaler::NoScale)), and `X` whatever else the run keeps. The defaults,
/// `serde_json::Value`, read any checkpoint untyped. Reading a part into a type it does not
/// hold is refused naming the part (see [`read_checkpoint_state`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainingState<O = serde_json::Value, S = serde_json::Value, X = serde_json::Value> {
    /// Optimizer steps taken (including skipped ones).
    pub step: u64,
    /// Where the training data loader is.
    pub loader: Option<LoaderPosition>,
    /// The training RNG (dropout, sampling), as it was after `step`.
    pub rng: Option<Rng>,
    /// Optimizer state (moments, step counts).
    pub optimizer: O,
    /// Loss scaler state (scale, growth tracker).
    pub scaler: S,
    /// Anything else the run wants back (its configuration, a vocabulary, metrics so far).
    pub extra: X,
}

impl TrainingState {
    /// Untyped state at `step` with everything else empty (JSON `null`).
    pub fn new(step: u64) -> Self {
        TrainingState::with_parts(step, serde_json::Value::Null, serde_json::Value::Null, serde_json::Value::Null)
    }
}

impl<O, S, X> TrainingState<O, S, X> {
    /// State at `step` with these optimizer, scaler and extra parts, and no loader position
    /// or RNG.
    pub fn with_parts(step: u64, optimizer: O, scaler: S, extra: X) -> Self {
        TrainingState { step, loader: None, rng: None, optimizer, scaler, extra }
    }
}

/// The `state` object of `training_state.json` with the typed parts still JSON; a part the
/// file lacks is `null`.
#[derive(serde::Deserialize)]
struct RawState {
    step: u64,
    #[serde(default)]
    loader: Option<LoaderPosition>,
    #[serde(default)]
    rng: Option<Rng>,
    #[serde(default)]
    optimizer: serde_json::Value,
    #[serde(default)]
    scaler: serde_json::Value,
    #[serde(default)]
    extra: serde_json::Value,
}

impl RawState {
    /// The typed state, or which part does not hold its type, and why.
    fn typed<O: DeserializeOwned, S: DeserializeOwned, X: DeserializeOwned>(
        self,
    ) -> std::result::Result<TrainingState<O, S, X>, String> {
        fn part<T: DeserializeOwned>(name: &str, value: serde_json::Value) -> std::result::Result<T, String> {
            serde_json::from_value(value).map_err(|e| {
                let e = e.to_string();
                // A float read as null is a non-finite value an earlier version wrote as null,
                // not a sign of another type.
                let hint = if e.contains(floats::NULL_FLOAT) {
                    ""
                } else if e.contains("invalid type: null, expected f") {
                    " (NaN and ±inf were written as null before amp-core wrote them as strings: the value \
                     cannot be recovered)"
                } else {
                    " (was the checkpoint saved with another optimizer, loss scaler or state type?)"
                };
                format!("`state.{name}` does not hold a `{}`: {e}{hint}", std::any::type_name::<T>())
            })
        }
        Ok(TrainingState {
            step: self.step,
            loader: self.loader,
            rng: self.rng,
            optimizer: part("optimizer", self.optimizer)?,
            scaler: part("scaler", self.scaler)?,
            extra: part("extra", self.extra)?,
        })
    }
}

/// Reads the layout [`TrainingState`] serialises to, each typed part on its own (an error
/// names the part that does not hold its type); a part the input lacks reads as `null`.
impl<'de, O: DeserializeOwned, S: DeserializeOwned, X: DeserializeOwned> serde::Deserialize<'de>
    for TrainingState<O, S, X>
{
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        RawState::deserialize(deserializer)?.typed().map_err(serde::de::Error::custom)
    }
}

/// The JSON file's layout as written: the state plus which weights belong to it.
#[derive(Serialize)]
struct StateFileOut<'a, O, S, X> {
    /// The file's checksum (see the module notes); written as zeros, then filled in.
    checksum: &'a str,
    format: &'a str,
    version: u32,
    /// File name of the weights, in the same directory.
    weights: &'a str,
    state: &'a TrainingState<O, S, X>,
}

/// The JSON file's layout as read.
#[derive(serde::Deserialize)]
struct StateFileIn {
    /// Absent in files of versions before it.
    #[serde(default)]
    checksum: Option<String>,
    format: String,
    version: u32,
    weights: String,
    state: RawState,
}

/// Just the format marker and version of a state file, to name them when the rest of a file
/// of another version does not parse.
#[derive(serde::Deserialize)]
struct StateFileVersion {
    format: String,
    version: u32,
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

// ---- safetensors files --------------------------------------------------------------------

/// The checksum of weights files and of `training_state.json`: FNV-1a over little-endian
/// 64-bit words with an xorshift per word. Each step is a bijection of the running state, so
/// any changed word changes the result.
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

/// The values of one tensor to write, borrowed.
enum Values<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    F64(&'a [f64]),
    I64(&'a [i64]),
}

impl Values<'_> {
    fn dtype(&self) -> &'static str {
        match self {
            Values::F32(_) => "F32",
            Values::BF16(_) => "BF16",
            Values::F16(_) => "F16",
            Values::F64(_) => "F64",
            Values::I64(_) => "I64",
        }
    }
    fn elem_size(&self) -> usize {
        match self {
            Values::F32(_) => 4,
            Values::BF16(_) | Values::F16(_) => 2,
            Values::F64(_) | Values::I64(_) => 8,
        }
    }
    fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::BF16(v) => v.len(),
            Values::F16(v) => v.len(),
            Values::F64(v) => v.len(),
            Values::I64(v) => v.len(),
        }
    }
    fn byte_len(&self) -> usize {
        self.elem_size() * self.len()
    }
    fn write_le(&self, out: &mut Vec<u8>) {
        match self {
            Values::F32(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            Values::BF16(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            Values::F16(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            Values::F64(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            Values::I64(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
        }
    }
    /// A parameter's values in their own element type.
    fn of<E: Precision>(data: &[E]) -> Values<'_> {
        if let Some(v) = as_same::<E, f32>(data) {
            Values::F32(v)
        } else if let Some(v) = as_same::<E, bf16>(data) {
            Values::BF16(v)
        } else if let Some(v) = as_same::<E, f16>(data) {
            Values::F16(v)
        } else if let Some(v) = as_same::<E, f64>(data) {
            Values::F64(v)
        } else {
            unreachable!("every Precision is f32, bf16, f16 or f64")
        }
    }
}

/// A safetensors file of `tensors` (names unique), with metadata `format = pt` (what
/// `safetensors.torch` writes) and the checksum.
///
/// The bytes are a function of the tensors alone: tensors with wider elements come first and
/// are sorted by name within a width (the order the `safetensors` writer uses, so every
/// tensor starts at a multiple of its element size; all-F32 weights are simply in name
/// order), and metadata keys are in a fixed order. The `safetensors` crate's writer takes the
/// metadata as a `HashMap`, whose order varies from run to run, so the header is written
/// here; the layout is the format's own (8-byte little-endian header length, JSON header
/// padded with spaces to 8 bytes, then the data) and every test reads the result back
/// through the `safetensors` parser (and Python's).
fn encode(mut tensors: Vec<(&str, &[usize], Values<'_>)>) -> Vec<u8> {
    tensors.sort_by(|a, b| b.2.elem_size().cmp(&a.2.elem_size()).then_with(|| a.0.cmp(b.0)));
    let json = |v: &str| serde_json::Value::from(v).to_string();
    let mut entries = Vec::with_capacity(tensors.len());
    let mut end = 0;
    for (name, shape, values) in &tensors {
        let start = end;
        end += values.byte_len();
        let shape: Vec<String> = shape.iter().map(usize::to_string).collect();
        entries.push(format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{start},{end}]}}",
            json(name),
            values.dtype(),
            shape.join(",")
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
    let mut out = Vec::with_capacity(8 + header.len() + end);
    out.extend((header.len() as u64).to_le_bytes());
    out.extend(header.as_bytes());
    for (_, _, values) in &tensors {
        values.write_le(&mut out);
    }
    // The checksum is computed with its own digits zero, then written over them (same length).
    let sum = format!("{:016x}", checksum(&out));
    let at = 8 + checksum_digits_at(&header).expect("the header was just written with the checksum key");
    out[at..at + 16].copy_from_slice(sum.as_bytes());
    out
}

/// Where the checksum's 16 digits are in a header this module wrote: right after the one
/// occurrence of `"amp.checksum":"`.
fn checksum_digits_at(header: &str) -> Option<usize> {
    let key = format!("\"{CHECKSUM_KEY}\":\"");
    let at = header.find(&key)? + key.len();
    (header.matches(&key).count() == 1 && header.len() >= at + 16).then_some(at)
}

fn read_bytes(path: &Path, what: &str) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| io_err(path, what, e))
}

/// Every tensor of a safetensors file, decoded, after verifying the checksum when the file
/// has one.
fn parse_tensors(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, StoredTensor>> {
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
        let tensor = decode(path, &name, &view)?;
        out.insert(name, tensor);
    }
    Ok(out)
}

/// One tensor's values: floating point as f32, integers and bools as i64.
fn decode(path: &Path, name: &str, view: &TensorView<'_>) -> Result<StoredTensor> {
    let data = view.data();
    let shape = view.shape().to_vec();
    let file_dtype = format!("{:?}", view.dtype());
    let float = |values: Vec<f32>| {
        StoredTensor::Float(LoadedTensor { shape: shape.clone(), file_dtype: file_dtype.clone(), values })
    };
    let ints: Vec<i64> = match view.dtype() {
        Dtype::F32 => {
            return Ok(float(
                data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(),
            ));
        }
        Dtype::F16 => {
            return Ok(float(data.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()));
        }
        Dtype::BF16 => {
            return Ok(float(data.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()));
        }
        Dtype::F64 => {
            return Ok(float(
                data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect(),
            ));
        }
        Dtype::I64 => data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect(),
        Dtype::I32 => data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")).into()).collect(),
        Dtype::I16 => data.chunks_exact(2).map(|c| i16::from_le_bytes([c[0], c[1]]).into()).collect(),
        Dtype::I8 => data.iter().map(|&b| i8::from_le_bytes([b]).into()).collect(),
        Dtype::U32 => data.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")).into()).collect(),
        Dtype::U16 => data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]).into()).collect(),
        Dtype::U8 => data.iter().map(|&b| b.into()).collect(),
        Dtype::U64 => {
            let mut out = Vec::with_capacity(data.len() / 8);
            for (i, c) in data.chunks_exact(8).enumerate() {
                let v = u64::from_le_bytes(c.try_into().expect("8 bytes"));
                let Ok(v) = i64::try_from(v) else {
                    return Err(file_err(
                        path,
                        format!("tensor `{name}` (U64) holds {v} at position {i}, beyond the i64 range of Indices"),
                    ));
                };
                out.push(v);
            }
            out
        }
        Dtype::BOOL => {
            if let Some(i) = data.iter().position(|&b| b > 1) {
                return Err(file_err(
                    path,
                    format!(
                        "tensor `{name}` is BOOL but holds the byte {} at position {i} (a bool is 0 or 1): the file \
                         is corrupt",
                        data[i]
                    ),
                ));
            }
            data.iter().map(|&b| b.into()).collect()
        }
        other => {
            return Err(file_err(
                path,
                format!(
                    "tensor `{name}` has dtype {other:?}, which is not read here (floating point: F32, F16, BF16, \
                     F64; integers: I64, I32, I16, I8, U64, U32, U16, U8, BOOL)"
                ),
            ));
        }
    };
    let indices = Indices::try_from_vec(ints, &shape).map_err(|e| file_err(path, format!("tensor `{name}`: {e}")))?;
    Ok(StoredTensor::Int { indices, file_dtype })
}

/// Why an integer tensor cannot be loaded as a parameter.
fn not_float(label: &str, file_dtype: &str) -> String {
    format!("tensor {label} holds {file_dtype} values; parameters are floating point (F32, F16, BF16 or F64)")
}

/// One floating-point tensor read from a file, converted to f32.
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

/// One tensor of a safetensors file: floating point or integer.
#[derive(Clone, Debug, PartialEq)]
pub enum StoredTensor {
    /// F32, F16, BF16 or F64 in the file, converted to f32 (written as F32).
    Float(LoadedTensor),
    /// I64 in the file, or I32, I16, I8, U64, U32, U16, U8 widened, or BOOL as 0 and 1
    /// (written as I64).
    Int {
        /// The values.
        indices: Indices,
        /// The dtype in the file (`I64` for one built from [`Indices`]).
        file_dtype: String,
    },
}

impl StoredTensor {
    /// Dims.
    pub fn shape(&self) -> &[usize] {
        match self {
            StoredTensor::Float(t) => &t.shape,
            StoredTensor::Int { indices, .. } => indices.shape(),
        }
    }
    /// The dtype in the file (`F32`, `I64`, ...).
    pub fn file_dtype(&self) -> &str {
        match self {
            StoredTensor::Float(t) => &t.file_dtype,
            StoredTensor::Int { file_dtype, .. } => file_dtype,
        }
    }
    /// The floating-point tensor, if this is one.
    pub fn as_float(&self) -> Option<&LoadedTensor> {
        match self {
            StoredTensor::Float(t) => Some(t),
            StoredTensor::Int { .. } => None,
        }
    }
    /// The integers, if this is an integer tensor.
    pub fn as_indices(&self) -> Option<&Indices> {
        match self {
            StoredTensor::Float(_) => None,
            StoredTensor::Int { indices, .. } => Some(indices),
        }
    }
    fn values(&self) -> Values<'_> {
        match self {
            StoredTensor::Float(t) => Values::F32(&t.values),
            StoredTensor::Int { indices, .. } => Values::I64(indices.as_slice()),
        }
    }
}

impl From<LoadedTensor> for StoredTensor {
    fn from(t: LoadedTensor) -> Self {
        StoredTensor::Float(t)
    }
}

impl From<&Tensor<f32>> for StoredTensor {
    /// The tensor's values (an F32 tensor).
    fn from(t: &Tensor<f32>) -> Self {
        StoredTensor::Float(LoadedTensor { shape: t.shape().to_vec(), file_dtype: "F32".into(), values: t.to_vec() })
    }
}

impl From<Tensor<f32>> for StoredTensor {
    /// The tensor's values (an F32 tensor).
    fn from(t: Tensor<f32>) -> Self {
        StoredTensor::from(&t)
    }
}

impl From<Indices> for StoredTensor {
    /// The indices (an I64 tensor).
    fn from(indices: Indices) -> Self {
        StoredTensor::Int { indices, file_dtype: "I64".into() }
    }
}

impl From<&Indices> for StoredTensor {
    /// The indices (an I64 tensor; the values are shared, not copied).
    fn from(indices: &Indices) -> Self {
        StoredTensor::from(indices.clone())
    }
}

/// The tensors of a safetensors file by name, floating point and integer: data and labels
/// (`x` as f32, `y` as [`Indices`]), or any `state_dict`. Read one with [`read_tensors`];
/// build one with [`TensorFile::insert`] and write it with [`save_tensors`].
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::checkpoint::{TensorFile, read_tensors, save_tensors};
/// use amp::{Indices, Tensor};
/// let mut data = TensorFile::new();
/// data.insert("x", &Tensor::<f32>::from_vec(vec![0.5, 1.5, -2.0, 4.0], &[2, 2]));
/// data.insert("y", Indices::from_vec(vec![3, -100], &[2]));
/// let path = std::env::temp_dir().join(format!("amp-doc-data-{}.safetensors", std::process::id()));
/// save_tensors(&path, &data)?;
/// let back = read_tensors(&path)?;
/// assert_eq!(back.indices("y")?.as_slice(), &[3, -100]);
/// assert_eq!(back.tensor("x")?.to_vec(), vec![0.5, 1.5, -2.0, 4.0]);
/// assert!(back.indices("x").unwrap_err().to_string().contains("holds F32 values"));
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), amp::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct TensorFile {
    tensors: BTreeMap<String, StoredTensor>,
    /// The file it was read from, for error messages.
    path: Option<PathBuf>,
}

impl TensorFile {
    /// No tensors.
    pub fn new() -> Self {
        TensorFile::default()
    }
    /// The file these tensors were read from (`None` for one built in memory).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
    /// Adds (or replaces, returning the old one) the tensor called `name`: a `&Tensor<f32>`,
    /// [`Indices`], or a [`StoredTensor`].
    pub fn insert(&mut self, name: impl Into<String>, tensor: impl Into<StoredTensor>) -> Option<StoredTensor> {
        self.tensors.insert(name.into(), tensor.into())
    }
    /// Removes the tensor called `name`, returning it.
    pub fn remove(&mut self, name: &str) -> Option<StoredTensor> {
        self.tensors.remove(name)
    }
    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&StoredTensor> {
        self.tensors.get(name)
    }
    /// Every tensor, by name (sorted).
    pub fn tensors(&self) -> &BTreeMap<String, StoredTensor> {
        &self.tensors
    }
    /// The tensors, by name.
    pub fn into_tensors(self) -> BTreeMap<String, StoredTensor> {
        self.tensors
    }
    /// The names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }
    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
    fn lookup(&self, name: &str) -> Result<&StoredTensor> {
        self.tensors.get(name).ok_or_else(|| {
            let names: Vec<String> = self.tensors.keys().take(20).map(|n| format!("`{n}`")).collect();
            let more =
                if self.tensors.len() > 20 { format!(" and {} more", self.tensors.len() - 20) } else { String::new() };
            self.err(format!(
                "there is no tensor `{name}` (the tensors are {}{more})",
                if names.is_empty() { "none".to_string() } else { names.join(", ") }
            ))
        })
    }
    fn err(&self, detail: String) -> Error {
        file_err(self.path.as_deref().unwrap_or(Path::new("tensors in memory")), detail)
    }
    /// The floating-point tensor called `name`, as a `Tensor<f32>`. Refuses, naming the file,
    /// a name the file lacks and an integer tensor (read that with [`TensorFile::indices`]).
    pub fn tensor(&self, name: &str) -> Result<Tensor<f32>> {
        match self.lookup(name)? {
            StoredTensor::Float(t) => Ok(t.to_tensor()),
            StoredTensor::Int { file_dtype, .. } => Err(self.err(format!(
                "tensor `{name}` holds {file_dtype} values (integers): read it with TensorFile::indices"
            ))),
        }
    }
    /// The integer tensor called `name`, as [`Indices`] (shared, not copied). Refuses,
    /// naming the file, a name the file lacks and a floating-point tensor.
    pub fn indices(&self, name: &str) -> Result<Indices> {
        match self.lookup(name)? {
            StoredTensor::Int { indices, .. } => Ok(indices.clone()),
            StoredTensor::Float(t) => Err(self.err(format!(
                "tensor `{name}` holds {} values (floating point), not integers: read it with TensorFile::tensor",
                t.file_dtype
            ))),
        }
    }
    /// The tensors as a safetensors file (floating point as F32, integers as I64), with the
    /// same metadata and checksum as [`weights_to_bytes`]; the bytes depend on the tensors
    /// alone.
    pub fn to_bytes(&self) -> Vec<u8> {
        encode(self.tensors.iter().map(|(name, t)| (name.as_str(), t.shape(), t.values())).collect())
    }
}

/// Reads every tensor of a safetensors file: floating point (F32, F16, BF16, F64) as f32,
/// integers as [`Indices`] (I64; I32, I16, I8, U64, U32, U16, U8 widened; BOOL as 0/1),
/// verifying the checksum when the file has one. Errors name the file, and the tensor where
/// one is at fault.
pub fn read_tensors(path: impl AsRef<Path>) -> Result<TensorFile> {
    let path = path.as_ref();
    let tensors = parse_tensors(path, &read_bytes(path, "cannot read the tensors")?)?;
    Ok(TensorFile { tensors, path: Some(path.to_path_buf()) })
}

/// Saves `tensors` to `path` atomically (see [`TensorFile::to_bytes`]).
pub fn save_tensors(path: impl AsRef<Path>, tensors: &TensorFile) -> Result<()> {
    write_atomic(path.as_ref(), &tensors.to_bytes())
}

// ---- weights -----------------------------------------------------------------------------

/// The model's parameters and buffers as a safetensors file: parameters in their element type
/// (`F32`, or `BF16` for a pure-bf16 model), buffers (running statistics) in `F32`, PyTorch
/// names, metadata `format = pt` (what `safetensors.torch` writes) and the checksum. Saving the
/// same model twice gives the same bytes.
pub fn weights_to_bytes<E: Precision, D: Device>(model: &impl Params<E, D>) -> Result<Vec<u8>> {
    let buffers: Vec<(String, Vec<usize>, Vec<f32>)> =
        model.named_buffers().into_iter().map(|(n, b)| (n, b.shape().to_vec(), b.to_vec())).collect();
    let params = model.named_params();
    // The values on the host (a copy, also on the CPU: the file is written from it).
    let values: Vec<Vec<E>> = params.iter().map(|(_, p)| p.to_vec()).collect();
    let mut named: Vec<(&str, &[usize], Values<'_>)> =
        params.iter().zip(&values).map(|((n, p), v)| (n.as_str(), p.shape(), Values::of(v))).collect();
    named.extend(buffers.iter().map(|(n, shape, v)| (n.as_str(), &shape[..], Values::F32(v))));
    named.sort_by(|a, b| a.0.cmp(b.0));
    if let Some(w) = named.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(Error::State {
            context: "checkpoint".into(),
            detail: format!("the model has two parameters or buffers named `{}`", w[0].0),
        });
    }
    Ok(encode(named))
}

/// Saves the model's parameters to `path` (safetensors in their element type, PyTorch names),
/// atomically.
pub fn save_weights<E: Precision, D: Device>(path: impl AsRef<Path>, model: &impl Params<E, D>) -> Result<()> {
    write_atomic(path.as_ref(), &weights_to_bytes(model)?)
}

/// Reads every tensor of a weights file (f32, f16, bf16 or f64, converted to f32),
/// verifying the checksum when the file has one. Errors name the file, and the tensor where
/// one is at fault; an integer tensor is refused ([`read_tensors`] reads those).
pub fn read_weights(path: impl AsRef<Path>) -> Result<BTreeMap<String, LoadedTensor>> {
    let path = path.as_ref();
    let tensors = parse_tensors(path, &read_bytes(path, "cannot read the weights")?)?;
    tensors
        .into_iter()
        .map(|(name, t)| match t {
            StoredTensor::Float(t) => Ok((name, t)),
            StoredTensor::Int { file_dtype, .. } => Err(file_err(
                path,
                format!(
                    "{}; read_tensors reads integer tensors (as Indices)",
                    not_float(&format!("`{name}`"), &file_dtype)
                ),
            )),
        })
        .collect()
}

/// A key-mapping hook: the name so far to the new one, or `None` to drop the tensor.
type KeyFn = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// A step of a [`LoadOptions`] key mapping.
#[derive(Clone)]
enum KeyStep {
    StripPrefix(String),
    /// Whole dotted components `from` replaced by `to` (empty: removed).
    Rename {
        from: Vec<String>,
        to: Vec<String>,
    },
    Map(KeyFn),
}

impl std::fmt::Debug for KeyStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyStep::StripPrefix(p) => write!(f, "strip_prefix({p:?})"),
            KeyStep::Rename { from, to } => write!(f, "rename({:?}, {:?})", from.join("."), to.join(".")),
            KeyStep::Map(_) => write!(f, "map_keys(..)"),
        }
    }
}

impl KeyStep {
    fn apply(&self, name: &str) -> Option<String> {
        match self {
            KeyStep::StripPrefix(p) => Some(name.strip_prefix(p.as_str()).unwrap_or(name).to_string()),
            KeyStep::Rename { from, to } => {
                let parts: Vec<&str> = name.split('.').collect();
                if from.is_empty() || from.len() > parts.len() {
                    return Some(name.to_string());
                }
                let mut out: Vec<&str> = Vec::with_capacity(parts.len() + to.len());
                let mut i = 0;
                while i < parts.len() {
                    if i + from.len() <= parts.len() && parts[i..i + from.len()].iter().eq(from.iter()) {
                        out.extend(to.iter().map(String::as_str));
                        i += from.len();
                    } else {
                        out.push(parts[i]);
                        i += 1;
                    }
                }
                Some(out.join("."))
            }
            KeyStep::Map(f) => f(name),
        }
    }
}

/// How [`load_weights_with`] matches a file's tensors to a model's parameters: strictly (the
/// default, as [`load_weights`]) or not, and how the file's names become the model's.
///
/// The mapping is a chain of steps applied in the order they were added to each name in the
/// file; the result is the model parameter the tensor loads into. A step that returns `None`
/// drops the tensor (it is listed in [`LoadReport::dropped`], and is not unexpected).
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::checkpoint::LoadOptions;
/// let opts = LoadOptions::new()
///     .strict(false)
///     .strip_prefix("module.") // saved from a DataParallel model
///     .rename("fc1", "mlp.fc") // whole components, anywhere in the name
///     .rename("ln", "ln_f") // `ln.weight`, but not `ln1.weight`
///     .map_keys(|name| (!name.ends_with(".attn.mask")).then(|| name.to_string())); // drop buffers
/// assert_eq!(opts.map_name("module.blocks.0.fc1.weight").as_deref(), Some("blocks.0.mlp.fc.weight"));
/// assert_eq!(opts.map_name("ln.bias").as_deref(), Some("ln_f.bias"));
/// assert_eq!(opts.map_name("blocks.0.ln1.bias").as_deref(), Some("blocks.0.ln1.bias"));
/// assert_eq!(opts.map_name("blocks.0.attn.mask"), None);
/// ```
#[derive(Clone, Debug)]
pub struct LoadOptions {
    strict: bool,
    steps: Vec<KeyStep>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { strict: true, steps: Vec::new() }
    }
}

impl LoadOptions {
    /// Strict, with names used as they are in the file.
    pub fn new() -> Self {
        LoadOptions::default()
    }
    /// Strict (the default): a model parameter the file lacks, or a file tensor the model
    /// lacks (after mapping), refuses the load. Not strict: the tensors that match load and
    /// the others are reported ([`LoadReport`]), as PyTorch's `strict=False`. A wrong shape, an
    /// integer tensor under a parameter's name and two tensors mapped to one name refuse the
    /// load either way.
    pub fn strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }
    /// Whether loads refuse missing and unexpected tensors.
    pub fn is_strict(&self) -> bool {
        self.strict
    }
    /// Adds a mapping step: `f` gets the name so far and returns the new one, or `None` to
    /// drop the tensor.
    pub fn map_keys(mut self, f: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> Self {
        self.steps.push(KeyStep::Map(Arc::new(f)));
        self
    }
    /// Adds a step that removes `prefix` from the start of a name that has it (others pass
    /// unchanged), as PyTorch's `consume_prefix_in_state_dict_if_present`: give the dot too
    /// (`"module."`).
    pub fn strip_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.steps.push(KeyStep::StripPrefix(prefix.into()));
        self
    }
    /// Adds a step that replaces the dotted components `from` with `to` wherever they occur as
    /// whole components: `rename("fc1", "mlp.fc")` maps `blocks.0.fc1.weight` to
    /// `blocks.0.mlp.fc.weight` but leaves `fc10.weight` alone; `rename("transformer.h",
    /// "blocks")` maps `transformer.h.3.ln_1.bias` to `blocks.3.ln_1.bias`. An empty `to`
    /// removes the components; an empty `from` changes nothing.
    pub fn rename(mut self, from: &str, to: &str) -> Self {
        let split = |s: &str| if s.is_empty() { Vec::new() } else { s.split('.').map(str::to_string).collect() };
        self.steps.push(KeyStep::Rename { from: split(from), to: split(to) });
        self
    }
    /// The model name a tensor called `file_name` in the file loads into, or `None` if the
    /// mapping drops it.
    pub fn map_name(&self, file_name: &str) -> Option<String> {
        let mut name = file_name.to_string();
        for step in &self.steps {
            name = step.apply(&name)?;
        }
        Some(name)
    }
}

/// What a [`load_weights_with`] loaded and what it did not, as PyTorch's
/// `load_state_dict(strict=False)` returns (`missing_keys`, `unexpected_keys`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Parameters loaded.
    pub loaded: usize,
    /// Model parameters the file has no tensor for (model names, in the model's order); they
    /// keep their values.
    pub missing: Vec<String>,
    /// File tensors that map to no model parameter (the file's names, sorted); not loaded.
    pub unexpected: Vec<String>,
    /// File tensors the key mapping dropped (the file's names, sorted); not loaded.
    pub dropped: Vec<String>,
}

impl LoadReport {
    /// Whether every parameter was loaded and every tensor not dropped was used.
    pub fn is_exact(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty()
    }
}

impl std::fmt::Display for LoadReport {
    /// `loaded 10 tensors; missing 1 (`head.bias`); unexpected 0; dropped 2 (`a`, `b`)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |names: &[String]| {
            if names.is_empty() {
                "0".to_string()
            } else {
                let shown: Vec<String> = names.iter().take(10).map(|n| format!("`{n}`")).collect();
                let more = if names.len() > 10 { format!(", and {} more", names.len() - 10) } else { String::new() };
                format!("{} ({}{more})", names.len(), shown.join(", "))
            }
        };
        write!(
            f,
            "loaded {} tensors; missing {}; unexpected {}; dropped {}",
            self.loaded,
            list(&self.missing),
            list(&self.unexpected),
            list(&self.dropped)
        )
    }
}

/// Loads a safetensors file into the model's parameters, by name, strictly. Refuses, naming
/// the file and the tensor, a tensor the model lacks, a parameter the file lacks, a shape or
/// dtype mismatch, and a truncated or corrupt file; nothing is written unless everything
/// matches. Files of any float dtype (PyTorch exports in f16/bf16/f64) are converted to the
/// model's element type: f32, or bf16 (rounded to nearest) for a pure-bf16 model. For other
/// names or a partial load, see [`load_weights_with`].
pub fn load_weights<E: Precision, D: Device>(path: impl AsRef<Path>, model: &mut impl Params<E, D>) -> Result<()> {
    load_weights_with(path, model, &LoadOptions::new()).map(|_| ())
}

/// Loads a safetensors file into the model's parameters as `opts` say: the file's names go
/// through the key mapping, then each tensor loads into the parameter of that name. Returns
/// what was loaded, missing, unexpected and dropped. Everything is checked before anything is
/// written: a refused load (a strict mismatch, a wrong shape, an integer tensor under a
/// parameter's name, two file tensors mapped to one name, a corrupt file) leaves the model as
/// it was, and its error names the file and every tensor at fault.
pub fn load_weights_with<E: Precision, D: Device>(
    path: impl AsRef<Path>,
    model: &mut impl Params<E, D>,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    let path = path.as_ref();
    let tensors = parse_tensors(path, &read_bytes(path, "cannot read the weights")?)?;
    assign(path, tensors, model, opts)
}

/// Problems of one kind listed in a refusal: at most this many, then a count.
const MAX_LISTED: usize = 6;

fn assign<E: Precision, D: Device>(
    path: &Path,
    tensors: BTreeMap<String, StoredTensor>,
    model: &mut impl Params<E, D>,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    // What the model holds: every parameter, then every buffer, by name, with its shape.
    let mut targets: Vec<(String, Vec<usize>)> =
        model.named_params().into_iter().map(|(n, p)| (n, p.shape().to_vec())).collect();
    let n_params = targets.len();
    targets.extend(model.named_buffers().into_iter().map(|(n, b)| (n, b.shape().to_vec())));
    let kind = |i: usize| if i < n_params { "parameter" } else { "buffer" };
    let mut errors = Vec::new();
    let mut seen = HashSet::with_capacity(targets.len());
    for (name, _) in &targets {
        if !seen.insert(name.as_str()) {
            errors.push(format!("the model has two parameters or buffers named `{name}`"));
        }
    }
    // Model name -> (file name, tensor).
    let mut mapped: BTreeMap<String, (String, StoredTensor)> = BTreeMap::new();
    let mut dropped = Vec::new();
    for (file_name, tensor) in tensors {
        let Some(name) = opts.map_name(&file_name) else {
            dropped.push(file_name);
            continue;
        };
        match mapped.entry(name) {
            std::collections::btree_map::Entry::Occupied(e) => errors.push(format!(
                "tensors `{}` and `{file_name}` both map to `{}`: the key mapping must give each tensor its own name",
                e.get().0,
                e.key()
            )),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert((file_name, tensor));
            }
        }
    }
    let label = |file: &str, model: &str| {
        if file == model { format!("`{file}`") } else { format!("`{file}` (mapped to `{model}`)") }
    };
    let mut plan = Vec::new(); // (target index, values)
    let mut missing = Vec::new();
    for (i, (name, shape)) in targets.iter().enumerate() {
        match mapped.remove(name) {
            None => missing.push((name.clone(), shape.clone(), kind(i))),
            Some((file, StoredTensor::Int { file_dtype, .. })) if i < n_params => {
                errors.push(not_float(&label(&file, name), &file_dtype))
            }
            Some((file, t)) if t.shape() != &shape[..] => errors.push(format!(
                "tensor {} has shape {:?} in the file, but the model's {} has shape {:?}",
                label(&file, name),
                t.shape(),
                kind(i),
                shape
            )),
            // A buffer may be stored as integers (PyTorch's `num_batches_tracked` is I64).
            Some((_, StoredTensor::Int { indices, .. })) => {
                plan.push((i, indices.as_slice().iter().map(|&v| v as f32).collect()))
            }
            Some((_, StoredTensor::Float(t))) => plan.push((i, t.values)),
        }
    }
    let mut unexpected: Vec<(String, String)> = mapped.into_iter().map(|(name, (file, _))| (file, name)).collect();
    unexpected.sort();
    let mismatch = !missing.is_empty() || !unexpected.is_empty();
    if !errors.is_empty() || (opts.strict && mismatch) {
        // Each kind of problem is listed up to a bound, so a file of other names shows both
        // sides of the mismatch.
        let mut parts = Vec::new();
        let mut list = |items: Vec<String>, more: &str| {
            let n = items.len();
            parts.extend(items.into_iter().take(MAX_LISTED));
            if n > MAX_LISTED {
                parts.push(format!("and {} more {more}", n - MAX_LISTED));
            }
        };
        list(errors, "problems");
        if opts.strict {
            let missing_msgs = missing.iter().map(|(name, shape, kind)| {
                format!("tensor `{name}` is missing: the model has this {kind} (shape {shape:?}), the file does not")
            });
            list(missing_msgs.collect(), "missing parameters");
            let unexpected_msgs = unexpected.iter().map(|(file, name)| {
                format!("unexpected tensor {}: the model has no parameter of that name", label(file, name))
            });
            list(unexpected_msgs.collect(), "unexpected tensors");
        }
        let mut detail = parts.join("; ");
        let missing_names: Vec<(String, Vec<usize>)> = missing.iter().map(|(n, s, _)| (n.clone(), s.clone())).collect();
        if opts.strict && mismatch {
            if let Some(hint) = prefix_hint(&missing_names, &unexpected) {
                detail.push_str(&format!(". {hint}"));
            }
            detail.push_str(
                ". A non-strict load (load_weights_with with LoadOptions::new().strict(false)) loads the tensors \
                 that match and reports the others",
            );
        }
        detail.push_str(" (nothing was loaded)");
        return Err(file_err(path, detail));
    }
    let loaded = plan.len();
    let (for_params, for_buffers): (Vec<_>, Vec<_>) = plan.into_iter().partition(|(i, _)| *i < n_params);
    let mut params = model.named_params_mut();
    for (i, values) in for_params {
        let p = &mut params[i].1;
        let mut converted = vec![E::from_f64(0.0); values.len()];
        E::from_f32_slice(&values, &mut converted);
        let dev = p.device().clone();
        p.set(&Tensor::from_storage(&dev, dev.from_host(converted), &targets[i].1));
    }
    drop(params);
    let mut buffers = model.named_buffers_mut();
    for (i, values) in for_buffers {
        let b = &mut buffers[i - n_params].1;
        let dev = b.device().clone();
        b.set_values(&Tensor::from_storage(&dev, dev.from_host(values), &targets[i].1));
    }
    Ok(LoadReport {
        loaded,
        missing: missing.into_iter().map(|(name, _, _)| name).collect(),
        unexpected: unexpected.into_iter().map(|(file, _)| file).collect(),
        dropped,
    })
}

/// A hint when the file's names are the model's with a prefix (`module.fc.weight` for
/// `fc.weight`).
fn prefix_hint(missing: &[(String, Vec<usize>)], unexpected: &[(String, String)]) -> Option<String> {
    let missing: HashSet<&str> = missing.iter().map(|(n, _)| n.as_str()).collect();
    unexpected.iter().take(MAX_LISTED).find_map(|(_, name)| {
        name.match_indices('.').map(|(at, _)| at + 1).find(|&at| missing.contains(&name[at..])).map(|at| {
            let prefix = &name[..at];
            format!(
                "The file's names look like the model's behind the prefix `{prefix}`: LoadOptions::strip_prefix({prefix:?}) \
                 removes it"
            )
        })
    })
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
pub fn save_checkpoint<O: Serialize, S: Serialize, X: Serialize, E: Precision, D: Device>(
    dir: impl AsRef<Path>,
    model: &impl Params<E, D>,
    state: &TrainingState<O, S, X>,
) -> Result<CheckpointFiles> {
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
    // The state is serialised first: a state that cannot be leaves no weights behind.
    if let Some((field, value)) = floats::find_non_finite(state) {
        return Err(Error::State {
            context: "checkpoint".into(),
            detail: format!(
                "cannot save `state.{field}`: it is {value}, which JSON has no number for (serde_json would \
                 write null, which does not load back as a float); serialise that field with \
                 `#[serde(with = \"amp_core::checkpoint::floats\")]`, which writes NaN and ±inf as strings"
            ),
        });
    }
    let file = StateFileOut {
        checksum: CHECKSUM_PLACEHOLDER,
        format: FORMAT,
        version: VERSION,
        weights: &weights_name,
        state,
    };
    let mut json = serde_json::to_vec_pretty(&file).map_err(|e| Error::State {
        context: "checkpoint".into(),
        detail: format!("cannot serialise the training state: {e}"),
    })?;
    // As in the weights: the checksum is computed with its own digits zero, then written over them.
    assert!(json.starts_with(STATE_CHECKSUM_PREFIX), "the checksum is the state file's first field");
    let sum = format!("{:016x}", checksum(&json));
    json[STATE_CHECKSUM_PREFIX.len()..][..16].copy_from_slice(sum.as_bytes());
    let weights = dir.join(&weights_name);
    save_weights(&weights, model)?;
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

/// Reads a checkpoint's state and the weights file it names, without touching a model. The
/// state's parts are read as `O`, `S` and `X` (say which by annotating the result, as
/// `let (state, _): (TrainingState, _) = ...` for untyped JSON); a part that does not hold
/// its type is refused naming the part and the file.
pub fn read_checkpoint_state<O: DeserializeOwned, S: DeserializeOwned, X: DeserializeOwned>(
    dir: impl AsRef<Path>,
) -> Result<(TrainingState<O, S, X>, PathBuf)> {
    let dir = dir.as_ref();
    let state_path = dir.join(STATE_FILE);
    let bytes = fs::read(&state_path).map_err(|e| io_err(&state_path, "cannot read the checkpoint", e))?;
    let check_version = |format: &str, version: u32| {
        if format != FORMAT || version != VERSION {
            return Err(file_err(
                &state_path,
                format!("format `{format}` version {version}, but this build reads `{FORMAT}` version {VERSION}"),
            ));
        }
        Ok(())
    };
    let file: StateFileIn = match serde_json::from_slice(&bytes) {
        Ok(file) => file,
        Err(e) => {
            // A file of another version may be laid out otherwise: that is the error to report.
            if let Ok(v) = serde_json::from_slice::<StateFileVersion>(&bytes) {
                check_version(&v.format, v.version)?;
            }
            return Err(file_err(&state_path, format!("not a valid checkpoint state (truncated or corrupt?): {e}")));
        }
    };
    check_version(&file.format, file.version)?;
    match &file.checksum {
        Some(recorded) => verify_state_checksum(&state_path, &bytes, recorded)?,
        // Files of earlier versions begin with `format`; one that does not lost its checksum
        // field (a changed key is ignored by the reader, which would load it unchecked).
        None if !first_key_is_format(&bytes) => {
            return Err(file_err(
                &state_path,
                "was modified or corrupted since it was saved: it has no `checksum` field, and it is not laid \
                 out as the files of earlier versions without one are"
                    .into(),
            ));
        }
        None => {}
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
    let state = file.state.typed().map_err(|detail| file_err(&state_path, detail))?;
    Ok((state, weights))
}

/// Whether a JSON object's first key is `format`, as in the state files of versions before
/// the checksum (written by this crate, or rewritten by a JSON library that sorts keys).
fn first_key_is_format(bytes: &[u8]) -> bool {
    let rest = bytes.trim_ascii_start();
    rest.strip_prefix(b"{").is_some_and(|r| r.trim_ascii_start().starts_with(b"\"format\""))
}

/// Refuses `bytes`, a `training_state.json` that records the checksum `recorded`, unless the
/// checksum of its bytes (with the checksum's own digits read as zeros) is `recorded`.
fn verify_state_checksum(path: &Path, bytes: &[u8], recorded: &str) -> Result<()> {
    let digits = STATE_CHECKSUM_PREFIX.len()..STATE_CHECKSUM_PREFIX.len() + 16;
    let in_place = bytes.starts_with(STATE_CHECKSUM_PREFIX)
        && bytes.get(digits.clone()) == Some(recorded.as_bytes())
        && bytes.get(digits.end) == Some(&b'"');
    if !in_place {
        return Err(file_err(
            path,
            "was modified or corrupted since it was saved: its `checksum` is not the first field as written \
             (was the file edited or reformatted?)"
                .into(),
        ));
    }
    let mut zeroed = bytes.to_vec();
    zeroed[digits].copy_from_slice(CHECKSUM_PLACEHOLDER.as_bytes());
    let actual = format!("{:016x}", checksum(&zeroed));
    if actual != recorded {
        return Err(file_err(
            path,
            format!(
                "was modified or corrupted since it was saved: its content's checksum is {actual}, but the file \
                 records {recorded}"
            ),
        ));
    }
    Ok(())
}

/// Loads the checkpoint in `dir` into `model` and returns its training state, with its parts
/// read as `O`, `S` and `X` (see [`read_checkpoint_state`]); the last generic argument is the
/// model's element type and device, inferred (`load_checkpoint::<O, S, X, _>`). The model is
/// untouched if anything is refused (see [`load_weights`]).
///
/// The model may be on any device: the weights are read on the host and copied to each
/// parameter's device, so a checkpoint written on one device resumes on another (the
/// optimizer's state follows at its next step, see [`crate::optim::Optim::load_state_dict`]).
pub fn load_checkpoint<O: DeserializeOwned, S: DeserializeOwned, X: DeserializeOwned, T>(
    dir: impl AsRef<Path>,
    model: &mut impl CheckpointModel<T>,
) -> Result<TrainingState<O, S, X>> {
    let (state, weights) = read_checkpoint_state(dir)?;
    model.load_weights_from(&weights)?;
    Ok(state)
}

/// A model [`load_checkpoint`] can load into: any [`Params<E, D>`], with `T = (E, D)`.
///
/// It exists so that `load_checkpoint::<O, S, X, _>` names one inferred argument for both the
/// element type and the device (a function's generic arguments have no defaults). Implemented
/// for every model; sealed.
pub trait CheckpointModel<T>: sealed::Sealed<T> {
    /// [`load_weights`] into this model.
    fn load_weights_from(&mut self, weights: &Path) -> Result<()>;
}

impl<E: Precision, D: Device, M: Params<E, D>> CheckpointModel<(E, D)> for M {
    fn load_weights_from(&mut self, weights: &Path) -> Result<()> {
        load_weights(weights, self)
    }
}

mod sealed {
    pub trait Sealed<T> {}
    impl<E: crate::Precision, D: crate::Device, M: crate::Params<E, D>> Sealed<(E, D)> for M {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Param, Rng};

    // `#[derive(Params)]` inside amp-core itself: generated `::amp_core` paths resolve through
    // the crate's `extern crate self as amp_core`.
    #[derive(crate::Params)]
    struct Pair {
        w: Param,
        b: Param,
    }

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
        let report =
            assign(Path::new("mem"), parse_tensors(Path::new("mem"), &bytes).unwrap(), &mut b, &LoadOptions::new())
                .unwrap();
        assert_eq!(report, LoadReport { loaded: 1, ..LoadReport::default() });
        assert_eq!(a.w.to_vec(), b.w.to_vec());
        // Deterministic bytes, readable by the safetensors parser, also with no tensors.
        assert_eq!(weights_to_bytes(&a).unwrap(), bytes);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.names(), ["w"]);
        let empty: Vec<Param> = Vec::new();
        let bytes = weights_to_bytes(&empty).unwrap();
        assert!(parse_tensors(Path::new("mem"), &bytes).unwrap().is_empty());
        assert_eq!(bytes.len() % 8, 0);
    }

    /// The bytes of a weights file are fixed: this header and data are what the format had
    /// before tensor files and integer dtypes were added (checksum included).
    #[test]
    fn weights_bytes_are_unchanged() {
        let m = Pair {
            w: Param::new(Tensor::from_vec(vec![0.5f32, -1.25, 2.0, 3.5], &[2, 2])),
            b: Param::new(Tensor::from_vec(vec![0.125f32, -0.0], &[2])),
        };
        let bytes = weights_to_bytes(&m).unwrap();
        let header = r#"{"__metadata__":{"format":"pt","amp.checksum":"234f41ad082e4132"},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]}} "#;
        assert_eq!(bytes[..8], (header.len() as u64).to_le_bytes());
        assert_eq!(std::str::from_utf8(&bytes[8..8 + header.len()]).unwrap(), header);
        let data: Vec<u8> = [0.125f32, -0.0, 0.5, -1.25, 2.0, 3.5].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(bytes[8 + header.len()..], data[..]);
        // The same tensors as a TensorFile give the same bytes.
        let mut file = TensorFile::new();
        file.insert("w", m.w.tensor());
        file.insert("b", m.b.tensor());
        assert_eq!(file.to_bytes(), bytes);
    }

    #[test]
    fn mixed_files_put_wider_elements_first() {
        let mut file = TensorFile::new();
        file.insert("a", Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0], &[3]));
        file.insert("b", Indices::from_vec(vec![-1, i64::MAX], &[2]));
        let bytes = file.to_bytes();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let offsets = |n: &str| meta.info(n).unwrap().data_offsets;
        assert_eq!((offsets("b"), offsets("a")), ((0, 16), (16, 28)));
        assert_eq!(st.tensor("b").unwrap().dtype(), Dtype::I64);
        let back = parse_tensors(Path::new("mem"), &bytes).unwrap();
        assert_eq!(back["b"].as_indices().unwrap().as_slice(), &[-1, i64::MAX]);
        assert_eq!(back["a"].as_float().unwrap().values, vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn key_steps() {
        let o = LoadOptions::new()
            .strip_prefix("module.")
            .rename("transformer.h", "blocks")
            .rename("c_fc", "mlp.fc")
            .rename("wrapper", "");
        let map = |n: &str| o.map_name(n);
        assert_eq!(map("module.transformer.h.3.c_fc.weight").as_deref(), Some("blocks.3.mlp.fc.weight"));
        // Whole components only: `c_fc2` and `xtransformer` are left alone.
        assert_eq!(map("transformer.h2.c_fc2.bias").as_deref(), Some("transformer.h2.c_fc2.bias"));
        assert_eq!(map("xtransformer.h.c_fc").as_deref(), Some("xtransformer.h.mlp.fc"));
        // A prefix in the middle is not stripped; an empty `to` removes components.
        assert_eq!(map("a.module.b").as_deref(), Some("a.module.b"));
        assert_eq!(map("wrapper.x.wrapper").as_deref(), Some("x"));
        assert_eq!(map("wrapper").as_deref(), Some(""));
        // An empty `from` changes nothing; every occurrence is renamed; steps run in order.
        let o = LoadOptions::new().rename("", "x").rename("a", "b").rename("b", "c");
        assert_eq!(o.map_name("a.b.a").as_deref(), Some("c.c.c"));
        // A hook's `None` ends the chain.
        let o = LoadOptions::new().map_keys(|n| n.strip_prefix("keep.").map(str::to_string)).rename("x", "y");
        assert_eq!((o.map_name("keep.x").as_deref(), o.map_name("x")), (Some("y"), None));
        assert!(o.is_strict() && !o.clone().strict(false).is_strict());
        assert_eq!(format!("{o:?}"), r#"LoadOptions { strict: true, steps: [map_keys(..), rename("x", "y")] }"#);
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
