// The static sm_70 gate's translation unit (scripts/nvrtc_gate.py): includes every device-only
// kernel header and instantiates every kernel configuration the launchers can launch, so NVRTC
// reports registers, spills and shared memory for each. Dynamic shared memory is invisible to
// ptxas: configurations assert their own budget with static_assert.
#include "cuda/kernels/dropout_mask.cuh"
