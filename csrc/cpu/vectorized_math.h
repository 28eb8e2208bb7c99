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
  // e^x - 1, relatively accurate for small |x|: the excess terms of csrc/divergences.h are built from it.
  static inline V expm1(const V& x) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<S, float>) return expm1_float_avx2(x);
#endif
    return x.expm1();
  }
  // log(1 + x) for x > -1, relatively accurate for small |x|; x <= -1 gives an unspecified value (the
  // divergences select those lanes away), +inf gives +inf and NaN gives NaN.
  static inline V log1p(const V& x) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<S, float>) return log1p_float_avx2(x);
#endif
    return x.log1p();
  }
#if defined(CPU_CAPABILITY_AVX2)
  // expm1(x) = 2^n (1 + p) - 1 = 2^n p + (2^n - 1) with n = round(x / ln 2), r = x - n ln 2 in
  // [-ln(2)/2, ln(2)/2] and p = e^r - 1 = r + r^2 q(r), q a degree-4 fit of (e^r - 1 - r)/r^2 (relative error
  // 2e-7 in float). For |x| < ln(2)/2, n = 0 and r = x exactly, so the result is r + r^2 q(r): relatively
  // accurate however small x is, where exp(x) - 1 would keep only an absolute accuracy of one rounding.
  // 2^n is built in the exponent field as exp_float_avx2 does; at n = 128 (x in [88.38, 88.72], where e^x
  // is still finite) 2^n overflows, so above x = 64 the result is (2 + 2p) 2^(n-1) instead (the -1 is
  // below a rounding there). Below x = -88, 2^n is 0 and the result -1. NaN passes the clamp and stays NaN.
  static inline V expm1_float_avx2(const V& x) {
    const __m256 clamped = _mm256_max_ps(_mm256_set1_ps(-88.0f), _mm256_min_ps(_mm256_set1_ps(89.0f), x));
    const __m256 round_magic = _mm256_set1_ps(12582912.0f);  // 1.5 * 2^23
    const __m256 shifted = _mm256_fmadd_ps(clamped, _mm256_set1_ps(1.44269504f), round_magic);
    const __m256 n = _mm256_sub_ps(shifted, round_magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);  // ln 2 = 0.693359375 - 2.12194e-4
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 q = _mm256_set1_ps(0.0013901280472055078f);
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.008363140746951103f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.04166685417294502f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.16666577756404877f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.5f));
    const __m256 p = _mm256_fmadd_ps(_mm256_mul_ps(r, r), q, r);
    const __m256i n_bits = _mm256_slli_epi32(_mm256_castps_si256(shifted), 23);  // n << 23
    const __m256 scale = _mm256_castsi256_ps(_mm256_add_epi32(n_bits, _mm256_set1_epi32(127 << 23)));
    const __m256 small = _mm256_fmadd_ps(scale, p, _mm256_sub_ps(scale, _mm256_set1_ps(1.0f)));
    const __m256 half_scale = _mm256_castsi256_ps(_mm256_add_epi32(n_bits, _mm256_set1_epi32(126 << 23)));
    const __m256 large = _mm256_mul_ps(_mm256_fmadd_ps(p, _mm256_set1_ps(2.0f), _mm256_set1_ps(2.0f)), half_scale);
    return V(_mm256_blendv_ps(small, large, _mm256_cmp_ps(clamped, _mm256_set1_ps(64.0f), _CMP_GT_OQ)));
  }
  // log1p(x) = k ln 2 + log(1 + f) with 1 + x = 2^k (1 + f), 1 + f in [sqrt(1/2), sqrt(2)); where k = 0, f = x
  // exactly (not the rounded (1 + x) - 1), which keeps small x relatively accurate. log(1 + f) =
  // f - f^2/2 + s (f^2/2 + R(s^2)) with s = f / (2 + f), R the classic degree-8 (in s) fit of fdlibm's logf;
  // for k != 0, |log(1 + x)| > 0.34, so the rounding of 1 + x costs at most two roundings of the result.
  static inline V log1p_float_avx2(const V& x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 u = _mm256_add_ps(one, x);
    // Adding 1 - sqrt(1/2) (in the bit pattern) moves the exponent boundary from 1 to sqrt(1/2).
    const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(u), _mm256_set1_epi32(0x3f800000 - 0x3f3504f3));
    const __m256i k = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
    const __m256 m = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f3504f3)));
    const __m256 k_is_zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(k, _mm256_setzero_si256()));
    const __m256 f = _mm256_blendv_ps(_mm256_sub_ps(m, one), x, k_is_zero);
    const __m256 s = _mm256_div_ps(f, _mm256_add_ps(_mm256_set1_ps(2.0f), f));
    const __m256 z = _mm256_mul_ps(s, s);
    const __m256 w = _mm256_mul_ps(z, z);
    const __m256 odd = _mm256_mul_ps(z, _mm256_fmadd_ps(w, _mm256_set1_ps(0.28498786688f), _mm256_set1_ps(0.66666662693f)));
    const __m256 even = _mm256_mul_ps(w, _mm256_fmadd_ps(w, _mm256_set1_ps(0.24279078841f), _mm256_set1_ps(0.40000972152f)));
    const __m256 half_f2 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), f), f);
    const __m256 dk = _mm256_cvtepi32_ps(k);
    // s (f^2/2 + R) + k ln2_lo - f^2/2 + f + k ln2_hi, smallest terms first
    __m256 result = _mm256_fmadd_ps(s, _mm256_add_ps(half_f2, _mm256_add_ps(odd, even)),
                                    _mm256_mul_ps(dk, _mm256_set1_ps(9.0580006145e-06f)));
    result = _mm256_add_ps(_mm256_sub_ps(result, half_f2), f);
    result = _mm256_fmadd_ps(dk, _mm256_set1_ps(6.9313812256e-01f), result);
    // +inf and NaN are returned as themselves (the bit manipulation above would make them finite).
    return V(_mm256_blendv_ps(result, x, _mm256_cmp_ps(x, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                                                          _CMP_NLT_UQ)));
  }
#endif
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
  static inline V max(const V& x, const V& lo) {
    if constexpr (std::is_same_v<S, float>) return V(_mm256_max_ps(lo, x));
    else return V(_mm256_max_pd(lo, x));
  }
  static inline V neg_abs(const V& x) {  // set the sign bit
    if constexpr (std::is_same_v<S, float>) return V(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));
    else return V(_mm256_or_pd(x, _mm256_set1_pd(-0.0)));
  }
#else
  // blendv(a, b, mask) takes b where mask is set; a NaN compares false everywhere, so it keeps x.
  static inline V relu(const V& x) { return V::blendv(x, V(S(0)), x < V(S(0))); }
  static inline V min(const V& x, const V& hi) { return V::blendv(x, hi, x > hi); }
  static inline V max(const V& x, const V& lo) { return V::blendv(x, lo, x < lo); }
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
