// Per-block problem geometry shared by the forward and backward kernels: which batch/head a block
// works on, where its tensors start, and which keys each query row may see (causal alignment).
#pragma once

#include "common/philox.h"
#include "cuda/kernels/configs.cuh"

namespace flashv100 {
namespace kern {

__device__ __forceinline__ const uint16_t* head_ptr(const void* base, const TensorStrides& st,
                                                    int64_t b, int64_t h, int64_t row) {
  return static_cast<const uint16_t*>(base) + b * st.batch + h * st.head + row * st.row;
}
__device__ __forceinline__ uint16_t* head_ptr(void* base, const TensorStrides& st, int64_t b,
                                              int64_t h, int64_t row) {
  return static_cast<uint16_t*>(base) + b * st.batch + h * st.head + row * st.row;
}

// n / d for 0 <= n, d < 2^31 by a multiply-high and a shift (Granlund and Montgomery's round-up
// method, as CUTLASS's FastDivmod): the divisor is set once per block, the quotients are taken per
// tile row, where an integer division would cost ~30 instructions each.
struct FastDivmod {
  int divisor = 1;
  uint32_t multiplier = 0, shift = 0;

  FastDivmod() = default;
  __device__ __forceinline__ explicit FastDivmod(int d) : divisor(d) {
    if (d > 1) {
      const int ceil_log2 = 32 - __clz(d - 1);
      multiplier = static_cast<uint32_t>(((1ull << (31 + ceil_log2)) + d - 1) / d);
      shift = ceil_log2 - 1;
    }
  }
  __device__ __forceinline__ int quotient(int n) const {
    return divisor == 1
               ? n
               : static_cast<int>(__umulhi(static_cast<uint32_t>(n), multiplier) >> shift);
  }
};

// The first 32 entries of a block_table row, entry i in lane i of each warp. Loaded at kernel
// entry, next to the sequence's length, they give a paged block its first key tiles' pages without
// a table read that waits for that length (a short split's whole latency is such reads).
struct TableHead {
  static constexpr int kEntries = 32;
  int32_t lane_entry = 0;

  __device__ __forceinline__ void load(const int32_t* row, int64_t entries, int lane) {
    if (lane < entries) lane_entry = __ldg(row + lane);
  }
  // The entry of the row's page `page`: from the lanes, else read from `row`. Warp-uniform `page`.
  __device__ __forceinline__ int entry(const int32_t* row, int page) const {
    return page < kEntries ? __shfl_sync(0xffffffffu, lane_entry, page) : __ldg(row + page);
  }
};

// The rows of one key/value head of a sequence in a paged KV cache (KVCacheParams), for a tile
// whose row 0 is the sequence's cache row `first`: row r is row (first + r) % page_size of page
// table[(first + r) / page_size].
struct PagedRows {
  const uint16_t* head;  // this head in page 0
  const int32_t* table;  // the sequence's block_table row
  int64_t page_stride, row_stride;
  FastDivmod page_size;
  int first;

  __device__ __forceinline__ const uint16_t* operator()(int r) const {
    const int row = first + r;
    const int page = page_size.quotient(row);
    return address(__ldg(table + page), page, row);
  }

  // The block-table entry of row 0's page: read from memory, or from `head`'s lanes.
  __device__ __forceinline__ int first_entry() const {
    return __ldg(table + page_size.quotient(first));
  }
  __device__ __forceinline__ int first_entry(const TableHead& head) const {
    return head.entry(table, page_size.quotient(first));
  }
  // Row 0's address if rows [0, rows) lie in one page (then row r is at row_stride * r from
  // it), else nullptr; `entry` is first_entry(), read ahead by the caller.
  __device__ __forceinline__ const uint16_t* single_page(int rows, int entry) const {
    const int page = page_size.quotient(first);
    return page == page_size.quotient(first + rows - 1) ? address(entry, page, first) : nullptr;
  }

 private:
  // Cache row `row`, which lies in the sequence's page `page`, stored in cache page `entry`.
  __device__ __forceinline__ const uint16_t* address(int entry, int page, int row) const {
    return head + static_cast<int64_t>(entry) * page_stride +
           static_cast<int64_t>(row - page * page_size.divisor) * row_stride;
  }
};

// Starts moving a block_table row's `entries` int32 entries into L2, one prefetch per 128-byte line
// over the block's threads. Issued at kernel entry, the table reads past TableHead's entries (a
// split deep in a long sequence, the loop's reads one tile ahead) hit L2.
// A hint only: the host emulation has no L2 and skips it.
template <int kThreads>
__device__ __forceinline__ void prefetch_table_row(const int32_t* row, int64_t entries, int tid) {
#ifndef FLASHV100_HOST_EMULATION
  constexpr uint64_t kLine = 128;
  const uint64_t first = reinterpret_cast<uint64_t>(row) & ~(kLine - 1);
  const uint64_t end = reinterpret_cast<uint64_t>(row + entries);
  for (uint64_t line = first + tid * kLine; line < end; line += kThreads * kLine)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(line));
#else
  (void)row, (void)entries, (void)tid;
#endif
}

// Key j of a sequence is visible from its query i iff j < len_kv and lo <= j - i <= hi: causal
// alignment and window of common/params.h (WindowParams) in one band. Unbounded sides are clamped
// to values no (padded) tile reaches, so that they cost nothing beyond one compare.
struct Visibility {
  int len_q, len_kv;
  int lo, hi;

  // Rows of a block tile past len_q stay below len_q + kRowPad (tiles have at most 128 rows).
  static constexpr int kRowPad = 256;

  __device__ __forceinline__ Visibility(const ForwardParams& p, const SequenceSpan& seq)
      : len_q(static_cast<int>(seq.len_q)), len_kv(static_cast<int>(seq.len_kv)) {
    const int shift = p.causal == CausalMode::kTopLeft ? 0 : len_kv - len_q;
    int right = p.window.right;
    if (p.causal != CausalMode::kNone) right = right < 0 ? 0 : min(right, 0);
    // Window sides are clamped where they stop hiding keys (right at len_q: shift + len_q is
    // len_kv; left at len_kv + kRowPad: below the band's floor), which keeps the sums in int32.
    hi = right < 0 ? len_kv : min(len_kv, shift + min(right, len_q));
    lo = p.window.left < 0
             ? -len_q - kRowPad
             : max(-len_q - kRowPad, shift - min(p.window.left, len_kv + kRowPad));
  }

  __device__ __forceinline__ bool visible(int i, int j) const {
    return j < len_kv && j - i <= hi && j - i >= lo;
  }
  // Keys [key_begin(row_begin), key_end(row_end)) cover every key visible from some query row in
  // [row_begin, row_end).
  __device__ __forceinline__ int key_begin(int row_begin) const {
    return max(0, row_begin + lo);
  }
  __device__ __forceinline__ int key_end(int row_end) const {
    const int last_row = min(row_end, len_q) - 1;
    return max(0, min(len_kv, last_row + hi + 1));
  }
  // Query rows [row_begin(key_begin), row_end(key_end)) cover every row that sees some key in
  // [key_begin, key_end).
  __device__ __forceinline__ int row_begin(int key_begin) const {
    return max(0, key_begin - hi);
  }
  __device__ __forceinline__ int row_end(int key_end) const {
    return max(0, min(len_q, key_end - lo));
  }
  // Does the (row_count x key_count) tile at (row0, key0) need per-element masking?
  __device__ __forceinline__ bool tile_needs_mask(int row0, int row_count, int key0,
                                                  int key_count) const {
    return key0 + key_count > len_kv || key0 + key_count - 1 - row0 > hi ||
           key0 - (row0 + row_count - 1) < lo;
  }
  // Sets the entries of a warp's score tile at (row0, key0) that are not visible to -inf. The
  // per-tile test is one uniform branch around the whole tile: a test per entry made the
  // compiler wrap every entry in its own divergence region (BSSY/BSYNC), 10-20% of the kernels'
  // stall samples on the H200. An entry's row and column are its lane's first entry's plus a
  // compile-time offset (both atoms), so an entry's tests take the lane's key room and diagonal
  // in the tile plus immediates: tested as visible(row0 + r, key0 + c), the compiler kept every
  // entry's offset in a register across the key loop (156 bytes of spills in a 128 x 64 forward
  // tile, sm_80).
  template <class Acc>
  __device__ __forceinline__ void hide(Acc& s, int lane, int row0, int key0) const {
    if (!tile_needs_mask(row0, Acc::kTileRows, key0, Acc::kTileCols)) return;
    const int r00 = Acc::row_of(lane, 0, 0), c00 = Acc::col_of(lane, 0, 0);
    const int diag = key0 + c00 - row0 - r00;
    const int kv_room = len_kv - key0 - c00;
    s.for_each(lane, [&](int, int, int r, int c, float& x) {
      const int dc = c - c00, d = diag + dc - (r - r00);
      if (!(dc < kv_room && d <= hi && d >= lo)) x = neg_inf();
    });
  }
  // The same problem with keys at and past `end` hidden (the alignment keeps the full key
  // length): what a mask that drops every key past `end` amounts to.
  __device__ __forceinline__ Visibility keys_before(int end) const {
    Visibility v = *this;
    v.len_kv = min(len_kv, end);
    return v;
  }
};

// FlashAttention-2's score modifiers of one (batch, query head) of a sequence (ScoreModParams),
// in registers: softcap, then ALiBi, on scores in natural-log units (the general variants only).
// Both are uniform per block, so their branches are too, and calls without them skip them whole.
struct ScoreMod {
  const ScoreModParams& params;  // a kernel parameter: read where used
  float slope;                   // this head's ALiBi slope; 0: none
  int diag;                      // len_kv - len_q: key i + diag is at ALiBi distance 0 from row i

  __device__ __forceinline__ ScoreMod(const ForwardParams& p, const SequenceSpan& seq, int64_t b,
                                      int64_t h)
      : params(p.score_mod),
        slope(p.score_mod.alibi_slopes != nullptr
                  ? p.score_mod.alibi_slopes[b * p.score_mod.alibi_batch_stride + h]
                  : 0.0f),
        diag(static_cast<int>(seq.len_kv - seq.len_q)) {}

  __device__ __forceinline__ bool softcap() const { return params.softcap > 0.0f; }
  __device__ __forceinline__ float alibi_bias(int i, int j) const {
    return slope * fabsf(static_cast<float>(i + diag - j));
  }
  // The modified score of one scaled score x (query i, key j).
  __device__ __forceinline__ float apply(float x, int i, int j) const {
    if (softcap()) x = params.softcap * fast_tanh(x * (1.0f / params.softcap));
    return slope != 0.0f ? x - alibi_bias(i, j) : x;
  }
  // The same on a warp tile of scaled scores whose (r, c) is query row0 + r, key col0 + c; hidden
  // scores (-inf) stay hidden.
  template <class Acc>
  __device__ __forceinline__ void apply(Acc& acc, int lane, int row0, int col0) const {
    if (softcap()) {
      const float cap = params.softcap, inv_cap = 1.0f / params.softcap;
      acc.for_each(lane, [&](int, int, int, int, float& x) {
        if (x != neg_inf()) x = cap * fast_tanh(x * inv_cap);
      });
    }
    if (slope != 0.0f) {
      acc.for_each(lane, [&](int, int, int r, int c, float& x) {
        x -= alibi_bias(row0 + r, col0 + c);
      });
    }
  }
  // d(softcapped score) / d(scaled score) = 1 - tanh^2, recovered from P = exp(score - base) as
  // the backward recomputes it (P's base and log2 normalizer, ALiBi undone), so that no second
  // accumulator tile holds it. P = 0 contributes nothing, whatever the factor.
  __device__ __forceinline__ float softcap_grad(float prob, float base, float log2_norm, int i,
                                                int j) const {
    if (prob == 0.0f) return 0.0f;
    float capped = base + (fast_log2(prob) - log2_norm) * (1.0f / kLog2e);
    if (slope != 0.0f) capped += alibi_bias(i, j);
    const float t = capped * (1.0f / params.softcap);
    return fmaxf(0.0f, 1.0f - t * t);
  }
};

// attn_mask of one (batch, head) as an additive bias in natural-log units: bool masks read as 0
// (keep) or -inf (drop). Broadcast dims have stride 0; any float dtype is read and widened here.
// `reads` is false when the mask amounts to `key_end` alone (MaskParams::key_range), so that no
// entry needs reading.
struct HeadMask {
  const char* base = nullptr;  // nullptr: no mask
  ScalarKind dtype = ScalarKind::kBool;
  int64_t row_stride = 0, col_stride = 0;
  bool reads = false;
  int key_end = 0x7fffffff;  // every key at and past it is dropped

  __device__ __forceinline__ HeadMask(const MaskParams& m, int64_t b, int64_t h, int64_t heads_q) {
    if (m.kind == MaskKind::kNone) return;
    const int64_t elem = m.dtype == ScalarKind::kDouble  ? 8
                         : m.dtype == ScalarKind::kFloat ? 4
                         : m.dtype == ScalarKind::kBool  ? 1
                                                         : 2;
    base = static_cast<const char*>(m.ptr) + (b * m.batch_stride + h * m.head_stride) * elem;
    dtype = m.dtype;
    row_stride = m.row_stride;
    col_stride = m.col_stride;
    reads = true;
    if (m.key_range != nullptr) {
      const int code = m.key_range[b * heads_q + h];
      reads = code < 0;
      key_end = reads ? -code - 1 : code;
    }
  }
  __device__ __forceinline__ bool present() const { return base != nullptr; }

  // The bias of query row i, key j (in range).
  __device__ __forceinline__ float bias(int i, int j) const {
    const int64_t idx = i * row_stride + j * col_stride;
    if (dtype == ScalarKind::kBool) return reinterpret_cast<const uint8_t*>(base)[idx] ? 0.0f : neg_inf();
    if (dtype == ScalarKind::kHalf) return Fp16::to_float(reinterpret_cast<const uint16_t*>(base)[idx]);
    if (dtype == ScalarKind::kBFloat16) return Bf16::to_float(reinterpret_cast<const uint16_t*>(base)[idx]);
    if (dtype == ScalarKind::kFloat) return reinterpret_cast<const float*>(base)[idx];
    return static_cast<float>(reinterpret_cast<const double*>(base)[idx]);
  }

  // Adds the bias to the scores of a warp tile whose (r, c) is query row0 + r, key col0 + c.
  // Hidden scores (-inf: past the keys or causal) and rows past len_q are left alone, their
  // entries never read.
  template <class Acc>
  __device__ __forceinline__ void add_bias(Acc& acc, int lane, int row0, int col0,
                                           int len_q) const {
    if (!reads) return;
    acc.for_each(lane, [&](int, int, int r, int c, float& x) {
      if (x != neg_inf() && row0 + r < len_q) x += bias(row0 + r, col0 + c);
    });
  }
};

// The Philox seed and offset of a dropout stream: given, or read from the generator's device
// state where a CUDA graph captured the step.
__device__ __forceinline__ uint64_t dropout_seed(const DropoutParams& d) {
  return d.seed_ptr != nullptr ? static_cast<uint64_t>(*d.seed_ptr) : d.seed;
}
__device__ __forceinline__ uint64_t dropout_offset(const DropoutParams& d) {
  return d.offset_ptr != nullptr ? static_cast<uint64_t>(*d.offset_ptr) + d.offset_intragraph
                                 : d.offset;
}
// DropoutParams::rng_state_out: the forward's [seed, offset] for its backward (zeros without
// dropout), written by one thread of its first block instead of a launch of its own.
__device__ __forceinline__ void write_rng_state(const DropoutParams& d) {
  if (d.rng_state_out == nullptr || blockIdx.x + blockIdx.y + blockIdx.z + threadIdx.x != 0) return;
  d.rng_state_out[0] = static_cast<int64_t>(dropout_seed(d));
  d.rng_state_out[1] = static_cast<int64_t>(dropout_offset(d));
}

// Dropout on attention probabilities with the Philox keep bits of common/philox.h (the kDropout
// kernel variants; p > 0). Seed and offset come from device memory when the launcher passes
// pointers (CUDA graph capture, and the backward reading the forward's rng_state).
struct Dropout {
  const DropoutParams& params;  // a kernel parameter: read where used, holding no register
  DropoutStream stream;

  __device__ __forceinline__ explicit Dropout(const DropoutParams& d)
      : params(d), stream(dropout_seed(d), dropout_offset(d)) {}
  // 1 / (1 - p), the scale of kept entries.
  __device__ __forceinline__ float inv_keep() const { return 1.0f / (1.0f - params.p); }
  // The drop threshold in the high 16 bits: one compare per 16-bit uniform.
  __device__ __forceinline__ uint32_t threshold_high() const {
    return dropout_threshold(params.p) << 16;
  }
  // f(fm, fn, i, keep_i, keep_i+1) with the keep decisions of each horizontal pair (i, i + 1) of a
  // warp tile whose (r, c) is query row0 + r, key col0 + c (the kernels apply the 1 / (1 - p) of
  // kept entries, inv_keep(), once per output element instead of per entry); col0 must be a
  // multiple of the tile's width. The pairs of a row that share a Philox call (a 32-column block
  // and a column group, common/philox.h) are visited together, right after the call, so that no
  // call is made twice and few are live at once. Atoms whose fragment rows span two groups pair
  // each lane with the lane holding the other words of the same two calls
  // (Atom::kDropoutPartnerLane): each makes one call, and they swap.
  template <class Atom, class Acc, class F>
  __device__ __forceinline__ void for_each_keep_pair(int lane, int64_t batch_head, int row0,
                                                     int col0, F&& f) const {
    constexpr int kFragsPerBlock = 32 / Atom::kN;
    constexpr int kBlocks = (Acc::kFragN + kFragsPerBlock - 1) / kFragsPerBlock;
    constexpr bool kSwap = Atom::kDropoutGroups == 2;
    static_assert(Atom::kDropoutGroups == 1 || (kSwap && Atom::kDropoutPartnerLane != 0 &&
                                                Atom::kCRegs == 4 * Atom::kRowSlots),
                  "swapping needs one pair per fragment, row slot and group");
    // Bits of col0 that move a word index: none when tiles are whole 32-column blocks, else
    // whether the tile is the block's second half.
    const int col0_in_block = Acc::kFragN * Atom::kN % 32 == 0 ? 0 : col0 & 16;
    const auto word_of = [&](int l, int fn, int i) {
      return ((col0_in_block + Acc::col_of(l, fn, i)) >> 3) & 3;
    };
    const uint32_t threshold = threshold_high();
    const auto apply = [&](int fm, int fn, int i, uint32_t pair_bits) {
      f(fm, fn, i, (pair_bits << 16) >= threshold, pair_bits >= threshold);
    };
    const int group = kSwap && (lane & Atom::kDropoutPartnerLane) != 0 ? 1 : 0;
#pragma unroll
    for (int fm = 0; fm < Acc::kFragM; ++fm)
#pragma unroll
      for (int slot = 0; slot < Atom::kRowSlots; ++slot)
#pragma unroll
        for (int block = 0; block < kBlocks; ++block) {
          const int fn0 = block * kFragsPerBlock;
          const int own_pair = group ? first_pair<Atom>(slot, 1) : first_pair<Atom>(slot, 0);
          const Philox4 bits = dropout_call(stream, batch_head, row0 + Acc::row_of(lane, fm, slot),
                                            col0 + Acc::col_of(lane, fn0, own_pair));
#pragma unroll
          for (int fn = fn0; fn < fn0 + kFragsPerBlock && fn < Acc::kFragN; ++fn) {
            if constexpr (kSwap) {
              // The partner holds the other words of my call in its pair of my group.
              const uint32_t received = __shfl_xor_sync(
                  0xffffffffu,
                  philox_word(bits, word_of(lane ^ Atom::kDropoutPartnerLane, fn, own_pair)),
                  Atom::kDropoutPartnerLane);
              const uint32_t own = philox_word(bits, word_of(lane, fn, own_pair));
              apply(fm, fn, first_pair<Atom>(slot, 0), group == 0 ? own : received);
              apply(fm, fn, first_pair<Atom>(slot, 1), group == 1 ? own : received);
            } else {
#pragma unroll
              for (int i = 0; i < Atom::kCRegs; i += 2)
                if (Atom::row_slot(i) == slot)
                  apply(fm, fn, i, philox_word(bits, word_of(lane, fn, i)));
            }
          }
        }
  }

 private:
  // The first pair (i, i + 1) of a fragment in row slot `slot` and dropout group `group`.
  template <class Atom>
  static __device__ __forceinline__ int first_pair(int slot, int group) {
#pragma unroll
    for (int i = 0; i < Atom::kCRegs; i += 2)
      if (Atom::row_slot(i) == slot && Atom::dropout_group(i) == group) return i;
    return 0;
  }
};

}  // namespace kern
}  // namespace flashv100
