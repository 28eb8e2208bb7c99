// CPU kernels over a 1-D tensor of losses, written once over at::vec::Vectorized and compiled once per
// SIMD capability. The including file defines DRO_EXT_CAPABILITY_AVX2 (or not) before including this.
#pragma once

#if defined(DRO_EXT_CAPABILITY_AVX2)
#pragma GCC target("avx2,fma,f16c")
// The target pragma enables the instructions but not the feature macros that ATen's and Sleef's headers
// test, so state them here; nothing outside this translation unit sees them.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>

#include <vector>

#include "cpu/kernels.h"
#include "cpu/vectorized_math.h"

namespace dro_ext::cpu {
namespace {

using at::vec::Vectorized;

// Reductions are cut into chunks of this many elements, independent of the thread count, so that the
// result is bitwise repeatable; each chunk is summed in blocks to keep the float32 rounding error small.
constexpr int64_t kChunk = 16384;
constexpr int64_t kBlock = 512;
// Elementwise maps hand out this many elements per task.
constexpr int64_t kMapGrain = 32768;

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

template <typename acc_t>
inline acc_t horizontal_sum(const Vectorized<acc_t>& v) {
  alignas(64) acc_t buf[Vectorized<acc_t>::size()];
  v.store(buf);
  acc_t s = 0;
  for (int64_t i = 0; i < Vectorized<acc_t>::size(); ++i) s += buf[i];
  return s;
}

template <int64_t ORDER, typename Div, typename T>
inline T derivative(const Div& div, const T& t) {
  if constexpr (ORDER == 0) {
    return div.value(t);
  } else if constexpr (ORDER == 1) {
    return div.first(t);
  } else {
    return div.second(t);
  }
}

template <int64_t A, int64_t B, typename scalar_t, typename Div>
std::array<double, 2> reduce_pair(const scalar_t* x, int64_t n, const Div& div, Affine affine) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  // A value of the form linear + log(factor) * weight (smoothed_cvar's softplus) is summed as sum(linear) +
  // log(prod(factor)) * weight: one logarithm per block and lane instead of one log1p per sample. A block
  // multiplies at most 64 (float) or 128 (double) factors in [1, 2] per lane, so the product stays finite,
  // and its rounding adds no more error to the logarithm than summing as many terms would.
  constexpr bool split_value = A == 0 && requires { requires Div::kValueHasLogFactor; };
  const V shift(static_cast<acc_t>(affine.shift));
  const V inv_lam(static_cast<acc_t>(affine.inv_lam));
  const V zero(acc_t(0)), one(acc_t(1));
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  std::vector<acc_t> partial_a(num_chunks), partial_b(num_chunks);
  at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
      V chunk_a = zero, chunk_b = zero;
      for (int64_t block = begin; block < end; block += kBlock) {
        const int64_t block_end = std::min(end, block + kBlock);
        // Two accumulators per sum, so consecutive vectors do not wait on one addition's latency.
        V sum_a = zero, sum_b = zero, sum_a2 = zero, sum_b2 = zero;
        V factor = one, factor2 = one;  // products of the value's log factors (split_value only)
        auto add_a = [&](V& sum, V& product, const V& t) {
          if constexpr (split_value) {
            sum = sum + div.value_linear(t);
            product = product * div.value_log_factor(t);
          } else {
            sum = sum + derivative<A>(div, t);
          }
        };
        int64_t i = block;
        for (; i + 2 * V::size() <= block_end; i += 2 * V::size()) {
          V t = (load<acc_t>(x + i, V::size()) - shift) * inv_lam;
          V t2 = (load<acc_t>(x + i + V::size(), V::size()) - shift) * inv_lam;
          add_a(sum_a, factor, t);
          sum_b = sum_b + derivative<B>(div, t);
          add_a(sum_a2, factor2, t2);
          sum_b2 = sum_b2 + derivative<B>(div, t2);
        }
        sum_a = sum_a + sum_a2;
        sum_b = sum_b + sum_b2;
        for (; i + V::size() <= block_end; i += V::size()) {
          V t = (load<acc_t>(x + i, V::size()) - shift) * inv_lam;
          add_a(sum_a, factor, t);
          sum_b = sum_b + derivative<B>(div, t);
        }
        if (i < block_end) {
          const int64_t count = block_end - i;
          V t = (load<acc_t>(x + i, count) - shift) * inv_lam;
          if constexpr (split_value) {
            sum_a = sum_a + V::set(zero, div.value_linear(t), count);
            factor = factor * V::set(one, div.value_log_factor(t), count);
          } else {
            sum_a = sum_a + V::set(zero, derivative<A>(div, t), count);
          }
          sum_b = sum_b + V::set(zero, derivative<B>(div, t), count);
        }
        if constexpr (split_value) sum_a = sum_a + (factor * factor2).log() * V(div.value_log_weight());
        chunk_a = chunk_a + sum_a;
        chunk_b = chunk_b + sum_b;
      }
      partial_a[c] = horizontal_sum(chunk_a);
      partial_b[c] = horizontal_sum(chunk_b);
    }
  });
  acc_t total_a = 0, total_b = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    total_a += partial_a[c];
    total_b += partial_b[c];
  }
  return {static_cast<double>(total_a), static_cast<double>(total_b)};
}

// Outputs at least this large go around the cache: they will not be read back before they are evicted,
// and a streaming store skips the read-for-ownership a cached store of a cold line costs.
constexpr int64_t kStreamingBytes = int64_t(8) << 20;

// Writes v to p, bypassing the cache where the build and the alignment allow; a task that stored this
// way ends with store_fence().
template <typename acc_t, typename scalar_t>
inline void store_streaming(scalar_t* p, const Vectorized<acc_t>& v) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) return _mm256_stream_ps(p, v);
  } else if constexpr (std::is_same_v<scalar_t, double> && std::is_same_v<acc_t, double>) {
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) return _mm256_stream_pd(p, v);
  }
#endif
  store<acc_t>(p, v, Vectorized<acc_t>::size());
}

inline void store_fence() {
#if defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

template <int64_t ORDER, typename scalar_t, typename Div>
void map_order(const scalar_t* x, scalar_t* out, int64_t n, const Div& div, Affine affine, double multiplier) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  const V shift(static_cast<acc_t>(affine.shift));
  const V inv_lam(static_cast<acc_t>(affine.inv_lam));
  const V mult(static_cast<acc_t>(multiplier));
  const bool streaming = n * static_cast<int64_t>(sizeof(scalar_t)) >= kStreamingBytes;
  at::parallel_for(0, n, kMapGrain, [&, div](int64_t begin, int64_t end) {
    // Local copies: the compiler cannot keep values reached through the captured references in registers
    // across the stores to out, and would reload every one of them per vector.
    const V shift_v = shift, inv_lam_v = inv_lam, mult_v = mult;
    auto term = [&](const V& xs) { return mult_v * derivative<ORDER>(div, (xs - shift_v) * inv_lam_v); };
    int64_t i = begin;
    if (streaming) {
      for (; i + V::size() <= end; i += V::size()) store_streaming<acc_t>(out + i, term(load<acc_t>(x + i, V::size())));
      store_fence();
    } else {
      for (; i + V::size() <= end; i += V::size()) store<acc_t>(out + i, term(load<acc_t>(x + i, V::size())), V::size());
    }
    if (i < end) store<acc_t>(out + i, term(load<acc_t>(x + i, end - i)), end - i);
  });
}

std::array<double, 2> reduce_derivatives_impl(
    const at::Tensor& x, const DivergenceSpec& spec, Affine affine, int64_t order_a, int64_t order_b) {
  TORCH_INTERNAL_ASSERT(x.is_contiguous() && x.dim() == 1);
  TORCH_INTERNAL_ASSERT((order_a == 0 && order_b == 1) || (order_a == 1 && order_b == 2));
  std::array<double, 2> out{};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_reduce", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    out = visit_divergence<acc_t>(spec, [&](const auto& div) {
      return order_a == 0 ? reduce_pair<0, 1>(data, x.numel(), div, affine)
                          : reduce_pair<1, 2>(data, x.numel(), div, affine);
    });
  });
  return out;
}

void map_derivative_impl(
    const at::Tensor& x, at::Tensor& out, const DivergenceSpec& spec, Affine affine, double multiplier,
    int64_t order) {
  TORCH_INTERNAL_ASSERT(x.is_contiguous() && out.is_contiguous() && x.numel() == out.numel());
  TORCH_INTERNAL_ASSERT(order >= 0 && order <= 2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_map", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    scalar_t* result = out.mutable_data_ptr<scalar_t>();
    visit_divergence<acc_t>(spec, [&](const auto& div) {
      switch (order) {
        case 0: map_order<0>(data, result, x.numel(), div, affine, multiplier); break;
        case 1: map_order<1>(data, result, x.numel(), div, affine, multiplier); break;
        default: map_order<2>(data, result, x.numel(), div, affine, multiplier); break;
      }
    });
  });
}

}  // namespace
}  // namespace dro_ext::cpu
