"""Shared test set-up: CPU engine environment, markers, and the tiny model fixtures."""

import os

# Before torch or sglang are imported anywhere: SGLang's CPU engine, one intra-op thread
# (several threads on 2 cores made each step ~50x slower), and the sgl_kernel stand-ins in
# this process (spawned engine subprocesses get them from the .pth file at start-up).
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import time  # noqa: E402

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


class FileClock:
    """Each test file's wall time and the session's so far, written at the end of the file's
    progress line, so that a run stopped part-way still shows where its time went."""

    def __init__(self, config):
        self.config = config
        self.started = self.file_started = time.monotonic()
        self.path = None

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter starts the next file's line
    def pytest_runtest_logstart(self, nodeid, location):
        path = nodeid.split("::")[0]
        if path != self.path:
            self.write_previous()
            self.path, self.file_started = path, time.monotonic()

    def pytest_sessionfinish(self):
        self.write_previous()

    def write_previous(self):
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if self.path is None or reporter is None or reporter.verbosity < 0:
            return
        now = time.monotonic()
        reporter.write(f" {now - self.file_started:.0f} s (at {(now - self.started) / 60:.1f} min)")


def pytest_configure(config):
    config.pluginmanager.register(FileClock(config), "file-clock")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny seeded checkpoints, built once per session (see tests/support/tiny/)."""
    from tests.support.tiny import TinyModels

    return TinyModels(tmp_path_factory.mktemp("models"))
