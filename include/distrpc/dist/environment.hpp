// The environment settings of process groups: TORCH_DISTRIBUTED_DEBUG (debug_level) and
// LOCAL_RANK (node_local_rank), read as PyTorch reads them.
#pragma once

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

#include <distrpc/dist/backend_config.hpp>
#include <distrpc/store/rendezvous.hpp>

namespace distrpc::dist {

enum class DebugLevel { OFF = 0, INFO = 1, DETAIL = 2 };

inline const char* to_string(DebugLevel level) noexcept {
  switch (level) {
    case DebugLevel::OFF:
      return "OFF";
    case DebugLevel::INFO:
      return "INFO";
    case DebugLevel::DETAIL:
      return "DETAIL";
  }
  return "?";
}

// TORCH_DISTRIBUTED_DEBUG, read now: unset or empty is OFF; OFF, INFO, DETAIL in any case.
inline DebugLevel debug_level() {
  const char* v = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  if (v == nullptr || *v == '\0') return DebugLevel::OFF;
  const std::string s = detail::upper(v);
  if (s == "OFF") return DebugLevel::OFF;
  if (s == "INFO") return DebugLevel::INFO;
  if (s == "DETAIL") return DebugLevel::DETAIL;
  throw std::invalid_argument(
      "The value of TORCH_DISTRIBUTED_DEBUG must be OFF, INFO, or DETAIL. Got '" + std::string(v) +
      "'.");
}

// This process's rank among those of its host: LOCAL_RANK (set by torchrun and distrpc-run) when
// set, else fallback, else an error naming LOCAL_RANK (PyTorch's get_node_local_rank).
inline int node_local_rank(std::optional<int> fallback = std::nullopt) {
  if (const char* v = std::getenv("LOCAL_RANK"); v != nullptr && *v != '\0') {
    int out = 0;
    if (!store::detail::parse_int(v, 0, 1 << 30, out)) {
      throw std::invalid_argument(std::string("LOCAL_RANK='") + v +
                                  "' is not a non-negative integer");
    }
    return out;
  }
  if (fallback) return *fallback;
  throw std::runtime_error(
      "LOCAL_RANK is not in the environment. Set it (torchrun and distrpc-run do) or pass a "
      "fallback rank to node_local_rank() to run locally.");
}

}  // namespace distrpc::dist
