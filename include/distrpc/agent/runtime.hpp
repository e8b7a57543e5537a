// The agents a process knows: the one init_rpc() starts (the free functions' default) and the
// calling thread's current one (detail::tls_current_agent, agent.hpp); and how an agent is
// started (options checked, rendezvous, the worker table).
#pragma once

#include <chrono>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "distrpc/agent.hpp"
#include "distrpc/log.hpp"
#include "distrpc/net/interfaces.hpp"
#include "distrpc/options.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/store/rendezvous.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc::detail {

struct Runtime {
  std::mutex mu;
  std::shared_ptr<RpcAgent> agent;
  bool was_shut_down = false;
  // At exit without shutdown(): stop while the agent is still owned here, so a stop that
  // abandons a blocked handler can keep the agent alive for it (RpcAgent::stop()).
  ~Runtime() {
    if (!agent) return;
    try {
      agent->stop(/*sync_exit=*/false, kNoRpcTimeout);
    } catch (...) {
      // stop(false) does no store work; nothing to report at exit.
    }
  }
};

inline Runtime& runtime() {
  static Runtime r;
  return r;
}

// The process's agent (init_rpc); throws when there is none.
inline std::shared_ptr<RpcAgent> runtime_agent() {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lk(rt.mu);
  if (rt.agent) return rt.agent;
  if (rt.was_shut_down) {
    throw RpcError(
        "RPC has not been initialized: the agent was shut down (call distrpc::init_rpc again to "
        "start a new one)");
  }
  throw RpcError(
      "Current RPC agent is not set! Did you initialize the RPC framework (e.g. by calling "
      "`distrpc::init_rpc`)?");
}

// The agent the free functions use: the one this thread works for (a handler or callback runs
// for the agent that runs it; RpcGroup::use()), else the process's.
inline std::shared_ptr<RpcAgent> current_agent() {
  if (RpcAgent* a = tls_current_agent) {
    if (auto agent = a->weak_from_this().lock()) return agent;
  }
  return runtime_agent();
}

// A setting left empty in the options is read from the environment (the first variable set).
inline std::string option_or_env(const std::string& option,
                                 std::initializer_list<const char*> vars) {
  if (!option.empty()) return option;
  for (const char* v : vars) {
    if (const char* value = std::getenv(v); value != nullptr && *value != '\0') return value;
  }
  return {};
}

// Where worker `name` listens and what it publishes (RpcBackendOptions::interface, listen_host,
// advertise_host; net::choose_endpoint has the rule), given where its group met.
inline net::Endpoint choose_worker_endpoint(const std::string& name,
                                            const RpcBackendOptions& options,
                                            const store::RendezvousResult& rdzv) {
  net::EndpointRequest r;
  r.interface = option_or_env(options.interface, {"DISTRPC_SOCKET_IFNAME", "TP_SOCKET_IFNAME"});
  r.listen_host = option_or_env(options.listen_host, {"DISTRPC_LISTEN_ADDR"});
  r.advertise_host = option_or_env(options.advertise_host, {"DISTRPC_ADVERTISE_ADDR"});
  r.store_host = rdzv.store_host;
  r.store_port = rdzv.store_port;
  try {
    return net::choose_endpoint(r);
  } catch (const net::AddressError& e) {
    throw RpcError("init_rpc: worker '" + name + "': " + e.what());
  }
}

// The checks every agent's options pass before it starts (init_rpc, RpcGroup::join).
inline void check_agent_options(const std::string& name, const RpcBackendOptions& options,
                                const std::shared_ptr<const Registry>& registry) {
  validate_worker_name(name);
  // Two implementations registered under one name while the program started (DISTRPC_EXPOSE,
  // DISTRPC_REGISTER, call sites): refused here, as it could not be at start-up. The process's
  // registry always counts (its library functions are served by every agent).
  Registry::instance().check_conflicts();
  if (registry) registry->check_conflicts();
  if (options.num_worker_threads < 1) {
    throw std::invalid_argument("num_worker_threads must be >= 1, got " +
                                std::to_string(options.num_worker_threads));
  }
  if (options.rpc_timeout.count() < 0) {
    throw std::invalid_argument("rpc_timeout must be >= 0 ms (0 means no limit), got " +
                                std::to_string(options.rpc_timeout.count()) + " ms");
  }
  if (options.sync_wait_spin.count() < 0) {
    throw std::invalid_argument("sync_wait_spin must be >= 0 us (0: never poll), got " +
                                std::to_string(options.sync_wait_spin.count()) + " us");
  }
  if (options.shutdown_grace.count() < 0) {
    throw std::invalid_argument("shutdown_grace must be >= 0 ms (0: abandon at once), got " +
                                std::to_string(options.shutdown_grace.count()) + " ms");
  }
}

// An agent on transport policy T for the group met in `rdzv` (its world size -1: a dynamic
// group), listening where the options and the rendezvous say; its worker table is still empty.
template <class T>
std::shared_ptr<RpcAgent> make_agent(const std::string& name, const store::RendezvousResult& rdzv,
                                     const RpcBackendOptions& options,
                                     std::shared_ptr<const Registry> registry) {
  const net::Endpoint endpoint = choose_worker_endpoint(name, options, rdzv);
  RpcBackendOptions effective = options;
  effective.listen_host = endpoint.listen_host;
  effective.advertise_host = endpoint.advertise_host;
  ::distrpc::detail::log(LogLevel::info, name,
                         "listening on " + endpoint.listen_host + ", publishing " +
                             endpoint.advertise_host + " (" + endpoint.why + ")");
  auto agent = std::make_shared<Agent<T>>(WorkerInfo{rdzv.rank, name}, rdzv.world_size,
                                          std::move(effective), std::move(registry));
  agent->set_store(rdzv.store);
  return agent;
}

// Checks the options, meets the group through options.init_method and starts an agent on
// transport policy T that runs what `registry` holds (null: the process's registry).
template <class T>
std::shared_ptr<RpcAgent> start_agent(const std::string& name, int rank, int world_size,
                                      const RpcBackendOptions& options,
                                      std::shared_ptr<const Registry> registry) {
  check_agent_options(name, options, registry);
  // The rendezvous store guards the workers' addresses: it takes the transports' secret and TLS.
  auto rdzv = store::rendezvous(options.init_method, rank, world_size, options.init_timeout,
                                options.auth_token, options.tls);
  auto agent = make_agent<T>(name, rdzv, options, std::move(registry));
  try {
    agent->join_group();
  } catch (...) {
    agent->stop(/*sync_exit=*/false, std::chrono::milliseconds(0));
    throw;
  }
  return agent;
}

}  // namespace distrpc::detail
