// Argument checks shared by every op and device: each failure names the argument and the allowed range.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <string>

#include "divergences.h"

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
    TORCH_CHECK_VALUE(alpha.has_value(), "dro_ext: divergence '", name, "' needs alpha in (0, 1), got alpha=None");
    TORCH_CHECK_VALUE(*alpha > 0.0 && *alpha < 1.0, "dro_ext: alpha must be in (0, 1) for divergence '", name,
                      "', got alpha=", *alpha);
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

// The arguments every loss op takes after the tensors: lam > 0 and a valid divergence with its parameters.
inline DivergenceSpec check_divergence_args(double lam, c10::string_view divergence, std::optional<double> alpha,
                                            std::optional<double> k) {
  check_positive("lam", lam);
  return parse_divergence(std::string(divergence), alpha, k);
}

inline void check_losses(const at::Tensor& losses) {
  TORCH_CHECK_VALUE(losses.dim() == 1, "dro_ext: losses must be a 1-D tensor of per-sample losses, got shape ",
                    losses.sizes());
  TORCH_CHECK_VALUE(losses.numel() > 0, "dro_ext: losses must not be empty");
  TORCH_CHECK_TYPE(at::isFloatingType(losses.scalar_type()),
                    "dro_ext: losses must have a floating dtype (float16, bfloat16, float32, float64), got ",
                    losses.scalar_type());
}

// A 0-d floating tensor on the device of `losses`.
inline void check_scalar_tensor(const char* arg, const at::Tensor& value, const at::Tensor& losses) {
  TORCH_CHECK_VALUE(value.dim() == 0, "dro_ext: ", arg, " must be a 0-d tensor, got shape ", value.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(value.scalar_type()), "dro_ext: ", arg, " must have a floating dtype, got ",
                    value.scalar_type());
  TORCH_CHECK_VALUE(value.device() == losses.device(), "dro_ext: ", arg, " is on ", value.device(),
                    " but losses is on ", losses.device(), "; move them to the same device");
}

inline void check_order(int64_t order) {
  TORCH_CHECK_VALUE(order >= 0 && order <= 2, "dro_ext: order must be 0, 1 or 2, got order=", order);
}

// The dtype reductions accumulate in: float32 for half/bfloat16/float32, float64 for float64.
inline at::ScalarType accumulate_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace dro_ext
