"""The CPU stand-ins for the linear-attention ops (sglang_dflash/cpu/linear_attention.py) against
an independent statement of the same maths: a loop over sequences and tokens, one token at a
time, written from the published recurrence (state as [K, V], as in the paper).
"""

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash.cpu import gated_delta, linear_attention, triton_ops

H, HV, K, V, DIM, W = 2, 4, 8, 6, 12, 4


def reference_delta_rule(q, k, v, a, b, A_log, dt_bias, state):
    """One sequence, token by token. q, k [L, H, K], v [L, HV, V], a, b [L, HV], state
    [HV, V, K] (pool layout). Returns (o [L, HV, V], the state [HV, V, K] after each token)."""
    S = state.double().transpose(-1, -2).clone()  # [HV, K, V]
    outs, states = [], []
    for t in range(q.shape[0]):
        o = torch.zeros(HV, V, dtype=torch.float64)
        for hv in range(HV):
            h = hv // (HV // H)
            qt = F.normalize(q[t, h].double(), dim=-1, eps=0) * K**-0.5
            kt = F.normalize(k[t, h].double(), dim=-1, eps=0)
            g = -torch.exp(A_log[hv].double()) * F.softplus(a[t, hv].double() + dt_bias[hv].double())
            beta = torch.sigmoid(b[t, hv].double())
            S[hv] = S[hv] * torch.exp(g)
            S[hv] = S[hv] + torch.outer(kt, beta * (v[t, hv].double() - kt @ S[hv]))
            o[hv] = qt @ S[hv]
        outs.append(o)
        states.append(S.transpose(-1, -2).clone())
    return torch.stack(outs).float(), torch.stack(states).float()


def reference_conv(x, weight, history):
    """One sequence: x [dim, L], history [dim, W - 1] -> (silu conv out [dim, L], windows [L, dim, W - 1])."""
    window, outs, windows = history.clone(), [], []
    for t in range(x.shape[1]):
        full = torch.cat([window, x[:, t : t + 1]], dim=1)  # [dim, W]
        outs.append(F.silu((full * weight).sum(1)))
        window = full[:, 1:]
        windows.append(window.clone())
    return torch.stack(outs, 1), torch.stack(windows)


@pytest.fixture
def params():
    torch.manual_seed(0)
    return dict(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV) * 0.5)


def _inputs(total):
    return (
        torch.randn(1, total, H, K),
        torch.randn(1, total, H, K),
        torch.randn(1, total, HV, V),
        torch.randn(total, HV),
        torch.randn(total, HV),
    )


def _recurrence(params, inputs, pool, rows, cu_seqlens, **verify):
    """The step-by-step op as SGLang's decode (and, with `verify`, target-verify) calls it."""
    q, k, v, a, b = inputs
    return torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=params["A_log"],
        dt_bias=params["dt_bias"],
        q=q,
        k=k,
        v=v,
        a=a,
        b=b,
        initial_state_source=pool,
        initial_state_indices=rows,
        cu_seqlens=cu_seqlens,
        **verify,
    )


def test_chunked_prefill_matches_the_token_loop(params):
    """Ragged sequences across chunk boundaries, from pool states, one row padding (-1)."""
    lens = [150, 1, 64, 37]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q, k, v, a, b = _inputs(sum(lens))
    pool = torch.randn(8, HV, V, K) * 0.3
    rows = torch.tensor([5, 2, -1, 7], dtype=torch.int32)
    before = pool.clone()
    g, beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(params["A_log"], a, b, params["dt_bias"])
    o, _, _ = linear_attention.chunk_gated_delta_rule_cpu(
        q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, initial_state_indices=rows
    )
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        start = before[rows[i]] if rows[i] >= 0 else torch.zeros(HV, V, K)
        want_o, want_states = reference_delta_rule(
            q[0, s:e], k[0, s:e], v[0, s:e], a[s:e], b[s:e], params["A_log"], params["dt_bias"], start
        )
        torch.testing.assert_close(o[0, s:e], want_o, atol=2e-4, rtol=2e-4)
        if rows[i] >= 0:
            torch.testing.assert_close(pool[rows[i]], want_states[-1], atol=2e-4, rtol=2e-4)
    untouched = [r for r in range(8) if r not in rows.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_verify_form_keeps_every_step_and_leaves_the_pool_alone(params):
    bs, steps = 3, 5
    q, k, v, a, b = _inputs(bs * steps)
    pool = torch.randn(6, HV, V, K) * 0.3
    before = pool.clone()
    rows = torch.tensor([4, 0, 3], dtype=torch.int32)
    scratch = torch.zeros(bs + 1, steps, HV, V, K)
    o = _recurrence(
        params,
        (q, k, v, a, b),
        pool,
        rows,
        torch.arange(0, bs * steps + 1, steps, dtype=torch.int32),
        disable_state_update=True,
        intermediate_states_buffer=scratch,
        intermediate_state_indices=torch.arange(bs + 1, dtype=torch.int32),
        cache_steps=steps,
    )
    assert torch.equal(pool, before)
    for i in range(bs):
        sl = slice(i * steps, (i + 1) * steps)
        want_o, want_states = reference_delta_rule(
            q[0, sl], k[0, sl], v[0, sl], a[sl], b[sl], params["A_log"], params["dt_bias"], before[rows[i]]
        )
        torch.testing.assert_close(o[0, sl], want_o, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(scratch[i], want_states, atol=2e-4, rtol=2e-4)


def test_decode_form_advances_the_pool(params):
    bs = 4
    q, k, v, a, b = _inputs(bs)
    pool = torch.randn(6, HV, V, K) * 0.3
    before = pool.clone()
    rows = torch.tensor([1, 5, -1, 2], dtype=torch.int32)
    o = _recurrence(params, (q, k, v, a, b), pool, rows, torch.arange(bs + 1, dtype=torch.int32))
    for i in [0, 1, 3]:
        want_o, want_states = reference_delta_rule(
            q[0, i : i + 1], k[0, i : i + 1], v[0, i : i + 1], a[i : i + 1], b[i : i + 1],
            params["A_log"], params["dt_bias"], before[rows[i]],
        )  # fmt: skip
        torch.testing.assert_close(o[0, i : i + 1], want_o, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(pool[rows[i]], want_states[-1], atol=2e-5, rtol=2e-5)
    assert torch.equal(pool[[0, 3, 4]], before[[0, 3, 4]])


def test_chunked_form_matches_transformers(params):
    """A second oracle: Hugging Face's own chunked implementation, on one sequence."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, a, b = _inputs(97)
    g, beta = gated_delta.gates(params["A_log"], a, b, params["dt_bias"])
    pool = torch.randn(1, HV, V, K) * 0.3
    start = pool.clone()
    o, _, _ = linear_attention.chunk_gated_delta_rule_cpu(
        q, k, v, g[None], beta[None], pool, torch.tensor([0, 97]), initial_state_indices=torch.tensor([0])
    )
    rep = HV // H
    want, final = torch_chunk_gated_delta_rule(
        q.repeat_interleave(rep, 2),
        k.repeat_interleave(rep, 2),
        v,
        g[None],
        beta[None],
        initial_state=start.transpose(-1, -2),  # HF keeps the state as [K, V]
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(pool, final.transpose(-1, -2), atol=2e-4, rtol=2e-4)


def test_conv_prefill_and_verify_match_the_loop():
    torch.manual_seed(1)
    weight = torch.randn(DIM, W)
    lens = [7, 1, 3]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    x = torch.randn(sum(lens), DIM)
    states = torch.randn(5, DIM, W - 1)
    before = states.clone()
    rows = torch.tensor([3, 0, 4], dtype=torch.int32)
    has_initial = torch.tensor([True, False, True])
    out = linear_attention.causal_conv1d_fn_cpu(
        x.t(), weight, None, "silu", states, has_initial, rows, cu, lens
    ).t()  # fmt: skip
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        history = before[rows[i]] if has_initial[i] else torch.zeros(DIM, W - 1)
        want, windows = reference_conv(x[s:e].t(), weight, history)
        torch.testing.assert_close(out[s:e], want.t())
        torch.testing.assert_close(states[rows[i]], windows[-1])

    # Verify: 2 sequences x 4 steps, each step's window kept, the state rolled past all 4.
    steps = 4
    xv = torch.randn(2, steps, DIM)
    scratch = torch.zeros(3, steps, DIM, W - 1)
    vrows = torch.tensor([1, 2], dtype=torch.int32)
    start = states.clone()
    outv = linear_attention.causal_conv1d_update_cpu(
        xv.transpose(1, 2), states, weight, None, "silu", vrows,
        intermediate_conv_window=scratch, intermediate_state_indices=torch.tensor([0, 1], dtype=torch.int32),
    )  # fmt: skip
    assert outv.transpose(1, 2).is_contiguous()
    for i in range(2):
        want, windows = reference_conv(xv[i].t(), weight, start[vrows[i]])
        torch.testing.assert_close(outv[i], want)
        torch.testing.assert_close(scratch[i], windows)
        torch.testing.assert_close(states[vrows[i]], windows[-1])


def test_commit_scatters_the_accepted_step():
    layers, slots, rows_, steps = 2, 6, 3, 4
    temporal = torch.zeros(layers, slots, HV, V, K)
    conv = torch.zeros(layers, slots, DIM, W - 1)
    inter = torch.randn(layers, rows_ + 1, steps, HV, V, K)
    inter_conv = torch.randn(layers, rows_ + 1, steps, DIM, W - 1)

    class Caches:
        pass

    caches = Caches()
    caches.temporal, caches.intermediate_ssm = temporal, inter
    caches.conv, caches.intermediate_conv_window = [conv], [inter_conv]
    dst = torch.tensor([4, -1, 1])
    last = torch.tensor([2, 0, 3])
    triton_ops.scatter_mamba_states_after_mtp_verify(caches, dst, last, None, None)
    assert torch.equal(temporal[:, 4], inter[:, 0, 2]) and torch.equal(temporal[:, 1], inter[:, 2, 3])
    assert torch.equal(conv[:, 4], inter_conv[:, 0, 2]) and torch.equal(conv[:, 1], inter_conv[:, 2, 3])
    assert temporal[:, [0, 2, 3, 5]].abs().sum() == 0


def test_verify_window_equals_decode_steps_with_a_bf16_conv_state():
    """SGLang keeps conv states in bf16 by default. A verify window must compute what the same
    inputs give decoded one at a time (each kept in bf16 once consumed), to float32 rounding;
    convolving the window's exact inputs instead would differ by bf16 rounding."""
    torch.manual_seed(2)
    weight, steps = torch.randn(DIM, W), 5
    x = torch.randn(2, DIM, steps)
    start = torch.randn(3, DIM, W - 1).to(torch.bfloat16)
    rows = torch.tensor([2, 0], dtype=torch.int32)

    stepped, decoded = start.clone(), []
    for t in range(steps):
        decoded.append(
            linear_attention.causal_conv1d_update_cpu(x[:, :, t], stepped, weight, None, "silu", rows)
        )
    decoded = torch.stack(decoded, dim=2)
    verify_states = start.clone()
    out = linear_attention.causal_conv1d_update_cpu(x, verify_states, weight, None, "silu", rows)
    torch.testing.assert_close(out, decoded, atol=1e-6, rtol=0)
    assert torch.equal(verify_states, stepped)
    exact_inputs = gated_delta.conv(torch.cat([start[rows.long()].float(), x], -1), weight, None, True)
    assert (exact_inputs - decoded).abs().max() > 1e-3


def test_verify_window_equals_decode_steps_with_a_bf16_recurrent_state(params):
    """With the pool's state in bf16, each decode step stores its state rounded; a verify window
    rounds after each step too, so its outputs and per-step states are the decode steps'."""
    bs, steps = 2, 4
    q, k, v, a, b = _inputs(bs * steps)
    start = (torch.randn(3, HV, V, K) * 0.3).to(torch.bfloat16)
    rows = torch.tensor([2, 0], dtype=torch.int32)
    pool, decoded, kept = start.clone(), [], []
    for t in range(steps):
        at = [i * steps + t for i in range(bs)]
        step = (q[:, at], k[:, at], v[:, at], a[at], b[at])
        decoded.append(_recurrence(params, step, pool, rows, torch.arange(bs + 1, dtype=torch.int32))[0])
        kept.append(pool[rows.long()].clone())
    scratch = torch.zeros(bs, steps, HV, V, K, dtype=torch.bfloat16)
    out = _recurrence(
        params,
        (q, k, v, a, b),
        start.clone(),
        rows,
        torch.arange(0, bs * steps + 1, steps, dtype=torch.int32),
        disable_state_update=True,
        intermediate_states_buffer=scratch,
        intermediate_state_indices=torch.arange(bs, dtype=torch.int32),
    )[0].view(bs, steps, HV, V)
    torch.testing.assert_close(out, torch.stack(decoded, 1), atol=1e-6, rtol=0)
    assert torch.equal(scratch, torch.stack(kept, 1))


def _defaulted_mutable_args(schema) -> list[str]:
    return [
        a.name
        for a in schema.arguments
        if a.alias_info is not None and a.alias_info.is_write and a.has_default_value()
    ]


def test_no_op_with_a_defaulted_mutated_argument_carries_custom_ops_mutation_wrapper():
    """torch 2.11's `custom_op` wraps a mutating op in an ADInplaceOrView kernel that indexes
    `args[i]` for every mutated argument: an omitted defaulted one raises IndexError (SGLang's
    decode omits `intermediate_states_buffer`). Such ops must be plain schema-defined kernels.
    Registering `fused_sigmoid_gating_delta_rule_update_cpu` with `custom_op` again fails this."""
    checked = []
    for name in dir(torch.ops.sgl_kernel):
        packet = getattr(torch.ops.sgl_kernel, name)
        if not name.endswith("_cpu") or not hasattr(packet, "default"):
            continue
        if _defaulted_mutable_args(packet.default._schema):
            wrapped = torch._C._dispatch_has_kernel_for_dispatch_key(f"sgl_kernel::{name}", "ADInplaceOrView")
            assert not wrapped, f"sgl_kernel::{name} is registered with custom_op"
            checked.append(name)
    assert "fused_sigmoid_gating_delta_rule_update_cpu" in checked
