// CPU launchers and kernels of the flashv100 ops (see flash_cpu.h for the tiling).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>
#include <torch/library.h>

#include <mutex>

#include "cpu/flash_cpu.h"
#include "tensor_params.h"

namespace flashv100::cpu {
namespace {

constexpr auto kNegInf = -std::numeric_limits<double>::infinity();

// Calls visit(batch, head, begin, end) for every `block`-sized range of [0, length) of every
// (batch, head), spread over ATen's thread pool.
template <typename Visit>
void parallel_over_blocks(int64_t batch, int64_t heads, int64_t length, int64_t block,
                          const Visit& visit) {
  const int64_t blocks = (length + block - 1) / block;
  at::parallel_for(0, batch * heads * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t batch_head = task / blocks, begin = (task % blocks) * block;
      visit(batch_head / heads, batch_head % heads, begin, std::min(begin + block, length));
    }
  });
}

// Rows [row_begin, row_end) of one (batch, query head); rows past the sequence's end (varlen
// blocks sized by max_seqlen_q) do nothing. Key blocks no row of the block sees are skipped. With
// split-KV, each share of the key blocks gives a normalized partial out and lse, combined in fixed
// order with weights exp(lse_share - lse) (the CUDA combine's arithmetic).
template <typename Scalar, typename Acc>
void forward_rows(const ForwardParams& p, Acc* lse, int64_t batch, int64_t head_q,
                  int64_t row_begin, int64_t row_end) {
  const AttentionShape& sh = p.shape;
  const SequenceSpan span = sequence_span(p, batch);
  row_end = std::min(row_end, span.len_q);
  if (row_begin >= row_end) return;
  const int64_t dim = sh.head_dim, dim_v = sh.head_dim_v;
  const int64_t head_kv = kv_head_of(head_q, sh.heads_q, sh.heads_kv);
  const int64_t rows = row_end - row_begin;
  const int64_t batch_head = batch * sh.heads_q + head_q;
  const bool dropout = p.dropout.p > 0.0f;
  const uint32_t threshold = dropout_threshold(p.dropout.p);
  const Acc neg_inf = static_cast<Acc>(kNegInf);

  std::vector<Acc> q(rows * dim), k(kBlockKV * dim), v(kBlockKV * dim_v), scores(rows * kBlockKV),
      keep(kBlockKV);
  std::vector<Acc> acc(rows * dim_v), row_max(rows), row_sum(rows);
  load_rows<Scalar>(p.q, p.q_strides, batch, head_q, span.q_start + row_begin,
                    span.q_start + row_end, dim, q.data());

  // Normalized out (into acc) and lse of the rows over `keys`: zeros and -inf without any.
  std::vector<Acc> row_lse(rows);
  const auto attend = [&](const KeyRange& keys) {
    std::fill(acc.begin(), acc.end(), Acc(0));
    std::fill(row_max.begin(), row_max.end(), neg_inf);
    std::fill(row_sum.begin(), row_sum.end(), Acc(0));
    for_each_key_block(keys, [&](int64_t col_begin, int64_t col_end) {
      const Tile t{batch, head_q, head_kv, row_begin, row_end, col_begin, col_end};
      load_kv_rows<Scalar>(p.k, p.k_strides, p.kvcache, batch, head_kv,
                           span.k_start + t.col_begin, span.k_start + t.col_end, dim, k.data());
      load_kv_rows<Scalar>(p.v, p.v_strides, p.kvcache, batch, head_kv,
                           span.k_start + t.col_begin, span.k_start + t.col_end, dim_v, v.data());
      tile_scores(p, span, t, q.data(), k.data(), scores.data());
      for (int64_t r = 0; r < rows; ++r) {
        const Acc* s = scores.data() + r * t.cols();
        Acc new_max = row_max[r];
        for (int64_t c = 0; c < t.cols(); ++c) new_max = std::max(new_max, s[c]);
        if (new_max == neg_inf) continue;  // nothing visible yet in this row
        const Acc correction = std::exp(row_max[r] - new_max);
        Acc* out_row = acc.data() + r * dim_v;
        row_sum[r] *= correction;
        for (int64_t e = 0; e < dim_v; ++e) out_row[e] *= correction;
        if (dropout) {
          dropout_row_factors(p.dropout, threshold, batch_head, row_begin + r, t.col_begin,
                              t.col_end, keep.data());
        }
        for (int64_t c = 0; c < t.cols(); ++c) {
          Acc prob = std::exp(s[c] - new_max);
          row_sum[r] += prob;
          if (dropout) prob *= keep[c];
          if (prob == Acc(0)) continue;
          const Acc* v_row = v.data() + c * dim_v;
          for (int64_t e = 0; e < dim_v; ++e) out_row[e] += prob * v_row[e];
        }
        row_max[r] = new_max;
      }
    });
    for (int64_t r = 0; r < rows; ++r) {
      const bool empty = row_sum[r] == Acc(0);  // every key hidden: zeros, as SDPA gives
      const Acc inv_sum = empty ? Acc(0) : Acc(1) / row_sum[r];
      for (int64_t e = 0; e < dim_v; ++e) acc[r * dim_v + e] *= inv_sum;
      row_lse[r] = empty ? neg_inf : row_max[r] + std::log(row_sum[r]);
    }
  };

  const KeyRange keys = visible_keys(p, span, row_begin, row_end);
  const int64_t splits = std::max<int64_t>(1, p.split.num_splits);
  if (splits == 1) {
    attend(keys);
  } else {
    std::vector<Acc> share_out(splits * rows * dim_v), share_lse(splits * rows);
    for (int64_t split = 0; split < splits; ++split) {
      attend(split_keys(keys, split, splits));
      std::copy(acc.begin(), acc.end(), share_out.begin() + split * rows * dim_v);
      std::copy(row_lse.begin(), row_lse.end(), share_lse.begin() + split * rows);
    }
    for (int64_t r = 0; r < rows; ++r) {
      Acc top = neg_inf;
      for (int64_t split = 0; split < splits; ++split) top = std::max(top, share_lse[split * rows + r]);
      Acc total = 0;
      for (int64_t split = 0; split < splits; ++split)
        total += top == neg_inf ? Acc(0) : std::exp(share_lse[split * rows + r] - top);
      row_lse[r] = total == Acc(0) ? neg_inf : top + std::log(total);
      Acc* out_row = acc.data() + r * dim_v;
      std::fill(out_row, out_row + dim_v, Acc(0));
      for (int64_t split = 0; split < splits; ++split) {
        const Acc l = share_lse[split * rows + r];
        if (l == neg_inf) continue;
        const Acc weight = std::exp(l - row_lse[r]);
        const Acc* part = share_out.data() + (split * rows + r) * dim_v;
        for (int64_t e = 0; e < dim_v; ++e) out_row[e] += weight * part[e];
      }
    }
  }

  Scalar* out = static_cast<Scalar*>(p.out) + batch * p.out_strides.batch +
                head_q * p.out_strides.head;
  Acc* lse_rows = lse + lse_offset(p, span, batch, head_q);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row_begin + r;
    for (int64_t e = 0; e < dim_v; ++e) {
      out[(span.q_start + row) * p.out_strides.row + e] = static_cast<Scalar>(acc[r * dim_v + e]);
    }
    lse_rows[row] = row_lse[r];
  }
}

template <typename Scalar, typename Acc>
void forward(const ForwardParams& p, Acc* lse) {
  const AttentionShape& sh = p.shape;
  parallel_over_blocks(sh.batch, sh.heads_q, sh.len_q, kBlockQ,
                       [&](int64_t batch, int64_t head_q, int64_t row_begin, int64_t row_end) {
                         forward_rows<Scalar, Acc>(p, lse, batch, head_q, row_begin, row_end);
                       });
}

// What the backward needs about one tile of query rows, loaded once per tile. P is recomputed as
// exp(s - lse) * norm (norm: see saturated_row_norms).
template <typename Acc>
struct RowTile {
  std::vector<Acc> q, dout, lse, delta, norm;
  RowTile(int64_t rows, int64_t dim, int64_t dim_v)
      : q(rows * dim), dout(rows * dim_v), lse(rows), delta(rows), norm(rows) {}
};

// Per query row, the factor that makes exp(s - lse) the row's probabilities. lse = max + log(sum)
// is only as precise as its own spacing: with huge biases (finfo.min on every visible key) log(sum)
// rounds away entirely and exp(s - lse) sums to `sum`, not 1. From |lse| = 2^16 on (spacing
// 2^-7 in fp32) the row's sum of exp(s - lse) is recounted from its scores (s - lse is exact
// there) and the factor is 1 / sum; everywhere else it is 1. Laid out like lse (lse_size entries).
template <typename Scalar, typename Acc>
std::vector<Acc> saturated_row_norms(const ForwardParams& f, const Acc* lse, int64_t lse_size) {
  const AttentionShape& sh = f.shape;
  const int64_t dim = sh.head_dim;
  std::vector<Acc> norm(lse_size, Acc(1));
  parallel_over_blocks(
      sh.batch, sh.heads_q, sh.len_q, kBlockQ,
      [&](int64_t batch, int64_t head_q, int64_t row_begin, int64_t row_end) {
        const SequenceSpan span = sequence_span(f, batch);
        const int64_t head_kv = kv_head_of(head_q, sh.heads_q, sh.heads_kv);
        const int64_t offset = lse_offset(f, span, batch, head_q);
        std::vector<Acc> q(dim), k(kBlockKV * dim), scores(kBlockKV);
        for (int64_t row = row_begin; row < std::min(row_end, span.len_q); ++row) {
          const Acc l = lse[offset + row];
          if (l == static_cast<Acc>(kNegInf) || std::abs(l) < static_cast<Acc>(kSaturatedLse)) continue;
          load_rows<Scalar>(f.q, f.q_strides, batch, head_q, span.q_start + row,
                            span.q_start + row + 1, dim, q.data());
          Acc sum = 0;
          const KeyRange keys = visible_keys(f, span, row);
          for_each_key_block(keys, [&](int64_t col_begin, int64_t col_end) {
            const Tile t{batch, head_q, head_kv, row, row + 1, col_begin, col_end};
            load_rows<Scalar>(f.k, f.k_strides, batch, head_kv, span.k_start + t.col_begin,
                              span.k_start + t.col_end, dim, k.data());
            tile_scores(f, span, t, q.data(), k.data(), scores.data());
            for (int64_t c = 0; c < t.cols(); ++c) sum += std::exp(scores[c] - l);
          });
          norm[offset + row] = Acc(1) / sum;
        }
      });
  return norm;
}

// Visits every visible element of a tile with (r, c, P, dropout factor, dS, dS_raw): dS is the
// gradient of the score the softmax sees, dS_raw that of scale * q.k (they differ by the softcap's
// derivative).
template <typename Acc, typename Visit>
void for_each_grad_element(const BackwardParams& p, const SequenceSpan& span, const Tile& t,
                           const RowTile<Acc>& rows, const Acc* k, const Acc* v, Acc* scores,
                           Visit&& visit) {
  const ForwardParams& f = p.fwd;
  const int64_t dim_v = f.shape.head_dim_v;
  const int64_t batch_head = t.batch * f.shape.heads_q + t.head_q;
  const bool dropout = f.dropout.p > 0.0f;
  const bool softcap = f.score_mod.softcap > 0.0f;
  const uint32_t threshold = dropout_threshold(f.dropout.p);
  std::vector<Acc> cap_grad(softcap ? t.rows() * t.cols() : 0);
  tile_scores(f, span, t, rows.q.data(), k, scores, softcap ? cap_grad.data() : nullptr);
  std::vector<Acc> keep(t.cols(), Acc(1));
  for (int64_t r = 0; r < t.rows(); ++r) {
    if (rows.lse[r] == static_cast<Acc>(kNegInf)) continue;  // fully hidden row: zero grads
    if (dropout) {
      dropout_row_factors(f.dropout, threshold, batch_head, t.row_begin + r, t.col_begin,
                          t.col_end, keep.data());
    }
    for (int64_t c = 0; c < t.cols(); ++c) {
      const Acc s = scores[r * t.cols() + c];
      if (s == static_cast<Acc>(kNegInf)) continue;
      const Acc prob = std::exp(s - rows.lse[r]) * rows.norm[r];
      const Acc dprob = keep[c] * dot(rows.dout.data() + r * dim_v, v + c * dim_v, dim_v);
      const Acc dscore = prob * (dprob - rows.delta[r]);
      visit(r, c, prob, keep[c], dscore, softcap ? dscore * cap_grad[r * t.cols() + c] : dscore);
    }
  }
}

// The per-row vectors of the backward, laid out like lse: lse, D = rowsum(dO * O), the P factor.
template <typename Acc>
struct RowVectors {
  const Acc* lse;
  const Acc* delta;
  const Acc* norm;
};

template <typename Scalar, typename Acc>
void load_row_tile(const BackwardParams& p, const RowVectors<Acc>& vec, const SequenceSpan& span,
                   int64_t batch, int64_t head_q, int64_t row_begin, int64_t row_end,
                   RowTile<Acc>& tile) {
  const ForwardParams& f = p.fwd;
  load_rows<Scalar>(f.q, f.q_strides, batch, head_q, span.q_start + row_begin,
                    span.q_start + row_end, f.shape.head_dim, tile.q.data());
  load_rows<Scalar>(p.dout, p.dout_strides, batch, head_q, span.q_start + row_begin,
                    span.q_start + row_end, f.shape.head_dim_v, tile.dout.data());
  const int64_t offset = lse_offset(f, span, batch, head_q);
  std::copy(vec.lse + offset + row_begin, vec.lse + offset + row_end, tile.lse.begin());
  std::copy(vec.delta + offset + row_begin, vec.delta + offset + row_end, tile.delta.begin());
  std::copy(vec.norm + offset + row_begin, vec.norm + offset + row_end, tile.norm.begin());
}

template <typename Scalar, typename Acc>
void store_rows(void* base, const TensorStrides& s, int64_t batch, int64_t head, int64_t begin,
                int64_t end, int64_t dim, const Acc* src) {
  Scalar* dst = static_cast<Scalar*>(base) + batch * s.batch + head * s.head;
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t e = 0; e < dim; ++e) {
      dst[r * s.row + e] = static_cast<Scalar>(src[(r - begin) * dim + e]);
    }
  }
}

// dK and dV of one block of keys, summed over the query heads that share it (GQA). Row blocks that
// see none of the block's keys are skipped. dmask: the additive mask's [B, Hq, Lq, Lkv] gradient
// (dense batches only), or nullptr.
template <typename Scalar, typename Acc>
void backward_key_block(const BackwardParams& p, const RowVectors<Acc>& vec, Acc* dmask,
                        int64_t batch, int64_t head_kv, int64_t col_begin, int64_t col_end) {
  const ForwardParams& f = p.fwd;
  const AttentionShape& sh = f.shape;
  const SequenceSpan span = sequence_span(f, batch);
  col_end = std::min(col_end, span.len_kv);
  if (col_begin >= col_end) return;
  const int64_t dim = sh.head_dim, dim_v = sh.head_dim_v, cols = col_end - col_begin;
  const int64_t group = sh.heads_q / sh.heads_kv;
  std::vector<Acc> k(cols * dim), v(cols * dim_v), dk(cols * dim, Acc(0)), dv(cols * dim_v, Acc(0));
  std::vector<Acc> scores(kBlockQ * cols);
  RowTile<Acc> rows(kBlockQ, dim, dim_v);
  load_rows<Scalar>(f.k, f.k_strides, batch, head_kv, span.k_start + col_begin,
                    span.k_start + col_end, dim, k.data());
  load_rows<Scalar>(f.v, f.v_strides, batch, head_kv, span.k_start + col_begin,
                    span.k_start + col_end, dim_v, v.data());
  const Acc scale = static_cast<Acc>(f.scale);
  for (int64_t head_q = head_kv * group; head_q < (head_kv + 1) * group; ++head_q) {
    Acc* dmask_head = dmask == nullptr
                          ? nullptr
                          : dmask + (batch * sh.heads_q + head_q) * sh.len_q * sh.len_kv;
    for (int64_t row_begin = 0; row_begin < span.len_q; row_begin += kBlockQ) {
      const int64_t row_end = std::min(row_begin + kBlockQ, span.len_q);
      const KeyRange keys = visible_keys(f, span, row_begin, row_end);
      if (keys.end <= col_begin || keys.begin >= col_end) continue;
      load_row_tile<Scalar>(p, vec, span, batch, head_q, row_begin, row_end, rows);
      const Tile t{batch, head_q, head_kv, row_begin, row_end, col_begin, col_end};
      for_each_grad_element(p, span, t, rows, k.data(), v.data(), scores.data(),
                            [&](int64_t r, int64_t c, Acc prob, Acc keep, Acc dscore, Acc draw) {
                              const Acc* dout_row = rows.dout.data() + r * dim_v;
                              const Acc* q_row = rows.q.data() + r * dim;
                              const Acc pv = prob * keep;
                              for (int64_t e = 0; e < dim_v; ++e) dv[c * dim_v + e] += pv * dout_row[e];
                              for (int64_t e = 0; e < dim; ++e) dk[c * dim + e] += scale * draw * q_row[e];
                              if (dmask_head != nullptr) {
                                dmask_head[(row_begin + r) * sh.len_kv + col_begin + c] = dscore;
                              }
                            });
    }
  }
  store_rows<Scalar>(p.dk, p.dk_strides, batch, head_kv, span.k_start + col_begin,
                     span.k_start + col_end, dim, dk.data());
  store_rows<Scalar>(p.dv, p.dv_strides, batch, head_kv, span.k_start + col_begin,
                     span.k_start + col_end, dim_v, dv.data());
}

// dQ of one block of query rows.
template <typename Scalar, typename Acc>
void backward_query_block(const BackwardParams& p, const RowVectors<Acc>& vec, int64_t batch,
                          int64_t head_q, int64_t row_begin, int64_t row_end) {
  const ForwardParams& f = p.fwd;
  const AttentionShape& sh = f.shape;
  const SequenceSpan span = sequence_span(f, batch);
  row_end = std::min(row_end, span.len_q);
  if (row_begin >= row_end) return;
  const int64_t dim = sh.head_dim, dim_v = sh.head_dim_v, rows_n = row_end - row_begin;
  const int64_t head_kv = kv_head_of(head_q, sh.heads_q, sh.heads_kv);
  std::vector<Acc> k(kBlockKV * dim), v(kBlockKV * dim_v), dq(rows_n * dim, Acc(0));
  std::vector<Acc> scores(rows_n * kBlockKV);
  RowTile<Acc> rows(rows_n, dim, dim_v);
  load_row_tile<Scalar>(p, vec, span, batch, head_q, row_begin, row_end, rows);
  const Acc scale = static_cast<Acc>(f.scale);
  const KeyRange keys = visible_keys(f, span, row_begin, row_end);
  for_each_key_block(keys, [&](int64_t col_begin, int64_t col_end) {
    load_rows<Scalar>(f.k, f.k_strides, batch, head_kv, span.k_start + col_begin,
                      span.k_start + col_end, dim, k.data());
    load_rows<Scalar>(f.v, f.v_strides, batch, head_kv, span.k_start + col_begin,
                      span.k_start + col_end, dim_v, v.data());
    const Tile t{batch, head_q, head_kv, row_begin, row_end, col_begin, col_end};
    for_each_grad_element(p, span, t, rows, k.data(), v.data(), scores.data(),
                          [&](int64_t r, int64_t c, Acc, Acc, Acc, Acc draw) {
                            const Acc* k_row = k.data() + c * dim;
                            for (int64_t e = 0; e < dim; ++e) dq[r * dim + e] += scale * draw * k_row[e];
                          });
  });
  store_rows<Scalar>(p.dq, p.dq_strides, batch, head_q, span.q_start + row_begin,
                     span.q_start + row_end, dim, dq.data());
}

// Two passes (keys, then queries) so that no two threads write one gradient element:
// deterministic by construction, so the `deterministic` flag needs nothing extra here. lse and
// delta: LseLayout, lse_size entries.
template <typename Scalar, typename Acc>
void backward(const BackwardParams& p, const Acc* lse, const Acc* delta, int64_t lse_size,
              Acc* dmask) {
  const AttentionShape& sh = p.fwd.shape;
  const std::vector<Acc> norm = saturated_row_norms<Scalar>(p.fwd, lse, lse_size);
  const RowVectors<Acc> vec{lse, delta, norm.data()};
  parallel_over_blocks(sh.batch, sh.heads_kv, sh.len_kv, kBlockKV,
                       [&](int64_t batch, int64_t head_kv, int64_t col_begin, int64_t col_end) {
                         backward_key_block<Scalar, Acc>(p, vec, dmask, batch, head_kv, col_begin,
                                                         col_end);
                       });
  parallel_over_blocks(sh.batch, sh.heads_q, sh.len_q, kBlockQ,
                       [&](int64_t batch, int64_t head_q, int64_t row_begin, int64_t row_end) {
                         backward_query_block<Scalar, Acc>(p, vec, batch, head_q, row_begin,
                                                           row_end);
                       });
}

at::Tensor make_rng_state(double dropout_p, uint64_t* seed) {
  at::Tensor state = at::zeros({2}, at::TensorOptions().dtype(at::kLong));
  if (dropout_p > 0.0) {
    auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
        std::nullopt, at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    *seed = gen->random64();
    state[0] = static_cast<int64_t>(*seed);
  }
  return state;
}

void load_rng_state(const at::Tensor& rng_state, DropoutParams& dropout) {
  TORCH_CHECK(rng_state.numel() == 2 && rng_state.scalar_type() == at::kLong,
              "flashv100: expected rng_state int64[2] (as returned by _attention_forward), got ",
              rng_state.scalar_type(), rng_state.sizes());
  const at::Tensor state = rng_state.cpu();
  dropout.seed = static_cast<uint64_t>(state[0].item<int64_t>());
  dropout.offset = static_cast<uint64_t>(state[1].item<int64_t>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, int64_t causal_mode,
    double scale) {
  check_attention_inputs("flashv100._attention_forward", query, key, value, attn_mask, dropout_p,
                         causal_mode);
  at::Tensor out = allocate_out(query, value);
  at::Tensor lse = allocate_lse(query);
  ForwardParams p = make_forward_params(query, key, value, attn_mask, out, lse, scale,
                                        causal_mode, dropout_p);
  at::Tensor rng_state = make_rng_state(dropout_p, &p.dropout.seed);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "flashv100_fwd", [&] {
    using Acc = at::opmath_type<scalar_t>;
    forward<scalar_t, Acc>(p, lse.data_ptr<Acc>());
  });
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const std::optional<at::Tensor>& attn_mask, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& rng_state, double dropout_p, int64_t causal_mode,
    double scale, bool mask_requires_grad, bool deterministic) {
  check_backward_inputs("flashv100._attention_backward", grad_out, query, key, value, attn_mask,
                        out, lse, rng_state, dropout_p, causal_mode, mask_requires_grad);
  at::Tensor grad_query = at::empty_like(query), grad_key = at::empty_like(key),
             grad_value = at::empty_like(value);
  // In the accumulation type (lse's), so that fp64 mask gradients stay exact.
  at::Tensor grad_mask_full;
  if (mask_requires_grad) {
    grad_mask_full = at::zeros({query.size(0), query.size(1), query.size(2), key.size(2)},
                               query.options().dtype(lse.scalar_type()));
  }
  const at::Tensor lse_c = lse.contiguous();
  const at::Tensor delta = (grad_out.to(lse.scalar_type()) * out.to(lse.scalar_type()))
                               .sum(-1)
                               .contiguous();
  BackwardParams p = make_backward_params(grad_out, query, key, value, attn_mask, out, lse_c,
                                          scale, causal_mode, dropout_p, grad_query, grad_key,
                                          grad_value, grad_mask_full, deterministic);
  if (dropout_p > 0.0) load_rng_state(rng_state, p.fwd.dropout);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "flashv100_bwd", [&] {
    using Acc = at::opmath_type<scalar_t>;
    backward<scalar_t, Acc>(p, lse_c.data_ptr<Acc>(), delta.data_ptr<Acc>(), lse_c.numel(),
                            mask_requires_grad ? grad_mask_full.data_ptr<Acc>() : nullptr);
  });
  at::Tensor grad_mask = mask_requires_grad ? reduce_mask_grad(grad_mask_full, *attn_mask)
                                            : at::empty({0}, query.options());
  return {grad_query, grad_key, grad_value, grad_mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_forward_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, double softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, bool /*deterministic: the backward's*/) {
  const FlashArgs args{query,        key,          value,     cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                       window_left,  window_right, softcap,   alibi_slopes};
  check_flash_inputs("flashv100._flash_forward", args);
  at::Tensor out = at::empty_like(query);
  at::Tensor lse = allocate_flash_lse(args);
  ForwardParams p = make_flash_forward_params(args, out, lse);
  at::Tensor rng_state = make_rng_state(dropout_p, &p.dropout.seed);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "flashv100_flash_fwd", [&] {
    using Acc = at::opmath_type<scalar_t>;
    forward<scalar_t, Acc>(p, lse.data_ptr<Acc>());
  });
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& softmax_lse,
    const at::Tensor& rng_state, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    bool deterministic) {
  constexpr const char* op = "flashv100._flash_backward";
  const FlashArgs args{query,        key,          value,     cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                       window_left,  window_right, softcap,   alibi_slopes};
  check_flash_inputs(op, args);
  check_flash_backward_inputs(op, args, grad_out, out, softmax_lse, rng_state);
  at::Tensor grad_query = at::empty_like(query), grad_key = at::empty_like(key),
             grad_value = at::empty_like(value);
  const at::Tensor lse = softmax_lse.contiguous();
  // D = rowsum(dO * O) laid out like lse: [B, Sq, Hq] -> [B, Hq, Sq], [total_q, Hq] -> [Hq, total_q].
  const at::Tensor row_dot = (grad_out.to(lse.scalar_type()) * out.to(lse.scalar_type())).sum(-1);
  const at::Tensor delta = row_dot.transpose(-2, -1).contiguous();
  BackwardParams p = make_flash_backward_params(args, grad_out, out, lse, grad_query, grad_key,
                                                grad_value, deterministic);
  if (dropout_p > 0.0) load_rng_state(rng_state, p.fwd.dropout);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "flashv100_flash_bwd", [&] {
    using Acc = at::opmath_type<scalar_t>;
    backward<scalar_t, Acc>(p, lse.data_ptr<Acc>(), delta.data_ptr<Acc>(), lse.numel(), nullptr);
  });
  return {grad_query, grad_key, grad_value};
}

at::Tensor dropout_mask_cpu(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                            int64_t len_q, int64_t len_kv, double dropout_p) {
  check_dropout_p("flashv100._dropout_mask", dropout_p);
  DropoutParams d;
  d.p = static_cast<float>(dropout_p);
  load_rng_state(rng_state, d);
  at::Tensor keep = at::empty({batch, heads, len_q, len_kv}, rng_state.options().dtype(at::kBool));
  bool* data = keep.data_ptr<bool>();
  const uint32_t threshold = dropout_threshold(d.p);
  at::parallel_for(0, batch * heads * len_q, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> factors(len_kv);
    for (int64_t row_id = begin; row_id < end; ++row_id) {
      dropout_row_factors(d, threshold, row_id / len_q, row_id % len_q, 0, len_kv,
                          factors.data());
      for (int64_t col = 0; col < len_kv; ++col) data[row_id * len_kv + col] = factors[col] != 0.0f;
    }
  });
  return keep;
}

// One row of `dim` elements, rotated at cos/sin row `position` over its first rotary_dim
// elements (rotary_dim 0: copied), written to dst in Scalar.
template <typename Scalar, typename Acc>
void rotate_row(const KVAppendParams& a, const Scalar* src, Scalar* dst, int64_t dim,
                int64_t position) {
  const int64_t half = a.rotary_dim / 2;
  const Scalar* cos = static_cast<const Scalar*>(a.rotary_cos) + position * half;
  const Scalar* sin = static_cast<const Scalar*>(a.rotary_sin) + position * half;
  std::vector<Acc> rotated(dim);
  for (int64_t e = 0; e < dim; ++e) {
    const Acc x = static_cast<Acc>(src[e]);
    if (e >= a.rotary_dim) {
      rotated[e] = x;
      continue;
    }
    const RotaryPair pair = rotary_pair(e, a.rotary_dim, a.rotary_interleaved);
    const Acc c = static_cast<Acc>(cos[pair.freq]), sn = static_cast<Acc>(sin[pair.freq]);
    const Acc y = static_cast<Acc>(src[pair.partner]);
    rotated[e] = pair.first ? x * c - y * sn : x * c + y * sn;
  }
  for (int64_t e = 0; e < dim; ++e) dst[e] = static_cast<Scalar>(rotated[e]);
}

// KVAppendParams on the CPU: q rotated into q_rotated, new keys (rotated) and values written into
// the cache.
template <typename Scalar, typename Acc>
void append_kv(const KVAppendParams& a) {
  const KVCacheParams& c = a.cache;
  const bool rotary = a.q_rotated != nullptr;
  const auto row_ptr = [](const void* base, const TensorStrides& s, int64_t b, int64_t h,
                          int64_t r) {
    return static_cast<const Scalar*>(base) + b * s.batch + h * s.head + r * s.row;
  };
  if (rotary) {
    at::parallel_for(0, a.batch * a.len_q, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / a.len_q, i = task % a.len_q;
        const int64_t position = c.seqlens[b] + (a.q_positions_advance ? i : 0);
        for (int64_t h = 0; h < a.heads_q; ++h) {
          Scalar* dst = const_cast<Scalar*>(row_ptr(a.q_rotated, a.q_rotated_strides, b, h, i));
          rotate_row<Scalar, Acc>(a, row_ptr(a.q, a.q_strides, b, h, i), dst, a.head_dim,
                                  position);
        }
      }
    });
  }
  if (a.k_new == nullptr) return;
  KVAppendParams plain = a;
  plain.rotary_dim = 0;  // values are never rotated
  at::parallel_for(0, a.batch * c.seqlen_new, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / c.seqlen_new, i = task % c.seqlen_new;
      const int64_t row = c.seqlens[b] + i;
      for (int64_t h = 0; h < a.heads_kv; ++h) {
        Scalar* k_dst = static_cast<Scalar*>(a.k_cache) + kv_row_offset(c, a.k_cache_strides, b, h, row);
        Scalar* v_dst = static_cast<Scalar*>(a.v_cache) + kv_row_offset(c, a.v_cache_strides, b, h, row);
        rotate_row<Scalar, Acc>(rotary ? a : plain, row_ptr(a.k_new, a.k_new_strides, b, h, i),
                                k_dst, a.head_dim, row);
        rotate_row<Scalar, Acc>(plain, row_ptr(a.v_new, a.v_new_strides, b, h, i), v_dst,
                                a.head_dim_v, row);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> kvcache_forward_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
    bool rotary_interleaved, const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits,
    bool /*check_index_values*/, const std::optional<at::Tensor>& cu_seqlens_q,
    int64_t max_seqlen_q) {
  const KVCacheArgs args{q,           k_cache,         v_cache,       k,
                         v,           rotary_cos,      rotary_sin,    cache_seqlens,
                         cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                         causal,      window_left,     window_right,  softcap,
                         rotary_interleaved, alibi_slopes, num_splits, cu_seqlens_q,
                         max_seqlen_q};
  // The index values are on the host already: checked whatever check_index_values asks.
  check_kvcache_inputs("flashv100._kvcache_forward", args, /*check_values=*/true);
  const at::Tensor q_rotated = rotary_cos.has_value() ? at::empty_like(q) : at::Tensor();
  const KVAppendParams append = make_kvcache_append_params(args, q_rotated);
  at::Tensor out = allocate_kvcache_out(args);
  at::Tensor lse = allocate_kvcache_lse(args);
  ForwardParams p = make_kvcache_forward_params(args, q_rotated.defined() ? q_rotated : q, out, lse);
  // The CPU kernels split exactly as asked; 0 (the CUDA heuristic's choice) is one share here.
  p.split.num_splits = static_cast<int32_t>(std::max<int64_t>(1, num_splits));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flashv100_kvcache", [&] {
    using Acc = at::opmath_type<scalar_t>;
    append_kv<scalar_t, Acc>(append);
    forward<scalar_t, Acc>(p, lse.data_ptr<Acc>());
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashv100, CPU, m) {
  m.impl("_kvcache_forward", TORCH_FN(kvcache_forward_cpu));
  m.impl("_attention_forward", TORCH_FN(attention_forward_cpu));
  m.impl("_attention_backward", TORCH_FN(attention_backward_cpu));
  m.impl("_flash_forward", TORCH_FN(flash_forward_cpu));
  m.impl("_flash_backward", TORCH_FN(flash_backward_cpu));
  m.impl("_dropout_mask", TORCH_FN(dropout_mask_cpu));
}

}  // namespace flashv100::cpu
