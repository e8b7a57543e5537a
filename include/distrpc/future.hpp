// Typed futures: the value type of every asynchronous call in distrpc (rpc_async, remote, async
// handlers) and the C++ counterpart of torch.futures.Future. Plain C++20, no libtorch.
//
// Shape
//   Future<T>   a cheap copyable handle to shared state (pending -> value | error). A default-made
//               Future<T> owns fresh pending state and can be completed through set_value /
//               set_exception, like torch.futures.Future().set_result(): ported code works.
//   Promise<T>  the writer side only, for code that wants to hand out read-only futures.
//   FutureBase  the type-erased handle: wait, done, errors, set_exception without knowing T (the
//               agent's timeout and peer-loss bookkeeping holds these).
//   Completion is set-once: a second completion throws std::logic_error whose text contains
//   "Future can only be marked completed once"; the try_set_* forms return false instead, for
//   the races the agent settles on purpose (response vs. timeout vs. peer loss).
//   A const Future is a const handle, not a const state: setters and then() work through it, the
//   way shared_ptr::operator* does.
//
// What runs where (the threading contract)
//   - Waiters are woken inline by the completing thread (condition-variable notify), before any
//     callback runs, and no lock is held while a callback runs: a callback may wait on other
//     futures, register callbacks on this one, or complete other futures.
//   - then(cb) / add_done_callback(cb) without an executor run cb on the thread that completes the
//     future; the callbacks registered before completion run there in registration order. A
//     callback registered on an already-completed future runs immediately on the registering
//     thread (as in c10's Future), so it never waits behind callbacks still running elsewhere.
//   - then(ex, cb) / add_done_callback(ex, cb) / via(ex) hand cb to `ex` instead. Transport I/O
//     threads must never run user code, so whoever completes a future on an I/O thread either
//     registers user callbacks only through an executor (the agent passes its worker pool) or
//     hands the completion itself to the pool. `ex` is copied into the future and must post
//     without blocking (it is called on the completing thread). An executor is any copyable
//     object `e` for which one of these works (checked by the `Executor` concept):
//         e.post(std::function<void()>)      (a pool object)
//         e->post(std::function<void()>)     (a pointer or shared_ptr to a pool)
//         e(std::function<void()>)           (a lambda / function object)
//     std::ref(pool) is accepted too. If posting throws, then()'s child fails with that error.
//   - The RPC layer tags the futures it hands out with its callback pool
//     (detail::set_callback_executor): the callbacks registered before completion are posted
//     there as ONE task that runs them in registration order (futures they complete run their
//     callbacks inline on that pool thread), instead of running on the I/O thread.
//   - A callback that throws: in then(), the exception fails only the child future; in
//     add_done_callback() it is logged to stderr and dropped; later callbacks still run.
//
// Combinators
//   collect_all(futs)       Future<std::vector<Future<T>>>: completes once all inputs have
//                           completed, whatever their outcome.
//   when_all_succeed(futs)  Future<std::vector<T>> (Future<void> for T = void): fails as soon as
//                           an input fails (Seastar's name), else holds the values in order.
//   wait_all(futs)          std::vector<T> (void for T = void): the blocking when_all_succeed;
//                           throws the first error as soon as it happens, without waiting for
//                           the futures still pending.
//   WaitAllScope            RAII scope collecting the rpc_async futures a thread makes while it
//                           is alive; see the class comment.
//
// Futures with devices (distrpc/device_future.hpp: make_future<T>(devices), PyTorch's
// Future(devices=...)) synchronize GPU streams at the points where a value changes hands:
// completion marks where the producer's work ends on its streams, wait()/value() make the waiting
// thread's current streams wait for those marks, and callbacks run on streams that do. This
// header only carries the hook (detail::CompletionSync, null for every other future) and finds
// the tensors in a value (detail::visit_tensors); it does not include libtorch.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <ranges>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "distrpc/function_ref.hpp"
#include "distrpc/log.hpp"

// Declared only: a value's tensors are handed by reference to a sink that libtorch code defines.
namespace at {
class Tensor;
}  // namespace at
namespace c10 {
struct IValue;
template <class T>
class List;
template <class K, class V>
class Dict;
}  // namespace c10

namespace distrpc {

class FutureBase;
template <class T>
class Future;
template <class T>
class Promise;
class WaitAllScope;

// ---- Traits: how the RPC layer recognises an asynchronous handler by its return type. ----

template <class T>
struct is_future : std::false_type {};
template <class T>
struct is_future<Future<T>> : std::true_type {};
// True for Future<U> with any cv-ref qualification (a handler may return `Future<U>` or a ref).
template <class T>
inline constexpr bool is_future_v = is_future<std::remove_cvref_t<T>>::value;

template <class T>
struct future_value {
  static_assert(is_future_v<T>, "distrpc::future_value_t<T>: T is not a distrpc::Future<U>");
};
template <class T>
struct future_value<Future<T>> {
  using type = T;
};
// U for Future<U> (cv-ref ignored); a readable error for anything else.
template <class T>
using future_value_t = typename future_value<std::remove_cvref_t<T>>::type;

// U for Future<U>, T itself otherwise (cv-ref removed): "the value a call eventually produces".
template <class T>
struct unwrap_future {
  using type = T;
};
template <class T>
struct unwrap_future<Future<T>> {
  using type = T;
};
template <class T>
using unwrap_future_t = typename unwrap_future<std::remove_cvref_t<T>>::type;

// ---- Executors ----

namespace detail {

template <class E>
struct is_reference_wrapper : std::false_type {};
template <class E>
struct is_reference_wrapper<std::reference_wrapper<E>> : std::true_type {};

template <class E>
concept HasPost = requires(E& e, std::function<void()> f) {
  e.post(std::move(f));
};
template <class E>
concept PointsToHasPost = requires(E& e, std::function<void()> f) {
  e->post(std::move(f));
};
template <class E>
concept ExecutorObject =
    HasPost<E> || PointsToHasPost<E> || std::invocable<E&, std::function<void()>>;

template <class E>
void post_to(E& ex, std::function<void()> fn) {
  if constexpr (is_reference_wrapper<E>::value) {
    post_to(ex.get(), std::move(fn));
  } else if constexpr (HasPost<E>) {
    ex.post(std::move(fn));
  } else if constexpr (PointsToHasPost<E>) {
    ex->post(std::move(fn));
  } else {
    std::invoke(ex, std::move(fn));
  }
}

}  // namespace detail

// Something a callback can be handed to; see the header comment for the accepted shapes.
template <class E>
concept Executor = std::copy_constructible<std::decay_t<E>> &&
    detail::ExecutorObject<std::unwrap_reference_t<std::decay_t<E>>>;

// ---- Shared state ----

namespace detail {

enum class Status : unsigned char { pending, value, error };

// The type-erased form of an Executor, as a future stores it.
using ExecutorFn = std::function<void(std::function<void()>)>;

// Set while a thread runs the callbacks of a future that carries a callback executor: a future
// completed as a consequence on that thread (a then-child, a flattened or aggregated result)
// posts its user callbacks there too, so a transport I/O thread never runs them transitively.
inline thread_local const ExecutorFn* inherited_executor = nullptr;

class InheritedExecutorScope {
 public:
  explicit InheritedExecutorScope(const ExecutorFn* ex) noexcept : saved_(inherited_executor) {
    inherited_executor = ex;
  }
  ~InheritedExecutorScope() { inherited_executor = saved_; }
  InheritedExecutorScope(const InheritedExecutorScope&) = delete;
  InheritedExecutorScope& operator=(const InheritedExecutorScope&) = delete;

 private:
  const ExecutorFn* saved_;
};

[[noreturn]] inline void throw_completed_twice() {
  throw std::logic_error("Future can only be marked completed once");
}

[[noreturn]] inline void throw_empty_future() {
  throw std::logic_error("distrpc::Future: use of an empty (moved-from) Future");
}

// Callbacks must not let exceptions escape into the completing thread (often an agent thread
// that cannot know what to do with them), so they end up here.
inline void log_dropped_error(const char* where, const std::exception_ptr& e) noexcept {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    log_warning(where, std::string("exception dropped: ") + ex.what());
  } catch (...) {
    log_warning(where, "exception dropped (not derived from std::exception)");
  }
}

// The part of the state that does not depend on T. Callbacks receive the owning shared_ptr so
// that a typed handle can be rebuilt for them without the state pointing at itself (which would
// keep a never-completed future alive forever). They also receive the executor user code must be
// posted to, or null to run inline; library-internal callbacks (forwarding, aggregation) ignore it
// and always run inline, which keeps them cheap and free of pool-starvation deadlocks.
// Something that can bring a pending future closer to completion from the thread that waits on
// it: an RPC agent, which reads its transport there (the reply then wakes no other thread).
// Asked once before a waiter sleeps; returns by `until` at the latest, done or not.
class WaitDriver {
 public:
  virtual ~WaitDriver() = default;
  virtual void drive_wait(const std::function<bool()>& done,
                          std::chrono::steady_clock::time_point until) = 0;
};

// Receives the tensors found in a value (device_future.hpp implements it).
class TensorSink {
 public:
  virtual void tensor(const at::Tensor& t) = 0;
  virtual void ivalue(const c10::IValue& v) = 0;  // the sink looks inside

 protected:
  ~TensorSink() = default;
};

template <class T>
struct is_tuple_like : std::false_type {};
template <class... E>
struct is_tuple_like<std::tuple<E...>> : std::true_type {};
template <class A, class B>
struct is_tuple_like<std::pair<A, B>> : std::true_type {};
template <class T, std::size_t N>
struct is_tuple_like<std::array<T, N>> : std::true_type {};

template <class T>
struct c10_container : std::false_type {};
template <class E>
struct c10_container<c10::List<E>> : std::true_type {};
template <class K, class V>
struct c10_container<c10::Dict<K, V>> : std::true_type {};

template <class T>
concept OptionalLike = requires(const T& v) {
  { v.has_value() } -> std::convertible_to<bool>;
  *v;
};
template <class T>
concept MapLike = requires {
  typename T::mapped_type;
}
&&std::ranges::range<const T>&& requires(const std::ranges::range_value_t<const T>& kv) {
  kv.second;
};
template <class T>
concept Container =
    std::ranges::range<const T> && !std::is_convertible_v<const T&, std::string_view> &&
    !std::is_same_v<std::ranges::range_value_t<const T>, T>;  // e.g. a path

// Hands every tensor of `v` to `sink`: tensors and IValues themselves, and what c10's List and
// Dict and the standard containers (ranges, maps' values, optionals, tuples, pairs, arrays) hold.
// The members of other class types are not seen (device_future.hpp says what that means).
template <class T>
void visit_tensors(const T& v, TensorSink& sink) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    sink.tensor(v);
  } else if constexpr (std::is_same_v<T, c10::IValue>) {
    sink.ivalue(v);
  } else if constexpr (c10_container<T>::value) {
    sink.ivalue(v);  // an IValue holds it (the sink converts; libtorch is there by then)
  } else if constexpr (is_tuple_like<T>::value) {
    std::apply([&](const auto&... e) { (visit_tensors(e, sink), ...); }, v);
  } else if constexpr (OptionalLike<T>) {
    if (v.has_value()) visit_tensors(*v, sink);
  } else if constexpr (MapLike<T>) {
    for (const auto& kv : v) visit_tensors(kv.second, sink);
  } else if constexpr (Container<T>) {
    for (const auto& e : v) visit_tensors(e, sink);
  }
}

// The device side of a future with devices (device_future.hpp), behind an interface so that
// this header needs no libtorch. Set on the state before the future is handed out, never
// changed: read without the lock.
class CompletionSync {
 public:
  virtual ~CompletionSync() = default;
  // On the completing thread, before the value is stored: checks the value's tensors (`visit`
  // hands them to a sink) and marks the end of the work queued so far on the current streams.
  // Throws to fail the future with that error instead. Returns the marks, which only the
  // completion that wins keeps (commit).
  virtual std::shared_ptr<const void> record(FunctionRef<void(TensorSink&)> visit) const = 0;
  // Under the state's lock, by the completion that stores the value: keeps `marks`. They are
  // immutable once the value is published, so the calls below read them without a lock.
  virtual void commit(std::shared_ptr<const void> marks) noexcept = 0;
  // On a thread that waited for the value: its current streams wait for the marks.
  virtual void synchronize() const = 0;
  // Around a callback: streams that wait for the marks (none after an error) are current until
  // the result is dropped.
  virtual std::shared_ptr<void> enter() const = 0;
  // For a future completed from this one's value (a then() or via() child): same devices.
  virtual std::shared_ptr<CompletionSync> fresh() const = 0;
};

class StateBase {
 public:
  using Callback = std::function<void(const std::shared_ptr<StateBase>&, const ExecutorFn*)>;

  Status status() const noexcept { return status_.load(std::memory_order_acquire); }
  bool done() const noexcept { return status() != Status::pending; }
  // Written before the status is published with release order, immutable afterwards.
  const std::exception_ptr& error() const noexcept { return error_; }

  void wait() const {
    if (done()) return;
    drive(std::chrono::steady_clock::time_point::max());
    std::unique_lock lk(mu_);
    cv_.wait(lk, [this] { return status_.load(std::memory_order_relaxed) != Status::pending; });
  }

  template <class Clock, class Dur>
  bool wait_until(const std::chrono::time_point<Clock, Dur>& deadline) const {
    if (done()) return true;
    if constexpr (std::is_same_v<Clock, std::chrono::steady_clock>) {
      drive(std::chrono::time_point_cast<std::chrono::steady_clock::duration>(deadline));
    }
    std::unique_lock lk(mu_);
    return cv_.wait_until(lk, deadline, [this] {
      return status_.load(std::memory_order_relaxed) != Status::pending;
    });
  }

  // Runs `write` (which stores the value) and publishes `s`, unless already complete.
  template <class Write>
  static bool complete(const std::shared_ptr<StateBase>& self, Status s, Write&& write) {
    std::vector<Callback> callbacks;
    std::shared_ptr<const ExecutorFn> own;  // kept alive for the nested completions below
    {
      std::lock_guard lk(self->mu_);
      if (self->status_.load(std::memory_order_relaxed) != Status::pending) return false;
      std::forward<Write>(write)();
      self->status_.store(s, std::memory_order_release);
      callbacks.swap(self->callbacks_);
      own = self->executor_;
    }
    // `self` keeps the state alive even if a woken waiter drops the last other handle.
    self->cv_.notify_all();
    const ExecutorFn* ex = own ? own.get() : inherited_executor;
    if (ex != nullptr && !callbacks.empty()) {
      // One task runs them all, in registration order, on the executor; inside it they run
      // inline (a pool thread may run user code), and so do completions they cause.
      auto shared = std::make_shared<std::vector<Callback>>(std::move(callbacks));
      try {
        (*ex)([self, shared, keep = own] {
          InheritedExecutorScope inherit(nullptr);
          for (auto& cb : *shared) cb(self, nullptr);
        });
        return true;
      } catch (...) {
        // The executor refused (e.g. shutting down): each callback meets the refusal on its own
        // terms (a then-child fails with it, a done-callback logs it, library bookkeeping runs).
        for (auto& cb : *shared) cb(self, ex);
        return true;
      }
    }
    for (auto& cb : callbacks) cb(self, nullptr);  // every Callback catches its own exceptions
    return true;
  }

  static bool complete_error(const std::shared_ptr<StateBase>& self, std::exception_ptr e) {
    if (!e) throw std::invalid_argument("distrpc::Future::set_exception: null exception_ptr");
    return complete(self, Status::error, [&] { self->error_ = std::move(e); });
  }

  static void add_callback(const std::shared_ptr<StateBase>& self, Callback cb) {
    {
      std::lock_guard lk(self->mu_);
      if (self->status_.load(std::memory_order_relaxed) == Status::pending) {
        self->callbacks_.push_back(std::move(cb));
        return;
      }
    }
    cb(self, nullptr);  // already complete: the registering thread runs it, never an I/O thread
  }

  void set_executor(std::shared_ptr<const ExecutorFn> ex) {
    std::lock_guard lk(mu_);
    executor_ = std::move(ex);
  }
  void set_driver(std::weak_ptr<WaitDriver> d) {
    std::lock_guard lk(mu_);
    driver_ = std::move(d);
  }
  // Before the future is handed out (see CompletionSync).
  void set_sync(std::shared_ptr<CompletionSync> s) noexcept { sync_ = std::move(s); }
  CompletionSync* sync() const noexcept { return sync_.get(); }

 private:
  // Lets the driver (if any, and still alive) poll for the outcome before the caller sleeps.
  void drive(std::chrono::steady_clock::time_point until) const {
    std::shared_ptr<WaitDriver> d;
    {
      std::lock_guard lk(mu_);
      d = driver_.lock();
    }
    if (d) d->drive_wait([this] { return done(); }, until);
  }

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::atomic<Status> status_{Status::pending};
  std::exception_ptr error_;
  std::vector<Callback> callbacks_;
  std::shared_ptr<const ExecutorFn> executor_;
  std::weak_ptr<WaitDriver> driver_;      // weak: a future may outlive its agent
  std::shared_ptr<CompletionSync> sync_;  // null unless made with devices
};

// Completes `s` (whose sync is `sync`) with a value: `visit` hands the value's tensors to the
// check, `store` stores the value under the lock. A value the check refuses fails the future. Two
// completions racing here may both record: only the one that stores its value commits its marks.
template <class Visit, class Store>
bool complete_synced(const std::shared_ptr<StateBase>& s, CompletionSync& sync, Visit&& visit,
                     Store&& store) {
  if (s->done()) return false;
  std::shared_ptr<const void> marks;
  try {
    marks = sync.record(visit);
  } catch (...) {
    return StateBase::complete_error(s, std::current_exception());
  }
  return StateBase::complete(s, Status::value, [&] {
    store();
    sync.commit(std::move(marks));
  });
}

// The streams scope of a callback on `s`'s outcome (null: nothing to do).
inline std::shared_ptr<void> enter_sync(const StateBase& s) {
  return s.sync() != nullptr ? s.sync()->enter() : nullptr;
}
// Gives `child` the devices of `parent`, if it has any.
inline void inherit_sync(const StateBase& parent, StateBase& child) {
  if (parent.sync() != nullptr) child.set_sync(parent.sync()->fresh());
}

template <class T>
class State : public StateBase {
 public:
  std::optional<T> value;  // same publication rule as error()
};

template <>
class State<void> : public StateBase {};

template <class T>
using value_ref_t =
    std::conditional_t<std::is_void_v<T>, void, std::add_lvalue_reference_t<const T>>;

// std::function needs copyable targets: a move-only callback is held through a shared_ptr.
template <class F>
auto make_copyable(F&& f) {
  using D = std::decay_t<F>;
  if constexpr (std::is_copy_constructible_v<D>) {
    return D(std::forward<F>(f));
  } else {
    return [p = std::make_shared<D>(std::forward<F>(f))](auto&&... args) -> decltype(auto) {
      return std::invoke(*p, std::forward<decltype(args)>(args)...);
    };
  }
}

// Thread-local state that a layer wants carried into the callbacks of futures (e.g. distributed
// autograd's current context, as PyTorch carries its ThreadLocalState): a carrier captures it on
// the thread that registers a callback, and re-enters it around the callback wherever that runs.
// Registered once per process (a header's static initializer), at most kMaxCarriers.
struct ThreadStateCarrier {
  std::shared_ptr<const void> (*capture)();  // null: nothing to carry from this thread
  std::shared_ptr<void> (*enter)(const std::shared_ptr<const void>&);  // a guard that restores
};
inline constexpr int kMaxCarriers = 4;
struct ThreadStateCarriers {
  std::mutex mu;
  std::atomic<int> count{0};
  std::array<ThreadStateCarrier, kMaxCarriers> list{};
};
inline ThreadStateCarriers& thread_state_carriers() {
  static ThreadStateCarriers c;
  return c;
}
inline bool register_thread_state_carrier(ThreadStateCarrier carrier) {
  auto& c = thread_state_carriers();
  std::lock_guard<std::mutex> lk(c.mu);
  const int n = c.count.load();
  for (int i = 0; i < n; ++i) {
    if (c.list[static_cast<std::size_t>(i)].capture == carrier.capture) return true;
  }
  if (n == kMaxCarriers) return false;
  c.list[static_cast<std::size_t>(n)] = carrier;
  c.count.store(n + 1);
  return true;
}
// What the carriers captured on one thread (null when none had anything to carry).
using CarriedState = std::shared_ptr<std::array<std::shared_ptr<const void>, kMaxCarriers>>;
inline CarriedState capture_thread_state() {
  auto& c = thread_state_carriers();
  const int n = c.count.load(std::memory_order_acquire);
  CarriedState out;
  for (int i = 0; i < n; ++i) {
    if (auto snap = c.list[static_cast<std::size_t>(i)].capture()) {
      if (!out) out = std::make_shared<std::array<std::shared_ptr<const void>, kMaxCarriers>>();
      (*out)[static_cast<std::size_t>(i)] = std::move(snap);
    }
  }
  return out;
}
// `f` run inside the state captured where it was made.
template <class F>
struct Carrying {
  F f;
  CarriedState state;
  template <class... A>
  decltype(auto) operator()(A&&... args) {
    std::array<std::shared_ptr<void>, kMaxCarriers> guards;
    if (state) {
      auto& c = thread_state_carriers();
      for (std::size_t i = 0; i < kMaxCarriers; ++i) {
        if ((*state)[i]) guards[i] = c.list[i].enter((*state)[i]);
      }
    }
    return std::invoke(f, std::forward<A>(args)...);
  }
};
template <class F>
auto carry_thread_state(F&& f) {
  return Carrying<std::decay_t<F>>{std::forward<F>(f), capture_thread_state()};
}

template <class Cb, class T>
inline constexpr bool is_callback_v = std::is_invocable_v<std::decay_t<Cb>&, Future<T>&>;

template <class Cb, class T, bool = is_callback_v<Cb, T>>
struct callback_result {
  using type = void;  // only reached after the readable static_assert has fired
};
template <class Cb, class T>
struct callback_result<Cb, T, true> {
  using type = std::remove_cvref_t<std::invoke_result_t<std::decay_t<Cb>&, Future<T>&>>;
};
template <class Cb, class T>
using callback_result_t = typename callback_result<Cb, T>::type;

// Grants the free helpers below access to the handles' state without making it public.
struct FutureAccess {
  template <class T>
  static Future<T> make(std::shared_ptr<StateBase> s) {
    return Future<T>(std::move(s));
  }
  static void add_callback(const FutureBase& f, StateBase::Callback cb);
  static const std::shared_ptr<StateBase>& state(const FutureBase& f);
};

}  // namespace detail

// ---- FutureBase: the type-erased handle ----

class FutureBase {
 public:
  // An empty handle (valid() == false); Future<T>'s default constructor makes fresh state instead.
  FutureBase() noexcept = default;

  bool valid() const noexcept { return state_ != nullptr; }
  bool done() const noexcept { return state_ && state_->done(); }
  bool has_value() const noexcept { return state_ && state_->status() == detail::Status::value; }
  bool has_error() const noexcept { return state_ && state_->status() == detail::Status::error; }
  // The stored error; null while pending or after success.
  std::exception_ptr exception_ptr() const noexcept {
    return has_error() ? state_->error() : std::exception_ptr{};
  }

  // Blocks until complete; rethrows the stored exception (every time it is called).
  // A future with devices then makes this thread's current streams wait for the value's work.
  void wait() const {
    base().wait();
    if (has_error()) std::rethrow_exception(state_->error());
    if (auto* sync = state_->sync()) sync->synchronize();
  }
  // True once complete (success or error); never throws the stored error.
  template <class Rep, class Period>
  bool wait_for(const std::chrono::duration<Rep, Period>& d) const {
    // Clamp so that "wait for duration::max()" cannot overflow into an immediate return.
    constexpr auto kForever = std::chrono::hours(24 * 365 * 100);
    if (d >= kForever) {
      base().wait();
      return true;
    }
    return base().wait_until(std::chrono::steady_clock::now() +
                             std::chrono::duration_cast<std::chrono::steady_clock::duration>(d));
  }
  template <class Clock, class Dur>
  bool wait_until(const std::chrono::time_point<Clock, Dur>& deadline) const {
    return base().wait_until(deadline);
  }

  void set_exception(std::exception_ptr e) const {
    if (!try_set_exception(std::move(e))) detail::throw_completed_twice();
  }
  template <class E>
  requires std::derived_from<std::remove_cvref_t<E>, std::exception>
  void set_exception(E&& e) const {
    set_exception(std::make_exception_ptr(std::remove_cvref_t<E>(std::forward<E>(e))));
  }
  // False (and no effect) if already complete; throws std::invalid_argument for a null error.
  bool try_set_exception(std::exception_ptr e) const {
    return detail::StateBase::complete_error(state_or_throw(), std::move(e));
  }
  template <class E>
  requires std::derived_from<std::remove_cvref_t<E>, std::exception>
  bool try_set_exception(E&& e) const {
    return try_set_exception(std::make_exception_ptr(std::remove_cvref_t<E>(std::forward<E>(e))));
  }

 protected:
  explicit FutureBase(std::shared_ptr<detail::StateBase> s) noexcept : state_(std::move(s)) {}

  const std::shared_ptr<detail::StateBase>& state_or_throw() const {
    if (!state_) detail::throw_empty_future();
    return state_;
  }
  detail::StateBase& base() const { return *state_or_throw(); }

  std::shared_ptr<detail::StateBase> state_;

  friend struct detail::FutureAccess;
};

namespace detail {

inline void FutureAccess::add_callback(const FutureBase& f, StateBase::Callback cb) {
  StateBase::add_callback(f.state_or_throw(), std::move(cb));
}
inline const std::shared_ptr<StateBase>& FutureAccess::state(const FutureBase& f) {
  return f.state_or_throw();
}

// Called by the RPC layer on the futures it hands out (they complete on transport I/O threads):
// when `f` completes, the callbacks registered on it without an executor are posted to `ex`, and
// so are those of the futures completed as a consequence on that thread (then-children, flattened
// and aggregated results). A callback registered after completion still runs inline on the
// registering thread, which is the user's. Set it before handing `f` out.
template <class Ex>
void set_callback_executor(const FutureBase& f, Ex&& ex) {
  static_assert(Executor<Ex>,
                "distrpc::detail::set_callback_executor: the executor must be copyable and offer "
                "ex.post(std::function<void()>), ex->post(...) or ex(std::function<void()>)");
  if constexpr (Executor<Ex>) {
    FutureAccess::state(f)->set_executor(std::make_shared<const ExecutorFn>(
        [e = std::decay_t<Ex>(std::forward<Ex>(ex))](std::function<void()> fn) mutable {
          post_to(e, std::move(fn));
        }));
  }
}

// Called by the RPC layer on the futures it hands out: a thread about to sleep in wait() (or
// wait_for/wait_until) on `f` first lets `d` poll for the outcome. Set it before handing `f` out.
inline void set_wait_driver(const FutureBase& f, std::weak_ptr<WaitDriver> d) {
  FutureAccess::state(f)->set_driver(std::move(d));
}

template <class T>
void copy_result(const Future<T>& src, const Future<T>& dst) noexcept;
template <class R, class F, class T, class U>
void run_then(F& fn, Future<T>& parent, const Future<U>& child) noexcept;

}  // namespace detail

// ---- Future<T> ----

template <class T>
// [[nodiscard]]: a Future dropped unread loses its error silently (rpc_async, then()).
class [[nodiscard]] Future : public FutureBase {
  static_assert(!std::is_reference_v<T>,
                "distrpc::Future<T>: T must not be a reference; return the value "
                "(Future<X>) or a handle such as std::shared_ptr<X>");
  static_assert(!std::is_const_v<T> && !std::is_volatile_v<T>,
                "distrpc::Future<T>: T must not be cv-qualified; write Future<X>, the value "
                "is already read-only through value()");
  static_assert(!std::is_array_v<T> && !std::is_function_v<T>,
                "distrpc::Future<T>: T must be an object type; use std::array or std::vector");

 public:
  using value_type = T;

  // Fresh pending state, completed later through set_value / set_exception (or a Promise).
  Future() : FutureBase(std::make_shared<detail::State<T>>()) {}

  // Waits; returns the value (const T&, valid while any handle to this future lives) or rethrows.
  detail::value_ref_t<T> value() const {
    FutureBase::wait();
    if constexpr (!std::is_void_v<T>) return *typed().value;
  }
  // PyTorch's name for value(): torch.futures.Future.wait() returns the result.
  detail::value_ref_t<T> wait() const { return value(); }
  // Non-blocking, non-throwing: the value if it is there, else nullptr.
  const T* try_value() const noexcept requires(!std::is_void_v<T>) {
    return has_value() ? &*typed().value : nullptr;
  }

  void set_value() const requires std::is_void_v<T> {
    if (!try_set_value()) detail::throw_completed_twice();
  }
  bool try_set_value() const requires std::is_void_v<T> {
    if (auto* sync = state_or_throw()->sync()) {
      return detail::complete_synced(
          state_, *sync, [](detail::TensorSink&) {}, [] {});
    }
    return detail::StateBase::complete(state_or_throw(), detail::Status::value, [] {});
  }
  template <class U = T>
  requires(!std::is_void_v<T> && std::constructible_from<T, U&&>) void set_value(U&& v) const {
    if (!try_set_value(std::forward<U>(v))) detail::throw_completed_twice();
  }
  // PyTorch's name for set_value() (torch.futures.Future.set_result).
  void set_result() const requires std::is_void_v<T> { set_value(); }
  template <class U = T>
  requires(!std::is_void_v<T> && std::constructible_from<T, U&&>) void set_result(U&& v) const {
    set_value(std::forward<U>(v));
  }
  // False (and no effect) if already complete.
  template <class U = T>
  requires(!std::is_void_v<T> && std::constructible_from<T, U&&>) bool try_set_value(U&& v) const {
    auto& st = typed();
    if (auto* sync = state_or_throw()->sync()) {
      // The check reads the argument (the value is made from it under the lock); in a race, the
      // losing completion's argument may be moved from.
      return detail::complete_synced(
          state_, *sync,
          [&](detail::TensorSink& sink) {
            detail::visit_tensors(static_cast<const std::remove_cvref_t<U>&>(v), sink);
          },
          [&] { st.value.emplace(std::forward<U>(v)); });
    }
    return detail::StateBase::complete(state_, detail::Status::value,
                                       [&] { st.value.emplace(std::forward<U>(v)); });
  }

  // Child future holding cb(*this). cb takes `Future<T>&` (or a const ref / copy) and returns
  // U, void, or Future<U>; the last is flattened: the child completes when that future does.
  // A throwing cb fails only the child. cb runs inline on the completing thread.
  template <class Cb>
  auto then(Cb&& cb) const {
    if constexpr (check_callback<Cb>()) {
      using R = detail::callback_result_t<Cb, T>;
      Future<unwrap_future_t<R>> child;
      detail::inherit_sync(base(), *detail::FutureAccess::state(child));
      add_erased(
          [child, fn = detail::make_copyable(detail::carry_thread_state(std::forward<Cb>(cb)))](
              const std::shared_ptr<detail::StateBase>& s, const detail::ExecutorFn* ex) mutable {
            if (ex == nullptr) {
              Future<T> parent(s);
              detail::run_then<R>(fn, parent, child);
              return;
            }
            post_then<R>(*ex, std::move(fn), Future<T>(s), child);
          });
      return child;
    }
  }
  // As then(cb), but cb runs on `ex` (see the header comment).
  template <class Ex, class Cb>
  auto then(Ex&& ex, Cb&& cb) const {
    if constexpr (check_executor<Ex>() && check_callback<Cb>()) {
      using R = detail::callback_result_t<Cb, T>;
      Future<unwrap_future_t<R>> child;
      detail::inherit_sync(base(), *detail::FutureAccess::state(child));
      add_erased(
          [child, fn = detail::make_copyable(detail::carry_thread_state(std::forward<Cb>(cb))),
           ex = std::decay_t<Ex>(std::forward<Ex>(ex))](const std::shared_ptr<detail::StateBase>& s,
                                                        const detail::ExecutorFn*) mutable {
            post_then<R>(ex, std::move(fn), Future<T>(s), child);
          });
      return child;
    }
  }

  // cb(Future<T>&) runs once on completion, in registration order, inline on the completing
  // thread (or right now on this thread if already complete). Its return value is ignored; an
  // exception it throws is logged to stderr and dropped.
  template <class Cb>
  void add_done_callback(Cb&& cb) const {
    if constexpr (check_callback<Cb>()) {
      add_erased(
          [fn = detail::make_copyable(detail::carry_thread_state(std::forward<Cb>(cb)))](
              const std::shared_ptr<detail::StateBase>& s, const detail::ExecutorFn* ex) mutable {
            if (ex == nullptr) {
              Future<T> f(s);
              run_logged(fn, f);
              return;
            }
            post_logged(*ex, std::move(fn), Future<T>(s));
          });
    }
  }
  // As add_done_callback(cb), but cb runs on `ex`.
  template <class Ex, class Cb>
  void add_done_callback(Ex&& ex, Cb&& cb) const {
    if constexpr (check_executor<Ex>() && check_callback<Cb>()) {
      add_erased(
          [fn = detail::make_copyable(detail::carry_thread_state(std::forward<Cb>(cb))),
           ex = std::decay_t<Ex>(std::forward<Ex>(ex))](const std::shared_ptr<detail::StateBase>& s,
                                                        const detail::ExecutorFn*) mutable {
            post_logged(ex, std::move(fn), Future<T>(s));
          });
    }
  }

  // A future with the same outcome, completed from `ex`: every inline callback registered on the
  // result runs on the executor. How the agent keeps user callbacks off its I/O threads.
  template <class Ex>
  Future<T> via(Ex&& ex) const {
    Future<T> child;
    detail::inherit_sync(base(), *detail::FutureAccess::state(child));
    if constexpr (check_executor<Ex>()) {
      add_erased(
          [child, ex = std::decay_t<Ex>(std::forward<Ex>(ex))](
              const std::shared_ptr<detail::StateBase>& s, const detail::ExecutorFn*) mutable {
            try {
              detail::post_to(ex, [child, src = Future<T>(s)] { detail::copy_result(src, child); });
            } catch (...) {
              child.try_set_exception(std::current_exception());
            }
          });
    }
    return child;
  }

 private:
  explicit Future(std::shared_ptr<detail::StateBase> s) noexcept : FutureBase(std::move(s)) {}

  detail::State<T>& typed() const { return static_cast<detail::State<T>&>(base()); }

  void add_erased(detail::StateBase::Callback cb) const {
    detail::StateBase::add_callback(state_or_throw(), std::move(cb));
  }

  // Fire the readable message first and let callers skip the body, so no cascade follows it.
  template <class Cb>
  static constexpr bool check_callback() {
    static_assert(detail::is_callback_v<Cb, T>,
                  "distrpc::Future<T>: the callback must be callable as cb(distrpc::Future<T>& f) "
                  "(taking `const Future<T>&` or `Future<T>` works too); read the outcome with "
                  "f.value(), which rethrows the error if there is one");
    return detail::is_callback_v<Cb, T>;
  }

  template <class Ex>
  static constexpr bool check_executor() {
    static_assert(Executor<Ex>,
                  "distrpc::Future<T>: the executor must be copyable and offer one of "
                  "ex.post(std::function<void()>), ex->post(std::function<void()>) or "
                  "ex(std::function<void()>); pass a non-copyable pool as a pointer, a "
                  "shared_ptr or std::ref(pool)");
    return Executor<Ex>;
  }

  // The callback runs exactly once, so it moves into the posted task. A refusing executor fails
  // the child: nothing else would ever complete it.
  template <class R, class Ex, class F, class U>
  static void post_then(Ex& ex, F&& fn, Future<T> parent, const Future<U>& child) noexcept {
    try {
      detail::post_to(ex, [child, fn = std::forward<F>(fn), parent]() mutable {
        detail::run_then<R>(fn, parent, child);
      });
    } catch (...) {
      child.try_set_exception(std::current_exception());
    }
  }

  template <class Ex, class F>
  static void post_logged(Ex& ex, F&& fn, Future<T> f) noexcept {
    try {
      detail::post_to(ex, [fn = std::forward<F>(fn), f]() mutable { run_logged(fn, f); });
    } catch (...) {
      detail::log_dropped_error("Future::add_done_callback: executor refused the callback",
                                std::current_exception());
    }
  }

  template <class F>
  static void run_logged(F& fn, Future<T>& f) noexcept {
    try {
      auto streams = detail::enter_sync(f.base());
      std::invoke(fn, f);
    } catch (...) {
      detail::log_dropped_error("Future::add_done_callback", std::current_exception());
    }
  }

  friend struct detail::FutureAccess;
};

namespace detail {

// Copies the outcome of a completed `src` into `dst` (the handles are shared, so no move).
template <class T>
void copy_result(const Future<T>& src, const Future<T>& dst) noexcept {
  try {
    // dst's marks then follow src's work (a future with devices on either side).
    auto streams = enter_sync(*FutureAccess::state(src));
    if (src.has_error()) {
      dst.try_set_exception(src.exception_ptr());
    } else if constexpr (std::is_void_v<T>) {
      dst.try_set_value();
    } else {
      dst.try_set_value(*src.try_value());
    }
  } catch (...) {
    dst.try_set_exception(std::current_exception());  // T's copy constructor threw
  }
}

template <class R, class F, class T, class U>
void run_then(F& fn, Future<T>& parent, const Future<U>& child) noexcept {
  try {
    auto streams = enter_sync(*FutureAccess::state(parent));
    if constexpr (is_future_v<R>) {
      Future<U> inner = std::invoke(fn, parent);
      if (!inner.valid()) {
        throw std::invalid_argument("distrpc::Future::then: the callback returned an empty Future");
      }
      FutureAccess::add_callback(inner,
                                 [child](const std::shared_ptr<StateBase>& s, const ExecutorFn*) {
                                   copy_result(FutureAccess::make<U>(s), child);
                                 });
    } else if constexpr (std::is_void_v<R>) {
      std::invoke(fn, parent);
      child.try_set_value();
    } else {
      child.try_set_value(std::invoke(fn, parent));
    }
  } catch (...) {
    child.try_set_exception(std::current_exception());
  }
}

}  // namespace detail

// ---- Promise<T>: the writer side ----

template <class T>
class Promise {
 public:
  Promise() = default;  // fresh pending state

  Future<T> get_future() const { return future_; }
  bool done() const noexcept { return future_.done(); }

  void set_value() const requires std::is_void_v<T> { future_.set_value(); }
  bool try_set_value() const requires std::is_void_v<T> { return future_.try_set_value(); }
  template <class U = T>
  requires(!std::is_void_v<T> && std::constructible_from<T, U&&>) void set_value(U&& v) const {
    future_.set_value(std::forward<U>(v));
  }
  template <class U = T>
  requires(!std::is_void_v<T> && std::constructible_from<T, U&&>) bool try_set_value(U&& v) const {
    return future_.try_set_value(std::forward<U>(v));
  }
  void set_exception(std::exception_ptr e) const { future_.set_exception(std::move(e)); }
  template <class E>
  requires std::derived_from<std::remove_cvref_t<E>, std::exception>
  void set_exception(E&& e) const { future_.set_exception(std::forward<E>(e)); }
  bool try_set_exception(std::exception_ptr e) const {
    return future_.try_set_exception(std::move(e));
  }

 private:
  Future<T> future_;
};

// ---- Factories ----

template <class T>
Future<T> make_future() {
  return Future<T>();
}

template <class T>
Future<std::decay_t<T>> make_ready_future(T&& value) {
  Future<std::decay_t<T>> f;
  f.set_value(std::forward<T>(value));
  return f;
}

inline Future<void> make_ready_future() {
  Future<void> f;
  f.set_value();
  return f;
}

template <class T>
Future<T> make_exceptional_future(std::exception_ptr e) {
  Future<T> f;
  f.set_exception(std::move(e));
  return f;
}

template <class T, class E>
requires std::derived_from<std::remove_cvref_t<E>, std::exception> Future<T>
make_exceptional_future(E&& e) {
  Future<T> f;
  f.set_exception(std::forward<E>(e));
  return f;
}

// ---- Combinators ----

// Completes (always with a value) once every input has completed, successfully or not; the
// result holds the inputs, in order, for inspection.
template <class T>
Future<std::vector<Future<T>>> collect_all(std::vector<Future<T>> futures) {
  Future<std::vector<Future<T>>> out;
  if (futures.empty()) {
    out.set_value(std::vector<Future<T>>{});
    return out;
  }
  struct Aggregate {
    Aggregate(std::size_t n, std::vector<Future<T>> f, Future<std::vector<Future<T>>> o)
        : remaining(n), futures(std::move(f)), out(std::move(o)) {}
    std::atomic<std::size_t> remaining;
    std::vector<Future<T>> futures;
    Future<std::vector<Future<T>>> out;
  };
  auto agg = std::make_shared<Aggregate>(futures.size(), futures, out);
  // Registers through the local copy: the last callback may move agg->futures out meanwhile.
  for (const auto& f : futures) {
    detail::FutureAccess::add_callback(
        f, [agg](const std::shared_ptr<detail::StateBase>&, const detail::ExecutorFn*) {
          if (agg->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            agg->out.try_set_value(std::move(agg->futures));
          }
        });
  }
  return out;
}

namespace detail {

// Completes with the first error as soon as one input fails, or with a value once all succeeded.
// Pending inputs keep the aggregate alive until they complete; that is the price of not waiting.
template <class T>
Future<void> first_error_or_all(const std::vector<Future<T>>& futures) {
  Future<void> gate;
  if (futures.empty()) {
    gate.set_value();
    return gate;
  }
  struct Aggregate {
    Aggregate(std::size_t n, Future<void> g) : remaining(n), gate(std::move(g)) {}
    std::atomic<std::size_t> remaining;
    Future<void> gate;
  };
  auto agg = std::make_shared<Aggregate>(futures.size(), gate);
  for (const auto& f : futures) {
    FutureAccess::add_callback(f, [agg](const std::shared_ptr<StateBase>& s, const ExecutorFn*) {
      if (s->status() == Status::error) {
        agg->gate.try_set_exception(s->error());  // the first failure wins; later ones lose
      } else if (agg->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        agg->gate.try_set_value();
      }
    });
  }
  return gate;
}

template <class T>
auto values_of(const std::vector<Future<T>>& futures) {
  if constexpr (!std::is_void_v<T>) {
    std::vector<T> values;
    values.reserve(futures.size());
    for (const auto& f : futures) values.push_back(f.value());
    return values;
  }
}

}  // namespace detail

template <class T>
using all_values_t = std::conditional_t<std::is_void_v<T>, void, std::vector<T>>;

// Fails as soon as any input fails (with that error), else holds every value, in input order.
template <class T>
Future<all_values_t<T>> when_all_succeed(std::vector<Future<T>> futures) {
  return detail::first_error_or_all(futures).then(
      [futures = std::move(futures)](Future<void>& gate) -> all_values_t<T> {
        gate.wait();  // rethrows the first error into the returned future
        return detail::values_of(futures);
      });
}

// Blocks until all inputs succeeded and returns their values in order; throws the first error as
// soon as any input fails, without waiting for the others. (Among inputs that had already failed
// before the call, the earliest in input order is the one thrown.)
template <class T>
all_values_t<T> wait_all(const std::vector<Future<T>>& futures) {
  detail::first_error_or_all(futures).wait();
  return detail::values_of(futures);
}

// ---- WaitAllScope ----

namespace detail {
inline thread_local WaitAllScope* current_wait_all_scope = nullptr;
// Called by the RPC layer for every future it hands out on this thread (rpc_async and friends):
// the innermost live WaitAllScope of the calling thread collects it. Returns whether one did.
inline bool register_in_scope(const FutureBase& f);
}  // namespace detail

// RAII: while alive on a thread, collects every future the RPC layer makes on that thread
// (through detail::register_in_scope); the innermost live scope collects, outer ones do not see
// those futures. Leaving the scope waits for all collected futures, so no work started inside
// outlives it, then rethrows the error of the earliest-registered one that failed.
//
// Errors and destructors: to observe errors without a throwing destructor, call wait() before the
// scope ends; it waits for what was collected so far, forgets it and throws the first error. The
// destructor waits for what remains and throws (it is noexcept(false)) only when the scope is not
// being left by an exception; while unwinding it still waits, but logs the error to stderr instead
// of replacing the exception in flight. Scopes live on the stack of one thread, and nest LIFO.
class WaitAllScope {
 public:
  WaitAllScope() noexcept
      : parent_(detail::current_wait_all_scope), uncaught_(std::uncaught_exceptions()) {
    detail::current_wait_all_scope = this;
  }
  WaitAllScope(const WaitAllScope&) = delete;
  WaitAllScope& operator=(const WaitAllScope&) = delete;
  // Stack only: the thread-local chain of scopes relies on LIFO destruction.
  static void* operator new(std::size_t) = delete;
  static void* operator new[](std::size_t) = delete;

  ~WaitAllScope() noexcept(false) {
    detail::current_wait_all_scope = parent_;
    std::exception_ptr error = settle();
    if (!error) return;
    if (std::uncaught_exceptions() > uncaught_) {
      detail::log_dropped_error("WaitAllScope (left by an exception)", error);
      return;
    }
    std::rethrow_exception(error);
  }

  // Waits for every future collected so far, forgets them, and throws the first error.
  void wait() {
    if (auto error = settle()) std::rethrow_exception(error);
  }

  // How many collected futures a wait() would wait for now.
  std::size_t size() const noexcept { return futures_.size(); }

 private:
  std::exception_ptr settle() noexcept {
    std::vector<FutureBase> futures;
    futures.swap(futures_);
    std::exception_ptr first;
    for (const auto& f : futures) {
      f.wait_for(std::chrono::hours::max());  // waits without rethrowing
      if (!first && f.has_error()) first = f.exception_ptr();
    }
    return first;
  }

  friend bool detail::register_in_scope(const FutureBase& f);

  std::vector<FutureBase> futures_;
  WaitAllScope* parent_;
  int uncaught_;
};

inline bool detail::register_in_scope(const FutureBase& f) {
  WaitAllScope* scope = current_wait_all_scope;
  if (scope == nullptr || !f.valid()) return false;
  scope->futures_.push_back(f);
  return true;
}

}  // namespace distrpc
