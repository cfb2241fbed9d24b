// The attention kernels (flash_fwd.cuh, flash_bwd.cuh) of one atom and head-dim bucket run whole
// on the CPU by the host emulation (cuda_host_emulation.h), launched as the CUDA launchers launch
// them (csrc/cuda/api/forward_launch.cuh, backward_launch.cuh): the forward in the prefill or the
// decode tile, then optionally the D pre-pass, dK/dV and dQ (atomic workspace + convert, the
// deterministic kernel, or with one key tile dK/dV alone) in one of the backward configurations
// (query-side buffers, tile size).
// tests/test_kernel_emulation.py builds it per (atom, bucket), writes a case and compares the
// results with the fp64 reference.
//
//   c++ -std=c++17 -O1 -Icsrc -Itests/atoms -DEMULATED_ATOM=VoltaAtom (or AmpereAtom)
//       -DEMULATED_HEAD_DIM=128 tests/atoms/kernel_emulation.cpp && ./a.out DIR
// DIR/case.txt: "name value" lines (batch heads_q heads_kv len_q len_kv head_dim bf16 scale causal
// window_left window_right softcap mask dropout_p seed offset decode_tile [narrow_tile] backward
// deterministic bwd_stages bwd_wide kv_group_parts [kv_row_parts]: with kv_group_parts > 1 the
// dK/dV kernel runs that many parts of each GQA group, and with one key tile kv_row_parts shares of
// each part's query tiles, reduced by flash_bwd_dkdv_reduce_kernel). Tensors, raw
// little-endian: q [B, Hq, Lq, d], k / v [B, Hkv, Lkv, d], dout like q (fp16 or bf16); mask [B, Hq,
// Lq, Lkv] fp32 (additive; "mask 1"). Writes out (like q), lse [B, Hq, Lq] (fp32) and with
// "backward 1" dq, dk, dv. Exits with 3 for a configuration the launchers never run (e.g. two query
// buffers on the Volta atom). Shared memory is filled with NaN before each block, so that a read of
// anything a block did not write shows up in its results.
//
// "kvcache 1" runs flash_attn_with_kvcache's kernels instead (launch_kvcache.cu): k / v are the
// caches, [cache_batch, cache_rows, Hkv, d] (paged: cache_batch pages of cache_rows rows, with
// block_table int32 [B, max_blocks]), seqlens int32 [B] and optionally leftpad / batch_idx int32
// [B]; with seqlen_new > 0 the new rows k_new / v_new [B, seqlen_new, Hkv, d] are appended by the
// append kernel (rotary_dim > 0: it also rotates them and q by cos / sin [seqlen_ro, rotary_dim /
// 2]) or by the decode tile itself ("append_in_kernel 1"); num_splits > 1 runs split-KV and the
// combine kernel; "pack_gqa 1" lays a one-row query's heads of a KV head out as rows, as
// make_kvcache_forward_params does; "total_q N" (N > 0) packs the queries as [N, Hq, d] with
// cu_seqlens_q int32 [B + 1] (flash_attn_varlen_func with block_table; out alike, lse [Hq, N]).
// Writes out, lse and the caches after the append (k_cache, v_cache).
#include "cuda_host_emulation.h"

// The kernels' `extern __shared__ uint4 smem_raw[]` (one block runs at a time).
namespace flashv100 {
namespace kern {
uint4 smem_raw[227 * 1024 / sizeof(uint4)];
}  // namespace kern
}  // namespace flashv100

#include <cstdlib>
#include <fstream>
#include <map>
#include <type_traits>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/kernels/flash_bwd.cuh"
#include "cuda/kernels/flash_fwd.cuh"
#include "cuda/kernels/kvcache.cuh"

static_assert(sizeof(flashv100::kern::smem_raw) >= flashv100::kern::kBwdLargestSmemBytes,
              "the emulated shared memory holds every tile");

namespace {

using namespace flashv100;
using kern::Variant;
using Atom = kern::EMULATED_ATOM;
constexpr int kBucket = EMULATED_HEAD_DIM;

std::map<std::string, double> read_case(const std::string& dir) {
  std::ifstream in(dir + "/case.txt");
  std::map<std::string, double> c;
  std::string key;
  double value;
  while (in >> key >> value) c[key] = value;
  return c;
}

template <class T>
std::vector<T> read_tensor(const std::string& path, size_t count) {
  std::vector<T> v(count);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(count * sizeof(T)));
  if (!in) {
    std::fprintf(stderr, "cannot read %zu values from %s\n", count, path.c_str());
    std::exit(2);
  }
  return v;
}

template <class T>
void write_tensor(const std::string& path, const std::vector<T>& v) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}

TensorStrides bhld_strides(int64_t heads, int64_t len, int64_t d) {
  return TensorStrides{heads * len * d, len * d, d};
}

// Every block starts from shared memory full of NaN (0x7e00 halves, 0x7e007e00 floats).
template <class Kernel, class... Args>
void launch(dim3 grid, int threads, Kernel kernel, const Args&... args) {
  cuda_emulation::launch(grid, threads, [&] {
    if (threadIdx.x == 0) {
      uint16_t* s = reinterpret_cast<uint16_t*>(kern::smem_raw);
      std::fill(s, s + sizeof(kern::smem_raw) / 2, static_cast<uint16_t>(0x7e00));
    }
    __syncthreads();
    kernel(args...);
  });
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
unsigned grid(int64_t n) { return static_cast<unsigned>(n); }

[[noreturn]] void unsupported(const char* what) {
  std::fprintf(stderr, "not a configuration the launchers run: %s\n", what);
  std::exit(3);
}

// A forward over q [B, Hq, Lq, d] and K / V of len_kv rows with k_strides (the case's shape,
// scale, causal mode, window and softcap), writing out (like q) and lse [B, Hq, Lq].
ForwardParams forward_params(const std::map<std::string, double>& c, std::vector<uint16_t>& q,
                             std::vector<uint16_t>& k, std::vector<uint16_t>& v,
                             std::vector<uint16_t>& out, std::vector<float>& lse, int64_t len_kv,
                             TensorStrides k_strides) {
  const int64_t B = c.at("batch"), Hq = c.at("heads_q"), Hkv = c.at("heads_kv");
  const int64_t Lq = c.at("len_q"), d = c.at("head_dim");
  ForwardParams p;
  p.shape = AttentionShape{B, Hq, Hkv, Lq, len_kv, d, d};
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.out = out.data();
  p.lse = lse.data();
  p.lse_layout = LseLayout{Hq * Lq, Lq};
  p.q_strides = p.out_strides = bhld_strides(Hq, Lq, d);
  p.k_strides = p.v_strides = k_strides;
  p.scale = c.at("scale");
  p.causal = static_cast<CausalMode>(static_cast<int>(c.at("causal")));
  p.window = WindowParams{static_cast<int32_t>(c.at("window_left")),
                          static_cast<int32_t>(c.at("window_right"))};
  p.score_mod.softcap = static_cast<float>(c.at("softcap"));
  return p;
}

// The forward tile a case asks for: "decode_tile 1", "narrow_tile 1" (the prefill tile of a small
// grid: narrow where there is one), else the prefill tile.
kern::FwdShape forward_tile(const std::map<std::string, double>& c) {
  if (c.at("decode_tile") != 0) return kern::FwdShape::kDecode;
  if (c.count("narrow_tile") != 0 && c.at("narrow_tile") != 0) {
    return kern::FwdShape::kNarrowPrefill;
  }
  return kern::FwdShape::kPrefill;
}

// The forward kernel of p in the prefill, narrow prefill or decode tile (forward_launch.cuh): one
// block per (query tile, batch * query head, split); K / V through a block table where p has one.
template <class Elem, Variant V>
void run_forward(const ForwardParams& p, kern::FwdShape tile) {
  constexpr int D = kBucket;
  const auto forward = [&](auto shape, auto paged) {
    constexpr kern::FwdShape kShape = decltype(shape)::value;
    constexpr bool kPaged = decltype(paged)::value;
    using Cfg = kern::FwdConfig<Atom, D, V, kShape, kPaged>;
    launch(dim3{grid(ceil_div(p.shape.len_q, Cfg::kBlockM)), grid(p.shape.batch * p.shape.heads_q),
                grid(p.split.num_splits)},
           Cfg::kThreads, kern::flash_fwd_kernel<Atom, Elem, D, V, kPaged, kShape>, p);
  };
  const auto in_tile = [&](auto shape) {
    if (p.kvcache.block_table != nullptr) {
      forward(shape, std::true_type{});
    } else {
      forward(shape, std::false_type{});
    }
  };
  using kern::FwdShape;
  if (tile == FwdShape::kPrefill) {
    in_tile(std::integral_constant<FwdShape, FwdShape::kPrefill>{});
  } else if (tile == FwdShape::kNarrowPrefill) {
    // The launcher's prefill tile for a grid that leaves SMs idle (uses_narrow_prefill_tile): the
    // narrow one where the atom, head dim and variant have it and K/V are contiguous.
    if constexpr (kern::has_narrow_prefill_tile<Atom, D, V>()) {
      if (p.kvcache.block_table == nullptr) {
        return forward(std::integral_constant<FwdShape, FwdShape::kNarrowPrefill>{},
                       std::false_type{});
      }
    }
    in_tile(std::integral_constant<FwdShape, FwdShape::kPrefill>{});
  } else if constexpr (kern::has_decode_tile<Atom>(D) && !kern::has_dropout(V)) {
    if (p.shape.len_q > kern::kDecodeRows) unsupported("the decode tile takes at most 32 rows");
    in_tile(std::integral_constant<FwdShape, FwdShape::kDecode>{});
  } else {
    unsupported("no decode tile for this atom, head dim and variant");
  }
}

// The backward after a forward: the D pre-pass, dK/dV and dQ in the configuration (query-side
// buffers, tile size) backward_launch.cuh's `run` would launch.
template <class Elem, int D, Variant V, int kStages, kern::BwdTileSize kSize,
          bool kDqDirect = false>
void run_backward(BackwardParams& bp, int kv_group_parts, int kv_row_parts) {
  const AttentionShape& s = bp.fwd.shape;
  using Cfg = kern::BwdConfig<Atom, D, V, kStages, kSize>;
  using DqWorkspace = kern::DqWorkspace<Atom, Cfg>;
  std::vector<float> dsum(s.batch * s.heads_q * s.len_q, NAN), dq_accum;
  const int64_t key_tiles = ceil_div(s.len_kv, Cfg::kBlockN);
  const bool dkdv_row_vectors =
      kDqDirect && kern::dkdv_computes_row_vectors<Cfg>(s.heads_q / s.heads_kv, s.len_q);
  kern::DqWorkspaceRows dq_ws{nullptr, s.len_q, 0};
  if (!bp.deterministic && !kDqDirect) {
    dq_accum.assign(DqWorkspace::floats(s.batch * s.heads_q, s.len_q), NAN);  // zeroed by D's pass
    dq_ws = DqWorkspace::rows(dq_accum.data(), s.len_q);
  }
  if (!dkdv_row_vectors) {
    launch(dim3{grid(ceil_div(s.batch * s.heads_q * dq_ws.padded_len_q, 4)), 1, 1}, 128,
           kern::flash_bwd_dsum_kernel<Elem, kern::is_general(V)>, bp, dsum.data(), dq_ws);
  }
  // The parts' fp32 slabs start as NaN: a row the reduction reads but no part wrote shows up.
  const int64_t slab = s.batch * s.heads_kv * s.len_kv * s.head_dim;
  const int parts = kv_group_parts * kv_row_parts;
  const int64_t parts_floats = parts > 1 ? parts * slab : 0;
  std::vector<float> kv_parts(2 * parts_floats, NAN);
  const kern::KvGroupSplit split{parts, kv_row_parts, kv_parts.data(),
                                 kv_parts.data() + parts_floats};
  launch(dim3{grid(key_tiles), grid(s.batch * s.heads_kv * parts), 1}, Cfg::kThreads,
         kern::flash_bwd_dkdv_kernel<Atom, Elem, D, V, kStages, kSize, kDqDirect>, bp, dsum.data(),
         dq_ws.floats, split, dkdv_row_vectors);
  if (parts > 1) {
    launch(dim3{grid(kern::dkdv_reduce_blocks(s.len_kv, s.head_dim)),
                grid(s.batch * s.heads_kv), 1},
           kern::kDkdvReduceThreads, kern::flash_bwd_dkdv_reduce_kernel<Elem>, bp, split);
  }
  if constexpr (kDqDirect) return;
  if (bp.deterministic) {
    launch(dim3{grid(ceil_div(s.len_q, Cfg::kBlockM)), grid(s.batch * s.heads_q), 1},
           Cfg::kThreads, kern::flash_bwd_dq_kernel<Atom, Elem, D, V, kSize>, bp,
           static_cast<const float*>(dsum.data()));
  } else {
    launch(dim3{grid(DqWorkspace::query_tiles(s.len_q)), grid(s.batch * s.heads_q), 1},
           Cfg::kThreads, kern::flash_bwd_dq_convert_kernel<Atom, Elem, D, V, kSize>, bp,
           static_cast<const float*>(dq_ws.floats));
  }
}

template <class Elem, Variant V>
void run(const std::map<std::string, double>& c, const std::string& dir) {
  constexpr int D = kBucket;
  const int64_t B = c.at("batch"), Hq = c.at("heads_q"), Hkv = c.at("heads_kv");
  const int64_t Lq = c.at("len_q"), Lkv = c.at("len_kv"), d = c.at("head_dim");
  std::vector<uint16_t> q = read_tensor<uint16_t>(dir + "/q", B * Hq * Lq * d);
  std::vector<uint16_t> k = read_tensor<uint16_t>(dir + "/k", B * Hkv * Lkv * d);
  std::vector<uint16_t> v = read_tensor<uint16_t>(dir + "/v", B * Hkv * Lkv * d);
  std::vector<float> mask;
  std::vector<uint16_t> out(B * Hq * Lq * d, 0x7e00);
  std::vector<float> lse(B * Hq * Lq, NAN);

  ForwardParams p = forward_params(c, q, k, v, out, lse, Lkv, bhld_strides(Hkv, Lkv, d));
  if (c.at("mask") != 0) {
    mask = read_tensor<float>(dir + "/mask", B * Hq * Lq * Lkv);
    p.mask.ptr = mask.data();
    p.mask.kind = MaskKind::kAdditive;
    p.mask.dtype = ScalarKind::kFloat;
    p.mask.batch_stride = Hq * Lq * Lkv;
    p.mask.head_stride = Lq * Lkv;
    p.mask.row_stride = Lkv;
    p.mask.col_stride = 1;
  }
  p.dropout.p = static_cast<float>(c.at("dropout_p"));
  p.dropout.seed = static_cast<uint64_t>(c.at("seed"));
  p.dropout.offset = static_cast<uint64_t>(c.at("offset"));

  run_forward<Elem, V>(p, forward_tile(c));
  write_tensor(dir + "/out", out);
  write_tensor(dir + "/lse", lse);
  if (c.at("backward") == 0) return;

  std::vector<uint16_t> dout = read_tensor<uint16_t>(dir + "/dout", B * Hq * Lq * d);
  std::vector<uint16_t> dq(q.size(), 0x7e00), dk(k.size(), 0x7e00), dv(v.size(), 0x7e00);
  std::vector<float> row_base(B * Hq * Lq, NAN), row_log2_norm(B * Hq * Lq, NAN);
  BackwardParams bp;
  bp.fwd = p;
  bp.dout = dout.data();
  bp.dq = dq.data();
  bp.dk = dk.data();
  bp.dv = dv.data();
  bp.dout_strides = bp.dq_strides = p.q_strides;
  bp.dk_strides = bp.dv_strides = p.k_strides;
  if (kern::is_general(V)) {
    bp.row_base = row_base.data();
    bp.row_log2_norm = row_log2_norm.data();
  }
  bp.deterministic = c.at("deterministic") != 0;
  const int parts = c.count("kv_group_parts") != 0 ? static_cast<int>(c.at("kv_group_parts")) : 1;
  const int row_parts = c.count("kv_row_parts") != 0 ? static_cast<int>(c.at("kv_row_parts")) : 1;
  using kern::BwdTileSize;
  if (kern::has_one_key_tile<kern::BwdConfig<Atom, D, V>>(Lkv)) {
    run_backward<Elem, D, V, 1, BwdTileSize::kCompact, true>(bp, parts, row_parts);
  } else if (c.at("bwd_wide") != 0) {
    if constexpr (kern::has_wide_bwd_tile<Atom, D, V>()) {
      using WideCfg = kern::BwdConfig<Atom, D, V, 2, BwdTileSize::kWide>;
      constexpr bool kDirect = kern::has_direct_wide_bwd_tile<Atom, D, V>();
      if (kDirect && kern::has_one_key_tile<WideCfg>(Lkv)) {
        run_backward<Elem, D, V, 2, BwdTileSize::kWide, kDirect>(bp, parts, row_parts);
      } else {
        run_backward<Elem, D, V, 2, BwdTileSize::kWide>(bp, parts, row_parts);
      }
    } else {
      unsupported("no wide backward tile for this atom, head dim and variant");
    }
  } else if (c.at("bwd_stages") == 2) {
    if constexpr (Atom::kAsyncCopy) {
      run_backward<Elem, D, V, 2, BwdTileSize::kCompact>(bp, parts, row_parts);
    } else {
      unsupported("two query-side buffers need cp.async");
    }
  } else {
    run_backward<Elem, D, V, 1, BwdTileSize::kCompact>(bp, parts, row_parts);
  }
  write_tensor(dir + "/dq", dq);
  write_tensor(dir + "/dk", dk);
  write_tensor(dir + "/dv", dv);
}

// The forward of flash_attn_with_kvcache (launch_kvcache.cu's run_kvcache_forward, with the split
// count given): append, forward (paged or not, either tile), combine.
template <class Elem, Variant V>
void run_kvcache(const std::map<std::string, double>& c, const std::string& dir) {
  const int64_t B = c.at("batch"), Hq = c.at("heads_q"), Hkv = c.at("heads_kv");
  const int64_t Lq = c.at("len_q"), d = c.at("head_dim");
  const int64_t cache_batch = c.at("cache_batch"), cache_rows = c.at("cache_rows");
  const int64_t seqlen_new = c.at("seqlen_new"), rotary_dim = c.at("rotary_dim");
  const bool paged = c.at("paged") != 0;
  const int64_t max_blocks = paged ? static_cast<int64_t>(c.at("max_blocks")) : 1;
  const int64_t total_q = c.count("total_q") != 0 ? static_cast<int64_t>(c.at("total_q")) : 0;
  const int64_t q_rows = total_q > 0 ? total_q : B * Lq;
  std::vector<uint16_t> q = read_tensor<uint16_t>(dir + "/q", q_rows * Hq * d);
  std::vector<uint16_t> k = read_tensor<uint16_t>(dir + "/k", cache_batch * cache_rows * Hkv * d);
  std::vector<uint16_t> v = read_tensor<uint16_t>(dir + "/v", cache_batch * cache_rows * Hkv * d);
  std::vector<int32_t> seqlens = read_tensor<int32_t>(dir + "/seqlens", B), leftpad, batch_idx,
                       block_table;
  std::vector<uint16_t> k_new, v_new, cos, sin, q_rotated;
  std::vector<uint16_t> out(q_rows * Hq * d, 0x7e00);
  std::vector<float> lse(q_rows * Hq, NAN);
  std::vector<int32_t> cu_seqlens_q;

  KVCacheParams cache;
  cache.seqlens = seqlens.data();
  if (c.at("leftpad") != 0) {
    leftpad = read_tensor<int32_t>(dir + "/leftpad", B);
    cache.leftpad = leftpad.data();
  }
  if (c.at("batch_idx") != 0) {
    batch_idx = read_tensor<int32_t>(dir + "/batch_idx", B);
    cache.batch_idx = batch_idx.data();
  }
  if (paged) {
    block_table = read_tensor<int32_t>(dir + "/block_table", B * max_blocks);
    cache.block_table = block_table.data();
    cache.block_table_stride = max_blocks;
    cache.block_table_cols = max_blocks;
    cache.page_size = cache_rows;
  }
  cache.seqlen_new = seqlen_new;
  const TensorStrides cache_strides{cache_rows * Hkv * d, d, Hkv * d};  // [batch, rows, heads, d]
  const TensorStrides new_strides{seqlen_new * Hkv * d, d, Hkv * d};

  KVAppendParams a;
  a.cache = cache;
  a.batch = B, a.heads_q = Hq, a.heads_kv = Hkv, a.len_q = Lq, a.head_dim = d, a.head_dim_v = d;
  a.k_cache = k.data();
  a.v_cache = v.data();
  a.k_cache_strides = a.v_cache_strides = cache_strides;
  a.q = q.data();
  a.q_strides = bhld_strides(Hq, Lq, d);
  if (seqlen_new > 0) {
    k_new = read_tensor<uint16_t>(dir + "/k_new", B * seqlen_new * Hkv * d);
    v_new = read_tensor<uint16_t>(dir + "/v_new", B * seqlen_new * Hkv * d);
    a.k_new = k_new.data();
    a.v_new = v_new.data();
    a.k_new_strides = a.v_new_strides = new_strides;
  }
  if (rotary_dim > 0) {
    const int64_t seqlen_ro = c.at("seqlen_ro");
    cos = read_tensor<uint16_t>(dir + "/cos", seqlen_ro * rotary_dim / 2);
    sin = read_tensor<uint16_t>(dir + "/sin", seqlen_ro * rotary_dim / 2);
    q_rotated.assign(q.size(), 0x7e00);
    a.q_rotated = q_rotated.data();
    a.q_rotated_strides = a.q_strides;
    a.rotary_cos = cos.data();
    a.rotary_sin = sin.data();
    a.rotary_dim = rotary_dim;
    a.rotary_interleaved = c.at("rotary_interleaved") != 0;
    a.q_positions_advance = c.at("causal") != 0 || c.at("window_left") >= 0 ||
                            c.at("window_right") >= 0;
  }

  ForwardParams p = forward_params(c, rotary_dim > 0 ? q_rotated : q, k, v, out, lse,
                                   cache_rows * max_blocks, cache_strides);
  p.kvcache = cache;
  if (total_q > 0) {  // make_kvcache_forward_params' packed queries
    if (seqlen_new > 0 || rotary_dim > 0 || c.at("num_splits") > 1 || c.at("pack_gqa") != 0)
      unsupported("packed queries take no new rows, rotary, split or GQA packing");
    cu_seqlens_q = read_tensor<int32_t>(dir + "/cu_seqlens_q", B + 1);
    p.varlen.cu_seqlens_q = cu_seqlens_q.data();
    p.q_strides = p.out_strides = TensorStrides{0, d, Hq * d};
    p.lse_layout = LseLayout{0, total_q};
  }
  if (c.at("pack_gqa") != 0) {  // make_kvcache_forward_params: query head h * g + r as row r
    const int64_t group = Hq / Hkv;
    if (Lq != 1 || group == 1 || p.window.left >= 0) unsupported("pack_gqa needs one query row");
    p.shape.heads_q = Hkv;
    p.shape.len_q = group;
    p.q_strides = p.out_strides = TensorStrides{Hq * d, group * d, d};
    p.lse_layout = LseLayout{Hq, group};
    p.window.right = -1;
    p.causal = CausalMode::kNone;
  }

  const bool decode_tile = c.at("decode_tile") != 0;
  if (c.at("append_in_kernel") != 0) {
    if (!decode_tile || seqlen_new == 0 || rotary_dim > 0 || p.shape.heads_q != Hkv)
      unsupported("the forward appends only in the decode tile, without rotary, per KV head");
    p.append = KVNewRows{a.k_new, a.v_new, a.k_new_strides, a.v_new_strides, a.k_cache,
                         a.v_cache};
  } else {
    const int64_t total = (rotary_dim > 0 ? B * Lq * Hq * d : 0) + 2 * B * seqlen_new * Hkv * d;
    if (total > 0)
      launch(dim3{grid(ceil_div(total, kern::kAppendThreads)), 1, 1}, kern::kAppendThreads,
             kern::kvcache_append_kernel<Elem>, a);
  }
  const int64_t rows = p.shape.batch * p.shape.heads_q * p.shape.len_q;
  p.split.num_splits = static_cast<int32_t>(c.at("num_splits"));
  std::vector<float> out_accum, lse_accum;
  if (p.split.num_splits > 1) {
    out_accum.assign(p.split.num_splits * rows * d, NAN);
    lse_accum.assign(p.split.num_splits * rows, NAN);
    p.split.out_accum = out_accum.data();
    p.split.lse_accum = lse_accum.data();
  }
  run_forward<Elem, V>(p, forward_tile(c));
  if (p.split.num_splits > 1)
    launch(dim3{grid(ceil_div(rows, kern::kCombineWarps)), 1, 1}, kern::kCombineWarps * 32,
           kern::split_kv_combine_kernel<Elem>, p);
  write_tensor(dir + "/out", out);
  write_tensor(dir + "/lse", lse);
  write_tensor(dir + "/k_cache", k);
  write_tensor(dir + "/v_cache", v);
}

// The launchers' variant rule (csrc/cuda/api/dispatch.cuh, variant_of).
template <class Elem>
void run_variant(const std::map<std::string, double>& c, const std::string& dir) {
  const bool general = c.at("mask") != 0 || !(c.at("scale") > 0.0) || c.at("softcap") > 0.0;
  const bool dropout = c.at("dropout_p") > 0.0;
  if (c.count("kvcache") != 0 && c.at("kvcache") != 0) {
    if (dropout || c.at("mask") != 0) unsupported("KV caches take neither attn_mask nor dropout");
    general ? run_kvcache<Elem, Variant::kMasked>(c, dir) : run_kvcache<Elem, Variant::kPlain>(c, dir);
  } else if (general) {
    dropout ? run<Elem, Variant::kMaskedDropout>(c, dir) : run<Elem, Variant::kMasked>(c, dir);
  } else {
    dropout ? run<Elem, Variant::kDropout>(c, dir) : run<Elem, Variant::kPlain>(c, dir);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "dkdv_split") {  // the launcher's rule, for its tests
    const kern::KvGroupSplit split = kern::dkdv_split(std::atoll(argv[2]), std::atoll(argv[3]),
                                                      std::atoll(argv[4]), std::atoi(argv[5]));
    std::printf("%d %d\n", split.count, split.row_parts);
    return 0;
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR | %s dkdv_split GROUP BLOCKS QUERY_TILES SMS\n", argv[0],
                 argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const std::map<std::string, double> c = read_case(dir);
  if (kern::head_dim_bucket(static_cast<int>(c.at("head_dim"))) != kBucket) {
    unsupported("a head dim of another bucket than this build's");
  }
  if (c.at("bf16") != 0) {
    if constexpr (Atom::kNativeArch >= 800) {
      run_variant<kern::Bf16>(c, dir);
    } else {
      unsupported("bf16 on the Volta atom");
    }
  } else {
    run_variant<kern::Fp16>(c, dir);
  }
  return 0;
}
