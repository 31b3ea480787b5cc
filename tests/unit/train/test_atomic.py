"""`train/atomic.py`: what a killed or failed write leaves behind. Pure Python."""

import json
import os

import pytest

from sglang_dflash.train import atomic


def test_write_json_creates_and_replaces(tmp_path):
    path = str(tmp_path / "manifest.json")
    atomic.write_json(path, {"shards": 1})
    atomic.write_json(path, {"shards": 2})
    assert json.load(open(path)) == {"shards": 2}
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_a_directory_is_replaced_whole(tmp_path):
    path = str(tmp_path / "step-10")
    for version in ("old", "new"):
        with atomic.replacing(path) as tmp:
            os.makedirs(tmp)
            (tmp_path / "step-10.tmp" / f"{version}.txt").write_text(version)
    assert os.listdir(path) == ["new.txt"]
    assert os.listdir(tmp_path) == ["step-10"]


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_failed_write_leaves_the_old_one_and_no_tmp(tmp_path, kind):
    path = str(tmp_path / "out")
    with atomic.replacing(path) as tmp:
        if kind == "file":
            open(tmp, "w").write("old")
        else:
            os.makedirs(tmp)
    with pytest.raises(KeyboardInterrupt):
        with atomic.replacing(path) as tmp:
            if kind == "file":
                open(tmp, "w").write("half")
            else:
                os.makedirs(tmp)
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["out"]
    if kind == "file":
        assert open(path).read() == "old"


def test_a_killed_run_s_tmp_is_cleared_first(tmp_path):
    """A tmp left by a run killed mid-write (a file where a directory goes, or the reverse)."""
    (tmp_path / "ckpt.tmp").write_text("left by a killed run")
    with atomic.replacing(str(tmp_path / "ckpt")) as tmp:
        os.makedirs(tmp)
    (tmp_path / "data.jsonl.tmp").mkdir()
    with atomic.replacing(str(tmp_path / "data.jsonl")) as tmp, open(tmp, "w") as f:
        f.write("{}\n")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "data.jsonl"]
