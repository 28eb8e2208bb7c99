// The O(G) part of one online Group DRO step (exponentiated gradient; docs/design.md section 1.9, "Online Group
// DRO"): the only copy of its per-group rules in C++, shared by the CPU kernel (csrc/group_dro.cpp) and the CUDA
// kernel (csrc/cuda/group_dro.cu). dro_ext/groups.py's GroupDROLoss._update is the same rules in PyTorch ops (the
// fallback, and the greedy CVaR mode, which has no native kernel).
//
// Per group g, from its batch sum s_g and count n_g (of every rank with a process group) and its state:
//   m_g     = s_g / max(n_g, 1)                 (0 for a group absent from the batch; s_g times the reciprocal)
//   ema_g  <- (1 - gamma) ema_g + gamma m_g      once seen before, m_g at its first batch; kept while absent
//   last_g <- m_g                                kept while absent
//   a_g     = (stale ? last_g : m_g) + C_g / sqrt(N_g)      divided by sum_h a_h when normalize_loss (and it is != 0)
//   x_g     = log q_g + step_size a_g            (-inf for a disabled group, and for one at log q = -inf)
//   log q_g <- x_g - logsumexp(x)
// (x_g is formed as log q_g + step_size (a_g - max_h a_h), h over the groups of x_h > -inf: the same log q, see
// GroupInputs::log_weight) and the loss sum_g q_g m_g with its gradient d loss / d s_g = q_g / max(n_g, 1) (q detached).
//
// A batch in which a present group's mean is not finite (an infinite or NaN loss) takes no step: the state stays as
// it was, and the loss and its gradient are those under the current q (infinite or NaN, as that mean is). A training
// loop skips such a batch (GradScaler skips its step, and many loops any step of a non-finite loss); taken into the
// state, one such batch left log q NaN (or every other group at q = 0) for every later batch. So does a mean past
// the state dtype's range (float64 losses of 1e39 beside a float32 state), which the state would store as infinite,
// and a live group's score (mean plus adjustment) past float64's range though both are finite.
//
// Everything is computed in double from the inputs' values and rounded once where it is stored; the sums over the
// groups are in a fixed order (group order on the CPU, a fixed block tree on CUDA), so a step is bitwise
// repeatable.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include "floating_types.h"

namespace dro_ext {

struct GroupDROStepArgs {
  double step_size;
  double ema_gamma;
  bool stale;           // missing="stale": an absent group scores its last mean loss (else 0)
  bool normalize_loss;  // the scores divided by their sum
  bool update;          // false: the loss under the current q, the state left alone
};

// One group's inputs, read in double.
struct GroupInputs {
  double sum, count, log_q, ema, last, adjustment;
  bool seen, active;

  C10_HOST_DEVICE bool present() const { return count > 0.0; }
  // Whether the batch must take no step for this group (see the top of this file), given its mean m: a mean not
  // finite, or past `largest_stored`, the state dtype's largest value.
  C10_HOST_DEVICE bool blocks_the_step(double m, double largest_stored) const {
    return present() && !(m >= -largest_stored && m <= largest_stored);  // (false for NaN as for the infinities)
  }
  C10_HOST_DEVICE double inverse_count() const { return 1.0 / (count > 1.0 ? count : 1.0); }
  C10_HOST_DEVICE double mean() const { return sum * inverse_count(); }
  C10_HOST_DEVICE double new_last(double m) const { return present() ? m : last; }
  C10_HOST_DEVICE double new_ema(double m, double gamma) const {
    if (!present()) return ema;
    return seen ? (1.0 - gamma) * ema + gamma * m : m;
  }
  // a_g before normalize_loss.
  C10_HOST_DEVICE double score(double m, bool stale) const { return (stale ? new_last(m) : m) + adjustment; }
  // Whether q_g can be above 0 after the step: not for a disabled group, nor for one whose q is exactly 0 (log q =
  // -inf, an underflow), which q_g exp(step_size a_g) keeps at 0 whatever its score.
  C10_HOST_DEVICE bool live() const { return active && log_q != -INFINITY; }
  // a_g as step_size multiplies it, given the mean of the scores over the G groups (used with normalize_loss only):
  // a_g / sum_h a_h, taken as (a_g / G) / mean, since finite scores can sum past float64's range (two of 1e308: the
  // step was a_g / inf = 0, q stood still) where their mean cannot. A zero mean leaves the scores as they are, a NaN
  // one makes them NaN, as the division would; -inf for a group that is not live.
  C10_HOST_DEVICE double step_score(double a, double score_mean, double num_groups,
                                    const GroupDROStepArgs& args) const {
    if (!live()) return -INFINITY;
    return args.normalize_loss && score_mean != 0.0 ? (a / num_groups) / score_mean : a;
  }
  // Whether this group's score a_g passes float64's range though its parts are finite (a mean of 1e308 plus an
  // adjustment of 1e308), for a live group, or for any group with normalize_loss (every score enters the mean that
  // divides them): the step would take that infinite largest score off it (inf - inf), leaving log q NaN for every
  // later batch, or divide every score by an infinite mean, so the batch takes no step, as for a mean not finite.
  // Given its mean m and its score a = score(m, args.stale).
  C10_HOST_DEVICE bool score_overflows(double m, double a, const GroupDROStepArgs& args) const {
    if (!(::fabs(a) == INFINITY)) return false;  // (the one test most groups take)
    const double base = args.stale ? new_last(m) : m;
    return (live() || args.normalize_loss) && ::fabs(base) < INFINITY;
  }
  // x_g - step_size * shift, from step_score's value. The step takes for shift the largest score of a live group
  // (shift_from_max: 0 where it is infinite). The log-sum-exp takes the same constant step_size * shift off every
  // x_g, so log q is mathematically the same; in floats x_g then stays near log q_g for the live groups of the
  // largest score whatever step_size * a_g is: it cannot overflow to inf - inf = NaN (step_size * a_g beyond the
  // double range), nor absorb log q_g (groups tied at the largest score keep their shares of q when step_size * a_g
  // is large against log q_g), and at least one x_g is finite (the largest score's, were every other x_g to
  // underflow to -inf). A score is finite here but for a stale group's last mean in a state loaded with an
  // infinite or NaN one (a batch with a mean not finite takes no step, see the top of this file): an infinite score
  // leaves the scores as they are, its group's log q NaN as in torch.logsumexp; a NaN one makes every log q NaN.
  C10_HOST_DEVICE double log_weight(double step_score, double shift, const GroupDROStepArgs& args) const {
    if (!live()) return -INFINITY;  // q = 0 stays 0 exactly, whatever the score (-inf + inf would be NaN)
    return log_q + args.step_size * (step_score - shift);
  }
};

template <typename T>
struct StridedVector {  // a 1-D tensor's elements, any stride
  T* data;
  int64_t stride;
  C10_HOST_DEVICE T& operator[](int64_t g) const { return data[g * stride]; }
};

template <typename T>
StridedVector<T> strided_vector(const at::Tensor& t) {
  if constexpr (std::is_const_v<T>) {
    return {t.const_data_ptr<std::remove_const_t<T>>(), t.stride(0)};
  } else {
    return {t.mutable_data_ptr<T>(), t.stride(0)};
  }
}

// The operands of one step, on the host or the device: the inputs of each group, and its state to write. out_t is
// the dtype of the loss and the gradient weights (float or double, see prepare_group_dro_step).
template <typename sums_t, typename state_t, typename result_t>
struct GroupDROStepOperands {
  using out_t = result_t;

  StridedVector<const sums_t> sums, counts;
  StridedVector<state_t> log_q, ema, last;
  StridedVector<bool> seen;
  StridedVector<const bool> active;
  StridedVector<const double> adjustment;

  C10_HOST_DEVICE C10_ALWAYS_INLINE GroupInputs inputs(int64_t g) const {
    return GroupInputs{static_cast<double>(sums[g]), static_cast<double>(counts[g]), static_cast<double>(log_q[g]),
                       static_cast<double>(ema[g]),  static_cast<double>(last[g]),  adjustment[g],
                       seen[g],                      active[g]};
  }
  // Group g's share of the rule, from its inputs, mean m and score a (taken once by the step's loop).
  C10_HOST_DEVICE C10_ALWAYS_INLINE bool blocks_the_step(const GroupInputs& in, double m, double a,
                                                         const GroupDROStepArgs& args) const {
    return in.blocks_the_step(m, static_cast<double>(std::numeric_limits<state_t>::max())) ||
           in.score_overflows(m, a, args);
  }
  // Group g's new state, from its inputs (read before) and its new log q.
  C10_HOST_DEVICE C10_ALWAYS_INLINE void write(int64_t g, const GroupInputs& in, double m, double new_log_q,
                                               double ema_gamma) const {
    ema[g] = static_cast<state_t>(in.new_ema(m, ema_gamma));
    last[g] = static_cast<state_t>(in.new_last(m));
    seen[g] = in.seen || in.present();
    log_q[g] = static_cast<state_t>(new_log_q);
  }
};

// adjustment must be float64 (the op converts it).
template <typename sums_t, typename state_t, typename out_t>
GroupDROStepOperands<sums_t, state_t, out_t> group_dro_step_operands(const at::Tensor& sums,
                                                                     const at::Tensor& counts, at::Tensor& log_q,
                                                                     at::Tensor& ema_loss, at::Tensor& last_loss,
                                                                     at::Tensor& seen, const at::Tensor& active,
                                                                     const at::Tensor& adjustment) {
  return {strided_vector<const sums_t>(sums),     strided_vector<const sums_t>(counts),
          strided_vector<state_t>(log_q),         strided_vector<state_t>(ema_loss),
          strided_vector<state_t>(last_loss),     strided_vector<bool>(seen),
          strided_vector<const bool>(active),     strided_vector<const double>(adjustment)};
}

// The shift taken from a largest value (of the x_g for the log-sum-exp, of the live groups' scores for x_g): that
// value, or 0 where it is infinite (as torch.logsumexp: an infinite x_g then makes the sum infinite, and log q NaN
// for that group; a NaN x_g makes the sum NaN; log_weight says where such a score can still come from).
C10_HOST_DEVICE inline double shift_from_max(double max_value) {
  return max_value == INFINITY || max_value == -INFINITY ? 0.0 : max_value;
}

// log q_g = x_g - logsumexp(x), from e_g = exp(x_g - shift) summed to exp_total: (x_g - shift) - log(exp_total), in
// that order. x_g - (log(exp_total) + shift) would lose log(exp_total) to a shift past 2^53 of it (x_g ~ -1e17 after
// large steps), storing log q_g = 0 for two groups of q_g = 1/2: a q summing to 2.
C10_HOST_DEVICE inline double normalized_log_q(double x, double shift, double log_exp_total) {
  return (x - shift) - log_exp_total;
}

// q_g is taken as 0 in the loss and its gradient weights (never in log q, which keeps every group's value) where
// log q_g (or x_g - shift, before the division by sum_h e_h <= G) lies below negligible_log_q<out_t>(): every q_g,
// q_g / n_g and q_g m_g then stays a normal number of out_t for n_g, G < 2^31 (which take off at most e^-43).
// Subnormal operands cost a hundred cycles apiece on x86 (glibc's exp itself takes a slow path for every result it
// underflows), and a run where q concentrates on a few of many groups meets them for most groups at every step.
// What is dropped weighs below e^-44 (float32) or e^-660 (float64) against the largest q_g.
template <typename out_t>
C10_HOST_DEVICE constexpr double negligible_log_q() {
  return std::is_same_v<out_t, double> ? -660.0 : -44.0;  // log of the smallest normal (-708.4, -87.3) + 43
}
C10_HOST_DEVICE inline double exp_or_zero(double x, double below) { return x < below ? 0.0 : ::exp(x); }

// The loss term q_g m_g of a group whose q_g the rule above dropped (log q_g below negligible_log_q<out_t>()), which
// the mean can still make count: a group that training had all but dropped (log q = (0, -50)) and whose mean then
// blows up in an update=False evaluation (means (1, 1e25)) read 1.0 against 1929.75. Formed from its logarithm, so
// that no subnormal q_g is multiplied; kept where the product reaches the same bound. Two bounds on log |m|,
// |m| - 1 and then 4 (|m|^(1/4) - 1) (from 4 log |m|^(1/4)), spare the log for every mean that cannot lift it (a
// library call per dropped group cost the step 12% at G = 1024). A mean not finite gives 0 * m_g (NaN), as the
// kept groups' terms do.
template <typename out_t>
C10_HOST_DEVICE inline double dropped_group_term(double log_q, double m) {
  const double below = negligible_log_q<out_t>(), abs_m = ::fabs(m);
  if (!(abs_m < INFINITY) || log_q + (abs_m - 1.0) < below) return 0.0 * m;
  if (log_q + 4.0 * (::sqrt(::sqrt(abs_m)) - 1.0) < below) return 0.0 * m;
  return ::copysign(exp_or_zero(log_q + ::log(abs_m), below), m);
}

// t in dtype: t itself when it has it. (A kernel beneath autograd must not call at::Tensor::to for nothing: that
// returns its input, which the custom-op contract forbids an op below autograd to do.)
inline at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// The operands: (G,) sums and counts of one floating dtype (float32 or float64); the state, on their device: log_q,
// ema_loss and last_loss of one floating dtype, seen and active bool, adjustment floating.
inline void check_group_dro_step_args(const at::Tensor& sums, const at::Tensor& counts, const at::Tensor& log_q,
                                      const at::Tensor& ema_loss, const at::Tensor& last_loss, const at::Tensor& seen,
                                      const at::Tensor& active, const at::Tensor& adjustment) {
  TORCH_CHECK_VALUE(sums.dim() == 1 && sums.numel() >= 1,
                    "dro_ext: sums must be a 1-D tensor of num_groups >= 1 group sums, got shape ", sums.sizes());
  TORCH_CHECK_TYPE(sums.scalar_type() == at::kFloat || sums.scalar_type() == at::kDouble,
                   "dro_ext: sums must be float32 or float64 (group_sums' output), got ", sums.scalar_type());
  TORCH_CHECK_TYPE(counts.scalar_type() == sums.scalar_type(), "dro_ext: counts must have the dtype of sums, ",
                   sums.scalar_type(), ", got ", counts.scalar_type());
  TORCH_CHECK_TYPE(is_kernel_floating_type(log_q.scalar_type()) && ema_loss.scalar_type() == log_q.scalar_type() &&
                       last_loss.scalar_type() == log_q.scalar_type(),
                   "dro_ext: log_q, ema_loss and last_loss must share one floating dtype, got ", log_q.scalar_type(),
                   ", ", ema_loss.scalar_type(), " and ", last_loss.scalar_type());
  TORCH_CHECK_TYPE(seen.scalar_type() == at::kBool && active.scalar_type() == at::kBool,
                   "dro_ext: seen and active must be bool tensors, got ", seen.scalar_type(), " and ",
                   active.scalar_type());
  TORCH_CHECK_TYPE(is_kernel_floating_type(adjustment.scalar_type()), "dro_ext: adjustment must be floating, got ",
                   adjustment.scalar_type());
  for (const at::Tensor* t : {&counts, &log_q, &ema_loss, &last_loss, &seen, &active, &adjustment}) {
    TORCH_CHECK_VALUE(t->sizes() == sums.sizes(), "dro_ext: every operand of group_dro_step_ must have the shape of "
                      "sums, ", sums.sizes(), " (one entry per group), got ", t->sizes());
    TORCH_CHECK_VALUE(t->device() == sums.device(), "dro_ext: GroupDROLoss's state is on ", t->device(),
                      " but the group sums are on ", sums.device(), "; move the module to the losses' device "
                      "(module.to(device))");
  }
}

// What the CPU and CUDA entry points of group_dro_step_ do before their kernel: check the operands, make the
// outputs (the loss and the gradient weights) in out_dtype, float32 or float64, by default the promoted dtype of the
// sums and the state, take the adjustment in float64 (a float64 buffer unless the module was cast) and gather the
// scalars. (GroupDROLoss passes float64 sums, which keep a group of float32 losses summing past float32's range
// finite, with out_dtype the losses' accumulate dtype promoted with the state's: float32 for float32 losses, whose
// weights a float64 result would double in bytes and keep down to e^-660 instead of e^-44.)
struct GroupDROStepCall {
  at::Tensor loss, weights, adjustment;
  GroupDROStepArgs args;
};

inline GroupDROStepCall prepare_group_dro_step(const at::Tensor& sums, const at::Tensor& counts,
                                               const at::Tensor& log_q, const at::Tensor& ema_loss,
                                               const at::Tensor& last_loss, const at::Tensor& seen,
                                               const at::Tensor& active, const at::Tensor& adjustment,
                                               double step_size, double ema_gamma, bool stale, bool normalize_loss,
                                               bool update, std::optional<at::ScalarType> out_dtype) {
  check_group_dro_step_args(sums, counts, log_q, ema_loss, last_loss, seen, active, adjustment);
  const at::ScalarType result_dtype = out_dtype.value_or(c10::promoteTypes(sums.scalar_type(), log_q.scalar_type()));
  TORCH_CHECK_TYPE(result_dtype == at::kFloat || result_dtype == at::kDouble,
                   "dro_ext: out_dtype must be float32 or float64, got ", result_dtype);
  const auto options = sums.options().dtype(result_dtype);
  return {at::empty({}, options), at::empty(sums.sizes(), options), as_dtype(adjustment, at::kDouble),
          GroupDROStepArgs{step_size, ema_gamma, stale, normalize_loss, update}};
}

// kernel(operands) with the operands typed by the dtypes the step takes, the one rule of both entry points: sums and
// counts float32 or float64, the state any floating dtype (a module cast to half keeps half buffers), the loss and
// the weights float32 or float64 (call's).
template <typename Kernel>
void with_group_dro_step_operands(const at::Tensor& sums, const at::Tensor& counts, at::Tensor& log_q,
                                  at::Tensor& ema_loss, at::Tensor& last_loss, at::Tensor& seen,
                                  const at::Tensor& active, const GroupDROStepCall& call, const Kernel& kernel) {
  AT_DISPATCH_FLOATING_TYPES(sums.scalar_type(), "dro_ext_group_dro_step", [&] {
    using sums_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, log_q.scalar_type(), "dro_ext_group_dro_state", [&] {
      using state_t = scalar_t;
      AT_DISPATCH_FLOATING_TYPES(call.loss.scalar_type(), "dro_ext_group_dro_result", [&] {
        kernel(group_dro_step_operands<sums_t, state_t, scalar_t>(sums, counts, log_q, ema_loss, last_loss, seen,
                                                                  active, call.adjustment));
      });
    });
  });
}

}  // namespace dro_ext
