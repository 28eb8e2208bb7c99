#pragma once
// The parts of CUB that csrc/cuda/*.cu use, emulated on the CPU (prelude.h first).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
