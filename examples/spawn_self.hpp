// How the examples run N workers on one machine: distrpc::launch_local starts copies of this very
// binary (posix_spawn of /proc/self/exe: never fork() once libtorch or threads may have started),
// forwards their lines behind "[rank] " and stops the group when one fails.
#pragma once

#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "distrpc/launch.hpp"

namespace distrpc_examples {

// The value given to --rank: a number, or "env" for the RANK variable that launch_local and
// distrpc-run set (so `distrpc-run -n 4 hello_rpc --rank env --init env://` works too).
inline std::string rank_text(const std::string& v) {
  if (v != "env") return v;
  const char* r = std::getenv("RANK");
  if (r == nullptr || *r == '\0') {
    throw std::invalid_argument("--rank env: the RANK environment variable is not set");
  }
  return r;
}

// Runs `world` copies of this binary as one local group and waits for them. Every copy gets
// "--rank env --init file://<dir>/rendezvous" followed by extra_args(dir), where dir is a fresh
// directory (for the rendezvous file and whatever the copies leave for the launcher);
// `before_cleanup` runs after every copy ended and before dir is removed. True when every copy
// exited with 0; otherwise which one failed and how is printed to stderr. A positive `timeout`
// bounds the whole run: copies still running then are stopped (SIGTERM, then SIGKILL), so a hung
// copy fails the run instead of hanging it.
inline bool run_local_group(
    int world, const std::string& name,
    const std::function<std::vector<std::string>(const std::string& dir)>& extra_args,
    const std::function<void(const std::string& dir)>& before_cleanup = {},
    std::chrono::milliseconds timeout = std::chrono::milliseconds{0}) {
  std::string tmpl = "/tmp/distrpc-" + name + "-XXXXXX";
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp of " + tmpl + " failed");
  auto remove_dir = [&] {
    std::error_code ec;
    std::filesystem::remove_all(tmpl, ec);
  };
  bool ok = false;
  try {
    std::vector<std::string> args{"--rank", "env", "--init", "file://" + tmpl + "/rendezvous"};
    const std::vector<std::string> extra = extra_args(tmpl);
    args.insert(args.end(), extra.begin(), extra.end());
    distrpc::LaunchOptions opts;
    opts.nprocs = world;
    opts.timeout = timeout;
    const distrpc::LaunchResult r =
        distrpc::launch_local(std::filesystem::read_symlink("/proc/self/exe").string(), args, opts);
    ok = r.ok();
    if (!ok) std::fprintf(stderr, "%s: %s\n", name.c_str(), r.describe().c_str());
    if (before_cleanup) before_cleanup(tmpl);
  } catch (...) {
    remove_dir();
    throw;
  }
  remove_dir();
  return ok;
}

// A benchmark's group: every copy also gets "--out <dir>/result.json", where rank 0 writes its one
// JSON line. Returns that line, or "" when a copy failed or wrote nothing. `timeout` as above.
inline std::string run_local_group_for_result(
    int world, const std::string& name, const std::vector<std::string>& args,
    std::chrono::milliseconds timeout = std::chrono::milliseconds{0}) {
  std::string line;
  const bool ok = run_local_group(
      world, name,
      [&](const std::string& dir) {
        std::vector<std::string> all{"--out", dir + "/result.json"};
        all.insert(all.end(), args.begin(), args.end());
        return all;
      },
      [&](const std::string& dir) {
        std::ifstream in(dir + "/result.json");
        std::getline(in, line);
      },
      timeout);
  return ok ? line : std::string();
}

}  // namespace distrpc_examples
