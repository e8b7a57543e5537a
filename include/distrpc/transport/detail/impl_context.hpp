// The public Context of a policy whose work is done by an implementation object shared with its
// own threads (Tcp, Shm): it makes the implementation, starts it, and forwards the concept's calls
// (transport.hpp) to it. Shared, because the threads hold it too; destroying the Context stops
// them first.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport::detail {

template <class Impl>
class ImplContext {
 public:
  // Starts listening and the policy's threads. Throws DistNetworkError when it cannot listen.
  ImplContext(const TransportOptions& options, TransportCallbacks callbacks)
      : impl_(std::make_shared<Impl>(options, std::move(callbacks))) {
    impl_->start();
  }
  ~ImplContext() { shutdown(); }
  ImplContext(const ImplContext&) = delete;
  ImplContext& operator=(const ImplContext&) = delete;

  // Where this process listens, to publish for peers.
  std::string address() const { return impl_->address(); }

  // Records where worker `id` listens. Calling it again (a restarted peer) also clears a lost
  // state, so the next send connects afresh.
  void add_peer(int id, const std::string& name, const std::string& address) {
    impl_->add_peer(id, name, address);
  }

  // Writes `message` to worker `peer` from the calling thread, connecting first if needed.
  // Thread-safe; messages to one peer keep the order of the calls. Throws wire::EncodeError
  // (over the limits, nothing written) or DistNetworkError (cannot connect, connection lost).
  void send(int peer, wire::Message&& message) { impl_->send(peer, std::move(message)); }

  // Idempotent: stops accepting, closes every connection, joins the threads; no callback runs
  // after it returns (except the one it is called from, if any). A thread still running a
  // handed-back task at `deadline` is abandoned instead (detached; it runs no callback afterwards
  // and exits when the task returns); returns how many were. Without a deadline:
  // kDefaultShutdownGrace from now.
  std::size_t shutdown(std::chrono::steady_clock::time_point deadline) {
    return impl_->shutdown(deadline);
  }
  void shutdown() { shutdown(std::chrono::steady_clock::now() + kDefaultShutdownGrace); }

  // Reads on the calling thread, never sleeping, until done() or `until` (transport.hpp).
  // The implementation is held for the call: a caller still inside when shutdown() stopped
  // waiting for it (a long library task) must not find it freed with the Context.
  void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point until) {
    const std::shared_ptr<Impl> impl = impl_;
    impl->drive(done, until);
  }

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace distrpc::transport::detail
