#pragma once
// CUDA's execution model, as much of it as csrc/cuda/*.cu use, on the CPU (see emulate.py). A launch
// emulate_launch(kernel, grid, block, args...) runs its blocks one after another, each on `block` std::threads
// (the block size of that launch: blockDim and gridDim are set per launch) that meet at a std::barrier for
// every __syncthreads() and at the end of the block; __shared__ variables are statics (one block at a time).
// A thread that returns early drops out of the block's __syncthreads barrier, as an exited CUDA thread does.
// A device-side assert (CUDA_KERNEL_ASSERT) or an exception in a thread ends the launch with an error after
// the block, where CUDA would poison the context: the op raises it on the host instead.
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <cmath>
#include <math.h>  // the float overloads of ::exp, ::log, ... in the global namespace, as CUDA's headers have
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline thread_local dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0};
inline dim3 blockDim{0, 0, 0}, gridDim{0, 0, 0};  // one launch at a time

// The generation of the block's __syncthreads barrier: bumped by the barrier's completion, so that every
// thread reads the same value between two barriers (the BlockReduce shim uses it to catch a TempStorage
// reused without a __syncthreads in between).
inline std::atomic<unsigned long> emu_generation{0};
struct EmuBump {
  void operator()() noexcept { emu_generation.fetch_add(1, std::memory_order_relaxed); }
};
inline std::optional<std::barrier<EmuBump>> emu_sync;  // the current block's __syncthreads barrier

// DRO_EXT_EMULATION_CHAOS=1: each thread sleeps a random 0-63 us before and after every __syncthreads and at the
// start of each block, so that the threads of a block interleave differently from run to run: a read of shared
// or global memory that only a missing barrier orders then fails more often than by the scheduler's chance.
inline const bool emu_chaos = [] {
  const char* v = std::getenv("DRO_EXT_EMULATION_CHAOS");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}();
inline void emu_jitter() {
  if (!emu_chaos) return;
  thread_local std::minstd_rand rng(std::hash<std::thread::id>{}(std::this_thread::get_id()));
  std::this_thread::sleep_for(std::chrono::microseconds(rng() % 64));
}
inline void __syncthreads() {
  emu_jitter();
  emu_sync->arrive_and_wait();
  emu_jitter();
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// Warps: the 32 threads of each warp meet at a barrier of their own for every full-mask shuffle. A lane that
// has returned drops out of it and is counted, so that a shuffle a returned lane would be named in (undefined on
// a GPU) fails here instead of reading a stale value.
inline std::vector<std::unique_ptr<std::barrier<>>> emu_warp_sync;
inline std::unique_ptr<std::atomic<unsigned>[]> emu_warp_exited;
alignas(16) inline unsigned char emu_lane_slot[1024][16];
inline void emu_reset_warps(unsigned threads) {
  emu_warp_sync.clear();
  for (unsigned w = 0; w * 32 < threads; ++w) {
    emu_warp_sync.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - w * 32)));
  }
  emu_warp_exited.reset(new std::atomic<unsigned>[emu_warp_sync.size()]());
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  static_assert(sizeof(T) <= 16, "emulated __shfl_xor_sync: at most 16 bytes");
  const unsigned t = threadIdx.x, w = t / 32;
  if (mask != 0xffffffffu || (w + 1) * 32 > blockDim.x || lane_mask < 0 || lane_mask > 31) {
    throw std::runtime_error("emulated __shfl_xor_sync: only full-warp masks within whole warps are emulated");
  }
  emu_jitter();
  std::memcpy(emu_lane_slot[t], &v, sizeof(T));
  emu_warp_sync[w]->arrive_and_wait();
  const bool lane_missing = emu_warp_exited[w].load() != 0;
  T out;
  std::memcpy(&out, emu_lane_slot[(t & ~31u) | ((t % 32) ^ static_cast<unsigned>(lane_mask))], sizeof(T));
  emu_warp_sync[w]->arrive_and_wait();
  if (lane_missing) throw std::runtime_error("emulated __shfl_xor_sync: a lane of the mask has returned");
  return out;
}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

// Device intrinsics the kernels use.
template <typename T>
T atomicAdd(T* address, T v) {
  static_assert(std::is_integral_v<T>, "emulated atomicAdd: integers only (the kernels use no float atomics)");
  return std::atomic_ref<T>(*address).fetch_add(v);
}
template <typename T>
T __ldcg(const T* p) { return *p; }

struct EmuDeviceAssert : std::runtime_error {
  using std::runtime_error::runtime_error;
};
#define EMU_KERNEL_ASSERT(cond)                                                                                \
  do {                                                                                                         \
    if (!(cond)) {                                                                                             \
      throw EmuDeviceAssert(std::string("emulated device-side assert triggered: ") + #cond + " (block " +    \
                            std::to_string(blockIdx.x) + ", thread " + std::to_string(threadIdx.x) + ")");     \
    }                                                                                                          \
  } while (0)

using std::isfinite;
using std::isinf;
using std::isnan;
using std::sqrt;

// DRO_EXT_EMULATION_BLOCK_ORDER=reverse|shuffle: the blocks of each launch run in reverse order, or in an order
// scrambled anew for each launch (block i runs as blockIdx (a*i + c) mod grid, a coprime to grid), instead of 0, 1,
// 2, ...: a GPU runs blocks in no set order, so a kernel whose result depends on which block runs first or last
// (a "last block" combine that assumes it is block grid-1, say) fails here too.
inline const int emu_block_order_mode = [] {
  const char* v = std::getenv("DRO_EXT_EMULATION_BLOCK_ORDER");
  if (v == nullptr || v[0] == '\0' || std::string(v) == "forward") return 0;
  if (std::string(v) == "reverse") return 1;
  if (std::string(v) == "shuffle") return 2;
  throw std::runtime_error("DRO_EXT_EMULATION_BLOCK_ORDER must be forward, reverse or shuffle");
}();
struct EmuBlockOrder {
  unsigned grid;
  unsigned long long a = 1, c = 0;
  explicit EmuBlockOrder(unsigned grid_) : grid(grid_) {
    if (emu_block_order_mode != 2 || grid < 2) return;
    static std::mt19937_64 rng(20261126);
    c = rng() % grid;
    for (a = rng() % grid | 1; std::gcd(a, static_cast<unsigned long long>(grid)) != 1; a = (a + 2) % grid) {
    }
  }
  unsigned operator()(unsigned i) const {
    if (emu_block_order_mode == 1) return grid - 1 - i;
    return static_cast<unsigned>((a * i + c) % grid);
  }
};

struct EmuBlockEnd {
  unsigned* block;
  unsigned threads;
  void operator()() noexcept {
    ++*block;
    emu_sync.emplace(threads, EmuBump{});  // a fresh barrier: threads that returned early dropped out of the old
    emu_reset_warps(threads);
  }
};

template <typename K, typename G, typename B, typename... A>
void emulate_launch(K kernel, G grid_arg, B block_arg, A... args) {
  const long long grid_ll = static_cast<long long>(grid_arg), block_ll = static_cast<long long>(block_arg);
  if (grid_ll < 1 || grid_ll > 0x7fffffffLL) throw std::runtime_error("emulated launch: invalid grid size " + std::to_string(grid_ll));
  if (block_ll < 1 || block_ll > 1024) throw std::runtime_error("emulated launch: invalid block size " + std::to_string(block_ll));
  const unsigned grid = static_cast<unsigned>(grid_ll), threads = static_cast<unsigned>(block_ll);
  blockDim = dim3(threads);
  gridDim = dim3(grid);
  unsigned block = 0;
  const EmuBlockOrder order(grid);
  emu_sync.emplace(threads, EmuBump{});
  emu_reset_warps(threads);
  std::barrier<EmuBlockEnd> end(threads, EmuBlockEnd{&block, threads});
  std::mutex error_mutex;
  std::exception_ptr error;
  auto body = [&](unsigned t) {
    threadIdx = dim3(t, 0, 0);
    while (block < grid) {  // block is only written by the end barrier's completion
      blockIdx = dim3(order(block), 0, 0);
      try {
        emu_jitter();
        kernel(args...);  // each thread gets its own copies of the arguments, as on the device
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
      emu_sync->arrive_and_drop();
      emu_warp_exited[t / 32].fetch_add(1);
      emu_warp_sync[t / 32]->arrive_and_drop();
      end.arrive_and_wait();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& th : pool) th.join();
  emu_sync.reset();
  if (error) std::rethrow_exception(error);
}
