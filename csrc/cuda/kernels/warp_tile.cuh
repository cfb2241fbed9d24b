// Warp tiles above the atoms: a warp's fp32 accumulator tile with its coordinate map, shared-memory
// operands, the warp GEMM and row reductions. Masking, softmax and epilogues use only these.
#pragma once

#include "cuda/kernels/mma_atoms.cuh"

namespace flashv100 {
namespace kern {

// Element (r, c) of a shared 16-bit tile with rows ld elements apart. Padded rows (ld = columns +
// kSmemPad) keep columns in place. Swizzled rows (kSwizzled; ld = columns, a multiple of 64) store
// the 16-byte chunk c / 8 of row r at chunk (c / 8) ^ (r % 8): the 8 rows an ldmatrix reads at one
// column fall in 8 different bank groups without padding, and a cp.async of a row's 128 bytes is
// one aligned shared wavefront, which keeps it one whole L2 request. Padded rows start 16 bytes
// further each row, and there the decode tile's copies took 2.6 L2 requests and 1.5x the sectors
// a line (Nsight Compute, H100). Swizzled tiles start on row multiples of 8.
template <bool kSwizzled>
__device__ __forceinline__ int smem_offset(int r, int c, int ld) {
  return kSwizzled ? r * ld + ((((c >> 3) ^ (r & 7)) << 3) | (c & 7)) : r * ld + c;
}
// The address of element (r, c) of a shared tile. Padded rows keep the pointer steps of
// `tile + r * ld + c`: as tile + smem_offset() the sm_80 head-dim-64 wide dK/dV kernel spilled
// 4 bytes (scripts/nvrtc_gate.py).
template <bool kSwizzled>
__device__ __forceinline__ uint16_t* smem_at(uint16_t* tile, int r, int c, int ld) {
  if constexpr (kSwizzled) return tile + smem_offset<true>(r, c, ld);
  return tile + r * ld + c;
}

// A 16-bit matrix in shared memory, row-major with leading dimension `ld` (elements), read as a
// GEMM operand X(m, k). kKContiguous: X(m, k) = base[m * ld + k]; otherwise the operand is the
// transpose of the stored matrix, X(m, k) = base[k * ld + m]. kSwizzled: rows stored as
// smem_offset swizzles them (ldmatrix atoms only: their addresses are of whole 16-byte chunks).
// The atoms load their fragments from either (mma_atoms.cuh).
template <bool kKContiguous_, bool kSwizzled = false>
struct SmemOperand {
  static constexpr bool kKContiguous = kKContiguous_;
  static constexpr bool kInRegisters = false;
  const uint16_t* base;
  int ld;

  // Address of X(m, k), and its offset from base in elements. at() keeps its own pointer steps:
  // written as base + offset(), the Ampere kernels' ldmatrix address math compiles differently.
  __device__ __forceinline__ const uint16_t* at(int m, int k) const {
    if constexpr (kSwizzled) return base + offset(m, k);
    return kKContiguous ? base + m * ld + k : base + k * ld + m;
  }
  __device__ __forceinline__ int offset(int m, int k) const {
    return kKContiguous ? smem_offset<kSwizzled>(m, k, ld) : smem_offset<kSwizzled>(k, m, ld);
  }
  // The operand starting at row m0 (m is the non-reduced dimension).
  __device__ __forceinline__ SmemOperand rows_from(int m0) const {
    static_assert(!kSwizzled, "a swizzled operand keeps its base");
    return SmemOperand{kKContiguous ? base + m0 * ld : base + m0, ld};
  }
};
using KMajor = SmemOperand<true>;
using MMajor = SmemOperand<false>;

// The A operand of a warp tile of kRows rows over k in [0, kMaxK) held in registers: every
// fragment loaded once from shared memory (the operand Op), for products that reuse it with many
// B operands (Volta's Q over the key tiles: shared memory's 128 bytes a cycle bound Volta's
// products, not the issue rate; scripts/sass_loops.py). The fragments keep Op's layout.
template <class Atom, int kRows, int kMaxK, class Op>
struct RegisterOperand {
  static constexpr bool kKContiguous = Op::kKContiguous;
  static constexpr bool kInRegisters = true;
  static constexpr int kSteps = kMaxK / Atom::kK, kFragM = kRows / Atom::kM;
  uint32_t frag[kSteps][kFragM][Atom::kARegs];

  __device__ __forceinline__ void load(const Op& op, int lane) {
#pragma unroll
    for (int step = 0; step < kSteps; ++step)
#pragma unroll
      for (int fm = 0; fm < kFragM; ++fm)
        Atom::load_a(op, fm * Atom::kM, step * Atom::kK, lane, frag[step][fm]);
  }
};

// One warp's kRows x kCols fp32 accumulator, made of kFragM x kFragN atom tiles.
template <class Atom, int kRows, int kCols>
struct WarpAccum {
  static_assert(kRows % Atom::kM == 0 && kCols % Atom::kN == 0, "warp tile must fit the atom");
  static constexpr int kTileRows = kRows, kTileCols = kCols;
  static constexpr int kFragM = kRows / Atom::kM;
  static constexpr int kFragN = kCols / Atom::kN;
  float c[kFragM][kFragN][Atom::kCRegs];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
      for (int fn = 0; fn < kFragN; ++fn)
#pragma unroll
        for (int i = 0; i < Atom::kCRegs; ++i) c[fm][fn][i] = 0.0f;
  }

  // Row (within the warp tile) of row slot `slot` of fragment row fm.
  static __device__ __forceinline__ int row_of(int lane, int fm, int slot) {
    return fm * Atom::kM + Atom::slot_row(lane, slot);
  }
  static __device__ __forceinline__ int col_of(int lane, int fn, int i) {
    return fn * Atom::kN + Atom::c_col(lane, i);
  }

  // f(fm, slot, row, col, value&) for every element this lane holds.
  template <class F>
  __device__ __forceinline__ void for_each(int lane, F&& f) {
#pragma unroll
    for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
      for (int fn = 0; fn < kFragN; ++fn)
#pragma unroll
        for (int i = 0; i < Atom::kCRegs; ++i) {
          const int slot = Atom::row_slot(i);
          f(fm, slot, row_of(lane, fm, slot), col_of(lane, fn, i), c[fm][fn][i]);
        }
  }

  // f(fm, slot, value&, other's value&) for every element, paired with the same element of
  // another accumulator of the same shape.
  template <class F>
  __device__ __forceinline__ void for_each_zip(WarpAccum& other, F&& f) {
#pragma unroll
    for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
      for (int fn = 0; fn < kFragN; ++fn)
#pragma unroll
        for (int i = 0; i < Atom::kCRegs; ++i) f(fm, Atom::row_slot(i), c[fm][fn][i], other.c[fm][fn][i]);
  }

  // f(fm, slot, row, col, value_at_col&, value_at_col_plus_1&) for each horizontal pair (2k, 2k+1).
  template <class F>
  __device__ __forceinline__ void for_each_pair(int lane, F&& f) {
#pragma unroll
    for (int fm = 0; fm < kFragM; ++fm)
#pragma unroll
      for (int fn = 0; fn < kFragN; ++fn)
#pragma unroll
        for (int i = 0; i < Atom::kCRegs; i += 2) {
          f(fm, Atom::row_slot(i), row_of(lane, fm, Atom::row_slot(i)), col_of(lane, fn, i),
            c[fm][fn][i], c[fm][fn][i + 1]);
        }
  }
};

// A compile-time flag passed to generic lambdas (NVRTC has no <type_traits>).
template <bool kChecked>
struct BoundsChecked {
  static constexpr bool value = kChecked;
};

// acc += A(:, k0:k0+kK) * B(k0:k0+kK, :) for A fragments already in registers (in the layout of
// an AOp operand): B fragments of the warp tile's columns. kChecked: skip column fragments at or
// beyond n_extent (head-dim padding), one branch per fragment; unchecked (the whole tile in
// range), ldmatrix atoms load the B fragments of two column fragments with one instruction.
template <class Atom, class Elem, bool kChecked, class AOp, class Acc, class BOp>
__device__ __forceinline__ void mma_k_step(Acc& acc, const uint32_t (&af)[Acc::kFragM][Atom::kARegs],
                                           const BOp& b, int k0, int n_extent, int lane) {
  if constexpr (!kChecked && Atom::kLdmatrix && Acc::kFragN % 2 == 0) {
#pragma unroll
    for (int fn = 0; fn < Acc::kFragN; fn += 2) {
      uint32_t bf[2][Atom::kBRegs];
      Atom::load_b_pair(b, fn * Atom::kN, k0, lane, bf[0], bf[1]);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int fm = 0; fm < Acc::kFragM; ++fm)
          Atom::template mma<Elem, AOp, BOp>(acc.c[fm][fn + j], af[fm], bf[j]);
    }
    return;
  }
#pragma unroll
  for (int fn = 0; fn < Acc::kFragN; ++fn) {
    if (kChecked && fn * Atom::kN >= n_extent) continue;
    uint32_t bf[Atom::kBRegs];
    Atom::load_b(b, fn * Atom::kN, k0, lane, bf);
#pragma unroll
    for (int fm = 0; fm < Acc::kFragM; ++fm)
      Atom::template mma<Elem, AOp, BOp>(acc.c[fm][fn], af[fm], bf);
  }
}

// acc += A * B with A(m, k) over the warp tile's rows and B addressed as (n, k) over its columns,
// fragments loaded by the atom. k_extent (a multiple of Atom::kK, at most kMaxK) and n_extent
// bound the reduction and the columns (head-dim padding). A product whose extents cover the whole
// tile (the head dim equal to its bucket, and every product over keys or query rows) runs without
// per-step or per-fragment exits; otherwise each step and fragment is checked. With ldmatrix the
// loop is unrolled whole, so that the scheduler overlaps each step's fragment loads with the
// previous step's MMAs. Volta's steps (k 4) are unrolled as far as the fragments of the unrolled
// steps fit kVoltaFragmentRegs registers (a power of two of steps): without it, address math and
// the loop's branch issue beside every step's 8 MMAs, and sm_70 issues one MMA in two cycles
// (scripts/sass_loops.py). More registers spill (scripts/nvrtc_gate.py). An A operand in
// registers (RegisterOperand) unrolls whole: its fragments are indexed by step. The Volta atom
// runs the same code on sm_80+, its correctness path, so that the GPU suite there tests what a
// V100 runs.
constexpr __host__ __device__ int floor_pow2(int x) { return x < 2 ? 1 : 2 * floor_pow2(x / 2); }
constexpr int kVoltaFragmentRegs = 32;
template <class Atom, class Elem, int kMaxK, class Acc, class AOp, class BOp, class Checked>
__device__ __forceinline__ void warp_gemm_k_step(Acc& acc, const AOp& a, const BOp& b, int k0,
                                                 int n_extent, int lane, Checked) {
  if constexpr (AOp::kInRegisters) {
    static_assert(AOp::kSteps == kMaxK / Atom::kK && AOp::kFragM == Acc::kFragM,
                  "register operand must cover the product");
    mma_k_step<Atom, Elem, Checked::value, AOp>(acc, a.frag[k0 / Atom::kK], b, k0, n_extent,
                                                lane);
  } else {
    uint32_t af[Acc::kFragM][Atom::kARegs];
#pragma unroll
    for (int fm = 0; fm < Acc::kFragM; ++fm) Atom::load_a(a, fm * Atom::kM, k0, lane, af[fm]);
    mma_k_step<Atom, Elem, Checked::value, AOp>(acc, af, b, k0, n_extent, lane);
  }
}
template <class Atom, int kMaxK, class Acc, class AOp>
constexpr int warp_gemm_unroll() {
  constexpr int kSteps = kMaxK / Atom::kK;
  constexpr int kStepRegs = Acc::kFragM * Atom::kARegs + Acc::kFragN * Atom::kBRegs;
  constexpr int kVoltaUnroll = floor_pow2(kVoltaFragmentRegs / kStepRegs);
  return Atom::kLdmatrix || AOp::kInRegisters || kSteps < kVoltaUnroll ? kSteps : kVoltaUnroll;
}
// warp_gemm over the whole tile (k_extent == kMaxK, every column): no exit anywhere, so that a
// caller can put several products and the math between them into one basic block.
template <class Atom, class Elem, int kMaxK, class Acc, class AOp, class BOp>
__device__ __forceinline__ void warp_gemm_whole(Acc& acc, const AOp& a, const BOp& b, int lane) {
  constexpr int kUnroll = warp_gemm_unroll<Atom, kMaxK, Acc, AOp>();
#pragma unroll kUnroll
  for (int k0 = 0; k0 < kMaxK; k0 += Atom::kK) {
    warp_gemm_k_step<Atom, Elem, kMaxK>(acc, a, b, k0, Acc::kFragN * Atom::kN, lane,
                                        BoundsChecked<false>{});
  }
}
template <class Atom, class Elem, int kMaxK, bool kStraight = true, class Acc, class AOp, class BOp>
__device__ __forceinline__ void warp_gemm(Acc& acc, const AOp& a, const BOp& b, int k_extent,
                                          int n_extent, int lane) {
  constexpr int kUnroll = warp_gemm_unroll<Atom, kMaxK, Acc, AOp>();
  if (kStraight && k_extent == kMaxK && n_extent >= Acc::kFragN * Atom::kN) {
    warp_gemm_whole<Atom, Elem, kMaxK>(acc, a, b, lane);
    return;
  }
#pragma unroll kUnroll
  for (int k0 = 0; k0 < kMaxK; k0 += Atom::kK) {
    if (k0 >= k_extent) break;
    warp_gemm_k_step<Atom, Elem, kMaxK>(acc, a, b, k0, n_extent, lane, BoundsChecked<true>{});
  }
}

// acc += A * B where A is another accumulator of the same warp (same rows, its columns are the
// reduction), converted to Elem in registers; only for atoms with kAccumIsA (FA2's P in registers).
template <class Atom, class Elem, class Acc, class AAcc, class BOp>
__device__ __forceinline__ void warp_gemm_accum_a(Acc& acc, const AAcc& a, const BOp& b,
                                                  int n_extent, int lane) {
  static_assert(Atom::kAccumIsA && AAcc::kFragM == Acc::kFragM && Atom::kK == 2 * Atom::kN,
                "A-from-accumulator needs two accumulator tiles per k step");
  const auto k_steps = [&](auto checked) {
#pragma unroll
    for (int kk = 0; kk < AAcc::kFragN / 2; ++kk) {
      uint32_t af[Acc::kFragM][Atom::kARegs];
#pragma unroll
      for (int fm = 0; fm < Acc::kFragM; ++fm)
        Atom::template a_from_accum<Elem>(a.c[fm][2 * kk], a.c[fm][2 * kk + 1], af[fm]);
      mma_k_step<Atom, Elem, decltype(checked)::value, KMajor>(acc, af, b, kk * Atom::kK,
                                                               n_extent, lane);
    }
  };
  if (n_extent >= Acc::kFragN * Atom::kN) {
    k_steps(BoundsChecked<false>{});
  } else {
    k_steps(BoundsChecked<true>{});
  }
}

// Reductions over the lanes that hold the same accumulator row.
template <class Atom>
__device__ __forceinline__ float row_allreduce_max(float x) {
#pragma unroll
  for (int bit = 1; bit < 32; bit <<= 1)
    if (Atom::kRowLaneMask & bit) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, bit));
  return x;
}

template <class Atom>
__device__ __forceinline__ float row_allreduce_sum(float x) {
#pragma unroll
  for (int bit = 1; bit < 32; bit <<= 1)
    if (Atom::kRowLaneMask & bit) x += __shfl_xor_sync(0xffffffffu, x, bit);
  return x;
}

// The one lane of each row group that writes per-row results.
template <class Atom>
__device__ __forceinline__ bool is_row_leader(int lane) {
  return (lane & Atom::kRowLaneMask) == 0;
}

constexpr __host__ __device__ int round_up(int x, int m) { return (x + m - 1) / m * m; }

}  // namespace kern
}  // namespace flashv100
