// Problem description shared by every kernel (CPU and CUDA). Plain C++: no ATen, no CUDA headers,
// so device-only code and the NVRTC gate can include it.
//
// Layout: query [B, Hq, Lq, E], key/value [B, Hkv, Lkv, E] (Hq % Hkv == 0, GQA), out like query,
// addressed through (batch, head, row) strides, so [B, L, H, E] tensors need no copy; lse through
// LseLayout. Strides are in elements; the last dim is contiguous. Packed variable-length batches
// (VarlenParams) address row r of sequence b as row seq_start + r with a batch stride of 0.
#pragma once

#include "common/fixed_width_types.h"

// NVRTC compiles device code only (the gate makes it the default execution space).
#if defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#define FLASHV100_HOST_DEVICE __host__ __device__
#else
#define FLASHV100_HOST_DEVICE
#endif

namespace flashv100 {

enum class CausalMode : int32_t {
  kNone = 0,
  kTopLeft = 1,      // key j visible from query i iff j <= i (SDPA)
  kBottomRight = 2,  // key j visible from query i iff j <= i + Lkv - Lq (FlashAttention-2)
};

enum class MaskKind : int32_t { kNone = 0, kBool = 1, kAdditive = 2 };

// Element type of an additive mask (the mask may differ from q/k/v dtype).
enum class ScalarKind : int32_t { kHalf = 0, kBFloat16 = 1, kFloat = 2, kDouble = 3, kBool = 4 };

// A [B, Hq, Lq, Lkv]-broadcastable tensor, addressed with zero strides on broadcast dims.
struct MaskParams {
  const void* ptr = nullptr;
  MaskKind kind = MaskKind::kNone;
  ScalarKind dtype = ScalarKind::kBool;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
  // For masks broadcast over query rows (row_stride 0), the launcher's pre-pass
  // (kernels/mask_key_range.cuh) writes one code per (batch, query head), index b * Hq + h:
  // end >= 0 when the head keeps exactly keys [0, end) with bias 0 (the mask adds nothing but that
  // limit), -end - 1 when keys past `end` are all dropped but some before it are dropped or biased.
  // nullptr: no such facts (every key may be visible, every entry is read).
  const int32_t* key_range = nullptr;
};

// Dropout randomness: Philox4x32-7 keyed by seed, counter offset by `offset` (see philox.h).
// When the generator is captured in a CUDA graph, seed/offset live in device memory and are read
// by the kernel (offset_ptr != nullptr, offset = *offset_ptr + offset_intragraph).
struct DropoutParams {
  float p = 0.0f;  // drop probability; 0 disables dropout entirely
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_intragraph = 0;
  int64_t* rng_state_out = nullptr;  // the forward kernel writes [seed, offset] here (or not: null)
};

struct TensorStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
};

struct AttentionShape {
  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t len_q = 0;
  int64_t len_kv = 0;
  int64_t head_dim = 0;    // of query and key
  int64_t head_dim_v = 0;  // of value and out (SDPA allows it to differ from head_dim)
};

// Packed variable-length batches (FlashAttention-2's varlen functions): sequence b is rows
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q/out/lse and [cu_seqlens_k[b], cu_seqlens_k[b + 1])
// of k/v; tensors have batch stride 0, and AttentionShape's len_q / len_kv are upper bounds
// (max_seqlen_q / max_seqlen_k) that size grids and workspaces. Both nullptr: a dense batch.
// With a KV cache (KVCacheParams) only cu_seqlens_q may be set: packed queries over cached keys.
// The arrays live on the kernels' device (int32, B + 1 entries, non-decreasing, from 0).
struct VarlenParams {
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
};

// Element (b, h, r) of the fp32 (fp64 on CPU for fp64 inputs) log-sum-exp is
// lse[b * batch + h * head + seq_start_q + r]: [B, Hq, Lq] contiguous (batch = Hq * Lq,
// head = Lq) or, for varlen, [Hq, total_q] (batch = 0, head = total_q) as FlashAttention-2 v2.8.
struct LseLayout {
  int64_t batch = 0;
  int64_t head = 0;
};

// Which keys a query row sees, besides attn_mask. With shift = 0 under CausalMode::kTopLeft and
// shift = len_kv - len_q otherwise (FlashAttention-2's bottom-right alignment, per sequence for
// varlen), key j is visible from query i iff j < len_kv and
//   causal (kTopLeft or kBottomRight):  j <= i + shift,
//   window_right >= 0:                  j <= i + shift + window_right,
//   window_left >= 0:                   j >= i + shift - window_left.
// -1 leaves a side unbounded (FlashAttention-2's window_size = (left, right)).
struct WindowParams {
  int32_t left = -1;
  int32_t right = -1;
};

// Score modifiers of FlashAttention-2, applied in this order to s = scale * q.k:
//   softcap > 0:  s -> softcap * tanh(s / softcap)
//   alibi_slopes: s -> s - slope[b, h] * |i + shift - j| (shift as in WindowParams, bottom-right)
//   attn_mask:    s -> s + bias (MaskParams)
// alibi_slopes is fp32, [B, Hq] with alibi_batch_stride Hq, or [Hq] with stride 0. Neither is
// ever materialised as a bias tensor.
struct ScoreModParams {
  float softcap = 0.0f;
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
};

// The KV cache of flash_attn_with_kvcache (seqlens != nullptr; else a dense or packed batch).
// Sequence b's keys/values are rows [leftpad[b], seqlens[b] + seqlen_new) of its cache (the
// seqlen_new appended rows included), so SequenceSpan's k_start is leftpad[b] and its len_kv
// seqlens[b] + seqlen_new - leftpad[b]. Its cache is batch batch_idx[b] (or b) of k/v, or, paged
// (block_table != nullptr), row r lives in page block_table[b * block_table_stride + r / page_size]
// at row r % page_size, k/v being [num_pages, page_size, Hkv, D] with TensorStrides::batch the page
// stride. Int32 arrays of B entries (block_table: B rows) on the kernels' device; nullptr: none.
struct KVCacheParams {
  const int32_t* seqlens = nullptr;
  const int32_t* leftpad = nullptr;
  const int32_t* batch_idx = nullptr;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int64_t block_table_cols = 0;  // entries of a block_table row (max pages per sequence)
  int64_t page_size = 0;
  int64_t seqlen_new = 0;
};

// Split-KV ("flash-decoding", num_splits > 1): each (query tile, batch, head) block's key tiles are
// cut into num_splits equal shares (split_share); share s writes its normalized fp32 partial out to
// out_accum [num_splits, B, Hq, Lq, Dv] and its lse to lse_accum [num_splits, B, Hq, Lq]
// (contiguous; -inf and zeros for a share without keys), and a combine step weighs the shares by
// exp(lse_s - lse) into out and lse. The CPU kernels combine in registers (no accum buffers).
struct SplitKVParams {
  int32_t num_splits = 1;
  float* out_accum = nullptr;
  float* lse_accum = nullptr;
};

// New key/value rows that the forward kernel writes into the KV cache itself, before attending
// (run_kvcache_forward: where each (sequence, KV head) has one query tile of the decode tile and
// no rotary embedding is asked for): row i of k / v [B, seqlen_new, Hkv, D] at cache row
// seqlens[b] + i of k_cache / v_cache (ForwardParams k / v; kv_row_offset). Each block writes the
// rows of its own share of the keys (the first share also those before the band, the last those
// past it) and reads them back after a barrier: no other block reads them.
struct KVNewRows {
  const void* k = nullptr;  // nullptr: nothing to append in the kernel
  const void* v = nullptr;
  TensorStrides k_strides, v_strides;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
};

struct ForwardParams {
  AttentionShape shape;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // LseLayout; -inf for rows with no visible key
  LseLayout lse_layout;
  TensorStrides q_strides, k_strides, v_strides, out_strides;
  double scale = 1.0;  // double so fp64 inputs stay exact; kernels cast to their compute type
  CausalMode causal = CausalMode::kNone;
  WindowParams window;
  ScoreModParams score_mod;
  VarlenParams varlen;
  MaskParams mask;
  DropoutParams dropout;
  KVCacheParams kvcache;
  KVNewRows append;
  SplitKVParams split;
};

// Where sequence b of a batch starts (rows of q/out/lse, rows of k/v) and how long it is.
struct SequenceSpan {
  int64_t q_start = 0;
  int64_t k_start = 0;
  int64_t len_q = 0;
  int64_t len_kv = 0;
};

// The span of a dense or packed batch, KV caches aside (what the backward kernels, which never
// see a KV cache, use: they stay free of its branch).
FLASHV100_HOST_DEVICE inline SequenceSpan batch_span(const ForwardParams& p, int64_t b) {
  if (p.varlen.cu_seqlens_q == nullptr) return SequenceSpan{0, 0, p.shape.len_q, p.shape.len_kv};
  const int64_t q0 = p.varlen.cu_seqlens_q[b], k0 = p.varlen.cu_seqlens_k[b];
  return SequenceSpan{q0, k0, p.varlen.cu_seqlens_q[b + 1] - q0,
                      p.varlen.cu_seqlens_k[b + 1] - k0};
}

FLASHV100_HOST_DEVICE inline SequenceSpan sequence_span(const ForwardParams& p, int64_t b) {
  const KVCacheParams& c = p.kvcache;
  if (c.seqlens == nullptr) return batch_span(p, b);
  const int64_t first = c.leftpad != nullptr ? c.leftpad[b] : 0;
  SequenceSpan span{0, first, p.shape.len_q, c.seqlens[b] + c.seqlen_new - first};
  if (p.varlen.cu_seqlens_q != nullptr) {  // packed queries
    span.q_start = p.varlen.cu_seqlens_q[b];
    span.len_q = p.varlen.cu_seqlens_q[b + 1] - span.q_start;
  }
  return span;
}

// Offset in elements of key/value row `row` (of the sequence's whole cache row range: k_start
// included) of head `head` of sequence b, for tensors with strides `s` (KVCacheParams). Dense and
// packed batches: b * s.batch + head * s.head + row * s.row.
FLASHV100_HOST_DEVICE inline int64_t kv_row_offset(const KVCacheParams& c, const TensorStrides& s,
                                                   int64_t b, int64_t head, int64_t row) {
  if (c.block_table != nullptr) {
    const int64_t page = c.block_table[b * c.block_table_stride + row / c.page_size];
    return page * s.batch + head * s.head + (row % c.page_size) * s.row;
  }
  const int64_t batch = c.batch_idx != nullptr ? c.batch_idx[b] : b;
  return batch * s.batch + head * s.head + row * s.row;
}

// What flash_attn_with_kvcache does before attending: rotary embedding of q (into q_rotated) and
// of the new keys, and the new keys/values [B, seqlen_new, Hkv, D] written into the cache at rows
// seqlens[b] .. seqlens[b] + seqlen_new - 1 (addressed by kv_row_offset). Rotary (rotary_dim > 0,
// even, <= D): pairs (x[2i], x[2i + 1]) when interleaved, else (x[i], x[i + rotary_dim / 2]),
// rotated by cos/sin row `position` ([seqlen_ro, rotary_dim / 2] contiguous, q's dtype): new key i
// at position seqlens[b] + i, query row i at seqlens[b] + i when q_positions_advance (causal or
// windowed attention), else at seqlens[b]; the dims past rotary_dim are copied. FlashAttention-2
// positions are cache rows: a left padding shifts none of them.
struct KVAppendParams {
  KVCacheParams cache;
  int64_t batch = 0, heads_q = 0, heads_kv = 0, len_q = 0, head_dim = 0, head_dim_v = 0;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  TensorStrides k_cache_strides, v_cache_strides;
  const void* k_new = nullptr;  // nullptr: nothing to append (seqlen_new = 0)
  const void* v_new = nullptr;
  TensorStrides k_new_strides, v_new_strides;
  const void* q = nullptr;
  void* q_rotated = nullptr;  // nullptr: no rotary embedding
  TensorStrides q_strides, q_rotated_strides;
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t rotary_dim = 0;
  bool rotary_interleaved = true;
  bool q_positions_advance = false;
};

// Rotary embedding of element e < rotary_dim of a row (KVAppendParams): with c, s the cos/sin of
// column `freq` of the position's row, it becomes x[e] * c - x[partner] * s when `first`, else
// x[e] * c + x[partner] * s.
struct RotaryPair {
  int64_t partner, freq;
  bool first;
};
FLASHV100_HOST_DEVICE inline RotaryPair rotary_pair(int64_t e, int64_t rotary_dim,
                                                    bool interleaved) {
  if (interleaved) return RotaryPair{e ^ 1, e / 2, (e & 1) == 0};
  const int64_t half = rotary_dim / 2;
  return e < half ? RotaryPair{e + half, e, true} : RotaryPair{e - half, e - half, false};
}

// The key blocks [first, last) of `blocks` consecutive ones that share `split` of `num_splits`
// takes: equal shares of ceil(blocks / num_splits), the last ones possibly short or empty.
struct BlockShare {
  int64_t first, last;
};
FLASHV100_HOST_DEVICE inline BlockShare split_share(int64_t blocks, int64_t split,
                                                   int64_t num_splits) {
  const int64_t per = (blocks + num_splits - 1) / num_splits;
  const int64_t first = split * per < blocks ? split * per : blocks;
  const int64_t last = first + per < blocks ? first + per : blocks;
  return BlockShare{first, last};
}

// |lse| from which lse = max + log(sum) carries log(sum) no better than to 2^-7 (fp32 spacing),
// and not at all under finfo.min biases: the backward recounts such rows' normalizer from their
// scores (CPU: saturated_row_norms; CUDA: recount_saturated_row).
constexpr float kSaturatedLse = 65536.0f;

struct BackwardParams {
  ForwardParams fwd;  // inputs, out and lse as saved by the forward
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  TensorStrides dout_strides, dq_strides, dk_strides, dv_strides;
  // Gradient of an additive mask, [B, Hq, Lq, Lkv] contiguous in fp32 (reduced to the mask's
  // broadcast shape by the caller); nullptr when the mask does not require grad.
  float* dmask = nullptr;
  // General CUDA variant only (else nullptr): per query row [B, Hq, Lq], written by the D pre-pass,
  // what P = exp2((s - row_base) * log2(e) + row_log2_norm) is recomputed from: lse and 0, except
  // for rows whose lse cannot carry log(sum) (kernels/flash_bwd.cuh, recount_saturated_row).
  float* row_base = nullptr;
  float* row_log2_norm = nullptr;
  bool deterministic = false;
};

// Index of the key/value head that query head `head_q` attends with.
inline constexpr int64_t kv_head_of(int64_t head_q, int64_t heads_q, int64_t heads_kv) {
  return head_q / (heads_q / heads_kv);
}

}  // namespace flashv100
