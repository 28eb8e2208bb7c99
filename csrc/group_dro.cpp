// One online Group DRO step (docs/design.md section 1.9): schemas, CPU kernel, autograd.
//
//   group_dro_step_(sums, counts, log_q!, ema_loss!, last_loss!, seen!, active, adjustment, step_size, ema_gamma,
//                   stale, normalize_loss, update, *, out_dtype=None) -> (loss, grad_weights)
//       over given group sums and counts: updates the state in place (when update) by the rules of
//       csrc/group_dro_step.h and returns the loss sum_g q_g m_g (0-d) and grad_weights_g = q_g / max(n_g, 1) =
//       d loss / d sums_g, both in out_dtype (float32 or float64; by default the wider of the sums' and the state's
//       dtype). Only sums is differentiable: q is detached, and the counts are integers. GroupDROLoss calls it with
//       a mask or a process group, whose sums are formed (masked, all-reduced) before the step.
//   group_dro_loss_(losses, groups, num_groups, log_q!, ..., update, validate) -> loss
//       group_sums (float64) then group_dro_step_ (out_dtype: the losses' accumulate dtype promoted with the
//       state's), in one call with one autograd Node from the losses to the loss (in the losses' dtype):
//       d loss / d l_i = grad * grad_weights_{g_i}. The step of a single process without a mask.
//
// At a few thousand samples the step's O(G) work as some twenty PyTorch ops on (G,) tensors, and every Python call
// and autograd Node, cost more than the pass over the losses; these ops make the whole step two calls (and one
// Node) from Python.
#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "autograd_node.h"
#include "checks.h"
#include "cpu/kernels.h"
#include "group_dro_step.h"
#include "group_sums.h"

namespace dro_ext {

namespace {

template <typename Operands>
void group_dro_step_kernel(const Operands& op, int64_t num_groups, const GroupDROStepArgs& args,
                           at::Tensor& loss_tensor, at::Tensor& weights_tensor) {
  using out_t = typename Operands::out_t;
  out_t* weights = weights_tensor.mutable_data_ptr<out_t>();
  const cpu::KernelTable& kernels = cpu::cpu_kernels(num_groups, cpu::kAvx512MinValuesOnePass);
  double loss = 0.0;
  // The step, or false (nothing written) for a batch that takes none.
  const auto step = [&]() {
    double score_mean = 0.0;
    if (args.normalize_loss) {
      for (int64_t g = 0; g < num_groups; ++g) {
        const GroupInputs in = op.inputs(g);
        score_mean += in.score(in.mean(), args.stale) / static_cast<double>(num_groups);
      }
    }
    // x_g and e_g = exp(x_g - shift) = q_g * sum_h e_h; the state is written only once every group's old state is
    // read. e holds the step scores until exp_shifted writes it.
    std::vector<double> x(num_groups), e(num_groups);
    double max_score = -INFINITY;
    bool blocked = false;
    for (int64_t g = 0; g < num_groups; ++g) {
      const GroupInputs in = op.inputs(g);
      const double m = in.mean(), a = in.score(m, args.stale);
      blocked |= op.blocks_the_step(in, m, a, args);
      e[g] = in.step_score(a, score_mean, static_cast<double>(num_groups), args);
      max_score = e[g] > max_score ? e[g] : max_score;
    }
    if (blocked) return false;
    const double shift_by = shift_from_max(max_score);
    double max_x = -INFINITY;
    for (int64_t g = 0; g < num_groups; ++g) {
      x[g] = op.inputs(g).log_weight(e[g], shift_by, args);
      max_x = x[g] > max_x ? x[g] : max_x;
    }
    const double shift = shift_from_max(max_x);
    kernels.exp_shifted(x.data(), shift, negligible_log_q<out_t>(), e.data(), num_groups);
    double total = 0.0;
    for (int64_t g = 0; g < num_groups; ++g) total += e[g];  // in group order, whatever the SIMD width
    const double log_total = std::log(total);
    for (int64_t g = 0; g < num_groups; ++g) {
      const GroupInputs in = op.inputs(g);
      const double m = in.mean(), q = e[g] / total, log_q = normalized_log_q(x[g], shift, log_total);
      op.write(g, in, m, log_q, args.ema_gamma);
      loss += q != 0.0 ? q * m : dropped_group_term<out_t>(log_q, m);
      weights[g] = static_cast<out_t>(q * in.inverse_count());
    }
    return true;
  };
  if (!(args.update && step())) {
    // The loss and its gradient weights under the current q (update=False, or a batch that takes no step).
    std::vector<double> log_q(num_groups), q(num_groups);
    for (int64_t g = 0; g < num_groups; ++g) log_q[g] = static_cast<double>(op.log_q[g]);
    kernels.exp_shifted(log_q.data(), 0.0, negligible_log_q<out_t>(), q.data(), num_groups);
    for (int64_t g = 0; g < num_groups; ++g) {
      const GroupInputs in = op.inputs(g);
      loss += q[g] != 0.0 ? q[g] * in.mean() : dropped_group_term<out_t>(log_q[g], in.mean());
      weights[g] = static_cast<out_t>(q[g] * in.inverse_count());
    }
  }
  *loss_tensor.mutable_data_ptr<out_t>() = static_cast<out_t>(loss);
}

std::tuple<at::Tensor, at::Tensor> group_dro_step_cpu(const at::Tensor& sums, const at::Tensor& counts,
                                                      at::Tensor& log_q, at::Tensor& ema_loss, at::Tensor& last_loss,
                                                      at::Tensor& seen, const at::Tensor& active,
                                                      const at::Tensor& adjustment, double step_size,
                                                      double ema_gamma, bool stale, bool normalize_loss, bool update,
                                                      std::optional<at::ScalarType> out_dtype) {
  GroupDROStepCall call = prepare_group_dro_step(sums, counts, log_q, ema_loss, last_loss, seen, active, adjustment,
                                                 step_size, ema_gamma, stale, normalize_loss, update, out_dtype);
  with_group_dro_step_operands(sums, counts, log_q, ema_loss, last_loss, seen, active, call, [&](const auto& op) {
    group_dro_step_kernel(op, sums.numel(), call.args, call.loss, call.weights);
  });
  return {call.loss, call.weights};
}

// ------------------------------------------------------------------------------------------------- autograd

std::tuple<at::Tensor, at::Tensor> call_group_dro_step(const at::Tensor& sums, const at::Tensor& counts,
                                                       at::Tensor& log_q, at::Tensor& ema_loss, at::Tensor& last_loss,
                                                       at::Tensor& seen, const at::Tensor& active,
                                                       const at::Tensor& adjustment, double step_size,
                                                       double ema_gamma, bool stale, bool normalize_loss, bool update,
                                                       std::optional<at::ScalarType> out_dtype) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
      const at::Tensor&, double, double, bool, bool, bool, std::optional<at::ScalarType>)>("dro_ext::group_dro_step_");
  return op.call(sums, counts, log_q, ema_loss, last_loss, seen, active, adjustment, step_size, ema_gamma, stale,
                 normalize_loss, update, out_dtype);
}

// What both ops check before stepping, and do after: the ADInplaceOrView layer's version bump of the state they
// update in place (the autograd kernels below call the kernels beneath that layer).
void check_state_needs_no_grad(const at::Tensor& x, const at::Tensor& log_q, const at::Tensor& ema_loss,
                               const at::Tensor& last_loss) {
  TORCH_CHECK(!torch::autograd::isFwGradDefined(x), "dro_ext: forward-mode AD is not implemented for GroupDROLoss; "
              "use the fallback (DRO_EXT_FORCE_PYTHON=1)");
  TORCH_CHECK(!torch::autograd::compute_requires_grad(log_q, ema_loss, last_loss),
              "dro_ext: GroupDROLoss's state (log_q, ema_loss, last_loss) must not require grad");
}

// An updating step run by a backward pass: torch.utils.checkpoint recomputing a region that holds GroupDROLoss.
// Updated again, q would take two steps from one batch, and the gradient would be that of a loss under another q
// than the one returned. GroupDROLoss refuses its eager calls in Python; the check here also covers the graphs that
// torch.compile makes of it (Python checks run once, while the graph is traced): an eager checkpoint runs a compiled
// module's graph again, and a checkpoint that torch.compile traces recomputes this op in the backward pass from the
// state as the forward left it (on copies: q is not updated again, but the gradient weights are a second step's).
void refuse_update_inside_backward(bool update) {
  TORCH_CHECK(!update || torch::autograd::get_current_graph_task_id() == -1,
              "dro_ext.GroupDROLoss: an updating forward ran inside a backward pass (a checkpoint recomputing its "
              "region?), which would update q twice from one batch; call the module outside the checkpointed region");
}

void bump_state_versions(bool update, const at::Tensor& log_q, const at::Tensor& ema_loss,
                         const at::Tensor& last_loss, const at::Tensor& seen) {
  if (!update) return;
  for (const at::Tensor* t : {&log_q, &ema_loss, &last_loss, &seen}) torch::autograd::impl::bump_version(*t);
}

// d loss / d sums = grad * grad_weights: a product of differentiable ops (double backward records it), the weights
// being constants.
struct GroupDROStepBackward final : public torch::autograd::Node {
  torch::autograd::SavedVariable grad_weights;
  at::ScalarType sums_dtype;

  std::string name() const override { return "GroupDROStepBackward"; }
  void release_variables() override { grad_weights.reset_data(); }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out(1);
    if (!grads[0].defined() || !should_compute_output(0)) return out;
    out[0] = (grads[0] * grad_weights.unpack()).to(sums_dtype);
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> group_dro_step_autograd(const at::Tensor& sums, const at::Tensor& counts,
                                                           at::Tensor& log_q, at::Tensor& ema_loss,
                                                           at::Tensor& last_loss, at::Tensor& seen,
                                                           const at::Tensor& active, const at::Tensor& adjustment,
                                                           double step_size, double ema_gamma, bool stale,
                                                           bool normalize_loss, bool update,
                                                           std::optional<at::ScalarType> out_dtype) {
  check_state_needs_no_grad(sums, log_q, ema_loss, last_loss);
  refuse_update_inside_backward(update);
  auto [loss, weights] = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_group_dro_step(sums, counts, log_q, ema_loss, last_loss, seen, active, adjustment, step_size,
                               ema_gamma, stale, normalize_loss, update, out_dtype);
  }();
  bump_state_versions(update, log_q, ema_loss, last_loss, seen);
  if (torch::autograd::compute_requires_grad(sums)) {
    auto node = make_node<GroupDROStepBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(sums));
    node->grad_weights = torch::autograd::SavedVariable(weights, /*is_output=*/false);
    node->sums_dtype = sums.scalar_type();
    torch::autograd::set_history(loss, node);  // grad_weights get no history: constants of the step
  }
  return {loss, weights};
}

// group_dro_loss_ beneath autograd, on any device: the two ops composed. Returns the loss in the losses' dtype and
// the gradient weights.
std::tuple<at::Tensor, at::Tensor> group_dro_loss_steps(const at::Tensor& losses, const at::Tensor& groups,
                                                        int64_t num_groups, at::Tensor& log_q, at::Tensor& ema_loss,
                                                        at::Tensor& last_loss, at::Tensor& seen,
                                                        const at::Tensor& active, const at::Tensor& adjustment,
                                                        double step_size, double ema_gamma, bool stale,
                                                        bool normalize_loss, bool update, bool validate) {
  // Float64 sums (the kernel adds in float64 anyway: wide keeps its totals unrounded), so that finite float32
  // losses summing past float32's range in one group keep a finite mean; the loss and the weights in the dtype
  // float32 sums gave them.
  auto [sums, counts] = call_group_sums(losses, groups, num_groups, validate, /*wide=*/true);
  auto [loss, weights] = call_group_dro_step(
      sums, counts, log_q, ema_loss, last_loss, seen, active, adjustment, step_size, ema_gamma, stale, normalize_loss,
      update, c10::promoteTypes(accumulate_type(losses.scalar_type()), log_q.scalar_type()));
  return {as_dtype(loss, losses.scalar_type()), weights};
}

at::Tensor group_dro_loss_backend(const at::Tensor& losses, const at::Tensor& groups, int64_t num_groups,
                                  at::Tensor& log_q, at::Tensor& ema_loss, at::Tensor& last_loss, at::Tensor& seen,
                                  const at::Tensor& active, const at::Tensor& adjustment, double step_size,
                                  double ema_gamma, bool stale, bool normalize_loss, bool update, bool validate) {
  return std::get<0>(group_dro_loss_steps(losses, groups, num_groups, log_q, ema_loss, last_loss, seen, active,
                                          adjustment, step_size, ema_gamma, stale, normalize_loss, update, validate));
}

// grad * weights for the 0-d gradient of the loss. On plain CPU tensors outside a double backward, a loop: ATen's
// broadcasting product of G numbers costs more than the gather that follows it at a few thousand samples. A double
// backward records ATen's product, and a tracer's or transform's tensors (torch.compile's fake tensors, vmap's) have
// no data to read here.
at::Tensor scale_weights(const at::Tensor& grad, const at::Tensor& weights) {
  if (at::GradMode::is_enabled() || !grad.is_cpu() || !weights.is_cpu() || grad.numel() != 1 ||
      at::areAnyTensorSubclassLike({grad, weights})) {
    return grad * weights;
  }
  at::Tensor out = at::empty(weights.sizes(), weights.options());
  AT_DISPATCH_FLOATING_TYPES(weights.scalar_type(), "dro_ext_group_dro_scale", [&] {
    using weight_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "dro_ext_group_dro_grad", [&] {
      const auto g = static_cast<weight_t>(*grad.const_data_ptr<scalar_t>());
      const weight_t* w = weights.const_data_ptr<weight_t>();
      weight_t* o = out.mutable_data_ptr<weight_t>();
      for (int64_t k = 0; k < weights.numel(); ++k) o[k] = g * w[k];
    });
  });
  return out;
}

// d loss / d l_i = grad * grad_weights_{g_i}: the weights scaled, then gathered (group_sums' backward, itself
// differentiable when a double backward records it).
struct GroupDROLossBackward final : public torch::autograd::Node {
  torch::autograd::SavedVariable groups, grad_weights;
  at::ScalarType losses_dtype;

  std::string name() const override { return "GroupDROLossBackward"; }
  void release_variables() override {
    groups.reset_data();
    grad_weights.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out(1);
    if (!grads[0].defined() || !should_compute_output(0)) return out;
    const at::Tensor saved_groups = groups.unpack();
    const at::Tensor saved_weights = grad_weights.unpack();
    const BelowAutogradUnlessRecording below_autograd;
    out[0] = call_group_sums_backward(scale_weights(grads[0], saved_weights), saved_groups, losses_dtype);
    return out;
  }
};

at::Tensor group_dro_loss_autograd(const at::Tensor& losses, const at::Tensor& groups, int64_t num_groups,
                                   at::Tensor& log_q, at::Tensor& ema_loss, at::Tensor& last_loss, at::Tensor& seen,
                                   const at::Tensor& active, const at::Tensor& adjustment, double step_size,
                                   double ema_gamma, bool stale, bool normalize_loss, bool update, bool validate) {
  check_state_needs_no_grad(losses, log_q, ema_loss, last_loss);
  refuse_update_inside_backward(update);
  auto [loss, weights] = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return group_dro_loss_steps(losses, groups, num_groups, log_q, ema_loss, last_loss, seen, active, adjustment,
                                step_size, ema_gamma, stale, normalize_loss, update, validate);
  }();
  bump_state_versions(update, log_q, ema_loss, last_loss, seen);
  if (torch::autograd::compute_requires_grad(losses)) {
    auto node = make_node<GroupDROLossBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(losses));
    node->groups = torch::autograd::SavedVariable(groups, /*is_output=*/false);
    node->grad_weights = torch::autograd::SavedVariable(weights, /*is_output=*/false);
    node->losses_dtype = losses.scalar_type();
    torch::autograd::set_history(loss, node);
  }
  return loss;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dro_ext, m) {
  m.def(
      "group_dro_step_(Tensor sums, Tensor counts, Tensor(a!) log_q, Tensor(b!) ema_loss, Tensor(c!) last_loss, "
      "Tensor(d!) seen, Tensor active, Tensor adjustment, float step_size, float ema_gamma, bool stale, "
      "bool normalize_loss, bool update, *, ScalarType? out_dtype=None) -> (Tensor, Tensor)");
  m.def(
      "group_dro_loss_(Tensor losses, Tensor groups, int num_groups, Tensor(a!) log_q, Tensor(b!) ema_loss, "
      "Tensor(c!) last_loss, Tensor(d!) seen, Tensor active, Tensor adjustment, float step_size, float ema_gamma, "
      "bool stale, bool normalize_loss, bool update, bool validate) -> Tensor");
}

TORCH_LIBRARY_IMPL(dro_ext, CPU, m) {
  m.impl("group_dro_step_", &group_dro_step_cpu);
  m.impl("group_dro_loss_", &group_dro_loss_backend);
}

// group_dro_loss_ composes ops that have CUDA kernels (csrc/cuda/group_sums.cu, csrc/cuda/group_dro.cu): its own
// registration for CUDA is that composition.
#ifdef DRO_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(dro_ext, CUDA, m) {
  m.impl("group_dro_loss_", &group_dro_loss_backend);
}
#endif

TORCH_LIBRARY_IMPL(dro_ext, Autograd, m) {
  m.impl("group_dro_step_", &group_dro_step_autograd);
  m.impl("group_dro_loss_", &group_dro_loss_autograd);
}

}  // namespace dro_ext
