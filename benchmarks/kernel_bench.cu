// Kernel-level timing of the fused attention kernels, without PyTorch: the forward (and the narrow
// prefill tile where the launcher picks it for this grid) and the backward (the D pre-pass, which
// also zeroes the dQ workspace, then dK/dV with dQ by atomics, with one and with two query-side
// buffers, and the wide tile where there is one; where one key tile holds every key, also the
// one-key-tile kernel the launcher runs there, with its own D where it computes it) of each kernel variant
// (plain, mask, dropout, mask + dropout; the mask variants run without a mask, i.e. they time the
// general score math alone), Ampere atom, fp16, CUDA-event medians. Inputs are random; outputs are
// not checked (the tests do that). It builds in seconds against a source tree, so kernel changes
// can be compared side by side:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Icsrc \
//       -o kernel_bench benchmarks/kernel_bench.cu
//   ./kernel_bench B H L E            (E = 64, 128 or 256; e.g. 16 32 1024 64)
//   ./kernel_bench decode B Hq Hkv S SPLITS...
//   ./kernel_bench decode-paged PAGE B Hq Hkv S SPLITS...
//
// decode: one query token per sequence against a contiguous KV cache [B, S, Hkv, 128] (the plain
// decode tile, GQA packed into rows as flash_attn_with_kvcache runs it, nothing appended), for
// each split count given (> 1: the split kernel and the combine, dependent on sm_90+ as the library
// launches it); the L2 is flushed before each step, and GB/s counts the K and V bytes read.
// decode-paged: the same step on the contiguous cache and then on the same memory as a paged
// cache of PAGE rows a page (pages in a shuffled order, as the decode suite's), one after the
// other per split count, so that the cost of paging is read off one run.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/kernels/flash_bwd.cuh"
#include "cuda/kernels/flash_fwd.cuh"

using namespace flashv100;
using namespace flashv100::kern;

#define CHECK_CUDA(call)                                                              \
  do {                                                                                \
    const cudaError_t err = (call);                                                   \
    if (err != cudaSuccess) {                                                         \
      std::fprintf(stderr, "CUDA error %s at line %d\n", cudaGetErrorString(err), __LINE__); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// Uniform values in [-1, 1) from a hash of the index.
__global__ void fill_random(__half* x, int64_t n, uint32_t salt) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ salt;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2half((h & 0xFFFF) / 32768.0f - 1.0f);
  }
}

// Median milliseconds of `launch` over `iters` runs, after 3 warm-up runs; `before_each(i)` runs
// before run i, outside the timed span.
template <class F, class G>
float median_ms(F&& launch, G&& before_each, int iters = 20) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> times;
  for (int i = 0; i < iters; ++i) {
    before_each(i);
    CHECK_CUDA(cudaEventRecord(start));
    launch();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

template <class F>
float median_ms(F&& launch) {
  return median_ms(launch, [](int) {});
}

// The same with `flush_bytes` of `flush` overwritten before each run, so that no run finds its
// inputs in the L2.
template <class F>
float median_ms_cold(F&& launch, void* flush, size_t flush_bytes) {
  return median_ms(launch, [&](int i) { CHECK_CUDA(cudaMemsetAsync(flush, i, flush_bytes)); });
}

// Device buffers of one problem, freed on scope exit.
struct Buffers {
  std::vector<void*> owned;
  template <class T>
  T* alloc(int64_t count) {
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, count * sizeof(T)));
    owned.push_back(p);
    return static_cast<T*>(p);
  }
  ~Buffers() {
    for (void* p : owned) cudaFree(p);
  }
};

template <int E, Variant V>
void run(int batch, int heads, int len) {
  const int64_t elems = static_cast<int64_t>(batch) * heads * len * E;
  const int64_t rows = static_cast<int64_t>(batch) * heads * len;
  using FCfg = FwdConfig<AmpereAtom, E, V>;
  using DqWs = DqWorkspace<AmpereAtom, BwdConfig<AmpereAtom, E, V>>;
  using WideDqWs = DqWorkspace<
      AmpereAtom, BwdConfig<AmpereAtom, E, V, 1,
                            has_wide_bwd_tile<AmpereAtom, E, V>() ? BwdTileSize::kWide
                                                                  : BwdTileSize::kCompact>>;
  Buffers buf;
  __half *q = buf.alloc<__half>(elems), *k = buf.alloc<__half>(elems);
  __half *v = buf.alloc<__half>(elems), *dout = buf.alloc<__half>(elems);
  fill_random<<<1024, 256>>>(q, elems, 1);
  fill_random<<<1024, 256>>>(k, elems, 2);
  fill_random<<<1024, 256>>>(v, elems, 3);
  fill_random<<<1024, 256>>>(dout, elems, 4);
  // The backward reads seed and offset from device memory (the forward's rng_state).
  int64_t* rng_state = buf.alloc<int64_t>(2);
  const int64_t seed_offset[2] = {1234, 0};
  CHECK_CUDA(cudaMemcpy(rng_state, seed_offset, sizeof(seed_offset), cudaMemcpyHostToDevice));

  ForwardParams p;
  p.shape = AttentionShape{batch, heads, heads, len, len, E, E};
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = buf.alloc<__half>(elems);
  p.lse = buf.alloc<float>(rows);
  p.lse_layout = LseLayout{static_cast<int64_t>(heads) * len, len};
  const TensorStrides strides{static_cast<int64_t>(heads) * len * E,
                              static_cast<int64_t>(len) * E, E};
  p.q_strides = p.k_strides = p.v_strides = p.out_strides = strides;
  p.scale = 1.0 / std::sqrt(static_cast<double>(E));
  p.dropout.p = has_dropout(V) ? 0.1f : 0.0f;
  p.dropout.seed = static_cast<uint64_t>(seed_offset[0]);

  const auto fwd = flash_fwd_kernel<AmpereAtom, Fp16, E, V>;
  CHECK_CUDA(cudaFuncSetAttribute(fwd, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  FCfg::kSmemBytes));
  const dim3 fwd_grid((len + FCfg::kBlockM - 1) / FCfg::kBlockM, batch * heads);
  const float fwd_ms = median_ms([&] { fwd<<<fwd_grid, FCfg::kThreads, FCfg::kSmemBytes>>>(p); });
  int sm_count = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  float narrow_ms = 0.0f;
  if constexpr (has_narrow_prefill_tile<AmpereAtom, E, V>()) {
    if (uses_narrow_prefill_tile(static_cast<int64_t>(fwd_grid.x) * fwd_grid.y, sm_count)) {
      using NCfg = FwdConfig<AmpereAtom, E, V, FwdShape::kNarrowPrefill>;
      const auto narrow = flash_fwd_kernel<AmpereAtom, Fp16, E, V, false, FwdShape::kNarrowPrefill>;
      CHECK_CUDA(cudaFuncSetAttribute(narrow, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      NCfg::kSmemBytes));
      const dim3 grid((len + NCfg::kBlockM - 1) / NCfg::kBlockM, batch * heads);
      narrow_ms = median_ms([&] { narrow<<<grid, NCfg::kThreads, NCfg::kSmemBytes>>>(p); });
    }
  }

  BackwardParams bp;
  bp.fwd = p;
  bp.fwd.dropout.seed_ptr = rng_state;
  bp.fwd.dropout.offset_ptr = rng_state + 1;
  bp.dout = dout;
  bp.dq = buf.alloc<__half>(elems);
  bp.dk = buf.alloc<__half>(elems);
  bp.dv = buf.alloc<__half>(elems);
  bp.dout_strides = bp.dq_strides = bp.dk_strides = bp.dv_strides = strides;
  float* row_vectors = buf.alloc<float>(3 * rows);  // D, and the masked variants' base and norm
  if (is_general(V)) {
    bp.row_base = row_vectors + rows;
    bp.row_log2_norm = row_vectors + 2 * rows;
  }
  // The workspace of the largest dQ tiling (the wide tile's query tiles may be taller).
  float* dq_accum = buf.alloc<float>(std::max(DqWs::floats(batch * heads, len),
                                              WideDqWs::floats(batch * heads, len)));
  const auto dsum = flash_bwd_dsum_kernel<Fp16, is_general(V)>;
  // D pre-pass + dK/dV kernel of one backward configuration (BwdConfig: query-side buffers, tile).
  const auto bwd_ms = [&](auto stages, auto size) {
    constexpr int kStages = decltype(stages)::value;
    constexpr BwdTileSize kSize = decltype(size)::value;
    using Cfg = BwdConfig<AmpereAtom, E, V, kStages, kSize>;
    const DqWorkspaceRows dq_ws = DqWorkspace<AmpereAtom, Cfg>::rows(dq_accum, len);
    const int64_t dsum_blocks = (batch * heads * dq_ws.padded_len_q + 3) / 4;
    const dim3 grid((len + Cfg::kBlockN - 1) / Cfg::kBlockN, batch * heads);
    const auto dkdv = flash_bwd_dkdv_kernel<AmpereAtom, Fp16, E, V, kStages, kSize>;
    CHECK_CUDA(cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Cfg::kSmemBytes));
    return median_ms([&] {
      dsum<<<dsum_blocks, 128>>>(bp, row_vectors, dq_ws);  // also zeroes the dQ workspace
      dkdv<<<grid, Cfg::kThreads, Cfg::kSmemBytes>>>(bp, row_vectors, dq_accum,
                                                      KvGroupSplit{1, 1, nullptr, nullptr}, false);
    });
  };
  using Compact = std::integral_constant<BwdTileSize, BwdTileSize::kCompact>;
  using Wide = std::integral_constant<BwdTileSize, BwdTileSize::kWide>;
  const float bwd1_ms = bwd_ms(std::integral_constant<int, 1>{}, Compact{});
  const float bwd2_ms = bwd_ms(std::integral_constant<int, 2>{}, Compact{});
  float wide_ms = 0.0f;
  if constexpr (has_wide_bwd_tile<AmpereAtom, E, V>()) {
    wide_ms = bwd_ms(std::integral_constant<int, 2>{}, Wide{});
  }
  // The one-key-tile kernel (kDqDirect) as the launcher picks it: the compact tile, else the wide
  // one where it has one, its query tiles split over blocks as dkdv_split says (then the slabs'
  // reduction too).
  const auto one_key_tile_ms = [&](auto stages, auto size) {
    constexpr int kStages = decltype(stages)::value;
    constexpr BwdTileSize kSize = decltype(size)::value;
    using Cfg = BwdConfig<AmpereAtom, E, V, kStages, kSize>;
    const bool computes_row_vectors = dkdv_computes_row_vectors<Cfg>(1, len);
    const DqWorkspaceRows no_ws{nullptr, len, 0};
    const int64_t dsum_blocks = (static_cast<int64_t>(batch) * heads * len + 3) / 4;
    const auto dkdv = flash_bwd_dkdv_kernel<AmpereAtom, Fp16, E, V, kStages, kSize, true>;
    CHECK_CUDA(cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Cfg::kSmemBytes));
    KvGroupSplit split =
        dkdv_split(1, batch * heads, (len + Cfg::kBlockM - 1) / Cfg::kBlockM, sm_count);
    if (split.count > 1) {
      split.dk = buf.alloc<float>(2 * split.count * elems);
      split.dv = split.dk + split.count * elems;
    }
    const dim3 reduce_grid(dkdv_reduce_blocks(len, E), batch * heads);
    return median_ms([&] {
      if (!computes_row_vectors) dsum<<<dsum_blocks, 128>>>(bp, row_vectors, no_ws);
      dkdv<<<dim3(1, batch * heads * split.count), Cfg::kThreads, Cfg::kSmemBytes>>>(
          bp, row_vectors, nullptr, split, computes_row_vectors);
      if (split.count > 1) {
        flash_bwd_dkdv_reduce_kernel<Fp16><<<reduce_grid, kDkdvReduceThreads>>>(bp, split);
      }
    });
  };
  float one_tile_ms = 0.0f;
  if (has_one_key_tile<BwdConfig<AmpereAtom, E, V>>(len)) {
    one_tile_ms = one_key_tile_ms(std::integral_constant<int, 1>{}, Compact{});
  } else if constexpr (has_direct_wide_bwd_tile<AmpereAtom, E, V>()) {
    if (has_one_key_tile<BwdConfig<AmpereAtom, E, V, 2, BwdTileSize::kWide>>(len)) {
      one_tile_ms = one_key_tile_ms(std::integral_constant<int, 2>{}, Wide{});
    }
  }

  const double fwd_flops = 4.0 * batch * heads * static_cast<double>(len) * len * E;
  const double bwd_flops = 2.5 * fwd_flops;
  std::printf(
      "B%d H%d L%d E%d %-12s fwd %.3f ms (%.0f TFLOP/s)  bwd %.3f ms (%.0f TFLOP/s), two query "
      "buffers %.3f ms (%.0f TFLOP/s)",
      batch, heads, len, E, variant_name(V), fwd_ms, fwd_flops / fwd_ms * 1e-9, bwd1_ms,
      bwd_flops / bwd1_ms * 1e-9, bwd2_ms, bwd_flops / bwd2_ms * 1e-9);
  if (wide_ms > 0.0f) {
    std::printf(", wide tile %.3f ms (%.0f TFLOP/s)", wide_ms, bwd_flops / wide_ms * 1e-9);
  }
  if (narrow_ms > 0.0f) std::printf(", narrow fwd %.4f ms", narrow_ms);
  if (one_tile_ms > 0.0f) std::printf(", one key tile %.4f ms", one_tile_ms);
  std::printf("\n");
}

template <int E>
void run_variants(int batch, int heads, int len) {
  run<E, Variant::kPlain>(batch, heads, len);
  run<E, Variant::kMasked>(batch, heads, len);
  run<E, Variant::kDropout>(batch, heads, len);
  run<E, Variant::kMaskedDropout>(batch, heads, len);
}

// One decode step (see the top of the file) per split count, and with page_size > 0 the same step
// on a paged view of the cache after it; the params mirror make_kvcache_forward_params: the group
// = Hq / Hkv query heads of a KV head are rows of it.
void run_decode(int batch, int heads_q, int heads_kv, int len_kv, const std::vector<int>& splits,
                int page_size) {
  constexpr int E = 128;
  using Cfg = FwdConfig<AmpereAtom, E, Variant::kPlain, FwdShape::kDecode>;
  using PagedCfg = FwdConfig<AmpereAtom, E, Variant::kPlain, FwdShape::kDecode, true>;
  const int group = heads_q / heads_kv;
  // Paged: each sequence's rows in whole pages of the same memory ([pages, page_size, Hkv, E]).
  const int seq_pages = page_size > 0 ? (len_kv + page_size - 1) / page_size : 0;
  const int64_t cache_rows = std::max(static_cast<int64_t>(len_kv),
                                      static_cast<int64_t>(seq_pages) * page_size);
  const int64_t cache_elems = static_cast<int64_t>(batch) * cache_rows * heads_kv * E;
  const int64_t rows = static_cast<int64_t>(batch) * heads_q;
  Buffers buf;
  __half *q = buf.alloc<__half>(rows * E), *out = buf.alloc<__half>(rows * E);
  __half *k = buf.alloc<__half>(cache_elems), *v = buf.alloc<__half>(cache_elems);
  fill_random<<<1024, 256>>>(q, rows * E, 1);
  fill_random<<<1024, 256>>>(k, cache_elems, 2);
  fill_random<<<1024, 256>>>(v, cache_elems, 3);
  const std::vector<int32_t> lengths(batch, len_kv);
  int32_t* seqlens = buf.alloc<int32_t>(batch);
  CHECK_CUDA(cudaMemcpy(seqlens, lengths.data(), batch * sizeof(int32_t), cudaMemcpyHostToDevice));
  const int max_splits = *std::max_element(splits.begin(), splits.end());
  float* out_accum = buf.alloc<float>(max_splits * rows * E);
  float* lse_accum = buf.alloc<float>(max_splits * rows);
  const size_t flush_bytes = 256u << 20;
  void* flush = buf.alloc<char>(flush_bytes);

  ForwardParams p;
  p.shape = AttentionShape{batch, heads_kv, heads_kv, group, len_kv, E, E};
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = buf.alloc<float>(rows);
  p.lse_layout = LseLayout{heads_q, group};
  p.q_strides = p.out_strides =
      TensorStrides{static_cast<int64_t>(heads_q) * E, static_cast<int64_t>(group) * E, E};
  p.k_strides = p.v_strides = TensorStrides{cache_rows * heads_kv * E, E,
                                            static_cast<int64_t>(heads_kv) * E};
  p.scale = 1.0 / std::sqrt(static_cast<double>(E));
  p.kvcache.seqlens = seqlens;
  p.split.out_accum = out_accum;
  p.split.lse_accum = lse_accum;

  const auto fwd = flash_fwd_kernel<AmpereAtom, Fp16, E, Variant::kPlain, false, FwdShape::kDecode>;
  CHECK_CUDA(cudaFuncSetAttribute(fwd, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  Cfg::kSmemBytes));
  const auto paged_fwd =
      flash_fwd_kernel<AmpereAtom, Fp16, E, Variant::kPlain, true, FwdShape::kDecode>;
  ForwardParams paged = p;
  if (page_size > 0) {
    CHECK_CUDA(cudaFuncSetAttribute(paged_fwd, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    PagedCfg::kSmemBytes));
    std::vector<int32_t> table(static_cast<size_t>(batch) * seq_pages);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(0));
    int32_t* block_table = buf.alloc<int32_t>(static_cast<int64_t>(table.size()));
    CHECK_CUDA(cudaMemcpy(block_table, table.data(), table.size() * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    paged.kvcache.block_table = block_table;
    paged.kvcache.block_table_stride = seq_pages;
    paged.kvcache.block_table_cols = seq_pages;
    paged.kvcache.page_size = page_size;
    paged.k_strides.batch = paged.v_strides.batch =
        static_cast<int64_t>(page_size) * heads_kv * E;  // a page
  }
  const double kv_bytes = 2.0 * static_cast<double>(batch) * len_kv * heads_kv * E * sizeof(__half);
  // The combine as the library launches it: programmatically dependent on sm_90+.
  cudaLaunchConfig_t combine = {};
  combine.gridDim = dim3((rows + kCombineWarps - 1) / kCombineWarps);
  combine.blockDim = dim3(kCombineWarps * 32);
  cudaLaunchAttribute dependent;
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  int major = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major >= 9) combine.attrs = &dependent, combine.numAttrs = 1;
  for (const int s : splits) {
    p.split.num_splits = paged.split.num_splits = s;
    const dim3 grid((group + Cfg::kBlockM - 1) / Cfg::kBlockM, batch * heads_kv, s);
    const float ms = median_ms_cold(
        [&] {
          fwd<<<grid, Cfg::kThreads, Cfg::kSmemBytes>>>(p);
          if (s > 1) CHECK_CUDA(cudaLaunchKernelEx(&combine, split_kv_combine_kernel<Fp16>, p));
        },
        flush, flush_bytes);
    std::printf("decode B%d H%d/%d S%d D%d splits %3d: %8.1f us  %6.0f GB/s (K/V read)\n", batch,
                heads_q, heads_kv, len_kv, E, s, ms * 1e3, kv_bytes / ms * 1e-6);
    if (page_size == 0) continue;
    const float paged_ms = median_ms_cold(
        [&] {
          paged_fwd<<<grid, PagedCfg::kThreads, PagedCfg::kSmemBytes>>>(paged);
          if (s > 1) {
            CHECK_CUDA(cudaLaunchKernelEx(&combine, split_kv_combine_kernel<Fp16>, paged));
          }
        },
        flush, flush_bytes);
    std::printf("decode paged%d B%d H%d/%d S%d D%d splits %3d: %8.1f us  %6.0f GB/s (K/V read)\n",
                page_size, batch, heads_q, heads_kv, len_kv, E, s, paged_ms * 1e3,
                kv_bytes / paged_ms * 1e-6);
  }
}

int main(int argc, char** argv) {
  const bool paged = argc >= 2 && std::string(argv[1]) == "decode-paged";
  if ((argc >= 7 && std::string(argv[1]) == "decode") || (paged && argc >= 8)) {
    const int first = paged ? 3 : 2;  // B's argument
    const int page_size = paged ? std::atoi(argv[2]) : 0;
    std::vector<int> splits;
    for (int i = first + 4; i < argc; ++i) splits.push_back(std::max(1, std::atoi(argv[i])));
    const int heads_q = std::atoi(argv[first + 1]), heads_kv = std::atoi(argv[first + 2]);
    if (heads_kv <= 0 || heads_q % heads_kv != 0 || heads_q / heads_kv > kDecodeRows) {
      std::fprintf(stderr, "decode: Hq must be a multiple of Hkv, at most %d times it\n",
                   kDecodeRows);
      return 2;
    }
    if (paged && (page_size <= 0 || page_size % 16 != 0)) {
      std::fprintf(stderr, "decode-paged: PAGE must be a positive multiple of 16\n");
      return 2;
    }
    run_decode(std::atoi(argv[first]), heads_q, heads_kv, std::atoi(argv[first + 3]), splits,
               page_size);
    return 0;
  }
  if (argc != 5) {
    std::fprintf(stderr,
                 "usage: %s B H L E  (E = 64, 128 or 256)\n       %s decode B Hq Hkv S SPLITS...\n"
                 "       %s decode-paged PAGE B Hq Hkv S SPLITS...\n",
                 argv[0], argv[0], argv[0]);
    return 2;
  }
  const int batch = std::atoi(argv[1]), heads = std::atoi(argv[2]), len = std::atoi(argv[3]);
  const int head_dim = std::atoi(argv[4]);
  if (head_dim == 64) {
    run_variants<64>(batch, heads, len);
  } else if (head_dim == 128) {
    run_variants<128>(batch, heads, len);
  } else if (head_dim == 256) {
    run_variants<256>(batch, heads, len);
  } else {
    std::fprintf(stderr, "E must be 64, 128 or 256\n");
    return 2;
  }
  return 0;
}
