// The body of kernels_default.cpp, kernels_avx2.cpp and kernels_avx512.cpp: each compiles the CPU kernels
// (kernels_impl.h, cross_entropy_impl.h) for one SIMD capability and defines that build's kernel tables.
// The including file defines DRO_EXT_CAPABILITY_AVX2 or DRO_EXT_CAPABILITY_AVX512 first (only on x86-64;
// elsewhere the wider builds are the portable one), then DRO_EXT_KERNEL_TABLES(its name).
#pragma once

#define DRO_EXT_STRINGIFY_(x) #x
#define DRO_EXT_STRINGIFY(x) DRO_EXT_STRINGIFY_(x)

#if defined(DRO_EXT_CAPABILITY_AVX2) || defined(DRO_EXT_CAPABILITY_AVX512) || defined(DRO_EXT_CAPABILITY_DEFAULT)
#include "cpu/cross_entropy_impl.h"
#include "cpu/kernels_impl.h"
#include "cpu/bracket_impl.h"

#define DRO_EXT_KERNEL_TABLES(build)                                                                     \
  namespace dro_ext::cpu {                                                                               \
  const KernelTable& kernels_##build() {                                                                 \
    static const KernelTable table{reduce_impl,         map_derivative_impl, min_max_impl,                \
                                   exp_shifted_impl,    bracket_counts_impl, gather_bracket_impl,         \
                                   DRO_EXT_STRINGIFY(build)};                                             \
    return table;                                                                                        \
  }                                                                                                      \
  const CrossEntropyKernelTable& cross_entropy_kernels_##build() {                                       \
    static const CrossEntropyKernelTable table{cross_entropy_forward_impl, cross_entropy_backward_impl, \
                                               logsumexp_columns_impl, DRO_EXT_STRINGIFY(build)};        \
    return table;                                                                                        \
  }                                                                                                      \
  }
#else
#include "cpu/cross_entropy_kernels.h"
#include "cpu/kernels.h"

#define DRO_EXT_KERNEL_TABLES(build)                                                                            \
  namespace dro_ext::cpu {                                                                                      \
  const KernelTable& kernels_##build() { return kernels_default(); }                                            \
  const CrossEntropyKernelTable& cross_entropy_kernels_##build() { return cross_entropy_kernels_default(); } \
  }
#endif
