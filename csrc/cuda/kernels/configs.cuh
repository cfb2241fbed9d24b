// Compiled tile configurations, one per head-dim bucket. Every head dim d (multiple of 8, <= 256)
// runs in the smallest bucket >= d with the columns beyond d zero-filled in shared memory.
// All warp tiles are multiples of 16x16 so both atoms (16x16x4 Volta, 16x8x16 Ampere) fit.
// Shared memory per block is static per config and stays within the atom's GPUs (static_asserts;
// Volta: 96 KB).
#pragma once

#include "cuda/kernels/warp_tile.cuh"

namespace flashv100 {
namespace kern {

// The compiled head-dim buckets; launchers and the NVRTC gate enumerate them through this list.
#define FLASHV100_FOR_EACH_HEAD_DIM(X) X(32) X(64) X(128) X(256)
constexpr int kMaxHeadDim = 256;  // the largest bucket

constexpr int kSmemPad = 8;  // 16 bytes of row padding against bank conflicts

constexpr __host__ __device__ int head_dim_bucket(int d) {
  return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256;
}

// Each kernel comes in four variants: with or without an attn_mask (or a scale that is not
// positive), with or without dropout. The masked ones use the general score math: scores scaled
// and biased in natural-log units, P recomputed from a per-row base and log2 normalizer, so that
// finfo.min biases stay exact; it costs 10-15% over the plain math, which dropout without a mask
// keeps. Each variant carries only its own state and code, without runtime branches; variants
// other than plain get smaller tiles where the plain tiles would spill registers (checked by
// scripts/nvrtc_gate.py).
enum class Variant { kPlain, kMasked, kDropout, kMaskedDropout };
constexpr __host__ __device__ bool is_general(Variant v) {
  return v == Variant::kMasked || v == Variant::kMaskedDropout;
}
constexpr __host__ __device__ bool has_dropout(Variant v) {
  return v == Variant::kDropout || v == Variant::kMaskedDropout;
}
constexpr __host__ __device__ const char* variant_name(Variant v) {
  return v == Variant::kPlain     ? "plain"
         : v == Variant::kMasked  ? "mask"
         : v == Variant::kDropout ? "dropout"
                                  : "mask+dropout";
}

// Forward tile shapes. Prefill: query tiles over four warps. Decode, for problems of at most
// kDecodeRows query rows per (batch, head) (decoding; GQA packs a KV group's query heads into the
// rows): one row tile of 16 with each key tile split across four warps, a small block of which
// several fit per SM, so that enough K/V loads are in flight to stream the cache at memory
// bandwidth and no warp multiplies only empty rows (a prefill tile there leaves most rows empty:
// its MMAs on them alone would bound the speed).
// kNarrowPrefill: the prefill tile at 16 rows a warp (64-row blocks) for atoms whose prefill tile
// is 128 rows wide, for grids too small to give every SM a block (has_narrow_prefill_tile).
enum class FwdShape { kPrefill, kDecode, kNarrowPrefill };
constexpr int kDecodeRows = 32;

// Prefill: each warp owns kBlockM / kWarps query rows and the whole key tile.
// Volta: 16 rows per warp (P staged through shared memory, 64K registers per SM). Atoms with P
// in registers take 32 rows per warp up to head dim 64, and at head dim 128 in the plain variant,
// so each K/V fragment feeds two MMAs. The other variants at head dim 128 (mask reads, Philox
// calls) fit 32 keys only next to 16-row warp tiles, which measured 11-15% (mask) and 1.6x
// (dropout) faster than 32-row tiles of 16 keys on the H200 (the plain variant 7% slower).
// kPaged: the kernel reads K/V through a block table (flash_fwd.cuh).
template <class Atom, int kHeadDim, Variant kVariant, FwdShape kShape = FwdShape::kPrefill,
          bool kPaged = false>
struct FwdTile {
  static constexpr bool kWide =
      kShape == FwdShape::kPrefill && Atom::kAccumIsA &&
      (kHeadDim < 128 || (kHeadDim == 128 && kVariant == Variant::kPlain));
  static constexpr int kWarps = 4;
  static constexpr int kKeyWarps = 1;  // warps that split a key tile (each its own rows here)
  static constexpr int kBlockM = kWide ? 128 : 64;
  // At head dim 128 the wide tile of contiguous K/V takes 64 keys, FlashAttention-2's 128 x 64:
  // half the block barriers and Q fragment loads per key of 32 keys, 4-5% faster on the H200
  // (kernel_bench, plain, 512-8k keys). It fits 255 registers since Visibility::hide keeps no
  // per-entry offsets; the paged kernel's page addressing still spilled 48 bytes (sm_80). The
  // narrow tile takes 64 keys too: its forward 0.94x the time of 32 keys at (1, 1, 128, 128), 0.85x
  // at (1, 4, 512, 128) (kernel_ab, H100).
  static constexpr bool kWideKeys =
      (kWide || kShape == FwdShape::kNarrowPrefill) && kHeadDim == 128 && !kPaged;
  // Keys per tile for head dims 32 / 64 / 128 / 256, the largest without register spills
  // (scripts/nvrtc_gate.py). Head dim 256 takes 32 keys with contiguous K/V. Volta: S's warp tile
  // loads 3 fragments per 2 MMAs instead of 2 per 1; sm_70 shared-memory ceiling of the plain
  // step 60-62% -> 70-74%, issue ceiling 89-100% -> 100% (scripts/sass_loops.py), 71 KB (one
  // block per SM either way). Ampere: sm_80 SASS of the plain step 4.66-11.69 -> 4.17-8.41
  // instructions per MMA, 66 KB (a third fewer blocks per SM on an A100 / H100), and the H100
  // ran the forward 23-25% faster (kernel_ab_h100_a522ea9.txt). The paged kernels keep 16 (the
  // masked one spilled 76 bytes at 32, sm_80). The plain wide tile at head dim 64 takes 128 keys,
  // FlashAttention-2's 128 x 128: half the block barriers and Q fragment loads per key, forward
  // 0.89-0.94x the time of 64 keys at 512-8k keys (kernel_ab, H100); the other variants spilled
  // 24-450 bytes there (nvcc 13, sm_80 / sm_90).
  static constexpr int kBlockN = kHeadDim == 64 && kWide && kVariant == Variant::kPlain && !kPaged
                                     ? 128
                                 : kHeadDim <= 64  ? 64
                                 : kHeadDim == 128 ? (kWideKeys ? 64 : 32)
                                 : kPaged          ? 16
                                                   : 32;
  // K/V buffers (flash_fwd.cuh). One: V loads during S and the next K during P.V. Two (cp.async
  // only) in the 32-key tiles at head dim 128: the next tile's K and V load during this whole
  // tile, one block barrier a tile. Forward on the H200 (kernel_bench, 4k and 512 keys): plain
  // 2-4%, mask 22-23%, dropout 3-5%, mask + dropout 14-19% faster; at head dim 64 none (mask +
  // dropout 1.5% slower). Shared memory 51 -> 68 KB (plain), 34 -> 51 KB (others): on a 100 KB SM
  // (sm_86/89) the latter fit one block per SM instead of two (no such GPU measured). The 64-key
  // tile keeps one (68 KB): two (102 KB) exceed sm_86/89's opt-in and measured 2% slower on the
  // H200.
  static constexpr int kKVStages = Atom::kAsyncCopy && kHeadDim == 128 && !kWideKeys ? 2 : 1;
  // Volta keeps each warp's Q fragments in registers over the key loop (warp_tile.cuh,
  // RegisterOperand) up to head dim 128: 2 per 4 columns, 64 registers at 128. Its products are
  // bound by shared memory's 128 bytes a cycle, which a fragment load (LDS.64) takes 2 cycles of;
  // the Q loads were 18% (head dim 128) and 9% (64) of the plain forward's shared-memory cycles
  // (scripts/sass_loops.py, sm_70).
  static constexpr bool kQInRegisters = Atom::kNativeArch < 800 && kHeadDim <= 128;
  static constexpr bool kSwizzledQKV = false;
};

// A wide prefill tile's one block per 128 query rows leaves most SMs idle in small grids (one head
// of 128 queries: one block): there the narrow tile of 64 rows runs twice the blocks, each with
// half the rows (launch: uses_narrow_prefill_tile). Contiguous K/V only (paged prefill keeps the
// wide tile).
template <class Atom, int kHeadDim, Variant kVariant>
constexpr __host__ __device__ bool has_narrow_prefill_tile() {
  return FwdTile<Atom, kHeadDim, kVariant>::kWide;
}
// Whether a grid of `wide_blocks` wide prefill blocks runs in the narrow tile: where each of
// twice as many blocks still has an SM of its own, so that halving a block's rows halves the
// step's time (a busier grid gains nothing from the split: two narrow blocks on one SM do a
// wide block's work, less efficiently).
constexpr __host__ __device__ bool uses_narrow_prefill_tile(int64_t wide_blocks, int sm_count) {
  return 2 * wide_blocks <= sm_count;
}

// The Volta atom's decode tile at head dim 256 spilled (its B fragments, and V then staged
// transposed; not tried since V is staged as loaded): the prefill tile runs there.
template <class Atom>
constexpr __host__ __device__ bool has_decode_tile(int head_dim_bucket) {
  return !(Atom::kNativeArch < 800 && head_dim_bucket == 256);
}

// An atom compiled for a newer arch than its own: the Volta atom on sm_80+, its correctness path
// there, where its MMAs are emulated in more registers. Its kernels ask ptxas for one block per
// SM rather than spill to fit more.
template <class Atom>
constexpr __host__ __device__ bool runs_emulated() {
  return Atom::kNativeArch < 800 && FLASHV100_SM80;
}

// The decode tile appends a step's new K/V rows itself (KVNewRows) up to head dim 128; at 256 the
// general paged kernel would spill on sm_80 (scripts/nvrtc_gate.py) and the append kernel runs.
constexpr __host__ __device__ bool decode_tile_appends(int head_dim_bucket) {
  return head_dim_bucket <= 128;
}

// Decode up to head dim 128: the 16 rows of a tile are every warp's; warp w takes keys
// [w * kWarpKeys, ...) of each key tile with a running max, sum and O of its own, merged through
// shared memory at the end (flash_fwd.cuh). Decoding has 1-16 rows per tile: split by rows, warps past the
// first multiply empty rows only. 32 keys per warp up to head dim 64, else 16 (the atom's K step of
// P.V). Two K/V buffers where copies are asynchronous: the next tile's K and V load while this one
// is computed, twice the bytes in flight of one buffer (decoding is bound by memory latency and
// bandwidth) and one block barrier per tile instead of two; Volta's loads go through registers.
// Head dim 256 keeps two warps of 16 rows each over 16-key tiles: split by keys, its tile (two
// buffers of 64 keys) exceeds shared memory on four warps, and spills on two (the masked paged
// variant; scripts/nvrtc_gate.py).
template <class Atom, int kHeadDim, Variant kVariant, bool kPaged>
struct FwdTile<Atom, kHeadDim, kVariant, FwdShape::kDecode, kPaged> {
  static_assert(!has_dropout(kVariant), "the decode tile takes no dropout");
  static_assert(has_decode_tile<Atom>(kHeadDim), "no decode tile for this atom and head dim");
  static constexpr bool kWide = false;
  static constexpr int kWarps = kHeadDim == 256 ? 2 : 4;
  static constexpr int kKeyWarps = kHeadDim == 256 ? 1 : kWarps;
  static constexpr int kBlockM = 16 * (kWarps / kKeyWarps);
  static constexpr int kBlockN = kKeyWarps * (kHeadDim <= 64 ? 32 : 16);
  static constexpr int kKVStages = Atom::kAsyncCopy ? 2 : 1;
  static constexpr bool kQInRegisters = false;
  // Q, K and V in swizzled rows (warp_tile.cuh, smem_offset) where the atom reads them by
  // ldmatrix, at head dims of 8 or more 16-byte chunks: a decode step is bound by the L2 requests
  // of its copies, which padded rows split (decode tile on the H100: 44 -> 17 M L2 requests and
  // 101 -> 67 M sectors for 2.15 GB of K/V).
  static constexpr bool kSwizzledQKV = Atom::kLdmatrix && kHeadDim >= 64;
};

template <class Atom, int kHeadDim_, Variant kVariant, FwdShape kShape = FwdShape::kPrefill,
          bool kPaged = false>
struct FwdConfig : FwdTile<Atom, kHeadDim_, kVariant, kShape, kPaged> {
  using T = FwdTile<Atom, kHeadDim_, kVariant, kShape, kPaged>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kGeneral = is_general(kVariant);
  static constexpr bool kDropout = has_dropout(kVariant);
  static constexpr int kThreads = T::kWarps * 32;
  static constexpr int kWarpRows = T::kBlockM / (T::kWarps / T::kKeyWarps);
  static constexpr int kWarpKeys = T::kBlockN / T::kKeyWarps;
  static_assert(T::kKeyWarps == 1 || T::kKeyWarps == T::kWarps,
                "a key-split tile has one row tile (its merge, flash_fwd.cuh)");
  static constexpr int kLdQK = kHeadDim + (T::kSwizzledQKV ? 0 : kSmemPad);  // Q, K, V: [rows][dim]
  static_assert(!T::kSwizzledQKV || kHeadDim % 64 == 0, "swizzled rows: 8-chunk multiples");
  static constexpr int kLdP = T::kBlockN + kSmemPad;    // P: [query rows][keys]
  static_assert(T::kKVStages == 1 || (T::kKVStages == 2 && Atom::kAsyncCopy && Atom::kAccumIsA),
                "two K/V buffers need cp.async (and P in registers: one barrier a tile)");
  static constexpr int kKVElems = T::kBlockN * kLdQK;  // one K or V buffer
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + T::kBlockM * kLdQK;  // K buffers, then V buffers
  static constexpr int kVOffset = kKOffset + T::kKVStages * kKVElems;
  static constexpr int kPOffset = kVOffset + T::kKVStages * kKVElems;
  static constexpr int kPElems = Atom::kAccumIsA ? 0 : T::kBlockM * kLdP;
  // Key-split tiles: after the loop each warp but the first leaves its O, row max and row sum
  // there (fp32, lane-major: every warp's accumulator has the same lane map) over Q/K/V.
  static constexpr int kMergeFloatsPerLane =
      kWarpRows * kHeadDim / 32 + 2 * (kWarpRows / Atom::kM) * Atom::kRowSlots;
  static constexpr int kMergeBytes = (T::kKeyWarps - 1) * 32 * kMergeFloatsPerLane * 4;
  static constexpr int kSmemBytes =
      (kPOffset + kPElems) * 2 > kMergeBytes ? (kPOffset + kPElems) * 2 : kMergeBytes;
  static_assert(kSmemBytes <= Atom::kMaxSmemBytes, "forward tile exceeds shared memory");
  // Resident blocks per SM asked of ptxas (0: its choice). An emulated atom asks for 1: else ptxas
  // spills the Volta atom's general variant on sm_80+ to fit a third block.
  // The plain decode tile at head dim 128 with asynchronous copies asks for 3 (168 registers):
  // decoding is bound by the loads in flight, and ptxas' own choice for the paged kernel held 2
  // blocks per SM (its general variant, and the paged one at head dim 64, spill at 3;
  // scripts/nvrtc_gate.py).
#if defined(__CUDA_ARCH__)
  static constexpr int kMinBlocks =
      runs_emulated<Atom>() ? 1
      : kShape == FwdShape::kDecode && Atom::kAsyncCopy && kVariant == Variant::kPlain &&
              kHeadDim_ == 128
          ? 3
          : 0;
#else
  static constexpr int kMinBlocks = 0;
#endif
  // Where kMinBlocks asks for none: paged kernels ask for one block, else ptxas spills the
  // general variant's page addressing to fit a third; so does the narrow prefill tile, whose
  // grids have at most one block an SM (ptxas' own choice spilled 8 bytes of the mask + dropout
  // variant at head dim 32, sm_80); the contiguous decode tile at head dim 32
  // asks for 4 (at most 128 registers), where ptxas' own choice, 96, spilled 4-8 bytes (Volta
  // plain on sm_70, Ampere masked on sm_80); Volta prefill tiles of which a V100's 96 KB hold
  // at most two blocks (head dims 64-256) ask for that many, where ptxas' own choice at head dim
  // 128 planned four blocks of 128 registers and spilled 8 bytes (scripts/nvrtc_gate.py).
  static constexpr int kVoltaResidentBlocks = Atom::kMaxSmemBytes / kSmemBytes;
  static constexpr int min_blocks() {
    return kMinBlocks != 0                                  ? kMinBlocks
           : kPaged                                         ? 1
           : kShape == FwdShape::kNarrowPrefill             ? 1
           : kShape == FwdShape::kDecode && kHeadDim_ == 32 ? 4
           : Atom::kNativeArch < 800 && kShape == FwdShape::kPrefill && kVoltaResidentBlocks <= 2
               ? kVoltaResidentBlocks
               : 0;
  }
};

// Backward: a (kBlockM query x kBlockN key) tile. The warp grids split S/dP [M x N] (over the
// first kSWarps warps: a 32x32 tile has only four 16x16 Volta tiles), dK/dV [N x E] and
// dQ [M x kDqCols] (dQ is produced kDqCols head-dim columns at a time to bound registers).
// kWarpsN* = warps along the columns of each grid. kSplitScores: S (and P) on the first kSWarps
// warps, dP on the other kSWarps, each warp one product of twice the tile (flash_bwd.cuh,
// compute_p_ds); else each of the first kSWarps warps computes both for its tile.
template <int kBlockM_, int kBlockN_, int kWarps_, int kSWarps_, int kWarpsNS_, int kWarpsNKV_,
          int kWarpsNQ_, int kDqCols_, bool kSplitScores_ = false>
struct BwdTileShape {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kWarps = kWarps_,
                       kSWarps = kSWarps_, kWarpsNS = kWarpsNS_, kWarpsNKV = kWarpsNKV_,
                       kWarpsNQ = kWarpsNQ_, kDqCols = kDqCols_;
  static constexpr bool kSplitScores = kSplitScores_;
  static_assert(!kSplitScores || 2 * kSWarps == kWarps, "split scores: half the warps each");
};
// Backward tile sizes: kCompact fits every GPU of its atom (shared memory: configs below); kWide
// is FlashAttention-2's tile with two query-side buffers, picked at launch where the device's
// opt-in holds it (sm_90). Head dim 128: 64 x 128 (plain and dropout variants; the masked
// ones spill 88-92 bytes; with one buffer, 136.5 KB, the plain variant spilled 60 bytes on
// sm_80), 170.5 KB; against the 64 x 64 tile it halves the dQ atomics and the Q/dO reloads per
// key, and the H200 ran the backward 23-29% faster
// (benchmarks/results/kernel_bench_h200_wide_tile.txt). Head dim 64: 128 x 128 (plain only; the
// dropout variant spills 56 bytes), 177 KB; against 64 x 128 it halves the K/V-side work per
// query row (block barriers, the dS/P staging per step), 5-8% faster on the H200 (kernel_bench,
// 512-4k keys). Head dim 256: 64 x 64 (every variant), 216.5 KB; against 32 x 32 it quarters the
// tile steps per query-key pair (sm_80 SASS of the plain dK/dV step: 4.61 -> 3.11 instructions per
// MMA); the H100 ran the backward 42-45% faster (kernel_ab_h100_a522ea9.txt, 2k keys).
enum class BwdTileSize { kCompact, kWide };
template <class Atom, int kHeadDim, Variant kVariant>
constexpr __host__ __device__ bool has_wide_bwd_tile() {
  return Atom::kAsyncCopy && ((kHeadDim == 128 && !is_general(kVariant)) ||
                              (kHeadDim == 64 && kVariant == Variant::kPlain) || kHeadDim == 256);
}
// The wide tile's one-key-tile kernel (kDqDirect: dK/dV and dQ in one launch, flash_bwd.cuh),
// where it takes more keys than the compact tile (head dims 128 and 256); the general variants
// at head dim 256 spill 24-88 bytes there (sm_80, scripts/nvrtc_gate.py).
template <class Atom, int kHeadDim, Variant kVariant>
constexpr __host__ __device__ bool has_direct_wide_bwd_tile() {
  return has_wide_bwd_tile<Atom, kHeadDim, kVariant>() && kHeadDim >= 128 && !is_general(kVariant);
}
template <class Atom, int kHeadDim, bool kSmall, BwdTileSize kSize = BwdTileSize::kCompact>
struct BwdTile;
// Whether a variant takes its atom's smaller tile (kSmall): those other than plain, where the
// plain tile would spill registers; on Volta at head dim 64 the masked variant fits the plain
// tile too (245 registers, sm_70) and only the dropout variants take the smaller one.
template <class Atom, int kHeadDim, Variant kVariant>
constexpr __host__ __device__ bool takes_small_bwd_tile() {
  return Atom::kNativeArch < 800 && kHeadDim == 64 ? has_dropout(kVariant)
                                                   : kVariant != Variant::kPlain;
}
// Volta: 16- and 32-row warp tiles (registers), smaller where the variants other than plain would
// spill. Head dim 64: 64 x 128 over 8 warps (32 x 32 S / dP and dK / dV warp tiles), 88.5 KB; against
// 64 x 64 over 4 warps it holds 8 warps per SM instead of 4 (one block: shared memory) and loads
// fewer fragments per MMA: sm_70 shared-memory ceiling of the plain dK/dV step 74-76% -> 84-86%,
// issue ceiling 85-100% -> 95-100%; the masked variant's (64 x 64 over 8 warps before) 61-63% ->
// 83-85% (scripts/sass_loops.py). Its dropout variants (64 x 64) split S and dP over the warp
// halves (kSplitScores): 32 x 32 S / dP warp tiles where each warp computed both on 16 x 32.
template <> struct BwdTile<VoltaAtom, 32, false> : BwdTileShape<64, 64, 8, 4, 2, 2, 2, 32> {};
template <> struct BwdTile<VoltaAtom, 32, true> : BwdTileShape<64, 64, 8, 8, 2, 2, 2, 32> {};
template <> struct BwdTile<VoltaAtom, 64, false> : BwdTileShape<64, 128, 8, 8, 4, 2, 2, 64> {};
template <> struct BwdTile<VoltaAtom, 64, true> : BwdTileShape<64, 64, 8, 4, 2, 2, 2, 64, true> {};
// Head dims 128 and 256: 32 x 32 dK / dV (and at 128 dQ) warp tiles, one fragment loaded per
// MMA where 16 x 64 loaded five per four, in the same registers: sm_70 dK/dV shared-memory
// ceiling 70-72% -> 78-81% (head dim 128 plain and mask), 75-80% -> 92-99% (dropout variants),
// 54-57% -> 57-59% (256 plain and mask), 66-76% -> 76-90% (256 dropout variants). S and dP on
// the warp halves (kSplitScores): at head dim 128 on 32 x 32 warp tiles where each warp computed
// both on 16 x 32, one fragment loaded per MMA instead of three per two (dK/dV 78-81% -> 88-99%,
// plain); at 256 the four warps idle during S and dP take dP (57-59% -> 60-66%). Head dim 256
// adds dQ on 32 x 32 warp tiles over all 256 columns at once (16 x 32 over 128 before):
// 60-66% -> 64-71%, deterministic dQ 50-52% -> 52-54% (scripts/sass_loops.py, sm_70).
template <bool G>
struct BwdTile<VoltaAtom, 128, G> : BwdTileShape<64, 64, 8, 4, 2, 4, 4, 128, true> {};
template <bool G>
struct BwdTile<VoltaAtom, 256, G> : BwdTileShape<32, 32, 8, 4, 2, 8, 8, 256, true> {};
// Ampere+: 32-row warp tiles, so that each B fragment read from shared memory feeds two MMAs
// (16-row tiles leave the products bound by shared-memory bandwidth); 128 keys per block up to
// head dim 64.
template <bool G> struct BwdTile<AmpereAtom, 32, G> : BwdTileShape<64, 128, 8, 8, 4, 2, 4, 32> {};
template <bool G> struct BwdTile<AmpereAtom, 64, G> : BwdTileShape<64, 128, 8, 8, 4, 2, 4, 64> {};
template <bool G> struct BwdTile<AmpereAtom, 128, G> : BwdTileShape<64, 64, 8, 8, 4, 4, 4, 64> {};
template <bool G> struct BwdTile<AmpereAtom, 256, G> : BwdTileShape<32, 32, 8, 4, 2, 4, 4, 128> {};
// FlashAttention-2's warp grids that fit 255 registers without spills only with ptxas 13 (nvcc 13,
// sm_80 and sm_90); ptxas 12.9 (scripts/nvrtc_gate.py) spills with them, so older toolchains keep
// the grids below them. Every size and layout follows BwdConfig, so either choice is consistent.
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 13
constexpr bool kPtxas13WideTiles = true;
#else
constexpr bool kPtxas13WideTiles = false;
#endif
// Head dim 64: 32 x 32 dK/dV and dQ warp tiles; 32 x 64 S warp tiles with ptxas 13 (the dK/dV
// kernel runs 0.957-0.967x the time of 64 x 32 at 512-8k keys, kernel_ab on the H100), else 64 x 32
// (ptxas 12.9 spills 100-116 bytes with 32 x 64).
template <bool G>
struct BwdTile<AmpereAtom, 64, G, BwdTileSize::kWide>
    : BwdTileShape<128, 128, 8, 8, kPtxas13WideTiles ? 2 : 4, 2, 2, 64> {};
// Head dim 128: 32 x 32 S warp tiles, 64 x 32 dK/dV warp tiles; 32 x 32 dQ warp tiles over all 128
// columns at once with ptxas 13 (0.944-0.979x the time (plain), 0.981-0.989x (dropout) at 512-8k
// keys, kernel_ab on the H100), else 16 x 32 dQ warp tiles in two 64-column passes (ptxas 12.9
// spills 16-40 bytes with the 32 x 32 grid; 8 x 8 dQ warp tiles were slower). Within 255
// registers without spills in the plain and dropout variants only.
template <bool G>
struct BwdTile<AmpereAtom, 128, G, BwdTileSize::kWide>
    : BwdTileShape<64, 128, 8, 8, 4, 4, kPtxas13WideTiles ? 4 : 2, kPtxas13WideTiles ? 128 : 64> {};
// Head dim 256: 16 x 32 S warp tiles, 32 x 64 dK/dV warp tiles, 32 x 32 dQ warp tiles in two
// head-dim chunks (FlashAttention-2's warp grids); within 255 registers without spills on sm_80 in
// every variant.
template <bool G>
struct BwdTile<AmpereAtom, 256, G, BwdTileSize::kWide>
    : BwdTileShape<64, 64, 8, 8, 2, 4, 4, 128> {};

// Query-side buffers (Q, dO) of the dK/dV kernel: with two (cp.async only) the next step's Q and
// dO load during the whole step and a step takes two block barriers instead of three
// (flash_bwd.cuh). Two exceed the 99 KB of sm_86/89 from head dim 64 on, so the launcher picks
// them, like the wide tile, by the device's shared-memory opt-in (at most sm_90's 227 KB).
constexpr int kBwdLargestSmemBytes = 227 * 1024;

// The one-key-tile dK/dV kernel (kDqDirect, flash_bwd.cuh) computes its rows' D (and the general
// variant's P base and normalizer) itself, in place of the D pre-pass, where its warps take at
// most kDirectRowRounds rounds of rows (each round a memory latency, where the pre-pass spreads
// the rows over the GPU): a round is one row a warp in the general variant, 32 / kDotLanes in
// the others (kDotLanes lanes a row).
constexpr int kDirectRowRounds = 2;
constexpr int kDotLanes = 4;

template <class Atom, int kHeadDim_, Variant kVariant, int kQStages_ = 1,
          BwdTileSize kSize_ = BwdTileSize::kCompact>
struct BwdConfig : BwdTile<Atom, kHeadDim_, takes_small_bwd_tile<Atom, kHeadDim_, kVariant>(),
                           kSize_> {
  using T = BwdTile<Atom, kHeadDim_, takes_small_bwd_tile<Atom, kHeadDim_, kVariant>(), kSize_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kQStages = kQStages_;
  static constexpr BwdTileSize kSize = kSize_;
  static_assert(kQStages == 1 || (kQStages == 2 && Atom::kAsyncCopy),
                "two query-side buffers need cp.async");
  static_assert(kSize == BwdTileSize::kCompact || has_wide_bwd_tile<Atom, kHeadDim_, kVariant>(),
                "no wide backward tile for this atom, head dim and variant");
  static constexpr bool kGeneral = is_general(kVariant);
  static constexpr bool kDropout = has_dropout(kVariant);
  static constexpr int kThreads = T::kWarps * 32;
  // S and dP as straight blocks where their extents allow (warp_gemm): all but the masked
  // variants at head dim 64, which spill that way (sm_80, scripts/nvrtc_gate.py).
  static constexpr bool kStraightScores = !(kGeneral && kHeadDim_ == 64);
  // Warp tiles of the three products.
  static constexpr int kSRows = T::kBlockM / (T::kSWarps / T::kWarpsNS);
  static constexpr int kSCols = T::kBlockN / T::kWarpsNS;
  static constexpr int kKVRows = T::kBlockN / (T::kWarps / T::kWarpsNKV);
  static constexpr int kKVCols = kHeadDim / T::kWarpsNKV;
  static constexpr int kQRows = T::kBlockM / (T::kWarps / T::kWarpsNQ);
  static constexpr int kQCols = T::kDqCols / T::kWarpsNQ;
  static constexpr int kQColsFull = kHeadDim / T::kWarpsNQ;  // the dQ-only kernel keeps all of dQ
  // Shared memory: K, V, Q and dO buffers [rows][head dim]; P, dS [query rows][keys]; per query
  // row lse (general variant: P's base), D, and for the general variant P's log2 normalizer.
  static constexpr int kLdE = kHeadDim + kSmemPad;
  static constexpr int kLdN = T::kBlockN + kSmemPad;
  static constexpr int kQElems = T::kBlockM * kLdE;  // one Q or dO buffer
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + T::kBlockN * kLdE;
  static constexpr int kQOffset = kVOffset + T::kBlockN * kLdE;  // Q buffers, then dO buffers
  static constexpr int kDOOffset = kQOffset + kQStages * kQElems;
  static constexpr int kPOffset = kDOOffset + kQStages * kQElems;
  static constexpr int kDSOffset = kPOffset + T::kBlockM * kLdN;
  static constexpr int kRowVecByteOffset = (kDSOffset + T::kBlockM * kLdN) * 2;
  static constexpr int kRowVecs = kGeneral ? 3 : 2;
  // Rows whose vectors a kDqDirect block computes itself, at most, and after the tile's row
  // vectors a place for them: D, and the general variant's base and normalizer too (the plain
  // base is the lse), of the rows of all the block's steps.
  static constexpr int kDirectRows =
      kDirectRowRounds * (kGeneral ? 1 : 32 / kDotLanes) * kThreads / 32;
  static constexpr int kDirectRowVecs = kGeneral ? 3 : 1;
  static constexpr int kDirectRowVecByteOffset = kRowVecByteOffset + kRowVecs * T::kBlockM * 4;
  static constexpr int kSmemBytes = kDirectRowVecByteOffset + kDirectRowVecs * kDirectRows * 4;
  static_assert(kSmemBytes <= (kQStages == 1 && kSize == BwdTileSize::kCompact
                                   ? Atom::kMaxSmemBytes
                                   : kBwdLargestSmemBytes),
                "backward tile exceeds shared memory");
};

}  // namespace kern
}  // namespace flashv100
