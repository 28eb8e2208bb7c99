// CUDA kernels of group_sums and its backward (schemas, CPU kernels and autograd in csrc/group_sums.cpp, same
// semantics and checks):
//
//   group_sums           keys: each id, or the sentinel G for an id outside [0, G) (which raises a device flag), and
//                        the losses in the accumulation dtype; a stable radix sort of the pairs by key (CUB); then
//                        blocks over fixed parts of each group's sorted segment (group g's segment [lo, hi) found
//                        by binary search, cut into `parts` equal spans) write per-block partial sums (float64),
//                        which one thread per group adds in part order and rounds once (wide: writes as they are,
//                        in float64). counts[g] = hi - lo, exact.
//   group_sums_backward  one elementwise launch: grad_l_i = grad_sums[g_i], 0 for an id outside [0, G).
//
// Deterministic: the sort is stable and its order a function of the keys only, each block sums a fixed span in a
// fixed tree (block_reduce), and the parts are combined in a fixed order; no float atomics. The sentinel key sorts
// after every group and belongs to none: an out-of-range id is dropped. Memory O(N + G): the sorted pairs, CUB's
// temporary storage, and parts * G <= max(G, kMaxReduceBlocks) partials.
//
// Host syncs: none, except the one read of the bad-id flag when validate is true (the op raises IndexError);
// validate=False leaves the op free of syncs, for CUDA-graph capture.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>

#include "checks.h"
#include "cuda/common.cuh"
#include "group_sums_checks.h"

namespace dro_ext::cuda {

namespace {

// Keys (the id, or num_groups for an id outside [0, num_groups)) and values (the losses in acc_t), contiguous.
template <typename scalar_t, typename id_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) group_keys_kernel(
    const scalar_t* __restrict__ x, int64_t x_stride, const id_t* __restrict__ ids, int64_t id_stride, int64_t n,
    int num_groups, int* __restrict__ keys, acc_t* __restrict__ values, int* __restrict__ bad_id) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t id = static_cast<int64_t>(ids[i * id_stride]);
    const bool in_range = id >= 0 && id < num_groups;
    if (!in_range) *bad_id = 1;  // every writer writes the same value
    keys[i] = in_range ? static_cast<int>(id) : num_groups;
    values[i] = static_cast<acc_t>(x[i * x_stride]);
  }
}

// The first index of sorted_keys[0, n) whose key is >= target.
__device__ __forceinline__ int64_t lower_bound(const int* __restrict__ sorted_keys, int64_t n, int target) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (sorted_keys[mid] < target) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Block b sums part b % parts of group b / parts's segment of the sorted values; part 0 also writes the count. The
// sums are float64 whatever acc_t is, as on the CPU: from num_groups >= kMaxReduceBlocks on, one block takes a whole
// group, and each of its threads adds 1/kThreads of the group one value after another (8192 of them for a group of
// 2^21), which in float32 drifts by about a rounding per value where the values are alike. Counts in out_t.
template <typename acc_t, typename out_t>
__global__ void __launch_bounds__(kThreads) group_part_sums_kernel(
    const int* __restrict__ sorted_keys, const acc_t* __restrict__ sorted_values, int64_t n, int parts,
    double* __restrict__ partials, out_t* __restrict__ counts) {
  const int64_t group = blockIdx.x / parts;
  const int part = static_cast<int>(blockIdx.x % parts);
  __shared__ int64_t bounds[2];
  if (threadIdx.x < 2) bounds[threadIdx.x] = lower_bound(sorted_keys, n, static_cast<int>(group + threadIdx.x));
  __syncthreads();
  const int64_t lo = bounds[0], hi = bounds[1];
  const int64_t span = (hi - lo + parts - 1) / parts;
  const int64_t begin = lo + part * span;
  const int64_t end = begin + span < hi ? begin + span : hi;
  double s = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) s += static_cast<double>(sorted_values[i]);
  const double sum = block_reduce(s, Sum());
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = sum;
    if (part == 0) counts[group] = static_cast<out_t>(hi - lo);
  }
}

// sums[g] = the parts of group g added in part order (float64), rounded once into out_t (the accumulation dtype, or
// double for wide sums: no rounding).
template <typename out_t>
__global__ void __launch_bounds__(kThreads) group_combine_kernel(const double* __restrict__ partials,
                                                                 int64_t num_groups, int parts,
                                                                 out_t* __restrict__ sums) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (group >= num_groups) return;
  double s = partials[group * parts];
  for (int p = 1; p < parts; ++p) s += partials[group * parts + p];
  sums[group] = static_cast<out_t>(s);
}

std::tuple<at::Tensor, at::Tensor> group_sums_cuda(const at::Tensor& losses, const at::Tensor& groups,
                                                   int64_t num_groups, bool validate, bool wide) {
  check_group_sums_args(losses, groups, num_groups);
  const int64_t n = losses.numel();
  TORCH_CHECK_VALUE(n <= INT_MAX && num_groups < INT_MAX, "dro_ext: group_sums on CUDA supports at most 2^31 - 1 "
                    "samples and num_groups < 2^31 - 1, got ", n, " samples and num_groups=", num_groups);
  const c10::cuda::CUDAGuard guard(losses.device());
  // The sorted values in the accumulation dtype (exact: half and float32 losses are float32 values); the sums and
  // counts in out_options.
  const auto options = losses.options().dtype(accumulate_type(losses.scalar_type()));
  const auto out_options = losses.options().dtype(group_sums_dtype(losses.scalar_type(), wide));
  if (n == 0) return {at::zeros({num_groups}, out_options), at::zeros({num_groups}, out_options)};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int g = static_cast<int>(num_groups);
  at::Tensor bad_id = at::zeros({}, losses.options().dtype(at::kInt));
  at::Tensor keys = at::empty({n}, losses.options().dtype(at::kInt));
  at::Tensor values = at::empty({n}, options);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, losses.scalar_type(), "dro_ext_cuda_group_keys", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    AT_DISPATCH_INDEX_TYPES(groups.scalar_type(), "dro_ext_cuda_group_keys_ids", [&] {
      group_keys_kernel<<<map_blocks<scalar_t>(n), kThreads, 0, stream>>>(
          losses.const_data_ptr<scalar_t>(), losses.stride(0), groups.const_data_ptr<index_t>(), groups.stride(0), n,
          g, keys.mutable_data_ptr<int>(), values.mutable_data_ptr<acc_t>(), bad_id.mutable_data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  // The one host read (skipped with validate=False): ids outside [0, num_groups) raise IndexError, as on the CPU.
  if (validate) check_ids_in_range(bad_id.item<int>() == 0, num_groups);

  int end_bit = 1;
  while (end_bit < 31 && (int64_t{1} << end_bit) <= num_groups) ++end_bit;  // keys are in [0, num_groups]
  at::Tensor sorted_keys = at::empty_like(keys), sorted_values = at::empty_like(values);
  at::Tensor sums = at::empty({num_groups}, out_options), counts = at::empty({num_groups}, out_options);
  // At most kMaxReduceBlocks blocks over the groups' segments (and at least one per group); a constant, so the
  // cut depends on n and num_groups only.
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxReduceBlocks / num_groups,
                                                                             ceil_div(n, kThreads))));
  at::Tensor partials = at::empty({num_groups * parts}, options.dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(options.dtype().toScalarType(), "dro_ext_cuda_group_sums", [&] {
    using acc_t = scalar_t;
    size_t temp_bytes = 0;
    // CUB's two-call protocol: with no temp storage the call only says how much it needs.
    auto sort_by_group = [&](void* temp_storage) {
      C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
          temp_storage, temp_bytes, keys.const_data_ptr<int>(), sorted_keys.mutable_data_ptr<int>(),
          values.const_data_ptr<acc_t>(), sorted_values.mutable_data_ptr<acc_t>(), static_cast<int>(n), 0, end_bit,
          stream));
    };
    sort_by_group(nullptr);
    at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, losses.options().dtype(at::kByte));
    sort_by_group(temp.mutable_data_ptr());
    const auto part_blocks = static_cast<unsigned int>(num_groups * parts);
    const auto combine_blocks = static_cast<unsigned int>(ceil_div(num_groups, kThreads));
    auto sum_into = [&](auto out_zero) {
      using out_t = decltype(out_zero);
      group_part_sums_kernel<acc_t, out_t><<<part_blocks, kThreads, 0, stream>>>(
          sorted_keys.const_data_ptr<int>(), sorted_values.const_data_ptr<acc_t>(), n, parts,
          partials.mutable_data_ptr<double>(), counts.mutable_data_ptr<out_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      group_combine_kernel<out_t><<<combine_blocks, kThreads, 0, stream>>>(
          partials.const_data_ptr<double>(), num_groups, parts, sums.mutable_data_ptr<out_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (wide) {
      sum_into(double{0});
    } else {
      sum_into(acc_t{0});
    }
  });
  return {sums, counts};
}

template <typename scalar_t, typename id_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) group_gather_kernel(const acc_t* __restrict__ grad, int64_t num_groups,
                                                                const id_t* __restrict__ ids, int64_t id_stride,
                                                                int64_t n, scalar_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t id = static_cast<int64_t>(ids[i * id_stride]);
    out[i] = static_cast<scalar_t>(id >= 0 && id < num_groups ? grad[id] : acc_t(0));
  }
}

at::Tensor group_sums_backward_cuda(const at::Tensor& grad_sums, const at::Tensor& groups, at::ScalarType dtype) {
  check_group_sums_backward_args(grad_sums, groups, dtype);
  const c10::cuda::CUDAGuard guard(groups.device());
  const int64_t n = groups.numel(), num_groups = grad_sums.numel();
  at::Tensor out = at::empty({n}, groups.options().dtype(dtype));
  if (n == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "dro_ext_cuda_group_gather", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // G values, read once per sample: converted up front to one contiguous type (stream-ordered, no sync).
    const at::Tensor grad = grad_sums.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    AT_DISPATCH_INDEX_TYPES(groups.scalar_type(), "dro_ext_cuda_group_gather_ids", [&] {
      group_gather_kernel<<<map_blocks<scalar_t>(n), kThreads, 0, stream>>>(
          grad.const_data_ptr<acc_t>(), num_groups, groups.const_data_ptr<index_t>(), groups.stride(0), n,
          out.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dro_ext, CUDA, m) {
  m.impl("group_sums", &group_sums_cuda);
  m.impl("group_sums_backward", &group_sums_backward_cuda);
}

}  // namespace dro_ext::cuda
