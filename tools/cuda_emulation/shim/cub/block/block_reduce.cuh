#pragma once
// Emulated cub::BlockReduce (prelude.h first): Sum and Reduce(v, op) combine the threads' values in a fixed
// order (thread 0's, then 1's, ...), in thread 0, like CUB valid in thread 0 only: the other threads get
// garbage (all bits set: NaN for floating members). Like CUB there is no barrier after the reduction, so a
// TempStorage reused without a __syncthreads in between is a race on the GPU: the shim raises it here.
#include <cstring>

#include <cub/block/block_storage.cuh>
namespace cub {
template <typename T, int N>
struct BlockReduce {
  using TempStorage = emu_detail::BlockStorage<T, N>;
  TempStorage& s;
  explicit BlockReduce(TempStorage& st) : s(st) {}

  template <typename Op>
  T Reduce(const T& x, Op op) {
    s.publish(x, "BlockReduce");
    if (threadIdx.x == 0) {
      T total = s.v[0];
      for (int i = 1; i < N; ++i) total = op(total, s.v[i]);
      return total;
    }
    T garbage;
    std::memset(static_cast<void*>(&garbage), 0xff, sizeof(T));
    return garbage;
  }
  T Sum(const T& x) {
    return Reduce(x, [](const T& a, const T& b) { return a + b; });
  }
};
}  // namespace cub
