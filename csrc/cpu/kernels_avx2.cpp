// The AVX2+FMA build of the CPU kernels, chosen at run time where the processor has them
// (csrc/cpu/kernel_selection.cpp).
#if defined(__x86_64__) || defined(_M_X64)
#define DRO_EXT_CAPABILITY_AVX2
#endif
#include "cpu/kernel_tables.h"

DRO_EXT_KERNEL_TABLES(avx2)
