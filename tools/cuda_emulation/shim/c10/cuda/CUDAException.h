#pragma once
#include <c10/util/Exception.h>
#define C10_CUDA_KERNEL_LAUNCH_CHECK() do {} while (0)
#define C10_CUDA_CHECK(expr)                                                          \
  do {                                                                                \
    const auto emu_status = (expr);                                                   \
    TORCH_CHECK(emu_status == 0, "emulated CUDA call failed: ", #expr);             \
  } while (0)
