// The Volta atom's warp GEMM (csrc/cuda/kernels/warp_tile.cuh, mma_atoms.cuh) run on the CPU:
// one warp of the host emulation (cuda_host_emulation.h: 32 fibers as the lanes, mma.sync.m8n8k4
// emulated from the fragment layouts of the PTX ISA, independently of the atom's own maps). Every
// operand storage (A and B each k-contiguous or not, i.e. every row/col layout of the
// instruction), full and partial reduction and column extents, both warp_gemm paths.
//
// Inputs are multiples of 1/8 in [-2, 2], so every product and partial sum is exact in fp32 and
// the result must equal the fp64 reference exactly, whatever the summation order.
//   c++ -std=c++17 -O1 -Icsrc tests/atoms/volta_warp_emulation.cpp && ./a.out
#include "cuda_host_emulation.h"

#include <random>
#include <vector>

#include "cuda/kernels/warp_tile.cuh"

using flashv100::kern::Fp16;
using flashv100::kern::SmemOperand;
using flashv100::kern::VoltaAtom;
using flashv100::kern::WarpAccum;

namespace {

// A (rows x max_k) and B (max_k x cols) stored k-contiguous or not; acc = A[:, :k_extent] B.
template <bool kAK, bool kBK, int kRows, int kCols, int kMaxK>
bool run_case(int k_extent, int n_extent, std::mt19937& rng) {
  constexpr int kPad = 8;
  std::uniform_int_distribution<int> eighths(-16, 16);
  std::vector<double> a(kRows * kMaxK), b(kMaxK * kCols);
  for (double& x : a) x = eighths(rng) / 8.0;
  for (double& x : b) x = eighths(rng) / 8.0;
  const int lda = kAK ? kMaxK + kPad : kRows + kPad, ldb = kBK ? kMaxK + kPad : kCols + kPad;
  // NaN in every element the operands do not define (row padding): reading one fails the case.
  std::vector<uint16_t> sa((kAK ? kRows : kMaxK) * lda, 0x7e00);
  std::vector<uint16_t> sb((kBK ? kCols : kMaxK) * ldb, 0x7e00);
  for (int m = 0; m < kRows; ++m)
    for (int k = 0; k < kMaxK; ++k)
      sa[kAK ? m * lda + k : k * lda + m] =
          emulated_float_to_half(static_cast<float>(a[m * kMaxK + k]));
  for (int k = 0; k < kMaxK; ++k)
    for (int n = 0; n < kCols; ++n)
      sb[kBK ? n * ldb + k : k * ldb + n] =
          emulated_float_to_half(static_cast<float>(b[k * kCols + n]));

  std::vector<float> out(kRows * kCols, -1000.0f);
  std::vector<int> writes(kRows * kCols, 0);
  cuda_emulation::launch(dim3{}, 32, [&] {
    const int lane = threadIdx.x;
    WarpAccum<VoltaAtom, kRows, kCols> acc;
    acc.zero();
    flashv100::kern::warp_gemm<VoltaAtom, Fp16, kMaxK>(
        acc, SmemOperand<kAK>{sa.data(), lda}, SmemOperand<kBK>{sb.data(), ldb}, k_extent,
        n_extent, lane);
    acc.for_each(lane, [&](int, int, int row, int col, float& value) {
      out[row * kCols + col] = value;
      ++writes[row * kCols + col];
    });
  });

  // Column fragments (16 wide) at or beyond n_extent are skipped: they stay 0.
  const int computed_cols = (n_extent + 15) / 16 * 16;
  for (int m = 0; m < kRows; ++m)
    for (int n = 0; n < kCols; ++n) {
      double expected = 0.0;
      if (n < computed_cols)
        for (int k = 0; k < k_extent; ++k) expected += a[m * kMaxK + k] * b[k * kCols + n];
      if (writes[m * kCols + n] != 1 || out[m * kCols + n] != expected) {
        std::printf("FAIL A %s B %s %dx%dx%d k_extent %d n_extent %d at (%d, %d): %g, expected %g "
                    "(%d writes)\n",
                    kAK ? "k-contiguous" : "m-contiguous", kBK ? "k-contiguous" : "n-contiguous",
                    kRows, kCols, kMaxK, k_extent, n_extent, m, n, out[m * kCols + n], expected,
                    writes[m * kCols + n]);
        return false;
      }
    }
  return true;
}

template <bool kAK, bool kBK>
int run_layout(std::mt19937& rng) {
  int failures = 0;
  // Full extents (the straight path), then partial reductions and columns (the checked path).
  failures += !run_case<kAK, kBK, 16, 32, 64>(64, 32, rng);
  failures += !run_case<kAK, kBK, 32, 16, 32>(32, 16, rng);
  failures += !run_case<kAK, kBK, 16, 128, 32>(32, 128, rng);
  failures += !run_case<kAK, kBK, 32, 64, 128>(128, 64, rng);
  failures += !run_case<kAK, kBK, 16, 32, 64>(36, 32, rng);
  failures += !run_case<kAK, kBK, 16, 64, 64>(64, 40, rng);
  failures += !run_case<kAK, kBK, 32, 48, 16>(8, 20, rng);
  return failures;
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  const int failures = run_layout<true, true>(rng) + run_layout<true, false>(rng) +
                       run_layout<false, true>(rng) + run_layout<false, false>(rng);
  if (failures) {
    std::printf("%d cases failed\n", failures);
    return 1;
  }
  std::printf("all 28 cases exact\n");
  return 0;
}
