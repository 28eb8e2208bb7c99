// What the hand-written autograd of the ops shares (csrc/autograd.cpp, csrc/group_sums.cpp, csrc/group_dro.cpp).
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

namespace dro_ext {

// torch 2.14 holds autograd Nodes in c10::intrusive_ptr, earlier releases in std::shared_ptr (the GPU machines
// have 2.11): make the node the way this torch's set_history takes it, so one source builds against both.
template <typename NodeT, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>) {
    return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<NodeT>(std::forward<Args>(args)...);
  }
}

// Where a Node's backward calls an op through the dispatcher: with autograd when grad mode is on (a double backward
// records the call), below it otherwise (no second pass through the Autograd kernel). Held for the call's scope.
// Made after the Node has unpacked its saved tensors: unpacking runs the saved-tensor hooks, and non-reentrant
// checkpointing's hook recomputes the forward there, which must record (and save) what the first forward did;
// below autograd it recorded nothing, and checkpoint refused the recomputation.
class BelowAutogradUnlessRecording {
 public:
  BelowAutogradUnlessRecording() {
    if (!at::GradMode::is_enabled()) guard_.emplace();
  }

 private:
  std::optional<at::AutoDispatchBelowADInplaceOrView> guard_;
};

// The typed handle of one of this library's ops, for a kernel or a Node to call it through the dispatcher (which
// picks the backend and, with grad mode on, records the call). Looked up once by each caller's function-local static.
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace dro_ext
