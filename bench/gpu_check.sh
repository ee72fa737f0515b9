#!/usr/bin/env bash
# The GPU check (issue 13): every schedule, every shard mode and tp 2 run with --check at 2 ranks on NCCL (one rank
# per GPU: it needs 2 GPUs on the node; NCCL refuses two ranks on one device), then the runtime benchmark.
#
#     bash bench/gpu_check.sh                 # from the repository root, with .venv ready (or PYTHON=...)
#     RUNS=1 bash bench/gpu_check.sh          # the benchmark with 1 run of each side
#     SKIP_BENCH=1 bash bench/gpu_check.sh    # the --check runs only
#
# A check prints PASS or FAIL per case and the script exits 1 if any failed. Each compile profiles its costs on
# the GPU (--costs profile); pipec run picks NCCL and cuda:LOCAL_RANK when torch sees CUDA.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUNS=${RUNS:-3}
WORK=$(mktemp -d -t pipec-gpu-XXXX)
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 2 ]; then
  echo "gpu_check: $GPUS CUDA device(s) visible; the 2-rank NCCL checks need 2 (one rank per GPU)" >&2
  exit 2
fi
$PY -c "import torch, torch.distributed as d; print('torch', torch.__version__, torch.cuda.get_device_name(), 'nccl', d.is_nccl_available())"

MODEL=(--model pipec.examples.gpt:build --model-arg layers=4 --model-arg dim=128 --model-arg heads=4
       --model-arg vocab=512 --model-arg seq=64 --input "tokens:int64[16,64]" --costs profile)
failed=0
check() {  # name, then compile flags
  local name=$1; shift
  local plan=$WORK/$name.json
  if ! $PY -m pipec compile "${MODEL[@]}" "$@" -o "$plan" >"$WORK/$name.compile.log" 2>&1; then
    echo "FAIL $name (compile: $WORK/$name.compile.log)"; failed=1; return
  fi
  if $PY -m pipec run "$plan" --nproc 2 --steps 3 --check --report "$WORK/$name.report.json" \
      >"$WORK/$name.run.log" 2>&1; then
    echo "PASS $name"
  else
    echo "FAIL $name (run: $WORK/$name.run.log)"; failed=1
  fi
}

# every schedule at pp 2 (dp 1), 8 microbatches (zb_h1 and zbv split the backward; interleaved and looped_bfs
# and zbv hold 2 chunks per rank)
for s in gpipe 1f1b interleaved_1f1b looped_bfs zb_h1 zbv; do
  check "schedule-$s" --schedule "$s" --ranks 2 --microbatches 8
done
# every shard mode at dp 2 (pp 1): FSDP2 over the two GPUs, ZeRO-1, plain dp; and bf16 under full sharding
for m in none optimizer grads full; do
  check "shard-$m" --schedule 1f1b --ranks 1 --dp 2 --shard "$m" --microbatches 4
done
check "shard-full-bf16" --schedule 1f1b --ranks 1 --dp 2 --shard full --microbatches 4 --dtype bfloat16
# a zero-bubble split under sharded grads, as tests/test_shard_run.py runs it on CPU
check "shard-grads-zb_h1" --schedule zb_h1 --ranks 1 --dp 2 --shard grads --microbatches 4
# tensor parallelism at tp 2 (pp 1): f and g over NCCL on the comm stream, the split backward of zb_h1 too
for s in 1f1b zb_h1; do
  check "tp2-$s" --schedule "$s" --ranks 1 --tp 2 --microbatches 4
done

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # the runtime benchmark at 2 ranks (one per GPU): host- and compute-bound, then the demo's plans need 4
  $PY bench/runtime.py --only speed --ranks 2 --runs "$RUNS" --work "$WORK/bench" || failed=1
fi
echo "logs and plans in $WORK"
exit $failed
