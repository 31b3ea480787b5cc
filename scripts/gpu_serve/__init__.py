"""The GPU serving kit (`make gpu-serve-check`): SGLang and our DFLASH on a GPU machine that has
PyTorch and no package index. See scripts/gpu_serve_check.sh."""
