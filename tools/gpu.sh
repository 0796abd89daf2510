#!/usr/bin/env bash
# The project's runs on a GPU machine, in one call: each step's whole output goes to $OUT (or
# /tmp/out), its summary to the terminal.
#   usage: bash tools/gpu.sh STEP...      (default: startup tests e2e)
#     startup   time to first step and first token, cold and warm kernel cache, beside PyTorch
#               (tools/startup.py); it fills the kernel cache that the later steps use
#     tests     the test suite at GPU sizes, in parallel workers
#     e2e       training tokens/s against PyTorch, andrea-12m and andrea-120m (tools/bench.py)
#     bench     the kernels against cuBLAS, SDPA and PyTorch's ops (tools/bench.py)
#     dev       the optimisation ladders, each version checked and timed (tools/dev/run.py)
#     bf16      the bf16 kernels of both presets compiled (`nanoandrea compile`), then the
#               matmuls and the training step in bf16 against PyTorch's (tools/bench.py)
#     train     the default recipe on tiny Shakespeare: `python -m nanoandrea.train`
#     ddp       data-parallel with a world of one: NCCL's step against the plain one
#               (tests/test_distributed.py), and what its communication costs a step
#               (tools/ddp_overlap.py, andrea-12m and andrea-120m)
# Each step has a time limit of its own (STEP_TIMEOUT, seconds), so that one slow step leaves
# the others their time. Where numba-cuda needs a NumPy older than the machine's, a wheel of it
# in .whl/ is installed into /tmp/site first.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
export NANOANDREA_CACHE=${NANOANDREA_CACHE:-/tmp/nanoandrea-cache}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
limit() { timeout "${STEP_TIMEOUT:-400}" "$@"; }
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(startup tests e2e)
for step in "${steps[@]}"; do
  echo "=== $step ($(date +%H:%M:%S))"
  case $step in
    startup)
      limit python3 tools/startup.py --json "$OUT/startup.json" --logs "$OUT/startup.log" ;;
    tests)
      workers=$(python3 -c 'import xdist' 2>/dev/null && echo "-n ${TEST_WORKERS:-14}")
      # (-v: each outcome on its own line as it ends, so that a run cut by its limit still
      # names what failed; --durations: the slowest, kernels compiling among them)
      limit python3 -m pytest -v -rf --durations=15 -o faulthandler_timeout=300 $workers \
          ${TESTS:-tests} > "$OUT/pytest.log" 2>&1
      grep -E "FAILED|ERROR|[0-9]+ (passed|failed)|^[0-9.]+s call" "$OUT/pytest.log" | tail -30 ;;
    e2e)
      limit python3 tools/bench.py --only e2e --json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
      grep -A10 "^summary" "$OUT/e2e.log" ;;
    bench)
      limit python3 tools/bench.py --only ${BENCH:-matmul,attention,small} --json "$OUT/bench.json" \
          > "$OUT/bench.log" 2>&1
      grep -A60 "^summary" "$OUT/bench.log" ;;
    dev)
      for op in matmul attention; do
        limit python3 tools/dev/run.py $op --json "$OUT/dev-$op.json" > "$OUT/dev-$op.log" 2>&1
        tail -22 "$OUT/dev-$op.log"
      done ;;
    bf16)
      limit python3 -m nanoandrea compile --preset andrea-12m --precision bf16
      limit python3 -m nanoandrea compile --preset andrea-120m --batch-size 16 --block-size 1024 \
          --precision bf16
      limit python3 tools/bench.py --only ${BENCH:-matmul,e2e} --precision bf16 \
          --json "$OUT/bench-bf16.json" > "$OUT/bench-bf16.log" 2>&1
      grep -A40 "^summary" "$OUT/bench-bf16.log" ;;
    train)
      limit python3 -m nanoandrea.train --out /tmp/shakespeare --stop-at ${STOP_AT:-1500} \
          > "$OUT/train.log" 2>&1
      tail -25 "$OUT/train.log"
      cp /tmp/shakespeare/metrics.jsonl /tmp/shakespeare/loss.png /tmp/shakespeare/samples.txt \
          "$OUT/" 2>/dev/null ;;
    ddp)
      python3 -c 'from cupy.cuda import nccl; print("NCCL", nccl.get_version())'
      limit python3 -m pytest -v -rf tests/test_distributed.py > "$OUT/ddp-tests.log" 2>&1
      grep -E "PASSED|FAILED|SKIPPED|ERROR|[0-9]+ (passed|failed)" "$OUT/ddp-tests.log" | tail -20
      limit python3 tools/ddp_overlap.py > "$OUT/ddp-overlap.log" 2>&1
      limit python3 tools/ddp_overlap.py --preset andrea-120m --batch-size 16 --block-size 1024 \
          >> "$OUT/ddp-overlap.log" 2>&1
      cat "$OUT/ddp-overlap.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
