#include <cstdlib>
#include <cstring>

#include "cpu/kernels.h"

namespace dro_ext::cpu {

namespace {
bool processor_has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
}  // namespace

const KernelTable& cpu_kernels() {
  // ATEN_CPU_CAPABILITY=default forces the portable kernels, as it does for ATen's own.
  static const KernelTable& table = [] () -> const KernelTable& {
    const char* forced = std::getenv("ATEN_CPU_CAPABILITY");
    if (forced != nullptr && std::strcmp(forced, "default") == 0) return kernels_default();
    return processor_has_avx2() ? kernels_avx2() : kernels_default();
  }();
  return table;
}

}  // namespace dro_ext::cpu
