// The CPU kernels' entry points, independent of the SIMD capability they were compiled for.
// kernels_impl.h is compiled once per capability (kernels_default.cpp, kernels_avx2.cpp, kernels_avx512.cpp);
// cpu_kernels() runs the active one (csrc/cpu/kernel_selection.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cmath>

#include "divergences.h"

namespace dro_ext::cpu {

// t_i = (x_i - shift) * inv_lam for every element of the contiguous 1-D tensor x.
struct Affine {
  double shift;
  double inv_lam;
};

// What one pass of reduce() sums, with t_i = (x_i - shift) * inv_lam.
enum class Sums {
  // {sum_i t_i, sum_i excess(t_i), sum_i excess_first(t_i)}: the loss value shift + lam (mean t + mean excess)
  // (= mean x + lam mean excess: lam t_i = x_i - shift to a rounding, so it keeps its precision as lam grows,
  // where shift + lam mean psi*(t) would not) and the mean weight 1 + mean excess_first.
  Loss,
  // {sum_i excess_first(t_i), sum_i second(t_i), 0}: the optimality condition of eta and its slope.
  Newton,
  // {sum_i first(t_i), 0, 0}: the total weight, relatively accurate when every weight is tiny.
  Weight,
  // {sum_i psi*(t_i), 0, 0}: the loss value shift + lam mean psi*(t) where Loss's form is inf - inf (some t_i
  // is infinite; divergences.h's penalized_value).
  Value,
};

struct KernelTable {
  // The sums of `sums` in one pass, accumulated in float for half/bfloat16/float and in double for double.
  // Deterministic: the partial sums are taken over fixed chunks and combined in order, whatever the number
  // of threads.
  std::array<double, 3> (*reduce)(const at::Tensor& x, const DivergenceSpec& spec, Affine affine, Sums sums);
  // out_i = multiplier * psi*^(order)(t_i); out has x's shape and dtype.
  void (*map_derivative)(
      const at::Tensor& x, at::Tensor& out, const DivergenceSpec& spec, Affine affine, double multiplier,
      int64_t order);
  // {min x, max x} in float64, both NaN if x holds a NaN. Exact; vectorized (the robust solvers' first pass).
  std::array<double, 2> (*min_max)(const at::Tensor& x);
  // {sum of the x_i > cut, number of them} (deterministic: fixed blocks summed in acc_t lanes, then in float64
  // in order).
  std::array<double, 2> (*sum_above)(const at::Tensor& x, double cut);
  const char* capability;
};

// The SIMD builds, in order: a processor that runs one runs the ones before it.
enum class Capability : int { Default = 0, AVX2 = 1, AVX512 = 2 };

// The build that runs: the widest the processor has (AVX2 with FMA and F16C; AVX-512 F/BW/VL/DQ), capped by
// ATEN_CPU_CAPABILITY (default, avx2) as ATen's own kernels are, unless a test switched it.
Capability cpu_capability();
bool use_avx2_kernels();  // cpu_capability() >= AVX2

const KernelTable& kernels_default();
const KernelTable& kernels_avx2();    // falls back to kernels_default() where AVX2 is not compiled in
const KernelTable& kernels_avx512();  // likewise
const KernelTable& cpu_kernels();

// The penalized objective over the contiguous 1-D x and its mean weight, with t_i = (x_i - shift) / lam:
//   value = mean_i lam psi*(t_i) + shift,  mean_weight = mean_i psi*'(t_i),
// from one Loss pass (dro_loss, and the robust objective at its eta). The value is formed as
// shift + lam (mean t + mean excess(t)) = mean x + lam mean (psi*(t) - t), which keeps its precision as lam grows,
// where lam mean psi*(t) + shift would cancel catastrophically (DESIGN.md, Numerics); lam t is x - shift to a
// rounding. That form is inf - inf where some t is infinite (a loss of +-inf): a NaN value takes a second pass
// summing psi*(t) itself, +inf for a loss of +inf, finite for -inf and NaN for NaN (divergences.h's
// penalized_value, which the CUDA kernel applies per element). Finite losses never pay for it.
struct PenalizedMean {
  double value;
  double mean_weight;
};
inline PenalizedMean penalized_mean(const at::Tensor& x, const DivergenceSpec& spec, double shift, double lam) {
  const Affine affine{shift, 1.0 / lam};
  const auto sums = cpu_kernels().reduce(x, spec, affine, Sums::Loss);
  const double n = static_cast<double>(x.numel());
  double value = shift + lam * (sums[0] / n + sums[1] / n);
  if (std::isnan(value)) value = shift + lam * (cpu_kernels().reduce(x, spec, affine, Sums::Value)[0] / n);
  return {value, 1.0 + sums[2] / n};
}

}  // namespace dro_ext::cpu
