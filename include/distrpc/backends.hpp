// Backends by name: a run-time registry of transport policies, for programs that pick their
// transport from configuration (PyTorch's `backend=` argument and `register_backend`).
//
// Transports stay compile-time policies: registering one instantiates Agent<T> in the program
// that registers it, and the registry only maps a name to that instantiation. Nothing is
// registered implicitly, so a binary carries only the transports it names:
//
//   distrpc::register_rpc_backend<distrpc::transport::Tcp>();          // as "tcp"
//   distrpc::init_rpc("worker0", config.backend, rank, world, opts);   // "tcp" → Agent<Tcp>
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "distrpc/rpc.hpp"

namespace distrpc {

// Starts RPC with one transport: what init_rpc<T> does for its T.
using BackendInit = std::function<void(const std::string& name, int rank, int world_size,
                                       const RpcBackendOptions& options)>;

class BackendRegistry {
 public:
  static BackendRegistry& instance() {
    static BackendRegistry registry;
    return registry;
  }

  // Adds `backend`; a name is registered once ("RPC backend <name>: already registered").
  void add(const std::string& backend, BackendInit init) {
    if (backend.empty()) throw std::invalid_argument("RPC backend name must be non-empty");
    if (!init) {
      throw std::invalid_argument("RPC backend " + backend + ": the init function is empty");
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (!inits_.emplace(backend, std::move(init)).second) {
      throw RpcError("RPC backend " + backend + ": already registered");
    }
  }

  bool contains(const std::string& backend) const {
    std::lock_guard<std::mutex> lk(mu_);
    return inits_.count(backend) > 0;
  }

  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::string> out;
    for (const auto& [n, f] : inits_) out.push_back(n);
    return out;
  }

  // The init function of `backend`, copied out so no lock is held while RPC starts.
  BackendInit find(const std::string& backend) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = inits_.find(backend);
    if (it != inits_.end()) return it->second;
    std::string known;
    for (const auto& [n, f] : inits_) known += (known.empty() ? "" : ", ") + n;
    throw RpcError("RPC backend '" + backend + "' is not registered (registered: " +
                   (known.empty() ? std::string("none") : known) +
                   "); register it with distrpc::register_rpc_backend<Transport>()");
  }

 private:
  BackendRegistry() = default;
  mutable std::mutex mu_;
  std::map<std::string, BackendInit> inits_;
};

// Registers transport policy T under `backend` (its own name by default).
template <class T>
void register_rpc_backend(const std::string& backend = std::string(T::name)) {
  static_assert(transport::check_transport<T>(), "see the messages above");
  BackendRegistry::instance().add(
      backend, [](const std::string& name, int rank, int world_size, const RpcBackendOptions& o) {
        init_rpc<T>(name, rank, world_size, o);
      });
}

// init_rpc with the transport chosen by name at run time.
inline void init_rpc(const std::string& name, const std::string& backend, int rank, int world_size,
                     const RpcBackendOptions& options = {}) {
  BackendRegistry::instance().find(backend)(name, rank, world_size, options);
}

}  // namespace distrpc
