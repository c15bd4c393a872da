#!/usr/bin/env bash
# Python interop check (CI): the Rust test writes safetensors weights and a JSON manifest,
# tests/python/read_checkpoint.py reads them with Python's safetensors + numpy and checks names,
# shapes and values, then writes f32 and f16 exports that the Rust test loads back.
# Needs: python3 -m pip install safetensors numpy
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -c "import safetensors, numpy" || {
  echo "tests/python/run.sh: python3 with safetensors and numpy is required: python3 -m pip install safetensors numpy" >&2
  exit 1
}
# --workspace: the features the README's `cargo test --workspace` built amp-core with, so
# nothing is compiled again (`-p amp-core` would build a second amp-core).
AMP_REQUIRE_PYTHON=1 cargo test --workspace --test checkpoint_python -- --nocapture
