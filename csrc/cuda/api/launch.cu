// Kernel launches: atom x dtype x head-dim bucket dispatch, grids, dynamic shared memory, streams.
#include "cuda/api/launch.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAException.h>

#include <mutex>
#include <type_traits>

#include "common/philox.h"
#include "cuda/kernels/dropout_mask.cuh"
#include "cuda/kernels/flash_bwd.cuh"
#include "cuda/kernels/flash_fwd.cuh"

namespace flashv100 {
namespace cuda {
namespace {

constexpr int64_t kMaxGridY = 65535;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool rows_aligned(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}

// Calls f(Atom{}, Elem{}, std::integral_constant<int, bucket>{}) for the compiled configuration.
template <class F>
void dispatch(MmaAtom atom, at::ScalarType dtype, int64_t head_dim, F&& f) {
  auto by_head_dim = [&](auto atom_tag, auto elem_tag) {
    switch (kern::head_dim_bucket(static_cast<int>(head_dim))) {
#define FLASHV100_CASE(D) \
  case D: f(atom_tag, elem_tag, std::integral_constant<int, D>{}); break;
      FLASHV100_FOR_EACH_HEAD_DIM(FLASHV100_CASE)
#undef FLASHV100_CASE
      default: TORCH_CHECK(false, "flashv100: no kernel for head dim ", head_dim);
    }
  };
  if (atom == MmaAtom::kVoltaM8N8K4) {
    by_head_dim(kern::VoltaAtom{}, kern::Fp16{});
  } else if (dtype == at::kHalf) {
    by_head_dim(kern::AmpereAtom{}, kern::Fp16{});
  } else {
    by_head_dim(kern::AmpereAtom{}, kern::Bf16{});
  }
}

// Opts a kernel into > 48 KB of dynamic shared memory (once per kernel and device is enough, but
// the call is cheap; do it per launch to stay correct across devices).
template <class Kernel>
void set_smem(Kernel kernel, int bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

__global__ void write_rng_state_kernel(at::PhiloxCudaState state, int64_t* out) {
  const auto seeds = at::cuda::philox::unpack(state);
  out[0] = static_cast<int64_t>(std::get<0>(seeds));
  out[1] = static_cast<int64_t>(std::get<1>(seeds));
}

}  // namespace

const char* fused_unsupported_reason(MmaAtom atom, const at::Tensor& query, const at::Tensor& key,
                                     const at::Tensor& value,
                                     const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                     std::initializer_list<const at::Tensor*> tensors) {
  const at::ScalarType dtype = query.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) return "dtype is not fp16/bf16";
  if (dtype == at::kBFloat16 && atom == MmaAtom::kVoltaM8N8K4)
    return "bf16 has no Volta tensor-core atom";
  const int64_t d = query.size(3);
  if (d % 8 != 0 || d < 8 || d > 256) return "head dim is not a multiple of 8 in [8, 256]";
  if (value.size(3) != d) return "value head dim differs from query head dim";
  if (attn_mask.has_value()) return "attn_mask is not fused yet (issue #6)";
  if (dropout_p > 0.0) return "dropout is not fused yet (issue #6)";
  if (query.numel() == 0 || key.numel() == 0) return "empty tensor";
  if (query.size(2) > INT32_MAX / 2 || key.size(2) > INT32_MAX / 2) return "sequence too long";
  if (query.size(0) * query.size(1) > kMaxGridY || key.size(0) * key.size(1) > kMaxGridY)
    return "batch * heads exceeds the grid";
  for (const at::Tensor* t : tensors)
    if (!rows_aligned(*t)) return "a tensor's rows are not 16-byte aligned";
  return nullptr;
}

void run_fused_forward(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch(atom, dtype, p.shape.head_dim, [&](auto atom_tag, auto elem_tag, auto dim) {
    using Cfg = kern::FwdConfig<decltype(dim)::value>;
    const auto kernel =
        kern::flash_fwd_kernel<decltype(atom_tag), decltype(elem_tag), decltype(dim)::value>;
    set_smem(kernel, Cfg::kSmemBytes);
    const dim3 grid(ceil_div(p.shape.len_q, Cfg::kBlockM), p.shape.batch * p.shape.heads_q);
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void run_fused_backward(MmaAtom atom, at::ScalarType dtype, const BackwardParams& p) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const AttentionShape& s = p.fwd.shape;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA,
                                                                 c10::cuda::current_device());
  at::Tensor dsum = at::empty({s.batch * s.heads_q * s.len_q}, f32);
  at::Tensor dq_accum;
  if (!p.deterministic) dq_accum = at::zeros({s.batch * s.heads_q * s.len_q * s.head_dim}, f32);
  dispatch(atom, dtype, s.head_dim, [&](auto atom_tag, auto elem_tag, auto dim) {
    using Atom = decltype(atom_tag);
    using Elem = decltype(elem_tag);
    constexpr int D = decltype(dim)::value;
    using Cfg = kern::BwdConfig<D>;
    kern::flash_bwd_dsum_kernel<Elem><<<ceil_div(s.batch * s.heads_q * s.len_q, 4), 128, 0,
                                        stream>>>(p, dsum.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    const auto dkdv = kern::flash_bwd_dkdv_kernel<Atom, Elem, D>;
    set_smem(dkdv, Cfg::kSmemBytes);
    const dim3 kv_grid(ceil_div(s.len_kv, Cfg::kBlockN), s.batch * s.heads_kv);
    dkdv<<<kv_grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
        p, dsum.data_ptr<float>(), p.deterministic ? nullptr : dq_accum.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    if (p.deterministic) {
      const auto dq = kern::flash_bwd_dq_kernel<Atom, Elem, D>;
      set_smem(dq, Cfg::kSmemBytes);
      const dim3 q_grid(ceil_div(s.len_q, Cfg::kBlockM), s.batch * s.heads_q);
      dq<<<q_grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, dsum.data_ptr<float>());
    } else {
      const int64_t pairs = s.batch * s.heads_q * s.len_q * s.head_dim / 2;
      const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(pairs, 256), 65536));
      kern::flash_bwd_dq_convert_kernel<Elem>
          <<<blocks, 256, 0, stream>>>(p, dq_accum.data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor next_rng_state(const at::Tensor& like) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(like.device().index()));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    // The whole call uses one Philox counter position (offset); see common/philox.h.
    state = gen->philox_cuda_state(4);
  }
  at::Tensor rng_state = at::empty({2}, like.options().dtype(at::kLong));
  write_rng_state_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      state, rng_state.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return rng_state;
}

at::Tensor dropout_keep_mask(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                             int64_t len_q, int64_t len_kv, double dropout_p) {
  at::Tensor keep =
      at::empty({batch, heads, len_q, len_kv}, rng_state.options().dtype(at::kBool));
  const int64_t rows = batch * heads * len_q;
  if (keep.numel() == 0) return keep;
  const int64_t groups = rows * ((len_kv + 3) / 4);
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(groups, 256), 65536));
  kern::dropout_mask_kernel<<<blocks, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      rng_state.data_ptr<int64_t>(), reinterpret_cast<uint8_t*>(keep.data_ptr<bool>()), rows,
      len_q, len_kv, dropout_threshold(static_cast<float>(dropout_p)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return keep;
}

}  // namespace cuda
}  // namespace flashv100
