// RRef<T>: a reference to a value that lives on one worker (its owner), usable from any worker.
//
//   distrpc::RRef<at::Tensor> r = distrpc::remote<&add>("worker1", x, y);  // owner: worker1
//   at::Tensor v = r.to_here();                      // fetch a copy
//   distrpc::rpc_sync<&use>("worker2", r);           // share it: worker2 gets its own fork
//   distrpc::RRef<Counter> c(Counter{});             // a local owner RRef
//   int n = c.rpc_sync<&Counter::increment>(1);      // run a method on the owner's object
//
// An RRef<T> is a cheap handle; copies in one process share one reference. The owner keeps the
// value until every user reference in the group is gone (the fork/confirm/delete protocol of
// docs/rref.md, kept in rref/context.hpp). RRefs serialize only inside RPC messages: as
// arguments and results of rpc_sync/rpc_async/remote (also nested in containers and inside
// values fetched with to_here()); any other cereal archive does not compile.
#pragma once

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "distrpc/rpc.hpp"
#include "distrpc/rref/context.hpp"
#include "distrpc/rref/id.hpp"
#include "distrpc/rref/proxy.hpp"
#include "distrpc/rref/scope.hpp"
#include "distrpc/wire/boxed_value.hpp"
#include "distrpc/wire/type_spelling.hpp"

namespace distrpc {

template <class T>
class RRef;

namespace detail {

template <class T>
struct is_rref : std::false_type {};
template <class T>
struct is_rref<RRef<T>> : std::true_type {};

template <class R, class Packed>
RRef<R> remote_packed(const std::shared_ptr<RpcAgent>& agent, const WorkerInfo& dst,
                      CallOptions opts, RequestHeader header, const Packed& packed,
                      const std::string& what);

}  // namespace detail

template <class T>
class RRef {
  static_assert(!std::is_reference_v<T> && !std::is_const_v<T> && !std::is_array_v<T>,
                "distrpc::RRef<T>: T must be a non-const object type (or void, see RRef<void>)");

 public:
  using value_type = T;

  // An empty handle (what an RRef argument is before it is decoded); using it throws.
  RRef() = default;

  // A local owner RRef holding `value` (RPC must be initialized). Not known to the RRef
  // bookkeeping until it is first shared.
  explicit RRef(T value) requires std::move_constructible<T>
      : RRef(std::make_shared<T>(std::move(value))) {}
  explicit RRef(std::shared_ptr<T> value) {
    if (!value) throw std::invalid_argument("distrpc::RRef<T>: null value");
    impl_ = detail::rref_context_of(*detail::current_agent())
                ->make_local_owner(std::static_pointer_cast<void>(std::move(value)),
                                   detail::value_ops<T>());
  }
  // A local owner RRef of T(args...), for types that cannot be moved (mutexes inside).
  template <class... A>
  static RRef make(A&&... args) {
    return RRef(std::make_shared<T>(std::forward<A>(args)...));
  }

  bool valid() const noexcept { return impl_ != nullptr; }
  bool is_owner() const { return impl().is_owner; }
  WorkerInfo owner() const { return impl().owner; }
  std::string owner_name() const { return impl().owner.name; }
  // True once the owner knows this reference (always on the owner). Inside a function that
  // received it as an argument it is always true: the callee waits for the confirmation.
  bool confirmed_by_owner() const { return impl().confirmed.load(); }
  RRefId rref_id() const { return impl().id; }
  ForkId fork_id() const { return impl().fork_id; }
  // The creation future: completes when remote() reached the owner (fails with its error, e.g.
  // the timeout); ready at once for RRefs that were not made by remote().
  Future<void> get_future() const { return impl().created; }
  // OwnerRRef(GloballyUniqueId(created_on=R, local_id=N)) or
  // UserRRef(RRefId = GloballyUniqueId(...), ForkId = GloballyUniqueId(...)).
  std::string str() const { return impl().str(); }

  // The owned object (owner only; waits for a remote() to this worker to produce it).
  T& local_value() const {
    const auto& i = impl();
    if (!i.is_owner) {
      auto ctx = i.ctx.lock();
      const std::string me = ctx ? ctx->self().str() : std::string("this worker");
      throw RpcError("For UserRRef(rref_id=" + i.id.str() + ", fork_id=" + i.fork_id.str() +
                     "), can't call localValue() on user " + me + ". Call it on owner " +
                     i.owner.str());
    }
    wait_owned(kUnsetRpcTimeout);
    return *static_cast<T*>(i.cell->value.get());
  }

  // A copy of the value: fetched from the owner (waiting until remote() produced it), or copied
  // locally on the owner. Remote errors keep their type.
  T to_here(std::chrono::milliseconds timeout = kUnsetRpcTimeout) const {
    static_assert(std::is_copy_constructible_v<T> && std::is_default_constructible_v<T>,
                  "distrpc::RRef<T>::to_here(): T must be default-constructible and copyable");
    static_assert(detail::wire_serializable_v<T>,
                  "distrpc::RRef<T>::to_here(): T must be serializable (give it a cereal "
                  "serialize function) to be fetched; call its methods through the proxies");
    const auto& i = impl();
    if (i.is_owner) {
      wait_owned(timeout);
      return *static_cast<const T*>(i.cell->value.get());
    }
    if (i.deleted.load()) {
      throw RpcError(i.deleted_text("Cannot call to_here() on it after deletion."));
    }
    throw_if_creation_failed();
    auto ctx = i.ctx.lock();
    if (!ctx) throw RpcError(i.deleted_text("Cannot call to_here() on it after deletion."));
    // Not waiting for the owner's confirmation first: a fetch that overtakes its remote() call
    // waits on the owner until the value exists, and fails here with the creation if that fails.
    CallAttachments sent;
    auto reply = ctx->fetch_value(impl_, timeout, sent);
    try {
      reply.wait();  // polls for the reply first (the future's wait driver)
    } catch (...) {
      throw_if_creation_failed();
      throw;
    }
    const wire::Message& m = reply.value();
    T out{};
    detail::RRefDecodeScope scope{ctx, i.owner.id, {}};
    detail::DecodeScopeGuard guard(detail::tls_rref_decode, &scope);
    ctx->decode_reply(i.owner.id, sent, [&] { wire::decode(m, out); });
    return out;
  }

  // The name of the owned value's type, as the owner's compiler spells it. On a user the first
  // call asks the owner (one RPC, waiting for a slow creation; creation errors are raised) and
  // later calls return the same future.
  Future<std::string> type_name_async() const {
    auto& i = impl();
    if (i.is_owner) {
      auto cell = i.cell;
      return cell->ready.then([cell](const Future<void>& done) {
        done.wait();
        return cell->ops->type_name;
      });
    }
    std::lock_guard<std::mutex> lk(i.mu);
    if (!i.type_future && i.owner_lost) return make_exceptional_future<std::string>(i.owner_lost);
    if (!i.type_future) {
      auto ctx = i.ctx.lock();
      if (!ctx) throw RpcError(i.deleted_text("Cannot query its type after deletion."));
      i.type_future = ctx->type_query(impl_, kUnsetRpcTimeout);
    }
    return *i.type_future;
  }
  std::string type_name(std::chrono::milliseconds timeout = kUnsetRpcTimeout) const {
    auto f = type_name_async();
    auto ctx = impl().ctx.lock();
    const auto limit = ctx ? ctx->timeout_for(timeout) : timeout;
    if (limit.count() > 0 && !f.wait_for(limit)) {
      throw RpcTimeoutError(timeout_text(limit) + " (type query of " + str() + ")");
    }
    return f.value();
  }

  // ---- proxies: run a method of T on the owner's object ----------------------------------------
  //   rref.rpc_sync<&T::m>(args...)   -> the result
  //   rref.rpc_async<&T::m>(args...)  -> Future of the result
  //   rref.remote<&T::m>(args...)     -> RRef of the result, owned by this RRef's owner
  // Each takes an optional CallOptions first (timeouts). Checked at compile time.
  template <auto M, class... A>
  auto rpc_async(CallOptions opts, A&&... args) const {
    if constexpr (detail::check_method<M, T>()) {
      using P = detail::MethodProxy<M>;
      detail::ensure_library_registered<&P::call>();  // the library's own proxy
      return ::distrpc::rpc_async<&P::call>(owner(), opts, *this, std::forward<A>(args)...);
    }
  }
  template <auto M, class... A>
  auto rpc_async(A&&... args) const {
    return rpc_async<M>(CallOptions{}, std::forward<A>(args)...);
  }
  template <auto M, class... A>
  auto rpc_sync(CallOptions opts, A&&... args) const {
    if constexpr (detail::check_method<M, T>()) {
      using P = detail::MethodProxy<M>;
      detail::ensure_library_registered<&P::call>();  // the library's own proxy
      return ::distrpc::rpc_sync<&P::call>(owner(), opts, *this, std::forward<A>(args)...);
    }
  }
  template <auto M, class... A>
  auto rpc_sync(A&&... args) const {
    return rpc_sync<M>(CallOptions{}, std::forward<A>(args)...);
  }
  template <auto M, class... A>
  auto remote(CallOptions opts, A&&... args) const;
  template <auto M, class... A>
  auto remote(A&&... args) const {
    return remote<M>(CallOptions{}, std::forward<A>(args)...);
  }

  // By name, for methods registered with DISTRPC_REGISTER_METHOD(T, m). R and the argument types
  // must be the method's exactly. An unknown name throws AttributeError ("has no attribute").
  // Each takes an optional CallOptions first, as the typed proxies do.
  template <class R, class... A>
  R rpc_sync_by_name(CallOptions opts, const std::string& method, A&&... args) const {
    return rpc_async_by_name<R>(opts, method, std::forward<A>(args)...).value();
  }
  template <class R, class... A>
  R rpc_sync_by_name(const std::string& method, A&&... args) const {
    return rpc_sync_by_name<R>(CallOptions{}, method, std::forward<A>(args)...);
  }
  template <class R, class... A>
  Future<R> rpc_async_by_name(CallOptions opts, const std::string& method, A&&... args) const {
    try {
      auto e = find_method<R, std::decay_t<A>...>(method);
      auto agent = detail::current_agent();
      const WorkerInfo dst = agent->worker(owner());
      auto packed = std::make_tuple(*this, std::decay_t<A>(std::forward<A>(args))...);
      auto reply =
          detail::send_packed(agent, dst, agent->effective_timeout(opts.timeout), header_of(e),
                              packed, "call to '" + e.proxy_name + "'", &opts.device_map);
      auto typed = detail::decode_reply<R>(reply, agent, dst.id);
      detail::register_in_scope(typed);
      return typed;
    } catch (...) {
      return make_exceptional_future<R>(std::current_exception());
    }
  }
  template <class R, class... A>
  Future<R> rpc_async_by_name(const std::string& method, A&&... args) const {
    return rpc_async_by_name<R>(CallOptions{}, method, std::forward<A>(args)...);
  }
  template <class R, class... A>
  RRef<R> remote_by_name(CallOptions opts, const std::string& method, A&&... args) const {
    auto e = find_method<R, std::decay_t<A>...>(method);
    auto agent = detail::current_agent();
    auto packed = std::make_tuple(*this, std::decay_t<A>(std::forward<A>(args))...);
    return detail::remote_packed<R>(agent, agent->worker(owner()), opts, header_of(e), packed,
                                    "remote() of '" + e.proxy_name + "'");
  }
  template <class R, class... A>
  RRef<R> remote_by_name(const std::string& method, A&&... args) const {
    return remote_by_name<R>(CallOptions{}, method, std::forward<A>(args)...);
  }

  // ---- serialization (inside RPC messages only) ------------------------------------------------
  template <class Archive>
  void save(Archive& ar) const {
    static_assert(std::is_same_v<Archive, wire::OutputArchive>,
                  "distrpc::RRef<T> can only be serialized by distrpc's RPC layer: pass it as an "
                  "argument or result of rpc_sync/rpc_async/remote");
    if (!impl_) throw std::invalid_argument("distrpc::RRef<T>: cannot send an empty RRef handle");
    if (!impl_->is_owner && impl_->deleted.load()) {
      throw RpcError(impl_->deleted_text("Cannot call fork an UserRRef after deletion."));
    }
    detail::RRefEncodeScope* scope = detail::tls_rref_encode;
    if (scope == nullptr || !scope->ctx) {
      throw RpcError(impl_->str() +
                     " can only be serialized inside an RPC call (as an argument or result of "
                     "rpc_sync/rpc_async/remote)");
    }
    ar(scope->ctx->prepare_child_fork(impl_, *scope));
  }
  template <class Archive>
  void load(Archive& ar) {
    static_assert(std::is_same_v<Archive, wire::InputArchive>,
                  "distrpc::RRef<T> can only be deserialized by distrpc's RPC layer");
    detail::RRefForkData d;
    ar(d);
    detail::RRefDecodeScope* scope = detail::tls_rref_decode;
    if (scope == nullptr || !scope->ctx) {
      throw wire::DecodeError("an RRef can only be received inside an RPC message");
    }
    if (!d.rref_id.valid() || !d.fork_id.valid() || d.owner < 0 || d.parent != scope->parent) {
      throw wire::DecodeError("malformed RRef from worker " + std::to_string(scope->parent) +
                              ": owner " + std::to_string(d.owner) + ", RRef id " +
                              d.rref_id.str() + ", fork id " + d.fork_id.str());
    }
    if (d.type_hash != detail::type_hash_of<T>()) {
      throw wire::DecodeError("RRef " + d.rref_id.str() + " does not hold a '" +
                              detail::value_type_name<T>() +
                              "' (sender and receiver disagree on its type)");
    }
    impl_ = scope->ctx->on_child_received(d, *scope);
  }

 private:
  template <class U>
  friend class RRef;
  template <class R, class Packed>
  friend RRef<R> detail::remote_packed(const std::shared_ptr<RpcAgent>&, const WorkerInfo&,
                                       CallOptions, RequestHeader, const Packed&,
                                       const std::string&);

  explicit RRef(std::shared_ptr<detail::RRefImpl> impl) : impl_(std::move(impl)) {}

  detail::RRefImpl& impl() const {
    if (!impl_) throw std::logic_error("distrpc::RRef<T>: use of an empty RRef handle");
    return *impl_;
  }

  void wait_owned(std::chrono::milliseconds timeout) const {
    const auto& i = impl();
    auto ctx = i.ctx.lock();
    const auto limit =
        ctx ? ctx->timeout_for(timeout) : (timeout.count() < 0 ? kNoRpcTimeout : timeout);
    i.cell->wait(limit, i.str());
    if (i.cell->ops->type_hash != detail::type_hash_of<T>()) {
      throw RpcError(i.str() + " holds a '" + i.cell->ops->type_name + "', not a '" +
                     detail::value_type_name<T>() + "'");
    }
  }

  void throw_if_creation_failed() const {
    const auto& i = impl();
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lk(i.mu);
      e = i.creation_error;
    }
    if (!e) return;
    const std::string text = "Error occurred during RRef creation of " + i.str() +
                             " via distrpc::remote() on " + i.owner.str() + ": " +
                             detail::exception_text(e);
    try {
      std::rethrow_exception(e);
    } catch (const RpcTimeoutError&) {
      throw RpcTimeoutError(text + " (the RRef may still exist on the owner)");
    } catch (...) {
      throw RpcError(text);
    }
  }

  template <class R, class... A>
  detail::MethodEntry find_method(const std::string& method) const {
    auto e = detail::MethodRegistry::instance().find(typeid(T), method);
    if (!e) {
      throw AttributeError("'" + std::string(detail::type_name<T>()) +
                           "' object has no attribute '" + method +
                           "' (methods callable by name "
                           "are registered with DISTRPC_REGISTER_METHOD)");
    }
    // The proxy's signature hash covers (RRef<T>, A...) and the result: compare what this call
    // would send with what the method takes.
    using Probe = R (*)(RRef<T>, A...);
    if (detail::fnv1a(detail::spmd_signature<Probe>::text()) != e->proxy_signature) {
      throw std::invalid_argument("'" + std::string(detail::type_name<T>()) + "::" + method +
                                  "' is '" + e->signature +
                                  "': call it by name with exactly that "
                                  "result type and those argument types");
    }
    return *e;
  }

  static RequestHeader header_of(const detail::MethodEntry& e) {
    RequestHeader h;
    h.name = e.proxy_name;
    h.signature = e.proxy_signature;
    return h;
  }

  std::shared_ptr<detail::RRefImpl> impl_;
};

namespace detail {
template <auto>
inline constexpr bool no_proxy_on_void_v = false;
template <class>
inline constexpr bool no_by_name_on_void_v = false;
}  // namespace detail

// RRef<void>: what remote() of a function returning void (or Future<void>) gives, like PyTorch's
// RRef of None. The owner holds no object, only the outcome of the call: to_here() returns once
// the function ran on the owner, or rethrows its exception with its type. Everything else (ids,
// the creation future, sharing over RPC, the delete protocol) is that of an RRef of an empty
// value, which is what it wraps. There is nothing to call methods on, so the proxies do not
// compile, and there is no local constructor (an RRef<void> only comes from remote()).
template <>
class RRef<void> {
 public:
  using value_type = void;

  RRef() = default;

  bool valid() const noexcept { return r_.valid(); }
  bool is_owner() const { return r_.is_owner(); }
  WorkerInfo owner() const { return r_.owner(); }
  std::string owner_name() const { return r_.owner_name(); }
  bool confirmed_by_owner() const { return r_.confirmed_by_owner(); }
  RRefId rref_id() const { return r_.rref_id(); }
  ForkId fork_id() const { return r_.fork_id(); }
  Future<void> get_future() const { return r_.get_future(); }
  std::string str() const { return r_.str(); }

  // Waits until the function ran on the owner; rethrows its exception. On the owner it waits
  // locally; on a user it asks the owner (one Fetch of an empty value).
  void to_here(std::chrono::milliseconds timeout = kUnsetRpcTimeout) const {
    (void)r_.to_here(timeout);
  }
  // Owner only, as for any RRef (a user raises PyTorch's "can't call localValue() on user"
  // text): waits until the function ran here and rethrows its exception; there is no value.
  void local_value() const { (void)r_.local_value(); }

  // "void", once the function ran (its exception otherwise).
  Future<std::string> type_name_async() const { return r_.type_name_async(); }
  std::string type_name(std::chrono::milliseconds timeout = kUnsetRpcTimeout) const {
    return r_.type_name(timeout);
  }

  // No object, so no methods to call on it.
  template <auto M, class... A>
  void rpc_sync(A&&...) const {
    static_assert(detail::no_proxy_on_void_v<M>,
                  "distrpc::RRef<void>::rpc_sync<&T::m>: an RRef<void> (remote() of a function "
                  "returning void) holds no object to call methods on; call to_here() to wait for "
                  "the function, or make the function return the object");
  }
  template <auto M, class... A>
  void rpc_async(A&&...) const {
    static_assert(detail::no_proxy_on_void_v<M>,
                  "distrpc::RRef<void>::rpc_async<&T::m>: an RRef<void> (remote() of a function "
                  "returning void) holds no object to call methods on; call to_here() to wait for "
                  "the function, or make the function return the object");
  }
  template <auto M, class... A>
  void remote(A&&...) const {
    static_assert(detail::no_proxy_on_void_v<M>,
                  "distrpc::RRef<void>::remote<&T::m>: an RRef<void> (remote() of a function "
                  "returning void) holds no object to call methods on; call to_here() to wait for "
                  "the function, or make the function return the object");
  }
  template <class R, class... A>
  void rpc_sync_by_name(A&&...) const {
    static_assert(detail::no_by_name_on_void_v<R>,
                  "distrpc::RRef<void>: an RRef<void> holds no object to call methods on by name");
  }
  template <class R, class... A>
  void rpc_async_by_name(A&&...) const {
    static_assert(detail::no_by_name_on_void_v<R>,
                  "distrpc::RRef<void>: an RRef<void> holds no object to call methods on by name");
  }
  template <class R, class... A>
  void remote_by_name(A&&...) const {
    static_assert(detail::no_by_name_on_void_v<R>,
                  "distrpc::RRef<void>: an RRef<void> holds no object to call methods on by name");
  }

  // Inside RPC messages only, like any RRef (the wire form is that of an RRef of an empty value).
  template <class Archive>
  void save(Archive& ar) const {
    r_.save(ar);
  }
  template <class Archive>
  void load(Archive& ar) {
    r_.load(ar);
  }

 private:
  template <class R, class Packed>
  friend RRef<R> detail::remote_packed(const std::shared_ptr<RpcAgent>&, const WorkerInfo&,
                                       CallOptions, RequestHeader, const Packed&,
                                       const std::string&);

  explicit RRef(std::shared_ptr<detail::RRefImpl> impl) : r_(std::move(impl)) {}

  RRef<detail::NoValue> r_;
};

namespace detail {

// remote() with the request already packed: creates the RRef (owner or pending user), sends the
// request, and ties the creation future to its reply.
template <class R, class Packed>
RRef<R> remote_packed(const std::shared_ptr<RpcAgent>& agent, const WorkerInfo& dst,
                      CallOptions opts, RequestHeader header, const Packed& packed,
                      const std::string& what) {
  const auto timeout = agent->effective_timeout(opts.timeout);
  auto ctx = detail::rref_context_of(*agent);
  const std::uint64_t type_hash = type_hash_of<boxed_storage_t<R>>();
  std::shared_ptr<RRefImpl> impl = dst.id == agent->self().id
                                       ? ctx->begin_remote_self(type_hash)
                                       : ctx->begin_remote_user(dst, type_hash);
  header.mode = RRefContext::kRemoteMode;
  header.mode_data = RemoteFields{impl->id, impl->fork_id}.encode();
  Future<wire::Message> reply;
  std::exception_ptr encode_error;
  try {
    reply = send_packed(agent, dst, timeout, header, packed, what, &opts.device_map).reply;
  } catch (...) {
    encode_error = std::current_exception();
    reply = make_exceptional_future<wire::Message>(encode_error);
  }
  ctx->finish_remote(impl, reply);
  if (encode_error) std::rethrow_exception(encode_error);
  return RRef<R>(std::move(impl));
}

}  // namespace detail

// Runs f(args...) on `to` and returns an RRef to its result, which `to` owns. The creation
// future (rref.get_future()) fails if the request does not reach `to` within the timeout; the
// value's own errors are raised by to_here(). A function returning Future<U> gives RRef<U>; one
// returning void (or Future<void>) gives RRef<void>, whose to_here() waits until f ran.
template <auto F, class... A>
RRef<detail::call_result_t<F>> remote(const Destination& to, CallOptions opts, A&&... args) {
  detail::check_call<F, A...>();
  using R = detail::call_result_t<F>;
  using Id = detail::call_identity<F>;
  Id::register_caller();
  auto agent = detail::current_agent();
  const WorkerInfo dst = to.resolve(*agent);
  typename Id::args packed(std::forward<A>(args)...);
  const RequestHeader h = Id::header();
  return detail::remote_packed<R>(agent, dst, opts, h, packed, "remote() of '" + h.name + "'");
}
template <auto F, class... A>
RRef<detail::call_result_t<F>> remote(const Destination& to, A&&... args) {
  return remote<F>(to, CallOptions{}, std::forward<A>(args)...);
}

// remote() of a builtin operator by schema name: RRef<c10::IValue>. CallOptions first, as for
// every call; the trailing form is also accepted.
inline RRef<c10::IValue> remote(const Destination& to, CallOptions opts, const std::string& op,
                                std::vector<c10::IValue> args) {
  detail::ensure_library_registered<&detail::run_builtin>();  // the library's own
  return remote<&detail::run_builtin>(to, opts, op, std::move(args));
}
inline RRef<c10::IValue> remote(const Destination& to, const std::string& op,
                                std::vector<c10::IValue> args, CallOptions opts = {}) {
  return remote(to, opts, op, std::move(args));
}

template <class T>
template <auto M, class... A>
auto RRef<T>::remote(CallOptions opts, A&&... args) const {
  if constexpr (detail::check_method<M, T>()) {
    using P = detail::MethodProxy<M>;
    detail::ensure_library_registered<&P::call>();  // the library's own proxy
    return ::distrpc::remote<&P::call>(owner(), opts, *this, std::forward<A>(args)...);
  }
}

// An RRef in a DISTRPC_REMOTE declaration reads "RRef<T>" (wire/type_spelling.hpp).
template <class T>
struct TypeName<RRef<T>> {
  static constexpr bool known = detail::spellable<T>();
  static std::string name() { return "RRef<" + detail::spelling<T>() + ">"; }
};

}  // namespace distrpc
