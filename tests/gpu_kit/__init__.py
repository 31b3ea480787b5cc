"""The GPU machine's kit, built here (where pip works and nvcc is found) and run there (PyTorch
and nvcc, no SGLang, no package index): `bundle.py` and `aot.py` pack SGLang, FlashInfer and its
precompiled kernels; `check.sh` (`make gpu-check`), `proof.py` with `serve/` (`make gpu-proof`)
and `train.sh` (`make gpu-train`) run there. See tests/gpu_kit/README.md."""
