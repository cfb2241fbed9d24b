// FlashAttention-2 backward. P is recomputed from the saved log-sum-exp, D = rowsum(dO * O) comes
// from a preprocessing kernel, and the main kernel runs one block per (key tile, batch*kv-head):
// it loops over the query heads of its GQA group and over query tiles, accumulating dK and dV in
// registers (no races between blocks, so dK/dV are deterministic). dQ is either atomically added
// into an fp32 workspace by that kernel (fast), or computed by a second kernel that loops over
// key tiles per query tile (deterministic: fixed summation order).
#pragma once

#include "cuda/kernels/attention_common.cuh"
#include "cuda/kernels/tile_io.cuh"

namespace flashv100 {
namespace kern {

template <class Cfg>
struct BwdSmem {
  uint16_t *k, *v, *q, *dout, *p, *ds;
  float *lse, *dsum;

  __device__ __forceinline__ explicit BwdSmem(uint4* raw) {
    uint16_t* base = reinterpret_cast<uint16_t*>(raw);
    k = base + Cfg::kKOffset;
    v = base + Cfg::kVOffset;
    q = base + Cfg::kQOffset;
    dout = base + Cfg::kDOOffset;
    p = base + Cfg::kPOffset;
    ds = base + Cfg::kDSOffset;
    lse = reinterpret_cast<float*>(reinterpret_cast<char*>(raw) + Cfg::kRowVecByteOffset);
    dsum = lse + Cfg::kBlockM;
  }
};

// Q, dO, lse and D of query rows [m0, m0 + kBlockM) of head h. Rows past the end get
// lse = +inf so that their recomputed P is exactly 0.
template <class Cfg>
__device__ __forceinline__ void load_query_side(const BwdSmem<Cfg>& sm, const BackwardParams& p,
                                                const float* dsum, int64_t b, int64_t h, int m0,
                                                int tid) {
  const ForwardParams& f = p.fwd;
  const int rows = static_cast<int>(f.shape.len_q) - m0;
  const int d = static_cast<int>(f.shape.head_dim);
  const int64_t row_index = (b * f.shape.heads_q + h) * f.shape.len_q + m0;
  load_tile<Cfg::kBlockM, Cfg::kHeadDim, Cfg::kThreads>(
      sm.q, Cfg::kLdE, head_ptr(f.q, f.q_strides, b, h, m0), f.q_strides.row, rows, d, tid);
  load_tile<Cfg::kBlockM, Cfg::kHeadDim, Cfg::kThreads>(
      sm.dout, Cfg::kLdE, head_ptr(p.dout, p.dout_strides, b, h, m0), p.dout_strides.row, rows, d,
      tid);
  load_row_vector<Cfg::kBlockM, Cfg::kThreads>(sm.lse, f.lse + row_index, rows, pos_inf(), tid);
  load_row_vector<Cfg::kBlockM, Cfg::kThreads>(sm.dsum, dsum + row_index, rows, 0.0f, tid);
}

template <class Cfg>
__device__ __forceinline__ void load_key_side(const BwdSmem<Cfg>& sm, const BackwardParams& p,
                                              int64_t b, int64_t hk, int n0, int tid) {
  const ForwardParams& f = p.fwd;
  const int rows = static_cast<int>(f.shape.len_kv) - n0;
  const int d = static_cast<int>(f.shape.head_dim);
  load_tile<Cfg::kBlockN, Cfg::kHeadDim, Cfg::kThreads>(
      sm.k, Cfg::kLdE, head_ptr(f.k, f.k_strides, b, hk, n0), f.k_strides.row, rows, d, tid);
  load_tile<Cfg::kBlockN, Cfg::kHeadDim, Cfg::kThreads>(
      sm.v, Cfg::kLdE, head_ptr(f.v, f.v_strides, b, hk, n0), f.v_strides.row, rows, d, tid);
}

// What the P/dS recomputation needs about one (batch, query head).
struct BwdHead {
  int64_t batch_head;  // b * Hq + h: dropout counter and dmask rows
  HeadMask mask;
  float* dmask;  // this head's [Lq, Lkv] rows of the fp32 mask gradient, or nullptr

  __device__ __forceinline__ BwdHead(const BackwardParams& p, int64_t b, int64_t h)
      : batch_head(b * p.fwd.shape.heads_q + h),
        mask(p.fwd.mask, b, h),
        dmask(p.dmask != nullptr ? p.dmask + batch_head * p.fwd.shape.len_q * p.fwd.shape.len_kv
                                 : nullptr) {}
};

// Recomputes P = exp(S * scale + bias - lse) of the (m0, n0) tile and dS = P * (dP - D) with
// dP = dO V^T (times the dropout factors), and stores dropout(P) and dS (as Elem) into shared
// memory for the products that reduce over rows or keys. kWriteDMask: also write dS, the
// gradient of an additive mask, to head.dmask (each tile is visited once by the dK/dV kernel).
template <class Atom, class Elem, class Cfg, bool kStoreP, bool kWriteDMask>
__device__ __forceinline__ void compute_p_ds(const BwdSmem<Cfg>& sm, const Visibility& vis,
                                             const BwdHead& head, const Dropout& dropout,
                                             float scale, int k_extent, int m0, int n0, int warp,
                                             int lane) {
  using Acc = WarpAccum<Atom, Cfg::kSRows, Cfg::kSCols>;
  if (warp >= Cfg::kSWarps) return;
  const int r0 = (warp / Cfg::kWarpsNS) * Cfg::kSRows;
  const int c0 = (warp % Cfg::kWarpsNS) * Cfg::kSCols;
  Acc s, dp;
  s.zero();
  dp.zero();
  warp_gemm<Atom, Elem>(s, KMajor{sm.q + r0 * Cfg::kLdE, Cfg::kLdE},
                        KMajor{sm.k + c0 * Cfg::kLdE, Cfg::kLdE}, k_extent, Cfg::kSCols, lane);
  warp_gemm<Atom, Elem>(dp, KMajor{sm.dout + r0 * Cfg::kLdE, Cfg::kLdE},
                        KMajor{sm.v + c0 * Cfg::kLdE, Cfg::kLdE}, k_extent, Cfg::kSCols, lane);
  const bool needs_mask = vis.tile_needs_mask(m0 + r0, n0 + c0, Cfg::kSCols);
#pragma unroll
  for (int fm = 0; fm < Acc::kFragM; ++fm)
#pragma unroll
    for (int fn = 0; fn < Acc::kFragN; ++fn)
#pragma unroll
      for (int i = 0; i < Atom::kCRegs; i += 2) {
        const int r = r0 + Acc::row_of(lane, fm, Atom::row_slot(i));
        const int i_q = m0 + r, j0 = n0 + c0 + Acc::col_of(lane, fn, i);
        float factor[2] = {1.0f, 1.0f};
        if (Cfg::kGeneral && dropout.enabled)
          dropout.factors(head.batch_head, i_q, j0, factor[0], factor[1]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = j0 + e;
          float score = neg_inf();
          if (!needs_mask || vis.visible(i_q, j)) {
            score = s.c[fm][fn][i + e] * scale;
            if constexpr (Cfg::kGeneral)
              if (head.mask.present() && i_q < vis.len_q) score += head.mask.bias(i_q, j);
          }
          // Fully hidden entries (incl. whole rows, lse = -inf) have probability exactly 0.
          const float prob =
              score == neg_inf() ? 0.0f : fast_exp2((score - sm.lse[r]) * kLog2e);
          const float ds = prob * (dp.c[fm][fn][i + e] * factor[e] - sm.dsum[r]);
          s.c[fm][fn][i + e] = prob * factor[e];
          dp.c[fm][fn][i + e] = ds;
          if (Cfg::kGeneral && kWriteDMask && head.dmask != nullptr && i_q < vis.len_q &&
              j < vis.len_kv)
            head.dmask[static_cast<int64_t>(i_q) * vis.len_kv + j] = ds;
        }
      }
  if constexpr (kStoreP) store_accum_smem<Elem>(s, sm.p, Cfg::kLdN, r0, c0, lane);
  store_accum_smem<Elem>(dp, sm.ds, Cfg::kLdN, r0, c0, lane);
}

// D[b, h, i] = sum_e dO[i, e] * O[i, e] in fp32: one warp per row.
template <class Elem>
__global__ void __launch_bounds__(128) flash_bwd_dsum_kernel(const BackwardParams p, float* dsum) {
  const ForwardParams& f = p.fwd;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (row >= f.shape.batch * f.shape.heads_q * f.shape.len_q) return;
  const int64_t bh = row / f.shape.len_q, i = row % f.shape.len_q;
  const int64_t b = bh / f.shape.heads_q, h = bh % f.shape.heads_q;
  const uint16_t* o = head_ptr(f.out, f.out_strides, b, h, i);
  const uint16_t* g = head_ptr(p.dout, p.dout_strides, b, h, i);
  float acc = 0.0f;
  for (int e = 2 * lane; e < f.shape.head_dim; e += 64) {
    const uint32_t ov = *reinterpret_cast<const uint32_t*>(o + e);
    const uint32_t gv = *reinterpret_cast<const uint32_t*>(g + e);
    acc += low_float<Elem>(ov) * low_float<Elem>(gv) + high_float<Elem>(ov) * high_float<Elem>(gv);
  }
#pragma unroll
  for (int bit = 16; bit > 0; bit >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, bit);
  if (lane == 0) dsum[row] = acc;
}

// dK, dV for key tile blockIdx.x of (batch, kv head) blockIdx.y; optionally dQ by fp32 atomics
// into dq_accum ([B, Hq, Lq, d] contiguous, unscaled). kGeneral: attn_mask and/or dropout.
template <class Atom, class Elem, int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(BwdConfig<kHeadDim, kGeneral>::kThreads)
    flash_bwd_dkdv_kernel(const BackwardParams p, const float* dsum, float* dq_accum) {
  using Cfg = BwdConfig<kHeadDim, kGeneral>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kLdE = Cfg::kLdE;
  extern __shared__ uint4 smem_raw[];
  const BwdSmem<Cfg> sm(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const ForwardParams& f = p.fwd;
  const Visibility vis(f);
  const int d = static_cast<int>(f.shape.head_dim);
  const int k_extent = round_up(d, Atom::kK), n_extent = round_up(d, Atom::kN);
  const float scale = static_cast<float>(f.scale);
  const Dropout dropout(f.dropout);
  const int n0 = blockIdx.x * kBlockN;
  const int64_t b = blockIdx.y / f.shape.heads_kv, hk = blockIdx.y % f.shape.heads_kv;
  const int64_t group = f.shape.heads_q / f.shape.heads_kv;

  load_key_side(sm, p, b, hk, n0, tid);

  using KVAcc = WarpAccum<Atom, Cfg::kKVRows, Cfg::kKVCols>;
  const int kv_r0 = (warp / Cfg::kWarpsNKV) * Cfg::kKVRows;
  const int kv_c0 = (warp % Cfg::kWarpsNKV) * Cfg::kKVCols;
  KVAcc dk, dv;
  dk.zero();
  dv.zero();

  using QAcc = WarpAccum<Atom, Cfg::kQRows, Cfg::kQCols>;
  const int q_r0 = (warp / Cfg::kWarpsNQ) * Cfg::kQRows;

  const int row_begin = vis.row_begin(n0) / kBlockM * kBlockM;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const BwdHead head(p, b, h);
    for (int m0 = row_begin; m0 < vis.len_q; m0 += kBlockM) {
      __syncthreads();  // the previous query tile (Q, dO, P, dS) is fully consumed
      load_query_side(sm, p, dsum, b, h, m0, tid);
      __syncthreads();
      compute_p_ds<Atom, Elem, Cfg, true, true>(sm, vis, head, dropout, scale, k_extent, m0, n0,
                                                warp, lane);
      __syncthreads();
      // dV += P^T dO and dK += dS^T Q: reductions over the tile's query rows.
      warp_gemm<Atom, Elem>(dv, MMajor{sm.p + kv_r0, Cfg::kLdN}, MMajor{sm.dout + kv_c0, kLdE},
                            kBlockM, n_extent - kv_c0, lane);
      warp_gemm<Atom, Elem>(dk, MMajor{sm.ds + kv_r0, Cfg::kLdN}, MMajor{sm.q + kv_c0, kLdE},
                            kBlockM, n_extent - kv_c0, lane);
      if (dq_accum != nullptr) {
        float* dq_rows = dq_accum + ((b * f.shape.heads_q + h) * f.shape.len_q + m0) * d;
        for (int e0 = 0; e0 < n_extent; e0 += Cfg::kDqCols) {
          const int q_c0 = e0 + (warp % Cfg::kWarpsNQ) * Cfg::kQCols;
          QAcc dq;
          dq.zero();
          warp_gemm<Atom, Elem>(dq, KMajor{sm.ds + q_r0 * Cfg::kLdN, Cfg::kLdN},
                                MMajor{sm.k + q_c0, kLdE}, kBlockN, n_extent - q_c0, lane);
          dq.for_each(lane, [&](int, int, int r, int c, float& x) {
            if (m0 + q_r0 + r < vis.len_q && q_c0 + c < d)
              atomicAdd(dq_rows + static_cast<int64_t>(q_r0 + r) * d + q_c0 + c, x);
          });
        }
      }
    }
  }

  const int rows_valid = vis.len_kv - n0 - kv_r0;
  store_accum_global<Elem>(dk, head_ptr(p.dk, p.dk_strides, b, hk, n0 + kv_r0) + kv_c0,
                           p.dk_strides.row, rows_valid, d - kv_c0, lane,
                           [&](int, int) { return scale; });
  store_accum_global<Elem>(dv, head_ptr(p.dv, p.dv_strides, b, hk, n0 + kv_r0) + kv_c0,
                           p.dv_strides.row, rows_valid, d - kv_c0, lane,
                           [&](int, int) { return 1.0f; });
}

// Deterministic dQ: query tile blockIdx.x of (batch, head) blockIdx.y, looping over key tiles.
template <class Atom, class Elem, int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(BwdConfig<kHeadDim, kGeneral>::kThreads)
    flash_bwd_dq_kernel(const BackwardParams p, const float* dsum) {
  using Cfg = BwdConfig<kHeadDim, kGeneral>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  extern __shared__ uint4 smem_raw[];
  const BwdSmem<Cfg> sm(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const ForwardParams& f = p.fwd;
  const Visibility vis(f);
  const int d = static_cast<int>(f.shape.head_dim);
  const int k_extent = round_up(d, Atom::kK), n_extent = round_up(d, Atom::kN);
  const float scale = static_cast<float>(f.scale);
  const Dropout dropout(f.dropout);
  const int m0 = blockIdx.x * kBlockM;
  const int64_t b = blockIdx.y / f.shape.heads_q, h = blockIdx.y % f.shape.heads_q;
  const int64_t hk = kv_head_of(h, f.shape.heads_q, f.shape.heads_kv);
  const BwdHead head(p, b, h);

  load_query_side(sm, p, dsum, b, h, m0, tid);

  using QAcc = WarpAccum<Atom, Cfg::kQRows, Cfg::kQColsFull>;
  const int q_r0 = (warp / Cfg::kWarpsNQ) * Cfg::kQRows;
  const int q_c0 = (warp % Cfg::kWarpsNQ) * Cfg::kQColsFull;
  QAcc dq;
  dq.zero();
  const int key_end = vis.key_end(m0 + kBlockM);
  for (int n0 = 0; n0 < key_end; n0 += kBlockN) {
    __syncthreads();  // the previous K/V/dS tile is fully consumed
    load_key_side(sm, p, b, hk, n0, tid);
    __syncthreads();
    compute_p_ds<Atom, Elem, Cfg, false, false>(sm, vis, head, dropout, scale, k_extent, m0, n0,
                                                warp, lane);
    __syncthreads();
    warp_gemm<Atom, Elem>(dq, KMajor{sm.ds + q_r0 * Cfg::kLdN, Cfg::kLdN},
                          MMajor{sm.k + q_c0, Cfg::kLdE}, kBlockN, n_extent - q_c0, lane);
  }
  store_accum_global<Elem>(dq, head_ptr(p.dq, p.dq_strides, b, h, m0 + q_r0) + q_c0,
                           p.dq_strides.row, vis.len_q - m0 - q_r0, d - q_c0, lane,
                           [&](int, int) { return scale; });
}

// dq = scale * dq_accum, converted to Elem and written with dq's strides.
template <class Elem>
__global__ void __launch_bounds__(256) flash_bwd_dq_convert_kernel(const BackwardParams p,
                                                                   const float* dq_accum) {
  const ForwardParams& f = p.fwd;
  const int64_t half_d = f.shape.head_dim / 2;
  const float scale = static_cast<float>(f.scale);
  const int64_t pairs = f.shape.batch * f.shape.heads_q * f.shape.len_q * half_d;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < pairs;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / half_d, e = (idx % half_d) * 2;
    const int64_t bh = row / f.shape.len_q, i = row % f.shape.len_q;
    uint16_t* dst = head_ptr(p.dq, p.dq_strides, bh / f.shape.heads_q, bh % f.shape.heads_q, i);
    const float* src = dq_accum + row * f.shape.head_dim + e;
    *reinterpret_cast<uint32_t*>(dst + e) = pack2<Elem>(src[0] * scale, src[1] * scale);
  }
}

}  // namespace kern
}  // namespace flashv100
