#!/usr/bin/env bash
# Serve SGLang on a GPU machine that has PyTorch and no package index, and check our DFLASH
# there (docs/gpu.md, "Serving on a GPU"):
#
#   python scripts/gpu_bundle.py --serve       # where pip works: .gpu-bundle/serve, ~26 MiB
#   make gpu-serve-check [STEPS="lossless race-baseline race-3 race-6.5"]   # on the GPU machine
#
# Prerequisites, each done once per machine and skipped when done: unpack the bundle into
# $STATE/site, build sglang_dflash._C with the local nvcc, build the models, import SGLang.
# Then the STEPS, each skipped when an earlier run finished it (FORCE=1 reruns):
#   lossless        our DFLASH's greedy outputs equal the plain engine's (tiny random models,
#                   FlashInfer + CUDA graphs, bf16, batch 1 and 8, overlap on and off); its
#                   first engine also JIT-compiles FlashInfer's kernels
#   race-baseline   a Qwen3-8B-shaped target, dummy weights, no speculation
#   race-<acc>      the same with its DFlash-shaped draft (5 layers, block 16) and
#                   SGLANG_SIMULATE_ACC_LEN=<acc>: our DFLASH, then SGLang's built-in
# Every step runs even when an earlier one fails. After each: the report
# ($RESULTS/gpu-serve-report.md) and one archive of the results and server logs
# ($RESULTS/gpu-serve-results.tar.gz); the whole log is $RESULTS/gpu-serve-check.log.
#
# The device tool allows 10 minutes a command: run one step a call while the machine stays
# warm: STEPS=lossless, then race-baseline, race-3, race-6.5.
#
# What the kit changes, all of it logged: SGLang's Python radix tree (its Rust one is built for
# torch 2.14), no sgl-kernel version check, the labelled sgl_kernel stand-in
# (scripts/gpu_serve/standin/sgl_kernel) and two import-time adjustments
# (scripts/gpu_serve/standin/sitecustomize.py), FlashInfer attention, no prefill CUDA graph.
set -uo pipefail
# shellcheck source=scripts/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
BUNDLE=${BUNDLE:-.gpu-bundle/serve}
# Git-ignored and not carried, so it survives between device calls while the machine is held.
STATE=${STATE:-$PWD/.gpu-bundle/state}
STEPS=${STEPS:-lossless race-baseline race-3 race-6.5}
RESULTS=${RESULTS:-${OUT:-$STATE/results}}  # $OUT: what the device tool brings back
RACE_CONCURRENCY=${RACE_CONCURRENCY:-1,8,32}
RACE_SECONDS=${RACE_SECONDS:-20}  # measured seconds per concurrency level
mkdir -p "$STATE/done" "$RESULTS"
# The log goes straight into $RESULTS too: a call stopped at the device tool's limit still
# brings back what ran.
exec > >(tee -a "$STATE/gpu-serve-check.log" "$RESULTS/gpu-serve-check.log") 2>&1

passed() { [ "${SUMMARY[-1]:0:2}" = ok ]; }  # the last step passed

outputs() {  # the report and the results archive in $RESULTS, after every step
  $PY -m scripts.gpu_serve.report "$STATE" > "$RESULTS/gpu-serve-report.md" || FAILED=1
  # shellcheck disable=SC2046
  tar czf "$RESULTS/gpu-serve-results.tar.gz" -C "$STATE" --exclude='*.csv' \
    $(cd "$STATE" && ls -d lossless.json race-* 2>/dev/null) "$(basename "$STATE/done")" || FAILED=1
}

require() {  # require NAME COMMAND...: a prerequisite; stop here if it fails
  step "$@"
  if ! passed; then
    summary
    exit 1
  fi
}

finished() {  # finished NAME: true (and noted) when an earlier run finished this step
  if [ -f "$STATE/done/$1" ] && [ "${FORCE:-0}" != 1 ]; then
    skipped "$1" "done earlier; FORCE=1 reruns it"
    return 0
  fi
  return 1
}

run_step() {  # run_step NAME COMMAND...: a step that leaves a marker when it passes
  local name=$1
  finished "$name" && return 0
  step "$@"
  passed && touch "$STATE/done/$name"
  outputs
}

require "unpack the serve bundle" $PY -m scripts.gpu_serve.unpack "$BUNDLE" "$STATE"
export PYTHONPATH="$STATE/site:$PWD/scripts/gpu_serve/standin:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_DFLASH_SGL_KERNEL_STANDIN=1 SGLANG_DFLASH_GPU_KIT=1
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export FLASHINFER_WORKSPACE_BASE="$STATE" MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
require "torch and the GPU" $PY -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name())"
cuda_library_headers
if ! finished build-extension; then
  build_extension  # if it fails, our DFLASH runs its PyTorch path and says so at start-up
  passed && touch "$STATE/done/build-extension"
fi
require "models" $PY -m scripts.gpu_serve.models "$STATE/models"
require "import SGLang, find the plugin" $PY -c "import sgl_kernel, sglang, flashinfer
from importlib.metadata import entry_points
from sglang.srt.entrypoints.engine import Engine
plugins = [e.value for e in entry_points(group='sglang.srt.plugins')]
assert 'sglang_dflash.plugin:register' in plugins, plugins
print('sglang', sglang.__version__, 'flashinfer', flashinfer.__version__, 'plugins', plugins)"

M=$STATE/models
RACE_ARGS=(--target "$M/qwen3-8b" --draft "$M/qwen3-8b-dflash" --num-draft-tokens 16 --device cuda
  --server-args "--load-format dummy --skip-tokenizer-init --attention-backend flashinfer --cuda-graph-backend-prefill disabled --cuda-graph-max-bs-decode 32 --max-running-requests 32 --context-length 4096 --dtype bfloat16 --mem-fraction-static 0.85 --watchdog-timeout 1800"
  --dataset random-ids --input-len 256 --max-new-tokens 256 --ignore-eos --concurrency "$RACE_CONCURRENCY"
  --duration "$RACE_SECONDS" --no-plots --no-progress)
race() {  # race DIR CONFIG [--simulate-acc-len X]
  local dir=$1 config=$2
  shift 2
  $PY scripts/load_test.py --configs "$config" "${RACE_ARGS[@]}" --output-dir "$STATE/$dir" "$@" || return 1
  # Which machine measured it: the report compares only runs of one machine side by side.
  echo "$(hostname) $(cat /proc/sys/kernel/random/boot_id) $(nvidia-smi -L 2>/dev/null | head -1)" > "$STATE/$dir/machine.txt"
}

for s in $STEPS; do
  case $s in
    lossless)
      run_step lossless $PY -m scripts.gpu_serve.lossless "$M/tiny-target" "$M/tiny-draft" --out "$STATE/lossless.json" ;;
    race-baseline)
      run_step race-baseline race race-baseline baseline ;;
    race-*)
      acc=${s#race-}
      run_step "race-$acc-dflash" race "race-$acc-dflash" dflash --simulate-acc-len "$acc"
      run_step "race-$acc-dflash-builtin" race "race-$acc-dflash-builtin" dflash-builtin --simulate-acc-len "$acc" ;;
    *)
      echo "unknown step $s (lossless, race-baseline, race-<acceptance>)" >&2
      FAILED=1 ;;
  esac
done

outputs
cat "$RESULTS/gpu-serve-report.md"
summary
exit $FAILED
