// The portable build of the CPU kernels (ATen's generic vectors; what the compiler vectorizes itself).
#include "cpu/kernels_impl.h"

namespace dro_ext::cpu {

const KernelTable& kernels_default() {
  static const KernelTable table{reduce_impl, map_derivative_impl, "default"};
  return table;
}

}  // namespace dro_ext::cpu
