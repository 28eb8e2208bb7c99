// CUDA kernels of the fused DRO cross-entropy ops (schemas in csrc/cross_entropy.cpp).
//
// One block per row: each thread keeps an online logsumexp (running max and rescaled sum of exponentials) over
// its strided share of the row, and CUB's BlockReduce merges the threads' pairs in a fixed order. Thread 0 then
// forms the row's loss, t, w and value term (csrc/cross_entropy_terms.h, the same code as the CPU, in float64 as
// there), and the block writes the row's gradient when asked. The DRO sums over rows are a
// second, single-block pass with a fixed summation order: no float atomics, bitwise repeatable. eta, the upstream
// gradient and inv_count are read on the device (no .item(), no host sync), everything runs on the current stream,
// so the ops are graph-capturable.
// Targets out of range trip a device assertion, as PyTorch's own nll_loss does.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <climits>
#include <cmath>
#include <limits>
#include <type_traits>

#include "checks.h"
#include "cross_entropy_checks.h"
#include "cross_entropy_terms.h"
#include "cuda/common.cuh"
#include "cuda/divergence_dispatch.cuh"
#include "divergences.h"

namespace dro_ext::cuda_cross_entropy {
namespace {

// Threads per block of the row kernels (one block per row) and of the one-block reduction over the rows.
constexpr int kRowThreads = 256;
constexpr int kReduceThreads = 512;

// The type of each row's t, weight and value term and of their sums over the rows: float64, as on the CPU (a scalar
// per row beside the row's C logits). With it the CUDA ops have the CPU's range: t formed from G eta as given, where
// float32 would round G eta and move every t by up to ulp(G eta) / (2 lam), and t and psi*(t) beyond float32 at a
// tiny lam, which float32 would meet only row by row on the device, too late to redo the pass.
using term_t = double;

// The parameters of the DRO terms, before eta is known (it is read on the device).
struct TermArgs {
  double scale;  // G
  double lam;
  int64_t ignore_index;
  double label_smoothing;
};

// (running max, sum of exp(x - max)) of a set of numbers; merging two is associative up to rounding, and
// BlockReduce applies it in a fixed tree.
template <typename acc_t>
struct MaxSum {
  acc_t max;
  acc_t sum;
};

template <typename acc_t>
__device__ __forceinline__ MaxSum<acc_t> merge(const MaxSum<acc_t>& a, const MaxSum<acc_t>& b) {
  if (a.max != a.max || b.max != b.max) {  // NaN anywhere: the row's loss is NaN
    const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
    return {nan, nan};
  }
  if (a.max == -std::numeric_limits<acc_t>::infinity()) return b;
  if (b.max == -std::numeric_limits<acc_t>::infinity()) return a;
  const acc_t m = a.max > b.max ? a.max : b.max;
  return {m, a.sum * ::exp(a.max - m) + b.sum * ::exp(b.max - m)};
}

template <typename acc_t>
struct MergeOp {
  __device__ __forceinline__ MaxSum<acc_t> operator()(const MaxSum<acc_t>& a, const MaxSum<acc_t>& b) const {
    return merge(a, b);
  }
};

// The row's logsumexp (shift: its max; log_sum) and (when smoothing) its sum, in one pass over global memory; valid
// in thread 0.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void row_logsumexp(const scalar_t* row, int64_t num_classes, bool want_total,
                                              ShiftedLogSumExp<acc_t>& lse, acc_t& total) {
  MaxSum<acc_t> mine{-std::numeric_limits<acc_t>::infinity(), acc_t(0)};
  acc_t row_sum = 0;
  for (int64_t j = threadIdx.x; j < num_classes; j += kRowThreads) {
    const acc_t x = static_cast<acc_t>(row[j]);
    if (x > mine.max) {
      mine.sum = mine.sum * ::exp(mine.max - x) + acc_t(1);
      mine.max = x;
    } else if (x != -std::numeric_limits<acc_t>::infinity()) {
      // A NaN x makes the sum NaN. A -inf x (a masked logit) adds exp(-inf) = 0, so it is skipped: while this
      // thread has seen only -inf, x - max would be -inf - -inf = NaN and turn a finite row's loss into NaN.
      mine.sum += ::exp(x - mine.max);
    }
    row_sum += x;
  }
  if (mine.sum != mine.sum) mine.max = mine.sum;  // carry a NaN into the max, which merge() tests
  const MaxSum<acc_t> all = cuda::block_reduce<kRowThreads>(mine, MergeOp<acc_t>());
  if (want_total) total = cuda::block_reduce<kRowThreads>(row_sum, cuda::Sum());
  lse = {all.max, ::log(all.sum)};
}

// grad_j = c (p_j - eps / C), and at the target c (p_y - eps / C - (1 - eps)) from x_target read before the row was
// overwritten (grad may be the row itself); each through weighted_residual, p_j = shifted_softmax
// (cross_entropy_terms.h).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void write_row_gradient(const scalar_t* row, scalar_t* grad, int64_t num_classes,
                                                   int64_t target, acc_t x_target, ShiftedLogSumExp<acc_t> lse,
                                                   acc_t c, acc_t smoothing) {
  const acc_t uniform = smoothing / static_cast<acc_t>(num_classes);
  for (int64_t j = threadIdx.x; j < num_classes; j += kRowThreads) {
    grad[j] = static_cast<scalar_t>(weighted_residual(c, shifted_softmax(static_cast<acc_t>(row[j]), lse) - uniform));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    grad[target] = static_cast<scalar_t>(
        weighted_residual(c, shifted_softmax(x_target, lse) - uniform - (acc_t(1) - smoothing)));
  }
}

template <typename scalar_t>
__device__ __forceinline__ void zero_row(scalar_t* grad, int64_t num_classes) {
  for (int64_t j = threadIdx.x; j < num_classes; j += kRowThreads) grad[j] = scalar_t(0);
}

// Per row: lse_i ((shift, log_sum)), w_i (raw), value_term_i (0 on ignored rows); and, when grad != nullptr, the
// row's gradient inv_count * w_i * (softmax_i - q_i) (grad may alias logits). w_i and the value term are formed and
// kept in term_t, Div's type (cross_entropy_terms.h's row_terms): a raw w_i beyond float32 (chi2 at lam = 1e-39)
// may still give a w_i / n within it.
template <typename scalar_t, typename acc_t, typename Div>
__global__ void __launch_bounds__(kRowThreads)
row_forward_kernel(const scalar_t* logits, const int64_t* targets, int64_t num_classes, Div div, TermArgs args,
                   cuda::ScalarRef eta, cuda::ScalarRef inv_count, ShiftedLogSumExp<acc_t>* lse_out,
                   term_t* weight_out, term_t* value_out, scalar_t* grad) {
  const int64_t i = blockIdx.x;
  const scalar_t* row = logits + i * num_classes;
  const int64_t target = targets[i];
  __shared__ ShiftedLogSumExp<acc_t> shared_lse;
  __shared__ acc_t shared_c, shared_x_target;
  if (target == args.ignore_index) {
    if (threadIdx.x == 0) {
      if (lse_out) lse_out[i] = {0, 0};
      weight_out[i] = 0;
      value_out[i] = 0;
    }
    if (grad) zero_row(grad + i * num_classes, num_classes);
    return;
  }
  CUDA_KERNEL_ASSERT(target >= 0 && target < num_classes && "dro_ext: targets must be in [0, C) or ignore_index");
  const acc_t smoothing = static_cast<acc_t>(args.label_smoothing);
  const bool smoothed = args.label_smoothing != 0.0;
  // Read before any thread may overwrite the row with its gradient.
  if (threadIdx.x == 0) shared_x_target = static_cast<acc_t>(row[target]);
  ShiftedLogSumExp<acc_t> lse{0, 0};
  acc_t total = 0;
  row_logsumexp<scalar_t, acc_t>(row, num_classes, smoothed, lse, total);
  if (threadIdx.x == 0) {
    const acc_t loss =
        cross_entropy_loss(lse, shared_x_target, total / static_cast<acc_t>(num_classes), smoothing);
    const DROTermParams<term_t> params{static_cast<term_t>(args.scale * eta.read()),
                                       static_cast<term_t>(1.0 / args.lam), static_cast<term_t>(args.lam)};
    const RowTerms<term_t> terms = row_terms(div, loss, params);
    if (lse_out) lse_out[i] = lse;
    weight_out[i] = terms.weight;
    value_out[i] = terms.value;
    shared_lse = lse;
    shared_c = static_cast<acc_t>(static_cast<term_t>(inv_count.read()) * terms.weight);
  }
  if (grad == nullptr) return;
  __syncthreads();
  write_row_gradient<scalar_t, acc_t>(row, grad + i * num_classes, num_classes, target, shared_x_target, shared_lse,
                                      shared_c, smoothing);
}

// One block: the DRO sums over the rows in a fixed order, in term_t. Each thread sums rows tid, tid + T, ... in order
// and BlockReduce combines the threads in a fixed tree. Then either
//  - (finalize) value = sum value_term / n (0 if n == 0), mean_weight = sum w / n (1 if n == 0), and
//    scaled_weights_i = w_i / n (scaled_weights may be the raw weights themselves where term_t is acc_t); or
//  - (sums) sums[0] = sum value_term, sums[1] = sum w, for the chunk op, in term_t (float64: the chunks' sums are
//    added up before they are divided by the kept count, and float32 ones overflow where the mean does not).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kReduceThreads)
reduce_rows_kernel(const int64_t* targets, int64_t rows, int64_t ignore_index, const term_t* value_terms,
                   const term_t* weights, acc_t* scaled_weights, acc_t* value_out, acc_t* mean_weight_out,
                   term_t* sums_out) {
  __shared__ term_t shared_inv_count;
  term_t value_sum = 0, weight_sum = 0;
  int64_t kept = 0;
  for (int64_t i = threadIdx.x; i < rows; i += kReduceThreads) {
    if (targets[i] == ignore_index) continue;
    value_sum += value_terms[i];
    weight_sum += weights[i];
    ++kept;
  }
  const term_t total_value = cuda::block_reduce<kReduceThreads>(value_sum, cuda::Sum());
  const term_t total_weight = cuda::block_reduce<kReduceThreads>(weight_sum, cuda::Sum());
  const int64_t total_kept = cuda::block_reduce<kReduceThreads>(kept, cuda::Sum());
  if (sums_out != nullptr) {
    if (threadIdx.x == 0) {
      sums_out[0] = total_value;
      sums_out[1] = total_weight;
    }
    return;
  }
  if (threadIdx.x == 0) {
    const term_t inv = total_kept > 0 ? term_t(1) / static_cast<term_t>(total_kept) : term_t(0);
    *value_out = static_cast<acc_t>(total_kept > 0 ? total_value * inv : term_t(0));
    *mean_weight_out = static_cast<acc_t>(total_kept > 0 ? total_weight * inv : term_t(1));
    shared_inv_count = inv;
  }
  __syncthreads();
  const term_t inv = shared_inv_count;
  for (int64_t i = threadIdx.x; i < rows; i += kReduceThreads) scaled_weights[i] = static_cast<acc_t>(weights[i] * inv);
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kRowThreads)
row_backward_kernel(const scalar_t* logits, const int64_t* targets, int64_t num_classes,
                    const ShiftedLogSumExp<acc_t>* lse,
                    const acc_t* row_weight, cuda::ScalarRef grad_value, int64_t ignore_index, double label_smoothing,
                    scalar_t* grad) {
  const int64_t i = blockIdx.x;
  const int64_t target = targets[i];
  scalar_t* out = grad + i * num_classes;
  if (target == ignore_index) {
    zero_row(out, num_classes);
    return;
  }
  CUDA_KERNEL_ASSERT(target >= 0 && target < num_classes && "dro_ext: targets must be in [0, C) or ignore_index");
  const scalar_t* row = logits + i * num_classes;
  const acc_t c = static_cast<acc_t>(grad_value.read()) * row_weight[i];
  const acc_t x_target = static_cast<acc_t>(row[target]);
  __syncthreads();  // every thread has read the target logit before any overwrites it (out may be the logits)
  write_row_gradient<scalar_t, acc_t>(row, out, num_classes, target, x_target, lse[i], c,
                                      static_cast<acc_t>(label_smoothing));
}

// The row kernels take one block per row, and a grid has at most 2^31 - 1 blocks.
void check_row_count(int64_t rows) {
  TORCH_CHECK(rows <= INT_MAX, "dro_cross_entropy: at most 2^31 - 1 rows (logits.size(0)) on CUDA, got ", rows);
}

// Launches the row pass and the row reduction. finalize: value/mean_weight outputs and scaled_weights = w_i / n;
// otherwise (scaled_weights null) the chunk's two sums into sums_out.
void launch_forward(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& eta,
                    const at::Tensor* inv_count, const DivergenceSpec& spec, const TermArgs& args, at::Tensor* lse,
                    at::Tensor* scaled_weights, bool write_grad, at::Tensor* value, at::Tensor* mean_weight,
                    at::Tensor* sums) {
  const int64_t rows = logits.size(0), num_classes = logits.size(1);
  check_row_count(rows);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dro_cross_entropy_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto term_options = logits.options().dtype(c10::CppTypeToScalarType<term_t>::value);
    // The raw weights are scaled in place where the output has their type.
    at::Tensor raw_weights = scaled_weights != nullptr && std::is_same_v<term_t, acc_t>
                                 ? *scaled_weights : at::empty({rows}, term_options);
    at::Tensor value_terms = at::empty({rows}, term_options);
    if (rows > 0) {
      cuda::launch_for_divergence<term_t>(spec, [&](auto div) {
        row_forward_kernel<scalar_t, acc_t, decltype(div)><<<rows, kRowThreads, 0, stream>>>(
            logits.const_data_ptr<scalar_t>(), targets.const_data_ptr<int64_t>(), num_classes, div, args,
            cuda::scalar_ref(eta), inv_count ? cuda::scalar_ref(*inv_count) : cuda::scalar_ref(eta),
            lse ? reinterpret_cast<ShiftedLogSumExp<acc_t>*>(lse->mutable_data_ptr<acc_t>()) : nullptr,
            raw_weights.mutable_data_ptr<term_t>(), value_terms.mutable_data_ptr<term_t>(),
            write_grad ? logits.data_ptr<scalar_t>() : nullptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    reduce_rows_kernel<scalar_t, acc_t><<<1, kReduceThreads, 0, stream>>>(
        targets.const_data_ptr<int64_t>(), rows, args.ignore_index, value_terms.const_data_ptr<term_t>(),
        raw_weights.const_data_ptr<term_t>(), scaled_weights ? scaled_weights->mutable_data_ptr<acc_t>() : nullptr,
        value ? value->mutable_data_ptr<acc_t>() : nullptr,
        mean_weight ? mean_weight->mutable_data_ptr<acc_t>() : nullptr,
        sums ? sums->mutable_data_ptr<term_t>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dro_cross_entropy_cuda(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& eta, double lam,
    c10::string_view divergence, std::optional<double> alpha, std::optional<double> k, double scale,
    int64_t ignore_index, double label_smoothing) {
  const DivergenceSpec spec =
      check_cross_entropy_forward_args(logits, targets, eta, lam, divergence, alpha, k, scale, label_smoothing);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor x = logits.contiguous(), y = targets.contiguous();
  const auto acc_options = logits.options().dtype(accumulate_type(logits.scalar_type()));
  const int64_t rows = x.size(0);
  at::Tensor lse = at::empty({rows, 2}, acc_options), row_weight = at::empty({rows}, acc_options);
  at::Tensor value = at::empty({}, acc_options), mean_weight = at::empty({}, acc_options);
  launch_forward(x, y, eta, nullptr, spec, TermArgs{scale, lam, ignore_index, label_smoothing}, &lse, &row_weight,
                 false, &value, &mean_weight, nullptr);
  return {value, mean_weight, lse, row_weight};
}

at::Tensor dro_cross_entropy_chunk_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& eta,
                                        const at::Tensor& inv_count, double lam, c10::string_view divergence,
                                        std::optional<double> alpha, std::optional<double> k, double scale,
                                        int64_t ignore_index, double label_smoothing, bool compute_grad) {
  const DivergenceSpec spec = check_cross_entropy_chunk_args(logits, targets, eta, inv_count, lam, divergence, alpha,
                                                             k, scale, label_smoothing);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor y = targets.contiguous();
  at::Tensor sums = at::empty({2}, logits.options().dtype(c10::CppTypeToScalarType<term_t>::value));
  launch_forward(logits, y, eta, &inv_count, spec, TermArgs{scale, lam, ignore_index, label_smoothing}, nullptr,
                 nullptr, compute_grad, nullptr, nullptr, &sums);
  return sums;
}

// grad_logits_i = grad * row_weight_i * (softmax_i - q_i) into out, which may be logits itself (each row's target
// logit is read before its row is written).
void launch_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                     const at::Tensor& lse, const at::Tensor& row_weight, int64_t ignore_index,
                     double label_smoothing, at::Tensor& out) {
  const int64_t rows = logits.size(0), num_classes = logits.size(1);
  if (rows == 0) return;
  check_row_count(rows);
  const at::Tensor y = targets.contiguous(), lse_c = lse.contiguous(), weight_c = row_weight.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dro_cross_entropy_backward_cuda",
                                  [&] {
    using acc_t = at::opmath_type<scalar_t>;
    row_backward_kernel<scalar_t, acc_t><<<rows, kRowThreads, 0, stream>>>(
        logits.const_data_ptr<scalar_t>(), y.const_data_ptr<int64_t>(), num_classes,
        reinterpret_cast<const ShiftedLogSumExp<acc_t>*>(lse_c.const_data_ptr<acc_t>()),
        weight_c.const_data_ptr<acc_t>(), cuda::scalar_ref(grad), ignore_index, label_smoothing,
        out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor dro_cross_entropy_backward_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                                           const at::Tensor& lse, const at::Tensor& row_weight, int64_t ignore_index,
                                           double label_smoothing) {
  check_cross_entropy_backward_args(grad, logits, targets, lse, row_weight, label_smoothing);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor x = logits.contiguous();
  at::Tensor grad_logits = at::empty(x.sizes(), x.options());
  launch_backward(grad, x, targets, lse, row_weight, ignore_index, label_smoothing, grad_logits);
  return grad_logits;
}

void dro_cross_entropy_backward_inplace_cuda(const at::Tensor& grad, at::Tensor& logits, const at::Tensor& targets,
                                             const at::Tensor& lse, const at::Tensor& row_weight, int64_t ignore_index,
                                             double label_smoothing) {
  check_cross_entropy_backward_inplace_args(grad, logits, targets, lse, row_weight, label_smoothing);
  const c10::cuda::CUDAGuard guard(logits.device());
  launch_backward(grad, logits, targets, lse, row_weight, ignore_index, label_smoothing, logits);
}

}  // namespace

TORCH_LIBRARY_IMPL(dro_ext, CUDA, m) {
  m.impl("dro_cross_entropy", &dro_cross_entropy_cuda);
  m.impl("dro_cross_entropy_backward", &dro_cross_entropy_backward_cuda);
  m.impl("dro_cross_entropy_backward_", &dro_cross_entropy_backward_inplace_cuda);
  m.impl("dro_cross_entropy_chunk_", &dro_cross_entropy_chunk_cuda);
}

}  // namespace dro_ext::cuda_cross_entropy
