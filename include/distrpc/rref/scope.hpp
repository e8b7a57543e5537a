// Where an RRef is being serialized: RRefs travel only inside RPC messages, and only the agent
// knows which worker a message goes to (or came from). The agent installs these thread-local
// scopes around the encoding and decoding of call arguments and results; RRef<T>'s save/load find
// them here. Outside any scope an RRef refuses to serialize, with a message saying why.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "distrpc/future.hpp"
#include "distrpc/rpc_error.hpp"

namespace distrpc {
class RRefContext;
}

namespace distrpc::detail {

// Encoding a message for worker `dst`. Forks made while encoding are undone if the message is
// never sent (encoding failed further on, or the transport refused it).
struct RRefEncodeScope {
  std::shared_ptr<RRefContext> ctx;
  int dst = -1;
  std::vector<std::function<void()>> undo;

  void rollback() {
    auto u = std::move(undo);
    undo.clear();
    for (auto& f : u) f();
  }
};

// Decoding a message that worker `parent` sent. User RRefs forked from a non-owner are not yet
// confirmed: their confirmations are collected so the callee can wait for them before it runs
// the function.
struct RRefDecodeScope {
  std::shared_ptr<RRefContext> ctx;
  int parent = -1;
  std::vector<std::pair<std::string, Future<void>>> confirmations;
};

inline thread_local RRefEncodeScope* tls_rref_encode = nullptr;
inline thread_local RRefDecodeScope* tls_rref_decode = nullptr;

template <class S>
class TlsScope {
 public:
  TlsScope(S*& slot, S* value) : slot_(slot), saved_(slot) { slot_ = value; }
  ~TlsScope() { slot_ = saved_; }
  TlsScope(const TlsScope&) = delete;
  TlsScope& operator=(const TlsScope&) = delete;

 private:
  S*& slot_;
  S* saved_;
};

using EncodeScopeGuard = TlsScope<RRefEncodeScope>;
using DecodeScopeGuard = TlsScope<RRefDecodeScope>;

// Called by a handler after it decoded its arguments and before it runs the function: blocks
// until the owner of every RRef argument confirmed the fork (each wait is bounded by the fork
// request's own timeout, or ends at once when the owner is lost).
inline void await_rref_confirmations() {
  RRefDecodeScope* s = tls_rref_decode;
  if (s == nullptr) return;
  auto pending = std::move(s->confirmations);
  s->confirmations.clear();
  for (auto& [what, fut] : pending) {
    fut.wait_for(std::chrono::hours::max());
    if (fut.has_error()) {
      std::string why;
      try {
        std::rethrow_exception(fut.exception_ptr());
      } catch (const std::exception& e) {
        why = e.what();
      } catch (...) {
        why = "unknown error";
      }
      throw RpcError("the owner did not confirm the RRef argument " + what +
                     ", so the function was not run: " + why);
    }
  }
}

}  // namespace distrpc::detail
