"""The draft step on one GPU, as served and in pieces, against its memory- and compute-bound limits.

    python scripts/bench/draft_step.py [--shape qwen3-8b|small] [--batch-sizes 1,8,32]
                                       [--contexts 1024,8192] [--iters 20] [--repeats 7]
                                       [--vocab 151936] [--json PATH]

One step: the block `[bonus, MASK x 15]` of every request, embedded, through the draft layers
(attention over its context in the draft KV store, FlashInfer), then the LM head and argmax over
the 15 proposal positions: `DraftStep` plus the head, as `worker._draft` runs it (width 16).

  eager-module   the draft layers module by module, eager (how the step was served before).
  eager-fused    the fused forward (`sglang_dflash/draft/fused_forward.py`), eager.
  graphed        `DraftStep` replaying its split-KV CUDA graph (fused forward), after the host
                 plan, then the head: as served above the plan-free bound
                 (SGLANG_DFLASH_DRAFT_PLAN_FREE_MAX_LEN, default 2048 tokens).
  plan-free      `DraftStep` replaying its plan-free graph (planned once at capture, split-KV
                 off, the layout built inside the graph), then the head: as served up to the
                 bound. Here it is captured with the bound at the case's context, so every
                 context runs it; compare the two to set the default bound.

For each, `step` is the wall time of back-to-back steps (host work of one step overlaps the
device work of the one before, as in serving), and `synced` the wall time of a step followed by
a device sync (nothing overlaps). Pieces, device time from CUDA events: the graph replay alone,
the LM head and argmax, the host time of the attention plan (`bind`), and the plan-free graph's
replay alone.

Limits, from this run's own measurements: memory-bound = bytes the step must read (draft
weights, LM head, context K/V) / the device's read bandwidth (the faster of a large copy and a
large reduction); compute-bound = its matmul FLOPs / a large bf16 matmul's FLOP rate. Random
weights (the Qwen3-8B draft's shape by default: hidden 4096, 5 layers, 32/8 heads, head_dim 128,
MLP 12288, block 16, vocab 151,936), bf16. Each number is min / median / max over --repeats
repeats of --iters steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from scripts.bench.ops import SHAPES, build_model, device_ms, new_store  # noqa: E402
from sglang_dflash.draft import flashinfer_attention as fia  # noqa: E402
from sglang_dflash.draft.fused_forward import FusedDraftForward  # noqa: E402
from sglang_dflash.draft.step import DraftStep  # noqa: E402

BLOCK = 16


@dataclass
class Stat:
    values: list[float]

    def __str__(self) -> str:
        v = sorted(self.values)
        return f"{v[0]:.3f} / {statistics.median(v):.3f} / {v[-1]:.3f}"

    @property
    def median(self) -> float:
        return statistics.median(self.values)


def repeat(measure, repeats: int) -> Stat:
    return Stat([measure() for _ in range(repeats)])


def wall_ms(fn, iters: int, sync_each: bool) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / iters


def read_bandwidth() -> float:
    """Bytes/s the device reads: the faster of a 2 GiB copy (read + write) and a reduction."""
    x = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    for _ in range(3):
        y.copy_(x)
        x.amax()
    copy = device_ms(lambda: y.copy_(x), 10)
    reduce = device_ms(lambda: x.amax(), 10)
    return max(2 * nbytes / (copy * 1e-3), nbytes / (reduce * 1e-3))


def matmul_flops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    ms = device_ms(lambda: a @ a, 10)
    return 2 * 8192**3 / (ms * 1e-3)


def as_served():
    """The benchmark's mode: no autograd, as served (SGLang runs its forwards without it).
    Without it, a grad-requiring input makes the module path record autograd history, and the
    write of the block's K/V into the store (`k_cache[rows] = k`) chains each step's history to
    the store: every step's activations stay alive (about 0.56 GB a step at bs 32, Qwen3-8B
    shape) and the eager numbers include autograd's bookkeeping."""
    return torch.no_grad()


class Head:
    """The target's embedding and LM head for a draft (`target_head.TargetHead` at TP 1): frozen
    weights, as served."""

    def __init__(self, vocab: int, hidden: int, device: str = "cuda", dtype=torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(1)
        self.embedding = torch.nn.Embedding(vocab, hidden, device=device, dtype=dtype).requires_grad_(False)
        self.embedding.weight.normal_(generator=g)
        self.weight = torch.randn(vocab, hidden, device=device, generator=g, dtype=dtype) * 0.02

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return F.linear(flat, self.weight).argmax(-1).view(hidden.shape[:-1])


class Case:
    """A batch of bs requests with `context` committed tokens each, in a store of random K/V."""

    def __init__(self, model, bs: int, context: int):
        self.bs, self.context = bs, context
        self.num_target_slots = bs * (context + 2 * BLOCK) + 1
        self.store = new_store(model, self.num_target_slots + fia.num_scratch_slots(bs, BLOCK))
        self.store.k.normal_()
        self.store.v.normal_()
        width = context + 2 * BLOCK
        slots = torch.randperm(self.num_target_slots - 1, device="cuda")[: bs * width] + 1
        self.req_to_token = torch.zeros(bs + 1, width, dtype=torch.int32, device="cuda")
        self.req_to_token[1:] = slots.view(bs, width).to(torch.int32)
        self.rows = torch.arange(1, bs + 1, device="cuda")
        self.bonus = torch.randint(0, 1000, (bs,), device="cuda")
        self.seq_lens = torch.full((bs,), context, device="cuda")
        self.host_lens = torch.full((bs,), context)

    def attention(self, config, graph_batch_size=None, buffers=None, workspace=None, **plan_free):
        return fia.FlashInferDraftAttention(
            config,
            self.store,
            scratch_base=self.num_target_slots,
            max_batch_size=self.bs,
            graph_batch_size=graph_batch_size,
            graph_buffers=buffers,
            workspace=workspace,
            **plan_free,
        )

    def step_inputs(self):
        return self.req_to_token, self.rows, self.bonus, self.seq_lens, self.host_lens, True

    def nbytes(self, model, vocab: int) -> int:
        c = model.config
        draft = sum(
            p.numel() * p.element_size() for name, p in model.named_parameters() if name.startswith("layers")
        )
        draft += model.norm.weight.numel() * 2
        kv = 2 * self.bs * self.context * c.num_hidden_layers * c.kv_size * 2
        return draft + vocab * c.hidden_size * 2 + kv

    def flops(self, model, vocab: int) -> float:
        c = model.config
        tokens = self.bs * BLOCK
        params = sum(
            p.numel() for name, p in model.named_parameters() if name.startswith("layers") and p.dim() == 2
        )
        attention = (
            4 * tokens * (self.context + BLOCK) * c.num_attention_heads * c.head_dim * c.num_hidden_layers
        )
        return 2 * tokens * params + attention + 2 * self.bs * (BLOCK - 1) * vocab * c.hidden_size


def bench_case(model, fused, head, case: Case, args, bandwidth: float, flops: float) -> dict:
    config = model.config
    eager_attention = case.attention(config)
    make_step = lambda forward: DraftStep(  # noqa: E731
        forward, head.embedding, eager_attention, block_size=BLOCK, mask_token_id=1
    )
    eager_module, eager_fused, graphed = make_step(model), make_step(fused), make_step(fused)
    plan_free = make_step(fused)
    buffers = eager_attention.graph_buffers(case.bs, case.context)
    capacity = buffers.capacity
    graphed.capture(
        [case.bs],
        lambda b: case.attention(config, b, buffers),
        case.req_to_token,
        kv_indices_capacity=capacity,
    )
    plan_free.capture(
        [case.bs],
        lambda b: case.attention(config, b, buffers),
        case.req_to_token,
        kv_indices_capacity=capacity,
        make_plan_free=lambda b: case.attention(config, b, buffers, plan_free_max_len=case.context),
        plan_free_max_len=case.context,
    )
    inputs = case.step_inputs()

    def served(step):
        def run():
            _, _, hidden = step(*inputs)
            head.argmax(hidden[:, 1:])

        return run

    paths = {
        "eager-module": served(eager_module),
        "eager-fused": served(eager_fused),
        "graphed": served(graphed),
        "plan-free": served(plan_free),
    }
    # The graphed step against the eager one, once: the same proposals where not a near-tie.
    want, got = eager_module(*inputs)[2][:, 1:].clone(), graphed(*inputs)[2][:, 1:].clone()
    agree = float((head.argmax(want) == head.argmax(got)).float().mean())
    got = plan_free(*inputs)[2][:, 1:].clone()
    agree_plan_free = float((head.argmax(want) == head.argmax(got)).float().mean())
    for run in paths.values():
        for _ in range(3):
            run()
    result = {
        "bs": case.bs,
        "context": case.context,
        "proposals_agree": agree,
        "plan_free_proposals_agree": agree_plan_free,
    }
    for name, run in paths.items():
        result[name] = {
            "step": repeat(lambda run=run: wall_ms(run, args.iters, False), args.repeats),
            "synced": repeat(lambda run=run: wall_ms(run, args.iters, True), args.repeats),
        }
    g = graphed.graphs[case.bs]
    hidden = g.outputs[2][:, 1:]
    result["pieces"] = {
        "replay": repeat(lambda: device_ms(g.graph.replay, args.iters), args.repeats),
        "lm_head+argmax": repeat(lambda: device_ms(lambda: head.argmax(hidden), args.iters), args.repeats),
        "plan (host)": repeat(
            lambda: wall_ms(lambda: g.attention.bind(*bind_inputs(g, case)), args.iters, True), args.repeats
        ),
        "plan-free replay": repeat(
            lambda: device_ms(plan_free.plan_free[case.bs].graph.replay, args.iters), args.repeats
        ),
    }
    result["memory_limit"] = case.nbytes(model, args.vocab) / bandwidth * 1e3
    result["compute_limit"] = case.flops(model, args.vocab) / flops * 1e3
    return result


def bind_inputs(g, case: Case):
    return case.req_to_token, g.pool_rows, g.seq_lens, case.host_lens, BLOCK


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("scripts/bench/draft_step.py needs a CUDA GPU")
    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv))
    with as_served():
        run(args)


def run(args) -> None:
    bandwidth, flops = read_bandwidth(), matmul_flops()
    model = build_model(args.shape, torch.bfloat16)
    reference = build_model(args.shape, torch.bfloat16)  # the module path keeps unstacked weights
    max_context = max(int(c) for c in args.contexts.split(","))
    fused = FusedDraftForward(model, max_context + BLOCK)
    head = Head(args.vocab, model.config.hidden_size)
    c = model.config
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | draft {args.shape}: "
        f"H={c.hidden_size} layers={c.num_hidden_layers} "
        f"heads={c.num_attention_heads}/{c.num_key_value_heads} "
        f"head_dim={c.head_dim} MLP={c.intermediate_size} block={BLOCK} vocab={args.vocab} bf16"
    )
    print(f"# read bandwidth {bandwidth / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s (this run)")
    print("# ms, min / median / max over repeats")
    results = []
    for context in (int(x) for x in args.contexts.split(",")):
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            case = Case(model, bs, context)
            r = bench_case(reference, fused, head, case, args, bandwidth, flops)
            results.append(r)
            limit = max(r["memory_limit"], r["compute_limit"])
            print(
                f"\nbs {bs:>3}  context {context:>5}  memory-bound {r['memory_limit']:.3f} ms  "
                f"compute-bound {r['compute_limit']:.3f} ms  "
                f"proposals graphed == eager: {r['proposals_agree']:.3f}, "
                f"plan-free == eager: {r['plan_free_proposals_agree']:.3f}"
            )
            for name in ("eager-module", "eager-fused", "graphed", "plan-free"):
                step = r[name]["step"]
                print(
                    f"  {name:<13} step {step}  synced {r[name]['synced']}  "
                    f"step/limit {step.median / limit:.2f}x"
                )
            for name, stat in r["pieces"].items():
                print(f"  {'piece':<13} {name:<15} {stat}")
            del case
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                results,
                f,
                indent=1,
                default=lambda s: {"min": min(s.values), "median": s.median, "max": max(s.values)},
            )


if __name__ == "__main__":
    main()
