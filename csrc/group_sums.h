// The group_sums ops through the dispatcher, for the C++ code that composes them (their autograd in
// csrc/group_sums.cpp, the online Group DRO step in csrc/group_dro.cpp): with autograd unless the caller is below it.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace dro_ext {

std::tuple<at::Tensor, at::Tensor> call_group_sums(const at::Tensor& losses, const at::Tensor& groups,
                                                   int64_t num_groups, bool validate, bool wide = false);
at::Tensor call_group_sums_backward(const at::Tensor& grad_sums, const at::Tensor& groups, at::ScalarType dtype);

}  // namespace dro_ext
