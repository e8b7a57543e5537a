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

// The hello this worker opens a connection with (`secret`: the group's shared secret, if any;
// it is never sent, only a fresh challenge nonce is; `address`: where this worker listens). The
// acceptor replies with wire::make_acceptor_hello() built on this.
inline wire::Hello make_hello(const TransportOptions& o, const std::optional<std::string>& secret,
                              const std::string& address) {
  wire::Hello h;
  h.protocol_version = wire::kProtocolVersion;
  h.worker_name = o.self_name;
  h.worker_id = o.self_id;
  h.listen_address = address;
  if (secret) h.nonce = wire::auth::make_nonce();
  return h;
}

// The shared secret a transport authenticates its connections with: TransportOptions::auth_token,
// else DISTRPC_AUTH_SECRET_FILE's file, else DISTRPC_AUTH_SECRET (wire::auth::resolve_secret).
inline std::optional<std::string> transport_secret(const TransportOptions& o) {
  return wire::auth::resolve_secret(o.auth_token);
}

}  // namespace distrpc::transport::detail
