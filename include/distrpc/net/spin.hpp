// How long a transport's reading thread keeps polling after activity before it sleeps in the
// kernel. On a virtual machine a thread woken from sleep on another core costs tens of
// microseconds, more than a small call itself; a reader that polls for a short while after each
// message is already awake when the next one of a conversation comes. Idle, it stops polling.
#pragma once

#include "distrpc/net/env_number.hpp"

namespace distrpc::net {

// The polling time in microseconds from environment variable `var`; `fallback` when unset or
// empty. Throws std::invalid_argument naming the variable and its value when that is not a whole
// number in 0..1000000 (0: never poll).
inline int spin_us_from_env(const char* var, int fallback) {
  return static_cast<int>(whole_number_from_env(var, static_cast<unsigned long long>(fallback),
                                                1000000, "microseconds"));
}

}  // namespace distrpc::net
