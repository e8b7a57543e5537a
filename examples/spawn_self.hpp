// Starts copies of this very binary (posix_spawn of /proc/self/exe: never fork() once libtorch
// or threads may have started) and waits for them: how the examples run N workers on one machine.
#pragma once

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <system_error>
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

// Runs `world` copies of this binary as one local group and waits for them. Each copy gets
// "--rank r --init file://<dir>/rendezvous" followed by extra_args(r, dir), where dir is a fresh
// directory (for the rendezvous file and whatever the copies leave for the launcher);
// `before_cleanup` runs after every copy exited and before dir is removed. True when every copy
// exited with 0.
inline bool run_local_group(
    int world, const std::string& name,
    const std::function<std::vector<std::string>(int rank, const std::string& dir)>& extra_args,
    const std::function<void(const std::string& dir)>& before_cleanup = {}) {
  std::string tmpl = "/tmp/distrpc-" + name + "-XXXXXX";
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp of " + tmpl + " failed");
  const std::string init = "file://" + tmpl + "/rendezvous";
  std::vector<std::vector<std::string>> ranks;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args{"--rank", std::to_string(r), "--init", init};
    const std::vector<std::string> extra = extra_args(r, tmpl);
    args.insert(args.end(), extra.begin(), extra.end());
    ranks.push_back(std::move(args));
  }
  bool ok = false;
  try {
    ok = spawn_self_and_wait(ranks);
    if (before_cleanup) before_cleanup(tmpl);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(tmpl, ec);
    throw;
  }
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
  return ok;
}

}  // namespace distrpc_examples
