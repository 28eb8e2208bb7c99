// The portable build of the cross-entropy CPU kernels, and the run-time choice between the builds.
#include "cpu/cross_entropy_impl.h"
#include "cpu/kernels.h"

namespace dro_ext::cpu {

const CrossEntropyKernelTable& cross_entropy_kernels_default() {
  static const CrossEntropyKernelTable table{cross_entropy_forward_impl, cross_entropy_backward_impl, "default"};
  return table;
}

// The same choice as cpu_kernels(): AVX2+FMA where the processor has them and ATEN_CPU_CAPABILITY allows.
const CrossEntropyKernelTable& cross_entropy_kernels() {
  static const CrossEntropyKernelTable& table =
      use_avx2_kernels() ? cross_entropy_kernels_avx2() : cross_entropy_kernels_default();
  return table;
}

}  // namespace dro_ext::cpu
