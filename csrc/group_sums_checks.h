// Argument checks of group_sums and its backward, called by the CPU and CUDA kernels alike (the same messages as
// dro_ext/groups.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "checks.h"
#include "floating_types.h"

namespace dro_ext {

inline void check_group_ids(const at::Tensor& groups) {
  TORCH_CHECK_TYPE(groups.scalar_type() == at::kLong || groups.scalar_type() == at::kInt,
                   "dro_ext: groups must be an int32 or int64 tensor of group ids, got ", groups.scalar_type());
}

inline void check_group_sums_args(const at::Tensor& losses, const at::Tensor& groups, int64_t num_groups) {
  TORCH_CHECK_VALUE(losses.dim() == 1, "dro_ext: losses must be a 1-D tensor of per-sample losses, got shape ",
                    losses.sizes());
  TORCH_CHECK_TYPE(is_kernel_floating_type(losses.scalar_type()),
                   "dro_ext: losses must have a floating dtype (float16, bfloat16, float32, float64), got ",
                   losses.scalar_type());
  check_group_ids(groups);
  TORCH_CHECK_VALUE(groups.sizes() == losses.sizes(), "dro_ext: groups must have the shape of losses, ",
                    losses.sizes(), ", got ", groups.sizes());
  TORCH_CHECK_VALUE(groups.device() == losses.device(), "dro_ext: groups is on ", groups.device(),
                    " but losses is on ", losses.device(), "; move them to the same device");
  TORCH_CHECK_VALUE(num_groups >= 1, "dro_ext: num_groups must be >= 1, got num_groups=", num_groups);
}

// The backward: grad_sums (G,) floating beside 1-D ids, and the floating dtype of the losses' gradient.
inline void check_group_sums_backward_args(const at::Tensor& grad_sums, const at::Tensor& groups,
                                           at::ScalarType dtype) {
  TORCH_CHECK_VALUE(grad_sums.dim() == 1 && grad_sums.numel() >= 1,
                    "dro_ext: grad_sums must be a 1-D tensor of num_groups >= 1 gradients, got shape ",
                    grad_sums.sizes());
  TORCH_CHECK_TYPE(is_kernel_floating_type(grad_sums.scalar_type()),
                   "dro_ext: grad_sums must have a floating dtype, got ", grad_sums.scalar_type());
  check_group_ids(groups);
  TORCH_CHECK_VALUE(groups.dim() == 1, "dro_ext: groups must be a 1-D tensor, got shape ", groups.sizes());
  TORCH_CHECK_VALUE(groups.device() == grad_sums.device(), "dro_ext: groups is on ", groups.device(),
                    " but grad_sums is on ", grad_sums.device(), "; move them to the same device");
  TORCH_CHECK_TYPE(is_kernel_floating_type(dtype), "dro_ext: dtype must be a floating dtype, got ", dtype);
}

// The dtype of the sums and counts: the losses' accumulation dtype, or float64 with wide (the kernels add in float64
// whatever the dtype, so wide sums are their totals unrounded, with no float64 copy of the losses).
inline at::ScalarType group_sums_dtype(at::ScalarType losses_dtype, bool wide) {
  return wide ? at::kDouble : accumulate_type(losses_dtype);
}

// Raised after a pass over the ids found one outside [0, num_groups), on every device.
inline void check_ids_in_range(bool in_range, int64_t num_groups) {
  TORCH_CHECK_INDEX(in_range, "dro_ext: groups holds an id outside [0, num_groups) with num_groups=", num_groups,
                    "; pass ids in range (or validate=False to drop them)");
}

}  // namespace dro_ext
