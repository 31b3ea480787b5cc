"""Shared test set-up: CPU engine environment, markers, and the tiny model fixtures."""

import os

# Before torch or sglang are imported anywhere: SGLang's CPU engine, one intra-op thread
# (several threads on 2 cores made each step ~50x slower), and the sgl_kernel stand-ins in
# this process (spawned engine subprocesses get them from the .pth file at start-up).
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from sglang_dflash.cpu import bootstrap  # noqa: E402

bootstrap.install()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="slow; pass --run-slow")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny seeded checkpoints, built once per session (see tests/support/tiny/)."""
    from tests.support.tiny import TinyModels

    return TinyModels(tmp_path_factory.mktemp("models"))
