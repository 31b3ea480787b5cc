"""Data-parallel training: `torchrun --nproc_per_node 2 -m sglang_dflash.train` (gloo on CPU).

Oracle: one optimizer step is the same whatever the run's shape. In fp32, for STEPS steps, 2
ranks x batch b (torchrun), 1 rank x 2b and 1 rank x b with accumulation 2 end with the same
weights (<= 1e-5) and log the same metrics at every step; each step's examples are the same set
(`data.shard`), each example's anchors are keyed by (seed, epoch, example index), and the loss
is normalised over the whole step. A 2-rank run resumed from its checkpoint ends bit-exactly as
the uninterrupted run; resumed with 1 rank x 2b, it continues with the same examples (the same
metrics) to the same weights. Rank 0 alone writes the log, the checkpoints and the export.

The 1-rank runs train in this process; the 2-rank runs are real torchrun launches.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from sglang_dflash.train.checkpoint import checkpoint_dir
from sglang_dflash.train.config import TrainConfig
from tests.support import paths
from tests.support.tiny import make_target

REPO = str(paths.REPO)
STEPS, SAVE = 8, 4
SHAPE = dict(max_length=40, num_draft_layers=1, block_size=6, num_anchors=6, seed=3, lr=3e-3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-parallel")
    with open(os.path.join(os.path.dirname(os.__file__), "json", "decoder.py")) as f:
        text = f.read()
    (root / "train.txt").write_text(text)
    return {"target": make_target(str(root / "target")), "train": str(root / "train.txt"), "root": root}


def _args(files, out: str, **fields) -> list[str]:
    values = dict(SHAPE, max_steps=STEPS, save_every=SAVE, export_dtype="float32", device="cpu", **fields)
    args = ["--target", files["target"], "--data", files["train"], "--out", out, "--no-progress"]
    for key, value in values.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def _torchrun(files, out: str, **fields) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    cmd += ["-m", "sglang_dflash.train", *_args(files, out, **fields)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _one_rank(files, out: str, **fields) -> None:
    from sglang_dflash.train.cli import config_from_args
    from sglang_dflash.train.loop import Trainer

    cfg: TrainConfig = config_from_args(_args(files, out, **fields))
    Trainer(cfg).fit()


def _weights(out: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "model.safetensors"))


def _log(out: str) -> list[dict]:
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), x["step"]
        assert x["tau"] == pytest.approx(y["tau"]) and x["acc"] == pytest.approx(y["acc"]), x["step"]


def _same_weights(a: dict, b: dict, exact: bool = False) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def two_ranks(files):
    out = str(files["root"] / "two-ranks")
    _torchrun(files, out, batch_size=2)
    return out


def test_two_ranks_take_the_steps_of_one_rank_with_the_whole_batch_or_accumulation(files, two_ranks):
    whole, accumulated = str(files["root"] / "whole"), str(files["root"] / "accumulated")
    _one_rank(files, whole, batch_size=4)
    _one_rank(files, accumulated, batch_size=2, grad_accum=2)
    reference = _weights(whole)
    for out in (two_ranks, accumulated):
        _same_weights(_weights(out), reference)
        _same_metrics(_log(out), _log(whole))
    assert _log(two_ranks)[0]["loss"] != _log(two_ranks)[-1]["loss"]  # it trained
    # Rank 0 alone wrote: one record per step, with the two ranks' throughput.
    record = _log(two_ranks)[-1]
    assert len(_log(two_ranks)) == STEPS and len(record["throughput"]["per_rank"]) == 2
    assert record["throughput"]["tokens_per_s"] > 0 and record["throughput"]["labels_per_s"] > 0
    with open(os.path.join(two_ranks, "train_config.json")) as f:
        assert json.load(f)["ranks"] == 2


def test_resume_is_exact_with_two_ranks_and_continues_the_stream_with_one(files, two_ranks):
    for ranks in (2, 1):
        out = str(files["root"] / f"resumed-{ranks}")
        os.makedirs(os.path.join(out, "checkpoints"))
        shutil.copytree(checkpoint_dir(two_ranks, SAVE), checkpoint_dir(out, SAVE))
        if ranks == 2:
            _torchrun(files, out, batch_size=2, resume="latest")
        else:
            _one_rank(files, out, batch_size=4, resume="latest")
        _same_weights(_weights(out), _weights(two_ranks), exact=ranks == 2)
        _same_metrics(_log(out), _log(two_ranks)[SAVE:])
