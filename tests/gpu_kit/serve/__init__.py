"""The GPU serving kit (`make gpu-proof`): SGLang and our DFLASH on a GPU machine that has
PyTorch and no package index. See tests/gpu_kit/proof.py."""
