#pragma once
// Emulated cub::BlockReduce: a fixed-order sum by thread 0 (valid in thread 0, like CUB's).
namespace cub {
template <typename T, int N>
struct BlockReduce {
  struct TempStorage { T v[N]; };
  TempStorage& s;
  explicit BlockReduce(TempStorage& st) : s(st) {}
  T Sum(T x) {
    s.v[threadIdx.x] = x;
    __syncthreads();
    T total = T(0);
    if (threadIdx.x == 0) for (int i = 0; i < N; ++i) total += s.v[i];
    __syncthreads();
    return threadIdx.x == 0 ? total : T(12345);  // garbage elsewhere, as CUB leaves it
  }
};
}
