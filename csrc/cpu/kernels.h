// The CPU kernels' entry points, independent of the SIMD capability they were compiled for.
// kernels_impl.h is compiled once per capability (kernels_default.cpp, kernels_avx2.cpp, kernels_avx512.cpp);
// cpu_kernels(n, ...) picks the one a call over n values runs (csrc/cpu/kernel_selection.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <array>
#include <cmath>
#include <vector>

#include "checks.h"
#include "divergences.h"

namespace dro_ext::cpu {

// t_i = (x_i - shift) * inv_lam for every element of the contiguous 1-D tensor x.
struct Affine {
  double shift;
  double inv_lam;
};

// What one pass of reduce() sums, with t_i = (x_i - shift) * inv_lam.
enum class Sums {
  // {sum_i a_i, sum_i b_i, sum_i excess_first(t_i)} with (a_i, b_i) divergences.h's loss parts: the loss value
  // shift + mean a + lam mean b, each sample's share in the form that keeps its precision (penalized_value:
  // mean x + lam mean excess as lam grows, where shift + lam mean psi*(t) would not; psi*(t) itself for a loss
  // far below the rest), and the mean weight 1 + mean excess_first.
  Loss,
  // {sum_i excess_first(t_i), sum_i second(t_i), sum_i second(t_i) |x_i - shift|}: the optimality condition of
  // eta, its slope, and the scale of the losses the slope comes from (how finely the condition can resolve eta).
  Newton,
  // {sum_i first(t_i), 0, 0}: the total weight, relatively accurate when every weight is tiny.
  Weight,
  // {sum_i psi*(t_i), 0, 0}: the loss value shift + lam mean psi*(t) where Loss's form is inf - inf (some t_i
  // is infinite; divergences.h's penalized_value).
  Value,
};

// One chunk's split of the losses around a bracket [lower, upper] (select_tail in csrc/robust_objective.cpp):
// the float64 sum and the number of the losses above upper, and the number with lower <= x_i <= upper.
struct BracketCounts {
  double sum_above;
  int64_t above;
  int64_t inside;
};

struct KernelTable {
  // The sums of `sums` in one pass, accumulated in float for half/bfloat16/float and in double for double.
  // Deterministic: the partial sums are taken over fixed chunks and combined in order, whatever the number
  // of threads.
  std::array<double, 3> (*reduce)(const at::Tensor& x, const DivergenceSpec& spec, Affine affine, Sums sums);
  // out_i = multiplier * psi*^(order)(t_i); out has x's shape and dtype. Returns whether a float32 t overflowed
  // (the caller then redoes it on a float64 copy).
  bool (*map_derivative)(
      const at::Tensor& x, at::Tensor& out, const DivergenceSpec& spec, Affine affine, double multiplier,
      int64_t order);
  // {min x, max x} in float64, both NaN if x holds a NaN. Exact; vectorized (the robust solvers' first pass).
  std::array<double, 2> (*min_max)(const at::Tensor& x);
  // out_i = exp(x_i - shift) for i < n, 0 where x_i - shift < below (csrc/group_dro_step.h's exp_or_zero, a SIMD
  // register at a time: the online Group DRO step's q over many groups).
  void (*exp_shifted)(const double* x, double shift, double below, double* out, int64_t n);
  // The BracketCounts of each chunk of x (csrc/cpu/chunks.h), in chunk order; lower <= upper.
  std::vector<BracketCounts> (*bracket_counts)(const at::Tensor& x, double lower, double upper);
  // The x_i with lower <= x_i <= upper as float64, in order, chunk c's from out + offsets[c] (offsets: the running
  // totals of bracket_counts' `inside`, with the total last). Writes nothing outside those ranges.
  void (*gather_bracket)(const at::Tensor& x, double lower, double upper, const int64_t* offsets, double* out);
  const char* capability;
};

// The SIMD builds, in order: a processor that runs one runs the ones before it.
enum class Capability : int { Default = 0, AVX2 = 1, AVX512 = 2 };

// The widest build allowed: the widest the processor has (AVX2 with FMA and F16C; AVX-512 F/BW/VL/DQ), capped by
// ATEN_CPU_CAPABILITY (default, avx2) as ATen's own kernels are, unless a test pinned a build.
Capability cpu_capability();
bool use_avx2_kernels();  // cpu_capability() >= AVX2

// On Intel processors, below a size a call runs the AVX2 build where AVX-512 is allowed (unless a test pinned a build).
// Intel's server cores lower their clock for a while after 512-bit floating-point instructions run, and the framework
// code around a small call pays for it: on a 2-vCPU Intel Xeon (Sapphire Rapids class) a pure-Python loop between
// AVX-512 calls ran 10% slower than between AVX2 calls. Where the wider vectors win that back depends on how much
// vector work a call does per value (measured there, 2 threads, AVX-512's time over AVX2's):
// - a pass or two (the loss forward and backward, the cross-entropy, the Group DRO step's q): the loss's forward +
//   backward 1.02x to 1.10x at 2048 to 8192 values, 0.94x to 0.98x at 16384;
constexpr int64_t kAvx512MinValuesOnePass = 16384;
// - a solver's several passes (the robust objective and its weights): chi2 1.08x at 128, 0.92x at 2048 and 0.80x at
//   8192 (cvar, which selects more than it computes, 0.99x to 1.04x at every size).
constexpr int64_t kAvx512MinValuesSolver = 1024;
// AMD's cores (Zen 4 and 5) run AVX-512 at their usual clock: there the widest build runs at every size.

const KernelTable& kernels_default();
const KernelTable& kernels_avx2();    // falls back to kernels_default() where AVX2 is not compiled in
const KernelTable& kernels_avx512();  // likewise
// The table a call over `values` values runs: cpu_capability()'s, or on Intel AVX2's below avx512_min_values (one of
// the two above). An op picks it once from its input's size, so one input runs one build whatever the order of its
// passes.
const KernelTable& cpu_kernels(int64_t values, int64_t avx512_min_values);

// The penalized objective over the contiguous 1-D x and its mean weight, with t_i = (x_i - shift) / lam:
//   value = mean_i lam psi*(t_i) + shift,  mean_weight = mean_i psi*'(t_i),
// from one Loss pass (dro_loss, and the robust objective at its eta), each sample's share formed as divergences.h's
// penalized_value does. That form is inf - inf where some t is +inf (a loss of +inf): a NaN value takes a second
// pass summing psi*(t) itself, +inf for a loss of +inf and NaN for NaN. Finite losses never pay for it.
// Where float32 intermediates overflow though the result need not (t = (x - shift) / lam, t^2 or the sums, at a
// tiny lam), a half/bfloat16/float32 x is summed again in float64: the value and the mean weight are then the
// float64 ones, which the caller rounds to its dtype (inf only where the exact result overflows it). So is every x
// where float32 cannot form t at all (float32_forms_t), or would move it rounding the shift (shift_rounding_moves_t).
struct PenalizedMean {
  double value;
  double mean_weight;
};

// How far, in units of t, rounding the shift to float32 may move t = (x - shift) / lam before a float32 x is summed
// in float64 instead: the float32 kernels subtract the shift in float32, and a shift that float32 does not hold (G eta
// of a float64 eta, or a scale that rounds G eta) moved every t by up to ulp(shift) / (2 lam), which is anything at a
// lam below the float32 spacing of the shift (float32 losses 1e6 + 1, eta 1e6 + 0.96 in float64, lam 1e-3: t 62.5
// where it is 40). At the usual scales (a float32 eta, or |G eta| / lam below about 4000) it stays under this limit
// and the float32 kernels run.
constexpr double kMaxShiftRoundingInT = 1.0 / 4096;

// Whether the float32 kernels would move t by more than kMaxShiftRoundingInT rounding the shift (never for float64 x).
inline bool shift_rounding_moves_t(const at::Tensor& x, double shift, double lam) {
  if (x.scalar_type() == at::kDouble) return false;
  const double rest = shift - static_cast<double>(static_cast<float>(shift));
  return std::isfinite(rest) && std::abs(rest) > kMaxShiftRoundingInT * lam;
}

// Whether the loss ops over x run the float64 kernels on a copy: where float32 cannot form t (runs_on_float64_copy,
// CUDA too), or where rounding the shift to float32 would move it (shift_rounding_moves_t: the CPU, which reads the
// shift on the host; CUDA reads it on the device and rounds it).
inline bool loss_runs_on_float64_copy(const at::Tensor& x, double shift, double lam) {
  return runs_on_float64_copy(x, lam) || shift_rounding_moves_t(x, shift, lam);
}

inline PenalizedMean penalized_mean(const at::Tensor& x, const DivergenceSpec& spec, double shift, double lam,
                                    int64_t avx512_min_values) {
  if (loss_runs_on_float64_copy(x, shift, lam)) {
    return penalized_mean(x.to(at::kDouble), spec, shift, lam, avx512_min_values);
  }
  const Affine affine{shift, 1.0 / lam};
  const KernelTable& kernels = cpu_kernels(x.numel(), avx512_min_values);
  const auto sums = kernels.reduce(x, spec, affine, Sums::Loss);
  const double n = static_cast<double>(x.numel());
  double value = shift + (sums[0] / n + lam * (sums[1] / n));
  const double mean_weight = 1.0 + sums[2] / n;
  if (!(std::isfinite(value) && std::isfinite(mean_weight)) && x.scalar_type() != at::kDouble) {
    return penalized_mean(x.to(at::kDouble), spec, shift, lam, avx512_min_values);
  }
  if (std::isnan(value)) value = shift + lam * (kernels.reduce(x, spec, affine, Sums::Value)[0] / n);
  return {value, mean_weight};
}

// The largest |t| whose float32 terms spec's divergence forms without an intermediate overflow, past which the map
// below is redone in float64: float32's largest (t itself), but for cressie_read, whose u = 1 + (k - 1) t overflows
// float32 once |t| passes FLT_MAX / (k - 1) while its weight u^(1/(k-1)) stays small (k = 100, t = 1e37: u = 1e39,
// a weight of 2.5, which came out inf), and -1 (every map redone) where k - 1 itself is past float32's range.
inline double float32_t_limit(const DivergenceSpec& spec) {
  constexpr double kFloatMax = std::numeric_limits<float>::max();
  const double k_minus_1 = spec.k - 1.0;
  if (spec.kind != Divergence::CressieRead || !(k_minus_1 > 1.0)) return kFloatMax;
  return k_minus_1 > kFloatMax ? -1.0 : kFloatMax / k_minus_1;
}

// out_i = multiplier * psi*^(order)((x_i - shift) / lam) over the contiguous x into out (x's shape, contiguous),
// whose dtype may be narrower than x's: x a float64 copy of out's losses, whose terms go through a float64 buffer.
// Where a float32 t overflowed (t = (x - shift) / lam past float32's range at a tiny lam, though the term need not
// be: cressie_read's weight grows as t^(1/(k-1))), or passed float32_t_limit, the map is redone on a float64 copy of
// x, as penalized_mean redoes its sums.
inline void map_derivative_over(const at::Tensor& x, at::Tensor& out, const DivergenceSpec& spec, double shift,
                                double lam, double multiplier, int64_t order, int64_t avx512_min_values) {
  const KernelTable& kernels = cpu_kernels(x.numel(), avx512_min_values);
  if (out.scalar_type() == x.scalar_type()) {
    if (kernels.map_derivative(x, out, spec, Affine{shift, 1.0 / lam}, multiplier, order)) {
      map_derivative_over(x.to(at::kDouble), out, spec, shift, lam, multiplier, order, avx512_min_values);
    }
    return;
  }
  at::Tensor wide_out = at::empty_like(x);
  kernels.map_derivative(x, wide_out, spec, Affine{shift, 1.0 / lam}, multiplier, order);  // x is float64 here
  out.copy_(wide_out);
}

// The same into out of x's dtype, through a float64 copy of x where float32 cannot form t (float32_forms_t) or would
// move it rounding the shift (shift_rounding_moves_t).
inline void map_derivative(const at::Tensor& x, at::Tensor& out, const DivergenceSpec& spec, double shift, double lam,
                           double multiplier, int64_t order, int64_t avx512_min_values) {
  const at::Tensor& source = loss_runs_on_float64_copy(x, shift, lam) ? x.to(at::kDouble) : x;
  map_derivative_over(source, out, spec, shift, lam, multiplier, order, avx512_min_values);
}

}  // namespace dro_ext::cpu
