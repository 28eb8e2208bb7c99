// The two passes of the CPU sample select (select_tail in csrc/robust_objective.cpp) over the losses x and a
// bracket [lower, upper] read off a sample: per chunk, the float64 sum and the count of the losses above the bracket
// and the count inside it; then the losses inside, gathered in order as float64. Compiled once per SIMD capability,
// like kernels_impl.h (csrc/cpu/kernel_tables.h includes both).
//
// Why SIMD here: both passes were scalar loops with a data-dependent branch per loss, and at a few thousand losses
// they (with a std::nth_element over every loss below 2^14) were most of the cvar objective's time.
#pragma once

#include "cpu/simd_capability.h"  // first: it sets the capability the ATen headers below compile for

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/kernels_impl.h"  // dispatch_floating, load, horizontal_sum, map_chunks

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace dro_ext::cpu {
namespace {

// The bracket in acc_t, so that comparing x_i (exact in acc_t) with it is comparing x_i with the float64 bounds:
// x > upper_d <=> x > upper_d rounded down, x >= lower_d <=> x >= lower_d rounded up.
template <typename acc_t>
std::pair<acc_t, acc_t> bracket_in(double lower_d, double upper_d) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  acc_t lower = static_cast<acc_t>(lower_d), upper = static_cast<acc_t>(upper_d);
  if (static_cast<double>(lower) < lower_d) lower = std::nextafter(lower, inf);
  if (static_cast<double>(upper) > upper_d) upper = std::nextafter(upper, -inf);
  return {lower, upper};
}

// The lanes of a float32 vector as float64, low half first.
inline std::pair<Vectorized<double>, Vectorized<double>> widen(const Vectorized<float>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 f = v;
  return {Vectorized<double>(_mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 0))),
          Vectorized<double>(_mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)))};
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 f = v;
  return {Vectorized<double>(_mm256_cvtps_pd(_mm256_extractf128_ps(f, 0))),
          Vectorized<double>(_mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)))};
#else
  static_assert(Vectorized<float>::size() == 2 * Vectorized<double>::size());
  alignas(64) float lanes[Vectorized<float>::size()];
  alignas(64) double wide[Vectorized<float>::size()];
  v.store(lanes);
  for (int64_t l = 0; l < Vectorized<float>::size(); ++l) wide[l] = static_cast<double>(lanes[l]);
  return {Vectorized<double>::loadu(wide), Vectorized<double>::loadu(wide + Vectorized<double>::size())};
#endif
}

// counts plus the losses [i, end) one at a time, then `inside` made the count inside the bracket (it came in as the
// count of the losses >= lower, which includes every loss above upper): the tail of both chunk functions below.
template <typename acc_t, typename scalar_t>
BracketCounts finish_chunk(BracketCounts counts, const scalar_t* data, int64_t i, int64_t end, acc_t lower,
                           acc_t upper) {
  for (; i < end; ++i) {
    const acc_t v = static_cast<acc_t>(data[i]);
    if (v > upper) {
      counts.sum_above += static_cast<double>(v);
      ++counts.above;
    }
    counts.inside += v >= lower;
  }
  counts.inside -= counts.above;
  return counts;
}

// One chunk's BracketCounts over Vectorized lanes of acc_t (compared there, as bracket_in says).
template <typename acc_t, typename scalar_t>
BracketCounts bracket_chunk(const scalar_t* data, int64_t begin, int64_t end, acc_t lower, acc_t upper) {
  using V = Vectorized<acc_t>;
  using D = Vectorized<double>;
  const V lower_v(lower), upper_v(upper), zero(acc_t(0)), one(acc_t(1));
  // Counts in acc_t lanes are exact: a chunk gives a lane at most kReductionChunk / lanes of them.
  V above_count(zero), at_least_count(zero);
  D sum_low(0.0), sum_high(0.0);
  int64_t i = begin;
  for (; i + V::size() <= end; i += V::size()) {
    const V v = load<acc_t>(data + i, V::size());
    const V above = v > upper_v;
    above_count = above_count + V::blendv(zero, one, above);
    at_least_count = at_least_count + V::blendv(zero, one, v >= lower_v);
    const V kept = V::blendv(zero, v, above);
    if constexpr (std::is_same_v<acc_t, double>) {
      sum_low = sum_low + kept;
    } else {
      const auto [low, high] = widen(kept);
      sum_low = sum_low + low;
      sum_high = sum_high + high;
    }
  }
  const BracketCounts counts{horizontal_sum(sum_low + sum_high), static_cast<int64_t>(horizontal_sum(above_count)),
                             static_cast<int64_t>(horizontal_sum(at_least_count))};
  return finish_chunk(counts, data, i, end, lower, upper);
}

#if defined(CPU_CAPABILITY_AVX512)
// The same for float32 and float64 losses with AVX-512's bit masks: counts by popcount and the float64 sum by
// masked adds, two vectors a step into two sums (the generic lanes spent a compare and a blend per count, and one
// add chain: 0.7 us of a 7 us cvar objective at 4096 float32 losses).
template <typename T>
BracketCounts bracket_chunk_avx512(const T* data, int64_t begin, int64_t end, T lower, T upper) {
  constexpr int64_t kLanes = 64 / sizeof(T);
  __m512d sum[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
  int64_t above = 0, at_least = 0;
  int64_t i = begin;
  if constexpr (std::is_same_v<T, float>) {
    const __m512 lower_v = _mm512_set1_ps(lower), upper_v = _mm512_set1_ps(upper);
    for (; i + kLanes <= end; i += kLanes) {
      const __m512 v = _mm512_loadu_ps(data + i);
      const __mmask16 is_above = _mm512_cmp_ps_mask(v, upper_v, _CMP_GT_OQ);
      above += __builtin_popcount(is_above);
      at_least += __builtin_popcount(_mm512_cmp_ps_mask(v, lower_v, _CMP_GE_OQ));
      const __m512d low = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 0));
      const __m512d high = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
      sum[0] = _mm512_mask_add_pd(sum[0], static_cast<__mmask8>(is_above), sum[0], low);
      sum[1] = _mm512_mask_add_pd(sum[1], static_cast<__mmask8>(is_above >> 8), sum[1], high);
    }
  } else {
    const __m512d lower_v = _mm512_set1_pd(lower), upper_v = _mm512_set1_pd(upper);
    for (; i + 2 * kLanes <= end; i += 2 * kLanes) {
      for (int half = 0; half < 2; ++half) {
        const __m512d v = _mm512_loadu_pd(data + i + half * kLanes);
        const __mmask8 is_above = _mm512_cmp_pd_mask(v, upper_v, _CMP_GT_OQ);
        above += __builtin_popcount(is_above);
        at_least += __builtin_popcount(_mm512_cmp_pd_mask(v, lower_v, _CMP_GE_OQ));
        sum[half] = _mm512_mask_add_pd(sum[half], is_above, sum[half], v);
      }
    }
  }
  return finish_chunk(BracketCounts{_mm512_reduce_add_pd(_mm512_add_pd(sum[0], sum[1])), above, at_least}, data, i,
                      end, lower, upper);
}
#endif

template <typename scalar_t>
std::vector<BracketCounts> bracket_counts_typed(const at::Tensor& x, double lower_d, double upper_d) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  const auto [lower, upper] = bracket_in<acc_t>(lower_d, upper_d);
  return map_chunks<BracketCounts>(x.numel(), [&](int64_t begin, int64_t end) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<scalar_t, acc_t>) return bracket_chunk_avx512(data, begin, end, lower, upper);
#endif
    return bracket_chunk(data, begin, end, lower, upper);
  });
}

// Writes the lanes of v set in mask (one bit per lane, lane 0 lowest) to dst as float64, in lane order, and returns
// how many; never writes at or past dst_end.
template <typename acc_t>
inline int64_t write_lanes(const Vectorized<acc_t>& v, uint32_t mask, double* dst, const double* dst_end) {
  using V = Vectorized<acc_t>;
  const int64_t count = __builtin_popcount(mask);
#if defined(CPU_CAPABILITY_AVX512)
  // Packing the set lanes in a register (vcompressps/pd to a register, not to memory, which is microcoded on some
  // processors) and storing whole vectors where the chunk's room allows.
  if (dst + V::size() <= dst_end) {
    if constexpr (std::is_same_v<acc_t, double>) {
      _mm512_storeu_pd(dst, _mm512_maskz_compress_pd(static_cast<__mmask8>(mask), v));
    } else {
      const auto [low, high] = widen(Vectorized<float>(_mm512_maskz_compress_ps(static_cast<__mmask16>(mask), v)));
      low.store(dst);
      high.store(dst + Vectorized<double>::size());
    }
    return count;
  }
#endif
  (void)dst_end;
  alignas(64) acc_t lanes[V::size()];
  v.store(lanes);
  for (uint32_t m = mask; m != 0; m &= m - 1) *dst++ = static_cast<double>(lanes[__builtin_ctz(m)]);
  return count;
}

// A bit per lane of v with lower <= v <= upper, lane 0 lowest.
template <typename acc_t>
inline uint32_t inside_lanes(const Vectorized<acc_t>& v, const Vectorized<acc_t>& lower, const Vectorized<acc_t>& upper,
                             uint32_t all_lanes) {
#if defined(CPU_CAPABILITY_AVX512)
  (void)all_lanes;
  if constexpr (std::is_same_v<acc_t, float>) {
    return _mm512_cmp_ps_mask(v, lower, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, upper, _CMP_LE_OQ);
  } else {
    return _mm512_cmp_pd_mask(v, lower, _CMP_GE_OQ) & _mm512_cmp_pd_mask(v, upper, _CMP_LE_OQ);
  }
#else
  // zero_mask: a bit per lane equal to 0.0; the lanes inside are all ones (a NaN), the others all zeros.
  return ~static_cast<uint32_t>(((v >= lower) & (v <= upper)).zero_mask()) & all_lanes;
#endif
}

template <typename scalar_t>
void gather_bracket_typed(const at::Tensor& x, double lower_d, double upper_d, const int64_t* offsets, double* out) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  const auto [lower, upper] = bracket_in<acc_t>(lower_d, upper_d);
  const uint32_t all_lanes = static_cast<uint32_t>((uint64_t{1} << V::size()) - 1);
  for_each_chunk(x.numel(), [&](int64_t c, int64_t begin, int64_t end) {
    double* dst = out + offsets[c];
    const double* const dst_end = out + offsets[c + 1];
    const V lower_v(lower), upper_v(upper);
    int64_t i = begin;
    for (; i + V::size() <= end; i += V::size()) {
      const V v = load<acc_t>(data + i, V::size());
      const uint32_t inside = inside_lanes(v, lower_v, upper_v, all_lanes);
      if (inside != 0) dst += write_lanes(v, inside, dst, dst_end);
    }
    for (; i < end; ++i) {
      const acc_t v = static_cast<acc_t>(data[i]);
      if (v >= lower && v <= upper) *dst++ = static_cast<double>(v);
    }
  });
}

std::vector<BracketCounts> bracket_counts_impl(const at::Tensor& x, double lower, double upper) {
  return dispatch_floating(x, [&](auto tag) { return bracket_counts_typed<decltype(tag)>(x, lower, upper); });
}

void gather_bracket_impl(const at::Tensor& x, double lower, double upper, const int64_t* offsets, double* out) {
  dispatch_floating(x, [&](auto tag) { gather_bracket_typed<decltype(tag)>(x, lower, upper, offsets, out); });
}

}  // namespace
}  // namespace dro_ext::cpu
