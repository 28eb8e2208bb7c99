#pragma once
// Emulated cub::BlockScan (prelude.h first): ExclusiveSum(x, out) gives each thread the sum of the values of the
// threads before it (0 in thread 0), in thread order. Like CUB there is no barrier after the scan: a TempStorage
// reused without a __syncthreads in between raises here, as in the BlockReduce shim.
#include <cub/block/block_storage.cuh>
namespace cub {
template <typename T, int N>
struct BlockScan {
  using TempStorage = emu_detail::BlockStorage<T, N>;
  TempStorage& s;
  explicit BlockScan(TempStorage& st) : s(st) {}

  void ExclusiveSum(const T& x, T& out) {
    s.publish(x, "BlockScan");
    T sum = T(0);
    for (unsigned i = 0; i < threadIdx.x; ++i) sum += s.v[i];
    out = sum;
  }
};
}  // namespace cub
