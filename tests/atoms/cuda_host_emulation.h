// The device kernels (csrc/cuda/kernels) as host code, for tests on a machine without a GPU: a
// block's threads are fibers (ucontext) run one at a time, each until it reaches a warp or block
// barrier or exits, so every block runs deterministically on one host thread. Blocks of a grid run
// one after another, sharing one copy of each shared-memory array.
//
// What it emulates: threadIdx / blockIdx / blockDim / gridDim, __syncthreads (live threads),
// __syncwarp, __shfl_xor_sync, __shfl_sync, __any_sync, the tensor-core instructions of both atoms
// from the PTX ISA's fragment maps, independently of the atoms' own (mma.sync.m8n8k4; ldmatrix
// .x2/.x4 with and without .trans and mma.sync.m16n8k16 in fp16 and bf16), cp.async (a
// synchronous copy: one order the asynchronous one may take), the fp16 conversions and the
// approximate exp2 / log2 / rcp (exact host math: results differ from a GPU's by rounding), and
// atomicAdd (fibers never interleave inside one). What it does not: data races (a missing barrier
// is not seen unless it changes the order the fibers run in), memory-model or timing effects.
// Include it before any kernel header.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define __device__
#define __host__
#define __global__
// Shared memory: blocks run one after another, so one copy of each array serves every block: the
// kernels' `static __shared__` arrays become function statics, and the dynamic `extern __shared__`
// one the program defines.
#define __shared__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define FLASHV100_HOST_EMULATION 1

struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<uint64_t>(a) * b) >> 32);
}
template <class T>
inline T __ldg(const T* p) { return *p; }
[[noreturn]] inline void __trap() { std::abort(); }
inline unsigned __cvta_generic_to_shared(const void*) { std::abort(); }
using std::max;
using std::min;

// IEEE half <-> float, round to nearest even (cvt.rn.f16.f32), subnormals kept.
inline float emulated_half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float magnitude;
  if (exponent == 0x1f) {
    magnitude = mantissa ? std::nanf("") : INFINITY;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  }
  return sign ? -magnitude : magnitude;
}
inline uint16_t emulated_float_to_half(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return 0x7e00;
  const float a = std::fabs(x);
  if (a >= 65520.0f) return sign | 0x7c00;  // rounds to infinity
  if (a < std::ldexp(1.0f, -14)) {  // subnormal: multiples of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(a, 24)));
  }
  int exponent;
  const float m = std::frexp(a, &exponent);  // a = m * 2^exponent, m in [0.5, 1)
  const uint32_t q = static_cast<uint32_t>(std::nearbyint(std::ldexp(m, 11)));  // 1024..2048
  return sign | static_cast<uint16_t>(((exponent + 14) << 10) + q - 1024);
}

namespace cuda_emulation {

constexpr int kStackBytes = 512 * 1024;

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  int tid = 0;
  bool done = false;
};

struct Warp {
  int arrived = 0;
  long generation = 0;
  uint64_t exchange[32];  // shuffled / __any_sync values, ldmatrix addresses
  uint32_t mma_a[32][4], mma_b[32][2];
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int live = 0;
  int block_arrived = 0;
  long block_generation = 0;
  int current = -1;
  ucontext_t scheduler;
  std::function<void()> body;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}
inline dim3& grid_dim() {
  static dim3 d;
  return d;
}
inline dim3& block_dim() {
  static dim3 d;
  return d;
}
inline dim3& block_idx() {
  static dim3 d;
  return d;
}
inline Fiber& self() { return block()->fibers[block()->current]; }
inline int lane() { return self().tid & 31; }
inline Warp& warp() { return block()->warps[self().tid >> 5]; }
inline int live_lanes(int w) {
  int n = 0;
  for (int t = 32 * w; t < 32 * (w + 1) && t < static_cast<int>(block()->fibers.size()); ++t)
    n += !block()->fibers[t].done;
  return n;
}

inline void yield() { swapcontext(&self().context, &block()->scheduler); }

// Every live lane of the warp arrives before any leaves.
inline void warp_barrier() {
  Warp& w = warp();
  const long generation = w.generation;
  if (++w.arrived == live_lanes(self().tid >> 5)) {
    w.arrived = 0;
    ++w.generation;
    return;
  }
  while (w.generation == generation) yield();
}

inline void block_barrier() {
  Block& b = *block();
  const long generation = b.block_generation;
  if (++b.block_arrived == b.live) {
    b.block_arrived = 0;
    ++b.block_generation;
    return;
  }
  while (b.block_generation == generation) yield();
}

inline void fiber_entry() {
  block()->body();
  Fiber& f = self();
  f.done = true;
  Block& b = *block();
  --b.live;
  // Barriers now complete with one thread fewer.
  if (b.block_arrived > 0 && b.block_arrived == b.live) {
    b.block_arrived = 0;
    ++b.block_generation;
  }
  Warp& w = warp();
  if (w.arrived > 0 && w.arrived == live_lanes(f.tid >> 5)) {
    w.arrived = 0;
    ++w.generation;
  }
}

// Runs kernel(args...) over grid x threads, one block at a time.
template <class Kernel, class... Args>
void launch(dim3 grid, int threads, Kernel&& kernel, Args&&... args) {
  grid_dim() = grid;
  block_dim() = dim3{static_cast<unsigned>(threads), 1, 1};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        block_idx() = dim3{x, y, z};
        Block b;
        b.fibers.resize(threads);
        b.warps.resize((threads + 31) / 32);
        b.live = threads;
        b.body = [&] { kernel(args...); };
        block() = &b;
        for (int t = 0; t < threads; ++t) {
          Fiber& f = b.fibers[t];
          f.tid = t;
          f.stack.reset(new char[kStackBytes]);
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = f.stack.get();
          f.context.uc_stack.ss_size = kStackBytes;
          f.context.uc_link = &b.scheduler;
          makecontext(&f.context, fiber_entry, 0);
        }
        // Round robin until every thread exits; a full round in which no thread moves is a
        // deadlock (a barrier some threads never reach).
        while (b.live > 0) {
          const long before_block = b.block_generation;
          long before_warps = 0;
          for (const Warp& w : b.warps) before_warps += w.generation;
          const int live_before = b.live;
          for (int t = 0; t < threads; ++t) {
            if (b.fibers[t].done) continue;
            b.current = t;
            swapcontext(&b.scheduler, &b.fibers[t].context);
          }
          long after_warps = 0;
          for (const Warp& w : b.warps) after_warps += w.generation;
          if (b.live > 0 && b.live == live_before && b.block_generation == before_block &&
              after_warps == before_warps) {
            std::fprintf(stderr, "cuda_emulation: deadlock in block (%u, %u, %u)\n", x, y, z);
            std::abort();
          }
        }
        block() = nullptr;
      }
}

template <class T>
inline uint64_t bits_of(T v) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 64 bits");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
inline T value_of_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

// An mma's operand fragments of every lane, in the warp's exchange, once all lanes posted theirs.
template <int kARegs, int kBRegs>
Warp& share_fragments(const uint32_t (&a)[kARegs], const uint32_t (&b)[kBRegs]) {
  Warp& w = warp();
  std::memcpy(w.mma_a[lane()], a, sizeof(a));
  std::memcpy(w.mma_b[lane()], b, sizeof(b));
  warp_barrier();
  return w;
}

}  // namespace cuda_emulation

#define threadIdx (dim3{static_cast<unsigned>(::cuda_emulation::self().tid), 0, 0})
#define blockIdx (::cuda_emulation::block_idx())
#define blockDim (::cuda_emulation::block_dim())
#define gridDim (::cuda_emulation::grid_dim())

inline void __syncthreads() { cuda_emulation::block_barrier(); }
inline void __syncwarp(unsigned = 0xffffffffu) { cuda_emulation::warp_barrier(); }

namespace cuda_emulation {
// Every lane posts `v`, then takes lane `src`'s.
template <class T>
inline T shuffle(T v, int src) {
  Warp& w = warp();
  w.exchange[lane()] = bits_of(v);
  warp_barrier();
  const T out = value_of_bits<T>(w.exchange[src & 31]);
  warp_barrier();  // read before any lane posts its next value
  return out;
}
}  // namespace cuda_emulation

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  return cuda_emulation::shuffle(v, cuda_emulation::lane() ^ lane_mask);
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src_lane) {
  return cuda_emulation::shuffle(v, src_lane);
}

inline bool __any_sync(unsigned, bool predicate) {
  cuda_emulation::Warp& w = cuda_emulation::warp();
  w.exchange[cuda_emulation::lane()] = predicate;
  cuda_emulation::warp_barrier();
  bool any = false;
  for (int l = 0; l < 32; ++l) {
    const int t = 32 * (cuda_emulation::self().tid >> 5) + l;
    if (t < static_cast<int>(cuda_emulation::block()->fibers.size()) &&
        !cuda_emulation::block()->fibers[t].done)
      any |= w.exchange[l] != 0;
  }
  cuda_emulation::warp_barrier();
  return any;
}

inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}

// One warp-wide mma.sync.aligned.m8n8k4.{row|col}.{col|row}.f32.f16.f16.f32. Quad pair q is lanes
// 4q..4q+3 (its threads t = 0..3) and 16+4q..16+4q+3 (t = 4..7). A fragments (M8 x K4): "row":
// thread t holds row t, k = value; "col": thread t holds k = t % 4, rows 4 (t / 4) + value.
// B fragments (K4 x N8): "col": thread t holds column t, k = value; "row": thread t holds
// k = t % 4, columns 4 (t / 4) + value. C: thread t = t0 + 2 t1 + 4 t2, value v = v0 + 2 v1 + 4 v2
// sits at row t0 + 2 v1 + 4 t2, column v0 + 2 t1 + 4 v2 (PTX ISA, "Matrix Fragments for
// mma.m8n8k4"; CUTLASS's SM70_8x4_Row / SM70_8x4_Col / SM70_8x8_32b).
template <bool kAKContiguous, bool kBKContiguous>
void emulated_mma_m8n8k4(float (&c)[8], const uint32_t (&a)[2], const uint32_t (&b)[2]) {
  const cuda_emulation::Warp& w = cuda_emulation::share_fragments(a, b);
  const int lane = cuda_emulation::lane();
  const auto value = [](const uint32_t* regs, int v) {
    return emulated_half_to_float(static_cast<uint16_t>(regs[v >> 1] >> (16 * (v & 1))));
  };
  const int q = (lane >> 2) & 3;
  const auto lane_of = [&](int t) { return 4 * q + (t & 3) + 16 * (t >> 2); };
  const auto a_at = [&](int m, int k) {
    return kAKContiguous ? value(w.mma_a[lane_of(m)], k)
                         : value(w.mma_a[lane_of(k + 4 * (m / 4))], m % 4);
  };
  const auto b_at = [&](int k, int n) {
    return kBKContiguous ? value(w.mma_b[lane_of(n)], k)
                         : value(w.mma_b[lane_of(k + 4 * (n / 4))], n % 4);
  };
  const int t = (lane & 3) + 4 * (lane >> 4);
  for (int v = 0; v < 8; ++v) {
    const int row = (t & 1) + 2 * ((v >> 1) & 1) + 4 * (t >> 2);
    const int col = (v & 1) + 2 * ((t >> 1) & 1) + 4 * (v >> 2);
    for (int k = 0; k < 4; ++k) c[v] += a_at(row, k) * b_at(k, col);
  }
  cuda_emulation::warp_barrier();  // every lane has read the fragments before any writes new ones
}

inline float emulated_bf16_to_float(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

// ldmatrix.sync.aligned.m8n8.xN[.trans].shared.b16: lanes 8 i .. 8 i + 7 give the addresses of rows
// 0-7 of matrix i; register i of lane l holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of
// matrix i (low half first), or with .trans its column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1.
template <bool kTrans, int kCount>
void emulated_ldmatrix(const uint16_t* row, uint32_t* (&regs)[kCount]) {
  cuda_emulation::Warp& w = cuda_emulation::warp();
  const int lane = cuda_emulation::lane();
  w.exchange[lane] = reinterpret_cast<uint64_t>(row);
  cuda_emulation::warp_barrier();
  const auto address = [&](int matrix, int r) {
    return reinterpret_cast<const uint16_t*>(w.exchange[8 * matrix + r]);
  };
  for (int i = 0; i < kCount; ++i) {
    uint16_t h[2];
    for (int e = 0; e < 2; ++e) {
      const int r = lane / 4, c = 2 * (lane % 4) + e;
      h[e] = kTrans ? address(i, c)[r] : address(i, r)[c];
    }
    *regs[i] = static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
  }
  cuda_emulation::warp_barrier();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16|bf16}: with g = lane / 4, t = lane % 4, A register j
// holds row g + 8 (j & 1), columns 2 t + 8 (j >> 1) + {0, 1}; B register j rows (k) 2 t + 8 j +
// {0, 1}, column g; C element i sits at row g + 8 (i >> 1), column 2 t + (i & 1).
template <bool kBf16>
void emulated_mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const cuda_emulation::Warp& w = cuda_emulation::share_fragments(a, b);
  const int lane = cuda_emulation::lane();
  const auto half = [](uint32_t reg, int e) {
    const uint16_t h = static_cast<uint16_t>(reg >> (16 * e));
    return kBf16 ? emulated_bf16_to_float(h) : emulated_half_to_float(h);
  };
  const auto a_at = [&](int m, int k) {
    return half(w.mma_a[4 * (m % 8) + (k % 8) / 2][(m / 8) + 2 * (k / 8)], k & 1);
  };
  const auto b_at = [&](int k, int n) {
    return half(w.mma_b[4 * n + (k % 8) / 2][k / 8], k & 1);
  };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    for (int k = 0; k < 16; ++k) c[i] += a_at(row, k) * b_at(k, col);
  }
  cuda_emulation::warp_barrier();
}

// cp.async of 16 bytes, or 16 zero bytes where src is null.
inline void emulated_cp_async_16(uint16_t* dst, const uint16_t* src) {
  if (src != nullptr) {
    std::memcpy(dst, src, 16);
  } else {
    std::memset(dst, 0, 16);
  }
}
