// Tensor-core atoms: one warp-wide mma instruction plus the map from (lane, register) to the
// matrix coordinates it holds. Everything above this file (tiles, softmax, masking) is written
// against these maps only, never against an instruction's layout.
//
// Operands are 16-bit pairs, B addressed as (n, k). Each atom loads its A and B fragments from a
// shared-memory operand (warp_tile.cuh's SmemOperand: at(m, k) and kKContiguous) itself, in the
// register layout its mma<Elem, AOp, BOp> expects for operands stored that way.
// Accumulator element i sits at (c_row, c_col); c_col(i ^ 1) == c_col(i) ^ 1, so elements (2k, 2k+1)
// are column neighbours, and elements i and i + 2 (i % 4 == 0) share columns in the two row slots.
// The rows a lane holds are indexed by a "row slot"; the lanes sharing a row differ exactly in the
// bits of kRowLaneMask (row reductions via shuffles). The pairs (i, i + 1) of one fragment row
// fall into kDropoutGroups of the Philox column groups of common/philox.h (dropout_group(i)).
// Besides the instruction, an atom names what the GPUs that run it offer the tiles above:
// kAccumIsA (an accumulator tile can be repacked as an A operand in registers), kAsyncCopy
// (cp.async) and kMaxSmemBytes (dynamic shared memory per block on the smallest such GPU).
#pragma once

#include "cuda/kernels/numeric.cuh"

namespace flashv100 {
namespace kern {

// Volta mma.m8n8k4: one warp instruction is four independent 8x8x4 products, one per quad pair
// (lanes 4q..4q+3 and 16+4q..16+4q+3, PTX ISA "quad-pair"). Quad pair q is placed at rows 8*(q&1)
// and columns 8*(q>>1), so one instruction computes a 16x16x4 warp tile.
struct VoltaAtom {
  static constexpr int kM = 16, kN = 16, kK = 4;
  static constexpr bool kLdmatrix = false;  // sm_70 has no ldmatrix
  static constexpr int kARegs = 2, kBRegs = 2, kCRegs = 8;
  static constexpr int kRowSlots = 2;
  static constexpr int kRowLaneMask = 0b01010;  // lanes of a row differ in bits 1 and 3
  // A fragment row's pairs are 4 columns apart, so their (column / 2) % 4 differ; the lane 8
  // columns over holds the other words of the same two Philox calls.
  static constexpr int kDropoutGroups = 2;
  static constexpr int kDropoutPartnerLane = 0b01000;
  // The m8n8k4 accumulator and A layouts differ, so P goes through shared memory.
  static constexpr bool kAccumIsA = false;
  static constexpr bool kAsyncCopy = false;
  static constexpr int kMaxSmemBytes = 96 * 1024;
  static constexpr int kNativeArch = 700;

  static __device__ __forceinline__ int row_slot(int i) { return (i >> 1) & 1; }
  static __device__ __forceinline__ int dropout_group(int i) { return (i >> 2) & 1; }
  static __device__ __forceinline__ int slot_row(int lane, int slot) {
    return ((lane >> 2) & 1) * 8 + (lane >> 4) * 4 + (lane & 1) + 2 * slot;
  }
  static __device__ __forceinline__ int c_row(int lane, int i) { return slot_row(lane, row_slot(i)); }
  static __device__ __forceinline__ int c_col(int lane, int i) {
    return ((lane >> 3) & 1) * 8 + (lane & 2) + (i & 1) + (i & 4);
  }

  // Fragments of quad pair q: A rows 8 (q & 1) and B columns 8 (q >> 1) of the 16x16 block. The
  // layout follows the operand's storage, so every fragment is one 64-bit shared-memory load:
  // k-contiguous A is "row" (a lane holds one row, k 0-3), otherwise "col" (one k, four rows);
  // k-contiguous B is "col" (one column, k 0-3), otherwise "row" (one k, four columns).
  template <class Op>
  static __device__ __forceinline__ void load_a(const Op& op, int m0, int k0, int lane,
                                                uint32_t (&a)[kARegs]) {
    load_quad(op, m0, ((lane >> 2) & 1) * 8 + (lane >> 4) * 4, k0, lane, a);
  }
  template <class Op>
  static __device__ __forceinline__ void load_b(const Op& op, int n0, int k0, int lane,
                                                uint32_t (&b)[kBRegs]) {
    load_quad(op, n0, ((lane >> 3) & 1) * 8 + (lane >> 4) * 4, k0, lane, b);
  }

  // D = A B + C of each quad pair; the layouts of A and B are those load_a / load_b gave them.
  template <class Elem, class AOp, class BOp>
  static __device__ __forceinline__ void mma(float (&c)[kCRegs], const uint32_t (&a)[kARegs],
                                             const uint32_t (&b)[kBRegs]) {
    static_assert(!Elem::kIsBf16, "Volta tensor cores take fp16 only");
#if defined(FLASHV100_HOST_EMULATION)
    emulated_mma_m8n8k4<AOp::kKContiguous, BOp::kKContiguous>(c, a, b);
#else
#define FLASHV100_MMA_M8N8K4(layouts)                                                          \
  asm volatile("mma.sync.aligned.m8n8k4." layouts ".f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, " \
               "{%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"                                \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]),       \
                 "+f"(c[6]), "+f"(c[7])                                                         \
               : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(b[1]))
    if constexpr (AOp::kKContiguous && BOp::kKContiguous) {
      FLASHV100_MMA_M8N8K4("row.col");
    } else if constexpr (AOp::kKContiguous) {
      FLASHV100_MMA_M8N8K4("row.row");
    } else if constexpr (BOp::kKContiguous) {
      FLASHV100_MMA_M8N8K4("col.col");
    } else {
      FLASHV100_MMA_M8N8K4("col.row");
    }
#undef FLASHV100_MMA_M8N8K4
#endif
  }

 private:
  // The four 16-bit values of a lane, contiguous in shared memory (one 64-bit load), for the
  // fragment at (x0, k0): at (x0 + x, k0..k0+3) of a k-contiguous operand (x = x_quad + lane % 4:
  // row of A or column of B), or at (x0 + x_quad..x0 + x_quad + 3, k0 + lane % 4) otherwise.
  // The lane's part of the offset is apart, so that the fragment's folds into the load's
  // immediate. Operands start 8-byte aligned, with ld a multiple of 4.
  template <class Op>
  static __device__ __forceinline__ void load_quad(const Op& op, int x0, int x_quad, int k0,
                                                   int lane, uint32_t (&r)[2]) {
    const int lane_offset =
        Op::kKContiguous ? op.offset(x_quad + (lane & 3), 0) : op.offset(x_quad, lane & 3);
    const uint2 quad = *reinterpret_cast<const uint2*>(op.base + lane_offset + op.offset(x0, k0));
    r[0] = quad.x;
    r[1] = quad.y;
  }
};

// Ampere+ mma.m16n8k16 (fp16 or bf16 inputs, fp32 accumulate).
struct AmpereAtom {
  static constexpr int kM = 16, kN = 8, kK = 16;
  static constexpr bool kLdmatrix = true;
  static constexpr int kARegs = 4, kBRegs = 2, kCRegs = 4;
  static constexpr int kRowSlots = 2;
  static constexpr int kRowLaneMask = 0b00011;  // lanes of a row differ in bits 0 and 1
  static constexpr int kDropoutGroups = 1;  // one pair per fragment row
  static constexpr int kDropoutPartnerLane = 0;
  static constexpr bool kAccumIsA = true;
  static constexpr bool kAsyncCopy = true;        // sm_80+
  static constexpr int kMaxSmemBytes = 99 * 1024;  // sm_86 / sm_89 (sm_80: 163 KB, sm_90: 227 KB)
  static constexpr int kNativeArch = 800;

  // The A fragment (16 rows x 16 k) made of two accumulator tiles (16 rows x 8 cols each) that
  // sit side by side along k: A register j holds (row + 8 (j & 1), col + 8 (j >> 1)), exactly the
  // accumulator pair (c[2 (j & 1)], c[2 (j & 1) + 1]) of tile j >> 1.
  template <class Elem>
  static __device__ __forceinline__ void a_from_accum(const float (&lo)[kCRegs],
                                                      const float (&hi)[kCRegs],
                                                      uint32_t (&a)[kARegs]) {
    a[0] = pack2<Elem>(lo[0], lo[1]);
    a[1] = pack2<Elem>(lo[2], lo[3]);
    a[2] = pack2<Elem>(hi[0], hi[1]);
    a[3] = pack2<Elem>(hi[2], hi[3]);
  }

  static __device__ __forceinline__ int row_slot(int i) { return i >> 1; }
  static __device__ __forceinline__ int dropout_group(int) { return 0; }
  static __device__ __forceinline__ int slot_row(int lane, int slot) { return (lane >> 2) + 8 * slot; }
  static __device__ __forceinline__ int c_row(int lane, int i) { return slot_row(lane, row_slot(i)); }
  static __device__ __forceinline__ int c_col(int lane, int i) { return (lane & 3) * 2 + (i & 1); }

  // ldmatrix of four / two 8x8 matrices from shared memory, lane i giving the address of row
  // i % 8 of matrix i / 8; kTrans transposes each matrix (the stored rows are its columns).
  template <bool kTrans>
  static __device__ __forceinline__ void ldmatrix_x4(const uint16_t* row, uint32_t& r0,
                                                     uint32_t& r1, uint32_t& r2, uint32_t& r3) {
#if FLASHV100_SM80
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
    }
#elif defined(FLASHV100_HOST_EMULATION)
    uint32_t* regs[4] = {&r0, &r1, &r2, &r3};
    emulated_ldmatrix<kTrans, 4>(row, regs);
#else
    (void)row, (void)r0, (void)r1, (void)r2, (void)r3;
    __trap();
#endif
  }
  template <bool kTrans>
  static __device__ __forceinline__ void ldmatrix_x2(const uint16_t* row, uint32_t& r0,
                                                     uint32_t& r1) {
#if FLASHV100_SM80
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                   : "=r"(r0), "=r"(r1) : "r"(addr));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                   : "=r"(r0), "=r"(r1) : "r"(addr));
    }
#elif defined(FLASHV100_HOST_EMULATION)
    uint32_t* regs[2] = {&r0, &r1};
    emulated_ldmatrix<kTrans, 2>(row, regs);
#else
    (void)row, (void)r0, (void)r1;
    __trap();
#endif
  }

  // The A fragment of the 16x16 block at (m0, k0): four 8x8 matrices (rows 0-7 / 8-15 x k 0-7 /
  // 8-15). A k-contiguous operand gives rows of A; otherwise the stored rows are rows of A^T and
  // ldmatrix.trans transposes them.
  template <class Op>
  static __device__ __forceinline__ void load_a(const Op& op, int m0, int k0, int lane,
                                                uint32_t (&a)[kARegs]) {
    const int q = lane >> 3, r = lane & 7;
    const int m = m0 + 8 * (q & 1), k = k0 + 8 * (q >> 1);
    ldmatrix_x4<!Op::kKContiguous>(Op::kKContiguous ? op.at(m + r, k) : op.at(m, k + r), a[0],
                                   a[1], a[2], a[3]);
  }
  // The B fragment of the 8(n) x 16(k) block at (n0, k0): two 8x8 matrices (k 0-7 / 8-15).
  template <class Op>
  static __device__ __forceinline__ void load_b(const Op& op, int n0, int k0, int lane,
                                                uint32_t (&b)[kBRegs]) {
    const int q = (lane >> 3) & 1, r = lane & 7;
    ldmatrix_x2<!Op::kKContiguous>(
        Op::kKContiguous ? op.at(n0 + r, k0 + 8 * q) : op.at(n0, k0 + 8 * q + r), b[0], b[1]);
  }
  // The B fragments of the two 8(n) x 16(k) blocks at (n0, k0) and (n0 + 8, k0): four 8x8
  // matrices (n block 0 / 1 x k 0-7 / 8-15), one instruction instead of two load_b.
  template <class Op>
  static __device__ __forceinline__ void load_b_pair(const Op& op, int n0, int k0, int lane,
                                                     uint32_t (&b0)[kBRegs],
                                                     uint32_t (&b1)[kBRegs]) {
    const int q = lane >> 3, r = lane & 7;
    const int n = n0 + 8 * (q >> 1), k = k0 + 8 * (q & 1);
    ldmatrix_x4<!Op::kKContiguous>(Op::kKContiguous ? op.at(n + r, k) : op.at(n, k + r), b0[0],
                                   b0[1], b1[0], b1[1]);
  }

  // ldmatrix(.trans) gives every operand the row.col layout, whatever its storage.
  template <class Elem, class AOp, class BOp>
  static __device__ __forceinline__ void mma(float (&c)[kCRegs], const uint32_t (&a)[kARegs],
                                             const uint32_t (&b)[kBRegs]) {
#if FLASHV100_SM80
    if constexpr (Elem::kIsBf16) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#elif defined(FLASHV100_HOST_EMULATION)
    emulated_mma_m16n8k16<Elem::kIsBf16>(c, a, b);
#else
    __trap();  // never launched below sm_80: the launcher picks VoltaAtom there
#endif
  }
};

}  // namespace kern
}  // namespace flashv100
