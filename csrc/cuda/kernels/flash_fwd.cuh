// FlashAttention-2 forward: one block per (query tile, batch*head). Q stays in shared memory, K/V
// tiles stream through it; S and the fp32 O accumulator live in registers, the online softmax runs
// in fp32 on the accumulator map. P becomes the A operand of P.V in registers where the atom's
// layouts allow it (kAccumIsA), else through a warp-private shared tile (Volta). K and V are
// stored as they come (rows of keys); each atom reads V as the B operand in its own way
// (ldmatrix.trans, or Volta's row-major B fragments). Loads are issued one stage ahead: V of a
// tile while S is computed, K of the next tile while P.V runs (asynchronous with cp.async; on
// Volta the same order, synchronous);
// tiles with two K/V buffers (configs.cuh, kKVStages) load the next tile's K and V while the
// current one is computed. Key-split tiles (the decode tile, kKeyWarps): each warp takes a slice of
// every key tile for the same rows, and the warps' partial rows are merged at the end as split-KV
// partials are (max, rescaled sums), through shared memory.
// The attn_mask bias is added to the scores and dropout is applied to P after the row sums (the
// softmax normalizes undropped P). Scores stay in natural-log units until exponentiation so that
// finfo.min biases cannot overflow. Packed (varlen) batches: the grid covers the longest sequence
// and the tiles past a sequence's end exit at once. Only the key tiles that the causal/window band
// of the block's rows reaches are loaded and multiplied. KV caches (KVCacheParams): a sequence's
// rows of a batch-indexed cache, or of pages (kPaged: rows addressed through the block table, one
// index read per row of a tile). Split-KV (SplitKVParams): blockIdx.z takes its share of the key
// tiles and writes a normalized fp32 partial out and its lse for the combine kernel. The decode
// tile may append the step's new K/V rows to the cache first (KVNewRows).
#pragma once

#include "cuda/kernels/attention_common.cuh"
#include "cuda/kernels/kvcache.cuh"
#include "cuda/kernels/tile_io.cuh"

namespace flashv100 {
namespace kern {

// The online softmax moves a row's running max only when a tile's max passes it by more than this
// many doublings of P (flash_fwd_kernel).
constexpr float kLazyRescaleLog2 = 8.0f;

// kVariant: with or without attn_mask, with or without dropout (configs.cuh). kPaged: K/V in a
// paged KV cache (FwdConfig::min_blocks). kShape: the prefill or the decode tile (configs.cuh).
template <class Atom, class Elem, int kHeadDim, Variant kVariant, bool kPaged = false,
          FwdShape kShape = FwdShape::kPrefill>
__global__ void __launch_bounds__(FwdConfig<Atom, kHeadDim, kVariant, kShape, kPaged>::kThreads,
                                  FwdConfig<Atom, kHeadDim, kVariant, kShape, kPaged>::min_blocks())
    flash_fwd_kernel(const ForwardParams p) {
  using Cfg = FwdConfig<Atom, kHeadDim, kVariant, kShape, kPaged>;
  constexpr bool kGeneral = Cfg::kGeneral, kDropout = Cfg::kDropout;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kWarpRows = Cfg::kWarpRows, kWarpKeys = Cfg::kWarpKeys;
  constexpr int kKeyWarps = Cfg::kKeyWarps, kStages = Cfg::kKVStages;
  constexpr bool kSwizzled = Cfg::kSwizzledQKV;
  using QKOperand = SmemOperand<true, kSwizzled>;  // Q and K, rows of the head dim
  using VOperand = SmemOperand<false, kSwizzled>;
  using SAcc = WarpAccum<Atom, kWarpRows, kWarpKeys>;
  using OAcc = WarpAccum<Atom, kWarpRows, kHeadDim>;
  constexpr int kFragM = SAcc::kFragM, kSlots = Atom::kRowSlots;

  extern __shared__ uint4 smem_raw[];
  uint16_t* smem = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* sQ = smem + Cfg::kQOffset;
  uint16_t* sK = smem + Cfg::kKOffset;
  uint16_t* sV = smem + Cfg::kVOffset;
  uint16_t* sP = smem + Cfg::kPOffset;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const AttentionShape& shape = p.shape;
  const int d = static_cast<int>(shape.head_dim);
  const int m0 = blockIdx.x * kBlockM;
  const int warp_row0 = warp / kKeyWarps * kWarpRows;
  const int key_warp = warp % kKeyWarps, warp_key0 = key_warp * kWarpKeys;  // in each key tile
  const int64_t b = blockIdx.y / shape.heads_q, h = blockIdx.y % shape.heads_q;
  const KVCacheParams& cache = p.kvcache;
  // The row's address is computed again for page_table below: kept live from here, it spilled
  // (sm_80, head-dim-128 paged decode kernel at its 168-register bound).
  TableHead table_head;
  if constexpr (kPaged) {
    const int32_t* const row = cache.block_table + b * cache.block_table_stride;
    table_head.load(row, cache.block_table_cols, lane);
    prefetch_table_row<kThreads>(row, cache.block_table_cols, tid);
  }
  write_rng_state(p.dropout);
  const SequenceSpan seq = sequence_span(p, b);
  if (m0 >= seq.len_q) return;  // past this sequence's end (varlen)
  const int64_t hk = kv_head_of(h, shape.heads_q, shape.heads_kv);
  // Contiguous K/V rows start at one head pointer (a KV cache's batch is cache.batch_idx[b]);
  // paged ones at the head's rows of page 0, which PagedRows offsets.
  const int64_t kv_b = kPaged ? 0 : cache.batch_idx != nullptr ? cache.batch_idx[b] : b;
  const int64_t kv_row0 = kPaged ? 0 : seq.k_start;
  const uint16_t* k_head = head_ptr(p.k, p.k_strides, kv_b, hk, kv_row0);
  const uint16_t* v_head = head_ptr(p.v, p.v_strides, kv_b, hk, kv_row0);
  const int32_t* const page_table =
      kPaged ? cache.block_table + b * cache.block_table_stride : nullptr;
  const int first_row = static_cast<int>(seq.k_start);
  const FastDivmod page_size =
      kPaged ? FastDivmod(static_cast<int>(cache.page_size)) : FastDivmod();
  const auto paged_rows = [=](const uint16_t* head, const TensorStrides& st, int n0) {
    return PagedRows{head, page_table, st.batch, st.row, page_size, first_row + n0};
  };
  const HeadMask mask(p.mask, b, h, shape.heads_q);
  // Keys a padding mask drops are never loaded or multiplied.
  const Visibility vis = Visibility(p, seq).keys_before(mask.key_end);
  const ScoreMod mods(p, seq, b, h);
  const Dropout dropout(p.dropout);
  // The key tiles the band of rows [m0, m0 + kBlockM) reaches (dropout needs them aligned).
  int key_begin = vis.key_begin(m0) / kBlockN * kBlockN;
  int key_end = vis.key_end(m0 + kBlockM);
  if (p.split.num_splits > 1) {  // this split's share of the tiles (maybe none)
    const int tiles = max(0, (key_end - key_begin + kBlockN - 1) / kBlockN);
    const BlockShare share = split_share(tiles, blockIdx.z, p.split.num_splits);
    key_end = min(key_end, key_begin + static_cast<int>(share.last) * kBlockN);
    key_begin += static_cast<int>(share.first) * kBlockN;
    allow_dependent_launch();  // the combine (kvcache.cuh) waits for this grid on the GPU
  }

  // Paged: the block-table entry of a key tile's first row, read one tile ahead of the tile's
  // copies (page_now: tile n0 of the loop, page_next: tile n0 + kBlockN), so that no copy waits
  // for a table read. K and V share the table. The first two come from table_head.
  const auto read_page_ahead = [&](int n0) {
    return kPaged && n0 < key_end ? paged_rows(k_head, p.k_strides, n0).first_entry() : 0;
  };
  const auto first_page = [&](int n0) {
    return kPaged && n0 < key_end ? paged_rows(k_head, p.k_strides, n0).first_entry(table_head)
                                  : 0;
  };
  int page_now = first_page(key_begin), page_next = first_page(key_begin + kBlockN);

  // Key tile n0 of K or V (rows from `head`) into a K/V buffer. Paged: as a contiguous tile when
  // it lies in one page (the one block-table entry `page` instead of one per row, and contiguous
  // address math), else row by row.
  const auto stage_kv = [&](uint16_t* dst, const uint16_t* head, const TensorStrides& st, int n0,
                            int page) {
    if constexpr (kPaged) {
      const PagedRows rows = paged_rows(head, st, n0);
      if (const uint16_t* base = rows.single_page(kBlockN, page)) {
        stage_tile<Atom, kBlockN, kHeadDim, kThreads, kSwizzled>(dst, Cfg::kLdQK, base, st.row,
                                                                 vis.len_kv - n0, d, tid);
      } else {
        stage_tile_rows<Atom, kBlockN, kHeadDim, kThreads, kSwizzled>(
            dst, Cfg::kLdQK, rows, head, vis.len_kv - n0, d, tid);
      }
    } else {
      (void)page;
      stage_tile<Atom, kBlockN, kHeadDim, kThreads, kSwizzled>(
          dst, Cfg::kLdQK, head + n0 * st.row, st.row, vis.len_kv - n0, d, tid);
    }
  };
  // Key tile n0 (block-table entry `page`) into K/V buffer `buf` (kKVStages of them).
  const auto stage_k = [&](int n0, int buf, int page) {
    stage_kv(sK + buf * Cfg::kKVElems, k_head, p.k_strides, n0, page);
  };
  const auto stage_v = [&](int n0, int buf, int page) {
    stage_kv(sV + buf * Cfg::kKVElems, v_head, p.v_strides, n0, page);
  };
  // After the loop's last copy of tile n0 + kBlockN: the entries move on one tile.
  const auto advance_pages = [&](int n0) {
    page_now = page_next;
    page_next = read_page_ahead(n0 + 2 * kBlockN);
  };
  if constexpr (kShape == FwdShape::kDecode && decode_tile_appends(kHeadDim)) {
    if (p.append.k != nullptr) {  // this block's share of the new rows (KVNewRows)
      const bool first = blockIdx.z == 0, last = blockIdx.z + 1 == gridDim.z;
      append_new_rows<kThreads>(p, seq, b, hk,
                                first ? static_cast<int>(seq.len_kv - cache.seqlen_new) : key_begin,
                                last ? static_cast<int>(seq.len_kv) : key_end, tid);
      __syncthreads();  // written before this block's loads read them back
    }
  }
  stage_tile<Atom, kBlockM, kHeadDim, kThreads, kSwizzled>(
      sQ, Cfg::kLdQK, head_ptr(p.q, p.q_strides, b, h, seq.q_start + m0), p.q_strides.row,
      vis.len_q - m0, d, tid);
  // A block that sees no key copies none (a paged tile's first row would read the block-table
  // entry past the sequence's pages).
  if (key_begin < key_end) {
    stage_k(key_begin, 0, page_now);
    if constexpr (kStages == 2) stage_v(key_begin, 0, page_now);
  }

  OAcc o;
  o.zero();
  float row_max[kFragM][kSlots], row_sum[kFragM][kSlots];
#pragma unroll
  for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
    for (int s = 0; s < kSlots; ++s) row_max[fm][s] = neg_inf(), row_sum[fm][s] = 0.0f;

  const float scale = static_cast<float>(p.scale);
  // Scores -> base-2 exponent, and -> natural-log units for lse.
  const float log2_unit = kGeneral ? kLog2e : scale * kLog2e;
  const float ln_unit = kGeneral ? 1.0f : scale;
  const int k_extent = round_up(d, Atom::kK);
  const int n_extent = round_up(d, Atom::kN);
  // Q as the A operand of S: from shared memory, or (configs.cuh, kQInRegisters) loaded into
  // registers once, after a barrier (the Volta atom's staging stores are synchronous).
  const auto q_op = [&] {
    const QKOperand q_smem{sQ + warp_row0 * Cfg::kLdQK, Cfg::kLdQK};
    if constexpr (Cfg::kQInRegisters) {
      static_assert(!Atom::kAsyncCopy, "Q in registers is read after synchronous stores");
      RegisterOperand<Atom, kWarpRows, kHeadDim, QKOperand> q_regs;
      __syncthreads();
      q_regs.load(q_smem, lane);
      return q_regs;
    } else {
      return q_smem;
    }
  }();
  const KMajor p_op{sP + warp_row0 * Cfg::kLdP + warp_key0, Cfg::kLdP};
  // B operand of P.V over the warp's keys: V(j, e) addressed as (n = e, k = j).
  const auto v_op = [&](int buf) {
    return VOperand{sV + buf * Cfg::kKVElems + warp_key0 * Cfg::kLdQK, Cfg::kLdQK};
  };

  // One buffer: V of a tile loads while S is computed, K of the next one during P.V (two
  // barriers a tile). Two: the next tile's K and V load while this one is computed (one barrier).
  for (int n0 = key_begin, buf = 0; n0 < key_end; n0 += kBlockN, buf ^= kStages - 1) {
    cp_async_wait_all();
    // This tile's K (and Q; two buffers: and V) landed; every warp is done with the previous
    // tile's V (two buffers: with the other buffer).
    __syncthreads();
    if constexpr (kStages == 1) {
      stage_v(n0, 0, page_now);
    } else {
      if (n0 + kBlockN < key_end) {
        stage_k(n0 + kBlockN, buf ^ 1, page_next);
        stage_v(n0 + kBlockN, buf ^ 1, page_next);
      }
      advance_pages(n0);
    }

    SAcc s;
    s.zero();
    const int nw0 = n0 + warp_key0;  // the warp's first key
    warp_gemm<Atom, Elem, kHeadDim>(
        s, q_op, QKOperand{sK + buf * Cfg::kKVElems + warp_key0 * Cfg::kLdQK, Cfg::kLdQK},
        k_extent, kWarpKeys, lane);

    // Scores in the units the exponent takes them: raw for the plain variant (the scale is
    // folded into one FMA with the running max), scaled, softcapped, ALiBi- and mask-biased
    // (natural-log units, so that finfo.min biases cannot overflow) for the general one.
    // Invisible keys: -inf.
    if constexpr (kGeneral) s.for_each(lane, [&](int, int, int, int, float& x) { x *= scale; });
    vis.hide(s, lane, m0 + warp_row0, nw0);
    if constexpr (kGeneral) {
      mods.apply(s, lane, m0 + warp_row0, nw0);
      mask.add_bias(s, lane, m0 + warp_row0, nw0, vis.len_q);
    }

    // Online softmax. The running max per row moves (and what was accumulated is rescaled) only
    // where this tile's max exceeds it by more than 2^kLazyRescaleLog2 in P: P, its sum and O stay
    // relative to one max either way (lse uses the same), so the result is the same softmax with
    // P <= 2^kLazyRescaleLog2, and most tiles skip the rescale of O (one warp-wide vote).
    float tile_max[kFragM][kSlots];
#pragma unroll
    for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
      for (int sl = 0; sl < kSlots; ++sl) tile_max[fm][sl] = neg_inf();
    s.for_each(lane, [&](int fm, int sl, int, int, float& x) {
      tile_max[fm][sl] = fmaxf(tile_max[fm][sl], x);
    });
    bool grows = false;
#pragma unroll
    for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
      for (int sl = 0; sl < kSlots; ++sl) {
        tile_max[fm][sl] = row_allreduce_max<Atom>(tile_max[fm][sl]);
        // -inf running max: any finite tile max grows it (the difference is +inf; -inf - -inf
        // is NaN and grows nothing).
        grows |= (tile_max[fm][sl] - row_max[fm][sl]) * log2_unit > kLazyRescaleLog2;
      }
    if (__any_sync(0xffffffffu, grows)) {
      float alpha[kFragM][kSlots];
#pragma unroll
      for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
        for (int sl = 0; sl < kSlots; ++sl) {
          const float m_new = fmaxf(row_max[fm][sl], tile_max[fm][sl]);
          alpha[fm][sl] = fast_exp2((row_max[fm][sl] - softmax_base(m_new)) * log2_unit);
          row_max[fm][sl] = m_new;
          row_sum[fm][sl] *= alpha[fm][sl];
        }
      o.for_each(lane, [&](int fm, int sl, int, int, float& x) { x *= alpha[fm][sl]; });
    }
    float base[kFragM][kSlots];
#pragma unroll
    for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
      for (int sl = 0; sl < kSlots; ++sl) base[fm][sl] = softmax_base(row_max[fm][sl]);
    s.for_each(lane, [&](int fm, int sl, int, int, float& x) {
      if constexpr (kGeneral) {
        x = fast_exp2((x - base[fm][sl]) * kLog2e);
      } else {
        x = fast_exp2(fmaf(x, log2_unit, -base[fm][sl] * log2_unit));
      }
      row_sum[fm][sl] += x;
    });
    if constexpr (kDropout) {  // the sum above is of all of P; 1 / (1 - p): epilogue
      dropout.for_each_keep_pair<Atom, SAcc>(lane, blockIdx.y, m0 + warp_row0, nw0,
                                             [&](int fm, int fn, int i, bool keep0, bool keep1) {
                                               if (!keep0) s.c[fm][fn][i] = 0.0f;
                                               if (!keep1) s.c[fm][fn][i + 1] = 0.0f;
                                             });
    }

    if constexpr (kStages == 1) {
      cp_async_wait_all();
      __syncthreads();  // V landed; every warp is done with K
      if (n0 + kBlockN < key_end) stage_k(n0 + kBlockN, 0, page_next);
      advance_pages(n0);
    }
    if constexpr (Atom::kAccumIsA) {
      warp_gemm_accum_a<Atom, Elem>(o, s, v_op(buf), n_extent, lane);
    } else {
      // The warp's P rows are rewritten only after the next two block barriers.
      store_accum_smem<Elem>(s, sP, Cfg::kLdP, warp_row0, warp_key0, lane);
      __syncwarp();
      warp_gemm<Atom, Elem, kWarpKeys>(o, p_op, v_op(buf), kWarpKeys, n_extent, lane);
    }
  }
  cp_async_wait_all();  // no copy may be in flight at exit (Q when no key is visible)

  if constexpr (kKeyWarps > 1) {
    // The key warps' partial rows merged into the first warp's: rescaled to their common max.
    float* const merge = reinterpret_cast<float*>(smem_raw) + lane;
    constexpr int kLaneFloats = Cfg::kMergeFloatsPerLane;
    constexpr int kStatsAt = kLaneFloats - 2 * kFragM * kSlots;  // max and sum after O
    // Warp w's row max of (fm, sl) in its area `area`; the row sum is 32 floats after it.
    const auto row_stats = [](auto* area, int fm, int sl) {
      return area + 32 * (kStatsAt + 2 * (fm * kSlots + sl));
    };
    __syncthreads();  // every warp is done with Q, K and V (the merge area)
    if (key_warp > 0) {
      float* const dst = merge + (key_warp - 1) * kLaneFloats * 32;
      int i = 0;
      o.for_each(lane, [&](int, int, int, int, float& x) { dst[32 * i++] = x; });
#pragma unroll
      for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
        for (int sl = 0; sl < kSlots; ++sl) {
          row_stats(dst, fm, sl)[0] = row_max[fm][sl];
          row_stats(dst, fm, sl)[32] = row_sum[fm][sl];
        }
    }
    __syncthreads();
    if (key_warp > 0) return;
#pragma unroll
    for (int w = 1; w < kKeyWarps; ++w) {
      const float* const src = merge + (w - 1) * kLaneFloats * 32;
      float alpha_own[kFragM][kSlots], alpha_w[kFragM][kSlots];
#pragma unroll
      for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
        for (int sl = 0; sl < kSlots; ++sl) {
          const float max_w = row_stats(src, fm, sl)[0];
          const float sum_w = row_stats(src, fm, sl)[32];
          const float m_new = fmaxf(row_max[fm][sl], max_w);
          const float base = softmax_base(m_new);
          alpha_own[fm][sl] = fast_exp2((row_max[fm][sl] - base) * log2_unit);
          alpha_w[fm][sl] = fast_exp2((max_w - base) * log2_unit);
          row_sum[fm][sl] = row_sum[fm][sl] * alpha_own[fm][sl] + sum_w * alpha_w[fm][sl];
          row_max[fm][sl] = m_new;
        }
      int i = 0;
      o.for_each(lane, [&](int fm, int sl, int, int, float& x) {
        x = x * alpha_own[fm][sl] + src[32 * i++] * alpha_w[fm][sl];
      });
    }
  }

  // Epilogue: O / l and lse = ln(sum exp(scaled scores)); rows with no visible key: 0 and -inf.
  float inv_sum[kFragM][kSlots];
  const int rows_valid = vis.len_q - m0 - warp_row0;
  const int64_t row0 = seq.q_start + m0 + warp_row0;
  // Split-KV: row (split, b, h, row0) of the contiguous partial buffers.
  const bool split = p.split.num_splits > 1;
  const int64_t part_row0 =
      ((blockIdx.z * shape.batch + b) * shape.heads_q + h) * shape.len_q + row0;
  float* const lse = split ? p.split.lse_accum + part_row0
                           : p.lse + b * p.lse_layout.batch + h * p.lse_layout.head + row0;
#pragma unroll
  for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
    for (int sl = 0; sl < kSlots; ++sl) {
      const float l = row_allreduce_sum<Atom>(row_sum[fm][sl]);
      inv_sum[fm][sl] = l > 0.0f ? (kDropout ? dropout.inv_keep() : 1.0f) / l : 0.0f;
      const int r = OAcc::row_of(lane, fm, sl);
      if (is_row_leader<Atom>(lane) && r < rows_valid) {
        lse[r] = l > 0.0f ? row_max[fm][sl] * ln_unit + logf(l) : neg_inf();
      }
    }
  const auto row_scale = [&](int fm, int sl) { return inv_sum[fm][sl]; };
  if (split) {
    store_accum_global_f32(o, p.split.out_accum + part_row0 * shape.head_dim_v, shape.head_dim_v,
                           rows_valid, d, lane, row_scale);
  } else if constexpr (kKeyWarps == 1) {
    // Through the warp's Q rows, read for the last time above, once every thread's Q copies
    // landed: where no key tile ran, no barrier of the loop waited for them.
    __syncthreads();
    store_accum_global_staged<Elem>(o, sQ + warp_row0 * Cfg::kLdQK, Cfg::kLdQK,
                                    head_ptr(p.out, p.out_strides, b, h, row0), p.out_strides.row,
                                    rows_valid, d, lane, row_scale);
  } else {
    store_accum_global<Elem>(o, head_ptr(p.out, p.out_strides, b, h, row0), p.out_strides.row,
                             rows_valid, d, lane, row_scale);
  }
}

}  // namespace kern
}  // namespace flashv100
