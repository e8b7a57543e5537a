// The Transport concept: what a policy class must provide so Agent<Transport> can move messages.
//
// A transport knows nothing of RPC: it moves wire::Message values (a payload plus out-of-band
// byte buffers) between the processes of one group, identified by integer worker ids. The core
// (agent, RRefs, modules) only talks to this concept, which is what makes policies pluggable:
// TCP (transports/tcp), shared memory (transports/shm), composites that pick one per peer, and
// decorators such as a fault injector all present the same shape.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/entry_gate.hpp"
#include "distrpc/log.hpp"
#include "distrpc/tls_options.hpp"
#include "distrpc/wire/frame.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport {

// What every policy's Context is constructed with.
struct TransportOptions {
  int self_id = 0;                        // this worker's id (its rank)
  std::string self_name;                  // this worker's name, carried by the handshake
  std::string listen_host = "127.0.0.1";  // loopback by default: exposing a port is a choice
  // The host published in address() (what peers dial); empty: the address listened on.
  std::string advertise_host;
  // Optional shared secret: connections are authenticated by challenge-response on it, and it is
  // never sent. Empty: DISTRPC_AUTH_SECRET_FILE's file, else DISTRPC_AUTH_SECRET, else none
  // (docs/security.md).
  std::string auth_token;
  // Mutual TLS (docs/security.md, "TLS"): every connection is encrypted and both ends present a
  // certificate signed by the CA in ca_file. Empty: DISTRPC_TLS_CERT / _KEY / _CA, else plain TCP.
  // Policies that never leave the host (Shm) ignore it.
  TlsOptions tls;
  wire::Limits limits{};                  // frames beyond these are refused / dropped
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(30)};
  // How long a refused connection is retried (within connect_timeout). A peer that is still
  // starting up refuses until it listens, hence the default, which lies beyond any sensible
  // connect_timeout; an owner that adds a peer only once it listens (the RPC agent: addresses are
  // published after the listener is up) sets it short, so a refusal then means the peer is gone
  // and a send fails in milliseconds, not after connect_timeout.
  std::chrono::milliseconds refused_retry{std::chrono::hours(24)};
};

// How a Context reports to its owner. Both are called on transport I/O threads: they must be
// quick and must not block or run user code (the agent only enqueues work or wakes waiters).
struct TransportCallbacks {
  // A complete message arrived from worker `peer`.
  std::function<void(int peer, wire::Message&& message)> on_message;
  // The connection with worker `peer` broke (EOF, reset, protocol error): `reason` says how.
  // Called at most once per broken connection; never after Context::shutdown() returned.
  std::function<void(int peer, const std::string& reason)> on_peer_lost;
};

struct InlineTask;
namespace detail {
inline thread_local InlineTask* inline_slot = nullptr;  // the scope open on this thread, if any
inline thread_local bool transport_thread = false;      // see mark_transport_thread()
inline thread_local bool wait_driver_thread = false;    // see InlineTask::run_library_here()
}  // namespace detail

// ---- Leader/follower hand-off (optional for a policy) ---------------------------------------
// A small call crosses four thread hand-offs: the callee's I/O thread wakes, posts the request to
// a pool thread (a second wake-up), the reply wakes the caller's I/O thread, which wakes the
// caller. A policy whose reading threads can take turns lets the receiver skip the second one:
// while it calls on_message it opens an InlineScope; the receiver may hand one task back through
// offer_inline() instead of posting it to its pool; the transport runs that task on the receiving
// thread only after it re-armed reading and while another of its threads keeps doing I/O, so I/O
// never waits on the task (the thread is a worker for that time, not the I/O thread). Otherwise it
// passes the task to the receiver's fallback, which queues it as usual. A policy that opens no
// scope changes nothing: offer_inline() returns false and the receiver posts as before.
// Library tasks (offer_inline_library(): short, never waiting on user code, such as RRef protocol
// steps) are kept through the rest of a read, in order, and run before the request when the task
// runs here: a delete that arrives just before the next call then costs no pool thread's wake-up.
struct InlineTask {
  using Fallback = std::function<bool(std::function<void()>)>;
  std::function<void()> run;
  // Queues `run` elsewhere (the receiver's pool); false if that was refused (shutting down).
  Fallback fallback;
  // Library tasks offered during the same read, to run first, each with its own fallback.
  std::vector<std::pair<std::function<void()>, Fallback>> first;

  bool empty() const { return !run && first.empty(); }
  // Runs everything here, the library tasks first; one that throws does not stop the others.
  // The thread is a worker meanwhile, not a reading thread (it let go of reading first): the
  // tasks may send and block like any worker (on_transport_thread() is false inside).
  void run_here() {
    struct WorkerScope {
      bool was = detail::transport_thread;
      WorkerScope() { detail::transport_thread = false; }
      ~WorkerScope() { detail::transport_thread = was; }
    } worker;
    for (auto& [f, fb] : first) run_one(f);
    first.clear();
    if (run) run_one(run);
    run = nullptr;
  }
  // For a caller reading while it waits for its own reply (a policy's drive()): the library
  // tasks run here, on the waiting thread (a control message it read then costs no pool thread's
  // wake-up: with two cores, that wake-up was most of a distributed backward's step); the
  // request goes to its fallback (a user's handler must not delay, or take the locks of, a
  // thread that waits). in_wait_driver() is true inside, so a library task that would run
  // user code can tell and queue it unless the waiter is waiting for exactly that.
  void run_library_here() {
    struct DriverScope {
      bool was_transport = detail::transport_thread;
      bool was_driver = detail::wait_driver_thread;
      DriverScope() {
        detail::transport_thread = false;
        detail::wait_driver_thread = true;
      }
      ~DriverScope() {
        detail::transport_thread = was_transport;
        detail::wait_driver_thread = was_driver;
      }
    };
    {
      DriverScope driver;
      for (auto& [f, fb] : first) run_one(f);
      first.clear();
    }
    if (run) queue_one(std::move(run), fallback);
    run = nullptr;
  }
  // Passes everything to its fallback. A refusal means the receiver is shutting down: it would
  // have dropped a posted task too.
  void queue() {
    for (auto& [f, fb] : first) queue_one(std::move(f), fb);
    first.clear();
    if (run) queue_one(std::move(run), fallback);
    run = nullptr;
  }

 private:
  static void run_one(std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      // No worker is known here: the task is the receiver's, run on a transport's thread.
      distrpc::detail::log_error("transport",
                                 std::string("a task handed back to a reading thread threw: ") +
                                     e.what());
    }
  }
  static void queue_one(std::function<void()>&& f, const Fallback& fb) {
    if (!fb) return;
    try {
      fb(std::move(f));
    } catch (...) {
    }
  }
};

// A policy marks its own threads (readers, listeners) at their start. Library code that may
// block on the network (a send waiting for back-pressure) must not run on them, nor inside their
// callbacks: it queues its work instead (on_transport_thread()).
inline void mark_transport_thread() {
  detail::transport_thread = true;
}
inline bool on_transport_thread() {
  return detail::transport_thread || detail::inline_slot != nullptr;
}
namespace detail {
// shutdown()'s lock, for a policy whose Context has one. On a transport thread (a callback that
// stops the Context) while another thread is already shutting it down, it does not wait: that
// thread joins this one, so waiting here would leave both waiting for ever. The lock is then not
// owned, and shutdown() returns at once (the other thread completes it).
// A library task that a caller in drive() runs (run_library_here()) is in the same position:
// shutdown() waits for that caller to leave drive().
inline std::unique_lock<std::mutex> lock_for_shutdown(std::mutex& mu) {
  if (!on_transport_thread() && !wait_driver_thread) return std::unique_lock<std::mutex>(mu);
  return std::unique_lock<std::mutex>(mu, std::try_to_lock);
}

// shutdown()'s wait for the callers reading in the policy's drive() (each holds an entry of
// `drivers`); the policy marked itself stopping first, so they leave their loop at once. One still
// inside at `deadline` is running a task it read there that has not returned: shutdown() goes on
// without it (that thread leaves drive() when the task returns), and says so in the log.
inline void close_drive_gate(distrpc::detail::EntryGate& drivers,
                             std::chrono::steady_clock::time_point deadline, const std::string& who,
                             const std::string& policy) {
  if (drivers.close_and_wait_until(deadline)) return;
  distrpc::detail::log_warning(who, policy +
                                        ": shutdown went on at its deadline while a caller's "
                                        "thread in drive() was still running a task read there; "
                                        "that thread leaves drive() when the task returns");
}
}  // namespace detail

// True inside a library task that a waiting caller runs for the transport (run_library_here()).
inline bool in_wait_driver() {
  return detail::wait_driver_thread;
}

// Receiver side, inside on_message: true when the task was taken (the transport will run or
// queue it); false when no scope is open here or it already holds a task.
inline bool offer_inline(std::function<void()>& run,
                         const std::function<bool(std::function<void()>)>& fallback) {
  if (detail::inline_slot == nullptr || detail::inline_slot->run) return false;
  detail::inline_slot->run = std::move(run);
  detail::inline_slot->fallback = fallback;
  return true;
}

// The same for a library task (see InlineTask); false when no scope is open here, or when the
// scope already keeps kMaxLibraryTasks of them (a stream of them goes to the pool as it comes).
inline constexpr std::size_t kMaxLibraryTasks = 16;
inline bool offer_inline_library(std::function<void()>& run,
                                 const std::function<bool(std::function<void()>)>& fallback) {
  if (detail::inline_slot == nullptr || detail::inline_slot->first.size() >= kMaxLibraryTasks) {
    return false;
  }
  detail::inline_slot->first.emplace_back(std::move(run), fallback);
  return true;
}

// Transport side: open around the on_message calls of one read, take() after re-arming. A task
// never taken (an early return on a protocol error) is queued through its fallback, never lost.
class InlineScope {
 public:
  InlineScope() : outer_(detail::inline_slot) { detail::inline_slot = &slot_; }
  ~InlineScope() {
    close();
    slot_.queue();
  }

  // Queues the request offered so far through its fallback (library tasks stay); the scope keeps
  // accepting offers.
  void release_to_fallback() {
    if (!slot_.run) return;
    InlineTask t;
    t.run = std::move(slot_.run);
    t.fallback = std::move(slot_.fallback);
    slot_.run = nullptr;
    slot_.fallback = nullptr;
    t.queue();
  }
  InlineScope(const InlineScope&) = delete;
  InlineScope& operator=(const InlineScope&) = delete;

  bool holds_task() const { return !slot_.empty(); }
  // A request (not only library tasks) was offered.
  bool holds_request() const { return static_cast<bool>(slot_.run); }

  // Stops accepting offers and returns what was offered (empty() when nothing was).
  InlineTask take() {
    close();
    InlineTask t = std::move(slot_);
    slot_ = InlineTask{};
    return t;
  }

 private:
  void close() {
    if (detail::inline_slot == &slot_) detail::inline_slot = outer_;
  }
  InlineTask slot_;
  InlineTask* outer_;
};

// The concept. A policy P provides:
//   static constexpr std::string_view name;      e.g. "tcp"
//   static bool viable();                        usable on this machine at all
//   static std::string domain_key();             peers with equal keys can use P with each other
//   class Context {                              per-agent state: threads, listener, connections
//     Context(const TransportOptions&, TransportCallbacks);
//     std::string address() const;               published in the store for peers to reach us
//     void add_peer(int id, const std::string& name, const std::string& address);
//                                                send() to a peer needs it first, even to answer
//                                                a peer that already reached us: messages may
//                                                arrive before it (the agent holds them until
//                                                its worker table is read)
//     void send(int peer, wire::Message&& m);    thread-safe; in order per peer; may block for
//                                                back-pressure; throws DistNetworkError when the
//                                                peer cannot be reached (naming it)
//     void shutdown();                           idempotent; joins threads; no callbacks after
//     void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point until);
//                                                optional: reads on the calling thread, never
//                                                sleeping in the kernel, until done() or `until`.
//                                                A thread waiting for a reply calls it while it
//                                                polls (sync_wait_spin), so the reply wakes no
//                                                other thread. It must never run a handler there:
//                                                requests it reads are queued. Where another
//                                                thread is reading, it may just yield.
//   };
// Optional, for a policy whose threads may run a handed-back task (InlineScope):
//     std::size_t shutdown(std::chrono::steady_clock::time_point deadline);
//       like shutdown(), but a thread still running a handed-back task at `deadline` is detached
//       instead of joined (abandoned: it owns what it needs and exits when the task returns);
//       returns how many were. The agent calls it through shutdown_until() below.
template <class P>
concept Transport =
    requires {
      typename P::Context;
      { P::name } -> std::convertible_to<std::string_view>;
      { P::viable() } -> std::same_as<bool>;
      { P::domain_key() } -> std::convertible_to<std::string>;
    } && std::constructible_from<typename P::Context, const TransportOptions&, TransportCallbacks> &&
    requires(typename P::Context& ctx, const typename P::Context& cctx, int peer,
             const std::string& s, wire::Message&& m) {
      { cctx.address() } -> std::convertible_to<std::string>;
      ctx.add_peer(peer, s, s);
      ctx.send(peer, std::move(m));
      ctx.shutdown();
    };

// Optional: `static constexpr bool carries_device_buffers = true;` for a policy whose send() takes
// messages whose buffers lie in device (CUDA) memory and whose receiver may hand such buffers to
// on_message (transport/device_direct.hpp). The agent then encodes device tensors without
// staging them through the CPU (wire/device_buffers.hpp). Every other policy gets CPU buffers only.
template <class P>
constexpr bool carries_device_buffers() {
  if constexpr (requires { P::carries_device_buffers; }) {
    return P::carries_device_buffers;
  } else {
    return false;
  }
}

// A Context with the optional bounded shutdown (above).
template <class C>
concept has_bounded_shutdown = requires(C& c, std::chrono::steady_clock::time_point deadline) {
  { c.shutdown(deadline) } -> std::convertible_to<std::size_t>;
};

// Shuts `ctx` down, waiting for threads that run handed-back tasks no later than `deadline` when
// the policy supports that (returns how many it abandoned), else with its plain shutdown().
template <class C>
std::size_t shutdown_until(C& ctx, std::chrono::steady_clock::time_point deadline) {
  if constexpr (has_bounded_shutdown<C>) {
    return ctx.shutdown(deadline);
  } else {
    ctx.shutdown();
    return 0;
  }
}

namespace detail {

// What a policy's shutdown does with its threads once they were told to stop (Tcp, Shm). The
// listener runs no user code and is joined. The readers may be running a handed-back task, so
// they are joined until `deadline` only (BoundedThread::join_until); one still inside user code
// then is detached and counted in `abandoned`. The calling thread may be one of them (a callback
// shutting its own transport down): it cannot join itself, so it is detached (`on_own_thread`)
// and exits when it returns to its stopped loop, owning what it needs.
struct StoppedThreads {
  std::size_t abandoned = 0;
  bool on_own_thread = false;  // the caller is one of the readers
};
template <class Readers>
StoppedThreads stop_threads(std::thread& listener, Readers& readers,
                            std::chrono::steady_clock::time_point deadline) {
  const auto me = std::this_thread::get_id();
  if (listener.joinable()) {
    if (listener.get_id() == me) {
      listener.detach();
    } else {
      listener.join();
    }
  }
  StoppedThreads out;
  for (auto& t : readers) {
    if (!t.joinable()) continue;
    if (t.get_id() == me) {
      t.detach();
      out.on_own_thread = true;
    } else if (!t.join_until(deadline)) {
      ++out.abandoned;
    }
  }
  return out;
}

template <class P>
concept has_context = requires { typename P::Context; };
template <class P>
concept has_name = requires {
  { P::name } -> std::convertible_to<std::string_view>;
};
template <class P>
concept has_viable = requires {
  { P::viable() } -> std::same_as<bool>;
};
template <class P>
concept has_domain_key = requires {
  { P::domain_key() } -> std::convertible_to<std::string>;
};
template <class C>
concept context_has_address = requires(const C& c) {
  { c.address() } -> std::convertible_to<std::string>;
};
template <class C>
concept context_has_add_peer = requires(C& c, int id, const std::string& s) { c.add_peer(id, s, s); };
template <class C>
concept context_has_send = requires(C& c, int id, wire::Message&& m) { c.send(id, std::move(m)); };
template <class C>
concept context_has_shutdown = requires(C& c) { c.shutdown(); };
}  // namespace detail

// The optional member above: the agent calls it only where the policy has it.
template <class C>
concept has_drive = requires(C& c, const std::function<bool()>& done,
                             std::chrono::steady_clock::time_point until) { c.drive(done, until); };

// Instantiated by Agent<P>: one readable message per missing member instead of a concept dump.
template <class P>
constexpr bool check_transport() {
  static_assert(detail::has_context<P>,
                "Transport policy: missing nested `class Context` (per-agent state: threads, "
                "listener, connections)");
  static_assert(detail::has_name<P>,
                "Transport policy: missing `static constexpr std::string_view name = \"...\";`");
  static_assert(detail::has_viable<P>, "Transport policy: missing `static bool viable();`");
  static_assert(detail::has_domain_key<P>,
                "Transport policy: missing `static std::string domain_key();`");
  if constexpr (detail::has_context<P>) {
    using C = typename P::Context;
    static_assert(std::constructible_from<C, const TransportOptions&, TransportCallbacks>,
                  "Transport policy: missing `Context(const TransportOptions&, TransportCallbacks)`");
    static_assert(detail::context_has_address<C>,
                  "Transport policy: missing `std::string Context::address() const;`");
    static_assert(detail::context_has_add_peer<C>,
                  "Transport policy: missing `void Context::add_peer(int id, const std::string& "
                  "name, const std::string& address);`");
    static_assert(detail::context_has_send<C>,
                  "Transport policy: missing `void Context::send(int peer, wire::Message&&);`");
    static_assert(detail::context_has_shutdown<C>,
                  "Transport policy: missing `void Context::shutdown();`");
  }
  return Transport<P>;
}

}  // namespace distrpc::transport
