// The store the process's RPC agent met through, for a program that also starts process groups
// and wants them to meet through the same store (one rendezvous port instead of two):
//
//   distrpc::init_rpc<Tcp>("trainer" + std::to_string(rank), rank, world, opts);
//   distrpc::dist::init_process_group("distrpc", distrpc::rpc_store(), rank, world);
//
// Process groups keep their keys under a prefix of their own, so they never meet the agent's.
// The store lives as long as someone holds it: destroy the process groups before
// distrpc::shutdown() (the rank that hosts a TCPStore server leaves last either way).
#pragma once

#include <memory>

#include "distrpc/agent/runtime.hpp"
#include "distrpc/store/store.hpp"

namespace distrpc {

// The running agent's store; throws RpcError (init_rpc's texts) when RPC is not running or
// has stopped.
inline std::shared_ptr<store::Store> rpc_store() {
  auto agent = detail::runtime_agent();
  std::shared_ptr<store::Store> s = agent->store();
  if (!s) throw RpcError("rpc_store: the RPC agent has stopped; it holds no store");
  return s;
}

}  // namespace distrpc
