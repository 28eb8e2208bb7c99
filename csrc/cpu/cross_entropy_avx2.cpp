// The AVX2+FMA build of the cross-entropy CPU kernels, chosen at run time where the processor has them.
#if defined(__x86_64__) || defined(_M_X64)
#define DRO_EXT_CAPABILITY_AVX2
#include "cpu/cross_entropy_impl.h"

namespace dro_ext::cpu {

const CrossEntropyKernelTable& cross_entropy_kernels_avx2() {
  static const CrossEntropyKernelTable table{cross_entropy_forward_impl, cross_entropy_backward_impl, "avx2"};
  return table;
}

}  // namespace dro_ext::cpu

#else
#include "cpu/cross_entropy_kernels.h"

namespace dro_ext::cpu {
const CrossEntropyKernelTable& cross_entropy_kernels_avx2() { return cross_entropy_kernels_default(); }
}  // namespace dro_ext::cpu
#endif
