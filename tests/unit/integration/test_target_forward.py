"""The target's forward over the verify window: at width 1, a plain DECODE forward."""

from types import SimpleNamespace

import torch


def test_a_width1_decode_forward_gives_the_target_a_plain_decode_batch():
    """The DECODE forward at W = 1 hands the target no speculative input (SGLang's Triton backend
    plans a decode from any spec_info's `kv_indptr`, which the draft's input lacks), with its
    lengths and token, and puts the batch back as it was."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dflash.integration.target_forward import decode_forward

    seen = {}

    class Target:
        model_runner = SimpleNamespace(decode_cuda_graph_runner=None)

        def forward_batch_generation(self, batch, **kwargs):
            seen.update(spec_info=batch.spec_info, mode=batch.forward_mode, seq_lens=batch.seq_lens.tolist())
            seen.update(seq_lens_cpu=batch.seq_lens_cpu.tolist(), input_ids=batch.input_ids.tolist())
            return "result"

    draft_input = object()
    batch = SimpleNamespace(
        spec_info=draft_input,
        forward_mode=ForwardMode.TARGET_VERIFY,
        seq_lens=torch.tensor([5, 9]),
        seq_lens_cpu=torch.tensor([5, 9]),
        seq_lens_sum=14,
        input_ids=None,
        out_cache_loc=None,
    )
    bonus, slots = torch.tensor([[3], [4]]), torch.tensor([[20], [21]])
    assert decode_forward(Target(), batch, bonus, slots) == "result"
    assert seen == dict(
        spec_info=None, mode=ForwardMode.DECODE, seq_lens=[6, 10], seq_lens_cpu=[6, 10], input_ids=[3, 4]
    )
    assert batch.spec_info is draft_input and batch.forward_mode == ForwardMode.TARGET_VERIFY
    assert batch.seq_lens.tolist() == [5, 9] and batch.seq_lens_sum == 14


def runner_of(mode):
    return None if mode is None else SimpleNamespace(capture_forward_mode=mode)


def test_a_width1_decode_forward_never_replays_a_verify_graph():
    """A speculative server's graph runner holds TARGET_VERIFY graphs, and SGLang's width check
    passes a batch without spec_info: the DECODE forward would replay the full-width verify graph
    (on FlashInfer, an assertion on the verify's prefix lengths). It runs eager instead, and
    the runner is put back; a runner of DECODE graphs (or none) is left as it is."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dflash.integration.target_forward import decode_forward, replays_decode

    assert not replays_decode(runner_of(ForwardMode.TARGET_VERIFY))
    assert replays_decode(runner_of(ForwardMode.DECODE)) and replays_decode(None)
    assert replays_decode(SimpleNamespace())  # SGLang's eager runner: it replays nothing

    for mode, seen_during in (
        (ForwardMode.TARGET_VERIFY, None),
        (ForwardMode.DECODE, ForwardMode.DECODE),
    ):
        graph_runner = runner_of(mode)
        target = SimpleNamespace(model_runner=SimpleNamespace(decode_cuda_graph_runner=graph_runner))
        seen = []

        def forward(batch, **kwargs):
            seen.append(getattr(target.model_runner.decode_cuda_graph_runner, "capture_forward_mode", None))
            raise RuntimeError("the forward failed")  # the runner is put back all the same

        target.forward_batch_generation = forward
        batch = SimpleNamespace(
            spec_info=None,
            forward_mode=ForwardMode.TARGET_VERIFY,
            seq_lens=torch.tensor([5]),
            seq_lens_cpu=torch.tensor([5]),
            seq_lens_sum=5,
            input_ids=None,
            out_cache_loc=None,
        )
        try:
            decode_forward(target, batch, torch.tensor([[3]]), torch.tensor([[20]]))
        except RuntimeError:
            pass
        assert seen == [seen_during]
        assert target.model_runner.decode_cuda_graph_runner is graph_runner
