// Autograd of the loss ops and of the robust objective, in C++ so that a training step at small batch sizes does
// not pay for a Python autograd round trip (each op is one fused pass; framework overhead would dominate: with the
// robust objective's autograd in Python, through torch.library.register_autograd, its training step took 1.11-1.16x
// of ERM's in `bench_train --quick --cases mlp-large-batch` on a 2-vCPU AMD EPYC, and 1.05-1.07x with the Node below,
// as much as DROLoss's step).
//
// dro_loss:         dL/dl_i = grad * w_i / N,  dL/deta = grad * G * (1 - mean w)
// psi_star_terms:   out_i = m psi*^(k)(t_i), t_i = (l_i - G eta)/lam:
//                   d/dl_i = m psi*^(k+1)(t_i) / lam,  d/deta = -G sum_i of that,  d/dm = psi*^(k)(t_i)
// robust_objective: Psi = min_eta L(eta); by Danskin's theorem dPsi/dl_i = grad * q_i, q the worst-case weights
//                   at eta* (robust_weights). Its second derivative (eta* moves with l) is not implemented.
//
// Device independent: the ops are called through the dispatcher, so every backend gets this autograd.
// A backward that must itself be differentiable (double backward) is composed of differentiable ops;
// otherwise it calls the kernels directly, below the autograd layer.
#include <ATen/TensorOperators.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include "autograd_node.h"
#include "checks.h"
#include "cpu/chunks.h"

namespace dro_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptDouble = std::optional<double>;

at::Tensor psi_star_terms(const at::Tensor& losses, const at::Tensor& eta, const at::Tensor& multiplier,
                          double lam, c10::string_view divergence, OptDouble alpha, OptDouble k, double scale,
                          int64_t order) {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                      c10::string_view, OptDouble, OptDouble, double, int64_t)>(
      "dro_ext::psi_star_terms");
  return op.call(losses, eta, multiplier, lam, divergence, alpha, k, scale, order);
}

// The divergence arguments every op shares, kept in the autograd context between forward and backward.
struct DivergenceArgs {
  double lam;
  std::string divergence;
  OptDouble alpha, k;
  double scale;

  void save(AutogradContext* ctx) const {
    ctx->saved_data["lam"] = lam;
    ctx->saved_data["divergence"] = divergence;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["k"] = k;
    ctx->saved_data["scale"] = scale;
  }
  static DivergenceArgs load(AutogradContext* ctx) {
    auto opt = [&](const char* key) {
      const c10::IValue& v = ctx->saved_data[key];
      return v.isNone() ? std::nullopt : OptDouble(v.toDouble());
    };
    return {ctx->saved_data["lam"].toDouble(), ctx->saved_data["divergence"].toStringRef(), opt("alpha"),
            opt("k"), ctx->saved_data["scale"].toDouble()};
  }
  at::Tensor terms(const at::Tensor& losses, const at::Tensor& eta, const at::Tensor& multiplier,
                   int64_t order) const {
    return psi_star_terms(losses, eta, multiplier, lam, divergence, alpha, k, scale, order);
  }
};

// dro_loss is the op of every training step, so its backward is a hand-written autograd Node, as PyTorch's
// generated code writes them, rather than a torch::autograd::Function: at a few thousand samples the
// generic Function's bookkeeping (per-input VariableInfo, output wrapping, saved_data hashing) is a visible
// share of the step.
struct DROLossBackward final : public torch::autograd::Node {
  torch::autograd::SavedVariable losses, eta, mean_weight;
  DivergenceArgs args;

  std::string name() const override { return "DROLossBackward"; }

  void release_variables() override {
    losses.reset_data();
    eta.reset_data();
    mean_weight.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const at::Tensor saved_losses = losses.unpack(), saved_eta = eta.unpack();
    const at::Tensor saved_mean_weight = mean_weight.unpack();
    const at::Tensor& grad = grads[0];
    variable_list out(2);
    if (!grad.defined()) return out;  // no gradient flows into the loss: none flows out
    at::Tensor grad_losses, grad_eta;
    if (!at::GradMode::is_enabled()) {
      static auto backward_op = find_op<std::tuple<at::Tensor, at::Tensor>(
          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, c10::string_view,
          OptDouble, OptDouble, double)>("dro_ext::dro_loss_backward");
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(grad_losses, grad_eta) = backward_op.call(grad, saved_losses, saved_eta, saved_mean_weight, args.lam,
                                                         args.divergence, args.alpha, args.k, args.scale);
    } else {
      // Double backward: build the gradient from differentiable ops, recomputing the weights (the saved
      // mean weight is a constant to autograd).
      const auto acc = saved_mean_weight.scalar_type();
      const at::Tensor weights =
          args.terms(saved_losses, saved_eta, at::ones({}, saved_losses.options().dtype(acc)), 1);
      // Both reductions in a fixed order, so that a second backward does not depend on the thread count: the mean
      // weight, and the sum that the product's backward takes over the broadcast grad / N.
      const double n = static_cast<double>(saved_losses.size(0));
      grad_losses = weights * cpu::fixed_order_broadcast(grad.to(acc) / n, weights);
      grad_eta = grad.to(acc) * (args.scale * (1.0 - cpu::fixed_order_sum(weights, acc) / n));
      grad_losses = grad_losses.to(saved_losses.scalar_type());
    }
    if (should_compute_output(0)) out[0] = std::move(grad_losses);
    if (should_compute_output(1)) out[1] = grad_eta.to(saved_eta.scalar_type());
    return out;
  }
};

// The robust objective is a training loss as well (the exact worst case of every batch): the same hand-written
// Node as DROLossBackward, for the same reason.
struct RobustObjectiveBackward final : public torch::autograd::Node {
  torch::autograd::SavedVariable losses, eta_star;
  double lam = 0.0;
  std::string divergence;
  OptDouble alpha, k;

  std::string name() const override { return "RobustObjectiveBackward"; }

  void release_variables() override {
    losses.reset_data();
    eta_star.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    static auto weights_op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double, c10::string_view,
                                                OptDouble, OptDouble)>("dro_ext::robust_weights");
    const at::Tensor saved_losses = losses.unpack(), saved_eta = eta_star.unpack();
    const at::Tensor& grad = grads[0];
    variable_list out(1);
    if (!grad.defined() || !should_compute_output(0)) return out;
    at::Tensor weights = [&] {
      at::AutoDispatchBelowADInplaceOrView guard;
      return weights_op.call(saved_losses, saved_eta, lam, divergence, alpha, k);
    }();
    const at::Tensor scale = grad.to(weights.scalar_type());
    if (at::GradMode::is_enabled() && saved_losses.requires_grad()) {
      // A backward that records (create_graph=True): the weights' own derivative is not implemented, so a second
      // backward through them raises instead of treating them as constants.
      auto not_implemented = make_node<torch::autograd::NotImplemented>("dro_ext::robust_objective's backward");
      not_implemented->set_next_edges(torch::autograd::collect_next_edges(saved_losses));
      torch::autograd::set_history(weights, not_implemented);
      out[0] = weights * scale;
    } else {
      // The weights are this call's own: scaled where they lie, the backward holds one N-vector, not two.
      out[0] = weights.mul_(scale);
    }
    return out;
  }
};

class PsiStarTermsFunction : public torch::autograd::Function<PsiStarTermsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& losses, const at::Tensor& eta,
                               const at::Tensor& multiplier, double lam, c10::string_view divergence,
                               OptDouble alpha, OptDouble k, double scale, int64_t order) {
    at::Tensor out = [&] {
      at::AutoDispatchBelowADInplaceOrView guard;
      return psi_star_terms(losses, eta, multiplier, lam, divergence, alpha, k, scale, order);
    }();
    ctx->save_for_backward({losses, eta, multiplier});
    DivergenceArgs{lam, std::string(divergence), alpha, k, scale}.save(ctx);
    ctx->saved_data["order"] = order;
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &losses = saved[0], &eta = saved[1], &multiplier = saved[2];
    const DivergenceArgs args = DivergenceArgs::load(ctx);
    const int64_t order = ctx->saved_data["order"].toInt();
    const at::Tensor& grad = grads[0];
    const auto acc = accumulate_type(losses.scalar_type());
    const BelowAutogradUnlessRecording below_autograd;

    at::Tensor grad_losses, grad_eta, grad_multiplier;
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(1)) {
      TORCH_CHECK(order < 2, "dro_ext: derivatives of psi* beyond the second are not implemented");
      const at::Tensor slope = args.terms(losses, eta, multiplier / args.lam, order + 1);
      const at::Tensor grad_slope = grad * slope;
      if (ctx->needs_input_grad(0)) grad_losses = grad_slope;
      if (ctx->needs_input_grad(1)) {
        grad_eta = (-args.scale * cpu::fixed_order_sum(grad_slope, acc)).to(eta.scalar_type());
      }
    }
    if (ctx->needs_input_grad(2)) {
      const at::Tensor terms = args.terms(losses, eta, at::ones({}, multiplier.options()), order);
      grad_multiplier = cpu::fixed_order_sum(grad * terms, acc).to(multiplier.scalar_type());
    }
    return {grad_losses, grad_eta, grad_multiplier, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> dro_loss_autograd(const at::Tensor& losses, const at::Tensor& eta, double lam,
                                                     c10::string_view divergence, OptDouble alpha, OptDouble k,
                                                     double scale) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double,
                                                              c10::string_view, OptDouble, OptDouble, double)>(
      "dro_ext::dro_loss");
  TORCH_CHECK(!torch::autograd::isFwGradDefined(losses) && !torch::autograd::isFwGradDefined(eta),
              "dro_ext: forward-mode AD is not implemented for dro_loss; use the fallback "
              "(DRO_EXT_FORCE_PYTHON=1) for forward-mode derivatives");
  auto [value, mean_weight] = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(losses, eta, lam, divergence, alpha, k, scale);
  }();
  if (torch::autograd::compute_requires_grad(losses, eta)) {
    auto node = make_node<DROLossBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(losses, eta));
    node->losses = torch::autograd::SavedVariable(losses, /*is_output=*/false);
    node->eta = torch::autograd::SavedVariable(eta, /*is_output=*/false);
    node->mean_weight = torch::autograd::SavedVariable(mean_weight, /*is_output=*/false);
    node->args = DivergenceArgs{lam, std::string(divergence), alpha, k, scale};
    // Only the value is differentiable; mean_weight gets no history.
    torch::autograd::set_history(value, node);
  }
  return {value, mean_weight};
}

std::tuple<at::Tensor, at::Tensor> robust_objective_autograd(const at::Tensor& losses, double lam,
                                                             c10::string_view divergence, OptDouble alpha,
                                                             OptDouble k) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, double, c10::string_view, OptDouble,
                                                              OptDouble)>("dro_ext::robust_objective");
  TORCH_CHECK(!torch::autograd::isFwGradDefined(losses),
              "dro_ext: forward-mode AD is not implemented for robust_objective");
  auto [value, eta_star] = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(losses, lam, divergence, alpha, k);
  }();
  if (torch::autograd::compute_requires_grad(losses)) {
    auto node = make_node<RobustObjectiveBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(losses));
    node->losses = torch::autograd::SavedVariable(losses, /*is_output=*/false);
    node->eta_star = torch::autograd::SavedVariable(eta_star, /*is_output=*/false);
    node->lam = lam;
    node->divergence = std::string(divergence);
    node->alpha = alpha;
    node->k = k;
    // Only the value is differentiable; eta* gets no history.
    torch::autograd::set_history(value, node);
  }
  return {value, eta_star};
}

at::Tensor psi_star_terms_autograd(const at::Tensor& losses, const at::Tensor& eta, const at::Tensor& multiplier,
                                   double lam, c10::string_view divergence, OptDouble alpha, OptDouble k,
                                   double scale, int64_t order) {
  return PsiStarTermsFunction::apply(losses, eta, multiplier, lam, divergence, alpha, k, scale, order)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(dro_ext, Autograd, m) {
  m.impl("dro_loss", &dro_loss_autograd);
  m.impl("psi_star_terms", &psi_star_terms_autograd);
  m.impl("robust_objective", &robust_objective_autograd);
}

}  // namespace dro_ext
