// 0-d CPU tensors read and written in place. item() and at::scalar_tensor() each go through the
// dispatcher (_local_scalar_dense, fill_), which at a few thousand samples costs about as much as the
// fused pass over the losses itself.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <array>

namespace dro_ext::cpu {

// The value of a 0-d floating CPU tensor, as a double.
inline double read_scalar(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() == 0 && t.device().is_cpu());
  if (t.is_neg() || t.is_conj()) return t.item<double>();  // lazy views: let ATen resolve them
  double out = 0.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "dro_ext_read_scalar",
                                  [&] { out = static_cast<double>(*t.const_data_ptr<scalar_t>()); });
  return out;
}

// Writes n doubles into a new contiguous floating CPU tensor of n elements, each rounded to its dtype: inf past the
// dtype's range, where fill_ would refuse a double it cannot hold.
inline void write_rounded(at::Tensor& out, const double* values, size_t n) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "dro_ext_write_rounded", [&] {
    scalar_t* data = out.mutable_data_ptr<scalar_t>();
    for (size_t i = 0; i < n; ++i) data[i] = static_cast<scalar_t>(values[i]);
  });
}

// A new 0-d tensor holding value, with the given (CPU, floating) options.
inline at::Tensor make_scalar(double value, const at::TensorOptions& options) {
  at::Tensor out = at::empty({}, options);
  write_rounded(out, &value, 1);
  return out;
}

// A new 1-d tensor holding values, with the given (CPU, floating) options.
template <size_t N>
inline at::Tensor make_vector(const std::array<double, N>& values, const at::TensorOptions& options) {
  at::Tensor out = at::empty({static_cast<int64_t>(N)}, options);
  write_rounded(out, values.data(), N);
  return out;
}

}  // namespace dro_ext::cpu
