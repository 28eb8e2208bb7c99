// The fused DRO cross-entropy on the CPU, written once over at::vec::Vectorized and compiled once per SIMD
// capability. The including file (through csrc/cpu/kernel_tables.h) sets the capability first.
#pragma once

#include "cpu/simd_capability.h"  // first: it sets the capability the ATen headers below compile for

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cross_entropy_kernels.h"
#include "cpu/vector_io.h"
#include "cpu/vectorized_math.h"
#include "cross_entropy_terms.h"

namespace dro_ext::cpu {
namespace {

using at::vec::Vectorized;

// Rows are reduced in groups of this many, whatever the thread count, so that the sums are bitwise
// repeatable; a row is read in blocks of kRowBlock elements, which stay in L1 between the block's max and
// its sum of exponentials (one pass over memory, the online logsumexp at block granularity).
constexpr int64_t kRowsPerGroup = 16;
constexpr int64_t kRowBlock = 2048;
// Work per task, in logits, below which a group is not split off to another thread.
constexpr int64_t kGrainElements = 1 << 16;

// The largest lane, NaN if any lane is NaN.
template <typename acc_t>
inline acc_t lane_max(const Vectorized<acc_t>& v) {
  alignas(64) acc_t buf[Vectorized<acc_t>::size()];
  v.store(buf);
  acc_t m = buf[0];
  for (int64_t i = 1; i < Vectorized<acc_t>::size(); ++i) m = (buf[i] > m || std::isnan(buf[i])) ? buf[i] : m;
  return m;
}

template <typename acc_t>
struct RowStats {
  ShiftedLogSumExp<acc_t> lse;  // the row's logsumexp, as its max and the log of the sum below it
  acc_t total;                  // sum of the row (only when label smoothing needs its mean)
};

// The row's logsumexp (shift: its max; log_sum) in one pass over memory: per block, its max (vector maximum, which
// keeps NaN), then the running sum of exponentials rescaled to the new max once per block, then the block's
// exponentials.
template <typename acc_t, typename scalar_t>
RowStats<acc_t> row_stats(const scalar_t* x, int64_t num_classes, bool want_total) {
  using V = Vectorized<acc_t>;
  using M = Math<V>;
  constexpr int64_t W = V::size();
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  acc_t running_max = neg_inf, total = 0;
  // The sum below the max: each block's lanes are added to it in float64, and its log taken there, so that a
  // confident row's sum, 1 plus its small probabilities, is not rounded at 1 (to steps of 1.2e-7) once per block and
  // lane. Within a block the lane that holds the 1 still rounds its later terms: the loss of a confident row over
  // 2048 to 32000 classes came out within 12 to 17 of those steps of float64's (F.cross_entropy's float32 sum: 30 to
  // 420). A compensated sum in the lanes (CompensatedSum, as the column kernel's) took that to half a step, but cost
  // this pass 15-20% (a 2-core AMD EPYC with AVX2: 21-23 ms against 25-28 ms for 2048 x 32000 float32 logits).
  double running_sum = 0;
  for (int64_t block = 0; block < num_classes; block += kRowBlock) {
    const int64_t n = std::min(kRowBlock, num_classes - block);
    const scalar_t* p = x + block;
    V vmax(neg_inf), vmax2(neg_inf);
    int64_t j = 0;
    for (; j + 2 * W <= n; j += 2 * W) {
      vmax = at::vec::maximum(vmax, load<acc_t>(p + j, W));
      vmax2 = at::vec::maximum(vmax2, load<acc_t>(p + j + W, W));
    }
    for (; j + W <= n; j += W) vmax = at::vec::maximum(vmax, load<acc_t>(p + j, W));
    if (j < n) vmax = at::vec::maximum(vmax, V::set(V(neg_inf), load<acc_t>(p + j, n - j), n - j));
    const acc_t block_max = lane_max(at::vec::maximum(vmax, vmax2));
    const acc_t new_max = (block_max > running_max || std::isnan(block_max)) ? block_max : running_max;
    if (new_max == neg_inf) {
      // Every logit so far is -inf (masked): they add exp(-inf) = 0 to the sum, and the row's sum is -inf, while
      // x - max would be -inf - -inf = NaN and turn a row with a later finite logit NaN.
      if (want_total) total = neg_inf;
      continue;
    }
    running_sum *= std::exp(static_cast<double>(running_max) - static_cast<double>(new_max));  // 0 * 0 first
    running_max = new_max;
    const V shift(new_max), zero(acc_t(0));
    V sum = zero, sum2 = zero, row = zero, row2 = zero;
    j = 0;
    for (; j + 2 * W <= n; j += 2 * W) {
      const V a = load<acc_t>(p + j, W), b = load<acc_t>(p + j + W, W);
      sum = sum + M::exp(a - shift);
      sum2 = sum2 + M::exp(b - shift);
      if (want_total) {
        row = row + a;
        row2 = row2 + b;
      }
    }
    for (; j + W <= n; j += W) {
      const V a = load<acc_t>(p + j, W);
      sum = sum + M::exp(a - shift);
      if (want_total) row = row + a;
    }
    if (j < n) {
      const V a = load<acc_t>(p + j, n - j);  // zero beyond the row
      sum = sum + V::set(zero, M::exp(a - shift), n - j);
      if (want_total) row = row + a;
    }
    running_sum += wide_horizontal_sum(sum) + wide_horizontal_sum(sum2);
    if (want_total) total += horizontal_sum(row + row2);
  }
  return {{running_max, static_cast<acc_t>(std::log(running_sum))}, total};
}

// out_j = c (p_j - eps / C), then out_y = c (p_y - eps / C - (1 - eps)) from the x_y read before the row was
// overwritten (out may be x itself); each through weighted_residual (cross_entropy_terms.h), p_j = softmax_j
// formed as shifted_softmax does.
template <typename acc_t, typename scalar_t>
void write_row_gradient(const scalar_t* x, scalar_t* out, int64_t num_classes, int64_t target,
                        ShiftedLogSumExp<acc_t> lse, acc_t c, acc_t smoothing) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  const acc_t x_target = static_cast<acc_t>(x[target]);
  const acc_t uniform = smoothing / static_cast<acc_t>(num_classes);
  const ShiftedLogSumExp<V> vlse{V(lse.shift), V(lse.log_sum)};
  const V vc(c), vuniform(uniform);
  const auto term = [&](const V& xs) { return weighted_residual(vc, shifted_softmax(xs, vlse) - vuniform); };
  int64_t j = 0;
  for (; j + W <= num_classes; j += W) store<acc_t>(out + j, term(load<acc_t>(x + j, W)), W);
  if (j < num_classes) {
    const int64_t n = num_classes - j;
    store<acc_t>(out + j, term(load<acc_t>(x + j, n)), n);
  }
  out[target] = static_cast<scalar_t>(
      weighted_residual(c, shifted_softmax(x_target, lse) - uniform - (acc_t(1) - smoothing)));
}

template <typename scalar_t>
inline void zero_row(scalar_t* out, int64_t num_classes) {
  std::fill(out, out + num_classes, scalar_t(0));
}

inline int64_t group_grain(int64_t num_classes) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, kRowsPerGroup * num_classes));
}

template <typename scalar_t>
std::array<double, 2> forward_typed(const at::Tensor& logits, const at::Tensor& targets, const CrossEntropyConfig& cfg,
                                    at::Tensor* lse_out, at::Tensor* weight_out, at::Tensor* grad_out,
                                    double inv_count) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = logits.size(0), num_classes = logits.size(1);
  const scalar_t* x = logits.const_data_ptr<scalar_t>();
  const int64_t* y = targets.const_data_ptr<int64_t>();
  auto* lse = lse_out ? reinterpret_cast<ShiftedLogSumExp<acc_t>*>(lse_out->mutable_data_ptr<acc_t>()) : nullptr;
  acc_t* row_weight = weight_out ? weight_out->mutable_data_ptr<acc_t>() : nullptr;
  // grad may alias x: rows are disjoint between tasks, and a row is read before it is written.
  scalar_t* grad = grad_out ? grad_out->data_ptr<scalar_t>() : nullptr;
  const acc_t smoothing = static_cast<acc_t>(cfg.label_smoothing);
  const bool smoothed = cfg.label_smoothing != 0.0;
  // The DRO terms of every row and their sums in float64 (cross_entropy_terms.h's row_terms): a scalar per row beside
  // the row's C logits, and the range of the loss ops, which redo a float32 pass in float64 where it overflows.
  const DROTermParams<double> params{cfg.g_eta, 1.0 / cfg.lam, cfg.lam};
  const int64_t groups = (rows + kRowsPerGroup - 1) / kRowsPerGroup;
  std::vector<double> group_value(groups), group_weight(groups);
  visit_divergence<double>(cfg.spec, [&](const auto& div) {
    at::parallel_for(0, groups, group_grain(num_classes), [&](int64_t group_begin, int64_t group_end) {
      for (int64_t g = group_begin; g < group_end; ++g) {
        double value_sum = 0, weight_sum = 0;
        for (int64_t i = g * kRowsPerGroup; i < std::min(rows, (g + 1) * kRowsPerGroup); ++i) {
          const scalar_t* row = x + i * num_classes;
          const int64_t target = y[i];
          if (target == cfg.ignore_index) {
            if (lse) lse[i] = {0, 0};
            if (row_weight) row_weight[i] = 0;
            if (grad) zero_row(grad + i * num_classes, num_classes);
            continue;
          }
          const RowStats<acc_t> stats = row_stats<acc_t>(row, num_classes, smoothed);
          const acc_t loss = cross_entropy_loss(stats.lse, static_cast<acc_t>(row[target]),
                                                stats.total / static_cast<acc_t>(num_classes), smoothing);
          const RowTerms<double> terms = row_terms(div, loss, params);
          const acc_t scaled_weight = static_cast<acc_t>(inv_count * terms.weight);
          value_sum += terms.value;
          weight_sum += terms.weight;
          if (lse) lse[i] = stats.lse;
          if (row_weight) row_weight[i] = scaled_weight;
          if (grad) write_row_gradient<acc_t>(row, grad + i * num_classes, num_classes, target, stats.lse,
                                              scaled_weight, smoothing);
        }
        group_value[g] = value_sum;
        group_weight[g] = weight_sum;
      }
    });
  });
  double value = 0, weight = 0;
  for (int64_t g = 0; g < groups; ++g) {
    value += group_value[g];
    weight += group_weight[g];
  }
  return {value, weight};
}

template <typename scalar_t>
void backward_typed(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse_in,
                    const at::Tensor& weight_in, at::Tensor& grad_out, int64_t ignore_index, double label_smoothing,
                    double grad_value) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = logits.size(0), num_classes = logits.size(1);
  const scalar_t* x = logits.const_data_ptr<scalar_t>();
  const int64_t* y = targets.const_data_ptr<int64_t>();
  const auto* lse = reinterpret_cast<const ShiftedLogSumExp<acc_t>*>(lse_in.const_data_ptr<acc_t>());
  const acc_t* row_weight = weight_in.const_data_ptr<acc_t>();
  scalar_t* grad = grad_out.mutable_data_ptr<scalar_t>();
  const acc_t smoothing = static_cast<acc_t>(label_smoothing), g = static_cast<acc_t>(grad_value);
  at::parallel_for(0, rows, group_grain(num_classes) * kRowsPerGroup, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (y[i] == ignore_index) {
        zero_row(grad + i * num_classes, num_classes);
      } else {
        write_row_gradient<acc_t>(x + i * num_classes, grad + i * num_classes, num_classes, y[i], lse[i],
                                  g * row_weight[i], smoothing);
      }
    }
  });
}

// The logsumexp of every column of a contiguous (R, C) matrix, as (shift, log_sum) pairs (cross_entropy_terms.h):
// the per-row logsumexp of logits formed transposed
// (a chunk's logits as weight @ hidden.T, which the benchmark machine's BLAS forms faster than hidden @ weight.T; see
// dro_ext/cross_entropy_groups.py). Columns are taken kColumnVectors vectors at a time, so that each row of a slab
// is read as whole cache lines, and rows kColumnSlab at a time, which stay in L1 between the slab's max and its
// exponentials: one pass over memory, the online logsumexp at slab granularity, per lane. Each column is summed
// by one thread in row order, so the result does not depend on the thread count. A lane sums a whole column, so
// its sum is compensated (CompensatedSum) and its log taken in float64: once a confident row's target term exp(0) = 1
// is in a plain float32 sum, every later term below half its rounding step (6e-8) is dropped, which for a 32000-class
// head was most of 1 - p_y and so most of a small loss.
constexpr int64_t kColumnVectors = 4;
constexpr int64_t kColumnSlab = 64;

template <typename scalar_t>
void logsumexp_columns_typed(const at::Tensor& matrix, at::Tensor& out_lse) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  using M = Math<V>;
  constexpr int64_t W = V::size(), kBlockColumns = kColumnVectors * W;
  const int64_t rows = matrix.size(0), cols = matrix.size(1);
  const scalar_t* x = matrix.const_data_ptr<scalar_t>();
  auto* lse = reinterpret_cast<ShiftedLogSumExp<acc_t>*>(out_lse.mutable_data_ptr<acc_t>());
  const V zero(acc_t(0)), neg_inf(-std::numeric_limits<acc_t>::infinity());
  at::parallel_for(0, (cols + kBlockColumns - 1) / kBlockColumns, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * kBlockColumns;
      const int64_t vectors = (std::min(kBlockColumns, cols - first) + W - 1) / W;
      int64_t lanes[kColumnVectors];
      V running_max[kColumnVectors], shift[kColumnVectors];
      CompensatedSum<acc_t> sum[kColumnVectors];
      for (int64_t k = 0; k < vectors; ++k) {
        lanes[k] = std::min(W, cols - first - k * W);
        running_max[k] = neg_inf;
        shift[k] = zero;
      }
      for (int64_t slab = 0; slab < rows; slab += kColumnSlab) {
        const int64_t slab_end = std::min(rows, slab + kColumnSlab);
        V slab_max[kColumnVectors];
        for (int64_t k = 0; k < vectors; ++k) slab_max[k] = neg_inf;
        for (int64_t r = slab; r < slab_end; ++r) {
          const scalar_t* row = x + r * cols + first;
          for (int64_t k = 0; k < vectors; ++k) {
            slab_max[k] = at::vec::maximum(slab_max[k], load<acc_t>(row + k * W, lanes[k]));  // keeps NaN
          }
        }
        for (int64_t k = 0; k < vectors; ++k) {
          running_max[k] = at::vec::maximum(running_max[k], slab_max[k]);
          // Exponentials are taken relative to the max, or to 0 where the max is -inf: a column of -inf then sums
          // to 0 (lse -inf), without -inf - -inf. A column with +inf comes out NaN (inf - inf), as F.cross_entropy
          // gives its row. The sum so far is rescaled to the new shift; the factor is capped at 1, which is only
          // reached from an empty sum (first slab) or an infinite max.
          const V new_shift = V::blendv(running_max[k], zero, running_max[k] == neg_inf);
          sum[k].scale(M::exp(at::vec::minimum(shift[k] - new_shift, zero)));
          shift[k] = new_shift;
        }
        for (int64_t r = slab; r < slab_end; ++r) {
          const scalar_t* row = x + r * cols + first;
          // The terms lie in [0, 1], or are NaN (which the sum keeps): no inf for the compensation to turn NaN.
          for (int64_t k = 0; k < vectors; ++k) sum[k].add(M::exp(load<acc_t>(row + k * W, lanes[k]) - shift[k]));
        }
      }
      for (int64_t k = 0; k < vectors; ++k) {
        alignas(64) acc_t shifts[W];
        double sums[W];
        shift[k].store(shifts);
        sum[k].store_wide(sums);
        for (int64_t i = 0; i < lanes[k]; ++i) lse[first + k * W + i] = {shifts[i], static_cast<acc_t>(std::log(sums[i]))};
      }
    }
  });
}

std::array<double, 2> cross_entropy_forward_impl(const at::Tensor& logits, const at::Tensor& targets,
                                                 const CrossEntropyConfig& cfg, at::Tensor* lse,
                                                 at::Tensor* row_weight, at::Tensor* grad, double inv_count) {
  TORCH_INTERNAL_ASSERT(logits.dim() == 2 && logits.is_contiguous() && targets.is_contiguous());
  std::array<double, 2> out{};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dro_cross_entropy", [&] {
    out = forward_typed<scalar_t>(logits, targets, cfg, lse, row_weight, grad, inv_count);
  });
  return out;
}

void cross_entropy_backward_impl(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                 const at::Tensor& row_weight, at::Tensor& grad, int64_t ignore_index,
                                 double label_smoothing, double grad_value) {
  TORCH_INTERNAL_ASSERT(logits.dim() == 2 && logits.is_contiguous() && grad.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dro_cross_entropy_backward", [&] {
    backward_typed<scalar_t>(logits, targets, lse, row_weight, grad, ignore_index, label_smoothing, grad_value);
  });
}

void logsumexp_columns_impl(const at::Tensor& matrix, at::Tensor& lse) {
  TORCH_INTERNAL_ASSERT(matrix.dim() == 2 && matrix.is_contiguous() && lse.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, matrix.scalar_type(), "dro_ext_logsumexp_columns", [&] {
    logsumexp_columns_typed<scalar_t>(matrix, lse);
  });
}

}  // namespace
}  // namespace dro_ext::cpu
