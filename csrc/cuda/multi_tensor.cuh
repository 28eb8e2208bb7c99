// Multi-tensor launches: one kernel launch works on a list of tensors (up to kMaxTensorsPerLaunch, all of one
// dtype), each cut into chunks of kMultiTensorChunk elements, one block per chunk. The tensors' pointers and sizes
// travel in the kernel's parameters, never through a host-to-device copy: no sync, and the launch can be captured
// in a CUDA graph. This file is the infrastructure only (which block works on which chunk, the launches, the
// vectorized loop over a chunk); the math is a functor the kernel calls once per block:
//
//   template <typename scalar_t> struct Op {
//     __device__ void operator()(const TensorChunks<DEPTH>& list, const ChunkOfBlock& chunk, Args... args) const;
//   };
//   launch_multi_tensor<Op>(launch, stream, args...);
//
// Chunk boundaries and the block that owns each chunk depend only on the list, so a functor that writes one result
// per chunk (at chunk.in_call) and combines them in a fixed order is bitwise repeatable.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/irange.h>

#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "cuda/common.cuh"

namespace dro_ext::cuda {

// Threads per block of a multi-tensor kernel.
constexpr int kMultiTensorThreads = 512;
// Elements per chunk, i.e. per block: 32 per thread, 4 (half) to 16 (float64) 16-byte loads.
constexpr int64_t kMultiTensorChunk = 16384;
// 16-byte loads each thread issues before their first use, to keep more bytes in flight.
constexpr int kMultiTensorUnroll = 4;
// Tensors per launch: a ResNet-18 (62 tensors) takes one launch, and the metadata (DEPTH + 1.5 words per tensor)
// leaves room for the functor's arguments within the 4 KiB of kernel parameters that every CUDA version accepts.
constexpr int kMaxTensorsPerLaunch = 64;
constexpr size_t kMaxKernelParameterBytes = 4000;  // 4096, less a margin for alignment

// The tensors of one launch: DEPTH operands per tensor (data[d][t] is operand d of tensor t; the functor knows
// their types). Block b works on tensor t, the one with block_end[t - 1] <= b < block_end[t].
template <int DEPTH>
struct TensorChunks {
  void* data[DEPTH][kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int32_t block_end[kMaxTensorsPerLaunch];  // blocks of this launch up to and including tensor t's chunks
  int32_t num_tensors;
  int32_t first_tensor;  // the index of tensor 0 among all the tensors of the call (every launch together)
  int64_t first_chunk;   // the index of block 0's chunk among all the chunks of the call
};

// Chunks of a tensor of numel elements. An empty tensor still gets one (empty) chunk, so that its block runs: a
// functor may have per-tensor work beside the elements (a step count).
C10_HOST_DEVICE inline int64_t chunks_of(int64_t numel) {
  return numel == 0 ? 1 : (numel + kMultiTensorChunk - 1) / kMultiTensorChunk;
}

// The chunk a block works on.
struct ChunkOfBlock {
  int tensor;       // in the launch's list
  int64_t index;    // among the tensor's chunks
  int64_t begin;    // its first element in the tensor
  int64_t size;     // its elements (kMultiTensorChunk, fewer in a tensor's last chunk)
  int64_t in_call;  // among all the chunks of the call, in launch order: where a per-chunk result goes
};

template <int DEPTH>
__device__ __forceinline__ ChunkOfBlock chunk_of_block(const TensorChunks<DEPTH>& list) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  int lo = 0, hi = list.num_tensors - 1;  // the first t with block_end[t] > b
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (list.block_end[mid] > b) hi = mid; else lo = mid + 1;
  }
  const int32_t first_block = lo == 0 ? 0 : list.block_end[lo - 1];
  const int64_t index = b - first_block;
  const int64_t begin = index * kMultiTensorChunk;
  const int64_t left = list.numel[lo] - begin;
  return {lo, index, begin, left < kMultiTensorChunk ? left : kMultiTensorChunk, list.first_chunk + b};
}

template <int DEPTH, typename Op, typename... Args>
__global__ void __launch_bounds__(kMultiTensorThreads) multi_tensor_kernel(TensorChunks<DEPTH> list, Op op,
                                                                           Args... args) {
  op(list, chunk_of_block(list), args...);
}

// op(w_i, r_i) on each of the n elements of one chunk, w read and written in place, r read, by the block's
// kMultiTensorThreads threads. Where both are 16-byte aligned, in whole 16-byte vectors with kMultiTensorUnroll
// vectors in flight per thread (a thread's loads all issue before the first use), then the elements past the last
// whole vector one by one. The order of the calls a thread makes is fixed, so a sum the op keeps is the same bits
// every run.
template <typename scalar_t, typename Op>
__device__ __forceinline__ void for_each_element_pair(scalar_t* __restrict__ w, const scalar_t* __restrict__ r,
                                                      int64_t n, Op op) {
  constexpr int kVec = vec_size<scalar_t>();
  int64_t scalar_from = 0;
  if (reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(r) % 16 == 0) {
    using Vec = AlignedVec<scalar_t, kVec>;
    Vec* wv = reinterpret_cast<Vec*>(w);
    const Vec* rv = reinterpret_cast<const Vec*>(r);
    const int64_t num_vectors = n / kVec;
    for (int64_t base = threadIdx.x; base < num_vectors; base += kMultiTensorThreads * kMultiTensorUnroll) {
      Vec wp[kMultiTensorUnroll], rp[kMultiTensorUnroll];
#pragma unroll
      for (int u = 0; u < kMultiTensorUnroll; ++u) {
        const int64_t i = base + u * kMultiTensorThreads;
        if (i < num_vectors) {
          wp[u] = wv[i];
          rp[u] = rv[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kMultiTensorUnroll; ++u) {
        const int64_t i = base + u * kMultiTensorThreads;
        if (i < num_vectors) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) op(wp[u].v[j], rp[u].v[j]);
          wv[i] = wp[u];
        }
      }
    }
    scalar_from = num_vectors * kVec;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < n; i += kMultiTensorThreads) op(w[i], r[i]);
}

// ---------------------------------------------------------------------------------------------------------
// Host side.

// One tensor of a multi-tensor call: its DEPTH operands' data, its elements and its dtype (operand 0's).
template <int DEPTH>
struct MultiTensorOperands {
  std::array<void*, DEPTH> data;
  int64_t numel;
  at::ScalarType dtype;
};

template <int DEPTH>
struct MultiTensorLaunch {
  at::ScalarType dtype;
  TensorChunks<DEPTH> list;
  int64_t num_blocks;
};

template <int DEPTH>
struct MultiTensorPlan {
  std::vector<MultiTensorLaunch<DEPTH>> launches;
  int64_t num_chunks = 0;  // of every launch together
};

// The launches of a call: the tensors of one dtype in list order, the dtypes in a fixed order (float32, float64,
// float16, bfloat16), at most kMaxTensorsPerLaunch tensors and 2^31 - 1 blocks a launch. Chunks and tensors are
// numbered in that order (ChunkOfBlock::in_call, TensorChunks::first_tensor), so per-chunk results, and sums over
// them in index order, depend only on the list, never on timing. `name` names the list in errors.
template <int DEPTH>
MultiTensorPlan<DEPTH> plan_multi_tensor(const std::vector<MultiTensorOperands<DEPTH>>& tensors, const char* name) {
  MultiTensorPlan<DEPTH> plan;
  int32_t num_planned = 0;
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    MultiTensorLaunch<DEPTH> current{dtype, {}, 0};
    auto start_launch = [&] {
      current.list.num_tensors = 0;
      current.list.first_tensor = num_planned;
      current.list.first_chunk = plan.num_chunks;
      current.num_blocks = 0;
    };
    start_launch();
    for (const auto i : c10::irange(tensors.size())) {
      const MultiTensorOperands<DEPTH>& tensor = tensors[i];
      if (tensor.dtype != dtype) continue;
      const int64_t chunks = chunks_of(tensor.numel);
      TORCH_CHECK(chunks <= std::numeric_limits<int32_t>::max(), "dro_ext: ", name, "[", i, "] has ", tensor.numel,
                  " elements, more than one launch can take");
      if (current.list.num_tensors == kMaxTensorsPerLaunch ||
          current.num_blocks + chunks > std::numeric_limits<int32_t>::max()) {
        plan.launches.push_back(current);
        start_launch();
      }
      TensorChunks<DEPTH>& list = current.list;
      const int t = list.num_tensors++;
      for (int d = 0; d < DEPTH; ++d) list.data[d][t] = tensor.data[d];
      list.numel[t] = tensor.numel;
      current.num_blocks += chunks;
      list.block_end[t] = static_cast<int32_t>(current.num_blocks);
      plan.num_chunks += chunks;
      ++num_planned;
    }
    if (current.list.num_tensors > 0) plan.launches.push_back(current);
  }
  return plan;
}

// One launch of multi_tensor_kernel with the functor Op<scalar_t> for the launch's dtype, on stream.
template <template <typename> class Op, int DEPTH, typename... Args>
void launch_multi_tensor(const MultiTensorLaunch<DEPTH>& launch, cudaStream_t stream, const Args&... args) {
  static_assert(sizeof(TensorChunks<DEPTH>) + (sizeof(Args) + ... + 0) <= kMaxKernelParameterBytes,
                "kernel parameters must stay under the 4 KiB limit");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, launch.dtype, "dro_ext_multi_tensor", [&] {
    multi_tensor_kernel<<<static_cast<unsigned>(launch.num_blocks), kMultiTensorThreads, 0, stream>>>(
        launch.list, Op<scalar_t>{}, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace dro_ext::cuda
