// The exact robust objective Psi = min over eta of L(eta) (docs/design.md section 1.7),
// its minimizer eta* and the worst-case distribution q at eta*.
//
//   robust_objective(l, lam, ...)        -> (Psi, eta*)     Psi in l's dtype, eta* in the accumulate dtype
//   robust_weights(l, eta*, lam, ...)    -> q (N,)          q_i = psi*'((l_i - eta*)/lam) / sum_j psi*'(...)
//   weight_stats(w, groups?, G)          -> (ess, max q, zero fraction, per-group mass): one pass over w
//
// Algorithms (G = 1, so eta* lies in [min l, max l] because psi*'(0) = 1):
//   kl            closed form: eta* = m + lam log(mean exp((l - m)/lam)) with m = max l, and Psi = eta*;
//                 the sum is one pass of the loss kernel at shift m, so nothing overflows. Where the mean is
//                 near 1 (lam large against the spread of l), lam log1p(mean expm1(t)) in a second pass keeps
//                 the precision that lam log(mean exp(t)) loses, so Psi -> mean l as lam -> inf.
//   cvar          selection: eta* = the ceil(alpha N)-th largest loss, Psi = (sum_{l > eta*} l + (alpha N - #{l > eta*}) eta*)
//                 / (alpha N): the tail mean with the fractional boundary sample (sample select for large N).
//   chi2,         psi*'(t) = (1 + t/c)_+ is piecewise linear (c = 2 for chi2, c = 1 for cressie_read at k = 2) and
//   cressie_read  mean psi*'((l - eta)/lam) - 1 is convex and decreasing in eta, so Newton left of the root never
//   at k = 2      overshoots (and from its right lands left of it) and stops once the active set {l_i > eta - c lam}
//                 stops changing (Michelot's active-set iteration); eta* is then solved exactly on that segment with
//                 float64 sums.
//   the others    safeguarded Newton on log(mean psi*') = 0 (exact in one step for exponential tails) with
//                 bisection inside the shrinking bracket whenever a step leaves it or stalls.
//   Newton starts from the root on a subsample (warm_start) and, for float64 kl_cvar and smoothed_cvar losses, on
//   a float32 copy (newton_start).
// Every Newton iteration is ONE pass of the loss kernel (reduce with Sums::Newton: sum psi*' - 1, sum psi*'' and
// sum psi*'' |l| fused), so the psi* math exists only in csrc/divergences.h. The condition is summed as
// psi*'(t) - 1 (excess_first), which keeps its relative precision as t -> 0, so eta* -> mean l as lam -> inf; the
// value at eta* is the loss kernel's (each sample's share formed as divergences.h's penalized_value) for the same
// reason. The sums accumulate in float32 for half/bfloat16/float32 input and in float64 for float64 input, as the
// loss does, except where lam is too fine for float32 to resolve eta (solve); the iteration itself and the closed
// forms run in float64. Psi never exceeds max l (solve).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/chunks.h"
#include "cpu/kernels.h"
#include "cpu/scalar_tensors.h"

namespace dro_ext {

namespace {

// Enough for any float64 bracket: kWidthHalvings halvings of its width, 64 of the floats' order, Newton's steps.
constexpr int kMaxIterations = 200;
// Bisection halves the bracket's width this many times, then the float64 values in it (bisection_point): a bracket
// still unresolved by then spans binades (a loss of -1e30 beside losses near 1), which halving the width would take
// ~100 more steps to cross. Every other input converges long before, on the same steps as always.
constexpr int kWidthHalvings = 48;
// At most this many floats stepped up from a final eta where a weight overflows (newton_root): the stop leaves it
// within a few of them (a tolerance of 4 roundings of the bracket's ends), so the cap is never reached in practice.
constexpr int kMaxOverflowSteps = 64;
// The float64 reductions below use the fixed chunks of cpu/chunks.h, so their results do not depend on the
// thread count.
using cpu::for_each_chunk;
using cpu::kReductionChunk;
using cpu::map_chunks;

struct Solution {
  double eta;
  double value;
  int iterations;
};

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Deterministic float64 sums of f(x_i) over fixed chunks: f(double) -> std::array<double, 2>.
template <typename F>
std::array<double, 2> sum_pairs(const at::Tensor& x, F f) {
  std::array<double, 2> total{0.0, 0.0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_robust_sum", [&] {
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    const auto partial = map_chunks<std::array<double, 2>>(x.numel(), [&](int64_t begin, int64_t end) {
      std::array<double, 2> s{0.0, 0.0};
      for (int64_t i = begin; i < end; ++i) {
        const auto v = f(static_cast<double>(data[i]));
        s[0] += v[0];
        s[1] += v[1];
      }
      return s;
    });
    for (const auto& s : partial) {
      total[0] += s[0];
      total[1] += s[1];
    }
  });
  return total;
}

// The CPU kernels' build for the solvers' passes over x (several a call: cpu::kAvx512MinValuesSolver).
const cpu::KernelTable& solver_kernels(const at::Tensor& x) {
  return cpu::cpu_kernels(x.numel(), cpu::kAvx512MinValuesSolver);
}

// {min, max} of x in float64; NaN if x holds a NaN. (at::aminmax takes milliseconds even for small inputs.)
std::array<double, 2> min_max(const at::Tensor& x) { return solver_kernels(x).min_max(x); }

double machine_epsilon(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? DBL_EPSILON : static_cast<double>(FLT_EPSILON);
}

// alpha * N, snapped to the nearest integer when it is one up to rounding (0.3 * 10 is 3.0000000000000004).
double tail_size(double alpha, int64_t n) {
  const double k = alpha * static_cast<double>(n);
  const double r = std::nearbyint(k);
  return std::abs(k - r) <= 8.0 * DBL_EPSILON * k ? r : k;
}

Solution solve_kl(const at::Tensor& x, const DivergenceSpec& spec, double lam, double hi) {
  const double n = static_cast<double>(x.numel());
  const cpu::Affine affine{hi, 1.0 / lam};
  // mean exp((l_i - max l)/lam): every exponent is <= 0, and the sum is relatively accurate however small.
  const double mean_exp = solver_kernels(x).reduce(x, spec, affine, cpu::Sums::Weight)[0] / n;
  double log_mean = std::log(mean_exp);
  if (mean_exp > 0.5) {
    // Near 1, log loses the digits of mean_exp - 1 that lam multiplies; the sum of expm1 keeps them.
    log_mean = std::log1p(solver_kernels(x).reduce(x, spec, affine, cpu::Sums::Newton)[0] / n);
  }
  const double eta = hi + lam * log_mean;
  return {eta, eta, 1};
}

// The j-th largest loss (1-based) and the float64 sum and count of the losses strictly above it.
struct TailSplit {
  double eta;
  double sum_above;
  int64_t count_above;
};

// split plus the sum and the number of the values[0, count) above split.eta. Four running sums and no branch: one sum
// in memory, a branch per value, made this loop an eighth of the cvar objective at 4096 losses.
TailSplit add_above(TailSplit split, const double* values, int64_t count) {
  double sums[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t above = 0;
  for (int64_t m = 0; m < count; ++m) {
    const bool is_above = values[m] > split.eta;
    sums[m & 3] += is_above ? values[m] : 0.0;
    above += is_above;
  }
  split.sum_above += (sums[0] + sums[1]) + (sums[2] + sums[3]);
  split.count_above += above;
  return split;
}

// Exact by copying every loss to float64 and one std::nth_element: O(N) but single-threaded, with N doubles
// to write and permute. The fallback of select_tail, and the whole method for small N.
TailSplit select_tail_by_partition(const at::Tensor& x, int64_t j) {
  const int64_t n = x.numel();
  std::vector<double> values(n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cvar_copy", [&] {
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, n, 65536, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) values[i] = static_cast<double>(data[i]);
    });
  });
  std::nth_element(values.begin(), values.begin() + (j - 1), values.end(), std::greater<double>());
  // The j - 1 values before it are >= eta; those > eta are every loss above it.
  return add_above(TailSplit{values[j - 1], 0.0, 0}, values.data(), j - 1);
}

// Sample select (Floyd and Rivest): the order statistics of an evenly strided sample bracket the j-th largest loss
// with a margin of kMarginDeviations standard deviations of the sample's rank; one vectorized pass
// (solver_kernels(x).bracket_counts) sums and counts the losses above the bracket and counts those inside it, a second
// (gather_bracket) gathers the ones inside (a few percent of N), and std::nth_element finds the answer among them.
// A bracket that misses (the sample was unrepresentative; the margin makes that rare, not impossible) falls back
// to the exact partition of all losses, so the answer never depends on the sample.
//
// The sample's size balances the two selections: S samples cost ~S, and the bracket holds
// ~2 kMarginDeviations sqrt(p (1 - p) / S) N losses, so S ~ N^(2/3): the stride is the power of two nearest N^(1/3)
// (16 at 4096 losses, 32 at 65536, 128 at 2^20), and the sample at most kMaxSelectSamples.
// Against the scalar passes from 2^14 on (bench/results/robust.md, lognormal float32 losses at alpha = 0.1, 2 cores, a
// whole call): 4096 losses 15.3 -> 8.2 us (about 4.5 of it the Python call and the op's dispatch), 65536 0.112 ->
// 0.033 ms, 2^22 10.3 -> 1.9 ms.
constexpr int64_t kMaxSelectSamples = 1 << 16;
constexpr double kMarginDeviations = 3.0;
constexpr double kMarginRanks = 3.0;  // added to the margin: at a few ranks the binomial spread is not yet normal
// Below this many losses the partition of all of them is as fast.
constexpr int64_t kMinSelectLosses = 1024;

TailSplit select_tail(const at::Tensor& x, int64_t j) {
  const int64_t n = x.numel();
  if (n < kMinSelectLosses) return select_tail_by_partition(x, j);
  const double size = static_cast<double>(n);
  const int64_t stride = std::max<int64_t>(int64_t{1} << static_cast<int>(std::lround(std::log2(std::cbrt(size)))),
                                           (n + kMaxSelectSamples - 1) / kMaxSelectSamples);
  const int64_t num_samples = n / stride;
  std::vector<double> sample(num_samples);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cvar_sample", [&] {
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < num_samples; ++i) sample[i] = static_cast<double>(data[i * stride]);
  });
  // The answer's rank in the sample, from the top, is about j S / N, with a binomial spread.
  const double samples = static_cast<double>(num_samples);
  const double p = static_cast<double>(j) / size;
  const double rank = p * samples;
  const double margin = kMarginDeviations * std::sqrt(samples * p * (1.0 - p)) + kMarginRanks;
  // The r-th largest sample (1-based) among the first `among`.
  const auto sample_rank = [&](double r, int64_t among) -> double {
    const int64_t i = static_cast<int64_t>(r) - 1;
    std::nth_element(sample.begin(), sample.begin() + i, sample.begin() + among, std::greater<double>());
    return sample[i];
  };
  // lower first: its nth_element leaves the samples above it in front, where upper's then looks.
  const double lower_rank = std::ceil(rank + margin);
  const bool has_lower = lower_rank <= samples;
  const double lower = has_lower ? sample_rank(lower_rank, num_samples) : -kInf;
  const int64_t above_lower = has_lower ? static_cast<int64_t>(lower_rank) - 1 : num_samples;
  const double upper = rank - margin >= 1.0 ? sample_rank(std::floor(rank - margin), above_lower) : kInf;

  const std::vector<cpu::BracketCounts> counts = solver_kernels(x).bracket_counts(x, lower, upper);
  TailSplit split{0.0, 0.0, 0};
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t c = 0; c < counts.size(); ++c) {
    split.sum_above += counts[c].sum_above;
    split.count_above += counts[c].above;
    offsets[c + 1] = offsets[c] + counts[c].inside;
  }
  const int64_t inside = offsets.back();
  if (!(split.count_above < j && j <= split.count_above + inside)) return select_tail_by_partition(x, j);

  std::vector<double> candidates(inside);
  solver_kernels(x).gather_bracket(x, lower, upper, offsets.data(), candidates.data());
  const int64_t i = j - split.count_above - 1;
  std::nth_element(candidates.begin(), candidates.begin() + i, candidates.end(), std::greater<double>());
  split.eta = candidates[i];
  return add_above(split, candidates.data(), i);
}

Solution solve_cvar(const at::Tensor& x, double alpha) {
  const int64_t n = x.numel();
  const double k = tail_size(alpha, n);
  const int64_t j = std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(k))));
  const TailSplit split = select_tail(x, j);
  const double value = (split.sum_above + (k - static_cast<double>(split.count_above)) * split.eta) / k;
  return {split.eta, value, 1};
}

// L(eta) = lam mean psi*((l - eta)/lam) + eta: one pass of the loss kernel.
double objective_at(const at::Tensor& x, const DivergenceSpec& spec, double lam, double eta) {
  return cpu::penalized_mean(x, spec, eta, lam, cpu::kAvx512MinValuesSolver).value;
}

// float64 x as an integer of the same order (-0.0 and 0.0 alike).
int64_t ordered_bits(double x) {
  int64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits >= 0 ? bits : std::numeric_limits<int64_t>::min() - bits;
}

// The middle of the float64 values in [a, b]: the arithmetic midpoint within a binade, a geometric one across many,
// so that any bracket narrows to adjacent floats within 64 halvings however many binades it spans.
// (dro_ext/_solver.py's bisection_point: the same point for the same bracket.)
double bisection_point(double a, double b) {
  const int64_t lo = ordered_bits(a), hi = ordered_bits(b);
  // hi - lo can exceed INT64_MAX (the finite doubles span 2^64 - 2^53 keys): halved as unsigned, it cannot.
  const int64_t middle = lo + static_cast<int64_t>((static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo)) / 2);
  const int64_t bits = middle >= 0 ? middle : std::numeric_limits<int64_t>::min() - middle;
  double x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// psi*' = (1 + t/c)_+ for some c > 0 (chi2: c = 2; cressie_read at k = 2: c = 1), or 0 when it is not
// piecewise linear.
double linear_weight_width(const DivergenceSpec& spec) {
  if (spec.kind == Divergence::Chi2) return 2.0;
  if (spec.kind == Divergence::CressieRead && spec.k == 2.0) return 1.0;
  return 0.0;
}

// Safeguarded Newton on g(eta) = mean psi*'((l - eta)/lam) - 1 (decreasing) inside [lo, hi], where
// g(lo) >= 0 >= g(hi), from `start` in [lo, hi]. Piecewise-linear weights step on g itself (convex: from the left
// no overshoot, from the right one step lands left of the root); the others on log(1 + g). Stops at the root as
// finely as the sums resolve it, or sooner once |g| <= stop_g (a warm start's subsample, which cannot tell the
// full input's root more finely than that). NaN where g is NaN.
struct Root {
  double eta;
  bool converged;
  int iterations;
  // Piecewise-linear weights that stopped because the active set held at eta: the Newton step from eta's own pass,
  // which solves that segment (NaN otherwise).
  double segment_step;
};

Root newton_root(const at::Tensor& x, const DivergenceSpec& spec, double lam, double lo, double hi, double start,
                 double stop_g) {
  const auto& kernels = solver_kernels(x);
  const double n = static_cast<double>(x.numel());
  const double width = linear_weight_width(spec);
  const bool linear = width > 0.0;
  const double eps = machine_epsilon(x);
  double a = lo, b = hi, eta = start;
  double step_before_last = b - a, last_step = b - a;
  double previous_active = -1.0, previous_g = kNaN;
  bool last_was_newton = false;
  int halvings = 0;       // bisections by the bracket's width so far
  bool by_order = false;  // the last step bisected the floats' order instead
  // A probe: eta moved one tolerance from probe_origin (where g was probe_origin_g) to see whether g changes sign.
  bool probing = false;
  double probe_origin = kNaN, probe_origin_g = kNaN;
  int iterations = 0;
  bool converged = false;
  double segment_step = kNaN;
  bool lower_overflows = false;  // g = +inf at a: a weight overflows there
  while (iterations < kMaxIterations) {
    ++iterations;
    const auto s = kernels.reduce(x, spec, cpu::Affine{eta, 1.0 / lam}, cpu::Sums::Newton);
    const double g = s[0] / n;
    if (std::isnan(g)) return {kNaN, false, iterations, kNaN};
    if (std::abs(g) <= stop_g) {
      converged = true;
      break;
    }
    if (g > 0.0) {
      a = eta;
      lower_overflows = g == kInf;
    } else {
      b = eta;
    }
    // Converged when eta is known to a few roundings of what it can be resolved to: the kernel forms l - eta in the
    // accumulate type, which moves the Newton step by roundings of |eta| and of the psi*''-weighted mean |l| (at
    // most |eta| + that mean of |l - eta|: the losses the slope comes from; g itself keeps its relative precision
    // at any lam). Not of the widest loss: a root at -4 beside losses of -1e20 (weight 0 there) is resolved as
    // finely as its neighbours allow. With no slope at all (every weight flat), the bracket's ends.
    const double scale =
        s[1] > 0.0 && std::isfinite(s[2]) ? 2.0 * std::abs(eta) + s[2] / s[1] : std::max(std::abs(a), std::abs(b));
    const double tol = 4.0 * eps * scale;
    // Newton's model of g holds here (its last step at least halved |g|): a step below tol then finds the root.
    const bool converging = last_was_newton && std::abs(g) <= 0.5 * std::abs(previous_g);
    bool bisect = false;
    if (probing) {
      probing = false;
      if ((g > 0.0) != (probe_origin_g > 0.0)) {  // the root lies within the probe's tolerance
        if (std::abs(probe_origin_g) < std::abs(g)) eta = probe_origin;
        converged = true;
        break;
      }
      bisect = true;  // the tiny Newton step was no sign of the root: halve the bracket instead
    }
    const double newton = linear ? lam * s[0] / s[1] : lam * std::log1p(g) * ((n + s[0]) / s[1]);
    // Linear weights: the last Newton step solved the linear piece of this same active set, so eta is its root, as
    // this step below tol confirms. (It need not be: from eta = -1.3e18, towards losses near 3 beside one of -1e20,
    // the step's rounding landed at 0, on the same piece, and only the step from there reached its root.)
    if (linear && last_was_newton && s[1] == previous_active && std::abs(newton) <= tol) {
      segment_step = newton;
      converged = true;
      break;
    }
    previous_active = s[1];
    double next;
    bool use_newton = false;
    if (!bisect && std::abs(newton) <= tol) {
      // A Newton step below the resolution of eta: g is at its rounding noise and eta is the root as far as the
      // kernel can tell, when Newton's model holds (converging). (Without this test, a last step that
      // rounds onto the bracket's end fell back to bisection, which then halved a bracket of 1e-10 down to the
      // tolerance: a dozen wasted passes.) Otherwise the step may be tiny only because g is steep here while the
      // root is far, which Newton's local slope cannot see (kl_cvar at lam = 1e-6, losses 0 and 1000: the weight
      // of 1000 capped at 1/alpha, the slope all from the loss at eta); one probe a tolerance towards the root
      // tells the two apart.
      if (converging) {
        converged = true;
        break;
      }
      next = eta + std::copysign(tol, g);  // g > 0: the root lies above eta
      if (!(next > a && next < b)) {       // the bracket is within a tolerance already
        converged = true;
        break;
      }
      probing = true;
      probe_origin = eta;
      probe_origin_g = g;
    } else {
      next = eta + newton;
      // Bisect when Newton leaves the bracket or (as in rtsafe) does not at least halve the step before last;
      // the linear case's Newton from the left end is monotone and needs no such guard.
      use_newton = !bisect && std::isfinite(next) && next > a && next < b &&
                   (linear || std::abs(newton) <= 0.5 * std::abs(step_before_last));
      if (!use_newton) {
        by_order = halvings >= kWidthHalvings;
        next = by_order ? bisection_point(a, b) : 0.5 * (a + b);
        halvings += by_order ? 0 : 1;
      }
    }
    previous_g = g;
    step_before_last = last_step;
    last_step = next - eta;
    eta = next;
    last_was_newton = use_newton;
    // Converged once the bracket is within tol, after a bisection step of its width within tol, or after a Newton
    // step within tol while Newton's model holds; a first tiny Newton step is evaluated (and, if still tiny, probed)
    // instead. (A step through the floats' order can be tiny beside a wide bracket: it is no sign of convergence.)
    if (!probing &&
        (b - a <= tol || (std::abs(last_step) <= tol && (use_newton ? converging : !by_order)))) {
      converged = true;
      break;
    }
  }
  // lam far finer than the losses' float spacing: below the root a weight overflows (cressie_read's u^(1/(k-1)) at
  // t ~ 1e50), and a stop within tol can leave eta a few floats below a root that lies within a few lam of max l,
  // where worst_case_weights would divide inf by inf. Step up through those floats, one pass each, to the first
  // where every weight is finite: the float nearest the root as far as the weights can tell (max l itself when
  // the root rounds to it, where the weights are exact).
  for (int steps = 0; lower_overflows && steps < kMaxOverflowSteps && eta < hi; ++steps, ++iterations) {
    if (kernels.reduce(x, spec, cpu::Affine{eta, 1.0 / lam}, cpu::Sums::Newton)[0] != kInf) break;
    eta = std::nextafter(eta, kInf);
    segment_step = kNaN;  // no longer the step from eta's own pass
  }
  return {eta, converged, iterations, segment_step};
}

// The root of g and L there. Piecewise-linear weights end with eta* solved exactly on the final segment.
Solution solve_newton(const at::Tensor& x, const DivergenceSpec& spec, double lam, double lo, double hi,
                      double start) {
  const Root root = newton_root(x, spec, lam, lo, hi, start, 0.0);
  double eta = root.eta;
  if (std::isnan(eta)) return {kNaN, kNaN, root.iterations};
  const double width = linear_weight_width(spec);
  if (width > 0.0 && root.converged) {
    // Exact on the final segment: sum_{A} (1 + (l_i - eta)/(c lam)) = N with A = {l_i > eta - c lam} gives
    // eta = (sum_A l_i + c lam (|A| - N)) / |A|, evaluated with float64 sums. float64 losses, whose Newton sums are
    // float64 ones, have it from the last pass: its Newton step is that root (eta + c lam (sum_A (1 + t_i/c) - N) /
    // |A|), to the rounding of the same sums of l_i - eta. float32 and half losses sum the pass in float32, so they
    // take the float64 sums of one more pass: select_tail's counting pass over the empty bracket [cut, cut].
    const double n = static_cast<double>(x.numel());
    double exact = kNaN;
    if (x.scalar_type() == at::kDouble && std::isfinite(root.segment_step)) {
      exact = eta + root.segment_step;
    } else {
      const double cut = eta - width * lam;
      double sum_above = 0.0;
      int64_t above = 0;
      for (const cpu::BracketCounts& chunk : solver_kernels(x).bracket_counts(x, cut, cut)) {
        sum_above += chunk.sum_above;
        above += chunk.above;
      }
      if (above > 0) exact = (sum_above + width * lam * (static_cast<double>(above) - n)) / static_cast<double>(above);
    }
    // It lies on the same segment as eta once the iteration has converged (at worst a loss within the rounding of
    // eta switches sides, which moves the root by a rounding too).
    if (exact >= lo && exact <= hi) eta = exact;
  }
  return {eta, objective_at(x, spec, lam, eta), root.iterations};
}

// Inputs of kWarmStartStride * kMinWarmStartSamples losses or more start Newton from the root on an evenly strided
// subsample of them (one loss in kWarmStartStride), itself started the same way, where a start at min l spends
// most of its passes bisecting towards the root. Each subsample is solved only to |g| <= 1/sqrt(its size), the
// precision at which it represents the whole (a finer root of the subsample is no nearer the input's): about two
// passes over each, an eighth of the size of the one above, and a start that leaves two or three passes over all N
// (bench/results/robust.md: cressie_read at k = 2 over 65536 float64 losses went from 0.15 ms to 0.11).
constexpr int64_t kWarmStartStride = 8;
constexpr int64_t kMinWarmStartSamples = 512;

double warm_start(const at::Tensor& x, const DivergenceSpec& spec, double lam, double lo, double hi) {
  const int64_t n = x.numel();
  if (n < kWarmStartStride * kMinWarmStartSamples) return lo;
  const at::Tensor sample = x.slice(0, 0, n, kWarmStartStride).contiguous();
  const auto [sample_lo, sample_hi] = min_max(sample);
  if (!(sample_lo < sample_hi)) return lo;
  const double stop_g = 1.0 / std::sqrt(static_cast<double>(sample.numel()));
  const double eta = newton_root(sample, spec, lam, sample_lo, sample_hi,
                                 warm_start(sample, spec, lam, sample_lo, sample_hi), stop_g).eta;
  return std::isfinite(eta) && eta > lo && eta < hi ? eta : lo;
}

// Whether float32 sums resolve eta at this lam: lam at least 256 roundings of the largest |loss| (else t moves by
// more than 1/256 per rounding of eta), 1/lam a normal float32 (else t is inf or 0 for every loss), and every t
// within the divergence's float32 limit (cpu/kernels.h's float32_t_limit: cressie_read at a k - 1 near float32's
// largest). Where they do not, the iterative solvers run on a float64 copy of the losses.
bool float32_resolves(const at::Tensor& x, const DivergenceSpec& spec, double lam, double largest) {
  return lam >= 256.0 * machine_epsilon(x) * largest && float32_forms_t(lam) &&
         2.0 * largest / lam <= cpu::float32_t_limit(spec);
}

// Where Newton over all N starts. float64 losses of a divergence with exponential weights (kl_cvar, smoothed_cvar)
// are first solved on a float32 copy, to float32's precision, where float32 sums resolve eta: a float64 pass of
// those weights costs two to three float32 ones (their exp and expm1 in twice the lanes' width), and from the
// float32 root float64 Newton finishes in two or three passes. Measured on bench_robust's lognormal float64 losses,
// 2 cores: kl_cvar 0.26 -> 0.23 ms at 65536 and 3.2 -> 2.8 at 2^20, smoothed_cvar 0.37 -> 0.30 and 5.3 -> 4.4.
// cressie_read's power weights were 10% slower so (0.09 -> 0.10 ms at 65536), and piecewise-linear weights cost
// little more in float64 and end on their exact segment: both start from the warm start.
double newton_start(const at::Tensor& x, const DivergenceSpec& spec, double lam, double lo, double hi) {
  const bool exponential = spec.kind == Divergence::KLCVaR || spec.kind == Divergence::SmoothedCVaR;
  if (x.scalar_type() == at::kDouble && exponential) {
    const at::Tensor narrow = x.to(at::kFloat);
    const auto [narrow_lo, narrow_hi] = min_max(narrow);
    if (narrow_lo < narrow_hi && std::isfinite(narrow_lo) && std::isfinite(narrow_hi) &&
        float32_resolves(narrow, spec, lam, std::max(-narrow_lo, narrow_hi))) {
      const double eta = newton_root(narrow, spec, lam, narrow_lo, narrow_hi,
                                     warm_start(narrow, spec, lam, narrow_lo, narrow_hi), 0.0).eta;
      if (std::isfinite(eta) && eta > lo && eta < hi) return eta;
    }
  }
  return warm_start(x, spec, lam, lo, hi);
}

Solution solve(const at::Tensor& x, const DivergenceSpec& spec, double lam) {
  const auto [lo, hi] = min_max(x);
  // NaN gives NaN; -inf has no sensible dual; +inf makes the worst case infinite.
  if (std::isnan(lo) || std::isnan(hi) || lo == -kInf) return {kNaN, kNaN, 0};
  if (hi == kInf) return {kInf, kInf, 0};
  if (lo == hi) return {lo, lo, 0};  // N = 1 or all equal: psi*(0) = 0
  Solution sol;
  if (spec.kind == Divergence::CVaR) {
    sol = solve_cvar(x, spec.alpha);  // a selection: exact in any dtype
  } else {
    const at::Tensor xs =
        x.scalar_type() != at::kDouble && !float32_resolves(x, spec, lam, std::max(-lo, hi)) ? x.to(at::kDouble) : x;
    if (spec.kind == Divergence::KL) {
      sol = solve_kl(xs, spec, lam, hi);
    } else {
      sol = solve_newton(xs, spec, lam, lo, hi, newton_start(xs, spec, lam, lo, hi));
    }
  }
  // Psi = min over eta of L <= L(max l) <= max l (psi*(t) <= 0 for t <= 0). Where lam is below even float64's
  // resolution of the losses, L at the rounded eta* can exceed that by the rounding of eta times its slope: the
  // bound holds regardless.
  sol.value = std::min(sol.value, hi);  // keeps NaN
  return sol;
}

std::tuple<at::Tensor, at::Tensor> robust_objective_cpu(
    const at::Tensor& losses, double lam, c10::string_view divergence, std::optional<double> alpha,
    std::optional<double> k) {
  check_losses(losses);
  const DivergenceSpec spec = check_divergence_args(lam, divergence, alpha, k);
  const at::Tensor x = losses.contiguous();
  const Solution sol = solve(x, spec, lam);
  auto options = losses.options();
  return {cpu::make_scalar(sol.value, options),
          cpu::make_scalar(sol.eta, options.dtype(accumulate_type(losses.scalar_type())))};
}

at::Tensor robust_weights_cpu(
    const at::Tensor& losses, const at::Tensor& eta_star, double lam, c10::string_view divergence,
    std::optional<double> alpha, std::optional<double> k) {
  const DivergenceSpec spec = check_robust_weights_args(losses, eta_star, lam, divergence, alpha, k);
  const at::Tensor x = losses.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const double eta = eta_star.item<double>();
  const int64_t n = x.numel();
  if (spec.kind == Divergence::CVaR) {
    // 1/(alpha N) above eta*, the remaining mass split equally among the losses equal to eta*, 0 below.
    const double tail = tail_size(spec.alpha, n);
    const auto counts = sum_pairs(x, [eta](double v) {
      return std::array<double, 2>{v > eta ? 1.0 : 0.0, v == eta ? 1.0 : 0.0};
    });
    const double above = 1.0 / tail;
    const double boundary = counts[1] > 0.0 ? std::max(0.0, 1.0 - counts[0] / tail) / counts[1] : 0.0;
    const double nan_weight = std::isnan(eta) ? kNaN : 0.0;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cvar_weights", [&] {
      const scalar_t* data = x.const_data_ptr<scalar_t>();
      scalar_t* result = out.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const double v = static_cast<double>(data[i]);
          const double q = v > eta ? above : (v == eta ? boundary : (v < eta ? nan_weight : kNaN));
          result[i] = static_cast<scalar_t>(q);
        }
      });
    });
    return out;
  }
  // psi*'(t_i) / sum_j psi*'(t_j): the sum is N at eta* up to rounding; dividing by it makes q sum to one
  // even when eta* was rounded to float32.
  at::Tensor xs = runs_on_float64_copy(x, lam) ? x.to(at::kDouble) : x;
  double total = solver_kernels(xs).reduce(xs, spec, cpu::Affine{eta, 1.0 / lam}, cpu::Sums::Weight)[0];
  if (!std::isfinite(total) && xs.scalar_type() != at::kDouble) {
    // A float32 t overflowed though the weights need not (|l - eta*| / lam beyond float32's range at a tiny lam,
    // cressie_read's u^(1/(k-1)) then inf/inf): the float64 copy forms them, as penalized_mean's second pass does.
    xs = x.to(at::kDouble);
    total = solver_kernels(xs).reduce(xs, spec, cpu::Affine{eta, 1.0 / lam}, cpu::Sums::Weight)[0];
  }
  cpu::map_derivative_over(xs, out, spec, eta, lam, 1.0 / total, 1, cpu::kAvx512MinValuesSolver);
  return out;
}

// One pass over the weights: sum, sum of squares, max, number of zeros and, with groups, the per-group
// sums, over fixed chunks (deterministic). Returns (ess, max_weight, zero_fraction, group_mass) of the
// weights normalized to sum to one; group_mass is empty without groups.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> weight_stats_cpu(
    const at::Tensor& weights, const std::optional<at::Tensor>& groups, int64_t num_groups) {
  const at::Tensor g = check_weight_stats_args(weights, groups, num_groups);
  const bool with_groups = g.defined();
  const at::Tensor x = weights.contiguous();
  const int64_t n = x.numel();
  const int64_t width = with_groups ? num_groups : 0;
  // Per part: sum, sum of squares, max, zeros, a NaN flag, a bad-id flag, then the group sums. Parts are
  // runs of whole chunks, few enough that the partial group sums stay under ~32 MB whatever num_groups is;
  // they depend on n and num_groups only, so the result does not depend on the thread count (cpu/chunks.h).
  constexpr int64_t kFixed = 6;
  const int64_t part_size = cpu::part_size(n, kFixed + width);
  const int64_t num_chunks = (n + part_size - 1) / part_size;
  std::vector<double> partial(num_chunks * (kFixed + width), 0.0);
  const int64_t* ids = with_groups ? g.const_data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_weight_stats", [&] {
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    // Parts own disjoint rows of `partial`.
    at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        double* row = partial.data() + c * (kFixed + width);
        double sum = 0.0, sumsq = 0.0, max = -kInf, zeros = 0.0;
        bool nan = false, bad_id = false;
        for (int64_t i = c * part_size; i < std::min(n, (c + 1) * part_size); ++i) {
          const double w = static_cast<double>(data[i]);
          sum += w;
          sumsq += w * w;
          max = std::max(max, w);
          zeros += w == 0.0 ? 1.0 : 0.0;
          nan |= std::isnan(w);
          if (ids != nullptr) {
            const int64_t id = ids[i];
            if (id < 0 || id >= width) {
              bad_id = true;
            } else {
              row[kFixed + id] += w;
            }
          }
        }
        row[0] = sum;
        row[1] = sumsq;
        row[2] = max;
        row[3] = zeros;
        row[4] = nan ? 1.0 : 0.0;
        row[5] = bad_id ? 1.0 : 0.0;
      }
    });
  });
  double sum = 0.0, sumsq = 0.0, max = -kInf, zeros = 0.0;
  bool nan = false, bad_id = false;
  std::vector<double> mass(width, 0.0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const double* row = partial.data() + c * (kFixed + width);
    sum += row[0];
    sumsq += row[1];
    max = std::max(max, row[2]);
    zeros += row[3];
    nan |= row[4] != 0.0;
    bad_id |= row[5] != 0.0;
    for (int64_t j = 0; j < width; ++j) mass[j] += row[kFixed + j];
  }
  TORCH_CHECK_INDEX(!bad_id, "dro_ext: groups holds an id outside [0, num_groups) with num_groups=", num_groups);
  if (nan) max = kNaN;
  const auto options = x.options().dtype(accumulate_type(x.scalar_type()));
  at::Tensor group_mass = at::empty({width}, options.dtype(at::kDouble));
  for (int64_t j = 0; j < width; ++j) group_mass.data_ptr<double>()[j] = mass[j] / sum;
  return {at::scalar_tensor(sum * sum / sumsq, options), at::scalar_tensor(max / sum, options),
          at::scalar_tensor(zeros / static_cast<double>(n), options), group_mass.to(options.dtype())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dro_ext, m) {
  m.def(
      "robust_objective(Tensor losses, float lam, str divergence, float? alpha=None, float? k=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "robust_weights(Tensor losses, Tensor eta_star, float lam, str divergence, float? alpha=None, "
      "float? k=None) -> Tensor");
  m.def(
      "weight_stats(Tensor weights, Tensor? groups=None, int num_groups=0) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dro_ext, CPU, m) {
  m.impl("robust_objective", &robust_objective_cpu);
  m.impl("robust_weights", &robust_weights_cpu);
  m.impl("weight_stats", &weight_stats_cpu);
}

}  // namespace dro_ext
