#!/usr/bin/env bash
# One device session on the H200 (see docs/gpu-runs.md): the quality run of issue 3, the test
# suite on the GPU, and where a training step's time goes. Logs and results go to $OUT.
#   usage: bash tools/h200_session.sh [train|tests|profile|bench|ready|lm|e2e|variants|
#                                      ncu-attention|ncu-matmul ...]
#          (default: train tests profile; each call of the device tool has 10 minutes: in
#          session 4 the whole bench needed more than 300 s and the suite ~200 s in 14 workers,
#          so "bench" in one call, "tests" in another)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export NANOANDREA_CACHE=/tmp/nanoandrea-cache
OUT=${OUT:-/tmp/out}
steps=("${@:-train tests profile}")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
for step in ${steps[@]}; do
  case $step in
    train)   # andrea-12m, char tokenizer, tiny Shakespeare, the default recipe; the best-val
             # checkpoint is kept, so the run stops once overfitting has set in
      timeout ${TRAIN_TIMEOUT:-420} python3 -m nanoandrea.train --out /tmp/shakespeare \
          --stop-at ${STOP_AT:-1750} --eval-iters 40 --log-interval 50 2>&1 | tee $OUT/train.log
      cp /tmp/shakespeare/metrics.jsonl /tmp/shakespeare/loss.png /tmp/shakespeare/samples.txt $OUT/ ;;
    tests)
      # kernels compile on the CPU, so the suite runs in parallel workers where pytest-xdist is
      # there (`pip download --no-deps -d .whl pytest-xdist execnet` beside the numpy wheel)
      workers=$(python3 -c 'import xdist' 2>/dev/null && echo "-n ${TEST_WORKERS:-8}")
      # (-v: each test's outcome on its own line as it ends, so that a run cut by its time
      # limit still names what failed; pytest's summary comes only at the end)
      # (--durations: the slowest tests, kernels compiling among them; a test still running
      # after 300 s prints where it is, as the graph test did in session 17 inside Numba's
      # inliner)
      # (NVVM inlines the device functions here unless NANOANDREA_INLINER says otherwise: the
      # same kernels compiled 4-5x faster, so that the suite fits one call; docs/perf.md, v20)
      NANOANDREA_INLINER=${NANOANDREA_INLINER:-nvvm} \
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -v -rf -p no:warnings --durations=15 \
          -o faulthandler_timeout=300 $workers ${TESTS:-tests} 2>&1 \
          | tee $OUT/pytest.log | grep -E "FAILED|ERROR|[0-9]+ (passed|failed)|^[0-9.]+s call" | tail -30 ;;
    profile)    # each kernel's GPU time in a training step, ours and PyTorch's (torch.profiler)
      timeout ${PROFILE_TIMEOUT:-200} python3 tools/bench.py --only profile --top 30 \
          ${MODELS:+--models $MODELS} 2>&1 | grep -v "Warn\|warn(" | tee $OUT/profile.log ;;
    bench)
      timeout ${BENCH_TIMEOUT:-400} python3 tools/bench.py --json $OUT/bench.json 2>&1 | tee $OUT/bench.log | tail -40 ;;
    ready)      # the small kernels (the cross-entropy's block sizes among them), then both
                # models end to end: eager, and the graph with one stream, with the second
                # stream in backward only, and with the forward's beside work too ("graph")
      timeout ${BENCH_TIMEOUT:-150} python3 tools/bench.py --only small --json $OUT/small.json \
          2>&1 | grep -v "Warn\|warn(" | tee $OUT/small.log | grep -A12 "^summary"
      timeout ${E2E_TIMEOUT:-400} python3 tools/bench.py --only e2e --json $OUT/e2e.json 2>&1 \
          | grep -v "Warn\|warn(" | tee $OUT/e2e.log | grep -A10 "^summary" ;;
    lm)         # the LM head at GPT-2's 50257 (padded copies, and in four classes of rows)
                # and at Vp
      timeout ${BENCH_TIMEOUT:-400} python3 tools/bench.py --only matmul \
          --shapes "lm head,lmVp" --json $OUT/lm.json 2>&1 \
          | grep -v "Warn\|warn(" | tee $OUT/lm.log | grep -A40 "^summary" ;;
    e2e)        # training tokens/s, ours (eager; graph with one stream; with the weight
                # gradients on a second; with the forward's K and V products there too)
                # against PyTorch's GPT-2, same B, T
      timeout ${E2E_TIMEOUT:-300} python3 tools/bench.py --only e2e ${MODELS:+--models $MODELS} \
          --json $OUT/e2e.json 2>&1 | grep -v "Warn\|warn(" | tee $OUT/e2e.log | tail -10 ;;
    variants)   # the matmul and attention tile variants, each checked, then timed
      timeout ${BENCH_TIMEOUT:-400} python3 tools/bench.py --only matmul,attention --variants \
          --json $OUT/variants.json 2>&1 | tee $OUT/variants.log | grep -A80 "^summary" ;;
    ncu-attention|ncu-matmul)   # Nsight Compute on one op at SHAPE (tools/run_once.py), ours and
                                # the library's kernels: occupancy, what the warps stall on,
                                # shared-memory bank conflicts; our first round is skipped
      op=${step#ncu-}
      kernels='blocked_matmul|gemm'
      [ $op = attention ] && kernels='dkdv|attention_forward|dq_sum|fmha'
      stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier \
          short_scoreboard long_scoreboard mio_throttle math_pipe_throttle wait not_selected \
          lg_throttle dispatch_stall no_instruction)
      counts=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
      counts=$counts,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed.sum
      counts=$counts,smsp__sass_thread_inst_executed_op_ffma_pred_on.sum
      timeout ${NCU_TIMEOUT:-300} ncu -k regex:"$kernels" \
          --launch-skip 3 --launch-count ${NCU_COUNT:-6} --section SpeedOfLight \
          --section LaunchStats --section Occupancy --section SchedulerStats \
          --section WarpStateStats --metrics "$stalls$counts" \
          python3 tools/run_once.py $op ${SHAPE:+--shape $SHAPE} --rounds 2 \
          2>&1 | tee $OUT/ncu-$op.log | grep -v "^==PROF==" | tail -${NCU_TAIL:-400} ;;
  esac
done
