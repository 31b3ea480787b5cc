# Sourced by tests/gpu_kit/check.sh: the CUDA library headers FlashInfer's JIT needs, the step
# runner and its summary.
PY=${PYTHON:-python3}

# FlashInfer's JIT norm module (the fused draft layers) includes cublasLt.h and curand_kernel.h,
# which a CUDA toolkit without cuBLAS and cuRAND lacks; PyTorch's CUDA wheels carry them. CPATH
# gets a folder of only those headers (the wheels' whole include folder on CPATH breaks nvcc 13's
# own headers). CPATH is searched after nvcc's -I, so the toolkit's headers still win.
cuda_library_headers() {
  if ! echo '#include <cublasLt.h>' | nvcc -x cu -E - >/dev/null 2>&1; then
    local include
    include=$($PY -c "from tests.gpu_kit.aot import library_headers; print(library_headers('.gpu-bundle/headers'))" 2>/dev/null)
    if [ -n "$include" ]; then
      export CPATH="${CPATH:+$CPATH:}$PWD/$include"
      echo "== CUDA library headers for FlashInfer's JIT from $include"
    fi
  fi
}

SUMMARY=()
FAILED=0
step() {  # step NAME COMMAND...: run it, record pass/fail, go on either way
  local name=$1
  shift
  echo
  echo "== $name: $*"
  local start=$SECONDS
  if "$@"; then
    SUMMARY+=("ok     $name ($((SECONDS - start)) s)")
  else
    SUMMARY+=("FAILED $name (exit $?, $((SECONDS - start)) s)")
    FAILED=1
  fi
}

skipped() {  # skipped NAME WHY
  SUMMARY+=("skip   $1 ($2)")
}

summary() {
  echo
  echo "== summary"
  printf '%s\n' "${SUMMARY[@]}"
}

build_extension() {  # sglang_dflash._C with the machine's nvcc, in place
  step "build sglang_dflash._C with $(command -v nvcc)" env SGLANG_DFLASH_BUILD_CUDA=1 \
    SGLANG_DFLASH_CUDA_ARCHS="${SGLANG_DFLASH_CUDA_ARCHS:-90}" MAX_JOBS="${MAX_JOBS:-16}" \
    $PY setup.py -q build_ext --inplace
}
