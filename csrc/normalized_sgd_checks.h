// Argument checks of normalized_sgd_step_, shared by the CPU and CUDA entry points: each failure names the
// argument (and, for the lists, the index).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// No two tensors of a list the step updates in place on shared memory: the CPU kernel would update the shared
// elements once per tensor, from two threads at once where their chunks run in parallel, and the CUDA kernel's blocks,
// which run at once, would race on them (a step count shared by two params loses increments). As ATen's own checks of
// memory overlap (at::get_overlap_status) take it: a dense tensor (no gaps between its elements, in any order of its
// dims) holds the bytes from its first element to its last, and two such spans that meet share memory; a strided view
// with gaps (a column slice, every other element) is too hard to tell apart cheaply and counts as shared only with
// the same view given twice. So two column halves of one matrix step, and two overlapping row slices are refused.
inline void check_each_tensor_once(const char* name, at::TensorList list) {
  struct Span {
    uintptr_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  spans.reserve(list.size());
  auto refuse = [&](size_t a, size_t b) {
    TORCH_CHECK_VALUE(false, "dro_ext: ", name, "[", std::min(a, b), "] and ", name, "[", std::max(a, b),
                      "] share memory; the step updates each in place, so no two may overlap");
  };
  for (const auto i : c10::irange(list.size())) {
    const at::Tensor& t = list[i];
    if (t.numel() == 0) continue;  // empty ones may share nullptr
    const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    if (t.is_non_overlapping_and_dense()) {
      spans.push_back({begin, begin + static_cast<uintptr_t>(t.numel() * t.element_size()), i});
      continue;
    }
    for (const auto j : c10::irange(i)) {  // (a view with gaps: only the same view again; rare, so a plain scan)
      const at::Tensor& u = list[j];
      if (u.numel() > 0 && u.const_data_ptr() == t.const_data_ptr() && u.sizes() == t.sizes() &&
          u.strides() == t.strides()) {
        refuse(j, i);
      }
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  uintptr_t reach = 0;  // the furthest end of the spans before
  size_t reacher = 0;   // whose it is
  for (size_t j = 0; j < spans.size(); ++j) {
    if (j > 0 && spans[j].begin < reach) refuse(reacher, spans[j].index);
    if (spans[j].end > reach) {
      reach = spans[j].end;
      reacher = spans[j].index;
    }
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
