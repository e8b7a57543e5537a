// RRefContext: one per agent, the bookkeeping of the RRef protocol (docs/rref.md).
//
// Owner side: the cells holding owned values (`owners_`), the forks each has handed out
// (`forks_`, with the worker holding each fork), deletions that arrived before the fork they
// delete (`early_deletes_`). User side: user RRefs waiting for their owner's confirmation
// (`pending_users_`), forks this worker gave away and whose child has not accepted yet
// (`pending_children_`, which keep the parent alive), and every live user RRef (`users_`, for the
// purge at shutdown).
//
// Messages (agent control kinds 0..4, each a request answered by an empty Response or an
// Exception): ForkRequest (child -> owner), ChildAccept (child -> parent), UserDelete (user ->
// owner), Fetch (user -> owner, answered with the value), TypeQuery (user -> owner, answered with
// the type's name). remote() itself is a Request of mode RRefContext::kRemoteMode, whose header
// carries the RRef's ids (RemoteFields).
//
// Threads: control messages are handled on the agent's callback pool (never on a transport I/O
// thread, never on the request pool, so confirmations cannot starve behind blocked handlers).
// Messages are always sent from the callback pool too: code running on an I/O thread (a reply
// being decoded) only queues them. No lock of this class is held while a value is destroyed or a
// future is completed.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "distrpc/agent/extension.hpp"
#include "distrpc/future.hpp"
#include "distrpc/log.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/rref/id.hpp"
#include "distrpc/rref/scope.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/wire/boxed_value.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc {

class RRefContext;

// The agent's control message kinds used by the RRef protocol (wire::control_message_type(k)).
enum class RRefControl : std::uint8_t {
  ForkRequest = 0,
  ChildAccept = 1,
  UserDelete = 2,
  Fetch = 3,
  TypeQuery = 4,
};
inline constexpr std::uint8_t kRRefControlKinds = 5;

inline wire::MessageType rref_message_type(RRefControl k) {
  return wire::control_message_type(static_cast<std::uint8_t>(k));
}

inline const char* rref_control_name(RRefControl k) {
  switch (k) {
    case RRefControl::ForkRequest:
      return "RRef fork request";
    case RRefControl::ChildAccept:
      return "RRef child accept";
    case RRefControl::UserDelete:
      return "RRef user delete";
    case RRefControl::Fetch:
      return "RRef fetch (to_here)";
    case RRefControl::TypeQuery:
      return "RRef type query";
  }
  return "RRef control";
}

// Process-wide switch: graceful shutdown reports leaked RRefs as an error unless this is set.
inline std::atomic<bool>& ignore_rref_leak_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
inline void set_ignore_rref_leak(bool ignore) {
  ignore_rref_leak_flag().store(ignore);
}

namespace detail {
// Tests switch the RRef purge of graceful shutdown off to see the leak check fire (PyTorch's
// tests mock _delete_all_user_and_unforked_owner_rrefs for the same purpose).
inline std::atomic<bool>& rref_purge_enabled() {
  static std::atomic<bool> on{true};
  return on;
}
}  // namespace detail

namespace detail {

// What a remote() request carries in its header (RequestHeader::mode_data): the RRef the callee
// creates, and the caller's fork of it (equal to rref_id when the caller is the owner itself).
struct RemoteFields {
  RRefId rref_id;
  ForkId fork_id;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(rref_id, fork_id);
  }

  std::string encode() const {
    wire::Message m;
    wire::encode(m, *this);
    return std::move(m.payload);
  }
  static RemoteFields decode(const std::string& data) {
    wire::Message m;
    m.payload = data;
    RemoteFields f;
    wire::decode(m, f);
    return f;
  }
};

// One released fork in a UserDelete message (which carries a batch of them).
struct UserDeleteEntry {
  RRefId rref_id;
  ForkId fork_id;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(rref_id, fork_id);
  }
};

// What travels for an RRef inside a message.
struct RRefForkData {
  int owner = -1;
  RRefId rref_id;
  ForkId fork_id;
  int parent = -1;
  std::uint64_t type_hash = 0;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(owner, rref_id, fork_id, parent, type_hash);
  }
};

// The owner's cell: the value (once created) of one RRef.
struct OwnerCell {
  explicit OwnerCell(RRefId i) : id(i) {}
  const RRefId id;
  Future<void> ready;  // completes when the value (or the error that replaced it) is set
  // Written once, before `ready` completes; read only after it did.
  std::shared_ptr<void> value;
  const ValueOps* ops = nullptr;
  std::atomic<bool> set_once{false};

  void set_value(std::shared_ptr<void> v, const ValueOps* o) {
    if (set_once.exchange(true)) return;
    value = std::move(v);
    ops = o;
    ready.try_set_value();
  }
  void set_error(std::exception_ptr e) {
    if (set_once.exchange(true)) return;
    ready.try_set_exception(std::move(e));
  }
  // Waits for the value up to `timeout` (0: no limit); rethrows the creation error.
  void wait(std::chrono::milliseconds timeout, const std::string& what) const {
    if (timeout.count() > 0 ? !ready.wait_for(timeout)
                            : !ready.wait_for(std::chrono::hours::max())) {
      throw RpcTimeoutError("timed out after " + std::to_string(timeout.count()) +
                            " ms waiting for the value of " + what + " to be created");
    }
    ready.wait();
  }
};

// The state shared by every RRef<T> handle of one RRef (owner) or one fork (user) in a process.
struct RRefImpl {
  RRefId id;
  ForkId fork_id;  // == id on the owner
  WorkerInfo owner;
  bool is_owner = false;
  std::uint64_t type_hash = 0;
  std::weak_ptr<RRefContext> ctx;
  std::shared_ptr<OwnerCell> cell;  // owner only
  Future<void> created;             // the creation future (get_future())
  std::atomic<bool> confirmed{false};
  std::atomic<bool> deleted{false};      // user: released (its delete was sent, or shutdown)
  std::atomic<bool> skip_delete{false};  // user: the owner never recorded this fork, or is gone
  mutable std::mutex mu;
  std::exception_ptr creation_error;  // user: remote() failed to reach the owner in time
  // User: the owner's process was lost. Every later use fails with this, also once a replacement
  // process joined under the owner's rank and name (it never held the value).
  std::exception_ptr owner_lost;
  // User: fetches sent before the owner confirmed the creation, failed with it if it fails
  // (the owner may then never have run the call).
  std::vector<Future<wire::Message>> early_fetches;
  std::optional<Future<std::string>> type_future;

  RRefImpl() = default;
  RRefImpl(const RRefImpl&) = delete;
  RRefImpl& operator=(const RRefImpl&) = delete;
  inline ~RRefImpl();

  std::string str() const {
    if (is_owner) return "OwnerRRef(" + id.str() + ")";
    return "UserRRef(RRefId = " + id.str() + ", ForkId = " + fork_id.str() + ")";
  }
  std::string deleted_text(const std::string& action) const {
    return "User RRef with RRefId=" + id.str() + " and ForkId=" + fork_id.str() +
           " has been deleted. " + action;
  }
};

inline std::string exception_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace detail

class RRefContext : public AgentExtension, public std::enable_shared_from_this<RRefContext> {
 public:
  using Impl = detail::RRefImpl;
  using ImplPtr = std::shared_ptr<detail::RRefImpl>;
  using CellPtr = std::shared_ptr<detail::OwnerCell>;

  // The agent is reached through its gate only (agent/extension.hpp, detail::HostGate): this
  // context outlives it whenever a user thread holds it (an RRef being dropped, to_here() under
  // way) while the agent is destroyed.
  explicit RRefContext(AgentServices& host) : gate_(host.host_gate()) {}
  RRefContext(const RRefContext&) = delete;
  RRefContext& operator=(const RRefContext&) = delete;

  const WorkerInfo& self() const { return gate_->self(); }

  // A new RRef or fork id of this worker (rref/id.hpp: unique across the processes that held
  // its rank).
  GloballyUniqueId next_id() const {
    std::int64_t incarnation = 0;
    if (auto pass = gate_->enter()) incarnation = pass->host_incarnation();
    return detail::next_guid(self().id, incarnation);
  }

  // The timeout a call made now uses (the agent's effective_timeout()); once the agent is gone,
  // `requested` itself, the unset one meaning no limit.
  std::chrono::milliseconds timeout_for(std::chrono::milliseconds requested) const {
    if (auto pass = gate_->enter()) return pass->host_timeout(requested);
    return requested.count() < 0 ? kNoRpcTimeout : requested;
  }
  // Decodes the reply of a fetch from `from` in the layers' scopes (AgentServices::
  // host_decode_reply); throws the agent's shut-down text once the agent is gone.
  void decode_reply(int from, const CallAttachments& sent, FunctionRef<void()> decode) {
    auto pass = gate_->enter();
    if (!pass)
      throw RpcError(gate_->shut_down_text("the reply from worker " + std::to_string(from) +
                                           " was not decoded"));
    pass->host_decode_reply(from, sent, decode);
  }

  // ---- the agent's extension points (agent/extension.hpp) -----------------------------------
  static constexpr int kExtensionId = 0;          // control kinds 0..15: rref_message_type()
  static constexpr std::uint8_t kRemoteMode = 1;  // RequestHeader::mode of remote()
  // Sends of a fork request, child accept or user delete whose send failed (send()): 6 in all,
  // 50 ms before the first retry and twice as long before each next (1.55 s of backoff at most),
  // as PyTorch retries its RRef control messages 5 times.
  static constexpr int kControlAttempts = 6;
  static constexpr std::chrono::milliseconds kControlFirstBackoff{50};
  int id() const override { return kExtensionId; }
  std::string control_name(int kind) const override {
    return rref_control_name(static_cast<RRefControl>(kind));
  }
  Future<wire::Message> handle_control(int peer, int kind, const wire::Message& m) override {
    if (kind < 0 || kind >= kRRefControlKinds) {
      throw RpcError("unknown RRef control message kind " + std::to_string(kind) + " from worker " +
                     std::to_string(peer) + " (on " + self().str() + ")");
    }
    return handle_control(peer, static_cast<RRefControl>(kind), m);
  }
  // RRefs among a request's arguments come from `peer`; RRefs in its result go back to it.
  std::shared_ptr<void> enter_request(int peer, const CallAttachments& /*got*/) override {
    struct Scopes {
      detail::RRefEncodeScope enc;
      detail::RRefDecodeScope dec;
      detail::EncodeScopeGuard enc_guard;
      detail::DecodeScopeGuard dec_guard;
      Scopes(std::shared_ptr<RRefContext> ctx, int from)
          : enc{ctx, from, {}},
            dec{std::move(ctx), from, {}},
            enc_guard(detail::tls_rref_encode, &enc),
            dec_guard(detail::tls_rref_decode, &dec) {}
    };
    return std::make_shared<Scopes>(shared_from_this(), peer);
  }
  void arguments_decoded(int /*peer*/) override { detail::await_rref_confirmations(); }
  std::optional<Future<wire::Message>> run_request(int peer, const RequestHeader& h,
                                                   const detail::RegistryEntry& entry,
                                                   wire::Message& request) override {
    if (h.mode != kRemoteMode) return std::nullopt;
    return run_remote(peer, h, detail::RemoteFields::decode(h.mode_data), entry.boxed_handler,
                      request);
  }
  void request_not_run(int peer, const RequestHeader& h, std::exception_ptr error) override {
    if (h.mode != kRemoteMode) return;
    detail::RemoteFields f;
    try {
      f = detail::RemoteFields::decode(h.mode_data);
    } catch (const std::exception&) {
      return;  // malformed: nothing of it was recorded
    }
    remote_not_run(peer, f.rref_id, std::move(error));
  }
  // RRefs among a call's arguments are forked to `dst`; the forks are undone if the message is
  // never sent.
  void encode_for(int dst, const CallAttachments& /*sent*/, FunctionRef<void()> encode,
                  std::vector<std::function<void()>>& undo) override {
    auto scope = std::make_shared<detail::RRefEncodeScope>();
    scope->ctx = shared_from_this();
    scope->dst = dst;
    {
      detail::EncodeScopeGuard guard(detail::tls_rref_encode, scope.get());
      try {
        encode();
      } catch (...) {
        scope->rollback();
        throw;
      }
    }
    if (!scope->undo.empty()) undo.push_back([scope] { scope->rollback(); });
  }
  // RRefs in a reply from `from` were forked by `from`.
  void decode_from(int from, const CallAttachments& /*sent*/, FunctionRef<void()> decode) override {
    detail::RRefDecodeScope scope{shared_from_this(), from, {}};
    detail::DecodeScopeGuard guard(detail::tls_rref_decode, &scope);
    decode();
  }
  void before_exit(std::chrono::milliseconds limit) override {
    if (detail::rref_purge_enabled().load()) purge(limit);
  }
  // Logs the leaks and returns them as the error, unless set_ignore_rref_leak(true).
  std::string report_leaks() const override {
    std::string leaks = leak_report();
    if (leaks.empty()) return leaks;
    detail::log_warning(self().name, "RRef leaks detected during shutdown:\n" + leaks);
    if (ignore_rref_leak_flag().load()) return {};
    return leaks;
  }
  void on_stop() override { close(); }
  void add_debug_info(std::map<std::string, std::string>& out) const override {
    for (auto& [k, v] : debug_info()) out[k] = v;
  }

  // ---- creation ------------------------------------------------------------------------------

  // RRef(value): an owner RRef that enters owners_ only when it is first shared.
  ImplPtr make_local_owner(std::shared_ptr<void> value, const detail::ValueOps* ops) {
    auto impl = std::make_shared<Impl>();
    impl->id = next_id();
    impl->fork_id = impl->id;
    impl->owner = self();
    impl->is_owner = true;
    impl->type_hash = ops->type_hash;
    impl->ctx = weak_from_this();
    impl->cell = std::make_shared<detail::OwnerCell>(impl->id);
    impl->cell->set_value(std::move(value), ops);
    impl->confirmed = true;
    impl->created = make_ready_future();
    return impl;
  }

  // remote() to this very worker: the cell is registered now so the request finds it.
  ImplPtr begin_remote_self(std::uint64_t type_hash) {
    auto impl = std::make_shared<Impl>();
    impl->id = next_id();
    impl->fork_id = impl->id;
    impl->owner = self();
    impl->is_owner = true;
    impl->type_hash = type_hash;
    impl->ctx = weak_from_this();
    impl->cell = std::make_shared<detail::OwnerCell>(impl->id);
    impl->confirmed = true;
    {
      std::lock_guard<std::mutex> lk(mu_);
      owners_[impl->id] = impl->cell;
    }
    return impl;
  }

  // remote() to `owner`: a user RRef, pending until the owner acknowledges the creation.
  ImplPtr begin_remote_user(const WorkerInfo& owner, std::uint64_t type_hash) {
    auto impl = std::make_shared<Impl>();
    impl->id = next_id();
    impl->fork_id = next_id();
    impl->owner = owner;
    impl->type_hash = type_hash;
    impl->ctx = weak_from_this();
    std::lock_guard<std::mutex> lk(mu_);
    pending_users_[impl->fork_id] = PendingUser{impl, Future<void>()};
    users_[impl->fork_id] = impl;
    return impl;
  }

  // The reply to the remote() request arrived (or the call failed): confirm, or record why not.
  void finish_remote(const ImplPtr& impl, const Future<wire::Message>& reply) {
    Future<void> created;
    detail::set_callback_executor(created, gate_->user_executor());
    detail::set_wait_driver(created, gate_->wait_driver());
    impl->created = created;
    auto weak = weak_from_this();
    reply.add_done_callback([weak, impl, created](const Future<wire::Message>& r) {
      auto self = weak.lock();
      std::exception_ptr error = r.has_error() ? r.exception_ptr() : nullptr;
      if (impl->is_owner) {
        if (error) impl->cell->set_error(error);
        if (self) self->erase_if_unforked(impl->id);
      } else {
        std::vector<Future<wire::Message>> early;
        if (error) {
          std::lock_guard<std::mutex> lk(impl->mu);
          early.swap(impl->early_fetches);
          impl->creation_error = error;
          // A timed-out creation may still happen on the owner (who then records the fork);
          // any other failure means the owner never recorded it.
          try {
            std::rethrow_exception(error);
          } catch (const RpcTimeoutError&) {
          } catch (...) {
            impl->skip_delete = true;
          }
        } else {
          impl->confirmed = true;
          std::lock_guard<std::mutex> lk(impl->mu);
          impl->early_fetches.clear();
        }
        if (self) self->drop_pending_user(impl->fork_id);
        for (auto& f : early) f.try_set_exception(error);
      }
      if (error) {
        created.try_set_exception(error);
      } else {
        created.try_set_value();
      }
    });
  }

  // ---- serialization ---------------------------------------------------------------------------

  // An RRef is being written into a message for `scope.dst`.
  detail::RRefForkData prepare_child_fork(const ImplPtr& impl, detail::RRefEncodeScope& scope) {
    if (!impl->is_owner && impl->deleted.load()) {
      throw RpcError(impl->deleted_text("Cannot call fork an UserRRef after deletion."));
    }
    if (impl->ctx.lock().get() != this) {
      throw RpcError(impl->str() +
                     " belongs to an RPC session that was shut down: it cannot be "
                     "sent in the RPC session of " +
                     self().str());
    }
    if (!impl->is_owner) {
      std::lock_guard<std::mutex> lk(impl->mu);
      if (impl->creation_error) {
        throw RpcError("cannot share " + impl->str() + ": its RRef creation on " +
                       impl->owner.str() +
                       " failed: " + detail::exception_text(impl->creation_error));
      }
      if (impl->owner_lost) {
        throw DistNetworkError("cannot share " + impl->str() + ": " +
                               detail::exception_text(impl->owner_lost));
      }
    }
    detail::RRefForkData data{impl->owner.id, impl->id, next_id(), self().id, impl->type_hash};
    auto weak = weak_from_this();
    const RRefId id = impl->id;
    const ForkId fork = data.fork_id;
    const int dst = scope.dst;
    if (impl->is_owner) {
      // Early fork registration: the fork exists from now on, so a delete by the child can never
      // find the count at zero before the fork was added.
      std::lock_guard<std::mutex> lk(mu_);
      owners_[id] = impl->cell;
      forks_[id][fork] = dst;
      ++forks_total_;
      scope.undo.push_back([weak, id, fork] {
        if (auto s = weak.lock()) s->del_fork(id, fork, /*tombstone=*/false);
      });
    } else {
      std::lock_guard<std::mutex> lk(mu_);
      pending_children_[fork] = PendingChild{impl, dst};
      scope.undo.push_back([weak, fork] {
        if (auto s = weak.lock()) s->release_child(fork);
      });
    }
    return data;
  }

  // An RRef was read from a message sent by `scope.parent`.
  ImplPtr on_child_received(const detail::RRefForkData& d, detail::RRefDecodeScope& scope) {
    const int me = self().id;
    const int parent = scope.parent;
    if (d.owner == me) {
      // This worker owns it: hand out an owner RRef.
      auto impl = std::make_shared<Impl>();
      impl->id = d.rref_id;
      impl->fork_id = d.rref_id;
      impl->owner = self();
      impl->is_owner = true;
      impl->type_hash = d.type_hash;
      impl->ctx = weak_from_this();
      impl->confirmed = true;
      impl->created = make_ready_future();
      {
        std::lock_guard<std::mutex> lk(mu_);
        impl->cell = cell_locked(d.rref_id);
      }
      if (parent == me) {
        // Sent to itself: drop the fork added when it was written.
        del_fork(d.rref_id, d.fork_id, /*tombstone=*/false);
      } else {
        // From a user: that fork id never becomes a real user, the parent may let go of it.
        send_child_accept(parent, d.fork_id);
      }
      return impl;
    }
    auto impl = std::make_shared<Impl>();
    impl->id = d.rref_id;
    impl->fork_id = d.fork_id;
    {
      auto pass = gate_->enter();
      if (!pass) {
        throw RpcError(gate_->shut_down_text("an RRef from worker " + std::to_string(parent) +
                                             " was not received"));
      }
      impl->owner = pass->host_worker(d.owner);
    }
    impl->type_hash = d.type_hash;
    impl->ctx = weak_from_this();
    impl->created = make_ready_future();
    if (parent == d.owner) {
      // Forked by the owner, who registered the fork before sending it.
      impl->confirmed = true;
      std::lock_guard<std::mutex> lk(mu_);
      users_[impl->fork_id] = impl;
      return impl;
    }
    Future<void> confirmed;
    {
      std::lock_guard<std::mutex> lk(mu_);
      pending_users_[impl->fork_id] = PendingUser{impl, confirmed};
      users_[impl->fork_id] = impl;
    }
    scope.confirmations.emplace_back(impl->str(), confirmed);
    wire::Message m;
    wire::encode(m, d.rref_id, d.fork_id);
    auto weak = weak_from_this();
    const ForkId fork = d.fork_id;
    send(impl->owner.id, RRefControl::ForkRequest, std::move(m),
         [weak, fork, parent](const Future<wire::Message>& r) {
           if (auto s = weak.lock()) s->finish_fork_request(fork, parent, r);
         });
    return impl;
  }

  // ---- owner side ------------------------------------------------------------------------------

  // A remote() request for an RRef this worker owns: register the fork, run, store the value.
  Future<wire::Message> run_remote(int peer, const RequestHeader& h, const detail::RemoteFields& f,
                                   const detail::BoxedHandler& handler,
                                   const wire::Message& request) {
    if (!f.rref_id.valid() || !f.fork_id.valid() || f.rref_id.created_on != peer) {
      throw RpcError("malformed remote() request from worker " + std::to_string(peer) +
                     ": RRef id " + f.rref_id.str() + ", fork id " + f.fork_id.str());
    }
    CellPtr cell;
    {
      std::lock_guard<std::mutex> lk(mu_);
      cell = cell_locked(f.rref_id);
      if (f.fork_id != f.rref_id) add_fork_locked(f.rref_id, f.fork_id, peer);
    }
    Future<detail::BoxedValue> boxed;
    try {
      if (!handler) throw RpcError("function '" + h.name + "' cannot be run by remote()");
      boxed = handler(request);
    } catch (...) {
      boxed = make_exceptional_future<detail::BoxedValue>(std::current_exception());
    }
    // The value's failure belongs to the RRef (to_here() raises it); the creation succeeded.
    return boxed.then([cell](const Future<detail::BoxedValue>& b) {
      if (b.has_error()) {
        cell->set_error(b.exception_ptr());
      } else {
        cell->set_value(b.value().value, b.value().ops);
      }
      return detail::empty_response();
    });
  }

  // A remote() request from `peer` failed before run_remote() recorded it (an unknown function, a
  // signature mismatch): its creator sees the failure in the creation reply and never deletes
  // the fork. A fetch (or type query) it sent along before that reply came may have made a cell
  // meanwhile, or may still come: fail the cell and forget it, or remember the failure for the
  // query still to come (the kMaxUnrunRemotes most recent ones).
  void remote_not_run(int peer, const RRefId& id, std::exception_ptr error) {
    if (!id.valid() || id.created_on != peer) return;
    CellPtr failed;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (auto f = forks_.find(id); f != forks_.end() && !f->second.empty()) return;  // recorded
      failed = erase_unforked_locked(id);
      if (!failed && unrun_remotes_.emplace(id, error).second) {
        unrun_order_.push_back(id);
        if (unrun_order_.size() > kMaxUnrunRemotes) {
          unrun_remotes_.erase(unrun_order_.front());
          unrun_order_.pop_front();
        }
      }
    }
    if (failed) failed->set_error(error);
  }

  // A control message (on the callback pool). The returned future holds the reply.
  Future<wire::Message> handle_control(int peer, RRefControl kind, const wire::Message& m) {
    switch (kind) {
      case RRefControl::ForkRequest: {
        RRefId id;
        ForkId fork;
        wire::decode(m, id, fork);
        std::lock_guard<std::mutex> lk(mu_);
        cell_locked(id);
        add_fork_locked(id, fork, peer);
        return make_ready_future(detail::empty_response());
      }
      case RRefControl::ChildAccept: {
        ForkId fork;
        wire::decode(m, fork);
        release_child(fork);
        return make_ready_future(detail::empty_response());
      }
      case RRefControl::UserDelete: {
        std::vector<detail::UserDeleteEntry> released;
        wire::decode(m, released);
        for (const auto& e : released) del_fork(e.rref_id, e.fork_id, /*tombstone=*/true);
        return make_ready_future(detail::empty_response());
      }
      case RRefControl::Fetch: {
        // The fetch is a call: what the layers attached to it (e.g. the caller's autograd
        // context) is handed to them where the value is encoded.
        RRefId id;
        std::uint64_t type_hash = 0;
        CallAttachments got;
        wire::decode(m, id, type_hash, got);
        std::exception_ptr unrun;
        auto cell = cell_for_query(id, unrun);
        if (unrun) return make_exceptional_future<wire::Message>(unrun);
        auto ctx = shared_from_this();
        return cell->ready.then([cell, ctx, peer, type_hash,
                                 got = std::move(got)](const Future<void>& done) {
          done.wait();
          check_type(*cell, type_hash);
          wire::Message out;
          out.type = wire::MessageType::Response;
          // The value may come long after the fetch, on any thread: the agent may be gone.
          auto pass = ctx->gate_->enter();
          if (!pass) {
            throw RpcError(ctx->gate_->shut_down_text("the value of RRef " + cell->id.str() +
                                                      " was not sent to worker " +
                                                      std::to_string(peer)));
          }
          detail::RRefEncodeScope scope{ctx, peer, {}};
          detail::EncodeScopeGuard guard(detail::tls_rref_encode, &scope);
          pass->host_encode_reply(peer, got, [&] { cell->ops->encode(out, cell->value.get()); });
          return out;
        });
      }
      case RRefControl::TypeQuery: {
        RRefId id;
        wire::decode(m, id);
        std::exception_ptr unrun;
        auto cell = cell_for_query(id, unrun);
        if (unrun) return make_exceptional_future<wire::Message>(unrun);
        return cell->ready.then([cell](const Future<void>& done) {
          done.wait();
          return detail::response_with(cell->ops->type_name);
        });
      }
    }
    throw RpcError("unknown RRef control message kind " + std::to_string(static_cast<int>(kind)) +
                   " from worker " + std::to_string(peer));
  }

  static void check_type(const detail::OwnerCell& cell, std::uint64_t expected) {
    if (expected != 0 && cell.ops->type_hash != expected) {
      throw RpcError("type mismatch for RRef " + cell.id.str() + ": the owner holds a '" +
                     cell.ops->type_name + "'");
    }
  }

  // ---- user operations -------------------------------------------------------------------------

  // `sent`: what the layers attached to the fetch, for the decoding of its reply
  // (host_decode_reply).
  Future<wire::Message> fetch(const ImplPtr& impl, std::chrono::milliseconds timeout,
                              CallAttachments* sent = nullptr) {
    if (auto lost = lost_owner_error(*impl)) return make_exceptional_future<wire::Message>(lost);
    auto pass = gate_->enter();
    if (!pass) {
      return make_exceptional_future<wire::Message>(std::make_exception_ptr(
          RpcError(gate_->shut_down_text("to_here() of " + impl->str() + " not sent"))));
    }
    CallAttachments atts = pass->host_attach(impl->owner.id);
    wire::Message m;
    wire::encode(m, impl->id, impl->type_hash, atts);
    if (sent != nullptr) *sent = std::move(atts);
    auto reply =
        pass->host_control_call(impl->owner.id, rref_message_type(RRefControl::Fetch), std::move(m),
                                pass->host_timeout(timeout), "to_here() of " + impl->str());
    detail::set_wait_driver(reply, pass->host_wait_driver());
    return reply;
  }

  // to_here()'s fetch, sent without waiting for the owner to confirm the creation (right after
  // remote(): one round trip instead of two, the owner answers once the value exists). While the
  // creation is unconfirmed, the future also fails as soon as the creation does: the owner may
  // never have run the call.
  Future<wire::Message> fetch_value(const ImplPtr& impl, std::chrono::milliseconds timeout,
                                    CallAttachments& sent) {
    auto reply = fetch(impl, timeout, &sent);
    Future<wire::Message> out;
    {
      std::lock_guard<std::mutex> lk(impl->mu);
      // Created (a confirmed remote(), a fork): nothing to wait for besides the reply.
      if (impl->created.done()) return reply;
      if (impl->creation_error) {
        out.try_set_exception(impl->creation_error);
        return out;
      }
      impl->early_fetches.push_back(out);
    }
    detail::set_wait_driver(out, gate_->wait_driver());
    reply.add_done_callback([out](const Future<wire::Message>& r) { detail::copy_result(r, out); });
    return out;
  }

  // Called with impl->mu held (the caller keeps the answer in impl->type_future).
  Future<std::string> type_query(const ImplPtr& impl, std::chrono::milliseconds timeout) {
    Future<wire::Message> reply;
    {
      auto pass = gate_->enter();
      if (!pass) {
        return make_exceptional_future<std::string>(std::make_exception_ptr(
            RpcError(gate_->shut_down_text("type query of " + impl->str() + " not sent"))));
      }
      wire::Message m;
      wire::encode(m, impl->id);
      reply = pass->host_control_call(impl->owner.id, rref_message_type(RRefControl::TypeQuery),
                                      std::move(m), pass->host_timeout(timeout),
                                      "type query of " + impl->str());
    }
    Future<std::string> out = reply.then([](const Future<wire::Message>& r) {
      std::string name;
      wire::decode(r.value(), name);
      return name;
    });
    detail::set_callback_executor(out, gate_->user_executor());
    return out;
  }

  // A user RRef's last handle is gone: tell the owner (once). The delete waits up to
  // kDeleteDelay for others to the same owner and goes with them in one message: a loop that
  // creates and drops RRefs would otherwise pay a message and its answer per RRef, more than the
  // remote() itself (docs/rref.md, "Deletes are batched"). The owner only frees the value a little
  // later. Queued deletes count as protocol steps under way, so a graceful shutdown's join waits
  // for them, and purge() sends them at once.
  void release_user(Impl& impl) {
    if (impl.deleted.exchange(true)) return;
    const int owner = impl.owner.id;
    std::vector<detail::UserDeleteEntry> full_batch;
    {
      // One section with close(): close() then finds the delete queued and ends the step itself.
      // The agent itself (its step counter and timer, leaf locks) is reached through a pass: this
      // runs on whatever thread drops the last handle, possibly after the agent was destroyed.
      auto pass = gate_->enter();
      std::lock_guard<std::mutex> lk(mu_);
      users_.erase(impl.fork_id);
      if (closed_ || !pass || impl.skip_delete.load()) return;
      ++pending_futures_;
      pass->host_protocol_begin(1);
      auto& q = delete_queue_[owner];
      q.push_back(detail::UserDeleteEntry{impl.id, impl.fork_id});
      ++queued_deletes_;
      if (!batch_deletes_ || q.size() >= kDeleteBatch) {
        full_batch.swap(q);
        delete_queue_.erase(owner);
        queued_deletes_ -= full_batch.size();
      } else if (!flush_scheduled_) {
        // Refused once the agent stops; close() then drops what is queued.
        auto me = shared_from_this();
        flush_scheduled_ = pass->host_after(kDeleteDelay, [me] { me->flush_deletes(); });
      }
    }
    if (!full_batch.empty()) send_user_deletes(owner, std::move(full_batch));
  }

  // Sends every queued delete now, one message per owner.
  void flush_deletes() {
    std::map<int, std::vector<detail::UserDeleteEntry>> batches;
    {
      std::lock_guard<std::mutex> lk(mu_);
      flush_scheduled_ = false;
      batches.swap(delete_queue_);
      queued_deletes_ = 0;
    }
    for (auto& [owner, batch] : batches) send_user_deletes(owner, std::move(batch));
  }

  // ---- lifecycle -------------------------------------------------------------------------------

  void on_peer_lost(int peer) {
    std::vector<ImplPtr> orphaned;  // user RRefs owned by the lost worker
    std::vector<ImplPtr> others;    // the other user RRefs, released (if last) past the lock
    std::vector<CellPtr> drop_cells;
    std::vector<ImplPtr> drop_children;
    std::size_t dropped_deletes = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      // A request the peer sent before it died may still create a fork for it afterwards: that
      // fork is dropped at once (add_fork_locked), until a replacement joins under its id.
      lost_holders_.insert(peer);
      for (auto it = forks_.begin(); it != forks_.end();) {
        auto& forks = it->second;
        for (auto f = forks.begin(); f != forks.end();) {
          if (f->second == peer) {
            f = forks.erase(f);
            --forks_total_;
          } else {
            ++f;
          }
        }
        if (forks.empty()) {
          auto o = owners_.find(it->first);
          if (o != owners_.end()) {
            drop_cells.push_back(std::move(o->second));
            owners_.erase(o);
          }
          it = forks_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto it = pending_children_.begin(); it != pending_children_.end();) {
        if (it->second.child == peer) {
          drop_children.push_back(std::move(it->second.impl));
          it = pending_children_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto& [fork, weak] : users_) {
        auto u = weak.lock();
        if (!u) continue;
        // Kept past the lock whatever its owner: a user thread may drop its last handle now,
        // and the RRef's release (which takes mu_) must not run here.
        if (u->owner.id == peer) {
          u->skip_delete = true;
          orphaned.push_back(std::move(u));
        } else {
          others.push_back(std::move(u));
        }
      }
      // Deletes still queued for a lost owner can never be answered: they are dropped.
      if (auto q = delete_queue_.find(peer); q != delete_queue_.end()) {
        dropped_deletes = q->second.size();
        queued_deletes_ -= dropped_deletes;
        delete_queue_.erase(q);
      }
    }
    if (dropped_deletes > 0) protocol_steps_done(dropped_deletes);
    for (const auto& u : orphaned) {
      std::lock_guard<std::mutex> lk(u->mu);
      if (!u->owner_lost) {
        u->owner_lost = std::make_exception_ptr(
            DistNetworkError(u->str() + " can no longer be used: its owner " + u->owner.str() +
                             " was lost (a process that joins in its place does not hold it)"));
      }
    }
    // Values and parents are released here, outside the lock.
  }

  void on_peer_joined(int peer) {
    std::lock_guard<std::mutex> lk(mu_);
    lost_holders_.erase(peer);  // a replacement: its forks are its own
  }

  // Graceful shutdown: wait for confirmations, release every user RRef (even those kept alive by
  // reference cycles) and the owner cells nobody forked, and wait for the owners' answers.
  void purge(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    wait_until([&] { return pending_users_.empty(); }, deadline, "pending user RRefs");
    std::vector<ImplPtr> users;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& [fork, weak] : users_) {
        if (auto u = weak.lock()) users.push_back(std::move(u));
      }
    }
    for (auto& u : users) release_user(*u);
    users.clear();
    {
      // From here on a released RRef's delete goes at once: nothing is left for a timer.
      std::lock_guard<std::mutex> lk(mu_);
      batch_deletes_ = false;
    }
    flush_deletes();
    wait_until([&] { return pending_futures_ == 0; }, deadline, "RRef protocol messages");
    std::vector<CellPtr> unforked;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto it = owners_.begin(); it != owners_.end();) {
        auto f = forks_.find(it->first);
        if (f == forks_.end() || f->second.empty()) {
          unforked.push_back(std::move(it->second));
          it = owners_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  // "Leaking RRef ..." lines for every fork still recorded here and every protocol step that
  // never finished; empty when nothing leaked.
  std::string leak_report() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::string out;
    for (const auto& [id, forks] : forks_) {
      for (const auto& [fork, holder] : forks) {
        out += "Leaking RRef " + id.str() + " with fork Id " + fork.str() + " (held by worker " +
               std::to_string(holder) + ")\n";
      }
    }
    for (const auto& [fork, p] : pending_users_) {
      out += "Leaking RRef " + p.impl->id.str() + " with fork Id " + fork.str() +
             " (a user RRef its owner never confirmed)\n";
    }
    for (const auto& [fork, p] : pending_children_) {
      out += "Leaking RRef " + p.impl->id.str() + " with fork Id " + fork.str() +
             " (forked to worker " + std::to_string(p.child) + ", which never accepted it)\n";
    }
    return out;
  }

  // The agent stopped: no message is sent any more, and every user RRef is dead.
  void close() {
    std::vector<ImplPtr> users;
    std::map<ForkId, PendingUser> pending;
    std::map<ForkId, PendingChild> children;
    std::size_t unsent = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      closed_ = true;
      unsent = queued_deletes_;
      delete_queue_.clear();
      queued_deletes_ = 0;
      for (auto& [fork, weak] : users_) {
        if (auto u = weak.lock()) users.push_back(std::move(u));
      }
      users_.clear();
      pending.swap(pending_users_);
      children.swap(pending_children_);
    }
    if (unsent > 0) protocol_steps_done(unsent);
    for (auto& u : users) u->deleted = true;
    for (auto& [fork, p] : pending) {
      p.impl->deleted = true;
      p.confirmed.try_set_exception(
          std::make_exception_ptr(RpcError("the RPC agent of " + self().str() + " shut down")));
    }
  }

  std::map<std::string, std::string> debug_info() const {
    std::lock_guard<std::mutex> lk(mu_);
    return {{"num_owner_rrefs", std::to_string(owners_.size())},
            {"num_pending_users", std::to_string(pending_users_.size())},
            {"num_pending_futures", std::to_string(pending_futures_.load())},
            {"num_forks", std::to_string(forks_total_)},
            {"num_pending_children", std::to_string(pending_children_.size())},
            {"num_queued_deletes", std::to_string(queued_deletes_)},
            {"num_user_deletes_sent", std::to_string(user_deletes_sent_)},
            {"num_user_delete_messages", std::to_string(user_delete_messages_)}};
  }

  // Forks recorded on this owner for `id` (tests and docs traces).
  std::size_t forks_of(const RRefId& id) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = forks_.find(id);
    return it == forks_.end() ? 0 : it->second.size();
  }

 private:
  using Clock = std::chrono::steady_clock;

  struct PendingUser {
    ImplPtr impl;
    Future<void> confirmed;
  };
  struct PendingChild {
    ImplPtr impl;
    int child = -1;
  };

  CellPtr cell_locked(const RRefId& id) {
    auto& c = owners_[id];
    if (!c) c = std::make_shared<detail::OwnerCell>(id);
    return c;
  }

  // The cell a fetch or type query waits on; none, and `unrun` set, for a remote() that failed
  // before it ran (remote_not_run()).
  CellPtr cell_for_query(const RRefId& id, std::exception_ptr& unrun) {
    std::lock_guard<std::mutex> lk(mu_);
    if (auto u = unrun_remotes_.find(id); u != unrun_remotes_.end()) {
      unrun = u->second;
      return nullptr;
    }
    return cell_locked(id);
  }

  void add_fork_locked(const RRefId& id, const ForkId& fork, int holder) {
    if (lost_holders_.count(holder) > 0) {
      // Its holder is gone (on_peer_lost ran before this request was served): nobody will ever
      // delete it.
      erase_unforked_locked(id);
      return;
    }
    auto t = early_deletes_.find(id);
    if (t != early_deletes_.end() && t->second.erase(fork) > 0) {
      // Its delete overtook it: the fork is already gone.
      if (t->second.empty()) early_deletes_.erase(t);
      erase_unforked_locked(id);
      return;
    }
    if (forks_[id].emplace(fork, holder).second) ++forks_total_;
  }

  CellPtr erase_unforked_locked(const RRefId& id) {
    auto f = forks_.find(id);
    if (f != forks_.end() && !f->second.empty()) return nullptr;
    if (f != forks_.end()) forks_.erase(f);
    auto o = owners_.find(id);
    if (o == owners_.end()) return nullptr;
    CellPtr c = std::move(o->second);
    owners_.erase(o);
    return c;
  }

  void erase_if_unforked(const RRefId& id) {
    CellPtr drop;
    std::lock_guard<std::mutex> lk(mu_);
    drop = erase_unforked_locked(id);
    // `drop` may hold the last reference to a value; the owner handle that called this holds
    // the cell too, so no value is destroyed under the lock here.
  }

  // Removes a fork; the owner lets go of the value once no fork is left. A delete that arrives
  // before its fork (remote() still queued here) leaves a tombstone the fork will meet.
  void del_fork(const RRefId& id, const ForkId& fork, bool tombstone) {
    CellPtr drop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto f = forks_.find(id);
      if (f == forks_.end() || f->second.erase(fork) == 0) {
        if (tombstone) early_deletes_[id].insert(fork);
        return;
      }
      --forks_total_;
      drop = erase_unforked_locked(id);
    }
    drop.reset();  // the value may be destroyed here, outside the lock
  }

  // A user RRef whose owner's process was lost: what every use fails with (null otherwise).
  static std::exception_ptr lost_owner_error(const detail::RRefImpl& impl) {
    std::lock_guard<std::mutex> lk(impl.mu);
    return impl.owner_lost;
  }

  void release_child(const ForkId& fork) {
    ImplPtr drop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = pending_children_.find(fork);
      if (it == pending_children_.end()) return;
      drop = std::move(it->second.impl);
      pending_children_.erase(it);
    }
    drop.reset();  // may send this parent's own delete (from the callback pool)
  }

  void drop_pending_user(const ForkId& fork) {
    ImplPtr drop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = pending_users_.find(fork);
      if (it == pending_users_.end()) return;
      drop = std::move(it->second.impl);
      pending_users_.erase(it);
    }
    cv_.notify_all();
  }

  void finish_fork_request(const ForkId& fork, int parent, const Future<wire::Message>& r) {
    std::optional<PendingUser> p;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = pending_users_.find(fork);
      if (it != pending_users_.end()) {
        p = std::move(it->second);
        pending_users_.erase(it);
      }
    }
    if (p) {
      if (r.has_error()) {
        try {
          std::rethrow_exception(r.exception_ptr());
        } catch (const RpcTimeoutError&) {
        } catch (...) {
          p->impl->skip_delete = true;
        }
        p->confirmed.try_set_exception(r.exception_ptr());
      } else {
        p->impl->confirmed = true;
        p->confirmed.try_set_value();
      }
    }
    // The parent may let go of its own reference now that the owner knows the child.
    send_child_accept(parent, fork);
    cv_.notify_all();
    // p (and the user RRef it may hold last) is released here: its delete is queued, not sent.
  }

  void send_child_accept(int parent, const ForkId& fork) {
    wire::Message m;
    wire::encode(m, fork);
    send(parent, RRefControl::ChildAccept, std::move(m), [](const Future<wire::Message>&) {});
  }

  // One message for a batch of queued deletes (each counted as a step under way until now).
  void send_user_deletes(int owner, std::vector<detail::UserDeleteEntry> batch) {
    const std::size_t n = batch.size();
    {
      std::lock_guard<std::mutex> lk(mu_);
      user_deletes_sent_ += n;
      ++user_delete_messages_;
    }
    wire::Message m;
    wire::encode(m, batch);
    send(owner, RRefControl::UserDelete, std::move(m), [](const Future<wire::Message>&) {});
    protocol_steps_done(n);
  }

  void protocol_steps_done(std::size_t n) {
    // Once the agent is gone there is no join left to count for.
    if (auto pass = gate_->enter()) pass->host_protocol_end(n);
    if ((pending_futures_ -= static_cast<std::int64_t>(n)) == 0) cv_.notify_all();
  }

  // Sends a protocol request from the callback pool (the caller may be a transport I/O thread).
  // From the moment it is queued until it is answered, it counts as outstanding work. These are
  // the fire-and-forget messages (fork request, child accept, user delete): no user waits on them
  // to see an error, and one lost would leak a value or block a confirmation, so a send that
  // fails before the message left is retried with backoff (host_control_call_retrying); Fetch and
  // TypeQuery are not sent here, their failure goes to the user's call.
  void send(int to, RRefControl kind, wire::Message&& m,
            std::function<void(const Future<wire::Message>&)> on_done) {
    // The pass spans the agent's part: a user thread dropping its last RRef gets here while
    // another may destroy the agent; without one (the agent gone) it is a closed agent.
    auto pass = gate_->enter();
    bool closed = !pass;
    if (!closed) {
      std::lock_guard<std::mutex> lk(mu_);
      closed = closed_;
    }
    if (closed) {
      pass = {};
      on_done(make_exceptional_future<wire::Message>(std::make_exception_ptr(
          RpcError(std::string(rref_control_name(kind)) + " to worker " + std::to_string(to) +
                   " not sent: the RPC agent of " + self().str() + " shut down"))));
      return;
    }
    ++pending_futures_;
    pass->host_protocol_begin(1);
    auto me = shared_from_this();
    auto finish = [me, on_done](const Future<wire::Message>& r) {
      if (r.has_error()) {
        detail::log_warning(me->self().name, detail::exception_text(r.exception_ptr()));
      }
      on_done(r);
      if (--me->pending_futures_ == 0) me->cv_.notify_all();
    };
    if (!transport::on_transport_thread()) {
      // A user or pool thread (an RRef dropped in user code): send from here. Waking a pool
      // thread to do it cost more than the message itself.
      auto fut = pass->host_control_call_retrying(
          to, rref_message_type(kind), std::move(m), pass->host_timeout(kUnsetRpcTimeout),
          std::string(rref_control_name(kind)), kControlAttempts, kControlFirstBackoff);
      pass->host_protocol_end(1);
      pass = {};  // the completion below is this layer's own code: no pass needed
      fut.add_done_callback(finish);
      return;
    }
    auto msg = std::make_shared<wire::Message>(std::move(m));
    const bool posted = pass->host_post([me, to, kind, msg, finish] {
      // A pool thread of the agent: it is joined before the agent goes, but the pass costs
      // little and keeps one rule for every use.
      auto p = me->gate_->enter();
      if (!p) {
        finish(make_exceptional_future<wire::Message>(std::make_exception_ptr(
            RpcError(std::string(rref_control_name(kind)) + " to worker " + std::to_string(to) +
                     " not sent: the RPC agent of " + me->self().str() + " shut down"))));
        return;
      }
      auto fut = p->host_control_call_retrying(
          to, rref_message_type(kind), std::move(*msg), p->host_timeout(kUnsetRpcTimeout),
          std::string(rref_control_name(kind)), kControlAttempts, kControlFirstBackoff);
      p->host_protocol_end(1);
      p = {};
      fut.add_done_callback(finish);
    });
    if (!posted) {
      pass->host_protocol_end(1);
      pass = {};
      finish(make_exceptional_future<wire::Message>(std::make_exception_ptr(
          RpcError(std::string(rref_control_name(kind)) + " to worker " + std::to_string(to) +
                   " dropped: the RPC agent of " + self().str() + " is shutting down"))));
    }
  }

  template <class Pred>
  void wait_until(Pred pred, Clock::time_point deadline, const char* what) {
    std::unique_lock<std::mutex> lk(mu_);
    while (!pred()) {
      if (cv_.wait_until(lk, std::min(deadline, Clock::now() + std::chrono::milliseconds(10))) ==
              std::cv_status::timeout &&
          Clock::now() >= deadline && !pred()) {
        throw RpcError("graceful shutdown of " + self().str() + ": timed out waiting for " + what +
                       " to finish");
      }
    }
  }

  // The agent, reached only through passes (see the constructor).
  const std::shared_ptr<detail::HostGate> gate_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<RRefId, CellPtr> owners_;
  std::map<RRefId, std::map<ForkId, int>> forks_;  // fork -> the worker holding it
  std::size_t forks_total_ = 0;
  std::map<RRefId, std::set<ForkId>> early_deletes_;
  std::set<int> lost_holders_;  // workers lost (and not replaced since): they hold no fork
  // remote() calls that failed before they ran, for the fetches their creators sent along.
  static constexpr std::size_t kMaxUnrunRemotes = 1024;
  std::map<RRefId, std::exception_ptr> unrun_remotes_;
  std::deque<RRefId> unrun_order_;
  std::map<ForkId, PendingUser> pending_users_;
  std::map<ForkId, PendingChild> pending_children_;
  std::map<ForkId, std::weak_ptr<Impl>> users_;
  std::atomic<std::int64_t> pending_futures_{0};
  bool closed_ = false;
  // Deletes of released user RRefs waiting to go, per owner (release_user()).
  static constexpr std::size_t kDeleteBatch = 256;
  static constexpr std::chrono::milliseconds kDeleteDelay{1};
  std::map<int, std::vector<detail::UserDeleteEntry>> delete_queue_;
  std::size_t queued_deletes_ = 0;
  bool flush_scheduled_ = false;
  bool batch_deletes_ = true;  // false once purge() began
  std::uint64_t user_deletes_sent_ = 0;
  std::uint64_t user_delete_messages_ = 0;
};

detail::RRefImpl::~RRefImpl() {
  if (is_owner) return;
  if (auto c = ctx.lock()) c->release_user(*this);
}

// The RRef layer plugs into every agent (agent/extension.hpp).
inline const bool rref_layer_registered = register_agent_extension(
    RRefContext::kExtensionId, [](AgentServices& host) -> std::shared_ptr<AgentExtension> {
      return std::make_shared<RRefContext>(host);
    });

namespace detail {
// The RRef bookkeeping of `agent` (an RpcAgent; a template so this layer needs only its
// declaration).
template <class Agent>
std::shared_ptr<RRefContext> rref_context_of(const Agent& agent) {
  auto ctx = agent.template extension<RRefContext>();
  if (!ctx) throw RpcError("the RRef layer is not plugged into the agent of " + agent.self().str());
  return ctx;
}
}  // namespace detail

}  // namespace distrpc
