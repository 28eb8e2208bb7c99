// Argument checks of the cross-entropy ops, shared by the CPU and CUDA entry points: each failure names the
// argument. (Targets out of range are found by the kernels' callers: on the host for the CPU, by a device
// assertion on CUDA, as PyTorch's own nll_loss does.)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

#include "checks.h"

namespace dro_ext {

inline void check_label_smoothing(double label_smoothing) {
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0,
                    "dro_ext: label_smoothing must be in [0, 1], got label_smoothing=", label_smoothing);
}

inline void check_cross_entropy_logits_targets(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "dro_ext: logits must be a 2-D tensor (N, C), got shape ", logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) > 0, "dro_ext: logits must have at least one class, got shape ", logits.sizes());
  TORCH_CHECK_TYPE(is_kernel_floating_type(logits.scalar_type()),
                   "dro_ext: logits must have a floating dtype (float16, bfloat16, float32, float64), got ",
                   logits.scalar_type());
  TORCH_CHECK_TYPE(targets.scalar_type() == at::kLong, "dro_ext: targets must be int64 class indices, got ",
                   targets.scalar_type());
  TORCH_CHECK_VALUE(targets.dim() == 1 && targets.size(0) == logits.size(0),
                    "dro_ext: targets must have shape (N,) = (", logits.size(0), ",) to match logits of shape ",
                    logits.sizes(), ", got ", targets.sizes());
  TORCH_CHECK_VALUE(targets.device() == logits.device(), "dro_ext: targets is on ", targets.device(),
                    " but logits is on ", logits.device(), "; move them to the same device");
}

// Accumulate-dtype values per row of logits, on its device: one per row (shape (N,)) when columns is 0, else
// shape (N, columns).
inline void check_row_values(const char* arg, const at::Tensor& value, const at::Tensor& logits, int64_t columns = 0) {
  const bool shaped = columns == 0 ? value.dim() == 1 && value.size(0) == logits.size(0)
                                   : value.dim() == 2 && value.size(0) == logits.size(0) && value.size(1) == columns;
  TORCH_CHECK_VALUE(shaped, "dro_ext: ", arg, " must have shape (", logits.size(0),
                    columns == 0 ? std::string(",)") : ", " + std::to_string(columns) + ")", ", got ",
                    value.sizes());
  TORCH_CHECK_TYPE(value.scalar_type() == accumulate_type(logits.scalar_type()), "dro_ext: ", arg, " must be ",
                   accumulate_type(logits.scalar_type()), " for ", logits.scalar_type(), " logits, got ",
                   value.scalar_type());
  TORCH_CHECK_VALUE(value.device() == logits.device(), "dro_ext: ", arg, " is on ", value.device(),
                    " but logits is on ", logits.device(), "; move them to the same device");
}

// The ops that overwrite the logits with their gradient write them where they are: no contiguous copy to write to.
inline void check_overwritable_logits(const char* op, const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.is_contiguous(), "dro_ext: ", op, " overwrites logits in place, so they must be contiguous");
}

inline void check_cross_entropy_inputs(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& eta,
                                       double scale, double label_smoothing) {
  check_cross_entropy_logits_targets(logits, targets);
  check_scalar_tensor("eta", eta, logits, "logits");
  check_positive("scale", scale);
  check_label_smoothing(label_smoothing);
}

// The checks of each cross-entropy op, called by its CPU and CUDA kernels alike; the forward ones return the
// parsed divergence.

inline DivergenceSpec check_cross_entropy_forward_args(const at::Tensor& logits, const at::Tensor& targets,
                                                       const at::Tensor& eta, double lam, c10::string_view divergence,
                                                       std::optional<double> alpha, std::optional<double> k,
                                                       double scale, double label_smoothing) {
  check_cross_entropy_inputs(logits, targets, eta, scale, label_smoothing);
  return check_divergence_args(lam, divergence, alpha, k);
}

inline DivergenceSpec check_cross_entropy_chunk_args(const at::Tensor& logits, const at::Tensor& targets,
                                                     const at::Tensor& eta, const at::Tensor& inv_count, double lam,
                                                     c10::string_view divergence, std::optional<double> alpha,
                                                     std::optional<double> k, double scale, double label_smoothing) {
  check_cross_entropy_inputs(logits, targets, eta, scale, label_smoothing);
  check_scalar_tensor("inv_count", inv_count, logits, "logits");
  check_overwritable_logits("dro_cross_entropy_chunk_", logits);
  return check_divergence_args(lam, divergence, alpha, k);
}

inline void check_cross_entropy_backward_args(const at::Tensor& grad, const at::Tensor& logits,
                                              const at::Tensor& targets, const at::Tensor& lse,
                                              const at::Tensor& row_weight, double label_smoothing) {
  check_cross_entropy_logits_targets(logits, targets);
  check_scalar_tensor("grad", grad, logits, "logits");
  check_row_values("lse", lse, logits, 2);  // (shift, log_sum) pairs: cross_entropy_terms.h
  check_row_values("row_weight", row_weight, logits);
  check_label_smoothing(label_smoothing);
}

inline void check_logsumexp_columns_args(const at::Tensor& matrix) {
  TORCH_CHECK_VALUE(matrix.dim() == 2, "dro_ext: matrix must be a 2-D tensor (R, C), got shape ", matrix.sizes());
  TORCH_CHECK_TYPE(is_kernel_floating_type(matrix.scalar_type()),
                   "dro_ext: matrix must have a floating dtype (float16, bfloat16, float32, float64), got ",
                   matrix.scalar_type());
}

// dro_cross_entropy_backward_: the backward's arguments, with logits that can be overwritten.
inline void check_cross_entropy_backward_inplace_args(const at::Tensor& grad, const at::Tensor& logits,
                                                      const at::Tensor& targets, const at::Tensor& lse,
                                                      const at::Tensor& row_weight, double label_smoothing) {
  check_cross_entropy_backward_args(grad, logits, targets, lse, row_weight, label_smoothing);
  check_overwritable_logits("dro_cross_entropy_backward_", logits);
}

}  // namespace dro_ext
