// Hand-written float32 exp, expm1, log1p and division, and float64 exp, on one SIMD register, written once over the
// dozen register operations that differ between AVX2 (8 lanes, comparisons give a lane mask) and AVX-512 (16 lanes,
// comparisons give a bit mask). The translation unit's capability (csrc/cpu/simd_capability.h) picks the
// operations; csrc/cpu/vectorized_math.h routes Math<Vectorized<float>> through the functions.
//
// Why not ATen's Vectorized<float>::exp and friends: the kernels of the exponential divergences are bound by
// these functions on the CPU (bench/results/loss.md). Sleef's exp/expm1/log1p are accurate to 1 ulp and
// handle every special case in software; the versions below are accurate to 2-3 ulp over the arguments the
// divergences use, keep NaN and +-inf where it matters, and cost about a third. A vector division costs as
// much as a dozen fused multiply-adds, so division goes through the reciprocal estimate and one correction.
#pragma once

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define DRO_EXT_SIMD_FLOAT 1

#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace dro_ext::cpu::simd {
// One namespace per capability (CPU_CAPABILITY, csrc/cpu/simd_capability.h), as ATen's Vectorized has: these inline
// functions are compiled into the AVX2 and the AVX-512 builds alike, and a function whose signature is the same in
// both (set(float), set_int, two_to_n(const Reduced&)) had one mangled name for two bodies. Where the compiler did
// not inline them (-O0: CI's build against torch 2.11), the linker kept one body for both builds, and the AVX-512
// expm1 scaled by the AVX2 build's 2^n: kl's psi*(1) read 0.36 for e - 1.
inline namespace CPU_CAPABILITY {

#if defined(CPU_CAPABILITY_AVX512)
using F = __m512;
using D = __m512d;
using I = __m512i;
using Mask = __mmask16;
inline F set(float c) { return _mm512_set1_ps(c); }
inline D set(double c) { return _mm512_set1_pd(c); }
inline I set_int(int32_t c) { return _mm512_set1_epi32(c); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c
inline F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
// min/max return their second operand when either is NaN (as AVX2's do).
inline F min(F a, F b) { return _mm512_min_ps(a, b); }
inline F max(F a, F b) { return _mm512_max_ps(a, b); }
inline D min(D a, D b) { return _mm512_min_pd(a, b); }
inline D max(D a, D b) { return _mm512_max_pd(a, b); }
inline F set_sign(F x) { return _mm512_or_ps(x, _mm512_set1_ps(-0.0f)); }
inline D set_sign(D x) { return _mm512_or_pd(x, _mm512_set1_pd(-0.0)); }
inline D mul(D a, D b) { return _mm512_mul_pd(a, b); }
inline D fmadd(D a, D b, D c) { return _mm512_fmadd_pd(a, b, c); }
inline D fnmadd(D a, D b, D c) { return _mm512_fnmadd_pd(a, b, c); }
inline I bits(F x) { return _mm512_castps_si512(x); }
inline F from_bits(I x) { return _mm512_castsi512_ps(x); }
inline I add_int(I a, I b) { return _mm512_add_epi32(a, b); }
inline I sub_int(I a, I b) { return _mm512_sub_epi32(a, b); }
inline I and_int(I a, I b) { return _mm512_and_si512(a, b); }
inline I shift_left_23(I x) { return _mm512_slli_epi32(x, 23); }
inline I shift_right_23(I x) { return _mm512_srli_epi32(x, 23); }
inline F to_float(I x) { return _mm512_cvtepi32_ps(x); }
inline Mask greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask less_equal(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline Mask not_less(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ); }  // true for NaN
inline Mask equal_int(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
inline F select(Mask m, F if_set, F otherwise) { return _mm512_mask_blend_ps(m, otherwise, if_set); }
using MaskD = __mmask8;
inline MaskD greater(D a, D b) { return _mm512_cmp_pd_mask(a, b, _CMP_GT_OQ); }
inline MaskD less_equal(D a, D b) { return _mm512_cmp_pd_mask(a, b, _CMP_LE_OQ); }
inline D select(MaskD m, D if_set, D otherwise) { return _mm512_mask_blend_pd(m, otherwise, if_set); }
// Whether every lane of a comparison holds (Math<Vectorized>::select_positive_rare's test).
inline bool all_lanes(Mask m) { return m == Mask(0xFFFF); }
inline bool all_lanes(MaskD m) { return m == MaskD(0xFF); }
inline F reciprocal_estimate(F x) { return _mm512_rcp14_ps(x); }  // relative error below 2^-14
constexpr int kRegisterBytes = 64;
inline void stream(float* p, F v) { _mm512_stream_ps(p, v); }
inline void stream(double* p, D v) { _mm512_stream_pd(p, v); }
#else
using F = __m256;
using D = __m256d;
using I = __m256i;
using Mask = __m256;  // all ones in the lanes where the comparison holds
inline F set(float c) { return _mm256_set1_ps(c); }
inline D set(double c) { return _mm256_set1_pd(c); }
inline I set_int(int32_t c) { return _mm256_set1_epi32(c); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
inline F min(F a, F b) { return _mm256_min_ps(a, b); }
inline F max(F a, F b) { return _mm256_max_ps(a, b); }
inline D min(D a, D b) { return _mm256_min_pd(a, b); }
inline D max(D a, D b) { return _mm256_max_pd(a, b); }
inline F set_sign(F x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }
inline D set_sign(D x) { return _mm256_or_pd(x, _mm256_set1_pd(-0.0)); }
inline D mul(D a, D b) { return _mm256_mul_pd(a, b); }
inline D fmadd(D a, D b, D c) { return _mm256_fmadd_pd(a, b, c); }
inline D fnmadd(D a, D b, D c) { return _mm256_fnmadd_pd(a, b, c); }
inline I bits(F x) { return _mm256_castps_si256(x); }
inline F from_bits(I x) { return _mm256_castsi256_ps(x); }
inline I add_int(I a, I b) { return _mm256_add_epi32(a, b); }
inline I sub_int(I a, I b) { return _mm256_sub_epi32(a, b); }
inline I and_int(I a, I b) { return _mm256_and_si256(a, b); }
inline I shift_left_23(I x) { return _mm256_slli_epi32(x, 23); }
inline I shift_right_23(I x) { return _mm256_srli_epi32(x, 23); }
inline F to_float(I x) { return _mm256_cvtepi32_ps(x); }
inline Mask greater(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline Mask less_equal(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
inline Mask not_less(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_NLT_UQ); }
inline Mask equal_int(I a, I b) { return _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)); }
inline F select(Mask m, F if_set, F otherwise) { return _mm256_blendv_ps(otherwise, if_set, m); }
using MaskD = __m256d;
inline MaskD greater(D a, D b) { return _mm256_cmp_pd(a, b, _CMP_GT_OQ); }
inline MaskD less_equal(D a, D b) { return _mm256_cmp_pd(a, b, _CMP_LE_OQ); }
inline D select(MaskD m, D if_set, D otherwise) { return _mm256_blendv_pd(otherwise, if_set, m); }
inline bool all_lanes(Mask m) { return _mm256_movemask_ps(m) == 0xFF; }
inline bool all_lanes(MaskD m) { return _mm256_movemask_pd(m) == 0xF; }
inline F reciprocal_estimate(F x) { return _mm256_rcp_ps(x); }  // relative error below 1.5 * 2^-12
constexpr int kRegisterBytes = 32;
inline void stream(float* p, F v) { _mm256_stream_ps(p, v); }
inline void stream(double* p, D v) { _mm256_stream_pd(p, v); }
#endif

// x = n ln 2 + r with n = round(x / ln 2) and r in [-ln(2)/2, ln(2)/2] (in two steps, so r stays exact for
// large |x|), for x already clamped to the range of the caller, and p 2^n for the p computed from r.
//  - AVX-512 rounds with one instruction and scales with vscalefps, which rounds p 2^n once, to inf or to a
//    subnormal or 0 where it leaves the normal range, like exp itself.
//  - AVX2 adds 1.5 * 2^23, which rounds x / ln 2 to an integer and leaves it in the low mantissa bits of
//    `shifted`, where a shift moves it into an exponent field (no float-to-int conversion); that exponent
//    field must stay in range, so the callers below fold a factor 2 into p and scale by 2^(n-1), which is
//    finite up to n = 128 (e^x is finite up to x = 88.72, n = 128) and 0 at n = -126.
struct Reduced {
  F n;
  F shifted;  // AVX2 only
  F r;
};
inline Reduced reduce_ln2(F clamped) {
#if defined(CPU_CAPABILITY_AVX512)
  const F n = _mm512_roundscale_ps(mul(clamped, set(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const F shifted = n;
#else
  const F round_magic = set(12582912.0f);  // 1.5 * 2^23
  const F shifted = fmadd(clamped, set(1.44269504f), round_magic);
  const F n = sub(shifted, round_magic);
#endif
  F r = fnmadd(n, set(0.693359375f), clamped);  // ln 2 = 0.693359375 - 2.12194e-4
  r = fnmadd(n, set(-2.12194440e-4f), r);
  return {n, shifted, r};
}
#if defined(CPU_CAPABILITY_AVX512)
constexpr float kHalfScale = 1.0f;  // p carries no extra factor: vscalefps covers the whole range
inline F times_2_to_n(F p, const Reduced& red) { return _mm512_scalef_ps(p, red.n); }
inline F two_to_n(const Reduced& red) { return _mm512_scalef_ps(set(1.0f), red.n); }
#else
constexpr float kHalfScale = 2.0f;  // p carries a factor 2, scaled by 2^(n-1)
inline F times_2_to_n(F p, const Reduced& red) {
  return mul(p, from_bits(add_int(shift_left_23(bits(red.shifted)), set_int(126 << 23))));
}
// 2^n for n in [-126, 127].
inline F two_to_n(const Reduced& red) { return from_bits(add_int(shift_left_23(bits(red.shifted)), set_int(127 << 23))); }
#endif

// exp(x) = 2^n e^r, e^r by a degree-5 polynomial on |r| <= ln(2)/2: about 2 ulp. Past log(FLT_MAX) the result
// overflows to inf, as it should; below log(FLT_MIN) = -87.34 it is 0 (as ATen's exp_u20 does; AVX2: below -86.99,
// where n = -126 and 2^(n-1) has no exponent field, so 1.2e-38 to 1.7e-38 come out 0 too), never a
// subnormal: every addition that reads a subnormal costs a microcode assist (measured: kl's robust objective,
// whose weights exp((l - max l)/lam) reach far below, three times slower with them). The clamps keep +-inf
// from making r NaN (AVX-512 zeroes the low lanes with a mask instead); with the constant first, NaN passes
// the clamp, and a NaN r makes the result NaN.
inline F exp(F x) {
#if defined(CPU_CAPABILITY_AVX512)
  const Reduced red = reduce_ln2(min(set(89.0f), x));
#else
  const Reduced red = reduce_ln2(max(set(-87.33654f), min(set(89.0f), x)));
#endif
  const F r = red.r;
  F p = set(kHalfScale * 0.00828929059f);
  p = fmadd(p, r, set(kHalfScale * 0.0418978221f));
  p = fmadd(p, r, set(kHalfScale * 0.166676521f));
  p = fmadd(p, r, set(kHalfScale * 0.499991506f));
  p = fmadd(p, r, set(kHalfScale * 0.999999701f));
  p = fmadd(p, r, set(kHalfScale));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_maskz_scalef_ps(not_less(x, set(-87.33654f)), p, red.n);  // NaN is "not less": kept
#else
  return times_2_to_n(p, red);
#endif
}

// float64 exp(x) = 2^n e^r as exp above: r = x - n ln 2 in two steps (fdlibm's split of ln 2, whose high part has
// enough trailing zeros that n ln2_hi is exact), e^r by its Taylor polynomial of degree 13 on |r| <= ln(2)/2
// (truncation below 5e-18, so about one rounding in all), evaluated by Horner's rule in fused multiply-adds. Sleef's
// double exp, which ATen's Vectorized<double>::exp calls, costs several times as much: the float64 robust
// objective's passes of the exponential divergences were bound by it (kl_cvar over 65536 float64 losses: one pass
// 82 -> 35 us). Accurate to 1 ulp. Past log(DBL_MAX) the result overflows to inf; below log(DBL_MIN) = -708.40
// (AVX2: below -708.05, where n = -1022) it is 0, never a subnormal (see exp above). NaN stays NaN.
inline D exp(D x) {
  constexpr double kInverseFactorials[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0,
                                           1.0 / 3628800.0,    1.0 / 362880.0,    1.0 / 40320.0,
                                           1.0 / 5040.0,       1.0 / 720.0,       1.0 / 120.0,
                                           1.0 / 24.0,         1.0 / 6.0,         0.5,
                                           1.0,                1.0};  // 1/13! down to 1/0!
#if defined(CPU_CAPABILITY_AVX512)
  constexpr double kScale = 1.0;  // vscalefpd scales by 2^n over the whole range
  const D clamped = min(set(710.0), x);  // NaN (second operand) passes
  const D n =
      _mm512_roundscale_pd(mul(clamped, set(1.4426950408889634)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  // As exp above: 1.5 * 2^52 rounds x / ln 2 into the low mantissa bits, which a shift moves into the exponent field,
  // and p carries a factor 2 so that 2^(n-1) stays finite at n = 1024 (x up to log(DBL_MAX) = 709.78).
  constexpr double kScale = 2.0;
  const D clamped = max(set(-708.3964185322641), min(set(710.0), x));  // 0 from n = -1022 below
  const D round_magic = set(6755399441055744.0);  // 1.5 * 2^52
  const D shifted = fmadd(clamped, set(1.4426950408889634), round_magic);
  const D n = _mm256_sub_pd(shifted, round_magic);
#endif
  D r = fnmadd(n, set(6.93147180369123816490e-01), clamped);
  r = fnmadd(n, set(1.90821492927058770002e-10), r);
  D p = set(kScale * kInverseFactorials[0]);
  for (int k = 1; k < 14; ++k) p = fmadd(p, r, set(kScale * kInverseFactorials[k]));
#if defined(CPU_CAPABILITY_AVX512)
  // 0 below log(DBL_MIN) (no subnormal); NaN is "not less": kept.
  return _mm512_maskz_scalef_pd(_mm512_cmp_pd_mask(x, set(-708.3964185322641), _CMP_NLT_UQ), p, n);
#else
  // 2^(n-1) from the exponent field (n - 1 + 1023) << 52: 0 at n = -1022.
  const __m256i scale_bits =
      _mm256_add_epi64(_mm256_slli_epi64(_mm256_castpd_si256(shifted), 52), _mm256_set1_epi64x(int64_t{1022} << 52));
  return mul(p, _mm256_castsi256_pd(scale_bits));
#endif
}

// expm1(x) = 2^n (1 + p) - 1 = 2^n p + (2^n - 1) with p = e^r - 1 = r + r^2 q(r), q a degree-4 fit of
// (e^r - 1 - r)/r^2 (relative error 2e-7). For |x| < ln(2)/2, n = 0 and r = x exactly, so the result is
// r + r^2 q(r): relatively accurate however small x is, where exp(x) - 1 would keep only an absolute accuracy
// of one rounding. At n = 128 (x in [88.38, 88.72], where e^x is still finite) 2^n overflows, so above x = 64
// the result is (1 + p) 2^n scaled as exp's is (the -1 is below a rounding there). Below x = -87 the result is
// -1, from 2^n = 2^-126, the smallest normal float (no subnormal, see exp). NaN passes the clamp and stays NaN.
inline F expm1(F x) {
  const F clamped = max(set(-87.0f), min(set(89.0f), x));
  const Reduced red = reduce_ln2(clamped);
  const F r = red.r;
  F q = set(0.0013901280472055078f);
  q = fmadd(q, r, set(0.008363140746951103f));
  q = fmadd(q, r, set(0.04166685417294502f));
  q = fmadd(q, r, set(0.16666577756404877f));
  q = fmadd(q, r, set(0.5f));
  const F p = fmadd(mul(r, r), q, r);
  const F scale = two_to_n(red);  // used where x <= 64, n <= 93
  const F small = fmadd(scale, p, sub(scale, set(1.0f)));
  const F large = times_2_to_n(fmadd(p, set(kHalfScale), set(kHalfScale)), red);
  return select(greater(clamped, set(64.0f)), large, small);
}

// a / b to within about a rounding, for b finite with |b| in the normal range (every caller's denominator is
// bounded away from 0 and infinity): q0 = a r from the reciprocal estimate r, then one correction
// q0 + r (a - b q0) squares the estimate's relative error. NaN in a or b gives NaN.
inline F divide(F a, F b) {
  const F r = reciprocal_estimate(b);
  const F q0 = mul(a, r);
  return fmadd(r, fnmadd(b, q0, a), q0);
}

// log1p(x) = k ln 2 + log(1 + f) with 1 + x = 2^k (1 + f), 1 + f in [sqrt(1/2), sqrt(2)); where k = 0, f = x
// exactly (not the rounded (1 + x) - 1), which keeps small x relatively accurate. log(1 + f) =
// f - f^2/2 + s (f^2/2 + R(s^2)) with s = f / (2 + f), R the classic degree-8 (in s) fit of fdlibm's logf;
// for k != 0, |log(1 + x)| > 0.34, so the rounding of 1 + x costs at most two roundings of the result.
// x <= -1 gives an unspecified value (the divergences select those lanes away); +inf and NaN are returned
// as themselves (the bit manipulation would make them finite).
inline F log1p(F x) {
  const F one = set(1.0f);
  const F u = add(one, x);
  // Adding 1 - sqrt(1/2) (in the bit pattern) moves the exponent boundary from 1 to sqrt(1/2).
  const I shifted_bits = add_int(bits(u), set_int(0x3f800000 - 0x3f3504f3));
  const I k = sub_int(shift_right_23(shifted_bits), set_int(127));
  const F m = from_bits(add_int(and_int(shifted_bits, set_int(0x007fffff)), set_int(0x3f3504f3)));
  const F f = select(equal_int(k, set_int(0)), x, sub(m, one));
  const F s = divide(f, add(set(2.0f), f));
  const F z = mul(s, s);
  const F w = mul(z, z);
  const F odd = mul(z, fmadd(w, set(0.28498786688f), set(0.66666662693f)));
  const F even = mul(w, fmadd(w, set(0.24279078841f), set(0.40000972152f)));
  const F half_f2 = mul(mul(set(0.5f), f), f);
  const F dk = to_float(k);
  // s (f^2/2 + R) + k ln2_lo - f^2/2 + f + k ln2_hi, smallest terms first
  F result = fmadd(s, add(half_f2, add(odd, even)), mul(dk, set(9.0580006145e-06f)));
  result = add(sub(result, half_f2), f);
  result = fmadd(dk, set(6.9313812256e-01f), result);
  return select(not_less(x, set(std::numeric_limits<float>::infinity())), x, result);
}

}  // namespace CPU_CAPABILITY
}  // namespace dro_ext::cpu::simd

#endif
