// How a RemoteModule interface becomes a signature (docs/remote_module.md, "From interface to
// stubs").
//
// An interface is a plain struct that declares one member function `forward`:
//
//   struct LinearInterface { at::Tensor forward(at::Tensor x); };
//   struct MyInterface {            // polymorphic: default arguments work, and a RemoteModule is-a
//     virtual ~MyInterface() = default;       // MyInterface (local and remote implementations
//     virtual std::tuple<std::string, int, at::Tensor> forward(   // are interchangeable)
//         at::Tensor t, int n, std::string word = "default") = 0;
//   };
//
// interface_traits<I> takes `&I::forward` apart with member-pointer traits: R, Args..., const.
// check_interface<I>() turns every way an interface can be unusable into a static_assert whose
// text says what to write instead. A member-pointer type carries no default arguments, so
// defaults are recovered by calling I::forward itself on a recorder (DefaultArgRecorder): the
// compiler fills the defaults at that call, virtual dispatch lands in the recorder's override,
// which keeps the complete argument list. That is why defaults need a virtual forward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "distrpc/function_id.hpp"
#include "distrpc/future.hpp"
#include "distrpc/wire/boxed_value.hpp"

namespace distrpc::nn::detail {

template <class... T>
inline constexpr bool dependent_false = false;

// `&I::forward`'s type taken apart. Anything else (a static function, a ref-qualified member)
// is `valid = false`, and check_interface says so.
template <class P>
struct forward_traits {
  static constexpr bool valid = false;
  static constexpr bool is_const = false;
  static constexpr bool is_noexcept = false;
  using result = void;
  using signature = void();
  using args = std::tuple<>;
  static constexpr std::size_t arity = 0;
  static constexpr bool params_by_value_or_const_ref = true;
  static constexpr bool params_serializable = true;
};

template <class A>
inline constexpr bool value_or_const_ref_v =
    !std::is_reference_v<A> ||
    (std::is_lvalue_reference_v<A> && std::is_const_v<std::remove_reference_t<A>>);

#define DISTRPC_NN_FORWARD_TRAITS(QUALS, CONST, NOEXCEPT)                                  \
  template <class C, class R, class... A>                                                  \
  struct forward_traits<R (C::*)(A...) QUALS> {                                            \
    static constexpr bool valid = true;                                                    \
    static constexpr bool is_const = CONST;                                                \
    static constexpr bool is_noexcept = NOEXCEPT;                                          \
    using result = R;                                                                      \
    using signature = R(A...);                                                             \
    using args = std::tuple<std::decay_t<A>...>;                                           \
    static constexpr std::size_t arity = sizeof...(A);                                     \
    static constexpr bool params_by_value_or_const_ref = (value_or_const_ref_v<A> && ...); \
    static constexpr bool params_serializable =                                            \
        (::distrpc::detail::wire_serializable_v<std::decay_t<A>> && ...);                  \
  };
DISTRPC_NN_FORWARD_TRAITS(, false, false)
DISTRPC_NN_FORWARD_TRAITS(const, true, false)
DISTRPC_NN_FORWARD_TRAITS(noexcept, false, true)
DISTRPC_NN_FORWARD_TRAITS(const noexcept, true, true)
#undef DISTRPC_NN_FORWARD_TRAITS

// True when `&I::forward` names exactly one member (not overloaded, not a template).
template <class I>
concept has_single_forward = requires {
  &I::forward;
};

template <class I, bool = has_single_forward<I>>
struct interface_traits : forward_traits<void> {};
template <class I>
struct interface_traits<I, true> : forward_traits<decltype(&I::forward)> {};

template <class I>
using interface_result_t = typename interface_traits<I>::result;
template <class I>
using interface_args_t = typename interface_traits<I>::args;
template <class I>
using interface_signature_t = typename interface_traits<I>::signature;

// Thrown by the recorder when R cannot be made without arguments; caught right where it is
// thrown (record_arguments), never seen by users.
struct recorded_call {};

template <class R>
R recorder_result() {
  if constexpr (std::is_void_v<R>) {
    return;
  } else if constexpr (std::is_default_constructible_v<R>) {
    return R{};
  } else {
    throw recorded_call{};
  }
}

// An implementation of a polymorphic interface that only records the arguments it receives.
template <class I, class Sig = interface_signature_t<I>, bool Const = interface_traits<I>::is_const>
class DefaultArgRecorder;

#define DISTRPC_NN_RECORDER(CONST, QUALS)                        \
  template <class I, class R, class... A>                        \
  class DefaultArgRecorder<I, R(A...), CONST> final : public I { \
   public:                                                       \
    mutable std::optional<std::tuple<std::decay_t<A>...>> args;  \
    R forward(A... a) QUALS override {                           \
      args.emplace(std::forward<A>(a)...);                       \
      return recorder_result<R>();                               \
    }                                                            \
  };
DISTRPC_NN_RECORDER(false, )
DISTRPC_NN_RECORDER(true, const)
#undef DISTRPC_NN_RECORDER

// True when I::forward, called as written with U..., is valid C++ (default arguments included)
// and the interface is polymorphic, so a recorder can see the complete argument list.
template <class I, class... U>
concept fills_defaults = std::is_polymorphic_v<I> && requires(I& i, U&&... u) {
  i.forward(std::forward<U>(u)...);
};

// The complete argument tuple of the call `I::forward(u...)`, defaults filled in by the compiler.
template <class I, class... U>
interface_args_t<I> record_arguments(U&&... u) {
  DefaultArgRecorder<I> recorder;
  I& as_interface = recorder;
  try {
    as_interface.forward(std::forward<U>(u)...);
  } catch (const recorded_call&) {
  }
  return std::move(*recorder.args);
}

template <class I>
constexpr bool polymorphic_recorder_ok() {
  if constexpr (std::is_polymorphic_v<I>) {
    return !std::is_abstract_v<DefaultArgRecorder<I>> &&
           std::is_default_constructible_v<DefaultArgRecorder<I>>;
  } else {
    return true;
  }
}

// Every requirement on an interface, each with the text a user needs. Returns whether all hold,
// so the caller can stop instantiating the rest (fewer follow-up errors).
template <class I>
constexpr bool check_interface() {
  static_assert(std::is_class_v<I>,
                "distrpc::nn::RemoteModule<Interface>: Interface must be a struct declaring "
                "forward, e.g. struct LinearInterface { at::Tensor forward(at::Tensor x); };");
  static_assert(has_single_forward<I>,
                "distrpc::nn::RemoteModule<Interface>: Interface must declare exactly one member "
                "function named forward (not overloaded, not a template), e.g. struct "
                "LinearInterface { at::Tensor forward(at::Tensor x); }; (for defaults declare it "
                "virtual: virtual R forward(at::Tensor x, int n = 2) = 0;)");
  if constexpr (std::is_class_v<I> && has_single_forward<I>) {
    using T = interface_traits<I>;
    static_assert(T::valid,
                  "distrpc::nn::RemoteModule<Interface>: Interface::forward must be a non-static "
                  "member function without & or && qualifier, e.g. at::Tensor forward(at::Tensor "
                  "x);");
    if constexpr (T::valid) {
      using R = typename T::result;
      static_assert(!T::is_noexcept,
                    "distrpc::nn::RemoteModule<Interface>: Interface::forward must not be "
                    "noexcept: a remote call can fail (the peer, the network, the module) and the "
                    "error reaches the caller as an exception");
      static_assert(T::params_by_value_or_const_ref,
                    "distrpc::nn::RemoteModule<Interface>: the parameters of Interface::forward "
                    "must be values or const references (a remote call cannot write back through "
                    "a reference)");
      static_assert(!is_future_v<R>,
                    "distrpc::nn::RemoteModule<Interface>: Interface::forward returns the value "
                    "(R forward(...)); RemoteModule::forward_async gives the Future<R>");
      static_assert(!std::is_reference_v<R> && !std::is_const_v<R>,
                    "distrpc::nn::RemoteModule<Interface>: Interface::forward must return a "
                    "non-const value (the result is a copy made on the remote worker)");
      static_assert(T::params_serializable,
                    "distrpc::nn::RemoteModule<Interface>: every parameter type of "
                    "Interface::forward must be serializable by distrpc: at::Tensor, "
                    "c10::Scalar, c10::IValue, standard containers of those, or a type with a "
                    "cereal serialize function");
      static_assert(std::is_void_v<R> || ::distrpc::detail::wire_serializable_v<R>,
                    "distrpc::nn::RemoteModule<Interface>: the result type of Interface::forward "
                    "must be serializable by distrpc (at::Tensor, standard containers, a type "
                    "with a cereal serialize function)");
      static_assert(polymorphic_recorder_ok<I>(),
                    "distrpc::nn::RemoteModule<Interface>: a polymorphic Interface must be "
                    "default-constructible and declare forward virtual, as its only pure virtual "
                    "function");
      return !T::is_noexcept && T::params_by_value_or_const_ref && !is_future_v<R> &&
             !std::is_reference_v<R> && !std::is_const_v<R> && polymorphic_recorder_ok<I>();
    }
  }
  return false;
}

// FNV-1a of the interface's name and signature, as the compiler spells them: what travels with
// a RemoteModule so the receiver can tell it was sent for another interface.
template <class I>
constexpr std::uint64_t interface_hash() {
  return ::distrpc::detail::fnv1a(::distrpc::detail::type_name<I>()) ^
         (::distrpc::detail::fnv1a(::distrpc::detail::type_name<interface_signature_t<I>>()) *
          1099511628211ull);
}

}  // namespace distrpc::nn::detail
