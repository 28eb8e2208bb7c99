// The floating dtypes every kernel is compiled for (AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, ...)): the
// argument checks accept these and no others, so that a float8 tensor (a floating type to at::isFloatingType) is
// refused naming its argument instead of failing inside the dispatch macro.
#pragma once

#include <c10/core/ScalarType.h>

namespace dro_ext {

inline bool is_kernel_floating_type(c10::ScalarType dtype) {
  return dtype == c10::kHalf || dtype == c10::kBFloat16 || dtype == c10::kFloat || dtype == c10::kDouble;
}

}  // namespace dro_ext
