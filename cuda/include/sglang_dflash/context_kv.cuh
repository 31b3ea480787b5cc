// Device code for the feature-fusion path: the epilogue that turns the two GEMM outputs into
// context K/V and stores them into the draft KV store. No tensor types here; the host launcher
// (cuda/context_kv.cu) validates its inputs and fills `ContextKVParams`.
//
// Per committed token t (one CTA row `blockIdx.x == t`):
//   y[t]      = target_features[t] @ fc_weight^T             (GEMM 1, cuBLAS, [N, H])
//   raw[t]    = y[t] @ kv_weight^T                           (GEMM 2, cuBLAS, [N, L*2*KVH*D])
//               kv_weight already carries hidden_norm's weight: kv_weight = W_kv * w_hidden.
//   r[t]      = rsqrt(mean(y[t]^2) + hidden_norm_eps)        (hidden_norm's row scale)
//   kv[t]     = r[t] * raw[t] + kv_bias                      (= k_proj/v_proj(hidden_norm(y)))
//   k         = RoPE(k_norm(kv.k)), v = kv.v                  (fp32, neox halves)
//   k_cache[l, slots[t]], v_cache[l, slots[t]] = k, v        (every layer l)
// All arithmetic after the GEMMs is fp32; the only roundings are the GEMM outputs and the store.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>

namespace sglang_dflash {

constexpr int kWarpSize = 32;
constexpr int kContextKVThreads = 256;

template <typename T>
struct ContextKVParams {
  const T* fused;          // [N, hidden_size], row stride fused_stride (GEMM 1 output y)
  const T* kv_raw;         // [N, num_layers * 2 * num_kv_heads * head_dim], row stride kv_raw_stride
  const T* kv_bias;        // [num_layers * 2 * num_kv_heads * head_dim] or nullptr
  const T* k_norm_weight;  // [num_layers, head_dim]
  const float* inv_freq;   // [head_dim / 2]
  const void* positions;   // [N] int32 or int64, element stride positions_stride
  const void* slots;       // [N] int32 or int64, element stride slots_stride
  T* k_cache;              // [num_layers, num_slots, num_kv_heads, head_dim], contiguous
  T* v_cache;              // same as k_cache
  int64_t fused_stride;
  int64_t kv_raw_stride;
  int64_t positions_stride;
  int64_t slots_stride;
  int64_t num_slots;
  int hidden_size;
  int num_layers;
  int num_kv_heads;
  int head_dim;
  int items_per_block;  // (layer, K|V, head) items handled by one CTA along gridDim.y
  bool positions_int64;
  bool slots_int64;
  float hidden_norm_eps;
  float k_norm_eps;
  float attention_scaling;
};

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// kVec consecutive elements, moved with one load/store of kVec * sizeof(T) bytes.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Packed {
  T v[kVec];
};

template <typename T, int kVec>
__device__ __forceinline__ void load_floats(const T* src, float (&out)[kVec]) {
  const Packed<T, kVec> packed = *reinterpret_cast<const Packed<T, kVec>*>(src);
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = to_float(packed.v[j]);
}

template <typename T, int kVec>
__device__ __forceinline__ void store_floats(T* dst, const float (&in)[kVec]) {
  Packed<T, kVec> packed;
#pragma unroll
  for (int j = 0; j < kVec; ++j) packed.v[j] = from_float<T>(in[j]);
  *reinterpret_cast<Packed<T, kVec>*>(dst) = packed;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sum over the CTA; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  x = warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < static_cast<int>(blockDim.x / kWarpSize) ? scratch[lane] : 0.0f;
    x = warp_sum(x);
    if (lane == 0) scratch[0] = x;
  }
  __syncthreads();
  return scratch[0];
}

__device__ __forceinline__ int64_t load_index(const void* base, int64_t i, bool is_int64) {
  return is_int64 ? static_cast<const int64_t*>(base)[i] : static_cast<const int32_t*>(base)[i];
}

// One warp: K head -> r * raw + bias -> k_norm (RMS over head_dim) -> neox RoPE -> store.
// Lane owns chunks of kVec elements in the first half and the matching ones in the second.
template <typename T, int kVec>
__device__ __forceinline__ void k_head(const ContextKVParams<T>& p, const T* src, const T* bias,
                                       const T* norm_w, T* dst, float r, const float* cos_s,
                                       const float* sin_s) {
  const int lane = threadIdx.x % kWarpSize;
  const int half = p.head_dim / 2;
  float sumsq = 0.0f;
  for (int i = lane * kVec; i < half; i += kWarpSize * kVec) {
    float a[kVec], b[kVec];
    load_floats<T, kVec>(src + i, a);
    load_floats<T, kVec>(src + half + i, b);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x1 = r * a[j] + (bias ? to_float(bias[i + j]) : 0.0f);
      const float x2 = r * b[j] + (bias ? to_float(bias[half + i + j]) : 0.0f);
      sumsq += x1 * x1 + x2 * x2;
    }
  }
  const float rk = rsqrtf(warp_sum(sumsq) / static_cast<float>(p.head_dim) + p.k_norm_eps);
  // Second pass re-reads the head (just loaded by this warp: L1 hits) to keep registers flat.
  for (int i = lane * kVec; i < half; i += kWarpSize * kVec) {
    float a[kVec], b[kVec], o1[kVec], o2[kVec];
    load_floats<T, kVec>(src + i, a);
    load_floats<T, kVec>(src + half + i, b);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x1 = (r * a[j] + (bias ? to_float(bias[i + j]) : 0.0f)) * rk * to_float(norm_w[i + j]);
      const float x2 =
          (r * b[j] + (bias ? to_float(bias[half + i + j]) : 0.0f)) * rk * to_float(norm_w[half + i + j]);
      const float c = cos_s[i + j], s = sin_s[i + j];
      o1[j] = x1 * c - x2 * s;
      o2[j] = x2 * c + x1 * s;
    }
    store_floats<T, kVec>(dst + i, o1);
    store_floats<T, kVec>(dst + half + i, o2);
  }
}

// One warp: V head -> r * raw + bias -> store.
template <typename T, int kVec>
__device__ __forceinline__ void v_head(const ContextKVParams<T>& p, const T* src, const T* bias, T* dst,
                                       float r) {
  const int lane = threadIdx.x % kWarpSize;
  for (int i = lane * kVec; i < p.head_dim; i += kWarpSize * kVec) {
    float a[kVec];
    load_floats<T, kVec>(src + i, a);
#pragma unroll
    for (int j = 0; j < kVec; ++j) a[j] = r * a[j] + (bias ? to_float(bias[i + j]) : 0.0f);
    store_floats<T, kVec>(dst + i, a);
  }
}

// Grid: (N tokens, ceil(items / items_per_block)); block: kContextKVThreads.
// Dynamic shared memory: (head_dim + kWarpSize) floats.
template <typename T, int kVec>
__global__ void __launch_bounds__(kContextKVThreads)
    context_kv_epilogue_kernel(const ContextKVParams<T> p) {
  extern __shared__ float smem[];
  const int half = p.head_dim / 2;
  float* cos_s = smem;
  float* sin_s = smem + half;
  float* scratch = smem + p.head_dim;
  const int64_t token = blockIdx.x;

  // hidden_norm's row scale, from GEMM 1's output.
  const T* y = p.fused + token * p.fused_stride;
  float sumsq = 0.0f;
  for (int i = threadIdx.x; i < p.hidden_size; i += blockDim.x) {
    const float v = to_float(y[i]);
    sumsq += v * v;
  }
  const float r = rsqrtf(block_sum(sumsq, scratch) / static_cast<float>(p.hidden_size) + p.hidden_norm_eps);

  // RoPE table for this token's position, as RotaryEmbedding.cos_sin computes it (fp32).
  const float pos = static_cast<float>(load_index(p.positions, token * p.positions_stride, p.positions_int64));
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * p.inv_freq[i], &s, &c);
    cos_s[i] = c * p.attention_scaling;
    sin_s[i] = s * p.attention_scaling;
  }
  __syncthreads();

  const int64_t slot = load_index(p.slots, token * p.slots_stride, p.slots_int64);
  if (slot < 0 || slot >= p.num_slots) {
    if (threadIdx.x == 0 && blockIdx.y == 0) {
      printf("sglang_dflash.inject_context_kv: slot %lld of token %lld is outside [0, %lld)\n",
             static_cast<long long>(slot), static_cast<long long>(token), static_cast<long long>(p.num_slots));
    }
    __trap();
  }

  const int kv_size = p.num_kv_heads * p.head_dim;
  const int num_items = p.num_layers * 2 * p.num_kv_heads;
  const int begin = blockIdx.y * p.items_per_block;
  const int end = min(num_items, begin + p.items_per_block);
  const int warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const T* raw_row = p.kv_raw + token * p.kv_raw_stride;
  // item -> (layer, kind 0=K 1=V, head), in the column order of the stacked projection.
  for (int item = begin + warp; item < end; item += num_warps) {
    const int layer = item / (2 * p.num_kv_heads);
    const int kind = (item / p.num_kv_heads) % 2;
    const int head = item % p.num_kv_heads;
    const int64_t col = static_cast<int64_t>(item) * p.head_dim;
    const T* bias = p.kv_bias ? p.kv_bias + col : nullptr;
    const int64_t dst_off = (layer * p.num_slots + slot) * kv_size + static_cast<int64_t>(head) * p.head_dim;
    if (kind == 0) {
      k_head<T, kVec>(p, raw_row + col, bias, p.k_norm_weight + static_cast<int64_t>(layer) * p.head_dim,
                      p.k_cache + dst_off, r, cos_s, sin_s);
    } else {
      v_head<T, kVec>(p, raw_row + col, bias, p.v_cache + dst_off, r);
    }
  }
}

}  // namespace sglang_dflash
