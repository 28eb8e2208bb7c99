#pragma once
// Emulated cub::DeviceRadixSort (SortKeys, SortKeysDescending, SortPairs, SortPairsDescending) over host
// pointers: a stable sort on the radix digits CUB sorts, i.e. the bits [begin_bit, end_bit) of the key after
// CUB's order-preserving twiddle (the sign bit flipped for signed integers; floating keys flipped whole when
// negative, else their sign bit, with -0.0 taken as +0.0). The two-call protocol is kept: a null d_temp_storage
// only sets temp_storage_bytes, and the second call checks it got at least that much.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;

namespace cub {
namespace emu_detail {

template <typename K>
uint64_t twiddled(K key) {
  static_assert(sizeof(K) <= 8, "emulated DeviceRadixSort: keys of at most 64 bits");
  if constexpr (std::is_floating_point_v<K>) {
    if (key == K(0)) key = K(0);  // -0.0 sorts as +0.0
    using U = std::conditional_t<sizeof(K) == 8, uint64_t, uint32_t>;
    U bits;
    std::memcpy(&bits, &key, sizeof(K));
    const U sign = U(1) << (8 * sizeof(K) - 1);
    return static_cast<uint64_t>((bits & sign) ? U(~bits) : U(bits ^ sign));
  } else {
    using U = std::make_unsigned_t<K>;
    U bits = static_cast<U>(key);
    if constexpr (std::is_signed_v<K>) bits ^= U(1) << (8 * sizeof(K) - 1);
    return static_cast<uint64_t>(bits);
  }
}

inline size_t required_bytes(int num_items) { return 256 + 16 * static_cast<size_t>(num_items > 0 ? num_items : 0); }

template <typename K, typename V>
cudaError_t sort(void* d_temp_storage, size_t& temp_storage_bytes, const K* keys_in, K* keys_out, const V* values_in,
                 V* values_out, int num_items, int begin_bit, int end_bit, bool descending) {
  const size_t need = required_bytes(num_items);
  if (d_temp_storage == nullptr) {
    temp_storage_bytes = need;
    return cudaSuccess;
  }
  if (temp_storage_bytes < need) {
    throw std::runtime_error("emulated DeviceRadixSort: temp_storage_bytes " + std::to_string(temp_storage_bytes) +
                             " < the " + std::to_string(need) + " the sizing call asked for");
  }
  const int key_bits = static_cast<int>(8 * sizeof(K));
  if (begin_bit < 0 || end_bit > key_bits || begin_bit >= end_bit) {
    throw std::runtime_error("emulated DeviceRadixSort: bad bit range [" + std::to_string(begin_bit) + ", " +
                             std::to_string(end_bit) + ") for " + std::to_string(key_bits) + "-bit keys");
  }
  if (num_items < 0) throw std::runtime_error("emulated DeviceRadixSort: negative num_items");
  const size_t n = static_cast<size_t>(num_items);
  if (n == 0) return cudaSuccess;
  if (static_cast<const void*>(keys_in) == static_cast<const void*>(keys_out)) {
    throw std::runtime_error("emulated DeviceRadixSort: keys_in and keys_out alias (CUB needs them apart)");
  }
  const uint64_t mask = (end_bit - begin_bit == 64 ? ~uint64_t(0) : ((uint64_t(1) << (end_bit - begin_bit)) - 1));
  std::vector<uint64_t> digits(n);
  for (size_t i = 0; i < n; ++i) digits[i] = (twiddled(keys_in[i]) >> begin_bit) & mask;
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return descending ? digits[a] > digits[b] : digits[a] < digits[b];
  });
  std::vector<K> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = keys_in[order[i]];
  std::copy(keys.begin(), keys.end(), keys_out);
  if constexpr (!std::is_same_v<V, std::nullptr_t>) {
    std::vector<V> values(n);
    for (size_t i = 0; i < n; ++i) values[i] = values_in[order[i]];
    std::copy(values.begin(), values.end(), values_out);
  }
  return cudaSuccess;
}

}  // namespace emu_detail

struct DeviceRadixSort {
  template <typename K, typename S = int>
  static cudaError_t SortKeys(void* temp, size_t& bytes, const K* in, K* out, int n, int begin_bit = 0,
                              int end_bit = sizeof(K) * 8, S = {}) {
    return emu_detail::sort<K, std::nullptr_t>(temp, bytes, in, out, nullptr, nullptr, n, begin_bit, end_bit, false);
  }
  template <typename K, typename S = int>
  static cudaError_t SortKeysDescending(void* temp, size_t& bytes, const K* in, K* out, int n, int begin_bit = 0,
                                        int end_bit = sizeof(K) * 8, S = {}) {
    return emu_detail::sort<K, std::nullptr_t>(temp, bytes, in, out, nullptr, nullptr, n, begin_bit, end_bit, true);
  }
  template <typename K, typename V, typename S = int>
  static cudaError_t SortPairs(void* temp, size_t& bytes, const K* keys_in, K* keys_out, const V* values_in,
                               V* values_out, int n, int begin_bit = 0, int end_bit = sizeof(K) * 8, S = {}) {
    return emu_detail::sort(temp, bytes, keys_in, keys_out, values_in, values_out, n, begin_bit, end_bit, false);
  }
  template <typename K, typename V, typename S = int>
  static cudaError_t SortPairsDescending(void* temp, size_t& bytes, const K* keys_in, K* keys_out,
                                         const V* values_in, V* values_out, int n, int begin_bit = 0,
                                         int end_bit = sizeof(K) * 8, S = {}) {
    return emu_detail::sort(temp, bytes, keys_in, keys_out, values_in, values_out, n, begin_bit, end_bit, true);
  }
};

}  // namespace cub
