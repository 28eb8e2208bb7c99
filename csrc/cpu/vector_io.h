// Loads, stores and lane sums between a buffer of any float dtype and at::vec::Vectorized of its accumulate
// dtype, shared by the CPU kernel headers. Include it after cpu/simd_capability.h, like every ATen vector header.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace dro_ext::cpu {
namespace {

using at::vec::Vectorized;

// The first min(count, lanes) elements of p as acc_t lanes (zero beyond count).
template <typename acc_t, typename scalar_t>
inline Vectorized<acc_t> load(const scalar_t* p, int64_t count) {
  using V = Vectorized<acc_t>;
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    return count >= V::size() ? V::loadu(p) : V::loadu(p, count);
  } else {
    alignas(64) acc_t buf[V::size()] = {};
    for (int64_t i = 0; i < std::min<int64_t>(count, V::size()); ++i) buf[i] = static_cast<acc_t>(p[i]);
    return V::loadu(buf);
  }
}

// The first min(count, lanes) lanes of v into p, converted to scalar_t.
template <typename acc_t, typename scalar_t>
inline void store(scalar_t* p, const Vectorized<acc_t>& v, int64_t count) {
  using V = Vectorized<acc_t>;
  if constexpr (std::is_same_v<acc_t, scalar_t>) {
    v.store(p, static_cast<int>(std::min<int64_t>(count, V::size())));
  } else {
    alignas(64) acc_t buf[V::size()];
    v.store(buf);
    for (int64_t i = 0; i < std::min<int64_t>(count, V::size()); ++i) p[i] = static_cast<scalar_t>(buf[i]);
  }
}

// The lanes' sum, pairwise (lane i + lane i + half, halving): a fixed order, and log2(lanes) additions deep instead of
// a chain through every lane, which the reductions pay once per block and per running sum (a tenth of smoothed_cvar's
// loss pass at 512-loss blocks).
template <typename acc_t>
inline acc_t horizontal_sum(const Vectorized<acc_t>& v) {
  constexpr int64_t kLanes = Vectorized<acc_t>::size();
  alignas(64) acc_t buf[kLanes];
  v.store(buf);
  for (int64_t half = kLanes / 2; half >= 1; half /= 2) {
    for (int64_t i = 0; i < half; ++i) buf[i] += buf[i + half];
  }
  return buf[0];
}

// The sum of the lanes in float64, in lane order.
template <typename acc_t>
inline double wide_horizontal_sum(const Vectorized<acc_t>& v) {
  constexpr int64_t kLanes = Vectorized<acc_t>::size();
  alignas(64) acc_t buf[kLanes];
  v.store(buf);
  double sum = 0;
  for (int64_t i = 0; i < kLanes; ++i) sum += static_cast<double>(buf[i]);
  return sum;
}

// Kahan's compensated sum, lane by lane: a sum of terms in [0, 1] whose largest term, once in, would otherwise drop
// every later term below half its rounding step (a confident row's 1 against its small probabilities). The terms
// must be finite or NaN (an inf would turn the compensation NaN).
template <typename acc_t>
struct CompensatedSum {
  Vectorized<acc_t> sum{acc_t(0)};
  Vectorized<acc_t> lost{acc_t(0)};  // what the roundings of sum dropped, negated

  void add(const Vectorized<acc_t>& x) {
    const Vectorized<acc_t> term = x - lost;
    const Vectorized<acc_t> next = sum + term;
    lost = (next - sum) - term;
    sum = next;
  }
  void scale(const Vectorized<acc_t>& factor) {
    sum = sum * factor;
    lost = lost * factor;
  }
  // Each lane's sum in float64, sum - lost, not rounded back to acc_t.
  void store_wide(double* out) const {
    constexpr int64_t kLanes = Vectorized<acc_t>::size();
    alignas(64) acc_t sums[kLanes], losts[kLanes];
    sum.store(sums);
    lost.store(losts);
    for (int64_t i = 0; i < kLanes; ++i) out[i] = static_cast<double>(sums[i]) - static_cast<double>(losts[i]);
  }
};

}  // namespace
}  // namespace dro_ext::cpu
