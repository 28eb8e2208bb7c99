// Per-group sums and counts of per-sample losses (docs/design.md section 1.9): schemas, CPU kernels, autograd.
//
//   group_sums(l, g, G, validate, *, wide)
//                                       -> (sums, counts): sums[k] = sum of l_i over g_i = k, counts[k] = n_k, both
//                                          (G,) in the accumulation dtype, or in float64 with wide (the kernels add
//                                          in float64 anyway: wide only skips the final rounding); ids outside [0, G)
//                                          raise IndexError (validate) or are dropped
//   group_sums_backward(grad, g, dtype) -> grad_l (N,) of dtype: grad_l_i = grad[g_i], 0 for an id outside [0, G)
//
// The gather is the backward of the sums and the sums the backward of the gather, so each op's autograd calls the
// other: double backward (and more) comes for free.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "autograd_node.h"
#include "checks.h"
#include "cpu/chunks.h"
#include "cpu/output_buffer.h"
#include "group_sums.h"
#include "group_sums_checks.h"

namespace dro_ext {

namespace {

// With few groups, consecutive samples often share one, and a single accumulator per group makes each add wait for
// the one before (a store-to-load chain through memory). kAccumulatorCopies interleaved copies of the accumulators,
// sample begin + kAccumulatorCopies q + j of a part going to copy j, break those chains; the copies are added in a
// fixed order at the end. With many groups the chains are rare and the copies would only cost memory and zeroing,
// so one copy is used: the choice depends on num_groups only, never on the data or the thread count.
constexpr int64_t kAccumulatorCopies = 4;
// At most this many groups get lanes: their kAccumulatorCopies rows of accumulators (12 bytes each) stay within L1
// (12 KiB).
constexpr int64_t kMaxGroupsForLanes = 256;
// Parts per at::parallel_for task: the loop over one part of a chunk is tens of microseconds, which a fork and
// join of the thread pool would cost as much as on a busy machine.
constexpr int64_t kPartsPerTask = 4;
static_assert(kAccumulatorCopies == 4, "group_sums_kernel adds the lanes of a part as (l0 + l1) + (l2 + l3)");

// Samples are read kBlock at a time, all their ids and values first, then their adds: a load of the accumulators
// is then not queued behind the stores of the samples before it in the same block. With many groups the
// accumulators span every offset of a 4 KiB page, and a load whose low address bits match an older pending store's
// waits for it (it may be the same address): reading ahead measured 20% faster at 1024 groups, and no slower with
// few. The adds still run in sample order, so the sums are the same, bit for bit.
constexpr int64_t kBlock = 8;
static_assert(kBlock % kAccumulatorCopies == 0, "a block's samples go to the lanes in turn, as unblocked ones would");

// The samples [begin, end) of one part into its `lanes` rows of num_groups + 1 accumulators (slot num_groups takes
// the ids outside [0, num_groups), and is dropped). Sample begin + t goes to lane t % LANES, so each lane's chain
// of adds to one group is independent of the others'. Returns whether every id was in range.
template <int64_t LANES, typename scalar_t, typename id_t, typename acc_t>
bool sum_part(const scalar_t* x, int64_t x_stride, const id_t* ids, int64_t id_stride, int64_t begin, int64_t end,
              int64_t num_groups, acc_t* s, int64_t* c) {
  const int64_t row = num_groups + 1;
  bool in_range = true;
  auto slot_of = [&](int64_t i, int64_t lane) {
    const int64_t id = static_cast<int64_t>(ids[i * id_stride]);
    const bool ok = static_cast<uint64_t>(id) < static_cast<uint64_t>(num_groups);  // negative ids wrap to huge
    in_range &= ok;
    return lane * row + (ok ? id : num_groups);
  };
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    int64_t slots[kBlock];
    acc_t values[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) {
      slots[j] = slot_of(i + j, j % LANES);
      values[j] = static_cast<acc_t>(x[(i + j) * x_stride]);
    }
    for (int64_t j = 0; j < kBlock; ++j) {
      s[slots[j]] += values[j];
      c[slots[j]] += 1;
    }
  }
  for (; i < end; ++i) {
    const int64_t slot = slot_of(i, (i - begin) % LANES);
    s[slot] += static_cast<acc_t>(x[i * x_stride]);
    c[slot] += 1;
  }
  return in_range;
}

// One pass over the samples: part p (a run of whole chunks, cpu::part_size) adds its samples in index order into
// its own lanes of partial sums and counts; then, for every group, each part's lanes are added ((l0 + l1) + (l2 +
// l3)) and the parts in part order. The partial sums are float64 whatever the losses' dtype, rounded once into the
// accumulate dtype: a part runs up to a third of the samples, and a group's samples added one after another in
// float32 drift by about one rounding each where they are alike (a group mean of 0.1 came out 0.096 at 2^24 samples).
// out_t is double for wide sums, which then take the float64 totals as they are. Counts are integers (exact at any
// N) converted once. Returns whether every id was in [0, num_groups).
template <typename scalar_t, typename id_t, typename out_t>
bool group_sums_kernel(const at::Tensor& losses, const at::Tensor& groups, int64_t num_groups, out_t* sums,
                       out_t* counts) {
  using acc_t = double;
  const int64_t n = losses.numel();
  const scalar_t* x = losses.const_data_ptr<scalar_t>();
  const id_t* ids = groups.const_data_ptr<id_t>();
  const int64_t x_stride = losses.stride(0), id_stride = groups.stride(0);
  const int64_t lanes = num_groups <= kMaxGroupsForLanes ? kAccumulatorCopies : 1;
  const int64_t row = num_groups + 1, width = lanes * row;
  const int64_t part = cpu::part_size(n, width);
  const int64_t num_parts = std::max<int64_t>(1, (n + part - 1) / part);
  // Through ATen's allocator, like every other tensor, so that memory profiles see the partials.
  const at::Tensor sums_buffer =
      at::empty({num_parts, width}, losses.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  const at::Tensor counts_buffer = at::empty({num_parts, width}, losses.options().dtype(at::kLong));
  acc_t* part_sums = sums_buffer.mutable_data_ptr<acc_t>();
  int64_t* part_counts = counts_buffer.mutable_data_ptr<int64_t>();
  std::vector<char> part_in_range(num_parts, 1);
  at::parallel_for(0, num_parts, kPartsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      acc_t* s = part_sums + p * width;
      int64_t* c = part_counts + p * width;
      std::fill(s, s + width, acc_t(0));  // zeroed here, by the thread that sums into it
      std::fill(c, c + width, int64_t{0});
      const int64_t first = p * part, last = std::min(n, (p + 1) * part);
      part_in_range[p] = lanes == kAccumulatorCopies
                             ? sum_part<kAccumulatorCopies>(x, x_stride, ids, id_stride, first, last, num_groups, s, c)
                             : sum_part<1>(x, x_stride, ids, id_stride, first, last, num_groups, s, c);
    }
  });
  // Part by part over a range of groups (rows read in order, not one strided column per group), the same sums in the
  // same order for every group: part 0, then + part 1, ...
  std::vector<acc_t> total_sums(num_groups);
  std::vector<int64_t> total_counts(num_groups, 0);
  at::parallel_for(0, num_groups, cpu::kReductionChunk, [&](int64_t begin, int64_t end) {
    for (int64_t p = 0; p < num_parts; ++p) {
      const acc_t* ps = part_sums + p * width;
      const int64_t* pc = part_counts + p * width;
      for (int64_t k = begin; k < end; ++k) {
        const acc_t part_sum =
            lanes == kAccumulatorCopies ? (ps[k] + ps[row + k]) + (ps[2 * row + k] + ps[3 * row + k]) : ps[k];
        total_sums[k] = p == 0 ? part_sum : total_sums[k] + part_sum;
        for (int64_t j = 0; j < lanes; ++j) total_counts[k] += pc[j * row + k];
      }
    }
    for (int64_t k = begin; k < end; ++k) {
      sums[k] = static_cast<out_t>(total_sums[k]);
      counts[k] = static_cast<out_t>(total_counts[k]);
    }
  });
  return std::all_of(part_in_range.begin(), part_in_range.end(), [](char ok) { return ok != 0; });
}

std::tuple<at::Tensor, at::Tensor> group_sums_cpu(const at::Tensor& losses, const at::Tensor& groups,
                                                  int64_t num_groups, bool validate, bool wide) {
  check_group_sums_args(losses, groups, num_groups);
  const auto options = losses.options().dtype(group_sums_dtype(losses.scalar_type(), wide));
  at::Tensor sums = at::empty({num_groups}, options), counts = at::empty({num_groups}, options);
  bool in_range = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, losses.scalar_type(), "dro_ext_group_sums", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    AT_DISPATCH_INDEX_TYPES(groups.scalar_type(), "dro_ext_group_sums_ids", [&] {
      in_range = wide ? group_sums_kernel<scalar_t, index_t>(losses, groups, num_groups,
                                                             sums.mutable_data_ptr<double>(),
                                                             counts.mutable_data_ptr<double>())
                      : group_sums_kernel<scalar_t, index_t>(losses, groups, num_groups,
                                                             sums.mutable_data_ptr<acc_t>(),
                                                             counts.mutable_data_ptr<acc_t>());
    });
  });
  if (validate) check_ids_in_range(in_range, num_groups);
  return {sums, counts};
}

at::Tensor group_sums_backward_cpu(const at::Tensor& grad_sums, const at::Tensor& groups, at::ScalarType dtype) {
  check_group_sums_backward_args(grad_sums, groups, dtype);
  const int64_t n = groups.numel(), num_groups = grad_sums.numel();
  // A training step asks for the same N-sized gradient every step: cpu/output_buffer.h reuses its pages.
  at::Tensor out = cpu::empty_output({n}, groups.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "dro_ext_group_sums_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // The G values in scalar_t (what every sample's gradient is rounded to anyway), converted up front, and a 0 past
    // them for the ids outside [0, num_groups): the loop is then one clamped load and store per sample.
    std::vector<scalar_t> table(num_groups + 1, scalar_t(0));
    {
      const at::Tensor g = grad_sums.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
      const acc_t* grad = g.const_data_ptr<acc_t>();
      for (int64_t k = 0; k < num_groups; ++k) table[k] = static_cast<scalar_t>(grad[k]);
    }
    const scalar_t* __restrict__ values = table.data();
    scalar_t* __restrict__ y = out.mutable_data_ptr<scalar_t>();
    AT_DISPATCH_INDEX_TYPES(groups.scalar_type(), "dro_ext_group_sums_backward_ids", [&] {
      const index_t* __restrict__ ids = groups.const_data_ptr<index_t>();
      const int64_t id_stride = groups.stride(0);
      const uint64_t bound = static_cast<uint64_t>(num_groups);
      auto value_of = [&](int64_t i) {
        const uint64_t id = static_cast<uint64_t>(static_cast<int64_t>(ids[i * id_stride]));  // negative: huge
        return values[id < bound ? id : bound];
      };
      at::parallel_for(0, n, kPartsPerTask * cpu::kReductionChunk, [&](int64_t begin, int64_t end) {
        int64_t i = begin;
        for (; i + kBlock <= end; i += kBlock) {  // a block's loads before its stores, as in sum_part
          scalar_t block[kBlock];
          for (int64_t j = 0; j < kBlock; ++j) block[j] = value_of(i + j);
          for (int64_t j = 0; j < kBlock; ++j) y[i + j] = block[j];
        }
        for (; i < end; ++i) y[i] = value_of(i);
      });
    });
  });
  return out;
}

}  // namespace

// ------------------------------------------------------------------------------------------------- autograd

std::tuple<at::Tensor, at::Tensor> call_group_sums(const at::Tensor& losses, const at::Tensor& groups,
                                                   int64_t num_groups, bool validate, bool wide) {
  static auto op =
      find_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t, bool, bool)>(
          "dro_ext::group_sums");
  return op.call(losses, groups, num_groups, validate, wide);
}

at::Tensor call_group_sums_backward(const at::Tensor& grad_sums, const at::Tensor& groups, at::ScalarType dtype) {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>(
      "dro_ext::group_sums_backward");
  return op.call(grad_sums, groups, dtype);
}

namespace {

// Hand-written Nodes, as dro_loss's (csrc/autograd.cpp): at a few thousand samples a generic Function's bookkeeping
// would be a visible share of the call. Each backward goes through the dispatcher, with autograd when grad mode is
// on (a double backward records it), below autograd otherwise.
struct GroupSumsBackward final : public torch::autograd::Node {
  torch::autograd::SavedVariable groups;
  at::ScalarType losses_dtype;

  std::string name() const override { return "GroupSumsBackward"; }
  void release_variables() override { groups.reset_data(); }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out(1);
    if (!grads[0].defined() || !should_compute_output(0)) return out;
    const at::Tensor saved_groups = groups.unpack();
    const BelowAutogradUnlessRecording below_autograd;
    out[0] = call_group_sums_backward(grads[0], saved_groups, losses_dtype);
    return out;
  }
};

// The gather's backward: its adjoint, the sums of the incoming gradient by group (out-of-range ids dropped, as the
// gather gave them 0), formed in float64 and rounded once. A gradient that reaches a gather is often alike within a
// group (each sample's equal share of its group's weight: robust_objective's over groups, the second derivative of
// group means), and group_sums adds a part's samples one after another: in float32 each add of alike terms rounds
// the same way, and a group's sum of 2^18 of them drifted by 1e-5 relative. (The kernels sum in float64 whatever the
// dtype; wide sums are those totals, cast here into the gradient's own dtype as a float64 gradient's sums would
// be, with no float64 copy of the incoming gradient.)
struct GroupGatherBackward final : public torch::autograd::Node {
  torch::autograd::SavedVariable groups;
  int64_t num_groups = 0;
  at::ScalarType grad_sums_dtype;

  std::string name() const override { return "GroupGatherBackward"; }
  void release_variables() override { groups.reset_data(); }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out(1);
    if (!grads[0].defined() || !should_compute_output(0)) return out;
    const at::Tensor saved_groups = groups.unpack();
    const BelowAutogradUnlessRecording below_autograd;
    out[0] = std::get<0>(call_group_sums(grads[0], saved_groups, num_groups, /*validate=*/false, /*wide=*/true))
                 .to(grad_sums_dtype);
    return out;
  }
};

// The sums' backward gathers grad_sums (wide: float64) straight into the losses' dtype, each value rounded once.
std::tuple<at::Tensor, at::Tensor> group_sums_autograd(const at::Tensor& losses, const at::Tensor& groups,
                                                       int64_t num_groups, bool validate, bool wide) {
  TORCH_CHECK(!torch::autograd::isFwGradDefined(losses),
              "dro_ext: forward-mode AD is not implemented for group_sums; use the fallback (DRO_EXT_FORCE_PYTHON=1)");
  auto [sums, counts] = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_group_sums(losses, groups, num_groups, validate, wide);
  }();
  if (torch::autograd::compute_requires_grad(losses)) {
    auto node = make_node<GroupSumsBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(losses));
    node->groups = torch::autograd::SavedVariable(groups, /*is_output=*/false);
    node->losses_dtype = losses.scalar_type();
    torch::autograd::set_history(sums, node);  // counts get no history: they are not differentiable
  }
  return {sums, counts};
}

at::Tensor group_sums_backward_autograd(const at::Tensor& grad_sums, const at::Tensor& groups, at::ScalarType dtype) {
  TORCH_CHECK(!torch::autograd::isFwGradDefined(grad_sums),
              "dro_ext: forward-mode AD is not implemented for group_sums_backward");
  at::Tensor out = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_group_sums_backward(grad_sums, groups, dtype);
  }();
  if (torch::autograd::compute_requires_grad(grad_sums)) {
    auto node = make_node<GroupGatherBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(grad_sums));
    node->groups = torch::autograd::SavedVariable(groups, /*is_output=*/false);
    node->num_groups = grad_sums.size(0);
    node->grad_sums_dtype = grad_sums.scalar_type();
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dro_ext, m) {
  m.def("group_sums(Tensor losses, Tensor groups, int num_groups, bool validate=True, *, bool wide=False) "
        "-> (Tensor, Tensor)");
  m.def("group_sums_backward(Tensor grad_sums, Tensor groups, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(dro_ext, CPU, m) {
  m.impl("group_sums", &group_sums_cpu);
  m.impl("group_sums_backward", &group_sums_backward_cpu);
}

TORCH_LIBRARY_IMPL(dro_ext, Autograd, m) {
  m.impl("group_sums", &group_sums_autograd);
  m.impl("group_sums_backward", &group_sums_backward_autograd);
}

}  // namespace dro_ext
