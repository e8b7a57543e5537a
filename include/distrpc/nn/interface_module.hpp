// InterfaceModule<I>: a torch::nn::Module seen through interface I. It is the value a
// RemoteModule's RRef holds on its owner (RRef<InterfaceModule<I>>, get_module_rref()).
//
// The concrete module type M is known where the module is built (create<M>, on the owner) and
// nowhere else: a RemoteModule<I> travels to workers that never heard of M. So the owner keeps
// the module behind a pointer to its torch::nn::Module base plus one plain function pointer,
// made from M when the module was adopted, that calls M::forward with the interface's argument
// tuple. Everything typed by M happens inside that function; everything else sees only I.
//
// On the owner (e.g. in a function that received the module RRef):
//   InterfaceModule<I>& m = module_rref.local_value();
//   m.module().is_training();  m.module().parameters();
//   std::shared_ptr<MyModule> mine = m.module_as<MyModule>();   // null if it is another type
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "distrpc/function_id.hpp"
#include "distrpc/nn/interface.hpp"
#include "distrpc/wire/type_spelling.hpp"

namespace distrpc::nn {

namespace detail {

// M itself, or the module a ModuleHolder (torch::nn::Linear, TORCH_MODULE types) wraps.
template <class M, bool = std::is_base_of_v<torch::detail::ModuleHolderIndicator, M>>
struct module_impl {
  using type = M;
};
template <class M>
struct module_impl<M, true> {
  using type = typename M::ContainedType;
};
template <class M>
using module_impl_t = typename module_impl<std::remove_cv_t<M>>::type;

template <class M>
inline constexpr bool is_module_holder_v =
    std::is_base_of_v<torch::detail::ModuleHolderIndicator, std::remove_cv_t<M>>;

// Whether Impl::forward takes the interface's arguments (as rvalues, how the owner passes the
// decoded values) and what it returns.
template <class Impl, class Args>
struct forward_call {
  static constexpr bool callable = false;
  using result = void;
};
template <class Impl, class... A>
requires requires(Impl& m, A&&... a) {
  m.forward(std::move(a)...);
}
struct forward_call<Impl, std::tuple<A...>> {
  static constexpr bool callable = true;
  using result = decltype(std::declval<Impl&>().forward(std::declval<A&&>()...));
};

template <class I, class M>
constexpr bool check_module() {
  using Impl = module_impl_t<M>;
  static_assert(std::is_base_of_v<torch::nn::Module, Impl>,
                "distrpc::nn::RemoteModule<Interface>: Expect `M(args...)` to be an instance of "
                "torch::nn::Module: derive M from torch::nn::Module, or pass a ModuleHolder such "
                "as torch::nn::Linear");
  if constexpr (std::is_base_of_v<torch::nn::Module, Impl>) {
    using Call = forward_call<Impl, interface_args_t<I>>;
    static_assert(Call::callable,
                  "distrpc::nn::RemoteModule<Interface>: M::forward cannot be called with the "
                  "argument types of Interface::forward: M needs a forward taking them (e.g. "
                  "at::Tensor forward(const at::Tensor& x) for at::Tensor forward(at::Tensor x))");
    if constexpr (Call::callable) {
      using R = interface_result_t<I>;
      constexpr bool converts =
          std::is_void_v<R> || std::is_convertible_v<typename Call::result, R>;
      static_assert(converts,
                    "distrpc::nn::RemoteModule<Interface>: the result of M::forward does not "
                    "convert to the result type of Interface::forward");
      return converts;
    }
  }
  return false;
}

}  // namespace detail

namespace detail {
template <class I>
class ModuleDirectory;
}  // namespace detail

template <class I>
class InterfaceModule {
 public:
  using interface_type = I;
  using result_type = detail::interface_result_t<I>;
  using args_tuple = detail::interface_args_t<I>;

  // Wraps `module` (a torch::nn::Module subclass whose forward fits I), sharing its ownership.
  template <class M>
  static InterfaceModule adopt(std::shared_ptr<M> module) {
    static_assert(!detail::is_module_holder_v<M>,
                  "distrpc::nn::InterfaceModule::adopt: pass the holder itself (adopt(linear)), "
                  "not a shared_ptr to it");
    if constexpr (detail::check_module<I, M>()) {
      if (!module) throw std::invalid_argument("distrpc::nn::InterfaceModule::adopt: null module");
      void* object = module.get();
      return InterfaceModule(std::make_shared<const Core>(
          Core{std::shared_ptr<torch::nn::Module>(std::move(module)), object, &call_forward<M>}));
    }
  }
  // A ModuleHolder (torch::nn::Linear, ...) shares its module.
  template <class H>
  requires detail::is_module_holder_v<H>
  static InterfaceModule adopt(const H& holder) {
    if (holder.is_empty()) {
      throw std::invalid_argument("distrpc::nn::InterfaceModule::adopt: empty module holder");
    }
    return adopt(holder.ptr());
  }

  torch::nn::Module& module() const { return *core_->module; }
  const std::shared_ptr<torch::nn::Module>& module_ptr() const noexcept { return core_->module; }
  // The module as M (or, for a ModuleHolder M, as its module type); null when it is not one.
  template <class M>
  std::shared_ptr<detail::module_impl_t<M>> module_as() const {
    return std::dynamic_pointer_cast<detail::module_impl_t<M>>(core_->module);
  }

  // Runs M::forward. Runs concurrently when several calls arrive at once, as PyTorch's does:
  // torch modules tolerate concurrent forward passes; a module that does not must lock inside.
  result_type forward(args_tuple args) const {
    return core_->forward(core_->object, std::move(args));
  }

  bool is_training() const { return core_->module->is_training(); }
  void train(bool on = true) const { core_->module->train(on); }

 private:
  friend class detail::ModuleDirectory<I>;

  // Shared by the copies of one InterfaceModule; the owner's directory holds it weakly, so it
  // dies with the owner's value.
  struct Core {
    std::shared_ptr<torch::nn::Module> module;
    void* object;  // the same object as `module`, as its concrete type M
    result_type (*forward)(void*, args_tuple&&);
  };

  explicit InterfaceModule(std::shared_ptr<const Core> core) : core_(std::move(core)) {}

  template <class M>
  static result_type call_forward(void* object, args_tuple&& args) {
    M& m = *static_cast<M*>(object);
    return std::apply(
        [&m](auto&&... a) -> result_type {
          if constexpr (std::is_void_v<result_type>) {
            m.forward(std::move(a)...);
          } else {
            return m.forward(std::move(a)...);
          }
        },
        std::move(args));
  }

  std::shared_ptr<const Core> core_;
};

}  // namespace distrpc::nn

namespace distrpc {

// A module held for interface I, in a DISTRPC_REMOTE declaration (e.g. a factory returning
// RRef<InterfaceModule<I>>, which RemoteModule<I>::init_from_module_rref wraps): "Module<I>",
// where I names itself (DISTRPC_TYPE_NAME).
template <class I>
struct TypeName<nn::InterfaceModule<I>> {
  static constexpr bool known = detail::spellable<I>();
  static std::string name() { return "Module<" + detail::spelling<I>() + ">"; }
};

}  // namespace distrpc
