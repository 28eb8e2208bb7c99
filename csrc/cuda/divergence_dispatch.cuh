// The divergence functor of a DivergenceSpec, for host code that launches kernels: divergences.h's
// visit_divergence is host+device, and nvcc warns (20014) for each host lambda it is instantiated with. The same
// mapping of the kind to its functor, except that cressie_read takes its general-k form for every k (the CPU
// kernels specialize k = 2 and k = 3/2). Shared by every .cu file.
#pragma once

#include "divergences.h"

namespace dro_ext::cuda {

template <typename acc_t, typename F>
void launch_for_divergence(const DivergenceSpec& spec, F&& f) {
  switch (spec.kind) {
    case Divergence::KL: return f(KL<acc_t>{});
    case Divergence::CVaR: return f(CVaR<acc_t>(spec.alpha));
    case Divergence::KLCVaR: return f(KLCVaR<acc_t>(spec.alpha));
    case Divergence::CressieRead: return f(CressieRead<acc_t>(spec.k));
    case Divergence::SmoothedCVaR: return f(SmoothedCVaR<acc_t>(spec.alpha));
    case Divergence::Chi2:
    default: return f(Chi2<acc_t>{});
  }
}

}  // namespace dro_ext::cuda
