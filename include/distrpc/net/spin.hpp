// How long a transport's reading thread keeps polling after activity before it sleeps in the
// kernel. On a virtual machine a thread woken from sleep on another core costs tens of
// microseconds, more than a small call itself; a reader that polls for a short while after each
// message is already awake when the next one of a conversation comes. Idle, it stops polling.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace distrpc::net {

// The polling time in microseconds from environment variable `var`; `fallback` when unset or
// empty. Throws std::invalid_argument naming the variable and its value when that is not a whole
// number in 0..1000000 (0: never poll).
inline int spin_us_from_env(const char* var, int fallback) {
  const char* v = std::getenv(var);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  // strtol also takes leading blanks and a sign: a whole number is digits only.
  if (*v < '0' || *v > '9' || *end != '\0' || n > 1000000) {
    throw std::invalid_argument(std::string(var) + "='" + v +
                                "' is not a number of microseconds in 0..1000000");
  }
  return static_cast<int>(n);
}

}  // namespace distrpc::net
