// Which build of the CPU kernels runs: the widest SIMD capability the processor has, capped by
// ATEN_CPU_CAPABILITY as ATen's own kernels are (default, avx2, avx512), and settable at run time through the
// private op dro_ext::_cpu_capability so that the tests cover every build the processor runs.
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

Capability from_environment() {
  const Capability best = best_supported();
  const char* forced = std::getenv("ATEN_CPU_CAPABILITY");
  if (forced == nullptr) return best;
  if (std::strcmp(forced, "default") == 0) return Capability::Default;
  if (std::strcmp(forced, "avx2") == 0) return best < Capability::AVX2 ? best : Capability::AVX2;
  return best;
}

std::atomic<Capability>& active() {
  static std::atomic<Capability> capability{from_environment()};
  return capability;
}

const char* name_of(Capability c) {
  switch (c) {
    case Capability::AVX512: return "avx512";
    case Capability::AVX2: return "avx2";
    default: return "default";
  }
}

// _cpu_capability(None) -> the active build's name; _cpu_capability(name) switches to that build (an error
// if the processor cannot run it) and returns the name of the one it replaced.
std::string cpu_capability_op(std::optional<c10::string_view> set) {
  const Capability previous = active().load();
  if (set.has_value()) {
    Capability wanted = Capability::Default;
    if (*set == "avx512") {
      wanted = Capability::AVX512;
    } else if (*set == "avx2") {
      wanted = Capability::AVX2;
    } else {
      TORCH_CHECK_VALUE(*set == "default", "dro_ext: capability must be 'default', 'avx2' or 'avx512', got '",
                        std::string(*set), "'");
    }
    TORCH_CHECK(wanted <= best_supported(), "dro_ext: this processor cannot run the ", name_of(wanted),
                " build of the CPU kernels (the best it runs is ", name_of(best_supported()), ")");
    active().store(wanted);
  }
  return name_of(previous);
}

}  // namespace

Capability cpu_capability() { return active().load(std::memory_order_relaxed); }

bool use_avx2_kernels() { return cpu_capability() >= Capability::AVX2; }

const KernelTable& cpu_kernels() {
  switch (cpu_capability()) {
    case Capability::AVX512: return kernels_avx512();
    case Capability::AVX2: return kernels_avx2();
    default: return kernels_default();
  }
}

const CrossEntropyKernelTable& cross_entropy_kernels() {
  switch (cpu_capability()) {
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
