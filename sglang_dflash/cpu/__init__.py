"""CPU support for SGLang's CPU engine on hosts without sgl-kernel's CPU build.

* `sgl_kernel_shim/`: pure-PyTorch stand-ins for the sgl_kernel ops SGLang's CPU paths call,
  served as the package `sgl_kernel`.
* `gated_delta`: the maths of Gated DeltaNet layers (gates, causal conv, the gated delta rule
  in chunked and step-by-step form); `linear_attention`: the stand-ins for the ops hybrid
  targets (Qwen3-Next, Qwen3.5) call, with SGLang's signatures.
* `triton_ops`: PyTorch versions of the SGLang Triton kernels the CPU path reaches with
  hybrid targets (the post-verify state commit, the shared-expert gate).
* `bootstrap`: puts the stand-ins behind `import sgl_kernel` when the real module cannot load,
  and patches the few SGLang modules whose CPU branch needs it, right after their import; it
  runs from `sglang_dflash_cpu.pth` at interpreter start, because SGLang imports sgl_kernel at
  module level in every process, before any plugin code runs.
* `verify_attention`: lets the `torch_native` attention backend run TARGET_VERIFY forwards, with
  one masked SDPA per layer for the batch's verify windows.
* `paged_attention`: that batched SDPA over SGLang's paged KV cache (sliding windows, sinks), and
  the attention sinks gpt-oss needs, given to `torch_native` in every CPU engine.

See docs/serving.md ("CPU").
"""
