// CUDA kernel of normalized_sgd_step_ (schema and CPU kernel: csrc/normalized_sgd.cpp). Same semantics as
// the CPU kernel, step for step:
//
//   grad_mul = (maximize ? -1 : 1) / grad_scale
//   m <- keep m + take g     keep, take = 0, grad_mul on a tensor's first step (steps == 0), else
//                            beta, (1 - beta) grad_mul; m is rounded to its dtype before it is squared
//   scale = lr / (||m|| + eps) if ||m|| > 0 else 0        (||m|| per group, or per tensor for norm="tensor")
//   p <- (1 - lr wd) p - scale m,   steps += 1
//
// and nothing at all (p, m, steps) changes when found_inf != 0.
//
// The whole parameter list is done in three kinds of launches on the current stream, with no host sync:
//   pass A   a multi-tensor launch (cuda/multi_tensor.cuh: one block per chunk of a tensor) of MomentumPass:
//            updates m and writes the chunk's sum of m^2 into partials[] (float32 sums per thread for
//            float32/half/bfloat16, float64 for float64; the block's sum in float64). A chunk whose float32 sum
//            may have under- or overflowed is summed again in float64, as the CPU kernel does, so tiny and huge
//            momenta still get their norm.
//   norm     one block per norm: sums its partials in a fixed order into scale (above), in float64.
//   pass B   a multi-tensor launch of UpdatePass: p <- decay p - scale m; the block of a tensor's first chunk
//            counts its step.
// lr, grad_scale and found_inf are read by the kernels where they live on the device; a CPU tensor (e.g. lr given
// as a Python float) is read on the host, which needs no sync (common.cuh's ScalarArg). No atomics anywhere: every
// sum has a fixed order, so the step is bitwise repeatable.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "cuda/multi_tensor.cuh"
#include "normalized_sgd_checks.h"
#include "normalized_sgd_operands.h"

namespace dro_ext::cuda {
namespace {

struct StepArgs {
  ScalarArg lr, grad_scale, found_inf;
  double momentum, eps, weight_decay;
  bool maximize;
  bool per_tensor_norm;  // norm="tensor": scales[] holds one scale per tensor of the call, else one
};

// The operands of a tensor in the multi-tensor launches (TensorChunks::data[operand][tensor]).
enum Operand { kParam, kGrad, kMomentum, kStep, kNumOperands };
using StepChunks = TensorChunks<kNumOperands>;

// m <- keep m + take g over one element; returns the stored m in the compute type.
template <typename scalar_t, typename opmath_t>
__device__ __forceinline__ opmath_t momentum_element(scalar_t& m, scalar_t g, opmath_t keep, opmath_t take) {
  const scalar_t stored = static_cast<scalar_t>(keep * static_cast<opmath_t>(m) + take * static_cast<opmath_t>(g));
  m = stored;
  return static_cast<opmath_t>(stored);
}

// Pass A over one chunk.
template <typename scalar_t>
struct MomentumPass {
  __device__ __forceinline__ void operator()(const StepChunks& list, const ChunkOfBlock& chunk, const StepArgs& args,
                                             double* partials) const {
    using opmath_t = at::opmath_type<scalar_t>;
    if (args.found_inf.read() != 0.0) return;  // the whole step is skipped
    const int t = chunk.tensor;
    const scalar_t* __restrict__ g = static_cast<const scalar_t*>(list.data[kGrad][t]) + chunk.begin;
    scalar_t* __restrict__ m = static_cast<scalar_t*>(list.data[kMomentum][t]) + chunk.begin;
    const int64_t n = chunk.size;

    double grad_mul = args.maximize ? -1.0 : 1.0;
    grad_mul /= args.grad_scale.read();
    // m_1 = g_1: the update with beta = 0 (m starts at zero).
    const bool first = *static_cast<const float*>(list.data[kStep][t]) == 0.0f;
    const auto keep = static_cast<opmath_t>(first ? 0.0 : args.momentum);
    const auto take = static_cast<opmath_t>(first ? grad_mul : (1.0 - args.momentum) * grad_mul);

    opmath_t sumsq = 0;
    for_each_element_pair(m, g, n, [&](scalar_t& m_i, scalar_t g_i) {
      const opmath_t v = momentum_element<scalar_t, opmath_t>(m_i, g_i, keep, take);
      sumsq += v * v;
    });

    double chunk_sumsq = block_sum_to_all<kMultiTensorThreads>(static_cast<double>(sumsq));
    if constexpr (!std::is_same_v<opmath_t, double>) {
      // Squares below ~1e-30 lose precision (or vanish) in float32; above ~1e38 they overflow. Then the
      // chunk is summed again in float64, from the m this block has just stored (block_sum_to_all's barriers
      // made every thread's stores visible to the whole block). The test is uniform across the block.
      if (!(chunk_sumsq > 1e-30 && chunk_sumsq < 1e37) && !isnan(chunk_sumsq)) {
        double exact = 0.0;
        for (int64_t i = threadIdx.x; i < n; i += kMultiTensorThreads) {
          const double v = static_cast<double>(static_cast<opmath_t>(m[i]));
          exact += v * v;
        }
        chunk_sumsq = block_sum_to_all<kMultiTensorThreads>(exact);
      }
    }
    if (threadIdx.x == 0) partials[chunk.in_call] = chunk_sumsq;
  }
};

// scale = lr / (norm + eps), or 0 for a zero norm (a zero momentum must not move p; a NaN norm gives 0 too,
// and the NaN of m then reaches p through 0 * NaN in pass B, as on the CPU).
__device__ __forceinline__ double step_scale(double sumsq, const StepArgs& args) {
  const double norm = sqrt(sumsq);
  return norm > 0.0 ? args.lr.read() / (norm + args.eps) : 0.0;
}

// norm="global": one block sums every partial of the call.
__global__ void __launch_bounds__(kMultiTensorThreads) global_norm(const double* partials, int64_t count,
                                                                   StepArgs args, double* scales) {
  if (args.found_inf.read() != 0.0) return;
  const double sum = reduce_partials<kMultiTensorThreads>(partials, count, 0.0, Sum());
  if (threadIdx.x == 0) scales[0] = step_scale(sum, args);
}

// norm="tensor": block t sums the partials of tensor t of the launch.
__global__ void __launch_bounds__(kMultiTensorThreads) tensor_norms(StepChunks list, StepArgs args,
                                                                    const double* partials, double* scales) {
  if (args.found_inf.read() != 0.0) return;
  const int t = blockIdx.x;
  const int32_t first_block = t == 0 ? 0 : list.block_end[t - 1];
  const double* mine = partials + list.first_chunk + first_block;
  const double sum = reduce_partials<kMultiTensorThreads>(mine, list.block_end[t] - first_block, 0.0, Sum());
  if (threadIdx.x == 0) scales[list.first_tensor + t] = step_scale(sum, args);
}

template <typename scalar_t, typename opmath_t>
__device__ __forceinline__ void update_element(scalar_t& p, scalar_t m, opmath_t decay, opmath_t scale) {
  p = static_cast<scalar_t>(decay * static_cast<opmath_t>(p) - scale * static_cast<opmath_t>(m));
}

// Pass B over one chunk.
template <typename scalar_t>
struct UpdatePass {
  __device__ __forceinline__ void operator()(const StepChunks& list, const ChunkOfBlock& chunk, const StepArgs& args,
                                             const double* scales) const {
    using opmath_t = at::opmath_type<scalar_t>;
    if (args.found_inf.read() != 0.0) return;
    const int t = chunk.tensor;
    scalar_t* __restrict__ p = static_cast<scalar_t*>(list.data[kParam][t]) + chunk.begin;
    const scalar_t* __restrict__ m = static_cast<const scalar_t*>(list.data[kMomentum][t]) + chunk.begin;
    const auto decay = static_cast<opmath_t>(1.0 - args.lr.read() * args.weight_decay);
    const auto scale = static_cast<opmath_t>(scales[args.per_tensor_norm ? list.first_tensor + t : 0]);

    for_each_element_pair(p, m, chunk.size, [&](scalar_t& p_i, scalar_t m_i) {
      update_element<scalar_t, opmath_t>(p_i, m_i, decay, scale);
    });
    // Nothing reads the counts after pass A, which has finished for every tensor before this launch.
    if (chunk.index == 0 && threadIdx.x == 0) *static_cast<float*>(list.data[kStep][t]) += 1.0f;
  }
};

// ---------------------------------------------------------------------------------------------------------
// Host side.

void normalized_sgd_step_cuda(
    at::TensorList params, at::TensorList grads, at::TensorList momenta, at::TensorList steps, const at::Tensor& lr,
    double momentum, double eps, double weight_decay, c10::string_view norm, bool maximize,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_step_list_lengths(params, grads, momenta, steps);
  check_step_hyperparameters(momentum, eps, weight_decay, norm);
  if (params.empty()) return;
  const c10::Device device = params[0].device();
  TORCH_CHECK_VALUE(device.is_cuda(), "dro_ext: params[0] is on ", device,
                    " while other arguments are CUDA tensors; every tensor of one call must sit on one device");
  check_step_lists(params, grads, momenta, steps, device);

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  std::vector<at::Tensor> keep_alive;
  auto step_scalar = [&](const char* name, const std::optional<at::Tensor>& t, double absent) {
    if (t.has_value()) check_step_scalar(name, *t, device);
    return scalar_arg(t, absent, keep_alive);
  };
  StepArgs args;
  args.lr = step_scalar("lr", lr, 0.0);
  args.grad_scale = step_scalar("grad_scale", grad_scale, 1.0);
  args.found_inf = step_scalar("found_inf", found_inf, 0.0);
  args.momentum = momentum;
  args.eps = eps;
  args.weight_decay = weight_decay;
  args.maximize = maximize;
  args.per_tensor_norm = norm == "tensor";
  // A skip known on the host (found_inf given on the CPU) launches nothing.
  if (args.found_inf.on_host() && args.found_inf.value != 0.0) return;

  const std::vector<StepOperands> ops = flat_step_operands(params, grads, momenta);
  std::vector<MultiTensorOperands<kNumOperands>> operands;
  operands.reserve(ops.size());
  for (const auto i : c10::irange(ops.size())) {
    // The grad is only read: const_data_ptr, which never materializes a copy-on-write tensor.
    void* grad = const_cast<void*>(ops[i].grad.const_data_ptr());
    operands.push_back({{ops[i].param.mutable_data_ptr(), grad, ops[i].momentum.mutable_data_ptr(),
                         steps[i].mutable_data_ptr()},
                        ops[i].param.numel(),
                        ops[i].param.scalar_type()});
  }
  const MultiTensorPlan<kNumOperands> plan = plan_multi_tensor(operands, "params");

  const auto on_device = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor partials = at::empty({plan.num_chunks}, on_device);
  at::Tensor scales = at::empty({args.per_tensor_norm ? static_cast<int64_t>(ops.size()) : 1}, on_device);
  double* partials_ptr = partials.mutable_data_ptr<double>();
  double* scales_ptr = scales.mutable_data_ptr<double>();

  for (const auto& launch : plan.launches) launch_multi_tensor<MomentumPass>(launch, stream, args, partials_ptr);
  if (args.per_tensor_norm) {
    for (const auto& launch : plan.launches) {
      tensor_norms<<<launch.list.num_tensors, kMultiTensorThreads, 0, stream>>>(launch.list, args, partials_ptr,
                                                                                scales_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  } else {
    global_norm<<<1, kMultiTensorThreads, 0, stream>>>(partials_ptr, plan.num_chunks, args, scales_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  for (const auto& launch : plan.launches) launch_multi_tensor<UpdatePass>(launch, stream, args, scales_ptr);
  copy_back_step_operands(ops, params, momenta);
}

}  // namespace

TORCH_LIBRARY_IMPL(dro_ext, CUDA, m) {
  m.impl("normalized_sgd_step_", &normalized_sgd_step_cuda);
}

}  // namespace dro_ext::cuda
