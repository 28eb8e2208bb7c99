// CPU kernels over a 1-D tensor of losses, written once over at::vec::Vectorized and compiled once per
// SIMD capability. The including file (through csrc/cpu/kernel_tables.h) sets the capability first.
#pragma once

#include "cpu/simd_capability.h"  // first: it sets the capability the ATen headers below compile for

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/chunks.h"
#include "cpu/kernels.h"
#include "cpu/vector_io.h"
#include "cpu/vectorized_math.h"
#include "group_dro_step.h"  // exp_or_zero

namespace dro_ext::cpu {
namespace {

using at::vec::Vectorized;

// Each chunk of a reduction (cpu/chunks.h) is summed in blocks of this many elements, to keep the float32
// rounding error small.
constexpr int64_t kBlock = 512;
// Elementwise maps hand out this many elements per task.
constexpr int64_t kMapGrain = 32768;
// How far ahead of the element being computed the kernels ask for the input. The hardware prefetchers stop
// at every 4 KiB page (and the page's translation misses the TLB): without a software prefetch a
// compute-bound pass over an input that lives beyond L2 pays the memory latency at every page instead of
// overlapping it with the arithmetic (measured: kl's forward at N = 2^24 took the time of its arithmetic
// plus that of a plain read).
constexpr int64_t kPrefetchBytes = 4096;

// Asks, without waiting, for the cache lines of the `count` elements that lie kPrefetchBytes ahead of x + i,
// clipped to x + limit.
template <typename scalar_t>
inline void prefetch_ahead(const scalar_t* x, int64_t i, int64_t count, int64_t limit) {
  constexpr int64_t kAhead = kPrefetchBytes / int64_t(sizeof(scalar_t));
  const char* first = reinterpret_cast<const char*>(x + i + kAhead);
  const char* last = std::min(first + count * int64_t(sizeof(scalar_t)), reinterpret_cast<const char*>(x + limit));
  for (const char* line = first; line < last; line += 64) __builtin_prefetch(line, 0, 3);
}

// map_order's ORDER for psi*'(t) as divergences.h's coarse_first_unscaled(t), its coarse_first_scale() folded into the
// multiplier (where coarse_ok() holds): one multiplication a sample fewer.
constexpr int64_t kUnscaledFirst = -1;

template <int64_t ORDER, typename Div, typename T>
inline T derivative(const Div& div, const T& t) {
  if constexpr (ORDER == kUnscaledFirst) {
    return div.coarse_first_unscaled(t);
  } else if constexpr (ORDER == 0) {
    return div.value(t);
  } else if constexpr (ORDER == 1) {
    return div.first(t);
  } else {
    return div.second(t);
  }
}

// The per-element terms a reduction sums, of the deviation d = x - shift and of t = d * inv_lam.
// LossA and LossB are divergences.h's loss_part_a and loss_part_b, the first in units of d (so that the ERM part of
// the loss, sum d, does not pass through t, which underflows where lam is huge); NegClampedAbsT is -min(|t|, 1);
// SecondAbsDeviation is psi*''(t) |d|; CoarseFirst is psi*'(t) in a coarse pass, divided by coarse_first_scale
// (divergences.h's coarse_first_unscaled where it has one).
enum class Term {
  None, Deviation, T, NegClampedAbsT, Value, Excess, ExcessFirst, First, Second, SecondAbsDeviation, LossA, LossB,
  CoarseValue, CoarseLinear, CoarseFactor, CoarseFirst
};

// A running product instead of a running sum (the factors of a coarse value in product form, divergences.h).
constexpr bool is_product(Term term) { return term == Term::CoarseFactor; }

// What Term::CoarseFirst's sums are multiplied by to be sums of psi*' (divergences.h's coarse_first_scale, or 1).
template <typename acc_t, typename Div>
inline acc_t coarse_first_scale(const Div& div) {
  if constexpr (requires { div.coarse_first_scale(); }) {
    return static_cast<acc_t>(div.coarse_first_scale());
  } else {
    return acc_t(1);
  }
}

template <Term kTerm, typename Div, typename T>
inline T term(const Div& div, const T& d, const T& t) {
  if constexpr (kTerm == Term::Deviation) {
    return d;
  } else if constexpr (kTerm == Term::T) {
    return t;
  } else if constexpr (kTerm == Term::NegClampedAbsT) {
    return Math<T>::max(Math<T>::neg_abs(t), Math<T>::constant(-1.0));
  } else if constexpr (kTerm == Term::Value) {
    return div.value(t);
  } else if constexpr (kTerm == Term::Excess) {
    return div.excess(t);
  } else if constexpr (kTerm == Term::ExcessFirst) {
    return div.excess_first(t);
  } else if constexpr (kTerm == Term::First) {
    return div.first(t);
  } else if constexpr (kTerm == Term::Second) {
    return div.second(t);
  } else if constexpr (kTerm == Term::SecondAbsDeviation) {
    return div.second(t) * -Math<T>::neg_abs(d);
  } else if constexpr (kTerm == Term::LossA) {
    return loss_part_a(div, t, d);
  } else if constexpr (kTerm == Term::LossB) {
    return loss_part_b(div, t);
  } else if constexpr (kTerm == Term::CoarseLinear) {
    return div.coarse_linear(t);
  } else if constexpr (kTerm == Term::CoarseFactor) {
    return div.coarse_factor(t);
  } else if constexpr (kTerm == Term::CoarseFirst) {  // first(t) / coarse_first_scale(div), where coarse_ok()
    if constexpr (requires { div.coarse_first_unscaled(t); }) {
      return div.coarse_first_unscaled(t);
    } else {
      return div.first(t);
    }
  } else {
    return div.coarse_value(t);
  }
}

// Up to four running sums and a running product (E) in registers (a Term::None slot is never touched).
template <typename V, Term A, Term B, Term C, Term D = Term::None, Term E = Term::None>
struct Accumulator {
  static_assert(!is_product(A) && !is_product(B) && !is_product(C) && !is_product(D) &&
                (E == Term::None || is_product(E)));
  V a, b, c, d, e;
  explicit Accumulator(const V& zero)
      : a(zero), b(zero), c(zero), d(zero), e(typename V::value_type(1)) {}
  template <typename Div>
  inline void add(const Div& div, const V& dev, const V& t) {
    if constexpr (A != Term::None) a = a + term<A>(div, dev, t);
    if constexpr (B != Term::None) b = b + term<B>(div, dev, t);
    if constexpr (C != Term::None) c = c + term<C>(div, dev, t);
    if constexpr (D != Term::None) d = d + term<D>(div, dev, t);
    if constexpr (E != Term::None) e = e * term<E>(div, dev, t);
  }
  // The terms of two vectors: one addition per running sum, so its latency is paid once per two vectors.
  template <typename Div>
  inline void add_pair(const Div& div, const V& d1, const V& t1, const V& d2, const V& t2) {
    if constexpr (A != Term::None) a = a + (term<A>(div, d1, t1) + term<A>(div, d2, t2));
    if constexpr (B != Term::None) b = b + (term<B>(div, d1, t1) + term<B>(div, d2, t2));
    if constexpr (C != Term::None) c = c + (term<C>(div, d1, t1) + term<C>(div, d2, t2));
    if constexpr (D != Term::None) d = d + (term<D>(div, d1, t1) + term<D>(div, d2, t2));
    if constexpr (E != Term::None) e = e * (term<E>(div, d1, t1) * term<E>(div, d2, t2));
  }
  // Adds only the first `count` lanes of other's terms (a partial vector's unused lanes hold junk terms).
  inline void add_lanes(const Accumulator& other, const V& zero, int64_t count) {
    if constexpr (A != Term::None) a = a + V::set(zero, other.a, count);
    if constexpr (B != Term::None) b = b + V::set(zero, other.b, count);
    if constexpr (C != Term::None) c = c + V::set(zero, other.c, count);
    if constexpr (D != Term::None) d = d + V::set(zero, other.d, count);
    if constexpr (E != Term::None) e = e * V::set(V(typename V::value_type(1)), other.e, count);
  }
  inline void add(const Accumulator& other) {
    a = a + other.a;
    b = b + other.b;
    c = c + other.c;
    d = d + other.d;
    if constexpr (E != Term::None) e = e * other.e;
  }
};

// The sums of the terms of the elements [begin, end) of x, two vectors at a time into one set of running
// sums: a second set of accumulators would hide more of the additions' latency, but the exponential
// divergences need most of the 32 vector registers for their constants, and GCC then keeps running sums in
// memory, which chains every vector through a store and a reload. The accumulators, the constants and the
// functor are locals of this function for the same reason: held through a reference, the compiler keeps
// them in memory (a store to them might change what x points to, as far as it knows).
//
// A pass that streams x from memory gives prefetch_limit = n: each step asks for the lines kPrefetchBytes
// ahead of it, a line or two at a time. (Asking for a whole block's 32 lines at its start stalled the loop:
// software prefetches that miss wait for a free fill buffer, of which a core has about 16; perf put a third
// of smoothed_cvar's forward at N = 2^24 on that burst.) A second pass over a block already in L1 gives 0.
template <typename Acc, typename acc_t, typename scalar_t, typename Div>
inline Acc accumulate_block(const scalar_t* x, int64_t begin, int64_t end, int64_t prefetch_limit, const Div& div_in,
                            const Vectorized<acc_t>& shift_in, const Vectorized<acc_t>& inv_lam_in) {
  using V = Vectorized<acc_t>;
  const V zero(acc_t(0));
  const V shift = shift_in, inv_lam = inv_lam_in;
  const Div div = div_in;
  Acc sums(zero);
  int64_t i = begin;
  for (; i + 2 * V::size() <= end; i += 2 * V::size()) {
    prefetch_ahead(x, i, 2 * V::size(), prefetch_limit);
    const V d1 = load<acc_t>(x + i, V::size()) - shift;
    const V d2 = load<acc_t>(x + i + V::size(), V::size()) - shift;
    sums.add_pair(div, d1, d1 * inv_lam, d2, d2 * inv_lam);
  }
  for (; i + V::size() <= end; i += V::size()) {
    const V d1 = load<acc_t>(x + i, V::size()) - shift;
    sums.add(div, d1, d1 * inv_lam);
  }
  if (i < end) {
    const V d1 = load<acc_t>(x + i, end - i) - shift;
    Acc tail(zero);
    tail.add(div, d1, d1 * inv_lam);
    sums.add_lanes(tail, zero, end - i);
  }
  return sums;
}

// The per-chunk sums added up in chunk order, in float64: in float32 the chunks' sums (of alike size) drifted by a
// rounding each, sqrt(N / chunk) of them in all (the worst-case weights summed to 1 + 6e-7 at N = 2^27).
template <typename acc_t>
std::array<double, 3> sum_chunks(const std::vector<std::array<acc_t, 3>>& partial) {
  std::array<double, 3> total{0.0, 0.0, 0.0};
  for (const auto& p : partial) {
    for (size_t j = 0; j < 3; ++j) total[j] += static_cast<double>(p[j]);
  }
  return total;
}

// {sum_i A, sum_i B, sum_i C} over the first n elements of x, in one pass (the terms of one element share
// their subexpressions once inlined: kl's excess and excess_first one expm1).
template <typename scalar_t, typename Div, Term A, Term B, Term C = Term::None>
std::array<double, 3> reduce_terms(const scalar_t* x, int64_t n, const Div& div, Affine affine) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  using Acc = Accumulator<V, A, B, C>;
  const V shift(static_cast<acc_t>(affine.shift));
  const V inv_lam(static_cast<acc_t>(affine.inv_lam));
  const V zero(acc_t(0));
  return sum_chunks(map_chunks<std::array<acc_t, 3>>(n, [&](int64_t begin, int64_t end) {
    Acc chunk(zero);
    for (int64_t block = begin; block < end; block += kBlock) {
      const int64_t block_end = std::min(end, block + kBlock);
      chunk.add(accumulate_block<Acc>(x, block, block_end, n, div, shift, inv_lam));
    }
    return std::array<acc_t, 3>{horizontal_sum(chunk.a), horizontal_sum(chunk.b), horizontal_sum(chunk.c)};
  }));
}

// Outputs at least this large go around the cache: they will not be read back before they are evicted,
// and a streaming store skips the read-for-ownership a cached store of a cold line costs.
constexpr int64_t kStreamingBytes = int64_t(8) << 20;

// Returns whether some t = (x - shift) / lam passed t_limit (float32_t_limit; never checked for float64): its term
// is then inf or NaN where it need not be (cressie_read's weight ~ t^(1/(k-1)) fits float32 long after t, or
// (k - 1) t, does), and the caller redoes the map on a float64 copy, as the reductions redo a pass whose float32
// result overflowed. Each vector's |d| against t_limit lam, kept as a running minimum of -|d|: two instructions a
// vector, no pass of its own.
template <int64_t ORDER, typename scalar_t, typename Div>
bool map_order(const scalar_t* x, scalar_t* out, int64_t n, const Div& div, Affine affine, double multiplier,
               double t_limit) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  constexpr bool kCheck = !std::is_same_v<acc_t, double>;
  const V shift(static_cast<acc_t>(affine.shift));
  const V inv_lam(static_cast<acc_t>(affine.inv_lam));
  const V mult(static_cast<acc_t>(multiplier));
  [[maybe_unused]] const bool streaming = n * static_cast<int64_t>(sizeof(scalar_t)) >= kStreamingBytes;
  std::atomic<bool> overflowed{false};
  at::parallel_for(0, n, kMapGrain, [&](int64_t begin, int64_t end) {
    // Local copies of everything the loop reads: the compiler cannot keep values reached through the
    // closure in registers across the stores to out (which may alias them as far as it knows), and would
    // reload every one of them per vector.
    const V shift_v = shift, inv_lam_v = inv_lam, mult_v = mult;
    const Div div_v = div;
    const scalar_t* const x_v = x;
    scalar_t* const out_v = out;
    V lowest(acc_t(0));  // the lowest -|x - shift| seen, a NaN passed over
    auto term = [&](const V& xs) {
      const V d = xs - shift_v;
      if constexpr (kCheck) {
#if defined(DRO_EXT_SIMD_FLOAT)
        lowest = V(cpu::simd::min(cpu::simd::set_sign(d), lowest));  // min gives its second operand for a NaN
#else
        const V size = -d.abs();
        lowest = V::blendv(lowest, size, size < lowest);
#endif
      }
      return mult_v * derivative<ORDER>(div_v, d * inv_lam_v);
    };
    // A partial vector: its unused lanes hold shift (d = 0), not the load's zeros (|d| = |shift|), which the check
    // took for an overflow where |shift| / lam is past FLT_MAX though no loss's t is: the float64 redo then ran or not
    // by where a task ended (off a vector's boundary or on it), and so by the thread count.
    auto load_part = [&](const scalar_t* p, int64_t count) {
      if constexpr (kCheck) {
        return V::set(shift_v, load<acc_t>(p, count), count);
      } else {
        return load<acc_t>(p, count);
      }
    };
    int64_t i = begin;
#if defined(DRO_EXT_SIMD_FLOAT)
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      if (streaming) {
        // A partial vector up to the first register-aligned element of out, then aligned streaming stores.
        constexpr uintptr_t kAlign = cpu::simd::kRegisterBytes;
        const uintptr_t misalignment = reinterpret_cast<uintptr_t>(out_v + i) % kAlign;
        const int64_t head = std::min<int64_t>(end - i, (kAlign - misalignment) % kAlign / sizeof(scalar_t));
        if (head > 0) store<acc_t>(out_v + i, term(load_part(x_v + i, head)), head);
        for (i += head; i + V::size() <= end; i += V::size()) {
          prefetch_ahead(x_v, i, V::size(), end);
          cpu::simd::stream(out_v + i, term(V::loadu(x_v + i)));
        }
        _mm_sfence();  // streaming stores are weakly ordered: make them visible before the task ends
      }
    }
#endif
    for (; i + V::size() <= end; i += V::size()) {
      prefetch_ahead(x_v, i, V::size(), end);
      store<acc_t>(out_v + i, term(load<acc_t>(x_v + i, V::size())), V::size());
    }
    if (i < end) store<acc_t>(out_v + i, term(load_part(x_v + i, end - i)), end - i);
    if constexpr (kCheck) {
      acc_t lanes[V::size()];
      lowest.store(lanes);
      const acc_t peak = -*std::min_element(lanes, lanes + V::size());
      if (static_cast<double>(peak) * affine.inv_lam > t_limit) {
        overflowed.store(true, std::memory_order_relaxed);
      }
    }
  });
  return overflowed.load();
}

// The Loss sums of a divergence with a coarse value (see csrc/divergences.h): {sum a, sum b, sum excess_first}
// with (a, b) the loss parts of divergences.h (value = shift + (sum a + lam sum b) / N). A block in the ERM regime
// (below), where only the accurate terms keep the loss's precision, sums loss_part_a, loss_part_b and
// excess_first; any other block sums the coarse value (as b, a = 0: the direct form lam psi*(t) + s) and first
// (sum excess_first = sum first - count). The coarse error, a few roundings of 1 + |psi*(t)| per sample, is within
// a small factor of the accurate terms' wherever |t| is not small, at the cost of value + first (one exp, where
// excess needs expm1 and log1p). A block is coarse when sum min(|t|, 1) >= count / 2: most of its samples have
// |t| near 1 or more, which one huge |t| among small ones cannot fake (a plain mean |t| could), and where
// lam <= 2 sum lam min(|t|, 1) / count bounds the coarse error's lam-sized roundings by the samples' own size.
//
// Which path a block takes needs that sum first. Blocks tend to be like their neighbours, so after a coarse
// block the next one sums it along with its coarse terms (no extra pass, and a second pass only if it turns out
// to be an ERM block), and after an ERM block it scans it alone first (a cheap pass over a block that is then in
// L1). Either way a block's sums are the same numbers: each running sum sees the same terms in the same order.
//
// The Newton sums {sum excess_first, sum second} take the same two paths (coarse: sum first - count).
//
// A coarse value in product form (SmoothedCVaR) is summed as its linear parts and the product of its factors,
// whose log the block takes once per lane (divergences.h).
template <typename scalar_t, typename Div, bool kNewton>
std::array<double, 3> reduce_coarse(const scalar_t* x, int64_t n, const Div& div, Affine affine) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  using Scan = Accumulator<V, Term::None, Term::NegClampedAbsT, Term::None>;
  constexpr bool kProduct = !kNewton && requires { requires Div::kCoarseValueAsProduct; };
  constexpr Term kCoarseFirst = kNewton ? Term::Second : (kProduct ? Term::CoarseLinear : Term::CoarseValue);
  constexpr Term kCoarseFactor = kProduct ? Term::CoarseFactor : Term::None;
  constexpr Term kNewtonScale = kNewton ? Term::SecondAbsDeviation : Term::None;  // either path sums it alike
  using Coarse = Accumulator<V, kNewtonScale, kCoarseFirst, Term::CoarseFirst, Term::None, kCoarseFactor>;
  using ScanAndCoarse =
      Accumulator<V, kNewtonScale, kCoarseFirst, Term::CoarseFirst, Term::NegClampedAbsT, kCoarseFactor>;
  using Accurate =
      std::conditional_t<kNewton, Accumulator<V, Term::SecondAbsDeviation, Term::Second, Term::ExcessFirst>,
                         Accumulator<V, Term::LossA, Term::LossB, Term::ExcessFirst>>;
  const V shift(static_cast<acc_t>(affine.shift));
  const V inv_lam(static_cast<acc_t>(affine.inv_lam));
  const acc_t first_scale = coarse_first_scale<acc_t>(div);
  // A block's sum of its first coarse term (Newton: second; Loss: the coarse value).
  const auto coarse_sum = [&](const auto& sums, acc_t count) -> acc_t {
    if constexpr (kProduct) {
      return static_cast<acc_t>(div.coarse_scale()) *
             (horizontal_sum(sums.b) + horizontal_sum(sums.e.log()) + count * static_cast<acc_t>(div.coarse_offset()));
    } else {
      return horizontal_sum(sums.b);
    }
  };
  const std::array<double, 3> total = sum_chunks(map_chunks<std::array<acc_t, 3>>(n, [&](int64_t begin, int64_t end) {
    // Loss: {sum a, sum b, sum excess_first}; Newton: {sum second |x|, sum second, sum excess_first}.
    std::array<acc_t, 3> chunk{0, 0, 0};
    bool previous_was_erm = false;  // reset per chunk: the sums must not depend on the thread count
    for (int64_t block = begin; block < end; block += kBlock) {
      const int64_t block_end = std::min(end, block + kBlock);
      const acc_t count = static_cast<acc_t>(block_end - block);
      acc_t sum_neg_clamped, coarse_first = 0, coarse_second = 0, coarse_scale = 0;
      if (previous_was_erm) {
        const Scan scan = accumulate_block<Scan>(x, block, block_end, n, div, shift, inv_lam);
        sum_neg_clamped = horizontal_sum(scan.b);
      } else {
        const ScanAndCoarse sums = accumulate_block<ScanAndCoarse>(x, block, block_end, n, div, shift, inv_lam);
        sum_neg_clamped = horizontal_sum(sums.d);
        coarse_first = coarse_sum(sums, count);
        coarse_second = first_scale * horizontal_sum(sums.c);
        if constexpr (kNewton) coarse_scale = horizontal_sum(sums.a);
      }
      // sum -min(|t|, 1) > -count / 2 (true for a NaN t: the accurate terms are NaN as well).
      const bool erm = !(sum_neg_clamped <= acc_t(-0.5) * count);
      if (erm) {
        const Accurate accurate = accumulate_block<Accurate>(x, block, block_end, 0, div, shift, inv_lam);
        chunk[0] += horizontal_sum(accurate.a);
        chunk[1] += horizontal_sum(accurate.b);
        chunk[2] += horizontal_sum(accurate.c);
      } else {
        if (previous_was_erm) {
          const Coarse sums = accumulate_block<Coarse>(x, block, block_end, 0, div, shift, inv_lam);
          coarse_first = coarse_sum(sums, count);
          coarse_second = first_scale * horizontal_sum(sums.c);
          if constexpr (kNewton) coarse_scale = horizontal_sum(sums.a);
        }
        chunk[0] += coarse_scale;
        chunk[1] += coarse_first;
        chunk[2] += coarse_second - count;
      }
      previous_was_erm = erm;
    }
    return chunk;
  }));
  if constexpr (kNewton) return {total[2], total[1], total[0]};
  return total;
}

std::array<double, 3> reduce_impl(const at::Tensor& x, const DivergenceSpec& spec, Affine affine, Sums sums) {
  TORCH_INTERNAL_ASSERT(x.is_contiguous() && x.dim() == 1);
  std::array<double, 3> out{};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_reduce", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    const int64_t n = x.numel();
    out = visit_divergence<acc_t>(spec, [&](const auto& div) {
      using Div = std::decay_t<decltype(div)>;
      switch (sums) {
        case Sums::Loss:
          if constexpr (requires { requires Div::kHasCoarseValue; }) {
            if (div.coarse_ok()) return reduce_coarse<scalar_t, Div, false>(data, n, div, affine);
          }
          return reduce_terms<scalar_t, Div, Term::LossA, Term::LossB, Term::ExcessFirst>(data, n, div, affine);
        case Sums::Newton:
          if constexpr (requires { requires Div::kHasCoarseValue; }) {
            if (div.coarse_ok()) return reduce_coarse<scalar_t, Div, true>(data, n, div, affine);
          }
          return reduce_terms<scalar_t, Div, Term::ExcessFirst, Term::Second, Term::SecondAbsDeviation>(data, n, div,
                                                                                                   affine);
        case Sums::Value:
          return reduce_terms<scalar_t, Div, Term::Value, Term::None>(data, n, div, affine);
        default:
          return reduce_terms<scalar_t, Div, Term::First, Term::None>(data, n, div, affine);
      }
    });
  });
  return out;
}

bool map_derivative_impl(
    const at::Tensor& x, at::Tensor& out, const DivergenceSpec& spec, Affine affine, double multiplier,
    int64_t order) {
  bool overflowed = false;
  TORCH_INTERNAL_ASSERT(x.is_contiguous() && out.is_contiguous() && x.numel() == out.numel());
  TORCH_INTERNAL_ASSERT(order >= 0 && order <= 2);
  const double t_limit = float32_t_limit(spec);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_map", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    scalar_t* result = out.mutable_data_ptr<scalar_t>();
    visit_divergence<acc_t>(spec, [&](const auto& div) {
      switch (order) {
        case 0: overflowed = map_order<0>(data, result, x.numel(), div, affine, multiplier, t_limit); break;
        case 1:
          if constexpr (requires { div.coarse_first_scale(); }) {
            if (div.coarse_ok()) {
              overflowed = map_order<kUnscaledFirst>(data, result, x.numel(), div, affine,
                                                     multiplier * div.coarse_first_scale(), t_limit);
              break;
            }
          }
          overflowed = map_order<1>(data, result, x.numel(), div, affine, multiplier, t_limit);
          break;
        default: overflowed = map_order<2>(data, result, x.numel(), div, affine, multiplier, t_limit); break;
      }
    });
  });
  return overflowed;
}

template <typename scalar_t>
std::array<double, 2> min_max_typed(const at::Tensor& x) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  const scalar_t* const data = x.const_data_ptr<scalar_t>();
  constexpr int64_t kWays = 2;  // independent running minima and maxima: one chain is bound by its latency
  const auto partial = map_chunks<std::array<acc_t, 2>>(x.numel(), [&](int64_t begin, int64_t end) {
    const scalar_t* const p = data;  // a local copy: through the capture the pointer was reloaded every step
    const acc_t inf = std::numeric_limits<acc_t>::infinity();
    V lo[kWays] = {V(inf), V(inf)}, hi[kWays] = {V(-inf), V(-inf)};
    // clamp_min/clamp_max do not propagate NaN (a NaN lane keeps either operand), so NaN is tracked on the side:
    // all ones in a lane that has seen one.
    V nan_seen(acc_t(0));
    int64_t i = begin;
    for (; i + kWays * V::size() <= end; i += kWays * V::size()) {
      for (int64_t w = 0; w < kWays; ++w) {
        const V v = load<acc_t>(p + i + w * V::size(), V::size());
        lo[w] = at::vec::clamp_max(lo[w], v);
        hi[w] = at::vec::clamp_min(hi[w], v);
        nan_seen = nan_seen | (v != v);
      }
    }
    alignas(64) acc_t lanes_lo[kWays][V::size()], lanes_hi[kWays][V::size()];
    for (int64_t w = 0; w < kWays; ++w) {
      lo[w].store(lanes_lo[w]);
      hi[w].store(lanes_hi[w]);
    }
    const bool any_nan = nan_seen.zero_mask() != static_cast<int>((uint64_t{1} << V::size()) - 1);
    acc_t low = any_nan ? std::numeric_limits<acc_t>::quiet_NaN() : inf, high = any_nan ? low : -inf;
    const auto fold = [&](acc_t a, acc_t b) {  // keeps a NaN once it has one
      low = (std::isnan(a) || a < low) ? a : low;
      high = (std::isnan(b) || b > high) ? b : high;
    };
    for (int64_t w = 0; w < kWays; ++w) {
      for (int64_t l = 0; l < V::size(); ++l) fold(lanes_lo[w][l], lanes_hi[w][l]);
    }
    for (; i < end; ++i) fold(static_cast<acc_t>(p[i]), static_cast<acc_t>(p[i]));
    return std::array<acc_t, 2>{low, high};
  });
  double low = std::numeric_limits<double>::infinity(), high = -low;
  for (const auto& part : partial) {
    if (std::isnan(part[0]) || std::isnan(part[1])) return {std::nan(""), std::nan("")};
    low = std::min(low, static_cast<double>(part[0]));
    high = std::max(high, static_cast<double>(part[1]));
  }
  return {low, high};
}

// f(scalar_t{}) for the floating dtype of the contiguous x, and what it returns.
template <typename F>
auto dispatch_floating(const at::Tensor& x, F f) {
  TORCH_INTERNAL_ASSERT(x.is_contiguous());
  using Result = decltype(f(float{}));
  if constexpr (std::is_void_v<Result>) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cpu_pass",
                                    [&] { f(scalar_t{}); });
  } else {
    Result out{};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cpu_pass",
                                    [&] { out = f(scalar_t{}); });
    return out;
  }
}

std::array<double, 2> min_max_impl(const at::Tensor& x) {
  return dispatch_floating(x, [&](auto tag) { return min_max_typed<decltype(tag)>(x); });
}

void exp_shifted_impl(const double* x, double shift, double below, double* out, int64_t n) {
  using V = Vectorized<double>;
  const V shift_v(shift), below_v(below), zero(0.0);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    const V d = V::loadu(x + i) - shift_v;
    V::blendv(Math<V>::exp(d), zero, d < below_v).store(out + i);  // a NaN d compares false: NaN out
  }
  for (; i < n; ++i) out[i] = exp_or_zero(x[i] - shift, below);
}

}  // namespace
}  // namespace dro_ext::cpu
