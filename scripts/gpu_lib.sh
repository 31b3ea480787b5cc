# Shared by scripts/gpu_check.sh and scripts/gpu_serve_check.sh (sourced, not run): the CUDA
# library headers FlashInfer's JIT needs, the step runner and its summary.
PY=${PYTHON:-python3}

# FlashInfer's JIT norm module (the fused draft layers, and SGLang's norms through the kit's
# sgl_kernel stand-in) includes cublasLt.h and curand_kernel.h, which a CUDA toolkit without
# cuBLAS and cuRAND lacks; PyTorch's CUDA wheels carry them (nvidia/cu*/include). CPATH is
# searched after nvcc's own -I, so the toolkit's headers still win.
cuda_library_headers() {
  if ! echo '#include <cublasLt.h>' | nvcc -x cu -E - >/dev/null 2>&1; then
    local include
    include=$($PY -c "import glob, os, nvidia; print(next(iter(sorted(os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + '/*/include/cublasLt.h'))), ''))" 2>/dev/null)
    if [ -n "$include" ]; then
      export CPATH="${CPATH:+$CPATH:}$include"
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
