// One worker of the "two hosts" check (tests/hosts/check.sh): joins a group through env://
// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) with default options unless the environment sets
// DISTRPC_SOCKET_IFNAME / DISTRPC_LISTEN_ADDR / DISTRPC_ADVERTISE_ADDR, prints how it chose its
// address, calls every other worker (a typed call with tensors and one returning the callee's
// view of the caller), and shuts down.
//
// Output, one line each (the check greps them):
//   endpoint <rank>: listening on A, publishing B (why)
//   call <rank> -> <peer>: ok <text>
//   done <rank>
//   error <rank>: <what init_rpc or a call threw>     (exit status 1)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <torch/torch.h>

#include "distrpc/distrpc.hpp"
#include "distrpc/transport/tcp.hpp"

namespace hosts_check {

at::Tensor scaled_sum(at::Tensor a, at::Tensor b, double k) {
  return (a + b) * k;
}

std::string greet(std::string from) {
  return distrpc::get_worker_info().name + " greets " + from;
}

}  // namespace hosts_check

int main() {
  const char* rank_text = std::getenv("RANK");
  const int rank = rank_text ? std::atoi(rank_text) : -1;
  // The endpoint choice is logged at info level: take it from the log and print it.
  distrpc::set_log_sink(
      [rank](distrpc::LogLevel level, std::string_view who, std::string_view text) {
        if (level == distrpc::LogLevel::info && text.rfind("listening on ", 0) == 0) {
          std::printf("endpoint %d: %.*s\n", rank, static_cast<int>(text.size()), text.data());
        } else {
          std::fprintf(stderr, "[distrpc] %.*s: %.*s\n", static_cast<int>(who.size()), who.data(),
                       static_cast<int>(text.size()), text.data());
        }
        std::fflush(stdout);
      });
  try {
    distrpc::RpcBackendOptions opts;
    opts.init_method = "env://";
    if (const char* t = std::getenv("HOSTS_INIT_TIMEOUT_MS")) {
      opts.init_timeout = std::chrono::milliseconds(std::atoi(t));
    }
    distrpc::init_rpc<distrpc::transport::Tcp>("worker" + std::to_string(rank), -1, -1, opts);
    const int world = static_cast<int>(distrpc::get_worker_infos().size());
    for (int peer = 0; peer < world; ++peer) {
      if (peer == rank) continue;
      const at::Tensor r = distrpc::rpc_sync<&hosts_check::scaled_sum>(
          peer, torch::full({3}, rank + 1.0), torch::ones({3}), 2.0);
      const std::string g =
          distrpc::rpc_sync<&hosts_check::greet>(peer, "worker" + std::to_string(rank));
      const bool ok = r.equal(torch::full({3}, 2.0 * (rank + 2.0)));
      std::printf("call %d -> %d: %s %s\n", rank, peer, ok ? "ok" : "WRONG", g.c_str());
      std::fflush(stdout);
      if (!ok) return 1;
    }
    distrpc::shutdown();
    std::printf("done %d\n", rank);
    return 0;
  } catch (const std::exception& e) {
    std::printf("error %d: %s\n", rank, e.what());
    return 1;
  }
}
