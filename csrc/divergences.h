// The psi-divergence conjugates psi*(t) and their first two derivatives: the only copy of the math.
//
// Each divergence is a small functor whose methods are templates over the arithmetic type T, which is
// float or double on the host and on CUDA devices, and at::vec::Vectorized<float|double> in the CPU
// kernels. All elementary operations go through Math<T> so that the vector kernels can specialize it
// (csrc/cpu/vectorized_math.h) without a second copy of any formula.
//
// Conventions every functor honours (DESIGN.md section 1):
//  - NaN in t gives NaN in value, first and second: selects test "t > 0" and "t <= 0" separately, so a NaN
//    falls through both and is returned as itself.
//  - Nothing overflows in a lane that is later discarded: exponentials are evaluated at clamped arguments.
//  - psi*'(t) >= 0 and is non-decreasing; psi*'(0) == 1 for all of them.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace dro_ext {

enum class Divergence : int64_t {
  Chi2 = 0,
  KL = 1,
  CVaR = 2,
  KLCVaR = 3,
  CressieRead = 4,
  SmoothedCVaR = 5,
};

// Elementary operations on scalars. The vector specialization lives in csrc/cpu/vectorized_math.h.
template <typename T>
struct Math {
  static C10_HOST_DEVICE inline T constant(double c) { return static_cast<T>(c); }
  static C10_HOST_DEVICE inline T exp(T x) { return ::exp(x); }
  // log1p(x) for x in [0, 1] only, where a vector build may use a cheaper series (vectorized_math.h).
  static C10_HOST_DEVICE inline T log1p_unit(T x) { return ::log1p(x); }
  static C10_HOST_DEVICE inline T neg_abs(T x) { return -::fabs(x); }
  static C10_HOST_DEVICE inline T pow(T x, T y) { return ::pow(x, y); }
  // max(x, 0) that keeps NaN.
  static C10_HOST_DEVICE inline T relu(T x) { return x < T(0) ? T(0) : x; }
  // min(x, hi) that keeps NaN in x.
  static C10_HOST_DEVICE inline T min(T x, T hi) { return x > hi ? hi : x; }
  // x > 0 ? if_pos : (x <= 0 ? if_nonpos : x): the NaN-keeping select.
  static C10_HOST_DEVICE inline T select_positive(T x, T if_pos, T if_nonpos) {
    return x > T(0) ? if_pos : (x <= T(0) ? if_nonpos : x);
  }
  // x > 0 ? if_pos : otherwise, for an `otherwise` that is NaN wherever x is (one select fewer).
  static C10_HOST_DEVICE inline T if_positive(T x, T if_pos, T otherwise) { return x > T(0) ? if_pos : otherwise; }
};

// psi(s) = (s - 1)^2 (see the erratum in DESIGN.md): psi*(t) = -1 + (t + 2)_+^2 / 4.
template <typename acc_t>
struct Chi2 {
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    T u = M::relu(t + M::constant(2.0));
    return u * u * M::constant(0.25) - M::constant(1.0);
  }
  template <typename T>
  C10_HOST_DEVICE inline T first(T t) const {
    using M = Math<T>;
    return M::relu(t + M::constant(2.0)) * M::constant(0.5);
  }
  template <typename T>
  C10_HOST_DEVICE inline T second(T t) const {
    using M = Math<T>;
    return M::select_positive(t + M::constant(2.0), M::constant(0.5), M::constant(0.0));
  }
};

// psi(s) = s log s - s + 1: psi*(t) = e^t - 1. Overflows to inf for t above ~88 (float) / ~709 (double);
// the robust objective uses the logsumexp closed form instead. value() is written as exp(t) - 1 rather
// than expm1(t) so that a kernel computing value and first shares one exponential (the absolute error,
// which is what a mean over samples sees, is the same).
template <typename acc_t>
struct KL {
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    return M::exp(t) - M::constant(1.0);
  }
  template <typename T>
  C10_HOST_DEVICE inline T first(T t) const { return Math<T>::exp(t); }
  template <typename T>
  C10_HOST_DEVICE inline T second(T t) const { return Math<T>::exp(t); }
};

// psi(s) = indicator of [0, 1/alpha]: psi*(t) = (t)_+ / alpha, subgradient 0 at t == 0.
template <typename acc_t>
struct CVaR {
  acc_t inv_alpha;
  C10_HOST_DEVICE explicit CVaR(double alpha) : inv_alpha(static_cast<acc_t>(1.0 / alpha)) {}
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    return M::relu(t) * M::constant(inv_alpha);
  }
  template <typename T>
  C10_HOST_DEVICE inline T first(T t) const {
    using M = Math<T>;
    return M::select_positive(t, M::constant(inv_alpha), M::constant(0.0));
  }
  template <typename T>
  C10_HOST_DEVICE inline T second(T t) const {
    using M = Math<T>;
    return M::select_positive(t, M::constant(0.0), M::constant(0.0));
  }
};

// psi(s) = s log s - s + 1 on [0, 1/alpha]: psi*(t) = e^t - 1 for t <= c = -log(alpha), and the tangent
// line at c beyond it (see the erratum in DESIGN.md). Written branch-free as
// exp(min(t, c)) - 1 + (t - c)_+ / alpha, which never evaluates exp above c (and shares that exponential
// with first()).
template <typename acc_t>
struct KLCVaR {
  acc_t cut;        // -log(alpha)
  acc_t inv_alpha;  // 1 / alpha == exp(cut)
  C10_HOST_DEVICE explicit KLCVaR(double alpha)
      : cut(static_cast<acc_t>(-::log(alpha))), inv_alpha(static_cast<acc_t>(1.0 / alpha)) {}
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    T c = M::constant(cut);
    return M::exp(M::min(t, c)) - M::constant(1.0) + M::relu(t - c) * M::constant(inv_alpha);
  }
  template <typename T>
  C10_HOST_DEVICE inline T first(T t) const {
    using M = Math<T>;
    return M::exp(M::min(t, M::constant(cut)));
  }
  template <typename T>
  C10_HOST_DEVICE inline T second(T t) const {
    using M = Math<T>;
    T c = M::constant(cut);
    return M::select_positive(t - c, M::constant(0.0), M::exp(M::min(t, c)));
  }
};

// psi(s) = (s^k - k s + k - 1) / (k (k - 1)), k > 1: with u = ((k-1) t + 1)_+,
// psi*(t) = (u^(k/(k-1)) - 1) / k, psi*'(t) = u^(1/(k-1)), psi*''(t) = u^((2-k)/(k-1)) for u > 0, else 0.
// u^(k/(k-1)) is computed as u * u^(1/(k-1)), which shares the power with first().
template <typename acc_t>
struct CressieRead {
  acc_t k_minus_1;
  acc_t inv_k;
  acc_t first_power;   // 1 / (k - 1)
  acc_t second_power;  // (2 - k) / (k - 1)
  C10_HOST_DEVICE explicit CressieRead(double k)
      : k_minus_1(static_cast<acc_t>(k - 1.0)),
        inv_k(static_cast<acc_t>(1.0 / k)),
        first_power(static_cast<acc_t>(1.0 / (k - 1.0))),
        second_power(static_cast<acc_t>((2.0 - k) / (k - 1.0))) {}
  template <typename T>
  C10_HOST_DEVICE inline T base(T t) const {
    using M = Math<T>;
    return t * M::constant(k_minus_1) + M::constant(1.0);
  }
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    T u = M::relu(base(t));
    return (u * M::pow(u, M::constant(first_power)) - M::constant(1.0)) * M::constant(inv_k);
  }
  template <typename T>
  C10_HOST_DEVICE inline T first(T t) const {
    using M = Math<T>;
    return M::pow(M::relu(base(t)), M::constant(first_power));
  }
  template <typename T>
  C10_HOST_DEVICE inline T second(T t) const {
    using M = Math<T>;
    T u = base(t);
    // Clamp before pow so the discarded lane never computes 0^negative.
    T safe_u = M::select_positive(u, u, M::constant(1.0));
    return M::select_positive(u, M::pow(safe_u, M::constant(second_power)), M::constant(0.0));
  }
};

// The paper's smoothed CVaR (eq. 3.3): psi*(t) = log(1 - alpha + alpha e^t) / alpha, evaluated as
// (log(1 - alpha) + softplus(s)) / alpha with s = t + log(alpha / (1 - alpha)), which neither overflows
// for large t nor loses the small-t tail; psi*'(t) = sigmoid(s) / alpha.
template <typename acc_t>
struct SmoothedCVaR {
  acc_t shift;          // log(alpha / (1 - alpha))
  acc_t log1m_alpha;    // log(1 - alpha)
  acc_t inv_alpha;
  C10_HOST_DEVICE explicit SmoothedCVaR(double alpha)
      : shift(static_cast<acc_t>(::log(alpha) - ::log1p(-alpha))),
        log1m_alpha(static_cast<acc_t>(::log1p(-alpha))),
        inv_alpha(static_cast<acc_t>(1.0 / alpha)) {}
  // exp(-|s|), the one exponential that both softplus(s) and sigmoid(s) need.
  template <typename T>
  C10_HOST_DEVICE inline T exp_neg_abs(T s) const {
    using M = Math<T>;
    return M::exp(M::neg_abs(s));
  }
  // sigmoid(s) = 1 / (1 + e) for s > 0 and e / (1 + e) otherwise, with e = exp(-|s|): never overflows.
  // A NaN s makes e NaN, so the cheaper select keeps it.
  template <typename T>
  C10_HOST_DEVICE inline T sigmoid(T s) const {
    using M = Math<T>;
    T e = exp_neg_abs(s);
    return M::if_positive(s, M::constant(1.0), e) / (M::constant(1.0) + e);
  }
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    return value_linear(t) + M::log1p_unit(exp_neg_abs(t + M::constant(shift))) * M::constant(inv_alpha);
  }
  // value(t) == value_linear(t) + log(value_log_factor(t)) * value_log_weight(), the factor in [1, 2]: a reduction
  // may sum the linear part, multiply the factors over a block and take one logarithm per block instead of
  // one log1p per sample (csrc/cpu/kernels_impl.h does).
  static constexpr bool kValueHasLogFactor = true;
  template <typename T>
  C10_HOST_DEVICE inline T value_linear(T t) const {
    using M = Math<T>;
    return (M::constant(log1m_alpha) + M::relu(t + M::constant(shift))) * M::constant(inv_alpha);
  }
  template <typename T>
  C10_HOST_DEVICE inline T value_log_factor(T t) const {
    using M = Math<T>;
    return M::constant(1.0) + exp_neg_abs(t + M::constant(shift));
  }
  C10_HOST_DEVICE inline acc_t value_log_weight() const { return inv_alpha; }
  template <typename T>
  C10_HOST_DEVICE inline T first(T t) const {
    using M = Math<T>;
    return sigmoid(t + M::constant(shift)) * M::constant(inv_alpha);
  }
  template <typename T>
  C10_HOST_DEVICE inline T second(T t) const {
    using M = Math<T>;
    T p = sigmoid(t + M::constant(shift));
    return p * (M::constant(1.0) - p) * M::constant(inv_alpha);
  }
};

// The parameters a divergence was asked for; only the ones it uses are read.
struct DivergenceSpec {
  Divergence kind;
  double alpha;
  double k;
};

// Calls f(functor) with the functor of spec.kind, so that kernels are instantiated once per divergence
// and the per-element loop carries no switch.
template <typename acc_t, typename F>
C10_HOST_DEVICE inline auto visit_divergence(const DivergenceSpec& spec, F&& f) {
  switch (spec.kind) {
    case Divergence::KL:
      return f(KL<acc_t>{});
    case Divergence::CVaR:
      return f(CVaR<acc_t>(spec.alpha));
    case Divergence::KLCVaR:
      return f(KLCVaR<acc_t>(spec.alpha));
    case Divergence::CressieRead:
      return f(CressieRead<acc_t>(spec.k));
    case Divergence::SmoothedCVaR:
      return f(SmoothedCVaR<acc_t>(spec.alpha));
    case Divergence::Chi2:
    default:
      return f(Chi2<acc_t>{});
  }
}

}  // namespace dro_ext
