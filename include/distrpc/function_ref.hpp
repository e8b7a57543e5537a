// FunctionRef<R(A...)>: a non-owning reference to a callable, for hooks that run a caller's code
// in place (a layer wrapping the encoding of a message in its scope). Unlike std::function it
// never allocates, which matters on the per-call path; the callable must outlive the call.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace distrpc {

template <class Sig>
class FunctionRef;

template <class R, class... A>
class FunctionRef<R(A...)> {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef> &&
                                              std::is_invocable_r_v<R, F&, A...>>>
  FunctionRef(F&& f) noexcept  // NOLINT: implicit, like std::function
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, A... a) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<A>(a)...);
        }) {}

  R operator()(A... a) const { return call_(object_, std::forward<A>(a)...); }

 private:
  void* object_;
  R (*call_)(void*, A...);
};

}  // namespace distrpc
