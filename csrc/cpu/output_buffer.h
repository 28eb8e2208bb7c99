// Fresh memory for the large outputs of the elementwise kernels (the gradient of the losses, the weights).
//
// Measured on the benchmark machine (bench/results/loss.md): writing a freshly allocated 64 MiB tensor
// costs about twice writing one that was used before, because the first touch of every page faults into
// the kernel, which zeroes it. Two things remove most of that cost for outputs of at least kLargeOutput:
//  - the buffer is aligned to 2 MiB and advised to use transparent huge pages (one fault per 2 MiB);
//  - a freed buffer is kept (the kCachedBuffers most recently freed) and handed to the next request of the
//    same size, as a caching allocator does: a training loop asks for the same N-sized gradient every step,
//    and frees the previous one before (the gradient is consumed within the backward pass). The oldest
//    makes room for a newer one, so that a size no longer asked for (an earlier phase's batch, an
//    evaluation pass) is not held for good.
// DRO_EXT_CPU_BUFFER_CACHE=0 turns the cache off (then every large output is a fresh huge-page buffer).
// These buffers bypass PyTorch's CPU allocator, so each one handed out and given back is reported to the profiler
// as the allocator reports its own: torch.profiler's memory events (and the benchmarks' CPU peak memory, built on
// them) saw none of dro_ext's large outputs before.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dro_ext::cpu {

class OutputBufferCache {
 public:
  static constexpr size_t kHugePage = size_t(2) << 20;
  static constexpr size_t kLargeOutput = size_t(8) << 20;
  static constexpr size_t kCachedBuffers = 2;

  static OutputBufferCache& instance() {
    // Never destroyed: tensors that outlive static destruction still return their buffers here.
    static OutputBufferCache* cache = new OutputBufferCache();
    return *cache;
  }

  // A buffer of `bytes` (a multiple of kHugePage), from the cache or newly allocated.
  void* acquire(size_t bytes) {
    if (enabled_) {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->first == bytes) {
          void* data = it->second;
          free_.erase(it);
          return data;
        }
      }
    }
    void* data = std::aligned_alloc(kHugePage, bytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // Advice only: where transparent huge pages are off, these are ordinary pages.
    if (data != nullptr) (void)madvise(data, bytes, MADV_HUGEPAGE);
#endif
    return data;
  }

  void release(size_t bytes, void* data) {
    if (enabled_) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (free_.size() == kCachedBuffers) {
        std::free(free_.front().second);
        free_.erase(free_.begin());
      }
      free_.emplace_back(bytes, data);
      return;
    }
    std::free(data);
  }

 private:
  OutputBufferCache() {
    const char* env = std::getenv("DRO_EXT_CPU_BUFFER_CACHE");
    enabled_ = env == nullptr || std::strcmp(env, "0") != 0;
  }
  bool enabled_ = true;
  std::mutex mutex_;
  std::vector<std::pair<size_t, void*>> free_;
};

// A buffer handed out (bytes > 0) or given back (bytes < 0), as the profiler sees allocations (a thread-local
// lookup where no profiler runs). The totals are this cache's own: the bytes handed out and not given back.
inline void report_to_profiler(void* data, int64_t bytes) {
  static std::atomic<int64_t> handed_out{0};
  const int64_t total = handed_out.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  c10::reportMemoryUsageToProfiler(data, bytes, static_cast<size_t>(total), static_cast<size_t>(total),
                                   c10::Device(c10::DeviceType::CPU));
}

// An uninitialized contiguous CPU tensor of the given sizes and options (a CPU device).
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  if (bytes < OutputBufferCache::kLargeOutput) return at::empty(sizes, options);
  const size_t rounded = (bytes + OutputBufferCache::kHugePage - 1) & ~(OutputBufferCache::kHugePage - 1);
  auto& cache = OutputBufferCache::instance();
  void* data = cache.acquire(rounded);
  TORCH_CHECK(data != nullptr, "dro_ext: out of memory allocating ", rounded, " bytes");
  report_to_profiler(data, static_cast<int64_t>(rounded));
  return at::from_blob(data, sizes,
                       [rounded](void* p) {
                         report_to_profiler(p, -static_cast<int64_t>(rounded));
                         OutputBufferCache::instance().release(rounded, p);
                       },
                       options);
}

// An uninitialized contiguous tensor shaped and typed like x, on the CPU.
inline at::Tensor empty_output_like(const at::Tensor& x) { return empty_output(x.sizes(), x.options()); }

}  // namespace dro_ext::cpu
