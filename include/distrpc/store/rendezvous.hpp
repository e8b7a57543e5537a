// rendezvous(url): turns an init method into a Store shared by the ranks of a group, as
// torch.distributed does.
//
//   tcp://host:port[?rank=R&world_size=N]   rank 0 hosts a TCPStore server on host:port (port 0:
//                                           rank 0 picks a free one; read it from the TCPStore)
//   file:///absolute/path[?rank=R&world_size=N]   a FileStore, removed by the last of N ranks
//   env://                                  MASTER_ADDR and MASTER_PORT name the TCP server;
//                                           RANK and WORLD_SIZE are read when the arguments are -1
//                                           (else what SLURM's srun or Open MPI's mpirun set), and
//                                           LOCAL_RANK / LOCAL_WORLD_SIZE likewise when present;
//                                           under torchrun's agent store
//                                           (TORCHELASTIC_USE_AGENT_STORE=True) every rank is a
//                                           client of the agent's server
//
// Where rank 0's server listens: a loopback host ("localhost", 127.0.0.1, a name resolving to
// loopback only) keeps it on loopback, a single-host group; any other host means other hosts
// will dial it, under whatever address their resolver gives for the name (Debian resolves its
// own host name to 127.0.1.1 locally but to the real address elsewhere), so it listens on every
// interface, as c10d's TCPStore does.
//
// The server-lifetime rule: the process hosting the TCP server (rank 0) must outlive every client,
// or a client still talking to it fails with "connection ... lost". finalize_rendezvous() enforces
// it: every rank calls it when done with the store; rank 0 returns only once all have.
#pragma once

#include <charconv>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "distrpc/net/interfaces.hpp"
#include "distrpc/store/detail/common.hpp"
#include "distrpc/store/file_store.hpp"
#include "distrpc/store/prefix_store.hpp"
#include "distrpc/store/store.hpp"
#include "distrpc/store/tcp_store.hpp"
#include "distrpc/tls_options.hpp"

namespace distrpc::store {

struct RendezvousResult {
  std::shared_ptr<Store> store;
  int rank = -1;
  int world_size = -1;
  // env:// only, from the launcher's variables (LOCAL_RANK, SLURM_LOCALID, ...); -1 when unknown.
  // The rank and count of this process among those of its host (e.g. which GPU to use).
  int local_rank = -1;
  int local_world_size = -1;
  // Where the store's TCP server is (tcp:// and env://): its host as given and its port; empty
  // for file://. A worker reads it to choose the address its peers on other hosts can dial.
  std::string store_host;
  int store_port = 0;
};

namespace detail {

inline constexpr const char* kUrlForms =
    "tcp://host:port[?rank=R&world_size=N], file:///absolute/path[?rank=R&world_size=N] or env://";

[[noreturn]] inline void bad_url(const std::string& url, const std::string& why) {
  throw DistError("rendezvous: malformed URL '" + url + "': " + why + " (expected " + kUrlForms +
                  ")");
}

inline bool parse_int(std::string_view s, long long lo, long long hi, int& out) {
  long long v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < lo || v > hi)
    return false;
  out = static_cast<int>(v);
  return true;
}

// Reads ?rank=&world_size= into the given slots (-1 when absent); any other parameter is refused so
// a typo does not pass silently.
inline void parse_query(const std::string& url, std::string_view query, int& rank, int& world) {
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (item.empty()) continue;
    const auto eq = item.find('=');
    const std::string_view name = item.substr(0, eq);
    const std::string_view value =
        eq == std::string_view::npos ? std::string_view() : item.substr(eq + 1);
    int* slot = name == "rank" ? &rank : name == "world_size" ? &world : nullptr;
    if (!slot) {
      bad_url(url,
              "unknown query parameter '" + std::string(name) + "' (accepted: rank, world_size)");
    }
    if (!parse_int(value, 0, 1 << 30, *slot)) {
      bad_url(url, "query parameter " + std::string(name) + "='" + std::string(value) +
                       "' is not a non-negative integer");
    }
  }
}

// An argument and a URL parameter may both give the rank (or world size) only if they agree.
inline int merge(const std::string& url, const char* what, int arg, int from_url) {
  if (arg >= 0 && from_url >= 0 && arg != from_url) {
    throw DistError("rendezvous '" + url + "': " + what + " " + std::to_string(arg) +
                    " given as an argument but " + std::to_string(from_url) + " in the URL");
  }
  return arg >= 0 ? arg : from_url;
}

inline void check_rank(const std::string& url, int rank, int world) {
  if (rank < 0) {
    throw DistError("rendezvous '" + url +
                    "': rank parameter missing: pass rank >= 0 or add ?rank=R to the URL");
  }
  if (world < 1) {
    throw DistError("rendezvous '" + url +
                    "': world_size missing: pass world_size >= 1 or add ?world_size=N to the URL");
  }
  if (rank >= world) {
    throw DistError("rendezvous '" + url + "': rank " + std::to_string(rank) +
                    " is not below world_size " + std::to_string(world));
  }
}

inline std::string env_or_throw(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) {
    throw DistError(std::string("Error initializing distrpc using env:// rendezvous: environment "
                                "variable ") +
                    name + " expected, but not set");
  }
  return v;
}

// The variables that carry one value under each launcher, first the torchrun / PyTorch name. A
// value is taken from the first one set. Open MPI's come before SLURM's: mpirun run inside a
// SLURM allocation sets its own per process, while the SLURM ones its processes see are the
// batch step's, inherited (the same SLURM_PROCID, and SLURM_NTASKS of the allocation, in every
// process); srun sets no OMPI_COMM_WORLD_* variable.
struct EnvNames {
  const char* torch;
  const char* open_mpi;
  const char* slurm;
};
inline constexpr EnvNames kRankVars{"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"};
inline constexpr EnvNames kWorldVars{"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"};
inline constexpr EnvNames kLocalRankVars{"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                         "SLURM_LOCALID"};
inline constexpr EnvNames kLocalWorldVars{"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                          "SLURM_NTASKS_PER_NODE"};

// The first of `names` that is set, or null.
inline const char* first_set(const EnvNames& names) {
  for (const char* n : {names.torch, names.open_mpi, names.slurm}) {
    if (const char* v = std::getenv(n); v != nullptr && *v != '\0') return n;
  }
  return nullptr;
}

inline int env_int(const char* name, long long lo, long long hi);

// The value of the first of `names` that is set; none set: an error naming them all (required),
// or -1.
inline int env_launcher_int(const EnvNames& names, long long lo, long long hi, bool required) {
  if (const char* n = first_set(names)) return env_int(n, lo, hi);
  if (!required) return -1;
  throw DistError(std::string("Error initializing distrpc using env:// rendezvous: environment "
                              "variable ") +
                  names.torch + " expected, but not set (nor " + names.open_mpi + " or " +
                  names.slurm + ", as mpirun and srun set)");
}

inline int env_int(const char* name, long long lo, long long hi) {
  const std::string v = env_or_throw(name);
  int out = 0;
  if (!parse_int(v, lo, hi, out)) {
    throw DistError(std::string("Error initializing distrpc using env:// rendezvous: environment "
                                "variable ") +
                    name + "='" + v + "' is not an integer in " + std::to_string(lo) + ".." +
                    std::to_string(hi));
  }
  return out;
}

// A tcp:// URL's host and port (the part before any '?').
inline std::pair<std::string, int> parse_tcp_authority(const std::string& url,
                                                       const std::string& authority) {
  std::string host, port_text;
  if (!authority.empty() && authority[0] == '[') {
    const auto close = authority.find(']');
    if (close == std::string::npos || close + 1 >= authority.size() ||
        authority[close + 1] != ':') {
      bad_url(url, "an IPv6 host is written [addr]:port");
    }
    host = authority.substr(1, close - 1);
    port_text = authority.substr(close + 2);
  } else {
    const auto colon = authority.rfind(':');
    if (colon == std::string::npos) bad_url(url, "no port after the host");
    host = authority.substr(0, colon);
    port_text = authority.substr(colon + 1);
  }
  if (host.empty()) bad_url(url, "empty host");
  if (port_text.find('/') != std::string::npos) bad_url(url, "a tcp:// URL has no path");
  int port = 0;
  if (!parse_int(port_text, 0, 65535, port)) {
    throw DistError("rendezvous '" + url + "': port '" + port_text +
                    "' is not a number in 0..65535");
  }
  return {host, port};
}

// See "Where rank 0's server listens" above: "" (what `host` resolves to) or a wildcard.
inline std::string store_listen_address(const std::string& host) {
  if (net::is_loopback_host(host)) return "";
  return host.find(':') != std::string::npos ? "::" : "0.0.0.0";
}

inline std::shared_ptr<Store> tcp_store(const std::string& url, const std::string& host, int port,
                                        int rank, int world, std::chrono::milliseconds timeout,
                                        const std::string& auth_secret, const TlsOptions& tls) {
  if (port == 0 && rank != 0) {
    throw DistError("rendezvous '" + url +
                    "': port 0 (\"pick a free port\") only works for rank 0, which hosts the "
                    "server; rank " +
                    std::to_string(rank) + " needs the real port");
  }
  // No waiting for workers here: rank 0 must be able to return (and publish a picked port) before
  // the others connect. A store_based_barrier gives the "everyone is here" point.
  TCPStoreOptions o;
  o.host = host;
  o.port = port;
  o.world_size = world;
  o.is_master = rank == 0;
  o.timeout = timeout;
  o.listen_address = store_listen_address(host);
  o.auth_secret = auth_secret;
  o.tls = tls;
  return std::make_shared<TCPStore>(std::move(o));
}

// Under torchrun with TORCHELASTIC_USE_AGENT_STORE set ("True", as torchrun sets it, or "1"), the
// elastic agent already hosts a TCPStore at MASTER_ADDR:MASTER_PORT: every rank joins it as a
// client, under the prefix PyTorch's env:// rendezvous uses there, so that Python ranks of the same
// job see the same keys. Otherwise rank 0 hosts the server.
inline std::shared_ptr<Store> env_store(const std::string& url, const std::string& host, int port,
                                        int rank, int world, std::chrono::milliseconds timeout,
                                        const std::string& auth_secret, const TlsOptions& tls) {
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const std::string use_agent = agent ? agent : "";
  if (use_agent != "True" && use_agent != "1") {
    return tcp_store(url, host, port, rank, world, timeout, auth_secret, tls);
  }
  const std::string attempt = env_or_throw("TORCHELASTIC_RESTART_COUNT");
  int restarts = 0;
  if (!parse_int(attempt, 0, 1 << 30, restarts)) {
    throw DistError(
        "Error initializing distrpc using env:// rendezvous: environment variable "
        "TORCHELASTIC_RESTART_COUNT='" +
        attempt + "' is not an integer in 0.." + std::to_string(1 << 30));
  }
  // The agent's store is PyTorch's TCPStore, which knows no shared secret: a secret here (given, or
  // from the environment) makes the first request fail naming the server (docs/security.md).
  TCPStoreOptions o;
  o.host = host;
  o.port = port;
  o.world_size = world;
  o.is_master = false;
  o.timeout = timeout;
  o.auth_secret = auth_secret;
  o.tls = tls;
  auto client = std::make_shared<TCPStore>(std::move(o));
  return std::make_shared<PrefixStore>("/worker/attempt_" + std::to_string(restarts),
                                       std::move(client));
}

}  // namespace detail

// Connects this rank to the group's store. rank/world_size of -1 are taken from the URL (or, for
// env://, from RANK/WORLD_SIZE). Errors are DistError texts that quote the URL and say what form
// was expected; connection failures are DistNetworkError naming host:port. `auth_secret` is the
// TCPStore's shared secret (TCPStoreOptions::auth_secret; empty: DISTRPC_AUTH_SECRET_FILE's file,
// else DISTRPC_AUTH_SECRET, else none) and `tls` its TLS files (TCPStoreOptions::tls; empty:
// DISTRPC_TLS_CERT / _KEY / _CA, else plain TCP); file:// stores have neither (the file system
// guards them).
inline RendezvousResult rendezvous(const std::string& url, int rank = -1, int world_size = -1,
                                   std::chrono::milliseconds timeout = Store::kDefaultTimeout,
                                   const std::string& auth_secret = "",
                                   const TlsOptions& tls = {}) {
  const auto sep = url.find("://");
  if (sep == std::string::npos || sep == 0) detail::bad_url(url, "no scheme");
  const std::string scheme = url.substr(0, sep);
  const std::string rest = url.substr(sep + 3);

  if (scheme == "env") {
    int url_rank = -1, url_world = -1;
    const auto q = rest.find('?');
    if (!rest.substr(0, q).empty()) detail::bad_url(url, "env:// takes nothing after the scheme");
    if (q != std::string::npos) detail::parse_query(url, rest.substr(q + 1), url_rank, url_world);
    const std::string host = detail::env_or_throw("MASTER_ADDR");
    const int port = detail::env_int("MASTER_PORT", 0, 65535);
    rank = detail::merge(url, "rank", rank, url_rank);
    world_size = detail::merge(url, "world_size", world_size, url_world);
    if (rank < 0) rank = detail::env_launcher_int(detail::kRankVars, 0, 1 << 30, true);
    if (world_size < 0) {
      world_size = detail::env_launcher_int(detail::kWorldVars, 1, 1 << 30, true);
    }
    detail::check_rank(url, rank, world_size);
    const int local_rank = detail::env_launcher_int(detail::kLocalRankVars, 0, 1 << 30, false);
    const int local_world = detail::env_launcher_int(detail::kLocalWorldVars, 1, 1 << 30, false);
    if (local_rank >= 0 && local_world >= 0 && local_rank >= local_world) {
      throw DistError("rendezvous '" + url + "': local rank " + std::to_string(local_rank) +
                      " is not below the local world size " + std::to_string(local_world));
    }
    auto store = detail::env_store(url, host, port, rank, world_size, timeout, auth_secret, tls);
    const int bound = port != 0 ? port : static_cast<TCPStore&>(*store).port();
    return {std::move(store), rank, world_size, local_rank, local_world, host, bound};
  }

  if (scheme == "tcp") {
    const auto q = rest.find('?');
    const std::string authority = rest.substr(0, q);
    int url_rank = -1, url_world = -1;
    if (q != std::string::npos) detail::parse_query(url, rest.substr(q + 1), url_rank, url_world);
    const auto [host, port] = detail::parse_tcp_authority(url, authority);
    rank = detail::merge(url, "rank", rank, url_rank);
    world_size = detail::merge(url, "world_size", world_size, url_world);
    detail::check_rank(url, rank, world_size);
    auto store = detail::tcp_store(url, host, port, rank, world_size, timeout, auth_secret, tls);
    const int bound = port != 0 ? port : static_cast<TCPStore&>(*store).port();
    return {std::move(store), rank, world_size, -1, -1, host, bound};
  }

  if (scheme == "file") {
    const auto q = rest.find('?');
    const std::string path = rest.substr(0, q);
    int url_rank = -1, url_world = -1;
    if (q != std::string::npos) detail::parse_query(url, rest.substr(q + 1), url_rank, url_world);
    if (path.empty() || path[0] != '/') {
      detail::bad_url(url, "a file:// URL needs an absolute path, as in file:///tmp/store");
    }
    rank = detail::merge(url, "rank", rank, url_rank);
    world_size = detail::merge(url, "world_size", world_size, url_world);
    detail::check_rank(url, rank, world_size);
    return {
        std::make_shared<FileStore>(path, world_size, timeout), rank, world_size, -1, -1, "", 0};
  }

  throw DistError("rendezvous: unknown scheme '" + scheme + "' in '" + url + "' (expected " +
                  detail::kUrlForms + ")");
}

// rendezvous() for a dynamic group (no world size: members join and leave over time, e.g. the
// elastic RPC groups of init_rpc without a world size). Only the rank is needed: from `rank`, else
// the URL's ?rank=, else (env://) RANK; missing: "rank parameter missing" (env://: "environment
// variable RANK expected"). Rank 0 hosts the TCP server (tcp://, env://), as in a static group, so
// it must be the first to start and the last to leave; a FileStore is never removed by the members
// (nobody knows which is last). world_size in the result is -1. `auth_secret` and `tls` as for
// rendezvous().
inline RendezvousResult rendezvous_dynamic(
    const std::string& url, int rank = -1,
    std::chrono::milliseconds timeout = Store::kDefaultTimeout, const std::string& auth_secret = "",
    const TlsOptions& tls = {}) {
  const auto sep = url.find("://");
  if (sep == std::string::npos || sep == 0) detail::bad_url(url, "no scheme");
  const std::string scheme = url.substr(0, sep);
  const std::string rest = url.substr(sep + 3);
  const auto q = rest.find('?');
  int url_rank = -1, url_world = -1;
  if (q != std::string::npos) detail::parse_query(url, rest.substr(q + 1), url_rank, url_world);
  if (url_world >= 0) {
    throw DistError("rendezvous '" + url +
                    "': a dynamic group has no world size: remove ?world_size= from the URL");
  }
  rank = detail::merge(url, "rank", rank, url_rank);
  const auto need_rank = [&] {
    if (rank < 0) {
      throw DistError("rendezvous '" + url +
                      "': rank parameter missing: a dynamic group needs each member's rank "
                      "(pass rank >= 0 or add ?rank=R to the URL)");
    }
  };
  if (scheme == "env") {
    if (!rest.substr(0, q).empty()) detail::bad_url(url, "env:// takes nothing after the scheme");
    if (rank < 0) rank = detail::env_launcher_int(detail::kRankVars, 0, 1 << 30, true);
    const std::string host = detail::env_or_throw("MASTER_ADDR");
    const int port = detail::env_int("MASTER_PORT", 0, 65535);
    auto store = detail::tcp_store(url, host, port, rank, -1, timeout, auth_secret, tls);
    const int bound = port != 0 ? port : static_cast<TCPStore&>(*store).port();
    return {std::move(store), rank, -1, -1, -1, host, bound};
  }
  if (scheme == "tcp" || scheme == "file") {
    need_rank();
    // The store gets no world size: no waiting for workers, no file cleanup.
    if (scheme == "file") {
      const std::string path = rest.substr(0, q);
      if (path.empty() || path[0] != '/') {
        detail::bad_url(url, "a file:// URL needs an absolute path, as in file:///tmp/store");
      }
      return {std::make_shared<FileStore>(path, -1, timeout), rank, -1, -1, -1, "", 0};
    }
    const auto [host, port] = detail::parse_tcp_authority(url, rest.substr(0, q));
    auto store = detail::tcp_store(url, host, port, rank, -1, timeout, auth_secret, tls);
    const int bound = port != 0 ? port : static_cast<TCPStore&>(*store).port();
    return {std::move(store), rank, -1, -1, -1, host, bound};
  }
  throw DistError("rendezvous: unknown scheme '" + scheme + "' in '" + url + "' (expected " +
                  detail::kUrlForms + ")");
}

// Checks this rank out of the group's store; rank 0 (the TCP server's host) returns only once all
// world_size ranks have checked out, so destroying its store cannot cut off a client still using
// it. Call it on every rank as the last store operation; each `name` is single-use.
inline void finalize_rendezvous(Store& store, int rank, int world_size,
                                std::chrono::milliseconds timeout = Store::kDefaultTimeout,
                                const std::string& name = "default") {
  const std::string key = "distrpc_finalize:" + name;
  const std::string all_done = key + ":all";
  if (store.add(key, 1) >= world_size) store.set(all_done, "1");
  if (rank != 0) return;
  try {
    store.wait({all_done}, timeout);
  } catch (const StoreTimeoutError&) {
    throw StoreTimeoutError("finalize_rendezvous: Timeout after " +
                            std::to_string(timeout.count()) + " ms on rank 0 waiting for " +
                            std::to_string(world_size) + " ranks to finish (" +
                            std::to_string(store.add(key, 0)) + " done, key '" + key + "')");
  }
}

}  // namespace distrpc::store
