// Distributed autograd plugged into the agent (agent/extension.hpp): the agent knows nothing of
// it. A call made inside a context carries (context id, autograd message id) as an attachment;
// the tensors requiring grad that the request and its reply carry are recorded as they are
// encoded and decoded (wire::TensorObserver): a SendRpcBackward where they leave, a
// RecvRpcBackward where they arrive. Three control messages of its own: the gradients of a recv
// function sent back to its send function (answered once the pass they start ran here, except
// those another worker sends to the backward's root: see send_gradients), the
// report of such a pass to the worker whose backward() it serves (termination.hpp: that worker
// counts the passes, so no pass waits for those it started), and the release of a context
// (forwarded to the workers it knows).
#pragma once

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "distrpc/agent/extension.hpp"
#include "distrpc/autograd/container.hpp"
#include "distrpc/autograd/context.hpp"
#include "distrpc/autograd/engine.hpp"
#include "distrpc/autograd/functions.hpp"
#include "distrpc/autograd/termination.hpp"
#include "distrpc/future.hpp"
#include "distrpc/log.hpp"
#include "distrpc/options.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/wire/tensor_observer.hpp"

namespace distrpc::dist_autograd {

namespace detail {

// What a call made inside a context carries: the context, and the autograd message id of the
// request's send function (the reply's is the next id: the caller reserves both).
struct CallTag {
  std::int64_t context_id = -1;
  std::int64_t message_id = -1;

  std::string encode() const {
    std::string s(16, '\0');
    std::memcpy(s.data(), &context_id, 8);
    std::memcpy(s.data() + 8, &message_id, 8);
    return s;
  }
  static std::optional<CallTag> find(const CallAttachments& atts, std::uint8_t layer) {
    for (const auto& [id, bytes] : atts) {
      if (id != layer) continue;
      if (bytes.size() != 16) {
        throw std::runtime_error("malformed distributed-autograd attachment of " +
                                 std::to_string(bytes.size()) + " bytes (16 expected)");
      }
      CallTag t;
      std::memcpy(&t.context_id, bytes.data(), 8);
      std::memcpy(&t.message_id, bytes.data() + 8, 8);
      return t;
    }
    return std::nullopt;
  }
};

// The thread's context (and libtorch's thread-local state: grad mode, the profiler) carried into
// the callbacks of futures registered inside a context (future.hpp's thread-state carriers).
struct CarriedContext {
  std::int64_t id;
  at::ThreadLocalState state;
};
inline std::shared_ptr<const void> capture_context() {
  if (dist_autograd::detail::tls_context_id < 0) return nullptr;
  return std::make_shared<const CarriedContext>(
      CarriedContext{dist_autograd::detail::tls_context_id, at::ThreadLocalState()});
}
inline std::shared_ptr<void> enter_context(const std::shared_ptr<const void>& snapshot) {
  struct Guard {
    explicit Guard(const CarriedContext& c) : scope(c.id), state(c.state) {}
    dist_autograd::detail::CurrentContextScope scope;
    at::ThreadLocalStateGuard state;
  };
  return std::make_shared<Guard>(*static_cast<const CarriedContext*>(snapshot.get()));
}
inline const bool context_carrier_registered =
    distrpc::detail::register_thread_state_carrier({&capture_context, &enter_context});

// Collects the tensors requiring grad that a message carries while it is encoded or decoded.
class Collector final : public wire::TensorObserver {
 public:
  void encoded(const at::Tensor& t) override { tensors.push_back(t); }
  void decoded(const at::Tensor& t) override { tensors.push_back(t); }
  std::vector<at::Tensor> tensors;
};

}  // namespace detail

class AutogradLayer final : public AgentExtension,
                            public std::enable_shared_from_this<AutogradLayer> {
 public:
  static constexpr int kExtensionId = 1;
  enum Kind : int { kGradients = 0, kCleanup = 1, kReport = 2, kKinds = 3 };
  // Release messages are sent this many times in all when a send fails (a transient link
  // failure), waiting kCleanupBackoff, doubled each time, in between.
  static constexpr int kCleanupAttempts = 6;
  static constexpr std::chrono::milliseconds kCleanupBackoff{100};
  // Releases wait at most this long to go out together (send_cleanup).
  static constexpr std::chrono::milliseconds kCleanupBatchDelay{5};
  // backward() reads the transport itself for this long before it sleeps (a short step's
  // passes elsewhere answer well within it; a long one costs this much spinning once).
  static constexpr std::chrono::milliseconds kBackwardDrive{2};
  // A lost worker fails the backwards that still need it this long after its loss was noticed,
  // once what it sent before has been handled (on_peer_lost).
  static constexpr std::chrono::milliseconds kLossGrace{500};

  // The agent is reached through its gate only (agent/extension.hpp, distrpc::detail::HostGate):
  // this layer outlives the agent when a user thread releases a context (or waits for a
  // backward) while another destroys the agent.
  explicit AutogradLayer(AgentServices& host) : gate_(host.host_gate()) {}

  // The wire type of control kind `k` (e.g. for a fault-injecting transport in tests).
  static constexpr wire::MessageType message_type(Kind k) {
    return wire::control_message_type(
        static_cast<std::uint8_t>(kExtensionId * kKindsPerExtension + static_cast<int>(k)));
  }

  int id() const override { return kExtensionId; }
  std::string control_name(int kind) const override {
    switch (kind) {
      case kGradients:
        return "distributed autograd gradients";
      case kCleanup:
        return "distributed autograd context cleanup";
      case kReport:
        return "distributed autograd pass report";
      default:
        return "distributed autograd control " + std::to_string(kind);
    }
  }

  ContextContainer& contexts() {
    std::call_once(container_once_, [&] {
      container_ = std::make_unique<ContextContainer>(self_id());
      made_.store(container_.get(), std::memory_order_release);
    });
    return *container_;
  }

  // ---- the public operations (dist_autograd.hpp) ------------------------------------------------

  // Runs the distributed backward pass from `roots` in context `context_id`, on this thread, and
  // waits until every worker it reached is done.
  void backward(std::int64_t context_id, const std::vector<at::Tensor>& roots, bool retain_graph) {
    RECORD_FUNCTION("torch::distributed::autograd::backward", std::vector<c10::IValue>());
    if (roots.empty()) throw std::runtime_error("No tensors provided for gradient computation.");
    torch::autograd::edge_list edges;
    torch::autograd::variable_list grads;
    for (std::size_t i = 0; i < roots.size(); ++i) {
      const at::Tensor& r = roots[i];
      const std::string which = "root " + std::to_string(i) + " of backward()";
      if (!r.defined()) throw std::runtime_error(which + " is an undefined tensor");
      if (!r.requires_grad()) throw std::runtime_error("requires_grad not set on " + which);
      if (r.numel() != 1) {
        throw std::runtime_error(which + " of sizes " + c10::str(r.sizes()) +
                                 " is not a scalar, all roots need to be scalar");
      }
      if (!r.grad_fn()) {
        throw std::runtime_error(which + " does not have a valid gradient function (it is a " +
                                 "leaf: nothing to back-propagate through)");
      }
      edges.push_back(torch::autograd::impl::gradient_edge(r));
      grads.push_back(at::ones_like(r, at::MemoryFormat::Preserve));
    }
    auto ctx = contexts().retrieve(context_id);
    PassCount count(*this);
    // This backward's id: every pass it starts anywhere reports to it (termination.hpp).
    const Origin origin{self_id(), next_message_id()};
    // Its roots, while it runs (engine.hpp's reached_by_others), beside those of other backwards
    // running in the same context.
    struct Running {
      DistAutogradContext& ctx;
      const std::int64_t id;
      ~Running() { ctx.remove_running_roots(id); }
    } running{*ctx, origin.backward_id};
    ctx->add_running_roots(origin.backward_id, edges);
    auto tracker = std::make_shared<detail::BackwardTracker>(origin.root);
    TrackerEntry entry(*this, origin.backward_id, tracker);
    // The first pass counts as a message of its own, done when it ran: nothing finishes while it
    // still sends.
    tracker->created(origin.backward_id, origin.root);
    try {
      dist_autograd::detail::CurrentContextScope current(context_id);
      run_pass(ctx, edges, grads, retain_graph, origin);
      tracker->report(origin.root, origin.backward_id, {}, {});
    } catch (...) {
      tracker->fail(std::current_exception());
    }
    Future<void> done = tracker->done();
    try {
      // Waiting, this thread reads the transport itself: for up to kBackwardDrive (the passes it
      // started answer within a few messages), then as a blocking rpc_sync does. The last report
      // then wakes no other thread, and gradients coming back for this worker run their pass on
      // this thread (receive_gradients) instead of waking a pool thread.
      WaitingScope waiting(origin.backward_id);
      if (auto pass = gate_->enter()) {
        pass->host_drive([&done] { return done.done(); },
                         std::chrono::steady_clock::now() + kBackwardDrive);
      }
      distrpc::detail::set_wait_driver(done, gate_->wait_driver());
      done.wait();
      done.value();
    } catch (...) {
      throw std::runtime_error(dist_autograd::detail::node_error_text(
          self_id(), dist_autograd::detail::message_of(std::current_exception())));
    }
  }

  // Releases context `id` here, and on every worker it sent autograd metadata to (which release
  // it on theirs, transitively). Throws "Could not find autograd context with id: <id>".
  void release(std::int64_t id) {
    auto ctx = contexts().erase(id);
    if (!ctx) throw std::runtime_error(dist_autograd::detail::not_found_text(id));
    send_cleanup(id, ctx->close(), -1);
  }

  std::map<std::string, std::string> debug_info() {
    return {{"num_current_backward_passes", std::to_string(passes_.load())},
            {"num_autograd_contexts", std::to_string(contexts().size())}};
  }

  // ---- the agent's hooks
  // --------------------------------------------------------------------------

  void attach(int dst, CallAttachments& out) override {
    const std::int64_t id = dist_autograd::detail::tls_context_id;
    if (id < 0) return;
    auto ctx = contexts().find(id);
    if (!ctx) return;  // released while current: nothing to record it in
    if (!ctx->add_known_worker(dst)) return;  // released meanwhile: the call goes without it
    out.emplace_back(kExtensionId, detail::CallTag{id, next_message_id()}.encode());
  }

  void encode_for(int /*dst*/, const CallAttachments& sent, FunctionRef<void()> encode,
                  std::vector<std::function<void()>>& /*undo*/) override {
    auto tag = detail::CallTag::find(sent, kExtensionId);
    if (!tag) {
      encode();
      return;
    }
    detail::Collector c;
    {
      wire::TensorObserverScope observe(&c);
      encode();
    }
    if (c.tensors.empty()) return;
    if (auto ctx = contexts().find(tag->context_id)) record_send(*ctx, tag->message_id, c.tensors);
  }

  void decode_from(int from, const CallAttachments& sent, FunctionRef<void()> decode) override {
    auto tag = detail::CallTag::find(sent, kExtensionId);
    if (!tag) {
      decode();
      return;
    }
    detail::Collector c;
    {
      wire::TensorObserverScope observe(&c);
      decode();
    }
    if (c.tensors.empty()) return;
    // The context may be gone (released before the reply came): the tensors stay leaves.
    if (auto ctx = contexts().find(tag->context_id)) {
      record_recv(*ctx, from, tag->message_id + 1, c.tensors, /*in_reply=*/true);
    }
  }

  std::shared_ptr<void> enter_request(int peer, const CallAttachments& got) override {
    auto tag = detail::CallTag::find(got, kExtensionId);
    if (!tag) return nullptr;
    auto ctx = contexts().get_or_create(tag->context_id);
    // Released here already (the caller left its context while this request was on its way):
    // the request runs outside any context, and nothing is recorded for it.
    if (!ctx) return nullptr;
    return std::make_shared<RequestScope>(shared_from_this(), peer, *tag, std::move(ctx));
  }

  void arguments_decoded(int /*peer*/) override {
    if (RequestScope* s = RequestScope::current()) s->arguments_done();
  }

  void encode_reply(int peer, const CallAttachments& got, FunctionRef<void()> encode) override {
    auto tag = detail::CallTag::find(got, kExtensionId);
    if (!tag) {
      encode();
      return;
    }
    // A reply to a call made in a context is encoded in it: made here if the call was not a
    // request run inside it (an RRef fetch); not when the context was released meanwhile (the
    // caller left it while the call ran), which would make it again for good.
    auto ctx = contexts().get_or_create(tag->context_id);
    if (!ctx) {
      encode();
      return;
    }
    detail::Collector c;
    {
      wire::TensorObserverScope observe(&c);
      encode();
    }
    if (c.tensors.empty()) return;
    record_send(*ctx, tag->message_id + 1, c.tensors);
    ctx->add_known_worker(peer);
  }

  Future<wire::Message> handle_control(int peer, int kind, const wire::Message& m) override {
    switch (kind) {
      case kGradients:
        return receive_gradients(peer, m);
      case kReport:
        receive_report(peer, m);
        return make_ready_future(distrpc::detail::empty_response());
      case kCleanup: {
        std::vector<std::int64_t> ids;
        wire::decode(m, ids);
        // Idempotent: a context already released (a cycle of known workers) is not an error.
        for (auto id : ids) {
          if (auto ctx = contexts().erase(id)) send_cleanup(id, ctx->close(), peer);
        }
        return make_ready_future(distrpc::detail::empty_response());
      }
      default:
        throw std::runtime_error("unknown distributed autograd control message kind " +
                                 std::to_string(kind) + " from worker " + std::to_string(peer));
    }
  }

  // Graceful shutdown: the releases still waiting for their batch go out now.
  void before_exit(std::chrono::milliseconds /*limit*/) override { flush_cleanup(); }
  void on_stop() override {
    stopping_.store(true);
    for (auto& t : trackers()) {
      t->fail(std::make_exception_ptr(std::runtime_error("the agent of worker " +
                                                         std::to_string(self_id()) +
                                                         " stopped during the backward pass")));
    }
  }
  // A backward that still needs a lost worker fails, naming it (termination.hpp says when). Not
  // at once: what that worker sent before it was lost (a report, gradients for this root) may
  // still wait for a thread here, and is handled first: the loss counts kLossGrace later.
  void on_peer_lost(int peer) override {
    // The contexts the lost worker made are released here and on the workers this one passed
    // them to: their maker will not release them, and would count its ids from 0 again if it
    // came back.
    if (made_.load(std::memory_order_acquire) != nullptr) {
      for (const auto& ctx : contexts().erase_made_by(peer)) {
        send_cleanup(ctx->context_id(), ctx->close(), peer);
      }
    }
    if (trackers().empty()) return;  // a backward started from now on cannot reach it
    std::string name = std::to_string(peer);
    try {
      if (auto pass = gate_->enter()) name = pass->host_worker(peer).name;
    } catch (const std::exception&) {
      // A member that already left the group: its id names it.
    }
    const auto error = std::make_exception_ptr(std::runtime_error(
        "worker " + name + " (id " + std::to_string(peer) + ") was lost during the backward pass"));
    std::weak_ptr<AutogradLayer> weak = weak_from_this();
    auto apply = [weak, peer, error] {
      if (auto self = weak.lock()) {
        for (auto& t : self->trackers()) t->lost(peer, error);
      }
    };
    auto pass = gate_->enter();
    if (!pass || !pass->host_after(kLossGrace, apply)) apply();
  }
  // A worker joined again (a replacement under a lost one's rank): its contexts may be made here
  // again.
  void on_peer_joined(int peer) override {
    if (made_.load(std::memory_order_acquire) != nullptr) contexts().joined(peer);
  }
  void add_debug_info(std::map<std::string, std::string>& out) const override {
    out["dist_autograd.num_current_backward_passes"] = std::to_string(passes_.load());
    // Not made yet, or being made on another thread: none to count.
    if (const auto* c = made_.load(std::memory_order_acquire)) {
      out["dist_autograd.num_autograd_contexts"] = std::to_string(c->size());
    }
  }

 private:
  // The scope of a request that carried a context: the thread runs in that context, and the
  // tensors requiring grad among its arguments get a RecvRpcBackward once they are decoded.
  class RequestScope {
   public:
    RequestScope(std::shared_ptr<AutogradLayer> layer, int peer, detail::CallTag tag,
                 ContextPtr ctx)
        : layer_(std::move(layer)),
          peer_(peer),
          tag_(tag),
          ctx_(std::move(ctx)),
          current_(tag.context_id),
          saved_observer_(wire::detail::tls_tensor_observer),
          saved_scope_(tls_scope) {
      wire::detail::tls_tensor_observer = &args_;
      tls_scope = this;
    }
    ~RequestScope() {
      if (decoding_) wire::detail::tls_tensor_observer = saved_observer_;
      tls_scope = saved_scope_;
    }
    RequestScope(const RequestScope&) = delete;
    RequestScope& operator=(const RequestScope&) = delete;

    static RequestScope* current() { return tls_scope; }

    void arguments_done() {
      if (!decoding_) return;
      decoding_ = false;
      wire::detail::tls_tensor_observer = saved_observer_;
      if (!args_.tensors.empty()) {
        layer_->record_recv(*ctx_, peer_, tag_.message_id, args_.tensors);
      }
    }

   private:
    static inline thread_local RequestScope* tls_scope = nullptr;
    const std::shared_ptr<AutogradLayer> layer_;
    const int peer_;
    const detail::CallTag tag_;
    const ContextPtr ctx_;
    dist_autograd::detail::CurrentContextScope current_;
    detail::Collector args_;
    wire::TensorObserver* const saved_observer_;
    RequestScope* const saved_scope_;
    bool decoding_ = true;
  };

  // The backward this thread waits for in backward(), while it does (receive_gradients).
  static inline thread_local std::int64_t tls_waiting_backward = -1;
  class WaitingScope {
   public:
    explicit WaitingScope(std::int64_t id) : saved_(tls_waiting_backward) {
      tls_waiting_backward = id;
    }
    ~WaitingScope() { tls_waiting_backward = saved_; }
    WaitingScope(const WaitingScope&) = delete;
    WaitingScope& operator=(const WaitingScope&) = delete;

   private:
    const std::int64_t saved_;
  };

  // Counts a pass in num_current_backward_passes while it lives.
  class PassCount {
   public:
    explicit PassCount(AutogradLayer& l) : l_(l) { l_.passes_.fetch_add(1); }
    ~PassCount() { l_.passes_.fetch_sub(1); }
    PassCount(const PassCount&) = delete;
    PassCount& operator=(const PassCount&) = delete;

   private:
    AutogradLayer& l_;
  };

  // Which backward a pass serves: the worker that called backward() and that call's id.
  struct Origin {
    int root = -1;
    std::int64_t backward_id = -1;
  };

  // Registers a backward's tracker, so that reports reach it, while backward() runs.
  class TrackerEntry {
   public:
    TrackerEntry(AutogradLayer& l, std::int64_t id, std::shared_ptr<detail::BackwardTracker> t)
        : l_(l), id_(id) {
      std::lock_guard<std::mutex> lk(l_.trackers_mu_);
      l_.trackers_[id_] = std::move(t);
    }
    ~TrackerEntry() {
      std::lock_guard<std::mutex> lk(l_.trackers_mu_);
      l_.trackers_.erase(id_);
    }
    TrackerEntry(const TrackerEntry&) = delete;
    TrackerEntry& operator=(const TrackerEntry&) = delete;

   private:
    AutogradLayer& l_;
    const std::int64_t id_;
  };

  std::shared_ptr<detail::BackwardTracker> tracker(std::int64_t backward_id) {
    std::lock_guard<std::mutex> lk(trackers_mu_);
    auto it = trackers_.find(backward_id);
    return it == trackers_.end() ? nullptr : it->second;
  }
  std::vector<std::shared_ptr<detail::BackwardTracker>> trackers() {
    std::lock_guard<std::mutex> lk(trackers_mu_);
    std::vector<std::shared_ptr<detail::BackwardTracker>> out;
    for (auto& [id, t] : trackers_) out.push_back(t);
    return out;
  }

  int self_id() const { return gate_->self().id; }

  std::int64_t next_message_id() {
    const std::int64_t n = next_message_.fetch_add(2);
    return (static_cast<std::int64_t>(self_id()) << kCounterBits) | (n & kCounterMask);
  }

  // One SendRpcBackward for the tensors requiring grad that message `message_id` carried out.
  static void record_send(DistAutogradContext& ctx, std::int64_t message_id,
                          const std::vector<at::Tensor>& tensors) {
    torch::autograd::edge_list edges;
    for (const auto& t : tensors) edges.push_back(torch::autograd::impl::gradient_edge(t));
    auto fn = std::make_shared<SendRpcBackward>(std::move(edges));
    for (const auto& t : tensors) fn->add_input_metadata(t);
    ctx.add_send(message_id, std::move(fn));
  }

  // One RecvRpcBackward, the grad_fn of every tensor requiring grad that arrived from `from` in
  // the message whose send function there is `send_id`.
  static void record_recv(DistAutogradContext& ctx, int from, std::int64_t send_id,
                          std::vector<at::Tensor>& tensors, bool in_reply = false) {
    auto fn = std::make_shared<RecvRpcBackward>(ctx.context_id(), from, send_id, in_reply);
    for (auto& t : tensors) torch::autograd::set_history(t, fn);
    ctx.add_recv(send_id, std::move(fn));
  }

  // Runs a pass here, sending the gradients it computes for recv functions; returns the messages
  // it sent (ids and destinations), which its report to the root lists.
  struct Sent {
    std::vector<std::int64_t> ids;
    std::vector<int> dsts;
  };
  Sent run_pass(const ContextPtr& ctx, const torch::autograd::edge_list& roots,
                const torch::autograd::variable_list& grads, bool retain_graph,
                const Origin& origin) {
    Sent sent;
    dist_autograd::detail::run_pass(
        ctx, self_id(), roots, grads, retain_graph,
        [&](const RecvRpcBackward& recv, torch::autograd::variable_list g, bool retain) {
          const std::int64_t id = next_message_id();
          sent.ids.push_back(id);
          sent.dsts.push_back(recv.from());
          send_gradients(ctx->context_id(), recv, std::move(g), retain, origin, id);
        });
    return sent;
  }

  // Sends gradients to `recv`'s sender as message `id` of backward `origin`. The root counts the
  // message before it leaves; the answer comes once the pass it starts ran there (to the root's
  // own messages it is that pass's report). Gradients that another worker sends to the root get
  // no answer (unanswered()): the root runs their pass itself and counts it there, failures
  // included, so an answer would only cost both sides a send, on the root one more before it can
  // read the report it waits for. Between two other workers the answer stays: its timeout is what
  // fails the backward when the receiver's pass never runs. A send that fails fails the backward,
  // naming the worker.
  void send_gradients(std::int64_t context_id, const RecvRpcBackward& recv,
                      torch::autograd::variable_list grads, bool retain_graph, const Origin& origin,
                      std::int64_t id) {
    const bool from_root = origin.root == self_id();
    std::shared_ptr<detail::BackwardTracker> t;
    if (from_root) {
      t = tracker(origin.backward_id);
      if (!t) return;  // that backward already failed and returned
      t->created(id, recv.from());
    }
    wire::Message m;
    Future<wire::Message> reply;
    try {
      const std::string what = "gradients of autograd context " + std::to_string(context_id);
      auto pass = gate_->enter();
      if (!pass) throw RpcError(gate_->shut_down_text(what + " not sent"));
      {
        // Gradients are not recorded, and go back the way their forward tensors came, mapped
        // the other way: each arrives on its leaf's device.
        wire::TensorObserverScope none(nullptr);
        pass->host_encode_back(recv.from(), recv.in_reply(), [&] {
          wire::encode(m, origin.root, origin.backward_id, id, context_id, recv.send_id(),
                       retain_graph, grads);
        });
      }
      if (unanswered(self_id(), recv.from(), origin)) {
        pass->host_control_notify(recv.from(), control_type(kGradients), std::move(m), what);
        return;
      }
      reply = pass->host_control_call(recv.from(), control_type(kGradients), std::move(m),
                                      pass->host_timeout(kUnsetRpcTimeout), what);
    } catch (...) {
      reply = make_exceptional_future<wire::Message>(std::current_exception());
    }
    std::weak_ptr<AutogradLayer> weak = weak_from_this();
    reply.add_done_callback([weak, t, origin, id,
                             to = recv.from()](const Future<wire::Message>& r) {
      auto self = weak.lock();
      if (!self) return;
      if (r.has_error()) {
        self->report_to_root(
            origin, id, {},
            dist_autograd::detail::node_error_text(
                self->self_id(), dist_autograd::detail::message_of(r.exception_ptr())));
        return;
      }
      if (!t) return;  // not the root: the pass reported to it directly
      try {
        Sent s;
        wire::decode(r.value(), s.ids, s.dsts);
        t->report(to, id, s.ids, s.dsts);
      } catch (...) {
        t->fail(std::current_exception());
      }
    });
  }

  // Tells backward `origin` that message `processed` was (its pass sent `sent`), or that it
  // failed (`error` not empty).
  void report_to_root(const Origin& origin, std::int64_t processed, const Sent& sent,
                      const std::string& error) {
    if (origin.root == self_id()) {
      apply_report(origin.backward_id, self_id(), processed, sent, error);
      return;
    }
    wire::Message m;
    wire::encode(m, origin.backward_id, processed, sent.ids, sent.dsts, error);
    Future<wire::Message> reply;
    try {
      auto pass = gate_->enter();
      if (!pass) return;  // the agent is gone: nobody here waits for the report
      reply = pass->host_control_call_retrying(
          origin.root, control_type(kReport), std::move(m), pass->host_timeout(kUnsetRpcTimeout),
          "report of a backward pass", kCleanupAttempts, kCleanupBackoff);
    } catch (...) {
      return;  // the root is lost or this agent stops: nobody waits for the report
    }
    // Sent again while the transport refused it; if it never went, the root waits until it
    // notices this worker's loss (a link that fails one way only): say so here.
    std::weak_ptr<AutogradLayer> weak = weak_from_this();
    reply.add_done_callback([weak, root = origin.root](const Future<wire::Message>& r) {
      if (!r.has_error()) return;
      try {
        std::rethrow_exception(r.exception_ptr());
      } catch (const DistNetworkError&) {
        return;  // the root is lost: nobody waits for the report
      } catch (...) {
      }
      auto self = weak.lock();
      if (!self || self->stopping_.load()) return;
      distrpc::detail::log_error(
          self->gate_->self().name,
          "the report of a backward pass to worker " + std::to_string(root) +
              " was not confirmed (" + dist_autograd::detail::message_of(r.exception_ptr()) +
              "); if it never arrived, that backward waits until its root notices this worker "
              "is lost");
    });
  }

  // Here on the root: worker `from` reports on backward `backward_id`.
  void apply_report(std::int64_t backward_id, int from, std::int64_t processed, const Sent& sent,
                    const std::string& error) {
    auto t = tracker(backward_id);
    if (!t) return;
    if (error.empty()) {
      t->report(from, processed, sent.ids, sent.dsts);
    } else {
      t->fail(std::make_exception_ptr(std::runtime_error(error)));
    }
  }

  void receive_report(int peer, const wire::Message& m) {
    std::int64_t backward_id = -1;
    std::int64_t processed = -1;
    Sent sent;
    std::string error;
    wire::decode(m, backward_id, processed, sent.ids, sent.dsts, error);
    apply_report(backward_id, peer, processed, sent, error);
  }

  // Gradients for one of this worker's send functions: its pass runs here when this is not a
  // transport thread, else on the callback pool. The answer goes back once it ran: to the root
  // it is the pass's report; to anyone else an acknowledgement (the report goes to the root).
  // Here on the root, gradients from another worker get no answer: the pass counts itself.
  Future<wire::Message> receive_gradients(int peer, const wire::Message& m) {
    std::int64_t context_id = -1;
    std::int64_t send_id = -1;
    bool retain_graph = false;
    torch::autograd::variable_list grads;
    Origin origin;
    std::int64_t id = -1;
    wire::InputArchive ar(m);
    // Which backward it serves comes first: gradients another worker sent to the root get no
    // answer, so the root learns from here when they cannot be read or run.
    ar(origin.root, origin.backward_id, id, context_id, send_id, retain_graph);
    // Here on the root, gradients another worker sent no longer depend on that worker.
    if (unanswered(peer, self_id(), origin)) {
      if (auto t = tracker(origin.backward_id)) t->arrived(id);
    }
    try {
      ar(grads);
      ar.finish();
    } catch (...) {
      unanswered_failure(peer, origin, id, std::current_exception());
      throw;
    }
    Future<wire::Message> out;
    auto self = shared_from_this();
    auto task = [self, peer, context_id, send_id, retain_graph, grads = std::move(grads), origin,
                 id, out]() mutable {
      Sent sent;
      try {
        sent = self->run_received_pass(context_id, send_id, std::move(grads), retain_graph, origin);
      } catch (...) {
        const std::string error = dist_autograd::detail::node_error_text(
            self->self_id(), dist_autograd::detail::message_of(std::current_exception()));
        if (peer != origin.root) self->report_to_root(origin, id, {}, error);
        out.try_set_exception(std::make_exception_ptr(std::runtime_error(error)));
        return;
      }
      // The root counted its own sends as they left; anyone else lists them in the report.
      if (origin.root == self->self_id()) sent = Sent{};
      if (peer == origin.root) {
        wire::Message reply = distrpc::detail::empty_response();
        wire::encode(reply, sent.ids, sent.dsts);
        out.try_set_value(std::move(reply));
        return;
      }
      self->report_to_root(origin, id, sent, "");
      out.try_set_value(distrpc::detail::empty_response());
    };
    // Already on a pool thread: run here (one hand-off less); so too on the thread reading while
    // it waits in backward() for this very backward (the pass is what it waits for). Never on a
    // transport thread, nor on a thread waiting for something else (the pass runs user code,
    // which must not delay that wait or take the locks its caller holds).
    const bool waiter_of_this =
        origin.root == self_id() && tls_waiting_backward == origin.backward_id;
    if (!transport::on_transport_thread() && (!transport::in_wait_driver() || waiter_of_this)) {
      // The pass may run user code (hooks) that waits on an RPC: more gradients of this backward
      // read during that wait must not run inline too, on this thread, which holds the
      // context's pass lock. They go to the pool and wait for this pass.
      WaitingScope not_waiting(-1);
      task();
      return out;
    }
    auto pass = gate_->enter();
    if (!pass || !pass->host_post(std::move(task))) {
      auto e = std::make_exception_ptr(std::runtime_error(dist_autograd::detail::node_error_text(
          self_id(), "the agent of worker " + std::to_string(self_id()) +
                         " is stopping: backward pass not run")));
      unanswered_failure(peer, origin, id, e);
      std::rethrow_exception(e);
    }
    return out;
  }

  // Whether gradients from worker `from` to worker `to` for backward `origin` go without an
  // answer (send_gradients): those another worker sends to the root.
  static bool unanswered(int from, int to, const Origin& origin) {
    return from != origin.root && to == origin.root;
  }

  // Gradients message `id` from `peer` failed before its pass ran. An answer would carry the
  // failure back to the sender, which reports it to the root; without one (this is the root) the
  // backward fails here.
  void unanswered_failure(int peer, const Origin& origin, std::int64_t id, std::exception_ptr e) {
    if (!unanswered(peer, self_id(), origin)) return;
    report_to_root(origin, id, {},
                   dist_autograd::detail::node_error_text(
                       self_id(), dist_autograd::detail::message_of(std::move(e))));
  }

  Sent run_received_pass(std::int64_t context_id, std::int64_t send_id,
                         torch::autograd::variable_list grads, bool retain_graph,
                         const Origin& origin) {
    auto ctx = contexts().retrieve(context_id);
    auto send = ctx->send_function(send_id);
    if (!send) {
      throw std::runtime_error("no send function " + std::to_string(send_id) +
                               " in autograd context " + std::to_string(context_id));
    }
    if (grads.size() != send->num_inputs()) {
      throw std::runtime_error("gradients for send function " + std::to_string(send_id) +
                               " carry " + std::to_string(grads.size()) + " tensors, " +
                               std::to_string(send->num_inputs()) + " expected");
    }
    PassCount count(*this);
    torch::autograd::edge_list roots;
    for (std::uint32_t i = 0; i < send->num_inputs(); ++i) roots.emplace_back(send, i);
    dist_autograd::detail::CurrentContextScope current(context_id);
    return run_pass(ctx, roots, grads, retain_graph, origin);
  }

  // Releases go out in batches, one message per worker every kCleanupBatchDelay at most: a
  // training loop releases a context per step, and one message per context and worker would cost
  // each step a send and a reply on both sides. A batch waiting to go out counts as one protocol
  // step of the agent, so a graceful shutdown's join (or a leaver's wait) does not end while a
  // release, this worker's own or one it forwards for another, has not left.
  void send_cleanup(std::int64_t id, const std::set<int>& workers, int except) {
    auto pass = gate_->enter();
    if (!pass) return;  // the agent is gone: so is every context it could release
    bool schedule = false;
    {
      std::lock_guard<std::mutex> lk(cleanup_mu_);
      for (int w : workers) {
        if (w != except) pending_cleanup_[w].push_back(id);
      }
      if (!pending_cleanup_.empty() && !flush_scheduled_) {
        flush_scheduled_ = true;
        schedule = true;
        pass->host_protocol_begin(1);
      }
    }
    if (!schedule) return;
    std::weak_ptr<AutogradLayer> weak = weak_from_this();
    if (!pass->host_after(kCleanupBatchDelay, [weak] {
          if (auto s = weak.lock()) s->flush_cleanup();
        })) {
      // Stopping: nothing is sent any more (unless a flush already took this batch).
      if (take_cleanup_batch().second) pass->host_protocol_end(1);
    }
  }

  void flush_cleanup() {
    auto [batch, scheduled] = take_cleanup_batch();
    for (auto& [worker, ids] : batch) send_cleanup_to(worker, std::move(ids));
    // Ended once the batch's calls are counted themselves (or failed to start).
    if (scheduled) {
      if (auto pass = gate_->enter()) pass->host_protocol_end(1);
    }
  }

  // The releases waiting, and whether a protocol step was begun for them (the taker ends it).
  std::pair<std::map<int, std::vector<std::int64_t>>, bool> take_cleanup_batch() {
    std::lock_guard<std::mutex> lk(cleanup_mu_);
    return {std::exchange(pending_cleanup_, {}), std::exchange(flush_scheduled_, false)};
  }

  // A batch of releases to `worker`, resent on a send failure (kCleanupAttempts in all,
  // backing off from kCleanupBackoff): a release that never arrives would leak the context there.
  void send_cleanup_to(int worker, std::vector<std::int64_t> ids) {
    if (stopping_.load()) return;
    wire::Message m;
    wire::encode(m, ids);
    const std::string what = "release of " + std::to_string(ids.size()) + " autograd context(s)";
    Future<wire::Message> reply;
    try {
      auto pass = gate_->enter();
      if (!pass) return;  // the agent is gone: so is every context it could release
      reply = pass->host_control_call_retrying(worker, control_type(kCleanup), std::move(m),
                                               pass->host_timeout(kUnsetRpcTimeout), what,
                                               kCleanupAttempts, kCleanupBackoff);
    } catch (...) {
      reply = make_exceptional_future<wire::Message>(std::current_exception());
    }
    std::weak_ptr<AutogradLayer> weak = weak_from_this();
    reply.add_done_callback([weak](const Future<wire::Message>& r) {
      if (!r.has_error()) return;
      auto self = weak.lock();
      if (!self || self->stopping_.load()) return;
      distrpc::detail::log_warning(self->gate_->self().name,
                                   dist_autograd::detail::message_of(r.exception_ptr()));
    });
  }

  // The agent, reached only through passes (see the constructor).
  const std::shared_ptr<distrpc::detail::HostGate> gate_;
  std::once_flag container_once_;
  std::unique_ptr<ContextContainer> container_;
  std::atomic<const ContextContainer*> made_{nullptr};  // container_, once made (debug info)
  std::atomic<std::int64_t> next_message_{0};
  std::atomic<int> passes_{0};
  std::atomic<bool> stopping_{false};
  std::mutex trackers_mu_;
  std::unordered_map<std::int64_t, std::shared_ptr<detail::BackwardTracker>> trackers_;
  std::mutex cleanup_mu_;
  std::map<int, std::vector<std::int64_t>> pending_cleanup_;
  bool flush_scheduled_ = false;
};

// Distributed autograd plugs into every agent made after this header is included.
inline const bool autograd_layer_registered = register_agent_extension(
    AutogradLayer::kExtensionId, [](AgentServices& host) -> std::shared_ptr<AgentExtension> {
      return std::make_shared<AutogradLayer>(host);
    });

}  // namespace distrpc::dist_autograd
