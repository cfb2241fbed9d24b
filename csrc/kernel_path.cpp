#include "kernel_path.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace flashv100 {
namespace {

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return false;
  return std::strcmp(value, "1") == 0 || std::strcmp(value, "true") == 0 ||
         std::strcmp(value, "TRUE") == 0 || std::strcmp(value, "yes") == 0;
}

std::atomic<bool>& force_volta_flag() {
  static std::atomic<bool> flag{env_flag("FLASHV100_FORCE_VOLTA")};
  return flag;
}

std::atomic<int>& smem_limit() {
  static std::atomic<int> limit{[] {
    const char* value = std::getenv("FLASHV100_SMEM_LIMIT");
    return value != nullptr ? std::max(0, std::atoi(value)) : 0;
  }()};
  return limit;
}

}  // namespace

int smem_limit_override() { return smem_limit().load(); }

void set_smem_limit_override(int bytes) { smem_limit().store(std::max(0, bytes)); }

bool force_volta_atom() { return force_volta_flag().load(); }

void set_force_volta_atom(bool force) { force_volta_flag().store(force); }

MmaAtom mma_atom_for(int cc_major, int /*cc_minor*/) {
  if (force_volta_atom() || cc_major < 8) return MmaAtom::kVoltaM8N8K4;
  return MmaAtom::kAmpereM16N8K16;
}

const char* mma_atom_name(MmaAtom atom) {
  return atom == MmaAtom::kVoltaM8N8K4 ? "volta-mma.m8n8k4" : "ampere-mma.m16n8k16";
}

}  // namespace flashv100
