// Host launcher of `sglang_dflash::inject_context_kv` on CUDA: 1. validate, 2. extract, 3. launch.
// Two cuBLAS GEMMs (at::mm) and one epilogue kernel, all on the current stream; the schema is in
// bindings.cpp and the maths in include/sglang_dflash/context_kv.cuh.

#include <ATen/core/Tensor.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "sglang_dflash/context_kv.cuh"

namespace sglang_dflash {
namespace {

constexpr const char* kOp = "sglang_dflash.inject_context_kv: ";

void check_cuda(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), kOp, name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == device, kOp, name, " is on ", t.device(), " but k_cache is on ", device);
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, kOp, name, " must have dtype ", dtype, " (the k_cache dtype), got ",
              t.scalar_type());
}

void check_index(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, kOp, name,
              " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, kOp, name, " must have shape [", n,
              "] (one per row of target_features), got ", t.sizes());
}

void check_contiguous_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, kOp, name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), kOp, name, " must be contiguous, got strides ", t.strides());
}

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

int num_sms(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cached[device] = count;
  return count;
}

template <typename T, int kVec>
void launch(const ContextKVParams<T>& params, int64_t num_tokens, int num_items, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_tokens),
                  static_cast<unsigned>((num_items + params.items_per_block - 1) / params.items_per_block));
  const size_t smem = (params.head_dim + kWarpSize) * sizeof(float);
  context_kv_epilogue_kernel<T, kVec><<<grid, kContextKVThreads, smem, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void run(const at::Tensor& fused, const at::Tensor& kv_raw, const std::optional<at::Tensor>& kv_bias,
         const at::Tensor& k_norm_weight, const at::Tensor& inv_freq, const at::Tensor& positions,
         const at::Tensor& slots, double hidden_norm_eps, double k_norm_eps, double attention_scaling,
         const at::Tensor& k_cache, const at::Tensor& v_cache) {
  // 2. Extract.
  ContextKVParams<T> p;
  p.fused = static_cast<const T*>(fused.data_ptr());
  p.kv_raw = static_cast<const T*>(kv_raw.data_ptr());
  p.kv_bias = kv_bias ? static_cast<const T*>(kv_bias->data_ptr()) : nullptr;
  p.k_norm_weight = static_cast<const T*>(k_norm_weight.data_ptr());
  p.inv_freq = inv_freq.data_ptr<float>();
  p.positions = positions.data_ptr();
  p.slots = slots.data_ptr();
  p.k_cache = static_cast<T*>(k_cache.data_ptr());
  p.v_cache = static_cast<T*>(v_cache.data_ptr());
  p.fused_stride = fused.stride(0);
  p.kv_raw_stride = kv_raw.stride(0);
  p.positions_stride = positions.stride(0);
  p.slots_stride = slots.stride(0);
  p.num_slots = k_cache.size(1);
  p.hidden_size = static_cast<int>(fused.size(1));
  p.num_layers = static_cast<int>(k_cache.size(0));
  p.num_kv_heads = static_cast<int>(k_cache.size(2));
  p.head_dim = static_cast<int>(k_cache.size(3));
  p.positions_int64 = positions.scalar_type() == at::kLong;
  p.slots_int64 = slots.scalar_type() == at::kLong;
  p.hidden_norm_eps = static_cast<float>(hidden_norm_eps);
  p.k_norm_eps = static_cast<float>(k_norm_eps);
  p.attention_scaling = static_cast<float>(attention_scaling);

  // Few tokens: split a token's (layer, K|V, head) items over several CTAs so the GPU fills up.
  const int64_t num_tokens = fused.size(0);
  const int num_items = p.num_layers * 2 * p.num_kv_heads;
  const int num_warps = kContextKVThreads / kWarpSize;
  const int64_t want_ctas = 2LL * num_sms(k_cache.get_device());
  const int64_t splits = std::clamp<int64_t>((want_ctas + num_tokens - 1) / num_tokens, 1,
                                             (num_items + num_warps - 1) / num_warps);
  p.items_per_block = static_cast<int>((num_items + splits - 1) / splits);

  // Widest vector with which a warp's 32 lanes all cover a half head (head_dim 128 -> 2,
  // 256 -> 4) and that keeps every row and base pointer aligned; else scalar.
  const int half = p.head_dim / 2;
  auto fits = [&](int vec) {
    const size_t bytes = vec * sizeof(T);
    return half % (kWarpSize * vec) == 0 && p.kv_raw_stride % vec == 0 && aligned(p.kv_raw, bytes) &&
           aligned(p.k_cache, bytes) && aligned(p.v_cache, bytes);
  };
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(k_cache.get_device()).stream();
  // 3. Launch.
  if (fits(4)) {
    launch<T, 4>(p, num_tokens, num_items, stream);
  } else if (fits(2)) {
    launch<T, 2>(p, num_tokens, num_items, stream);
  } else {
    launch<T, 1>(p, num_tokens, num_items, stream);
  }
}

void inject_context_kv_cuda(const at::Tensor& target_features, const at::Tensor& positions,
                            const at::Tensor& slots, const at::Tensor& fc_weight, const at::Tensor& kv_weight,
                            const std::optional<at::Tensor>& kv_bias, const at::Tensor& k_norm_weight,
                            const at::Tensor& inv_freq, double hidden_norm_eps, double k_norm_eps,
                            double attention_scaling, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  // 1. Validate everything before touching a pointer.
  TORCH_CHECK(k_cache.dim() == 4, kOp, "k_cache must be [num_layers, num_slots, num_kv_heads, head_dim], got ",
              k_cache.sizes());
  const at::Device device = k_cache.device();
  const at::ScalarType dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat, kOp,
              "k_cache must be bfloat16, float16 or float32, got ", dtype);
  const int64_t num_layers = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(num_layers >= 1 && num_slots >= 1 && num_kv_heads >= 1, kOp, "k_cache has an empty dimension: ",
              k_cache.sizes());
  TORCH_CHECK(head_dim >= 2 && head_dim % 2 == 0 && head_dim <= 1024, kOp,
              "head_dim must be even and in [2, 1024], got ", head_dim);
  check_cuda(k_cache, "k_cache", device);
  TORCH_CHECK(k_cache.is_contiguous(), kOp, "k_cache must be contiguous, got strides ", k_cache.strides());
  check_cuda(v_cache, "v_cache", device);
  check_dtype(v_cache, "v_cache", dtype);
  check_contiguous_shape(v_cache, "v_cache", k_cache.sizes());
  TORCH_CHECK(!v_cache.is_same(k_cache), kOp, "k_cache and v_cache must be different tensors");

  TORCH_CHECK(target_features.dim() == 2, kOp, "target_features must be [N, K*H], got ", target_features.sizes());
  check_cuda(target_features, "target_features", device);
  check_dtype(target_features, "target_features", dtype);
  TORCH_CHECK(target_features.stride(1) == 1 || target_features.size(1) == 1, kOp,
              "target_features rows must be contiguous (stride 1 along K*H), got strides ",
              target_features.strides());
  const int64_t num_tokens = target_features.size(0), in_features = target_features.size(1);

  check_cuda(fc_weight, "fc_weight", device);
  check_dtype(fc_weight, "fc_weight", dtype);
  TORCH_CHECK(fc_weight.dim() == 2 && fc_weight.size(1) == in_features, kOp,
              "fc_weight must be [H, K*H] with K*H = ", in_features, ", got ", fc_weight.sizes());
  TORCH_CHECK(fc_weight.is_contiguous(), kOp, "fc_weight must be contiguous");
  const int64_t hidden_size = fc_weight.size(0);
  TORCH_CHECK(hidden_size >= 1, kOp, "fc_weight has no rows");

  const int64_t kv_cols = num_layers * 2 * num_kv_heads * head_dim;
  check_cuda(kv_weight, "kv_weight", device);
  check_dtype(kv_weight, "kv_weight", dtype);
  check_contiguous_shape(kv_weight, "kv_weight", {kv_cols, hidden_size});
  if (kv_bias) {
    check_cuda(*kv_bias, "kv_bias", device);
    check_dtype(*kv_bias, "kv_bias", dtype);
    check_contiguous_shape(*kv_bias, "kv_bias", {kv_cols});
  }
  check_cuda(k_norm_weight, "k_norm_weight", device);
  check_dtype(k_norm_weight, "k_norm_weight", dtype);
  check_contiguous_shape(k_norm_weight, "k_norm_weight", {num_layers, head_dim});
  check_cuda(inv_freq, "inv_freq", device);
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat, kOp, "inv_freq must be float32, got ", inv_freq.scalar_type());
  check_contiguous_shape(inv_freq, "inv_freq", {head_dim / 2});

  check_cuda(positions, "positions", device);
  check_index(positions, "positions", num_tokens);
  check_cuda(slots, "slots", device);
  check_index(slots, "slots", num_tokens);
  TORCH_CHECK(hidden_norm_eps > 0 && k_norm_eps > 0, kOp, "norm epsilons must be positive, got ",
              hidden_norm_eps, " and ", k_norm_eps);
  TORCH_CHECK(num_tokens < (1LL << 31), kOp, "too many tokens: ", num_tokens);
  if (num_tokens == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  // The two GEMMs (cuBLAS, current stream). at::mm reads strided rows and the transposed
  // weights in place; its outputs are the op's only temporaries.
  const at::Tensor fused = at::mm(target_features, fc_weight.t());  // [N, H]
  const at::Tensor kv_raw = at::mm(fused, kv_weight.t());           // [N, L*2*KVH*D]

  switch (dtype) {
    case at::kBFloat16:
      run<__nv_bfloat16>(fused, kv_raw, kv_bias, k_norm_weight, inv_freq, positions, slots, hidden_norm_eps,
                         k_norm_eps, attention_scaling, k_cache, v_cache);
      break;
    case at::kHalf:
      run<__half>(fused, kv_raw, kv_bias, k_norm_weight, inv_freq, positions, slots, hidden_norm_eps, k_norm_eps,
                  attention_scaling, k_cache, v_cache);
      break;
    default:
      run<float>(fused, kv_raw, kv_bias, k_norm_weight, inv_freq, positions, slots, hidden_norm_eps, k_norm_eps,
                 attention_scaling, k_cache, v_cache);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(sglang_dflash, CUDA, m) { m.impl("inject_context_kv", &inject_context_kv_cuda); }

}  // namespace sglang_dflash
