#pragma once
// Emulated cub::BlockScan (prelude.h first): ExclusiveSum(x, out) gives each thread the sum of the values of the
// threads before it (0 in thread 0), in thread order. Like CUB there is no barrier after the scan, so a
// TempStorage reused without a __syncthreads in between is a race on the GPU: the shim raises it here, as the
// BlockReduce shim does.
#include <stdexcept>
#include <string>
namespace cub {
template <typename T, int N>
struct BlockScan {
  struct TempStorage {
    T v[N];
    std::atomic<unsigned long> read_generation{~0ul};  // the __syncthreads generation its last readers read in
  };
  TempStorage& s;
  explicit BlockScan(TempStorage& st) : s(st) {}

  void ExclusiveSum(const T& x, T& out) {
    if (static_cast<int>(blockDim.x) != N) {
      throw std::runtime_error("emulated cub::BlockScan<T, " + std::to_string(N) + "> in a block of " +
                               std::to_string(blockDim.x) + " threads");
    }
    if (s.read_generation.load() == emu_generation.load()) {
      throw std::runtime_error("emulated cub::BlockScan: TempStorage reused without a __syncthreads() after "
                               "its previous scan (a race on the GPU)");
    }
    s.v[threadIdx.x] = x;
    __syncthreads();
    s.read_generation.store(emu_generation.load());
    T sum = T(0);
    for (unsigned i = 0; i < threadIdx.x; ++i) sum += s.v[i];
    out = sum;
  }
};
}  // namespace cub
