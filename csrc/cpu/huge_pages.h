// Large outputs of the elementwise kernels are fresh allocations that the kernel touches for the first
// time; with 4 KiB pages that first touch costs one page fault per 4 KiB, which on the machines we measured
// takes longer than writing the data (bench/results/loss.md). Asking for transparent huge pages on the
// untouched range before the kernel writes it turns that into one fault per 2 MiB, as PyTorch's own
// THP_MEM_ALLOC_ENABLE does for every CPU allocation.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dro_ext::cpu {

inline void advise_huge_pages(void* data, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHugePage = size_t(2) << 20;
  if (nbytes < 2 * kHugePage) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + nbytes) & ~(kHugePage - 1);
  if (end > begin) {
    // Advice only: where the kernel declines (THP disabled), the pages are simply 4 KiB ones.
    (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#else
  (void)data;
  (void)nbytes;
#endif
}

}  // namespace dro_ext::cpu
