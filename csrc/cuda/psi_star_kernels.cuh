// The two kernels over the losses that the loss ops and the robust objective share, with their launchers:
//  - derivative_partials: per-block sums of (psi*^(A)(t_i), psi*^(B)(t_i)), t_i = (l_i - shift) / lam, the
//    shift read on the device; one launch, one partial per block (combined by a one-block second stage);
//  - map_derivative: out_i = multiplier * psi*^(order)(t_i), the multiplier read on the device.
// The math comes from csrc/divergences.h (its functors, picked by launch_for_divergence); nothing here knows a formula.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include "cuda/common.cuh"

namespace dro_ext::cuda {

// One partial per block. `skip` (may be null) points to a device flag: when it is set, the kernel does
// nothing (an iterative solve that has already finished).
template <int A, int B, typename scalar_t, typename Div>
__global__ void __launch_bounds__(kThreads) derivative_partials_kernel(
    const scalar_t* __restrict__ x, int64_t n, Div div, ShiftRef shift_ref, double inv_lam,
    const int* skip, Pair<at::opmath_type<scalar_t>>* __restrict__ partials) {
  using acc_t = at::opmath_type<scalar_t>;
  if (skip != nullptr && *skip) return;
  const acc_t shift = static_cast<acc_t>(shift_ref.read());
  const Pair<acc_t> s = thread_derivative_sums<A, B>(x, n, div, shift, static_cast<acc_t>(inv_lam));
  const Pair<acc_t> block = block_reduce(s, PairSum());
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

// Launches derivative_partials_kernel over the contiguous 1-D x; partials is a (blocks, 2) tensor of the
// accumulate dtype from derivative_partials_buffer(x).
inline at::Tensor derivative_partials_buffer(const at::Tensor& x) {
  int blocks = 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_blocks",
                                  [&] { blocks = reduce_blocks<scalar_t>(x.numel()); });
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::empty({blocks, 2}, x.options().dtype(acc));
}

template <int A, int B>
void launch_derivative_partials(const at::Tensor& x, const DivergenceSpec& spec, ShiftRef shift, double lam,
                                const int* skip, at::Tensor& partials) {
  const int64_t n = x.numel();
  const int blocks = static_cast<int>(partials.size(0));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_partials", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    auto* out = reinterpret_cast<Pair<acc_t>*>(partials.mutable_data_ptr<acc_t>());
    launch_for_divergence<acc_t>(spec, [&](const auto& div) {
      derivative_partials_kernel<A, B><<<blocks, kThreads, 0, stream>>>(data, n, div, shift, 1.0 / lam, skip, out);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// The 0-d gradient of eta that dro_loss_backward writes beside the map: grad * scale * (1 - mean_weight).
struct EtaGradient {
  bool enabled;
  ScalarRef grad;
  ScalarRef mean_weight;
  double scale;
  ScalarOut out;
  __device__ __forceinline__ void write() const { out.write(grad.read() * scale * (1.0 - mean_weight.read())); }
};

// out_i = multiplier * psi*^(order)((x_i - shift) / lam) with multiplier = (*mult) / divisor. With
// VECTORIZED, x and out are 16-byte aligned and move in 16-byte vectors.
template <bool VECTORIZED, typename scalar_t, typename Div>
__global__ void __launch_bounds__(kThreads) map_derivative_kernel(
    const scalar_t* __restrict__ x, scalar_t* __restrict__ out, int64_t n, Div div, ShiftRef shift_ref,
    double inv_lam, ScalarRef mult, double divisor, int order, EtaGradient eta_grad) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t shift = static_cast<acc_t>(shift_ref.read());
  const acc_t multiplier = static_cast<acc_t>(mult.read() / divisor);
  const acc_t inv = static_cast<acc_t>(inv_lam);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (eta_grad.enabled && tid == 0) eta_grad.write();
  auto term = [&](scalar_t l) {
    return static_cast<scalar_t>(multiplier * derivative(div, (static_cast<acc_t>(l) - shift) * inv, order));
  };
  int64_t done = 0;
  if constexpr (VECTORIZED) {
    constexpr int kVec = vec_size<scalar_t>();
    using Vec = AlignedVec<scalar_t, kVec>;
    const int64_t vectors = n / kVec;
    const Vec* vx = reinterpret_cast<const Vec*>(x);
    Vec* vout = reinterpret_cast<Vec*>(out);
    for (int64_t v = tid; v < vectors; v += stride) {
      const Vec in = vx[v];
      Vec result;
#pragma unroll
      for (int j = 0; j < kVec; ++j) result.v[j] = term(in.v[j]);
      vout[v] = result;
    }
    done = vectors * kVec;
  }
  for (int64_t i = done + tid; i < n; i += stride) out[i] = term(x[i]);
}

// Launches map_derivative_kernel over the contiguous x into the contiguous out (same numel).
inline void launch_map_derivative(const at::Tensor& x, at::Tensor& out, const DivergenceSpec& spec, ShiftRef shift,
                                  double lam, ScalarRef mult, double divisor, int order,
                                  EtaGradient eta_grad = EtaGradient{false, {}, {}, 0.0, {}}) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_map", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    scalar_t* result = out.mutable_data_ptr<scalar_t>();
    const bool aligned = reinterpret_cast<uintptr_t>(data) % 16 == 0 && reinterpret_cast<uintptr_t>(result) % 16 == 0;
    const int blocks = map_blocks<scalar_t>(n);
    launch_for_divergence<acc_t>(spec, [&](const auto& div) {
      if (aligned) {
        map_derivative_kernel<true><<<blocks, kThreads, 0, stream>>>(data, result, n, div, shift, 1.0 / lam, mult,
                                                                      divisor, order, eta_grad);
      } else {
        map_derivative_kernel<false><<<blocks, kThreads, 0, stream>>>(data, result, n, div, shift, 1.0 / lam, mult,
                                                                       divisor, order, eta_grad);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace dro_ext::cuda
