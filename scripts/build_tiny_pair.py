"""Build the embedded tiny target/draft pair (`sglang_dflash/assets/tiny_pair/`), reproducibly.

    python scripts/build_tiny_pair.py [--out DIR] [--work DIR] [--threads 2]
    python scripts/build_tiny_pair.py --dflash2    # only draft-dflash2/, for the shipped target
    python scripts/build_tiny_pair.py --block-16   # only a B = 16 draft, into WORK/draft-b16/

Everything runs on the CPU, from files present on every Python 3.11 install, with fixed seeds.

Corpus (the selection rule)
    Every `*.py` file under these packages of the running interpreter's standard library
    (`os.path.dirname(os.__file__)`), skipping any file inside a directory named `test`,
    `tests` or `idle_test`:
        asyncio collections concurrent ctypes dbm email html http importlib json logging
        multiprocessing sqlite3 tomllib unittest urllib wsgiref xml xmlrpc
    sorted by path relative to the library directory (203 files, about 3.0 MB on CPython
    3.11.7). File number i of that sorted list is HELD OUT when i % 10 == 9 (20 files); the
    other 183 files are the training corpus. The held-out files only provide evaluation
    prompts (`prompts.json`), so the acceptance tests measure text the models never saw.
    The corpus hash is printed and recorded in `build_info.json`; another 3.11 patch release
    changes a few files, hence the hash and (slightly) the weights, but not the recipe.

Steps (each prints its progress and wall-clock time)
    1. corpus     the files above; training documents are joined with the EOS token.
    2. tokenizer  byte-level BPE (HF `tokenizers`), 2048 entries including `<|endoftext|>`
                  (EOS and padding) and `<|MASK|>` (the draft's mask token), saved as a
                  transformers fast tokenizer with a chat template.
    3. target     a Qwen3ForCausalLM trained from scratch on the training corpus (next-token
                  loss, random 512-token windows, AdamW, bf16 autocast with fp32 master
                  weights), saved in bf16.
    4. prompts    evaluation prompts cut from the held-out files.
    5. draft      `sglang_dflash.train` (this repo's recipe) on the target's own greedy
                  continuations (`--regenerate greedy`) of prefixes of the training corpus,
                  evaluated on the held-out files' continuations.
    6. export     target/, draft/, prompts.json and build_info.json into --out.

With --dflash2, steps 2-3 and the plain draft are skipped: a DFlash2 draft (`--family dflash2`)
of the same recipe is trained for the target already in --out, on the same data, and exported
to --out/draft-dflash2/ (its build information under "draft_dflash2" in build_info.json).
With --block-16, the same for a plain draft of block size 16 (the served default B, for
measurements at B = 16: `scripts/bench/narrow_drafting.py --draft WORK/draft-b16`); it is not
shipped, so it stays in WORK/draft-b16/ with its record in WORK/draft-b16/build_info.json.

Reproducibility: same interpreter files, same thread count and same CPU give the same bytes;
other CPUs give slightly different floating-point rounding, hence slightly different weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PACKAGES = (
    "asyncio collections concurrent ctypes dbm email html http importlib json logging "
    "multiprocessing sqlite3 tomllib unittest urllib wsgiref xml xmlrpc"
).split()
SKIP_DIRS = {"test", "tests", "idle_test"}
HOLD_OUT_EVERY = 10  # file i is held out when i % 10 == 9

EOS, MASK = "<|endoftext|>", "<|MASK|>"
# A code model: a chat is its messages' contents run together, so the assistant continues the
# user's code. System messages become comment lines.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}# {{ m['content'] }}\n"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
)

# The target: ~4.2M parameters (bf16 on disk: ~8.4 MB).
TARGET = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
TARGET_TRAIN = dict(seq_len=512, batch_size=8, steps=1200, lr=2e-3, warmup=60, min_lr_ratio=0.1, seed=0)


class Clock:
    """Prints each step with its wall-clock time, and keeps them for build_info.json."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: dict[str, float] = {}

    def step(self, name: str):
        clock = self

        class _Step:
            def __enter__(self):
                print(f"\n=== {name}", flush=True)
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                dt = time.perf_counter() - self.t0
                clock.times[name] = round(dt, 1)
                if exc[0] is None:
                    print(
                        f"=== {name}: {dt:.1f} s (total {time.perf_counter() - clock.start:.0f} s)",
                        flush=True,
                    )

        return _Step()


# ------------------------------------------------------------------------------------ corpus


def corpus_files(lib_dir: str) -> list[str]:
    """The selection rule of the module docstring: relative paths, sorted."""
    found = []
    for package in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(lib_dir, package)):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
            found += [os.path.relpath(os.path.join(root, f), lib_dir) for f in files if f.endswith(".py")]
    return sorted(found)


def split_corpus(files: list[str]) -> tuple[list[str], list[str]]:
    train = [f for i, f in enumerate(files) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    held_out = [f for i, f in enumerate(files) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    return train, held_out


def read_texts(lib_dir: str, files: list[str]) -> list[str]:
    texts = []
    for f in files:
        with open(os.path.join(lib_dir, f), encoding="utf-8") as fh:
            texts.append(fh.read())
    return texts


def corpus_hash(files: list[str], texts: list[str]) -> str:
    h = hashlib.sha256()
    for name, text in zip(files, texts):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], path: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=MASK)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = TARGET["max_position_embeddings"]
    fast.save_pretrained(path)
    return fast


# ------------------------------------------------------------------------------------ target


def token_stream(tokenizer, texts: list[str]):
    """Documents joined by EOS: EOS doc EOS doc ... EOS, as one int64 tensor."""
    import torch

    eos = tokenizer.eos_token_id
    ids = [eos]
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += enc + [eos]
    return torch.tensor(ids, dtype=torch.int64)


def train_target(tokenizer, train_ids, eval_ids, path: str, steps: int) -> dict:
    """Next-token training from scratch; returns the training record for build_info.json."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    t = dict(TARGET_TRAIN, steps=steps)
    torch.manual_seed(t["seed"])
    config = Qwen3Config(
        **TARGET,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    params = sum(p.numel() for p in model.parameters())
    print(f"target: {params / 1e6:.2f}M parameters, {TARGET}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(0.9, 0.95), weight_decay=0.1)

    def lr_factor(step: int) -> float:
        if step < t["warmup"]:
            return (step + 1) / t["warmup"]
        progress = (step - t["warmup"]) / max(1, t["steps"] - t["warmup"])
        return t["min_lr_ratio"] + (1 - t["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    gen = torch.Generator().manual_seed(t["seed"])
    window = t["seq_len"] + 1
    start, tokens, log = time.perf_counter(), 0, []
    for step in range(1, t["steps"] + 1):
        offsets = torch.randint(0, len(train_ids) - window, (t["batch_size"],), generator=gen)
        batch = torch.stack([train_ids[o : o + window] for o in offsets.tolist()])
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch[:, 1:].numel()
        if step % 25 == 0 or step == t["steps"]:
            elapsed = time.perf_counter() - start
            print(
                f"target step {step}/{t['steps']} loss {loss.item():.3f} "
                f"({tokens / elapsed:.0f} tokens/s, {elapsed:.0f} s)",
                flush=True,
            )
            log.append({"step": step, "loss": round(loss.item(), 4)})
    eval_loss = evaluate_target(model, eval_ids, t["seq_len"])
    print(f"target held-out loss {eval_loss:.3f} (perplexity {math.exp(eval_loss):.1f})", flush=True)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, do_sample=False
    )
    model.save_pretrained(path)
    return {
        "parameters": params,
        "tokens_seen": tokens,
        "train_tokens": len(train_ids),
        "eval_loss": round(eval_loss, 4),
        "log": log,
        **t,
    }


def evaluate_target(model, ids, seq_len: int) -> float:
    """Mean next-token loss over consecutive windows of the held-out stream, in fp32."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for lo in range(0, len(ids) - 1, seq_len):
            chunk = ids[lo : lo + seq_len + 1][None]
            if chunk.shape[1] < 2:
                break
            logits = model(input_ids=chunk[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[0, 1:], reduction="sum")
            total, count = total + loss.item(), count + chunk.shape[1] - 1
    return total / count


# ----------------------------------------------------------------------------------- prompts

DEF_LINE = re.compile(r"^( {0,4})def \w+\(.*\):\s*$")


def eval_prompts(
    files: list[str], texts: list[str], train_texts: list[str], per_file: int = 2, context_lines: int = 6
) -> list[dict]:
    """Completion prompts from the held-out files: a one-line `def` (top level or method)
    with up to `context_lines` lines before it, without its newline. From each file, the first `per_file` such
    lines at least 30 lines into the file and 40 lines apart, skipping any prompt whose text
    also occurs in a training file."""
    prompts = []
    for name, text in zip(files, texts):
        lines = text.splitlines(keepends=True)
        taken, last = 0, -(10**9)
        for i, line in enumerate(lines):
            if taken == per_file:
                break
            if i >= 30 and i - last >= 40 and DEF_LINE.match(line):
                # Without the final newline: the tokenizer merges a newline with the next line's
                # indentation, so a prompt ending in a bare newline token would ask for a
                # line at column 0.
                prompt = "".join(lines[max(0, i - context_lines) : i + 1]).rstrip()
                if any(prompt in t for t in train_texts):
                    continue
                prompts.append({"source": f"{name}:{i + 1}", "text": prompt})
                taken, last = taken + 1, i
    return prompts


# ------------------------------------------------------------------------------------- draft

BLOCK_SIZE = 8


def draft_argv(
    target: str, data: str, eval_data: str, out: str, steps: int, block_size: int = BLOCK_SIZE
) -> list[str]:
    """The recipe's command line (`python -m sglang_dflash.train ...`)."""
    return [
        *("--target", target, "--data", data, "--eval-data", eval_data, "--out", out),
        *("--device", "cpu", "--export-dtype", "bfloat16", "--save-every", "0", "--seed", "0"),
        # bf16 forward passes (fp32 weights and optimizer): half the time per step on a CPU
        # with bf16 units; the recipe's CPU default is fp32.
        *("--autocast", "bf16"),
        # Data: the target's greedy continuation (192 tokens) of the first 64 tokens of every
        # 256-token chunk of the training documents.
        *("--max-length", "256", "--regenerate", "greedy", "--regen-prompt-tokens", "64"),
        *("--regen-max-new-tokens", "192", "--regen-batch-size", "32"),
        # Draft: two layers over three target layers, block of 8.
        *("--num-draft-layers", "2", "--block-size", str(block_size), "--target-layer-ids", "0", "1", "2"),
        # Objective and optimisation.
        *("--num-anchors", "64", "--batch-size", "8", "--lr", "2e-3", "--warmup-ratio", "0.04"),
        *("--max-steps", str(steps)),
    ]


# DFlash2 (--dflash2): the recipe's convolution (2 taps over groups of 16 channels) and a selector
# of rank 64 over the top 16 candidates (the recipe's 256 is as wide as this draft).
DFLASH2_ARGV = ("--family", "dflash2", "--selector-rank", "64", "--selector-top-k", "16")


def write_documents(path: str, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def write_draft_data(work: str, train_texts, held_texts, max_docs) -> tuple[str, str]:
    """WORK/draft_data/{train,eval}.jsonl: the training and held-out documents (the first
    `max_docs` of each, if set) -> their paths."""
    data_dir = os.path.join(work, "draft_data")
    os.makedirs(data_dir, exist_ok=True)
    paths = os.path.join(data_dir, "train.jsonl"), os.path.join(data_dir, "eval.jsonl")
    for path, texts in zip(paths, (train_texts, held_texts)):
        write_documents(path, texts[:max_docs])
    return paths


def train_draft(argv: list[str]) -> dict:
    """The recipe's `Trainer` on the command line `argv`."""
    from sglang_dflash.train.cli import config_from_args
    from sglang_dflash.train.loop import Trainer, format_metrics

    print("python -m sglang_dflash.train " + " ".join(argv), flush=True)
    trainer = Trainer(config_from_args(argv))
    trainer.fit()
    held_out = trainer.evaluate(trainer.eval_examples)
    print(f"draft held-out (recipe's estimate): {format_metrics(held_out)}", flush=True)
    params = sum(p.numel() for p in trainer.draft.parameters())
    return {
        "parameters": params,
        "steps": trainer.step,
        "train_examples": len(trainer.examples),
        "held_out_examples": len(trainer.eval_examples),
        "held_out": {k: round(v, 4) for k, v in held_out.summary().items() if k != "acc"},
    }


# ------------------------------------------------------------------------------------ export

TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
DRAFT_FILES = ("config.json", "model.safetensors")


def export(work: str, out: str, prompts: list[dict], info: dict) -> None:
    for name, files in (("target", TARGET_FILES), ("draft", DRAFT_FILES)):
        dst = os.path.join(out, name)
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        for f in files:
            shutil.copy(os.path.join(work, name, f), os.path.join(dst, f))
        extra = os.path.join(work, name, "chat_template.jinja")
        if os.path.isfile(extra):
            shutil.copy(extra, os.path.join(dst, "chat_template.jinja"))
    with open(os.path.join(out, "prompts.json"), "w") as f:
        json.dump(prompts, f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")


def file_sizes(out: str) -> dict:
    sizes = {}
    for name in ("target", "draft"):
        d = os.path.join(out, name)
        sizes[name] = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    return sizes


# -------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.path.join(REPO, "sglang_dflash", "assets", "tiny_pair"))
    parser.add_argument("--work", default=os.path.join(REPO, "build", "tiny_pair"), help="intermediate files")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (the results depend on it; more than the idle cores slows everything down a lot)",
    )
    parser.add_argument("--target-steps", type=int, default=TARGET_TRAIN["steps"])
    parser.add_argument("--draft-steps", type=int, default=4000)
    parser.add_argument("--max-docs", type=int, help="debugging: regenerate from the first N documents only")
    parser.add_argument(
        "--reuse-target", action="store_true", help="keep WORK/target from an earlier run (draft only)"
    )
    parser.add_argument(
        "--dflash2", action="store_true", help="train only a DFlash2 draft for the target in --out"
    )
    parser.add_argument(
        "--block-16",
        action="store_true",
        help="train only a plain draft of block size 16 for the target in --out, into WORK/draft-b16",
    )
    args = parser.parse_args()
    if args.dflash2 or args.block_16:
        build_extra_draft(args)
        return

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    clock = Clock()
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    target_dir, draft_dir = os.path.join(work, "target"), os.path.join(work, "draft")
    info: dict = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
    }

    with clock.step("1. corpus"):
        lib_dir = os.path.dirname(os.__file__)
        files = corpus_files(lib_dir)
        train_files, held_files = split_corpus(files)
        train_texts, held_texts = read_texts(lib_dir, train_files), read_texts(lib_dir, held_files)
        info["corpus"] = {
            "rule": f"*.py under Lib/{{{','.join(PACKAGES)}}}, minus {sorted(SKIP_DIRS)} dirs, sorted; "
            f"file i held out when i % {HOLD_OUT_EVERY} == {HOLD_OUT_EVERY - 1}",
            "files": len(files),
            "train_files": len(train_files),
            "held_out_files": held_files,
            "train_bytes": sum(len(t.encode()) for t in train_texts),
            "held_out_bytes": sum(len(t.encode()) for t in held_texts),
            "sha256": corpus_hash(files, read_texts(lib_dir, files)),
        }
        print(json.dumps({k: v for k, v in info["corpus"].items() if k != "held_out_files"}, indent=1))

    if args.reuse_target and os.path.isfile(os.path.join(target_dir, "model.safetensors")):
        from transformers import AutoTokenizer

        print(f"\nreusing the target in {target_dir}")
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        with open(os.path.join(work, "target_info.json")) as f:
            info["target"] = json.load(f)
    else:
        shutil.rmtree(target_dir, ignore_errors=True)
        with clock.step("2. tokenizer"):
            tokenizer = train_tokenizer(train_texts, target_dir, TARGET["vocab_size"])
            assert tokenizer.eos_token_id == 0 and tokenizer.mask_token_id == 1
            assert len(tokenizer) == TARGET["vocab_size"], len(tokenizer)
        with clock.step("3. target"):
            train_ids = token_stream(tokenizer, train_texts)
            eval_ids = token_stream(tokenizer, held_texts)
            print(f"{len(train_ids)} training tokens, {len(eval_ids)} held-out tokens", flush=True)
            info["target"] = train_target(tokenizer, train_ids, eval_ids, target_dir, args.target_steps)
        info["target"]["wall_s"] = clock.times["3. target"]
        with open(os.path.join(work, "target_info.json"), "w") as f:
            json.dump(info["target"], f, indent=1)

    with clock.step("4. prompts"):
        prompts = eval_prompts(held_files, held_texts, train_texts)
        print(f"{len(prompts)} prompts from {len(held_files)} held-out files", flush=True)

    with clock.step("5. draft"):
        shutil.rmtree(draft_dir, ignore_errors=True)
        train_data, eval_data = write_draft_data(work, train_texts, held_texts, args.max_docs)
        argv = draft_argv(target_dir, train_data, eval_data, draft_dir, args.draft_steps)
        info["draft"] = train_draft(argv)
        info["draft"]["command"] = "python -m sglang_dflash.train " + " ".join(
            os.path.relpath(a, work) if os.path.isabs(a) else a for a in argv
        )

    with clock.step("6. export"):
        info["times_s"] = clock.times
        export(work, args.out, prompts, info)
        sizes = file_sizes(args.out)
        print(f"wrote {args.out}: target {sizes['target'] / 1e6:.1f} MB, draft {sizes['draft'] / 1e6:.1f} MB")
    print(f"\ntotal {time.perf_counter() - clock.start:.0f} s")


def build_extra_draft(args) -> None:
    """One more draft of the shipped recipe for the target in `args.out`: DFlash2 (--dflash2),
    exported to `args.out`/draft-dflash2/ with its record under "draft_dflash2" in
    build_info.json, or block size 16 (--block-16), left in WORK/draft-b16/ with its record
    beside it."""
    import torch

    torch.set_num_threads(args.threads)
    clock = Clock()
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    target_dir = os.path.join(os.path.abspath(args.out), "target")
    name, extra, block_size = (
        ("draft-dflash2", list(DFLASH2_ARGV), BLOCK_SIZE) if args.dflash2 else ("draft-b16", [], 16)
    )
    draft_dir = os.path.join(work, name)
    with clock.step("1. corpus"):
        lib_dir = os.path.dirname(os.__file__)
        train_files, held_files = split_corpus(corpus_files(lib_dir))
        train_texts, held_texts = read_texts(lib_dir, train_files), read_texts(lib_dir, held_files)
    with clock.step(f"5. draft ({name})"):
        shutil.rmtree(draft_dir, ignore_errors=True)
        train_data, eval_data = write_draft_data(work, train_texts, held_texts, args.max_docs)
        argv = draft_argv(target_dir, train_data, eval_data, draft_dir, args.draft_steps, block_size) + extra
        record = train_draft(argv)
        # Paths as the plain draft's record has them: the pair's target as `target`, the rest
        # relative to WORK (no machine's absolute paths).
        shown = [
            "target" if a == target_dir else os.path.relpath(a, work) if os.path.isabs(a) else a for a in argv
        ]
        record["command"] = "python -m sglang_dflash.train " + " ".join(shown)
    record["times_s"] = clock.times
    if not args.dflash2:
        with open(os.path.join(draft_dir, "build_info.json"), "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"wrote {draft_dir}; total {time.perf_counter() - clock.start:.0f} s")
        return
    with clock.step("6. export"):
        dst = os.path.join(args.out, name)
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        for f in DRAFT_FILES:
            shutil.copy(os.path.join(draft_dir, f), os.path.join(dst, f))
        info_file = os.path.join(args.out, "build_info.json")
        with open(info_file) as f:
            info = json.load(f)
        info["draft_dflash2"] = record
        with open(info_file, "w") as f:
            json.dump(info, f, indent=1)
            f.write("\n")
    print(f"wrote {dst}; total {time.perf_counter() - clock.start:.0f} s")


if __name__ == "__main__":
    main()
