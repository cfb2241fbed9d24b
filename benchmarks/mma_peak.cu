// Measured peak of the tensor-core instructions the kernels are built on: mma.sync m16n8k16
// (fp16 in, fp32 accumulate; the native atom on sm_80+) and mma.sync m8n8k4 (the Volta atom).
// The attention TFLOP/s of the benchmarks are reported as a share of these ceilings.
//
//   nvcc -O3 -arch=sm_90 -o mma_peak benchmarks/mma_peak.cu && ./mma_peak
//   (-arch=sm_70 on a V100: only the m8n8k4 line runs there)
#include <cstdio>
#include <cuda_runtime.h>

constexpr int kChains = 8;  // independent accumulators per warp: enough to fill the pipe
constexpr int kIters = 4096;

template <int kMode>  // 0: m16n8k16, 1: m8n8k4
__global__ void __launch_bounds__(128) mma_loop(float* sink) {
  unsigned a[4] = {0x3c003c00u ^ threadIdx.x, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  unsigned b[2] = {0x3c003c00u, 0x3c003c00u ^ threadIdx.x};
  float c[kChains][8] = {};
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int k = 0; k < kChains; ++k) {
      if constexpr (kMode == 0) {
#if __CUDA_ARCH__ >= 800
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
      } else {
        asm volatile(
            "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
            : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3]), "+f"(c[k][4]),
              "+f"(c[k][5]), "+f"(c[k][6]), "+f"(c[k][7])
            : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(b[1]));
      }
    }
  }
  float total = 0.0f;
  for (int k = 0; k < kChains; ++k)
    for (int i = 0; i < 8; ++i) total += c[k][i];
  if (total == 1.2345f) sink[threadIdx.x] = total;  // keeps the loop alive
}

template <int kMode>
double measure(int sms, float* sink) {
  const int blocks = sms * 8;
  mma_loop<kMode><<<blocks, 128>>>(sink);  // warm-up (clocks, code load)
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start);
  mma_loop<kMode><<<blocks, 128>>>(sink);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, start, stop);
  // Per warp instruction: m16n8k16 = 16*8*16 MACs; m8n8k4 = four 8x8x4 products (quad pairs).
  const double flop_per_mma = kMode == 0 ? 2.0 * 16 * 8 * 16 : 2.0 * 4 * 8 * 8 * 4;
  const double flops = flop_per_mma * kChains * kIters * (blocks * 4.0);
  return flops / (ms * 1e-3) / 1e12;
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  float* sink;
  cudaMalloc(&sink, 128 * sizeof(float));
  std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  if (prop.major >= 8)
    std::printf("mma.sync m16n8k16 f16->f32: %.1f TFLOP/s\n",
                measure<0>(prop.multiProcessorCount, sink));
  std::printf("mma.sync m8n8k4 f16->f32: %.1f TFLOP/s\n", measure<1>(prop.multiProcessorCount, sink));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
