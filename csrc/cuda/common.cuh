// Device helpers shared by the CUDA kernels of the loss and the robust objective: scalars read on the device,
// the launch configuration, vectorized grid-stride loops and deterministic block reductions.
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
#include <type_traits>

#include "cuda/divergence_dispatch.cuh"
#include "divergences.h"

namespace dro_ext::cuda {

constexpr int kThreads = 256;
// At most this many blocks per reduction: about one wave of 256-thread blocks on an H100 (132 SMs x 8),
// and few enough partials for one block to combine. A constant, so the summation tree depends on N only.
constexpr int64_t kMaxReduceBlocks = 1024;
constexpr int64_t kMaxMapBlocks = 65535 * 4;

// A 0-d floating tensor read on the device: the pointer and its dtype, so that no kernel is instantiated
// per dtype of eta/grad/multiplier and nothing is copied to the host.
struct ScalarRef {
  const void* ptr;
  int kind;  // 0 float, 1 double, 2 half, 3 bfloat16

  __device__ __forceinline__ double read() const {
    switch (kind) {
      case 1:
        return *static_cast<const double*>(ptr);
      case 2:
        return static_cast<double>(static_cast<float>(*static_cast<const c10::Half*>(ptr)));
      case 3:
        return static_cast<double>(static_cast<float>(*static_cast<const c10::BFloat16*>(ptr)));
      default:
        return static_cast<double>(*static_cast<const float*>(ptr));
    }
  }
};

inline int scalar_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return 1;
    case at::kHalf: return 2;
    case at::kBFloat16: return 3;
    default: return 0;
  }
}

inline ScalarRef scalar_ref(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() == 0 && t.is_cuda());
  const auto type = t.scalar_type();
  TORCH_CHECK_TYPE(type == at::kFloat || type == at::kDouble || type == at::kHalf || type == at::kBFloat16,
                   "dro_ext: expected a float16, bfloat16, float32 or float64 scalar, got ", type);
  return ScalarRef{t.const_data_ptr(), scalar_kind(t)};
}

inline ScalarRef scalar_ref(const double* device_ptr) { return ScalarRef{device_ptr, 1}; }

// A 0-d floating output tensor written on the device, whatever its dtype.
struct ScalarOut {
  void* ptr;
  int kind;  // as ScalarRef

  __device__ __forceinline__ void write(double v) const {
    switch (kind) {
      case 1: *static_cast<double*>(ptr) = v; break;
      case 2: *static_cast<c10::Half*>(ptr) = c10::Half(static_cast<float>(v)); break;
      case 3: *static_cast<c10::BFloat16*>(ptr) = c10::BFloat16(static_cast<float>(v)); break;
      default: *static_cast<float*>(ptr) = static_cast<float>(v); break;
    }
  }
};

inline ScalarOut scalar_out(at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() == 0 && t.is_cuda() && at::isFloatingType(t.scalar_type()));
  return ScalarOut{t.mutable_data_ptr(), scalar_kind(t)};
}

// shift = scale * (*ref) + offset, in double, read once per thread (the CPU kernels form G*eta in double too).
struct ShiftRef {
  ScalarRef ref;
  double scale;
  double offset;
  __device__ __forceinline__ double read() const { return scale * ref.read() + offset; }
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

// The block-wide combination of v under op, valid in thread 0. Safe to call repeatedly in one kernel.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(const T& v, Op op) {
  using Reduce = cub::BlockReduce<T, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __syncthreads();  // a previous call's readers are done with storage
  return Reduce(storage).Reduce(v, op);
}

// Combines count partials in a fixed order with one block: thread j takes j, j + kThreads, ... then the block
// tree. Valid in thread 0.
template <typename T, typename Op>
__device__ __forceinline__ T reduce_partials(const T* partials, int count, T identity, Op op) {
  T v = identity;
  for (int i = threadIdx.x; i < count; i += kThreads) v = op(v, partials[i]);
  return block_reduce(v, op);
}

// The k-th derivative of psi* (0: the value).
// ORDER 0, 1, 2: psi*, psi*', psi*''; kExcessFirst: psi*' - 1, accurate where psi*' is near 1 (large lam).
constexpr int kExcessFirst = 3;

template <int ORDER, typename Div, typename T>
__device__ __forceinline__ T derivative(const Div& div, T t) {
  if constexpr (ORDER == kExcessFirst) {
    return div.excess_first(t);
  } else if constexpr (ORDER == 0) {
    return div.value(t);
  } else if constexpr (ORDER == 1) {
    return div.first(t);
  } else {
    return div.second(t);
  }
}

template <typename Div, typename T>
__device__ __forceinline__ T derivative(const Div& div, T t, int order) {
  return order == 0 ? div.value(t) : (order == 1 ? div.first(t) : div.second(t));
}

// The per-element term of the loss VALUE, in one place: L = lam * mean_i value_term(div, t_i, l_i, shift, inv_lam),
// with value_term = psi*(t) + shift / lam formed as l / lam + excess(t) (divergences.h's penalized_value, divided
// by lam: it keeps its precision as lam grows, and takes psi*(t) itself where t is infinite).
template <typename Div, typename T>
__device__ __forceinline__ T value_term(const Div& div, T t, T l, T shift, T inv_lam) {
  return penalized_value(div, t, l * inv_lam, T(1), shift * inv_lam);
}

// Per-thread sums of (value_term, psi*') for a divergence with a coarse value (divergences.h: kl, kl_cvar,
// smoothed_cvar, whose accurate excess costs an expm1 and a log1p on top of first()'s exponential; callers take it
// only where div.coarse_ok()). As csrc/cpu/kernels_impl.h's reduce_coarse does per block of 512 losses, each warp's
// 32 vectors (128 float32 losses) whose mean of min(|t|, 1) is at least 1/2 sum the coarse value, which shares
// first()'s exponential: there its error, a few roundings of 1 + |psi*(t)|, is within a small factor of the
// accurate term's (min: one huge |t| cannot send its small neighbours to the coarse terms). Any other warp (the ERM
// regime, and NaN) sums value_term itself. The choice is the warp's, not each lane's: a lane-by-lane choice sent nearly
// every warp down both paths (some lane of 32 almost always falls short), and on an H100 smoothed_cvar's forward
// then took 77 us at 2^24 against chi2's 32 (bench/results/h100_2026-11-27). Vectors outside a whole-warp
// iteration (the grid's last, the head and the tail) choose alone.
// The coarse terms enter as sum value_term = sum psi*(t) + count shift / lam (value_term = psi*(t) + shift / lam);
// smoothed_cvar's coarse value is summed in product form, its factors (in [1, 2]) multiplied 16 at a time between
// logarithms: about an instruction a loss, and the flush runs in any thread that owns four float32 vectors
// (reduce_blocks gives most threads ~4 from n = 4096 on), not only past 2^24. Every sum sees its terms in the
// thread's fixed order: deterministic.
template <typename scalar_t, typename Div>
__device__ __forceinline__ Pair<at::opmath_type<scalar_t>> thread_loss_sums_coarse(
    const scalar_t* __restrict__ x, int64_t n, const Div& div, at::opmath_type<scalar_t> shift,
    at::opmath_type<scalar_t> inv_lam) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kProduct = requires { requires Div::kCoarseValueAsProduct; };
  constexpr int kFlush = 16;  // factors per product: at most 2^16
  acc_t accurate = 0, first = 0, coarse = 0, coarse_count = 0;
  acc_t log_product = 0, product = 1;  // kProduct only
  int factors = 0;
  for_each_vector<acc_t>(x, n, [&](const acc_t* l, auto count, bool whole_warp) {
    constexpr int K = decltype(count)::value;
    acc_t t[K];
    acc_t abs_t = 0;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      t[j] = (l[j] - shift) * inv_lam;
      abs_t += ::fmin(::fabs(t[j]), acc_t(1));  // fmin returns 1 for a NaN |t|: the NaN is in t and first
      first += div.first(t[j]);
    }
    if (whole_warp ? warp_sum(abs_t) >= static_cast<acc_t>(16 * K) : abs_t >= static_cast<acc_t>(0.5 * K)) {
      coarse_count += static_cast<acc_t>(K);
#pragma unroll
      for (int j = 0; j < K; ++j) {
        if constexpr (kProduct) {
          coarse += div.coarse_linear(t[j]);
          product *= div.coarse_factor(t[j]);
        } else {
          coarse += div.coarse_value(t[j]);
        }
      }
      if constexpr (kProduct) {
        factors += K;
        if (factors >= kFlush) {
          log_product += ::log(product);
          product = 1;
          factors = 0;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < K; ++j) accurate += value_term(div, t[j], l[j], shift, inv_lam);
    }
  });
  if constexpr (kProduct) {
    coarse = static_cast<acc_t>(div.coarse_scale()) *
             (coarse + (log_product + ::log(product)) + coarse_count * static_cast<acc_t>(div.coarse_offset()));
  }
  return Pair<acc_t>{accurate + (coarse + coarse_count * (shift * inv_lam)), first};
}

// Per-thread partial sums of (derivative A, derivative B) of psi* at t_i = (x_i - shift) * inv_lam over the
// elements this thread owns; A == 0 is the loss value term (with B == 1, through the coarse value where the
// divergence has one: thread_loss_sums_coarse).
template <int A, int B, typename scalar_t, typename Div>
__device__ __forceinline__ Pair<at::opmath_type<scalar_t>> thread_derivative_sums(
    const scalar_t* __restrict__ x, int64_t n, const Div& div, at::opmath_type<scalar_t> shift,
    at::opmath_type<scalar_t> inv_lam) {
  using acc_t = at::opmath_type<scalar_t>;
  if constexpr (A == 0 && B == 1 && requires { requires Div::kHasCoarseValue; }) {
    if (div.coarse_ok()) return thread_loss_sums_coarse(x, n, div, shift, inv_lam);
  }
  {
    Pair<acc_t> s{acc_t(0), acc_t(0)};
    for_each_element<acc_t>(x, n, [&](acc_t l) {
      const acc_t t = (l - shift) * inv_lam;
      if constexpr (A == 0) {
        s.a += value_term(div, t, l, shift, inv_lam);
      } else {
        s.a += derivative<A>(div, t);
      }
      s.b += derivative<B>(div, t);
    });
    return s;
  }
}

// Launch checks on the current stream (no sync).
#define DRO_EXT_CUDA_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()

}  // namespace dro_ext::cuda
