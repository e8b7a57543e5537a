// The program launch_local's tests start (tests/test_launch.cpp, tests/launch/check.sh): each mode
// does one observable thing with what the launcher gave it. No distrpc header: it stands for any
// user program.
//   env                 prints "RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. LOCAL_WORLD_SIZE=..
//                       MASTER_ADDR=.. MASTER_PORT=.. EXTRA=.." (unset: "-")
//   lines K             K lines "rank R line I <filler>" to stdout, each written in pieces
//                       with pauses, and "rank R err I" to stderr
//   tail                "no newline here" to stdout, without a '\n'
//   fail R CODE MS      rank R exits with CODE after MS ms; the others sleep 60 s
//   kill R MS           rank R raises SIGSEGV after MS ms; the others sleep 60 s
//   stubborn R CODE     rank R exits with CODE after 200 ms; the others ignore SIGTERM, sleep 60 s
//   sleep MS            every rank sleeps MS ms and exits with 0
//   ready MS            every rank prints "ready", then sleeps MS ms and exits with 0
//   flood               writes "y" lines to stdout without pause until it is stopped
//   torchrun_env        prints "TORCHELASTIC_USE_AGENT_STORE=.. TORCHELASTIC_RESTART_COUNT=..
//                       GROUP_RANK=.. ROLE_RANK=.." (unset: "-")
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "-";
}

void sleep_ms(long ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

void write_str(int fd, const std::string& s) {
  ssize_t unused = ::write(fd, s.data(), s.size());
  (void)unused;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const int rank = std::atoi(env("RANK"));
  if (mode == "env") {
    std::printf(
        "RANK=%s WORLD_SIZE=%s LOCAL_RANK=%s LOCAL_WORLD_SIZE=%s MASTER_ADDR=%s "
        "MASTER_PORT=%s EXTRA=%s\n",
        env("RANK"), env("WORLD_SIZE"), env("LOCAL_RANK"), env("LOCAL_WORLD_SIZE"),
        env("MASTER_ADDR"), env("MASTER_PORT"), env("EXTRA"));
    return 0;
  }
  if (mode == "lines" && argc == 3) {
    const int k = std::atoi(argv[2]);
    const std::string filler(100, static_cast<char>('a' + rank % 26));
    for (int i = 0; i < k; ++i) {
      // Unbuffered pieces with pauses: the ranks' writes overlap in time, mid-line.
      const std::string line =
          "rank " + std::to_string(rank) + " line " + std::to_string(i) + " " + filler + "\n";
      const std::size_t half = line.size() / 2;
      write_str(STDOUT_FILENO, line.substr(0, half));
      if (i % 10 == 0) sleep_ms(1);
      write_str(STDOUT_FILENO, line.substr(half));
      write_str(STDERR_FILENO, "rank " + std::to_string(rank) + " err " + std::to_string(i) + "\n");
    }
    return 0;
  }
  if (mode == "tail") {
    write_str(STDOUT_FILENO, "no newline here");
    return 0;
  }
  if ((mode == "fail" || mode == "stubborn") && argc >= 4) {
    if (rank == std::atoi(argv[2])) {
      sleep_ms(mode == "fail" && argc == 5 ? std::atol(argv[4]) : 200);
      std::printf("rank %d fails\n", rank);
      return std::atoi(argv[3]);
    }
    if (mode == "stubborn") ::signal(SIGTERM, SIG_IGN);
    sleep_ms(60000);
    return 0;
  }
  if (mode == "kill" && argc == 4) {
    if (rank == std::atoi(argv[2])) {
      sleep_ms(std::atol(argv[3]));
      const rlimit no_core{0, 0};  // a crash on purpose leaves no core file behind
      ::setrlimit(RLIMIT_CORE, &no_core);
      ::signal(SIGSEGV, SIG_DFL);  // a sanitizer's handler would turn the signal into an exit
      ::raise(SIGSEGV);
    }
    sleep_ms(60000);
    return 0;
  }
  if (mode == "ready" && argc == 3) {
    write_str(STDOUT_FILENO, "ready\n");
    sleep_ms(std::atol(argv[2]));
    return 0;
  }
  if (mode == "flood") {
    std::string block;
    for (int i = 0; i < 32768; ++i) block += "y\n";
    for (;;) write_str(STDOUT_FILENO, block);
  }
  if (mode == "torchrun_env") {
    std::printf(
        "TORCHELASTIC_USE_AGENT_STORE=%s TORCHELASTIC_RESTART_COUNT=%s GROUP_RANK=%s "
        "ROLE_RANK=%s\n",
        env("TORCHELASTIC_USE_AGENT_STORE"), env("TORCHELASTIC_RESTART_COUNT"), env("GROUP_RANK"),
        env("ROLE_RANK"));
    return 0;
  }
  if (mode == "sleep" && argc == 3) {
    sleep_ms(std::atol(argv[2]));
    return 0;
  }
  std::fprintf(stderr, "launch_probe: unknown mode\n");
  return 99;
}
