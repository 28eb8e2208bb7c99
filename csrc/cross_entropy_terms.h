// The per-row DRO terms of the fused cross-entropy, shared by the CPU and CUDA kernels (host + device).
//
// With l_i the cross-entropy of row i, t_i = (l_i - G eta) / lam and w_i = psi*'(t_i), the objective over
// the n kept rows is  L = (1/n) sum_i value_term(div, t_i, l_i)  and its gradient with respect to row i's
// logits is (w_i / n) (softmax_i - q_i), q_i the (label-smoothed) target distribution.
#pragma once

#include <c10/macros/Macros.h>

#include "divergences.h"

namespace dro_ext {

// A row's logsumexp as shift + log_sum: shift is the row's max (the column kernel's: 0 where that max is -inf)
// and log_sum = log sum_j exp(x_j - shift), at most log C. Kept in two parts because their sum, rounded at the
// logits' magnitude, would carry that rounding into every softmax_j and every loss: at logits near 64 in float32,
// 64 roundings of the residual 1 - p_y of a confident row, where the shifted form keeps it to one or two.
template <typename T>
struct ShiftedLogSumExp {
  T shift;
  T log_sum;
};

// softmax_j = exp((x_j - shift) - log_sum): x_j - shift is exact for the logits near the max, whose probabilities
// are the ones near 1. T: a scalar or a CPU vector.
template <typename T>
C10_HOST_DEVICE inline T shifted_softmax(T x, const ShiftedLogSumExp<T>& lse) {
  return Math<T>::exp((x - lse.shift) - lse.log_sum);
}

// F.cross_entropy's loss of a row, (1 - eps)(lse - x_y) + eps (lse - mean_j x_j), each difference formed from the
// shift, as log_softmax does.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t cross_entropy_loss(const ShiftedLogSumExp<acc_t>& lse, acc_t x_target, acc_t row_mean,
                                                acc_t smoothing) {
  if (smoothing == acc_t(0)) return (lse.shift - x_target) + lse.log_sum;
  return (acc_t(1) - smoothing) * (lse.shift - x_target) + smoothing * (lse.shift - row_mean) + lse.log_sum;
}

// The scalar constants every row needs, in the type its DRO terms are formed in (term_t, below).
template <typename term_t>
struct DROTermParams {
  term_t g_eta;    // G * eta
  term_t inv_lam;  // 1 / lam
  term_t lam;
};

// t_i = (l_i - G eta) / lam.
template <typename term_t>
C10_HOST_DEVICE inline term_t dro_argument(term_t loss, const DROTermParams<term_t>& p) {
  return (loss - p.g_eta) * p.inv_lam;
}

// Row i's share of the value, lam * psi*(t_i) + G eta, whose mean over the kept rows is the objective
// (divergences.h's penalized_value: formed as l_i + lam * (psi*(t_i) - t_i), which keeps its precision however
// large lam is, and +inf for a row whose loss is +inf).
template <typename term_t, typename Div>
C10_HOST_DEVICE inline term_t value_term(const Div& div, term_t t, term_t loss, const DROTermParams<term_t>& p) {
  return penalized_value(div, t, loss, p.lam, p.g_eta);
}

// A row's weight w_i = psi*'(t_i) and value term.
template <typename term_t>
struct RowTerms {
  term_t weight;
  term_t value;
};

// The row's DRO terms from its loss (formed in the logits' accumulate dtype), in term_t, the type of Div and p:
// the accumulate dtype, or float64 where float32 cannot form them (the CPU always, a scalar per row beside the row's
// C logits; CUDA where 1/lam is no normal float32, checks.h's runs_on_float64_copy). In float32, t = (l - G eta)/lam
// is +-inf for every row at lam below about 2.9e-39 (cvar's value then came out inf for losses near 5), lam itself
// is inf above 3.4e38 (the value NaN), and psi*(t) can overflow where lam psi*(t) does not (cressie_read at
// lam = 1e-36: inf for 1e18).
template <typename term_t, typename Div, typename acc_t>
C10_HOST_DEVICE inline RowTerms<term_t> row_terms(const Div& div, acc_t loss, const DROTermParams<term_t>& p) {
  const term_t l = static_cast<term_t>(loss);
  const term_t t = dro_argument(l, p);
  return {div.first(t), value_term(div, t, l, p)};
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
