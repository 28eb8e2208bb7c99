// Math<Vectorized<T>>: the elementary operations of csrc/divergences.h on ATen's CPU vectors, so the
// same divergence functors run a whole SIMD register at a time. Include this after defining the CPU
// capability of the translation unit (see cpu_capability.h).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <limits>
#include <type_traits>

#include "divergences.h"

namespace dro_ext {

template <typename S>
struct Math<at::vec::Vectorized<S>> {
  using V = at::vec::Vectorized<S>;
  static inline V constant(double c) { return V(static_cast<S>(c)); }
  static inline V exp(const V& x) {
    if constexpr (std::is_same_v<S, float>) {
      // ATen's exp_u20 (a degree-5 polynomial, within 2 ulp) is about twice as fast as Sleef's exp.
      // It clamps its argument, so put back what the clamp hides: inf past the overflow threshold, NaN.
      const V overflow(88.72283935546875f);  // log(FLT_MAX), the constant exp_u20 clamps at
      V r = V::blendv(x.exp_u20(), V(std::numeric_limits<float>::infinity()), x > overflow);
      return V::blendv(r, x, x.isnan());
    } else {
      return x.exp();
    }
  }
  static inline V log1p_unit(const V& x) {
    if constexpr (std::is_same_v<S, float>) {
      // log1p(x) = 2 atanh(u) = 2 (u + u^3/3 + u^5/5 + ...) with u = x / (2 + x) in [0, 1/3] for x in [0, 1]:
      // eight terms leave a relative error below 1e-8, cheaper than Sleef's general log1p. NaN stays NaN.
      const V u = x / (V(2.0f) + x);
      const V u2 = u * u;
      V series = V(1.0f / 15.0f);
      series = at::vec::fmadd(series, u2, V(1.0f / 13.0f));
      series = at::vec::fmadd(series, u2, V(1.0f / 11.0f));
      series = at::vec::fmadd(series, u2, V(1.0f / 9.0f));
      series = at::vec::fmadd(series, u2, V(1.0f / 7.0f));
      series = at::vec::fmadd(series, u2, V(1.0f / 5.0f));
      series = at::vec::fmadd(series, u2, V(1.0f / 3.0f));
      series = at::vec::fmadd(series, u2, V(1.0f));
      return V(2.0f) * u * series;
    } else {
      return x.log1p();
    }
  }
  static inline V abs(const V& x) { return x.abs(); }
  static inline V pow(const V& x, const V& y) { return x.pow(y); }
  // blendv(a, b, mask) takes b where mask is set; a NaN compares false everywhere, so it keeps x.
  static inline V relu(const V& x) { return V::blendv(x, V(S(0)), x < V(S(0))); }
  static inline V min(const V& x, const V& hi) { return V::blendv(x, hi, x > hi); }
  static inline V select_positive(const V& x, const V& if_pos, const V& if_nonpos) {
    const V zero(S(0));
    V out = V::blendv(x, if_nonpos, x <= zero);
    return V::blendv(out, if_pos, x > zero);
  }
};

}  // namespace dro_ext
