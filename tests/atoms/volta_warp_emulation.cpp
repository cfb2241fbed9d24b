// The Volta atom's warp GEMM (csrc/cuda/kernels/warp_tile.cuh, mma_atoms.cuh) run on the CPU:
// 32 host threads are the lanes of one warp, and mma.sync.m8n8k4 is emulated from the fragment
// layouts of the PTX ISA ("Matrix Fragments for mma.m8n8k4", the same maps as CUTLASS's
// SM70_8x4_Row / SM70_8x4_Col / SM70_8x8_32b), independently of the atom's own maps. Every
// operand storage (A and B each k-contiguous or not, i.e. every row/col layout of the
// instruction), full and partial reduction and column extents, both warp_gemm paths.
//
// Inputs are multiples of 1/8 in [-2, 2], so every product and partial sum is exact in fp32 and
// the result must equal the fp64 reference exactly, whatever the summation order.
//   c++ -std=c++17 -O1 -pthread -Icsrc tests/atoms/volta_warp_emulation.cpp && ./a.out
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

// The device headers as host code. The functions below are declared for the headers' other
// functions (never called here).
#define __device__
#define __host__
#define __forceinline__ inline
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline void __trap() { std::abort(); }
inline float __shfl_xor_sync(unsigned, float, int) { std::abort(); }
inline unsigned __cvta_generic_to_shared(const void*) { std::abort(); }
inline float fmaxf(float a, float b) { return a > b ? a : b; }
struct uint2 {
  unsigned x, y;
};

template <bool kAKContiguous, bool kBKContiguous>
void emulated_mma_m8n8k4(float (&c)[8], const uint32_t (&a)[2], const uint32_t (&b)[2]);

#define FLASHV100_WARP_EMULATION 1
#include "cuda/kernels/warp_tile.cuh"

namespace {

using flashv100::kern::Fp16;
using flashv100::kern::SmemOperand;
using flashv100::kern::VoltaAtom;
using flashv100::kern::WarpAccum;

// A reusable barrier for the 32 lanes.
class WarpBarrier {
 public:
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const long generation = generation_;
    if (++arrived_ == 32) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  long generation_ = 0;
};

WarpBarrier barrier;
uint32_t lane_a[32][2], lane_b[32][2];
thread_local int this_lane = -1;

float half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -24)
                                  : std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  return sign ? -magnitude : magnitude;
}

// Multiples of 1/8 in [-2, 2]: exact in fp16.
uint16_t float_to_half_exact(float x) {
  if (x == 0.0f) return 0;
  const uint16_t sign = x < 0 ? 0x8000 : 0;
  float m = std::fabs(x);
  int exponent = 0;
  while (m >= 2.0f) m /= 2.0f, ++exponent;
  while (m < 1.0f) m *= 2.0f, --exponent;
  return sign | static_cast<uint16_t>((exponent + 15) << 10) |
         static_cast<uint16_t>((m - 1.0f) * 1024.0f);
}

// Value v (0-3) of a lane's two registers: register v / 2, low half first.
float value_of(const uint32_t (&regs)[2], int v) {
  return half_to_float(static_cast<uint16_t>(regs[v >> 1] >> (16 * (v & 1))));
}

}  // namespace

// One warp-wide mma.sync.aligned.m8n8k4.{row|col}.{col|row}.f32.f16.f16.f32. Quad pair q is lanes
// 4q..4q+3 (its threads t = 0..3) and 16+4q..16+4q+3 (t = 4..7). A fragments (M8 x K4): "row":
// thread t holds row t, k = value; "col": thread t holds k = t % 4, rows 4 (t / 4) + value.
// B fragments (K4 x N8): "col": thread t holds column t, k = value; "row": thread t holds
// k = t % 4, columns 4 (t / 4) + value. C: thread t = t0 + 2 t1 + 4 t2, value v = v0 + 2 v1 + 4 v2
// sits at row t0 + 2 v1 + 4 t2, column v0 + 2 t1 + 4 v2.
template <bool kAKContiguous, bool kBKContiguous>
void emulated_mma_m8n8k4(float (&c)[8], const uint32_t (&a)[2], const uint32_t (&b)[2]) {
  const int lane = this_lane;
  std::memcpy(lane_a[lane], a, sizeof(a));
  std::memcpy(lane_b[lane], b, sizeof(b));
  barrier.wait();
  const int q = (lane >> 2) & 3;
  const auto lane_of = [&](int t) { return 4 * q + (t & 3) + 16 * (t >> 2); };
  const auto a_at = [&](int m, int k) {
    return kAKContiguous ? value_of(lane_a[lane_of(m)], k)
                         : value_of(lane_a[lane_of(k + 4 * (m / 4))], m % 4);
  };
  const auto b_at = [&](int k, int n) {
    return kBKContiguous ? value_of(lane_b[lane_of(n)], k)
                         : value_of(lane_b[lane_of(k + 4 * (n / 4))], n % 4);
  };
  const int t = (lane & 3) + 4 * (lane >> 4);
  for (int v = 0; v < 8; ++v) {
    const int row = (t & 1) + 2 * ((v >> 1) & 1) + 4 * (t >> 2);
    const int col = (v & 1) + 2 * ((t >> 1) & 1) + 4 * (v >> 2);
    for (int k = 0; k < 4; ++k) c[v] += a_at(row, k) * b_at(k, col);
  }
  barrier.wait();  // every lane has read the fragments before any lane writes the next ones
}

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
          float_to_half_exact(static_cast<float>(a[m * kMaxK + k]));
  for (int k = 0; k < kMaxK; ++k)
    for (int n = 0; n < kCols; ++n)
      sb[kBK ? n * ldb + k : k * ldb + n] =
          float_to_half_exact(static_cast<float>(b[k * kCols + n]));

  std::vector<float> out(kRows * kCols, -1000.0f);
  std::vector<int> writes(kRows * kCols, 0);
  std::mutex out_mutex;
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&, lane] {
      this_lane = lane;
      WarpAccum<VoltaAtom, kRows, kCols> acc;
      acc.zero();
      flashv100::kern::warp_gemm<VoltaAtom, Fp16, kMaxK>(
          acc, SmemOperand<kAK>{sa.data(), lda}, SmemOperand<kBK>{sb.data(), ldb}, k_extent,
          n_extent, lane);
      std::lock_guard<std::mutex> lock(out_mutex);
      acc.for_each(lane, [&](int, int, int row, int col, float& value) {
        out[row * kCols + col] = value;
        ++writes[row * kCols + col];
      });
    });
  }
  for (std::thread& lane : lanes) lane.join();

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
