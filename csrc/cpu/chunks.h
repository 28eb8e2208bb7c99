// The fixed cut of a reduction into chunks, shared by every CPU reduction (kernels_impl.h, the robust solvers).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/sum.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace dro_ext::cpu {

// Reductions are cut into chunks of this many elements, independent of the thread count, so that the
// result is bitwise repeatable; each chunk is summed in blocks to keep the float32 rounding error small.
// (The optimizer step chunks its tensors on its own: kStepChunk in csrc/normalized_sgd.cpp.)
constexpr int64_t kReductionChunk = 16384;

// A reduction into `width` accumulators per part (weight_stats' group masses, group_sums' per-group sums) cuts
// [0, n) into parts of whole chunks, each summed by one thread into its own row of partials: as many parts as keep
// parts * width within kPartialsBudget accumulators (one part at least), so the partials take O(width) memory
// whatever n is. The cut depends on n and width only, so the result does not depend on the thread count.
constexpr int64_t kPartialsBudget = int64_t{1} << 22;

// The number of elements of each part (the last may be shorter): a multiple of kReductionChunk.
inline int64_t part_size(int64_t n, int64_t width) {
  const int64_t chunks = std::max<int64_t>(1, (n + kReductionChunk - 1) / kReductionChunk);
  const int64_t parts = std::min(chunks, std::max<int64_t>(1, kPartialsBudget / std::max<int64_t>(1, width)));
  return ((chunks + parts - 1) / parts) * kReductionChunk;
}

// f(c, begin, end) for every chunk c = [begin, end) of [0, n), on the thread pool.
template <typename F>
void for_each_chunk(int64_t n, const F& f) {
  const int64_t num_chunks = (n + kReductionChunk - 1) / kReductionChunk;
  at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      f(c, c * kReductionChunk, std::min(n, (c + 1) * kReductionChunk));
    }
  });
}

// chunk_result(begin, end) for every chunk [begin, end) of [0, n), in chunk order: the caller combines them
// in that order, whichever thread computed which.
template <typename Result, typename F>
std::vector<Result> map_chunks(int64_t n, const F& chunk_result) {
  std::vector<Result> results((n + kReductionChunk - 1) / kReductionChunk);
  for_each_chunk(n, [&](int64_t c, int64_t begin, int64_t end) { results[c] = chunk_result(begin, end); });
  return results;
}

// at::sum splits a CPU tensor of more than this many elements between threads (ATen's grain size, at::internal::
// GRAIN_SIZE in TensorIterator.h), in as many parts as it has threads: the rounding then depends on the thread count.
constexpr int64_t kSingleThreadSum = 32768;

// Whether at::sum over every element of x (or the backward of an expand over it) depends on the thread count: a CPU
// tensor past kSingleThreadSum. A traced call with symbolic sizes, torch.compile's, counts as not: its graph's
// reductions are the compiler's.
inline bool sums_split_by_thread_count(const at::Tensor& x) {
  return x.is_cpu() && !x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() && x.numel() > kSingleThreadSum;
}

// The sum of every element of x in the accumulate dtype `acc`, the same bits whatever the thread count: at::sum of
// a CPU tensor longer than kSingleThreadSum is split between threads, so a longer one is summed as rows of
// kReductionChunk (each row by one thread, zeros padding the last) and then the rows (the fallback's fixed_order_sum,
// dro_ext/_divergences.py). CUDA's sums take a tree fixed by the size: at::sum as it is. (The autograd formulas'
// sums over the losses.)
inline at::Tensor fixed_order_sum(const at::Tensor& x, at::ScalarType acc) {
  if (!sums_split_by_thread_count(x)) {
    return at::sum(x, acc);
  }
  const at::Tensor flat = x.reshape({-1});
  const int64_t padding = (kReductionChunk - flat.numel() % kReductionChunk) % kReductionChunk;
  return at::sum(at::sum(at::constant_pad_nd(flat, {0, padding}).view({-1, kReductionChunk}), {1}, false, acc));
}

// A 0-d s broadcast over the 1-D `like` (s.expand(like.sizes())), whose gradient autograd sums as fixed_order_sum
// does: the backward of one expand over n elements is an at::sum over n, split between threads past
// kSingleThreadSum; here it is two expands, a row of kReductionChunk per element of a column and the column per s,
// each of whose backward sums keeps every output on one thread (the fallback's fixed_order_broadcast). For the
// autograd formulas that a double backward differentiates.
inline at::Tensor fixed_order_broadcast(const at::Tensor& s, const at::Tensor& like) {
  if (!sums_split_by_thread_count(like)) {
    return s.expand(like.sizes());
  }
  const int64_t n = like.numel();
  const int64_t rows = (n + kReductionChunk - 1) / kReductionChunk;
  return s.reshape({1, 1}).expand({rows, 1}).expand({rows, kReductionChunk}).reshape({-1}).narrow(0, 0, n);
}

}  // namespace dro_ext::cpu
