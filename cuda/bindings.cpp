// The `sglang_dflash` operator library: schemas only. Each backend registers its kernel next to
// its code (CUDA: context_kv.cu; CPU: the pure-PyTorch reference, sglang_dflash/ops/_cuda.py).
// Python calls torch.ops.sglang_dflash.<op>, never this module's symbols.

#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(sglang_dflash, m) {
  // Feature fusion + KV injection for committed tokens (see ops/reference.py:fused_inject_reference
  // for the exact maths). Writes k_cache/v_cache[:, slots[t]] for every token t; slot 0 is the
  // sink for rows to drop.
  //   target_features [N, K*H] (rows may be strided), positions [N], slots [N] (int32|int64),
  //   fc_weight [H, K*H], kv_weight [L*2*KVH*D, H] (hidden_norm.weight folded in),
  //   kv_bias [L*2*KVH*D] or None, k_norm_weight [L, D], inv_freq [D/2] (float32),
  //   k_cache, v_cache [L, num_slots, KVH, D].
  m.def(
      "inject_context_kv(Tensor target_features, Tensor positions, Tensor slots, Tensor fc_weight, "
      "Tensor kv_weight, Tensor? kv_bias, Tensor k_norm_weight, Tensor inv_freq, float hidden_norm_eps, "
      "float k_norm_eps, float attention_scaling, Tensor(a!) k_cache, Tensor(b!) v_cache) -> ()");
}

// `import sglang_dflash._C` loads this library, which runs the registrations above.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "sglang_dflash operator library", -1, nullptr};
  return PyModule_Create(&module);
}
