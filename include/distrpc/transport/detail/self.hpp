// How a transport presents this worker: in error texts, in its diagnostics, and in the hello it
// opens each connection with. Tcp and Shm present it alike.
#pragma once

#include <optional>
#include <string>

#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/handshake.hpp"

namespace distrpc::transport::detail {

// This worker in error texts: "worker 3 ('trainer3')".
inline std::string worker_text(const TransportOptions& o) {
  return "worker " + std::to_string(o.self_id) + " ('" + o.self_name + "')";
}

// Who a transport's diagnostics name (distrpc/log.hpp): the worker, by name when it has one.
inline std::string log_who(const TransportOptions& o) {
  return o.self_name.empty() ? "worker " + std::to_string(o.self_id) : o.self_name;
}

// The hello this worker opens a connection with (`token`: the group's auth token, if any).
inline wire::Hello make_hello(const TransportOptions& o, const std::optional<std::string>& token) {
  wire::Hello h;
  h.protocol_version = wire::kProtocolVersion;
  h.worker_name = o.self_name;
  h.worker_id = o.self_id;
  h.auth_token = token;
  return h;
}

}  // namespace distrpc::transport::detail
