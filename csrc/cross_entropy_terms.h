// The per-row DRO terms of the fused cross-entropy, shared by the CPU and CUDA kernels (host + device).
//
// With l_i the cross-entropy of row i, t_i = (l_i - G eta) / lam and w_i = psi*'(t_i), the objective over
// the n kept rows is  L = (1/n) sum_i value_term(div, t_i, l_i)  and its gradient with respect to row i's
// logits is (w_i / n) (softmax_i - q_i), q_i the (label-smoothed) target distribution.
#pragma once

#include <c10/macros/Macros.h>

#include "divergences.h"

namespace dro_ext {

// The scalar constants every row needs.
template <typename acc_t>
struct DROTermParams {
  acc_t g_eta;    // G * eta
  acc_t inv_lam;  // 1 / lam
  acc_t lam;
};

// t_i = (l_i - G eta) / lam.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t dro_argument(acc_t loss, const DROTermParams<acc_t>& p) {
  return (loss - p.g_eta) * p.inv_lam;
}

// Row i's share of the value, lam * psi*(t_i) + G eta, whose mean over the kept rows is the objective
// (divergences.h's penalized_value: formed as l_i + lam * (psi*(t_i) - t_i), which keeps its precision however
// large lam is, and +inf for a row whose loss is +inf).
template <typename acc_t, typename Div>
C10_HOST_DEVICE inline acc_t value_term(const Div& div, acc_t t, acc_t loss, const DROTermParams<acc_t>& p) {
  return penalized_value(div, t, loss, p.lam, p.g_eta);
}

// A class's share of the row's gradient, (w_i / n) (softmax_j - q_j) = c r with r = softmax_j - q_j, and 0 where
// r is 0: a row whose weight overflowed to inf (kl at a loss far above eta) moves only the classes its residual
// moves (+-inf there), where inf * 0 would make its whole gradient NaN. T: a scalar or a CPU vector.
template <typename T>
C10_HOST_DEVICE inline T weighted_residual(T c, T r) {
  using M = Math<T>;
  return M::select_positive(-M::neg_abs(r), c * r, M::constant(0.0));  // a NaN r stays NaN
}

}  // namespace dro_ext
