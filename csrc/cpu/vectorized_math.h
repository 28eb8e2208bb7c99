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
#if defined(CPU_CAPABILITY_AVX2)
      return exp_float_avx2(x);
#else
      // ATen's exp_u20 (a degree-5 polynomial) is about twice as fast as Sleef's exp. It clamps its
      // argument, so put back what the clamp hides: inf past the overflow threshold, NaN.
      const V overflow(88.72283935546875f);  // log(FLT_MAX), the constant exp_u20 clamps at
      V r = V::blendv(x.exp_u20(), V(std::numeric_limits<float>::infinity()), x > overflow);
      return V::blendv(r, x, x.isnan());
#endif
    } else {
      return x.exp();
    }
  }
#if defined(CPU_CAPABILITY_AVX2)
  // exp(x) = 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 (in two steps, so r stays exact for large
  // |x|), e^r by a degree-5 polynomial on |r| <= ln(2)/2: about 2 ulp. The kernels of the exponential
  // divergences are bound by this function on the CPU, so every operation counts:
  //  - n comes from adding 1.5 * 2^23, which rounds x / ln 2 to an integer and leaves it in the low
  //    mantissa bits, where a shift moves it into an exponent field (no float-to-int conversion);
  //  - the result is (2 e^r) * 2^(n-1), the 2 folded into the polynomial's coefficients: past log(FLT_MAX)
  //    that overflows to inf, as it should, and at the lower clamp 2^(n-1) has a zero exponent field,
  //    which gives 0 (values below about 2e-38 flush to zero, as ATen's exp_u20 does);
  //  - max/min return their second operand when either is NaN, so with the constant first NaN passes the
  //    clamp, and a NaN r makes the result NaN.
  static inline V exp_float_avx2(const V& x) {
    const __m256 clamped = _mm256_max_ps(_mm256_set1_ps(-87.33654f), _mm256_min_ps(_mm256_set1_ps(89.0f), x));
    const __m256 round_magic = _mm256_set1_ps(12582912.0f);  // 1.5 * 2^23
    const __m256 shifted = _mm256_fmadd_ps(clamped, _mm256_set1_ps(1.44269504f), round_magic);
    const __m256 n = _mm256_sub_ps(shifted, round_magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);  // ln 2 = 0.693359375 - 2.12194e-4
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(2 * 0.00828929059f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2 * 0.0418978221f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2 * 0.166676521f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2 * 0.499991506f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2 * 0.999999701f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.0f));
    const __m256i half_scale_bits =  // (n - 1 + 127) << 23, from n in the low bits of `shifted`
        _mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(shifted), 23), _mm256_set1_epi32(126 << 23));
    return V(_mm256_mul_ps(p, _mm256_castsi256_ps(half_scale_bits)));
  }
#endif
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
  static inline V pow(const V& x, const V& y) { return x.pow(y); }
#if defined(CPU_CAPABILITY_AVX2)
  // maxps/minps return their second operand when either is NaN: with x second, NaN passes in one instruction.
  static inline V relu(const V& x) {
    if constexpr (std::is_same_v<S, float>) return V(_mm256_max_ps(_mm256_setzero_ps(), x));
    else return V(_mm256_max_pd(_mm256_setzero_pd(), x));
  }
  static inline V min(const V& x, const V& hi) {
    if constexpr (std::is_same_v<S, float>) return V(_mm256_min_ps(hi, x));
    else return V(_mm256_min_pd(hi, x));
  }
  static inline V neg_abs(const V& x) {  // set the sign bit
    if constexpr (std::is_same_v<S, float>) return V(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));
    else return V(_mm256_or_pd(x, _mm256_set1_pd(-0.0)));
  }
#else
  // blendv(a, b, mask) takes b where mask is set; a NaN compares false everywhere, so it keeps x.
  static inline V relu(const V& x) { return V::blendv(x, V(S(0)), x < V(S(0))); }
  static inline V min(const V& x, const V& hi) { return V::blendv(x, hi, x > hi); }
  static inline V neg_abs(const V& x) { return -x.abs(); }
#endif
  static inline V select_positive(const V& x, const V& if_pos, const V& if_nonpos) {
    const V zero(S(0));
    V out = V::blendv(x, if_nonpos, x <= zero);
    return V::blendv(out, if_pos, x > zero);
  }
  static inline V if_positive(const V& x, const V& if_pos, const V& otherwise) {
    return V::blendv(otherwise, if_pos, x > V(S(0)));
  }
};

}  // namespace dro_ext
