// The fused DRO loss: schemas of the loss ops and their CPU kernels.
//
//   dro_loss(l, eta)            -> (L, mean_i w_i) with L = mean_i lam psi*((l_i - G eta)/lam) + G eta,
//                                  formed as mean_i l_i + lam mean_i excess(t_i) (csrc/divergences.h)
//   psi_star_terms(l, eta, m)   -> m * psi*^(order)((l_i - G eta)/lam), elementwise
//
// The autograd formulas live in csrc/autograd.cpp: dL/dl_i = w_i / N is one pass (dro_loss_backward)
// and dL/deta = G (1 - mean w) uses the mean weight dro_loss already returned, so nothing N-sized is
// saved for backward beyond the losses.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/kernels.h"
#include "cpu/output_buffer.h"
#include "cpu/scalar_tensors.h"

namespace dro_ext {

namespace {

std::tuple<at::Tensor, at::Tensor> dro_loss_cpu(
    const at::Tensor& losses, const at::Tensor& eta, double lam, c10::string_view divergence,
    std::optional<double> alpha, std::optional<double> k, double scale) {
  const DivergenceSpec spec = check_dro_loss_args(losses, eta, lam, divergence, alpha, k, scale);
  const at::Tensor x = losses.contiguous();
  const double g_eta = scale * cpu::read_scalar(eta);
  const cpu::PenalizedMean mean = cpu::penalized_mean(x, spec, g_eta, lam, cpu::kAvx512MinValuesOnePass);
  auto options = losses.options();
  return {cpu::make_scalar(mean.value, options),
          cpu::make_scalar(mean.mean_weight, options.dtype(accumulate_type(losses.scalar_type())))};
}

// out_i = multiplier * psi*^(order)((x_i - G eta) / lam), into a fresh contiguous tensor like x.
at::Tensor map_terms(const at::Tensor& x, const at::Tensor& eta, double multiplier, double lam,
                     const DivergenceSpec& spec, double scale, int64_t order) {
  at::Tensor out = cpu::empty_output_like(x);
  if (x.numel() > 0) {
    const double g_eta = scale * cpu::read_scalar(eta);
    at::Tensor flat = out.view(-1);
    cpu::map_derivative(x.view(-1), flat, spec, g_eta, lam, multiplier, order, cpu::kAvx512MinValuesOnePass);
  }
  return out;
}

at::Tensor psi_star_terms_cpu(
    const at::Tensor& losses, const at::Tensor& eta, const at::Tensor& multiplier, double lam,
    c10::string_view divergence, std::optional<double> alpha, std::optional<double> k, double scale,
    int64_t order) {
  const DivergenceSpec spec =
      check_psi_star_terms_args(losses, eta, multiplier, lam, divergence, alpha, k, scale, order);
  return map_terms(losses.contiguous(), eta, cpu::read_scalar(multiplier), lam, spec, scale, order);
}

std::tuple<at::Tensor, at::Tensor> dro_loss_backward_cpu(
    const at::Tensor& grad, const at::Tensor& losses, const at::Tensor& eta, const at::Tensor& mean_weight,
    double lam, c10::string_view divergence, std::optional<double> alpha, std::optional<double> k,
    double scale) {
  const DivergenceSpec spec =
      check_dro_loss_backward_args(grad, losses, eta, mean_weight, lam, divergence, alpha, k, scale);
  const double g = cpu::read_scalar(grad);
  at::Tensor grad_losses = map_terms(
      losses.contiguous(), eta, g / static_cast<double>(losses.numel()), lam, spec, scale, 1);
  at::Tensor grad_eta = cpu::make_scalar(g * scale * (1.0 - cpu::read_scalar(mean_weight)), eta.options());
  return {grad_losses, grad_eta};
}

}  // namespace

TORCH_LIBRARY(dro_ext, m) {
  m.def(
      "dro_loss(Tensor losses, Tensor eta, float lam, str divergence, float? alpha=None, float? k=None, "
      "float scale=1.0) -> (Tensor, Tensor)");
  m.def(
      "psi_star_terms(Tensor losses, Tensor eta, Tensor multiplier, float lam, str divergence, "
      "float? alpha=None, float? k=None, float scale=1.0, int order=1) -> Tensor");
  // The first-order backward of dro_loss in one pass (csrc/autograd.cpp uses it when the backward
  // itself needs no gradient): (grad * w_i / N, grad * G * (1 - mean_weight)).
  m.def(
      "dro_loss_backward(Tensor grad, Tensor losses, Tensor eta, Tensor mean_weight, float lam, str divergence, "
      "float? alpha=None, float? k=None, float scale=1.0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dro_ext, CPU, m) {
  m.impl("dro_loss", &dro_loss_cpu);
  m.impl("psi_star_terms", &psi_star_terms_cpu);
  m.impl("dro_loss_backward", &dro_loss_backward_cpu);
}

}  // namespace dro_ext
