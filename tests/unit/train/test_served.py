"""Served acceptance while training (`train/served.py`, `--eval-prompts`).

Oracle: z-lab's reference `dflash_generate` (greedy) on the shipped trained pair: our
`speculative_generate` with the same weights gives the same tokens and the same tokens committed
per step, so `tau_served` is the reference's. The trainer logs it next to the teacher-forced tau
and warns when it falls well below.
"""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch

from sglang_dflash.assets import tiny_pair, tiny_pair_prompts
from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.train.served import speculative_generate

NEW_TOKENS = 40


def test_served_decoding_equals_the_reference_on_the_shipped_pair(monkeypatch):
    reference = pytest.importorskip("dflash.model", reason="z-lab reference not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # its stats clock, on CPU
    target_dir, draft_dir = tiny_pair()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    theirs = reference.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    config = DFlashDraftConfig.from_pretrained(draft_dir)
    layer_ids = config.target_layer_ids
    ours = DFlashDraftModel.from_pretrained(draft_dir, config, len(layer_ids))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    taus = []
    for text in tiny_pair_prompts()[:3]:
        ids = tokenizer(text).input_ids[-48:]
        want = reference.dflash_generate(
            theirs,
            target,
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            stop_token_ids=None,
            return_stats=True,
        )
        got = speculative_generate(ours, target, layer_ids, ids, NEW_TOKENS, config.mask_token_id)
        assert got.output_ids == want.output_ids[0, len(ids) :].tolist()
        assert got.committed == want.acceptance_lengths
        taus.append(got.tau)
    assert min(taus) > 1.5  # the trained draft is accepted: the comparison is not of empty drafts


def test_the_trainer_logs_tau_served_and_warns_when_it_lags(tmp_path, caplog):
    from sglang_dflash.train.cli import config_from_args
    from sglang_dflash.train.loop import Trainer
    from tests.support.tiny import make_target

    target = make_target(str(tmp_path / "target"))
    with open(os.path.join(os.path.dirname(os.__file__), "json", "decoder.py")) as f:
        (tmp_path / "train.txt").write_text(f.read())
    prompts = tmp_path / "prompts.jsonl"
    record = {"input_ids": list(range(5, 25)), "loss_mask": [0] * 10 + [1] * 10}  # prompt: the first 10
    prompts.write_text("\n".join(json.dumps(record) for _ in range(2)))
    argv = ["--target", target, "--data", str(tmp_path / "train.txt"), "--out", str(tmp_path / "out")]
    argv += ["--max-length", "40", "--num-draft-layers", "1", "--block-size", "4", "--num-anchors", "4"]
    argv += ["--max-steps", "2", "--eval-every", "1", "--save-every", "0", "--no-progress", "--device", "cpu"]
    argv += ["--eval-prompts", str(prompts), "--eval-max-new-tokens", "8", "--export-dtype", "float32"]
    trainer = Trainer(config_from_args(argv))
    trainer.fit()
    with open(tmp_path / "out" / "train_log.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert all(1.0 <= r["tau_served"] <= 4.0 for r in records)
    with open(tmp_path / "out" / "training_info.json") as f:
        assert "chat_template" in json.load(f)
    trainer.served_tau = lambda: 1.0  # a draft that serves worse than it trains
    metrics = trainer.evaluate(trainer.examples[:2])
    metrics.accepted += 10 * metrics.blocks  # a teacher-forced tau of about 11
    with caplog.at_level(logging.WARNING):
        record = trainer._evaluations(metrics)
    assert record["tau_served"] == 1.0 and "served acceptance 1.00 is below" in caplog.text


def test_narrow_verify_windows_stay_lossless_either_way_of_drafting():
    """`verify_width` below the block: drafting the whole block or only the window, the output is
    the same greedy continuation as full-width decoding, in steps of at most W tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = tiny_pair()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config = DFlashDraftConfig.from_pretrained(draft_dir)
    layer_ids = config.target_layer_ids
    draft = DFlashDraftModel.from_pretrained(draft_dir, config, len(layer_ids))
    ids = AutoTokenizer.from_pretrained(target_dir)(tiny_pair_prompts()[0]).input_ids[-48:]
    full = speculative_generate(draft, target, layer_ids, ids, NEW_TOKENS, config.mask_token_id)
    for full_block in (True, False):
        narrow = speculative_generate(
            draft,
            target,
            layer_ids,
            ids,
            NEW_TOKENS,
            config.mask_token_id,
            verify_width=3,
            full_block=full_block,
        )
        assert narrow.output_ids == full.output_ids
        assert max(narrow.committed) <= 3 < max(full.committed)
