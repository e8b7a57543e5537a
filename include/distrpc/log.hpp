// Diagnostics: every line the library writes goes through distrpc::detail::log().
//
// A line names who wrote it (a worker, a store, a transport) and what happened. Where it goes:
//  - a sink the program set with distrpc::set_log_sink(), if any;
//  - else libtorch's c10 logging when the program uses the libtorch layers (distrpc/log_c10.hpp,
//    included by the agent), so TORCH_CPP_LOG_LEVEL (INFO, WARNING, ERROR) filters it;
//  - else stderr, one line "[distrpc] who: text".
// The library logs only what a caller cannot be told through an exception or a future: an error
// on a thread with no caller (an I/O thread, a dropped future), or a condition found at shutdown.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

namespace distrpc {

enum class LogLevel : int { info = 0, warning = 1, error = 2 };

inline const char* to_string(LogLevel level) {
  switch (level) {
    case LogLevel::info:
      return "info";
    case LogLevel::warning:
      return "warning";
    case LogLevel::error:
      return "error";
  }
  return "?";
}

// Receives one diagnostic: its level, who wrote it ("worker1", "TCPStore 127.0.0.1:29500") and
// the text (one line, no trailing newline). Called on the thread that logs, possibly an I/O
// thread and possibly several at once: a sink must be quick and thread-safe, and must not call
// back into distrpc.
using LogSink = std::function<void(LogLevel level, std::string_view who, std::string_view text)>;

namespace detail {

struct LogRouting {
  std::mutex mu;
  LogSink user;      // set_log_sink()
  LogSink fallback;  // the layer's default (c10 logging when libtorch is in), else none
};

inline LogRouting& log_routing() {
  static LogRouting r;
  return r;
}

inline void log_to_stderr(LogLevel level, std::string_view who, std::string_view text) {
  std::fprintf(stderr, "[distrpc] %s%.*s: %.*s\n", level == LogLevel::error ? "error: " : "",
               static_cast<int>(who.size()), who.data(), static_cast<int>(text.size()),
               text.data());
}

// Installed by a layer at static initialization (log_c10.hpp); a user's sink takes precedence.
inline void set_default_log_sink(LogSink sink) {
  auto& r = log_routing();
  std::lock_guard<std::mutex> lk(r.mu);
  r.fallback = std::move(sink);
}

// Writes one diagnostic. Never throws: a sink that throws is reported on stderr instead.
inline void log(LogLevel level, std::string_view who, std::string_view text) noexcept {
  LogSink sink;
  {
    auto& r = log_routing();
    std::lock_guard<std::mutex> lk(r.mu);
    sink = r.user ? r.user : r.fallback;
  }
  if (!sink) {
    log_to_stderr(level, who, text);
    return;
  }
  try {
    sink(level, who, text);
  } catch (const std::exception& e) {
    log_to_stderr(level, who, text);
    log_to_stderr(LogLevel::error, "distrpc", std::string("the log sink threw: ") + e.what());
  } catch (...) {
    log_to_stderr(level, who, text);
    log_to_stderr(LogLevel::error, "distrpc", "the log sink threw a non-standard exception");
  }
}

inline void log_warning(std::string_view who, std::string_view text) noexcept {
  log(LogLevel::warning, who, text);
}
inline void log_error(std::string_view who, std::string_view text) noexcept {
  log(LogLevel::error, who, text);
}

}  // namespace detail

// Sends every diagnostic line to `sink` from now on; an empty sink restores the default (c10
// logging with libtorch, else stderr).
inline void set_log_sink(LogSink sink) {
  auto& r = detail::log_routing();
  std::lock_guard<std::mutex> lk(r.mu);
  r.user = std::move(sink);
}

}  // namespace distrpc
