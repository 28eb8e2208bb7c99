// What the hand-written autograd Nodes of the ops share (csrc/autograd.cpp, csrc/group_sums.cpp).
#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>

namespace dro_ext {

// torch 2.14 holds autograd Nodes in c10::intrusive_ptr, earlier releases in std::shared_ptr (the GPU machines
// have 2.11): make the node the way this torch's set_history takes it, so one source builds against both.
template <typename NodeT>
auto make_node() {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>) {
    return c10::make_intrusive<NodeT>();
  } else {
    return std::make_shared<NodeT>();
  }
}

}  // namespace dro_ext
