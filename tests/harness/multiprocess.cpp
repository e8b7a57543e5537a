// Multi-process harness: see multiprocess.hpp for the contract.
#include "multiprocess.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace distrpc::testing {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kEnvCase = "DISTRPC_MP_CASE";
constexpr const char* kEnvRank = "DISTRPC_MP_RANK";
constexpr const char* kEnvWorld = "DISTRPC_MP_WORLD";
constexpr const char* kEnvDir = "DISTRPC_MP_DIR";

// Parsed once: the environment of a rank process does not change its identity later.
std::optional<RankContext>& child_context() {
  static std::optional<RankContext> ctx = []() -> std::optional<RankContext> {
    const char* rank = std::getenv(kEnvRank);
    const char* world = std::getenv(kEnvWorld);
    const char* dir = std::getenv(kEnvDir);
    if (!rank || !world || !dir || !std::getenv(kEnvCase)) return std::nullopt;
    RankContext c;
    c.rank = std::atoi(rank);
    c.world = std::atoi(world);
    c.dir = dir;
    return c;
  }();
  return ctx;
}

// doctest filters treat ',' as a separator and '*', '?' as wildcards; '?' matches any one
// character, so it stands in for the characters that cannot be written literally.
std::string doctest_filter_for(const std::string& name) {
  std::string out = name;
  for (char& ch : out) {
    if (ch == ',' || ch == '\\' || ch == '*') ch = '?';
  }
  return out;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string make_run_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/distrpc-mp-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) {
    throw std::runtime_error("multiprocess harness: mkdtemp(" + tmpl +
                             ") failed: " + std::strerror(errno));
  }
  return std::string(buf.data());
}

struct Child {
  pid_t pid = -1;
  bool finished = false;
  RankOutcome outcome;
  fs::path log;
};

// "NAME=value". Built with append: GCC 12 reports a false -Warray-bounds on
// std::string(const char*) + "=" at -O2 (GCC bug 105651).
std::string env_entry(const char* name, const std::string& value) {
  std::string out;
  out.reserve(std::strlen(name) + 1 + value.size());
  out.append(name);
  out.push_back('=');
  out.append(value);
  return out;
}

pid_t spawn_rank(const std::string& case_name, bool is_target, int rank, const RunOptions& opts,
                 const std::string& dir, const fs::path& log) {
  std::string self = fs::read_symlink("/proc/self/exe").string();
  std::vector<std::string> args = {self, "--test-case=" + doctest_filter_for(case_name),
                                   "--no-intro=true", "--no-version=true"};
  if (is_target) args.push_back("--no-skip=true");

  // The case's own variables (RunOptions::env, then this rank's RunOptions::rank_env) replace
  // the inherited ones and each other by name: getenv() returns the first entry, so a duplicate
  // would be ignored.
  std::vector<std::string> own = opts.env;
  if (const auto it = opts.rank_env.find(rank); it != opts.rank_env.end()) {
    own.insert(own.end(), it->second.begin(), it->second.end());
  }
  const auto name_of = [](std::string_view kv) { return kv.substr(0, kv.find('=')); };
  auto overridden = [&](std::string_view kv, std::size_t from) {
    for (std::size_t i = from; i < own.size(); ++i) {
      if (name_of(own[i]) == name_of(kv)) return true;
    }
    return false;
  };
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string_view kv(*e);
    if (kv.starts_with("DISTRPC_MP_") || overridden(kv, 0)) continue;
    env.emplace_back(kv);
  }
  env.push_back(env_entry(kEnvCase, case_name));
  env.push_back(env_entry(kEnvRank, std::to_string(rank)));
  env.push_back(env_entry(kEnvWorld, std::to_string(opts.world)));
  env.push_back(env_entry(kEnvDir, dir));
  for (std::size_t i = 0; i < own.size(); ++i) {
    if (!overridden(own[i], i + 1)) env.push_back(own[i]);
  }

  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);

  // Each rank leads its own process group so a hung rank and anything it started die together.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);

  pid_t pid = -1;
  int rc = posix_spawn(&pid, self.c_str(), &fa, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    throw std::runtime_error("multiprocess harness: posix_spawn of rank " + std::to_string(rank) +
                             " failed: " + std::strerror(rc));
  }
  return pid;
}

bool outcome_ok(const RankOutcome& o, const RunOptions& opts) {
  if (o.killed_by_harness) return false;
  if (o.signal != 0) return opts.may_die.count(o.rank) > 0;
  return o.exit_code == 0;
}

RunResult run_impl(const std::string& case_name, const RunOptions& opts, bool is_target) {
  if (opts.world < 1) throw std::invalid_argument("multiprocess harness: world must be >= 1");
  // A rank outside the world in rank_env or may_die is a mistake in the test: silently ignored,
  // the test would check less than it says.
  const auto check_rank = [&](int r, const char* field) {
    if (r < 0 || r >= opts.world) {
      throw std::invalid_argument("multiprocess harness: RunOptions::" + std::string(field) +
                                  " names rank " + std::to_string(r) + ", outside a world of " +
                                  std::to_string(opts.world));
    }
  };
  for (const auto& [r, vars] : opts.rank_env) check_rank(r, "rank_env");
  for (int r : opts.may_die) check_rank(r, "may_die");
  RunResult result;
  const std::string dir = make_run_dir();
  const auto start = Clock::now();
  const auto deadline = start + opts.limit;

  std::vector<Child> children(static_cast<std::size_t>(opts.world));
  for (int r = 0; r < opts.world; ++r) {
    auto& c = children[static_cast<std::size_t>(r)];
    c.outcome.rank = r;
    c.log = fs::path(dir) / ("rank" + std::to_string(r) + ".log");
    c.pid = spawn_rank(case_name, is_target, r, opts, dir, c.log);
  }

  std::optional<Clock::time_point> failure_deadline;
  std::size_t remaining = children.size();
  auto kill_all = [&] {
    for (auto& c : children) {
      if (c.finished) continue;
      ::kill(-c.pid, SIGKILL);
      ::kill(c.pid, SIGKILL);
      c.outcome.killed_by_harness = true;
    }
  };

  while (remaining > 0) {
    bool progressed = false;
    for (auto& c : children) {
      if (c.finished) continue;
      int status = 0;
      pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r == c.pid) {
        c.finished = true;
        --remaining;
        progressed = true;
        if (WIFEXITED(status)) c.outcome.exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) c.outcome.signal = WTERMSIG(status);
        // Anything the rank left running in its group goes with it.
        ::kill(-c.pid, SIGKILL);
        if (!c.outcome.killed_by_harness && !outcome_ok(c.outcome, opts) && !failure_deadline) {
          failure_deadline = Clock::now() + opts.grace_after_failure;
        }
      }
    }
    if (remaining == 0) break;
    const auto now = Clock::now();
    if (now >= deadline) {
      result.timed_out = true;
      kill_all();
    } else if (failure_deadline && now >= *failure_deadline) {
      kill_all();
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  result.ok = !result.timed_out;
  for (auto& c : children) {
    c.outcome.output = read_file(c.log);
    if (!outcome_ok(c.outcome, opts)) result.ok = false;
    result.ranks.push_back(std::move(c.outcome));
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return result;
}

}  // namespace

int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    throw std::runtime_error(std::string("free_loopback_port: socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  if (!ok) throw std::runtime_error("free_loopback_port: could not bind a loopback port");
  return ntohs(a.sin_port);
}

std::string RankContext::file_url() const {
  return "file://" + dir + "/rendezvous";
}

void RankContext::publish(const std::string& key, const std::string& value) const {
  const fs::path final_path = fs::path(dir) / ("kv." + key);
  const fs::path tmp = fs::path(dir) / ("kv." + key + ".tmp." + std::to_string(::getpid()));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << value;
    if (!out) throw std::runtime_error("publish(" + key + "): cannot write " + tmp.string());
  }
  // rename() is atomic: a reader sees the whole value or nothing.
  fs::rename(tmp, final_path);
}

std::string RankContext::lookup(const std::string& key, std::chrono::milliseconds timeout) const {
  const fs::path p = fs::path(dir) / ("kv." + key);
  const auto deadline = Clock::now() + timeout;
  while (true) {
    std::error_code ec;
    if (fs::exists(p, ec)) return read_file(p);
    if (Clock::now() >= deadline) {
      throw std::runtime_error("lookup(" + key + "): not published within " +
                               std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

std::string RunResult::report() const {
  std::ostringstream out;
  out << "multi-process run " << (ok ? "passed" : "FAILED") << " after " << elapsed.count() << " ms"
      << (timed_out ? " (wall-clock limit reached: hung ranks killed)" : "") << "\n";
  for (const auto& r : ranks) {
    out << "---- rank " << r.rank << ": ";
    if (r.killed_by_harness) {
      out << "killed by the harness";
    } else if (r.signal != 0) {
      out << "died of signal " << r.signal << " (" << strsignal(r.signal) << ")";
    } else {
      out << "exit code " << r.exit_code;
    }
    out << " ----\n" << r.output;
    if (!r.output.empty() && r.output.back() != '\n') out << "\n";
  }
  return out.str();
}

RunResult run_ranks(const std::string& case_name, const RunOptions& opts) {
  return run_impl(case_name, opts, /*is_target=*/true);
}

const RankContext* current_rank() {
  auto& ctx = child_context();
  return ctx ? &*ctx : nullptr;
}

namespace detail {

bool is_rank_of(const char* name) {
  const char* c = std::getenv(kEnvCase);
  return c && child_context() && std::string_view(c) == name;
}

void run_multiprocess_case(const char* name, int world, int limit_seconds) {
  // A rank process of another case that happens to match this filter must not spawn ranks itself.
  if (child_context()) return;
  RunOptions opts;
  opts.world = world;
  opts.limit = std::chrono::seconds(limit_seconds);
  RunResult r = run_impl(name, opts, /*is_target=*/false);
  if (!r.ok) FAIL(r.report());
  // A rank in which no test case matched would "pass" vacuously: doctest reports how many ran.
  for (const auto& rank : r.ranks) {
    if (rank.output.find("test cases: 0 ") != std::string::npos ||
        rank.output.find("test cases:      0") != std::string::npos) {
      FAIL("rank " << rank.rank << " ran no test case (filter did not match):\n" << r.report());
    }
  }
}

}  // namespace detail
}  // namespace distrpc::testing
