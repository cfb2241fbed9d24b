// The KV-cache kernels around the forward kernel (flash_attn_with_kvcache): the append step
// before it (rotary embedding of q and of the new keys, new rows written into the cache,
// KVAppendParams) and the split-KV combine after it (SplitKVParams). Both are memory-bound and
// small next to the attention: one thread per element, one warp per query row. Where the forward
// kernel appends the new rows itself (KVNewRows), append_new_rows is its step.
#pragma once

#include "cuda/kernels/attention_common.cuh"

namespace flashv100 {
namespace kern {

constexpr int kAppendThreads = 256;
constexpr int kCombineWarps = 4;
constexpr int kMaxSplits = 128;

// Programmatic dependent launch (sm_90+; no-ops below): the split forward lets the combine launch
// before it finishes (its blocks then wait on the GPU instead of behind a kernel boundary), and
// the combine waits for the forward's partials to be complete and visible before reading them.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Element e of a row at `src`, rotated at cos/sin row `position` if e < rotary_dim.
template <class Elem>
__device__ __forceinline__ float rotated_element(const KVAppendParams& a, const uint16_t* src,
                                                 int64_t e, int64_t position) {
  const float x = Elem::to_float(src[e]);
  if (e >= a.rotary_dim) return x;
  const RotaryPair pair = rotary_pair(e, a.rotary_dim, a.rotary_interleaved);
  const int64_t at = position * (a.rotary_dim / 2) + pair.freq;
  const float c = Elem::to_float(static_cast<const uint16_t*>(a.rotary_cos)[at]);
  const float s = Elem::to_float(static_cast<const uint16_t*>(a.rotary_sin)[at]);
  const float y = Elem::to_float(src[pair.partner]);
  return pair.first ? x * c - y * s : x * c + y * s;
}

// Thread i handles element i of [rotated q | new keys | new values] (each [B, rows, heads, D],
// the head dim fastest); the cache rows of the new keys/values come from kv_row_offset.
template <class Elem>
__global__ void __launch_bounds__(kAppendThreads) kvcache_append_kernel(const KVAppendParams a) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kAppendThreads + threadIdx.x;
  const KVCacheParams& c = a.cache;
  const int64_t q_count = a.q_rotated != nullptr ? a.batch * a.len_q * a.heads_q * a.head_dim : 0;
  const int64_t kv_count = a.k_new != nullptr ? a.batch * c.seqlen_new * a.heads_kv * a.head_dim : 0;
  if (index < q_count) {
    const int64_t e = index % a.head_dim, t = index / a.head_dim;
    const int64_t h = t % a.heads_q, i = (t / a.heads_q) % a.len_q, b = t / a.heads_q / a.len_q;
    const int64_t position = c.seqlens[b] + (a.q_positions_advance ? i : 0);
    const uint16_t* src = head_ptr(a.q, a.q_strides, b, h, i);
    head_ptr(a.q_rotated, a.q_rotated_strides, b, h, i)[e] =
        Elem::from_float(rotated_element<Elem>(a, src, e, position));
    return;
  }
  const int64_t kv_index = index - q_count;
  if (kv_index >= 2 * kv_count) return;
  const bool is_key = kv_index < kv_count;
  const int64_t local = is_key ? kv_index : kv_index - kv_count;
  const int64_t e = local % a.head_dim, t = local / a.head_dim;
  const int64_t h = t % a.heads_kv, i = (t / a.heads_kv) % c.seqlen_new;
  const int64_t b = t / a.heads_kv / c.seqlen_new;
  const int64_t row = c.seqlens[b] + i;
  if (is_key) {
    const uint16_t* src = head_ptr(a.k_new, a.k_new_strides, b, h, i);
    const float x = a.q_rotated != nullptr ? rotated_element<Elem>(a, src, e, row)
                                           : Elem::to_float(src[e]);
    static_cast<uint16_t*>(a.k_cache)[kv_row_offset(c, a.k_cache_strides, b, h, row) + e] =
        Elem::from_float(x);
  } else {
    static_cast<uint16_t*>(a.v_cache)[kv_row_offset(c, a.v_cache_strides, b, h, row) + e] =
        head_ptr(a.v_new, a.v_new_strides, b, h, i)[e];
  }
}

// The forward kernel's append (KVNewRows): the new rows of KV head hk of sequence b whose keys
// lie in [key_lo, key_hi) (sequence coordinates: key j is cache row seq.k_start + j), copied into
// the cache row by row by kThreads threads.
template <int kThreads>
__device__ __forceinline__ void append_new_rows(const ForwardParams& p, const SequenceSpan& seq,
                                                int64_t b, int64_t hk, int key_lo, int key_hi,
                                                int tid) {
  const KVNewRows& a = p.append;
  const KVCacheParams& c = p.kvcache;
  const int first_new = static_cast<int>(seq.len_kv - c.seqlen_new);
  const int hi = min(key_hi, static_cast<int>(seq.len_kv));
#pragma unroll 1
  for (int j = max(key_lo, first_new); j < hi; ++j) {
    const int64_t row = seq.k_start + j;
    uint16_t* const k_dst =
        static_cast<uint16_t*>(a.k_cache) + kv_row_offset(c, p.k_strides, b, hk, row);
    uint16_t* const v_dst =
        static_cast<uint16_t*>(a.v_cache) + kv_row_offset(c, p.v_strides, b, hk, row);
    const uint16_t* const k_src = head_ptr(a.k, a.k_strides, b, hk, j - first_new);
    const uint16_t* const v_src = head_ptr(a.v, a.v_strides, b, hk, j - first_new);
#pragma unroll 1
    for (int e = tid; e < p.shape.head_dim; e += kThreads) k_dst[e] = k_src[e];
#pragma unroll 1
    for (int e = tid; e < p.shape.head_dim_v; e += kThreads) v_dst[e] = v_src[e];
  }
}

// One warp per query row (b, h, r) of the split problem: lse = log sum_s exp(lse_s), out =
// sum_s exp(lse_s - lse) * out_s over the splits in order (deterministic; shares without keys
// have lse_s = -inf and weigh nothing). Rows no split saw: out 0, lse -inf.
template <class Elem>
__global__ void __launch_bounds__(kCombineWarps * 32) split_kv_combine_kernel(const ForwardParams p) {
  static __shared__ float weights[kCombineWarps][kMaxSplits];
  wait_for_primary_grid();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const AttentionShape& shape = p.shape;
  const int64_t rows = shape.batch * shape.heads_q * shape.len_q;
  const int64_t row_id = static_cast<int64_t>(blockIdx.x) * kCombineWarps + warp;
  if (row_id >= rows) return;
  const int splits = p.split.num_splits;
  const float* lse_parts = p.split.lse_accum + row_id;
  float top = neg_inf();
  for (int s = lane; s < splits; s += 32) top = fmaxf(top, lse_parts[s * rows]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
  float total = 0.0f;
  for (int s = lane; s < splits; s += 32) {
    const float l = lse_parts[s * rows];
    const float w = top == neg_inf() ? 0.0f : expf(l - top);
    weights[warp][s] = w;
    total += w;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    total += __shfl_xor_sync(0xffffffffu, total, offset);
  __syncwarp();
  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  const int64_t r = row_id % shape.len_q, h = (row_id / shape.len_q) % shape.heads_q;
  const int64_t b = row_id / shape.len_q / shape.heads_q;
  if (lane == 0) {
    p.lse[b * p.lse_layout.batch + h * p.lse_layout.head + r] =
        total > 0.0f ? top + logf(total) : neg_inf();
  }
  // Lane l sums elements [8 l, 8 l + 8) of the row (head dims are multiples of 8) split by split,
  // in order. The partials were just written (L2): the loads of kBatch splits go out together
  // before their sums, not one L2 round trip a split. Every split wrote its rows (zeros for an
  // empty share), so weight 0 adds exact zeros.
  constexpr int kLaneElems = 8, kBatch = 8;
  static_assert(kLaneElems * 32 >= kMaxHeadDim, "a row's elements over one warp");
  const int dim = static_cast<int>(shape.head_dim_v);
  const int e0 = lane * kLaneElems;
  if (e0 >= dim) return;
  const float* part = p.split.out_accum + row_id * dim + e0;
  const int64_t split_stride = rows * dim;
  float acc[kLaneElems] = {};
  const auto accumulate = [&](float w, const float4 (&x)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      acc[4 * i] += w * x[i].x, acc[4 * i + 1] += w * x[i].y;
      acc[4 * i + 2] += w * x[i].z, acc[4 * i + 3] += w * x[i].w;
    }
  };
  const auto load = [&](int s, float4 (&x)[2]) {
    const float4* src = reinterpret_cast<const float4*>(part + s * split_stride);
    x[0] = src[0], x[1] = src[1];
  };
  int s = 0;
  for (; s + kBatch <= splits; s += kBatch) {
    float4 x[kBatch][2];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) load(s + u, x[u]);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) accumulate(weights[warp][s + u], x[u]);
  }
  for (; s < splits; ++s) {
    float4 x[2];
    load(s, x);
    accumulate(weights[warp][s], x);
  }
  uint16_t* out = head_ptr(p.out, p.out_strides, b, h, r) + e0;
#pragma unroll
  for (int i = 0; i < kLaneElems; ++i) out[i] = Elem::from_float(acc[i] * inv_total);
}

}  // namespace kern
}  // namespace flashv100
