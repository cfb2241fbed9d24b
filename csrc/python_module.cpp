// The Python extension module: loading it registers the ops (static initialisers in ops.cpp and
// the device kernels); it also exposes build facts and the tensor-core atom and shared-memory
// overrides.
#include <pybind11/pybind11.h>

#include "kernel_path.h"

#ifndef FLASHV100_CUDA_VERSION
#define FLASHV100_CUDA_VERSION ""
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch-flash-v100 native extension";
  m.def("build_info", [] {
    py::dict info;
    info["torch_version"] = FLASHV100_TORCH_VERSION;
#ifdef FLASHV100_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    info["cuda_version"] = std::string(FLASHV100_CUDA_VERSION);
    info["cuda_archs"] = std::string(FLASHV100_CUDA_ARCHS);
    info["cxx_abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
    return info;
  });
  m.def("force_volta_atom", &flashv100::force_volta_atom,
        "Whether the Volta m8n8k4 atom is forced on GPUs that have newer ones");
  m.def("set_force_volta_atom", &flashv100::set_force_volta_atom, py::arg("force"));
  m.def("smem_limit_override", &flashv100::smem_limit_override,
        "The cap on shared memory per block the CUDA launchers plan with (0: the device's)");
  m.def("set_smem_limit_override", &flashv100::set_smem_limit_override, py::arg("bytes"));
  m.def(
      "mma_atom_name",
      [](int cc_major, int cc_minor) {
        return std::string(flashv100::mma_atom_name(flashv100::mma_atom_for(cc_major, cc_minor)));
      },
      py::arg("cc_major"), py::arg("cc_minor"));
}
