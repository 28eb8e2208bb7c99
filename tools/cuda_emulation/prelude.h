#pragma once
// CUDA's execution model, as much of it as csrc/cuda/normalized_sgd.cu uses, on the CPU (see emulate.py):
// a launch runs its blocks one after another, each on 512 std::threads that meet at a std::barrier for
// every __syncthreads() and at the end of the block; __shared__ variables are statics (one block at a time).
#include <barrier>
#include <cmath>
#include <thread>
#include <vector>
#include <cstdint>
struct dim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local dim3 threadIdx, blockIdx;
inline std::barrier<>* emu_barrier = nullptr;
inline void __syncthreads() { emu_barrier->arrive_and_wait(); }
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
using std::isnan;
using std::sqrt;
template <typename K, typename... A>
void emulate_launch(K kernel, unsigned grid, A... args) {
  constexpr int N = 512;  // the kernels' kThreads
  std::barrier<> bar(N);
  emu_barrier = &bar;
  std::vector<std::thread> threads;
  for (int t = 0; t < N; ++t) threads.emplace_back([&, t] {
    threadIdx.x = t;
    for (unsigned b = 0; b < grid; ++b) { blockIdx.x = b; kernel(args...); bar.arrive_and_wait(); }
  });
  for (auto& th : threads) th.join();
  emu_barrier = nullptr;
}
