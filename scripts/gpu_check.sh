#!/usr/bin/env bash
# The GPU path on a machine with a CUDA PyTorch and nvcc, and no SGLang (README, "Checking the GPU
# path"): build sglang_dflash._C with the local nvcc, run every GPU test, then the GPU benchmarks.
#
#   make gpu-check [BUNDLE=.gpu-bundle/wheels]
#
# BUNDLE: FlashInfer's wheels from `python scripts/gpu_bundle.py` (run where pip works), installed
# into .gpu-bundle/site (or GPU_SITE) when `import flashinfer` fails. GPU_TESTS: the test files
# holding `pytest.mark.gpu` tests (tests/test_gpu_kit.py checks the list); they import without
# SGLang.
set -euo pipefail
PY=${PYTHON:-python3}
BUNDLE=${BUNDLE:-.gpu-bundle/wheels}
SITE=${GPU_SITE:-$PWD/.gpu-bundle/site}  # git-ignored
GPU_TESTS="tests/test_flashinfer_attention.py tests/test_ops.py tests/test_sampling.py"

if ! $PY -c "import flashinfer" 2>/dev/null; then
  if ! ls "$BUNDLE"/*.whl >/dev/null 2>&1; then
    echo "flashinfer is not importable and $BUNDLE holds no wheels: run scripts/gpu_bundle.py where pip works" >&2
    exit 1
  fi
  echo "== FlashInfer from $BUNDLE into $SITE"
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$BUNDLE"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import torch; print('== torch', torch.__version__, 'on', torch.cuda.get_device_name())"

echo "== sglang_dflash._C with $(command -v nvcc)"
SGLANG_DFLASH_BUILD_CUDA=1 SGLANG_DFLASH_CUDA_ARCHS=${SGLANG_DFLASH_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-8} \
  $PY setup.py -q build_ext --inplace

echo "== pytest -m gpu"
SGLANG_DFLASH_BUILD_CUDA=1 $PY -m pytest -m gpu -q -p no:cacheprovider $GPU_TESTS

echo "== benchmarks"
$PY scripts/bench_ops.py --no-builtin
$PY scripts/bench_ops.py --no-builtin --graph
$PY scripts/bench_sampling_memory.py --device cuda
