// A RemoteModule as a submodule of a local torch::nn::Module tree (docs/remote_module.md, "Inside
// a local module tree").
//
//   struct Net : torch::nn::Module {
//     Net(distrpc::nn::RemoteModule<LinearInterface> remote)
//         : local(register_module("local", torch::nn::Linear(4, 8))),
//           encoder(register_module("encoder", distrpc::nn::RemoteModuleHolder<LinearInterface>(
//                                                  std::move(remote)))) {}
//     at::Tensor forward(at::Tensor x) { return encoder->forward(local->forward(x)); }
//     torch::nn::Linear local;
//     distrpc::nn::RemoteModuleHolder<LinearInterface> encoder;
//   };
//
// RemoteModuleImpl<I> is a torch::nn::Module and a RemoteModule<I> at once: the tree sees a child
// module (named, printed, walked by modules() / named_children()), the parent's forward calls the
// typed stubs. What the tree does to its children and what happens to the remote part:
//   - train(on) / eval(): one RPC sets the remote module's flag, then the local flag (a failed RPC
//     leaves both as they were);
//   - parameters(), named_parameters(), buffers(), state_dict, torch::save, to(device),
//     zero_grad(): the remote module's tensors are not local and are not listed; use
//     remote_parameters() (a distributed optimizer takes those RRefs);
//   - clone(): refused with a logic_error (a copy would need a second remote module);
//   - copies of the holder share this one module, as for every ModuleHolder.
// The handle itself (RemoteModule<I>, by value, sendable over RPC) is handle() or a plain copy.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>

#include "distrpc/function_id.hpp"
#include "distrpc/nn/remote_module.hpp"

namespace distrpc::nn {

template <class I>
class RemoteModuleImpl : public torch::nn::Module, public RemoteModule<I> {
 public:
  using handle_type = RemoteModule<I>;

  // Wraps a valid handle (made by RemoteModule<I>::create or init_from_module_rref).
  explicit RemoteModuleImpl(RemoteModule<I> handle)
      : torch::nn::Module(module_name()), RemoteModule<I>(checked(std::move(handle))) {}

  // The by-value handle: what to send over RPC or keep beside the tree.
  const RemoteModule<I>& handle() const noexcept { return *this; }

  // The remote flag first (one RPC), then this module's own flag (and its children's, of which it
  // has none), so that a failed RPC changes neither.
  void train(bool on = true) override { train(CallOptions{}, on); }
  void train(CallOptions opts, bool on = true) {
    RemoteModule<I>::train(opts, on);
    torch::nn::Module::train(on);
  }
  void eval() { train(false); }
  void eval(CallOptions opts) { train(opts, false); }

  // torch::nn::Module's, not RemoteModule's wire serialization: torch::save of a parent saves
  // nothing for this child (it holds no local tensor).
  using torch::nn::Module::load;
  using torch::nn::Module::save;

  // distrpc::nn::RemoteModule<LinearInterface>(worker1/cpu)
  void pretty_print(std::ostream& stream) const override {
    stream << name() << "(" << RemoteModule<I>::remote_device().str() << ")";
  }

  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<c10::Device>& /*device*/ = c10::nullopt) const override {
    throw std::logic_error(clone_text());
  }

 private:
  // What a Cloneable parent's clone() calls on its children.
  void clone_(torch::nn::Module& /*other*/, const c10::optional<c10::Device>& /*device*/) override {
    throw std::logic_error(clone_text());
  }

  static std::string module_name() {
    return "distrpc::nn::RemoteModule<" + std::string(::distrpc::detail::type_name<I>()) + ">";
  }

  std::string clone_text() const {
    return module_name() + " cannot be cloned: its module lives on " +
           RemoteModule<I>::owner().str() +
           "; create another RemoteModule (RemoteModule::create) for a second copy";
  }

  static RemoteModule<I> checked(RemoteModule<I> handle) {
    if (!handle.valid()) {
      throw std::invalid_argument(module_name() +
                                  ": cannot wrap an empty RemoteModule handle (make it with "
                                  "RemoteModule::create or init_from_module_rref)");
    }
    return handle;
  }
};

// The ModuleHolder of RemoteModuleImpl<I>, as TORCH_MODULE makes one for a local module:
// RemoteModuleHolder<I>(handle), holder->forward(x), register_module("name", holder).
template <class I>
using RemoteModuleHolder = torch::nn::ModuleHolder<RemoteModuleImpl<I>>;

}  // namespace distrpc::nn
