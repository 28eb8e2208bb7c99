// The operands of normalized_sgd_step_ as flat arrays, shared by the CPU and CUDA kernels: element i of a tensor's
// param, grad and momentum arrays is the same element of the three tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>

#include <vector>

namespace dro_ext {

struct StepOperands {
  at::Tensor param, grad, momentum;
  bool copied = false;  // param and momentum are contiguous copies, which copy_back_step_operands writes back
};

// Each tensor's p, g and m as given when they share one dense layout (any order of dimensions), else contiguous
// copies.
inline std::vector<StepOperands> flat_step_operands(at::TensorList params, at::TensorList grads,
                                                    at::TensorList momenta) {
  std::vector<StepOperands> operands;
  operands.reserve(params.size());
  for (const auto i : c10::irange(params.size())) {
    const at::Tensor &p = params[i], &g = grads[i], &m = momenta[i];
    if (p.is_non_overlapping_and_dense() && g.strides() == p.strides() && m.strides() == p.strides()) {
      operands.push_back({p, g, m, false});
    } else {
      operands.push_back({p.contiguous(), g.contiguous(), m.contiguous(), true});
    }
  }
  return operands;
}

// The updated copies back into the params and momenta they were made from (on CUDA, stream-ordered after the step).
inline void copy_back_step_operands(const std::vector<StepOperands>& operands, at::TensorList params,
                                    at::TensorList momenta) {
  for (const auto i : c10::irange(operands.size())) {
    if (!operands[i].copied) continue;
    params[i].copy_(operands[i].param);
    momenta[i].copy_(operands[i].momentum);
  }
}

}  // namespace dro_ext
