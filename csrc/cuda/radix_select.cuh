// The j-th largest element of a floating tensor on the device, exactly, by radix select: one launch per
// kSelectDigitBits-bit digit of the element's order-preserving key (2 for half/bfloat16, 3 for float32, 6 for
// float64). Each launch counts, in a shared-memory histogram per block, the digit of every element whose higher
// digits match the ones already chosen; the blocks add their counts into one global histogram with integer
// atomics (exact in any order, so the result is deterministic), and the last block to finish picks the bin that
// holds the j-th largest and clears the histogram for the next digit. The last digit leaves the element's value
// in device memory; nothing is read on the host.
//
// Why not a device sort: cvar's robust objective needs one order statistic, and CUB's radix sort of the losses as
// float64 keys makes eight 8-bit passes, each reading and writing N doubles; this reads the losses once per digit.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/common.cuh"

namespace dro_ext::cuda {

constexpr int kSelectDigitBits = 11;
constexpr int kSelectBins = 1 << kSelectDigitBits;
static_assert(kSelectBins % kThreads == 0, "each thread of the last block owns the same number of bins");

// The bits of a floating value as an unsigned integer that orders like the value: a larger value has a larger
// key. -0.0 takes +0.0's key, as they compare equal. NaN is never passed (the callers check for it first).
template <typename scalar_t>
struct SelectKey {
  using bits_t = std::conditional_t<sizeof(scalar_t) == 8, uint64_t,
                                    std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint16_t>>;
  static constexpr int kBits = 8 * static_cast<int>(sizeof(scalar_t));
  static constexpr bits_t kSign = bits_t(bits_t(1) << (kBits - 1));

  __host__ __device__ static uint64_t of(scalar_t v) {
    if (static_cast<double>(v) == 0.0) v = scalar_t(0);
    bits_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    return (bits & kSign) ? bits_t(~bits) : bits_t(bits | kSign);
  }

  __host__ __device__ static double value(uint64_t key) {
    const bits_t k = static_cast<bits_t>(key);
    const bits_t bits = (k & kSign) ? bits_t(k ^ kSign) : bits_t(~k);
    scalar_t v;
    std::memcpy(&v, &bits, sizeof(bits));
    return static_cast<double>(v);
  }
};

// Cleared (clear_select_state) before the first digit: nothing chosen, nothing above, the counter at rest, an
// empty histogram.
struct SelectState {
  unsigned long long prefix;  // the key bits chosen so far, in place (the bits below them zero)
  unsigned long long above;   // elements whose key is above every key with that prefix
  double value;               // the j-th largest element, after the last digit
  unsigned int blocks_done;   // last-block-done counter, reset by the last block
  unsigned long long histogram[kSelectBins];
};

// Called by every thread of one block of a kernel that runs before the first digit (the robust objective's
// init_solver_kernel): a launch and a memset fewer than clearing it on its own.
__device__ __forceinline__ void clear_select_state(SelectState* state) {
  for (int i = threadIdx.x; i < kSelectBins; i += blockDim.x) state->histogram[i] = 0ull;
  if (threadIdx.x == 0) {
    state->prefix = 0ull;
    state->above = 0ull;
    state->value = 0.0;
    state->blocks_done = 0u;
  }
}

// One digit: bits [shift, shift + bits) of the key, among the elements whose bits above shift + bits equal the
// prefix. Returns at once when *skip is set (the caller's answer is already known: NaN, inf, N = 1, ...).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) select_digit_kernel(const scalar_t* __restrict__ x, int64_t n, int64_t j,
                                                                int shift, int bits, const int* skip,
                                                                SelectState* state) {
  using Key = SelectKey<scalar_t>;
  if (*skip) return;
  __shared__ unsigned int counts[kSelectBins];
  for (int i = threadIdx.x; i < kSelectBins; i += kThreads) counts[i] = 0u;
  const int decided = shift + bits;  // the bits at and above this one are the prefix
  const unsigned long long prefix = state->prefix;
  const unsigned long long rank = static_cast<unsigned long long>(j) - state->above;  // 1-based, within the prefix
  const uint64_t digit_mask = (uint64_t{1} << bits) - 1;
  __syncthreads();
  for_each_element<scalar_t>(x, n, [&](scalar_t v) {
    const uint64_t key = Key::of(v);
    if (decided >= Key::kBits || (key >> decided) == (prefix >> decided)) {
      atomicAdd(&counts[(key >> shift) & digit_mask], 1u);
    }
  });
  __syncthreads();
  for (int i = threadIdx.x; i < kSelectBins; i += kThreads) {
    if (counts[i] != 0u) atomicAdd(&state->histogram[i], static_cast<unsigned long long>(counts[i]));
  }
  if (!arrive_last(&state->blocks_done)) return;

  // Thread t owns the kPerThread bins t * kPerThread ... from the top, so the block's exclusive scan in thread
  // order counts the elements in the bins above each thread's.
  constexpr int kPerThread = kSelectBins / kThreads;
  const auto bin_of = [](int i) { return kSelectBins - 1 - (static_cast<int>(threadIdx.x) * kPerThread + i); };
  unsigned long long mine[kPerThread];
  unsigned long long local = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    mine[i] = __ldcg(&state->histogram[bin_of(i)]);  // bypass L1: added by other SMs
    state->histogram[bin_of(i)] = 0ull;              // clear for the next digit (every block is done with it)
    local += mine[i];
  }
  using Scan = cub::BlockScan<unsigned long long, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  unsigned long long before;
  Scan(scan_storage).ExclusiveSum(local, before);
  // Exactly one thread's bins hold the rank-th largest (1 <= rank <= the prefix's count, as 1 <= j <= N).
  if (before < rank && rank <= before + local) {
    unsigned long long count = before;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (rank <= count + mine[i]) {
        state->prefix = prefix | (static_cast<uint64_t>(bin_of(i)) << shift);
        state->above += count;
        if (shift == 0) state->value = Key::value(state->prefix);
        break;
      }
      count += mine[i];
    }
  }
  if (threadIdx.x == 0) state->blocks_done = 0u;
}

// Leaves the j-th largest of x (1 <= j <= N, no NaN; contiguous) in state->value, one launch per digit, unless
// *skip. state: a SelectState in device memory that an earlier launch cleared (clear_select_state).
template <typename scalar_t>
void launch_select(const scalar_t* x, int64_t n, int64_t j, const int* skip, SelectState* state, int blocks,
                   cudaStream_t stream) {
  for (int decided = SelectKey<scalar_t>::kBits; decided > 0;) {
    const int bits = decided < kSelectDigitBits ? decided : kSelectDigitBits;
    const int shift = decided - bits;
    select_digit_kernel<<<blocks, kThreads, 0, stream>>>(x, n, j, shift, bits, skip, state);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    decided = shift;
  }
}

}  // namespace dro_ext::cuda
