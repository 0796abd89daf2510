#!/usr/bin/env bash
# The project's runs on a GPU machine, in one call: each step's whole output goes to $OUT (or
# /tmp/out), its summary to the terminal.
#   usage: bash tools/gpu.sh STEP...      (default: startup tests e2e)
#     startup   time to first step and first token, cold and warm kernel cache, beside PyTorch
#               (tools/bench.py --only startup); it fills the kernel cache later steps use
#     tests     the test suite at GPU sizes, in parallel workers
#     e2e       training tokens/s against PyTorch, andrea-12m and andrea-120m (tools/bench.py;
#               PRECISION, default fp32; MODELS, default both; COMPILE=1: torch.compile too)
#     attention the tensor-core attention: its tests (those named wgmma or attention), the
#               ladder's v9 (mma.sync), v10-v12 (wgmma) at both presets' shapes (LADDER: the
#               versions; none: no ladder), then tools/bench.py's attention in bf16 beside SDPA
#     bench     the kernels against cuBLAS, SDPA and PyTorch's ops (tools/bench.py)
#     dev       the optimisation ladders, each version checked and timed in one run
#               (tools/dev/run.py: dev.json, and dev-table.md, tools/dev/README.md's table)
#     wgmma     the wgmma tests (those named wgmma), then the wgmma rungs of the matmul ladder
#               (WGMMA, default v12-v16; v17-v21 the producer ones) checked and timed at
#               andrea-120m's three shapes
#     profile   each kernel's GPU time in one training step, ours beside PyTorch's, andrea-12m
#               and andrea-120m (tools/bench.py --only profile; PRECISION, default bf16)
#     products  each matrix product of one bf16 training step as the step makes it, timed beside
#               cuBLAS bf16 in the same orientation (tools/bench.py --only products; MODELS)
#     ncu       Nsight Compute's speed-of-light, occupancy, warp-state and scheduler sections of
#               the wgmma kernels: attention at [16,12,1024,64], a linear layer's three products
#               at 16384x3072x768 (tools/profile/run_once.py, bf16); NCU_LADDER=v17,v18: also
#               the first launch of each of these matmul ladder versions (their checks)
#     stalls    where the warps of GELU's two products (16384x3072x768) and of attention's three
#               kernels at [16,12,1024,64] wait, instruction by instruction: Nsight Compute's
#               warp-state samples of one launch each (tools/profile/run_once.py), summarised by
#               tools/profile/stalls.py (stalls.log); the GELU products' source pages as CSV
#               (STALLS=attention_forward,attention_dq: some of the five cases only)
#     hardware  docs/hardware.md's figures: one fused projection against per-head products,
#               attention by head size (tools/bench.py --only hardware: hardware.json, .png)
#     bf16      the bf16 kernels of both presets compiled (`nanoandrea compile`), then the
#               matmuls, attention and the training step in bf16 against PyTorch's (tools/bench.py)
#     train     the default recipe on tiny Shakespeare: `python -m nanoandrea train` (STOP_AT,
#               default 1500; 0: the whole schedule), then `nanoandrea sample` from its best
#     sample    sampling: the decode kernels' tests at GPU sizes (those named matvec, kvcache or
#               cached), then tools/bench.py's sample section
#     ddp       data-parallel with a world of one: NCCL's step against the plain one (the tests
#               named distributed), and what its communication costs a step (tools/bench.py
#               --only ddp, andrea-12m and andrea-120m; PRECISION, default bf16)
#     two-gpus  on a machine of two GPUs: 20 steps of andrea-12m on two against one (the same
#               global batch; metrics.jsonl side by side), andrea-120m tokens/s on one GPU and
#               on two, PyTorch DDP beside it (tools/baselines/torch_ddp.py under torchrun),
#               and a rank killed mid-run
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
      limit python3 tools/bench.py --only startup --json "$OUT/startup.json" \
          --logs "$OUT/startup.log" > "$OUT/startup-bench.log" 2>&1
      grep -A12 "^summary" "$OUT/startup-bench.log" ;;
    tests)
      workers=$(python3 -c 'import xdist' 2>/dev/null && echo "-n ${TEST_WORKERS:-14}")
      # (-v: each outcome on its own line as it ends, so that a run cut by its limit still
      # names what failed; --durations: the slowest, kernels compiling among them)
      limit python3 -m pytest -v -rf --durations=15 -o faulthandler_timeout=300 $workers \
          ${TESTS:-tests} > "$OUT/pytest.log" 2>&1
      grep -E "FAILED|ERROR|[0-9]+ (passed|failed)|^[0-9.]+s call" "$OUT/pytest.log" | tail -30 ;;
    e2e)
      limit python3 tools/bench.py --only e2e --precision ${PRECISION:-fp32} ${MODELS:+--models $MODELS} \
          ${COMPILE:+--compile} --json "$OUT/e2e-${PRECISION:-fp32}.json" > "$OUT/e2e-${PRECISION:-fp32}.log" 2>&1
      grep -A10 "^summary" "$OUT/e2e-${PRECISION:-fp32}.log" ;;
    attention)
      NANOANDREA_INLINER=nvvm limit python3 -m pytest -v -rf -n ${TEST_WORKERS:-8} tests \
          -k "wgmma or attention" > "$OUT/pytest-attention.log" 2>&1
      grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" "$OUT/pytest-attention.log" | tail -20
      for shape in $([ "${LADDER:-}" = none ] || echo 16,12,1024,64 64,12,256,32); do
        limit python3 tools/dev/run.py attention --only ${LADDER:-v9,v10,v11,v12} --shape $shape \
            --json "$OUT/dev-attention-${shape//,/x}.json" > "$OUT/dev-attention-${shape//,/x}.log" 2>&1
        tail -6 "$OUT/dev-attention-${shape//,/x}.log"
      done
      limit python3 tools/bench.py --only attention --precision bf16 --json "$OUT/bench-attention-bf16.json" \
          > "$OUT/bench-attention-bf16.log" 2>&1
      grep -A12 "^summary" "$OUT/bench-attention-bf16.log" ;;
    bench)
      limit python3 tools/bench.py --only ${BENCH:-matmul,attention,small} --json "$OUT/bench.json" \
          > "$OUT/bench.log" 2>&1
      grep -A60 "^summary" "$OUT/bench.log" ;;
    dev)
      limit python3 tools/dev/run.py --json "$OUT/dev.json" > "$OUT/dev.log" 2>&1
      python3 tools/dev/run.py --table "$OUT/dev.json" | tee "$OUT/dev-table.md" ;;
    wgmma)
      limit python3 -m pytest -v -rf tests -k wgmma > "$OUT/pytest-wgmma.log" 2>&1
      grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" "$OUT/pytest-wgmma.log" | tail -10
      for shape in 16384,3072,768 16384,768,768 16384,768,3072; do
        limit python3 tools/dev/run.py matmul --only ${WGMMA:-v12,v13,v14,v15,v16} --shape $shape \
            --json "$OUT/dev-wgmma-${shape//,/x}.json" > "$OUT/dev-wgmma-${shape//,/x}.log" 2>&1
        tail -12 "$OUT/dev-wgmma-${shape//,/x}.log"
      done ;;
    profile)
      limit python3 tools/bench.py --only profile --precision ${PRECISION:-bf16} \
          > "$OUT/profile-${PRECISION:-bf16}.log" 2>&1
      grep -A8 "^profile:" "$OUT/profile-${PRECISION:-bf16}.log" ;;
    products)
      limit python3 tools/bench.py --only products --precision bf16 ${MODELS:+--models $MODELS} \
          > "$OUT/products.log" 2>&1
      grep -E "^products|all .* summed" "$OUT/products.log" ;;
    ncu)
      sections="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats"
      for op in "attention --shape 16,12,1024,64" "matmul --shape 16384,3072,768"; do
        limit ncu --clock-control none -k regex:wgmma --launch-skip 3 --launch-count 3 $sections \
            python3 tools/profile/run_once.py $op --rounds 2 --precision bf16 \
            > "$OUT/ncu-${op%% *}.txt" 2>&1
        grep -E "wgmma_.*kernel|Duration|Issued Ipc|No Eligible|Stall|Warp Cycles Per Issued" \
            "$OUT/ncu-${op%% *}.txt" | head -40
      done
      if [ -n "${NCU_LADDER:-}" ]; then   # (the ladder's versions too: their checks' launches)
        limit ncu --clock-control none -k regex:wgmma --launch-count 2 $sections \
            python3 tools/dev/run.py matmul --only $NCU_LADDER --repeat 1 > "$OUT/ncu-ladder.txt" 2>&1
        grep -E "wgmma_.*kernel|Duration|Issued Ipc|No Eligible|Stall|Warp Cycles Per Issued" \
            "$OUT/ncu-ladder.txt" | head -40
      fi ;;
    stalls)
      # name:kernel:run_once.py's arguments; the kernel's third launch (the first two compile
      # and warm up)
      for case in "gelu:wgmma_matmul:matmul --epilogue gelu" \
                  "gelu_grad:wgmma_matmul:matmul --epilogue gelu_grad" \
                  "attention_forward:attention_forward_wgmma:attention --shape 16,12,1024,64" \
                  "attention_dq:attention_dq_wgmma:attention --shape 16,12,1024,64" \
                  "attention_dkdv:attention_dkdv_wgmma:attention --shape 16,12,1024,64"; do
        name=${case%%:*}; rest=${case#*:}; kernel=${rest%%:*}
        # (STALLS=gelu,attention_dq: those cases only)
        [ -z "${STALLS:-}" ] || [[ ",$STALLS," == *",$name,"* ]] || continue
        limit ncu --clock-control none -k regex:$kernel --launch-skip 2 --launch-count 1 \
            --section WarpStateStats --section SourceCounters -f -o /tmp/stalls-$name \
            python3 tools/profile/run_once.py ${rest#*:} --precision bf16 > /tmp/stalls-$name.log 2>&1
        ncu -i /tmp/stalls-$name.ncu-rep --page source --csv --print-source sass \
            > /tmp/stalls-$name.csv 2>> /tmp/stalls-$name.log
        grep -q Source /tmp/stalls-$name.csv || ncu -i /tmp/stalls-$name.ncu-rep --page source \
            --csv > /tmp/stalls-$name.csv 2>> /tmp/stalls-$name.log   # (an older ncu's options)
        python3 tools/profile/stalls.py /tmp/stalls-$name.csv >> /tmp/stalls-$name.log 2>&1
        grep -A22 "samples (" /tmp/stalls-$name.log | head -40
      done
      # (the files that come back are few: the logs in one, the two GELU pages' CSVs)
      cat /tmp/stalls-*.log > "$OUT/stalls.log"
      for name in gelu gelu_grad; do
        [ ! -f /tmp/stalls-$name.csv ] || cp /tmp/stalls-$name.csv "$OUT/"
      done ;;
    hardware)
      limit python3 tools/bench.py --only hardware --json "$OUT/hardware.json" \
          --plot "$OUT/hardware.png" > "$OUT/hardware.log" 2>&1
      grep -A8 "by head size" "$OUT/hardware.log" ;;
    bf16)
      limit python3 -m nanoandrea compile --preset andrea-12m --precision bf16
      limit python3 -m nanoandrea compile --preset andrea-120m --batch-size 16 --block-size 1024 \
          --precision bf16
      limit python3 tools/bench.py --only ${BENCH:-matmul,attention,e2e} --precision bf16 \
          --json "$OUT/bench-bf16.json" > "$OUT/bench-bf16.log" 2>&1
      grep -A40 "^summary" "$OUT/bench-bf16.log" ;;
    sample)
      limit python3 -m pytest -v -rf --durations=10 tests -k "matvec or kvcache or cached" \
          > "$OUT/pytest-sample.log" 2>&1
      grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" "$OUT/pytest-sample.log" | tail -20
      limit python3 tools/bench.py --only sample --json "$OUT/bench-sample.json" \
          > "$OUT/bench-sample.log" 2>&1
      grep -A20 "^summary" "$OUT/bench-sample.log" ;;
    train)
      stop=${STOP_AT:-1500}; [ "$stop" = 0 ] && stop=
      limit python3 -m nanoandrea train --out /tmp/shakespeare ${stop:+--stop-at $stop} \
          > "$OUT/train.log" 2>&1
      tail -25 "$OUT/train.log"
      cp /tmp/shakespeare/metrics.jsonl /tmp/shakespeare/loss.png /tmp/shakespeare/samples.txt \
          "$OUT/" 2>/dev/null
      # then the trained model as its user samples it, from the best checkpoint
      limit python3 -m nanoandrea sample --checkpoint /tmp/shakespeare/best --prompt "ROMEO:" \
          --max-new-tokens 300 > "$OUT/sample-cli.log" 2>&1
      cat "$OUT/sample-cli.log" ;;
    ddp)
      python3 -c 'from cupy.cuda import nccl; print("NCCL", nccl.get_version())'
      limit python3 -m pytest -v -rf tests -k distributed > "$OUT/ddp-tests.log" 2>&1
      grep -E "PASSED|FAILED|SKIPPED|ERROR|[0-9]+ (passed|failed)" "$OUT/ddp-tests.log" | tail -20
      limit python3 tools/bench.py --only ddp --precision ${PRECISION:-bf16} \
          --json "$OUT/ddp.json" > "$OUT/ddp.log" 2>&1
      grep -A12 "^summary" "$OUT/ddp.log" ;;
    two-gpus)
      export NCCL_NVLS_ENABLE=0           # (NVLink multicast stays off on these machines)
      equal="--max-steps 20 --log-interval 1 --eval-interval 1000 --eval-iters 2 --dropout 0"
      limit python3 -m nanoandrea train $equal --out /tmp/one > "$OUT/two-equal-1.log" 2>&1
      limit python3 -m nanoandrea train $equal --gpus 2 --out /tmp/two > "$OUT/two-equal-2.log" 2>&1
      python3 - /tmp/one/metrics.jsonl /tmp/two/metrics.jsonl <<'PY'
import json, sys
one, two = ({r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r}
            for p in sys.argv[1:])
worst = max(abs(two[s] / one[s] - 1) for s in one)
print(f"20 steps, 2 GPUs against 1: {len(one)} losses, the largest relative difference {worst:.2e}")
PY
      big="--preset andrea-120m --block-size 1024 --max-steps 60 --eval-interval 1000 --eval-iters 2"
      limit python3 -m nanoandrea train $big --batch-size 16 --out /tmp/big1 > "$OUT/two-120m-1.log" 2>&1
      limit python3 -m nanoandrea train $big --batch-size 32 --gpus 2 --out /tmp/big2 > "$OUT/two-120m-2.log" 2>&1
      grep "^step    60 " "$OUT/two-120m-1.log" "$OUT/two-120m-2.log"
      limit torchrun --nproc_per_node 2 tools/baselines/torch_ddp.py --preset andrea-120m --batch-size 16 \
          --block-size 1024 --precision bf16 --steps 30 > "$OUT/two-torch-ddp.log" 2>&1
      tail -3 "$OUT/two-torch-ddp.log"
      # a rank killed mid-run: the other stops within --rank-timeout, naming it
      python3 -m nanoandrea train $equal --max-steps 2000 --gpus 2 --rank-timeout 30 \
          --out /tmp/kill > "$OUT/two-kill.log" 2>&1 &
      sleep 60; pkill -9 -f "nanoandrea.*--rank" -n; wait; tail -3 "$OUT/two-kill.log"
      limit python3 -m nanoandrea train $equal --max-steps 2000 --resume --out /tmp/kill --stop-at 30 \
          > "$OUT/two-kill-resume.log" 2>&1; tail -2 "$OUT/two-kill-resume.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
