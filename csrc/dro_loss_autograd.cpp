// Autograd for dro_ext::dro_loss, in C++ so that a training step at small batch sizes does not pay for a
// Python autograd.Function round trip (the loss is one fused pass; the framework overhead would dominate).
//
//   dL/dl_i  = grad * w_i / N       one psi_star_terms pass (order 1, multiplier grad/N)
//   dL/deta  = grad * G * (1 - mean w), from the mean weight the forward already computed
//
// Device independent: it calls the ops through the dispatcher, so the CUDA kernels get the same autograd.
// Double backward works: when the backward itself must be differentiable, it is built from differentiable
// ops (psi_star_terms has its own autograd formula, registered in dro_ext/ops.py).
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/ones.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "checks.h"

namespace dro_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor psi_star_terms(
    const at::Tensor& losses, const at::Tensor& eta, const at::Tensor& multiplier, double lam,
    c10::string_view divergence, std::optional<double> alpha, std::optional<double> k, double scale,
    int64_t order) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dro_ext::psi_star_terms", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                         c10::string_view, std::optional<double>, std::optional<double>, double,
                                         int64_t)>();
  return op.call(losses, eta, multiplier, lam, divergence, alpha, k, scale, order);
}

std::tuple<at::Tensor, at::Tensor> dro_loss_below_autograd(
    const at::Tensor& losses, const at::Tensor& eta, double lam, c10::string_view divergence,
    std::optional<double> alpha, std::optional<double> k, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dro_ext::dro_loss", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double,
                                                                 c10::string_view, std::optional<double>,
                                                                 std::optional<double>, double)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(losses, eta, lam, divergence, alpha, k, scale);
}

std::optional<double> optional_double(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::optional<double>(v.toDouble());
}

class DROLossFunction : public torch::autograd::Function<DROLossFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& losses, const at::Tensor& eta, double lam, c10::string_view divergence,
      std::optional<double> alpha, std::optional<double> k, double scale) {
    auto [value, mean_weight] = dro_loss_below_autograd(losses, eta, lam, divergence, alpha, k, scale);
    ctx->save_for_backward({losses, eta, mean_weight});
    ctx->saved_data["lam"] = lam;
    ctx->saved_data["divergence"] = std::string(divergence);
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["k"] = k;
    ctx->saved_data["scale"] = scale;
    ctx->mark_non_differentiable({mean_weight});
    return {value, mean_weight};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& losses = saved[0];
    const at::Tensor& eta = saved[1];
    at::Tensor mean_weight = saved[2];
    const double lam = ctx->saved_data["lam"].toDouble();
    const std::string divergence = ctx->saved_data["divergence"].toStringRef();
    const auto alpha = optional_double(ctx->saved_data["alpha"]);
    const auto k = optional_double(ctx->saved_data["k"]);
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor& grad_value = grads[0];
    const auto acc = mean_weight.scalar_type();
    // A backward that must itself be differentiated goes through psi_star_terms' autograd; otherwise
    // skip the autograd layer and call the kernel directly.
    const bool differentiable = at::GradMode::is_enabled();
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!differentiable) below_autograd.emplace();

    at::Tensor grad_losses, grad_eta;
    if (ctx->needs_input_grad(0)) {
      const at::Tensor multiplier = (grad_value / static_cast<double>(losses.size(0))).to(acc);
      grad_losses = psi_star_terms(losses, eta, multiplier, lam, divergence, alpha, k, scale, 1);
    }
    if (ctx->needs_input_grad(1)) {
      if (differentiable && (losses.requires_grad() || eta.requires_grad())) {
        // The saved mean weight is a constant to autograd: recompute it differentiably.
        const at::Tensor one = at::ones({}, losses.options().dtype(acc));
        mean_weight = psi_star_terms(losses, eta, one, lam, divergence, alpha, k, scale, 1).mean(acc);
      }
      grad_eta = (grad_value.to(acc) * (scale * (1.0 - mean_weight))).to(eta.scalar_type());
    }
    return {grad_losses, grad_eta, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> dro_loss_autograd(
    const at::Tensor& losses, const at::Tensor& eta, double lam, c10::string_view divergence,
    std::optional<double> alpha, std::optional<double> k, double scale) {
  auto out = DROLossFunction::apply(losses, eta, lam, divergence, alpha, k, scale);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(dro_ext, Autograd, m) {
  m.impl("dro_loss", &dro_loss_autograd);
}

}  // namespace dro_ext
