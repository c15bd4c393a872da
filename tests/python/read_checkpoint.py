#!/usr/bin/env python3
"""Reads amp's safetensors weights with Python's `safetensors` + numpy and checks them against the
JSON manifest the Rust side wrote next to them; then writes the same weights back from Python
(f32 and f16, PyTorch's `format: pt` metadata) for the Rust side to load. Likewise checks a data
file of f32 and int64 tensors (amp's `save_tensors`), and writes integer tensors (int64, int32,
uint8, bool) for the Rust side to read as Indices.

Usage: python3 tests/python/read_checkpoint.py DIR
  DIR holds manifest.json ({"weights": FILE, "tensors": [{"name", "shape", "dtype", "values"}],
  optionally "data": {"file": FILE, "tensors": [...]}) and the files it names. Writes
  DIR/from_python_f32.safetensors, DIR/from_python_f16.safetensors and
  DIR/from_python_ints.safetensors.
Run by `cargo test -p amp-core --test checkpoint_python` (needs `pip install safetensors numpy`).
Exits non-zero, saying what differs, on any mismatch.
"""
import json
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

DTYPES = {"F32": np.float32, "I64": np.int64}


def fail(msg: str) -> None:
    print(f"read_checkpoint.py: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def check_file(path: Path, expected_tensors: list) -> dict:
    """Checks the metadata and every tensor of `path` against the manifest's list; returns the
    tensors by name."""
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata() or {}
        names = sorted(f.keys())
    if meta.get("format") != "pt":
        fail(f"{path}: metadata format is {meta.get('format')!r}, expected 'pt'")

    tensors = load_file(str(path))
    expected = {t["name"]: t for t in expected_tensors}
    if names != sorted(expected):
        fail(f"{path}: names {names} != manifest {sorted(expected)}")
    for name, want in expected.items():
        got = tensors[name]
        dtype = DTYPES[want["dtype"]]
        if got.dtype != dtype:
            fail(f"{path}: {name} has dtype {got.dtype}, expected {np.dtype(dtype)}")
        if list(got.shape) != want["shape"]:
            fail(f"{path}: {name} has shape {list(got.shape)}, expected {want['shape']}")
        if dtype == np.float32:
            values = np.array(want["values"], dtype=np.float64).astype(np.float32)
        else:
            values = np.array(want["values"], dtype=dtype)
        if values.size != got.size:
            fail(f"manifest lists {values.size} values for {name}, the file has {got.size}")
        values = values.reshape(want["shape"])
        if not np.array_equal(got, values):
            diff = int(np.sum(got != values))
            fail(f"{path}: {name}: {diff} of {got.size} values differ from the manifest")
    return tensors


def main() -> None:
    if len(sys.argv) != 2:
        fail("usage: read_checkpoint.py DIR")
    root = Path(sys.argv[1])
    manifest = json.loads((root / "manifest.json").read_text())
    path = root / manifest["weights"]
    tensors = check_file(path, manifest["tensors"])
    names = sorted(tensors)

    # Export back, as PyTorch would: same names, reversed insertion order, f32 and f16.
    out = {name: np.ascontiguousarray(tensors[name]) for name in reversed(names)}
    save_file(out, str(root / "from_python_f32.safetensors"), metadata={"format": "pt"})
    save_file({k: v.astype(np.float16) for k, v in out.items()}, str(root / "from_python_f16.safetensors"),
              metadata={"format": "pt"})
    total = sum(int(t.size) for t in tensors.values())
    print(f"read_checkpoint.py: OK: {len(names)} tensors, {total} values match {path.name}; wrote f32 and f16 exports")

    if "data" in manifest:
        data_path = root / manifest["data"]["file"]
        data = check_file(data_path, manifest["data"]["tensors"])
        kinds = ", ".join(f"{n} {data[n].dtype}" for n in sorted(data))
        print(f"read_checkpoint.py: OK: {len(data)} data tensors ({kinds}) match {data_path.name}")

    # Integer tensors as a dataset would hold them, for the Rust side to read as Indices.
    ints = {
        "labels": np.array([[0, -100, 2**40], [7, -(2**40), 3]], dtype=np.int64),
        "ids32": np.array([-5, 0, 2**31 - 1], dtype=np.int32),
        "bytes": np.array([0, 200, 255], dtype=np.uint8),
        "mask": np.array([True, False, True]),
        "x": np.array([0.5, -2.0], dtype=np.float32),
    }
    save_file(ints, str(root / "from_python_ints.safetensors"), metadata={"format": "pt"})
    print("read_checkpoint.py: wrote int64, int32, uint8, bool and f32 tensors for the Rust side")


if __name__ == "__main__":
    main()
