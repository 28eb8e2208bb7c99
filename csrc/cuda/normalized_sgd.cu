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
//   pass A   one block per chunk of kChunk elements of a tensor: updates m and writes the chunk's sum of
//            m^2 into partials[] (float32 sums per thread for float32/half/bfloat16, float64 for float64;
//            the block's sum in float64). A chunk whose float32 sum may have under- or overflowed is summed
//            again in float64, as the CPU kernel does, so tiny and huge momenta still get their norm.
//   norm     one block per norm: sums its partials in a fixed order into scale (above), in float64.
//   pass B   one block per chunk again: p <- decay p - scale m; the block of a tensor's first chunk counts
//            its step.
// The tensors' pointers and sizes travel in the kernels' parameters (up to kMaxTensors tensors of one dtype
// per launch, like ATen's MultiTensorApply), never through a host-to-device copy: that keeps the step free
// of syncs and capturable in a CUDA graph. lr, grad_scale and found_inf are read by the kernels where they
// live on the device; a CPU tensor (e.g. lr given as a Python float) is read on the host, which needs no
// sync (in a captured graph its value is then fixed: pass a device tensor to change lr between replays).
// No atomics anywhere: every sum has a fixed order, so the step is bitwise repeatable.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "normalized_sgd_checks.h"

namespace dro_ext {
namespace {

constexpr int kThreads = 512;
// Elements per block of pass A and pass B: 32 per thread, i.e. 8 (float32) to 2 (half) 16-byte loads.
constexpr int64_t kChunk = 16384;
// Loads issued before their first use in the element loops, to keep more bytes in flight per thread.
constexpr int kUnroll = 4;
// Tensors per launch: the metadata (7 words per tensor) plus StepArgs stay under the 4 KiB of kernel
// parameters that every CUDA version accepts; 64 takes a ResNet-18 (62 tensors) in one launch per pass.
constexpr int kMaxTensors = 64;

// A one-element tensor argument: read on the device through ptr, or (ptr == nullptr) the host value.
struct ScalarArg {
  enum Kind : int { kFloat, kDouble, kHalf, kBFloat16 };
  const void* ptr = nullptr;
  double value = 0.0;
  int kind = kDouble;

  __device__ __forceinline__ double read() const {
    if (ptr == nullptr) return value;
    switch (kind) {
      case kFloat: return static_cast<double>(*static_cast<const float*>(ptr));
      case kHalf: return static_cast<double>(static_cast<float>(*static_cast<const c10::Half*>(ptr)));
      case kBFloat16: return static_cast<double>(static_cast<float>(*static_cast<const c10::BFloat16*>(ptr)));
      default: return *static_cast<const double*>(ptr);
    }
  }
};

struct StepArgs {
  ScalarArg lr, grad_scale, found_inf;
  double momentum, eps, weight_decay;
  bool maximize;
};

// The tensors of one launch (all of one dtype). Block b of a pass works on tensor t, the one with
// block_end[t - 1] <= b < block_end[t], and on its chunk b - block_end[t - 1].
struct TensorList {
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  void* momentum[kMaxTensors];
  float* step[kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t partial_base[kMaxTensors];  // index in partials[] of the tensor's first chunk
  int32_t norm_slot[kMaxTensors];     // index in scales[] of the tensor's norm (0 for norm="global")
  int32_t block_end[kMaxTensors];     // blocks of this launch up to and including the tensor's chunks
  int32_t num_tensors;
};
static_assert(sizeof(TensorList) + sizeof(StepArgs) + 2 * sizeof(void*) <= 4000,
              "kernel parameters must stay under the 4 KiB limit");

C10_HOST_DEVICE inline int64_t chunks_of(int64_t numel) {
  // An empty tensor still gets one (empty) block: it writes a zero partial and counts the step.
  return numel == 0 ? 1 : (numel + kChunk - 1) / kChunk;
}

struct BlockWork {
  int tensor;
  int64_t chunk;
};

__device__ __forceinline__ BlockWork block_work(const TensorList& list) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  int lo = 0, hi = list.num_tensors - 1;  // first t with block_end[t] > b
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (list.block_end[mid] > b) hi = mid; else lo = mid + 1;
  }
  const int32_t first_block = lo == 0 ? 0 : list.block_end[lo - 1];
  return {lo, static_cast<int64_t>(b - first_block)};
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T val[N];
};

template <typename scalar_t>
constexpr int kVec = 16 / sizeof(scalar_t);

__device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// op(w_i, r_i) on each of the n elements of one chunk, w read and written in place, r read. Where both are
// 16-byte aligned, in whole 16-byte packs with kUnroll packs in flight per thread (a thread's loads all issue
// before the first use), then the elements past the last whole pack one by one. The order of the calls a
// thread makes is fixed, so a sum the op keeps is the same bits every run.
template <typename scalar_t, typename Op>
__device__ __forceinline__ void for_each_element_pair(scalar_t* __restrict__ w, const scalar_t* __restrict__ r,
                                                      int64_t n, Op op) {
  int64_t scalar_from = 0;
  constexpr int V = kVec<scalar_t>;
  if (aligned16(w) && aligned16(r)) {
    using P = Pack<scalar_t, V>;
    P* wv = reinterpret_cast<P*>(w);
    const P* rv = reinterpret_cast<const P*>(r);
    const int64_t num_packs = n / V;
    for (int64_t base = threadIdx.x; base < num_packs; base += kThreads * kUnroll) {
      P wp[kUnroll], rp[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kThreads;
        if (i < num_packs) {
          wp[u] = wv[i];
          rp[u] = rv[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kThreads;
        if (i < num_packs) {
#pragma unroll
          for (int j = 0; j < V; ++j) op(wp[u].val[j], rp[u].val[j]);
          wv[i] = wp[u];
        }
      }
    }
    scalar_from = num_packs * V;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < n; i += kThreads) op(w[i], r[i]);
}

using BlockSum = cub::BlockReduce<double, kThreads>;

// Every thread gets the block's sum of `value` (a fixed reduction tree: the same bits every run).
__device__ __forceinline__ double block_sum(double value, typename BlockSum::TempStorage& temp, double& shared) {
  const double sum = BlockSum(temp).Sum(value);
  if (threadIdx.x == 0) shared = sum;
  __syncthreads();
  const double result = shared;
  __syncthreads();  // temp and shared may be reused right after
  return result;
}

// m <- keep m + take g over one element; returns the stored m in the compute type.
template <typename scalar_t, typename opmath_t>
__device__ __forceinline__ opmath_t momentum_element(scalar_t& m, scalar_t g, opmath_t keep, opmath_t take) {
  const scalar_t stored = static_cast<scalar_t>(keep * static_cast<opmath_t>(m) + take * static_cast<opmath_t>(g));
  m = stored;
  return static_cast<opmath_t>(stored);
}

// Pass A.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) momentum_pass(TensorList list, StepArgs args, double* partials) {
  using opmath_t = at::opmath_type<scalar_t>;
  if (args.found_inf.read() != 0.0) return;  // the whole step is skipped
  const BlockWork work = block_work(list);
  const int t = work.tensor;
  const int64_t begin = work.chunk * kChunk;
  const int64_t n = list.numel[t] - begin < kChunk ? list.numel[t] - begin : kChunk;
  const scalar_t* __restrict__ g = static_cast<const scalar_t*>(list.grad[t]) + begin;
  scalar_t* __restrict__ m = static_cast<scalar_t*>(list.momentum[t]) + begin;

  double grad_mul = args.maximize ? -1.0 : 1.0;
  grad_mul /= args.grad_scale.read();
  const bool first = *list.step[t] == 0.0f;  // m_1 = g_1: the update with beta = 0 (m starts at zero)
  const auto keep = static_cast<opmath_t>(first ? 0.0 : args.momentum);
  const auto take = static_cast<opmath_t>(first ? grad_mul : (1.0 - args.momentum) * grad_mul);

  opmath_t sumsq = 0;
  for_each_element_pair(m, g, n, [&](scalar_t& m_i, scalar_t g_i) {
    const opmath_t v = momentum_element<scalar_t, opmath_t>(m_i, g_i, keep, take);
    sumsq += v * v;
  });

  __shared__ typename BlockSum::TempStorage temp;
  __shared__ double shared;
  double chunk_sumsq = block_sum(static_cast<double>(sumsq), temp, shared);
  if constexpr (!std::is_same_v<opmath_t, double>) {
    // Squares below ~1e-30 lose precision (or vanish) in float32; above ~1e38 they overflow. Then the
    // chunk is summed again in float64, from the m this block has just stored (block_sum's barrier made
    // every thread's stores visible to the whole block). The test is uniform across the block.
    if (!(chunk_sumsq > 1e-30 && chunk_sumsq < 1e37) && !isnan(chunk_sumsq)) {
      double exact = 0.0;
      for (int64_t i = threadIdx.x; i < n; i += kThreads) {
        const double v = static_cast<double>(static_cast<opmath_t>(m[i]));
        exact += v * v;
      }
      chunk_sumsq = block_sum(exact, temp, shared);
    }
  }
  if (threadIdx.x == 0) partials[list.partial_base[t] + work.chunk] = chunk_sumsq;
}

// scale = lr / (norm + eps), or 0 for a zero norm (a zero momentum must not move p; a NaN norm gives 0 too,
// and the NaN of m then reaches p through 0 * NaN in pass B, as on the CPU).
__device__ __forceinline__ double step_scale(double sumsq, const StepArgs& args) {
  const double norm = sqrt(sumsq);
  return norm > 0.0 ? args.lr.read() / (norm + args.eps) : 0.0;
}

// norm="global": one block sums every partial of the call.
__global__ void __launch_bounds__(kThreads) global_norm(const double* partials, int64_t count, StepArgs args,
                                                          double* scales) {
  if (args.found_inf.read() != 0.0) return;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) sum += partials[i];
  __shared__ typename BlockSum::TempStorage temp;
  __shared__ double shared;
  sum = block_sum(sum, temp, shared);
  if (threadIdx.x == 0) scales[0] = step_scale(sum, args);
}

// norm="tensor": block t sums the partials of tensor t of the launch.
__global__ void __launch_bounds__(kThreads) tensor_norms(TensorList list, StepArgs args, const double* partials,
                                                           double* scales) {
  if (args.found_inf.read() != 0.0) return;
  const int t = blockIdx.x;
  const int64_t count = chunks_of(list.numel[t]);
  const double* mine = partials + list.partial_base[t];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) sum += mine[i];
  __shared__ typename BlockSum::TempStorage temp;
  __shared__ double shared;
  sum = block_sum(sum, temp, shared);
  if (threadIdx.x == 0) scales[list.norm_slot[t]] = step_scale(sum, args);
}

template <typename scalar_t, typename opmath_t>
__device__ __forceinline__ void update_element(scalar_t& p, scalar_t m, opmath_t decay, opmath_t scale) {
  p = static_cast<scalar_t>(decay * static_cast<opmath_t>(p) - scale * static_cast<opmath_t>(m));
}

// Pass B.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) update_pass(TensorList list, StepArgs args, const double* scales) {
  using opmath_t = at::opmath_type<scalar_t>;
  if (args.found_inf.read() != 0.0) return;
  const BlockWork work = block_work(list);
  const int t = work.tensor;
  const int64_t begin = work.chunk * kChunk;
  const int64_t n = list.numel[t] - begin < kChunk ? list.numel[t] - begin : kChunk;
  scalar_t* __restrict__ p = static_cast<scalar_t*>(list.param[t]) + begin;
  const scalar_t* __restrict__ m = static_cast<const scalar_t*>(list.momentum[t]) + begin;
  const auto decay = static_cast<opmath_t>(1.0 - args.lr.read() * args.weight_decay);
  const auto scale = static_cast<opmath_t>(scales[list.norm_slot[t]]);

  for_each_element_pair(p, m, n, [&](scalar_t& p_i, scalar_t m_i) {
    update_element<scalar_t, opmath_t>(p_i, m_i, decay, scale);
  });
  // Nothing reads the counts after pass A, which has finished for every tensor before this launch.
  if (work.chunk == 0 && threadIdx.x == 0) *list.step[t] += 1.0f;
}

// ---------------------------------------------------------------------------------------------------------
// Host side.

ScalarArg scalar_arg(const char* name, const std::optional<at::Tensor>& tensor, double absent, c10::Device device,
                     std::vector<at::Tensor>& keep_alive) {
  ScalarArg arg;
  arg.value = absent;
  if (!tensor.has_value()) return arg;
  const at::Tensor& t = *tensor;
  TORCH_CHECK_VALUE(t.numel() == 1, "dro_ext: ", name, " must hold one element, got shape ", t.sizes());
  if (t.device().is_cpu()) {
    arg.value = t.item<double>();  // host memory: no device sync
    return arg;
  }
  TORCH_CHECK_VALUE(t.device() == device, "dro_ext: ", name, " is on ", t.device(), " but the parameters are on ",
                    device, "; pass it on ", device, " or on the CPU");
  at::Tensor value = t;
  switch (t.scalar_type()) {
    case at::kFloat: arg.kind = ScalarArg::kFloat; break;
    case at::kDouble: arg.kind = ScalarArg::kDouble; break;
    case at::kHalf: arg.kind = ScalarArg::kHalf; break;
    case at::kBFloat16: arg.kind = ScalarArg::kBFloat16; break;
    default:
      // Integers or bool (e.g. a found_inf flag): converted on the device, stream-ordered, no sync. The
      // copy is kept alive until the kernels are enqueued; the caching allocator orders its reuse after them.
      value = t.to(at::kDouble);
      keep_alive.push_back(value);
      arg.kind = ScalarArg::kDouble;
  }
  arg.ptr = value.const_data_ptr();
  return arg;
}

// One tensor's operands as flat arrays: as given when p, g and m share one dense layout, else contiguous
// copies (p and m are copied back after the step), exactly as the CPU kernel does.
struct Operands {
  at::Tensor param, grad, momentum;
  bool copied = false;
};

Operands flat_operands(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m) {
  if (p.is_non_overlapping_and_dense() && g.strides() == p.strides() && m.strides() == p.strides()) {
    return {p, g, m, false};
  }
  return {p.contiguous(), g.contiguous(), m.contiguous(), true};
}

struct Launch {
  at::ScalarType dtype;
  TensorList list;
  int64_t num_blocks;
};

template <typename scalar_t>
void launch_momentum_pass(const Launch& l, const StepArgs& args, double* partials, cudaStream_t stream) {
  momentum_pass<scalar_t><<<static_cast<unsigned>(l.num_blocks), kThreads, 0, stream>>>(l.list, args, partials);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_update_pass(const Launch& l, const StepArgs& args, const double* scales, cudaStream_t stream) {
  update_pass<scalar_t><<<static_cast<unsigned>(l.num_blocks), kThreads, 0, stream>>>(l.list, args, scales);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename F>
void by_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kDouble: f(double{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "dro_ext: unexpected dtype ", dtype);
  }
}

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
  const bool per_tensor = norm == "tensor";

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  std::vector<at::Tensor> keep_alive;
  StepArgs args;
  args.lr = scalar_arg("lr", lr, 0.0, device, keep_alive);
  args.grad_scale = scalar_arg("grad_scale", grad_scale, 1.0, device, keep_alive);
  args.found_inf = scalar_arg("found_inf", found_inf, 0.0, device, keep_alive);
  args.momentum = momentum;
  args.eps = eps;
  args.weight_decay = weight_decay;
  args.maximize = maximize;
  // A skip known on the host (found_inf given on the CPU) launches nothing.
  if (args.found_inf.ptr == nullptr && args.found_inf.value != 0.0) return;

  const int64_t num_tensors = static_cast<int64_t>(params.size());
  std::vector<Operands> ops;
  ops.reserve(num_tensors);
  for (const auto i : c10::irange(num_tensors)) ops.push_back(flat_operands(params[i], grads[i], momenta[i]));

  // Launches: the tensors of one dtype in list order, dtypes in a fixed order, at most kMaxTensors each.
  // A tensor's chunks get consecutive partials, so the sums (hence the bits of the step) depend only on
  // the list, never on timing.
  std::vector<Launch> launches;
  int64_t num_partials = 0;
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    Launch current{dtype, {}, 0};
    current.list.num_tensors = 0;
    for (const auto i : c10::irange(num_tensors)) {
      if (params[i].scalar_type() != dtype) continue;
      const int64_t numel = params[i].numel();
      const int64_t chunks = chunks_of(numel);
      TORCH_CHECK(chunks <= std::numeric_limits<int32_t>::max(), "dro_ext: params[", i, "] has ", numel,
                  " elements, more than one launch can take");
      if (current.list.num_tensors == kMaxTensors ||
          current.num_blocks + chunks > std::numeric_limits<int32_t>::max()) {
        launches.push_back(current);
        current.list.num_tensors = 0;
        current.num_blocks = 0;
      }
      TensorList& list = current.list;
      const int k = list.num_tensors++;
      list.param[k] = ops[i].param.mutable_data_ptr();
      list.grad[k] = ops[i].grad.const_data_ptr();
      list.momentum[k] = ops[i].momentum.mutable_data_ptr();
      list.step[k] = steps[i].mutable_data_ptr<float>();
      list.numel[k] = numel;
      list.partial_base[k] = num_partials;
      list.norm_slot[k] = per_tensor ? static_cast<int32_t>(i) : 0;
      current.num_blocks += chunks;
      list.block_end[k] = static_cast<int32_t>(current.num_blocks);
      num_partials += chunks;
    }
    if (current.list.num_tensors > 0) launches.push_back(current);
  }

  const auto on_device = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor partials = at::empty({num_partials}, on_device);
  at::Tensor scales = at::empty({per_tensor ? num_tensors : 1}, on_device);
  double* partials_ptr = partials.mutable_data_ptr<double>();
  double* scales_ptr = scales.mutable_data_ptr<double>();

  for (const Launch& l : launches) {
    by_dtype(l.dtype, [&](auto tag) { launch_momentum_pass<decltype(tag)>(l, args, partials_ptr, stream); });
  }
  if (per_tensor) {
    for (const Launch& l : launches) {
      tensor_norms<<<l.list.num_tensors, kThreads, 0, stream>>>(l.list, args, partials_ptr, scales_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  } else {
    global_norm<<<1, kThreads, 0, stream>>>(partials_ptr, num_partials, args, scales_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  for (const Launch& l : launches) {
    by_dtype(l.dtype, [&](auto tag) { launch_update_pass<decltype(tag)>(l, args, scales_ptr, stream); });
  }

  for (const auto i : c10::irange(num_tensors)) {
    if (ops[i].copied) {
      params[i].copy_(ops[i].param);
      momenta[i].copy_(ops[i].momentum);
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(dro_ext, CUDA, m) {
  m.impl("normalized_sgd_step_", &normalized_sgd_step_cuda);
}

}  // namespace dro_ext
