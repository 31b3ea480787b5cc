# Two commands on a fresh machine:
#   make demo   - set up .venv, then serve a tiny model with DFLASH and print what it did
#   make test   - set up .venv, then run the test suite (CPU; GPU tests are skipped)
# `make` alone (`make help`) lists every target, from the `## ` comment on its line.

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# The GPU machine's Triton, for `make triton-preflight`.
TRITON36 := $(VENV)/triton-3.6.0

# SGLang's CPU engine, with one intra-op thread per process (see docs/serving.md, "CPU").
CPU_ENV := SGLANG_USE_CPU_ENGINE=1 OMP_NUM_THREADS=1
# The CUDA extension (cuda/): built when nvcc is found; BUILD_CUDA=1 makes a missing toolkit or
# a compile error fatal (make test sets it, so CI checks that the extension compiles).
BUILD_CUDA ?=
EXT_ENV = SGLANG_DFLASH_BUILD_CUDA=$(BUILD_CUDA) MAX_JOBS=2

.DEFAULT_GOAL := help
# Two groups: the gpu-* and triton-* targets are the GPU test machine's; every other one is a user's.
HELP_LINE := awk 'BEGIN {FS = ":.*\#\# "} {printf "  %-20s %s\n", $$1, $$2}'
help: ## list the targets (the default goal)
	@echo "For users:"
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | grep -vE '^(gpu|triton)-' | $(HELP_LINE)
	@echo
	@echo "For maintainers: the GPU test machine (tests/gpu_kit/README.md):"
	@grep -hE '^(gpu|triton)-[a-z-]*:.*## ' $(MAKEFILE_LIST) | $(HELP_LINE)

.PHONY: help demo test install lint clean triton-preflight gpu-check gpu-check-tests gpu-check-benches gpu-aot gpu-bundle gpu-carry gpu-first gpu-proof gpu-race gpu-matrix gpu-serve-check gpu-train

$(VENV)/.deps: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "sglang==0.5.23" "setuptools>=77" wheel pytest pytest-timeout ruff matplotlib
	$(PIP) install -q --no-deps "dflash==0.1.0"  # test-only oracle: z-lab's reference
	# Prefill/decode disaggregation tests: SGLang's PD router, and Mooncake's CPU build, which links
	# libibverbs even for its TCP transport; Debian's libraries are unpacked into $(VENV)/rdma.
	$(PIP) install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" "sglang-router==0.3.2"
	rm -rf $(VENV)/rdma && mkdir -p $(VENV)/rdma/debs
	cd $(VENV)/rdma/debs && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200
	for deb in $(VENV)/rdma/debs/*.deb; do dpkg-deb -x $$deb $(VENV)/rdma; done
	touch $@

install: $(VENV)/.deps ## set up .venv, install the package into it (its CUDA op too where nvcc is found)
	# setuptools copies into build/lib without removing what the tree no longer has, and pip would
	# install those leftovers (a moved module under its old name); the compiled objects stay.
	rm -rf build/lib.*
	$(EXT_ENV) $(PIP) install -q --no-deps --no-build-isolation .
	# The tests import the source tree, so the extension is also built in place (ninja reuses build/).
	$(EXT_ENV) $(PY) setup.py -q build_ext --inplace

demo: install ## serve a tiny model with DFLASH and without, and print what it did
	$(PY) scripts/demo.py  # picks CUDA if torch sees a GPU, else the CPU engine

lint: $(VENV)/.deps ## ruff check and ruff format --check
	$(VENV)/bin/ruff check sglang_dflash tests scripts setup.py
	$(VENV)/bin/ruff format --check sglang_dflash tests scripts setup.py

test: BUILD_CUDA = 1
test: install lint $(TRITON36)/.installed ## install, lint, then the test suite on CPU (GPU tests are skipped)
	$(CPU_ENV) $(EXT_ENV) $(PY) -m pytest  # EXT_ENV: the tests check the extension was built

# ==== For maintainers: the GPU test machine's kit (tests/gpu_kit/, tests/gpu_kit/README.md). ====
# Not needed to serve on your own GPU (docs/gpu.md).
# ---- Built here, where pip works and nvcc is found (no GPU needed): ----
# SGLang, FlashInfer and what they import for the GPU machine's Python (.gpu-bundle/serve), and
# FlashInfer's kernels for sm_90a (.gpu-bundle/aot; 20-30 CPU-minutes, resumable).
gpu-bundle: $(VENV)/.deps ## here: SGLang, FlashInfer and their imports for the GPU machine (.gpu-bundle/serve)
	$(PY) tests/gpu_kit/bundle.py --serve

gpu-aot: $(VENV)/.deps ## here, with nvcc: FlashInfer's kernels for sm_90a (.gpu-bundle/aot; about 25 minutes)
	nice $(PY) tests/gpu_kit/aot.py

# Everything gpu-first's call carries, built where it is missing (the serve bundle, 2-3 minutes;
# the AOT modules, about 25 minutes on 2 cores the first time, resumable), then checked: the
# carry list and its size under 64 MiB, and every checkout file gpu-first imports carried.
gpu-carry: $(VENV)/.deps ## here: build and check what gpu-first carries (about 28 minutes the first time)
	$(PY) tests/gpu_kit/carry.py

# SGLang's Triton kernels that gpu-matrix runs, compiled for sm_90 by the GPU machine's Triton
# (3.6.0, installed beside the venv's own, TRITON36 above), without a GPU; a kernel that fails
# is named.
$(TRITON36)/.installed: $(VENV)/.deps
	rm -rf $(TRITON36)
	$(PIP) install -q --no-deps --target $(TRITON36) "triton==3.6.0"
	touch $@

triton-preflight: $(TRITON36)/.installed ## here: compile gpu-matrix's Triton kernels for sm_90 with Triton 3.6.0
	PYTHONPATH=$(TRITON36) $(PY) -m tests.gpu_kit.triton_preflight

# ---- On the GPU machine (Python, a CUDA PyTorch and nvcc; no SGLang, no package index): ----
# The first command whenever a GPU is at hand, at most 9 minutes (540 s), in priority order:
# greedy lossless (one plain engine per pair, one DFLASH run cycling the widths), the race at
# acceptance 3 from 1 to 256 concurrent requests; then, while time is left, 8 and 64 requests,
# acceptance 6.5, the W = 1 step against a plain decode step and the draft step at bs 1.
# Carry what make gpu-carry lists. DEADLINE (seconds) overrides the default.
gpu-first: ## GPU, first whenever one is at hand: lossless, the race to 256, W = 1, the draft step
	$(GPU_PY) -m tests.gpu_kit.proof --plan first $(if $(DEADLINE),--deadline $(DEADLINE))

# The GPU numbers in one command of at most 9 minutes, in priority order: greedy lossless, the
# race at simulated acceptance 6.5, the draft-step benchmark. Carry .gpu-bundle/serve and
# .gpu-bundle/aot. STEPS and DEADLINE (seconds) override the defaults.
GPU_PY ?= python3
gpu-proof: ## GPU: lossless, the race at acceptance 6.5, the draft-step benchmark (STEPS, DEADLINE)
	$(GPU_PY) -m tests.gpu_kit.proof $(if $(STEPS),--steps $(STEPS)) $(if $(DEADLINE),--deadline $(DEADLINE))

# The race under load, from 1 to 256 concurrent requests (one command of at most 9 minutes, in
# priority order: acceptance 3 with every server, ours adaptive against ours at B under
# geometric acceptance 3, then 6.5). Carry what gpu-proof carries.
RACE_LEVELS ?= 1,8,32,64,128,256
RACE_STEPS := race-3,race-geo-3,race-6.5
gpu-race: ## GPU: the race from 1 to 256 concurrent requests (RACE_LEVELS)
	$(GPU_PY) -m tests.gpu_kit.proof --steps $(or $(STEPS),$(RACE_STEPS)) --race-concurrency $(RACE_LEVELS) \
		--race-servers dflash,dflash-builtin,baseline,dflash-fixed --race-seconds 8 \
		$(if $(DEADLINE),--deadline $(DEADLINE))

# Every target family on a GPU (one command of at most 9 minutes, in priority order: gpt-oss,
# Gemma-4, Qwen3-MoE, Qwen3.5 GDN, DeepSeek-V3 MLA, float32 on Triton, then the rest), each its
# tiny pair built on the machine, the plain engine against our DFLASH, three families at once.
# Carry what gpu-proof carries. FAMILIES (comma-separated) and DEADLINE override the defaults.
gpu-matrix: ## GPU: every target family, the plain engine against DFLASH (FAMILIES)
	$(GPU_PY) -m tests.gpu_kit.proof --steps matrix $(if $(FAMILIES),--families $(FAMILIES)) \
		$(if $(DEADLINE),--deadline $(DEADLINE))

# A second call: overlap off, the other acceptance length, the stand-in's kernel tests.
SECOND_CALL := lossless-no-overlap,race-3,standin-tests
gpu-serve-check: ## GPU, a second command: overlap off, acceptance 3, the stand-in's kernel tests
	$(GPU_PY) -m tests.gpu_kit.proof --steps $(or $(STEPS),$(SECOND_CALL))

# The training recipe on the GPU (one command, about 6 minutes, nothing carried): throughput at a
# Qwen3-8B shape, the tiny pair with one process and with NCCL, the block attention benchmark.
gpu-train: ## GPU: the training recipe, about 6 minutes, nothing carried
	GPU_PY=$(GPU_PY) bash tests/gpu_kit/train.sh

# Our GPU components without SGLang: make gpu-check-tests, then make gpu-check-benches (each
# fits one 10-minute command; gpu-check runs both). FlashInfer from .gpu-bundle/wheels
# (`python tests/gpu_kit/bundle.py`) when the machine has none.
gpu-check: ## GPU: gpu-check-tests, then gpu-check-benches
gpu-check-tests: ## GPU, without SGLang: build sglang_dflash._C, run the gpu tests
gpu-check-benches: ## GPU, without SGLang: the draft-step, op and sampling-memory benchmarks
gpu-check gpu-check-tests gpu-check-benches:
	BUNDLE=$(or $(BUNDLE),.gpu-bundle/wheels) PART=$(or $(subst gpu-check-,,$(filter gpu-check-%,$@)),all) bash tests/gpu_kit/check.sh

clean: ## remove build outputs (build/, *.egg-info, the compiled extension)
	rm -rf build *.egg-info sglang_dflash/_C*.so
