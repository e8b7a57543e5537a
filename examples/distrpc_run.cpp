// distrpc-run: starts a program as N local ranks of one group (distrpc::launch_local behind a
// command line), as `torchrun --standalone --nproc-per-node N` does for Python programs.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "distrpc/launch.hpp"

namespace {

constexpr const char* kUsage =
    "Usage: distrpc-run -n N [--master-addr A] [--master-port P] [--timeout S] [--grace S]\n"
    "                   [--] PROGRAM [ARGS...]\n"
    "\n"
    "Starts PROGRAM as N processes on this machine. Each gets RANK (0..N-1), WORLD_SIZE (N),\n"
    "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment: what the\n"
    "env:// rendezvous reads. Every line a rank writes is shown behind \"[RANK] \". When one\n"
    "rank fails, the others get SIGTERM, then SIGKILL after the grace period.\n"
    "\n"
    "  -n, --nprocs N       number of processes (required, >= 1)\n"
    "  --master-addr A      MASTER_ADDR (default 127.0.0.1)\n"
    "  --master-port P      MASTER_PORT (default: a free port picked at start)\n"
    "  --timeout S          stop every rank after S seconds (default: no limit)\n"
    "  --grace S            seconds between SIGTERM and SIGKILL (default 5)\n"
    "  -h, --help           this text\n"
    "\n"
    "Exit status: 0 when every rank exits with 0; else the first failing rank's exit code\n"
    "(128 + the signal when a signal ended it); 124 after --timeout; 128 + the signal when\n"
    "distrpc-run itself is stopped by SIGINT or SIGTERM; 2 for a bad command line.\n";

int usage_error(const std::string& what) {
  std::fprintf(stderr, "distrpc-run: %s\nTry 'distrpc-run --help'.\n", what.c_str());
  return 2;
}

bool parse_long(const std::string& s, long lo, long hi, long& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  out = v;
  return true;
}

bool parse_seconds(const std::string& s, std::chrono::milliseconds& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || *end != '\0' || !(v >= 0) || v > 1e9) return false;
  out = std::chrono::milliseconds(static_cast<long long>(v * 1000));
  return true;
}

// SIGINT and SIGTERM reach distrpc-run's handler, which wakes launch_local through a pipe so the
// ranks are stopped (SIGTERM, grace, SIGKILL) instead of being left without their launcher.
int stop_pipe[2] = {-1, -1};
volatile sig_atomic_t stop_signal = 0;

void on_stop_signal(int sig) {
  stop_signal = sig;
  const char b = 1;
  ssize_t unused = ::write(stop_pipe[1], &b, 1);
  (void)unused;
}

}  // namespace

int main(int argc, char** argv) {
  distrpc::LaunchOptions opts;
  opts.nprocs = 0;
  bool have_n = false;
  std::vector<std::string> rest;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string& out) {
      if (i + 1 >= argc) return false;
      out = argv[++i];
      return true;
    };
    std::string v;
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "-n" || a == "--nprocs") {
      long n = 0;
      if (!value(v)) return usage_error(a + " needs a value");
      if (!parse_long(v, 1, 4096, n)) {
        return usage_error(a + " must be an integer within 1..4096, got '" + v + "'");
      }
      opts.nprocs = static_cast<int>(n);
      have_n = true;
    } else if (a == "--master-addr") {
      if (!value(v) || v.empty()) return usage_error("--master-addr needs a value");
      opts.master_addr = v;
    } else if (a == "--master-port") {
      long p = 0;
      if (!value(v)) return usage_error("--master-port needs a value");
      if (!parse_long(v, 1, 65535, p)) {
        return usage_error("--master-port must be an integer within 1..65535, got '" + v + "'");
      }
      opts.master_port = static_cast<int>(p);
    } else if (a == "--timeout" || a == "--grace") {
      std::chrono::milliseconds ms{0};
      if (!value(v)) return usage_error(a + " needs a value");
      if (!parse_seconds(v, ms) || (a == "--timeout" && ms.count() == 0)) {
        return usage_error(a + " must be a number of seconds" +
                           (a == "--timeout" ? std::string(" above 0") : std::string(" >= 0")) +
                           ", got '" + v + "'");
      }
      (a == "--timeout" ? opts.timeout : opts.grace) = ms;
    } else if (a == "--") {
      for (++i; i < argc; ++i) rest.emplace_back(argv[i]);
    } else if (a.size() > 1 && a[0] == '-') {
      return usage_error("unknown option '" + a + "'");
    } else {
      for (; i < argc; ++i) rest.emplace_back(argv[i]);
    }
  }
  if (!have_n) return usage_error("the number of processes is missing: give -n N");
  if (rest.empty()) return usage_error("the program to run is missing");
  try {
    distrpc::find_program(rest[0]);
  } catch (const distrpc::LaunchError& e) {
    return usage_error(std::string(e.what()).substr(sizeof("distrpc::launch_local: ") - 1));
  }

  if (::pipe2(stop_pipe, O_CLOEXEC) != 0) {
    std::perror("distrpc-run: pipe");
    return 1;
  }
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  // A closed stdout (`distrpc-run ... | head`) must not kill the launcher before its ranks.
  ::signal(SIGPIPE, SIG_IGN);
  opts.stop_fd = stop_pipe[0];

  const std::string program = rest[0];
  rest.erase(rest.begin());
  try {
    const distrpc::LaunchResult r = distrpc::launch_local(program, rest, opts);
    if (r.ok()) return 0;
    std::fprintf(stderr, "distrpc-run: %s\n", r.describe().c_str());
    if (r.failed_rank >= 0) return r.ranks[static_cast<std::size_t>(r.failed_rank)].shell_code();
    if (r.timed_out) return 124;
    return 128 + (stop_signal != 0 ? static_cast<int>(stop_signal) : SIGTERM);
  } catch (const distrpc::LaunchError& e) {
    std::fprintf(stderr, "distrpc-run: %s\n", e.what());
    return 1;
  }
}
