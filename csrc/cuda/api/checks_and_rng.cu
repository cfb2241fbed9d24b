// Problem checks for the fused path, Philox state from PyTorch's CUDA generator, and the dropout
// keep-mask kernel launch.
#include "cuda/api/launch.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>

#include "common/philox.h"
#include "cuda/api/dispatch.cuh"
#include "cuda/kernels/dropout_mask.cuh"

namespace flashv100 {
namespace cuda {
namespace {

constexpr int64_t kMaxGridY = 65535;

bool rows_aligned(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}

__global__ void write_rng_state_kernel(at::PhiloxCudaState state, int64_t* out) {
  const auto seeds = at::cuda::philox::unpack(state);
  out[0] = static_cast<int64_t>(std::get<0>(seeds));
  out[1] = static_cast<int64_t>(std::get<1>(seeds));
}

}  // namespace

const char* fused_unsupported_reason(MmaAtom atom, const FusedProblem& problem,
                                     std::initializer_list<const at::Tensor*> tensors) {
  const at::ScalarType dtype = problem.dtype;
  if (dtype != at::kHalf && dtype != at::kBFloat16) return "dtype is not fp16/bf16";
  if (dtype == at::kBFloat16 && atom == MmaAtom::kVoltaM8N8K4)
    return "bf16 has no Volta tensor-core atom";
  const int64_t d = problem.head_dim;
  if (d % 8 != 0 || d < 8 || d > kern::kMaxHeadDim)
    return "head dim is not a multiple of 8 in [8, 256]";
  if (problem.head_dim_v != d) return "value head dim differs from query head dim";
  if (problem.empty) return "empty tensor";
  if (problem.len_q > INT32_MAX / 2 || problem.len_kv > INT32_MAX / 2) return "sequence too long";
  if (problem.batch_heads_q > kMaxGridY || problem.batch_heads_kv > kMaxGridY)
    return "batch * heads exceeds the grid";
  for (const at::Tensor* t : tensors)
    if (!rows_aligned(*t)) return "a tensor's rows are not 16-byte aligned";
  return nullptr;
}

at::Tensor forward_rng_state(const at::Tensor& like, double dropout_p, DropoutParams& dropout,
                             bool by_forward_kernel) {
  at::Tensor rng_state = at::empty({2}, like.options().dtype(at::kLong));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (by_forward_kernel) dropout.rng_state_out = rng_state.data_ptr<int64_t>();
  if (dropout_p <= 0.0) {
    if (!by_forward_kernel) {
      C10_CUDA_CHECK(cudaMemsetAsync(rng_state.data_ptr(), 0, rng_state.nbytes(), stream));
    }
    return rng_state;
  }
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(like.device().index()));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    // The whole call uses one Philox counter position (offset); see common/philox.h.
    state = gen->philox_cuda_state(4);
  }
  if (state.captured_) {
    dropout.seed_ptr = reinterpret_cast<const int64_t*>(state.seed_.ptr);
    dropout.offset_ptr = reinterpret_cast<const int64_t*>(state.offset_.ptr);
    dropout.offset_intragraph = state.offset_intragraph_;
  } else {
    dropout.seed = state.seed_.val;
    dropout.offset = state.offset_.val;
  }
  if (!by_forward_kernel) {
    write_rng_state_kernel<<<1, 1, 0, stream>>>(state, rng_state.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return rng_state;
}

at::Tensor dropout_keep_mask(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                             int64_t len_q, int64_t len_kv, double dropout_p) {
  at::Tensor keep =
      at::empty({batch, heads, len_q, len_kv}, rng_state.options().dtype(at::kBool));
  const int64_t rows = batch * heads * len_q;
  if (keep.numel() == 0) return keep;
  const int64_t calls = rows * ceil_div(len_kv, 32) * 4;  // one thread per Philox call
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(calls, 256), 65536));
  kern::dropout_mask_kernel<<<blocks, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      rng_state.data_ptr<int64_t>(), reinterpret_cast<uint8_t*>(keep.data_ptr<bool>()), rows,
      len_q, len_kv, dropout_threshold(static_cast<float>(dropout_p)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return keep;
}

}  // namespace cuda
}  // namespace flashv100
