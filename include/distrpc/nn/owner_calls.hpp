// The functions a RemoteModule runs on its module's owner, registered like any RPC function.
//
// PyTorch generates `_remote_forward` from a text template per interface; here it is one class
// template, OwnerCalls<I>, whose forward has the interface's exact parameters after the three
// the template passes first (module RRef, device, is_device_map_set). Registration: a binary that
// instantiates RemoteModule<I> registers them (its calls do, and RemoteModule's own static
// registrar does); a binary that only serves modules writes DISTRPC_REGISTER_MODULE(I, M, ...).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "distrpc/nn/device_transfer.hpp"
#include "distrpc/nn/interface.hpp"
#include "distrpc/nn/interface_module.hpp"
#include "distrpc/nn/module_directory.hpp"
#include "distrpc/nn/module_options.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rref.hpp"

namespace distrpc::nn::detail {

// A constructor argument as it travels: decayed, C strings as std::string (a pointer cannot be
// sent), and options structs (module_options.hpp) inside WireOptions, which a decoder can make
// empty first.
template <class T>
struct wire_arg {
  using type = T;
};
template <class T>
requires has_options_codec<T>
struct wire_arg<T> {
  using type = WireOptions<T>;
};
template <>
struct wire_arg<const char*> {
  using type = std::string;
};
template <>
struct wire_arg<char*> {
  using type = std::string;
};
template <class T>
using wire_arg_t = typename wire_arg<std::decay_t<T>>::type;

// What the module's constructor receives for an argument that travelled as W: the options
// themselves for WireOptions, W otherwise.
template <class W>
struct ctor_arg {
  using type = W;
  static W&& get(W& w) { return std::move(w); }
};
template <class O>
struct ctor_arg<WireOptions<O>> {
  using type = const O&;
  static const O& get(const WireOptions<O>& w) { return w.get(); }
};
template <class W>
using ctor_arg_t = typename ctor_arg<W>::type;

// The module's device as a call argument: decoded arguments are default-constructed first, which
// c10::Device is not.
struct DeviceArg {
  c10::Device device{c10::kCPU};

  template <class Archive>
  void serialize(Archive& ar) {
    ar(device);
  }
};

// Builds M (its module type, for a ModuleHolder) on the owner and moves it to `device`. Runs
// through remote(): an exception here becomes the RRef's value, raised by the first forward.
template <class I, class M, class... C>
InterfaceModule<I> construct_module(DeviceArg device, C... args) {
  using Impl = module_impl_t<M>;
  auto module = std::make_shared<Impl>(ctor_arg<C>::get(args)...);
  module->to(device.device);
  return InterfaceModule<I>::adopt(std::move(module));
}

// init_from_module_rref for an RRef<M> made elsewhere: the owner wraps the same module object.
template <class I, class M>
InterfaceModule<I> adopt_module(RRef<M> module) {
  M& m = module.local_value();
  if constexpr (is_module_holder_v<M>) {
    return InterfaceModule<I>::adopt(m);
  } else {
    // The owner's cell holds the module through a shared_ptr, so torch::nn::Module's
    // enable_shared_from_this gives a handle that shares it.
    auto shared = std::dynamic_pointer_cast<M>(m.shared_from_this());
    if (!shared) {
      throw std::logic_error(
          "distrpc::nn::RemoteModule::init_from_module_rref: the module held "
          "by " +
          module.str() + " is not a '" + std::string(::distrpc::detail::type_name<M>()) + "'");
    }
    return InterfaceModule<I>::adopt(std::move(shared));
  }
}

template <class I, class Sig = interface_signature_t<I>>
struct OwnerCalls;

template <class I, class R, class... A>
struct OwnerCalls<I, R(A...)> {
  using Module = InterfaceModule<I>;
  using Args = std::tuple<std::decay_t<A>...>;

  // PyTorch's _remote_forward. The module's creation error, if any, is raised by local_value().
  // Records the module under its RRef id for the short form below.
  static R forward(RRef<Module> module, DeviceArg device, bool device_map_set,
                   std::decay_t<A>... args) {
    const Module& m = module.local_value();
    ModuleDirectory<I>::instance().put(module.rref_id(), m);
    return run(m, device.device, device_map_set, Args(std::move(args)...));
  }

  // The short form, once a call through the RRef succeeded (module_directory.hpp says why).
  static R forward_by_id(RRefId module, DeviceArg device, bool device_map_set,
                         std::decay_t<A>... args) {
    auto m = ModuleDirectory<I>::instance().find(module);
    if (!m) {
      throw RpcError("distrpc::nn::RemoteModule: no module for interface '" +
                     std::string(::distrpc::detail::type_name<I>()) + "' is held under RRef " +
                     module.str() + " on " + ::distrpc::get_worker_info().str() +
                     " (its RRef was released)");
    }
    return run(*m, device.device, device_map_set, Args(std::move(args)...));
  }

  // On a non-CPU device: tensor arguments go to the module's device; without a device map every
  // tensor of the result comes back to the CPU (the only device the wire carries without one);
  // with a device map the result is returned as it is, for a device-aware transport to carry.
  static R run(const Module& m, c10::Device device, bool device_map_set, Args&& args) {
    if (device.is_cpu()) return m.forward(std::move(args));
    to_device(args, device);
    if constexpr (std::is_void_v<R>) {
      m.forward(std::move(args));
    } else {
      R out = m.forward(std::move(args));
      if (!device_map_set) to_device(out, c10::Device(c10::kCPU));
      return out;
    }
  }
};

// remote_parameters(): one owner RRef per parameter (sharing the parameter's storage, so an
// optimizer stepping through them updates the module).
template <class I>
std::vector<RRef<at::Tensor>> parameter_rrefs(RRef<InterfaceModule<I>> module, bool recurse) {
  std::vector<RRef<at::Tensor>> out;
  for (auto& p : module.local_value().module().parameters(recurse)) out.emplace_back(p);
  return out;
}

template <class I>
void set_training(RRef<InterfaceModule<I>> module, bool on) {
  module.local_value().train(on);
}

// Everything a RemoteModule<I> may ask of a worker, whatever the module type.
template <class I>
bool register_interface() {
  ::distrpc::detail::ensure_library_registered<&OwnerCalls<I>::forward>();
  ::distrpc::detail::ensure_library_registered<&OwnerCalls<I>::forward_by_id>();
  ::distrpc::detail::ensure_library_registered<&parameter_rrefs<I>>();
  ::distrpc::detail::ensure_library_registered<&set_training<I>>();
  return true;
}

template <class I>
struct InterfaceRegistrar {
  // Instantiated by RemoteModule<I>: a binary that uses the interface also serves it.
  static inline const bool registered = register_interface<I>();
};

template <class I, class M, class... C>
constexpr bool check_construction() {
  using Impl = module_impl_t<M>;
  constexpr bool constructible = std::is_constructible_v<Impl, ctor_arg_t<wire_arg_t<C>>...>;
  static_assert(constructible,
                "distrpc::nn::RemoteModule<Interface>::create<M>(remote_device, args...): M "
                "cannot be constructed from these arguments (for a ModuleHolder such as "
                "torch::nn::Linear, its module type, e.g. torch::nn::LinearImpl, must be)");
  constexpr bool serializable = (::distrpc::detail::wire_serializable_v<wire_arg_t<C>> && ...);
  static_assert(serializable,
                "distrpc::nn::RemoteModule<Interface>::create<M>(remote_device, args...): every "
                "constructor argument travels to the remote worker and must be serializable: "
                "numbers, strings, tensors, standard containers, a type with a cereal serialize "
                "function, or an options struct with a codec (LinearOptions, Conv2dOptions, ... "
                "in distrpc/nn/module_options.hpp); for another options struct, specialize "
                "distrpc::nn::OptionsCodec<TheOptions> with static save(Archive&, const "
                "TheOptions&) and load(Archive&) as that header shows");
  return constructible && serializable;
}

template <class I, class M, class... C>
bool register_module() {
  static_assert(check_interface<I>() && check_module<I, M>() && check_construction<I, M, C...>());
  register_interface<I>();
  ::distrpc::detail::ensure_library_registered<&construct_module<I, M, wire_arg_t<C>...>>();
  ::distrpc::detail::ensure_library_registered<&adopt_module<I, M>>();
  return true;
}

}  // namespace distrpc::nn::detail

// Makes this worker able to build module M for RemoteModule<Interface>::create<M>(device, args...)
// called with arguments of types CtorArgs... (as the caller passes them: `64` is int, "x" is
// std::string), and to serve RemoteModule<Interface> calls. Needed only in binaries that do not
// call create<M> themselves (SPMD programs register what they instantiate).
//   DISTRPC_REGISTER_MODULE(LinearInterface, torch::nn::Linear, int, int);
#define DISTRPC_REGISTER_MODULE(Interface, ...)                                            \
  [[maybe_unused]] static const bool DISTRPC_REGISTER_CAT(distrpc_module_reg_, __LINE__) = \
      ::distrpc::nn::detail::register_module<Interface, __VA_ARGS__>()
