// RpcBackendOptions: plain options with defaults (PyTorch's names where they exist).
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/device_map.hpp"
#include "distrpc/tls_options.hpp"

namespace distrpc {

// Passing this as a per-call timeout means "use the agent's default, read when the call is made".
inline constexpr std::chrono::milliseconds kUnsetRpcTimeout{-1};
// A timeout of zero means "no limit", per call and as the default.
inline constexpr std::chrono::milliseconds kNoRpcTimeout{0};
inline constexpr std::chrono::milliseconds kDefaultRpcTimeout{60'000};

struct RpcBackendOptions {
  // Where the group rendezvous: "env://" (MASTER_ADDR, MASTER_PORT), "tcp://host:port",
  // "file:///abs/path".
  std::string init_method = "env://";
  // Default timeout of every call (0 = none). Changeable later with set_rpc_timeout().
  std::chrono::milliseconds rpc_timeout = kDefaultRpcTimeout;
  // Threads running incoming requests. Handlers may block; responses and callbacks are processed
  // elsewhere, so blocked handlers never starve them (docs/threading.md).
  int num_worker_threads = 16;
  // Timeout of the rendezvous (store operations during init).
  std::chrono::milliseconds init_timeout{std::chrono::seconds(120)};
  // Where this worker listens and what address it publishes to its peers (docs/rpc.md, "Many
  // hosts"). All empty (the default) chooses by where the group meets: a rendezvous host on
  // loopback (or a file:// store) keeps the worker on loopback; any other rendezvous host means
  // many hosts, and the worker listens on, and publishes, its address on the route to that host.
  // Each is also read from the environment when left empty here.
  //  - interface (DISTRPC_SOCKET_IFNAME, or PyTorch's TP_SOCKET_IFNAME): listen on the address of
  //    this network interface ("eth0", "ib0") and publish it;
  //  - listen_host (DISTRPC_LISTEN_ADDR): listen on this address; "0.0.0.0" or "::" means every
  //    interface, publishing the address on the route to the rendezvous host;
  //  - advertise_host (DISTRPC_ADVERTISE_ADDR): publish this address instead (NAT, containers).
  // A worker that would publish a loopback address to a group whose rendezvous host is another
  // machine fails at init_rpc, saying what to set.
  std::string interface;
  std::string listen_host;
  std::string advertise_host;
  // Optional shared secret: a connection whose peer cannot prove it knows the same secret
  // (challenge-response; the secret is never sent) is dropped at the handshake. Empty:
  // DISTRPC_AUTH_SECRET_FILE's file, else DISTRPC_AUTH_SECRET, else none (docs/security.md).
  std::string auth_token;
  // Mutual TLS for the TCP transport (docs/security.md, "TLS"): certificate, private key and the
  // CA both ends check each other against. Empty: DISTRPC_TLS_CERT / _KEY / _CA, else plain TCP.
  // The rendezvous store takes the same variables (TCPStoreOptions::tls).
  TlsOptions tls;
  // Largest message (payload plus tensors) sent or accepted, in bytes.
  std::uint64_t max_message_bytes = 16ull << 30;
  // How long a blocking call (rpc_sync, to_here) polls for its reply, yielding the CPU, before it
  // sleeps. A small call's reply comes back within microseconds, and a sleeping thread's wake-up is
  // then the largest single cost; 0 always sleeps at once (docs/threading.md).
  std::chrono::microseconds sync_wait_spin{50};
  // How long a local stop (shutdown, also after a graceful join) waits for handlers and callbacks
  // still running when shutdown() was given no timeout (a positive timeout replaces it). Threads
  // still inside user code after that are abandoned (detached), so shutdown never hangs on a
  // handler that never returns; 0 abandons them at once (docs/threading.md, "Bounded shutdown").
  std::chrono::milliseconds shutdown_grace = kDefaultShutdownGrace;
  // device_maps[worker][src] = dst: a tensor on local device src sent to `worker` arrives on its
  // device dst, and its responses' tensors come back through the inverse map. Without an entry
  // only CPU tensors may be sent. Checked across the whole group when it meets (docs/cuda.md).
  std::map<std::string, DeviceMap> device_maps;
  // The CUDA devices this worker uses; empty: those its maps and its peers' maps name.
  std::vector<DeviceName> devices;

  // Merges `map` into device_maps[worker]: set_device_map("worker1", {{0, 1}}) sends cuda:0's
  // tensors to worker1's cuda:1. A source already mapped to another target is refused ("only
  // supports 1-to-1 mapping"), as is a negative index.
  void set_device_map(const std::string& worker,
                      std::initializer_list<std::pair<DeviceSpec, DeviceSpec>> map) {
    merge_device_map(device_maps[worker], make_device_map(map, "`set_device_map`"));
  }
  // Replaces `devices`; CUDA devices only, as in PyTorch.
  void set_devices(std::initializer_list<DeviceSpec> list) {
    std::vector<DeviceName> out;
    for (const auto& d : list) {
      if (d.device.is_cpu()) {
        throw std::invalid_argument(
            "`set_devices` expect a list of CUDA devices, but got device type cpu.");
      }
      out.push_back(d.device);
    }
    devices = std::move(out);
  }
  // What peers may run here (docs/rpc.md, "Who can call what"). false (SPMD programs): every
  // registered function, also those registered because this binary calls them. true: only the
  // functions exposed explicitly (DISTRPC_REGISTER, Registry::add) and the library's own.
  bool serve_exposed_only = false;
  // The builtin ATen operators peers may run here by schema name: "aten::add.Tensor" (one
  // overload), "aten::add" (all of its overloads), "*" (any operator). Empty (the default): none.
  std::vector<std::string> builtin_operators;
};

}  // namespace distrpc
