// Math<Vectorized<T>>: the elementary operations of csrc/divergences.h on ATen's CPU vectors, so the
// same divergence functors run a whole SIMD register at a time. Include this after defining the CPU
// capability of the translation unit (see simd_capability.h).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <limits>
#include <type_traits>

#include "cpu/simd_float.h"
#include "divergences.h"

namespace dro_ext {

template <typename S>
struct Math<at::vec::Vectorized<S>> {
  using V = at::vec::Vectorized<S>;
  static constexpr bool kFloat = std::is_same_v<S, float>;
  static inline V constant(double c) { return V(static_cast<S>(c)); }
  static inline V exp(const V& x) {
#if defined(DRO_EXT_SIMD_FLOAT)
    return V(cpu::simd::exp(x));  // float and double: simd_float.h's
#else
    if constexpr (kFloat) {
      // ATen's exp_u20 (a degree-5 polynomial) is about twice as fast as Sleef's exp. It clamps its
      // argument, so put back what the clamp hides: inf past the overflow threshold, NaN.
      const V overflow(88.72283935546875f);  // log(FLT_MAX), the constant exp_u20 clamps at
      V r = V::blendv(x.exp_u20(), V(std::numeric_limits<float>::infinity()), x > overflow);
      return V::blendv(r, x, x.isnan());
    }
#endif
    return x.exp();
  }
  // e^x - 1, relatively accurate for small |x|: the excess terms of csrc/divergences.h are built from it.
  static inline V expm1(const V& x) {
#if defined(DRO_EXT_SIMD_FLOAT)
    if constexpr (kFloat) return V(cpu::simd::expm1(x));
#endif
    return x.expm1();
  }
  // log(1 + x) for x > -1, relatively accurate for small |x|; x <= -1 gives an unspecified value (the
  // divergences select those lanes away), +inf gives +inf and NaN gives NaN.
  static inline V log1p(const V& x) {
#if defined(DRO_EXT_SIMD_FLOAT)
    if constexpr (kFloat) return V(cpu::simd::log1p(x));
#endif
    return x.log1p();
  }
  // log(x) for x > 0 (smoothed_cvar's log of a sum of positive terms, away from 1).
  static inline V log(const V& x) { return x.log(); }
  // a b + c (see Math<T>::fmadd): one FMA in the SIMD builds, two roundings in the portable one.
  static inline V fmadd(const V& a, const V& b, const V& c) {
#if defined(DRO_EXT_SIMD_FLOAT)
    return V(cpu::simd::fmadd(a, b, c));
#else
    return a * b + c;
#endif
  }
  // a / b for b bounded away from 0 and infinity (see Math<T>::divide).
  static inline V divide(const V& a, const V& b) {
#if defined(DRO_EXT_SIMD_FLOAT)
    if constexpr (kFloat) return V(cpu::simd::divide(a, b));
#endif
    return a / b;
  }
#if defined(DRO_EXT_SIMD_FLOAT)
  // max/min return their second operand when either is NaN: with x second, NaN passes in one instruction.
  static inline V relu(const V& x) { return V(cpu::simd::max(cpu::simd::set(S(0)), x)); }
  static inline V min(const V& x, const V& hi) { return V(cpu::simd::min(hi, x)); }
  static inline V max(const V& x, const V& lo) { return V(cpu::simd::max(lo, x)); }
  static inline V neg_abs(const V& x) { return V(cpu::simd::set_sign(x)); }
#else
  // blendv(a, b, mask) takes b where mask is set; a NaN compares false everywhere, so it keeps x.
  static inline V relu(const V& x) { return V::blendv(x, V(S(0)), x < V(S(0))); }
  static inline V min(const V& x, const V& hi) { return V::blendv(x, hi, x > hi); }
  static inline V max(const V& x, const V& lo) { return V::blendv(x, lo, x < lo); }
  static inline V neg_abs(const V& x) { return -x.abs(); }
#endif
  // The selects compare into the register's own mask type (a bit mask on AVX-512): ATen's comparisons
  // return a vector, which AVX-512 converts from a bit mask and back for every blend.
  // (float32 and float64 alike: the float64 Newton pass of chi2 spent a third of its instructions converting masks.)
  static inline V select_positive(const V& x, const V& if_pos, const V& if_nonpos) {
#if defined(DRO_EXT_SIMD_FLOAT)
    using namespace cpu::simd;
    const auto zero = set(S(0));
    return V(select(greater(x, zero), if_pos, select(less_equal(x, zero), if_nonpos, x)));
#else
    const V zero(S(0));
    V out = V::blendv(x, if_nonpos, x <= zero);
    return V::blendv(out, if_pos, x > zero);
#endif
  }
  // (see Math<T>::select_positive_rare) make_if_nonpos runs only when some lane of x is not above 0: a branch that
  // data without such lanes always predicts.
  template <typename F>
  static inline V select_positive_rare(const V& x, const V& if_pos, F make_if_nonpos) {
#if defined(DRO_EXT_SIMD_FLOAT)
    // One comparison into the register's own mask type and one test of it (ATen's comparison builds a vector of
    // the mask, and zero_mask takes it back).
    using namespace cpu::simd;
    const auto positive = greater(x, set(S(0)));
    if (all_lanes(positive)) [[likely]] return if_pos;
    return V(select(positive, if_pos, select(less_equal(x, set(S(0))), make_if_nonpos(), x)));
#else
    if ((x > V(S(0))).zero_mask() == 0) [[likely]] return if_pos;
    return select_positive(x, if_pos, make_if_nonpos());
#endif
  }

  static inline V if_positive(const V& x, const V& if_pos, const V& otherwise) {
#if defined(DRO_EXT_SIMD_FLOAT)
    return V(cpu::simd::select(cpu::simd::greater(x, cpu::simd::set(S(0))), if_pos, otherwise));
#else
    return V::blendv(otherwise, if_pos, x > V(S(0)));
#endif
  }
};

}  // namespace dro_ext
