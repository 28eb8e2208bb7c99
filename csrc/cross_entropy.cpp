// The fused DRO cross-entropy: schemas of its ops and their CPU entry points.
//
//   dro_cross_entropy(logits (N, C), targets (N,), eta, ...) -> (value, mean_weight, lse, row_weight)
//       l_i = F.cross_entropy(logits, targets, reduction="none", ignore_index, label_smoothing)[i],
//       t_i = (l_i - G eta) / lam, w_i = psi*'(t_i), over the n rows whose target is not ignore_index:
//       value = (1/n) sum_i lam psi*(t_i) + G eta      (0 when n == 0)
//       mean_weight = (1/n) sum_i w_i                   (1 when n == 0, so that dL/deta = G (1 - 1) = 0)
//       both in the accumulate dtype (float32 for half logits, as F.cross_entropy's value under autocast: a float16
//       value would make GradScaler's scaled gradient of 2^16 overflow on its way into the backward)
//       lse (N, 2): row i's logsumexp_j logits_ij as (shift, log_sum), shift its max and log_sum the log of
//       sum_j exp(logits_ij - shift) (cross_entropy_terms.h: two parts, which keep what their rounded sum would
//       lose); row_weight_i = w_i / n (both 0 on ignored rows; accumulate dtype)
//   dro_cross_entropy_backward(grad, logits, targets, lse, row_weight) -> grad_logits
//       grad_logits_i = grad * row_weight_i * (softmax_i - q_i), q_i = (1 - eps) onehot(y_i) + eps / C:
//       one pass, from the logits and the 3N floats the forward saved; nothing N x C is kept.
//   dro_cross_entropy_backward_(grad, logits!, targets, lse, row_weight) -> ()
//       The same gradient written over the logits (contiguous): the second pass of the grouped linear
//       cross-entropy (dro_ext/cross_entropy_groups.py) recomputes a chunk's logits and turns them into their
//       gradient where they lie, without a second chunk of memory or a copy.
//   dro_cross_entropy_chunk_(logits, targets, eta, inv_count, ...) -> sums (2,), float64
//       The building block of dro_linear_cross_entropy (dro_ext/cross_entropy.py): for a chunk of rows,
//       {sum_i value_term_i, sum_i w_i} over its kept rows, and (compute_grad) the logits overwritten in
//       place by inv_count * w_i * (softmax_i - q_i), the chunk's share of the gradient. The weights need only
//       the row's own loss and eta, so the gradient is final as soon as the row's loss is known.
//   logsumexp_columns(matrix (R, C)) -> lse (C, 2)
//       logsumexp_r matrix_rc as (shift, log_sum) pairs in the accumulate dtype, shift 0 where the column's max is
//       -inf, NaN where it is +inf (as F.cross_entropy gives that row): the per-row logsumexp of logits formed
//       transposed, which the first pass of the grouped linear cross-entropy does on the CPU
//       (dro_ext/cross_entropy_groups.py).
//       On CUDA, where that pass keeps the row layout, it is composed of ATen ops.
//
// Autograd is registered in Python (dro_ext/cross_entropy.py): each call moves N x C logits, so the
// microseconds of a Python backward are lost in the noise, unlike for the O(N) dro_loss.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <limits>

#include "checks.h"
#include "cpu/cross_entropy_kernels.h"
#include "cpu/output_buffer.h"
#include "cpu/scalar_tensors.h"
#include "cross_entropy_checks.h"

namespace dro_ext {

namespace {

// The rows whose target is not ignore_index; fails naming the first target out of range.
int64_t count_kept_rows_cpu(const at::Tensor& targets, int64_t num_classes, int64_t ignore_index) {
  const int64_t* y = targets.const_data_ptr<int64_t>();
  int64_t kept = 0;
  for (int64_t i = 0; i < targets.numel(); ++i) {
    if (y[i] == ignore_index) continue;
    TORCH_CHECK_INDEX(y[i] >= 0 && y[i] < num_classes, "dro_ext: targets must be class indices in [0, ", num_classes,
                      ") or ignore_index=", ignore_index, ", got targets[", i, "]=", y[i]);
    ++kept;
  }
  return kept;
}

cpu::CrossEntropyConfig make_config(const DivergenceSpec& spec, const at::Tensor& eta, double lam, double scale,
                                    int64_t ignore_index, double label_smoothing) {
  return {spec, scale * cpu::read_scalar(eta), lam, ignore_index, label_smoothing};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dro_cross_entropy_cpu(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& eta, double lam,
    c10::string_view divergence, std::optional<double> alpha, std::optional<double> k, double scale,
    int64_t ignore_index, double label_smoothing) {
  const DivergenceSpec spec =
      check_cross_entropy_forward_args(logits, targets, eta, lam, divergence, alpha, k, scale, label_smoothing);
  const at::Tensor x = logits.contiguous(), y = targets.contiguous();
  const int64_t kept = count_kept_rows_cpu(y, x.size(1), ignore_index);
  const auto acc_options = logits.options().dtype(accumulate_type(logits.scalar_type()));
  at::Tensor lse = at::empty({x.size(0), 2}, acc_options), row_weight = at::empty({x.size(0)}, acc_options);
  const double inv_count = kept > 0 ? 1.0 / static_cast<double>(kept) : 0.0;
  const auto sums = cpu::cross_entropy_kernels(x.numel()).forward(
      x, y, make_config(spec, eta, lam, scale, ignore_index, label_smoothing), &lse, &row_weight, nullptr, inv_count);
  const double value = kept > 0 ? sums[0] * inv_count : 0.0;
  const double mean_weight = kept > 0 ? sums[1] * inv_count : 1.0;
  return {cpu::make_scalar(value, acc_options), cpu::make_scalar(mean_weight, acc_options), lse, row_weight};
}

at::Tensor dro_cross_entropy_backward_cpu(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                                          const at::Tensor& lse, const at::Tensor& row_weight, int64_t ignore_index,
                                          double label_smoothing) {
  check_cross_entropy_backward_args(grad, logits, targets, lse, row_weight, label_smoothing);
  const at::Tensor x = logits.contiguous(), y = targets.contiguous();
  count_kept_rows_cpu(y, x.size(1), ignore_index);  // the targets index the logits: check them again
  // From the repository's buffer cache: a training loop asks for the same N x C gradient every step, and
  // first-touching fresh pages costs about as much as the pass itself (csrc/cpu/output_buffer.h).
  at::Tensor grad_logits = cpu::empty_output_like(x);
  cpu::cross_entropy_kernels(x.numel()).backward(x, y, lse.contiguous(), row_weight.contiguous(), grad_logits,
                                                 ignore_index, label_smoothing, cpu::read_scalar(grad));
  return grad_logits;
}

void dro_cross_entropy_backward_inplace_cpu(const at::Tensor& grad, at::Tensor& logits, const at::Tensor& targets,
                                            const at::Tensor& lse, const at::Tensor& row_weight, int64_t ignore_index,
                                            double label_smoothing) {
  check_cross_entropy_backward_inplace_args(grad, logits, targets, lse, row_weight, label_smoothing);
  const at::Tensor y = targets.contiguous();
  count_kept_rows_cpu(y, logits.size(1), ignore_index);
  // Each row's target logit is read before the row is overwritten (write_row_gradient): in place is exact.
  cpu::cross_entropy_kernels(logits.numel()).backward(logits, y, lse.contiguous(), row_weight.contiguous(), logits,
                                                      ignore_index, label_smoothing, cpu::read_scalar(grad));
}

at::Tensor logsumexp_columns_cpu(const at::Tensor& matrix) {
  check_logsumexp_columns_args(matrix);
  const at::Tensor x = matrix.contiguous();
  at::Tensor lse = at::empty({x.size(1), 2}, x.options().dtype(accumulate_type(x.scalar_type())));
  cpu::cross_entropy_kernels(x.numel()).logsumexp_columns(x, lse);
  return lse;
}

#ifdef DRO_EXT_WITH_CUDA
at::Tensor logsumexp_columns_composite(const at::Tensor& matrix) {
  check_logsumexp_columns_args(matrix);
  const at::Tensor x = matrix.to(accumulate_type(matrix.scalar_type()));
  const at::Tensor max = x.amax({0});
  // 0 where the max is -inf (no -inf - -inf); a +inf max gives NaN, as F.cross_entropy does. Keeps NaN.
  const at::Tensor shift = at::where(max.eq(-std::numeric_limits<double>::infinity()), at::zeros_like(max), max);
  const at::Tensor log_sum = x.sub(shift).exp().sum(0).log();
  return at::stack({shift, log_sum}, 1);
}
#endif

at::Tensor dro_cross_entropy_chunk_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& eta,
                                       const at::Tensor& inv_count, double lam, c10::string_view divergence,
                                       std::optional<double> alpha, std::optional<double> k, double scale,
                                       int64_t ignore_index, double label_smoothing, bool compute_grad) {
  const DivergenceSpec spec = check_cross_entropy_chunk_args(logits, targets, eta, inv_count, lam, divergence, alpha,
                                                             k, scale, label_smoothing);
  const at::Tensor y = targets.contiguous();
  count_kept_rows_cpu(y, logits.size(1), ignore_index);
  at::Tensor grad = logits;  // the gradient overwrites the logits
  const auto sums = cpu::cross_entropy_kernels(logits.numel()).forward(
      logits, y, make_config(spec, eta, lam, scale, ignore_index, label_smoothing), nullptr, nullptr,
      compute_grad ? &grad : nullptr, cpu::read_scalar(inv_count));
  // In float64 whatever the logits: the caller adds the chunks up and divides by the kept count last, and a chunk's
  // float32 sums overflowed where the mean over every chunk does not (one row at t = 92 among 1000, kl).
  return cpu::make_vector(sums, logits.options().dtype(at::kDouble));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dro_ext, m) {
  m.def(
      "dro_cross_entropy(Tensor logits, Tensor targets, Tensor eta, float lam, str divergence, float? alpha=None, "
      "float? k=None, float scale=1.0, int ignore_index=-100, float label_smoothing=0.0) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "dro_cross_entropy_backward(Tensor grad, Tensor logits, Tensor targets, Tensor lse, Tensor row_weight, "
      "int ignore_index=-100, float label_smoothing=0.0) -> Tensor");
  m.def(
      "dro_cross_entropy_backward_(Tensor grad, Tensor(a!) logits, Tensor targets, Tensor lse, Tensor row_weight, "
      "int ignore_index=-100, float label_smoothing=0.0) -> ()");
  m.def(
      "dro_cross_entropy_chunk_(Tensor(a!) logits, Tensor targets, Tensor eta, Tensor inv_count, float lam, "
      "str divergence, float? alpha=None, float? k=None, float scale=1.0, int ignore_index=-100, "
      "float label_smoothing=0.0, bool compute_grad=True) -> Tensor");
  m.def("logsumexp_columns(Tensor matrix) -> Tensor");
}

TORCH_LIBRARY_IMPL(dro_ext, CPU, m) {
  m.impl("dro_cross_entropy", &dro_cross_entropy_cpu);
  m.impl("dro_cross_entropy_backward", &dro_cross_entropy_backward_cpu);
  m.impl("dro_cross_entropy_backward_", &dro_cross_entropy_backward_inplace_cpu);
  m.impl("dro_cross_entropy_chunk_", &dro_cross_entropy_chunk_cpu);
  m.impl("logsumexp_columns", &logsumexp_columns_cpu);
}

#ifdef DRO_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(dro_ext, CUDA, m) {
  m.impl("logsumexp_columns", &logsumexp_columns_composite);
}
#endif

}  // namespace dro_ext
