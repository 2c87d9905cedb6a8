#!/usr/bin/env bash
# One pass of the GPU checks on a lent CUDA machine, from the repository root:
#
#     OUT=/some/dir bash scripts/device_check.sh
#
# Every step is bounded by `timeout` and the next one runs whatever it returned (a device
# session is too short to rerun for one failure); each logs to $OUT/<step>.log, and
# $OUT/summary.log gets one stamped line per step with its exit status (124: timed out).
# All steps' limits add up to 785 s with their kill grace, more than one 600 s command:
# ONLY="install torch test_gpu ..." runs the named steps alone, in this file's order.
# Needs: torch with CUDA, pytest, pytest-xdist and pytest-timeout; no network (the peer
# libraries of .peers/ are not needed: the CPU subset of step 6 runs none of their tests).

set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.log"
: > "$SUMMARY"

# step NAME SECONDS COMMAND...: run COMMAND under `timeout SECONDS` (then SIGKILL 3 s later),
# its output into $OUT/NAME.log; say when it started and how it ended.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return 0
    fi
    start=$(date +%s)
    echo "[$(date -Is)] $name: start (limit ${limit}s): $*" | tee -a "$SUMMARY"
    (
        echo "[$(date -Is)] \$ $*"
        timeout -k 3 "$limit" "$@"
        rc=$?
        echo "[$(date -Is)] exit status $rc"
        exit "$rc"
    ) > "$OUT/$name.log" 2>&1
    rc=$?
    echo "[$(date -Is)] $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$SUMMARY"
}

# 1. the package from this tree, the GPU, the torch build (70 s)
step install 40 python3 -m pip install -q --no-deps --no-build-isolation -e .
step gpus 10 nvidia-smi -L
step torch 20 python3 -c "import torch, metadist; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'available', torch.cuda.is_available(), 'gpus', torch.cuda.device_count(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'metadist', \
metadist.__file__)"

# pytest-timeout bounds each test where the machine has it; `timeout` bounds every step.
PER_TEST=()
if python3 -c "import pytest_timeout" 2>/dev/null; then PER_TEST=(--timeout 140); fi

# 2. the CUDA tests, four at a time on the one GPU (120 s)
step test_gpu 150 python3 -m pytest -q -n 4 -p no:cacheprovider "${PER_TEST[@]}" -rA \
    tests/test_gpu.py

# 3. the step-time table, each case in its own process (185 s)
step gpu_step 185 python3 -m benchmarks.gpu_step --device cuda --case-timeout 60 \
    --json "$OUT/gpu_step.json"

# 4. the suite's pipeline on cuda, tiny sizes (55 s)
step bench 35 metadist bench --quick --device cuda --only maml_overhead,gpu_step \
    --timeout 25 --out "$OUT/bench"

# 5. the sharded meta-step's time against the gathered one at N = 2, batch 32, on CPU ranks
#    that each have a core of their own (on a 2-core machine gloo's threads compete with the
#    ranks): 3 launches per path, taking turns, took 150 s on the H200 machine's 16 cores
step sharded_time 200 env CUDA_VISIBLE_DEVICES= python3 -m benchmarks.sharded_meta --parts time \
    --paths sharded,gathered --time-batches 32 --rounds 3 --steps 5 --warmup 2 \
    --json "$OUT/sharded_time.json"

# 6. this torch build on the CPU: the fast-weight files, which need no peer library (54 tests
#    took 89 s with 8 workers on 16 cores; nine files with 12 workers did not fit 100 s)
step cpu_tests 120 env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -n 8 -p no:cacheprovider \
    "${PER_TEST[@]}" tests/test_fast_ahead.py tests/test_fast_weights.py \
    tests/test_fast_hypergrad.py tests/test_fast_reach.py tests/test_zero3_graphs.py

echo "[$(date -Is)] done" | tee -a "$SUMMARY"
