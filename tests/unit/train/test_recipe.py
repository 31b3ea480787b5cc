"""The training recipe (`sglang_dflash.train`) on tiny random targets, CPU only.

Oracles: a brute-force mask, a loop-based loss, the serving attention path, an uninterrupted
run (for resume), per-prompt `generate` (for batched regeneration), and the z-lab reference
loader (for the export).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash import ops
from sglang_dflash.checkpoint.config import DFlashDraftConfig
from sglang_dflash.draft.attention import SdpaDraftAttention
from sglang_dflash.draft.kv_store import DraftKVStore
from sglang_dflash.draft.model import DFlashDraftModel
from sglang_dflash.train import data
from sglang_dflash.train.checkpoint import latest_checkpoint
from sglang_dflash.train.config import TrainConfig, TrainConfigError, default_loss_gamma
from sglang_dflash.train.mask import block_attention_mask
from sglang_dflash.train.objective import (
    block_loss,
    draft_hidden,
    loss_weights,
    make_blocks,
    sample_anchors,
    valid_anchors,
)
from sglang_dflash.train.target import TargetOutput
from tests.support import paths
from tests.support.tiny import MASK_ID, make_draft, make_target

REPO = str(paths.REPO)
JSON_SOURCES = os.path.join(os.path.dirname(os.__file__), "json")


# ----------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny target, a near-bigram target, and text files (the json package's sources)."""
    root = tmp_path_factory.mktemp("train")
    target = make_target(str(root / "target"))
    bigram = _bigram_target(str(root / "bigram"))
    paths = {"target": target, "bigram": bigram}
    for name, src in (("train", "decoder.py"), ("eval", "encoder.py")):
        with open(os.path.join(JSON_SOURCES, src)) as f:
            (root / f"{name}.txt").write_text(f.read())
        paths[name] = str(root / f"{name}.txt")
    paths["root"] = str(root)
    return paths


def _bigram_target(path: str) -> str:
    """The tiny target with its attention and MLP outputs zeroed: the next token depends on the
    current token only, so greedy continuations settle into short cycles a draft can learn in a
    few dozen steps (the plain tiny target's continuations are chaotic)."""
    from transformers import AutoModelForCausalLM

    make_target(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
    model.save_pretrained(path)
    return path


def _config(files, out: str, **overrides) -> TrainConfig:
    base = dict(
        target=files["target"],
        data=files["train"],
        out=out,
        max_length=48,
        num_draft_layers=1,
        block_size=8,
        num_anchors=8,
        batch_size=4,
        max_steps=4,
        save_every=0,
        export_dtype="float32",
        progress=False,
    )
    base.update(overrides)
    return TrainConfig(**base)


def _trainer(cfg: TrainConfig):
    from sglang_dflash.train.loop import Trainer

    return Trainer(cfg)


# ------------------------------------------------------------------------------ block mask


def _brute_force_mask(anchors, seq_len, block_size, causal, window):
    """Element by element, straight from the rules in `mask.py`'s docstring."""
    b, num_anchors = anchors.shape
    q = num_anchors * block_size
    mask = torch.zeros(b, q, seq_len + q, dtype=torch.bool)
    for i in range(b):
        for j in range(num_anchors):
            a = int(anchors[i, j])
            for k in range(block_size):
                row, q_pos = j * block_size + k, a + k
                keys = [(t, t, t < a) for t in range(seq_len)]
                keys += [
                    (seq_len + jj * block_size + kk, int(anchors[i, jj]) + kk, jj == j)
                    for jj in range(num_anchors)
                    for kk in range(block_size)
                ]
                for col, k_pos, structural in keys:
                    ok = structural
                    if causal:
                        ok = ok and k_pos <= q_pos
                    if window is not None:
                        ok = ok and q_pos - k_pos < window
                        if not causal:
                            ok = ok and k_pos - q_pos < window
                    mask[i, row, col] = ok
    return mask


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3), (False, 3)])
def test_block_mask_matches_brute_force(causal, window):
    # Overlapping blocks (anchors 2 and 3), an anchor near the end, and a second sequence.
    anchors = torch.tensor([[1, 2, 3, 9], [4, 5, 7, 10]])
    got = block_attention_mask(anchors, 12, 4, causal=causal, window=window)
    want = _brute_force_mask(anchors, 12, 4, causal, window)
    assert torch.equal(got, want)
    assert bool(got.any(-1).all()), "every query sees at least one key"


def test_block_mask_docstring_example():
    got = block_attention_mask(torch.tensor([[1, 3]]), 6, 2, causal=False, window=None)[0].int()
    assert got.tolist() == [
        [1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 1, 1],
        [1, 1, 1, 0, 0, 0, 0, 0, 1, 1],
    ]


# ------------------------------------------------------------------------- blocks and labels


def test_anchors_and_labels_worked_example():
    batch = data.collate(
        [
            data.Example([7, 8, 9, 5, 6], [False, False, True, True, True]),
            data.Example([3, 4, 2], [True] * 3),
        ],
        pad_id=0,
    )
    assert valid_anchors(batch.loss_mask, batch.lengths).int().tolist() == [
        [0, 1, 1, 1, 0],  # 1: first label at 2; 4: nothing after it
        [0, 1, 0, 0, 0],  # padding is never an anchor
    ]
    predictions = torch.tensor([[70, 80, 90, 50, 60], [30, 40, 20, 0, 0]])
    anchors, anchor_valid = torch.tensor([[1, 3], [1, 1]]), torch.tensor([[True, True], [True, False]])
    # Sequence 0: anchor 1 labels positions 2, 3; anchor 3 labels position 4 (5 is past the end).
    for labels, first, second in (("data", [9, 5], 6), ("target", [80, 90], 50)):
        blocks = make_blocks(
            batch, predictions, anchors, anchor_valid, block_size=3, mask_token_id=MASK_ID, labels=labels
        )
        assert blocks.labels[0, 0].tolist() == first
        assert blocks.labels[0, 1, 0].item() == second
    assert blocks.block_ids[0].tolist() == [[8, MASK_ID, MASK_ID], [5, MASK_ID, MASK_ID]]
    assert blocks.positions[0].tolist() == [[1, 2, 3], [3, 4, 5]]
    # a=3, k=2 is position 5, past the end; the invalid anchor of sequence 1 has no labels.
    assert blocks.label_valid.tolist() == [[[True, True], [True, False]], [[True, False], [False, False]]]


def test_sample_anchors_distinct_valid_reproducible():
    valid = torch.zeros(3, 40, dtype=torch.bool)
    valid[0, 5:30] = True
    valid[1, [3, 7]] = True  # fewer valid positions than anchors
    keys = [data.anchor_key(0, 0, i) for i in range(3)]
    a1, v1 = sample_anchors(valid, 6, keys, 64)
    a2, v2 = sample_anchors(valid, 6, keys, 64)
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    # A row's anchors depend on its key only: not on its batch, its place there or the padding.
    alone, _ = sample_anchors(valid[:1, :35], 6, keys[:1], 64)
    assert torch.equal(alone[0], a1[0])
    other, _ = sample_anchors(valid[:1], 6, [data.anchor_key(0, 1, 0)], 64)  # another epoch
    assert not torch.equal(other[0], a1[0])
    assert v1[0].all() and v1[1].sum() == 2 and not v1[2].any()
    assert sorted(a1[1][v1[1]].tolist()) == [3, 7]
    for row in a1:
        assert len(set(row.tolist())) == row.numel()


# ----------------------------------------------------------------------------------- loss


def test_loss_weights():
    w = loss_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    torch.testing.assert_close(w, torch.tensor([math.exp(-k / 7.0) for k in range(15)]))
    assert default_loss_gamma(16) == 7.0
    # Other block sizes keep the first/last weight ratio of B=16.
    torch.testing.assert_close(loss_weights(8, default_loss_gamma(8))[-1], w[-1])


def test_block_loss_matches_loop_oracle():
    gen = torch.Generator().manual_seed(0)
    b, a, bs, h, v = 2, 3, 5, 8, 11
    hidden = torch.randn(b, a, bs, h, generator=gen)
    lm_head = torch.randn(v, h, generator=gen)
    labels = torch.randint(0, v, (b, a, bs - 1), generator=gen)
    valid = torch.rand(b, a, bs - 1, generator=gen) > 0.3
    valid[0, 0] = True  # one complete block at least
    # Make block (0, 0) right at k=1, 2 and wrong at k=3: an accepted run of 2.
    logits0 = hidden[0, 0, 1:] @ lm_head.T
    labels[0, 0, :2] = logits0[:2].argmax(-1)
    labels[0, 0, 2] = (logits0[2].argmax() + 1) % v
    weights = loss_weights(bs, 2.0)

    from sglang_dflash.train.objective import Blocks

    blocks = Blocks(anchors=None, block_ids=None, positions=None, labels=labels, label_valid=valid)
    loss_sum, m = block_loss(hidden, blocks, lm_head, weights)

    num = den = 0.0
    correct, count = [0] * (bs - 1), [0] * (bs - 1)
    runs = []
    for i in range(b):
        for j in range(a):
            hits = []
            for k in range(bs - 1):
                if valid[i, j, k]:
                    logits = hidden[i, j, k + 1] @ lm_head.T
                    ce = F.cross_entropy(logits[None], labels[i, j, k][None]).item()
                    num += weights[k].item() * ce
                    den += weights[k].item()
                    hit = int(logits.argmax() == labels[i, j, k])
                    correct[k] += hit
                    count[k] += 1
                    hits.append(hit)
            if valid[i, j].all():
                run = 0
                while run < len(hits) and hits[run]:
                    run += 1
                runs.append(run)
    assert loss_sum.item() == pytest.approx(num, rel=1e-5) and m.weight_sum.item() == pytest.approx(den)
    assert m.loss == pytest.approx(num / den, rel=1e-5)
    assert m.count.tolist() == count and m.correct.tolist() == correct
    assert m.acceptance_length == pytest.approx(1 + sum(runs) / len(runs))
    assert runs[0] == 2


def test_the_chunked_head_loss_equals_the_whole_one(monkeypatch):
    """`head_loss` in checkpointed chunks: the loss, the hits, the top-k candidates and the
    gradient of the whole [M, V] path, to fp32 rounding."""
    from sglang_dflash.train import objective

    gen = torch.Generator().manual_seed(0)
    m, h, v = 50, 16, 300
    lm_head = torch.randn(v, h, generator=gen)
    labels = torch.randint(0, v, (m,), generator=gen)
    w = torch.rand(m, generator=gen)
    rows = torch.randn(m, h, generator=gen, requires_grad=True)
    logits = F.linear(rows, lm_head).float()
    whole = (w * F.cross_entropy(logits, labels, reduction="none")).sum()
    (want_grad,) = torch.autograd.grad(whole, rows)
    monkeypatch.setattr(objective, "LOSS_CHUNK_BYTES", 4 * v * 7)  # 7 rows a chunk: 8 chunks
    chunked, hits, candidates = objective.head_loss(rows, labels, w, lm_head, top_k=5)
    (grad,) = torch.autograd.grad(chunked, rows)
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(hits, logits.argmax(-1) == labels)
    assert torch.equal(candidates, logits.topk(5, dim=-1).indices)  # DFlash2's candidates


def test_the_hooked_target_equals_hf_hidden_states_and_logits(files, monkeypatch):
    """Features from hooks on the named layers and the chunked argmax equal HF's
    `output_hidden_states` and full logits."""
    from sglang_dflash.train import target as target_module
    from sglang_dflash.train.target import FrozenTarget

    frozen = FrozenTarget.load(files["target"], (0, 2, 2), torch.device("cpu"))
    monkeypatch.setattr(target_module, "PREDICT_CHUNK_BYTES", 4 * 384 * 5)  # 5 rows a chunk
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 384, (2, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    got = frozen.forward(ids, mask)
    with torch.no_grad():
        out = frozen.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    want = torch.cat([out.hidden_states[i + 1] for i in (0, 2, 2)], dim=-1)
    assert torch.equal(got.features, want)
    assert torch.equal(got.predictions, out.logits.argmax(-1))


_PEAK = """
import sys, torch, torch.nn.functional as F
from sglang_dflash.train import objective


def status(key):  # kB, from the kernel's accounting of this process
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


m, h, v = 4096, 64, 32768  # 512 anchors x 8 block positions, a 32K vocabulary
g = torch.Generator().manual_seed(0)
lm_head, labels = torch.randn(v, h, generator=g), torch.randint(0, v, (m,), generator=g)
rows, w = torch.randn(m, h, generator=g, requires_grad=True), torch.ones(m)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size: earlier peaks do not count
base = status("VmRSS:")
if sys.argv[1] == "whole":
    loss = (w * F.cross_entropy(F.linear(rows, lm_head).float(), labels, reduction="none")).sum()
else:
    loss, _, _ = objective.head_loss(rows, labels, w, lm_head)
loss.backward()
print((status("VmHWM:") - base) // 1024)
"""


def test_the_chunked_head_loss_peaks_lower():
    """Peak resident memory of one loss and backward over 4096 labels and a 32K vocabulary, in a
    fresh process each: the whole [M, V] path against the chunks (peak resident size from the
    kernel, reset after the inputs are built)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("no /proc/self/clear_refs to reset the peak resident size")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    peak = {
        mode: int(subprocess.run([sys.executable, "-c", _PEAK, mode], env=env, capture_output=True, text=True,
                                 check=True).stdout)
        for mode in ("whole", "chunked")
    }  # fmt: skip
    print(f"peak MiB above the inputs: {peak}")
    assert peak["whole"] > 500 and peak["chunked"] < peak["whole"] / 2, peak


# ------------------------------------------------------------ training forward == serving


class _Embedding:
    def __init__(self, table: torch.Tensor):
        self.table = table

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


@pytest.mark.parametrize("mode", ["split", "flex", "dense"])
@pytest.mark.parametrize("sliding, conv", [(False, False), (True, False), (False, True)])
def test_training_forward_matches_serving(tmp_path, sliding, conv, mode):
    """Every anchored block of a padded batch, trained in one forward, gets the hidden states
    that serving computes for that block alone: context = the tokens before the anchor (with
    any block attention, `--block-attention`; flex's forward only, as on CPU). With DFlash2's
    grouped convolution (`conv`), whose taps reach back along each block's rows: the training
    batch holds whole blocks, as serving's does."""
    path = make_draft(
        str(tmp_path / "draft"), num_layers=2, num_kv_heads=1, target_layer_ids=[0, 2], block_size=4
    )
    if sliding:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        raw.update(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
        raw["use_sliding_window"] = True  # else Qwen3Config, as SGLang reads it, drops the window
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f)
    config = DFlashDraftConfig.from_pretrained(path)
    draft = DFlashDraftModel.from_pretrained(path, config, 2)
    gen = torch.Generator().manual_seed(1)
    if conv:  # the same draft with convolutions of 2 taps over groups of 16, their deltas random
        config = dataclasses.replace(config, conv_kernel_size=2, conv_group_size=16)
        plain, draft = draft, DFlashDraftModel(config, 2)
        draft.load_state_dict(plain.state_dict(), strict=False)
        with torch.no_grad():
            for layer in draft.layers:
                for c in (layer.attention_conv, layer.mlp_conv):
                    c.kernel_projection.weight.normal_(0, 0.3, generator=gen)
                    c.base_kernel.normal_(0, 0.5, generator=gen)
    target = _Embedding(torch.randn(384, 64, generator=gen))
    lengths, s, bs = [12, 8], 12, 4
    examples = [
        data.Example(torch.randint(2, 384, (n,), generator=gen).tolist(), [True] * n) for n in lengths
    ]
    batch = data.collate(examples, pad_id=0)
    features = torch.randn(2, s, 2 * 64, generator=gen)  # padded rows are garbage on purpose
    anchors = torch.tensor([[1, 4, 5, 10], [2, 3, 6, 6]])
    blocks = make_blocks(
        batch,
        torch.zeros(2, s, dtype=torch.int64),
        anchors,
        torch.ones(2, 4, dtype=torch.bool),
        block_size=bs,
        mask_token_id=MASK_ID,
        labels="data",
    )
    with torch.no_grad():
        got = draft_hidden(draft, target, TargetOutput(features, None), blocks, mode=mode)  # [b, A, B, H]

    store = DraftKVStore(
        num_slots=16, num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, device="cpu"
    )
    attention = SdpaDraftAttention(config, store)
    for i in range(2):
        for j in range(4):
            a = int(anchors[i, j])
            slots = torch.arange(1, a + 1)
            with torch.no_grad():
                ops.inject_context_kv(draft, store, features[i, :a], torch.arange(a), slots)
                lens = torch.tensor([a])
                attend = attention.bind(slots[None], torch.tensor([0]), lens, lens, bs)
                want = draft(target.embed(blocks.block_ids[i, j]), a + torch.arange(bs), attend)
            torch.testing.assert_close(got[i, j], want, rtol=2e-5, atol=2e-5, msg=f"seq {i} anchor {a}")


# ----------------------------------------------------------------------------------- data


def test_chat_labels_are_assistant_tokens(files, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files["target"])
    tok.chat_template = (
        "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}"
    )
    chat = [
        {"role": "user", "content": "def loads(s):"},
        {"role": "assistant", "content": "return decode(s)"},
        {"role": "user", "content": "and dumps?"},
        {"role": "assistant", "content": "return encode(obj)"},
    ]
    file = tmp_path / "chat.jsonl"
    file.write_text(json.dumps({"messages": chat}) + "\n")
    [example] = data.load_examples(str(file), tok, 512)
    labelled = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    # " return" straddles the generation prompt's trailing space and the turn: it is a label.
    assert tok.decode(labelled) == " return decode(s)\n return encode(obj)\n"
    [prompt] = data.load_prompts(str(file), tok, max_length=512, prompt_tokens=8)
    assert tok.decode(prompt.input_ids).endswith("and dumps?\n<|endoftext|>assistant: ")


def test_bad_data_errors(files, tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(TrainConfigError, match=r"--data '.*missing.txt' does not exist"):
        _trainer(_config(files, out, data=str(tmp_path / "missing.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(TrainConfigError, match=r"--data '.*empty.txt' is empty"):
        _trainer(_config(files, out, data=str(empty)))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(TrainConfigError, match=r"--data '.*blank.jsonl' is empty"):
        _trainer(_config(files, out, data=str(blank)))


def test_tokenizer_without_mask_token(files, tmp_path):
    target = str(tmp_path / "no-mask")
    shutil.copytree(files["target"], target)
    file = os.path.join(target, "tokenizer_config.json")
    with open(file) as f:
        tok_config = json.load(f)
    del tok_config["mask_token"]
    with open(file, "w") as f:
        json.dump(tok_config, f)
    out = str(tmp_path / "out")
    with pytest.raises(TrainConfigError, match="tokenizer has no mask token.*--mask-token"):
        _trainer(_config(files, out, target=target))
    with pytest.raises(TrainConfigError, match=r"--mask-token '<\|nope\|>' is not in the .* vocabulary"):
        _trainer(_config(files, out, target=target, mask_token="<|nope|>"))
    trainer = _trainer(_config(files, out, target=target, mask_token="<|MASK|>"))
    assert trainer.raw_config["dflash_config"]["mask_token_id"] == MASK_ID


def test_target_layer_ids_out_of_range(files, tmp_path):
    with pytest.raises(TrainConfigError, match=r"\[0, 7\] names layer\(s\) \[7\].*has 4 layers"):
        _trainer(_config(files, str(tmp_path / "out"), target_layer_ids=(0, 7)))


def test_cli_exits_with_the_message_and_imports_no_sglang(files, tmp_path):
    code = (
        "import runpy, sys\n"
        "try:\n"
        "    runpy.run_module('sglang_dflash.train', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    names = {m.split('.')[0] for m in sys.modules}\n"
        "    print('exit', e.code, 'sglang imported:', 'sglang' in names)\n"
    )
    args = ["--target", files["target"], "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert "exit 2 sglang imported: False" in proc.stdout, proc.stdout + proc.stderr
    assert "error: --data" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_regeneration_matches_per_prompt_generate(files, tmp_path):
    """Batched, left-padded regeneration == the target's greedy continuation of each prompt."""
    with open(os.path.join(JSON_SOURCES, "decoder.py")) as f:
        lines = [line for line in f.read().splitlines() if line.strip()][:12]
    file = tmp_path / "lines.jsonl"
    file.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    cfg = _config(
        files,
        str(tmp_path / "out"),
        data=str(file),
        regenerate="greedy",
        regen_prompt_tokens=8,
        regen_max_new_tokens=10,
        regen_batch_size=6,
    )
    trainer = _trainer(cfg)
    prompts = data.load_prompts(str(file), trainer.tokenizer, max_length=48, prompt_tokens=8)
    assert len({len(p.input_ids) for p in prompts}) > 2, "prompts of different lengths share a batch"
    assert len(trainer.examples) == len(prompts)
    model = trainer.target.model
    for prompt, example in zip(prompts, trainer.examples):
        ids = torch.tensor([prompt.input_ids])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        n = len(prompt.input_ids)
        assert example.input_ids == want[0].tolist()
        assert example.loss_mask == [False] * n + [True] * (len(example.input_ids) - n)


def test_sampled_regeneration_is_seeded(files, tmp_path):
    def regenerated(name, **kw):
        cfg = _config(files, str(tmp_path / name), regen_prompt_tokens=6, regen_max_new_tokens=12, **kw)
        return [e.input_ids for e in _trainer(cfg).examples]

    sampled = regenerated("s1", regenerate="sample", regen_temperature=1.0)
    assert sampled == regenerated("s2", regenerate="sample", regen_temperature=1.0)
    assert sampled != regenerated("s3", regenerate="sample", regen_temperature=1.0, seed=1)
    assert sampled != regenerated("g", regenerate="greedy")


# ----------------------------------------------------------------- round trip and learning


def test_train_checkpoint_resume_export(files, tmp_path):
    """A run interrupted after a checkpoint and resumed ends with exactly the weights of an
    uninterrupted run; the export loads in ours and in the z-lab reference."""
    shape = dict(
        num_draft_layers=2,
        layer_types=("full", "sliding"),
        sliding_window=6,
        target_layer_ids=(0, 2),
        grad_accum=2,
        max_steps=6,
        save_every=3,
    )
    straight = _trainer(_config(files, str(tmp_path / "straight"), **shape))
    straight.fit()

    out = str(tmp_path / "interrupted")
    crashing = _trainer(_config(files, out, **shape))
    step = crashing.train_step

    def crash_after_4():
        if crashing.step == 4:
            raise KeyboardInterrupt
        return step()

    crashing.train_step = crash_after_4
    with pytest.raises(KeyboardInterrupt):
        crashing.fit()
    assert latest_checkpoint(out).endswith("step-000003")
    with pytest.raises(TrainConfigError, match="already holds checkpoints; pass --resume latest"):
        _trainer(_config(files, out, **shape))
    resumed = _trainer(_config(files, out, resume="latest", **shape))
    assert resumed.step == 3
    resumed.fit()
    for (name, p), q in zip(straight.draft.state_dict().items(), resumed.draft.state_dict().values()):
        assert torch.equal(p, q), name
    with open(os.path.join(out, "train_log.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [1, 2, 3, 4, 4, 5, 6]  # step 4 is redone after the resume

    # The export, in ours: same weights, config as trained.
    config = DFlashDraftConfig.from_pretrained(out)
    assert config.block_size == 8 and config.target_layer_ids == (0, 2) and config.mask_token_id == MASK_ID
    assert config.layer_types == ("full_attention", "sliding_attention") and config.sliding_window == 6
    ours = DFlashDraftModel.from_pretrained(out, config, 2)
    for (name, p), q in zip(ours.state_dict().items(), resumed.draft.state_dict().values()):
        assert torch.equal(p, q), name
    # Every checkpoint is itself a servable export.
    DFlashDraftModel.from_pretrained(latest_checkpoint(out), DFlashDraftConfig.from_pretrained(out), 2)

    reference = pytest.importorskip("dflash.model", reason="z-lab reference not installed")
    ref = reference.DFlashDraftModel.from_pretrained(out, dtype=torch.float32)
    assert list(ref.target_layer_ids) == [0, 2] and ref.block_size == 8 and ref.mask_token_id == MASK_ID
    assert [layer.self_attn.sliding_window for layer in ref.layers] == [None, 6]
    assert [layer.self_attn.is_causal for layer in ref.layers] == [False, True]
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, ref_params[name]), name


def test_bf16_export_loads_in_both(files, tmp_path):
    out = str(tmp_path / "out")
    trainer = _trainer(_config(files, out, export_dtype="bfloat16", max_steps=1))
    trainer.fit()
    config = DFlashDraftConfig.from_pretrained(out)
    ours = DFlashDraftModel.from_pretrained(out, config, 1, dtype=torch.bfloat16)
    assert ours.fc.weight.dtype == torch.bfloat16
    torch.testing.assert_close(ours.fc.weight.float(), trainer.draft.fc.weight, rtol=1e-2, atol=1e-3)
    reference = pytest.importorskip("dflash.model", reason="z-lab reference not installed")
    ref = reference.DFlashDraftModel.from_pretrained(out)
    assert ref.fc.weight.dtype == torch.bfloat16
    assert torch.equal(ref.fc.weight, ours.fc.weight)


def test_autocast_setting(files, tmp_path):
    """--autocast auto is fp32 on CPU; bf16 autocasts the forward there too, weights stay fp32."""
    seen = {}
    for mode in ("auto", "bf16", "off"):
        trainer = _trainer(_config(files, str(tmp_path / mode), autocast=mode))
        dtypes = set()
        trainer.draft.fc.register_forward_hook(lambda module, args, out: dtypes.add(out.dtype))
        trainer.evaluate(trainer.examples[:4])
        seen[mode] = dtypes
        assert trainer.draft.fc.weight.dtype == torch.float32
    assert seen == {"auto": {torch.float32}, "bf16": {torch.bfloat16}, "off": {torch.float32}}
    with pytest.raises(TrainConfigError, match=r"--autocast must be one of .*, got 'fp8'"):
        _config(files, str(tmp_path / "bad"), autocast="fp8")


def test_ranks_share_the_evaluation(files, tmp_path):
    """Under torchrun every rank evaluates its share (batches r, r + N, ...; prompts likewise) and
    the all-reduce sums them. Oracle: one process's evaluation of everything, which the two
    shares add up to; a rank that evaluated everything alone would count every example twice."""
    import json

    from sglang_dflash.train.ranks import Ranks

    prompts = tmp_path / "prompts.jsonl"
    records = [{"input_ids": list(range(5 + i, 25 + i)), "loss_mask": [0] * 10 + [1] * 10} for i in range(3)]
    prompts.write_text("\n".join(json.dumps(r) for r in records))
    cfg = _config(files, str(tmp_path / "out"), eval_data=files["eval"], eval_prompts=str(prompts))
    trainer = _trainer(cfg)
    examples = trainer.eval_examples[:9]  # batches of 4: [0..3], [4..7], [8]
    whole, whole_tau = trainer.evaluate(examples).as_vector(), trainer.served_tau()

    sums = []

    class StandIn(Ranks):  # two ranks in one process: each share is recorded, then added here
        def sum_(self, tensor):
            sums.append(tensor.clone())
            return tensor

    for rank in (0, 1):
        trainer.ranks = StandIn(rank=rank, world=2)
        trainer.evaluate(examples)
        trainer.served_tau()
    eval0, tau0, eval1, tau1 = sums
    torch.testing.assert_close(eval0 + eval1, whole, rtol=0, atol=1e-9)
    tokens, steps = (tau0 + tau1).tolist()
    assert tokens / steps == pytest.approx(whole_tau)
    assert min(eval0.sum(), eval1.sum(), tau0[1], tau1[1]) > 0  # each rank took a share


def test_training_on_greedy_continuations_raises_accuracy(files, tmp_path):
    """A few dozen steps on the target's own greedy continuations, judged on held-out prompts."""
    cfg = _config(
        files,
        str(tmp_path / "out"),
        target=files["bigram"],
        eval_data=files["eval"],
        max_length=64,
        regenerate="greedy",
        regen_prompt_tokens=16,
        regen_max_new_tokens=48,
        num_anchors=16,
        batch_size=8,
        lr=1e-2,
        warmup_ratio=0.1,
        max_steps=60,
    )
    trainer = _trainer(cfg)
    before = trainer.evaluate(trainer.eval_examples)
    trainer.fit()
    after = trainer.evaluate(trainer.eval_examples)

    # What always guessing the most frequent held-out label would score.
    counts = torch.bincount(
        torch.tensor([t for e in trainer.eval_examples for t, m in zip(e.input_ids, e.loss_mask) if m])
    )
    majority = (counts.max() / counts.sum()).item()
    assert min(after.count.tolist()) > 300, "enough held-out labels per position"
    assert max(before.accuracy) < 0.05
    for k, (acc0, acc1) in enumerate(zip(before.accuracy, after.accuracy), start=1):
        assert acc1 > acc0 + 0.15, f"position {k}: {acc0:.2f} -> {acc1:.2f}"
    mean0, mean1 = (sum(m.accuracy) / len(m.accuracy) for m in (before, after))
    assert mean1 > mean0 + 0.3, f"mean accuracy {mean0:.2f} -> {mean1:.2f}"
    assert after.accuracy[0] > majority + 0.25, f"position 1: {after.accuracy[0]:.2f} vs {majority:.2f}"
    assert after.acceptance_length > 2.0
