// Which tensor-core atom the CUDA kernels use. Host-only, no ATen.
#pragma once

namespace flashv100 {

enum class MmaAtom : int { kVoltaM8N8K4 = 0, kAmpereM16N8K16 = 1 };

// Forces the Volta atom on GPUs that have newer ones (how the sm_70 path is tested on newer GPUs).
// Initialised from the environment variable FLASHV100_FORCE_VOLTA (1/true/yes), then settable.
bool force_volta_atom();
void set_force_volta_atom(bool force);

// A cap on the dynamic shared memory per block the launchers plan with (0: none, the device's
// own opt-in): how the configurations chosen for GPUs with less of it (sm_86/89: 99 KB) are
// tested on larger ones. Initialised from FLASHV100_SMEM_LIMIT (bytes), then settable.
int smem_limit_override();
void set_smem_limit_override(int bytes);

// The atom used on a device of compute capability major.minor, honouring the override.
MmaAtom mma_atom_for(int cc_major, int cc_minor);
const char* mma_atom_name(MmaAtom atom);

}  // namespace flashv100
