// The CPU kernels of the fused DRO cross-entropy, independent of the SIMD capability they were compiled for.
// cross_entropy_impl.h is compiled once per capability with the loss kernels (csrc/cpu/kernel_tables.h);
// cross_entropy_kernels(n) runs the build cpu_kernels(n, kAvx512MinValuesOnePass) runs (csrc/cpu/kernel_selection.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>

#include "divergences.h"

namespace dro_ext::cpu {

struct CrossEntropyConfig {
  DivergenceSpec spec;
  double g_eta;  // G * eta
  double lam;
  int64_t ignore_index;
  double label_smoothing;
};

struct CrossEntropyKernelTable {
  // One pass over the rows of the contiguous (N, C) logits, in parallel over fixed groups of rows. Per row:
  // the logsumexp (blockwise online), the cross-entropy l_i as F.cross_entropy computes it, then t_i,
  // w_i = psi*'(t_i) and the value term in float64. Writes, for each output that is defined (all of them in the
  // accumulate dtype, except grad, which is (N, C) in the logits' dtype and may be the logits themselves):
  //   lse (N, 2): row i's (shift, log_sum) (cross_entropy_terms.h's ShiftedLogSumExp; 0 for ignored rows);
  //   row_weight_i = inv_count * w_i (0 for ignored rows);
  //   grad_i = inv_count * w_i * (softmax_i - q_i) (0 for ignored rows), q_i the smoothed one-hot target.
  // Returns {sum over kept rows of value_term, sum over kept rows of w_i} (float64 sums), deterministic whatever the
  // thread count (fixed groups combined in order).
  std::array<double, 2> (*forward)(const at::Tensor& logits, const at::Tensor& targets, const CrossEntropyConfig& cfg,
                                   at::Tensor* lse, at::Tensor* row_weight, at::Tensor* grad, double inv_count);
  // grad_i = grad_value * row_weight_i * (softmax_i - q_i), softmax_i = shifted_softmax(logits_i, lse_i): one pass.
  void (*backward)(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                   const at::Tensor& row_weight, at::Tensor& grad, int64_t ignore_index, double label_smoothing,
                   double grad_value);
  // lse_c = logsumexp over r of matrix_rc, for a contiguous (R, C) matrix, as (C, 2) (shift, log_sum) pairs in the
  // accumulate dtype (the shift 0 for a column whose max is infinite).
  // Deterministic: each column is summed in row order by one thread.
  void (*logsumexp_columns)(const at::Tensor& matrix, at::Tensor& lse);
  const char* capability;
};

const CrossEntropyKernelTable& cross_entropy_kernels_default();
const CrossEntropyKernelTable& cross_entropy_kernels_avx2();  // the default where AVX2 is not compiled in
const CrossEntropyKernelTable& cross_entropy_kernels_avx512();  // likewise
const CrossEntropyKernelTable& cross_entropy_kernels(int64_t values);

}  // namespace dro_ext::cpu
