// Moving tiles between global memory, shared memory and warp accumulators. Global rows are
// addressed with 64-bit strides; the launcher guarantees 16-byte aligned rows (pointer and
// batch/head/row strides multiples of 8 elements) and a head dim that is a multiple of 8.
#pragma once

#include "cuda/kernels/warp_tile.cuh"

namespace flashv100 {
namespace kern {

// f(it, r, c) for each 8-element vector (row r, columns c .. c + 7) of a kRows x kCols tile that
// thread tid of kThreads moves, `it` counting the thread's vectors: consecutive threads take
// consecutive 16-byte chunks of a row.
template <int kRows, int kCols, int kThreads>
constexpr int kTileVectorsPerThread = (kRows * kCols / 8 + kThreads - 1) / kThreads;
template <int kRows, int kCols, int kThreads, class F>
__device__ __forceinline__ void for_each_tile_vector_indexed(int tid, F&& f) {
  constexpr int kVecPerRow = kCols / 8;
  constexpr int kVecs = kRows * kVecPerRow;
#pragma unroll
  for (int it = 0; it < kTileVectorsPerThread<kRows, kCols, kThreads>; ++it) {
    const int idx = it * kThreads + tid;
    if (kVecs % kThreads != 0 && idx >= kVecs) break;
    f(it, idx / kVecPerRow, (idx % kVecPerRow) * 8);
  }
}
template <int kRows, int kCols, int kThreads, class F>
__device__ __forceinline__ void for_each_tile_vector(int tid, F&& f) {
  for_each_tile_vector_indexed<kRows, kCols, kThreads>(tid, [&](int, int r, int c) { f(r, c); });
}

// for_each_tile_vector over a global tile at gmem with rows row_stride apart: f(r, c, address of
// (r, c)). Where kThreads is a multiple of the vectors per row, a thread's vectors share a column
// and lie a fixed number of rows apart, so each address is the last one plus a step: a 64-bit
// product per vector cost ~10 instructions (sm_80 SASS of the backward's query-side loads).
template <int kRows, int kCols, int kThreads, class F>
__device__ __forceinline__ void for_each_strided_vector(const uint16_t* gmem, int64_t row_stride,
                                                        int tid, F&& f) {
  constexpr int kVecPerRow = kCols / 8;
  if constexpr (kThreads % kVecPerRow == 0) {
    constexpr int kRowsPerPass = kThreads / kVecPerRow;
    const int r0 = tid / kVecPerRow, c = (tid % kVecPerRow) * 8;
    const uint16_t* src = gmem + r0 * row_stride + c;
    const int64_t step = kRowsPerPass * row_stride;
#pragma unroll
    for (int it = 0; it < kTileVectorsPerThread<kRows, kCols, kThreads>; ++it) {
      const int r = r0 + it * kRowsPerPass;
      if (kRows % kRowsPerPass != 0 && r >= kRows) break;
      f(r, c, src);
      src += step;
    }
  } else {
    for_each_tile_vector<kRows, kCols, kThreads>(
        tid, [&](int r, int c) { f(r, c, gmem + r * row_stride + c); });
  }
}

// Copies rows [0, rows_valid) x cols [0, cols_valid) of a global 16-bit matrix into a kRows x kCols
// shared tile (row stride ld), zero-filling the rest so that padding contributes nothing to any
// product. Row r starts at row_ptr(r), called for valid rows only (paged caches: an index read).
template <int kRows, int kCols, int kThreads, bool kSwizzled, class RowPtr>
__device__ __forceinline__ void load_tile_rows(uint16_t* smem, int ld, RowPtr&& row_ptr,
                                               int rows_valid, int cols_valid, int tid) {
  for_each_tile_vector<kRows, kCols, kThreads>(tid, [&](int r, int c) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows_valid && c < cols_valid)
      v = __ldg(reinterpret_cast<const uint4*>(row_ptr(r) + c));
    *reinterpret_cast<uint4*>(smem_at<kSwizzled>(smem, r, c, ld)) = v;
  });
}

template <int kRows, int kCols, int kThreads, bool kSwizzled>
__device__ __forceinline__ void load_tile(uint16_t* smem, int ld, const uint16_t* gmem,
                                          int64_t row_stride, int rows_valid, int cols_valid,
                                          int tid) {
  for_each_strided_vector<kRows, kCols, kThreads>(
      gmem, row_stride, tid, [&](int r, int c, const uint16_t* src) {
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows_valid && c < cols_valid) v = __ldg(reinterpret_cast<const uint4*>(src));
        *reinterpret_cast<uint4*>(smem_at<kSwizzled>(smem, r, c, ld)) = v;
      });
}

// One 16-byte cp.async into shared memory at dst from src, or where !valid 16 zero bytes (reading
// nothing at fallback, a valid address). The L2 fetches whole 128-byte lines (FlashAttention-2's
// hint): decoding on the H200 read 2-3% faster from 8k keys (kernel_bench), prefill unchanged;
// 256 bytes was slower. Completed by cp_async_wait_all(); sm_80+ only.
__device__ __forceinline__ void cp_async_16(uint16_t* dst, const uint16_t* src,
                                            const uint16_t* fallback, bool valid) {
#if FLASHV100_SM80
  const uint32_t dst_shared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst_shared),
               "l"(valid ? src : fallback), "r"(valid ? 16 : 0));
#elif defined(FLASHV100_HOST_EMULATION)
  (void)fallback;
  emulated_cp_async_16(dst, valid ? src : nullptr);
#else
  (void)dst, (void)src, (void)fallback, (void)valid;
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if FLASHV100_SM80
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// load_tile_rows without the trip through registers (cp_async_16, rows or columns past the valid
// range zero-filled by the copy itself). row_ptr reads memory (a paged cache's block table), so
// every row address of the thread is resolved before the first copy: the reads are in flight
// together instead of one read's latency before each copy.
template <int kRows, int kCols, int kThreads, bool kSwizzled, class RowPtr>
__device__ __forceinline__ void load_tile_async_rows(uint16_t* smem, int ld, RowPtr&& row_ptr,
                                                     const uint16_t* fallback, int rows_valid,
                                                     int cols_valid, int tid) {
  const uint16_t* src[kTileVectorsPerThread<kRows, kCols, kThreads>];
  for_each_tile_vector_indexed<kRows, kCols, kThreads>(tid, [&](int it, int r, int c) {
    src[it] = r < rows_valid && c < cols_valid ? row_ptr(r) + c : nullptr;
  });
  for_each_tile_vector_indexed<kRows, kCols, kThreads>(tid, [&](int it, int r, int c) {
    cp_async_16(smem_at<kSwizzled>(smem, r, c, ld), src[it], fallback, src[it] != nullptr);
  });
  cp_async_commit();
}

template <int kRows, int kCols, int kThreads, bool kSwizzled>
__device__ __forceinline__ void load_tile_async(uint16_t* smem, int ld, const uint16_t* gmem,
                                                int64_t row_stride, int rows_valid,
                                                int cols_valid, int tid) {
  for_each_strided_vector<kRows, kCols, kThreads>(
      gmem, row_stride, tid, [&](int r, int c, const uint16_t* src) {
        cp_async_16(smem_at<kSwizzled>(smem, r, c, ld), src, gmem,
                    r < rows_valid && c < cols_valid);
      });
  cp_async_commit();
}

__device__ __forceinline__ void cp_async_wait_all() {
#if FLASHV100_SM80
  asm volatile("cp.async.wait_all;\n" ::);
#endif
}

// A tile for the atom's kernels, row r at row_ptr(r): by cp.async where the GPU has it (landing
// after cp_async_wait_all), else by plain loads. kSwizzled: rows as smem_offset swizzles them.
template <class Atom, int kRows, int kCols, int kThreads, bool kSwizzled = false, class RowPtr>
__device__ __forceinline__ void stage_tile_rows(uint16_t* smem, int ld, RowPtr&& row_ptr,
                                                const uint16_t* fallback, int rows_valid,
                                                int cols_valid, int tid) {
  if constexpr (Atom::kAsyncCopy) {
    load_tile_async_rows<kRows, kCols, kThreads, kSwizzled>(smem, ld, row_ptr, fallback,
                                                            rows_valid, cols_valid, tid);
  } else {
    load_tile_rows<kRows, kCols, kThreads, kSwizzled>(smem, ld, row_ptr, rows_valid, cols_valid,
                                                      tid);
  }
}

// stage_tile_rows of a tile with rows row_stride apart.
template <class Atom, int kRows, int kCols, int kThreads, bool kSwizzled = false>
__device__ __forceinline__ void stage_tile(uint16_t* smem, int ld, const uint16_t* gmem,
                                           int64_t row_stride, int rows_valid, int cols_valid,
                                           int tid) {
  if constexpr (Atom::kAsyncCopy) {
    load_tile_async<kRows, kCols, kThreads, kSwizzled>(smem, ld, gmem, row_stride, rows_valid,
                                                       cols_valid, tid);
  } else {
    load_tile<kRows, kCols, kThreads, kSwizzled>(smem, ld, gmem, row_stride, rows_valid,
                                                 cols_valid, tid);
  }
}

// Writes a warp accumulator (converted to Elem) into a shared tile at (row0, col0), ld elements.
template <class Elem, class Acc>
__device__ __forceinline__ void store_accum_smem(Acc& acc, uint16_t* smem, int ld, int row0,
                                                 int col0, int lane) {
  acc.for_each_pair(lane, [&](int, int, int r, int c, float v0, float v1) {
    *reinterpret_cast<uint32_t*>(smem + (row0 + r) * ld + col0 + c) = pack2<Elem>(v0, v1);
  });
}

// Writes a warp accumulator tile to global memory (tile origin `gmem`), rows < rows_valid and
// cols < cols_valid only, each value multiplied by row_scale(fm, slot).
template <class Elem, class Acc, class RowScale>
__device__ __forceinline__ void store_accum_global(Acc& acc, uint16_t* gmem,
                                                   int64_t row_stride, int rows_valid,
                                                   int cols_valid, int lane, RowScale row_scale) {
  acc.for_each_pair(lane, [&](int fm, int slot, int r, int c, float v0, float v1) {
    if (r < rows_valid && c < cols_valid) {
      const float s = row_scale(fm, slot);
      *reinterpret_cast<uint32_t*>(gmem + r * row_stride + c) = pack2<Elem>(v0 * s, v1 * s);
    }
  });
}

// store_accum_global through the warp's own shared rows `stage` (ld elements, no other warp's):
// whole 16-byte row chunks a lane, where the fragments store 4 bytes a lane and touch half of
// each 32-byte sector. cols_valid is a multiple of 8 and gmem's rows 16-byte aligned (the fused
// kernels' rule). The caller has a block barrier between every earlier access to `stage` and this
// store.
template <class Elem, class Acc, class RowScale>
__device__ __forceinline__ void store_accum_global_staged(Acc& acc, uint16_t* stage, int ld,
                                                          uint16_t* gmem, int64_t row_stride,
                                                          int rows_valid, int cols_valid, int lane,
                                                          RowScale row_scale) {
  acc.for_each_pair(lane, [&](int fm, int slot, int r, int c, float v0, float v1) {
    const float s = row_scale(fm, slot);
    *reinterpret_cast<uint32_t*>(stage + r * ld + c) = pack2<Elem>(v0 * s, v1 * s);
  });
  __syncwarp();
  constexpr int kChunks = Acc::kTileCols / 8;
#pragma unroll
  for (int i = lane; i < Acc::kTileRows * kChunks; i += 32) {
    const int r = i / kChunks, c = i % kChunks * 8;
    if (r < rows_valid && c < cols_valid) {
      *reinterpret_cast<uint4*>(gmem + r * row_stride + c) =
          *reinterpret_cast<const uint4*>(stage + r * ld + c);
    }
  }
}

// store_accum_global into an fp32 matrix (split-KV partial outputs).
template <class Acc, class RowScale>
__device__ __forceinline__ void store_accum_global_f32(Acc& acc, float* gmem, int64_t row_stride,
                                                       int rows_valid, int cols_valid, int lane,
                                                       RowScale row_scale) {
  acc.for_each_pair(lane, [&](int fm, int slot, int r, int c, float v0, float v1) {
    if (r < rows_valid && c < cols_valid) {
      const float s = row_scale(fm, slot);
      *reinterpret_cast<float2*>(gmem + r * row_stride + c) = make_float2(v0 * s, v1 * s);
    }
  });
}

}  // namespace kern
}  // namespace flashv100
