// The doctest runner shared by every test binary, with a backtrace when a test crashes.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <execinfo.h>
#include <unistd.h>

#include <csignal>

namespace {

// doctest reports a crash ("test case CRASHED: SIGSEGV") without saying where, then raises the
// signal again under the handler it found installed: this one. It adds the frames of the crash
// (frames inside a test binary print as offsets: `addr2line -Cfpe BINARY OFFSET` names them)
// and lets the process die of the signal as it would have. A rank of a multi-process test writes
// it to its log, which the harness shows when the rank fails.
void print_backtrace_and_die(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  static const char head[] = "\n---- backtrace of the crash ----\n";
  (void)!write(STDERR_FILENO, head, sizeof head - 1);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);  // writes without allocating
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void backtrace_on_crash() {
  void* warm[1];
  (void)backtrace(warm, 1);  // loads the unwinder now rather than inside the handler
  struct sigaction sa {};
  sa.sa_handler = print_backtrace_and_die;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(sig, &sa, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  backtrace_on_crash();
  return doctest::Context(argc, argv).run();
}
