// Argument checks shared by every op and device: each failure names the argument and the allowed range.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <limits>
#include <string>

#include "divergences.h"
#include "floating_types.h"

namespace dro_ext {

inline DivergenceSpec parse_divergence(const std::string& name, std::optional<double> alpha, std::optional<double> k) {
  // A parameter the divergence does not take is an error, not silently ignored (it is likely a mistake
  // about which divergence runs).
  auto takes_no = [&](const char* arg, const std::optional<double>& value) {
    TORCH_CHECK_VALUE(!value.has_value(), "dro_ext: divergence '", name, "' takes no ", arg, ", got ", arg, "=",
                      value.value_or(0.0), "; pass ", arg, "=None");
  };
  const bool known = name == "chi2" || name == "kl" || name == "cvar" || name == "kl_cvar" ||
                     name == "smoothed_cvar" || name == "cressie_read";
  if (known) {
    if (name != "cvar" && name != "kl_cvar" && name != "smoothed_cvar") takes_no("alpha", alpha);
    if (name != "cressie_read") takes_no("k", k);
  }
  auto need_alpha = [&](Divergence kind) {
    TORCH_CHECK_VALUE(alpha.has_value(), "dro_ext: divergence '", name,
                      "' needs alpha in [1e-30, 1), got alpha=None");
    // 1/alpha and alpha itself must stay normal float32 numbers, with room to spare (dro_ext/_divergences.py).
    constexpr double kMinAlpha = 1e-30;
    TORCH_CHECK_VALUE(*alpha >= kMinAlpha && *alpha < 1.0, "dro_ext: alpha must be in [1e-30, 1) for divergence '",
                      name, "', got alpha=", *alpha);
    return DivergenceSpec{kind, *alpha, 0.0};
  };
  if (name == "chi2") return DivergenceSpec{Divergence::Chi2, 0.0, 0.0};
  if (name == "kl") return DivergenceSpec{Divergence::KL, 0.0, 0.0};
  if (name == "cvar") return need_alpha(Divergence::CVaR);
  if (name == "kl_cvar") return need_alpha(Divergence::KLCVaR);
  if (name == "smoothed_cvar") return need_alpha(Divergence::SmoothedCVaR);
  if (name == "cressie_read") {
    TORCH_CHECK_VALUE(k.has_value(), "dro_ext: divergence 'cressie_read' needs k > 1, got k=None");
    TORCH_CHECK_VALUE(*k > 1.0 && std::isfinite(*k), "dro_ext: k must be a finite number > 1 for divergence "
                      "'cressie_read', got k=", *k);
    return DivergenceSpec{Divergence::CressieRead, 0.0, *k};
  }
  TORCH_CHECK_VALUE(false, "dro_ext: unknown divergence '", name,
                    "'; expected one of chi2, kl, cvar, kl_cvar, cressie_read, smoothed_cvar");
}

inline void check_positive(const char* arg, double value) {
  TORCH_CHECK_VALUE(value > 0.0 && std::isfinite(value), "dro_ext: ", arg, " must be a finite number > 0, got ",
                    arg, "=", value);
}

// lam no smaller than float64's smallest normal number, whose reciprocal is finite: the kernels multiply by 1/lam,
// and a subnormal lam's is inf (t = 0 * inf was NaN at a loss equal to the shift). dro_ext._divergences' check_lam.
inline void check_lam(double lam) {
  TORCH_CHECK_VALUE(lam >= std::numeric_limits<double>::min() && std::isfinite(lam),
                    "dro_ext: lam must be a finite number > 0 (and no smaller than 2.2250738585072014e-308, "
                    "float64's smallest normal number), got lam=", lam);
}

// The arguments every loss op takes after the tensors: lam (check_lam) and a valid divergence with its parameters.
inline DivergenceSpec check_divergence_args(double lam, c10::string_view divergence, std::optional<double> alpha,
                                            std::optional<double> k) {
  check_lam(lam);
  return parse_divergence(std::string(divergence), alpha, k);
}

inline void check_losses(const at::Tensor& losses) {
  TORCH_CHECK_VALUE(losses.dim() == 1, "dro_ext: losses must be a 1-D tensor of per-sample losses, got shape ",
                    losses.sizes());
  TORCH_CHECK_VALUE(losses.numel() > 0, "dro_ext: losses must not be empty");
  TORCH_CHECK_TYPE(is_kernel_floating_type(losses.scalar_type()),
                    "dro_ext: losses must have a floating dtype (float16, bfloat16, float32, float64), got ",
                    losses.scalar_type());
}

// A 0-d floating tensor on the device of `beside` (the op's main tensor, named beside_name in the message).
inline void check_scalar_tensor(const char* arg, const at::Tensor& value, const at::Tensor& beside,
                                const char* beside_name = "losses") {
  TORCH_CHECK_VALUE(value.dim() == 0, "dro_ext: ", arg, " must be a 0-d tensor, got shape ", value.sizes());
  TORCH_CHECK_TYPE(is_kernel_floating_type(value.scalar_type()), "dro_ext: ", arg, " must have a floating dtype, got ",
                    value.scalar_type());
  TORCH_CHECK_VALUE(value.device() == beside.device(), "dro_ext: ", arg, " is on ", value.device(), " but ",
                    beside_name, " is on ", beside.device(), "; move them to the same device");
}

inline void check_order(int64_t order) {
  TORCH_CHECK_VALUE(order >= 0 && order <= 2, "dro_ext: order must be 0, 1 or 2, got order=", order);
}

// The checks of each op over the losses, one function per op, called by its CPU and CUDA kernels alike;
// each returns the parsed divergence.

inline DivergenceSpec check_dro_loss_args(const at::Tensor& losses, const at::Tensor& eta, double lam,
                                          c10::string_view divergence, std::optional<double> alpha,
                                          std::optional<double> k, double scale) {
  check_losses(losses);
  check_scalar_tensor("eta", eta, losses);
  check_positive("scale", scale);
  return check_divergence_args(lam, divergence, alpha, k);
}

inline DivergenceSpec check_dro_loss_backward_args(const at::Tensor& grad, const at::Tensor& losses,
                                                   const at::Tensor& eta, const at::Tensor& mean_weight, double lam,
                                                   c10::string_view divergence, std::optional<double> alpha,
                                                   std::optional<double> k, double scale) {
  check_losses(losses);
  check_scalar_tensor("grad", grad, losses);
  check_scalar_tensor("eta", eta, losses);
  check_scalar_tensor("mean_weight", mean_weight, losses);
  check_positive("scale", scale);
  return check_divergence_args(lam, divergence, alpha, k);
}

// psi_star_terms also takes empty or N-d losses (it is elementwise).
inline DivergenceSpec check_psi_star_terms_args(const at::Tensor& losses, const at::Tensor& eta,
                                                const at::Tensor& multiplier, double lam, c10::string_view divergence,
                                                std::optional<double> alpha, std::optional<double> k, double scale,
                                                int64_t order) {
  TORCH_CHECK_TYPE(is_kernel_floating_type(losses.scalar_type()),
                    "dro_ext: losses must have a floating dtype, got ", losses.scalar_type());
  check_scalar_tensor("eta", eta, losses);
  check_scalar_tensor("multiplier", multiplier, losses);
  check_positive("scale", scale);
  check_order(order);
  return check_divergence_args(lam, divergence, alpha, k);
}

inline DivergenceSpec check_robust_weights_args(const at::Tensor& losses, const at::Tensor& eta_star, double lam,
                                                c10::string_view divergence, std::optional<double> alpha,
                                                std::optional<double> k) {
  check_losses(losses);
  check_scalar_tensor("eta_star", eta_star, losses);
  return check_divergence_args(lam, divergence, alpha, k);
}

// weight_stats: 1-D floating weights and, when given, int32/int64 group ids beside them in [0, num_groups)
// (the range is checked by the kernels, which read the ids). Returns the ids as a contiguous int64 tensor, or
// an undefined tensor without groups.
inline at::Tensor check_weight_stats_args(const at::Tensor& weights, const std::optional<at::Tensor>& groups,
                                          int64_t num_groups) {
  TORCH_CHECK_VALUE(weights.dim() == 1, "dro_ext: weights must be a 1-D tensor, got shape ", weights.sizes());
  TORCH_CHECK_VALUE(weights.numel() > 0, "dro_ext: weights must not be empty");
  TORCH_CHECK_TYPE(is_kernel_floating_type(weights.scalar_type()), "dro_ext: weights must have a floating dtype, got ",
                    weights.scalar_type());
  if (!groups.has_value()) return at::Tensor();
  TORCH_CHECK_VALUE(num_groups > 0, "dro_ext: num_groups must be > 0, got num_groups=", num_groups);
  TORCH_CHECK_VALUE(groups->sizes() == weights.sizes(), "dro_ext: groups must have shape ", weights.sizes(),
                    ", got ", groups->sizes());
  TORCH_CHECK_VALUE(groups->device() == weights.device(), "dro_ext: groups is on ", groups->device(),
                    " but the weights are on ", weights.device());
  TORCH_CHECK_VALUE(groups->scalar_type() == at::kLong || groups->scalar_type() == at::kInt,
                    "dro_ext: groups must be an int64 or int32 tensor of group ids, got ", groups->scalar_type());
  return groups->to(at::kLong).contiguous();
}

// The dtype reductions accumulate in: float32 for half/bfloat16/float32, float64 for float64.
inline at::ScalarType accumulate_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Whether float32 kernels can form t = (x - shift) / lam as (x - shift) * inv_lam: 1/lam a normal float32. Else t is
// +-inf or 0 for every loss (NaN where x == shift).
inline bool float32_forms_t(double lam) {
  return std::isnormal(static_cast<float>(1.0 / lam));
}

// Whether an op over half/bfloat16/float32 x runs the float64 kernels on a copy of it, its results rounded to the
// outputs' dtypes: where float32 cannot form t (float32_forms_t), on the CPU and on CUDA alike. lam alone decides, so
// CUDA needs no host sync for it; float32 overflowing at a normal 1/lam (t past float32's range) needs a look at
// the losses or the result, which only the CPU kernels take.
inline bool runs_on_float64_copy(const at::Tensor& x, double lam) {
  return x.scalar_type() != at::kDouble && !float32_forms_t(lam);
}

}  // namespace dro_ext
