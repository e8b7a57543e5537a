// Starts copies of this very binary (posix_spawn of /proc/self/exe: never fork() once libtorch
// or threads may have started) and waits for them: how the examples run N workers on one machine.
#pragma once

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace distrpc_examples {

// Runs one copy per argument list (each without argv[0]); true when every copy exited with 0.
inline bool spawn_self_and_wait(const std::vector<std::vector<std::string>>& arg_lists) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<pid_t> pids;
  for (const auto& list : arg_lists) {
    std::vector<std::string> args{self};
    args.insert(args.end(), list.begin(), list.end());
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    if (int rc = posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), environ); rc != 0) {
      throw std::runtime_error("posix_spawn of " + self + " failed: " + std::strerror(rc));
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = false;
  }
  return ok;
}

}  // namespace distrpc_examples
