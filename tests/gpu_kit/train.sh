#!/usr/bin/env bash
# The training recipe on one GPU in one command of about 6 minutes (`make gpu-train`), on a
# machine with Python, a CUDA PyTorch and transformers (no SGLang, nothing carried).
# Results go to $OUT (default gpu-train-out/) as each step ends, in priority order, each under
# a time cap; every step's output is appended to $OUT/all.log:
#   1. bench_train.json      a Qwen3-8B-shaped target (random weights) and a 5-layer draft,
#                            S = 2048, 512 anchors, B = 16, bf16 autocast: throughput and peak
#                            per --block-attention mode, flex (auto on CUDA) then dense
#                            (scripts/bench/train.py)
#   2. tiny-1.jsonl          docs/training.md's throughput command on the GPU: one process, then
#      tiny-nccl.jsonl       torchrun with one NCCL rank
#   3. block_attention.json  one layer call of each block attention, forward + backward, at the
#      block_attention_3072.json  Qwen3-8B draft's shape, S = 2048 and 3072, the split and
#                            FlexAttention checked against the dense path in fp32
set -u
OUT=${OUT:-gpu-train-out}
PY=${GPU_PY:-python3}
WORK=${WORK:-$(mktemp -d)}  # the random 8B target (16 GB) and the runs: not sent back
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log() { echo "[gpu-train $(date +%T)] $*" | tee -a "$OUT/steps.log"; }
step() {  # step NAME SECONDS CMD...: run under a cap, log its end and status
    local name=$1 cap=$2; shift 2
    log "$name: start (cap ${cap}s)"
    echo "===== $name: $*" >> "$OUT/all.log"
    timeout "$cap" "$@" >> "$OUT/all.log" 2>&1
    log "$name: rc=$?"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/steps.log" 2>&1
$PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
    >> "$OUT/steps.log" 2>&1

step bench_train 280 $PY scripts/bench/train.py --work "$WORK" --shape qwen3-8b --block-attention flex,dense
cp "$WORK/bench_train.json" "$OUT/" 2>/dev/null
for mode in flex dense; do
    [ -f "$WORK/run-$mode.log" ] && { echo "===== run-$mode.log (tail)"; tail -5 "$WORK/run-$mode.log"; } >> "$OUT/all.log"
done

cp "$($PY -c 'import asyncio, os; print(os.path.dirname(asyncio.__file__))')/base_events.py" "$WORK/base_events.txt"
ARGS="--target sglang_dflash/assets/tiny_pair/target --data $WORK/base_events.txt --device cuda \
  --max-length 256 --num-draft-layers 2 --block-size 8 --target-layer-ids 0 1 2 --num-anchors 64 \
  --max-steps 12 --save-every 0 --no-progress --export-dtype float32 --batch-size 8"
step tiny_1 60 $PY -m sglang_dflash.train $ARGS --out "$WORK/tiny-1"
cp "$WORK/tiny-1/train_log.jsonl" "$OUT/tiny-1.jsonl" 2>/dev/null
step tiny_nccl 60 $PY -m torch.distributed.run --nproc_per_node 1 -m sglang_dflash.train $ARGS --out "$WORK/tiny-nccl"
cp "$WORK/tiny-nccl/train_log.jsonl" "$OUT/tiny-nccl.jsonl" 2>/dev/null

step block_attention 90 $PY scripts/bench/block_attention.py --device cuda --modes dense,split,flex \
    --out "$OUT/block_attention.json"
step block_attention_3072 60 $PY scripts/bench/block_attention.py --device cuda --modes dense,split,flex \
    --seq-len 3072 --out "$OUT/block_attention_3072.json"
log "done"
