// The divergence functor of a DivergenceSpec for host code that launches kernels: divergences.h's
// visit_divergence, the one mapping of a kind to its functor. cressie_read's k = 2 and k = 3/2 take their
// pure-arithmetic specializations here as on the CPU: with the general form's log1p and expm1, a float32
// multisection pass of the robust objective costs ~430 instructions per loss, against ~30 and ~45
// (tools/sass_loops.py, sm_90).
// Shared by the .cu files of the loss ops, the robust objective and the cross-entropy.
#pragma once

#include <utility>

#include "divergences.h"

namespace dro_ext::cuda {

template <typename acc_t, typename F>
void launch_for_divergence(const DivergenceSpec& spec, F&& f) {
  visit_divergence<acc_t>(spec, std::forward<F>(f));
}

}  // namespace dro_ext::cuda
