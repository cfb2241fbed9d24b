// FlashAttention-2 backward. P is recomputed from the saved log-sum-exp (the general variant: from
// a per-row base and log2 normalizer, see recount_saturated_row), D = rowsum(dO * O) comes from a
// preprocessing kernel, and the main kernel runs one block per (key tile, batch*kv-head, part of
// its GQA group: KvGroupSplit): it loops over those query heads and over query tiles, accumulating
// dK and dV in registers (no races between blocks, so dK/dV are deterministic). dQ is either
// atomically added into an fp32 workspace by that kernel (fast), or computed by a second kernel
// that loops over key tiles per query tile (deterministic: fixed summation order). Packed (varlen)
// batches: grids cover the longest sequence, tiles past a sequence's end exit; per-row vectors (D,
// P's base and normalizer) and the dQ workspace are laid out [B, Hq, max_seqlen_q]. Key tiles loop
// only over the query tiles of their causal/window band, query tiles only over the key tiles of
// theirs.
#pragma once

#include "cuda/kernels/attention_common.cuh"
#include "cuda/kernels/tile_io.cuh"

namespace flashv100 {
namespace kern {

template <class Cfg>
struct BwdSmem {
  uint16_t *k, *v, *q, *dout, *p, *ds;
  // Per query row: P's base (the lse in base 2, +inf for a row without a visible key; general
  // variant: BackwardParams::row_base), D, and for the general variant P's log2 normalizer
  // (BackwardParams::row_log2_norm).
  float *row_base, *dsum, *log2_norm;

  // Q and dO are those of query-side buffer `stage` (Cfg::kQStages).
  __device__ __forceinline__ BwdSmem(uint4* raw, int stage) {
    uint16_t* base = reinterpret_cast<uint16_t*>(raw);
    k = base + Cfg::kKOffset;
    v = base + Cfg::kVOffset;
    q = base + Cfg::kQOffset + stage * Cfg::kQElems;
    dout = base + Cfg::kDOOffset + stage * Cfg::kQElems;
    p = base + Cfg::kPOffset;
    ds = base + Cfg::kDSOffset;
    row_base = reinterpret_cast<float*>(reinterpret_cast<char*>(raw) + Cfg::kRowVecByteOffset);
    dsum = row_base + Cfg::kBlockM;
    log2_norm = dsum + Cfg::kBlockM;
  }
};

// Index of row i of sequence b, head h, in the backward's per-row vectors: [B, Hq, len_q] with
// len_q the longest sequence's length (varlen); the lse itself is addressed by its LseLayout.
__device__ __forceinline__ int64_t row_vector_index(const ForwardParams& f, int64_t b, int64_t h,
                                                    int64_t i) {
  return (b * f.shape.heads_q + h) * f.shape.len_q + i;
}
__device__ __forceinline__ int64_t lse_index(const ForwardParams& f, const SequenceSpan& seq,
                                             int64_t b, int64_t h, int64_t i) {
  return b * f.lse_layout.batch + h * f.lse_layout.head + seq.q_start + i;
}

// Where one query row's vectors go: its D, and for the general variant P's base and log2
// normalizer (write_row_vectors).
struct RowVectorSlots {
  float *dsum, *base, *log2_norm;
};

// The row vectors a kDqDirect block computes itself (dkdv_computes_row_vectors), in shared memory
// (BwdConfig::kDirectRows): row i of the block's j-th head at j * len_q + i. Plain variant: D
// only (its base is the lse).
template <class Cfg>
struct DirectRowVectors {
  float* dsum;
  int64_t len_q;
  int head_begin;

  __device__ __forceinline__ DirectRowVectors(uint4* raw, int64_t len_q, int head_begin)
      : dsum(reinterpret_cast<float*>(reinterpret_cast<char*>(raw) +
                                      Cfg::kDirectRowVecByteOffset)),
        len_q(len_q),
        head_begin(head_begin) {}
  __device__ __forceinline__ int64_t index(int h, int i) const {
    return (h - head_begin) * len_q + i;
  }
  __device__ __forceinline__ RowVectorSlots slots(int h, int i) const {
    const int64_t j = index(h, i);
    if constexpr (!Cfg::kGeneral) return {dsum + j, nullptr, nullptr};
    return {dsum + j, dsum + Cfg::kDirectRows + j, dsum + 2 * Cfg::kDirectRows + j};
  }
};

// The row vectors of BwdSmem for one query tile, one row per thread of the first kBlockM:
// fetched into registers when the tile's loads are issued and written to shared memory just
// before the barrier that publishes the tile, so that the global loads' latency overlaps the
// work in between (loading straight into shared memory would stall those warps at the load).
// Rows past the end get row_base = +inf so that their recomputed P is exactly 0. Where the block
// computes the row vectors itself (DirectRowVectors), fetch reads only the plain variant's lse and
// take_direct the rest, once they are computed.
template <class Cfg>
struct QueryRowVectors {
  static_assert(Cfg::kBlockM <= Cfg::kThreads, "one query row per thread");
  float base, dsum, log2_norm;

  __device__ __forceinline__ void fetch(const BackwardParams& p, const float* dsum_all,
                                        const SequenceSpan& seq, int64_t b, int64_t h, int m0,
                                        int tid, bool direct) {
    const ForwardParams& f = p.fwd;
    const int64_t row_index = row_vector_index(f, b, h, m0 + tid);
    base = pos_inf();
    dsum = log2_norm = 0.0f;
    if (m0 + tid >= seq.len_q) return;
    if constexpr (!Cfg::kGeneral) base = f.lse[lse_index(f, seq, b, h, m0 + tid)];
    if (direct) return;
    if constexpr (Cfg::kGeneral) {
      base = p.row_base[row_index];
      log2_norm = p.row_log2_norm[row_index];
    }
    dsum = dsum_all[row_index];
  }
  __device__ __forceinline__ void take_direct(const DirectRowVectors<Cfg>& direct,
                                              const SequenceSpan& seq, int h, int m0, int tid) {
    if (tid >= Cfg::kBlockM || m0 + tid >= seq.len_q) return;
    const RowVectorSlots slots = direct.slots(h, m0 + tid);
    dsum = *slots.dsum;
    if constexpr (Cfg::kGeneral) {
      base = *slots.base;
      log2_norm = *slots.log2_norm;
    }
  }
  // The plain variant's base goes in base 2, and +inf for rows without a visible key (lse -inf),
  // so that every hidden score (-inf) maps to P = 0 without a test per entry.
  __device__ __forceinline__ void commit(const BwdSmem<Cfg>& sm, int tid) const {
    if (tid >= Cfg::kBlockM) return;
    sm.row_base[tid] = Cfg::kGeneral ? base : base == neg_inf() ? pos_inf() : base * kLog2e;
    sm.dsum[tid] = dsum;
    if constexpr (Cfg::kGeneral) sm.log2_norm[tid] = log2_norm;
  }
};

// Q and dO of query rows [m0, m0 + kBlockM) of head h (by stage_tile: they land after
// cp_async_wait_all), and that tile's row vectors into `rows` (to commit before the barrier;
// `direct`: QueryRowVectors::fetch).
template <class Atom, class Cfg>
__device__ __forceinline__ void load_query_side(const BwdSmem<Cfg>& sm, QueryRowVectors<Cfg>& rows,
                                                const BackwardParams& p, const float* dsum,
                                                const SequenceSpan& seq, int64_t b, int64_t h,
                                                int m0, int tid, bool direct = false) {
  const ForwardParams& f = p.fwd;
  const int n_rows = static_cast<int>(seq.len_q) - m0;
  const int d = static_cast<int>(f.shape.head_dim);
  const int64_t q_row = seq.q_start + m0;
  if (tid < Cfg::kBlockM) rows.fetch(p, dsum, seq, b, h, m0, tid, direct);
  stage_tile<Atom, Cfg::kBlockM, Cfg::kHeadDim, Cfg::kThreads>(
      sm.q, Cfg::kLdE, head_ptr(f.q, f.q_strides, b, h, q_row), f.q_strides.row, n_rows, d, tid);
  stage_tile<Atom, Cfg::kBlockM, Cfg::kHeadDim, Cfg::kThreads>(
      sm.dout, Cfg::kLdE, head_ptr(p.dout, p.dout_strides, b, h, q_row), p.dout_strides.row,
      n_rows, d, tid);
}

// K and V of key rows [n0, n0 + kBlockN) of a sequence's kv head, whose row 0 is at k_head and
// v_head, with len_kv keys (by stage_tile).
template <class Atom, class Cfg>
__device__ __forceinline__ void load_key_side(const BwdSmem<Cfg>& sm, const BackwardParams& p,
                                              const uint16_t* k_head, const uint16_t* v_head,
                                              int len_kv, int n0, int tid) {
  const ForwardParams& f = p.fwd;
  const int rows = len_kv - n0;
  const int d = static_cast<int>(f.shape.head_dim);
  stage_tile<Atom, Cfg::kBlockN, Cfg::kHeadDim, Cfg::kThreads>(
      sm.k, Cfg::kLdE, k_head + n0 * f.k_strides.row, f.k_strides.row, rows, d, tid);
  stage_tile<Atom, Cfg::kBlockN, Cfg::kHeadDim, Cfg::kThreads>(
      sm.v, Cfg::kLdE, v_head + n0 * f.v_strides.row, f.v_strides.row, rows, d, tid);
}

// What the P/dS recomputation needs about one (batch, query head) of a sequence.
struct BwdHead {
  int64_t batch_head;  // b * Hq + h: dropout counter and dmask rows
  HeadMask mask;
  Visibility vis;  // keys past the mask's key_end hidden
  ScoreMod mods;
  float* dmask;    // this head's [Lq, Lkv] rows of the fp32 mask gradient, or nullptr
  int64_t dmask_ld;

  __device__ __forceinline__ BwdHead(const BackwardParams& p, const SequenceSpan& seq, int64_t b,
                                     int64_t h)
      : batch_head(b * p.fwd.shape.heads_q + h),
        mask(p.fwd.mask, b, h, p.fwd.shape.heads_q),
        vis(Visibility(p.fwd, seq).keys_before(mask.key_end)),
        mods(p.fwd, seq, b, h),
        dmask(p.dmask != nullptr ? p.dmask + batch_head * p.fwd.shape.len_q * p.fwd.shape.len_kv
                                 : nullptr),
        dmask_ld(p.fwd.shape.len_kv) {}
};

// P of compute_p_ds's warp tile by pairs of accumulator registers (i even): in the warp's own
// accumulator, or in a shared tile laid out as store_accum_smem writes one.
template <class Acc>
struct AccumPairs {
  Acc& acc;
  __device__ __forceinline__ void get(int fm, int fn, int i, float (&v)[2]) const {
    v[0] = acc.c[fm][fn][i];
    v[1] = acc.c[fm][fn][i + 1];
  }
  __device__ __forceinline__ void set(int fm, int fn, int i, float v0, float v1) const {
    acc.c[fm][fn][i] = v0;
    acc.c[fm][fn][i + 1] = v1;
  }
};
template <class Atom, class Elem, class Acc>
struct SharedPairs {
  uint16_t* tile;  // the warp tile's (0, 0)
  int ld;
  int lane;
  __device__ __forceinline__ uint32_t* at(int fm, int fn, int i) const {
    return reinterpret_cast<uint32_t*>(tile + Acc::row_of(lane, fm, Atom::row_slot(i)) * ld +
                                       Acc::col_of(lane, fn, i));
  }
  __device__ __forceinline__ void get(int fm, int fn, int i, float (&v)[2]) const {
    const uint32_t pair = *at(fm, fn, i);
    v[0] = low_float<Elem>(pair);
    v[1] = high_float<Elem>(pair);
  }
  __device__ __forceinline__ void set(int fm, int fn, int i, float v0, float v1) const {
    *at(fm, fn, i) = pack2<Elem>(v0, v1);
  }
};

// compute_p_ds's path for a warp tile that needs no bounds (a compile-time flag: NVRTC has no
// <type_traits>).
template <bool kWhole>
struct WholeTile {
  static constexpr bool value = kWhole;
};

// Recomputes P = exp(S * scale + bias - lse) (general variant: BwdSmem's row_base and log2_norm
// in place of lse) of the (m0, n0) tile and dS = P * (dP - D) with dP = dO V^T (times the
// dropout factors), and stores P (times the keep mask) and dS (as Elem) into shared memory for
// the products that reduce over rows or keys. kWriteDMask: also write dS, the gradient of an
// additive mask, to head.dmask (each tile is visited once by the dK/dV kernel).
// Cfg::kSplitScores: the first kSWarps warps compute S and P, store P (as Elem) and are done; the
// others compute dP of the same tiles meanwhile and, after a block barrier inside, read that P
// back for dS (and P times the keep mask). Every warp of the block must call it then.
template <class Atom, class Elem, class Cfg, bool kStoreP, bool kWriteDMask>
__device__ __forceinline__ void compute_p_ds(const BwdSmem<Cfg>& sm, const BwdHead& head,
                                             const Dropout& dropout, float scale, int k_extent,
                                             int m0, int n0, int warp, int lane) {
  using Acc = WarpAccum<Atom, Cfg::kSRows, Cfg::kSCols>;
  constexpr bool kSplit = Cfg::kSplitScores;
  if (!kSplit && warp >= Cfg::kSWarps) return;
  const bool p_warp = warp < Cfg::kSWarps;  // split: S and P, not dP
  const int tile = kSplit ? warp % Cfg::kSWarps : warp;
  const Visibility& vis = head.vis;
  const int r0 = (tile / Cfg::kWarpsNS) * Cfg::kSRows;
  const int c0 = (tile % Cfg::kWarpsNS) * Cfg::kSCols;
  // Split: one accumulator, S or dP by the warp's role, from one product.
  Acc first, second;
  Acc& s = first;
  Acc& dp = kSplit ? first : second;
  // A warp tile whose keys are all past the last one (a sequence's last key tile) skips its
  // products: hide() below makes every entry -inf, so P = dS = 0 as computed.
  const bool has_keys = n0 + c0 < vis.len_kv;
  // A whole tile (every head-dim column, every entry visible; plain and dropout variants, S and
  // dP on the same warp) runs from S's first MMA to dS without an exit: one basic block, in which
  // ptxas can overlap dP's fragment loads and MMAs with S's and with P's exponentials. The exits
  // of the partial-tile paths (the extent and mask tests) would end a block between them.
  // Not on the wide tiles: at 255 registers nvcc 13 spills there with one block (sm_90).
  constexpr bool kMayBeWhole = !kSplit && !Cfg::kGeneral && Cfg::kSize == BwdTileSize::kCompact;
  const bool whole = kMayBeWhole && has_keys && k_extent == Cfg::kHeadDim &&
                     !vis.tile_needs_mask(m0 + r0, Cfg::kSRows, n0 + c0, Cfg::kSCols);
  // S, P, dP and dS into `s` and `dp`; false where the warp is done (split: the S warps, once P
  // is stored).
  const auto scores = [&](auto whole_tile) {
    constexpr bool kWhole = decltype(whole_tile)::value;
    const auto product = [&](Acc& acc, const uint16_t* a, const uint16_t* b) {
      acc.zero();
      const KMajor a_op{a + r0 * Cfg::kLdE, Cfg::kLdE}, b_op{b + c0 * Cfg::kLdE, Cfg::kLdE};
      if constexpr (kWhole) {
        warp_gemm_whole<Atom, Elem, Cfg::kHeadDim>(acc, a_op, b_op, lane);
      } else {
        if (!has_keys) return;
        warp_gemm<Atom, Elem, Cfg::kHeadDim, Cfg::kStraightScores>(acc, a_op, b_op, k_extent,
                                                                   Cfg::kSCols, lane);
      }
    };
    if constexpr (kSplit) {
      product(first, p_warp ? sm.q : sm.dout, p_warp ? sm.k : sm.v);
    } else {
      product(s, sm.q, sm.k);
      product(dp, sm.dout, sm.v);
    }
    // Base and D of the rows this lane holds; the base in base 2 for the plain variant (one FMA
    // per score), in natural-log units for the general one (scores - base first: finfo.min
    // biases), which adds the row's log2 normalizer in the same FMA.
    const float log2_unit = scale * kLog2e;
    float base[Acc::kFragM][Atom::kRowSlots], log2_norm[Acc::kFragM][Atom::kRowSlots],
        dsum[Acc::kFragM][Atom::kRowSlots];
#pragma unroll
    for (int fm = 0; fm < Acc::kFragM; ++fm)
#pragma unroll
      for (int sl = 0; sl < Atom::kRowSlots; ++sl) {
        const int r = r0 + Acc::row_of(lane, fm, sl);
        base[fm][sl] = sm.row_base[r];
        if constexpr (Cfg::kGeneral) log2_norm[fm][sl] = sm.log2_norm[r];
        dsum[fm][sl] = sm.dsum[r];
      }
    if (!kSplit || p_warp) {
      // Scores as in the forward (raw for the plain variant, scaled plus bias for the general
      // one); hidden entries -inf, so that they (and whole hidden rows, lse = -inf) get
      // probability 0.
      if constexpr (Cfg::kGeneral)
        s.for_each(lane, [&](int, int, int, int, float& x) { x *= scale; });
      if constexpr (!kWhole) vis.hide(s, lane, m0 + r0, n0 + c0);
      if constexpr (Cfg::kGeneral) {
        head.mods.apply(s, lane, m0 + r0, n0 + c0);
        head.mask.add_bias(s, lane, m0 + r0, n0 + c0, vis.len_q);
      }
      s.for_each(lane, [&](int fm, int sl, int, int, float& x) {
        if constexpr (Cfg::kGeneral) {
          x = x == neg_inf() ? 0.0f : fast_exp2(fmaf(x - base[fm][sl], kLog2e, log2_norm[fm][sl]));
        } else {
          x = fast_exp2(fmaf(x, log2_unit, -base[fm][sl]));  // 0 for -inf (base finite or +inf)
        }
      });
    }
    if constexpr (kSplit) {
      if (p_warp) store_accum_smem<Elem>(s, sm.p, Cfg::kLdN, r0, c0, lane);
      __syncthreads();
      if (p_warp) return false;
    }
    // dP's warps read P where it is, a pair of registers at a time: their own accumulator, or
    // (split) the S warps' P in shared memory, so that they hold no second tile.
    const auto ds_from_p = [&](const auto& prob_pairs) {
      const bool softcap = Cfg::kGeneral && head.mods.softcap();
      if constexpr (Cfg::kDropout) {
        // A scheduling fence: without it ptxas starts the Philox calls among the exponentials and
        // spills the mask + dropout variant (8-16 bytes at 255 registers, sm_80).
        __syncwarp();
        // With the dropout factor z = Z / (1 - p) (keep mask Z): dS = P (dP z - D), and P z is
        // what dV multiplies. One select per entry; the rest are FMA-pipe products.
        const float inv_keep = dropout.inv_keep();
        dropout.for_each_keep_pair<Atom, Acc>(
            lane, head.batch_head, m0 + r0, n0 + c0, [&](int fm, int fn, int i, bool k0, bool k1) {
              const int sl = Atom::row_slot(i);
              const float d_row = dsum[fm][sl];
              const float z[2] = {k0 ? inv_keep : 0.0f, k1 ? inv_keep : 0.0f};
              float prob[2];
              prob_pairs.get(fm, fn, i, prob);
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                float& ds = dp.c[fm][fn][i + e];
                ds = prob[e] * fmaf(ds, z[e], -d_row);
                if constexpr (Cfg::kGeneral) {
                  if (softcap) {
                    ds *= head.mods.softcap_grad(prob[e], base[fm][sl], log2_norm[fm][sl],
                                                 m0 + r0 + Acc::row_of(lane, fm, sl),
                                                 n0 + c0 + Acc::col_of(lane, fn, i + e));
                  }
                }
              }
              if constexpr (kStoreP) prob_pairs.set(fm, fn, i, prob[0] * z[0], prob[1] * z[1]);
            });
      } else {
        // f(fm, fn, i, sl, prob[2]) for each register pair and its P.
        const auto for_each_prob_pair = [&](auto&& f) {
#pragma unroll
          for (int fm = 0; fm < Acc::kFragM; ++fm)
#pragma unroll
            for (int fn = 0; fn < Acc::kFragN; ++fn)
#pragma unroll
              for (int i = 0; i < Atom::kCRegs; i += 2) {
                float prob[2];
                prob_pairs.get(fm, fn, i, prob);
                f(fm, fn, i, Atom::row_slot(i), prob);
              }
        };
        for_each_prob_pair([&](int fm, int fn, int i, int sl, const float (&prob)[2]) {
          dp.c[fm][fn][i] = prob[0] * (dp.c[fm][fn][i] - dsum[fm][sl]);
          dp.c[fm][fn][i + 1] = prob[1] * (dp.c[fm][fn][i + 1] - dsum[fm][sl]);
        });
        if constexpr (Cfg::kGeneral) {
          if (softcap) {  // dS of the scaled score: times softcap's 1 - tanh^2
            for_each_prob_pair([&](int fm, int fn, int i, int sl, const float (&prob)[2]) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                dp.c[fm][fn][i + e] *= head.mods.softcap_grad(
                    prob[e], base[fm][sl], log2_norm[fm][sl], m0 + r0 + Acc::row_of(lane, fm, sl),
                    n0 + c0 + Acc::col_of(lane, fn, i + e));
              }
            });
          }
        }
      }
    };
    if constexpr (kSplit) {
      ds_from_p(SharedPairs<Atom, Elem, Acc>{sm.p + r0 * Cfg::kLdN + c0, Cfg::kLdN, lane});
    } else {
      ds_from_p(AccumPairs<Acc>{s});
    }
    return true;
  };
  // `whole` is false unless kMayBeWhole: then only the bounded instance exists.
  if (!(whole ? scores(WholeTile<kMayBeWhole>{}) : scores(WholeTile<false>{}))) return;
  if constexpr (Cfg::kGeneral && kWriteDMask) {
    if (head.dmask != nullptr) {
      dp.for_each(lane, [&](int, int, int r, int c, float& ds) {
        const int i = m0 + r0 + r, j = n0 + c0 + c;
        if (i < vis.len_q && j < vis.len_kv) head.dmask[i * head.dmask_ld + j] = ds;
      });
    }
  }
  if constexpr (kStoreP && !kSplit) store_accum_smem<Elem>(s, sm.p, Cfg::kLdN, r0, c0, lane);
  store_accum_smem<Elem>(dp, sm.ds, Cfg::kLdN, r0, c0, lane);
}

// sum_e a[e] * b[e] over n (even) 16-bit elements in fp32, by each group of kLanes lanes of the
// warp (a pair of elements per lane and step; every lane of the warp calls it, with n = 0 where
// its group has no row); every lane of a group returns the group's sum.
template <class Elem, int kLanes = 32>
__device__ __forceinline__ float warp_row_dot(const uint16_t* a, const uint16_t* b, int64_t n,
                                              int lane) {
  float acc = 0.0f;
  for (int e = 2 * (lane % kLanes); e < n; e += 2 * kLanes) {
    const uint32_t av = *reinterpret_cast<const uint32_t*>(a + e);
    const uint32_t bv = *reinterpret_cast<const uint32_t*>(b + e);
    acc += low_float<Elem>(av) * low_float<Elem>(bv) + high_float<Elem>(av) * high_float<Elem>(bv);
  }
#pragma unroll
  for (int bit = kLanes / 2; bit > 0; bit >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, bit);
  return acc;
}

// Whether any of n (even) 16-bit values is not +-0, by the whole warp.
__device__ __forceinline__ bool warp_row_nonzero(const uint16_t* a, int64_t n, int lane) {
  bool nonzero = false;
  for (int e = 2 * lane; e < n; e += 64)
    nonzero |= (*reinterpret_cast<const uint32_t*>(a + e) & 0x7fff7fffu) != 0;
  return __any_sync(0xffffffffu, nonzero);
}

// P's base and log2 normalizer for query row i of (b, h) when its lse cannot serve: lse = max +
// log(sum) keeps log(sum) only to lse's own spacing (2^-7 from |lse| = 2^16 on, and nothing of it
// when finfo.min is on every visible key), so exp(s - lse) would sum to `sum`, not 1. Recounts
// max and sum from the row's scores, computed as the general forward does (scale, then the mask
// bias), one key at a time by the whole warp: O(S * E) per row on CUDA cores, which only such
// rows pay. Every lane gets base = max, log2_norm = -log2(sum).
template <class Elem>
__device__ __forceinline__ void recount_saturated_row(const BackwardParams& p, int64_t b,
                                                      int64_t h, int i, int lane, float& base,
                                                      float& log2_norm) {
  const ForwardParams& f = p.fwd;
  const SequenceSpan seq = batch_span(f, b);
  const BwdHead head(p, seq, b, h);
  const int64_t hk = kv_head_of(h, f.shape.heads_q, f.shape.heads_kv);
  const uint16_t* q = head_ptr(f.q, f.q_strides, b, h, seq.q_start + i);
  const float scale = static_cast<float>(f.scale);
  // Keys [key_begin, key_end) hold every key visible from row i.
  const int key_end = head.vis.key_end(i + 1);
  float row_max = neg_inf(), sum = 0.0f;
  for (int j = head.vis.key_begin(i); j < key_end; ++j) {
    if (!head.vis.visible(i, j)) continue;
    float s = warp_row_dot<Elem>(q, head_ptr(f.k, f.k_strides, b, hk, seq.k_start + j),
                                 f.shape.head_dim, lane) * scale;
    s = head.mods.apply(s, i, j);
    if (head.mask.reads) s += head.mask.bias(i, j);
    if (s == neg_inf()) continue;  // dropped by the mask
    const float new_max = fmaxf(row_max, s);
    sum = sum * fast_exp2((row_max - new_max) * kLog2e) + fast_exp2((s - new_max) * kLog2e);
    row_max = new_max;
  }
  base = row_max;
  log2_norm = -log2f(sum);
}

// The atomic path's dQ workspace (DqWorkspace below) as rows of `row_floats` floats,
// `padded_len_q` per (batch, head): the D pre-pass zeroes it, so it needs no fill launch of its
// own (as FlashAttention-2 does). `floats` is null in the deterministic path, and the rows are
// then the queries themselves (padded_len_q = len_q).
struct DqWorkspaceRows {
  float* floats;
  int64_t padded_len_q;
  int row_floats;
};

// D[b, h, i] = sum_e dO[i, e] * O[i, e] in fp32 of query row i < seq.len_q of (b, h), by one
// warp. The general variant also writes the row's P base and log2 normalizer (p.row_base,
// p.row_log2_norm): lse and 0, or recounted for rows with finite |lse| >= 2^16 whose dO is not 0
// (with dO = 0, P does not reach any gradient). The plain variant's scores are never biased that
// far: it skips all of that.
template <class Elem, bool kGeneral>
__device__ __forceinline__ void write_row_vectors(const BackwardParams& p,
                                                  const RowVectorSlots& out,
                                                  const SequenceSpan& seq, int64_t b, int64_t h,
                                                  int i, int lane) {
  const ForwardParams& f = p.fwd;
  const uint16_t* g = head_ptr(p.dout, p.dout_strides, b, h, seq.q_start + i);
  const float d_row = warp_row_dot<Elem>(head_ptr(f.out, f.out_strides, b, h, seq.q_start + i), g,
                                         f.shape.head_dim, lane);
  if (lane == 0) *out.dsum = d_row;
  if constexpr (!kGeneral) return;
  float base = f.lse[lse_index(f, seq, b, h, i)], log2_norm = 0.0f;
  if (fabsf(base) >= kSaturatedLse && fabsf(base) != pos_inf() &&
      warp_row_nonzero(g, f.shape.head_dim, lane)) {
    recount_saturated_row<Elem>(p, b, h, i, lane, base, log2_norm);
  }
  if (lane == 0) {
    *out.base = base;
    *out.log2_norm = log2_norm;
  }
}

// The D pre-pass: write_row_vectors with one warp per row, padded to the dQ workspace's rows when
// there is one (each warp zeroes its workspace row).
template <class Elem, bool kGeneral>
__global__ void __launch_bounds__(128)
    flash_bwd_dsum_kernel(const BackwardParams p, float* dsum, const DqWorkspaceRows dq_ws) {
  const ForwardParams& f = p.fwd;
  const int lane = threadIdx.x & 31;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int64_t bh = slot / dq_ws.padded_len_q, i = slot % dq_ws.padded_len_q;
  if (bh >= f.shape.batch * f.shape.heads_q) return;
  if (dq_ws.floats != nullptr) {
    float4* ws_row = reinterpret_cast<float4*>(dq_ws.floats + slot * dq_ws.row_floats);
    for (int c = lane; c < dq_ws.row_floats / 4; c += 32) ws_row[c] = make_float4(0, 0, 0, 0);
  }
  const int64_t b = bh / f.shape.heads_q, h = bh % f.shape.heads_q;
  const SequenceSpan seq = batch_span(f, b);
  if (i >= seq.len_q) return;  // past this sequence's end (varlen), or a padded row
  const int64_t row = row_vector_index(f, b, h, i);
  const RowVectorSlots out{dsum + row, kGeneral ? p.row_base + row : nullptr,
                           kGeneral ? p.row_log2_norm + row : nullptr};
  write_row_vectors<Elem, kGeneral>(p, out, seq, b, h, static_cast<int>(i), lane);
}

// The fp32 dQ workspace of the atomic path, laid out the way the dK/dV kernel's warps hold dQ:
// per (batch * head, query tile, head-dim chunk of kDqCols, warp), the warp's accumulator
// registers one after another, each as 32 consecutive floats (one per lane), so that every
// atomic instruction of a warp covers 128 contiguous bytes. Unscaled; query tiles are padded.
template <class Atom, class Cfg>
struct DqWorkspace {
  using Acc = WarpAccum<Atom, Cfg::kQRows, Cfg::kQCols>;
  static constexpr int kWarpFloats = Acc::kFragM * Acc::kFragN * Atom::kCRegs * 32;
  static constexpr int kTileFloats = Cfg::kHeadDim / Cfg::kDqCols * Cfg::kWarps * kWarpFloats;
  static_assert(kTileFloats == Cfg::kBlockM * Cfg::kHeadDim, "dQ warps must tile the query tile");

  static __host__ __device__ int64_t query_tiles(int64_t len_q) {
    return (len_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  }
  static __host__ __device__ int64_t floats(int64_t batch_heads, int64_t len_q) {
    return batch_heads * query_tiles(len_q) * kTileFloats;
  }
  static __host__ __device__ DqWorkspaceRows rows(float* ws, int64_t len_q) {
    return {ws, query_tiles(len_q) * Cfg::kBlockM, Cfg::kHeadDim};
  }
  // The first register of `lane` of `warp` for query tile m0 / kBlockM and head-dim chunk `chunk`.
  template <class Float>
  static __device__ __forceinline__ Float* lane_tile(Float* ws, int64_t batch_head, int len_q,
                                                     int m0, int chunk, int warp, int lane) {
    const int64_t tile = batch_head * query_tiles(len_q) + m0 / Cfg::kBlockM;
    return ws + tile * kTileFloats +
           static_cast<int64_t>(chunk * Cfg::kWarps + warp) * kWarpFloats + lane;
  }
  // f(fm, fn, i, offset of register (fm, fn, i) from the lane's first one): compile-time offsets,
  // so that each access is an immediate offset of one address.
  template <class F>
  static __device__ __forceinline__ void for_each_slot(F&& f) {
#pragma unroll
    for (int fm = 0; fm < Acc::kFragM; ++fm)
#pragma unroll
      for (int fn = 0; fn < Acc::kFragN; ++fn)
#pragma unroll
        for (int i = 0; i < Atom::kCRegs; ++i)
          f(fm, fn, i, ((fm * Acc::kFragN + fn) * Atom::kCRegs + i) * 32);
  }
};

// The work of a (key tile, batch, kv head) split over `count` blocks, where one block would leave
// SMs idle (few kv heads, short sequences) or a causal band's longest blocks 'group' times longer
// than one head's: count / row_parts parts of the GQA group's query heads, each cut into
// `row_parts` interleaved shares of its query tiles (the launcher cuts them for the one-key-tile
// kernel only, kDqDirect: a query tile's whole dQ is then one block's, and the fp32 slabs below
// are one key tile). Part s = head part * row_parts + row share writes its dK (scaled) and dV in
// fp32 to slab s of `dk` / `dv`, each [count, B * Hkv, len_kv, head_dim];
// flash_bwd_dkdv_reduce_kernel sums the slabs in part order (deterministic, as the unsplit kernel
// is). count 1: dK, dV written straight to p.dk, p.dv.
struct KvGroupSplit {
  int count;
  int row_parts;
  float* dk;
  float* dv;
};

// The split of `blocks` (key tile, batch, kv head) blocks (kern::KvGroupSplit) over `sm_count`
// SMs. Parts of the GQA group: the fewest, dividing the group, that give the dK/dV grid kWaves
// waves of one block per SM, else the whole group. Parts cost a round trip of fp32 dK/dV through
// global memory, whose bytes grow with the grid and not with the work: grids that already fill
// the GPU keep one part. Then, where each block has one key tile (`query_tiles` query tiles, else
// 0), shares of the query tiles until the grid fills the SMs once: a short sequence's few heads
// otherwise run their steps one after another on a few SMs.
__host__ __device__ inline KvGroupSplit dkdv_split(int64_t group, int64_t blocks,
                                                   int64_t query_tiles, int sm_count) {
  constexpr int64_t kWaves = 4;
  int head_parts = 1;
  while (head_parts < group && blocks * head_parts < kWaves * sm_count) {
    do {
      ++head_parts;
    } while (group % head_parts != 0);
  }
  int64_t row_parts = 1;
  while (row_parts < query_tiles && blocks * head_parts * row_parts < sm_count) ++row_parts;
  // As many shares as split_share fills: none left empty.
  const int64_t tiles_per_share = (query_tiles + row_parts - 1) / row_parts;
  if (row_parts > 1) row_parts = (query_tiles + tiles_per_share - 1) / tiles_per_share;
  return {head_parts * static_cast<int>(row_parts), static_cast<int>(row_parts), nullptr, nullptr};
}

// Whether Cfg's dK/dV grid over `len_kv` keys has one key tile: then one block per (batch, kv
// head, group part) visits each of its query tiles once and writes dQ itself (kDqDirect).
template <class Cfg>
__host__ __device__ constexpr bool has_one_key_tile(int64_t len_kv) {
  return 0 < len_kv && len_kv <= Cfg::kBlockN;
}

// kDqDirect: rows [r_begin, r_end) of query head h that no step of the dK/dV kernel visits (no key
// is visible to them) get dQ = 0, as the zeroed workspace of the atomic path leaves them.
template <int kThreads>
__device__ __forceinline__ void zero_dq_rows(const BackwardParams& p, const SequenceSpan& seq,
                                             int64_t b, int64_t h, int r_begin, int r_end,
                                             int tid) {
  const int d = static_cast<int>(p.fwd.shape.head_dim);
  for (int i = tid; i < (r_end - r_begin) * d; i += kThreads) {
    head_ptr(p.dq, p.dq_strides, b, h, seq.q_start + r_begin + i / d)[i % d] = 0;
  }
}
// Whether the kDqDirect dK/dV kernel computes the row vectors itself over `len_q` queries and
// GQA groups of `group` heads (DirectRowVectors): where they fit its BwdConfig::kDirectRows.
template <class Cfg>
__host__ __device__ inline bool dkdv_computes_row_vectors(int64_t group, int64_t len_q) {
  return group * len_q <= Cfg::kDirectRows;
}

// D of query rows [r_begin, r_end) of (b, h) into dsum[i] (write_row_vectors' D, the only row
// vector the plain variant computes), by warps of kThreads threads: kDotLanes lanes a row.
template <class Elem, int kThreads>
__device__ __forceinline__ void write_dsum_rows(const BackwardParams& p, float* dsum,
                                                const SequenceSpan& seq, int64_t b, int64_t h,
                                                int r_begin, int r_end, int tid) {
  const ForwardParams& f = p.fwd;
  constexpr int kRowsAtOnce = kThreads / kDotLanes;
  for (int r0 = r_begin; r0 < r_end; r0 += kRowsAtOnce) {
    const int i = r0 + tid / kDotLanes;
    const int64_t q_row = seq.q_start + min(i, r_end - 1);  // rows past r_end add nothing
    const float d_row = warp_row_dot<Elem, kDotLanes>(
        head_ptr(f.out, f.out_strides, b, h, q_row),
        head_ptr(p.dout, p.dout_strides, b, h, q_row), i < r_end ? f.shape.head_dim : 0, tid % 32);
    if (i < r_end && tid % kDotLanes == 0) dsum[i] = d_row;
  }
}

// dK, dV for key tile blockIdx.x of (batch, kv head, part of its GQA group: KvGroupSplit)
// blockIdx.y, and dQ: with kDqDirect (where the grid has one key tile, so that one block visits
// each of its heads' query tiles once and computes their whole dQ) written to p.dq as Elem, no
// convert or dQ kernel after it, and with `computes_row_vectors` (dkdv_computes_row_vectors) the
// rows' D too, into shared memory (DirectRowVectors, in place of the D pre-pass) while the first
// step's Q and dO load: the backward of a short sequence is then one launch, where launches take
// most of its time. Otherwise dQ is added by fp32
// atomics into dq_accum (a DqWorkspace), or not at all (null: the deterministic dQ kernel computes
// it). (The two as one struct parameter made ptxas spill the wide sm_80 kernels.) kVariant: see
// configs.cuh; kQStages: query-side buffers, kSize: the tile (BwdConfig). One block per SM is
// enough: the tiles are sized to the registers, and without it ptxas may trade spills for a
// second block.
template <class Atom, class Elem, int kHeadDim, Variant kVariant, int kQStages = 1,
          BwdTileSize kSize = BwdTileSize::kCompact, bool kDqDirect = false>
__global__ void __launch_bounds__(BwdConfig<Atom, kHeadDim, kVariant, kQStages, kSize>::kThreads, 1)
    flash_bwd_dkdv_kernel(const BackwardParams p, float* dsum, float* dq_accum,
                          const KvGroupSplit split, bool computes_row_vectors) {
  using Cfg = BwdConfig<Atom, kHeadDim, kVariant, kQStages, kSize>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kLdE = Cfg::kLdE;
  extern __shared__ uint4 smem_raw[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const ForwardParams& f = p.fwd;
  const int n0 = blockIdx.x * kBlockN;
  const int64_t bh = blockIdx.y / split.count, part = blockIdx.y % split.count;
  const int64_t b = bh / f.shape.heads_kv, hk = bh % f.shape.heads_kv;
  // The part's heads [head_begin, head_end) and its share of their query tiles.
  const int row_part = static_cast<int>(part % split.row_parts);
  const bool first_row_part = row_part == 0, last_row_part = row_part + 1 == split.row_parts;
  const int64_t group = f.shape.heads_q / f.shape.heads_kv;
  const int64_t part_heads = group * split.row_parts / split.count;
  const int head_begin = static_cast<int>(hk * group + part / split.row_parts * part_heads);
  const int head_end = head_begin + static_cast<int>(part_heads);
  const SequenceSpan seq = batch_span(f, b);
  if (n0 >= seq.len_kv) {  // past this sequence's end (varlen)
    if (kDqDirect && first_row_part) {  // no key at all: the part's heads get dQ = 0
      for (int h = head_begin; h < head_end; ++h) {
        zero_dq_rows<Cfg::kThreads>(p, seq, b, h, 0, static_cast<int>(seq.len_q), tid);
      }
    }
    return;
  }
  const Visibility vis(f, seq);
  const int d = static_cast<int>(f.shape.head_dim);
  const int k_extent = round_up(d, Atom::kK), n_extent = round_up(d, Atom::kN);
  const float scale = static_cast<float>(f.scale);
  const Dropout dropout(f.dropout);

  load_key_side<Atom>(BwdSmem<Cfg>(smem_raw, 0), p, head_ptr(f.k, f.k_strides, b, hk, seq.k_start),
                      head_ptr(f.v, f.v_strides, b, hk, seq.k_start), vis.len_kv, n0, tid);

  using KVAcc = WarpAccum<Atom, Cfg::kKVRows, Cfg::kKVCols>;
  const int kv_r0 = (warp / Cfg::kWarpsNKV) * Cfg::kKVRows;
  const int kv_c0 = (warp % Cfg::kWarpsNKV) * Cfg::kKVCols;
  KVAcc dk, dv;
  dk.zero();
  dv.zero();

  using DqWs = DqWorkspace<Atom, Cfg>;
  using QAcc = typename DqWs::Acc;
  const int q_r0 = (warp / Cfg::kWarpsNQ) * Cfg::kQRows;

  // Steps: the query tiles that can see this key tile (its causal/window band [row_begin,
  // row_end)), head by head over the block's part of the GQA group; heads whose padding mask drops
  // every key of this tile are skipped whole. Row share r takes the band's tiles r, r + row_parts,
  // ... (interleaved: a causal band's tiles differ in length). The walk advances by increments: a
  // division per step cost more than its step's bookkeeping.
  const int row_begin = vis.row_begin(n0) / kBlockM * kBlockM;
  const int row_end = vis.row_end(min(n0 + kBlockN, vis.len_kv));
  const int share_begin = row_begin + row_part * kBlockM, share_step = split.row_parts * kBlockM;
  const auto active_head = [&](int h) {
    while (h < head_end && n0 >= HeadMask(f.mask, b, h, f.shape.heads_q).key_end) ++h;
    return h;
  };
  int h = share_begin < row_end ? active_head(head_begin) : head_end;
  int m0 = share_begin;
  int stage = 0;  // the query-side buffer of this step
  QueryRowVectors<Cfg> rows;
  const bool direct_rows = kDqDirect && computes_row_vectors;
  const DirectRowVectors<Cfg> direct(smem_raw, seq.len_q, head_begin);
  if (h < head_end) {  // with direct_rows, loading while the row vectors are computed
    load_query_side<Atom>(BwdSmem<Cfg>(smem_raw, stage), rows, p, dsum, seq, b, h, m0, tid,
                          direct_rows);
  }
  if constexpr (kDqDirect) {
    // The steps' rows: whole query tiles from row_begin while they start before row_end, of the
    // heads active_head does not skip. The row vectors of the share's tiles (direct_rows: the D
    // pre-pass's work) are written before any step takes them; the rows outside the band's
    // steps get dQ = 0 from the first and last row share.
    const int steps_begin = min(row_begin, vis.len_q);
    const int steps_end = row_begin < row_end
                              ? min(vis.len_q, row_begin + round_up(row_end - row_begin, kBlockM))
                              : steps_begin;
    for (int hq = head_begin; hq < head_end; ++hq) {
      const bool stepped = active_head(hq) == hq;
      if (first_row_part) {
        zero_dq_rows<Cfg::kThreads>(p, seq, b, hq, 0, stepped ? steps_begin : vis.len_q, tid);
      }
      if (!stepped) continue;
      if (last_row_part) zero_dq_rows<Cfg::kThreads>(p, seq, b, hq, steps_end, vis.len_q, tid);
      if (!direct_rows) continue;
      for (int t0 = share_begin; t0 < steps_end; t0 += share_step) {
        const int t1 = min(t0 + kBlockM, steps_end);
        if constexpr (Cfg::kGeneral) {
          for (int i = t0 + warp; i < t1; i += Cfg::kThreads / 32) {
            write_row_vectors<Elem, true>(p, direct.slots(hq, i), seq, b, hq, i, lane);
          }
        } else {
          write_dsum_rows<Elem, Cfg::kThreads>(p, direct.dsum + direct.index(hq, 0), seq, b, hq,
                                               t0, t1, tid);
        }
      }
    }
    __syncthreads();
  }
  while (h < head_end) {
    int next_h = h, next_m0 = m0 + share_step;
    if (next_m0 >= row_end) {  // the share's first tile again (kept in no register)
      next_h = active_head(h + 1);
      next_m0 = row_begin + (m0 - row_begin) % share_step;
    }
    const BwdHead head(p, seq, b, h);
    const BwdSmem<Cfg> sm(smem_raw, stage);
    const int next_stage = (stage + 1) % kQStages;
    const auto load_next_query_side = [&] {
      if (next_h < head_end) {
        load_query_side<Atom>(BwdSmem<Cfg>(smem_raw, next_stage), rows, p, dsum, seq, b, next_h,
                              next_m0, tid, direct_rows);
      }
    };
    cp_async_wait_all();
    if (direct_rows) rows.take_direct(direct, seq, h, m0, tid);
    // The row vectors have one buffer: the last step read them before its second barrier.
    rows.commit(sm, tid);
    // This step's Q, dO, lse, D landed; the last step's P, dS and query-side buffer are consumed.
    __syncthreads();
    // Two buffers: the next step's query side loads during this whole step.
    if constexpr (kQStages == 2) load_next_query_side();
    compute_p_ds<Atom, Elem, Cfg, true, true>(sm, head, dropout, scale, k_extent, m0, n0, warp,
                                              lane);
    __syncthreads();
    // dV += P^T dO and dK += dS^T Q: reductions over the tile's query rows (none for warps whose
    // key rows are all past the last key: their dK and dV are not stored).
    if (kv_r0 < vis.len_kv - n0) {
      warp_gemm<Atom, Elem, kBlockM>(dv, MMajor{sm.p + kv_r0, Cfg::kLdN},
                                     MMajor{sm.dout + kv_c0, kLdE}, kBlockM, n_extent - kv_c0,
                                     lane);
      warp_gemm<Atom, Elem, kBlockM>(dk, MMajor{sm.ds + kv_r0, Cfg::kLdN},
                                     MMajor{sm.q + kv_c0, kLdE}, kBlockM, n_extent - kv_c0, lane);
    }
    // One buffer: the next step's query side loads while dQ = dS K is computed (it reads only dS
    // and K), once every warp is done with this step's Q and dO.
    if constexpr (kQStages == 1) {
      __syncthreads();
      load_next_query_side();
    }
    if (kDqDirect || dq_accum != nullptr) {
      for (int e0 = 0; e0 < n_extent; e0 += Cfg::kDqCols) {
        const int q_c0 = e0 + (warp % Cfg::kWarpsNQ) * Cfg::kQCols;
        QAcc dq;
        dq.zero();
        warp_gemm<Atom, Elem, kBlockN>(dq, KMajor{sm.ds + q_r0 * Cfg::kLdN, Cfg::kLdN},
                                       MMajor{sm.k + q_c0, kLdE}, kBlockN, n_extent - q_c0, lane);
        if constexpr (kDqDirect) {
          const int64_t q_row = seq.q_start + m0 + q_r0;
          store_accum_global<Elem>(dq, head_ptr(p.dq, p.dq_strides, b, h, q_row) + q_c0,
                                   p.dq_strides.row, vis.len_q - m0 - q_r0, d - q_c0, lane,
                                   [&](int, int) { return scale; });
        } else {
          float* dst = DqWs::lane_tile(dq_accum, b * f.shape.heads_q + h, f.shape.len_q, m0,
                                       e0 / Cfg::kDqCols, warp, lane);
          // Columns past d only where the warp's columns reach past it: one uniform branch, not
          // a divergence region per atomic.
          const auto add = [&](auto checked) {
            DqWs::for_each_slot([&](int fm, int fn, int i, int slot) {
              if (!decltype(checked)::value || q_c0 + QAcc::col_of(lane, fn, i) < d)
                atomicAdd(dst + slot, dq.c[fm][fn][i]);
            });
          };
          if (q_c0 + Cfg::kQCols <= d) {
            add(BoundsChecked<false>{});
          } else {
            add(BoundsChecked<true>{});
          }
        }
      }
    }
    h = next_h;
    m0 = next_m0;
    stage = next_stage;
  }
  cp_async_wait_all();  // K and V when no query tile sees this key tile

  const int rows_valid = vis.len_kv - n0 - kv_r0;
  const auto dk_scale = [&](int, int) { return scale; };
  const auto dv_scale = [](int, int) { return 1.0f; };
  if (split.count == 1) {
    const int64_t k_row = batch_span(f, b).k_start + n0 + kv_r0;  // not kept over the loop
    store_accum_global<Elem>(dk, head_ptr(p.dk, p.dk_strides, b, hk, k_row) + kv_c0,
                             p.dk_strides.row, rows_valid, d - kv_c0, lane, dk_scale);
    store_accum_global<Elem>(dv, head_ptr(p.dv, p.dv_strides, b, hk, k_row) + kv_c0,
                             p.dv_strides.row, rows_valid, d - kv_c0, lane, dv_scale);
  } else {
    const int64_t slab_row =
        (part * f.shape.batch * f.shape.heads_kv + bh) * f.shape.len_kv + n0 + kv_r0;
    store_accum_global_f32(dk, split.dk + slab_row * d + kv_c0, d, rows_valid, d - kv_c0, lane,
                           dk_scale);
    store_accum_global_f32(dv, split.dv + slab_row * d + kv_c0, d, rows_valid, d - kv_c0, lane,
                           dv_scale);
  }
}

// dK, dV of a split GQA group (KvGroupSplit): the parts' slabs summed in part order, converted to
// Elem and written with dk's / dv's strides: two columns a thread; grid row blockIdx.y is a
// (batch, kv head), its kDkdvReduceThreads-thread blocks (dkdv_reduce_blocks of them) cover that
// head's rows.
constexpr int kDkdvReduceThreads = 256;
__host__ __device__ inline int64_t dkdv_reduce_blocks(int64_t len_kv, int64_t head_dim) {
  return (len_kv * head_dim / 2 + kDkdvReduceThreads - 1) / kDkdvReduceThreads;
}
template <class Elem>
__global__ void __launch_bounds__(kDkdvReduceThreads)
    flash_bwd_dkdv_reduce_kernel(const BackwardParams p, const KvGroupSplit split) {
  const ForwardParams& f = p.fwd;
  const int64_t bh = blockIdx.y, b = bh / f.shape.heads_kv, hk = bh % f.shape.heads_kv;
  const int d = static_cast<int>(f.shape.head_dim);
  // 32-bit: a 64-bit division is a called subroutine (its saved registers spill on sm_80); the
  // launcher keeps len_kv * head_dim / 2 within int.
  const int pair = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int row = pair / (d / 2);
  const int c = (pair - row * (d / 2)) * 2;
  const SequenceSpan seq = batch_span(f, b);
  if (row >= seq.len_kv) return;  // past this sequence's end: never written by the parts
  const int64_t slab = f.shape.batch * f.shape.heads_kv * f.shape.len_kv * d;
  const float* dk_part = split.dk + (bh * f.shape.len_kv + row) * d + c;
  const float* dv_part = split.dv + (bh * f.shape.len_kv + row) * d + c;
  float2 dk = make_float2(0.0f, 0.0f), dv = make_float2(0.0f, 0.0f);
  for (int s = 0; s < split.count; ++s) {
    const float2 k = *reinterpret_cast<const float2*>(dk_part + s * slab);
    const float2 v = *reinterpret_cast<const float2*>(dv_part + s * slab);
    dk.x += k.x;
    dk.y += k.y;
    dv.x += v.x;
    dv.y += v.y;
  }
  const int64_t k_row = seq.k_start + row;
  *reinterpret_cast<uint32_t*>(head_ptr(p.dk, p.dk_strides, b, hk, k_row) + c) =
      pack2<Elem>(dk.x, dk.y);
  *reinterpret_cast<uint32_t*>(head_ptr(p.dv, p.dv_strides, b, hk, k_row) + c) =
      pack2<Elem>(dv.x, dv.y);
}

// Deterministic dQ: query tile blockIdx.x of (batch, head) blockIdx.y, looping over key tiles.
// The general variants (above 128 registers on Volta anyway) and emulated atoms ask for one block
// per SM: else ptxas may spill them to fit two (the Volta head-dim-64 dropout variant on sm_80).
template <class Atom, class Elem, int kHeadDim, Variant kVariant,
          BwdTileSize kSize = BwdTileSize::kCompact>
__global__ void __launch_bounds__(BwdConfig<Atom, kHeadDim, kVariant, 1, kSize>::kThreads,
                                  is_general(kVariant) || runs_emulated<Atom>() ? 1 : 0)
    flash_bwd_dq_kernel(const BackwardParams p, const float* dsum) {
  using Cfg = BwdConfig<Atom, kHeadDim, kVariant, 1, kSize>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  extern __shared__ uint4 smem_raw[];
  const BwdSmem<Cfg> sm(smem_raw, 0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const ForwardParams& f = p.fwd;
  const int d = static_cast<int>(f.shape.head_dim);
  const int k_extent = round_up(d, Atom::kK), n_extent = round_up(d, Atom::kN);
  const float scale = static_cast<float>(f.scale);
  const Dropout dropout(f.dropout);
  const int m0 = blockIdx.x * kBlockM;
  const int64_t b = blockIdx.y / f.shape.heads_q, h = blockIdx.y % f.shape.heads_q;
  const SequenceSpan seq = batch_span(f, b);
  if (m0 >= seq.len_q) return;  // past this sequence's end (varlen)
  const int64_t hk = kv_head_of(h, f.shape.heads_q, f.shape.heads_kv);
  const BwdHead head(p, seq, b, h);

  QueryRowVectors<Cfg> rows;
  load_query_side<Atom>(sm, rows, p, dsum, seq, b, h, m0, tid);
  rows.commit(sm, tid);  // published by the first key tile's barriers
  const uint16_t* k_head = head_ptr(f.k, f.k_strides, b, hk, seq.k_start);
  const uint16_t* v_head = head_ptr(f.v, f.v_strides, b, hk, seq.k_start);

  using QAcc = WarpAccum<Atom, Cfg::kQRows, Cfg::kQColsFull>;
  const int q_r0 = (warp / Cfg::kWarpsNQ) * Cfg::kQRows;
  const int q_c0 = (warp % Cfg::kWarpsNQ) * Cfg::kQColsFull;
  QAcc dq;
  dq.zero();
  // The key tiles of this query tile's causal/window band (dropout needs them aligned).
  const int key_begin = head.vis.key_begin(m0) / kBlockN * kBlockN;
  const int key_end = head.vis.key_end(m0 + kBlockM);
  for (int n0 = key_begin; n0 < key_end; n0 += kBlockN) {
    __syncthreads();  // the previous K/V/dS tile is fully consumed
    load_key_side<Atom>(sm, p, k_head, v_head, head.vis.len_kv, n0, tid);
    cp_async_wait_all();
    __syncthreads();
    compute_p_ds<Atom, Elem, Cfg, false, false>(sm, head, dropout, scale, k_extent, m0, n0, warp,
                                                lane);
    __syncthreads();
    warp_gemm<Atom, Elem, kBlockN>(dq, KMajor{sm.ds + q_r0 * Cfg::kLdN, Cfg::kLdN},
                                   MMajor{sm.k + q_c0, Cfg::kLdE}, kBlockN, n_extent - q_c0, lane);
  }
  cp_async_wait_all();  // Q and dO when no key is visible
  const int64_t q_row = batch_span(f, b).q_start + m0 + q_r0;  // not kept over the loop
  store_accum_global<Elem>(dq, head_ptr(p.dq, p.dq_strides, b, h, q_row) + q_c0,
                           p.dq_strides.row, head.vis.len_q - m0 - q_r0, d - q_c0, lane,
                           [&](int, int) { return scale; });
}

// dq = scale * dq_accum (a DqWorkspace), converted to Elem and written with dq's strides: query
// tile blockIdx.x of (batch, head) blockIdx.y, each warp reading back the registers it added.
template <class Atom, class Elem, int kHeadDim, Variant kVariant,
          BwdTileSize kSize = BwdTileSize::kCompact>
__global__ void __launch_bounds__(BwdConfig<Atom, kHeadDim, kVariant, 1, kSize>::kThreads)
    flash_bwd_dq_convert_kernel(const BackwardParams p, const float* dq_accum) {
  using Cfg = BwdConfig<Atom, kHeadDim, kVariant, 1, kSize>;
  using DqWs = DqWorkspace<Atom, Cfg>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const ForwardParams& f = p.fwd;
  const int len_q = static_cast<int>(f.shape.len_q), d = static_cast<int>(f.shape.head_dim);
  const int m0 = blockIdx.x * Cfg::kBlockM;
  const int64_t b = blockIdx.y / f.shape.heads_q, h = blockIdx.y % f.shape.heads_q;
  const SequenceSpan seq = batch_span(f, b);
  if (m0 >= seq.len_q) return;  // past this sequence's end (varlen)
  const int q_r0 = (warp / Cfg::kWarpsNQ) * Cfg::kQRows;
  const float scale = static_cast<float>(f.scale);
  for (int e0 = 0; e0 < round_up(d, Atom::kN); e0 += Cfg::kDqCols) {
    const int q_c0 = e0 + (warp % Cfg::kWarpsNQ) * Cfg::kQCols;
    const float* src = DqWs::lane_tile(dq_accum, blockIdx.y, len_q, m0, e0 / Cfg::kDqCols, warp,
                                       lane);
    typename DqWs::Acc dq;
    DqWs::for_each_slot([&](int fm, int fn, int i, int slot) { dq.c[fm][fn][i] = src[slot]; });
    store_accum_global<Elem>(dq, head_ptr(p.dq, p.dq_strides, b, h, seq.q_start + m0 + q_r0) + q_c0,
                             p.dq_strides.row, static_cast<int>(seq.len_q) - m0 - q_r0,
                             d - q_c0, lane,
                             [&](int, int) { return scale; });
  }
}

}  // namespace kern
}  // namespace flashv100
