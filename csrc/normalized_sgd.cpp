// Normalized SGD with momentum (Algorithm 1 of the paper) as one multi-tensor op, and its CPU kernel.
//
//   m <- beta m + (1 - beta) g          (m <- g on a tensor's first step)
//   p <- (1 - lr wd) p - lr m / (||m|| + eps)
//
// ||m|| is taken over every tensor of the call (norm="global") or per tensor (norm="tensor"). The step
// is two passes over the list: pass A updates m and sums m^2 into per-chunk partials, pass B applies the
// update. lr, grad_scale, found_inf and the step counts are tensors, read where the kernel runs, so the
// CUDA kernel can run the same step without a host sync (and be graph-captured).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include "cpu/kernels.h"
#include "normalized_sgd_checks.h"
#include "normalized_sgd_operands.h"

#include <cmath>
#include <cstring>
#include <type_traits>
#include <string>
#include <vector>

namespace dro_ext {

namespace {

// The CPU step cuts each tensor into chunks of this many elements, whatever the thread count: a chunk is one task
// on the thread pool and one partial sum of squares, and the partials are combined in chunk order, so the norm,
// hence the step, is bitwise repeatable. The step's own constant, apart from cpu::kReductionChunk (the loss
// reductions') and cuda::kMultiTensorChunk (one block's share of the CUDA step): changing it changes the step's bits.
constexpr int64_t kStepChunk = 8192;
// Below this many elements in all, threads cost more than they save.
constexpr int64_t kSerialBelow = 1 << 16;
// Independent accumulators, so the compiler vectorizes the sum of squares without reordering a sum.
constexpr int kSquareSumLanes = 16;

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// sum m^2 over one chunk, every product and sum in double.
template <typename scalar_t>
C10_ALWAYS_INLINE double sum_squares_double(const scalar_t* m, int64_t n) {
  double lanes[kSquareSumLanes] = {};
  int64_t i = 0;
  for (; i + kSquareSumLanes <= n; i += kSquareSumLanes) {
    for (int j = 0; j < kSquareSumLanes; ++j) {
      const double v = static_cast<double>(m[i + j]);
      lanes[j] += v * v;
    }
  }
  for (; i < n; ++i) lanes[0] += static_cast<double>(m[i]) * static_cast<double>(m[i]);
  double sum = 0.0;
  for (int j = 0; j < kSquareSumLanes; ++j) sum += lanes[j];
  return sum;
}

// m <- keep * m + take * g over one chunk; returns sum m^2 of the stored (rounded) m.
// The squares are summed in the compute type over short blocks (kSquareBlock elements, a few additions
// per lane) and the block sums in double: as accurate as summing in double, at the speed of float
// arithmetic. Where float squares could have overflowed or underflowed (a huge or tiny momentum), the
// chunk is summed again entirely in double.
constexpr int64_t kSquareBlock = 4 * kSquareSumLanes;

#if defined(__GNUC__)
// float32, the common case, is written with GCC/Clang vector types: from the scalar-lane loop below GCC
// moved each block's float sums into double one lane at a time, which cost more than the update itself
// and left one thread well short of memory bandwidth.
typedef float float8 __attribute__((vector_size(32)));
typedef double double4 __attribute__((vector_size(32)));

C10_ALWAYS_INLINE double update_momentum_float(const float* g, float* m, int64_t n, float keep, float take) {
  double4 low = {}, high = {};
  int64_t i = 0;
  for (; i + kSquareBlock <= n; i += kSquareBlock) {
    float8 block = {};
    for (int64_t b = 0; b < kSquareBlock; b += 8) {
      float8 gv, mv;
      std::memcpy(&gv, g + i + b, sizeof gv);  // unaligned vector loads and stores
      std::memcpy(&mv, m + i + b, sizeof mv);
      const float8 stored = keep * mv + take * gv;
      std::memcpy(m + i + b, &stored, sizeof stored);
      block += stored * stored;
    }
    low += __builtin_convertvector(__builtin_shufflevector(block, block, 0, 1, 2, 3), double4);
    high += __builtin_convertvector(__builtin_shufflevector(block, block, 4, 5, 6, 7), double4);
  }
  const double4 total = low + high;
  double sum = (total[0] + total[1]) + (total[2] + total[3]);
  for (; i < n; ++i) {
    m[i] = keep * m[i] + take * g[i];
    sum += static_cast<double>(m[i]) * static_cast<double>(m[i]);
  }
  return sum;
}
#endif

template <typename scalar_t>
C10_ALWAYS_INLINE double sum_updated_momentum(const scalar_t* g, scalar_t* m, int64_t n, double keep_d,
                                              double take_d) {
  using opmath_t = at::opmath_type<scalar_t>;
  const auto keep = static_cast<opmath_t>(keep_d), take = static_cast<opmath_t>(take_d);
#if defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, float>) return update_momentum_float(g, m, n, keep, take);
#endif
  double lanes[kSquareSumLanes] = {};
  int64_t i = 0;
  for (; i + kSquareBlock <= n; i += kSquareBlock) {
    opmath_t block_lanes[kSquareSumLanes] = {};
    for (int64_t b = 0; b < kSquareBlock; b += kSquareSumLanes) {
      for (int j = 0; j < kSquareSumLanes; ++j) {
        const scalar_t stored = static_cast<scalar_t>(keep * static_cast<opmath_t>(m[i + b + j]) +
                                                      take * static_cast<opmath_t>(g[i + b + j]));
        m[i + b + j] = stored;
        const opmath_t v = static_cast<opmath_t>(stored);
        block_lanes[j] += v * v;
      }
    }
    for (int j = 0; j < kSquareSumLanes; ++j) lanes[j] += static_cast<double>(block_lanes[j]);
  }
  for (; i < n; ++i) {
    const scalar_t stored =
        static_cast<scalar_t>(keep * static_cast<opmath_t>(m[i]) + take * static_cast<opmath_t>(g[i]));
    m[i] = stored;
    const double v = static_cast<double>(stored);
    lanes[0] += v * v;
  }
  double sum = 0.0;
  for (int j = 0; j < kSquareSumLanes; ++j) sum += lanes[j];
  return sum;
}

template <typename scalar_t>
C10_ALWAYS_INLINE double update_momentum(const scalar_t* g, scalar_t* m, int64_t n, double keep_d, double take_d) {
  const double sum = sum_updated_momentum(g, m, n, keep_d, take_d);
  if constexpr (!std::is_same_v<at::opmath_type<scalar_t>, double>) {
    // Squares below ~1e-30 lose precision (or vanish) in float; above ~1e38 they overflow.
    if (!(sum > 1e-30 && sum < 1e37) && !std::isnan(sum)) return sum_squares_double(m, n);
  }
  return sum;
}

// p <- decay * p - scale * m over one chunk.
template <typename scalar_t>
C10_ALWAYS_INLINE void apply_update(scalar_t* p, const scalar_t* m, int64_t n, double decay_d, double scale_d) {
  using opmath_t = at::opmath_type<scalar_t>;
  const auto decay = static_cast<opmath_t>(decay_d), scale = static_cast<opmath_t>(scale_d);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = static_cast<scalar_t>(decay * static_cast<opmath_t>(p[i]) - scale * static_cast<opmath_t>(m[i]));
  }
}

// The passes compiled twice, for the baseline x86-64 ISA and for AVX2+FMA: one stream per core does not
// saturate memory, and wider vectors keep more loads in flight. Chosen once at run time;
// ATEN_CPU_CAPABILITY=default forces the baseline, as it does for ATen's kernels.
template <typename scalar_t>
struct Passes {
  double (*momentum)(const scalar_t*, scalar_t*, int64_t, double, double);
  void (*apply)(scalar_t*, const scalar_t*, int64_t, double, double);
};

template <typename scalar_t>
double update_momentum_default(const scalar_t* g, scalar_t* m, int64_t n, double keep, double take) {
  return update_momentum(g, m, n, keep, take);
}
template <typename scalar_t>
void apply_update_default(scalar_t* p, const scalar_t* m, int64_t n, double decay, double scale) {
  apply_update(p, m, n, decay, scale);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename scalar_t>
__attribute__((target("avx2,fma"))) double update_momentum_avx2(
    const scalar_t* g, scalar_t* m, int64_t n, double keep, double take) {
  return update_momentum(g, m, n, keep, take);
}
template <typename scalar_t>
__attribute__((target("avx2,fma"))) void apply_update_avx2(
    scalar_t* p, const scalar_t* m, int64_t n, double decay, double scale) {
  apply_update(p, m, n, decay, scale);
}

template <typename scalar_t>
Passes<scalar_t> passes() {
  if (cpu::use_avx2_kernels()) return {&update_momentum_avx2<scalar_t>, &apply_update_avx2<scalar_t>};
  return {&update_momentum_default<scalar_t>, &apply_update_default<scalar_t>};
}
#else
template <typename scalar_t>
Passes<scalar_t> passes() {
  return {&update_momentum_default<scalar_t>, &apply_update_default<scalar_t>};
}
#endif

double read_scalar(const char* name, const at::Tensor& t) {
  check_step_scalar(name, t, at::kCPU);
  return t.item<double>();
}

void normalized_sgd_step_cpu(
    at::TensorList params, at::TensorList grads, at::TensorList momenta, at::TensorList steps, const at::Tensor& lr,
    double momentum, double eps, double weight_decay, c10::string_view norm, bool maximize,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_step_lists(params, grads, momenta, steps, at::kCPU);
  check_step_hyperparameters(momentum, eps, weight_decay, norm);
  const bool per_tensor = norm == "tensor";
  // GradScaler found an inf or NaN in some gradient: the whole step is skipped, counts included.
  if (found_inf.has_value() && read_scalar("found_inf", *found_inf) != 0.0) return;
  const double lr_value = read_scalar("lr", lr);
  double grad_mul = maximize ? -1.0 : 1.0;
  if (grad_scale.has_value()) grad_mul /= read_scalar("grad_scale", *grad_scale);

  const int64_t num_tensors = static_cast<int64_t>(params.size());
  const std::vector<StepOperands> ops = flat_step_operands(params, grads, momenta);
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (const auto t : c10::irange(num_tensors)) {
    const int64_t n = params[t].numel();
    total += n;
    for (int64_t begin = 0; begin < n; begin += kStepChunk) {
      chunks.push_back({t, begin, std::min(n, begin + kStepChunk)});
    }
  }
  // m_1 = g_1 is the update with beta = 0; state starts at zero so 0 * m adds nothing.
  std::vector<double> keep(num_tensors), take(num_tensors);
  for (const auto t : c10::irange(num_tensors)) {
    const bool first = *steps[t].const_data_ptr<float>() == 0.0f;
    keep[t] = first ? 0.0 : momentum;
    take[t] = first ? grad_mul : (1.0 - momentum) * grad_mul;
  }

  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  const int64_t grain = total < kSerialBelow ? std::max<int64_t>(num_chunks, 1) : 1;
  std::vector<double> partial(num_chunks);
  at::parallel_for(0, num_chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      const StepOperands& op = ops[chunk.tensor];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, op.param.scalar_type(), "normalized_sgd_momentum", [&] {
        partial[c] = passes<scalar_t>().momentum(
            op.grad.const_data_ptr<scalar_t>() + chunk.begin, op.momentum.mutable_data_ptr<scalar_t>() + chunk.begin,
            chunk.end - chunk.begin, keep[chunk.tensor], take[chunk.tensor]);
      });
    }
  });

  // Sum the partials in chunk order; a zero norm means a zero momentum, which must not move p.
  std::vector<double> sumsq(num_tensors, 0.0);
  for (const auto c : c10::irange(num_chunks)) sumsq[chunks[c].tensor] += partial[c];
  std::vector<double> scale(num_tensors);
  double global_sumsq = 0.0;
  for (const double s : sumsq) global_sumsq += s;
  for (const auto t : c10::irange(num_tensors)) {
    const double norm_value = std::sqrt(per_tensor ? sumsq[t] : global_sumsq);
    scale[t] = norm_value > 0.0 ? lr_value / (norm_value + eps) : 0.0;
  }
  const double decay = 1.0 - lr_value * weight_decay;

  at::parallel_for(0, num_chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      const StepOperands& op = ops[chunk.tensor];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, op.param.scalar_type(), "normalized_sgd_apply", [&] {
        passes<scalar_t>().apply(op.param.mutable_data_ptr<scalar_t>() + chunk.begin,
                               op.momentum.const_data_ptr<scalar_t>() + chunk.begin, chunk.end - chunk.begin,
                               decay, scale[chunk.tensor]);
      });
    }
  });

  copy_back_step_operands(ops, params, momenta);
  for (const auto t : c10::irange(num_tensors)) *steps[t].mutable_data_ptr<float>() += 1.0f;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dro_ext, m) {
  m.def(
      "normalized_sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momenta, Tensor(c!)[] steps, "
      "Tensor lr, float momentum, float eps, float weight_decay=0.0, str norm=\"global\", bool maximize=False, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
}

TORCH_LIBRARY_IMPL(dro_ext, CPU, m) {
  m.impl("normalized_sgd_step_", &normalized_sgd_step_cpu);
}

}  // namespace dro_ext
