// The AVX2+FMA build of the CPU kernels, chosen at run time by cpu_kernels() where the processor has them.
#if defined(__x86_64__) || defined(_M_X64)
#define DRO_EXT_CAPABILITY_AVX2
#include "cpu/kernels_impl.h"

namespace dro_ext::cpu {

const KernelTable& kernels_avx2() {
  static const KernelTable table{reduce_impl, map_derivative_impl, "avx2"};
  return table;
}

}  // namespace dro_ext::cpu

#else
#include "cpu/kernels.h"

namespace dro_ext::cpu {
const KernelTable& kernels_avx2() { return kernels_default(); }
}  // namespace dro_ext::cpu
#endif
