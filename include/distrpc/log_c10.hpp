// The default destination of distrpc's diagnostics in programs that use libtorch: c10 logging,
// so TORCH_CPP_LOG_LEVEL filters distrpc's lines with libtorch's own. See distrpc/log.hpp.
#pragma once

#include <c10/util/Logging.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>

#include "distrpc/log.hpp"

namespace distrpc::detail {

// TORCH_CPP_LOG_LEVEL as libtorch reads it (INFO, WARNING, ERROR, FATAL or 0-3; WARNING when
// unset). Read here too: libtorch builds on glog apply it only once c10::initLogging() ran,
// which a C++ program rarely calls.
inline int torch_cpp_log_level() {
  static const int level = [] {
    const char* v = std::getenv("TORCH_CPP_LOG_LEVEL");
    if (v == nullptr) return 1;
    const std::string s(v);
    if (s == "INFO" || s == "0") return 0;
    if (s == "WARNING" || s == "1") return 1;
    if (s == "ERROR" || s == "2") return 2;
    if (s == "FATAL" || s == "3") return 3;
    return 1;  // libtorch itself reports an unparsable value
  }();
  return level;
}

inline void log_to_c10(LogLevel level, std::string_view who, std::string_view text) {
  if (static_cast<int>(level) < torch_cpp_log_level()) return;
  switch (level) {
    case LogLevel::info:
      LOG(INFO) << "[distrpc] " << who << ": " << text;
      break;
    case LogLevel::warning:
      LOG(WARNING) << "[distrpc] " << who << ": " << text;
      break;
    case LogLevel::error:
      LOG(ERROR) << "[distrpc] " << who << ": " << text;
      break;
  }
}

// Installed once per program at static initialization (an inline variable has one instance).
inline const bool c10_log_installed = (set_default_log_sink(&log_to_c10), true);

}  // namespace distrpc::detail
