// Blocked FlashAttention-2 on the CPU: the semantic reference kernel of the library. Extra memory
// is O(block^2) per thread; the L x S score matrix is never materialised. Scalars are read in
// their own type and computed in `Acc` (double for fp64 inputs, float otherwise).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/params.h"
#include "common/philox.h"

namespace flashv100::cpu {

constexpr int64_t kBlockQ = 32;
constexpr int64_t kBlockKV = 64;

template <typename Acc>
Acc read_scalar(const void* base, int64_t index, ScalarKind kind) {
  switch (kind) {
    case ScalarKind::kHalf: return static_cast<Acc>(static_cast<const c10::Half*>(base)[index]);
    case ScalarKind::kBFloat16:
      return static_cast<Acc>(static_cast<const c10::BFloat16*>(base)[index]);
    case ScalarKind::kFloat: return static_cast<Acc>(static_cast<const float*>(base)[index]);
    case ScalarKind::kDouble: return static_cast<Acc>(static_cast<const double*>(base)[index]);
    case ScalarKind::kBool: return static_cast<const bool*>(base)[index] ? Acc(1) : Acc(0);
  }
  return Acc(0);
}

// The keys [begin, end) of its sequence that query row `row` sees (params.h, WindowParams);
// attn_mask aside. begin and end never decrease from one row to the next.
struct KeyRange {
  int64_t begin, end;
};

// i + shift is the key on query row i's diagonal (bottom-right alignment but for kTopLeft).
inline int64_t diagonal_shift(const ForwardParams& p, const SequenceSpan& s) {
  return p.causal == CausalMode::kTopLeft ? 0 : s.len_kv - s.len_q;
}

inline KeyRange visible_keys(const ForwardParams& p, const SequenceSpan& s, int64_t row) {
  const int64_t diagonal = row + diagonal_shift(p, s);
  int64_t begin = 0, end = s.len_kv;
  if (p.causal != CausalMode::kNone) end = std::min(end, diagonal + 1);
  if (p.window.right >= 0) end = std::min(end, diagonal + p.window.right + 1);
  if (p.window.left >= 0) begin = std::max(begin, diagonal - p.window.left);
  end = std::max<int64_t>(end, 0);
  return KeyRange{std::min(begin, end), end};
}

// f(col_begin, col_end) for the blocks of kBlockKV keys that cover `keys`: aligned to multiples of
// kBlockKV (a window changes which blocks run, not where they start), the last cut at keys.end.
template <typename F>
void for_each_key_block(const KeyRange& keys, F&& f) {
  for (int64_t begin = keys.begin / kBlockKV * kBlockKV; begin < keys.end; begin += kBlockKV)
    f(begin, std::min(begin + kBlockKV, keys.end));
}

// The keys of share `split` of `num_splits` (SplitKVParams): the blocks f visits for `keys`,
// split into equal shares of whole blocks.
inline KeyRange split_keys(const KeyRange& keys, int64_t split, int64_t num_splits) {
  if (num_splits <= 1 || keys.end <= keys.begin) return keys;
  const int64_t first_block = keys.begin / kBlockKV;
  const int64_t blocks = (keys.end + kBlockKV - 1) / kBlockKV - first_block;
  const BlockShare share = split_share(blocks, split, num_splits);
  const int64_t begin = std::max(keys.begin, (first_block + share.first) * kBlockKV);
  const int64_t end = std::min(keys.end, (first_block + share.last) * kBlockKV);
  return begin < end ? KeyRange{begin, end} : KeyRange{0, 0};  // {0, 0}: no block at all
}

// The keys any row of [row_begin, row_end) can see (a superset where rows' ranges have gaps).
inline KeyRange visible_keys(const ForwardParams& p, const SequenceSpan& s, int64_t row_begin,
                             int64_t row_end) {
  if (row_end <= row_begin) return KeyRange{0, 0};
  return KeyRange{visible_keys(p, s, row_begin).begin, visible_keys(p, s, row_end - 1).end};
}

// One (batch, query head) pair of a sequence and the rows / columns (within the sequence) of a
// tile of its score matrix.
struct Tile {
  int64_t batch, head_q, head_kv;
  int64_t row_begin, row_end, col_begin, col_end;
  int64_t rows() const { return row_end - row_begin; }
  int64_t cols() const { return col_end - col_begin; }
};

// Copies rows [begin, end) (packed row indices for varlen) of one head into a dense Acc buffer.
template <typename Scalar, typename Acc>
void load_rows(const void* base, const TensorStrides& s, int64_t batch, int64_t head,
               int64_t begin, int64_t end, int64_t dim, Acc* dst) {
  const Scalar* src = static_cast<const Scalar*>(base) + batch * s.batch + head * s.head;
  for (int64_t r = begin; r < end; ++r) {
    const Scalar* row = src + r * s.row;
    for (int64_t e = 0; e < dim; ++e) dst[(r - begin) * dim + e] = static_cast<Acc>(row[e]);
  }
}

// load_rows for keys/values: rows [begin, end) of the sequence's cache rows (kv_row_offset: a
// dense, packed, batch-indexed or paged cache).
template <typename Scalar, typename Acc>
void load_kv_rows(const void* base, const TensorStrides& s, const KVCacheParams& cache,
                  int64_t batch, int64_t head, int64_t begin, int64_t end, int64_t dim, Acc* dst) {
  const Scalar* src = static_cast<const Scalar*>(base);
  for (int64_t r = begin; r < end; ++r) {
    const Scalar* row = src + kv_row_offset(cache, s, batch, head, r);
    for (int64_t e = 0; e < dim; ++e) dst[(r - begin) * dim + e] = static_cast<Acc>(row[e]);
  }
}

template <typename Acc>
Acc dot(const Acc* a, const Acc* b, int64_t n) {
  Acc sum = 0;
  for (int64_t e = 0; e < n; ++e) sum += a[e] * b[e];
  return sum;
}

// Scores of a tile with FlashAttention-2's modifiers (params.h, ScoreModParams): -inf where the
// window, the causal or the bool mask hides a key. With softcap, cap_grad (if not null) receives
// d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2 per element.
template <typename Acc>
void tile_scores(const ForwardParams& p, const SequenceSpan& span, const Tile& t, const Acc* q,
                 const Acc* k, Acc* scores, Acc* cap_grad = nullptr) {
  const int64_t dim = p.shape.head_dim;
  const MaskParams& m = p.mask;
  const int64_t mask_base = t.batch * m.batch_stride + t.head_q * m.head_stride;
  const Acc softcap = static_cast<Acc>(p.score_mod.softcap);
  const bool alibi = p.score_mod.alibi_slopes != nullptr;
  const Acc slope =
      alibi ? static_cast<Acc>(
                  p.score_mod.alibi_slopes[t.batch * p.score_mod.alibi_batch_stride + t.head_q])
            : Acc(0);
  const int64_t shift = diagonal_shift(p, span);
  for (int64_t r = 0; r < t.rows(); ++r) {
    const int64_t row = t.row_begin + r;
    const KeyRange visible = visible_keys(p, span, row);
    for (int64_t c = 0; c < t.cols(); ++c) {
      const int64_t col = t.col_begin + c;
      Acc s = -std::numeric_limits<Acc>::infinity();
      if (col >= visible.begin && col < visible.end) {
        s = static_cast<Acc>(p.scale) * dot(q + r * dim, k + c * dim, dim);
        if (softcap > Acc(0)) {
          const Acc capped = std::tanh(s / softcap);
          s = softcap * capped;
          if (cap_grad != nullptr) cap_grad[r * t.cols() + c] = Acc(1) - capped * capped;
        }
        if (alibi) s -= slope * static_cast<Acc>(std::abs(row + shift - col));
        if (m.kind != MaskKind::kNone) {
          const Acc value =
              read_scalar<Acc>(m.ptr, mask_base + row * m.row_stride + col * m.col_stride, m.dtype);
          if (m.kind == MaskKind::kBool) {
            if (value == Acc(0)) s = -std::numeric_limits<Acc>::infinity();
          } else {
            s += value;
          }
        }
      }
      scores[r * t.cols() + c] = s;
    }
  }
}

// Dropout factors of row `row`, columns [col_begin, col_end), into factors[0, col_end - col_begin):
// 0 if dropped, 1 / (1 - p) if kept. One Philox call per column group of common/philox.h (8
// columns), not one per element.
template <typename Acc>
void dropout_row_factors(const DropoutParams& d, uint32_t threshold, int64_t batch_head,
                         int64_t row, int64_t col_begin, int64_t col_end, Acc* factors) {
  const Acc kept = static_cast<Acc>(1.0 / (1.0 - static_cast<double>(d.p)));
  const DropoutStream stream(d.seed, d.offset);
  for (int64_t block = col_begin / 32 * 32; block < col_end; block += 32) {
    for (int64_t t = 0; t < 4; ++t) {
      const Philox4 bits = dropout_call(stream, batch_head, row, block + 2 * t);
      for (int64_t j = 0; j < 4; ++j) {
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t col = block + 8 * j + 2 * t + e;
          if (col >= col_begin && col < col_end)
            factors[col - col_begin] = dropout_uniform16(bits, col) >= threshold ? kept : Acc(0);
        }
      }
    }
  }
}

// Offset of row 0 of sequence `span` of (batch, head_q) in lse-shaped arrays (LseLayout).
inline int64_t lse_offset(const ForwardParams& p, const SequenceSpan& span, int64_t batch,
                          int64_t head_q) {
  return batch * p.lse_layout.batch + head_q * p.lse_layout.head + span.q_start;
}

}  // namespace flashv100::cpu
