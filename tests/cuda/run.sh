#!/usr/bin/env bash
# Runs the GPU bundle (built by tests/cuda/bundle.sh) on a GPU machine: no Rust toolchain or
# network needed. Usage: run.sh LOGDIR [BUDGET_SECONDS]
#
# Writes one log per program into LOGDIR and prints a short table last: tests passed / failed /
# skipped, the parity suite's worst errors, the benchmarks beside PyTorch's, the main command
# and the GPU-scale GPT. The GPU may be lent for minutes only, so everything runs under one
# time budget (default 540 s): the stages run in order of importance, each under a cap and
# under what is left, and a stage with no time left is reported as not run.
#
# The CUDA 13 libraries: the driver's libcuda (/usr/local/nvidia or the system), cuBLAS,
# cuBLASLt and NVRTC from the Python packages of the image's PyTorch
# (`site-packages/nvidia/*/lib`), found by name and put on LD_LIBRARY_PATH.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
logs=${1:?usage: run.sh LOGDIR [BUDGET_SECONDS]}
budget=${2:-540}
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
t0=$(date +%s)
left() { echo $((budget - ($(date +%s) - t0))); }

# ---- libraries and the machine ---------------------------------------------------------------
libdirs=()
add_dir() { # a folder holding a library, once
    local d
    d=$(dirname "$1")
    for x in "${libdirs[@]:-}"; do [ "$x" = "$d" ] && return; done
    libdirs+=("$d")
}
roots=(/usr/local/nvidia /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda /opt/torch/.venv /usr/local/lib)
for lib in 'libcuda.so.1' 'libcublas.so.13*' 'libcublasLt.so.13*' 'libnvrtc.so.13*' 'libnvrtc-builtins.so.13*'; do
    hit=""
    for r in "${roots[@]}"; do
        [ -d "$r" ] || continue
        hit=$(timeout 20 find "$r" -name "$lib" -not -path '*stubs*' 2>/dev/null | sort | head -n 1)
        [ -n "$hit" ] && break
    done
    if [ -n "$hit" ]; then add_dir "$hit"; echo "found $lib: $hit"; else echo "NOT FOUND: $lib"; fi
done > "$logs/libraries.txt"
joined=$(IFS=:; echo "${libdirs[*]:-}")
export LD_LIBRARY_PATH="${joined}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    cat "$logs/libraries.txt"
    nvidia-smi 2>&1 || echo "nvidia-smi: not found"
    lscpu | grep -E 'Model name|^CPU\(s\)' || true
    ls /usr/local/nvidia /usr/local/cuda* 2>&1 | head -n 20
    torch_py=/opt/torch/.venv/bin/python
    [ -x "$torch_py" ] && "$torch_py" -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))' 2>&1
} > "$logs/env.txt" 2>&1

# ---- stages ----------------------------------------------------------------------------------
# stage NAME CAP CMD...: runs CMD with its output in LOGDIR/NAME.log, under min(CAP, what is
# left of the budget), and appends its exit status and time.
notrun=()
stage() {
    local name=$1 cap=$2; shift 2
    local t
    t=$(left)
    [ "$t" -gt "$cap" ] && t=$cap
    if [ "$t" -lt 5 ]; then
        [ "$name" = one-test ] || notrun+=("$name")
        echo "not run: out of time budget" > "$logs/$name.log"
        return 0
    fi
    local s
    s=$(date +%s)
    timeout -k 5 "$t" "$@" > "$logs/$name.log" 2>&1
    local rc=$?
    echo "exit $rc after $(($(date +%s) - s)) s (limit $t s)" >> "$logs/$name.log"
}

# Tests, one process per test (a hung kernel or a poisoned context costs one test, not the
# rest), in order of importance. A test that printed SKIPPED: did not check the GPU code.
summary=()
run_tests() { # binary, cap per test
    local bin=$here/bin/$1 cap=$2 name p=0 f=0 sk=0 nr=0 failed=""
    [ -x "$bin" ] || { summary+=("| $1 | missing | | | |"); return; }
    : > "$logs/$1.log"
    for name in $("$bin" --list --format terse 2>/dev/null | sed -n 's/: test$//p'); do
        stage "one-test" "$cap" "$bin" --exact "$name" --test-threads=1 --nocapture
        { echo "=== $name"; cat "$logs/one-test.log"; } >> "$logs/$1.log"
        if grep -q 'out of time budget' "$logs/one-test.log"; then
            nr=$((nr + 1))
        elif grep -q 'SKIPPED:' "$logs/one-test.log"; then
            sk=$((sk + 1))
        elif grep -q '^exit 0 ' "$logs/one-test.log"; then
            p=$((p + 1))
        else
            f=$((f + 1)); failed="$failed $name"
        fi
    done
    rm -f "$logs/one-test.log"
    summary+=("| $1 | $p | $f | $sk | $nr |")
    [ -n "$failed" ] && summary+=("|   failed:$failed | | | | |")
}
run_tests test-device 60
run_tests test-scaler_traces 60
run_tests test-parity 45
run_tests test-amp_cuda-lib 60

torch_py=/opt/torch/.venv/bin/python
[ -x "$torch_py" ] || torch_py=""
stage gpu_bench 90 "$here/bin/gpu_bench"
[ -n "$torch_py" ] && stage gpu_bench-torch 90 "$torch_py" "$here/gpu_bench.py"

# The main command on the GPU in both precisions, and checkpoints across devices: a bf16 run
# stopped at step 750 on the GPU finishes on the CPU, an f16 run stopped at 200 on the CPU
# finishes on the GPU.
stage train-f16 150 "$here/bin/train" --device cuda --precision f16 --out "$logs/run-f16" --overwrite --quiet
stage train-bf16-gpu-750 100 "$here/bin/train" --device cuda --precision bf16 --out "$logs/run-bf16" --overwrite \
    --quiet --stop-after 750
stage resume-bf16-on-cpu 100 "$here/bin/train" --device cpu --precision bf16 --out "$logs/run-bf16" --resume --quiet
stage train-f16-cpu-200 60 "$here/bin/train" --device cpu --precision f16 --out "$logs/run-cpu" --overwrite --quiet \
    --stop-after 200
stage resume-f16-on-gpu 150 "$here/bin/train" --device cuda --precision f16 --out "$logs/run-cpu" --resume --quiet

# The GPU-scale GPT at batch 16 beside PyTorch eager, then bf16 at the batch that fills ~40 GiB.
stage gpu_gpt 180 "$here/bin/gpu_gpt" --batch 16 --steps 10 --warmup 2
[ -n "$torch_py" ] && stage gpu_gpt-torch 120 "$torch_py" "$here/gpu_gpt.py" --batch 16 --steps 10 --warmup 2
# Where the step's time goes, kernel by kernel, on both sides (3 steps each, after the timing).
stage gpu_gpt-profile 120 "$here/bin/gpu_gpt" --batch 16 --steps 2 --warmup 2 --profile 3
[ -n "$torch_py" ] && stage gpu_gpt-profile-torch 120 "$torch_py" "$here/gpu_gpt.py" --batch 16 --steps 2 --warmup 2 \
    --profile 3
stage gpu_gpt-40gib 150 "$here/bin/gpu_gpt" --precision bf16 --steps 5 --warmup 1

# ---- the table -------------------------------------------------------------------------------
echo
echo "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
grep -h 'NOT FOUND' "$logs/libraries.txt"
echo
echo "| test binary | passed | failed | skipped | not run |"
echo "| --- | --- | --- | --- | --- |"
printf '%s\n' "${summary[@]}"
if grep -q '^PARITY' "$logs/test-parity.log" 2>/dev/null; then
    echo
    echo "parity, worst over every case and output, per precision: abs (where), rel (where)"
    # Numbers as numbers (+0): mawk compares "1.9e-3" and "2e-5" as strings otherwise.
    grep -h '^PARITY' "$logs/test-parity.log" | awk '{d=$3; a=$7+0; r=$9+0; w=$2 ":" $4
        if (!(d in A) || a > A[d]) {A[d]=a; WA[d]=w}; if (!(d in R) || r > R[d]) {R[d]=r; WR[d]=w}}
        END {for (d in A) printf "  %s abs %.3e (%s), rel %.3e (%s)\n", d, A[d], WA[d], R[d], WR[d]}'
fi
echo
echo "benchmarks: ours | PyTorch (same GPU, same run)"
if [ -f "$logs/gpu_bench.log" ]; then
    grep -h '^BENCH' "$logs/gpu_bench.log" | while read -r _ what dt shape _ ms unit val rest; do
        tv=$(grep -h "^BENCH torch_$what $dt $shape " "$logs/gpu_bench-torch.log" 2>/dev/null | awk '{print $8}')
        ratio=""
        [ -n "$tv" ] && ratio=$(awk -v a="$val" -v b="$tv" 'BEGIN {if (b > 0) printf "%.2f", a / b}')
        echo "  $what $dt $shape: $ms ms, $val $unit $rest | torch $tv | ours/torch $ratio"
    done
fi
for f in "$logs"/train-f16.log "$logs"/train-bf16-gpu-750.log "$logs"/resume-bf16-on-cpu.log \
    "$logs"/train-f16-cpu-200.log "$logs"/resume-f16-on-gpu.log "$logs"/gpu_gpt*.log; do
    [ -e "$f" ] || continue
    echo
    echo "== $(basename "$f" .log) (last lines)"
    grep -v '^\s*$' "$f" | tail -n 5 | cut -c1-220
done
if [ -f "$logs/gpu_gpt-profile.log" ]; then
    echo
    echo "== gpu_gpt --profile: the 12 heaviest kernels of each precision, and the time outside any kernel"
    awk '/^Profile of/ {print; n = 0; next} /^\| kernel/ {n = 1; next} n && /^\| ---/ {next}
        n && n <= 12 && /^\| / {print; n++; next} /outside any kernel|\(wall\)/ {print}' "$logs/gpu_gpt-profile.log"
fi
if [ -f "$logs/gpu_gpt-profile-torch.log" ]; then
    echo
    echo "== gpu_gpt.py --profile: torch.profiler's 12 heaviest ops by self device time"
    grep -A 15 '^torch.profiler,' "$logs/gpu_gpt-profile-torch.log" | cut -c1-200
fi
[ ${#notrun[@]} -gt 0 ] && echo "not run (time budget): ${notrun[*]}"
echo "total $(($(date +%s) - t0)) s of $budget s"
