// CUDA kernels of the loss ops (schemas and CPU kernels in csrc/dro_loss.cpp, same semantics and checks):
//
//   dro_loss           one pass over the losses writing per-block partials of (psi*(t), psi*'(t)), then a
//                      one-block second stage writing L and mean_i w_i as 0-d device tensors;
//   dro_loss_backward  one elementwise launch: grad * w_i / N, and grad * G * (1 - mean_weight) from thread 0;
//   psi_star_terms     one elementwise launch: multiplier * psi*^(order)(t_i).
//
// eta, grad, multiplier and mean_weight are read by the kernels (never .item()), everything runs on the
// current stream, and the only allocations are through the caching allocator, so the ops neither sync
// nor break a CUDA graph capture. Where 1/lam is no normal float32, half/bfloat16/float32 losses run through
// the float64 kernels on a copy (runs_on_float64_copy), as on the CPU.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda/psi_star_kernels.cuh"

namespace dro_ext::cuda {

namespace {

// L = lam * (sum value_term / N), mean_weight = sum w / N, as the CPU forms them.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) loss_finalize_kernel(
    const Pair<acc_t>* __restrict__ partials, int count, double lam, double n,
    scalar_t* __restrict__ value, acc_t* __restrict__ mean_weight) {
  const Pair<acc_t> total = reduce_partials(partials, count, Pair<acc_t>{acc_t(0), acc_t(0)}, PairSum());
  if (threadIdx.x == 0) {
    *value = static_cast<scalar_t>(lam * (static_cast<double>(total.a) / n));
    *mean_weight = static_cast<acc_t>(static_cast<double>(total.b) / n);
  }
}

std::tuple<at::Tensor, at::Tensor> dro_loss_cuda(
    const at::Tensor& losses, const at::Tensor& eta, double lam, c10::string_view divergence,
    std::optional<double> alpha, std::optional<double> k, double scale) {
  const DivergenceSpec spec = check_dro_loss_args(losses, eta, lam, divergence, alpha, k, scale);
  const c10::cuda::CUDAGuard guard(losses.device());
  if (runs_on_float64_copy(losses, lam)) {
    const auto [value, mean_weight] = dro_loss_cuda(losses.to(at::kDouble), eta, lam, divergence, alpha, k, scale);
    return {value.to(losses.scalar_type()), mean_weight.to(accumulate_type(losses.scalar_type()))};
  }
  const at::Tensor x = losses.contiguous();
  const ShiftRef g_eta{scalar_ref(eta), scale, 0.0};
  at::Tensor partials = derivative_partials_buffer(x);
  launch_derivative_partials<0, 1>(x, spec, g_eta, lam, nullptr, partials);
  const auto options = losses.options();
  at::Tensor value = at::empty({}, options);
  at::Tensor mean_weight = at::empty({}, options.dtype(accumulate_type(losses.scalar_type())));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_loss_finalize", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    loss_finalize_kernel<scalar_t, acc_t><<<1, kThreads, 0, stream>>>(
        reinterpret_cast<const Pair<acc_t>*>(partials.const_data_ptr<acc_t>()), static_cast<int>(partials.size(0)),
        lam, static_cast<double>(x.numel()), value.mutable_data_ptr<scalar_t>(),
        mean_weight.mutable_data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {value, mean_weight};
}

at::Tensor psi_star_terms_cuda(
    const at::Tensor& losses, const at::Tensor& eta, const at::Tensor& multiplier, double lam,
    c10::string_view divergence, std::optional<double> alpha, std::optional<double> k, double scale,
    int64_t order) {
  const DivergenceSpec spec =
      check_psi_star_terms_args(losses, eta, multiplier, lam, divergence, alpha, k, scale, order);
  const c10::cuda::CUDAGuard guard(losses.device());
  if (runs_on_float64_copy(losses, lam)) {
    return psi_star_terms_cuda(losses.to(at::kDouble), eta, multiplier, lam, divergence, alpha, k, scale, order)
        .to(losses.scalar_type());
  }
  const at::Tensor x = losses.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  launch_map_derivative(x, out, spec, ShiftRef{scalar_ref(eta), scale, 0.0}, lam, scalar_ref(multiplier), 1.0,
                        static_cast<int>(order));
  return out;
}

std::tuple<at::Tensor, at::Tensor> dro_loss_backward_cuda(
    const at::Tensor& grad, const at::Tensor& losses, const at::Tensor& eta, const at::Tensor& mean_weight,
    double lam, c10::string_view divergence, std::optional<double> alpha, std::optional<double> k,
    double scale) {
  const DivergenceSpec spec =
      check_dro_loss_backward_args(grad, losses, eta, mean_weight, lam, divergence, alpha, k, scale);
  const c10::cuda::CUDAGuard guard(losses.device());
  if (runs_on_float64_copy(losses, lam)) {
    const auto [grad_losses, grad_eta] =
        dro_loss_backward_cuda(grad, losses.to(at::kDouble), eta, mean_weight, lam, divergence, alpha, k, scale);
    return {grad_losses.to(losses.scalar_type()), grad_eta};
  }
  const at::Tensor x = losses.contiguous();
  at::Tensor grad_losses = at::empty(x.sizes(), x.options());
  at::Tensor grad_eta = at::empty({}, eta.options());
  const EtaGradient eta_grad{true, scalar_ref(grad), scalar_ref(mean_weight), scale, scalar_out(grad_eta)};
  launch_map_derivative(x, grad_losses, spec, ShiftRef{scalar_ref(eta), scale, 0.0}, lam, scalar_ref(grad),
                        static_cast<double>(x.numel()), 1, eta_grad);
  return {grad_losses, grad_eta};
}

}  // namespace

TORCH_LIBRARY_IMPL(dro_ext, CUDA, m) {
  m.impl("dro_loss", &dro_loss_cuda);
  m.impl("psi_star_terms", &psi_star_terms_cuda);
  m.impl("dro_loss_backward", &dro_loss_backward_cuda);
}

}  // namespace dro_ext::cuda
