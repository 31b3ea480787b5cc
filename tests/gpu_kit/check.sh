#!/usr/bin/env bash
# The GPU path on a machine with a CUDA PyTorch and nvcc, and no SGLang (tests/gpu_kit/README.md,
# "Checking the GPU path without SGLang"): build sglang_dflash._C with the local nvcc, run every
# GPU test, then the GPU benchmarks.
# Every step runs even when an earlier one fails; a summary follows, and the exit status is
# non-zero if any step failed.
#
#   make gpu-check-tests     # PART=tests: build _C, the GPU tests (one 10-minute command)
#   make gpu-check-benches   # PART=benches: the GPU benchmarks (a second command)
#   make gpu-check           # PART=all: both
#
# BUNDLE: FlashInfer's wheels from `python tests/gpu_kit/bundle.py` (run where pip works), installed
# into .gpu-bundle/site (or GPU_SITE) when `import flashinfer` fails. GPU_TESTS: the test files
# holding `pytest.mark.gpu` tests that need no SGLang (tests/unit/gpu_kit/test_bundle.py checks the list;
# the sgl_kernel stand-in's GPU tests run in the serving check, tests/gpu_kit/proof.py).
set -uo pipefail
# shellcheck source=tests/gpu_kit/lib.sh
source "$(dirname "$0")/lib.sh"
BUNDLE=${BUNDLE:-.gpu-bundle/wheels}
SITE=${GPU_SITE:-$PWD/.gpu-bundle/site}  # git-ignored
PART=${PART:-all}
GPU_TESTS="tests/unit/draft/test_step.py tests/unit/draft/test_flashinfer_attention.py tests/unit/draft/test_window_ring.py tests/unit/train/test_flex_attention.py tests/unit/draft/test_fused_forward.py tests/unit/ops/test_ops.py tests/unit/verify/test_sampling.py"
export PYTHONUNBUFFERED=1  # a command stopped at its limit keeps what was printed

if ! $PY -c "import flashinfer" 2>/dev/null; then
  if ! ls "$BUNDLE"/*.whl >/dev/null 2>&1; then
    echo "flashinfer is not importable and $BUNDLE holds no wheels: run tests/gpu_kit/bundle.py where pip works" >&2
    exit 1
  fi
  echo "== FlashInfer from $BUNDLE into $SITE"
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$BUNDLE"/*.whl || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import torch; print('== torch', torch.__version__, 'on', torch.cuda.get_device_name())" || exit 1

cuda_library_headers

if [ "$PART" != benches ]; then
  build_extension
  # A per-test timeout well under one command: one hung test cannot take the whole call.
  # shellcheck disable=SC2086
  step "pytest -m gpu" env SGLANG_DFLASH_BUILD_CUDA=1 $PY -m pytest -m gpu -q -p no:cacheprovider --timeout=240 $GPU_TESTS
fi
if [ "$PART" != tests ]; then
  step "bench_draft_step" $PY scripts/bench/draft_step.py
  step "bench_ops eager" $PY scripts/bench/ops.py --no-builtin
  step "bench_ops graphed" $PY scripts/bench/ops.py --no-builtin --graph
  step "bench_sampling_memory 64 rows" $PY scripts/bench/sampling_memory.py --device cuda
  # More rows than one chunk (73 at the default budget), so the chunked draw is measured too.
  step "bench_sampling_memory 512 rows" $PY scripts/bench/sampling_memory.py --device cuda --rows 512
fi

summary
exit $FAILED
