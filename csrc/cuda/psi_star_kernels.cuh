// The two kernels over the losses that the loss ops and the robust objective share, with their launchers:
//  - derivative_partials: per-block sums of (psi*^(A)(t_i), psi*^(B)(t_i)), t_i = (l_i - shift) / lam, the
//    shift read on the device in float64 and taken as hi + lo in the accumulate dtype (ShiftRef::split, so that its
//    rounding moves no t); one launch, one partial per block (combined by a one-block second stage);
//  - map_derivative: out_i = multiplier * psi*^(order)(t_i), the multiplier read on the device;
// and the per-thread sums of psi* terms behind the first (the loss value's coarse-or-accurate choice included).
// The math comes from csrc/divergences.h (its functors, picked by launch_for_divergence); nothing here knows a formula.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include "cuda/common.cuh"
#include "cuda/divergence_dispatch.cuh"
#include "divergences.h"

namespace dro_ext::cuda {

// The k-th derivative of psi* (0: the value).
// ORDER 0, 1, 2: psi*, psi*', psi*''; kExcessFirst: psi*' - 1, accurate where psi*' is near 1 (large lam).
constexpr int kExcessFirst = 3;

template <int ORDER, typename Div, typename T>
__device__ __forceinline__ T derivative(const Div& div, T t) {
  if constexpr (ORDER == kExcessFirst) {
    return div.excess_first(t);
  } else if constexpr (ORDER == 0) {
    return div.value(t);
  } else if constexpr (ORDER == 1) {
    return div.first(t);
  } else {
    return div.second(t);
  }
}

template <typename Div, typename T>
__device__ __forceinline__ T derivative(const Div& div, T t, int order) {
  return order == 0 ? div.value(t) : (order == 1 ? div.first(t) : div.second(t));
}

// The per-element term of the loss VALUE, in one place: L = lam * mean_i value_term(div, t_i, l_i, shift, inv_lam),
// with value_term = psi*(t) + shift / lam formed as l / lam + excess(t) (divergences.h's penalized_value, divided
// by lam: it keeps its precision as lam grows, and takes psi*(t) itself where t is infinite).
template <typename Div, typename T>
__device__ __forceinline__ T value_term(const Div& div, T t, T l, T shift, T inv_lam) {
  return penalized_value(div, t, l * inv_lam, T(1), shift * inv_lam);
}

// Per-thread sums of (value_term, psi*') for a divergence with a coarse value (divergences.h: kl, kl_cvar,
// smoothed_cvar, whose accurate excess costs an expm1 and a log1p on top of first()'s exponential; callers take it
// only where div.coarse_ok()). As csrc/cpu/kernels_impl.h's reduce_coarse does per block of 512 losses, each warp's
// 32 vectors (128 float32 losses) whose mean of min(|t|, 1) is at least 1/2 sum the coarse value, which shares
// first()'s exponential: there its error, a few roundings of 1 + |psi*(t)|, is within a small factor of the
// accurate term's (min: one huge |t| cannot send its small neighbours to the coarse terms). Any other warp (the ERM
// regime, and NaN) sums value_term itself. The choice is the warp's, not each lane's: a lane-by-lane choice sent nearly
// every warp down both paths (some lane of 32 almost always falls short), and on an H100 smoothed_cvar's forward
// then took 77 us at 2^24 against chi2's 32 (bench/results/h100_2026-11-27). Vectors outside a whole-warp
// iteration (the grid's last, the head and the tail) choose alone.
// The coarse terms enter as sum value_term = sum psi*(t) + count shift / lam (value_term = psi*(t) + shift / lam);
// smoothed_cvar's coarse value is summed in product form, its factors (in [1, 2]) multiplied 16 at a time between
// logarithms: about an instruction a loss, and the flush runs in any thread that owns four float32 vectors
// (reduce_blocks gives most threads ~4 from n = 4096 on), not only past 2^24. Every sum sees its terms in the
// thread's fixed order: deterministic.
template <typename scalar_t, typename Div>
__device__ __forceinline__ Pair<at::opmath_type<scalar_t>> thread_loss_sums_coarse(
    const scalar_t* __restrict__ x, int64_t n, const Div& div, SplitShift<at::opmath_type<scalar_t>> shift,
    at::opmath_type<scalar_t> inv_lam) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kProduct = requires { requires Div::kCoarseValueAsProduct; };
  constexpr int kFlush = 16;  // factors per product: at most 2^16
  acc_t accurate = 0, first = 0, coarse = 0, coarse_count = 0;
  acc_t log_product = 0, product = 1;  // kProduct only
  int factors = 0;
  for_each_vector<acc_t>(x, n, [&](const acc_t* l, auto count, bool whole_warp) {
    constexpr int K = decltype(count)::value;
    acc_t t[K];
    acc_t abs_t = 0;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      t[j] = shift.deviation(l[j]) * inv_lam;
      abs_t += ::fmin(::fabs(t[j]), acc_t(1));  // fmin returns 1 for a NaN |t|: the NaN is in t and first
      first += div.first(t[j]);
    }
    if (whole_warp ? warp_sum(abs_t) >= static_cast<acc_t>(16 * K) : abs_t >= static_cast<acc_t>(0.5 * K)) {
      coarse_count += static_cast<acc_t>(K);
#pragma unroll
      for (int j = 0; j < K; ++j) {
        if constexpr (kProduct) {
          coarse += div.coarse_linear(t[j]);
          product *= div.coarse_factor(t[j]);
        } else {
          coarse += div.coarse_value(t[j]);
        }
      }
      if constexpr (kProduct) {
        factors += K;
        if (factors >= kFlush) {
          log_product += ::log(product);
          product = 1;
          factors = 0;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < K; ++j) accurate += value_term(div, t[j], l[j], shift.hi, inv_lam);
    }
  });
  if constexpr (kProduct) {
    coarse = static_cast<acc_t>(div.coarse_scale()) *
             (coarse + (log_product + ::log(product)) + coarse_count * static_cast<acc_t>(div.coarse_offset()));
  }
  return Pair<acc_t>{accurate + (coarse + coarse_count * (shift.hi * inv_lam)), first};
}

// Per-thread partial sums of (derivative A, derivative B) of psi* at t_i = (x_i - shift) * inv_lam over the
// elements this thread owns; A == 0 is the loss value term (with B == 1, through the coarse value where the
// divergence has one: thread_loss_sums_coarse).
template <int A, int B, typename scalar_t, typename Div>
__device__ __forceinline__ Pair<at::opmath_type<scalar_t>> thread_derivative_sums(
    const scalar_t* __restrict__ x, int64_t n, const Div& div, SplitShift<at::opmath_type<scalar_t>> shift,
    at::opmath_type<scalar_t> inv_lam) {
  using acc_t = at::opmath_type<scalar_t>;
  if constexpr (A == 0 && B == 1 && requires { requires Div::kHasCoarseValue; }) {
    if (div.coarse_ok()) return thread_loss_sums_coarse(x, n, div, shift, inv_lam);
  }
  {
    Pair<acc_t> s{acc_t(0), acc_t(0)};
    for_each_element<acc_t>(x, n, [&](acc_t l) {
      const acc_t t = shift.deviation(l) * inv_lam;
      if constexpr (A == 0) {
        s.a += value_term(div, t, l, shift.hi, inv_lam);
      } else {
        s.a += derivative<A>(div, t);
      }
      s.b += derivative<B>(div, t);
    });
    return s;
  }
}

// One partial per block. `skip` (may be null) points to a device flag: when it is set, the kernel does
// nothing (an iterative solve that has already finished).
template <int A, int B, typename scalar_t, typename Div>
__global__ void __launch_bounds__(kThreads) derivative_partials_kernel(
    const scalar_t* __restrict__ x, int64_t n, Div div, ShiftRef shift_ref, double inv_lam,
    const int* skip, Pair<at::opmath_type<scalar_t>>* __restrict__ partials) {
  using acc_t = at::opmath_type<scalar_t>;
  if (skip != nullptr && *skip) return;
  const SplitShift<acc_t> shift = shift_ref.split<acc_t>();
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
  const SplitShift<acc_t> shift = shift_ref.split<acc_t>();
  const acc_t multiplier = static_cast<acc_t>(mult.read() / divisor);
  const acc_t inv = static_cast<acc_t>(inv_lam);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (eta_grad.enabled && tid == 0) eta_grad.write();
  auto term = [&](scalar_t l) {
    return static_cast<scalar_t>(multiplier * derivative(div, shift.deviation(static_cast<acc_t>(l)) * inv, order));
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
