#!/usr/bin/env python3
"""Reads amp's safetensors weights with Python's `safetensors` + numpy and checks them against the
JSON manifest the Rust side wrote next to them; then writes the same weights back from Python
(f32 and f16, PyTorch's `format: pt` metadata) for the Rust side to load.

Usage: python3 tests/python/read_checkpoint.py DIR
  DIR holds manifest.json ({"weights": FILE, "tensors": [{"name", "shape", "dtype", "values"}]})
  and the weights FILE. Writes DIR/from_python_f32.safetensors and DIR/from_python_f16.safetensors.
Run by `cargo test -p amp-core --test checkpoint_python` (needs `pip install safetensors numpy`).
Exits non-zero, saying what differs, on any mismatch.
"""
import json
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file


def fail(msg: str) -> None:
    print(f"read_checkpoint.py: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    if len(sys.argv) != 2:
        fail("usage: read_checkpoint.py DIR")
    root = Path(sys.argv[1])
    manifest = json.loads((root / "manifest.json").read_text())
    path = root / manifest["weights"]

    with safe_open(str(path), framework="np") as f:
        meta = f.metadata() or {}
        names = sorted(f.keys())
    if meta.get("format") != "pt":
        fail(f"{path}: metadata format is {meta.get('format')!r}, expected 'pt'")

    tensors = load_file(str(path))
    expected = {t["name"]: t for t in manifest["tensors"]}
    if names != sorted(expected):
        fail(f"{path}: names {names} != manifest {sorted(expected)}")
    for name, want in expected.items():
        got = tensors[name]
        if got.dtype != np.float32:
            fail(f"{path}: {name} has dtype {got.dtype}, expected float32")
        if list(got.shape) != want["shape"]:
            fail(f"{path}: {name} has shape {list(got.shape)}, expected {want['shape']}")
        values = np.array(want["values"], dtype=np.float64).astype(np.float32)
        if values.size != got.size:
            fail(f"manifest lists {values.size} values for {name}, the file has {got.size}")
        values = values.reshape(want["shape"])
        if not np.array_equal(got, values):
            diff = int(np.sum(got != values))
            fail(f"{path}: {name}: {diff} of {got.size} values differ from the manifest")

    # Export back, as PyTorch would: same names, reversed insertion order, f32 and f16.
    out = {name: np.ascontiguousarray(tensors[name]) for name in reversed(names)}
    save_file(out, str(root / "from_python_f32.safetensors"), metadata={"format": "pt"})
    save_file({k: v.astype(np.float16) for k, v in out.items()}, str(root / "from_python_f16.safetensors"),
              metadata={"format": "pt"})
    total = sum(int(t.size) for t in tensors.values())
    print(f"read_checkpoint.py: OK: {len(names)} tensors, {total} values match {path.name}; wrote f32 and f16 exports")


if __name__ == "__main__":
    main()
