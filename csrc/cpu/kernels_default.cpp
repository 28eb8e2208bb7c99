// The portable build of the CPU kernels (ATen's generic vectors; what the compiler vectorizes itself).
#define DRO_EXT_CAPABILITY_DEFAULT
#include "cpu/kernel_tables.h"

DRO_EXT_KERNEL_TABLES(default)
