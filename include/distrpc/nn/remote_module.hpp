// RemoteModule<Interface>: a torch::nn::Module that lives on another worker, called through
// typed stubs generated at compile time from the interface's forward (PyTorch's
// torch.distributed.nn.RemoteModule, without its code generation). docs/remote_module.md.
//
//   struct LinearInterface { at::Tensor forward(at::Tensor x); };
//   auto rm = distrpc::nn::RemoteModule<LinearInterface>::create<torch::nn::Linear>(
//       "worker1/cpu", 64, 64);                    // built on worker1, asynchronously
//   at::Tensor y = rm.forward(x);                  // exactly forward(at::Tensor)
//   distrpc::Future<at::Tensor> f = rm.forward_async(x);
//   rm.forward(distrpc::with_timeout(100ms), x);   // per-call options first, as rpc_sync's
//   auto params = rm.remote_parameters();          // std::vector<RRef<at::Tensor>>
//   rm.eval();                                     // the remote module's flag
//   distrpc::rpc_sync<&use>("worker2", rm);        // travels inside RPC like an RRef
//
// A RemoteModule is a cheap handle (copies share one module RRef). It is not a
// torch::nn::Module: the local-module API that cannot work remotely (parameters(), to(),
// state_dict(), hooks, ...) is simply absent (the list is in docs/remote_module.md). To place one
// inside a local module tree (register_module), wrap it in RemoteModuleImpl / RemoteModuleHolder
// (remote_module_holder.hpp). Constructor arguments may be libtorch options structs
// (module_options.hpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "distrpc/future.hpp"
#include "distrpc/nn/interface.hpp"
#include "distrpc/nn/interface_module.hpp"
#include "distrpc/nn/owner_calls.hpp"
#include "distrpc/nn/remote_device.hpp"
#include "distrpc/rpc.hpp"
#include "distrpc/rref.hpp"
#include "distrpc/rref/scope.hpp"
#include "distrpc/wire.hpp"

namespace distrpc::nn {

template <class I>
class RemoteModule;

namespace detail {

struct empty_interface_base {};

// A polymorphic interface is a base of its RemoteModule: code written against `I&` takes a
// local implementation or a remote one alike, and I's default arguments apply through it.
template <class I>
using interface_base_t = std::conditional_t<std::is_polymorphic_v<I>, I, empty_interface_base>;

// I, once check_interface<I>() ran: naming it in a base-specifier makes the interface's
// static_asserts the first errors a bad interface produces.
template <class I, bool = check_interface<I>()>
struct checked_interface {
  using type = I;
};

// The typed stubs: forward / forward_async with exactly Interface::forward's parameters, and the
// same after a CallOptions (per-call options, as rpc_sync / rpc_async and the RRef proxies take
// them). forward is const unless it overrides a non-const virtual forward of the interface.
template <class Derived, class I, class Sig = interface_signature_t<I>,
          bool Const = !std::is_polymorphic_v<I> || interface_traits<I>::is_const>
class ForwardStubs;

#define DISTRPC_NN_FORWARD_STUBS(CONST, QUALS)                                                  \
  template <class Derived, class I, class R, class... A>                                        \
  class ForwardStubs<Derived, I, R(A...), CONST> : public interface_base_t<I> {                 \
   public:                                                                                      \
    /* Overrides I::forward when the interface is polymorphic. */                               \
    R forward(A... a) QUALS {                                                                   \
      return self().call_sync(CallOptions{},                                                    \
                              std::tuple<std::decay_t<A>...>(std::forward<A>(a)...));           \
    }                                                                                           \
    R forward(CallOptions opts, A... a) const {                                                 \
      return self().call_sync(opts, std::tuple<std::decay_t<A>...>(std::forward<A>(a)...));     \
    }                                                                                           \
    Future<R> forward_async(A... a) const {                                                     \
      return self().call(CallOptions{}, std::tuple<std::decay_t<A>...>(std::forward<A>(a)...)); \
    }                                                                                           \
    Future<R> forward_async(CallOptions opts, A... a) const {                                   \
      return self().call(opts, std::tuple<std::decay_t<A>...>(std::forward<A>(a)...));          \
    }                                                                                           \
                                                                                                \
   private:                                                                                     \
    const Derived& self() const { return static_cast<const Derived&>(*this); }                  \
  };
DISTRPC_NN_FORWARD_STUBS(false, )
DISTRPC_NN_FORWARD_STUBS(true, const)
#undef DISTRPC_NN_FORWARD_STUBS

// The calls the exact stubs do not take (so that overload resolution never prefers a template
// over the stub for a call the stub accepts).
template <class I, class... U>
concept not_the_stub_call =
    !std::is_invocable_v<std::add_pointer_t<interface_signature_t<I>>, U...>;

// Whether a call's first argument is its CallOptions (the options-first overloads take it).
template <class... U>
inline constexpr bool call_options_first_v = false;
template <class U0, class... U>
inline constexpr bool call_options_first_v<U0, U...> =
    std::is_same_v<std::remove_cvref_t<U0>, CallOptions>;

// Why a forward / forward_async call does not compile, in words.
template <class I, class... U>
constexpr void report_bad_forward_call() {
  constexpr std::size_t n = sizeof...(U);
  constexpr std::size_t arity = interface_traits<I>::arity;
  if constexpr (n > arity) {
    static_assert(dependent_false<U...>,
                  "distrpc::nn::RemoteModule<Interface>::forward/forward_async: too many "
                  "arguments for Interface::forward (U... in the 'required from' line are the "
                  "types passed)");
  } else if constexpr (n < arity && !std::is_polymorphic_v<I>) {
    static_assert(dependent_false<U...>,
                  "distrpc::nn::RemoteModule<Interface>::forward/forward_async: too few "
                  "arguments for Interface::forward; its default arguments apply only when the "
                  "Interface declares forward virtual (virtual R forward(at::Tensor x, int n = "
                  "2) = 0;)");
  } else {
    static_assert(dependent_false<U...>,
                  "distrpc::nn::RemoteModule<Interface>::forward/forward_async: an argument "
                  "does not convert to the type of Interface::forward's parameter at the same "
                  "position (U... in the 'required from' line are the types passed)");
  }
}

inline std::shared_ptr<RpcAgent> agent_for_remote_module() {
  try {
    return ::distrpc::detail::current_agent();
  } catch (const RpcError& e) {
    throw RpcError(std::string("RemoteModule only works in RPC: ") + e.what());
  }
}

// PyTorch's is_device_map_set: this worker has a device map towards `to`.
inline bool device_map_set_for(const RpcAgent& agent, const WorkerInfo& to) {
  const auto& maps = agent.options().device_maps;
  auto it = maps.find(to.name);
  return it != maps.end() && !it->second.empty();
}

inline WorkerInfo resolve_worker(const RpcAgent& agent, const RemoteDevice& where) {
  if (auto name = where.worker_name()) return Destination(*name).resolve(agent);
  if (auto rank = where.rank()) return Destination(*rank).resolve(agent);
  throw std::invalid_argument("distrpc::nn::RemoteModule: remote_device '" + where.str() +
                              "' names no worker: write '<workername>/<device>' or "
                              "'rank:<rank>/<device>'");
}

}  // namespace detail

template <class I>
class RemoteModule
    : public detail::ForwardStubs<RemoteModule<I>, typename detail::checked_interface<I>::type> {
  using Stubs = detail::ForwardStubs<RemoteModule<I>, I>;
  using Calls = detail::OwnerCalls<I>;
  template <class, class, class, bool>
  friend class detail::ForwardStubs;

 public:
  using interface_type = I;
  using result_type = detail::interface_result_t<I>;
  using args_tuple = detail::interface_args_t<I>;
  using module_type = InterfaceModule<I>;
  using module_rref_type = RRef<InterfaceModule<I>>;

  // An empty handle (what a RemoteModule argument is before it is decoded); using it throws.
  RemoteModule() = default;

  // Builds M(ctor_args...) on the worker `remote_device` names, through remote(), and moves it to
  // the device. Returns at once; an error of the construction (a constructor that throws, a
  // device that does not exist there) is raised by the first forward. Parse errors of
  // remote_device (std::invalid_argument), an unknown worker and a missing RPC agent (RpcError)
  // are raised here. M is a torch::nn::Module subclass or a ModuleHolder (torch::nn::Linear).
  template <class M, class... C>
  static RemoteModule create(const RemoteDevice& remote_device, C&&... ctor_args) {
    if constexpr (detail::check_module<I, M>() && detail::check_construction<I, M, C...>()) {
      auto agent = detail::agent_for_remote_module();
      const WorkerInfo dst = detail::resolve_worker(*agent, remote_device);
      auto rref = ::distrpc::remote<&detail::construct_module<I, M, detail::wire_arg_t<C>...>>(
          dst, detail::DeviceArg{remote_device.device()},
          detail::wire_arg_t<C>(std::forward<C>(ctor_args))...);
      return RemoteModule(remote_device, detail::device_map_set_for(*agent, dst), std::move(rref));
    } else {
      throw std::logic_error("unreachable: M does not fit the interface");
    }
  }
  template <class M, class... C>
  static RemoteModule create(std::string_view remote_device, C&&... ctor_args) {
    return create<M>(RemoteDevice(remote_device), std::forward<C>(ctor_args)...);
  }

  // A RemoteModule around an existing module RRef (e.g. another RemoteModule's
  // get_module_rref()). `remote_device` gives on / device / is_device_map_set; calls go to the
  // RRef's owner, whatever `on` says (as in PyTorch).
  static RemoteModule init_from_module_rref(const RemoteDevice& remote_device,
                                            module_rref_type module_rref) {
    if (!module_rref.valid()) {
      throw std::invalid_argument(
          "distrpc::nn::RemoteModule::init_from_module_rref: empty module RRef");
    }
    auto agent = detail::agent_for_remote_module();
    const WorkerInfo on = detail::resolve_worker(*agent, remote_device);
    return RemoteModule(remote_device, detail::device_map_set_for(*agent, on),
                        std::move(module_rref));
  }
  static RemoteModule init_from_module_rref(std::string_view remote_device,
                                            module_rref_type module_rref) {
    return init_from_module_rref(RemoteDevice(remote_device), std::move(module_rref));
  }
  // The same for an RRef to a module of type M (an RRef<torch::nn::Linear>, an RRef<MyModule>):
  // its owner wraps that very module object for the interface (one remote() to the owner).
  template <class M>
  static RemoteModule init_from_module_rref(std::string_view remote_device, RRef<M> module_rref) {
    if constexpr (detail::check_module<I, M>()) {
      if (!module_rref.valid()) {
        throw std::invalid_argument(
            "distrpc::nn::RemoteModule::init_from_module_rref: empty module RRef");
      }
      auto wrapped =
          ::distrpc::remote<&detail::adopt_module<I, M>>(module_rref.owner(), module_rref);
      return init_from_module_rref(remote_device, std::move(wrapped));
    } else {
      throw std::logic_error("unreachable: M does not fit the interface");
    }
  }

  // ---- forward -------------------------------------------------------------------------------
  // R forward(Args...) and Future<R> forward_async(Args...), each also with a CallOptions first
  // (rm.forward(distrpc::with_timeout(100ms), x)), come from the stubs base. These catch every
  // other call: the interface's default arguments (polymorphic interfaces), or a static_assert
  // saying what is wrong.
  using Stubs::forward;
  using Stubs::forward_async;

  template <class... U>
  result_type forward(U&&... u) const
      requires(detail::not_the_stub_call<I, U...> && !detail::call_options_first_v<U...>) {
    return forward(CallOptions{}, std::forward<U>(u)...);
  }
  template <class... U>
  Future<result_type> forward_async(U&&... u) const
      requires(detail::not_the_stub_call<I, U...> && !detail::call_options_first_v<U...>) {
    return forward_async(CallOptions{}, std::forward<U>(u)...);
  }
  template <class... U>
  result_type forward(CallOptions opts,
                      U&&... u) const requires detail::not_the_stub_call<I, U...> {
    if constexpr (detail::fills_defaults<I, U...>) {
      return call_sync(opts, detail::record_arguments<I>(std::forward<U>(u)...));
    } else {
      detail::report_bad_forward_call<I, U...>();
      throw std::logic_error("unreachable");
    }
  }
  template <class... U>
  Future<result_type> forward_async(CallOptions opts,
                                    U&&... u) const requires detail::not_the_stub_call<I, U...> {
    if constexpr (detail::fills_defaults<I, U...>) {
      return call(opts, detail::record_arguments<I>(std::forward<U>(u)...));
    } else {
      detail::report_bad_forward_call<I, U...>();
      throw std::logic_error("unreachable");
    }
  }

  // ---- the remote module ------------------------------------------------------------------------

  // One RRef per parameter of the remote module, owned by its worker (for a distributed
  // optimizer). PyTorch's remote_parameters(recurse).
  std::vector<RRef<at::Tensor>> remote_parameters(bool recurse = true) const {
    return remote_parameters(CallOptions{}, recurse);
  }
  std::vector<RRef<at::Tensor>> remote_parameters(CallOptions opts, bool recurse = true) const {
    const State& s = state("remote_parameters()");
    return ::distrpc::rpc_sync<&detail::parameter_rrefs<I>>(s.module_rref.owner(), opts,
                                                            s.module_rref, recurse);
  }

  module_rref_type get_module_rref() const { return state("get_module_rref()").module_rref; }

  // Sets the remote module's training flag (torch::nn::Module::train / eval), synchronously.
  void train(bool on = true) const { train(CallOptions{}, on); }
  void train(CallOptions opts, bool on = true) const {
    const State& s = state("train()");
    ::distrpc::rpc_sync<&detail::set_training<I>>(s.module_rref.owner(), opts, s.module_rref, on);
  }
  void eval() const { train(false); }
  void eval(CallOptions opts) const { train(opts, false); }

  // ---- attributes (PyTorch's on, device, is_device_map_set) ---------------------------------

  bool valid() const noexcept { return state_ != nullptr; }
  // The worker as remote_device named it: its name, or its rank for "rank:<n>/...".
  std::variant<std::string, int> on() const {
    const RemoteDevice& where = state("on()").where;
    if (auto name = where.worker_name()) return *name;
    if (auto rank = where.rank()) return *rank;
    throw std::logic_error("distrpc::nn::RemoteModule: remote_device '" + where.str() +
                           "' names no worker");
  }
  // The module's device, as text ("cpu", "cuda:0").
  std::string device() const { return state("device()").where.device().str(); }
  bool is_device_map_set() const { return state("is_device_map_set()").device_map_set; }
  const RemoteDevice& remote_device() const { return state("remote_device()").where; }
  // Where calls go: the module RRef's owner.
  WorkerInfo owner() const { return state("owner()").module_rref.owner(); }

  // ---- serialization (inside RPC messages only, like RRef) ------------------------------------
  // What travels: the interface's identity, remote_device (on + device), is_device_map_set and
  // the module RRef (forked with the RRef protocol).
  template <class Archive>
  void save(Archive& ar) const {
    static_assert(std::is_same_v<Archive, wire::OutputArchive>,
                  "distrpc::nn::RemoteModule can only be serialized by distrpc's RPC layer (as an "
                  "argument or result of rpc_sync/rpc_async/remote): it holds an RRef, which "
                  "means something only inside an RPC session");
    const State& s = state("serialization");
    if (::distrpc::detail::tls_rref_encode == nullptr) {
      throw RpcError(
          "Cannot serialize a RemoteModule outside RPC: a RemoteModule can only be serialized "
          "inside an RPC call (as an argument or result of rpc_sync/rpc_async/remote)");
    }
    ar(detail::interface_hash<I>(), s.where, s.device_map_set, s.module_rref);
  }
  template <class Archive>
  void load(Archive& ar) {
    static_assert(std::is_same_v<Archive, wire::InputArchive>,
                  "distrpc::nn::RemoteModule can only be deserialized by distrpc's RPC layer");
    (void)detail::InterfaceRegistrar<I>::registered;
    std::uint64_t hash = 0;
    ar(hash);
    if (hash != detail::interface_hash<I>()) {
      throw wire::DecodeError(
          "a RemoteModule made for another interface was received as a "
          "distrpc::nn::RemoteModule<" +
          std::string(::distrpc::detail::type_name<I>()) +
          "> (sender and receiver disagree on the interface or its forward's signature)");
    }
    RemoteDevice where;
    bool device_map_set = false;
    module_rref_type module_rref;
    ar(where, device_map_set, module_rref);
    if (!where.has_worker()) {
      throw wire::DecodeError("a RemoteModule arrived without a worker in its remote_device ('" +
                              where.str() + "')");
    }
    state_ =
        std::make_shared<const State>(std::move(where), device_map_set, std::move(module_rref));
  }

 private:
  // Shared by the copies of one handle in this process.
  struct State {
    State(RemoteDevice w, bool map_set, module_rref_type rref)
        : where(std::move(w)), device_map_set(map_set), module_rref(std::move(rref)) {}
    const RemoteDevice where;
    const bool device_map_set;
    const module_rref_type module_rref;
    // Set once a call through the RRef succeeded: the owner knows the module by its RRef id.
    mutable std::atomic<bool> owner_knows{false};
  };

  RemoteModule(RemoteDevice where, bool device_map_set, module_rref_type rref)
      : state_(std::make_shared<const State>(std::move(where), device_map_set, std::move(rref))) {
    (void)detail::InterfaceRegistrar<I>::registered;
  }

  const State& state(const char* what) const {
    if (!state_) {
      throw std::logic_error(std::string("distrpc::nn::RemoteModule: ") + what +
                             " on an empty RemoteModule handle");
    }
    return *state_;
  }

  // PyTorch's forward_async: rpc_async(module_rref.owner(), _remote_forward, (module_rref,
  // device, is_device_map_set, args...)); after the first success, the RRef's id instead of the
  // RRef (module_directory.hpp). rpc_async's steps, spelled out to reach the reply future.
  Future<result_type> call(CallOptions opts, args_tuple&& args) const {
    const State& s = state("forward()");
    auto agent = ::distrpc::detail::current_agent();
    const WorkerInfo owner = s.module_rref.owner();
    const detail::DeviceArg device{s.where.device()};
    ::distrpc::detail::SentCall sent;
    if (s.owner_knows.load(std::memory_order_acquire)) {
      sent = std::apply(
          [&](auto&&... a) {
            return ::distrpc::detail::send_call<&Calls::forward_by_id>(
                agent, owner, opts, /*internal=*/false, s.module_rref.rref_id(), device,
                s.device_map_set, std::move(a)...);
          },
          std::move(args));
      // The fork is held until the reply, so the owner's entry outlives this call even if the
      // last handle goes meanwhile (a release would otherwise race the request). Inline on the
      // I/O thread: dropping an RRef there only queues its delete.
      sent.reply.add_done_callback([keep = s.module_rref](const Future<wire::Message>&) {});
    } else {
      sent = std::apply(
          [&](auto&&... a) {
            return ::distrpc::detail::send_call<&Calls::forward>(
                agent, owner, opts, /*internal=*/false, s.module_rref, device, s.device_map_set,
                std::move(a)...);
          },
          std::move(args));
      sent.reply.add_done_callback([state = state_](const Future<wire::Message>& r) {
        if (!r.has_error()) state->owner_knows.store(true, std::memory_order_release);
      });
    }
    auto typed = ::distrpc::detail::decode_reply<result_type>(std::move(sent), agent, owner.id);
    ::distrpc::detail::register_in_scope(typed);
    return typed;
  }

  // forward(): as rpc_sync; waiting on the reply polls for it first (the future's wait driver).
  result_type call_sync(CallOptions opts, args_tuple&& args) const {
    auto f = call(opts, std::move(args));
    if constexpr (std::is_void_v<result_type>) {
      f.value();
    } else {
      return f.value();
    }
  }

  std::shared_ptr<const State> state_;
};

}  // namespace distrpc::nn
