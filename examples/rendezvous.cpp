// Flagship store example: N local processes find each other through a store.
//
//   rendezvous [--world N] [--init tcp|file]
//
// Run without a rank it is the launcher: it starts rank 0 (re-executing this binary with
// posix_spawn, never fork), which hosts the TCP server on a port it picks and reports it on a pipe;
// then it starts ranks 1..N-1 on tcp://127.0.0.1:<port> (or all N on a file:// store). Each rank
// publishes its name and pid, reads every other rank's, passes a store barrier, prints what it saw,
// and checks out with finalize_rendezvous(), so rank 0, whose process serves the store, is the last
// to stop using it.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "distrpc/store.hpp"

extern char** environ;

namespace {

namespace ds = distrpc::store;
using namespace std::chrono_literals;

constexpr const char* kEnvRank = "DISTRPC_EXAMPLE_RANK";
constexpr const char* kEnvWorld = "DISTRPC_EXAMPLE_WORLD";
constexpr const char* kEnvUrl = "DISTRPC_EXAMPLE_URL";
constexpr const char* kEnvPortFd = "DISTRPC_EXAMPLE_PORT_FD";
constexpr int kPortFd = 3;  // where rank 0 finds the pipe to the launcher

// One write per message, so the ranks' lines do not interleave mid-line.
void say(const std::string& text) {
  const std::string line = text + "\n";
  [[maybe_unused]] auto n = ::write(STDOUT_FILENO, line.data(), line.size());
}

int run_rank(int rank, int world, const std::string& url) {
  auto r = ds::rendezvous(url, rank, world, 30s);
  if (rank == 0) {
    if (auto tcp = std::dynamic_pointer_cast<ds::TCPStore>(r.store)) {
      // Tell the launcher which port the server got; the others cannot start without it.
      if (const char* fd = std::getenv(kEnvPortFd)) {
        const std::string port = std::to_string(tcp->port()) + "\n";
        [[maybe_unused]] auto n = ::write(std::atoi(fd), port.data(), port.size());
        ::close(std::atoi(fd));
      }
    }
  }
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const std::string me =
      "worker" + std::to_string(rank) + " (pid " + std::to_string(::getpid()) + " on " + host + ")";
  r.store->set("worker/" + std::to_string(rank), me);

  std::ostringstream seen;
  seen << "rank " << rank << " is " << me << "; it saw:";
  for (int other = 0; other < world; ++other) {
    if (other == rank) continue;
    // get() waits until that rank has published.
    seen << "\n    rank " << other << ": "
         << r.store->get_string("worker/" + std::to_string(other));
  }
  ds::store_based_barrier(*r.store, rank, world, "example", 30s);
  const auto arrived = r.store->add("store_based_barrier_key:example", 0);
  seen << "\n    barrier passed with " << arrived << "/" << world << " ranks";
  say(seen.str());

  ds::finalize_rendezvous(*r.store, rank, world, 30s);
  if (rank == 0) {
    say("rank 0: all " + std::to_string(world) +
        " ranks have checked out of the store; shutting it down last");
  }
  return 0;
}

pid_t spawn_rank(int rank, int world, const std::string& url, int port_pipe) {
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, "DISTRPC_EXAMPLE_", 16) != 0) env.emplace_back(*e);
  }
  env.push_back(std::string(kEnvRank) + "=" + std::to_string(rank));
  env.push_back(std::string(kEnvWorld) + "=" + std::to_string(world));
  env.push_back(std::string(kEnvUrl) + "=" + url);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (port_pipe >= 0) {
    posix_spawn_file_actions_adddup2(&fa, port_pipe, kPortFd);
    env.push_back(std::string(kEnvPortFd) + "=" + std::to_string(kPortFd));
  }
  std::vector<char*> argv = {self.data(), nullptr};
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, self.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw std::runtime_error("posix_spawn failed: " + std::string(std::strerror(rc)));
  return pid;
}

// Reads rank 0's port from the pipe, giving up after `limit`.
int read_port(int fd, std::chrono::milliseconds limit) {
  std::string line;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (line.find('\n') == std::string::npos) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
      throw std::runtime_error("rank 0 did not report its port within " +
                               std::to_string(limit.count()) + " ms");
    }
    char buf[32];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) throw std::runtime_error("rank 0 exited before reporting its port");
    line.append(buf, static_cast<std::size_t>(n));
  }
  return std::stoi(line);
}

int launch(int world, const std::string& init) {
  std::map<pid_t, int> ranks;
  std::string url;
  std::string dir;
  if (init == "file") {
    std::string tmpl = (std::filesystem::temp_directory_path() / "distrpc-rdv-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    dir = tmpl;
    url = "file://" + dir + "/store";
    for (int r = 0; r < world; ++r) ranks[spawn_rank(r, world, url, -1)] = r;
  } else {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    ranks[spawn_rank(0, world, "tcp://127.0.0.1:0", fds[1])] = 0;
    ::close(fds[1]);
    int port = 0;
    try {
      port = read_port(fds[0], 30s);
    } catch (...) {
      for (auto& [pid, r] : ranks) ::kill(pid, SIGKILL);
      ::waitpid(-1, nullptr, 0);
      throw;
    }
    ::close(fds[0]);
    url = "tcp://127.0.0.1:" + std::to_string(port);
    say("launcher: rank 0 hosts the store at " + url);
    for (int r = 1; r < world; ++r) ranks[spawn_rank(r, world, url, -1)] = r;
  }

  // Wait for all; a hung group is killed after 60 s.
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  std::size_t finished = 0;
  bool ok = true;
  while (finished < ranks.size()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        say("launcher: ranks still running after 60 s; killing them");
        for (auto& [p, r] : ranks) ::kill(p, SIGKILL);
        ok = false;
        while (::waitpid(-1, nullptr, 0) > 0) {
        }
        break;
      }
      ::usleep(2000);
      continue;
    }
    if (pid < 0) break;
    const int rank = ranks[pid];
    ++finished;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ok = false;
      say("launcher: rank " + std::to_string(rank) + " failed (status " + std::to_string(status) +
          ")");
    }
  }
  if (!dir.empty()) std::filesystem::remove_all(dir);
  say(ok ? "launcher: all " + std::to_string(world) + " ranks finished cleanly"
         : "launcher: FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (const char* rank = std::getenv(kEnvRank)) {
      return run_rank(std::atoi(rank), std::atoi(std::getenv(kEnvWorld)), std::getenv(kEnvUrl));
    }
    int world = 4;
    std::string init = "tcp";
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--world" && i + 1 < argc) {
        world = std::atoi(argv[++i]);
      } else if (a == "--init" && i + 1 < argc) {
        init = argv[++i];
      } else {
        std::cerr << "usage: " << argv[0] << " [--world N] [--init tcp|file]\n";
        return 2;
      }
    }
    if (world < 1 || world > 256 || (init != "tcp" && init != "file")) {
      std::cerr << "rendezvous: --world must be 1..256 and --init tcp or file\n";
      return 2;
    }
    return launch(world, init);
  } catch (const std::exception& e) {
    std::cerr << "rendezvous: " << e.what() << "\n";
    return 1;
  }
}
