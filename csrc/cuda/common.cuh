// Device infrastructure shared by every CUDA kernel of dro_ext, apart from any math: scalars read and written on
// the device, the launch shape, vectorized grid-stride loops and deterministic warp and block reductions. The
// divergence math the loss kernels sum lives in psi_star_kernels.cuh; the multi-tensor launches of the optimizer
// in multi_tensor.cuh. Every launch is checked with C10_CUDA_KERNEL_LAUNCH_CHECK() right after it.
//
// Determinism: every reduction here is a fixed tree. Each thread sums a fixed set of elements (the grid size
// depends on N only, never on the card or the run), CUB's BlockReduce combines the threads of a block in a
// fixed order, and a second stage (one block) combines the per-block partials in a fixed order. No float
// atomics anywhere, so results are bitwise identical run to run.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cub/cub.cuh>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace dro_ext::cuda {

// Threads per block of the kernels over the losses (elementwise maps and reductions).
constexpr int kThreads = 256;
// At most this many blocks per reduction: about one wave of 256-thread blocks on an H100 (132 SMs x 8),
// and few enough partials for one block to combine. A constant, so the summation tree depends on N only.
constexpr int64_t kMaxReduceBlocks = 1024;
constexpr int64_t kMaxMapBlocks = 65535 * 4;

// The dtype of a scalar a kernel reads or writes through a pointer, so that no kernel is instantiated per dtype
// of a scalar argument.
enum class ScalarKind : int { kFloat, kDouble, kHalf, kBFloat16 };

// A 0-d floating tensor read on the device: the pointer and its dtype; nothing is copied to the host.
struct ScalarRef {
  const void* ptr;
  ScalarKind kind;

  __device__ __forceinline__ double read() const {
    switch (kind) {
      case ScalarKind::kDouble:
        return *static_cast<const double*>(ptr);
      case ScalarKind::kHalf:
        return static_cast<double>(static_cast<float>(*static_cast<const c10::Half*>(ptr)));
      case ScalarKind::kBFloat16:
        return static_cast<double>(static_cast<float>(*static_cast<const c10::BFloat16*>(ptr)));
      default:
        return static_cast<double>(*static_cast<const float*>(ptr));
    }
  }
};

inline ScalarKind scalar_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return ScalarKind::kDouble;
    case at::kHalf: return ScalarKind::kHalf;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    default: return ScalarKind::kFloat;
  }
}

inline ScalarRef scalar_ref(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() == 0 && t.is_cuda());
  const auto type = t.scalar_type();
  TORCH_CHECK_TYPE(type == at::kFloat || type == at::kDouble || type == at::kHalf || type == at::kBFloat16,
                   "dro_ext: expected a float16, bfloat16, float32 or float64 scalar, got ", type);
  return ScalarRef{t.const_data_ptr(), scalar_kind(t)};
}

inline ScalarRef scalar_ref(const double* device_ptr) { return ScalarRef{device_ptr, ScalarKind::kDouble}; }

// A one-element tensor argument that may sit on the host or on the device: a host tensor's value is read when the
// kernel is enqueued (host memory: no sync), a device tensor is read by the kernel through ref. In a captured CUDA
// graph a host value is fixed; a device tensor may change between replays.
struct ScalarArg {
  ScalarRef ref{nullptr, ScalarKind::kDouble};  // ref.ptr == nullptr: the value is `value`
  double value = 0.0;

  bool on_host() const { return ref.ptr == nullptr; }
  __device__ __forceinline__ double read() const { return ref.ptr == nullptr ? value : ref.read(); }
};

// The ScalarArg of an optional one-element tensor (checked by the op beforehand: on the CPU or on the device the
// kernels run on): `absent` when it is not given. An integer or bool tensor on the device (e.g. a found_inf flag)
// is converted to float64 there, stream-ordered (no sync); the copy joins keep_alive, which the caller holds until
// its kernels are enqueued (the caching allocator orders any reuse of the memory after them).
inline ScalarArg scalar_arg(const std::optional<at::Tensor>& tensor, double absent,
                            std::vector<at::Tensor>& keep_alive) {
  ScalarArg arg;
  arg.value = absent;
  if (!tensor.has_value()) return arg;
  const at::Tensor& t = *tensor;
  if (t.device().is_cpu()) {
    arg.value = t.item<double>();
    return arg;
  }
  const auto type = t.scalar_type();
  if (type == at::kFloat || type == at::kDouble || type == at::kHalf || type == at::kBFloat16) {
    arg.ref = ScalarRef{t.const_data_ptr(), scalar_kind(t)};
  } else {
    keep_alive.push_back(t.to(at::kDouble));
    arg.ref = ScalarRef{keep_alive.back().const_data_ptr(), ScalarKind::kDouble};
  }
  return arg;
}

// A 0-d floating output tensor written on the device, whatever its dtype.
struct ScalarOut {
  void* ptr;
  ScalarKind kind;

  __device__ __forceinline__ void write(double v) const {
    switch (kind) {
      case ScalarKind::kDouble: *static_cast<double*>(ptr) = v; break;
      case ScalarKind::kHalf: *static_cast<c10::Half*>(ptr) = c10::Half(static_cast<float>(v)); break;
      case ScalarKind::kBFloat16: *static_cast<c10::BFloat16*>(ptr) = c10::BFloat16(static_cast<float>(v)); break;
      default: *static_cast<float*>(ptr) = static_cast<float>(v); break;
    }
  }
};

inline ScalarOut scalar_out(at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() == 0 && t.is_cuda() && at::isFloatingType(t.scalar_type()));
  return ScalarOut{t.mutable_data_ptr(), scalar_kind(t)};
}

// A double shift s as hi + lo in the accumulate dtype, for t = (l - s) / lam over losses of that dtype:
// deviation(l) = (l - hi) - lo misses l - s by a rounding of lo and of the difference, where (l - hi) alone would
// miss it by hi's rounding of s, ulp(s) / 2, which a tiny lam turns into a large error in t (float32 losses near
// 1e6, a float64 eta, lam = 1e-3: t off by 30). l - hi is exact where l is within a factor 2 of hi, which is where
// the difference is small. lo is 0 where hi is no finite number (s NaN or beyond the dtype): t is then +-inf or
// NaN as it was, never inf - inf.
template <typename acc_t>
struct SplitShift {
  acc_t hi;
  acc_t lo;
  __device__ __forceinline__ acc_t deviation(acc_t l) const { return (l - hi) - lo; }
};

// shift = scale * (*ref) + offset, in double, read once per thread (the CPU kernels form G*eta in double too).
struct ShiftRef {
  ScalarRef ref;
  double scale;
  double offset;
  __device__ __forceinline__ double read() const { return scale * ref.read() + offset; }
  template <typename acc_t>
  __device__ __forceinline__ SplitShift<acc_t> split() const {
    const double s = read();
    const acc_t hi = static_cast<acc_t>(s);
    const double rest = s - static_cast<double>(hi);
    return {hi, isfinite(rest) ? static_cast<acc_t>(rest) : acc_t(0)};
  }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Elements per 16-byte vector of scalar_t.
template <typename scalar_t>
__host__ __device__ constexpr int vec_size() {
  return 16 / static_cast<int>(sizeof(scalar_t));
}

template <typename scalar_t, int N>
struct alignas(sizeof(scalar_t) * N) AlignedVec {
  scalar_t v[N];
};

// Blocks for a reduction over n elements of scalar_t: enough for every thread to load a few vectors,
// at most kMaxReduceBlocks.
template <typename scalar_t>
int reduce_blocks(int64_t n) {
  const int64_t per_block = int64_t(kThreads) * vec_size<scalar_t>() * 4;
  return static_cast<int>(std::max<int64_t>(1, std::min(kMaxReduceBlocks, ceil_div(n, per_block))));
}

template <typename scalar_t>
int map_blocks(int64_t n) {
  const int64_t per_block = int64_t(kThreads) * vec_size<scalar_t>();
  return static_cast<int>(std::max<int64_t>(1, std::min(kMaxMapBlocks, ceil_div(n, per_block))));
}

// Calls f(e, std::integral_constant<int, K>{}, whole_warp) with e the next K elements (as acc_t) this thread owns,
// in a grid-stride loop over all of x: K = one 16-byte vector's worth over the aligned body, K = 1 for the (< one
// vector) head before it and the tail after it. Works for any element-aligned x (a view at an odd offset
// included); the order in which a thread sees its elements depends only on n and x's alignment. whole_warp is
// true, in every lane of the warp alike, when all 32 lanes are in the same body iteration (32 consecutive
// vectors): only then may f use full-mask warp intrinsics (warp_sum). It depends only on n, x's alignment and the
// launch shape (blockDim a multiple of 32), so a decision made from it is deterministic.
template <typename acc_t, typename scalar_t, typename F>
__device__ __forceinline__ void for_each_vector(const scalar_t* __restrict__ x, int64_t n, F&& f) {
  constexpr int kVec = vec_size<scalar_t>();
  using Vec = AlignedVec<scalar_t, kVec>;
  const int64_t misalign = static_cast<int64_t>((reinterpret_cast<uintptr_t>(x) / sizeof(scalar_t)) % kVec);
  const int64_t head = misalign == 0 ? 0 : (n < kVec - misalign ? n : kVec - misalign);
  const int64_t body = (n - head) / kVec;
  const int64_t tail_begin = head + body * kVec;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const Vec* vx = reinterpret_cast<const Vec*>(x + head);
  const int64_t lane = threadIdx.x % 32;
  for (int64_t v = tid; v < body; v += stride) {
    const Vec data = vx[v];
    acc_t e[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) e[j] = static_cast<acc_t>(data.v[j]);
    f(e, std::integral_constant<int, kVec>{}, v - lane + 31 < body);
  }
  if (tid < head) {
    const acc_t e[1] = {static_cast<acc_t>(x[tid])};
    f(e, std::integral_constant<int, 1>{}, false);
  }
  if (tail_begin + tid < n) {
    const acc_t e[1] = {static_cast<acc_t>(x[tail_begin + tid])};
    f(e, std::integral_constant<int, 1>{}, false);
  }
}

// The sum of v over the 32 lanes of the warp, bitwise the same in every lane (each butterfly step adds the same
// two values in every lane: a + b == b + a). Every lane of the warp must call it together.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Calls f(acc_t(x_i)) for the elements this thread owns, in for_each_vector's order.
template <typename acc_t, typename scalar_t, typename F>
__device__ __forceinline__ void for_each_element(const scalar_t* __restrict__ x, int64_t n, F&& f) {
  for_each_vector<acc_t>(x, n, [&](const acc_t* e, auto count, bool) {
#pragma unroll
    for (int j = 0; j < decltype(count)::value; ++j) f(e[j]);
  });
}

template <typename T>
struct Pair {
  T a;
  T b;
};

struct PairSum {
  template <typename T>
  __device__ __forceinline__ Pair<T> operator()(const Pair<T>& x, const Pair<T>& y) const {
    return Pair<T>{x.a + y.a, x.b + y.b};
  }
};

struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(const T& x, const T& y) const {
    return x + y;
  }
};

// The last-block-done pattern: every thread calls it once its writes for the last block are made (global memory);
// it returns, in every thread, whether this block is the last of the grid to arrive at the counter, and in that
// block every other block's writes are then visible. The caller's last block resets *counter for the next launch.
__device__ __forceinline__ bool arrive_last(unsigned int* counter) {
  __threadfence();  // this thread's writes are visible to every block before the counter says so
  __syncthreads();
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __threadfence();  // the acquire side, at the thread that observed the counter, before the barrier hands it on
  }
  __syncthreads();
  if (is_last) __threadfence();
  return is_last;
}

// The block-wide combination of v under op, valid in thread 0, for blocks of THREADS threads. Safe to call
// repeatedly in one kernel.
template <int THREADS = kThreads, typename T, typename Op>
__device__ __forceinline__ T block_reduce(const T& v, Op op) {
  using Reduce = cub::BlockReduce<T, THREADS>;
  __shared__ typename Reduce::TempStorage storage;
  __syncthreads();  // a previous call's readers are done with storage
  return Reduce(storage).Reduce(v, op);
}

// The block-wide sum of v in every thread of the block (block_reduce's, passed on through shared memory); its
// barriers also make every thread's earlier writes visible to the whole block. Safe to call repeatedly.
template <int THREADS = kThreads, typename T>
__device__ __forceinline__ T block_sum_to_all(const T& v) {
  __shared__ T total;
  const T sum = block_reduce<THREADS>(v, Sum());
  if (threadIdx.x == 0) total = sum;
  __syncthreads();
  const T result = total;
  __syncthreads();  // every thread has read total before a next call writes it
  return result;
}

// Combines count partials in a fixed order with one block of THREADS threads: thread j takes j, j + THREADS, ...
// then the block tree. Valid in thread 0.
template <int THREADS = kThreads, typename T, typename Op>
__device__ __forceinline__ T reduce_partials(const T* partials, int64_t count, T identity, Op op) {
  T v = identity;
  for (int64_t i = threadIdx.x; i < count; i += THREADS) v = op(v, partials[i]);
  return block_reduce<THREADS>(v, op);
}

}  // namespace dro_ext::cuda
