// fresh_file_url(tag): a file:// rendezvous in a new temporary directory, for tests that start
// agents inside one process (each group needs its own).
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

namespace distrpc::testing {

inline std::string fresh_file_url(const std::string& tag) {
  static std::atomic<int> n{0};
  const auto dir =
      std::filesystem::temp_directory_path() /
      ("distrpc-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
  std::filesystem::create_directories(dir);
  return "file://" + (dir / "rendezvous").string();
}

}  // namespace distrpc::testing
