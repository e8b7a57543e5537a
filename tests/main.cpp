// The doctest runner shared by every test binary, with a backtrace when a test crashes.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstddef>
#include <iterator>

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction previous[std::size(kSignals)];  // what was installed before (a sanitizer's)

// doctest reports a crash ("test case CRASHED: SIGSEGV") without saying where, then raises the
// signal again under the handler it found installed: this one. It adds the frames of the crash
// (frames inside a test binary print as offsets: `addr2line -Cfpe BINARY OFFSET` names them),
// puts back the handler that was there before (the default, or a sanitizer's, which then adds
// its own report) and raises the signal again, so the process dies of it as it would have. A rank
// of a multi-process test writes all this to its log, which the harness shows when the rank fails.
void print_backtrace_and_die(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  static const char head[] = "\n---- backtrace of the crash ----\n";
  (void)!write(STDERR_FILENO, head, sizeof head - 1);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);  // writes without allocating
  for (std::size_t i = 0; i < std::size(kSignals); ++i) {
    if (kSignals[i] == sig) sigaction(sig, &previous[i], nullptr);
  }
  std::raise(sig);
}

void backtrace_on_crash() {
  void* warm[1];
  (void)backtrace(warm, 1);  // loads the unwinder now rather than inside the handler
  struct sigaction sa {};
  sa.sa_handler = print_backtrace_and_die;
  sa.sa_flags = SA_RESETHAND;  // a fault inside the handler itself ends the process
  sigemptyset(&sa.sa_mask);
  for (std::size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &sa, &previous[i]);
}

}  // namespace

int main(int argc, char** argv) {
  backtrace_on_crash();
  return doctest::Context(argc, argv).run();
}
