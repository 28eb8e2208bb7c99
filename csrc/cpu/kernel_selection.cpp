#include <cstdlib>
#include <cstring>

#include "cpu/kernels.h"

namespace dro_ext::cpu {

bool use_avx2_kernels() {
  static const bool avx2 = [] {
    const char* forced = std::getenv("ATEN_CPU_CAPABILITY");
    if (forced != nullptr && std::strcmp(forced, "default") == 0) return false;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
  }();
  return avx2;
}

const KernelTable& cpu_kernels() {
  static const KernelTable& table = use_avx2_kernels() ? kernels_avx2() : kernels_default();
  return table;
}

}  // namespace dro_ext::cpu
