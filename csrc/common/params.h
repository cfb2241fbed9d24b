// Problem description shared by every kernel (CPU and CUDA). Plain C++: no ATen, no CUDA headers,
// so device-only code and the NVRTC gate can include it.
//
// Layout: query [B, Hq, Lq, E], key/value [B, Hkv, Lkv, E] (Hq % Hkv == 0, GQA), out like query,
// lse [B, Hq, Lq] contiguous fp32. Strides are in elements; the last dim is contiguous.
#pragma once

#include "common/fixed_width_types.h"

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
  int64_t* rng_state_out = nullptr;  // kernel writes {seed, offset} here for the backward
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

struct ForwardParams {
  AttentionShape shape;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // [B, Hq, Lq] contiguous; -inf for rows with no visible key
  TensorStrides q_strides, k_strides, v_strides, out_strides;
  double scale = 1.0;  // double so fp64 inputs stay exact; kernels cast to their compute type
  CausalMode causal = CausalMode::kNone;
  MaskParams mask;
  DropoutParams dropout;
};

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
