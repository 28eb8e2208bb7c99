// Which build of the CPU kernels runs: the widest SIMD capability the processor has, capped by
// ATEN_CPU_CAPABILITY as ATen's own kernels are (default, avx2, avx512), AVX2 for calls too small for AVX-512 to pay
// (kAvx512MinValuesOnePass and kAvx512MinValuesSolver, csrc/cpu/kernels.h), and pinned at run time through the
// private op dro_ext::_cpu_capability so that the tests cover every build the processor runs at every size.
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu/cross_entropy_kernels.h"
#include "cpu/kernels.h"

namespace dro_ext::cpu {

namespace {

Capability best_supported() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return avx512 ? Capability::AVX512 : (avx2 ? Capability::AVX2 : Capability::Default);
#else
  return Capability::Default;
#endif
}

// Whether 512-bit arithmetic lowers this processor's clock, the cost the size rule of capability_for avoids: Intel's
// cores do; AMD's (Zen 4 and 5) run AVX-512 at their usual clock, and there the wider build runs at every size.
bool avx512_lowers_clock() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

Capability from_environment() {
  const Capability best = best_supported();
  const char* forced = std::getenv("ATEN_CPU_CAPABILITY");
  if (forced == nullptr) return best;
  if (std::strcmp(forced, "default") == 0) return Capability::Default;
  if (std::strcmp(forced, "avx2") == 0) return best < Capability::AVX2 ? best : Capability::AVX2;
  return best;
}

// What a test set with _cpu_capability: nothing (every call runs capability_for's choice) or one build pinned for
// every call, whatever its size.
struct Setting {
  bool pinned;
  Capability build;
};

std::atomic<Setting>& setting() {
  static std::atomic<Setting> value{Setting{false, from_environment()}};
  return value;
}

const char* name_of(Capability c) {
  switch (c) {
    case Capability::AVX512: return "avx512";
    case Capability::AVX2: return "avx2";
    default: return "default";
  }
}

// _cpu_capability(None) -> the widest build allowed (cpu_capability()); _cpu_capability(name) pins that build for
// every call (an error if the processor cannot run it), and _cpu_capability("auto") returns to the size rule of
// capability_for. Either returns the setting it replaced: "auto" or the pinned build's name.
std::string cpu_capability_op(std::optional<c10::string_view> set) {
  const Setting previous = setting().load();
  if (set.has_value()) {
    if (*set == "auto") {
      setting().store(Setting{false, from_environment()});
    } else {
      Capability wanted = Capability::Default;
      if (*set == "avx512") {
        wanted = Capability::AVX512;
      } else if (*set == "avx2") {
        wanted = Capability::AVX2;
      } else {
        TORCH_CHECK_VALUE(*set == "default", "dro_ext: capability must be 'auto', 'default', 'avx2' or 'avx512', got '",
                          std::string(*set), "'");
      }
      TORCH_CHECK(wanted <= best_supported(), "dro_ext: this processor cannot run the ", name_of(wanted),
                  " build of the CPU kernels (the best it runs is ", name_of(best_supported()), ")");
      setting().store(Setting{true, wanted});
    }
    return previous.pinned ? name_of(previous.build) : "auto";
  }
  return name_of(previous.build);
}

// The build a call over `values` values runs (cpu_kernels, csrc/cpu/kernels.h).
Capability capability_for(int64_t values, int64_t avx512_min_values) {
  static const bool lowers_clock = avx512_lowers_clock();
  const Setting current = setting().load(std::memory_order_relaxed);
  if (lowers_clock && !current.pinned && current.build == Capability::AVX512 && values < avx512_min_values) {
    return Capability::AVX2;
  }
  return current.build;
}

}  // namespace

Capability cpu_capability() { return setting().load(std::memory_order_relaxed).build; }

bool use_avx2_kernels() { return cpu_capability() >= Capability::AVX2; }

const KernelTable& cpu_kernels(int64_t values, int64_t avx512_min_values) {
  switch (capability_for(values, avx512_min_values)) {
    case Capability::AVX512: return kernels_avx512();
    case Capability::AVX2: return kernels_avx2();
    default: return kernels_default();
  }
}

const CrossEntropyKernelTable& cross_entropy_kernels(int64_t values) {
  switch (capability_for(values, kAvx512MinValuesOnePass)) {
    case Capability::AVX512: return cross_entropy_kernels_avx512();
    case Capability::AVX2: return cross_entropy_kernels_avx2();
    default: return cross_entropy_kernels_default();
  }
}

}  // namespace dro_ext::cpu

TORCH_LIBRARY_FRAGMENT(dro_ext, m) {
  // Private: which SIMD build of the CPU kernels runs (tests switch between them). Not an operator on tensors;
  // torch.compile never sees it.
  m.def("_cpu_capability(str? set=None) -> str", &dro_ext::cpu::cpu_capability_op);
}
