// distrpc::launch_local and distrpc-run, run on tests/launch_probe.cpp (a stand-in user program
// whose modes each do one observable thing). Their paths come from tests/meson.build.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/launch.hpp"
#include "support/scoped_env.hpp"

#ifndef DISTRPC_LAUNCH_PROBE
#error "tests/meson.build defines DISTRPC_LAUNCH_PROBE (the path of launch_probe)"
#endif
#ifndef DISTRPC_RUN_EXE
#error "tests/meson.build defines DISTRPC_RUN_EXE (the path of distrpc-run)"
#endif

using namespace std::chrono_literals;

namespace {

const std::string kProbe = DISTRPC_LAUNCH_PROBE;

struct Captured {
  // lines[rank][stream]
  std::map<int, std::vector<std::string>> out, err;
};

distrpc::LaunchOptions capturing(int n, Captured& c) {
  distrpc::LaunchOptions o;
  o.nprocs = n;
  o.on_line = [&c](int rank, distrpc::OutputStream s, std::string_view line) {
    (s == distrpc::OutputStream::out ? c.out : c.err)[rank].emplace_back(line);
  };
  return o;
}

std::string launch_error(const std::string& program, const distrpc::LaunchOptions& o) {
  try {
    (void)distrpc::launch_local(program, {"sleep", "0"}, o);
  } catch (const distrpc::LaunchError& e) {
    return e.what();
  }
  return "(no error)";
}

struct Ran {
  int status = -1;  // shell view: exit code or 128 + signal
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs distrpc-run with `args`, its stdout and stderr in files (no pipe to fill up and block);
// with `signal` != 0, sends it that signal once its stdout holds `ready_lines` lines (the ranks
// run, so distrpc-run's handlers are in place).
Ran run_tool(const std::vector<std::string>& args, int signal = 0, std::size_t ready_lines = 0) {
  char dir[] = "/tmp/distrpc-launch-test-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string out_path = std::string(dir) + "/out", err_path = std::string(dir) + "/err";
  const int out_fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  const int err_fd = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  REQUIRE(out_fd >= 0);
  REQUIRE(err_fd >= 0);
  std::vector<std::string> argv_s{DISTRPC_RUN_EXE};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_fd, 1);
  posix_spawn_file_actions_adddup2(&fa, err_fd, 2);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, argv_s[0].c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(out_fd);
  ::close(err_fd);
  REQUIRE(rc == 0);
  if (signal != 0) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < until) {
      const std::string so_far = slurp(out_path);
      if (static_cast<std::size_t>(std::count(so_far.begin(), so_far.end(), '\n')) >= ready_lines) {
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    ::kill(pid, signal);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  Ran r;
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  ::unlink(out_path.c_str());
  ::unlink(err_path.c_str());
  ::rmdir(dir);
  return r;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> lines;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

std::string env_line(int rank, int world, const std::string& addr, int port,
                     const std::string& extra) {
  return "RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world) +
         " LOCAL_RANK=" + std::to_string(rank) + " LOCAL_WORLD_SIZE=" + std::to_string(world) +
         " MASTER_ADDR=" + addr + " MASTER_PORT=" + std::to_string(port) + " EXTRA=" + extra;
}

}  // namespace

TEST_SUITE("launch_local") {
  TEST_CASE("every rank sees its rank, the world and a picked free master port") {
    // An inherited RANK must not leak into the ranks: the launcher's values replace it.
    std::optional<distrpc::testing::ScopedEnv> rank_env(std::in_place, "RANK", "77");
    Captured c;
    distrpc::LaunchOptions o = capturing(3, c);
    o.env = {"EXTRA=x=1"};
    const distrpc::LaunchResult r = distrpc::launch_local(kProbe, {"env"}, o);
    rank_env.reset();
    CHECK(r.ok());
    CHECK(r.describe() == "all 3 ranks exited with code 0");
    CHECK(r.failed_rank == -1);
    CHECK(r.master_port > 0);
    CHECK(r.master_port <= 65535);
    REQUIRE(r.ranks.size() == 3);
    for (int rank = 0; rank < 3; ++rank) {
      CHECK(r.ranks[rank].rank == rank);
      CHECK(r.ranks[rank].exit_code == 0);
      CHECK(r.ranks[rank].signal == 0);
      CHECK_FALSE(r.ranks[rank].stopped_by_launcher);
      CHECK(c.out[rank] ==
            std::vector<std::string>{env_line(rank, 3, "127.0.0.1", r.master_port, "x=1")});
      CHECK(c.err[rank].empty());
    }
  }

  TEST_CASE("a given master address and port are passed as they are") {
    Captured c;
    distrpc::LaunchOptions o = capturing(2, c);
    o.master_addr = "10.1.2.3";  // not bound here: a given port is not probed
    o.master_port = 29876;
    const distrpc::LaunchResult r = distrpc::launch_local(kProbe, {"env"}, o);
    CHECK(r.ok());
    CHECK(r.master_port == 29876);
    CHECK(c.out[0] == std::vector<std::string>{env_line(0, 2, "10.1.2.3", 29876, "-")});
    CHECK(c.out[1] == std::vector<std::string>{env_line(1, 2, "10.1.2.3", 29876, "-")});
  }

  TEST_CASE("output comes back whole line by line, in each rank's order, per stream") {
    Captured c;
    const int k = 300;
    const distrpc::LaunchResult r =
        distrpc::launch_local(kProbe, {"lines", std::to_string(k)}, capturing(3, c));
    CHECK(r.ok());
    for (int rank = 0; rank < 3; ++rank) {
      REQUIRE(c.out[rank].size() == static_cast<std::size_t>(k));
      REQUIRE(c.err[rank].size() == static_cast<std::size_t>(k));
      const std::string filler(100, static_cast<char>('a' + rank));
      for (int i = 0; i < k; ++i) {
        CHECK(c.out[rank][i] ==
              "rank " + std::to_string(rank) + " line " + std::to_string(i) + " " + filler);
        CHECK(c.err[rank][i] == "rank " + std::to_string(rank) + " err " + std::to_string(i));
      }
    }
  }

  TEST_CASE("a last line without a newline is delivered when the rank ends") {
    Captured c;
    const distrpc::LaunchResult r = distrpc::launch_local(kProbe, {"tail"}, capturing(2, c));
    CHECK(r.ok());
    CHECK(c.out[0] == std::vector<std::string>{"no newline here"});
    CHECK(c.out[1] == std::vector<std::string>{"no newline here"});
  }

  TEST_CASE("a failing rank stops the others with SIGTERM and is named with its exit code") {
    Captured c;
    const distrpc::LaunchResult r =
        distrpc::launch_local(kProbe, {"fail", "1", "3", "100"}, capturing(3, c));
    CHECK_FALSE(r.ok());
    CHECK(r.failed_rank == 1);
    CHECK_FALSE(r.timed_out);
    CHECK(r.ranks[1].exit_code == 3);
    CHECK_FALSE(r.ranks[1].stopped_by_launcher);
    for (int rank : {0, 2}) {
      CHECK(r.ranks[rank].signal == SIGTERM);
      CHECK(r.ranks[rank].stopped_by_launcher);
      CHECK(r.ranks[rank].shell_code() == 128 + SIGTERM);
    }
    // The others sleep 60 s: they were stopped, not waited for.
    CHECK(r.elapsed < 10s);
    CHECK(c.out[1] == std::vector<std::string>{"rank 1 fails"});
    const std::string text =
        "rank 1 exited with code 3; stopped: rank 0 (killed by signal SIGTERM), rank 2 (killed by "
        "signal SIGTERM)";
    CHECK(r.describe() == text);
    CHECK_THROWS_WITH_AS(r.throw_if_failed(), ("distrpc::launch_local: " + text).c_str(),
                         distrpc::LaunchError);
  }

  TEST_CASE("a rank that ignores SIGTERM is killed with SIGKILL after the grace period") {
    Captured c;
    distrpc::LaunchOptions o = capturing(2, c);
    o.grace = 500ms;
    const distrpc::LaunchResult r = distrpc::launch_local(kProbe, {"stubborn", "1", "5"}, o);
    CHECK(r.failed_rank == 1);
    CHECK(r.ranks[1].exit_code == 5);
    CHECK(r.ranks[0].signal == SIGKILL);
    CHECK(r.ranks[0].stopped_by_launcher);
    CHECK(r.elapsed >= 200ms + 500ms);  // rank 1 fails after 200 ms, then the grace period
    CHECK(r.elapsed < 10s);
    CHECK(r.describe() == "rank 1 exited with code 5; stopped: rank 0 (killed by signal SIGKILL)");
  }

  TEST_CASE("a rank ended by a signal is named with the signal") {
    Captured c;
    const distrpc::LaunchResult r =
        distrpc::launch_local(kProbe, {"kill", "0", "100"}, capturing(2, c));
    CHECK(r.failed_rank == 0);
    CHECK(r.ranks[0].signal == SIGSEGV);
    CHECK(r.ranks[0].shell_code() == 128 + SIGSEGV);
    CHECK(r.describe() ==
          "rank 0 killed by signal SIGSEGV; stopped: rank 1 (killed by signal SIGTERM)");
  }

  TEST_CASE("the timeout stops every rank") {
    Captured c;
    distrpc::LaunchOptions o = capturing(2, c);
    o.timeout = 300ms;
    const distrpc::LaunchResult r = distrpc::launch_local(kProbe, {"sleep", "60000"}, o);
    CHECK(r.timed_out);
    CHECK(r.failed_rank == -1);
    CHECK_FALSE(r.ok());
    CHECK(r.elapsed >= 300ms);
    CHECK(r.elapsed < 10s);
    CHECK(r.describe() ==
          "timed out after 300 ms; stopped: rank 0 (killed by signal SIGTERM), rank 1 (killed by "
          "signal SIGTERM)");
  }

  TEST_CASE("a rank that writes without pause does not keep the timeout from stopping it") {
    // Its lines come faster than they are handled: the pipe never runs dry.
    std::size_t lines = 0;
    distrpc::LaunchOptions o;
    o.nprocs = 1;
    o.timeout = 500ms;
    o.grace = 500ms;
    o.on_line = [&lines](int, distrpc::OutputStream, std::string_view) {
      ++lines;
      // Slower than the rank writes: about 1 us a line against a few ns.
      const auto until = std::chrono::steady_clock::now() + 1us;
      while (std::chrono::steady_clock::now() < until) {
      }
    };
    auto run =
        std::async(std::launch::async, [&] { return distrpc::launch_local(kProbe, {"flood"}, o); });
    if (run.wait_for(30s) != std::future_status::ready) {
      // Stuck for good (the future would wait for it when destroyed): fail the process.
      std::fprintf(stderr, "launch_local did not return within 30 s of a 500 ms timeout\n");
      std::_Exit(3);
    }
    const distrpc::LaunchResult r = run.get();
    CHECK(r.timed_out);
    CHECK(r.elapsed < 10s);
    CHECK(lines > 0);
  }

  TEST_CASE("the ranks do not inherit an outer torchrun's variables") {
    distrpc::testing::ScopedEnv agent("TORCHELASTIC_USE_AGENT_STORE", "True");
    distrpc::testing::ScopedEnv restarts("TORCHELASTIC_RESTART_COUNT", "0");
    distrpc::testing::ScopedEnv group_rank("GROUP_RANK", "3");
    distrpc::testing::ScopedEnv role_rank("ROLE_RANK", "5");
    Captured c;
    distrpc::LaunchOptions o = capturing(2, c);
    o.env = {"ROLE_RANK=given"};  // what the caller gives still goes through
    const distrpc::LaunchResult r = distrpc::launch_local(kProbe, {"torchrun_env"}, o);
    CHECK(r.ok());
    for (int rank = 0; rank < 2; ++rank) {
      CHECK(c.out[rank] == std::vector<std::string>{"TORCHELASTIC_USE_AGENT_STORE=- "
                                                    "TORCHELASTIC_RESTART_COUNT=- GROUP_RANK=- "
                                                    "ROLE_RANK=given"});
    }
  }

  TEST_CASE("a readable stop descriptor stops every rank") {
    int p[2];
    REQUIRE(::pipe(p) == 0);
    REQUIRE(::write(p[1], "x", 1) == 1);
    Captured c;
    distrpc::LaunchOptions o = capturing(2, c);
    o.stop_fd = p[0];
    const distrpc::LaunchResult r = distrpc::launch_local(kProbe, {"sleep", "60000"}, o);
    ::close(p[0]);
    ::close(p[1]);
    CHECK(r.interrupted);
    CHECK(r.elapsed < 10s);
    CHECK(r.describe() ==
          "interrupted; stopped: rank 0 (killed by signal SIGTERM), rank 1 (killed by signal "
          "SIGTERM)");
  }

  TEST_CASE("bad input is refused before anything starts, naming what was wrong") {
    distrpc::LaunchOptions o;
    o.nprocs = 0;
    CHECK(launch_error(kProbe, o) == "distrpc::launch_local: nprocs must be within 1..4096, got 0");
    o = {};
    o.master_port = 70000;
    CHECK(launch_error(kProbe, o) ==
          "distrpc::launch_local: master_port must be within 0..65535 (0: pick a free one), got "
          "70000");
    o = {};
    o.master_addr = "";
    CHECK(launch_error(kProbe, o) == "distrpc::launch_local: master_addr is empty");
    o = {};
    o.timeout = -1ms;
    CHECK(launch_error(kProbe, o) ==
          "distrpc::launch_local: timeout must be >= 0 ms (0: none), got -1 ms");
    o = {};
    o.grace = -5ms;
    CHECK(launch_error(kProbe, o) == "distrpc::launch_local: grace must be >= 0 ms, got -5 ms");
    o = {};
    o.env = {"NOVALUE"};
    CHECK(launch_error(kProbe, o) ==
          "distrpc::launch_local: env entry 'NOVALUE' is not of the form NAME=value");
    o = {};
    CHECK(launch_error("", o) == "distrpc::launch_local: the program name is empty");
    CHECK(launch_error("/no/such/dir/prog", o) ==
          "distrpc::launch_local: program '/no/such/dir/prog' does not exist");
    char plain[] = "/tmp/distrpc-launch-plain-XXXXXX";  // mode 0600: a file, not executable
    const int fd = ::mkstemp(plain);
    REQUIRE(fd >= 0);
    ::close(fd);
    CHECK(launch_error(plain, o) ==
          "distrpc::launch_local: program '" + std::string(plain) + "' is not an executable file");
    ::unlink(plain);
    CHECK(launch_error("distrpc-no-such-program", o) ==
          "distrpc::launch_local: program 'distrpc-no-such-program' not found in PATH (give a "
          "path to run a file that is not there)");
  }

  TEST_CASE("children reaped elsewhere (SIGCHLD ignored) give an error, not a hang") {
    struct sigaction ignore {
    }, old{};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    REQUIRE(::sigaction(SIGCHLD, &ignore, &old) == 0);
    const std::string text = launch_error(kProbe, distrpc::LaunchOptions{});
    ::sigaction(SIGCHLD, &old, nullptr);
    CHECK(text ==
          "distrpc::launch_local: cannot wait for rank 0: No child processes (is SIGCHLD ignored, "
          "or are children reaped elsewhere?)");
  }

  TEST_CASE("a name without a slash is looked up in PATH") {
    CHECK(distrpc::find_program("sh").find("/sh") != std::string::npos);
    CHECK(distrpc::find_program(kProbe) == kProbe);
  }
}

TEST_SUITE("distrpc-run") {
  TEST_CASE("runs N ranks with the env variables and prefixes their lines") {
    const Ran r = run_tool(
        {"-n", "2", "--master-addr", "127.0.0.2", "--master-port", "29555", kProbe, "env"});
    CHECK(r.status == 0);
    std::vector<std::string> lines = split_lines(r.out);
    std::sort(lines.begin(), lines.end());
    CHECK(lines == std::vector<std::string>{"[0] " + env_line(0, 2, "127.0.0.2", 29555, "-"),
                                            "[1] " + env_line(1, 2, "127.0.0.2", 29555, "-")});
    CHECK(r.err == "");
  }

  TEST_CASE("lines of different ranks never mix, on stdout and on stderr") {
    const int k = 400;
    const Ran r = run_tool({"-n", "3", kProbe, "lines", std::to_string(k)});
    CHECK(r.status == 0);
    std::map<int, int> next_out, next_err;
    const std::vector<std::string> out = split_lines(r.out), err = split_lines(r.err);
    CHECK(out.size() == 3u * k);
    CHECK(err.size() == 3u * k);
    int bad = 0;
    for (const std::string& l : out) {
      const int rank = l.size() > 1 ? l[1] - '0' : -1;
      const std::string want = "[" + std::to_string(rank) + "] rank " + std::to_string(rank) +
                               " line " + std::to_string(next_out[rank]++) + " " +
                               std::string(100, static_cast<char>('a' + rank));
      if (l != want) ++bad;
    }
    for (const std::string& l : err) {
      const int rank = l.size() > 1 ? l[1] - '0' : -1;
      if (l != "[" + std::to_string(rank) + "] rank " + std::to_string(rank) + " err " +
                   std::to_string(next_err[rank]++)) {
        ++bad;
      }
    }
    CHECK(bad == 0);
  }

  TEST_CASE("exits with the failing rank's code and says which rank failed") {
    const Ran r = run_tool({"-n", "3", kProbe, "fail", "2", "7", "100"});
    CHECK(r.status == 7);
    CHECK(r.out == "[2] rank 2 fails\n");
    CHECK(r.err ==
          "distrpc-run: rank 2 exited with code 7; stopped: rank 0 (killed by signal SIGTERM), "
          "rank 1 (killed by signal SIGTERM)\n");
  }

  TEST_CASE("a rank ended by a signal gives 128 + the signal") {
    const Ran r = run_tool({"-n", "2", kProbe, "kill", "1", "100"});
    CHECK(r.status == 128 + SIGSEGV);
    CHECK(r.err ==
          "distrpc-run: rank 1 killed by signal SIGSEGV; stopped: rank 0 (killed by signal "
          "SIGTERM)\n");
  }

  TEST_CASE("--timeout stops the ranks and exits with 124") {
    const Ran r = run_tool({"-n", "2", "--timeout", "0.3", "--", kProbe, "sleep", "60000"});
    CHECK(r.status == 124);
    CHECK(r.err ==
          "distrpc-run: timed out after 300 ms; stopped: rank 0 (killed by signal SIGTERM), rank 1 "
          "(killed by signal SIGTERM)\n");
  }

  TEST_CASE("SIGTERM to distrpc-run stops the ranks and exits with 128 + SIGTERM") {
    const auto start = std::chrono::steady_clock::now();
    const Ran r = run_tool({"-n", "2", kProbe, "ready", "60000"}, SIGTERM, 2);
    CHECK(std::chrono::steady_clock::now() - start < 10s);
    CHECK(r.status == 128 + SIGTERM);
    std::vector<std::string> lines = split_lines(r.out);
    std::sort(lines.begin(), lines.end());
    CHECK(lines == std::vector<std::string>{"[0] ready", "[1] ready"});
    CHECK(r.err ==
          "distrpc-run: interrupted; stopped: rank 0 (killed by signal SIGTERM), rank 1 (killed by "
          "signal SIGTERM)\n");
  }

  TEST_CASE("--help, and a bad command line exits with 2 naming the problem") {
    const Ran help = run_tool({"--help"});
    CHECK(help.status == 0);
    CHECK(help.out.rfind("Usage: distrpc-run -n N", 0) == 0);
    const std::string hint = "\nTry 'distrpc-run --help'.\n";
    const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
        {{}, "the number of processes is missing: give -n N"},
        {{kProbe, "env"}, "the number of processes is missing: give -n N"},
        {{"-n"}, "-n needs a value"},
        {{"-n", "0", kProbe}, "-n must be an integer within 1..4096, got '0'"},
        {{"-n", "two", kProbe}, "-n must be an integer within 1..4096, got 'two'"},
        {{"-n", "2"}, "the program to run is missing"},
        {{"-n", "2", "/no/such/prog"}, "program '/no/such/prog' does not exist"},
        {{"-n", "2", "distrpc-no-such-program"},
         "program 'distrpc-no-such-program' not found in PATH (give a path to run a file that is "
         "not there)"},
        {{"-n", "2", "--master-port", "0", kProbe},
         "--master-port must be an integer within "
         "1..65535, got '0'"},
        {{"-n", "2", "--timeout", "soon", kProbe},
         "--timeout must be a number of seconds above 0, "
         "got 'soon'"},
        {{"-n", "2", "--grace", "-1", kProbe},
         "--grace must be a number of seconds >= 0, got '-1'"},
        {{"-n", "2", "--master-addr"}, "--master-addr needs a value"},
        {{"-n", "2", "--bogus", kProbe}, "unknown option '--bogus'"},
    };
    for (const auto& [args, text] : cases) {
      CAPTURE(text);
      const Ran r = run_tool(args);
      CHECK(r.status == 2);
      CHECK(r.out == "");
      CHECK(r.err == "distrpc-run: " + text + hint);
    }
  }
}
