// The AVX-512 (F, BW, VL, DQ) build of the CPU kernels, chosen at run time where the processor has them
// (csrc/cpu/kernel_selection.cpp): twice the lanes of the AVX2 build for the compute-bound exponential
// divergences.
#if defined(__x86_64__) || defined(_M_X64)
#define DRO_EXT_CAPABILITY_AVX512
#endif
#include "cpu/kernel_tables.h"

DRO_EXT_KERNEL_TABLES(avx512)
