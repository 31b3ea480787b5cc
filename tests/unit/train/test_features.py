"""Offline target features (`train/features.py`): capture, then train with `--features`.

Oracle: online training. Captured with the batching the run uses (one sequence per forward),
training from the features ends with bit-identical weights and the same log as training online,
in fp32 on CPU, and builds no target decoder (loading one fails the test). The capture resumes
shard by shard, prints its size in bytes per token, and a features directory that does not match
`--data` is refused.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from sglang_dflash.train import features
from sglang_dflash.train.config import TrainConfigError
from tests.support.tiny import make_target

ARGS = ["--max-length", "40", "--num-draft-layers", "1", "--block-size", "6", "--num-anchors", "6"]
RUN = ["--batch-size", "1", "--grad-accum", "2", "--max-steps", "4", "--save-every", "0", "--seed", "1"]
RUN += ["--export-dtype", "float32", "--device", "cpu", "--no-progress"]


def _train(target, text, out, *extra):
    from sglang_dflash.train.cli import config_from_args
    from sglang_dflash.train.loop import Trainer

    trainer = Trainer(
        config_from_args(["--target", target, "--data", text, "--out", out, *ARGS, *RUN, *extra])
    )
    trainer.fit()
    return trainer


def test_training_from_captured_features_equals_online_training(tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    from sglang_dflash.train import target as target_module

    target = make_target(str(tmp_path / "target"))
    text = str(tmp_path / "train.txt")
    with open(os.path.join(os.path.dirname(os.__file__), "json", "decoder.py")) as f, open(text, "w") as g:
        g.write(f.read())
    online = _train(target, text, str(tmp_path / "online"))

    feats = str(tmp_path / "features")
    capture = ["--target", target, "--data", text, "--out", feats, "--max-length", "40"]
    capture += ["--num-draft-layers", "1", "--shard-size", "3", "--batch-size", "1", "--device", "cpu"]
    assert features.main(capture) == 0
    assert "bytes per token" in capsys.readouterr().out
    shards = sorted(os.listdir(feats))
    assert "manifest.json" in shards and len(shards) > 3
    kept = features.shard_path(feats, 0)
    stamp = os.stat(kept).st_mtime_ns
    os.remove(features.shard_path(feats, 1))  # an interrupted capture
    assert features.main(capture) == 0
    assert os.path.isfile(features.shard_path(feats, 1)) and os.stat(kept).st_mtime_ns == stamp

    def no_decoder(*args, **kwargs):
        raise AssertionError("training from features built the target's decoder")

    monkeypatch.setattr(target_module.FrozenTarget, "load", no_decoder)
    offline = _train(target, text, str(tmp_path / "offline"), "--features", feats)
    ours, theirs = (
        load_file(str(tmp_path / "offline" / "model.safetensors")),
        load_file(str(tmp_path / "online" / "model.safetensors")),
    )
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    with (
        open(tmp_path / "online" / "train_log.jsonl") as f,
        open(tmp_path / "offline" / "train_log.jsonl") as g,
    ):
        for a, b in zip(f, g):
            a, b = json.loads(a), json.loads(b)
            assert (a["loss"], a["acc"]) == (b["loss"], b["acc"])
    assert offline.step == online.step == 4

    other = str(tmp_path / "other.txt")
    with open(other, "w") as f:
        f.write("something else entirely " * 40)
    with pytest.raises(TrainConfigError, match="give other examples"):
        _train(target, other, str(tmp_path / "mismatch"), "--features", feats)
