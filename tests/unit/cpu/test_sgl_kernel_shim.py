"""The sgl_kernel stand-ins SGLang's CPU engine calls, against loops over their definitions."""

import subprocess
import sys

import torch


def test_sgl_kernel_is_served_by_the_stand_ins_on_cpu():
    code = "import sgl_kernel; print(sgl_kernel.__file__); sgl_kernel.decode_attention_cpu()"
    env = {"SGLANG_USE_CPU_ENGINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "sglang_dflash/cpu/sgl_kernel_shim/__init__.py" in result.stdout
    assert "NotImplementedError: sgl_kernel.decode_attention_cpu is not available" in result.stderr


def test_assign_req_to_token_pool_cpu_matches_a_loop():
    from sglang_dflash.cpu.sgl_kernel_shim import assign_req_to_token_pool_cpu

    rows, start, end = torch.tensor([2, 0, 5]), torch.tensor([0, 3, 7]), torch.tensor([2, 3, 11])
    loc = torch.arange(100, 106)
    table = torch.zeros(6, 16, dtype=torch.int32)
    assign_req_to_token_pool_cpu(rows, table, start, end, loc, 16)
    want, offset = torch.zeros_like(table), 0
    for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist()):
        want[r, s:e] = loc[offset : offset + e - s]
        offset += e - s
    assert torch.equal(table, want)


def test_copy_all_layer_kv_cache_cpu_moves_rows_of_every_buffer():
    from sglang_dflash.cpu.sgl_kernel_shim import copy_all_layer_kv_cache_cpu

    buffers = [torch.randn(10, 3, 4), torch.randn(10, 3, 4, dtype=torch.float64)]
    before = [b.clone() for b in buffers]
    ptrs = torch.tensor([b.data_ptr() for b in buffers])
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers])
    copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([7, 1]), torch.tensor([2, 9]))
    for b, old in zip(buffers, before):
        old[[7, 1]] = old[[2, 9]]
        assert torch.equal(b, old)


def test_stand_ins_serve_when_the_script_sets_the_cpu_engine_itself():
    """SGLang reads SGLANG_USE_CPU_ENGINE when it needs it; so do the stand-ins, so a script may
    set it before importing sglang rather than in its environment."""
    code = (
        "import os; os.environ['SGLANG_USE_CPU_ENGINE'] = '1'\nimport sgl_kernel; print(sgl_kernel.__file__)"
    )
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "sglang_dflash/cpu/sgl_kernel_shim/__init__.py" in result.stdout, result.stderr[-2000:]
