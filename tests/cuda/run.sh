#!/usr/bin/env bash
# Runs the GPU bundle (built by tests/cuda/bundle.sh) on a GPU machine: no Rust toolchain or
# network needed. Usage: run.sh LOGDIR. Writes one log per program into LOGDIR and prints a
# short table last: tests passed / failed / skipped per binary, then the main command's and
# the benchmarks' last lines.
#
# The CUDA 13 libraries: the driver's libcuda from /usr/local/nvidia (or the system), cuBLAS
# and NVRTC from the Python packages of the image's PyTorch (`site-packages/nvidia/*/lib`).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
logs=${1:?usage: run.sh LOGDIR}
mkdir -p "$logs"

libs=""
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 \
    /opt/torch/.venv/lib/python3*/site-packages/nvidia/*/lib; do
    [ -d "$d" ] && libs="$libs:$d"
done
export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" > "$logs/env.txt"
nvidia-smi >> "$logs/env.txt" 2>&1 || echo "nvidia-smi: not found" >> "$logs/env.txt"

summary=()
for t in "$here"/bin/test-*; do
    name=$(basename "$t")
    "$t" --test-threads=1 --nocapture > "$logs/$name.log" 2>&1
    rc=$?
    passed=$(grep -oE '[0-9]+ passed' "$logs/$name.log" | awk '{s+=$1} END {print s+0}')
    failed=$(grep -oE '[0-9]+ failed' "$logs/$name.log" | awk '{s+=$1} END {print s+0}')
    skipped=$(grep -c 'SKIPPED:' "$logs/$name.log")
    summary+=("| $name | $passed | $failed | $skipped | $rc |")
done

run() { # name, then the command
    local name=$1; shift
    timeout 900 "$@" > "$logs/$name.log" 2>&1
    echo "exit $?" >> "$logs/$name.log"
}
run train-f16 "$here/bin/train" --device cuda --precision f16 --out "$logs/run-f16" --overwrite
run train-bf16 "$here/bin/train" --device cuda --precision bf16 --out "$logs/run-bf16" --overwrite
# The GPU-scale GPT: both precisions at batch 16 beside PyTorch eager on the same GPU (when the
# image's PyTorch is there), then bf16 at the batch that fills about 40 GiB.
if [ -x "$here/bin/gpu_gpt" ]; then
    run gpu_gpt "$here/bin/gpu_gpt" --batch 16
    torch_py=/opt/torch/.venv/bin/python
    [ -x "$torch_py" ] && run gpu_gpt-torch "$torch_py" "$here/gpu_gpt.py" --batch 16
    run gpu_gpt-40gib "$here/bin/gpu_gpt" --precision bf16
fi

echo
echo "| test binary | passed | failed | skipped (SKIPPED: lines) | exit |"
echo "| --- | --- | --- | --- | --- |"
printf '%s\n' "${summary[@]}"
for f in "$logs"/train-*.log "$logs"/gpu_*.log; do
    [ -e "$f" ] || continue
    echo
    echo "== $(basename "$f" .log) (last lines)"
    tail -n 6 "$f"
done
