// The psi-divergence conjugates psi*(t) and their first two derivatives: the only copy of the math.
//
// Each divergence is a small functor whose methods are templates over the arithmetic type T, which is
// float or double on the host and on CUDA devices, and at::vec::Vectorized<float|double> in the CPU
// kernels. All elementary operations go through Math<T> so that the vector kernels can specialize it
// (csrc/cpu/vectorized_math.h) without a second copy of any formula.
//
// Conventions every functor honours (docs/design.md section 1.5):
//  - NaN in t gives NaN in value, first, second, excess and excess_first: selects test "t > 0" and
//    "t <= 0" separately, so a NaN falls through both and is returned as itself.
//  - A lane that a select discards may hold inf or NaN (cressie_read's log1p(a t) at a t <= -1); no
//    arithmetic combines it with a kept lane. Exponentials of kept lanes are evaluated at clamped arguments.
//  - psi*'(t) >= 0 and is non-decreasing; psi*'(0) == 1 for all of them.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <limits>

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
  // e^x - 1 and log(1 + x) with a small relative error for small |x| (where exp(x) - 1 and log(1 + x)
  // lose every digit): the excess terms below are built from them.
  static C10_HOST_DEVICE inline T expm1(T x) { return ::expm1(x); }
  static C10_HOST_DEVICE inline T log1p(T x) { return ::log1p(x); }
  static C10_HOST_DEVICE inline T log(T x) { return ::log(x); }
  // a / b for b bounded away from 0 and infinity, where a vector build may divide through a reciprocal
  // estimate (a vector division costs as much as a dozen multiply-adds).
  static C10_HOST_DEVICE inline T divide(T a, T b) { return a / b; }
  // a b + c. The host compiles with -ffp-contract=off (the same bits on any thread count: setup.py), so a scalar
  // a * b + c rounds twice there, as in the portable vector build; the SIMD builds fuse it into one FMA
  // (vectorized_math.h), and nvcc contracts it on the device as it does every a * b + c. Asked for by name in the
  // terms that are a few arithmetic operations (cressie_read's integer powers, kl_cvar's linear part), where the
  // FMAs that the flag took from the compiler were a visible share of a pass.
  static C10_HOST_DEVICE inline T fmadd(T a, T b, T c) { return a * b + c; }
  static C10_HOST_DEVICE inline T neg_abs(T x) { return -::fabs(x); }
  // max(x, 0) that keeps NaN.
  static C10_HOST_DEVICE inline T relu(T x) { return x < T(0) ? T(0) : x; }
  // max(x, lo) that keeps NaN in x.
  static C10_HOST_DEVICE inline T max(T x, T lo) { return x < lo ? lo : x; }
  // min(x, hi) that keeps NaN in x.
  static C10_HOST_DEVICE inline T min(T x, T hi) { return x > hi ? hi : x; }
  // x > 0 ? if_pos : (x <= 0 ? if_nonpos : x): the NaN-keeping select.
  static C10_HOST_DEVICE inline T select_positive(T x, T if_pos, T if_nonpos) {
    return x > T(0) ? if_pos : (x <= T(0) ? if_nonpos : x);
  }
  // x > 0 ? if_pos : otherwise, for an `otherwise` that is NaN wherever x is (one select fewer).
  static C10_HOST_DEVICE inline T if_positive(T x, T if_pos, T otherwise) { return x > T(0) ? if_pos : otherwise; }
  // select_positive(x, if_pos, make_if_nonpos()) with make_if_nonpos called only where it is taken (a vector: where
  // any lane takes it), for a slow form that few elements need: they cost nothing where none does.
  template <typename F>
  static C10_HOST_DEVICE inline T select_positive_rare(T x, T if_pos, F make_if_nonpos) {
    return x > T(0) ? if_pos : (x <= T(0) ? make_if_nonpos() : x);
  }
};

// Every functor below has, for its arithmetic type T:
//   value(t)         psi*(t)
//   first(t)         psi*'(t)            (the per-sample weight; >= 0, non-decreasing, psi*'(0) = 1)
//   second(t)        psi*''(t)
//   excess(t)        psi*(t) - t         (>= 0 by convexity, with psi*(0) = 0 and psi*'(0) = 1)
//   excess_first(t)  psi*'(t) - 1        (the derivative of excess)
// excess and excess_first are accurate to a few roundings of |t| + excess(t) (resp. |t| + |excess_first(t)|)
// however small t is: a loss formed as mean_i l_i + lam * mean_i excess(t_i) then keeps its precision as
// lam grows (t = (l - G eta)/lam -> 0, the ERM limit), where lam * psi*(t) + G eta would cancel
// catastrophically; and mean_i excess_first(t_i) = 0 is the optimality condition of eta with the same
// precision. value(t) is accurate relative to |psi*(t)| near t = 0 as well.
//   direct_below()   t_d = max(2 psi*(-inf), the top of psi*'s zero set) <= 0: psi*(t) >= t/2 for every t <= t_d,
//                    and every t of weight psi*'(t) = 0 lies at or below t_d. There a sample's share of the
//                    objective is best formed directly; above it, from the excess (penalized_value).
//
// The divergences whose accurate excess costs much more than value + first (the exponential ones: expm1,
// log1p) also have
//   coarse_value(t)   psi*(t) to a few roundings of 1 + |psi*(t)|, sharing its exponential with first(t)
//                     (or, where kCoarseValueAsProduct, its parts: see SmoothedCVaR),
// with which a reduction may form sum excess = sum coarse_value - sum t and sum excess_first = sum first - N
// over a block of samples whose mean |t| is at least 1 (there the two error bounds agree within a small
// factor; csrc/cpu/kernels_impl.h does). `kHasCoarseValue` says it exists.

// Runs. The CUDA multisection wants excess_first of every loss at K equally spaced points per pass,
// t_j = t_c - (j - c) d (j = 0..K-1, spacing d > 0 in t, c the run's center). Where psi*' is exponential in t
// the K values follow from ONE exponential per loss, since e^(t_c - (j - c) d) = e^(t_c) e^(-(j - c) d):
//   expm1(t_j) = expm1(t_c) f_j + g_j  with  f_j = e^(-(j - c) d), g_j = expm1(-(j - c) d),
// one fused multiply-add per point from per-pass constants, instead of an expm1 per point (~25 instructions
// each on a GPU; the pass was compute-bound). Both terms are exact to a rounding or so, so the error does not
// grow along the run; it is at most ~eps max(1, f_j) |expm1(t_c)| on top of the direct one. A divergence with
// kHasExcessFirstRun has
//   run_fits<K>(d)           whether a run of spacing d keeps every product finite and that error small
//   run_table<K>(d)          the per-pass constants (formed in double, once per pass)
//   excess_first_run(t_c, table, out)   out[j] = excess_first(t_c - (j - c) d) to the accuracy above
// and callers evaluate excess_first point by point where run_fits is false (wide brackets, early passes).
template <typename acc_t, int K>
struct ExcessFirstRunTable {
  int center;        // c: the point whose t the caller forms from the loss
  acc_t step[K];     // (j - c) d: t_j = t_c - step[j]
  acc_t factor[K];   // e^(-+(j - c) d)
  acc_t offset[K];   // e^(-+(j - c) d) - 1
  acc_t clamp;       // the largest argument the run's one exponential is given
  // The table for exponent signs s * (j - c) d (s = -1: e^(t_j); s = +1: e^(-t_j)).
  C10_HOST_DEVICE ExcessFirstRunTable(int c, double d, double sign, double clamp_)
      : center(c), clamp(static_cast<acc_t>(clamp_)) {
    for (int j = 0; j < K; ++j) {
      const double x = static_cast<double>(j - c) * d;
      step[j] = static_cast<acc_t>(x);
      factor[j] = static_cast<acc_t>(::exp(sign * x));
      offset[j] = static_cast<acc_t>(::expm1(sign * x));
    }
  }
};

// Arguments up to which exp(x) of the type stays finite with room for a factor of e^8.
template <typename acc_t>
C10_HOST_DEVICE constexpr double exp_headroom() {
  return sizeof(acc_t) == sizeof(float) ? 80.0 : 700.0;
}

// psi(s) = (s - 1)^2 (see the erratum in docs/design.md section 1.4): psi*(t) = -1 + (t + 2)_+^2 / 4, which is t + t^2/4
// for t > -2 and -1 below. With m = max(t, -2): psi*(t) = m (1 + m/4), psi*(t) - t = m^2/4 + (m - t) and
// psi*'(t) - 1 = m/2, each exact to a rounding or two (m - t is exact or 0).
template <typename acc_t>
struct Chi2 {
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    const T m = M::max(t, M::constant(-2.0));
    return m * (m * M::constant(0.25) + M::constant(1.0));
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
  template <typename T>
  C10_HOST_DEVICE inline T excess(T t) const {
    using M = Math<T>;
    const T m = M::max(t, M::constant(-2.0));
    return m * (m * M::constant(0.25)) + (m - t);  // m/4 first: m m overflows for m past sqrt(largest), m^2/4 later
  }
  template <typename T>
  C10_HOST_DEVICE inline T excess_first(T t) const {
    using M = Math<T>;
    return M::max(t, M::constant(-2.0)) * M::constant(0.5);
  }
  C10_HOST_DEVICE inline acc_t direct_below() const { return acc_t(-2); }  // psi*' = 0 there
};

// psi(s) = s log s - s + 1: psi*(t) = e^t - 1. Overflows to inf for t above ~88 (float) / ~709 (double);
// the robust objective uses the logsumexp closed form instead.
template <typename acc_t>
struct KL {
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const { return Math<T>::expm1(t); }
  template <typename T>
  C10_HOST_DEVICE inline T first(T t) const { return Math<T>::exp(t); }
  template <typename T>
  C10_HOST_DEVICE inline T second(T t) const { return Math<T>::exp(t); }
  // expm1(t) - t: its rounding error is that of expm1(t), a few roundings of |t| for small t.
  template <typename T>
  C10_HOST_DEVICE inline T excess(T t) const { return Math<T>::expm1(t) - t; }
  template <typename T>
  C10_HOST_DEVICE inline T excess_first(T t) const { return Math<T>::expm1(t); }
  C10_HOST_DEVICE inline acc_t direct_below() const { return acc_t(-2); }  // 2 psi*(-inf)
  static constexpr bool kHasCoarseValue = true;
  C10_HOST_DEVICE inline bool coarse_ok() const { return true; }
  template <typename T>
  C10_HOST_DEVICE inline T coarse_value(T t) const {
    using M = Math<T>;
    return M::exp(t) - M::constant(1.0);
  }
};

// psi(s) = indicator of [0, 1/alpha]: psi*(t) = (t)_+ / alpha, subgradient 0 at t == 0.
template <typename acc_t>
struct CVaR {
  acc_t inv_alpha;
  acc_t inv_alpha_minus_1;  // 1/alpha - 1, the slope of the excess for t > 0
  C10_HOST_DEVICE explicit CVaR(double alpha)
      : inv_alpha(static_cast<acc_t>(1.0 / alpha)), inv_alpha_minus_1(static_cast<acc_t>((1.0 - alpha) / alpha)) {}
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
  // (t)_+ / alpha - t: t (1/alpha - 1) for t > 0 (to a rounding or two) and -t (exactly) otherwise.
  template <typename T>
  C10_HOST_DEVICE inline T excess(T t) const {
    using M = Math<T>;
    return M::relu(t) * M::constant(inv_alpha) - t;
  }
  template <typename T>
  C10_HOST_DEVICE inline T excess_first(T t) const {
    using M = Math<T>;
    return M::select_positive(t, M::constant(inv_alpha_minus_1), M::constant(-1.0));
  }
  C10_HOST_DEVICE inline acc_t direct_below() const { return acc_t(0); }  // psi*' = 0 for t <= 0
};

// psi(s) = s log s - s + 1 on [0, 1/alpha]: psi*(t) = e^t - 1 for t <= c = -log(alpha), and the tangent
// line at c beyond it (see the erratum in docs/design.md section 1.4). Written branch-free with m = min(t, c) as
// expm1(m) + (t - c)_+ / alpha, which never evaluates exp above c; since t - m = (t - c)_+, the excess is
// (expm1(m) - m) + (t - c)_+ (1/alpha - 1), and psi*'(t) - 1 = expm1(m) (= 1/alpha - 1 beyond c).
template <typename acc_t>
struct KLCVaR {
  acc_t cut;        // -log(alpha)
  acc_t inv_alpha;  // 1 / alpha == exp(cut)
  acc_t inv_alpha_minus_1;
  C10_HOST_DEVICE explicit KLCVaR(double alpha)
      : cut(static_cast<acc_t>(-::log(alpha))),
        inv_alpha(static_cast<acc_t>(1.0 / alpha)),
        inv_alpha_minus_1(static_cast<acc_t>((1.0 - alpha) / alpha)) {}
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    T c = M::constant(cut);
    return M::fmadd(M::relu(t - c), M::constant(inv_alpha), M::expm1(M::min(t, c)));
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
  template <typename T>
  C10_HOST_DEVICE inline T excess(T t) const {
    using M = Math<T>;
    T c = M::constant(cut);
    T m = M::min(t, c);
    return M::fmadd(M::relu(t - c), M::constant(inv_alpha_minus_1), M::expm1(m) - m);
  }
  template <typename T>
  C10_HOST_DEVICE inline T excess_first(T t) const {
    using M = Math<T>;
    return M::expm1(M::min(t, M::constant(cut)));
  }
  C10_HOST_DEVICE inline acc_t direct_below() const { return acc_t(-2); }  // 2 psi*(-inf)
  static constexpr bool kHasCoarseValue = true;
  C10_HOST_DEVICE inline bool coarse_ok() const { return true; }
  template <typename T>
  C10_HOST_DEVICE inline T coarse_value(T t) const {
    using M = Math<T>;
    T c = M::constant(cut);
    return M::fmadd(M::relu(t - c), M::constant(inv_alpha), M::exp(M::min(t, c)) - M::constant(1.0));
  }
  // The run (see ExcessFirstRunTable) from its first, largest point t_0: expm1(t_j) = expm1(t_0) e^(-j d) +
  // expm1(-j d), the factors at most 1, so the run's error is that of the one expm1 whatever d is. Points at
  // or past the cut take 1/alpha - 1; t_0 is clamped to cut + (K - 1) d, beyond which every point is past it,
  // so the exponential stays finite when that bound is inside the type's range (run_fits).
  static constexpr bool kHasExcessFirstRun = true;
  template <int K>
  C10_HOST_DEVICE inline bool run_fits(double d) const {
    const double top = static_cast<double>(cut) + (K - 1) * d;
    return top == top && top <= exp_headroom<acc_t>();
  }
  template <int K>
  C10_HOST_DEVICE inline ExcessFirstRunTable<acc_t, K> run_table(double d) const {
    return ExcessFirstRunTable<acc_t, K>(0, d, -1.0, static_cast<double>(cut) + (K - 1) * d);
  }
  template <int K>
  C10_HOST_DEVICE inline void excess_first_run(acc_t t0, const ExcessFirstRunTable<acc_t, K>& run,
                                               acc_t (&out)[K]) const {
    using M = Math<acc_t>;
    const acc_t base = M::expm1(M::min(t0, run.clamp));  // NaN stays NaN
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const acc_t t = t0 - run.step[j];
      // t >= cut fails for NaN, which takes the product: NaN as well.
      out[j] = t >= cut ? inv_alpha_minus_1 : base * run.factor[j] + run.offset[j];
    }
  }
};

// psi(s) = (s^k - k s + k - 1) / (k (k - 1)), k > 1. With a = k - 1, p = 1/a and u = 1 + a t:
//   psi*(t) = (u^(p+1) - 1) / k,  psi*'(t) = u^p,  psi*''(t) = u^(p-1)   for u > 0,
//   psi*(t) = -1/k,               psi*'(t) = psi*''(t) = 0                for u <= 0.
// The powers go through log1p and expm1: e = u^p - 1 = expm1(p log1p(a t)) keeps its relative precision
// for small t, and as k -> 1 (a -> 0, p log1p(a t) -> t) it tends to the KL conjugate's expm1(t), where
// pow(1 + a t, p) would round 1 + a t to 1. Then u^(p+1) - 1 = e + a t (1 + e), and
// psi*(t) - t = (e - t + a t e) / k (using k t = t + a t).
// kPower = 1 (k = 2, p = 1) and kPower = 2 (k = 3/2, p = 2) are integer powers of u and take a
// pure-arithmetic path; kPower = 0 is any k. visit_divergence picks the specialization from k. With
// m = max(t, -1/a) (u clamped at 0), as for chi2, no select is needed:
//   k = 2:    psi* = m (1 + m/2),          excess = m^2/2 + (m - t),             psi*' - 1 = m
//   k = 3/2:  psi* = m (v^2 + v + 1) / 3,  excess = m^2 (v + 2) / 6 + (m - t),   psi*' - 1 = m + m^2/4,
//             v = 1 + m/2.
template <typename acc_t, int kPower = 0>
struct CressieRead {
  acc_t k_minus_1;     // a
  acc_t inv_k;
  acc_t k_minus_1_over_k;  // a / k < 1 (see value)
  acc_t first_power;   // p = 1 / (k - 1)
  acc_t second_power;  // p - 1 = (2 - k) / (k - 1)
  acc_t flat_limit;    // max(2 psi*(-inf), -1/a) = max(-2/k, -1/(k - 1)) (see direct_below)
  acc_t log_floor;     // the acc_t just above -1 (see log_base)
  C10_HOST_DEVICE explicit CressieRead(double k)
      : k_minus_1(static_cast<acc_t>(k - 1.0)),
        inv_k(static_cast<acc_t>(1.0 / k)),
        k_minus_1_over_k(static_cast<acc_t>((k - 1.0) / k)),
        first_power(static_cast<acc_t>(1.0 / (k - 1.0))),
        second_power(static_cast<acc_t>((2.0 - k) / (k - 1.0))),
        flat_limit(static_cast<acc_t>(-2.0 / k > -1.0 / (k - 1.0) ? -2.0 / k : -1.0 / (k - 1.0))),
        log_floor(static_cast<acc_t>(-1.0 + (sizeof(acc_t) == sizeof(float) ? 0x1p-24 : 0x1p-53))) {}
  C10_HOST_DEVICE inline acc_t direct_below() const { return flat_limit; }
  template <typename T>
  C10_HOST_DEVICE inline T base(T t) const {
    using M = Math<T>;
    return M::fmadd(t, M::constant(k_minus_1), M::constant(1.0));
  }
  // log(u) = log1p(a t); only meaningful where u > 0 (every caller selects those lanes). The callers select on
  // base(t), a fused multiply-add in the SIMD builds and on the device, which can leave u > 0 where the product here
  // rounds to -1 itself: log1p(-1) is -inf there (psi*'' = inf for k > 2; the AVX2 float32 log1p returns a finite
  // value instead, and psi*' came out half its value). The floor makes it the log of the smallest u above 0 that
  // the product can tell from 0, as near the true one as the rounding of t lets any be.
  // Not handled: a t past the largest acc_t / a (k = 1000 at t = 1e306, k = 1e300 at t = 1e10), where u overflows
  // while u^p is a modest number, gives log(u) = inf (a weight of inf). log(a) + log(t) there, through
  // select_positive_rare, cost general k's passes 15% at 2^20 losses (measured side by side on a Xeon): no such t
  // is worth that to the range the README states.
  template <typename T>
  C10_HOST_DEVICE inline T log_base(T t) const {
    using M = Math<T>;
    return M::log1p(M::max(t * M::constant(k_minus_1), M::constant(log_floor)));
  }
  // u^p - 1 for u > 0.
  template <typename T>
  C10_HOST_DEVICE inline T power_minus_1(T t) const {
    using M = Math<T>;
    if constexpr (kPower == 1) {
      return t;
    } else if constexpr (kPower == 2) {
      return M::fmadd(t, t * M::constant(0.25), t);  // (1 + t/2)^2 - 1, t/4 first (t t overflows before t^2/4)
    } else {
      return M::expm1(log_base(t) * M::constant(first_power));
    }
  }
  // max(t, -1/a), where u = 1 + a t reaches 0 (k = 2 and k = 3/2 only).
  template <typename T>
  C10_HOST_DEVICE inline T clamped(T t) const {
    using M = Math<T>;
    return M::max(t, M::constant(kPower == 1 ? -1.0 : -2.0));
  }
  // The products below are divided (by k, 3, 6) only after the factor that keeps them in range: where psi*(t) is
  // finite near the largest acc_t, a product formed before its division is not (a t (1 + e) / k at k = 1000,
  // t = 1e306: a t overflows while psi* = 2.04e306). Each reassociation costs no operation.
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    if constexpr (kPower == 1) {
      const T m = clamped(t);
      return m * M::fmadd(m, M::constant(0.5), M::constant(1.0));
    } else if constexpr (kPower == 2) {
      // (u^3 - 1) / (3/2) = (t/2)(u^2 + u + 1) / (3/2)
      const T m = clamped(t);
      const T v = base(m);
      return m * ((M::fmadd(v, v, v) + M::constant(1.0)) * M::constant(1.0 / 3.0));
    } else {
      // (e + a t (1 + e)) / k = e / k + t ((a / k) (1 + e)), a / k < 1.
      const T inv_k_v = M::constant(inv_k);
      const T e = power_minus_1(t);
      const T grown = t * (M::constant(k_minus_1_over_k) * (e + M::constant(1.0)));
      return M::select_positive(base(t), e * inv_k_v + grown, -inv_k_v);
    }
  }
  template <typename T>
  C10_HOST_DEVICE inline T first(T t) const {
    using M = Math<T>;
    const T u = base(t);
    if constexpr (kPower == 1) {
      return M::relu(u);
    } else if constexpr (kPower == 2) {
      const T v = M::relu(u);
      return v * v;
    } else {
      return M::select_positive(u, M::exp(log_base(t) * M::constant(first_power)), M::constant(0.0));
    }
  }
  template <typename T>
  C10_HOST_DEVICE inline T second(T t) const {
    using M = Math<T>;
    const T u = base(t);
    if constexpr (kPower == 1) {
      return M::select_positive(u, M::constant(1.0), M::constant(0.0));
    } else if constexpr (kPower == 2) {
      return M::relu(u);
    } else {
      // exp((p - 1) log u): +inf as u -> 0+ when k > 2, as the power is; never evaluated at u <= 0.
      return M::select_positive(u, M::exp(log_base(t) * M::constant(second_power)), M::constant(0.0));
    }
  }
  template <typename T>
  C10_HOST_DEVICE inline T excess(T t) const {
    using M = Math<T>;
    if constexpr (kPower == 1) {
      const T m = clamped(t);
      return M::fmadd(m, m * M::constant(0.5), m - t);
    } else if constexpr (kPower == 2) {
      const T m = clamped(t);
      return M::fmadd(m, m * ((base(m) + M::constant(2.0)) * M::constant(1.0 / 6.0)), m - t);
    } else {
      // (e - t + a t e) / k = (e - t) / k + t ((a / k) e), as value.
      const T inv_k_v = M::constant(inv_k);
      const T e = power_minus_1(t);
      const T grown = t * (M::constant(k_minus_1_over_k) * e);
      return M::select_positive(base(t), (e - t) * inv_k_v + grown, -inv_k_v - t);
    }
  }
  template <typename T>
  C10_HOST_DEVICE inline T excess_first(T t) const {
    using M = Math<T>;
    if constexpr (kPower == 1 || kPower == 2) {
      return power_minus_1(clamped(t));
    } else {
      return M::select_positive(base(t), power_minus_1(t), M::constant(-1.0));
    }
  }
};

// The paper's smoothed CVaR (eq. 3.3): psi*(t) = log(1 - alpha + alpha e^t) / alpha = log1p(x) / alpha with
// x = alpha expm1(t). alpha may lie anywhere in (0, 1), however close to 0 or 1, so no form below computes
// 1 - alpha + ... as 1 + c m (which rounds to 0 when c m is near -1: alpha near 0 with t large, alpha near 1 with
// t very negative). With q = e^-|t| in [0, 1] and m = expm1(-|t|) = q - 1,
//   t > 0:   1 - alpha + alpha e^t = e^t (alpha + (1 - alpha) q)
//   t <= 0:  1 - alpha + alpha e^t = (1 - alpha) + alpha q
// both sums of positive terms: c1 + c2 q with (c1, c2) = (alpha, 1 - alpha) for t > 0 and swapped otherwise.
//  - psi*(t) = log1p(x) / alpha wherever x is in [-1/2, 1] (relatively accurate near t = 0, where the other form
//    cancels), and (t_+ + log(c1 + c2 q)) / alpha elsewhere: there |log(c1 + c2 q)| is at most ~max(|log alpha|,
//    |log(1 - alpha)|) times the result, which is what the conditioning of psi* in t costs anyway. x = alpha E with
//    E = expm1(t), formed as m for t <= 0 and -m / q for t > 0 (+inf once q underflows, selecting the second form).
//  - excess(t) = psi*(t) - t, formed from psi*(t): a few roundings of |t| + excess(t).
//  - psi*'(t) - 1 = (1 - alpha) m / (c1 + c2 q) for t <= 0 and -(1 - alpha) m / (c1 + c2 q) for t > 0.
//  - psi*'(t) and psi*''(t) likewise (first, second).
// The shortcuts (the coarse value in product form, the multisection runs) lose what these forms keep, in
// proportion to 1/alpha and |log(1 - alpha)|: they are used only for alpha in [1/16, 15/16] (shortcuts).
template <typename acc_t>
struct SmoothedCVaR {
  acc_t shift;          // log(alpha / (1 - alpha))
  acc_t log1m_alpha;    // log(1 - alpha)
  acc_t alpha;
  acc_t one_minus_alpha;
  acc_t inv_alpha;
  acc_t inv_alpha_minus_1;
  acc_t flat_limit;     // 2 psi*(-inf) = 2 log(1 - alpha) / alpha (see direct_below)
  bool shortcuts;
  C10_HOST_DEVICE explicit SmoothedCVaR(double alpha_)
      : shift(static_cast<acc_t>(::log(alpha_) - ::log1p(-alpha_))),
        log1m_alpha(static_cast<acc_t>(::log1p(-alpha_))),
        alpha(static_cast<acc_t>(alpha_)),
        one_minus_alpha(static_cast<acc_t>(1.0 - alpha_)),
        inv_alpha(static_cast<acc_t>(1.0 / alpha_)),
        inv_alpha_minus_1(static_cast<acc_t>((1.0 - alpha_) / alpha_)),
        flat_limit(static_cast<acc_t>(2.0 * ::log1p(-alpha_) / alpha_)),
        shortcuts(alpha_ >= 1.0 / 16.0 && alpha_ <= 15.0 / 16.0) {}
  C10_HOST_DEVICE inline acc_t direct_below() const { return flat_limit; }
  C10_HOST_DEVICE inline bool coarse_ok() const { return shortcuts; }
  // e = exp(-|s|) and w = 1 / (1 + e) in [1/2, 1], from which sigmoid(s) (w for s > 0, e w otherwise) and
  // softplus(s) = s_+ + log1p(e) = s_+ - log(w) follow without overflow (a NaN s makes both NaN).
  template <typename T>
  struct Logistic {
    T e;
    T w;
    T ew;  // e w = sigmoid(-|s|), in [0, 1/2]
  };
  template <typename T>
  C10_HOST_DEVICE inline Logistic<T> logistic(T s) const {
    using M = Math<T>;
    const T e = M::exp(M::neg_abs(s));
    const T w = M::divide(M::constant(1.0), M::constant(1.0) + e);
    return {e, w, e * w};
  }
  template <typename T>
  C10_HOST_DEVICE inline T sigmoid(T s) const {
    using M = Math<T>;
    const Logistic<T> g = logistic(s);
    return M::if_positive(s, g.w, g.ew);
  }
  // c1 + c2 q (see above), in [min(alpha, 1 - alpha), 1].
  template <typename T>
  C10_HOST_DEVICE inline T positive_sum(T t, T q) const {
    using M = Math<T>;
    const T a = M::constant(alpha), b = M::constant(one_minus_alpha);
    return M::if_positive(t, q * b + a, q * a + b);
  }
  template <typename T>
  C10_HOST_DEVICE inline T value(T t) const {
    using M = Math<T>;
    const T minus_abs = M::neg_abs(t);
    const T m = M::expm1(minus_abs);
    const T q = M::exp(minus_abs);
    const T e = M::if_positive(t, -m / q, m);
    const T x = e * M::constant(alpha);
    // log1p(x) / alpha, which is e itself to the last bit where |x| < 2^-60 (and where alpha e would lose digits
    // below the type's smallest normal).
    const T near = M::select_positive(-M::neg_abs(x) - M::constant(0x1p-60), M::log1p(x) * M::constant(inv_alpha), e);
    const T far = (M::relu(t) + M::log(positive_sum(t, q))) * M::constant(inv_alpha);
    // x > 1 or x < -1/2 takes the far form; a NaN x stays NaN (select_positive returns it).
    return M::select_positive(x - M::constant(1.0), far, M::select_positive(M::constant(-0.5) - x, far, near));
  }
  // `ratio`, a quotient of q = e^-|t| (or of 1: then `gauge` is 1) by powers of the sum c1 + c2 q, which is down to
  // min(alpha, 1 - alpha): the quotient is a normal number well below the smallest normal q (psi*'(-100) = 3.7e-38
  // at alpha = 1 - 1e-6 in float32), where q is 0 (the AVX builds' exp) or a subnormal short of digits. There it is
  // exp(log_ratio()) instead, the same quotient with q's logarithm -|t| in place of q: its argument rounds to a few
  // roundings of |t|, the conditioning of e^-|t| itself. Formed only where needed (select_positive_rare): a log and
  // an exp more on every element cost the non-shortcut path a fifth of its time. (The shortcuts' sigmoids pass the
  // result itself as the gauge: it is what underflows there.)
  template <typename T, typename F>
  C10_HOST_DEVICE inline T unless_below_normal(T gauge, T ratio, F log_ratio) const {
    using M = Math<T>;
    return M::select_positive_rare(gauge - M::constant(log_form_below()), ratio, [&] { return M::exp(log_ratio()); });
  }
  // The gauge below which unless_below_normal takes the log form: not the smallest normal itself but 256 times it,
  // above the band where the AVX2 build's exp returns 0 (results from the smallest normal up to 1.7e-38 in float,
  // 3.1e-308 in double: csrc/cpu/simd_float.h), so that every build takes the same form at the same t (the two are
  // hundreds of roundings apart at |t| ~ 700). Both forms are good to a few roundings of |t| around it.
  C10_HOST_DEVICE static constexpr double log_form_below() { return 256.0 * std::numeric_limits<acc_t>::min(); }
  // log psi*'(t) for t <= 0 and log psi*''(t), from -|t| and the sum c1 + c2 q: unless_below_normal's log forms.
  template <typename T>
  C10_HOST_DEVICE inline T log_first_below_zero(T minus_abs, T sum) const {
    return minus_abs - Math<T>::log(sum);
  }
  template <typename T>
  C10_HOST_DEVICE inline T log_second(T minus_abs, T sum) const {
    using M = Math<T>;
    const T log_sum = M::log(sum);
    return minus_abs + M::constant(log1m_alpha) - log_sum - log_sum;
  }
  // The sum c1 + c2 q at t, for the shortcuts' log forms (their ordinary forms need neither q nor the sum).
  template <typename T>
  C10_HOST_DEVICE inline T sum_at(T t, T minus_abs) const {
    return positive_sum(t, Math<T>::exp(minus_abs));
  }
  // psi*'(t) = e^t / (1 - alpha + alpha e^t) = [t > 0 ? 1 : q] / (c1 + c2 q) and
  // psi*''(t) = psi*'(t) (1 - alpha psi*'(t)) = (1 - alpha) q / (c1 + c2 q)^2, relatively accurate for any alpha.
  // With the shortcuts, sigmoid(s) / alpha and sigmoid(s) sigmoid(-s) / alpha instead (s = t + shift), whose
  // exponential the coarse value shares; they lose |shift| roundings to t + shift, at most ~3 there. Their e^-|s|
  // underflows (0 in the AVX builds) where they are still normal numbers, up to 1/alpha (first) and 1/alpha^2
  // (second) times above the smallest normal: there they take the log forms as well.
  template <typename T>
  C10_HOST_DEVICE inline T first(T t) const {
    using M = Math<T>;
    if (shortcuts) {
      // sigmoid(s) / alpha with the 1/alpha in the division's numerator: no operation more than sigmoid(s) itself.
      const T s = t + M::constant(shift);
      const T e = M::exp(M::neg_abs(s));
      const T w = M::divide(M::constant(inv_alpha), M::constant(1.0) + e);
      const T weight = M::if_positive(s, w, e * w);
      return unless_below_normal(weight, weight, [&] {
        const T minus_abs = M::neg_abs(t);  // t < s < 0 wherever the weight is that small
        return log_first_below_zero(minus_abs, sum_at(t, minus_abs));
      });
    }
    const T minus_abs = M::neg_abs(t);
    const T q = M::exp(minus_abs);
    const T sum = positive_sum(t, q);
    const T numerator = M::if_positive(t, M::constant(1.0), q);
    return unless_below_normal(numerator, numerator / sum, [&] { return log_first_below_zero(minus_abs, sum); });
  }
  template <typename T>
  C10_HOST_DEVICE inline T second(T t) const {
    using M = Math<T>;
    if (shortcuts) {
      // sigmoid(s) sigmoid(-s) = e w^2 whatever the sign of s: no 1 - p to lose the small side's digits.
      const Logistic<T> g = logistic(t + M::constant(shift));
      const T curvature = g.ew * g.w * M::constant(inv_alpha);
      return unless_below_normal(curvature, curvature, [&] {
        const T minus_abs = M::neg_abs(t);
        return log_second(minus_abs, sum_at(t, minus_abs));
      });
    }
    const T minus_abs = M::neg_abs(t);
    const T q = M::exp(minus_abs);
    const T sum = positive_sum(t, q);
    // Divided by the sum twice, not by its square: the sum is down to about alpha, whose square underflows float32
    // below alpha ~ 1e-19 (NaN or inf where the second derivative is finite).
    return unless_below_normal(q, (q / sum) * (M::constant(one_minus_alpha) / sum),
                               [&] { return log_second(minus_abs, sum); });
  }
  template <typename T>
  C10_HOST_DEVICE inline T excess(T t) const {
    return value(t) - t;
  }
  template <typename T>
  C10_HOST_DEVICE inline T excess_first(T t) const {
    using M = Math<T>;
    const T minus_abs = M::neg_abs(t);
    const T m = M::expm1(minus_abs);
    const T q = M::exp(minus_abs);
    const T ratio = M::divide(m * M::constant(one_minus_alpha), positive_sum(t, q));  // base >= min(alpha, 1 - alpha)
    return M::select_positive(t, -ratio, ratio);
  }
  // The coarse value in product form (see above): psi*(t) = (log(1 - alpha) + s_+ + log(1 + e)) / alpha with
  // s = t + shift and e = exp(-|s|) in [0, 1] (shared with first()), so that over a block of samples
  //   sum psi*(t_i) = coarse_scale * (count * coarse_offset + sum coarse_linear(t_i) + log prod coarse_factor(t_i))
  // where the factors 1 + e_i lie in [1, 2]: a product of a few dozen neither overflows nor loses more than a
  // rounding per factor, and the block takes one log per lane instead of a log per sample. Each rounding there
  // is of |log(1 - alpha)| + s_+ + 1, divided by alpha: only for alpha in [1/16, 15/16] (coarse_ok).
  static constexpr bool kHasCoarseValue = true;
  static constexpr bool kCoarseValueAsProduct = true;
  C10_HOST_DEVICE inline acc_t coarse_scale() const { return inv_alpha; }
  C10_HOST_DEVICE inline acc_t coarse_offset() const { return log1m_alpha; }
  template <typename T>
  C10_HOST_DEVICE inline T coarse_linear(T t) const {
    return Math<T>::relu(t + Math<T>::constant(shift));
  }
  template <typename T>
  C10_HOST_DEVICE inline T coarse_factor(T t) const {
    using M = Math<T>;
    return M::constant(1.0) + M::exp(M::neg_abs(t + M::constant(shift)));
  }
  // first(t) where coarse_ok() holds, to a rounding, is coarse_first_unscaled(t) coarse_first_scale(), without
  // first()'s test of coarse_ok(): a coarse pass sums it beside coarse_factor(t), and the two then share one
  // exp(-|s|) (with the test between them the CPU compiler formed it twice); a pass that sums or scales it applies
  // the 1/alpha once. It underflows where first() takes its log form: the CPU weights map, which scales it, keeps
  // those zeros (up to 1/alpha times above the smallest normal) rather than first()'s test of each lane.
  template <typename T>
  C10_HOST_DEVICE inline T coarse_first_unscaled(T t) const {
    return sigmoid(t + Math<T>::constant(shift));
  }
  C10_HOST_DEVICE inline acc_t coarse_first_scale() const { return inv_alpha; }
  // The run (see ExcessFirstRunTable) around its middle point: with D = expm1(-t),
  //   psi*'(t) - 1 = (1 - alpha)(1 - e^-t) / (alpha + (1 - alpha) e^-t) = -P / (1 + P),  P = (1 - alpha) D,
  // which is the two-sided form above in one expression (D in (-1, 0) for t > 0, >= 0 otherwise), and
  // D_j = expm1(-t_c) e^((j - c) d) + expm1((j - c) d). Factors up to e^(c d) scale expm1(-t_c)'s absolute error
  // (it is ~eps where D is near -1, a loss far above the points), so runs are kept to (K - 1) d <= 2: at most
  // e times the error of expm1 itself. 1 + P >= alpha is formed as 1 + P, whose rounding is ~eps / alpha
  // relative: runs are used only where the shortcuts are (alpha >= 1/16). -t_c is clamped so that D stays
  // finite; past the clamp every D_j is above e^70 and -P / (1 + P) is -1 to the last bit, as it should be.
  static constexpr bool kHasExcessFirstRun = true;
  template <int K>
  C10_HOST_DEVICE inline bool run_fits(double d) const {
    return shortcuts && (K - 1) * d <= 2.0;  // false for NaN
  }
  template <int K>
  C10_HOST_DEVICE inline ExcessFirstRunTable<acc_t, K> run_table(double d) const {
    constexpr int c = (K - 1) / 2;
    return ExcessFirstRunTable<acc_t, K>(c, d, 1.0, exp_headroom<acc_t>() - (K - 1 - c) * d);
  }
  template <int K>
  C10_HOST_DEVICE inline void excess_first_run(acc_t tc, const ExcessFirstRunTable<acc_t, K>& run,
                                               acc_t (&out)[K]) const {
    using M = Math<acc_t>;
    const acc_t base = M::expm1(M::min(-tc, run.clamp));  // NaN stays NaN
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const acc_t p = (base * run.factor[j] + run.offset[j]) * one_minus_alpha;
      out[j] = M::divide(-p, M::constant(1.0) + p);  // 1 + p >= alpha: no division by ~0
    }
  }
};

// One sample's share of the penalized objective, lam psi*(t) + s with t = (l - s) / lam, in one of two forms:
//  - l + lam excess(t) (lam t + s == l): its absolute error stays near eps |l - s| however large lam is, where
//    lam psi*(t) + s cancels catastrophically (the ERM limit, t -> 0; docs/design.md section 1.6);
//  - lam psi*(t) + s itself, for t <= direct_below(): there psi*(t) is flat (psi*(t) >= t/2), so l + lam excess(t)
//    would be l - l + lam psi*(t) + s, and a loss far below the others (-1e30 beside losses near 1) would take
//    every digit of its neighbours' shares down with it. Samples whose weight is 0 take this form too, so their
//    gradient is 0 exactly (the fallback differentiates these forms).
// Either form's error is then within a small factor of eps (|s| + lam |psi*(t)|) plus what t's rounding moves
// it by. The excess form is inf - inf where t = +inf (a loss of +inf, or an overflowing division by a tiny lam):
// those samples take lam psi*(t) + s, +inf. A NaN t stays NaN. For scalar T (the per-element value term of the
// CUDA loss and of the fused cross-entropy on both devices); the CPU loss kernel sums the same forms as
// (loss_part_a, loss_part_b).
template <typename Div, typename T>
C10_HOST_DEVICE inline T penalized_value(const Div& div, T t, T l, T lam, T s) {
  if (t <= static_cast<T>(div.direct_below())) return lam * div.value(t) + s;
  const T v = l + lam * div.excess(t);
  return (v != v && t == t) ? lam * div.value(t) + s : v;
}

// The same choice for a sum: lam psi*(t) + s = s + a + lam b with (a, b) = (l - s, excess(t)) above direct_below()
// and (0, psi*(t)) at or below it (d = l - s, as the caller formed it for t = d / lam), so that
// s + (sum a + lam sum b) / N is the mean of penalized_value (where no t is +inf) with the precision of each form,
// and sum a never holds the deviation of a loss far below the rest.
template <typename Div, typename T>
C10_HOST_DEVICE inline T loss_part_a(const Div& div, T t, T d) {
  using M = Math<T>;
  return M::select_positive(t - M::constant(div.direct_below()), d, M::constant(0.0));  // NaN t stays NaN
}
template <typename Div, typename T>
C10_HOST_DEVICE inline T loss_part_b(const Div& div, T t) {
  using M = Math<T>;
  return M::select_positive(t - M::constant(div.direct_below()), div.excess(t), div.value(t));
}

// The parameters a divergence was asked for; only the ones it uses are read.
struct DivergenceSpec {
  Divergence kind;
  double alpha;
  double k;
};

// Calls f(functor) with the functor of spec.kind, so that kernels are instantiated once per divergence
// and the per-element loop carries no switch. Host code that launches CUDA kernels calls it with host lambdas:
// nv_exec_check_disable keeps nvcc from warning (20014) that a host-device function calls a host one.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
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
      // Exponents 1 / (k - 1) that are small integers take the pure-arithmetic path.
      if (spec.k == 2.0) return f(CressieRead<acc_t, 1>(spec.k));
      if (spec.k == 1.5) return f(CressieRead<acc_t, 2>(spec.k));
      return f(CressieRead<acc_t, 0>(spec.k));
    case Divergence::SmoothedCVaR:
      return f(SmoothedCVaR<acc_t>(spec.alpha));
    case Divergence::Chi2:
    default:
      return f(Chi2<acc_t>{});
  }
}

}  // namespace dro_ext
