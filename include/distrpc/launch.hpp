// Runs a program as n local processes of one group, the way torchrun's standalone mode does: each
// process finds its rank and the group's meeting point in its environment (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: what `env://` rendezvous reads), its
// output comes back line by line behind a "[rank] " prefix, and one failing process stops the
// others. `distrpc-run` is this function behind a command line. No libtorch: it belongs to the
// net layer (operating-system helpers) and is safe to call from a program that already started
// threads (it spawns with posix_spawn, never fork()).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "distrpc/error.hpp"
#include "distrpc/net/errno_text.hpp"
#include "distrpc/net/fd.hpp"

extern char** environ;

namespace distrpc {

// Bad launch options, a program that cannot be found, or a process that could not be started.
// A rank that fails is not an exception: it is reported in the LaunchResult.
class LaunchError : public DistError {
 public:
  using DistError::DistError;
};

// Which of a rank's streams a line came from.
enum class OutputStream { out, err };

struct LaunchOptions {
  int nprocs = 1;                         // processes to start, ranks 0..nprocs-1
  std::string master_addr = "127.0.0.1";  // MASTER_ADDR given to every rank
  int master_port = 0;                    // MASTER_PORT; 0: a port that is free now, picked here
  std::chrono::milliseconds timeout{0};   // the whole run; 0: no limit
  // After a failure, the timeout or a stop request, the other ranks get SIGTERM, and SIGKILL when
  // they are still running this long afterwards.
  std::chrono::milliseconds grace{std::chrono::seconds(5)};
  std::vector<std::string> env;  // extra "NAME=value" for every rank (replacing inherited ones)
  // Receives each complete line of each rank (without its '\n'; a last line without one is
  // delivered when the stream ends). Runs on the launching thread. Empty: "[rank] line\n" goes to
  // this process's stdout or stderr in one write, so lines of different ranks never mix.
  std::function<void(int rank, OutputStream stream, std::string_view line)> on_line;
  // When this descriptor becomes readable (e.g. a pipe written by a SIGINT handler), the ranks
  // are stopped as after a failure and the result says `interrupted`. -1: none.
  int stop_fd = -1;
};

struct RankExit {
  int rank = 0;
  int exit_code = -1;  // when signal == 0
  int signal = 0;      // the signal that ended it, 0 when it exited
  // It was still running when the launcher began stopping the group (another rank failed, the
  // timeout passed or a stop was requested), so its end is the launcher's doing.
  bool stopped_by_launcher = false;

  bool ok() const { return signal == 0 && exit_code == 0; }
  // A shell's view of the end: the exit code, or 128 + the signal.
  int shell_code() const { return signal != 0 ? 128 + signal : exit_code; }
  // "exited with code 3", "killed by signal SIGSEGV".
  std::string describe() const;
};

struct LaunchResult {
  std::vector<RankExit> ranks;  // indexed by rank
  int master_port = 0;          // the MASTER_PORT the ranks were given
  int failed_rank = -1;         // the first rank that failed on its own; -1: none did
  bool timed_out = false;
  std::chrono::milliseconds timeout{0};  // the limit that passed, when timed_out
  bool interrupted = false;              // stop_fd became readable
  std::chrono::milliseconds elapsed{0};

  // Every rank exited with code 0.
  bool ok() const;
  // One line: "all 2 ranks exited with code 0", "rank 1 exited with code 3; stopped: rank 0
  // (killed by signal SIGTERM)", "timed out after 2000 ms; stopped: rank 0 (...), rank 1 (...)".
  std::string describe() const;
  // Throws LaunchError("distrpc::launch_local: " + describe()) unless ok().
  void throw_if_failed() const;
};

// Starts `program` (a path, or a name looked up in PATH) with `args` as opts.nprocs processes,
// forwards their output, and waits until every one has ended. Throws LaunchError, naming the
// option or the program, for bad input or a process that cannot be started (the ones already
// started are killed first); otherwise returns the outcome of every rank.
LaunchResult launch_local(const std::string& program, const std::vector<std::string>& args,
                          const LaunchOptions& opts = {});

// The file `program` names: itself when it contains a '/', else the first match in PATH. Throws
// LaunchError when it does not exist or is not executable.
std::string find_program(const std::string& program);

// "SIGTERM", "SIGSEGV", ...; "signal N" for one without a name here.
std::string signal_name(int sig);

// ---------------------------------------------------------------------------------------------
// Implementation

inline std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP:
      return "SIGHUP";
    case SIGINT:
      return "SIGINT";
    case SIGQUIT:
      return "SIGQUIT";
    case SIGILL:
      return "SIGILL";
    case SIGTRAP:
      return "SIGTRAP";
    case SIGABRT:
      return "SIGABRT";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGKILL:
      return "SIGKILL";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGSEGV:
      return "SIGSEGV";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGPIPE:
      return "SIGPIPE";
    case SIGALRM:
      return "SIGALRM";
    case SIGTERM:
      return "SIGTERM";
    case SIGXCPU:
      return "SIGXCPU";
    case SIGXFSZ:
      return "SIGXFSZ";
    default:
      return "signal " + std::to_string(sig);
  }
}

inline std::string RankExit::describe() const {
  if (signal != 0) return "killed by signal " + signal_name(signal);
  return "exited with code " + std::to_string(exit_code);
}

inline bool LaunchResult::ok() const {
  if (ranks.empty() || timed_out || interrupted) return false;
  return std::all_of(ranks.begin(), ranks.end(), [](const RankExit& r) { return r.ok(); });
}

inline std::string LaunchResult::describe() const {
  if (ok()) return "all " + std::to_string(ranks.size()) + " ranks exited with code 0";
  std::string out;
  if (failed_rank >= 0) {
    out = "rank " + std::to_string(failed_rank) + " " + ranks[failed_rank].describe();
  } else if (timed_out) {
    out = "timed out after " + std::to_string(timeout.count()) + " ms";
  } else if (interrupted) {
    out = "interrupted";
  }
  std::string stopped;
  for (const RankExit& r : ranks) {
    if (!r.stopped_by_launcher) continue;
    stopped += (stopped.empty() ? "" : ", ") + ("rank " + std::to_string(r.rank)) + " (" +
               r.describe() + ")";
  }
  if (!stopped.empty()) out += "; stopped: " + stopped;
  return out;
}

inline void LaunchResult::throw_if_failed() const {
  if (!ok()) throw LaunchError("distrpc::launch_local: " + describe());
}

inline std::string find_program(const std::string& program) {
  auto runnable = [](const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
           ::access(path.c_str(), X_OK) == 0;
  };
  if (program.empty()) throw LaunchError("distrpc::launch_local: the program name is empty");
  if (program.find('/') != std::string::npos) {
    if (runnable(program)) return program;
    struct stat st {};
    const bool exists = ::stat(program.c_str(), &st) == 0;
    throw LaunchError("distrpc::launch_local: program '" + program + "' " +
                      (exists ? "is not an executable file" : "does not exist"));
  }
  const char* path = std::getenv("PATH");
  std::string_view dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    const auto colon = dirs.find(':');
    std::string dir(dirs.substr(0, colon));
    if (dir.empty()) dir = ".";  // an empty PATH entry means the current directory
    const std::string candidate = dir + "/" + program;
    if (runnable(candidate)) return candidate;
    if (colon == std::string_view::npos) break;
    dirs.remove_prefix(colon + 1);
  }
  throw LaunchError("distrpc::launch_local: program '" + program +
                    "' not found in PATH (give a path to run a file that is not there)");
}

namespace detail::launch {

// Lines of one stream are cut here even without a '\n', so one endless line cannot grow the
// launcher's memory without bound.
inline constexpr std::size_t kMaxLine = 64 * 1024;
// Reads of 64 KiB from one pipe per wake-up of the launcher's loop, and once every rank ended
// (what a pipe can hold: 1 MiB at most, Linux's default pipe-max-size; a process a rank left
// behind that still writes is not waited for).
inline constexpr int kReadsPerWake = 4;
inline constexpr int kReadsAtEnd = 16;

inline void write_all(int fd, const std::string& s) {
  const char* p = s.data();
  std::size_t left = s.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // output closed (EPIPE): the ranks still run to their end
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

// A free TCP port on `addr` (a numeric address; anything else: every address), found by binding
// port 0. Another process may take it before rank 0 binds it: a given master_port avoids that.
inline int pick_free_port(const std::string& addr) {
  sockaddr_in6 a6{};
  sockaddr_in a4{};
  int family = AF_INET;
  a4.sin_family = AF_INET;
  a4.sin_addr.s_addr = htonl(INADDR_ANY);
  if (::inet_pton(AF_INET6, addr.c_str(), &a6.sin6_addr) == 1) {
    family = AF_INET6;
    a6.sin6_family = AF_INET6;
  } else if (::inet_pton(AF_INET, addr.c_str(), &a4.sin_addr) != 1) {
    a4.sin_addr.s_addr = htonl(INADDR_ANY);
  }
  net::Fd s(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s) throw LaunchError("distrpc::launch_local: socket() failed: " + net::errno_text(errno));
  const int rc = family == AF_INET6 ? ::bind(s.get(), reinterpret_cast<sockaddr*>(&a6), sizeof a6)
                                    : ::bind(s.get(), reinterpret_cast<sockaddr*>(&a4), sizeof a4);
  if (rc != 0) {
    throw LaunchError("distrpc::launch_local: cannot pick a free port on master_addr '" + addr +
                      "': " + net::errno_text(errno));
  }
  sockaddr_storage got{};
  socklen_t len = sizeof got;
  ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&got), &len);
  return family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&got)->sin6_port)
                            : ntohs(reinterpret_cast<sockaddr_in*>(&got)->sin_port);
}

inline std::string env_name(const std::string& entry) {
  return entry.substr(0, entry.find('='));
}

// One started rank: its process, its two output pipes and what is left of an unfinished line.
struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  net::Fd out[2];          // stdout, stderr read ends
  std::string partial[2];  // bytes after the last '\n' seen
};

// Owns the started processes: whatever way launch_local leaves (a throwing on_line, a failed
// spawn), none is left running or unreaped.
class Group {
 public:
  std::vector<Child> children;

  ~Group() {
    for (Child& c : children) {
      if (!c.running) continue;
      ::kill(c.pid, SIGKILL);
      int st = 0;
      while (::waitpid(c.pid, &st, 0) < 0 && errno == EINTR) {
      }
    }
  }

  bool any_running() const {
    return std::any_of(children.begin(), children.end(), [](const Child& c) { return c.running; });
  }
  void signal_running(int sig) {
    for (Child& c : children) {
      if (c.running) ::kill(c.pid, sig);
    }
  }
};

}  // namespace detail::launch

inline LaunchResult launch_local(const std::string& program, const std::vector<std::string>& args,
                                 const LaunchOptions& opts) {
  using Clock = std::chrono::steady_clock;
  using namespace detail::launch;
  const std::string where = "distrpc::launch_local: ";
  if (opts.nprocs < 1 || opts.nprocs > 4096) {
    throw LaunchError(where + "nprocs must be within 1..4096, got " + std::to_string(opts.nprocs));
  }
  if (opts.master_addr.empty()) throw LaunchError(where + "master_addr is empty");
  if (opts.master_port < 0 || opts.master_port > 65535) {
    throw LaunchError(where + "master_port must be within 0..65535 (0: pick a free one), got " +
                      std::to_string(opts.master_port));
  }
  if (opts.timeout.count() < 0) {
    throw LaunchError(where + "timeout must be >= 0 ms (0: none), got " +
                      std::to_string(opts.timeout.count()) + " ms");
  }
  if (opts.grace.count() < 0) {
    throw LaunchError(where + "grace must be >= 0 ms, got " + std::to_string(opts.grace.count()) +
                      " ms");
  }
  for (const std::string& e : opts.env) {
    if (e.find('=') == std::string::npos || e.front() == '=') {
      throw LaunchError(where + "env entry '" + e + "' is not of the form NAME=value");
    }
  }
  const std::string path = find_program(program);

  LaunchResult result;
  result.master_port = opts.master_port != 0 ? opts.master_port : pick_free_port(opts.master_addr);

  // The environment every rank shares: ours, minus what the launcher sets, and minus what an
  // outer torchrun set for this process (run inside one, the ranks would otherwise look for its
  // agent's store at the MASTER_PORT picked here, where no agent listens).
  std::vector<std::string> names{"RANK",        "WORLD_SIZE",      "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                 "MASTER_ADDR", "MASTER_PORT",     "GROUP_RANK", "GROUP_WORLD_SIZE",
                                 "ROLE_RANK",   "ROLE_WORLD_SIZE", "ROLE_NAME"};
  for (const std::string& e : opts.env) names.push_back(env_name(e));
  std::vector<std::string> base_env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = env_name(entry);
    if (std::find(names.begin(), names.end(), name) == names.end() &&
        !name.starts_with("TORCHELASTIC_")) {
      base_env.push_back(entry);
    }
  }
  base_env.insert(base_env.end(), opts.env.begin(), opts.env.end());
  const std::string world = std::to_string(opts.nprocs);
  base_env.push_back("WORLD_SIZE=" + world);
  base_env.push_back("LOCAL_WORLD_SIZE=" + world);
  base_env.push_back("MASTER_ADDR=" + opts.master_addr);
  base_env.push_back("MASTER_PORT=" + std::to_string(result.master_port));

  std::vector<std::string> argv_s{path};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);

  // Output this process buffered must come out before the ranks' lines.
  std::fflush(nullptr);

  const auto start = Clock::now();
  Group group;
  group.children.resize(static_cast<std::size_t>(opts.nprocs));
  for (int r = 0; r < opts.nprocs; ++r) {
    Child& c = group.children[static_cast<std::size_t>(r)];
    c.rank = r;
    net::Fd write_ends[2];
    for (int s = 0; s < 2; ++s) {
      // Close-on-exec everywhere: a rank inherits only its own two write ends, as 1 and 2. Each
      // end is owned at once, so a failure of the second pipe closes the first.
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) {
        throw LaunchError(where + "pipe() failed for rank " + std::to_string(r) + ": " +
                          net::errno_text(errno));
      }
      c.out[s] = net::Fd(p[0]);
      write_ends[s] = net::Fd(p[1]);
      ::fcntl(c.out[s].get(), F_SETFL, ::fcntl(c.out[s].get(), F_GETFL) | O_NONBLOCK);
    }
    std::vector<std::string> env_s = base_env;
    env_s.push_back("RANK=" + std::to_string(r));
    env_s.push_back("LOCAL_RANK=" + std::to_string(r));
    std::vector<char*> envp;
    for (std::string& s : env_s) envp.push_back(s.data());
    envp.push_back(nullptr);

    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, write_ends[0].get(), STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&fa, write_ends[1].get(), STDERR_FILENO);
    // A rank starts with default dispositions and no blocked signals, whatever this process set
    // (a launcher ignoring SIGPIPE, a thread blocking SIGTERM), so SIGTERM stops it.
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t defaults, none;
    sigemptyset(&defaults);
    for (int sig : {SIGHUP, SIGINT, SIGQUIT, SIGPIPE, SIGTERM, SIGCHLD, SIGUSR1, SIGUSR2}) {
      sigaddset(&defaults, sig);
    }
    sigemptyset(&none);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
    const int rc = ::posix_spawn(&c.pid, path.c_str(), &fa, &attr, argv.data(), envp.data());
    posix_spawnattr_destroy(&attr);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      throw LaunchError(where + "could not start rank " + std::to_string(r) + " ('" + path +
                        "'): " + net::errno_text(rc));
    }
    c.running = true;
  }
  result.ranks.resize(group.children.size());

  auto emit = [&](Child& c, int s, std::string_view line) {
    const OutputStream stream = s == 0 ? OutputStream::out : OutputStream::err;
    if (opts.on_line) {
      opts.on_line(c.rank, stream, line);
      return;
    }
    std::string text = "[" + std::to_string(c.rank) + "] ";
    text.append(line);
    text += '\n';
    write_all(s == 0 ? STDOUT_FILENO : STDERR_FILENO, text);
  };
  // Reads what the pipe holds now, `reads` reads of 64 KiB at most (a rank writing faster than
  // its lines are handled keeps the pipe full: the loop below must still get to its deadlines,
  // reaping and other ranks); at its end, delivers an unfinished last line and closes it.
  auto drain = [&](Child& c, int s, int reads) {
    char buf[65536];
    for (; c.out[s] && reads > 0; --reads) {
      const ssize_t n = ::read(c.out[s].get(), buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        if (!c.partial[s].empty()) emit(c, s, c.partial[s]);
        c.partial[s].clear();
        c.out[s].reset();
        return;
      }
      std::string& p = c.partial[s];
      p.append(buf, static_cast<std::size_t>(n));
      std::size_t from = 0;
      for (std::size_t nl; (nl = p.find('\n', from)) != std::string::npos; from = nl + 1) {
        emit(c, s, std::string_view(p).substr(from, nl - from));
      }
      p.erase(0, from);
      while (p.size() >= kMaxLine) {
        emit(c, s, std::string_view(p).substr(0, kMaxLine));
        p.erase(0, kMaxLine);
      }
    }
  };

  bool stopping = false;
  Clock::time_point kill_at{};
  bool killed = false;
  auto begin_stop = [&] {
    stopping = true;
    for (Child& c : group.children) {
      if (c.running) result.ranks[static_cast<std::size_t>(c.rank)].stopped_by_launcher = true;
    }
    group.signal_running(SIGTERM);
    kill_at = Clock::now() + opts.grace;
  };

  while (group.any_running()) {
    // Wake for output, a stop request, and every 20 ms to reap ended ranks and check deadlines
    // (no SIGCHLD handler: the launching program's signal handling stays its own).
    std::vector<pollfd> fds;
    std::vector<std::pair<Child*, int>> who;
    for (Child& c : group.children) {
      for (int s = 0; s < 2; ++s) {
        if (c.out[s]) {
          fds.push_back({c.out[s].get(), POLLIN, 0});
          who.emplace_back(&c, s);
        }
      }
    }
    if (opts.stop_fd >= 0 && !stopping) fds.push_back({opts.stop_fd, POLLIN, 0});
    const int n = ::poll(fds.data(), fds.size(), 20);
    if (n < 0 && errno != EINTR) {
      throw LaunchError(where + "poll() failed: " + net::errno_text(errno));
    }
    for (std::size_t i = 0; n > 0 && i < who.size(); ++i) {
      if (fds[i].revents != 0) drain(*who[i].first, who[i].second, kReadsPerWake);
    }
    if (opts.stop_fd >= 0 && !stopping && n > 0 && fds.back().revents != 0) {
      result.interrupted = true;
      begin_stop();
    }
    for (Child& c : group.children) {
      if (!c.running) continue;
      int st = 0;
      const pid_t got = ::waitpid(c.pid, &st, WNOHANG);
      if (got < 0 && errno != EINTR) {
        // ECHILD: this process reaps its children elsewhere (SIGCHLD ignored, or a reaper
        // thread), so how the rank ended cannot be known here.
        const int err = errno;
        c.running = false;
        throw LaunchError(where + "cannot wait for rank " + std::to_string(c.rank) + ": " +
                          net::errno_text(err) +
                          " (is SIGCHLD ignored, or are children reaped elsewhere?)");
      }
      if (got != c.pid) continue;
      c.running = false;
      RankExit& e = result.ranks[static_cast<std::size_t>(c.rank)];
      e.rank = c.rank;
      if (WIFSIGNALED(st)) {
        e.signal = WTERMSIG(st);
      } else {
        e.exit_code = WEXITSTATUS(st);
      }
      if (!e.ok() && !stopping) {
        result.failed_rank = c.rank;
        begin_stop();
      }
    }
    const auto now = Clock::now();
    if (!stopping && opts.timeout.count() > 0 && now - start >= opts.timeout) {
      result.timed_out = true;
      result.timeout = opts.timeout;
      begin_stop();
    }
    if (stopping && !killed && now >= kill_at) {
      killed = true;
      group.signal_running(SIGKILL);
    }
  }
  // Every rank ended: what they wrote is in the pipes. A process they started and left behind may
  // still hold a pipe open; its later output is not waited for.
  for (Child& c : group.children) {
    drain(c, 0, kReadsAtEnd);
    drain(c, 1, kReadsAtEnd);
    for (int s = 0; s < 2; ++s) {
      if (!c.partial[s].empty()) emit(c, s, c.partial[s]);
      c.partial[s].clear();
    }
  }
  for (std::size_t r = 0; r < result.ranks.size(); ++r) result.ranks[r].rank = static_cast<int>(r);
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  return result;
}

}  // namespace distrpc
