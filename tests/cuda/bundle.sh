#!/usr/bin/env bash
# Builds the GPU bundle: everything that needs an NVIDIA GPU, compiled here (no GPU needed) for
# a portable CPU, into one folder with a run.sh for a bare GPU machine (no Rust toolchain, no
# network). Built for the target's baseline CPU in its own target folder: the CPU kernels pick
# their SIMD level at run time (amp_core::simd), so the binaries run at speed on the GPU host.
#
# Usage: tests/cuda/bundle.sh [OUT]      (default OUT: target/gpu-bundle, git-ignored)
# Then, on the GPU machine:  OUT/run.sh LOGDIR [BUDGET_SECONDS]
# Contents: the amp-cuda test binaries (device tests and the CPU/GPU parity suite; not the
# host emulation's, which need the sources and a C++ compiler), the main
# command and the benchmarks, stripped; size printed at the end (the device tool carries 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-target/gpu-bundle}
rm -rf "$out"
mkdir -p "$out/bin"

export RUSTFLAGS="-C strip=symbols"
export CARGO_TARGET_DIR=target/gpu-build
# Test executables of amp-cuda (release, so the parity suite and benchmarks run at speed).
cargo test --release -p amp-cuda --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys, shutil, os
out = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["profile"]["test"]:
        name = m["target"]["name"] + ("-lib" if "lib" in m["target"]["kind"] else "")
        if name.endswith("_emulated"):
            continue  # host-only: kernel sources under a C++ emulation; the GPU runs the kernels
        shutil.copy(exe, os.path.join(out, "bin", "test-" + name))
        print("test binary:", name)
' "$out"
# The main command and the benchmarks, with the CUDA backend.
cargo build --release --features cuda --example train --example bench_steps
for ex in train bench_steps; do
    cp "$CARGO_TARGET_DIR/release/examples/$ex" "$out/bin/$ex"
done
for ex in examples/gpu_*.rs; do
    [ -e "$ex" ] || continue
    name=$(basename "$ex" .rs)
    cargo build --release --features cuda --example "$name"
    cp "$CARGO_TARGET_DIR/release/examples/$name" "$out/bin/$name"
done
cp tests/cuda/run.sh "$out/run.sh"
cp tests/python/gpu_gpt.py "$out/gpu_gpt.py"     # PyTorch's side of examples/gpu_gpt.rs
cp tests/python/gpu_bench.py "$out/gpu_bench.py" # and of examples/gpu_bench.rs
chmod +x "$out/run.sh"
du -sh "$out"
