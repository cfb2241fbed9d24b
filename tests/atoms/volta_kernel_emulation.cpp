// The Volta atom's attention kernels (flash_fwd.cuh, flash_bwd.cuh) run whole on the CPU by the
// host emulation (cuda_host_emulation.h), launched as the CUDA launchers launch them for a V100
// (csrc/cuda/api/forward_launch.cuh, backward_launch.cuh: one query-side buffer, the compact
// tile): forward, then optionally the D pre-pass, dK/dV and dQ (atomic workspace + convert, or
// the deterministic kernel). tests/test_volta_kernel_emulation.py writes a case and compares
// the results with the fp64 reference.
//
//   volta_kernel_emulation DIR
// DIR/case.txt: "name value" lines (batch heads_q heads_kv len_q len_kv head_dim scale causal
// window_left window_right softcap mask dropout_p seed offset backward deterministic). Tensors,
// raw little-endian:
// q [B, Hq, Lq, d], k / v [B, Hkv, Lkv, d], dout like q (fp16); mask [B, Hq, Lq, Lkv] fp32
// (additive; "mask 1"). Writes out (fp16, like q), lse [B, Hq, Lq] (fp32) and with "backward 1"
// dq, dk, dv (fp16). Shared memory is filled with NaN before each block, so that a read of
// anything a block did not write shows up in its results.
#include "cuda_host_emulation.h"

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/kernels/flash_bwd.cuh"
#include "cuda/kernels/flash_fwd.cuh"

namespace flashv100 {
namespace kern {
// The kernels' `extern __shared__ uint4 smem_raw[]`: one block runs at a time.
uint4 smem_raw[VoltaAtom::kMaxSmemBytes / sizeof(uint4)];
}  // namespace kern
}  // namespace flashv100

namespace {

using namespace flashv100;
using kern::VoltaAtom;
using kern::Fp16;
using kern::Variant;

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

template <int D, Variant V>
void run(const std::map<std::string, double>& c, const std::string& dir) {
  const int64_t B = c.at("batch"), Hq = c.at("heads_q"), Hkv = c.at("heads_kv");
  const int64_t Lq = c.at("len_q"), Lkv = c.at("len_kv"), d = c.at("head_dim");
  std::vector<uint16_t> q = read_tensor<uint16_t>(dir + "/q", B * Hq * Lq * d);
  std::vector<uint16_t> k = read_tensor<uint16_t>(dir + "/k", B * Hkv * Lkv * d);
  std::vector<uint16_t> v = read_tensor<uint16_t>(dir + "/v", B * Hkv * Lkv * d);
  std::vector<float> mask;
  std::vector<uint16_t> out(B * Hq * Lq * d, 0x7e00);
  std::vector<float> lse(B * Hq * Lq, NAN);

  ForwardParams p;
  p.shape = AttentionShape{B, Hq, Hkv, Lq, Lkv, d, d};
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.out = out.data();
  p.lse = lse.data();
  p.lse_layout = LseLayout{Hq * Lq, Lq};
  p.q_strides = p.out_strides = bhld_strides(Hq, Lq, d);
  p.k_strides = p.v_strides = bhld_strides(Hkv, Lkv, d);
  p.scale = c.at("scale");
  p.causal = static_cast<CausalMode>(static_cast<int>(c.at("causal")));
  p.window = WindowParams{static_cast<int32_t>(c.at("window_left")),
                          static_cast<int32_t>(c.at("window_right"))};
  p.score_mod.softcap = static_cast<float>(c.at("softcap"));
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

  using FwdCfg = kern::FwdConfig<VoltaAtom, D, V>;
  launch(dim3{static_cast<unsigned>(ceil_div(Lq, FwdCfg::kBlockM)), static_cast<unsigned>(B * Hq), 1},
         FwdCfg::kThreads, kern::flash_fwd_kernel<VoltaAtom, Fp16, D, V>, p);
  write_tensor(dir + "/out", out);
  write_tensor(dir + "/lse", lse);
  if (c.at("backward") == 0) return;

  std::vector<uint16_t> dout = read_tensor<uint16_t>(dir + "/dout", B * Hq * Lq * d);
  std::vector<uint16_t> dq(q.size(), 0x7e00), dk(k.size(), 0x7e00), dv(v.size(), 0x7e00);
  std::vector<float> dsum(B * Hq * Lq, NAN), row_base(B * Hq * Lq, NAN),
      row_log2_norm(B * Hq * Lq, NAN);
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

  using Cfg = kern::BwdConfig<VoltaAtom, D, V>;
  using DqWorkspace = kern::DqWorkspace<VoltaAtom, Cfg>;
  std::vector<float> dq_accum;
  kern::DqWorkspaceRows dq_ws{nullptr, Lq, 0};
  if (!bp.deterministic) {
    dq_accum.assign(DqWorkspace::floats(B * Hq, Lq), NAN);  // the D pre-pass zeroes it
    dq_ws = DqWorkspace::rows(dq_accum.data(), Lq);
  }
  const int64_t dsum_warps = B * Hq * dq_ws.padded_len_q;
  launch(dim3{static_cast<unsigned>(ceil_div(dsum_warps, 4)), 1, 1}, 128,
         kern::flash_bwd_dsum_kernel<Fp16, kern::is_general(V)>, bp,
         static_cast<float*>(dsum.data()), dq_ws);
  launch(dim3{static_cast<unsigned>(ceil_div(Lkv, Cfg::kBlockN)), static_cast<unsigned>(B * Hkv), 1},
         Cfg::kThreads, kern::flash_bwd_dkdv_kernel<VoltaAtom, Fp16, D, V>, bp,
         static_cast<const float*>(dsum.data()), bp.deterministic ? nullptr : dq_accum.data());
  if (bp.deterministic) {
    launch(dim3{static_cast<unsigned>(ceil_div(Lq, Cfg::kBlockM)), static_cast<unsigned>(B * Hq), 1},
           Cfg::kThreads, kern::flash_bwd_dq_kernel<VoltaAtom, Fp16, D, V>, bp,
           static_cast<const float*>(dsum.data()));
  } else {
    launch(dim3{static_cast<unsigned>(DqWorkspace::query_tiles(Lq)), static_cast<unsigned>(B * Hq), 1},
           Cfg::kThreads, kern::flash_bwd_dq_convert_kernel<VoltaAtom, Fp16, D, V>, bp,
           static_cast<const float*>(dq_accum.data()));
  }
  write_tensor(dir + "/dq", dq);
  write_tensor(dir + "/dk", dk);
  write_tensor(dir + "/dv", dv);
}

// The launchers' variant rule (csrc/cuda/api/dispatch.cuh, variant_of).
template <int D>
void run_variant(const std::map<std::string, double>& c, const std::string& dir) {
  const bool general = c.at("mask") != 0 || !(c.at("scale") > 0.0) || c.at("softcap") > 0.0;
  const bool dropout = c.at("dropout_p") > 0.0;
  if (general) {
    dropout ? run<D, Variant::kMaskedDropout>(c, dir) : run<D, Variant::kMasked>(c, dir);
  } else {
    dropout ? run<D, Variant::kDropout>(c, dir) : run<D, Variant::kPlain>(c, dir);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const std::map<std::string, double> c = read_case(dir);
  switch (kern::head_dim_bucket(static_cast<int>(c.at("head_dim")))) {
    case 32: run_variant<32>(c, dir); break;
    case 64: run_variant<64>(c, dir); break;
    case 128: run_variant<128>(c, dir); break;
    default: run_variant<256>(c, dir); break;
  }
  return 0;
}
