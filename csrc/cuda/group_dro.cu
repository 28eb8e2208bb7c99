// CUDA kernel of group_dro_step_ (schema, CPU kernel and autograd in csrc/group_dro.cpp; the per-group rules in
// csrc/group_dro_step.h): one block of kThreads threads strides over the groups, thread j taking groups j,
// j + kThreads, ...; the sums over the groups (the scores' total, the log-sum-exp, the loss) are per-thread sums in
// that order and then CUB's block tree, a fixed order: deterministic. Every pass reads the state as it was; the last
// writes each group's new state from the thread that read it, so no group is read after it is written. As on the
// CPU, the loss of an updating step uses q_g = e_g / sum_h e_h, e_g = exp(x_g - shift), and log q_g = x_g minus the
// log-sum-exp.
//
// O(G) work in one launch, no host sync (CUDA-graph capturable), on the operands in place at any stride. G is the
// number of groups, at most a few thousand in the uses this serves, where one block is enough.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/common.cuh"
#include "group_dro_step.h"

namespace dro_ext::cuda {

namespace {

struct Max {
  __device__ __forceinline__ double operator()(double x, double y) const { return x > y ? x : y; }
};

// The block-wide maximum in every thread.
__device__ __forceinline__ double block_max_to_all(double v) {
  __shared__ double result;
  const double max = block_reduce(v, Max());
  if (threadIdx.x == 0) result = max;
  __syncthreads();
  const double out = result;
  __syncthreads();
  return out;
}

template <typename sums_t, typename state_t, typename out_t>
__global__ void __launch_bounds__(kThreads) group_dro_step_kernel(GroupDROStepOperands<sums_t, state_t, out_t> op,
                                                                  int64_t num_groups, GroupDROStepArgs args,
                                                                  out_t* __restrict__ loss,
                                                                  out_t* __restrict__ weights) {
  double part = 0.0;  // this thread's share of the loss sum_g q_g m_g
  const auto largest = [&](const auto& value) {
    double max = -INFINITY;
    for (int64_t g = threadIdx.x; g < num_groups; g += kThreads) max = Max()(value(op.inputs(g)), max);
    return block_max_to_all(max);
  };
  const auto blocks_the_step = [&](const GroupInputs& in) {
    const double m = in.mean();
    return op.blocks_the_step(in, m, in.score(m, args.stale), args) ? 1.0 : 0.0;
  };
  if (args.update && largest(blocks_the_step) == 0.0) {
    double score_mean = 0.0;
    if (args.normalize_loss) {
      double score_part = 0.0;
      for (int64_t g = threadIdx.x; g < num_groups; g += kThreads) {
        const GroupInputs in = op.inputs(g);
        score_part += in.score(in.mean(), args.stale) / static_cast<double>(num_groups);
      }
      score_mean = block_sum_to_all(score_part);
    }
    const auto step_score = [&](const GroupInputs& in) {
      return in.step_score(in.score(in.mean(), args.stale), score_mean, static_cast<double>(num_groups), args);
    };
    const double shift_by = shift_from_max(largest(step_score));
    const auto log_weight = [&](const GroupInputs& in) { return in.log_weight(step_score(in), shift_by, args); };
    const double max_x = largest(log_weight);
    const double shift = shift_from_max(max_x);
    double exp_part = 0.0;
    for (int64_t g = threadIdx.x; g < num_groups; g += kThreads) {
      exp_part += exp_or_zero(log_weight(op.inputs(g)) - shift, negligible_log_q<out_t>());
    }
    const double exp_total = block_sum_to_all(exp_part), log_exp_total = ::log(exp_total);
    for (int64_t g = threadIdx.x; g < num_groups; g += kThreads) {
      const GroupInputs in = op.inputs(g);
      const double m = in.mean(), x = log_weight(in);
      const double q = exp_or_zero(x - shift, negligible_log_q<out_t>()) / exp_total;
      const double log_q = normalized_log_q(x, shift, log_exp_total);
      op.write(g, in, m, log_q, args.ema_gamma);
      part += q != 0.0 ? q * m : dropped_group_term<out_t>(log_q, m);
      weights[g] = static_cast<out_t>(q * in.inverse_count());
    }
  } else {
    // The loss and its gradient weights under the current q (update=False, or a batch that takes no step).
    for (int64_t g = threadIdx.x; g < num_groups; g += kThreads) {
      const GroupInputs in = op.inputs(g);
      const double q = exp_or_zero(in.log_q, negligible_log_q<out_t>());
      part += q != 0.0 ? q * in.mean() : dropped_group_term<out_t>(in.log_q, in.mean());
      weights[g] = static_cast<out_t>(q * in.inverse_count());
    }
  }
  const double total = block_reduce(part, Sum());
  if (threadIdx.x == 0) *loss = static_cast<out_t>(total);
}

std::tuple<at::Tensor, at::Tensor> group_dro_step_cuda(const at::Tensor& sums, const at::Tensor& counts,
                                                       at::Tensor& log_q, at::Tensor& ema_loss, at::Tensor& last_loss,
                                                       at::Tensor& seen, const at::Tensor& active,
                                                       const at::Tensor& adjustment, double step_size,
                                                       double ema_gamma, bool stale, bool normalize_loss, bool update,
                                                       std::optional<at::ScalarType> out_dtype) {
  const c10::cuda::CUDAGuard guard(sums.device());
  GroupDROStepCall call = prepare_group_dro_step(sums, counts, log_q, ema_loss, last_loss, seen, active, adjustment,
                                                 step_size, ema_gamma, stale, normalize_loss, update, out_dtype);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  with_group_dro_step_operands(sums, counts, log_q, ema_loss, last_loss, seen, active, call, [&](const auto& op) {
    using out_t = typename std::decay_t<decltype(op)>::out_t;
    group_dro_step_kernel<<<1, kThreads, 0, stream>>>(op, sums.numel(), call.args,
                                                      call.loss.mutable_data_ptr<out_t>(),
                                                      call.weights.mutable_data_ptr<out_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {call.loss, call.weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(dro_ext, CUDA, m) {
  m.impl("group_dro_step_", &group_dro_step_cuda);
}

}  // namespace dro_ext::cuda
