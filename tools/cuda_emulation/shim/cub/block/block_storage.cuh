#pragma once
// What the emulated cub::BlockReduce and cub::BlockScan share (prelude.h first): a TempStorage holding one value per
// thread, written by publish(), which also catches the two misuses that are races or errors on the GPU: a block
// size other than the template's, and a TempStorage reused without a __syncthreads() after its last readers (CUB
// puts no barrier after a reduction or a scan).
#include <stdexcept>
#include <string>
namespace cub::emu_detail {
template <typename T, int N>
struct BlockStorage {
  T v[N];
  std::atomic<unsigned long> read_generation{~0ul};  // the __syncthreads generation its last readers read in

  // Stores this thread's x and waits for the block's: then v holds every thread's value.
  void publish(const T& x, const char* primitive) {
    if (static_cast<int>(blockDim.x) != N) {
      throw std::runtime_error(std::string("emulated cub::") + primitive + "<T, " + std::to_string(N) +
                               "> in a block of " + std::to_string(blockDim.x) + " threads");
    }
    if (read_generation.load() == emu_generation.load()) {
      throw std::runtime_error(std::string("emulated cub::") + primitive + ": TempStorage reused without a "
                               "__syncthreads() after its previous use (a race on the GPU)");
    }
    v[threadIdx.x] = x;
    __syncthreads();
    read_generation.store(emu_generation.load());
  }
};
}  // namespace cub::emu_detail
