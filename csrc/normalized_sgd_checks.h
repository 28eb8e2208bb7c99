// Argument checks of normalized_sgd_step_, shared by the CPU and CUDA entry points: each failure names the
// argument (and, for the lists, the index).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace dro_ext {

inline void check_step_hyperparameters(double momentum, double eps, double weight_decay, c10::string_view norm) {
  TORCH_CHECK_VALUE(momentum >= 0.0 && momentum < 1.0, "dro_ext: momentum must be in [0, 1), got ", momentum);
  TORCH_CHECK_VALUE(eps >= 0.0 && std::isfinite(eps), "dro_ext: eps must be a finite number >= 0, got ", eps);
  TORCH_CHECK_VALUE(weight_decay >= 0.0 && std::isfinite(weight_decay),
                    "dro_ext: weight_decay must be a finite number >= 0, got ", weight_decay);
  TORCH_CHECK_VALUE(norm == "global" || norm == "tensor", "dro_ext: norm must be 'global' or 'tensor', got '",
                    std::string(norm), "'");
}

inline void check_step_list_lengths(at::TensorList params, at::TensorList grads, at::TensorList momenta,
                                    at::TensorList steps) {
  TORCH_CHECK_VALUE(grads.size() == params.size() && momenta.size() == params.size() && steps.size() == params.size(),
                    "dro_ext: params, grads, momenta and steps must have the same length, got ", params.size(), ", ",
                    grads.size(), ", ", momenta.size(), ", ", steps.size());
}

// lr, grad_scale or found_inf given as a tensor: one element, on the CPU or, for a step on a GPU, on that GPU (where
// the kernels read it without a host sync).
inline void check_step_scalar(const char* name, const at::Tensor& t, c10::Device device) {
  TORCH_CHECK_VALUE(t.numel() == 1, "dro_ext: ", name, " must hold one element, got shape ", t.sizes());
  if (device.is_cpu()) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), "dro_ext: ", name, " must be on the CPU for CPU parameters, got ",
                      t.device());
  } else {
    TORCH_CHECK_VALUE(t.device().is_cpu() || t.device() == device, "dro_ext: ", name, " is on ", t.device(),
                      " but the parameters are on ", device, "; pass it on ", device, " or on the CPU");
  }
}

// No tensor given twice in a list the step updates in place: the CPU kernel would update it twice, and the CUDA
// kernel's blocks, which run at once, would race on it (a step count shared by two params loses increments).
inline void check_each_tensor_once(const char* name, at::TensorList list) {
  std::vector<std::pair<const void*, size_t>> starts;
  starts.reserve(list.size());
  for (const auto i : c10::irange(list.size())) {
    if (list[i].numel() > 0) starts.emplace_back(list[i].const_data_ptr(), i);  // empty ones may share nullptr
  }
  std::sort(starts.begin(), starts.end());
  for (size_t j = 1; j < starts.size(); ++j) {
    TORCH_CHECK_VALUE(starts[j].first != starts[j - 1].first, "dro_ext: ", name, "[",
                      std::min(starts[j - 1].second, starts[j].second), "] and ", name, "[",
                      std::max(starts[j - 1].second, starts[j].second),
                      "] are the same memory; the step updates each in place, so each must appear once");
  }
}

// Every param a float32, float64, float16 or bfloat16 tensor on `device` (the one the kernel runs on), its grad
// and momentum alike, and its step count a one-element float32 tensor beside it.
inline void check_step_lists(at::TensorList params, at::TensorList grads, at::TensorList momenta,
                             at::TensorList steps, c10::Device device) {
  check_step_list_lengths(params, grads, momenta, steps);
  for (const auto i : c10::irange(params.size())) {
    const at::Tensor& p = params[i];
    const auto dtype = p.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
                     "dro_ext: params[", i, "] must be float32, float64, float16 or bfloat16, got ", dtype);
    TORCH_CHECK_VALUE(p.device() == device, "dro_ext: params[", i, "] is on ", p.device(), " but this step runs on ",
                      device, "; every tensor of one call must sit on one device");
    auto check_like_param = [&](const char* name, const at::Tensor& t) {
      TORCH_CHECK_VALUE(t.scalar_type() == p.scalar_type() && t.device() == p.device() && t.sizes() == p.sizes(),
                        "dro_ext: ", name, "[", i, "] must match params[", i, "] (", p.scalar_type(), " ", p.sizes(),
                        " on ", p.device(), "), got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
    };
    check_like_param("grads", grads[i]);
    check_like_param("momenta", momenta[i]);
    TORCH_CHECK_VALUE(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat && steps[i].device() == device,
                      "dro_ext: steps[", i, "] must be a one-element float32 tensor on ", device, " (beside params[",
                      i, "]), got ", steps[i].scalar_type(), " ", steps[i].sizes(), " on ", steps[i].device());
  }
  check_each_tensor_once("params", params);
  check_each_tensor_once("momenta", momenta);
  check_each_tensor_once("steps", steps);
}

}  // namespace dro_ext
