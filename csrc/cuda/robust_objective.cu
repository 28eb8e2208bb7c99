// CUDA kernels of the robust objective ops (schemas and CPU kernels in csrc/robust_objective.cpp, whose
// algorithms and results these mirror):
//
//   robust_objective  kl: a max pass, then one sum pass at shift max l (a device logsumexp);
//                     cvar: the ceil(alpha N)-th largest loss by a device radix select (cuda/radix_select.cuh:
//                       one launch per 11-bit digit of its key, no sort), then one pass summing the losses above it
//                       for the tail mean with the fractional boundary sample;
//                     chi2 and the others: multisection on g(eta) = mean psi*'((l - eta)/lam) - 1, which is
//                       non-increasing with g(min l) >= 0 >= g(max l), the bracket in device memory. Each pass
//                       is ONE launch: every block sums psi*' at the kSplit points that cut the bracket into
//                       kSplit + 1 equal parts, and the last block to finish (an integer counter, no float
//                       atomics) combines the partials in a fixed order and keeps the part where g changes sign.
//                       The points are equally spaced, so kl_cvar and smoothed_cvar take all of them from one
//                       exponential per loss once the spacing allows (divergences.h, ExcessFirstRunTable); a
//                       bracket far wider than its root's scale (a far outlier below the losses) is cut into
//                       parts of equally many float64 values instead (split_by_order). The bracket shrinks by
//                       kSplit + 1 per pass, so the convergence test (width <= 4 eps max(|a|, |b|, |max l|),
//                       coarser than the CPU's, whose Newton steps stop at 4 eps (2 |eta| + the weighted mean
//                       |l - eta|)) holds after a number of passes known in
//                       advance (8 for float32 sums, 17 for float64; a pass or two more beside a far outlier):
//                       that is the fixed budget, plus three. eta* is then interpolated linearly
//                       between the bracket ends, and chi2 (piecewise linear) solves its final segment exactly.
//                       The CPU's Newton steps would need ~100 launches of budget to be as sure of converging.
//                     No host round trip at all: the result stays on the device until the caller reads it.
//                     Where 1/lam is no normal float32, half/bfloat16/float32 losses are solved on a float64 copy
//                     (runs_on_float64_copy), as on the CPU.
//   robust_weights    one reduction (the normalizer, or cvar's counts) and one elementwise pass.
//   weight_stats      one pass over the weights (sum, sum of squares, max, zeros, NaN and bad-id flags);
//                     with groups, a radix sort by group id and one block per group summing its segment in
//                     a fixed order, then ONE host read of the bad-id flag to raise IndexError as the CPU does.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <limits>

#include "checks.h"
#include "cuda/psi_star_kernels.cuh"
#include "cuda/radix_select.cuh"

namespace dro_ext::cuda {

namespace {

// Interior points per multisection pass: each pass shrinks the bracket 8-fold for 7 evaluations of psi*' per
// loss. The float32 pass loop costs per loss (tools/sass_loops.py, nvcc 13, sm_90, cheapest path): ~30 SASS
// instructions for chi2 and cressie_read k = 2, ~45 for k = 3/2, ~430 for other k; kl_cvar ~234 and smoothed_cvar
// ~350 point by point, ~70 and ~140 as a run. An H100 SXM issues ~40 instructions per loss in the time HBM
// delivers a float32 (132 SMs x 128 lanes x 1.98 GHz against 3.35 TB/s; fewer from L2, where a 2^22 pass's
// 16 MB stays): the first two are memory-bound, the exponential divergences compute-bound, several-fold less so
// as runs.
constexpr int kSplit = 7;

// Passes that take a bracket of width <= 2 max|l| below 4 eps max(|l|, lam), i.e. shrink it by 1/(2 eps),
// plus three for rounding (a float64 solve emulated on the CPU needed 18 where this bound says 17): 11 passes
// for float32 sums, 21 for float64 (the rounded logarithm makes the bound 18).
int pass_budget(double eps) {
  return static_cast<int>(std::ceil(std::log(1.0 / (2.0 * eps)) / std::log(kSplit + 1.0))) + 3;
}

// The solver's state, in device memory, written by one thread of one block at a time.
struct SolverState {
  double lo, hi;  // min and max of the losses
  double a, b;    // the bracket of eta*: g(a) >= 0 >= g(b)
  double ga, gb;  // g at the bracket ends (NaN until evaluated)
  double eta, value;
  double tol_unit;  // 4 eps: the bracket is converged within 4 eps of the root's scale (multisection_step)
  int finished;        // (eta, value) is the final result: later passes return at once
  int search_idle;     // the multisection is not running (not started, converged or out of budget)
  int skip_segment;    // chi2's exact segment solve does not apply (not chi2, or not converged)
  int passes;
  unsigned int blocks_done;  // last-block-done counter of the multisection kernel, reset by that block
};

// alpha * N, snapped to the nearest integer when it is one up to rounding (as csrc/robust_objective.cpp).
double tail_size(double alpha, int64_t n) {
  const double k = alpha * static_cast<double>(n);
  const double r = std::nearbyint(k);
  return std::abs(k - r) <= 8.0 * DBL_EPSILON * k ? r : k;
}

template <typename T>
struct MinMax {
  T lo;
  T hi;
  int nan;
};

struct MinMaxOp {
  template <typename T>
  __device__ __forceinline__ MinMax<T> operator()(const MinMax<T>& x, const MinMax<T>& y) const {
    return MinMax<T>{y.lo < x.lo ? y.lo : x.lo, y.hi > x.hi ? y.hi : x.hi, x.nan | y.nan};
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) min_max_kernel(const scalar_t* __restrict__ x, int64_t n,
                                                           MinMax<at::opmath_type<scalar_t>>* __restrict__ partials) {
  using acc_t = at::opmath_type<scalar_t>;
  MinMax<acc_t> m{std::numeric_limits<acc_t>::infinity(), -std::numeric_limits<acc_t>::infinity(), 0};
  for_each_element<acc_t>(x, n, [&](acc_t v) {
    m.lo = v < m.lo ? v : m.lo;
    m.hi = v > m.hi ? v : m.hi;
    m.nan |= v != v;
  });
  const MinMax<acc_t> block = block_reduce(m, MinMaxOp());
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

// Combines the min/max partials and initializes the solver exactly as solve() in the CPU file does; clears cvar's
// select state when given one.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) init_solver_kernel(const MinMax<acc_t>* __restrict__ partials, int count,
                                                               SolverState* state, double lam, double eps,
                                                               bool iterative, SelectState* select) {
  if (select != nullptr) clear_select_state(select);
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  const MinMax<acc_t> m = reduce_partials(partials, count, MinMax<acc_t>{inf, -inf, 0}, MinMaxOp());
  if (threadIdx.x != 0) return;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double lo = m.nan ? nan : static_cast<double>(m.lo);
  const double hi = m.nan ? nan : static_cast<double>(m.hi);
  SolverState s;
  s.lo = lo;
  s.hi = hi;
  s.finished = 1;
  if (isnan(lo) || isnan(hi) || lo == -INFINITY) {  // NaN gives NaN; -inf has no sensible dual
    s.eta = s.value = nan;
  } else if (hi == INFINITY) {  // the worst case is infinite
    s.eta = s.value = INFINITY;
  } else if (lo == hi) {  // N = 1 or all equal: psi*(0) = 0
    s.eta = s.value = lo;
  } else {
    s.finished = 0;
    s.eta = 0.5 * (lo + hi);
    s.value = nan;
  }
  s.a = lo;
  s.b = hi;
  s.ga = s.gb = nan;
  s.tol_unit = 4.0 * eps;
  s.search_idle = s.finished || !iterative;
  s.skip_segment = 1;
  s.passes = 0;
  s.blocks_done = 0u;
  *state = s;
}

// kl: eta* = max l + lam log(mean exp((l - max l)/lam)) = Psi, from the sums of (expm1(t), exp(t)) at shift
// max l. Where the mean exponential is near 1 (large lam, the ERM limit) its logarithm is taken as log1p of the
// mean expm1, which keeps the small difference that lam multiplies; elsewhere log of the mean exp (as the CPU).
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) kl_finalize_kernel(const Pair<acc_t>* __restrict__ partials, int count,
                                                               SolverState* state, double lam, double n) {
  if (state->finished) return;  // the partials were skipped too (unwritten): read nothing
  const Pair<acc_t> total = reduce_partials(partials, count, Pair<acc_t>{acc_t(0), acc_t(0)}, PairSum());
  if (threadIdx.x != 0) return;
  const double mean_exp = static_cast<double>(total.b) / n;
  const double log_mean = mean_exp > 0.5 ? log1p(static_cast<double>(total.a) / n) : log(mean_exp);
  const double eta = state->hi + lam * log_mean;
  state->eta = eta;
  state->value = eta;
  state->finished = 1;
}

// Sums over float64 values v of the pairs cvar and chi2 need, against a threshold c read on the device:
//   kAboveSum:   (v > c ? v : 0, v > c ? 1 : 0)
//   kAboveEqual: (v > c ? 1 : 0, v == c ? 1 : 0)
enum class Threshold { kAboveSum, kAboveEqual };

template <Threshold MODE, typename scalar_t>
__global__ void __launch_bounds__(kThreads) threshold_partials_kernel(const scalar_t* __restrict__ x, int64_t n,
                                                                      ShiftRef threshold, const int* skip,
                                                                      Pair<double>* __restrict__ partials) {
  if (skip != nullptr && *skip) return;
  const double c = threshold.read();
  Pair<double> s{0.0, 0.0};
  for_each_element<double>(x, n, [&](double v) {
    if constexpr (MODE == Threshold::kAboveSum) {
      s.a += v > c ? v : 0.0;
      s.b += v > c ? 1.0 : 0.0;
    } else {
      s.a += v > c ? 1.0 : 0.0;
      s.b += v == c ? 1.0 : 0.0;
    }
  });
  const Pair<double> block = block_reduce(s, PairSum());
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

template <Threshold MODE>
void launch_threshold_partials(const at::Tensor& x, ShiftRef threshold, const int* skip, at::Tensor& partials) {
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_threshold", [&] {
    threshold_partials_kernel<MODE><<<static_cast<int>(partials.size(0)), kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), x.numel(), threshold, skip,
        reinterpret_cast<Pair<double>*>(partials.mutable_data_ptr<double>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor threshold_partials_buffer(const at::Tensor& x) {
  int blocks = 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_blocks",
                                  [&] { blocks = reduce_blocks<scalar_t>(x.numel()); });
  return at::empty({blocks, 2}, x.options().dtype(at::kDouble));
}

// cvar: eta* = the j-th largest loss (the boundary); Psi = (sum_{l > eta*} l + (k - #{l > eta*}) eta*) / k.
__global__ void __launch_bounds__(kThreads) cvar_finalize_kernel(const Pair<double>* __restrict__ partials, int count,
                                                                 const double* __restrict__ boundary,
                                                                 SolverState* state, double k) {
  if (state->finished) return;  // the partials were skipped too (unwritten): read nothing
  const Pair<double> total = reduce_partials(partials, count, Pair<double>{0.0, 0.0}, PairSum());
  if (threadIdx.x != 0) return;
  const double eta = *boundary;
  state->eta = eta;
  // Never above max l, which (k eta) / k can round past where the tail is max l alone (alpha N < 1), as the CPU.
  const double value = (total.a + (k - total.b) * eta) / k;
  state->value = value > state->hi ? state->hi : value;  // keeps NaN
  state->finished = 1;
}

// A bracket wider than this many times the scale of its root's neighbourhood is split by the floats' order
// (split_by_order).
constexpr double kOrderSplitWidth = 1024.0;

// Whether a pass splits [a, b] by the floats' order rather than by value. Equally spaced points shrink the width
// 8-fold a pass, which reaches the tolerance within the budget from a width up to 2048 times the scale the root is
// resolved at (multisection_step: at least |max l|). From -1e30 beside losses near 3 it would take 50 passes, and
// a tolerance at the bracket's scale resolved nothing (it returned max l): points equally spaced in the floats'
// order span every binade between, and bring such a bracket within the root's binades in a pass or two, while any
// bracket narrows to adjacent floats within 21 such passes. The reference scale is |max l| or the bracket's end
// nearer 0: a bracket of nonnegative losses is never wider than max l, and so splits by value exactly as before.
__device__ __forceinline__ bool split_by_order(double a, double b, double hi) {
  return b - a > kOrderSplitWidth * fmax(fabs(hi), fmin(fabs(a), fabs(b)));
}

// The kSplit points of a pass, j = 1..kSplit, formed identically by every block and by the step that reads their
// sums: a + (b - a) j / (kSplit + 1), or (by_order) the floats j / (kSplit + 1) of the way through the float64
// values in [a, b] in their order (radix_select.cuh's order-preserving keys).
__device__ __forceinline__ double split_point(double a, double b, int j, bool by_order) {
  if (by_order) {
    const uint64_t first = SelectKey<double>::of(a), span = SelectKey<double>::of(b) - first;
    return SelectKey<double>::value(first + span / (kSplit + 1) * static_cast<uint64_t>(j + 1));
  }
  return a + (b - a) * static_cast<double>(j + 1) / static_cast<double>(kSplit + 1);
}

template <typename T>
struct SplitSums {
  T v[kSplit];
};

struct SplitSumsOp {
  template <typename T>
  __device__ __forceinline__ SplitSums<T> operator()(const SplitSums<T>& x, const SplitSums<T>& y) const {
    SplitSums<T> out;
#pragma unroll
    for (int j = 0; j < kSplit; ++j) out.v[j] = x.v[j] + y.v[j];
    return out;
  }
};

// eta inside [a, b] by linear interpolation of g between the ends (exact on a linear piece), else the midpoint.
// g = +inf at a (a weight overflows there: lam far finer than the losses' float spacing, cressie_read near k = 1)
// gives b, where g is finite: between the two the weights can overflow (inf/inf: NaN worst-case weights), and the
// root lies within the bracket's few floats of b (max l itself where it rounds to it). The CPU's Newton ends on the
// first float above where no weight overflows, for the same reason.
__device__ __forceinline__ double interpolate(double a, double b, double ga, double gb) {
  if (ga == INFINITY) return b;
  if (isfinite(ga) && isfinite(gb) && ga > gb) return fmin(fmax(a + (b - a) * (ga / (ga - gb)), a), b);
  return 0.5 * (a + b);
}

// One multisection step on sums[j] = sum (psi*'((l - p_j)/lam) - 1) at the split points p_j of the current bracket.
__device__ void multisection_step(SolverState* st, const double* sums, double n, bool chi2, int budget) {
  st->passes += 1;
  const double a = st->a, b = st->b;
  const bool by_order = split_by_order(a, b, st->hi);
  double na = a, nb = b, nga = st->ga, ngb = st->gb;
  auto stop = [&](bool converged) {
    st->search_idle = 1;
    st->skip_segment = !(chi2 && converged);
  };
  for (int j = 0; j < kSplit; ++j) {
    const double p = split_point(a, b, j, by_order);
    const double g = sums[j] / n;  // mean psi*' - 1, summed as psi*' - 1 (exact near the root at large lam)
    if (isnan(g)) {
      st->eta = st->value = std::numeric_limits<double>::quiet_NaN();
      st->finished = 1;
      return stop(false);
    }
    if (g == 0.0) {
      st->eta = p;
      return stop(true);
    }
    if (g > 0.0) {
      na = p;
      nga = g;
    } else {
      nb = p;
      ngb = g;
      break;
    }
  }
  st->a = na;
  st->b = nb;
  st->ga = nga;
  st->gb = ngb;
  st->eta = interpolate(na, nb, nga, ngb);
  // Converged within 4 eps of the root's scale: the larger of the bracket's ends, or |max l| if larger (a root near
  // 0 is resolved as finely as the losses allow, not to denormals). Coarser than the CPU's test (4 eps times
  // 2 |eta| + the psi''-weighted mean |l - eta|) where max l is far above eta; beside a far outlier below, |l| of the
  // outlier would leave the root unresolved.
  if (nb - na <= st->tol_unit * fmax(fmax(fabs(na), fabs(nb)), fabs(st->hi))) return stop(true);
  if (st->passes >= budget) stop(false);
}

// One multisection pass in one launch: block partials of sum (psi*' - 1) at the kSplit points, then the last block to
// finish combines them in block order and steps. Returns at once when the search is idle.
template <typename scalar_t, typename Div>
__global__ void __launch_bounds__(kThreads) multisection_kernel(
    const scalar_t* __restrict__ x, int64_t n, Div div, double lam, bool chi2, int budget, SolverState* state,
    SplitSums<at::opmath_type<scalar_t>>* __restrict__ partials) {
  using acc_t = at::opmath_type<scalar_t>;
  if (state->search_idle) return;
  const double a = state->a, b = state->b;
  const bool by_order = split_by_order(a, b, state->hi);
  acc_t shift[kSplit];
#pragma unroll
  for (int j = 0; j < kSplit; ++j) shift[j] = static_cast<acc_t>(split_point(a, b, j, by_order));
  const acc_t inv_lam = static_cast<acc_t>(1.0 / lam);
  SplitSums<acc_t> s;
#pragma unroll
  for (int j = 0; j < kSplit; ++j) s.v[j] = acc_t(0);
  bool direct = true;
  if constexpr (requires { requires Div::kHasExcessFirstRun; }) {
    // Equally spaced split points: an exponential divergence evaluates them as a run, one exponential per loss
    // (divergences.h, ExcessFirstRunTable) where the spacing allows. The same choice in every block.
    const double spacing = (b - a) / static_cast<double>(kSplit + 1) / lam;
    if (!by_order && div.template run_fits<kSplit>(spacing) && isfinite(static_cast<double>(inv_lam))) {
      direct = false;
      const auto run = div.template run_table<kSplit>(spacing);
      const acc_t center = static_cast<acc_t>(split_point(a, b, run.center, false));
      for_each_element<acc_t>(x, n, [&](acc_t l) {
        acc_t terms[kSplit];
        div.excess_first_run((l - center) * inv_lam, run, terms);
#pragma unroll
        for (int j = 0; j < kSplit; ++j) s.v[j] += terms[j];
      });
    }
  }
  if (direct) {
    for_each_element<acc_t>(x, n, [&](acc_t l) {
#pragma unroll
      for (int j = 0; j < kSplit; ++j) s.v[j] += div.excess_first((l - shift[j]) * inv_lam);
    });
  }
  const SplitSums<acc_t> block = block_reduce(s, SplitSumsOp());
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
  if (!arrive_last(&state->blocks_done)) return;
  SplitSums<acc_t> v;
#pragma unroll
  for (int j = 0; j < kSplit; ++j) v.v[j] = acc_t(0);
  for (int i = threadIdx.x; i < static_cast<int>(gridDim.x); i += kThreads) {
#pragma unroll
    for (int j = 0; j < kSplit; ++j) v.v[j] += __ldcg(&partials[i].v[j]);  // bypass L1: written by other SMs
  }
  const SplitSums<acc_t> total = block_reduce(v, SplitSumsOp());
  if (threadIdx.x == 0) {
    state->blocks_done = 0u;
    double sums[kSplit];
#pragma unroll
    for (int j = 0; j < kSplit; ++j) sums[j] = static_cast<double>(total.v[j]);
    multisection_step(state, sums, static_cast<double>(n), chi2, budget);
  }
}

// chi2 on its final segment A = {l > eta - 2 lam}: eta = (sum_A l + 2 lam (|A| - N)) / |A|, float64 sums.
__global__ void __launch_bounds__(kThreads) chi2_segment_kernel(const Pair<double>* __restrict__ partials, int count,
                                                                SolverState* state, double lam, double n) {
  if (state->skip_segment || state->finished) return;  // the partials were skipped too: read nothing
  const Pair<double> total = reduce_partials(partials, count, Pair<double>{0.0, 0.0}, PairSum());
  if (threadIdx.x != 0) return;
  if (total.b > 0.0) {
    const double exact = (total.a + 2.0 * lam * (total.b - n)) / total.b;
    if (exact >= state->lo && exact <= state->hi) state->eta = exact;
  }
}

// Psi = L(eta*) = lam * mean value_term, from the (psi*, psi*') sums at eta*, and never above max l
// (Psi <= L(max l) <= max l), which L at a rounded eta* can exceed where lam is below the losses' resolution.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) objective_finalize_kernel(const Pair<acc_t>* __restrict__ partials,
                                                                      int count, SolverState* state, double lam,
                                                                      double n) {
  if (state->finished) return;  // the partials were skipped too (unwritten): read nothing
  const Pair<acc_t> total = reduce_partials(partials, count, Pair<acc_t>{acc_t(0), acc_t(0)}, PairSum());
  if (threadIdx.x != 0) return;
  const double value = lam * (static_cast<double>(total.a) / n);
  state->value = value > state->hi ? state->hi : value;  // keeps NaN
  state->finished = 1;
}

__global__ void write_result_kernel(const SolverState* state, ScalarOut value, ScalarOut eta) {
  value.write(state->value);
  eta.write(state->eta);
}

template <typename F>
void dispatch_acc(at::ScalarType type, F&& f) {
  if (type == at::kDouble) {
    f(double{});
  } else {
    f(float{});
  }
}

std::tuple<at::Tensor, at::Tensor> robust_objective_cuda(
    const at::Tensor& losses, double lam, c10::string_view divergence, std::optional<double> alpha,
    std::optional<double> k) {
  check_losses(losses);
  const DivergenceSpec spec = check_divergence_args(lam, divergence, alpha, k);
  const c10::cuda::CUDAGuard guard(losses.device());
  if (spec.kind != Divergence::CVaR && runs_on_float64_copy(losses, lam)) {  // cvar's selection takes no t
    const auto [value, eta] = robust_objective_cuda(losses.to(at::kDouble), lam, divergence, alpha, k);
    return {value.to(losses.scalar_type()), eta.to(accumulate_type(losses.scalar_type()))};
  }
  const at::Tensor x = losses.contiguous();
  const int64_t n = x.numel();
  const double nd = static_cast<double>(n);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const bool iterative = spec.kind != Divergence::KL && spec.kind != Divergence::CVaR;
  const bool chi2 = spec.kind == Divergence::Chi2;
  const double eps = x.scalar_type() == at::kDouble ? DBL_EPSILON : static_cast<double>(FLT_EPSILON);

  at::Tensor state_buffer = at::empty({static_cast<int64_t>(sizeof(SolverState))}, x.options().dtype(at::kByte));
  auto* state = reinterpret_cast<SolverState*>(state_buffer.mutable_data_ptr());
  const int* finished = &state->finished;

  // cvar's radix select state, cleared by the init kernel.
  at::Tensor select_buffer;
  SelectState* select = nullptr;
  if (spec.kind == Divergence::CVaR) {
    select_buffer = at::empty({static_cast<int64_t>(sizeof(SelectState))}, x.options().dtype(at::kByte));
    select = reinterpret_cast<SelectState*>(select_buffer.mutable_data_ptr());
  }

  // min, max and NaN in one pass; the solver starts from them.
  at::Tensor partials = derivative_partials_buffer(x);  // (blocks, 2) of the accumulate dtype
  const int blocks = static_cast<int>(partials.size(0));
  // MinMax<acc_t> is two acc_t and an int: four acc_t hold it.
  at::Tensor minmax = at::empty({blocks, 4}, partials.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_minmax", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto* mm = reinterpret_cast<MinMax<acc_t>*>(minmax.mutable_data_ptr<acc_t>());
    min_max_kernel<<<blocks, kThreads, 0, stream>>>(x.const_data_ptr<scalar_t>(), n, mm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    init_solver_kernel<acc_t><<<1, kThreads, 0, stream>>>(mm, blocks, state, lam, eps, iterative, select);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  if (spec.kind == Divergence::KL) {
    launch_derivative_partials<kExcessFirst, 1>(x, spec, ShiftRef{scalar_ref(&state->hi), 1.0, 0.0}, lam, finished,
                                               partials);
    dispatch_acc(x.scalar_type(), [&](auto acc_zero) {
      using acc_t = decltype(acc_zero);
      kl_finalize_kernel<acc_t><<<1, kThreads, 0, stream>>>(
          reinterpret_cast<const Pair<acc_t>*>(partials.const_data_ptr<acc_t>()), blocks, state, lam, nd);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else if (spec.kind == Divergence::CVaR) {
    const double tail = tail_size(spec.alpha, n);
    const int64_t j = std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(tail))));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_cvar_select", [&] {
      launch_select(x.const_data_ptr<scalar_t>(), n, j, finished, select, reduce_blocks<scalar_t>(n), stream);
    });
    // The losses above the boundary are the full-weight tail: their float64 sum and count in one pass.
    at::Tensor partials_above = threshold_partials_buffer(x);
    launch_threshold_partials<Threshold::kAboveSum>(x, ShiftRef{scalar_ref(&select->value), 1.0, 0.0}, finished,
                                                   partials_above);
    cvar_finalize_kernel<<<1, kThreads, 0, stream>>>(
        reinterpret_cast<const Pair<double>*>(partials_above.const_data_ptr<double>()),
        static_cast<int>(partials_above.size(0)), &select->value, state, tail);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    const int budget = pass_budget(eps);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_multisection", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      at::Tensor split_partials = at::empty({blocks, kSplit}, partials.options());
      auto* out = reinterpret_cast<SplitSums<acc_t>*>(split_partials.mutable_data_ptr<acc_t>());
      const scalar_t* data = x.const_data_ptr<scalar_t>();
      launch_for_divergence<acc_t>(spec, [&](const auto& div) {
        for (int pass = 0; pass < budget; ++pass) {
          multisection_kernel<<<blocks, kThreads, 0, stream>>>(data, n, div, lam, chi2, budget, state, out);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
    });
    if (chi2) {
      at::Tensor segment = threshold_partials_buffer(x);
      launch_threshold_partials<Threshold::kAboveSum>(x, ShiftRef{scalar_ref(&state->eta), 1.0, -2.0 * lam},
                                                     &state->skip_segment, segment);
      chi2_segment_kernel<<<1, kThreads, 0, stream>>>(
          reinterpret_cast<const Pair<double>*>(segment.const_data_ptr<double>()), static_cast<int>(segment.size(0)),
          state, lam, nd);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    launch_derivative_partials<0, 1>(x, spec, ShiftRef{scalar_ref(&state->eta), 1.0, 0.0}, lam, finished, partials);
    dispatch_acc(x.scalar_type(), [&](auto acc_zero) {
      using acc_t = decltype(acc_zero);
      objective_finalize_kernel<acc_t><<<1, kThreads, 0, stream>>>(
          reinterpret_cast<const Pair<acc_t>*>(partials.const_data_ptr<acc_t>()), blocks, state, lam, nd);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  const auto options = losses.options();
  at::Tensor value = at::empty({}, options);
  at::Tensor eta = at::empty({}, options.dtype(accumulate_type(losses.scalar_type())));
  write_result_kernel<<<1, 1, 0, stream>>>(state, scalar_out(value), scalar_out(eta));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {value, eta};
}

// ---------------------------------------------------------------------------------------------------
// robust_weights
// ---------------------------------------------------------------------------------------------------

// 1 / sum psi*'(t_j) at eta*: the normalizer of the weights.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) inverse_sum_kernel(const Pair<acc_t>* __restrict__ partials, int count,
                                                               double* inverse) {
  const Pair<acc_t> total = reduce_partials(partials, count, Pair<acc_t>{acc_t(0), acc_t(0)}, PairSum());
  if (threadIdx.x == 0) *inverse = 1.0 / static_cast<double>(total.a);
}

// cvar: 1/(alpha N) above eta*, the remaining mass split equally among the losses equal to it, 0 below.
__global__ void __launch_bounds__(kThreads) cvar_weight_params_kernel(const Pair<double>* __restrict__ partials,
                                                                      int count, ScalarRef eta_ref, double tail,
                                                                      double* params) {
  const Pair<double> counts = reduce_partials(partials, count, Pair<double>{0.0, 0.0}, PairSum());
  if (threadIdx.x != 0) return;
  params[0] = 1.0 / tail;
  params[1] = counts.b > 0.0 ? fmax(0.0, 1.0 - counts.a / tail) / counts.b : 0.0;
  params[2] = isnan(eta_ref.read()) ? std::numeric_limits<double>::quiet_NaN() : 0.0;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) cvar_weights_kernel(const scalar_t* __restrict__ x,
                                                                scalar_t* __restrict__ out, int64_t n,
                                                                ScalarRef eta_ref, const double* __restrict__ params) {
  const double eta = eta_ref.read();
  const double above = params[0], boundary = params[1], below = params[2];
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = static_cast<double>(x[i]);
    const double q = v > eta ? above : (v == eta ? boundary : (v < eta ? below : nan));
    out[i] = static_cast<scalar_t>(q);
  }
}

at::Tensor robust_weights_cuda(
    const at::Tensor& losses, const at::Tensor& eta_star, double lam, c10::string_view divergence,
    std::optional<double> alpha, std::optional<double> k) {
  const DivergenceSpec spec = check_robust_weights_args(losses, eta_star, lam, divergence, alpha, k);
  const c10::cuda::CUDAGuard guard(losses.device());
  if (spec.kind != Divergence::CVaR && runs_on_float64_copy(losses, lam)) {  // cvar's selection takes no t
    return robust_weights_cuda(losses.to(at::kDouble), eta_star.to(at::kDouble), lam, divergence, alpha, k)
        .to(losses.scalar_type());
  }
  const at::Tensor x = losses.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.numel();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const ScalarRef eta = scalar_ref(eta_star);
  if (spec.kind == Divergence::CVaR) {
    at::Tensor counts = threshold_partials_buffer(x);
    launch_threshold_partials<Threshold::kAboveEqual>(x, ShiftRef{eta, 1.0, 0.0}, nullptr, counts);
    at::Tensor params = at::empty({3}, x.options().dtype(at::kDouble));
    cvar_weight_params_kernel<<<1, kThreads, 0, stream>>>(
        reinterpret_cast<const Pair<double>*>(counts.const_data_ptr<double>()), static_cast<int>(counts.size(0)), eta,
        tail_size(spec.alpha, n), params.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_cvar_weights", [&] {
      cvar_weights_kernel<<<map_blocks<scalar_t>(n), kThreads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), n, eta, params.const_data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return out;
  }
  // psi*'(t_i) / sum_j psi*'(t_j): dividing by the sum makes q sum to one even for a rounded eta*.
  at::Tensor partials = derivative_partials_buffer(x);
  launch_derivative_partials<1, 2>(x, spec, ShiftRef{eta, 1.0, 0.0}, lam, nullptr, partials);
  at::Tensor inverse = at::empty({}, x.options().dtype(at::kDouble));
  dispatch_acc(x.scalar_type(), [&](auto acc_zero) {
    using acc_t = decltype(acc_zero);
    inverse_sum_kernel<acc_t><<<1, kThreads, 0, stream>>>(
        reinterpret_cast<const Pair<acc_t>*>(partials.const_data_ptr<acc_t>()), static_cast<int>(partials.size(0)),
        inverse.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  launch_map_derivative(x, out, spec, ShiftRef{eta, 1.0, 0.0}, lam, scalar_ref(inverse.const_data_ptr<double>()), 1.0,
                        1);
  return out;
}

// ---------------------------------------------------------------------------------------------------
// weight_stats
// ---------------------------------------------------------------------------------------------------

struct Stats {
  double sum, sumsq, max, zeros;
  int nan, bad_id;
};

struct StatsOp {
  __device__ __forceinline__ Stats operator()(const Stats& x, const Stats& y) const {
    return Stats{x.sum + y.sum, x.sumsq + y.sumsq, y.max > x.max ? y.max : x.max, x.zeros + y.zeros,
                 x.nan | y.nan, x.bad_id | y.bad_id};
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) weight_stats_kernel(const scalar_t* __restrict__ w,
                                                                const int64_t* __restrict__ ids, int64_t n,
                                                                int64_t num_groups, Stats* __restrict__ partials) {
  Stats s{0.0, 0.0, -INFINITY, 0.0, 0, 0};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = static_cast<double>(w[i]);
    s.sum += v;
    s.sumsq += v * v;
    s.max = v > s.max ? v : s.max;
    s.zeros += v == 0.0 ? 1.0 : 0.0;
    s.nan |= v != v;
    if (ids != nullptr) {
      const int64_t id = ids[i];
      s.bad_id |= id < 0 || id >= num_groups;
    }
  }
  const Stats block = block_reduce(s, StatsOp());
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

template <typename acc_t>
__global__ void __launch_bounds__(kThreads) weight_stats_finalize_kernel(
    const Stats* __restrict__ partials, int count, double n, acc_t* ess, acc_t* max_weight, acc_t* zero_fraction,
    double* total, int* bad_id) {
  const Stats s = reduce_partials(partials, count, Stats{0.0, 0.0, -INFINITY, 0.0, 0, 0}, StatsOp());
  if (threadIdx.x != 0) return;
  const double max = s.nan ? std::numeric_limits<double>::quiet_NaN() : s.max;
  *ess = static_cast<acc_t>(s.sum * s.sum / s.sumsq);
  *max_weight = static_cast<acc_t>(max / s.sum);
  *zero_fraction = static_cast<acc_t>(s.zeros / n);
  *total = s.sum;
  *bad_id = s.bad_id;
}

// One block per group: the group's segment of the weights sorted by group id, summed in a fixed order.
__global__ void __launch_bounds__(kThreads) group_mass_kernel(const int64_t* __restrict__ sorted_ids,
                                                              const double* __restrict__ sorted_w, int64_t n,
                                                              const double* __restrict__ total, double* mass) {
  const int64_t group = blockIdx.x;
  __shared__ int64_t bounds[2];
  if (threadIdx.x < 2) {
    const int64_t target = group + threadIdx.x;  // first index with id >= target
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (sorted_ids[mid] < target) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    bounds[threadIdx.x] = lo;
  }
  __syncthreads();
  double s = 0.0;
  for (int64_t i = bounds[0] + threadIdx.x; i < bounds[1]; i += kThreads) s += sorted_w[i];
  const double sum = block_reduce(s, Sum());
  if (threadIdx.x == 0) mass[group] = sum / *total;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> weight_stats_cuda(
    const at::Tensor& weights, const std::optional<at::Tensor>& groups, int64_t num_groups) {
  const at::Tensor g = check_weight_stats_args(weights, groups, num_groups);
  const bool with_groups = g.defined();
  const c10::cuda::CUDAGuard guard(weights.device());
  const at::Tensor x = weights.contiguous();
  const int64_t n = x.numel();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto options = x.options().dtype(accumulate_type(x.scalar_type()));
  at::Tensor ess = at::empty({}, options), max_weight = at::empty({}, options), zero_fraction = at::empty({}, options);
  at::Tensor total = at::empty({}, x.options().dtype(at::kDouble));
  at::Tensor bad_id = at::empty({}, x.options().dtype(at::kInt));
  int blocks = 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_blocks",
                                  [&] { blocks = reduce_blocks<scalar_t>(n); });
  static_assert(sizeof(Stats) % sizeof(double) == 0, "Stats is stored in a double buffer");
  at::Tensor partials = at::empty({blocks, static_cast<int64_t>(sizeof(Stats) / sizeof(double))},
                                  x.options().dtype(at::kDouble));
  auto* stats = reinterpret_cast<Stats*>(partials.mutable_data_ptr<double>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dro_ext_cuda_weight_stats", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    weight_stats_kernel<<<blocks, kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), with_groups ? g.const_data_ptr<int64_t>() : nullptr, n,
        with_groups ? num_groups : 0, stats);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    weight_stats_finalize_kernel<acc_t><<<1, kThreads, 0, stream>>>(
        stats, blocks, static_cast<double>(n), ess.mutable_data_ptr<acc_t>(), max_weight.mutable_data_ptr<acc_t>(),
        zero_fraction.mutable_data_ptr<acc_t>(), total.mutable_data_ptr<double>(), bad_id.mutable_data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!with_groups) return {ess, max_weight, zero_fraction, at::empty({0}, options)};

  TORCH_CHECK(n <= INT_MAX && num_groups <= INT_MAX,
              "dro_ext: weight_stats with groups on CUDA supports at most 2^31 - 1 weights and groups, got ", n,
              " weights and num_groups=", num_groups);
  // The one host read: ids outside [0, num_groups) raise IndexError, as on the CPU.
  TORCH_CHECK_INDEX(bad_id.item<int>() == 0, "dro_ext: groups holds an id outside [0, num_groups) with num_groups=",
                    num_groups);
  const at::Tensor values = x.to(at::kDouble);
  at::Tensor sorted_ids = at::empty_like(g), sorted_w = at::empty_like(values);
  size_t temp_bytes = 0;
  int end_bit = 1;
  while (end_bit < 63 && (int64_t{1} << end_bit) < num_groups) ++end_bit;  // ids are in [0, num_groups)
  // CUB's two-call protocol: with no temp storage the call only says how much it needs.
  auto sort_by_group = [&](void* temp_storage) {
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        temp_storage, temp_bytes, g.const_data_ptr<int64_t>(), sorted_ids.mutable_data_ptr<int64_t>(),
        values.const_data_ptr<double>(), sorted_w.mutable_data_ptr<double>(), static_cast<int>(n), 0, end_bit,
        stream));
  };
  sort_by_group(nullptr);
  at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, x.options().dtype(at::kByte));
  sort_by_group(temp.mutable_data_ptr());
  at::Tensor mass = at::empty({num_groups}, x.options().dtype(at::kDouble));
  group_mass_kernel<<<static_cast<unsigned int>(num_groups), kThreads, 0, stream>>>(
      sorted_ids.const_data_ptr<int64_t>(), sorted_w.const_data_ptr<double>(), n, total.const_data_ptr<double>(),
      mass.mutable_data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {ess, max_weight, zero_fraction, mass.to(options.dtype())};
}

}  // namespace

TORCH_LIBRARY_IMPL(dro_ext, CUDA, m) {
  m.impl("robust_objective", &robust_objective_cuda);
  m.impl("robust_weights", &robust_weights_cuda);
  m.impl("weight_stats", &weight_stats_cuda);
}

}  // namespace dro_ext::cuda
