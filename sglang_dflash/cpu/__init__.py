"""CPU support for SGLang's CPU engine on hosts without sgl-kernel's CPU build.

* `sgl_kernel_shim`: pure-PyTorch stand-ins for the sgl_kernel ops SGLang's CPU paths call.
* `bootstrap`: puts the stand-ins behind `import sgl_kernel` when the real module cannot load;
  it runs from `sglang_dflash_cpu.pth` at interpreter start, because SGLang imports sgl_kernel
  at module level in every process, before any plugin code runs.
* `verify_attention`: lets the `torch_native` attention backend run TARGET_VERIFY forwards.
"""
